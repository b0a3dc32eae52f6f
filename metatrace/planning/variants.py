"""The single changes to a job that could make it fit, smallest first, and closed-form
estimates of their peak and step time anchored on a traced job (metatrace.planning.advice
traces the few most promising).

Each kind of change is a ladder of steps, the smallest change first: a smaller micro-batch
(the sizes that divide the batch per replica, largest first), recompute (selective modules
added one at a time, then full recompute of the first 1, 2, ... layers of every chunk, method
block), activation offloading (Transformer Engine's layer-wise offloading of more layers at
pp 1 without recompute, else megatron-core's fine-grained offloading of more modules), the
distributed optimizer, then Megatron-FSDP sharding everything, a larger tensor- or
pipeline-parallel size on the same GPUs (data parallel smaller by as much). Every step is
resolved and checked as a job file is (Megatron's own rules included); refused steps are
left out.

The estimate of a step scales the anchor's (a traced job's) binding rank's memory by part
(metatrace.analysis.memory.RoleMemory): parameters, gradients and optimizer state by how many
ranks share them, the activations held at the peak by the closed form of what one layer keeps
(Korthikanti et al.'s 34·sbh/t with sequence parallel, 10 + 24/t without; full recompute
keeps its input, 2·sbh/t; one checkpointed layer's activations come back in backward), the
layers of a stage, the micro-batches in flight (metatrace.planning.estimates) and, for
selective recompute and fine-grained offloading, the share of a layer's saved activations the
traced modules hold (less the input a recomputed module keeps). The caching allocator's
reserve grows with the peak at the anchor's reserve per allocated byte. The step time is the
anchor's traced one scaled by the closed-form iteration time
(metatrace.planning.estimates.estimate).

Known limitations: the binding rank is assumed to stay the binding one and the memory outside
the allocator (NCCL's buffers) the same; the temporaries of offloading's reloads and of the
recomputed modules are estimated only as far as said above.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from metatrace.config import Recompute, resolve
from metatrace.config.job import replace
from metatrace.errors import ConfigError
from metatrace.planning.estimates import _in_flight, estimate
from metatrace.tracing.checks import check_with_megatron

# Module names in the traced tree of what a selective-recompute module or a fine-grained
# offloading module covers (megatron-core 0.16.1's TransformerLayer, MLP and MoELayer).
RECOMPUTE_ROWS = {
    "core_attn": ("core_attention",),
    "mlp": ("mlp",),
    "layernorm": ("input_layernorm", "pre_mlp_layernorm"),
    "moe_act": ("experts",),
    "shared_experts": ("shared_experts",),
}
OFFLOAD_ROWS = {
    "qkv_linear": ("linear_qkv",),
    "core_attn": ("core_attention",),
    "attn_proj": ("linear_proj",),
    "expert_fc1": ("linear_fc1",),
    "moe_act": ("experts",),
}
DENSE_SELECTIVE = ("core_attn", "mlp", "layernorm")
MOE_SELECTIVE = ("core_attn", "moe_act", "shared_experts", "layernorm")
OFFLOAD_ORDER = ("core_attn", "qkv_linear", "attn_proj", "expert_fc1", "moe_act")


@dataclass(frozen=True)
class Step:
    """One change: the job-file keys it sets (dotted paths, values as a job file writes them)
    and the job with it, resolved and checked."""

    kind: str
    keys: tuple[tuple[str, Any], ...]
    job: Any
    shares: tuple[str, ...] = ()
    """Modules newly recomputed or offloaded (their share of the saved activations goes)."""
    numeric: bool = False
    """One number of the job grows from step to step (micro-batch size, layers recomputed or
    offloaded, tp, pp): a traced step's error in the change it made carries to the next."""


def _apply(job, keys: dict, reset: dict | None = None):
    """`job` with the dotted `keys` (and `reset`, fields re-derived), resolved and checked;
    ConfigError when Megatron refuses it."""
    sections: dict[str, dict] = {}
    for path, value in {**keys, **(reset or {})}.items():
        section, name = path.split(".", 1)
        if name == "recompute":
            value = Recompute(**value) if value else Recompute()
        sections.setdefault(section, {})[name] = value
    changed = {s: replace(getattr(job, s), **v) for s, v in sections.items()}
    candidate = resolve(replace(job, **changed, notes=()))
    check_with_megatron(candidate)
    return dataclasses.replace(candidate, notes=job.notes, not_modelled=job.not_modelled)


def _step(
    kind: str, job, keys: dict, reset: dict | None = None, shares=(), numeric: bool = False
) -> Step | None:
    try:
        return Step(kind, tuple(keys.items()), _apply(job, keys, reset), tuple(shares), numeric)
    except ConfigError:
        return None


def micro_batch_steps(job) -> list[Step]:
    from metatrace.planning.search import candidates

    try:
        sizes = candidates(job)
    except ConfigError:
        return []
    mbs = job.training.micro_batch_size
    return [
        Step(
            "micro-batch",
            (("training.micro_batch_size", m),),
            dataclasses.replace(j, notes=job.notes),
            numeric=True,
        )
        for m, j in reversed(sizes)
        if m < mbs
    ]


def recompute_steps(job) -> list[Step]:
    """Selective modules added one at a time, then full recompute (block) of 1, 2, ... layers
    of every chunk."""
    rec = job.training.recompute
    out: list[Step | None] = []
    if rec.granularity in (None, "selective"):
        given = list(rec.modules or []) if rec.granularity else []
        names = MOE_SELECTIVE if job.model.num_experts else DENSE_SELECTIVE
        added: list[str] = []
        for name in (n for n in names if n not in given):
            added.append(name)
            keys = {"training.recompute": {"granularity": "selective", "modules": given + added}}
            out.append(_step("recompute", job, keys, shares=added))
    chunk = job.model.num_layers // job.parallel.pp // (job.parallel.vpp or 1)
    start = rec.num_layers if rec.granularity == "full" and rec.method == "block" else 0
    if rec.granularity != "full" or rec.method == "block":
        for n in range((start or 0) + 1, chunk + 1):
            keys = {
                "training.recompute": {"granularity": "full", "method": "block", "num_layers": n}
            }
            out.append(_step("recompute", job, keys, numeric=True))
    return [s for s in out if s is not None]


def offload_steps(job) -> list[Step]:
    """Transformer Engine's layer-wise offloading of more layers where it applies (pp 1, no
    recompute, no fine-grained offloading), else fine-grained offloading of more modules."""
    tr = job.training
    out: list[Step | None] = []
    if (
        job.parallel.pp == 1
        and tr.recompute.granularity is None
        and not tr.activation_offload_modules
    ):
        for n in range(tr.cpu_offloading_num_layers + 1, job.model.num_layers):
            keys = {"training.cpu_offloading_num_layers": n}
            out.append(_step("offloading", job, keys, numeric=True))
    if not tr.cpu_offloading_num_layers:
        given = list(tr.activation_offload_modules or [])
        added = []
        for name in (n for n in OFFLOAD_ORDER if n not in given):
            added.append(name)
            keys = {"training.activation_offload_modules": given + added}
            out.append(_step("offloading", job, keys, shares=added))
    return [s for s in out if s is not None]


def sharding_steps(job) -> list[Step]:
    """The distributed optimizer, then Megatron-FSDP sharding parameters, gradients and
    optimizer state (ZeRO-3)."""
    tr, par = job.training, job.parallel
    if par.dp * par.cp == 1:
        return []
    out: list[Step | None] = []
    if not tr.distributed_optimizer and not tr.megatron_fsdp:
        out.append(_step("sharding", job, {"training.distributed_optimizer": True}))
    if not (tr.megatron_fsdp and tr.fsdp_sharding_strategy == "optim_grads_params"):
        keys = {
            "training.megatron_fsdp": True,
            "training.fsdp_sharding_strategy": "optim_grads_params",
        }
        if not tr.distributed_optimizer:  # Megatron-LM asks for it with Megatron-FSDP
            keys["training.distributed_optimizer"] = True
        out.append(_step("sharding", job, keys))
    return [s for s in out if s is not None]


def parallel_steps(job) -> list[Step]:
    """tp, then pp, 2, 4, ... times larger on the same GPUs (dp as many times smaller)."""
    par, m = job.parallel, job.model
    out: list[Step | None] = []
    k = 2
    while par.dp % k == 0 and par.tp * k <= job.cluster.gpus_per_node:
        keys: dict[str, Any] = {"parallel.tp": par.tp * k, "parallel.dp": par.dp // k}
        if not par.sequence_parallel:
            keys["parallel.sequence_parallel"] = True
        # etp follows tp where it was tp's (as Megatron-LM derives it); one given stays
        reset = {"parallel.etp": None} if par.etp in (None, par.tp) else None
        out.append(_step("tensor parallel", job, keys, reset=reset, numeric=True))
        k *= 2
    k = 2
    fixed = par.layout or par.first_stage_layers or par.last_stage_layers
    while not fixed and par.dp % k == 0 and m.num_layers % (par.pp * k) == 0:
        keys = {"parallel.pp": par.pp * k, "parallel.dp": par.dp // k}
        if par.vpp and (m.num_layers // (par.pp * k)) % par.vpp:
            keys["parallel.vpp"] = None
        out.append(_step("pipeline parallel", job, keys, numeric=True))
        k *= 2
    return [s for s in out if s is not None]


def ladders(job) -> list[list[Step]]:
    """Every kind of change, its steps smallest first (kinds with no valid step left out)."""
    found = [
        micro_batch_steps(job),
        recompute_steps(job),
        offload_steps(job),
        sharding_steps(job),
        parallel_steps(job),
    ]
    return [steps for steps in found if steps]


# ----------------------------------------------------------------------------- estimates


def _sharers(job) -> tuple[int, int, int]:
    """Ranks that share one copy of the parameters, the gradients and the optimizer state."""
    par, tr = job.parallel, job.training
    grid = par.tp * par.pp
    shards = par.dp * par.cp // tr.num_distributed_optimizer_instances
    strategy = tr.fsdp_sharding_strategy if tr.megatron_fsdp else "no_shard"
    params = grid * (shards if strategy == "optim_grads_params" else 1)
    grads = grid * (shards if strategy in ("optim_grads", "optim_grads_params") else 1)
    optimizer = grid * (shards if tr.distributed_optimizer or tr.megatron_fsdp else 1)
    return params, grads, optimizer


def _per_layer(job) -> tuple[float, float]:
    """(what a layer keeps for backward, its input) per token and unit of hidden size, in
    bytes: Korthikanti et al.'s 34/t with sequence parallel (10 + 24/t without), 2/t (2)."""
    par = job.parallel
    if par.sequence_parallel:
        return 34 / par.tp, 2 / par.tp
    return 10 + 24 / par.tp, 2.0


def _held(job) -> float:
    """The activations a first-stage rank holds at its peak, in token x hidden units: a
    layer's by the stage's layers, the micro-batches in flight and the share of the layers not
    recomputed (full recompute keeps each layer's input) nor offloaded layer-wise."""
    par, tr = job.parallel, job.training
    layer, kept_input = _per_layer(job)
    layers = job.model.num_layers / par.pp
    chunk = layers / (par.vpp or 1)
    kept = 1.0
    rec = tr.recompute
    if rec.granularity == "full":
        share = min(rec.num_layers or chunk, chunk) / chunk if rec.method == "block" else 1.0
        kept -= share * (1 - kept_input / layer)
    if tr.cpu_offloading_num_layers:
        kept -= tr.cpu_offloading_num_layers / job.model.num_layers
    tokens = tr.micro_batch_size * tr.seq_length / par.cp
    return tokens * layer * layers * _in_flight(job) * max(kept, 0.0)


def _input_bytes(job, name: str) -> int:
    """Bytes per micro-batch and layer that a recomputed module keeps: its input (q, k and v
    for core attention; the hidden states for an MLP); what recompute saves is the rest."""
    m, par, tr = job.model, job.parallel, job.training
    tokens = tr.micro_batch_size * tr.seq_length // par.cp
    if name == "core_attn":
        return (
            tokens * (m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels * 2 // par.tp
        )
    if name in ("mlp", "shared_experts"):
        return tokens * m.hidden_size * 2 // (par.tp if par.sequence_parallel else 1)
    return 0


def module_saving(job, tree, names, *, recompute: bool) -> tuple[float, int]:
    """(the share of the layers' saved activations that recomputing, or offloading, the
    modules of `names` frees; the bytes one layer's recompute brings back for a moment), from
    the traced rank's module `tree` (one micro-batch): what the modules save themselves and
    below them (the experts: themselves, their activation), less the input a recomputed module
    keeps."""
    rows = {**RECOMPUTE_ROWS, **OFFLOAD_ROWS}
    owner = {row: name for name in names for row in rows[name]}
    totals = {"layers": 0, "saved": 0, "kept": 0, "count": 0}

    def walk(row, in_layer: bool) -> None:
        is_layer = not in_layer and row.layer is not None and row.name.isdigit()
        if is_layer:
            totals["layers"] += row.activation_bytes_total
            totals["count"] += 1
        elif in_layer and row.name in owner:
            saved = row.activation_bytes if row.name == "experts" else row.activation_bytes_total
            kept = min(saved, _input_bytes(job, owner[row.name])) if recompute else 0
            totals["saved"] += saved
            totals["kept"] += kept
            return
        for child in row.children:
            walk(child, in_layer or is_layer)

    for root in tree:
        walk(root, False)
    if not totals["layers"]:
        return 0.0, 0
    share = (totals["saved"] - totals["kept"]) / totals["layers"]
    again = totals["saved"] // max(1, totals["count"]) if recompute else 0
    return min(1.0, share), again


@dataclass(frozen=True)
class Anchor:
    """A traced job the estimates scale from: the binding rank's memory and module tree, its
    allocated peak and headroom, how much its caching allocator reserves per byte allocated at
    the peak (fragmentation, taken to grow with the peak), the modules of a ladder it already
    recomputes or offloads, and how far the closed form's change of headroom fell short of the
    traced one on the way to it (`scale`, for steps of one number; None where no step of the
    ladder has been traced yet)."""

    job: Any
    memory: Any
    tree: Any
    peak: int
    room: int
    """Its headroom."""
    reserve_ratio: float
    seconds: float | None
    """Its traced step time (None: the GPU's peak FLOP/s is unknown)."""
    shares: tuple[str, ...] = ()
    scale: float | None = None

    def headroom(self, peak: int, step: Step | None = None) -> int:
        """The binding rank's estimated headroom at an allocated `peak` (of `step`)."""
        scale = self.scale if self.scale is not None and step is not None and step.numeric else 1
        return self.room + round(scale * self.reserve_ratio * (self.peak - peak))

    def margin(self, step: Step) -> int:
        """What the estimate may miss by: until a step of the ladder's one number has been
        traced, what the allocator reserves beyond the allocated peak (its fragmentation, which
        a change of the peak can rearrange); after it, the scale has taken it in."""
        if step.numeric and self.scale is not None:
            return 0
        return round(self.peak * (self.reserve_ratio - 1))


def estimated_peak(anchor: Anchor, step: Step) -> int:
    """The binding rank's allocated peak with `step`, scaled from `anchor` (see the module
    docstring)."""
    base, memory, job = anchor.job, anchor.memory, step.job
    (p0, g0, o0), (p1, g1, o1) = _sharers(base), _sharers(job)
    held0, held1 = _held(base), _held(job)
    names = [n for n in step.shares if n not in anchor.shares]
    share, again = (
        module_saving(base, anchor.tree, names, recompute=step.kind == "recompute")
        if names
        else (0.0, 0)
    )
    activations = memory.activations * (held1 / held0 if held0 else 1.0) * (1 - share)
    tokens = [
        j.training.micro_batch_size * j.training.seq_length / j.parallel.cp / j.parallel.tp
        for j in (base, job)
    ]
    out = (
        memory.workspaces
        + memory.params * p0 / p1
        + memory.grads * g0 / g1
        + memory.optimizer * o0 / o1
        + activations
        + memory.temporary * tokens[1] / tokens[0]
        + again * tokens[1] / tokens[0]
    )
    if (
        job.training.recompute.granularity == "full"
        and base.training.recompute.granularity != "full"
    ):
        # backward runs one checkpointed layer's forward again: its activations, for a moment
        layer, _ = _per_layer(job)
        out += (memory.activations / held0 if held0 else 0.0) * tokens[1] * job.parallel.tp * layer
    grid0 = base.parallel.tp * base.parallel.pp
    grid1 = job.parallel.tp * job.parallel.pp
    if p1 // grid1 > p0 // grid0:
        # Megatron-FSDP gathers a layer's parameters while the one before runs: two layers'
        out += 2 * memory.params * p0 / grid1 / (job.model.num_layers / job.parallel.pp)
    return round(out)


def _closed_seconds(job) -> float:
    """The closed-form iteration time; full recompute of the first N layers of each chunk
    (block) costs N / chunk of what every layer's would."""
    rec = job.training.recompute
    full = estimate(job).seconds
    if rec.granularity != "full" or rec.method != "block":
        return full
    none = estimate(replace(job, training=replace(job.training, recompute=Recompute()))).seconds
    chunk = job.model.num_layers / job.parallel.pp / (job.parallel.vpp or 1)
    return none + min(rec.num_layers, chunk) / chunk * (full - none)


def estimated_seconds(anchor: Anchor, step: Step) -> float | None:
    """The anchor's traced step time scaled by the closed forms' ratio."""
    if anchor.seconds is None:
        return None
    try:
        return anchor.seconds * _closed_seconds(step.job) / _closed_seconds(anchor.job)
    except (KeyError, ZeroDivisionError):
        return anchor.seconds
