"""The real Slurm test cluster: munged, MariaDB + slurmdbd, slurmctld and N slurmd.

Everything here runs the Debian Slurm 22.05 daemons for real, as root, on one
machine; nothing is mocked.  ``SlurmCluster`` is the entry point (see
``tests/cluster/slurm.py``); ``conftest.py`` exposes it as pytest fixtures and
``faults.py`` holds the fault injectors the end-to-end scenarios use.
"""
