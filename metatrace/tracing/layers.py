"""Decoder layers that do the same work: a few traced, the others' records built from them.

A run of identical decoder layers (same modules and shapes, same kind: `stages._kind`) does the
same work layer after layer: each middle layer's forward and backward record what the one
before recorded, one layer on. The traced micro-batch runs the first `KEEP` layers of such a run
and its last layer (`truncated`: the block's layer list is cut for the micro-batch only; the
model keeps every layer's parameters, gradient buffers and optimizer state), marks where each
layer's forward and backward begin, and `expand` inserts the skipped layers' records: copies of
the last kept layer's forward and backward, with sequence numbers, storage ids, live bytes,
FLOPs and operator counts moved on and module names renamed, exactly as tracing them gives.

References between layers are relative: a record of layer i names storages of layers i-1, i
and i+1 (activations, gradients, parameters) by their place among what that layer's forward or
backward first saw, and modules by their place in the layer. In that form the forwards of the
last two kept layers must record the same thing, and so must the backwards of the two before
the last kept one (whose backward follows the run's last layer's, which may differ: it becomes
the backward of the layer before the run's last). `expand` checks it and returns None when they
do not: the micro-batch is then traced whole. Jobs with features that keep state per layer or
treat layers by position are traced whole (`eligible`). Where the layers share a cache that
fills up (MLA's rotary embeddings), metatrace.tracing.caches puts back the evictions of the
skipped layers; buffers a layer's forward replaces (the router's float32 expert bias) are
replaced in the skipped layers too (`mirror`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from typing import Any

from metatrace.config.host import product

KEEP = 5
"""Leading layers of a run that are traced (the last two are compared)."""


@dataclasses.dataclass(frozen=True)
class Run:
    """Layers first..last (local indices in the block `block`, an FQN) that do the same work;
    the micro-batch runs first..first+KEEP-1 and last."""

    block: str
    first: int
    last: int

    @property
    def period(self) -> int:
        """The last kept layer before `last`: its records are copied."""
        return self.first + KEEP - 1

    @property
    def copies(self) -> int:
        return self.last - self.period - 1

    def fqn(self, layer: int) -> str:
        return f"{self.block}.layers.{layer}" if self.block else f"layers.{layer}"


def eligible(job, config, device: str) -> bool:
    """Whether the job's layers can be traced in part: on meta, and without the features that
    keep state per layer or treat layers by position (full recompute's groups, FP8's BF16 first
    and last layers, offloading, CUDA graphs, Megatron-FSDP's per-layer gathers, userbuffers,
    delayed weight gradients), which no test has checked."""
    from metatrace.tracing.stages import keeps_state

    per_layer = config.recompute_method == "uniform" and config.recompute_num_layers == 1
    return device == "meta" and not (
        (config.recompute_granularity == "full" and not per_layer)
        or keeps_state(job)
        or getattr(config, "delay_wgrad_compute", False)
        or getattr(config, "fine_grained_activation_offloading", False)
    )


def runs(config, models: dict[str, Any]) -> list[Run]:
    """The runs worth cutting in the decoders of `models` ({chunk prefix: GPTModel}). Where
    the layers share a cache that fills up (MLA's rotary embeddings), metatrace.tracing.caches
    puts back the evictions the skipped layers make."""
    out = []
    for prefix, model in models.items():
        block = getattr(model, "decoder", None)
        layers = list(getattr(block, "layers", ()))
        keys = [_layer_key(config, layer) for layer in layers]
        name = f"{prefix}.decoder" if prefix else "decoder"
        start = 0
        for i in range(1, len(keys) + 1):
            if i < len(keys) and keys[i] == keys[start]:
                continue
            if i - start >= KEEP + 2:
                out.append(Run(name, start, i - 1))
            start = i
    return out


def _layer_key(config, layer) -> tuple:
    from metatrace.tracing.stages import _kind

    modules = tuple(
        (
            name,
            type(mod).__name__,
            tuple(
                (p_name, tuple(p.shape), str(p.dtype))
                for p_name, p in mod.named_parameters(recurse=False)
            ),
        )
        for name, mod in layer.named_modules()
    )
    return modules, _kind(config, layer.layer_number - 1)


class Marks:
    """Where each kept layer's forward began ("pre") and ended ("post"), where its backward
    began ("grad": the gradient of its output is complete, or full recompute runs its forward
    again), and where the block's forward ended ("end", under its last layer), by (block,
    layer)."""

    def __init__(self):
        from metatrace.tracing.caches import Calls

        self.at: dict[tuple[str, int, str], Any] = {}
        self.statics: dict[tuple[str, int], list[int]] = {}
        """The storage ids of each layer's parameters and buffers (all layers, kept or not)."""
        self.calls = Calls()
        """The calls of a cache the layers share (metatrace.tracing.caches)."""


@contextlib.contextmanager
def truncated(models: dict[str, Any], cut: list[Run], rec):
    """While inside, each block runs only the kept layers of its runs; yields the Marks."""
    import torch

    from metatrace.tracing import caches

    marks = Marks()
    handles = []
    saved = []
    by_block: dict[str, list[Run]] = {}
    for run in cut:
        by_block.setdefault(run.block, []).append(run)
    watching = contextlib.ExitStack()
    try:
        if caches.fills(models):
            watching.enter_context(caches.watch(models, rec, marks.at, marks.calls))
        for prefix, model in models.items():
            name = f"{prefix}.decoder" if prefix else "decoder"
            block_runs = by_block.get(name)
            if not block_runs:
                continue
            block = model.decoder
            layers = list(block.layers)
            skipped = {i for run in block_runs for i in range(run.period + 1, run.last)}
            for i, layer in enumerate(layers):
                marks.statics[(name, i)] = [
                    rec.known_storage(t) for t in (*layer.parameters(), *layer.buffers())
                ]
                if i in skipped:
                    continue
                handles.append(layer.register_forward_pre_hook(_pre(marks, rec, name, i)))
                handles.append(layer.register_forward_hook(_post(marks, rec, name, i)))
            saved.append((block, block.layers, block.num_layers_per_pipeline_rank))
            block.layers = torch.nn.ModuleList(
                [layer for i, layer in enumerate(layers) if i not in skipped]
            )
            # full recompute's checkpointed forward counts the layers by this attribute
            block.num_layers_per_pipeline_rank = len(block.layers)
            handles.append(block.register_forward_hook(_end(marks, rec, name, len(layers) - 1)))
        yield marks
    finally:
        for block, layers, count in saved:
            block.layers = layers
            block.num_layers_per_pipeline_rank = count
        for handle in handles:
            handle.remove()
        watching.close()


def mirror(models: dict[str, Any], cut: list[Run]) -> bool:
    """After a micro-batch traced in part, outside its recorder: give each skipped layer the
    buffers its forward would have replaced, as the period layer's forward replaced its own
    (megatron-core's router keeps its expert bias in float32 from its first forward on; MLA's
    rotary embedding caches cos and sin in the input's dtype): a new tensor like the period
    layer's where its dtype or shape differ. The iteration's recorder sees them. False where
    the skipped layers' parameters and buffers still differ from the period layer's (the
    micro-batch is then traced whole)."""
    import torch

    def state(layer) -> list:
        return [
            (name, t.dtype, tuple(t.shape))
            for name, t in (*layer.named_parameters(), *layer.named_buffers())
        ]

    blocks = {
        (f"{prefix}.decoder" if prefix else "decoder"): model.decoder
        for prefix, model in models.items()
        if getattr(model, "decoder", None) is not None
    }
    for run in cut:
        layers = blocks[run.block].layers
        period = layers[run.period]
        theirs = dict(period.named_buffers())
        for i in range(run.period + 1, run.last):
            with torch.no_grad():
                for name, buffer in layers[i].named_buffers():
                    like = theirs.get(name)
                    if like is None:
                        return False
                    if (like.dtype, like.shape) != (buffer.dtype, buffer.shape):
                        buffer.data = torch.empty_like(like)
            if state(layers[i]) != state(period):
                return False
    return True


def _in_backward() -> bool:
    import torch

    return torch._C._current_graph_task_id() != -1


def _pre(marks, rec, block, i):
    def hook(module, args):
        if not _in_backward():
            marks.at[(block, i, "pre")] = rec.mark()
        else:
            # Full recompute: the layer's forward ran without grad (no hook on its output);
            # its backward starts where the checkpoint runs it again.
            marks.at.setdefault((block, i, "grad"), rec.mark())

    return hook


def _post(marks, rec, block, i):
    import torch

    def on_grad(grad):
        marks.at[(block, i, "grad")] = rec.mark()

    def hook(module, args, output):
        if _in_backward():
            return
        marks.at[(block, i, "post")] = rec.mark()
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(on_grad)

    return hook


def _end(marks, rec, block, last):
    def hook(module, args, output):
        # Where the block's forward ends: the last layer's forward reaches here (full
        # recompute's checkpoint saves the layer's input after running it).
        if not _in_backward():
            marks.at[(block, last, "end")] = rec.mark()

    return hook


# ---------------------------------------------------------------------------- expanding


def expand(trace, cut: list[Run], marks: Marks):
    """The records of the whole micro-batch from those of the truncated one, or None when a
    run's kept layers do not record the same thing (see the module docstring)."""
    from metatrace.tracing import caches

    at = dict(marks.at)
    for run in cut:
        copies = _copied_calls(run, at, marks.calls)
        done = _expand_run(trace, run, at, marks.statics)
        if done is None:
            return None
        trace, at = done
        if copies is not None:
            caches.copied(at, marks.calls, run, *copies)
    if marks.calls.info:
        trace = caches.evict(trace, at, marks.calls)
        if trace is None:
            return None
    # Each window's host pieces (cut at the marks) as one, as tracing every layer gives them.
    windows = tuple(
        dataclasses.replace(w, host=(product(w.host),)) if len(w.host) > 1 else w
        for w in trace.windows
    )
    return dataclasses.replace(trace, windows=windows)


def _copied_calls(run: Run, at: dict, calls) -> tuple | None:
    """Where the calls of a shared cache by `run`'s skipped layers go (caches.copied's
    arguments after the run): the period layer's call, the copies' count, and one forward's
    records, storage ids and live bytes; None where the period layer made no call."""
    from metatrace.tracing.caches import CALL

    fqn = run.fqn(run.period)
    keys = [k for k, info in calls.info.items() if info[3] == fqn or info[3].startswith(fqn + ".")]
    executed = sorted({i for (b, i, _) in at if b == run.block})
    later = [i for i in executed if i > run.period]
    if len(keys) > 1:  # copies of one call per layer only
        calls.failed = "a layer calling the cache more than once"
    if len(keys) != 1 or keys[0][0] != CALL or not later:
        return None
    key = keys[0]
    start, end = at[(run.block, run.period, "pre")], at[(run.block, later[0], "pre")]
    return key, run.copies, end.seq - start.seq, end.sid - start.sid, end.live - start.live


_COLLECTIVE_FIELDS = (
    "op",
    "aten",
    "group",
    "ranks",
    "shape",
    "dtype",
    "bytes",
    "count",
    "phase",
    "peer",
    "output_bytes",
    "overlap",
)


class _Span:
    """The records between two marks, and the layers around the layer they belong to."""

    def __init__(self, start, end, bands: dict, statics: dict, fqns: dict):
        self.start, self.end = start, end
        self.bands = bands  # {(kind "F"/"B", d): (first sid, end sid)}
        self.statics = statics  # {sid: (d, position)} of the layers at d = -1, 0, 1
        self.fqns = fqns  # {d: FQN of the layer at d}

    def holds(self, seq: int) -> bool:
        return self.start.seq < seq <= self.end.seq

    def ref(self, sid: int):
        if sid < 0:
            return ("none",)
        for (kind, d), (lo, hi) in self.bands.items():
            if lo <= sid < hi:
                return (kind, d, sid - lo)
        if sid in self.statics:
            return ("S", *self.statics[sid])
        return ("A", sid)

    def module(self, name: str):
        for d, fqn in self.fqns.items():
            if name == fqn or name.startswith(fqn + "."):
                return ("M", d, name[len(fqn) :])
        return ("A", name)

    def stats(self) -> tuple:
        a, b = self.start, self.end
        return (
            b.seq - a.seq,
            b.sid - a.sid,
            b.live - a.live,
            b.flops - a.flops,
            b.fp8_flops - a.fp8_flops,
            b.ps - a.ps,
            b.attention_ps - a.attention_ps,
            tuple(sorted((b.ops - a.ops).items())),
            tuple(sorted((b.unclassified - a.unclassified).items())),
            b.kernels - a.kernels,
            b.host_ps - a.host_ps,
            b.syncs - a.syncs,
        )

    def form(self, trace) -> tuple:
        """The span's records with every reference made relative."""
        a = self.start
        cf = trace.collective_flops
        out: list[tuple] = [self.stats()]
        for r in trace.saved:
            if self.holds(r.seq):
                out.append(
                    (
                        "saved",
                        r.seq - a.seq,
                        self.ref(r.storage),
                        r.bytes,
                        r.shape,
                        r.dtype,
                        self.module(r.module),
                        r.phase,
                        r.static,
                    )
                )
        for r in trace.memory:
            if self.holds(r.seq):
                out.append(
                    (
                        "memory",
                        r.seq - a.seq,
                        r.delta,
                        r.live - a.live,
                        self.module(r.module),
                        r.phase,
                        self.ref(r.storage),
                    )
                )
        for r in trace.collectives:
            if self.holds(r.seq):
                fields = tuple(getattr(r, n) for n in _COLLECTIVE_FIELDS)
                flops = cf[r.seq] - a.flops if r.seq in cf else None
                out.append(("collective", r.seq - a.seq, fields, self.module(r.module), flops))
        return tuple(out)


def _expand_run(trace, run: Run, at: dict, statics: dict):
    block = run.block
    executed = sorted({i for (b, i, _) in at if b == block})
    pos = {layer: n for n, layer in enumerate(executed)}

    def neighbour(layer, d):
        n = pos[layer] + d
        return executed[n] if 0 <= n < len(executed) else None

    def band(layer, kind):
        """(first, end) storage ids of what `layer`'s forward ("F") or backward ("B") first
        saw, or None."""
        if layer is None:
            return None
        if kind == "F":
            nxt = neighbour(layer, 1)
            end = at[(block, nxt, "pre")] if nxt is not None else at[(block, layer, "post")]
            return at[(block, layer, "pre")].sid, end.sid
        prev = neighbour(layer, -1)
        start = at.get((block, layer, "grad"))
        end = at.get((block, prev, "grad")) if prev is not None else None
        if start is None or end is None:
            return None
        return start.sid, end.sid

    count = Counter(sid for key, sids in statics.items() if key[0] == block for sid in sids)

    def span(layer, phase):
        """The records of `layer`'s forward ("F") or backward ("B"), in the truncated run."""
        around = {d: neighbour(layer, d) for d in (-1, 0, 1)}
        bands = {}
        private = {}
        for d, other in around.items():
            if other is None:
                continue
            for kind in ("F", "B"):
                found = band(other, kind)
                if found is not None:
                    bands[(kind, d)] = found
            for n, sid in enumerate(statics[(block, other)]):
                if sid is not None and count[sid] == 1:
                    private[sid] = (d, n)
        if phase == "F":
            nxt = neighbour(layer, 1)
            start = at[(block, layer, "pre")]
            last_end = at.get((block, layer, "end"), at[(block, layer, "post")])
            end = at[(block, nxt, "pre")] if nxt is not None else last_end
        else:
            start, end = at[(block, layer, "grad")], at[(block, neighbour(layer, -1), "grad")]
        fqns = {d: run.fqn(other) for d, other in around.items() if other is not None}
        return _Span(start, end, bands, private, fqns)

    period, last = run.period, run.last
    try:
        spans = {
            (layer, phase): span(layer, phase)
            for layer, phase in (
                (period - 1, "F"),
                (period, "F"),
                (period - 2, "B"),
                (period - 1, "B"),
                (period, "B"),
                (last, "F"),
                (last, "B"),
            )
        }
    except (KeyError, TypeError):
        return None
    # A middle layer's forward, and its backward where the next layer is a middle one too (the
    # last kept layer's backward follows the run's last layer's, which may differ).
    for a, b in (((period - 1, "F"), (period, "F")), ((period - 2, "B"), (period - 1, "B"))):
        if spans[a].form(trace) != spans[b].form(trace):
            return None
    old_bands = {
        (layer, kind): band(layer, kind)
        for layer in executed
        for kind in ("F", "B")
        if band(layer, kind) is not None
    }
    return _insert(trace, run, at, statics, spans, old_bands)


def _insert(trace, run: Run, at: dict, statics: dict, spans: dict, old_bands: dict):
    """`trace` with the run's skipped layers inserted (and the marks `at` moved as the records
    were). The forward gets run.copies copies of the last kept layer's forward after it; the
    backward of the last kept layer becomes that of the layer before the run's last, and copies
    of the backward of the layer before it (a middle layer's, followed by a middle layer) stand
    for the layers from there down to the last kept layer."""
    m = run.copies
    period, last = run.period, run.last
    fwd, bwd = spans[(period, "F")], spans[(period - 1, "B")]
    n_f, k_f, live_f, flops_f, fp8_f, ps_f, at_f = fwd.stats()[:7]
    n_b, k_b, live_b, flops_b, fp8_b, ps_b, at_b = bwd.stats()[:7]
    host_f, host_b = fwd.stats()[9:], bwd.stats()[9:]  # kernels, host_ps, syncs
    seq_f, sid_f = fwd.end.seq, fwd.end.sid  # the forward copies go here
    seq_b, sid_b = bwd.start.seq, bwd.start.sid  # the backward copies go here

    def seq_new(s: int) -> int:
        return s + (m * n_f if s > seq_f else 0) + (m * n_b if s > seq_b else 0)

    def sid_new(y: int) -> int:
        if y < 0:
            return y
        return y + (m * k_f if y >= sid_f else 0) + (m * k_b if y >= sid_b else 0)

    def live_new(s: int, live: int) -> int:
        return live + (m * live_f if s > seq_f else 0) + (m * live_b if s > seq_b else 0)

    def band_new(layer: int, kind: str) -> tuple[int, int] | None:
        """The storage ids a layer's forward or backward first sees, in the new records."""
        if kind == "F" and period <= layer <= period + m:
            lo = fwd.start.sid + (layer - period) * k_f
            return lo, lo + k_f
        if kind == "B" and period <= layer < period + m:
            lo = sid_b + m * k_f + (period + m - 1 - layer) * k_b
            return lo, lo + k_b
        old = old_bands.get((period if layer == period + m else layer, kind))
        return None if old is None else (sid_new(old[0]), sid_new(old[1]))

    def resolver(source: _Span, layer: int):
        """Functions moving the storage ids and module names of `source`'s records to those
        of `layer` in the new records (references to the layers around it included)."""

        def sid(y: int) -> int:
            ref = source.ref(y)
            if ref[0] in ("F", "B"):
                found = band_new(layer + ref[1], ref[0])
                return found[0] + ref[2] if found is not None else sid_new(y)
            if ref[0] == "S":
                return statics[(run.block, layer + ref[1])][ref[2]]
            return sid_new(y)

        def module(name: str) -> str:
            ref = source.module(name)
            return run.fqn(layer + ref[1]) + ref[2] if ref[0] == "M" else name

        return sid, module

    windows = trace.windows
    w_f = next(w for w in windows if w.first <= fwd.start.seq + 1 and fwd.end.seq <= w.last)
    w_b = next(w for w in windows if w.first <= bwd.start.seq + 1 and bwd.end.seq <= w.last)
    cf_old = trace.collective_flops

    def flops_new(s: int, value: int) -> int:
        if s > seq_f and w_f.first <= s <= w_f.last:
            value += m * flops_f
        if s > seq_b and w_b.first <= s <= w_b.last:
            value += m * flops_b
        return value

    # Spans whose records stay but whose neighbours change: (span, the layer it is now).
    moved_spans = [
        (fwd, period),
        (spans[(period, "B")], period + m),
        (bwd, period - 1),
        (spans[(last, "F")], last),
        (spans[(last, "B")], last),
    ]
    plain = (sid_new, lambda name: name)
    collective_flops: dict[int, int] = {}

    def convert(r, copy: tuple | None = None):
        """Record r in the new records: moved (copy None), or as a copy (source span, layer,
        seq shift, live shift, FLOPs shift)."""
        if copy is None:
            found = next(((sp, layer) for sp, layer in moved_spans if sp.holds(r.seq)), None)
            sid, module = resolver(*found) if found is not None else plain
            seq = seq_new(r.seq)
            live = live_new(r.seq, getattr(r, "live", 0))
            flops = flops_new(r.seq, cf_old[r.seq]) if r.seq in cf_old else None
        else:
            source, layer, seq_shift, live_shift, flops_shift = copy
            sid, module = resolver(source, layer)
            seq = r.seq + seq_shift
            live = getattr(r, "live", 0) + live_shift
            flops = cf_old[r.seq] + flops_shift if r.seq in cf_old else None
        changes: dict[str, Any] = {"seq": seq, "module": module(r.module)}
        if hasattr(r, "storage"):
            changes["storage"] = sid(r.storage)
        if hasattr(r, "live"):
            changes["live"] = live
        if flops is not None:
            collective_flops[seq] = flops
        return dataclasses.replace(r, **changes)

    forward_copies = [(fwd, period + i, i * n_f, i * live_f, i * flops_f) for i in range(1, m + 1)]
    backward_copies = [
        (bwd, period + m - 1 - j, m * n_f + j * n_b, m * live_f + j * live_b, j * flops_b)
        for j in range(m)
    ]

    def rebuild(records) -> tuple:
        in_f = [r for r in records if fwd.holds(r.seq)]
        in_b = [r for r in records if bwd.holds(r.seq)]
        out: list = []
        pending = [(seq_f, forward_copies, in_f), (seq_b, backward_copies, in_b)]
        for r in records:
            while pending and r.seq > pending[0][0]:
                _, copies, pattern = pending.pop(0)
                out += [convert(x, c) for c in copies for x in pattern]
            out.append(convert(r))
        for _, copies, pattern in pending:
            out += [convert(x, c) for c in copies for x in pattern]
        return tuple(out)

    memory = rebuild(trace.memory)
    saved = rebuild(trace.saved)
    collectives = rebuild(trace.collectives)
    # The host's pieces (cut at every mark): the copies' after the forward span's end, before
    # the backward span's start (where their records go).
    pieces_f = w_f.host[fwd.start.piece : fwd.end.piece]
    pieces_b = w_b.host[bwd.start.piece : bwd.end.piece]
    new_windows = []
    for w in windows:
        changes = {"first": seq_new(w.first - 1) + 1, "last": seq_new(w.last)}
        for key in ("output", "held"):
            value = getattr(w, key)
            if value is not None:
                changes[key] = sid_new(value)
        if w is w_f:
            changes["flops"] = w.flops + m * flops_f
            changes["fp8_flops"] = w.fp8_flops + m * fp8_f
            changes["kernel_ps"] = w.kernel_ps + m * ps_f
            changes["attention_ps"] = w.attention_ps + m * at_f
        if w is w_b:
            changes["flops"] = w.flops + m * flops_b
            changes["fp8_flops"] = w.fp8_flops + m * fp8_b
            changes["kernel_ps"] = w.kernel_ps + m * ps_b
            changes["attention_ps"] = w.attention_ps + m * at_b
        for which, at_piece, pieces, added in (
            (w_f, fwd.end.piece, pieces_f, host_f),
            (w_b, bwd.start.piece, pieces_b, host_b),
        ):
            if w is which:
                kernels, host_ps, syncs = added
                changes["kernels"] = w.kernels + m * kernels
                changes["host_ps"] = w.host_ps + m * host_ps
                changes["syncs"] = w.syncs + m * syncs
                changes["host"] = w.host[:at_piece] + pieces * m + w.host[at_piece:]
        new_windows.append(dataclasses.replace(w, **changes))
    added = [
        (seq_f, fwd, flops_f, fp8_f, ps_f, at_f),
        (seq_b, bwd, flops_b, fp8_b, ps_b, at_b),
    ]

    def counted(counter: Counter, name: str, upto: int | None = None) -> dict:
        """`counter` with the operators of the copies before seq `upto` (all: None) added."""
        out = Counter(counter)
        for at_seq, sp, *_ in added:
            if upto is None or upto > at_seq:
                for op, n in (getattr(sp.end, name) - getattr(sp.start, name)).items():
                    out[op] += m * n
        return out

    expanded = dataclasses.replace(
        trace,
        memory=memory,
        saved=saved,
        collectives=collectives,
        windows=tuple(new_windows),
        op_counts=dict(counted(Counter(trace.op_counts), "ops")),
        unclassified=dict(counted(Counter(trace.unclassified), "unclassified")),
        collective_flops=collective_flops,
        workspaces=tuple(sid_new(y) for y in trace.workspaces),
    )

    def moved(mark):
        s = mark.seq

        def more(i: int) -> int:  # the copies' count `i` (of `added`) before seq s
            return sum(m * entry[i] for entry in added if s > entry[0])

        return type(mark)(
            seq_new(s),
            sid_new(mark.sid),
            live_new(s, mark.live),
            mark.flops + more(2),
            mark.fp8_flops + more(3),
            mark.ps + more(4),
            mark.attention_ps + more(5),
            counted(mark.ops, "ops", s),
            counted(mark.unclassified, "unclassified", s),
            *(
                value
                + sum(m * h[k] for at_seq, h in ((seq_f, host_f), (seq_b, host_b)) if s > at_seq)
                for k, value in enumerate((mark.kernels, mark.host_ps, mark.syncs))
            ),
            mark.piece
            + sum(
                m * len(pieces)
                for w, at_seq, pieces in ((w_f, seq_f, pieces_f), (w_b, seq_b, pieces_b))
                if at_seq < s <= w.last
            ),
        )

    return expanded, {key: moved(mark) for key, mark in at.items()}
