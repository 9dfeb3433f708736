"""Artemis: finds what slows a distributed training job, acts within policy, verifies recovery."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("artemis-hpc")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"
