"""SlurmBackend over pyslurm, for sites whose pyslurm matches their Slurm.

Optional: pyslurm on the package index is 25.11.x, which builds only against
Slurm 25.11 (this project's test platform is 22.05, where it cannot build),
so this backend is not exercised by the test suite.  Select it with
``SlurmBackend=pyslurm``; everything pyslurm does not cover (accounting
AdminComment of finished jobs) goes through the CLI backend.
"""

from __future__ import annotations

from typing import Any

from artemisd.slurm.api import JobInfo, NodeInfo, SlurmError, check_job_id, check_name
from artemisd.slurm.cli import CliSlurm, collect_hostlist, expand_hostlist


class PySlurm(CliSlurm):
    def __init__(self, timeout: float = 30.0):
        super().__init__(timeout=timeout)
        try:
            import pyslurm  # noqa: PLC0415 - optional dependency
        except ImportError as err:
            raise SlurmError(f"SlurmBackend=pyslurm but pyslurm cannot be imported: {err}",
                             transient=False) from None
        self._ps: Any = pyslurm

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except self._ps.RPCError as err:
            raise SlurmError(f"pyslurm {what}: {err}") from None

    def node(self, name: str) -> NodeInfo:
        node = self._call("node", self._ps.Node.load, check_name("node", name))
        states = {str(node.state).upper(), *(str(f).upper() for f in (node.state_flags or ()))}
        return NodeInfo(name=name, states=frozenset(states), reason=node.reason or "",
                        partitions=tuple(node.partitions or ()))

    def job(self, job_id: str) -> JobInfo | None:
        if not check_job_id(job_id).isdigit():
            return super().job(job_id)  # an array task or het component: pyslurm's Job.load takes an int
        try:
            job = self._ps.Job.load(int(job_id))
        except self._ps.RPCError:
            return self._job_from_sacct(job_id)
        return JobInfo(job_id=job_id, user_id=int(job.user_id), state=str(job.state).upper(),
                       partition=job.partition or "", nodes=expand_hostlist(job.nodes or ""),
                       batch=bool(job.is_batch), requeue=bool(job.is_requeueable),
                       held=str(job.state_reason or "").startswith("JobHeld"),
                       excluded_nodes=expand_hostlist(job.excluded_nodes or ""),
                       features=",".join(job.required_features or ()) if not isinstance(
                           job.required_features, str) else job.required_features,
                       admin_comment=job.admin_comment or "",
                       tasks=int(job.ntasks) if getattr(job, "ntasks", None) else None,
                       cpus=int(job.cpus) if getattr(job, "cpus", None) else None)

    def drain(self, node: str, reason: str) -> None:
        self._call("drain", self._ps.Node(check_name("node", node)).modify, self._ps.Node(state="DRAIN", reason=reason))

    def resume(self, node: str) -> None:
        self._call("resume", self._ps.Node(check_name("node", node)).modify, self._ps.Node(state="RESUME"))

    def set_excluded_nodes(self, job_id: str, nodes: tuple[str, ...]) -> None:
        for node in nodes:
            check_name("node", node)
        if not check_job_id(job_id).isdigit():
            return super().set_excluded_nodes(job_id, nodes)
        self._call("update", self._ps.Job(int(job_id)).modify,
                   self._ps.JobSubmitDescription(excluded_nodes=collect_hostlist(nodes)))
