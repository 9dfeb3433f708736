"""The Slurm boundary: a small protocol (api.py) and its implementations.

``cli.py`` drives the Slurm commands (the tested default); ``pyslurm.py``
uses the pyslurm bindings where the site's pyslurm matches its Slurm.
"""

from __future__ import annotations

from artemisd.slurm.api import SlurmBackend, SlurmError


def make_backend(name: str, timeout: float = 30.0) -> SlurmBackend:
    """The backend named by ``SlurmBackend=`` in artemis.conf."""
    if name == "cli":
        from artemisd.slurm.cli import CliSlurm

        return CliSlurm(timeout=timeout)
    if name == "pyslurm":
        from artemisd.slurm.pyslurm import PySlurm

        return PySlurm()
    raise SlurmError(f"unknown Slurm backend {name!r} (cli or pyslurm)")


__all__ = ["SlurmBackend", "SlurmError", "make_backend"]
