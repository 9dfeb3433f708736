"""Property: a rank that only waits is never blamed.

Whatever the job's shape, noise, communication time and set of slowed ranks,
every incident the pipeline raises names only ranks (or nodes holding ranks)
that were actually slowed — never one of the healthy ranks whose comm_wait
rose because they waited for the others.  The same holds for islands of
two (a 2-rank job, or a pair of one make in a mixed job), which are judged
against their own history and the wait they cause rather than a peer median.
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


@st.composite
def pair_jobs(draw):
    others = draw(st.sampled_from([0, 0, 4, 8]))  # 0: a 2-rank job; else a mixed job with an AMD pair
    world = others + 2
    slow = draw(st.sets(st.integers(min_value=0, max_value=world - 1), max_size=2))
    factor = draw(st.floats(min_value=1.0, max_value=2.0))
    comm = draw(st.floats(min_value=0.0, max_value=500.0))
    comm_rise = draw(st.floats(min_value=1.0, max_value=3.0))
    amd_speed = draw(st.floats(min_value=0.7, max_value=1.4))
    onset = draw(st.integers(min_value=0, max_value=12))
    load = draw(st.lists(st.floats(min_value=0.8, max_value=1.25), min_size=20, max_size=20))
    noise = draw(st.lists(st.floats(min_value=-0.01, max_value=0.01), min_size=world * 20, max_size=world * 20))
    return others, slow, factor, comm, comm_rise, amd_speed, onset, load, noise


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair_jobs())
def test_pairs_only_ever_blame_slowed_ranks(job):
    others, slow, factor, comm, comm_rise, amd_speed, onset, load, noise = job
    world = others + 2
    island = ["nvidia"] * others + ["amd"] * 2
    nodes = [f"n{r}" for r in range(world)]
    windows = []
    for seq in range(20):
        # The whole machine's load moves every window; each rank wobbles on its own.
        busy = [100.0 * load[seq] * (amd_speed if island[r] == "amd" else 1.0) * (1 + noise[seq * world + r])
                for r in range(world)]
        comm_ms = comm
        if seq >= onset:
            busy = [b * factor if r in slow else b for r, b in enumerate(busy)]
            comm_ms = comm * comm_rise
        windows.append(lockstep(seq, busy, nodes=nodes, comm_ms=comm_ms, island=island))
    analyzer = Analyzer()
    run(analyzer, windows)
    for incident in analyzer.incidents:
        if incident.rank is not None:
            assert incident.rank in slow, incident
        elif incident.kind.value == "node":
            assert incident.node in {nodes[r] for r in slow}, incident
