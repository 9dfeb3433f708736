"""`artemis replay` as a user runs it: a trace file in, incidents out."""

import json
import random
import subprocess
import sys

from artemisd.cli import main
from artemisd.wire import dump_record
from tests.unit.windows import lockstep


def write_trace(path, bad_lines=()):
    rng = random.Random(1)
    lines = []
    for seq in range(12):
        busy = [100 * (1 + rng.gauss(0, 0.004)) for _ in range(8)]
        gpu = {}
        if seq >= 5:
            busy[6] *= 1.2
            gpu = {6: {"throttle": ["sw_power_cap"], "power_w": 400}}
        lines += [dump_record(r) for r in lockstep(seq, busy, gpu=gpu)]
    for index, text in bad_lines:
        lines.insert(index, text)
    path.write_text("\n".join(lines) + "\n")


def test_json_output_is_one_contract_incident_per_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace)
    assert main(["replay", str(trace), "--json"]) == 0
    out = capsys.readouterr()
    [line] = out.out.strip().splitlines()
    incident = json.loads(line)
    assert incident["rank"] == 6 and incident["cause"] == "gpu.power"
    assert incident["action"]["status"] == "proposed" and incident["result"] is None
    assert "0 line(s) rejected" in out.err


def test_bad_lines_are_named_and_the_rest_is_kept(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, bad_lines=[(3, "{not json"), (10, json.dumps({"type": "window", "v": 1}))])
    assert main(["replay", str(trace)]) == 0
    out = capsys.readouterr()
    assert f"{trace}:4: " in out.err and f"{trace}:11: " in out.err
    assert "2 line(s) rejected" in out.err
    assert "gpu.power" in out.out and "rank 6@n3" in out.out


def test_config_error_names_file_line_and_key(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace)
    conf = tmp_path / "artemis.conf"
    conf.write_text("# analysis\nConfirmWindows=3\nMinSlowdown=lots\n")
    assert main(["replay", str(trace), "--config", str(conf)]) == 2
    assert f"{conf}:3: MinSlowdown: bad value 'lots'" in capsys.readouterr().err


def test_console_script_runs(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace)
    done = subprocess.run([sys.executable, "-m", "artemisd.cli", "replay", str(trace), "--json"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout)["cause"] == "gpu.power"


def test_replay_of_a_simulated_two_rank_job_names_its_slow_rank(tmp_path, capsys):
    # Issue 10: a 2-rank job gets a rank incident, not only a job-level one.
    slowed, healthy = tmp_path / "slowed.jsonl", tmp_path / "healthy.jsonl"
    common = ["--world", "2", "--ranks-per-node", "1", "--windows", "30", "--seed", "3", "--noise", "varlen"]
    assert main(["sim", str(slowed), *common, "--fault", "gpu.clocks:rank=1,onset=12,magnitude=0.15"]) == 0
    assert main(["sim", str(healthy), *common]) == 0
    capsys.readouterr()
    assert main(["replay", str(slowed), "--json"]) == 0
    [line] = capsys.readouterr().out.strip().splitlines()
    incident = json.loads(line)
    assert (incident["kind"], incident["rank"], incident["node"], incident["cause"]) == ("rank", 1, "n00001",
                                                                                        "gpu.clocks")
    assert incident["ratio"] > 1.1 and incident["excess_ms"] > 0
    assert main(["replay", str(healthy), "--json", "--all"]) == 0
    assert capsys.readouterr().out.strip() == ""
