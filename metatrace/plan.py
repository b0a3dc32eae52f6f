"""`metatrace plan`: which parallel layouts of a model fit a cluster, and which is fastest.

1. Enumerate layouts: tp (dividing a node), pp (dividing the layers), vpp, cp, ep (with
   experts), dp (what is left), sequence parallel (on with tp > 1: the same traffic as without,
   activations divided by tp), micro-batch size, recompute (none, selective, full) and the
   distributed optimizer; every one is resolved and checked as a job file would be, and the
   ones Megatron would refuse are dropped.
2. Prune with closed forms that never prune a layout that fits: a lower bound of a rank's
   memory (parameters, gradients and optimizer state of its largest stage, plus the input of
   every layer for the micro-batches the schedule keeps in flight: what full recompute keeps);
   and dominance: without the distributed optimizer a layout moves the same bytes and holds
   more (so it never ranks above its twin with it), and a recompute variant is traced only when
   the variant with less recompute does not fit.
3. Order the rest by a closed-form estimate of the iteration time (compute at the assumed
   efficiency, the pipeline bubble, exposed communication), layouts whose estimated memory fits
   first, and trace them in that order (each one a whole `metatrace run` without the full model,
   its roles in parallel processes) until `top` fit and no untraced layout is estimated faster
   than the slowest of them, or the trace budget is spent.
4. Rank the fitting layouts by the estimated iteration time with their traced communication.

Known limitations: the time model is FLOPs at a fixed efficiency plus bandwidth-only
communication, so a larger micro-batch never helps (kernel efficiency growing with size is not
modelled) and the planner prefers the smallest one that keeps the bubble down.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from metatrace.config import GPU_PEAK_TFLOPS, Recompute, resolve
from metatrace.errors import ConfigError

GiB = 2**30
RECOMPUTE = {
    "none": Recompute(),
    "selective": Recompute(granularity="selective"),
    "full": Recompute(granularity="full", method="uniform", num_layers=1),
}
# Extra compute of a training step per recompute kind, in forward passes (forward + backward
# = 3 forward passes): full recompute runs every layer's forward again; selective recomputes
# attention's core only (its share of the FLOPs is estimated per model below).
_FULL_RECOMPUTE = 1.0


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
                eps = [e for e in _divisors(m.num_experts) if (dp * cp) % e == 0] if m.num_experts else [1]
                per_replica = tr.global_batch_size // dp if tr.global_batch_size % dp == 0 else 0
                for vpp in vpps:
                    for ep in eps:
                        for mbs in (b for b in _divisors(per_replica) if b <= 16):
                            for recompute in RECOMPUTE:
                                for dist in (True, False) if dp * cp > 1 else (False,):
                                    out.append(Layout(tp, pp, vpp, cp, ep, dp, tp > 1, mbs,
                                                      recompute, dist))
    return out


def base_job(*, model: str | None, config: str | None, seq: int | None,
             global_batch: int | None, num_gpus: int | None, cluster: dict):
    """(job on one GPU with the model, batch and cluster to plan for, GPUs to plan for): from a
    preset or a Hugging Face config.json (`model`), or a job file (`config`) whose parallel
    layout is dropped; `cluster` overrides given as not None (a new `gpu` brings its own
    memory, links and cuBLAS defaults unless `gpu_memory_gib` is given too)."""
    from metatrace.config import job_from_dict, load_job

    if config:
        base, source = load_job(config), config
    else:
        key = "hf_config" if model.endswith(".json") else "preset"
        base = job_from_dict({"model": {key: model},
                              "training": {"seq_length": seq, "global_batch_size": global_batch},
                              "cluster": {"num_gpus": 1}}, source=model)
        source = model
    training = dataclasses.replace(
        base.training,
        seq_length=seq or base.training.seq_length,
        global_batch_size=global_batch or base.training.global_batch_size,
    )
    given = {k: v for k, v in cluster.items() if v is not None}
    if "gpu" in given and "gpu_memory_gib" not in given:
        given.update(gpu_memory_gib=None, intra_node_gbps=None, inter_node_gbps=None,
                     cublas_workspace_config=None)
    fresh = dataclasses.replace(base.cluster, num_gpus=None, **given)
    parallel = type(base.parallel)(rank_order=base.parallel.rank_order)
    job = resolve(dataclasses.replace(base, parallel=parallel, training=training, cluster=fresh,
                                      notes=(), source=source))
    return job, num_gpus or base.cluster.num_gpus


def job_of(job, layout: Layout):
    """The base job with `layout`, resolved and checked; ConfigError when Megatron refuses it."""
    par = dataclasses.replace(
        job.parallel, tp=layout.tp, pp=layout.pp, vpp=layout.vpp, cp=layout.cp, ep=layout.ep,
        etp=None, dp=layout.dp, sequence_parallel=layout.sp, layout=None,
        first_stage_layers=None, last_stage_layers=None, overlap_p2p_comm=None,
    )
    tr = dataclasses.replace(
        job.training, micro_batch_size=layout.mbs, recompute=RECOMPUTE[layout.recompute],
        distributed_optimizer=layout.distributed_optimizer,
        overlap_grad_reduce=layout.distributed_optimizer,
        overlap_param_gather=layout.distributed_optimizer,
    )
    cl = dataclasses.replace(job.cluster, num_gpus=layout.tp * layout.pp * layout.cp * layout.dp)
    return resolve(dataclasses.replace(job, parallel=par, training=tr, cluster=cl, notes=()))


# ----------------------------------------------------------------------------- closed forms


@dataclass(frozen=True)
class Shape:
    """Parameters of one layer and of the embedding, from the model's dimensions."""

    dense: int
    """A layer's attention, norms and dense MLP (or router and shared experts)."""
    experts: int
    """A MoE layer's routed experts, all of them."""
    moe_layers: int
    embedding: int
    """The word embedding (the output layer has as many when untied)."""


def shape_of(job) -> Shape:
    m = job.model
    h, d = m.hidden_size, m.kv_channels
    gated = 2 if m.activation in ("swiglu", "geglu") else 1
    if m.multi_latent_attention:
        q = (h * m.q_lora_rank + m.q_lora_rank * m.num_attention_heads *
             (m.qk_head_dim + m.qk_pos_emb_head_dim)) if m.q_lora_rank else (
            h * m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim))
        kv = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * m.num_attention_heads * (
            m.qk_head_dim + m.v_head_dim)
        attention = q + kv + m.num_attention_heads * m.v_head_dim * h
    else:
        attention = h * (m.num_attention_heads + 2 * m.num_query_groups) * d + m.num_attention_heads * d * h
    mlp = (gated + 1) * h * m.ffn_hidden_size
    moe_layers, experts, dense = 0, 0, m.num_layers * (attention + mlp + 2 * h)
    if m.num_experts:
        freq = m.moe_layer_freq if isinstance(m.moe_layer_freq, list) else [1] * m.num_layers
        moe_layers = sum(freq)
        expert = (gated + 1) * h * (m.moe_ffn_hidden_size or m.ffn_hidden_size)
        shared = (gated + 1) * h * (m.moe_shared_expert_intermediate_size or 0)
        dense -= moe_layers * (mlp - h * m.num_experts - shared)
        experts = m.num_experts * expert
    return Shape(dense=dense // m.num_layers, experts=experts, moe_layers=moe_layers,
                 embedding=job.padded_vocab_size * h)


def _in_flight(job) -> int:
    """Micro-batches whose activations the first stage holds at once under the schedule."""
    par = job.parallel
    if par.pp == 1:
        return 1
    if par.vpp:  # interleaved: a warm-up of (pp - 1) * 2 + (vpp - 1) * pp chunk steps
        steps = min(job.num_microbatches * par.vpp, (par.pp - 1) * 2 + (par.vpp - 1) * par.pp + 1)
        return -(-steps // par.vpp)
    return min(par.pp, job.num_microbatches)


def static_bytes(job) -> int:
    """Parameters, gradients and optimizer state of a first-stage rank (biases, position
    embeddings and LayerNorm's second vector left out: a lower bound)."""
    par, tr, s = job.parallel, job.training, shape_of(job)
    stage_layers = job.model.num_layers // par.pp
    dense = stage_layers * s.dense // par.tp + s.embedding // par.tp
    if par.pp == 1:  # the first stage is also the last: final norm, untied output layer
        dense += job.model.hidden_size
        if job.model.untie_embeddings_and_output_weights:
            dense += s.embedding // par.tp
    expert = s.experts * s.moe_layers // par.pp // (par.ep * par.etp)
    grad = 4 if tr.grad_reduce_in_fp32 else 2
    shard = par.dp * par.cp if tr.distributed_optimizer else 1
    edp = par.dp * par.cp * par.tp // (par.ep * par.etp) if tr.distributed_optimizer else 1
    # bf16 parameter, main gradient, fp32 main parameter and Adam's two moments.
    return dense * (2 + grad) + 12 * dense // shard + expert * (2 + grad) + 12 * expert // max(1, edp)


def _layer_input(job) -> int:
    par, tr = job.parallel, job.training
    tokens = tr.seq_length // par.cp * tr.micro_batch_size
    return tokens * job.model.hidden_size * 2 // (par.tp if par.sequence_parallel else 1)


def _fixed_bytes(job) -> int:
    """Static memory and PyTorch's cuBLAS workspace of the thread running the forward (always
    allocated)."""
    from metatrace.trace import cublas_workspace_bytes

    return static_bytes(job) + cublas_workspace_bytes(job)


def memory_lower_bound(job) -> int:
    """What any rank of the first stage holds at least: its fixed memory and every layer's
    input for the micro-batches in flight."""
    layers = job.model.num_layers // job.parallel.pp
    return _fixed_bytes(job) + layers * _layer_input(job) * _in_flight(job)


def memory_estimate(job) -> int:
    """A closed-form estimate (not a bound) to order the layouts: Korthikanti et al.'s 34·sbh/t
    bytes per layer with sequence parallel and fused attention (10 + 24/t without), the layer
    input alone with full recompute."""
    par, tr = job.parallel, job.training
    layers = job.model.num_layers // par.pp
    if tr.recompute.granularity == "full":
        per_layer = _layer_input(job)
    else:
        tokens = tr.seq_length // par.cp * tr.micro_batch_size * job.model.hidden_size
        per_layer = tokens * (34 / par.tp if par.sequence_parallel else 10 + 24 / par.tp)
    return _fixed_bytes(job) + int(layers * per_layer * _in_flight(job))


@dataclass(frozen=True)
class Estimate:
    compute: float
    """Seconds of compute per iteration (FLOPs at the assumed efficiency, recompute included)."""
    bubble: float
    """Idle fraction of the pipeline schedule: (pp - 1) / (vpp · m + pp - 1)."""
    comm: float
    """Exposed communication seconds per iteration (closed form, or traced when known)."""
    seconds: float
    """The iteration: compute / (1 - bubble) + comm, or the traced time model's figure."""


def _flops(job) -> float:
    """FLOPs of one iteration over all GPUs: 6 per parameter and token for the layers'
    matmuls (experts: top-k of them), the causal attention scores, recompute."""
    m, tr, s = job.model, job.training, shape_of(job)
    tokens = tr.global_batch_size * tr.seq_length
    active = m.num_layers * s.dense + s.embedding
    if m.num_experts:
        active += s.moe_layers * s.experts * m.moe_router_topk // m.num_experts
    attention = 2 * 2 * tr.seq_length * m.num_attention_heads * m.kv_channels * m.num_layers / 2
    forward = 2 * active + attention
    extra = {"full": _FULL_RECOMPUTE * forward, "selective": attention}.get(
        tr.recompute.granularity or "none", 0.0)
    return tokens * (3 * forward + extra)


def estimate(job, exposed_comm: float | None = None) -> Estimate:
    """Closed-form iteration time; `exposed_comm` replaces the communication term."""
    par, cl = job.parallel, job.cluster
    compute = _flops(job) / cl.num_gpus / (GPU_PEAK_TFLOPS[cl.gpu] * 1e12 * cl.compute_efficiency)
    m = job.num_microbatches
    bubble = (par.pp - 1) / ((par.vpp or 1) * m + par.pp - 1)
    if exposed_comm is None:
        exposed_comm = _comm_seconds(job)
    return Estimate(compute, bubble, exposed_comm, compute / (1 - bubble) + exposed_comm)


def _comm_seconds(job) -> float:
    """Closed-form communication of a rank per iteration, counted as exposed: tensor parallel
    (10 collectives of the layer's [s, b, h] per layer and micro-batch, 4 more with full
    recompute), the context-parallel ring (which Megatron overlaps with attention, but only as
    far as attention lasts), pipeline boundaries per virtual stage, expert all-to-alls (4 per
    MoE layer); the data-parallel reduction only without overlap."""
    par, tr, m = job.parallel, job.training, job.model
    intra, inter = (x * 1e9 / 8 for x in (job.cluster.intra_node_gbps, job.cluster.inter_node_gbps))
    node = job.cluster.gpus_per_node
    layers = m.num_layers // par.pp
    full = tr.seq_length // par.cp * tr.micro_batch_size * m.hidden_size * 2
    mbs = job.num_microbatches
    out = 0.0
    if par.tp > 1:
        calls = 10 + (4 if tr.recompute.granularity == "full" else 0)
        bw = intra if par.tp <= node else inter
        out += layers * mbs * calls * full * (par.tp - 1) / par.tp / bw
    if par.cp > 1:  # the ring passes K and V forward, K, V and their gradients backward
        kv = full // m.hidden_size * 2 * m.num_query_groups * m.kv_channels
        bw = intra if par.tp * par.cp <= node else inter
        out += layers * mbs * 3 * kv * (par.cp - 1) / par.tp / bw
    if par.pp > 1:  # a send and a receive per boundary and micro-batch, each way
        bw = intra if par.tp * par.cp * par.dp * 2 <= node else inter
        out += 2 * (par.vpp or 1) * mbs * full / (par.tp if par.sequence_parallel else 1) / bw
    if m.num_experts and par.ep > 1:
        moe_layers = shape_of(job).moe_layers // par.pp
        sent = full * m.moe_router_topk * (par.ep - 1) / par.ep / (par.tp if par.sequence_parallel else 1)
        out += 4 * moe_layers * mbs * sent / (intra if par.ep * par.tp <= node else inter)
    if par.dp * par.cp > 1 and not tr.overlap_grad_reduce:
        grads = static_bytes(job) / 18 * 4  # the gradients' share of the static bytes
        out += 2 * grads * (par.dp - 1) / par.dp / (intra if par.tp * par.pp == 1 and par.dp <= node else inter)
    return out


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
    represented: int = 0
    """Variants not traced because a variant of the same degrees estimated faster fits (the
    ranking shows one layout per set of degrees)."""
    untraced: int = 0
    """Candidates left when the search stopped (estimated slower, or over the budget)."""

    def ranked(self) -> list[Traced]:
        return sorted((t for t in self.traced if t.fits), key=lambda t: t.estimate.seconds)


def candidates(job, num_gpus: int) -> tuple[list[Candidate], int, int, int]:
    """(valid candidates after the memory bound, enumerated, invalid, pruned by memory)."""
    capacity = round(job.cluster.gpu_memory_gib * GiB) - round(job.cluster.reserved_overhead_gib * GiB)
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


def plan(job, num_gpus: int, *, trace: Callable, top: int = 3, budget: int = 16,
         progress: Callable | None = None) -> Plan:
    """Search the layouts of `job` (its model, batch and cluster) on `num_gpus` GPUs.
    `trace(job) -> report dict` traces one; `progress(done, total, text)` reports."""
    found, enumerated, invalid, pruned = candidates(job, num_gpus)
    result = Plan(layouts=enumerated, invalid=invalid, pruned_memory=pruned)
    capacity = round(job.cluster.gpu_memory_gib * GiB) - round(job.cluster.reserved_overhead_gib * GiB)
    order = sorted(found, key=lambda c: (c.estimated_memory > capacity, c.estimate.seconds, c.layout))
    fits: dict[Layout, bool] = {}
    families: set = set()
    for i, cand in enumerate(order):
        better = [t for t in _dominated_by(cand.layout) if fits.get(t)]
        if better:
            result.dominated.append((cand, better[0]))
            continue
        if _family(cand.layout) in families:
            result.represented += 1
            continue
        ranked = result.ranked()
        # Closed form against closed form: the traced figures are on another footing.
        slowest = (max(t.candidate.estimate.seconds for t in ranked[:top])
                   if len(ranked) >= top else None)
        if len(result.traced) >= budget or (slowest is not None and cand.estimate.seconds > slowest
                                            and cand.estimated_memory <= capacity):
            result.untraced = len(order) - i
            break
        if progress:
            progress(len(result.traced), budget, cand.layout.describe())
        report = trace(cand.job)
        traced = _traced(cand, report)
        fits[cand.layout] = traced.fits
        if traced.fits:
            families.add(_family(cand.layout))
        result.traced.append(traced)
    return result


def _traced(cand: Candidate, report: dict) -> Traced:
    """The traced figures: the time model's iteration and bubble (metatrace.timing, from the
    traced FLOPs and collectives) when the report has them, else the closed form with the
    traced exposed communication."""
    v = report["memory_verdict"]
    exposed = max(sum(d["exposed_seconds"] for d in r["comm"].values()) for r in report["roles"])
    est = estimate(cand.job, exposed_comm=exposed)
    timing = report.get("timing")
    if timing:
        est = dataclasses.replace(est, bubble=timing["bubble_fraction"],
                                  seconds=timing["iteration_seconds"])
    return Traced(cand, v["highest_peak_bytes"], v["headroom_bytes"], v["fits"], est, report)


def plan_report(result: Plan, top: int) -> dict:
    """The plan as JSON data."""

    def entry(t: Traced) -> dict:
        return {
            "layout": dataclasses.asdict(t.candidate.layout),
            "description": t.candidate.layout.describe(),
            "fits": t.fits,
            "peak_bytes": t.peak,
            "headroom_bytes": t.headroom,
            "memory_lower_bound_bytes": t.candidate.lower_bound,
            "estimated_memory_bytes": t.candidate.estimated_memory,
            "estimate": {"compute_seconds": t.estimate.compute, "bubble_fraction": t.estimate.bubble,
                         "exposed_comm_seconds": t.estimate.comm, "iteration_seconds": t.estimate.seconds},
        }

    return {
        "layouts": result.layouts,
        "invalid": result.invalid,
        "pruned_memory": result.pruned_memory,
        "dominated": len(result.dominated),
        "represented": result.represented,
        "untraced": result.untraced,
        "traced": [entry(t) for t in result.traced],
        "best": [entry(t) for t in result.ranked()[:top]],
    }
