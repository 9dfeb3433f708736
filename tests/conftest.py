"""What every test session shares."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def ranks_tmpdir():
    """The processes the tests start (ranks under torchrun, srun and sbatch, the daemons) get a
    ``TMPDIR`` of their own, removed when the session ends: a rank's node relay binds its socket
    there, and the ranks a test kills by a signal leave theirs behind.  This process keeps the temp
    directory it has (pytest's ``tmp_path`` included)."""
    tempfile.gettempdir()  # fixed now, before TMPDIR changes
    path = tempfile.mkdtemp(prefix="artemis-tests-")
    os.chmod(path, 0o1777)  # like /tmp: the jobs the tests run as nobody write there too
    prior = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = path
    try:
        yield path
    finally:
        if prior is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = prior
        shutil.rmtree(path, ignore_errors=True)
