"""Fixtures shared by unit tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def munged():
    """A private munged of this test's own (root only: munged must own its key and socket)."""
    if os.geteuid() != 0:
        pytest.skip("runs a private munged")
    from tests.cluster.munge import Munged

    with Munged() as m:
        yield m
