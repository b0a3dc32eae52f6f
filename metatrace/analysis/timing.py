"""A time model of one training iteration, from the records (pure functions, no torch).

Assumptions, all approximate:
- a step's compute is the sum of its kernels' times on the GPU (Window.kernel_ps:
  metatrace.config.kernels prices each GEMM and fused attention by its shape and each
  memory-bound operator by the bytes it moves, as the trace dispatched them); with
  `cluster.compute_efficiency` set, instead its counted FLOPs (hooks/flops.py: matrix products
  and attention) at the GPU's peak dense bf16 FLOP/s (config.GPU_PEAK_TFLOPS) times that
  fraction, FP8 GEMMs at twice that peak on the GPUs with FP8 tensor cores
  (config.GPU_FP8_ARCHS), element-wise work free;
- the collectives inside a step (tensor, sequence, context, expert parallel, the batch
  broadcast) take their estimated wire time (metatrace.analysis.comm: ring algorithm, link bandwidth, no
  latency) one after another with the compute: the traced micro-batch's own calls, per step, so
  a step's share of a role's exposed TP/CP/EP seconds per iteration is exactly what it issued
  (those per-iteration seconds are the steps' sums times the micro-batches). What Megatron
  overlaps is hidden as far as the kernels beside it last: the context-parallel ring beside the
  step's fused attention kernels (Window.attention_ps); with tp_comm_overlap, the TP
  collectives Transformer Engine's userbuffers run beside the rest of its kernels (the linear
  layers' GEMMs); with overlap_moe_expert_parallel_comm the EP all-to-alls beside the other
  micro-batch's layers in a combined 1F1B step (the step's compute). A step whose overlapped
  calls outlast those kernels takes the difference more;
- each pipeline stage runs its steps in the order the replayed iteration recorded them
  (megatron-core's own 1F1B or interleaved order for that stage), each as early as its
  dependencies allow: chunk v of stage s is virtual stage k = v·pp + s; the forward step of
  micro-batch m on virtual stage k waits for the forward of m on k - 1 plus the transfer of the
  boundary tensor (bytes / link bandwidth, the traced send's size and peer), the backward of m
  on k waits for the backward of m on k + 1 plus the transfer of the gradient. A transfer
  delays the receiver only (the sender goes on: asynchronous sends; with overlap_p2p_comm off
  megatron-core waits for its sends too, which is not modelled), and links are never shared;
- the optimizer step starts on every stage when the last stage finishes its steps (the
  gradient norm's all-reduce over the model-parallel group synchronises them) and takes the
  stage's exposed communication outside the steps (gradient reduction and parameter gathering
  that are not overlapped, the embedding and layer-norm gradient all-reduces, the gradient
  norm's and the loss's all-reduces), one after another, plus the update itself, bound by
  memory bandwidth: it reads and writes the optimizer state (main parameters, moments) and
  reads the gradients and writes the parameters once, at config.GPU_HBM_TBPS;
- overlapped data-parallel communication (Megatron's DDP, not Megatron-FSDP): overlap_grad_reduce's
  reductions of a chunk start with its last backward step, one after another on the stage's
  communication stream, the last (the first layers' bucket) only after the step; the optimizer
  step waits for every stage's (exposed: what runs past the last step). overlap_param_gather's
  all-gathers run ahead of the forward steps: a chunk's first forward step lasts at least its
  gather, or, with virtual stages (Megatron-LM's align_param_gather), ends no earlier than the
  stage's gathers up to its chunk, started with the iteration (exposed: the difference). The
  collectives' kernels share the GPU with the compute they overlap; that slowdown is not
  modelled;
- activation offloading's copies (a micro-batch's offloaded bytes, split evenly over the
  rank's chunks) run on their own stream over the host link (cluster.host_link_gbps) beside
  the step: to the host in forward, back in backward. A step lasts at least its copies.
Bubble: a stage's idle time during the forward-backward part of the iteration (from the first
step's start to the last step's end on any stage), as a fraction of that part. With equal
stages and no communication it is Megatron's (pp - 1) / (m + pp - 1) for 1F1B and
(pp - 1) / (vpp·m + pp - 1) for the interleaved schedule.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

from metatrace.config.host import apply, product, scaled
from metatrace.records import Trace

STEP_PHASES = ("forward", "backward")
_IN_STEP = ("tp", "cp", "ep")  # dimensions whose overlapped calls run beside a step's compute


@dataclass(frozen=True)
class Call:
    """A collective placed in time inside a step (the steps of one chunk and phase share them)."""

    offset: float
    """Seconds from the start of the step."""
    seconds: float
    op: str
    group: str
    dimension: str
    bytes: int
    module: str
    overlapped: str | None
    """What Megatron overlaps it with (None: exposed, part of the step's time)."""


@dataclass(frozen=True)
class Span:
    """A step of one stage in time: a chunk's forward or backward for one micro-batch, or the
    optimizer step (with the gradient synchronisation before it)."""

    start: float
    end: float
    phase: str
    microbatch: int | None
    chunk: int | None
    flops: int = 0
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    """Exposed communication inside the step."""
    peak_bytes: int = 0
    """The rank's highest allocated memory during the step (replayed iteration)."""
    calls: tuple[Call, ...] = ()
    """The collectives inside the step, at offsets from its start."""
    offload_seconds: float = 0.0
    """Activation offloading's host copies beside the step (to the host in forward, back in
    backward); the step takes at least this long."""
    host_wait_seconds: float = 0.0
    """What the step lasts longer because the GPU waited for the host to issue its kernels
    (metatrace.config.host)."""


@dataclass(frozen=True)
class Transfer:
    """A pipeline send: the boundary tensor of a forward step, or its gradient in backward."""

    start: float
    end: float
    phase: str
    microbatch: int
    source: tuple[int, int]
    """(stage, chunk) that sends."""
    target: tuple[int, int]
    bytes: int


@dataclass(frozen=True)
class StageTiming:
    stage: int
    spans: tuple[Span, ...]
    """Steps in order, then the optimizer step."""
    busy_seconds: float
    """Forward and backward steps."""
    optimizer_seconds: float
    iteration_seconds: float
    """When the stage's optimizer step ends."""
    bubble_fraction: float


@dataclass(frozen=True)
class Timing:
    stages: tuple[StageTiming, ...]
    transfers: tuple[Transfer, ...]
    pipeline_seconds: float
    """The forward-backward part: the last step's end on any stage."""
    iteration_seconds: float
    bubble_fraction: float
    """Idle GPU time over GPU time in the forward-backward part, all stages together."""
    peak_tflops: float
    efficiency: float | None
    """cluster.compute_efficiency: every FLOP at this fraction of peak; None: each kernel at its
    modelled rate (metatrace.config.kernels)."""
    dp_exposed_seconds: float = 0.0
    """What overlap_param_gather's gathers and overlap_grad_reduce's reductions add past the
    steps beside them (the first forward steps' waits on the slowest stage, and the optimizer
    step's wait for the reductions)."""
    host: Host | None = None
    """The host's side of the iteration of the stage that finishes last (None: not recorded)."""


@dataclass(frozen=True)
class Host:
    """What the host does in an iteration of one stage (metatrace.config.host)."""

    stage: int
    seconds: float
    """Host work issuing the steps' and the optimizer step's kernels."""
    wait_seconds: float
    """Of the iteration, the time the GPU waits for the host (the steps last longer than their
    kernels and communication, the optimizer step longer than its update)."""
    kernels: int
    """Kernels launched."""
    syncs: int
    """Synchronisations (the host waits for the GPU): in the steps and the optimizer step, and
    after the pipeline's batched sends and receives (`simulate`'s p2p_sync)."""

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "seconds": self.seconds,
            "wait_seconds": self.wait_seconds,
            "kernels": self.kernels,
            "syncs": self.syncs,
        }

    @classmethod
    def from_json(cls, d: dict) -> Host:
        return cls(d["stage"], d["seconds"], d["wait_seconds"], d["kernels"], d["syncs"])


# ----------------------------------------------------------------------------- rates


def peak_flops(job) -> tuple[float, float] | None:
    """(bf16, fp8) peak dense FLOP/s of the job's GPU, or None when the tables lack it."""
    from metatrace.config.kernels import kernel_model

    model = kernel_model(job.cluster.gpu)
    return None if model is None else (model.peak_flops, model.fp8_flops)


def compute_seconds(
    flops: int, fp8_flops: int, peak: tuple[float, float], efficiency: float
) -> float:
    bf16, fp8 = peak
    return ((flops - fp8_flops) / bf16 + fp8_flops / fp8) / efficiency


def describe_rates(efficiency: float | None, peak_tflops: float) -> str:
    """How the time model priced the compute, for a report's line."""
    if efficiency is None:
        return f"kernels at their modelled rates ({peak_tflops:,.0f} TFLOP/s peak)"
    return f"compute at {efficiency:.0%} of {peak_tflops:,.0f} TFLOP/s peak"


# ----------------------------------------------------------------------------- the pipeline


def virtual_stage(stage: int, chunk: int, pp: int) -> int:
    return chunk * pp + stage


def simulate(
    orders,
    seconds,
    *,
    pp: int,
    vpp: int | None = None,
    p2p=None,
    least=None,
    ends_after=None,
    host=None,
    clocks=None,
    waited=None,
    p2p_sync: bool = False,
    synced=None,
):
    """Start and end of every step of every stage.

    `orders[s]`: stage s's steps in order, (phase, chunk, microbatch); `seconds(s, phase, chunk)`
    a step's duration; `p2p(s, phase)` the transfer time of what stage s sends after a step of
    `phase` (default 0); `least(s, phase, chunk, microbatch)` a step's least duration and
    `ends_after(s, phase, chunk, microbatch)` the earliest time it can end (defaults none: what
    it waits for beside its compute). `host(s, phase, chunk)`: the step's host matrix in
    seconds, its kernels' seconds and its GPU stream's (kernels and exposed communication)
    (config.host; None: the host keeps up), applied to the stage's host clock and to the GPU's
    where the step starts; the exposed communication follows the kernels, copies on other
    streams run beside them. `p2p_sync`: the host waits for the GPU after each pipeline
    communication (megatron-core's batched send and receive, batch_p2p_comm, end with
    torch.cuda.synchronize(): p2p_communication._communicate, batch_p2p_sync, always on in
    Megatron-LM), before a step that receives or after one that sends; `synced`: a list that
    gets each stage's number of them. `clocks`: a list that gets each stage's host clock at its
    end; `waited`: a dict that gets what each step (s, phase,
    chunk, microbatch) lasts longer waiting for the host. Returns, per stage, [(start, end,
    phase, chunk, microbatch)]."""
    chunks = vpp or 1
    last = pp * chunks - 1
    p2p = p2p or (lambda stage, phase: 0.0)
    finish: dict[tuple[str, int, int], float] = {}
    out: list[list[tuple]] = [[] for _ in orders]
    clock = [0.0] * len(orders)
    host_clock = [0.0] * len(orders)
    cursor = [0] * len(orders)
    sent = [False] * len(orders)  # whether the stage's last step sent its output on
    syncs = [0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progress = False
        for s, order in enumerate(orders):
            while cursor[s] < len(order):
                phase, chunk, mb = order[cursor[s]]
                k = virtual_stage(s, chunk, pp)
                ready = clock[s]
                dep = k - 1 if phase == "forward" else k + 1
                if 0 <= dep <= last:
                    done = finish.get((phase, dep, mb))
                    if done is None:
                        break  # waits for another stage
                    ready = max(ready, done + p2p(dep % pp, phase))
                took = seconds(s, phase, chunk)
                if least is not None:
                    took = max(took, least(s, phase, chunk, mb))
                start, end = ready, ready + took
                gpu_end = end
                issued = host(s, phase, chunk) if host is not None else None
                if p2p_sync and (sent[s] or 0 <= dep <= last):
                    # The communication before the step (the last step's send, this one's
                    # receive) ends in a synchronisation: the host goes on when the GPU has
                    # run everything before the step.
                    host_clock[s] = max(host_clock[s], ready)
                    syncs[s] += 1
                sent[s] = 0 <= (k + 1 if phase == "forward" else k - 1) <= last
                if issued is not None:
                    matrix, kernels, serial = issued
                    host_clock[s], gpu = apply(matrix, host_clock[s], ready)
                    end = max(end, gpu + max(0.0, serial - kernels))
                if ends_after is not None:
                    after = ends_after(s, phase, chunk, mb)
                    end, gpu_end = max(end, after), max(gpu_end, after)
                if waited is not None and end > gpu_end:
                    waited[(s, phase, chunk, mb)] = end - gpu_end
                finish[(phase, k, mb)] = end
                out[s].append((start, end, phase, chunk, mb))
                clock[s] = end
                cursor[s] += 1
                remaining -= 1
                progress = True
        if not progress:
            waiting = [order[cursor[s]] for s, order in enumerate(orders) if cursor[s] < len(order)]
            raise ValueError(f"the stages' step orders wait for each other: {waiting}")
    if clocks is not None:
        # The last step's send synchronises too.
        clocks[:] = [
            max(h, clock[s]) if p2p_sync and sent[s] else h for s, h in enumerate(host_clock)
        ]
    if synced is not None:
        synced[:] = [n + (p2p_sync and sent[s]) for s, n in enumerate(syncs)]
    return out


def bubble(steps, pipeline: float) -> float:
    """Idle fraction of `pipeline` seconds for a stage's [(start, end, ...)] steps."""
    if pipeline <= 0:
        return 0.0
    busy = sum(end - start for start, end, *_ in steps)
    return max(0.0, pipeline - busy) / pipeline


# ----------------------------------------------------------------------------- a traced job


def _inside(windows):
    """seq -> the window that holds it (or None)."""
    spans = sorted(windows, key=lambda w: w.first)
    firsts = [w.first for w in spans]

    def find(seq: int):
        i = bisect.bisect_right(firsts, seq) - 1
        return spans[i] if i >= 0 and seq <= spans[i].last else None

    return find


def _step_calls(job, world, micro: Trace, rank: int):
    """{(phase, chunk): [(flops before, Collective, dimension, seconds, overlapped)]} of the
    traced micro-batch's steps, in order."""
    from metatrace.analysis.comm import call_seconds

    find = _inside([w for w in micro.windows if w.chunk is not None])
    out: dict[tuple[str, int], list] = {}
    for c in micro.collectives:
        w = find(c.seq)
        if w is None:
            continue
        dim, sec, over = call_seconds(job, world, c, rank)
        if sec == 0.0:
            continue
        out.setdefault((w.phase, w.chunk), []).append(
            (micro.collective_flops.get(c.seq, 0), c, dim, sec, over)
        )
    return out


def _p2p(job, world, micro: Trace, rank: int) -> dict[str, tuple[float, int]]:
    """{phase: (seconds, bytes)} of the largest pipeline send after a step of that phase."""
    from metatrace.analysis.comm import call_seconds

    out: dict[str, tuple[float, int]] = {}
    for c in micro.collectives:
        if c.op == "send" and c.peer is not None and c.phase in STEP_PHASES:
            _, sec, _ = call_seconds(job, world, c, rank)
            out[c.phase] = max(out.get(c.phase, (0.0, 0)), (sec, c.bytes))
    return out


def _peaks(iteration: Trace, extra: int) -> dict:
    """{(phase, chunk, microbatch): highest live bytes (+ `extra`)} of the iteration's steps."""
    from metatrace.analysis.memory import window_highs

    ev = iteration.columns("memory", ("seq", "live"))
    win = iteration.columns("windows", ("phase", "chunk", "microbatch", "first", "last"))
    highs = window_highs(iteration.static_bytes, ev, win, carry=False) + extra
    out: dict[tuple, int] = {}
    keys = zip(win["phase"].tolist(), win["chunk"].tolist(), win["microbatch"].tolist())
    for key, high in zip(keys, highs.tolist()):
        out[key] = max(out.get(key, 0), high)
    return out


def _place(compute: float, flops: int, calls) -> tuple[Call, ...]:
    """The step's collectives in time: each after the share of the compute that came before it
    (by FLOPs) and the exposed calls before it; overlapped ones do not delay what follows."""
    placed, waited = [], 0.0
    for before, c, dim, sec, over in calls:
        at = (compute * before / flops if flops else 0.0) + waited
        placed.append(Call(at, sec, c.op, c.group, dim, c.bytes, c.module, over))
        if over is None:
            waited += sec
    return tuple(placed)


def _optimizer(job, world, iteration: Trace, rank: int):
    """The optimizer step's seconds, the update's, and its exposed calls (see module doc)."""
    import numpy as np

    from metatrace.analysis.comm import call_seconds
    from metatrace.config import GPU_HBM_TBPS

    # Outside the steps, and not the pipeline's transfers (read as columns: an iteration of
    # many micro-batches has millions of records).
    win = iteration.columns("windows", ("chunk", "first", "last"))
    steps = np.array([v is not None for v in win["chunk"].tolist()], dtype=bool)
    first, last = win["first"][steps], win["last"][steps]
    order = np.argsort(first, kind="stable")
    first, last = first[order], last[order]
    col = iteration.columns("collectives", ("seq", "op"))
    seq = col["seq"]
    inside = np.zeros(len(seq), dtype=bool)
    if len(first):
        at = np.searchsorted(first, seq, side="right") - 1
        inside = (at >= 0) & (seq <= last[np.maximum(at, 0)])
    p2p = np.array([op in ("send", "recv") for op in col["op"].tolist()], dtype=bool)
    calls = []
    for c in iteration.pick("collectives", np.flatnonzero(~inside & ~p2p).tolist()):
        dim, sec, over = call_seconds(job, world, c, rank)
        if over is None and sec > 0.0:
            calls.append((c, dim, sec))
    parts = iteration.static_parts
    traffic = 2 * parts.get("optimizer", 0) + parts.get("grads", 0) + parts.get("params", 0)
    tbps = GPU_HBM_TBPS.get(job.cluster.gpu)
    update = traffic / (tbps * 1e12) if tbps else 0.0
    # The update runs before the distributed optimizer's parameter all-gather.
    gather = next(
        (i for i, (c, _, _) in enumerate(calls) if c.op == "all_gather" and c.phase == "optimizer"),
        len(calls),
    )
    placed, t = [], 0.0
    for i, (c, dim, sec) in enumerate(calls):
        if i == gather:
            t += update
        placed.append(Call(t, sec, c.op, c.group, dim, c.bytes, c.module, None))
        t += sec
    if gather == len(calls):
        t += update
    return t, update, tuple(placed)


def _dp_overlap(job, world, iteration: Trace, rank: int):
    """The data-parallel collectives Megatron overlaps with the steps, per model chunk:
    ({chunk: seconds of overlap_param_gather's all-gathers before its first forward},
    {chunk: (seconds of overlap_grad_reduce's reductions from its last backward on, the last
    call's seconds)}). Empty for Megatron-FSDP, which gathers and reduces layer by layer inside
    every step (taken as hidden)."""
    import numpy as np

    from metatrace.analysis.comm import GROUP_DIMENSION, call_seconds

    gathers: dict[int, float] = {}
    reduces: dict[int, tuple[float, float]] = {}
    if job.training.megatron_fsdp:
        return gathers, reduces
    win = iteration.columns("windows", ("chunk", "first", "last"))
    chunk_of = np.array([-1 if c is None else c for c in win["chunk"].tolist()])
    steps = np.flatnonzero(chunk_of >= 0)
    if not len(steps):
        return gathers, reduces
    order = steps[np.argsort(win["first"][steps], kind="stable")]
    firsts, lasts, chunks = win["first"][order], win["last"][order], chunk_of[order]
    col = iteration.columns("collectives", ("seq", "op", "group"))
    ops, groups = col["op"].tolist(), col["group"].tolist()
    picked = [
        i
        for i, (op, group) in enumerate(zip(ops, groups))
        if op in ("all_gather", "reduce_scatter", "all_reduce")
        and GROUP_DIMENSION.get(group) == "dp"
    ]
    for c in iteration.pick("collectives", picked):
        dim, sec, over = call_seconds(job, world, c, rank)
        if over is None or sec == 0.0:
            continue
        at = int(np.searchsorted(firsts, c.seq, side="right")) - 1
        inside = at >= 0 and c.seq <= lasts[at]
        if c.op == "all_gather" and c.phase == "forward" and not inside and at + 1 < len(chunks):
            chunk = int(chunks[at + 1])  # before the step that needs the parameters
            gathers[chunk] = gathers.get(chunk, 0.0) + sec
        elif c.op != "all_gather" and c.phase == "backward" and at >= 0:
            chunk = int(chunks[at])  # in or after the backward step whose gradients it reduces
            total, _ = reduces.get(chunk, (0.0, 0.0))
            reduces[chunk] = (total + sec, sec)
    return gathers, reduces


def _reduced_by(stage_steps, reduces) -> float:
    """When a stage's overlapped gradient reductions end: each chunk's start with its last
    backward step (bucket by bucket as its gradients complete; the last bucket, of the first
    layers, only after the step), one after another on the communication stream."""
    last: dict[int, tuple[float, float]] = {}
    for start, end, phase, chunk, _ in stage_steps:
        if phase == "backward":
            last[chunk] = (start, end)
    t = 0.0
    for chunk, (start, end) in sorted(last.items(), key=lambda kv: kv[1]):
        if chunk in reduces:
            total, tail = reduces[chunk]
            t = max(max(t, start) + total, end + tail)
    return t


def job_timing(job_trace) -> Timing | None:
    """The time model of a traced job (needs iteration traces and a GPU with a known peak)."""
    from metatrace.analysis.memory import persistent_bytes

    job, world = job_trace.job, job_trace.world
    peak = peak_flops(job)
    roles = sorted(job_trace.roles, key=lambda rt: rt.role.pp_stage)
    if peak is None or any(rt.iteration is None for rt in roles):
        return None
    eff = job.cluster.compute_efficiency  # None: each kernel at its modelled rate
    pp, vpp = world.layout.pp, job.parallel.vpp
    taken = dispatch_sms_share(job)
    # Per (stage, phase, chunk), what every micro-batch's step does: (flops, compute seconds,
    # exposed communication seconds, the collectives placed in the step).
    kinds, sends, orders = {}, {}, []
    issued: dict[tuple, tuple] = {}  # (stage, phase, chunk): (host matrix, kernels, stream)
    counts: dict[tuple, tuple] = {}  # (stage, phase, chunk): (host seconds, kernels, syncs)
    for rt in roles:
        s, micro = rt.role.pp_stage, rt.trace
        calls = _step_calls(job, world, micro, micro.rank)
        for w in micro.windows:
            if w.chunk is not None:
                comp = (
                    w.kernel_ps / 1e12
                    if eff is None
                    else compute_seconds(w.flops, w.fp8_flops, peak, eff)
                )
                mine = calls.get((w.phase, w.chunk), ())
                exposed = sum(sec for *_, sec, over in mine if over is None)
                # What Megatron overlaps inside the step is hidden as far as the kernels beside
                # it last: the CP ring the attention kernels, TE's userbuffers the rest (the
                # linear layers' GEMMs), the EP all-to-alls of a combined 1F1B step its compute.
                attention = comp * w.attention_ps / w.kernel_ps if w.kernel_ps else 0.0
                beside = dict.fromkeys(_IN_STEP, 0.0)
                ring = {"send": 0.0, "recv": 0.0}
                for _, c, dim, sec, over in mine:
                    if over is not None and dim == "cp" and c.op in ring:
                        ring[c.op] += sec  # a ring step sends and receives at once
                    elif over is not None and dim in beside:
                        beside[dim] += sec
                beside["cp"] += max(ring.values())
                exposed += max(0.0, beside["cp"] - attention)
                exposed += max(0.0, beside["tp"] - (comp - attention))
                exposed += _beside_dispatch(beside["ep"], comp, taken)
                kinds[(s, w.phase, w.chunk)] = (w.flops, comp, exposed, _place(comp, w.flops, mine))
                if eff is None and w.host and w.kernel_ps:
                    # The step's host work and kernels (config.host), where its kernels are
                    # priced; the host keeps up with the GPU otherwise.
                    issued[(s, w.phase, w.chunk)] = (
                        scaled(product(w.host), 1e-12),
                        w.kernel_ps / 1e12,
                        comp + exposed,
                    )
                counts[(s, w.phase, w.chunk)] = (w.host_ps / 1e12, w.kernels, w.syncs)
        sends[s] = _p2p(job, world, micro, micro.rank)
        win = rt.iteration.columns("windows", ("phase", "chunk", "microbatch"))
        steps = zip(win["phase"].tolist(), win["chunk"].tolist(), win["microbatch"].tolist())
        orders.append([step for step in steps if step[1] is not None])
    none = (0, 0.0, 0.0, ())
    copies = {rt.role.pp_stage: _offload_seconds(job, rt) for rt in roles}
    dp = {rt.role.pp_stage: _dp_overlap(job, world, rt.iteration, rt.trace.rank) for rt in roles}
    # (stage, chunk): the micro-batch of its first forward step
    first_forward: dict[tuple[int, int], int] = {}
    for s, order in enumerate(orders):
        for phase, chunk, mb in order:
            if phase == "forward":
                first_forward.setdefault((s, chunk), mb)

    def duration(s, phase, chunk):
        _, comp, exposed, _ = kinds.get((s, phase, chunk), none)
        return max(comp + exposed, copies[s].get(phase, 0.0))

    # overlap_param_gather: a chunk's first forward waits for its parameters. With virtual
    # stages Megatron-LM aligns the gathers (align_param_gather): every stage starts them when
    # the iteration does, chunk after chunk (schedules.py launches later chunks' ahead of their
    # first forward), so the step ends no earlier than its chunk's gather does. Otherwise each
    # stage gathers when its first forward asks, bucket by bucket as the layers need them: the
    # step lasts at least the gather.
    aligned = job.training.overlap_param_gather and vpp is not None
    gathered_by = {
        (s, chunk): sum(sec for c, sec in dp[s][0].items() if c <= chunk)
        for (s, chunk) in first_forward
    }

    def waits(s, phase, chunk, mb) -> bool:
        return phase == "forward" and first_forward.get((s, chunk)) == mb

    def least(s, phase, chunk, mb):
        return dp[s][0].get(chunk, 0.0) if not aligned and waits(s, phase, chunk, mb) else 0.0

    def ends_after(s, phase, chunk, mb):
        return gathered_by[(s, chunk)] if aligned and waits(s, phase, chunk, mb) else 0.0

    host_clocks: list[float] = []
    p2p_syncs: list[int] = []
    waited: dict[tuple, float] = {}
    simulated = simulate(
        orders,
        duration,
        pp=pp,
        vpp=vpp,
        p2p=lambda s, phase: sends[s].get(phase, (0.0, 0))[0],
        least=least,
        ends_after=ends_after,
        host=lambda s, phase, chunk: issued.get((s, phase, chunk)),
        clocks=host_clocks,
        waited=waited,
        p2p_sync=pp > 1 and not job.parallel.overlap_p2p_comm,
        synced=p2p_syncs,
    )
    pipeline = max((end for stage in simulated for _, end, *_ in stage), default=0.0)
    # The optimizer step starts when every stage's gradients are reduced (the gradient norm's
    # all-reduce over the model-parallel group waits for the slowest); the wait beyond the
    # steps is exposed gradient reduction.
    reduced = max(
        [pipeline]
        + [_reduced_by(stage, dp[rt.role.pp_stage][1]) for rt, stage in zip(roles, simulated)]
    )
    wait = reduced - pipeline
    stages, transfers = [], []
    hosts: dict[int, Host] = {}
    gather_waits = 0.0
    for rt, stage in zip(roles, simulated):
        s = rt.role.pp_stage
        peaks = _peaks(rt.iteration, persistent_bytes(rt.trace))
        spans = []
        gathered = 0.0
        host_seconds = 0.0
        for start, end, phase, chunk, mb in stage:
            flops, comp, exposed, placed = kinds.get((s, phase, chunk), none)
            host_wait = waited.get((s, phase, chunk, mb), 0.0)
            host_seconds += counts.get((s, phase, chunk), (0.0,))[0]
            # A first forward waiting for its parameters: the wait is exposed communication.
            extra = end - start - host_wait - max(comp + exposed, copies[s].get(phase, 0.0))
            extra = extra if extra > 1e-9 else 0.0  # not the rounding of start + duration
            exposed += extra
            gathered += extra
            spans.append(
                Span(
                    start,
                    end,
                    phase,
                    mb,
                    chunk,
                    flops,
                    comp,
                    exposed,
                    peaks.get((phase, chunk, mb), 0),
                    placed,
                    copies[s].get(phase, 0.0),
                    host_wait,
                )
            )
            transfers.extend(_transfers(s, phase, chunk, mb, end, sends[s], pp, vpp))
        opt_seconds, update, opt_calls = _optimizer(job, world, rt.iteration, rt.trace.rank)
        host = host_optimizer_seconds(job, rt.host_optimizer) or 0.0
        opt_seconds += host  # the optimizer CPU offload's copies, in the step
        opt_seconds += wait
        # The optimizer step's host work starts where the host finished issuing the steps;
        # the step ends no earlier than the host has issued it (and read its gradient norm).
        opt_host, opt_kernels, opt_syncs = _outside_steps(rt.iteration)
        opt_wait = 0.0
        if issued and host_clocks:
            opt_wait = max(0.0, host_clocks[s] + opt_host - pipeline - opt_seconds)
        opt_seconds += opt_wait
        host_seconds += opt_host
        opt_calls = tuple(dataclasses.replace(c, offset=c.offset + wait) for c in opt_calls)
        opt_peak = max(
            (v for (ph, _, _), v in peaks.items() if ph in ("grad sync", "optimizer")), default=0
        )
        spans.append(
            Span(
                pipeline,
                pipeline + opt_seconds,
                "optimizer",
                None,
                None,
                compute_seconds=update,
                comm_seconds=opt_seconds - update - host - opt_wait,
                peak_bytes=opt_peak,
                calls=opt_calls,
                offload_seconds=host,
                host_wait_seconds=opt_wait,
            )
        )
        step_counts = [
            counts.get((s, phase, chunk), (0.0, 0, 0)) for _, _, phase, chunk, _ in stage
        ]
        hosts[s] = Host(
            stage=s,
            seconds=host_seconds,
            wait_seconds=sum(sp.host_wait_seconds for sp in spans),
            kernels=sum(k for _, k, _ in step_counts) + opt_kernels,
            syncs=sum(n for _, _, n in step_counts) + opt_syncs + p2p_syncs[s],
        )
        gather_waits = max(gather_waits, gathered)
        busy = sum(end - start for start, end, *_ in stage)
        stages.append(
            StageTiming(
                s, tuple(spans), busy, opt_seconds, pipeline + opt_seconds, bubble(stage, pipeline)
            )
        )
    idle = sum(pipeline - st.busy_seconds for st in stages)
    last = max(stages, key=lambda st: st.iteration_seconds).stage
    return Timing(
        stages=tuple(stages),
        transfers=tuple(transfers),
        pipeline_seconds=pipeline,
        iteration_seconds=max(st.iteration_seconds for st in stages),
        bubble_fraction=idle / (pipeline * len(stages)) if pipeline else 0.0,
        peak_tflops=peak[0] / 1e12,
        efficiency=eff,
        dp_exposed_seconds=gather_waits + wait,
        host=hosts[last] if issued else None,
    )


def _outside_steps(iteration: Trace) -> tuple[float, int, int]:
    """(host seconds, kernels, synchronisations) of the iteration's windows outside the steps
    (the gradient synchronisation and the optimizer step)."""
    import numpy as np

    win = iteration.columns("windows", ("chunk", "host_ps", "kernels", "syncs"))
    outside = np.array([c is None for c in win["chunk"].tolist()], dtype=bool)
    total = lambda name: int(win[name][outside].sum())
    return total("host_ps") / 1e12, total("kernels"), total("syncs")


def dispatch_sms_share(job) -> float:
    """The share of the GPU's multiprocessors the flex dispatcher's kernels hold while they run:
    DeepEP's moe_deepep_num_sms, HybridEP's moe_hybridep_num_sms (megatron-core passes them to
    the kernels: fused_a2a.py set_deepep_num_sms, hybrid_ep_dispatch's num_sms); 0 for NCCL's
    all-to-alls (their share is not modelled, as for every NCCL kernel)."""
    from metatrace.config.kernels import GPU_SMS

    par = job.parallel
    total = GPU_SMS.get(job.cluster.gpu)
    if par.moe_token_dispatcher_type != "flex" or not total:
        return 0.0
    deepep = par.moe_flex_dispatcher_backend == "deepep"
    sms = par.moe_deepep_num_sms if deepep else par.moe_hybridep_num_sms
    return min(sms, total - 1) / total


def _beside_dispatch(dispatch: float, compute: float, taken: float) -> float:
    """What the expert-parallel all-to-alls of a combined 1F1B step (`dispatch` seconds, run
    beside the step's `compute`) add to it: the compute runs on the multiprocessors the
    dispatcher's kernels leave (1 - `taken` of them) while they run, so the step lasts
    compute + dispatch x taken, or the dispatch where that is longer."""
    if dispatch <= 0.0:
        return 0.0
    return max(dispatch * taken, dispatch - compute)


def _offload_seconds(job, rt) -> dict[str, float]:
    """{phase: seconds of one step's activation-offloading copies} of a role (none without
    offloading, or without a host-link bandwidth)."""
    from metatrace.analysis.memory import role_offload

    summary = role_offload(job, rt)
    gbps = job.cluster.host_link_gbps
    if summary is None or not gbps:
        return {}
    per_step = summary.d2h_per_microbatch / max(1, len(rt.chunks)) * 8 / (gbps * 1e9)
    return {"forward": per_step, "backward": per_step}


def host_optimizer_seconds(job, host) -> float | None:
    """Seconds of the optimizer CPU offload's copies in one optimizer step
    (metatrace.hooks.optimizer_offload.HostOptimizer; None without it or without a host-link
    bandwidth): the gradients to the host, then the parameters back; with
    overlap_cpu_optimizer_d2h_h2d both directions run at once, parameter by parameter. The host
    update between them is not timed."""
    gbps = job.cluster.host_link_gbps
    if host is None or not gbps:
        return None
    d2h, h2d = host.d2h_bytes, host.h2d_bytes
    moved = max(d2h, h2d) if job.training.overlap_cpu_optimizer_d2h_h2d else d2h + h2d
    return moved * 8 / (gbps * 1e9)


@dataclass(frozen=True)
class Breakdown:
    """Where the iteration of the stage that finishes last goes; the terms add up to it."""

    stage: int
    compute: float
    """Its forward and backward steps' kernels."""
    communication: float
    """Communication its steps wait for: the exposed TP, CP and EP collectives, overlapped ones
    outlasting the kernels beside them, first forwards waiting for their parameters."""
    idle: float
    """Waiting for other stages: the pipeline's bubble and its transfers."""
    optimizer: float
    """The optimizer step: the update, its exposed collectives, the wait for overlapped gradient
    reductions, the optimizer CPU offload's copies."""
    offload: float
    """Activation offloading's copies outlasting the steps."""
    host: float = 0.0
    """The GPU waiting for the host to issue the kernels of its steps and optimizer step."""

    _JSON = (
        ("compute", "compute_seconds"),
        ("communication", "communication_seconds"),
        ("idle", "idle_seconds"),
        ("optimizer", "optimizer_seconds"),
        ("offload", "offload_seconds"),
        ("host", "host_seconds"),
    )

    def to_json(self) -> dict:
        """The JSON report's form (timing.breakdown)."""
        return {"stage": self.stage, **{key: getattr(self, f) for f, key in self._JSON}}

    @classmethod
    def from_json(cls, d: dict) -> Breakdown:
        # host_seconds: reports of metatrace before the host was modelled have none.
        return cls(stage=d["stage"], **{f: d.get(key, 0.0) for f, key in cls._JSON})

    def terms(self) -> tuple[tuple[str, float], ...]:
        """(name, seconds) of each term, largest first."""
        named = (
            ("compute", self.compute),
            ("communication in the steps", self.communication),
            ("pipeline idle", self.idle),
            ("optimizer step", self.optimizer),
            ("offload copies", self.offload),
            ("waiting for the host", self.host),
        )
        return tuple(sorted(named, key=lambda kv: -kv[1]))


def breakdown(timing: Timing) -> Breakdown:
    """The terms of the iteration of the stage that finishes last (see Breakdown)."""
    st = max(timing.stages, key=lambda s: s.iteration_seconds)
    steps = [sp for sp in st.spans if sp.phase in STEP_PHASES]
    compute = sum(sp.compute_seconds for sp in steps)
    comm = sum(sp.comm_seconds for sp in steps)
    busy = sum(sp.end - sp.start for sp in steps)
    waits = sum(sp.host_wait_seconds for sp in steps)
    opt_wait = sum(sp.host_wait_seconds for sp in st.spans if sp.phase == "optimizer")
    return Breakdown(
        stage=st.stage,
        compute=compute,
        communication=comm,
        idle=max(0.0, timing.pipeline_seconds - busy),
        optimizer=st.optimizer_seconds - opt_wait,
        offload=max(0.0, busy - compute - comm - waits),
        host=waits + opt_wait,
    )


def offload_exposed_seconds(timing: Timing) -> float:
    """Seconds per iteration that offloading's copies add to the slowest stage's steps (the
    copies outlast the compute and communication)."""
    worst = 0.0
    for st in timing.stages:
        extra = sum(
            max(0.0, sp.offload_seconds - sp.compute_seconds - sp.comm_seconds)
            for sp in st.spans
            if sp.phase in STEP_PHASES
        )
        worst = max(worst, extra)
    return worst


def _transfers(s, phase, chunk, mb, end, sends, pp, vpp):
    """The pipeline send after a step, if its virtual stage has a neighbour that way."""
    if phase not in sends:
        return ()
    k = virtual_stage(s, chunk, pp) + (1 if phase == "forward" else -1)
    if not 0 <= k < pp * (vpp or 1):
        return ()
    sec, nbytes = sends[phase]
    return (Transfer(end, end + sec, phase, mb, (s, chunk), (k % pp, k // pp), nbytes),)
