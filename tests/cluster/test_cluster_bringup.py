"""The test cluster itself: real daemons up, nodes on their own addresses, clean teardown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .munge import Munged
from .netlab import SAFETY_ROUTE
from .procs import pid_alive, run
from .slurm import SlurmCluster

pytestmark = pytest.mark.cluster


def test_every_node_is_idle_and_accounted(slurm_cluster: SlurmCluster) -> None:
    info = slurm_cluster.node_info()
    assert sorted(info) == slurm_cluster.node_names
    assert {v["state"] for v in info.values()} == {"idle"}
    clusters = slurm_cluster.cmd("sacctmgr", "-n", "-P", "show", "cluster", "format=cluster").stdout
    assert slurm_cluster.name in clusters.split()


def test_a_job_runs_on_every_node_at_its_own_address(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.dir / "jobs" / "where-%j.out"
    job = slurm_cluster.sbatch(
        "#!/bin/sh\nsrun sh -c 'echo $SLURMD_NODENAME $(ip -4 -o addr show dev '\"$IFACE\"' "
        "| awk \"{print \\$4}\")'\n",
        "-N", str(slurm_cluster.node_count), "-o", str(out),
        env={"IFACE": next(iter(slurm_cluster.nodes.values())).iface},
    )
    assert slurm_cluster.wait_job(job, timeout_s=60) == "COMPLETED"
    seen = dict(line.split() for line in Path(str(out).replace("%j", job)).read_text().splitlines())
    expected = {n.name: n.address for n in slurm_cluster.nodes.values()}
    assert {name: addr.split("/")[0] for name, addr in seen.items()} == expected
    # Accounting reached MariaDB through slurmdbd.
    slurm_cluster.cmd("sacct", "-n", "-X", "-j", job, "-o", "JobID")


def test_namespaced_nodes_sit_behind_the_safety_net(slurm_cluster: SlurmCluster) -> None:
    if slurm_cluster.network != "netns":
        pytest.skip(f"cluster runs in the {slurm_cluster.network} layout")
    routes = run(["ip", "route", "show", "type", "unreachable"]).stdout
    assert "10.77.0.0/24" in routes and "metric 4000" in routes
    assert slurm_cluster.lab is not None
    for node in slurm_cluster.nodes.values():
        assert f"dev {slurm_cluster.lab.bridge}" in run(["ip", "route", "get", node.address]).stdout
        inside = run(["ip", "-n", node.netns or "", "route", "show"]).stdout
        assert "default" not in inside  # a namespace can only reach the bridge
        assert slurm_cluster.slurmd[node.name].pid in node.pids()


def test_teardown_leaves_nothing_behind(munged: Munged) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    with SlurmCluster(nodes=2, munged=munged) as cluster:
        pids = [d.pid for d in cluster.daemons]
        netns = [n.netns for n in cluster.nodes.values() if n.netns]
        cgroups = [n.cgroup.path for n in cluster.nodes.values()]
        bridge = cluster.lab.bridge if cluster.lab else None
        workdir = cluster.dir
    assert not [pid for pid in pids if pid_alive(pid)]
    listed = run(["ip", "netns", "list"]).stdout
    assert not [ns for ns in netns if ns in listed]
    assert not [path for path in cgroups if path.exists()]
    if bridge:
        assert run(["ip", "link", "show", bridge], check=False).returncode != 0
    assert not workdir.exists()
    # The shared safety route goes with the last lab; munged (the caller's) is untouched.
    assert munged.daemon is not None and munged.daemon.alive()
    still_routed = " ".join(SAFETY_ROUTE[:2]) in run(["ip", "route", "show", "type", "unreachable"]).stdout
    assert still_routed == _another_lab_is_up()


def _another_lab_is_up() -> bool:
    bridges = [line.split(": ")[1] for line in
               run(["ip", "-o", "link", "show", "type", "bridge"]).stdout.splitlines()]
    return any(name.startswith("artbr") for name in bridges)
