"""`analyze(job_trace)`: every figure metatrace shows, computed once from the records.

The terminal report, the JSON report (and through it the HTML page), the Chrome trace and
`--fail-on-oom` all read one `Analysis`; none of them computes. The pieces come from the
modules beside this one (aggregate: module trees and summaries; memory: memory over the
iteration and the verdict; comm: communication per role and for the cluster; timing: the time
model).
"""

from __future__ import annotations

from dataclasses import dataclass

from metatrace.analysis import aggregate as agg
from metatrace.analysis.comm import JobComm, RoleComm, job_comm
from metatrace.analysis.device import DeviceMemory, role_device_memory
from metatrace.analysis.memory import (
    OffloadSummary,
    RoleMemory,
    Verdict,
    role_memory,
    role_offload,
    verdict,
)
from metatrace.analysis.timing import Timing, job_timing
from metatrace.records import JobTrace, RoleTrace


@dataclass(frozen=True)
class RoleAnalysis:
    """One role (pipeline stage): its records and what they add up to."""

    traced: RoleTrace
    summary: agg.RoleSummary
    """Parameters, activations saved, layers and collectives of one micro-batch."""
    tree: tuple[agg.ModuleRow, ...]
    """The module tree, one root per model chunk, with per-module totals."""
    signature: tuple
    """Equal for roles with the same structure and work (aggregate.role_signature)."""
    memory: RoleMemory | None = None
    """Memory over one iteration (None when no iteration was traced)."""
    comm: RoleComm | None = None
    """Communication over one iteration (None when no iteration was traced)."""
    offload: OffloadSummary | None = None
    """Fine-grained activation offloading's traffic (None when the job does not offload)."""
    device: DeviceMemory | None = None
    """What the rank takes on its GPU: the caching allocator's reserve and what lives outside
    it (None when no iteration was traced)."""

    @property
    def role(self):
        return self.traced.role

    @property
    def trace(self):
        return self.traced.trace


@dataclass(frozen=True)
class Analysis:
    """A traced job, analysed. Iteration figures (`comm`, `verdict`, roles' `memory`) are None
    when only micro-batches were traced; `timing` also when the GPU's peak FLOP/s is unknown."""

    traced: JobTrace
    roles: tuple[RoleAnalysis, ...]
    full: RoleAnalysis | None
    """The whole model on one GPU without parallelism (None when not traced)."""
    total_params: int
    active_params: int
    """Parameters one token passes through (routed experts counted topk / experts)."""
    comm: JobComm | None
    verdict: Verdict | None
    timing: Timing | None

    @property
    def job(self):
        return self.traced.job

    @property
    def world(self):
        return self.traced.world

    @property
    def iterations(self) -> bool:
        """Whether every role's whole iteration was traced."""
        return self.verdict is not None


def _role(rt: RoleTrace, job, comm: RoleComm | None) -> RoleAnalysis:
    tree = tuple(agg.module_tree(rt.trace, rt.chunks))
    memory = role_memory(rt.trace, rt.iteration) if rt.iteration is not None else None
    device = None
    if memory is not None:
        room = round(job.cluster.gpu_memory_gib * 2**30) - round(
            job.cluster.reserved_overhead_gib * 2**30
        )
        device = role_device_memory(job, rt, memory.peak, capacity=room)
    return RoleAnalysis(
        traced=rt,
        summary=agg.role_summary(rt.trace),
        tree=tree,
        signature=agg.role_signature(rt.trace, tree),
        memory=memory,
        comm=comm,
        offload=role_offload(job, rt),
        device=device,
    )


def analyze(job_trace: JobTrace) -> Analysis:
    job = job_trace.job
    par = job.parallel
    iterations = all(rt.iteration is not None for rt in job_trace.roles)
    comm = job_comm(job_trace) if iterations else None
    comms = [c for _, c in comm.roles] if comm is not None else [None] * len(job_trace.roles)
    roles = tuple(_role(rt, job, c) for rt, c in zip(job_trace.roles, comms))
    traces = [rt.trace for rt in job_trace.roles]
    m = job.model
    share = m.moe_router_topk / m.num_experts if m.num_experts else 1.0
    return Analysis(
        traced=job_trace,
        roles=roles,
        full=_role(job_trace.full, job, None) if job_trace.full is not None else None,
        total_params=agg.model_params(traces, par.tp, par.ep, par.etp),
        active_params=agg.model_params(traces, par.tp, par.ep, par.etp, expert_share=share),
        comm=comm,
        verdict=verdict(job, [(r.role.ranks, r.memory, r.device) for r in roles])
        if iterations
        else None,
        timing=job_timing(job_trace) if iterations else None,
    )
