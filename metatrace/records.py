"""Plain, frozen event records: what the instruments hand to the aggregator.

Records hold no tensors and no modules: module references are fully qualified names (FQNs,
relative to the GPTModel of a model chunk, prefixed with `chunk{v}.` when a rank holds several
virtual-pipeline chunks; the GPTModel itself is "" or `chunk{v}`, and STEP is the training step
around the model: batch loading, loss function, pipeline transfers), tensors are described by
shape, dtype and bytes. `seq` orders all events of one trace.

Phases (`Phase`): "forward", "backward", and "recompute" (a forward run again inside backward
by activation checkpointing) inside a micro-batch's steps; "grad sync", "optimizer" and
"deferred" (the deferred embedding weight gradients) are steps of the iteration.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import Any, Literal

Phase = Literal["forward", "backward", "recompute", "grad sync", "optimizer", "deferred"]
"""Where an event happened (see the module docstring)."""

OpKind = Literal[
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "barrier",
]
"""A collective's normalised kind (hooks/collectives.py maps the dispatched operators to it)."""


def _pickled_by_fields(cls):
    """Pickle a record as its class and its field values (a trace sends tens of thousands from
    a worker process): half the time of a slotted dataclass's per-field state."""
    values = operator.attrgetter(*(f.name for f in fields(cls)))

    def __reduce__(self):
        return cls, values(self)

    cls.__reduce__ = __reduce__
    return cls


STEP = "(step)"
"""Module name of work done outside the model (batch, loss function, pipeline transfers)."""


LAYER_TYPES = ("TransformerLayer", "MambaLayer", "MLPLayer")
"""Class names (or their endings) of megatron-core's decoder layers: GPT's TransformerLayer and
MoETransformerLayer, and a hybrid model's MambaLayer and MLPLayer."""


def is_layer_type(name: str) -> bool:
    """Whether a module class `name` is one of megatron-core's decoder layers."""
    return name.endswith(LAYER_TYPES)


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class ParamInfo:
    name: str
    """Parameter name within its module (e.g. "weight")."""
    shape: tuple[int, ...]
    dtype: str
    numel: int
    bytes: int
    tp_sharded: bool = False
    """megatron-core split it over the TP group (attribute `tensor_model_parallel`), or an
    expert's linear over the expert TP group where megatron-core communicates for it and TE,
    given no parallel mode, marks nothing (metatrace's `metatrace_expert_tp_sharded`)."""
    expert: bool = False
    """A routed expert's parameter (under a MoE layer's `experts` module): sharded over the
    expert-parallel group (and the expert tensor-parallel one when tp_sharded)."""
    embedding_copy: bool = False
    """The last pipeline stage's copy of the tied word embedding (megatron-core marks it
    `shared`): the same model parameter as the first stage's, held twice."""


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class ModuleInfo:
    fqn: str
    type: str
    """Class name of the module (e.g. ColumnParallelLinear)."""
    params: tuple[ParamInfo, ...]
    """The module's own parameters (not its children's)."""
    layer: int | None = None
    """Global 1-based transformer layer number when the module is (inside) a decoder layer."""


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Collective:
    seq: int
    op: OpKind
    aten: str
    """The dispatched operator, e.g. c10d._allgather_base_.default."""
    group: str
    """megatron-core's name for the process group (tp, pp, dp, cp, dp_cp, ...), or "unnamed"."""
    ranks: tuple[int, ...]
    """Global ranks of the group's members."""
    shape: tuple[int, ...]
    """Shape of the message tensor (the full tensor: gathered output, scattered input)."""
    dtype: str
    bytes: int
    """Message size in bytes (sum over the tensors of a coalesced call)."""
    count: int
    """Tensors in the call (more than one for coalesced collectives)."""
    phase: Phase
    module: str
    peer: int | None = None
    """Global rank of the other side of a send or recv."""
    output_bytes: int | None = None
    """All-to-all: bytes of the output (what arrives), which differs from the message (what
    leaves) when the split sizes do."""
    overlap: str | None = None
    """What the issuing kernel overlaps it with (e.g. "GEMM (userbuffers)"), None if it
    runs on its own."""
    inter_bytes: int | None = None
    """Bytes of the message that leave the rank's NVLink domain where the kernel forwards
    inside it (DeepEP's internode kernels send a token once per node); None: every peer outside
    the domain gets its share over the network."""
    library: str | None = None
    """The library whose kernels move it with buffers of their own (deepep, hybridep: the flex
    dispatcher's), not through an NCCL communicator; None: NCCL."""


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Saved:
    seq: int
    storage: int
    """Id of the storage (views share it); numbered in order of first sight within a trace."""
    bytes: int
    """Storage size rounded up as the CUDA caching allocator does (512 B blocks)."""
    shape: tuple[int, ...]
    dtype: str
    module: str
    phase: Phase
    static: bool
    """The storage existed before this micro-batch (parameters, buffers): not an activation."""


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class MemEvent:
    seq: int
    delta: int
    """Bytes allocated (positive) or freed (negative), rounded to 512-byte blocks."""
    live: int
    """Bytes live on the device after the event (including static storages)."""
    module: str
    phase: Phase
    storage: int = -1
    """Id of the storage allocated or freed (as in Saved.storage)."""


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Window:
    """A stretch of one trace that the schedule driver marked: one model chunk's forward or
    backward step for one micro-batch, or a step of the iteration (e.g. the optimizer)."""

    phase: Phase
    """forward or backward (a model chunk's step), or a step of the iteration."""
    chunk: int | None
    """Model chunk (virtual stage) index on this rank; None outside the model."""
    microbatch: int | None
    first: int
    """seq of the first event inside the window."""
    last: int
    """seq of the last event inside the window (first - 1 when nothing happened)."""
    output: int | None = None
    """Storage id of the tensor the step handed on (a forward step's output), if any."""
    held: int | None = None
    """Storage id of the tensor that stands for the activations a replayed forward step keeps."""
    flops: int = 0
    """Floating-point operations inside the window (hooks/flops.py: matrix products and
    attention; a backward step includes its recompute). A replayed step computes nothing: read
    the traced micro-batch's windows."""
    fp8_flops: int = 0
    """Of `flops`, those of FP8 GEMMs (not those of FP4 GEMMs, which hooks/flops.py's FlopCount
    keeps apart in `fp4`)."""
    kernel_ps: int = 0
    """Picoseconds the window's kernels take on the job's GPU (metatrace.config.kernels: GEMMs
    and attention by shape, memory-bound operators by bytes moved), 0 without its rates."""
    attention_ps: int = 0
    """Of `kernel_ps`, the fused attention kernels' (what the context-parallel ring runs
    beside)."""
    kernels: int = 0
    """Kernels the window launches on a GPU (metatrace.config.host: dispatched operators but
    views and metadata, the kernels stand-ins report; those a CUDA graph replays count, and
    launch nothing)."""
    host_ps: int = 0
    """Picoseconds of host work issuing them: PyTorch's per operator, megatron-core's Python per
    module, the launches (config.host.HOST_SECONDS)."""
    syncs: int = 0
    """Synchronisations: where the host waits for the GPU (a value read back on the host, an
    operator whose output size depends on the data)."""
    host: tuple = ()
    """The window's host work, kernels and synchronisations as max-plus matrices (a, b, c, d)
    in picoseconds, one after another (config.host): what the time model applies to the
    host's and the GPU's clocks."""


@dataclass(frozen=True)
class Trace:
    """Everything recorded for one rank: its modules, and one micro-batch's events."""

    rank: int
    modules: tuple[ModuleInfo, ...]
    collectives: tuple[Collective, ...]
    saved: tuple[Saved, ...]
    memory: tuple[MemEvent, ...]
    static_bytes: int
    """Bytes live before the micro-batch (parameters and buffers, 512-byte rounded)."""
    op_counts: dict[str, int] = field(default_factory=dict)
    """Every dispatched operator and how often it ran."""
    unclassified: dict[str, int] = field(default_factory=dict)
    """Operators that no table knows (neither aten compute nor a known collective)."""
    windows: tuple[Window, ...] = ()
    """The stretches the schedule driver marked, in order."""
    static_parts: dict[str, int] = field(default_factory=dict)
    """static_bytes by part: "params" (parameters and module buffers), and the parts the
    tracer names (e.g. "grads", "optimizer")."""
    collective_flops: dict[int, int] = field(default_factory=dict)
    """{seq of a collective issued inside a Window: the window's FLOPs before it} (where the
    collective sits in the step's compute)."""
    static_sizes: tuple[int, ...] = ()
    """Bytes of each static storage (512-byte rounded) in the order the recorder first saw
    them: the parameters and buffers module by module, then the parts of static_parts; what
    the allocator simulation (analysis.device) allocates before the first micro-batch."""
    workspaces: tuple[int, ...] = ()
    """Storage ids of PyTorch's cuBLAS workspaces (hooks.remap.cublas_workspaces), made at the
    micro-batch's first GEMMs and kept for the process's life: what a CPU run does not
    allocate (tracing.measure compares without them)."""

    def columns(self, kind: str, names: tuple[str, ...]) -> dict[str, Any]:
        """Fields `names` of the records of `kind` ("memory", "windows", ...) as numpy arrays,
        one entry per record: int64 where every value is an int, else objects. What the
        analysis of a long iteration reads (a Trace of a steady state builds them without
        building its records: metatrace.tracing.steady)."""
        records = getattr(self, kind)
        return {name: column([getattr(r, name) for r in records]) for name in names}

    def tally(self, kind: str, ignore: frozenset[str] = frozenset({"seq"})) -> list:
        """[(record, how many)] that add up to the records of `kind`, for readers that count
        them and read nothing in `ignore` (a Trace of a steady state gives a repeated record
        once, with its repetitions)."""
        return [(r, 1) for r in getattr(self, kind)]

    def pick(self, kind: str, indices) -> list:
        """The records of `kind` at these positions."""
        records = getattr(self, kind)
        return [records[i] for i in indices]


def column(values: list) -> Any:
    """`values` as a numpy array: int64 when they are all ints, else objects."""
    import numpy as np

    if all(type(v) is int for v in values):
        return np.array(values, dtype=np.int64)
    return np.fromiter(values, dtype=object, count=len(values))


# --------------------------------------------------------------------------- offloading


@dataclass(frozen=True)
class Moved:
    """One saved tensor the offload manager copied to host memory (and back in backward)."""

    chunk: int
    """The model chunk whose forward saved it (the handler's place among the trace's)."""
    group: int
    """Index of its offload group in the chunk's forward (one group per module and layer)."""
    name: str
    """The offload module: attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, ..."""
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    """Exact bytes copied each way."""
    source: int | None
    """Recorder storage id of the GPU storage it came from (None without a recorder)."""
    reload: int | None = None
    """Recorder storage id of the GPU copy its reload allocated (None without a recorder, or
    before the reload)."""


@dataclass(frozen=True)
class OffloadRecord:
    """What megatron-core's offload manager did in one traced micro-batch (its warm-up mode:
    every group offloaded, every reload on demand in backward)."""

    moved: tuple[Moved, ...]
    groups: tuple[tuple[str, ...], ...]
    """Per chunk, the names of its offload groups in forward order (those that moved nothing
    included: megatron-core's steady-state rules count them)."""
    reloads: frozenset[int]
    """Recorder storage ids of the GPU copies reloads allocated."""


# --------------------------------------------------------------------------- traces


@dataclass(frozen=True)
class RoleTrace:
    """What tracing one role (a pipeline stage) produced."""

    role: Any
    """The metatrace.world.Role traced."""
    trace: Trace
    """One micro-batch."""
    chunks: tuple[str, ...]
    """FQN prefix of each model chunk ("" for one chunk, "chunk{v}" with virtual stages)."""
    seconds: float
    """Wall time to build and trace the role."""
    iteration: Trace | None = None
    """A whole iteration, steps replayed from `trace`, optimizer step included."""
    offload: OffloadRecord | None = None
    """What fine-grained activation offloading moved in the traced micro-batch (None when the
    job does not offload); memory.role_offload sums it up."""
    host_optimizer: Any = None
    """What the optimizer CPU offload keeps on the host and moves per step
    (metatrace.hooks.optimizer_offload.HostOptimizer; None without it)."""


@dataclass(frozen=True)
class JobTrace:
    """What tracing a job produced: every role's traces, the unparallelised model's."""

    job: Any
    """The metatrace.config.Job traced."""
    world: Any
    """Its metatrace.world.World."""
    roles: tuple[RoleTrace, ...]
    full: RoleTrace | None
    """The whole model on a single GPU (no parallelism), for the "full model" view."""
    seconds: dict = field(default_factory=dict)
    megatron_core: str | None = None
    """The megatron-core release traced ("0.19.2"); None where no trace ran (estimates)."""
