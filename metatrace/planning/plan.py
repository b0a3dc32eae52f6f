"""`metatrace plan`: which parallel layouts of a model fit a cluster, and which is fastest.

1. Enumerate layouts: tp (dividing a node), pp (dividing the layers), vpp, cp, ep (with
   experts), dp (what is left), sequence parallel (on with tp > 1: the same traffic as without,
   activations divided by tp), micro-batch size, recompute (none, selective, full) and the
   distributed optimizer; every one is resolved and checked as a job file would be, and the
   ones Megatron would refuse are dropped.
2. Prune with closed forms (metatrace.planning.estimates) that never prune a layout that fits: a lower bound of a rank's
   memory (parameters, gradients and optimizer state of its largest stage, plus the input of
   every layer for the micro-batches the schedule keeps in flight: what full recompute keeps);
   and dominance: without the distributed optimizer a layout moves the same bytes and holds
   more (so it never ranks above its twin with it), and a recompute variant is traced only when
   the variant with less recompute does not fit.
3. Order the rest by a closed-form estimate of the iteration time (compute kernel by kernel,
   estimates.kernel_seconds: each layer's GEMMs by their shapes, fused attention by its
   sequence, memory-bound work by the bytes it moves; the pipeline bubble; exposed
   communication), layouts whose estimated memory fits first, and trace them in that order
   (each one a whole `metatrace run` without the full model, its roles in parallel processes)
   until `top` fit and no untraced layout is estimated faster than the slowest of them, or the
   trace budget is spent. A layout that holds no more than a traced one that does not fit (the
   same degrees, a smaller micro-batch, the distributed optimizer; context parallelism with as
   many tokens a rank; selective recompute of a fused attention against none) is not traced.
   After each trace the layouts left are ordered again, their memory estimates raised by what
   the traced layouts took beyond theirs (the allocator's reserve, NCCL's buffers, what the
   closed forms leave out: the least of those of the same degrees, else of all).
4. Rank the fitting layouts by the traced time model (metatrace.analysis.timing: the same
   per-kernel rates as `metatrace run`), those whose headroom lies within the prediction's
   error band for the job's kind (metatrace.analysis.margins) after the others; only layouts
   that fit beyond the band stand for their degrees, dominate a twin and count towards `top`.

Known limitations: the stop rule compares closed forms with closed forms; the closed form's
compute is within about 15 % of the traced kernels' (tests/tracing/test_plan.py), so a layout
estimated slightly slower than the slowest of the top ones but traced faster can be missed.
With cluster.compute_efficiency set, every FLOP runs at that rate whatever the kernel's shape:
then micro-batch 1 and cp > 1 (more micro-batches per replica, a smaller bubble) cost nothing,
and the search prefers them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from metatrace.config import Recompute, resolve
from metatrace.config.job import replace
from metatrace.config.megatron.to_args import megatron_args
from metatrace.errors import ConfigError
from metatrace.planning.estimates import Estimate, estimate, memory_estimate, memory_lower_bound
from metatrace.tracing.checks import check_with_megatron

GiB = 2**30
RECOMPUTE = {
    "none": Recompute(),
    "selective": Recompute(granularity="selective"),
    "full": Recompute(granularity="full", method="uniform", num_layers=1),
}


@dataclass(frozen=True, order=True)
class Layout:
    tp: int
    pp: int
    vpp: int | None
    cp: int
    ep: int
    dp: int
    sp: bool
    mbs: int
    recompute: str
    distributed_optimizer: bool

    def describe(self) -> str:
        parts = [f"tp {self.tp}", f"pp {self.pp}"]
        if self.vpp:
            parts.append(f"vpp {self.vpp}")
        if self.cp > 1:
            parts.append(f"cp {self.cp}")
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        parts += [f"dp {self.dp}", f"mbs {self.mbs}"]
        if self.sp:
            parts.append("SP")
        if self.recompute != "none":
            parts.append(f"{self.recompute} recompute")
        if self.distributed_optimizer:
            parts.append("dist-opt")
        return ", ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(job, num_gpus: int) -> list[Layout]:
    """Every combination worth resolving (see the module docstring)."""
    m, tr = job.model, job.training
    out = []
    node = job.cluster.gpus_per_node
    for tp in (d for d in _divisors(node) if num_gpus % d == 0):
        for pp in (d for d in _divisors(m.num_layers) if num_gpus % (tp * d) == 0):
            per_stage = m.num_layers // pp
            vpps = [None] + ([v for v in _divisors(per_stage) if v > 1] if pp > 1 else [])
            for cp in (c for c in (1, 2, 4, 8) if num_gpus % (tp * pp * c) == 0):
                if cp > 1 and tr.seq_length // cp < 1024:
                    continue  # context parallelism pays only on long sequences
                dp = num_gpus // (tp * pp * cp)
                eps = (
                    [e for e in _divisors(m.num_experts) if (dp * cp) % e == 0]
                    if m.num_experts
                    else [1]
                )
                per_replica = tr.global_batch_size // dp if tr.global_batch_size % dp == 0 else 0
                for vpp in vpps:
                    for ep in eps:
                        for mbs in (b for b in _divisors(per_replica) if b <= 16):
                            for recompute in RECOMPUTE:
                                for dist in (True, False) if dp * cp > 1 else (False,):
                                    out.append(
                                        Layout(
                                            tp, pp, vpp, cp, ep, dp, tp > 1, mbs, recompute, dist
                                        )
                                    )
    return out


def base_job(
    *,
    model: str | None,
    base=None,
    seq: int | None,
    global_batch: int | None,
    num_gpus: int | None,
    cluster: dict,
):
    """(job on one GPU with the model, batch and cluster to plan for, GPUs to plan for): from a
    preset or a Hugging Face config.json (`model`), or a job (`base`: read from a job file or
    Megatron-LM arguments) whose parallel layout is dropped; `cluster` overrides given as not
    None (a new `gpu` brings its own memory, links and cuBLAS defaults unless `gpu_memory_gib`
    is given too)."""
    from metatrace.config import job_from_dict

    if base is not None:
        source = base.source
    else:
        assert model is not None
        key = "hf_config" if model.endswith(".json") else "preset"
        base = job_from_dict(
            {
                "model": {key: model},
                "training": {"seq_length": seq, "global_batch_size": global_batch},
                "cluster": {"num_gpus": 1},
            },
            source=model,
        )
        source = model
    training = dataclasses.replace(
        base.training,
        seq_length=seq or base.training.seq_length,
        global_batch_size=global_batch or base.training.global_batch_size,
    )
    given = {k: v for k, v in cluster.items() if v is not None}
    if "gpu" in given and "gpu_memory_gib" not in given:
        given.update(
            gpu_memory_gib=None,
            intra_node_gbps=None,
            inter_node_gbps=None,
            cublas_workspace_config=None,
        )
    fresh = dataclasses.replace(base.cluster, num_gpus=None, **given)
    parallel = type(base.parallel)(rank_order=base.parallel.rank_order)
    job = resolve(
        dataclasses.replace(
            base, parallel=parallel, training=training, cluster=fresh, notes=(), source=source
        )
    )
    return job, num_gpus or base.cluster.num_gpus


def job_of(job, layout: Layout):
    """The base job with `layout`, resolved and checked; ConfigError when Megatron refuses it."""
    par = replace(
        job.parallel,
        tp=layout.tp,
        pp=layout.pp,
        vpp=layout.vpp,
        cp=layout.cp,
        ep=layout.ep,
        etp=None,
        dp=layout.dp,
        sequence_parallel=layout.sp,
        layout=None,
        first_stage_layers=None,
        last_stage_layers=None,
        overlap_p2p_comm=None,
    )
    tr = replace(
        job.training,
        micro_batch_size=layout.mbs,
        recompute=RECOMPUTE[layout.recompute],
        distributed_optimizer=layout.distributed_optimizer,
        overlap_grad_reduce=layout.distributed_optimizer,
        overlap_param_gather=layout.distributed_optimizer,
        # The base job's optimizer instances where the layout shards (layouts whose dp x cp
        # they do not divide are refused by the checks, as Megatron refuses them).
        num_distributed_optimizer_instances=(
            job.training.num_distributed_optimizer_instances if layout.distributed_optimizer else 1
        ),
    )
    cl = replace(job.cluster, num_gpus=layout.tp * layout.pp * layout.cp * layout.dp)
    candidate = resolve(replace(job, parallel=par, training=tr, cluster=cl, notes=()))
    check_with_megatron(candidate)
    return candidate


# ----------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    job: object
    lower_bound: int
    estimated_memory: int
    estimate: Estimate


@dataclass
class Traced:
    candidate: Candidate
    peak: int
    headroom: int
    fits: bool
    estimate: Estimate
    """The closed-form compute and bubble with the traced exposed communication (or the
    traced time model's figures when the report has them)."""
    report: dict = field(repr=False, default_factory=dict)

    @property
    def within_error(self) -> bool:
        """Whether it fits by less than the prediction's error band for the job's kind
        (metatrace.analysis.margins): ranked after the layouts that fit beyond it."""
        band = self.report.get("memory_verdict", {}).get("error_band")
        return bool(self.fits and band and band["within"])


@dataclass
class Plan:
    layouts: int
    """Combinations enumerated."""
    invalid: int
    """Refused by Megatron's rules (heads by tp, layers by pp, batch by dp, ...)."""
    pruned_memory: int
    """Whose memory lower bound exceeds the GPU."""
    dominated: list = field(default_factory=list)
    """Candidates not traced because a traced twin dominates them."""
    traced: list = field(default_factory=list)
    outgrown: int = 0
    """Candidates not traced because a traced layout that holds no more memory does not fit,
    or fits only within the prediction's error band (the same degrees with a smaller or equal
    micro-batch, with the distributed optimizer where the candidate has none)."""
    represented: int = 0
    """Variants not traced because a variant of the same degrees estimated faster fits (the
    ranking shows one layout per set of degrees)."""
    untraced: int = 0
    """Candidates left when the search stopped (estimated slower, or over the budget)."""

    def ranked(self) -> list[Traced]:
        """The layouts that fit, fastest first; those whose headroom lies within the
        prediction's error band after the others."""
        return sorted(
            (t for t in self.traced if t.fits), key=lambda t: (t.within_error, t.estimate.seconds)
        )


def _room(job) -> int:
    """What the closed forms may fill of a GPU: its memory less the margin kept free and the
    CUDA context (the traced verdict adds the allocator's reserve and NCCL's buffers)."""
    from metatrace.analysis.device import context_bytes

    cl = job.cluster
    return (
        round(cl.gpu_memory_gib * GiB) - round(cl.reserved_overhead_gib * GiB) - context_bytes(job)
    )


def candidates(job, num_gpus: int) -> tuple[list[Candidate], int, int, int]:
    """(valid candidates after the memory bound, enumerated, invalid, pruned by memory)."""
    capacity = _room(job)
    every = layouts(job, num_gpus)
    out, invalid, pruned = [], 0, 0
    for layout in every:
        try:
            variant = job_of(job, layout)
        except ConfigError:
            invalid += 1
            continue
        bound = memory_lower_bound(variant)
        if bound > capacity:
            pruned += 1
            continue
        out.append(Candidate(layout, variant, bound, memory_estimate(variant), estimate(variant)))
    return out, len(every), invalid, pruned


def _family(layout: Layout) -> tuple:
    """The degrees of parallelism; its variants differ in vpp, micro-batch size, recompute and
    optimizer sharding."""
    return (layout.tp, layout.pp, layout.cp, layout.ep, layout.dp)


def _twin(layout: Layout, **change) -> Layout:
    return dataclasses.replace(layout, **change)


def _dominated_by(layout: Layout) -> list[Layout]:
    """Layouts that, when they fit, are at least as good as `layout`: its twin with the
    distributed optimizer, its twins with less recompute."""
    out = []
    if not layout.distributed_optimizer and layout.dp * layout.cp > 1:
        out.append(_twin(layout, distributed_optimizer=True))
    less = {"full": ("none", "selective"), "selective": ("none",)}.get(layout.recompute, ())
    out += [_twin(layout, recompute=r) for r in less]
    return out


def _holds_no_more(small: Layout, big: Layout, fused_attention: bool) -> bool:
    """Whether `small` holds no more memory than `big`: the same tp, pp, ep and dp x cp (the
    same static memory: the distributed optimizer shards over dp x cp), no more context
    parallelism (its ring's buffers), no more tokens a micro-batch on a rank (mbs / cp: every
    activation grows with them; the same micro-batches an iteration then), the same virtual
    stages and recompute and the distributed optimizer where `big` has it. Selective
    recompute of the core attention (the planner's) holds no less than none where the
    attention kernel is fused: the kernel keeps no score matrix, and the checkpoint keeps its
    inputs (traced: Qwen3-30B-A3B, 82.0 against 78.7 GiB)."""
    recompute = small.recompute == big.recompute or (
        fused_attention and (small.recompute, big.recompute) == ("none", "selective")
    )
    return (
        (small.tp, small.pp, small.ep, small.dp * small.cp)
        == (big.tp, big.pp, big.ep, big.dp * big.cp)
        and small.cp <= big.cp
        and small.mbs * big.cp <= big.mbs * small.cp
        and (small.vpp, small.sp) == (big.vpp, big.sp)
        and recompute
        and (small.distributed_optimizer or not big.distributed_optimizer)
    )


def ordered(cands: list[Candidate], capacity: int, beyond: dict | None = None) -> list[Candidate]:
    """`cands` in the order to trace them: those whose estimated memory plus what the traced
    layouts took beyond their estimates (`beyond`: by degrees, _family, the least of those of
    the same degrees; under None, the least of all) fits `capacity` first, each part by its
    estimated iteration time."""
    beyond = beyond or {}
    default = min(beyond.values(), default=0)

    def key(c: Candidate) -> tuple:
        more = beyond.get(_family(c.layout), default)
        return (c.estimated_memory + more > capacity, c.estimate.seconds, c.layout)

    return sorted(cands, key=key)


def plan(
    job,
    num_gpus: int,
    *,
    trace: Callable,
    top: int = 3,
    budget: int = 16,
    progress: Callable | None = None,
) -> Plan:
    """Search the layouts of `job` (its model, batch and cluster) on `num_gpus` GPUs.
    `trace(job) -> report dict` traces one; `progress(done, total, text)` reports."""
    found, enumerated, invalid, pruned = candidates(job, num_gpus)
    result = Plan(layouts=enumerated, invalid=invalid, pruned_memory=pruned)
    capacity = _room(job)
    # What the traced layouts took beyond their closed-form estimates (the allocator's reserve,
    # NCCL's buffers, what the closed forms leave out), at least: after each trace the layouts
    # left are ordered as their estimates plus it fit or not (only the order: every verdict
    # is traced).
    beyond: dict = {}
    order = ordered(found, capacity)
    # Traced layouts and whether they fit beyond the prediction's error band: only those that do
    # dominate a twin, stand for their degrees and count towards `top` (one within the band
    # leaves room for a safer twin); one that does not rules out every layout that holds no
    # less (its headroom is no larger, its band no smaller).
    clear: dict[Layout, bool] = {}
    families: set = set()
    i = 0
    while i < len(order):
        cand = order[i]
        i += 1
        better = [t for t in _dominated_by(cand.layout) if clear.get(t)]
        if better:
            result.dominated.append((cand, better[0]))
            continue
        if _family(cand.layout) in families:
            result.represented += 1
            continue
        fused = cand.job.attention_kernel in ("fused", "flash")
        if any(_holds_no_more(t, cand.layout, fused) for t, ok in clear.items() if not ok):
            result.outgrown += 1
            continue
        ranked = [t for t in result.ranked() if not t.within_error]
        # Closed form against closed form: the traced figures are on another footing.
        slowest = (
            max(t.candidate.estimate.seconds for t in ranked[:top]) if len(ranked) >= top else None
        )
        if len(result.traced) >= budget or (
            slowest is not None
            and cand.estimate.seconds > slowest
            and cand.estimated_memory
            + beyond.get(_family(cand.layout), min(beyond.values(), default=0))
            <= capacity
        ):
            result.untraced = len(order) - i + 1
            break
        if progress:
            progress(len(result.traced), budget, cand.layout.describe())
        report = trace(cand.job)
        traced = _traced(cand, report)
        clear[cand.layout] = traced.fits and not traced.within_error
        if clear[cand.layout]:
            families.add(_family(cand.layout))
        result.traced.append(traced)
        residual = capacity - traced.headroom - cand.estimated_memory
        degrees = _family(cand.layout)
        beyond[degrees] = min(beyond.get(degrees, residual), residual)
        order[i:] = ordered(order[i:], capacity, beyond)
    return result


def _traced(cand: Candidate, report: dict) -> Traced:
    """The traced figures: the time model's iteration, bubble and compute (metatrace.analysis.timing,
    from the traced kernels and collectives; compute: the stage that finishes last) when the report
    has them, else the closed form with the traced exposed communication."""
    v = report["memory_verdict"]
    exposed = max(sum(d["exposed_seconds"] for d in r["comm"].values()) for r in report["roles"])
    est = estimate(cand.job, exposed_comm=exposed)
    timing = report.get("timing")
    if timing:
        est = dataclasses.replace(
            est,
            compute=timing["breakdown"]["compute_seconds"],
            bubble=timing["bubble_fraction"],
            seconds=timing["iteration_seconds"],
        )
    return Traced(cand, v["highest_peak_bytes"], v["headroom_bytes"], v["fits"], est, report)


def plan_report(result: Plan, top: int) -> dict:
    """The plan as JSON data."""

    def entry(t: Traced) -> dict:
        return {
            "layout": dataclasses.asdict(t.candidate.layout),
            "description": t.candidate.layout.describe(),
            "megatron_args": megatron_args(t.candidate.job),
            "fits": t.fits,
            "peak_bytes": t.peak,
            "headroom_bytes": t.headroom,
            "within_error_band": t.within_error,
            "memory_lower_bound_bytes": t.candidate.lower_bound,
            "estimated_memory_bytes": t.candidate.estimated_memory,
            "estimate": {
                "compute_seconds": t.estimate.compute,
                "bubble_fraction": t.estimate.bubble,
                "exposed_comm_seconds": t.estimate.comm,
                "host_seconds": t.estimate.host,
                "iteration_seconds": t.estimate.seconds,
            },
        }

    return {
        "layouts": result.layouts,
        "invalid": result.invalid,
        "pruned_memory": result.pruned_memory,
        "dominated": len(result.dominated),
        "outgrown": result.outgrown,
        "represented": result.represented,
        "untraced": result.untraced,
        "traced": [entry(t) for t in result.traced],
        "best": [entry(t) for t in result.ranked()[:top]],
    }
