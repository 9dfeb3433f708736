"""What every test session shares."""

from __future__ import annotations

import pytest

from tests.cluster.procs import own_tmpdir


@pytest.fixture(scope="session", autouse=True)
def ranks_tmpdir():
    """The processes the tests start get a ``TMPDIR`` of their own for the whole session
    (``own_tmpdir``): the relay sockets of ranks a test kills by a signal go with it."""
    with own_tmpdir("artemis-tests-") as path:
        yield path
