"""Property: a rank that only waits is never blamed.

Whatever the job's shape, noise, communication time and set of slowed ranks,
every incident the pipeline raises names only ranks (or nodes holding ranks)
that were actually slowed — never one of the healthy ranks whose comm_wait
rose because they waited for the others.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from artemisd.pipeline import Analyzer
from tests.unit.windows import lockstep, run


@st.composite
def jobs(draw):
    world = draw(st.integers(min_value=4, max_value=24))
    ranks_per_node = draw(st.sampled_from([1, 2, 4, 8]))
    slow = draw(st.sets(st.integers(min_value=0, max_value=world - 1), max_size=max(1, world // 4)))
    factor = draw(st.floats(min_value=1.0, max_value=2.0))
    comm = draw(st.floats(min_value=0.0, max_value=500.0))
    comm_rise = draw(st.floats(min_value=1.0, max_value=3.0))
    onset = draw(st.integers(min_value=0, max_value=8))
    seed_noise = draw(st.lists(st.floats(min_value=-0.01, max_value=0.01), min_size=world * 16,
                               max_size=world * 16))
    return world, ranks_per_node, slow, factor, comm, comm_rise, onset, seed_noise


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs())
def test_only_slowed_ranks_are_ever_blamed(job):
    world, per_node, slow, factor, comm, comm_rise, onset, noise = job
    nodes = [f"n{r // per_node}" for r in range(world)]
    windows = []
    for seq in range(16):
        busy = [100.0 * (1 + noise[seq * world + r]) for r in range(world)]
        comm_ms = comm
        if seq >= onset:
            busy = [b * factor if r in slow else b for r, b in enumerate(busy)]
            comm_ms = comm * comm_rise  # everyone also waits longer at collectives
        windows.append(lockstep(seq, busy, nodes=nodes, comm_ms=comm_ms))
    analyzer = Analyzer()
    run(analyzer, windows)
    slow_nodes = {nodes[r] for r in slow}
    for incident in analyzer.incidents:
        if incident.rank is not None:
            assert incident.rank in slow, incident
        elif incident.kind.value == "node":
            assert incident.node in slow_nodes, incident
