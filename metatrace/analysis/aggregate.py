"""Pure aggregation: records of a trace in, per-module and per-role tables out.

Nothing here touches torch or Megatron. Conventions:
- Activation bytes of a micro-batch are the storages autograd saved during the forward phase that
  did not exist before the micro-batch (parameters and buffers are not activations). A storage
  saved by several modules (views, the same input saved twice) counts once, for the first module
  that saved it.
- Sizes are bytes of 512-byte blocks, as the CUDA caching allocator hands them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metatrace.analysis.memory import lifetimes
from metatrace.records import STEP, Collective, ModuleInfo, Trace, is_layer_type

PHASES = ("forward", "backward", "recompute")


def parent_of(fqn: str) -> str | None:
    """FQN of the parent module; None for a chunk root ("" or "chunk{v}")."""
    if fqn == "" or ("." not in fqn and fqn.startswith("chunk")):
        return None
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def is_within(fqn: str, ancestor: str) -> bool:
    """`fqn` is `ancestor` or one of its descendants (the model root "" holds every module of a
    single-chunk trace, but not the training step)."""
    if fqn == ancestor:
        return True
    if fqn == STEP:
        return False
    return ancestor == "" or fqn.startswith(ancestor + ".")


def activation_owners(trace: Trace) -> dict[int, tuple[str, int]]:
    """{storage: (module that saved it first in forward, bytes)} for the micro-batch's activations.

    A storage saved in forward but freed before the first backward step is not held for
    backward: e.g. the dropout masks of megatron-core's bias-dropout-add, which runs with grad
    enabled inside a checkpointed (no-grad) layer; the small graph it builds is dropped when
    the checkpoint returns, and its masks with it."""
    freed = lifetimes(trace.memory).freed
    backward = min((w.first for w in trace.windows if w.phase == "backward"), default=None)
    owners: dict[int, tuple[str, int]] = {}
    for s in trace.saved:
        if s.phase != "forward" or s.static or s.storage in owners:
            continue
        if backward is not None and freed.get(s.storage, backward) < backward:
            continue
        owners[s.storage] = (s.module, s.bytes)
    return owners


def activation_bytes(trace: Trace) -> int:
    return sum(b for _, b in activation_owners(trace).values())


@dataclass(frozen=True)
class Peak:
    bytes: int
    phase: str
    module: str
    seq: int


def peak(trace: Trace) -> Peak:
    """Highest live bytes during the micro-batch (static storages included) and where."""
    best = Peak(trace.static_bytes, "forward", STEP, 0)
    for e in trace.memory:
        if e.live > best.bytes:
            best = Peak(e.live, e.phase, e.module, e.seq)
    return best


def module_peaks(trace: Trace) -> dict[str, dict[str, int]]:
    """{module: {phase: highest live bytes while it or a descendant was running}}."""
    out: dict[str, dict[str, int]] = {}
    for e in trace.memory:
        fqn: str | None = e.module
        while fqn is not None:
            phases = out.setdefault(fqn, {})
            if e.live > phases.get(e.phase, -1):
                phases[e.phase] = e.live
            fqn = parent_of(fqn) if fqn != STEP else None
    return out


@dataclass
class ModuleRow:
    fqn: str
    type: str
    layer: int | None
    params: int
    """Parameters of the module itself (not its children)."""
    param_bytes: int
    param_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    activation_bytes: int
    """Saved for backward by the module itself, per micro-batch."""
    collectives: tuple[Collective, ...]
    """Issued while the module itself (not a child) was running."""
    peaks: dict[str, int] = field(default_factory=dict)
    params_total: int = 0
    param_bytes_total: int = 0
    activation_bytes_total: int = 0
    children: list[ModuleRow] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.fqn.rsplit(".", 1)[-1] if self.fqn else ""


def module_tree(trace: Trace, chunks: tuple[str, ...] = ("",)) -> list[ModuleRow]:
    """One tree per model chunk (roots in chunk order), every row with its own and total
    parameters, activations and collectives."""
    owners = activation_owners(trace)
    act: dict[str, int] = {}
    for module, nbytes in owners.values():
        act[module] = act.get(module, 0) + nbytes
    coll: dict[str, list[Collective]] = {}
    for c in trace.collectives:
        coll.setdefault(c.module, []).append(c)
    peaks = module_peaks(trace)
    rows: dict[str, ModuleRow] = {}
    for info in trace.modules:
        rows[info.fqn] = _row(info, act.get(info.fqn, 0), coll.get(info.fqn, ()), peaks)
    roots = []
    for fqn, row in rows.items():
        parent = parent_of(fqn)
        if parent is None:
            roots.append(row)
        else:
            rows[parent].children.append(row)
    for root in roots:
        _totals(root)
    order = {c: i for i, c in enumerate(chunks)}
    return sorted(roots, key=lambda r: order.get(r.fqn, len(order)))


def _row(info: ModuleInfo, act: int, coll, peaks) -> ModuleRow:
    return ModuleRow(
        fqn=info.fqn,
        type=info.type,
        layer=info.layer,
        params=sum(p.numel for p in info.params),
        param_bytes=sum(p.bytes for p in info.params),
        param_shapes=tuple((p.name, p.shape) for p in info.params),
        activation_bytes=act,
        collectives=tuple(coll),
        peaks=dict(peaks.get(info.fqn, {})),
    )


def _totals(row: ModuleRow) -> None:
    row.params_total = row.params
    row.param_bytes_total = row.param_bytes
    row.activation_bytes_total = row.activation_bytes
    for child in row.children:
        _totals(child)
        row.params_total += child.params_total
        row.param_bytes_total += child.param_bytes_total
        row.activation_bytes_total += child.activation_bytes_total


def walk(rows):
    for row in rows:
        yield row
        yield from walk(row.children)


# ----------------------------------------------------------------------------- folding


def signature(row: ModuleRow):
    """What makes two subtrees the same for display: structure, shapes, bytes, collectives."""
    return (
        row.type,
        row.param_shapes,
        row.activation_bytes,
        tuple((c.op, c.group, c.shape, c.dtype, c.phase, c.count) for c in row.collectives),
        tuple((_local_name(c), signature(c)) for c in row.children),
    )


def _local_name(row: ModuleRow) -> str:
    return "#" if row.name.isdigit() else row.name


@dataclass
class Fold:
    """A run of consecutive identical siblings shown once: `row` stands for `count` of them."""

    row: ModuleRow
    count: int
    first: str
    last: str
    layers: tuple[int, int] | None


def fold_children(row: ModuleRow) -> list[Fold]:
    """Children of `row`, consecutive identical numbered siblings (e.g. layers) folded."""
    out: list[Fold] = []
    for child in row.children:
        prev = out[-1] if out else None
        if (
            prev is not None
            and child.name.isdigit()
            and prev.row.name.isdigit()
            and signature(prev.row) == signature(child)
        ):
            prev.count += 1
            prev.last = child.name
            if prev.layers and child.layer is not None:
                prev.layers = (prev.layers[0], child.layer)
            continue
        layers = (child.layer, child.layer) if child.layer is not None else None
        out.append(Fold(child, 1, child.name, child.name, layers))
    return out


# ----------------------------------------------------------------------------- roles


@dataclass(frozen=True)
class RoleSummary:
    params: int
    param_bytes: int
    activation_bytes: int
    static_bytes: int
    peak: Peak
    layers: tuple[int, ...]
    """Global layer numbers this role holds, in chunk order."""
    collectives: int


def role_summary(trace: Trace) -> RoleSummary:
    layers = []
    for info in trace.modules:
        if info.layer is not None and is_layer_type(info.type):
            layers.append(info.layer)
    return RoleSummary(
        params=sum(p.numel for m in trace.modules for p in m.params),
        param_bytes=sum(p.bytes for m in trace.modules for p in m.params),
        activation_bytes=activation_bytes(trace),
        static_bytes=trace.static_bytes,
        peak=peak(trace),
        layers=tuple(layers),
        collectives=len(trace.collectives),
    )


def model_params(
    traces, tp: int, ep: int = 1, etp: int | None = None, expert_share: float = 1.0
) -> int:
    """Distinct parameters of the whole model from one trace per pipeline stage: TP-sharded
    parameters count tp times, replicated ones once, the last stage's copy of a tied embedding
    not at all; routed experts' ep times (the other ranks' experts), and etp times instead of
    tp when sharded. `expert_share` counts that fraction of the routed experts (topk / experts
    gives the parameters active per token)."""
    etp = tp if etp is None else etp
    total = 0
    for trace in traces:
        for m in trace.modules:
            for p in m.params:
                if p.embedding_copy:
                    continue
                if p.expert:
                    total += round(p.numel * ep * (etp if p.tp_sharded else 1) * expert_share)
                else:
                    total += p.numel * (tp if p.tp_sharded else 1)
    return total


def role_signature(trace: Trace, rows=None):
    """Equal for roles that hold the same structure and do the same work (layer numbers and
    group members aside), so they can be shown once. `rows`: the trace's module_tree, if at
    hand."""
    rows = module_tree(trace) if rows is None else rows
    return (
        tuple(signature(r) for r in rows),
        tuple((c.op, c.group, c.shape, c.dtype, c.phase, c.module) for c in trace.collectives),
        trace.static_bytes,
        peak(trace).bytes,
    )
