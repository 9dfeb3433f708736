"""A healthy job on a loaded host names nobody: the analysis against recorded OS noise.

``data/healthy_ddp_pinned_hog.jsonl`` is a real trace: tests/probe/stacks.py's
plain-DDP job, 4 gloo ranks on this 2-core machine, 8 steps per window
(windows of ~0.1 s), healthy throughout, recorded while a CPU hog pinned to
core 0 ran beside it.  Whichever rank the scheduler left on core 0 was 1.6x
slower than its peers for three windows (rank 2, windows 3-5): a real
slowdown, 0.3 s long, that the windows' statistics cannot tell from a
straggler: only its length can (``ConfirmSeconds``).  Before that floor the
defaults confirmed rank 2 and escalated the job; they must name nothing.
"""

from pathlib import Path

from artemisd.config import parse_config_text
from artemisd.replay import replay_records
from artemisd.wire import parse_line

TRACE = Path(__file__).with_name("data") / "healthy_ddp_pinned_hog.jsonl"


def load_trace(path: Path):
    return [parse_line(line, f"{path.name}:{n}") for n, line in enumerate(path.read_text().splitlines(), 1)]


def named(incidents):
    return [(i.kind.value, i.rank, i.node) for i in incidents
            if i.rank is not None or i.node is not None or i.link is not None]


def test_the_shipped_defaults_name_nobody_in_a_healthy_job_on_a_loaded_host():
    assert named(replay_records(load_trace(TRACE))) == []


def test_the_episode_is_in_the_trace_and_only_its_length_sets_it_apart():
    suspects = [(i.rank, i.state.value) for i in replay_records(load_trace(TRACE), include_unconfirmed=True)
                if i.rank == 2]
    assert suspects == [(2, "suspect")]  # flagged, never confirmed
    by_windows_alone = parse_config_text("ConfirmSeconds=0\n")
    assert named(replay_records(load_trace(TRACE), by_windows_alone)) == [("rank", 2, "n2")]
