"""Memory over an iteration, from the records (pure functions, no torch).

Two traces per role feed it (metatrace.tracing.trace):
1. one micro-batch through the rank's chunks under megatron-core's forward_step/backward_step,
   with a Window around each chunk's forward and backward step;
2. the whole iteration under megatron-core's own schedule, each step replayed from what (1)
   measured (metatrace.tracing.iteration), then the optimizer step.

`step_profiles(trace1)` condenses (1) into what each replayed step must allocate and free;
`iteration_memory(...)` reads the peak of (2) and splits it into its parts.

Every storage is classified by when it is allocated and freed in (1):
- static: existed before (parameters, DDP's gradient and parameter buffers, optimizer state);
- persistent: allocated during the micro-batch and never freed (kernel workspaces, FP8 weight
  caches, buffers megatron-core keeps for reuse). In the steady state of training they exist
  before the iteration starts, so they count once, beside the static memory;
- held: allocated by a chunk's forward step and freed in or after its backward step: the
  activations a micro-batch keeps while it is in flight;
- everything else is temporary.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from metatrace.records import STEP, MemEvent, OffloadRecord, Trace, Window


@dataclass(frozen=True)
class StepProfile:
    """What one chunk's forward or backward step does to memory, for one micro-batch."""

    phase: str
    chunk: int
    held: int
    """Forward: bytes it allocates that stay until the chunk's backward step (0 for backward)."""
    output: int
    """Forward: bytes of the output handed to the next stage and freed right after the send."""
    excess: int
    """Highest live bytes inside the step above the bytes live when it starts (persistent
    allocations left out); at least held + output for a forward step."""
    module: str
    """Module active when the step reached its highest point."""
    overlap: int = 0
    """Forward, with overlap_moe_expert_parallel_comm: the largest attention part of one layer's
    held bytes (attn node: norms, attention, router, shared experts), what megatron-core's
    combined 1F1B holds beside a micro-batch's activations (metatrace.tracing.overlap)."""


@dataclass(frozen=True)
class Lifetimes:
    """When each storage a trace allocated was allocated and freed, and its size."""

    bytes: dict[int, int]
    """Largest size the storage had (storages grow with resize_)."""
    allocated: dict[int, int]
    freed: dict[int, int]
    """Storages freed within the trace (the others are still alive at its end)."""

    def persistent(self) -> set[int]:
        return {sid for sid in self.allocated if sid not in self.freed}


def lifetimes(memory: tuple[MemEvent, ...]) -> Lifetimes:
    """Lifetimes of the storages in `memory`. A storage that shrinks to nothing and grows
    again (`resize_(0)`, then back: Megatron-FSDP's parameter and gradient buckets between
    their uses, megatron-core's CheckpointWithoutOutput outputs until their recompute) lives
    once per time it grows from nothing: its first life has its own id, each later one the key
    (id, n), so that memory freed in between is not taken for memory held."""
    size: dict = {}
    largest: dict = {}
    allocated: dict = {}
    freed: dict = {}
    current: dict[int, object] = {}  # storage id -> key of its current life
    lives: dict[int, int] = {}
    for e in memory:
        key = current.get(e.storage, e.storage)
        if e.delta > 0 and key in freed:  # grown again from nothing: a new life
            lives[e.storage] = lives.get(e.storage, 0) + 1
            key = current[e.storage] = (e.storage, lives[e.storage])
        now = size.get(key, 0) + e.delta
        size[key] = now
        if e.delta > 0:
            allocated.setdefault(key, e.seq)
            largest[key] = max(largest.get(key, 0), now)
        elif now <= 0 and key in allocated:
            freed[key] = e.seq
    return Lifetimes(bytes=largest, allocated=allocated, freed=freed)


def persistent_bytes(trace: Trace) -> int:
    """Bytes allocated during the trace and still alive at its end."""
    life = lifetimes(trace.memory)
    return sum(life.bytes[sid] for sid in life.persistent())


def _window_excess(trace: Trace, window: Window, persistent: set[int]) -> tuple[int, str]:
    """Highest live bytes inside `window` above its start, persistent storages left out."""
    live, best, module = 0, 0, STEP
    for e in trace.memory:
        if e.seq < window.first:
            continue
        if e.seq > window.last:
            break
        if e.storage in persistent:
            continue
        live += e.delta
        if live > best:
            best, module = live, e.module
    return best, module


def step_profiles(
    trace: Trace, *, reloads: frozenset[int] = frozenset()
) -> dict[tuple[str, int], StepProfile]:
    """{(phase, chunk): StepProfile} from a one-micro-batch trace with Windows.

    `reloads`: storages of activations offloading brought back (OffloadRecord.reloads), left
    out of the backward excess: the traced micro-batch reloads on demand (megatron-core's
    warm-up), the steady state one layer ahead, which the replay holds as a slot of its own
    (offload_slots)."""
    life = lifetimes(trace.memory)
    persistent = life.persistent()
    windows = {
        (w.phase, w.chunk): w
        for w in trace.windows
        if w.chunk is not None and w.phase in ("forward", "backward")
    }
    profiles: dict[tuple[str, int], StepProfile] = {}
    for (phase, chunk), w in windows.items():
        left_out = persistent | reloads if phase == "backward" else persistent
        excess, module = _window_excess(trace, w, left_out)
        held = output = 0
        kept: set = set()
        if phase == "forward":
            back = windows.get(("backward", chunk))
            until = back.first if back is not None else w.last + 1
            for sid, seq in life.allocated.items():
                if not w.first <= seq <= w.last or sid in persistent:
                    continue
                end = life.freed[sid]
                if end <= w.last:
                    continue  # a temporary of the step
                if end >= until:
                    held += life.bytes[sid]
                    kept.add(sid if isinstance(sid, int) else sid[0])
                elif sid == w.output:
                    output += life.bytes[sid]
            excess = max(excess, held + output)
        overlap = _attention_part(trace, w, kept) if phase == "forward" else 0
        profiles[(phase, chunk)] = StepProfile(phase, chunk, held, output, excess, module, overlap)
    return profiles


_LAYER = re.compile(r"^(.*?layers\.\d+)\.(.*)$")
# The MoE layer's parts in megatron-core's attn node (fine_grained_callables.py:427-458); the
# rest of `mlp` (dispatch, experts, combine) is freed by the other micro-batch's mlp backward
# before the attention backward.
_ATTN_SIDE_OF_MLP = ("mlp.router", "mlp.shared_experts")


def _attention_part(trace: Trace, window: Window, held: set) -> int:
    """Largest held bytes one layer allocates in `window` outside its MLP / experts part."""
    per_layer: dict[str, int] = {}
    for e in trace.memory:
        if e.seq < window.first or e.delta <= 0 or e.storage not in held:
            continue
        if e.seq > window.last:
            break
        m = _LAYER.match(e.module)
        if m is None:
            continue
        part = m.group(2)
        if part.startswith("mlp") and not part.startswith(_ATTN_SIDE_OF_MLP):
            continue
        per_layer[m.group(1)] = per_layer.get(m.group(1), 0) + e.delta
    return max(per_layer.values(), default=0)


def deferred_bytes(trace: Trace) -> int:
    """Bytes one micro-batch keeps until the pipeline flush with
    --defer-embedding-wgrad-compute: what the trace's "deferred" window frees."""
    total = 0
    for w in trace.windows:
        if w.phase != "deferred":
            continue
        for e in trace.memory:
            if w.first <= e.seq <= w.last and e.delta < 0:
                total -= e.delta
    return total


# ----------------------------------------------------------------------------- offloading
# megatron-core's fine-grained activation offloading (hooks/offload.py records it). The traced
# micro-batch runs the offload manager's warm-up mode: every group offloaded, every reload on
# demand. From the second iteration on (post_warmup_callback, should_bulk_offload), the last
# group of each name stays on the GPU in the chunk that runs backward next, and reloads run one
# layer ahead: one "slot" of about a layer's offloaded activations is resident at any time.


def _blocks(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def _last_groups(names: tuple[str, ...]) -> set[int]:
    """Index of the last group of each name in a chunk's forward."""
    return {max(i for i, n in enumerate(names) if n == name) for name in set(names)}


def offload_slots(
    trace: Trace, record: OffloadRecord, *, last_stage: bool, steady: Steady | None = None
) -> tuple[int, ...]:
    """Per chunk, the bytes the steady state holds on the GPU while a step of the chunk runs,
    beyond what the traced micro-batch keeps: the last group of each name of one chunk.

    Where the manager offloads them, they come back ahead of that chunk's backward step (at the
    end of the backward step before) and stay through the forward steps in between: one reload
    copy per tensor, the largest chunk's. The last pipeline stage runs the backward of its last
    chunk right after its forward, and the manager never offloads what is about to be used: in
    that chunk's steps its groups stay where the forward left them, the storages the traced
    micro-batch freed before the chunk's backward. With `steady` (activation_offload_fraction),
    what comes back ahead is the last offloaded group of each name in the chunk's steady
    micro-batches (measured: megatron-core 0.19's manager running every step,
    tests/tracing/test_offload.py)."""
    life = lifetimes(trace.memory)
    backward = {w.chunk: w.first for w in trace.windows if w.phase == "backward"}
    kept, reload = [], []
    for chunk, names in enumerate(record.groups):
        last = _last_groups(names)
        moved = [m for m in record.moved if m.chunk == chunk and m.group in last]
        start = backward.get(chunk, 1 << 62)
        freed = {
            m.source
            for m in moved
            if m.source is not None and life.freed.get(m.source, start) < start
        }
        kept.append(sum(life.bytes[sid] for sid in freed))
        if steady is not None:  # the last offloaded group of each name comes back ahead
            offloaded = steady.offloaded(chunk)
            ahead = {
                max(i for i in offloaded if names[i] == n) for n in {names[i] for i in offloaded}
            }
            moved = [m for m in record.moved if m.chunk == chunk and m.group in ahead]
        reload.append(sum(_blocks(m.bytes) for m in moved))
    if not reload:
        return ()
    if not last_stage:
        return (max(reload),) * len(reload)
    others = max(reload[:-1], default=kept[-1])
    return (others,) * (len(reload) - 1) + (kept[-1],)


# megatron-core 0.19's activation_offload_fraction keeps more groups on the GPU from the second
# iteration on: PipelineOffloadManager.post_warmup_callback decides per offload handler (one per
# micro-batch and chunk), in the order the handlers run backward. The replay gives each
# micro-batch the traced micro-batch as if those groups had stayed (keeping_groups), less the
# last group of each name that offload_slots holds.


@dataclass(frozen=True)
class Steady:
    """Which offload groups megatron-core's manager keeps on the GPU in the steady state."""

    order: tuple[tuple[int, int], ...]
    """The handlers, (chunk, micro-batch), in the order their backward steps run."""
    kept: dict[tuple[int, int], frozenset[int]]
    """Per handler, its groups not offloaded (by post_warmup_callback, and on the last pipeline
    stage the last group of each name of the last chunk, which should_bulk_offload keeps)."""
    slotted: dict[tuple[int, int], frozenset[int]]
    """Per handler, those of its kept groups that offload_slots holds (the first handler's
    margin; the last stage's last chunk's last groups)."""
    sizes: tuple[tuple[int, ...], ...]
    """Per chunk, the bytes each group moves."""

    def steady(self, chunk: int) -> int:
        """The micro-batch whose handler stands for the chunk's steady state (the last to run
        backward)."""
        return [m for v, m in self.order if v == chunk][-1]

    def offloaded(self, chunk: int) -> set[int]:
        """Groups the chunk's steady micro-batches offload."""
        kept = self.kept[(chunk, self.steady(chunk))]
        return set(range(len(self.sizes[chunk]))) - kept

    def held(self, chunk: int, microbatch: int) -> frozenset[int]:
        """Groups the micro-batch keeps beyond what the traced one and the slots hold."""
        h = (chunk, microbatch)
        return self.kept[h] - self.slotted[h]

    def typical(self) -> dict[int, frozenset[int]]:
        """Per chunk, what its steady micro-batch holds (held)."""
        return {v: self.held(v, self.steady(v)) for v in range(len(self.sizes))}

    def atypical(self) -> list[tuple[int, int]]:
        """The handlers, (chunk, micro-batch), that hold other groups than their chunk's
        steady one."""
        typical = self.typical()
        return [(v, m) for v, m in self.order if self.held(v, m) != typical[v]]

    def moved(self, chunk: int, microbatch: int) -> int:
        """Bytes the micro-batch's forward step of the chunk copies to the host."""
        kept = self.kept[(chunk, microbatch)]
        return sum(b for i, b in enumerate(self.sizes[chunk]) if i not in kept)


def backward_order(microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """(chunk, micro-batch) in the order megatron-core's schedules run backward steps (the
    order the offload manager queues its handlers): per group of `group` micro-batches, the
    last chunk first."""
    if chunks == 1:
        return [(0, m) for m in range(microbatches)]
    out = []
    for start in range(0, microbatches, group):
        batch = range(start, min(start + group, microbatches))
        for v in reversed(range(chunks)):
            out += [(v, m) for m in batch]
    return out


def steady_offload(
    record: OffloadRecord,
    *,
    last_stage: bool,
    microbatches: int,
    group: int,
    fraction: float,
) -> Steady:
    """post_warmup_callback of megatron-core 0.19 (pipeline_parallel/
    fine_grained_activation_offload.py; 0.16.1's without the fraction) over the traced
    micro-batch's groups, repeated for each handler.

    Its delta across pipeline ranks keeps nothing on rank 0 and, on the others, the first
    group of the first handler, which megatron-core 0.19.2 cannot run (config.checks refuses
    it with pipeline parallelism)."""
    chunks = len(record.groups)
    sizes = tuple(
        tuple(
            sum(m.bytes for m in record.moved if m.chunk == v and m.group == i)
            for i in range(len(names))
        )
        for v, names in enumerate(record.groups)
    )
    order = backward_order(microbatches, chunks, group)
    offload = {h: [True] * len(sizes[h[0]]) for h in order}
    # The margin: the last group of each name in the first handler to run backward.
    margin = max((len(set(names)) for names in record.groups), default=0)
    last_of_name: dict[str, tuple] = {}
    for h in reversed(order):
        for i, name in enumerate(record.groups[h[0]]):
            last_of_name[name] = (h, i)
    for h, i in last_of_name.values():
        if margin <= 0:
            break
        offload[h][i] = False
        margin -= 1
    slotted = {h: frozenset(i for i, on in enumerate(offload[h]) if not on) for h in order}
    # The fraction: per handler, the last of its eligible groups.
    for h in order:
        eligible = [i for i, on in enumerate(offload[h]) if on and sizes[h[0]][i] > 0]
        for i in reversed(eligible[len(eligible) - int(len(eligible) * (1 - fraction)) :]):
            offload[h][i] = False
    kept = {h: frozenset(i for i, on in enumerate(offload[h]) if not on) for h in order}
    if last_stage and chunks:  # should_bulk_offload: what the next backward step uses at once
        tail = frozenset(_last_groups(record.groups[-1]))
        for h in order:
            if h[0] == chunks - 1:
                kept[h] |= tail
                slotted[h] = tail
    return Steady(tuple(order), kept, slotted, sizes)


def keeping_groups(trace: Trace, record: OffloadRecord, chunk: int, groups) -> Trace:
    """The traced (warm-up) micro-batch as it would have been had the manager kept `groups` of
    `chunk` on the GPU: their storages stay until the copies their reloads made are freed in
    backward, and those reloads do not happen."""
    kept = [  # (source storage, reload storage)
        (m.source, m.reload)
        for m in record.moved
        if m.chunk == chunk and m.group in groups and m.source is not None and m.reload is not None
    ]
    if not kept:
        return trace
    life = lifetimes(trace.memory)
    forward = next(w for w in trace.windows if w.phase == "forward" and w.chunk == chunk)
    backward = next(w for w in trace.windows if w.phase == "backward" and w.chunk == chunk)
    reloads = {reload for _, reload in kept}
    until: dict[int, int] = {}  # source -> where its last kept reload was freed
    for source, reload in kept:
        until[source] = max(until.get(source, 0), life.freed.get(reload, backward.last))
    at = {seq: sid for sid, seq in until.items()}
    dropped: dict[int, int] = {}
    events: list[MemEvent] = []
    for e in trace.memory:
        if e.storage in until and e.delta < 0 and forward.first <= e.seq < backward.first:
            dropped[e.storage] = dropped.get(e.storage, 0) + e.delta  # freed by the offload
            continue
        if e.storage not in reloads:
            events.append(e)
        elif e.seq in at and dropped.get(at[e.seq]):
            events.append(dataclasses.replace(e, delta=dropped.pop(at[e.seq]), storage=at[e.seq]))
    live, out = trace.memory[0].live - trace.memory[0].delta if trace.memory else 0, []
    for e in events:
        live += e.delta
        out.append(dataclasses.replace(e, live=live))
    return dataclasses.replace(trace, memory=tuple(out))


def keeps_more(job) -> bool:
    """Whether the steady state keeps groups on the GPU beyond the traced micro-batch and
    offload_slots (activation_offload_fraction below 1): the replay then takes each
    micro-batch's steps from role_steady."""
    return job.training.activation_offload_fraction < 1.0


def role_steady(job, record: OffloadRecord, *, pp_stage: int) -> Steady:
    """steady_offload for a rank of pipeline stage `pp_stage` of `job`."""
    tr, par = job.training, job.parallel
    return steady_offload(
        record,
        last_stage=pp_stage == par.pp - 1,
        microbatches=job.num_microbatches,
        group=par.microbatch_group_size or par.pp,
        fraction=tr.activation_offload_fraction,
    )


def offload_profiles(
    trace: Trace, record: OffloadRecord, steady: Steady | None
) -> dict[tuple, StepProfile]:
    """step_profiles of the traced micro-batch for the replay of an offloading rank: per chunk
    its steady micro-batches' steps, and ("forward", chunk, micro-batch) for the micro-batches
    that keep other groups on the GPU (`steady`)."""
    profiles: dict[tuple, StepProfile] = dict(step_profiles(trace, reloads=record.reloads))
    if steady is None:
        return profiles
    cache: dict[tuple[int, frozenset], StepProfile] = {}

    def forward(v: int, groups: frozenset) -> StepProfile:
        if (v, groups) not in cache:
            kept = keeping_groups(trace, record, v, groups)
            gone = {m.reload for m in record.moved if m.chunk == v and m.group in groups}
            cache[(v, groups)] = step_profiles(kept, reloads=record.reloads - gone)[("forward", v)]
        return cache[(v, groups)]

    for v, groups in steady.typical().items():
        profiles[("forward", v)] = forward(v, groups)
    for v, m in steady.atypical():
        profiles[("forward", v, m)] = forward(v, steady.held(v, m))
    return profiles


def steady_microbatches(job, rt) -> tuple[Trace, dict[tuple[int, int], Trace]] | None:
    """The traced micro-batch as an offloading role's steady micro-batches run it (each chunk
    keeping what its steady state keeps, role_steady), and {(chunk, micro-batch): trace} for the
    micro-batches that keep other groups; None where the traced one stands for them all."""
    if rt.offload is None or job.training.cpu_offloading_num_layers or not keeps_more(job):
        return None
    steady = role_steady(job, rt.offload, pp_stage=rt.role.pp_stage)
    typical = steady.typical()

    def keeping(groups: dict[int, frozenset]) -> Trace:
        trace = rt.trace
        for v, kept in groups.items():
            trace = keeping_groups(trace, rt.offload, v, kept)
        return trace

    others = {(v, m): keeping({**typical, v: steady.held(v, m)}) for v, m in steady.atypical()}
    return keeping(typical), others


@dataclass(frozen=True)
class OffloadSummary:
    """Fine-grained activation offloading on one rank over a steady-state iteration (bytes).
    What goes to the host (D2H) comes back (H2D)."""

    d2h_per_microbatch: int
    """Copied to the host by one micro-batch's forward steps, all chunks of the rank."""
    d2h_per_iteration: int
    """Over the iteration's micro-batches, less the groups the steady state keeps."""
    pinned_host: int
    """Pinned host memory the offload buffers hold (megatron-core never frees them): the
    in-flight micro-batches' copies at their most, each buffer a power of two (PyTorch's caching
    host allocator); per node, times the GPUs per node."""


def offload_summary(record: OffloadRecord, iteration: Trace, steady: Steady) -> OffloadSummary:
    """PCIe traffic and pinned host memory from the offload record of the traced micro-batch and
    the replayed iteration (its forward and backward windows say what is in flight).

    What stays on the GPU is `steady`'s: the last group of each name on the last pipeline stage
    in every micro-batch of the last chunk (its backward comes right after its forward, so the
    manager never offloads what is about to be used), elsewhere in the first micro-batch of the
    chunk that runs backward first (the last chunk); with a fraction, the later groups of
    every micro-batch."""
    chunks = len(record.groups)
    per_microbatch = sum(steady.moved(v, steady.steady(v)) for v in range(chunks))
    per_iteration = sum(steady.moved(v, m) for v, m in steady.order)
    host = [_pinned(m for m in record.moved if m.chunk == v) for v in range(chunks)]
    changes = []
    win = iteration.columns("windows", ("phase", "chunk", "first", "last"))
    for phase, chunk, first, last in zip(*(win[k].tolist() for k in win)):
        if chunk is not None and chunk < chunks and phase in ("forward", "backward"):
            sign = 1 if phase == "forward" else -1
            changes.append((first if sign > 0 else last, sign * host[chunk]))
    pinned = now = 0
    for _, delta in sorted(changes):
        now += delta
        pinned = max(pinned, now)
    return OffloadSummary(per_microbatch, per_iteration, pinned)


def _pinned(moved) -> int:
    """Pinned host bytes of these copies: PyTorch's caching host allocator rounds each block up
    to a power of two."""
    return sum(1 << max(0, m.bytes - 1).bit_length() for m in moved)


def layer_offload_summary(record: OffloadRecord, *, microbatches: int) -> OffloadSummary:
    """Transformer Engine's layer-wise offloading (pipeline parallel size 1): every micro-batch
    copies the same tensors out and back, one micro-batch's copies are in flight at a time
    (each freed when its reload replaces it, and reused by the next from the allocator's
    cache)."""
    per_microbatch = sum(m.bytes for m in record.moved)
    return OffloadSummary(per_microbatch, microbatches * per_microbatch, _pinned(record.moved))


def role_offload(job, rt) -> OffloadSummary | None:
    """offload_summary of a traced role (metatrace.tracing.trace.RoleTrace); None when the job does not
    offload or no iteration was traced."""
    if rt.offload is None or rt.iteration is None:
        return None
    if job.training.cpu_offloading_num_layers:
        return layer_offload_summary(rt.offload, microbatches=job.num_microbatches)
    return offload_summary(
        rt.offload, rt.iteration, role_steady(job, rt.offload, pp_stage=rt.role.pp_stage)
    )


# ----------------------------------------------------------------------------- the iteration


@dataclass(frozen=True)
class PeakAt:
    phase: str
    """forward, backward (a chunk's step), optimizer, or the schedule's own work between steps."""
    microbatch: int | None
    chunk: int | None
    module: str
    """Module active at the peak (for a replayed step, where the traced micro-batch peaked)."""


@dataclass(frozen=True)
class RoleMemory:
    """A rank's memory over one training iteration, the optimizer step included (bytes)."""

    params: int
    """Parameters and module buffers (with the distributed optimizer: DDP's parameter buffer)."""
    grads: int
    """DDP's main-gradient buffers."""
    optimizer: int
    """Main parameters, optimizer state and the optimizer's small tensors."""
    workspaces: int
    """Allocated once and kept: kernel workspaces (cuBLAS, Transformer Engine), TE's dummy
    weight gradients, FP8 weight caches, buffers megatron-core reuses."""
    activations: int
    """Held at the peak for the micro-batches in flight: what their forward steps keep for
    backward, and the pipeline buffers that carry them (received inputs, input gradients)."""
    temporary: int
    """Everything else live at the peak: the running step's temporaries."""
    peak: int
    peak_at: PeakAt
    inflight: int
    """Micro-batches whose activations are held at the peak (the running one included)."""
    most_steps_held: int
    """The most forward steps (chunk x micro-batch) whose activations were held at once during
    the iteration: the schedule's warm-up depth plus one."""
    timeline: tuple[tuple[str, int], ...]
    """(phase, highest live bytes) of every step of the iteration in order (each chunk's
    forward and backward per micro-batch, then the optimizer), workspaces included: the picture
    of memory over time."""

    @property
    def static(self) -> int:
        return self.params + self.grads + self.optimizer + self.workspaces


def role_memory(micro: Trace, iteration: Trace) -> RoleMemory:
    """The iteration's peak and its parts, from the two traces of a role (see module doc).

    It reads the iteration's records as columns (Trace.columns): an iteration of 100,000
    micro-batches has millions of memory events."""
    import numpy as np

    workspaces = persistent_bytes(micro)
    ev = iteration.columns("memory", ("seq", "delta", "live", "storage"))
    win = iteration.columns("windows", ("phase", "chunk", "microbatch", "first", "last", "held"))
    life = _lifetime_columns(ev)
    best = int(np.argmax(ev["live"])) if len(ev["live"]) else None
    best_seq = int(ev["seq"][best]) if best is not None else 0
    peak = (int(ev["live"][best]) if best is not None else iteration.static_bytes) + workspaces
    window = None
    if best is not None:
        inside = np.flatnonzero((win["first"] <= best_seq) & (best_seq <= win["last"]))
        window = int(inside[0]) if len(inside) else None
    activations = temporary = 0
    inflight: set = set()
    if best is not None:
        # Storages alive right after the peak event, the static ones aside.
        if window is not None:
            since = int(win["first"][window])
        else:
            before = win["last"][win["last"] < best_seq]
            since = int(before.max()) + 1 if len(before) else 0
        alive = (life["allocated"] <= best_seq) & (life["freed"] > best_seq)
        held_at = {}  # held storage -> its (last) window's micro-batch
        for sid, mb in zip(win["held"].tolist(), win["microbatch"].tolist()):
            if sid is not None:
                held_at[sid] = mb
        held = np.zeros(len(alive), dtype=bool)
        if held_at:
            ids = np.fromiter(held_at, dtype=np.int64, count=len(held_at))
            held = (life["life"] == 0) & np.isin(life["storage"], ids)
        size = life["bytes"]
        activations = int(size[alive & held].sum())
        inflight = {held_at[sid] for sid in life["storage"][alive & held].tolist()}
        rest = alive & ~held
        temporary = int(size[rest & (life["allocated"] >= since)].sum())
        activations += int(size[rest & (life["allocated"] < since)].sum())
    parts = iteration.static_parts
    if window is not None and win["phase"][window] == "forward":
        mb = win["microbatch"][window]
        if mb is not None:
            inflight.add(int(mb))
    module, phase = STEP, "forward"
    if best is not None:
        event = iteration.columns("memory", ("module", "phase"))
        module, phase = event["module"][best], event["phase"][best]
    at = PeakAt(
        phase=win["phase"][window] if window is not None else phase,
        microbatch=_int(win["microbatch"][window]) if window is not None else None,
        chunk=_int(win["chunk"][window]) if window is not None else None,
        module=module,
    )
    return RoleMemory(
        params=parts.get("params", 0),
        grads=parts.get("grads", 0),
        optimizer=parts.get("optimizer", 0),
        workspaces=workspaces,
        activations=activations,
        temporary=temporary,
        peak=peak,
        peak_at=at,
        inflight=len(inflight),
        timeline=_timeline(iteration.static_bytes, ev, win, workspaces),
        most_steps_held=_most_held(win, life),
    )


def _int(value) -> int | None:
    return None if value is None else int(value)


def _lifetime_columns(ev: dict) -> dict:
    """`lifetimes` of memory event columns (seq, delta, storage), as columns, one entry per
    life: storage, life (0 for a storage's first, then 1, 2, ...), allocated, freed (2**62 when
    alive at the end), bytes. Storages allocated once and freed once (or never) are read with
    numpy; the others, few (resized storages), go through `lifetimes` itself."""
    import numpy as np

    seq, delta, storage = ev["seq"], ev["delta"], ev["storage"]
    order = np.argsort(storage, kind="stable")
    sid, d, sq = storage[order], delta[order], seq[order]
    starts = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]]) if len(sid) else np.array([], int)
    counts = np.diff(np.r_[starts, len(sid)])
    first_delta = d[starts]
    # One allocation, or one allocation and a free of all of it.
    second = np.where(counts == 2, d[np.minimum(starts + 1, len(d) - 1)], 0)
    simple = ((counts == 1) & (first_delta > 0)) | (
        (counts == 2) & (first_delta > 0) & (first_delta + second <= 0) & (second < 0)
    )
    none = (counts == 1) & (first_delta <= 0)  # a free of what was there before: no life
    out = {
        "storage": [sid[starts[simple]]],
        "life": [np.zeros(int(simple.sum()), dtype=np.int64)],
        "allocated": [sq[starts[simple]]],
        "freed": [
            np.where(counts[simple] == 2, sq[np.minimum(starts[simple] + 1, len(sq) - 1)], _ALIVE)
        ],
        "bytes": [first_delta[simple]],
    }
    for g in np.flatnonzero(~simple & ~none):
        a, b = starts[g], starts[g] + counts[g]
        events = [
            MemEvent(int(q), int(x), 0, "", "forward", int(sid[a])) for q, x in zip(sq[a:b], d[a:b])
        ]
        life = lifetimes(tuple(events))
        for key, at in life.allocated.items():
            s, n = key if isinstance(key, tuple) else (key, 0)
            for name, value in (
                ("storage", s),
                ("life", n),
                ("allocated", at),
                ("freed", life.freed.get(key, _ALIVE)),
                ("bytes", life.bytes[key]),
            ):
                out[name].append(np.array([value], dtype=np.int64))
    return {name: np.concatenate(parts) for name, parts in out.items()}


_ALIVE = 1 << 62
"""`freed` of a storage alive at the end of the trace."""


def _most_held(win: dict, life: dict) -> int:
    """The most forward steps whose held activations were alive at once."""
    import numpy as np

    held = np.array([h for h in win["held"].tolist() if h is not None], dtype=np.int64)
    first = life["life"] == 0
    mine = first & np.isin(life["storage"], held)
    # A held storage counted once per window that names it.
    names = np.unique(held, return_counts=True)
    times = np.searchsorted(names[0], life["storage"][mine])
    repeat = names[1][times]
    starts = np.repeat(life["allocated"][mine], repeat)
    ends = np.repeat(life["freed"][mine], repeat)
    if not len(starts):
        return 0
    at = np.concatenate([starts, ends])
    step = np.concatenate([np.ones(len(starts), np.int64), -np.ones(len(ends), np.int64)])
    order = np.lexsort((step, at))
    return max(0, int(np.cumsum(step[order]).max()))


def window_highs(static: int, ev: dict, win: dict, *, carry: bool) -> Any:
    """Highest live bytes of each window (numpy, in window order) from memory event and
    window columns: the level before it counts, and with `carry` the events one window read
    are not read again by a later one (as _timeline walks the windows in order)."""
    import numpy as np

    seq, live = ev["seq"], ev["live"]
    lo = np.searchsorted(seq, win["first"], side="left")
    hi = np.searchsorted(seq, win["last"], side="right")
    if carry and len(lo):
        reach = np.maximum.accumulate(np.maximum(lo, hi))
        lo = np.maximum(np.r_[0, reach[:-1]], lo)
        hi = np.maximum(lo, hi)
    before = np.where(lo > 0, live[np.maximum(lo - 1, 0)] if len(live) else 0, static)
    top = before.copy()
    some = np.flatnonzero(hi > lo)
    if len(some):
        # maximum.reduceat reads live[lo:hi] at the even places of (lo, hi, lo, hi, ...).
        bounds = np.empty(2 * len(some), dtype=np.int64)
        bounds[0::2], bounds[1::2] = lo[some], hi[some]
        highs = np.maximum.reduceat(np.r_[live, 0], bounds)[0::2]
        top[some] = np.maximum(top[some], highs)
    return top


def _timeline(static: int, ev: dict, win: dict, workspaces: int) -> tuple[tuple[str, int], ...]:
    """Highest live bytes of each window, in order (a window without events keeps the level)."""
    top = window_highs(static, ev, win, carry=True) + workspaces
    return tuple(zip(win["phase"].tolist(), top.tolist()))


# ----------------------------------------------------------------------------- the verdict

GiB = 2**30


@dataclass(frozen=True)
class Verdict:
    """Whether every GPU holds what its rank takes: the caching allocator's reserve and what
    lives outside the allocator (analysis.device), plus the margin the user keeps (bytes)."""

    capacity: int
    """Memory of one GPU (cluster.gpu_memory_gib)."""
    overhead: int
    """The margin the user keeps free (cluster.reserved_overhead_gib; 0 by default)."""
    worst: int
    """The highest predicted allocated peak of any rank."""
    worst_ranks: tuple[int, ...]
    """Ranks with that peak."""
    oom_ranks: tuple[int, ...]
    """Ranks whose device memory plus the margin exceeds the capacity."""
    userbuffers: int = 0
    """Transformer Engine's userbuffers on every GPU (tp_comm_overlap): outside PyTorch's
    allocator, so not in the peak, but on the GPU (part of `binding.outside`)."""
    binding: Any = None
    """The analysis.device.DeviceMemory of the rank that takes the most of its GPU."""
    binding_ranks: tuple[int, ...] = ()
    expandable_ranks_oom: tuple[int, ...] | None = None
    """With expandable_segments:True (where the job does not set it): the ranks that would be
    out of memory then (None: the job sets it)."""
    expandable_headroom: int | None = None
    """With expandable_segments:True: the binding rank's headroom then."""

    @property
    def fits(self) -> bool:
        return not self.oom_ranks

    @property
    def headroom(self) -> int:
        """Capacity left on the tightest rank (negative: what its allocator would reserve
        beyond the GPU's room)."""
        return self.binding.fit[1]


_DIRECTIONS = {
    "raises": "could raise the peak",
    "lowers": "could lower the peak",
    "either": "could raise or lower the peak",
    "unknown": "effect on the peak unknown",
    "traffic": "changes communication, not the peak",
}


def not_modelled_text(items: list[dict]) -> str:
    """One sentence for the verdict: what the prediction leaves out, by feature, and the way
    each could move the peak. `items`: the report's memory_verdict.not_modelled."""
    by_feature: dict[tuple[str, str], list[str]] = {}
    for item in items:
        by_feature.setdefault((item["feature"], item["direction"]), []).append(item["option"])
    parts = [
        f"{feature} ({', '.join(options)}: {_DIRECTIONS[direction]})"
        for (feature, direction), options in by_feature.items()
    ]
    return "Not modelled, left out of these figures: " + "; ".join(parts) + "."


def verdict(job, roles) -> Verdict:
    """`roles`: (ranks, RoleMemory, analysis.device.DeviceMemory) for every role, the device
    memory's fit asked against the GPU's memory less the margin kept free."""
    from metatrace.config.allocator import parse_alloc_conf
    from metatrace.config.userbuffers import userbuffer_bytes

    capacity = round(job.cluster.gpu_memory_gib * GiB)
    overhead = round(job.cluster.reserved_overhead_gib * GiB)
    worst = max(m.peak for _, m, _ in roles)
    worst_ranks = sorted(r for ranks, m, _ in roles if m.peak == worst for r in ranks)
    binding = min((d for _, _, d in roles), key=lambda d: d.fit[1])
    binding_ranks = sorted(r for ranks, _, d in roles if d.fit[1] == binding.fit[1] for r in ranks)
    oom = sorted(r for ranks, _, d in roles if not d.fit[0] for r in ranks)
    expandable_oom = expandable_room = None
    if not parse_alloc_conf(job.cluster.allocator_conf or "").expandable_segments:
        fits = [(ranks, d.expandable_fit) for ranks, _, d in roles]
        expandable_oom = tuple(sorted(r for ranks, (ok, _) in fits if not ok for r in ranks))
        expandable_room = min(left for _, (_, left) in fits)
    return Verdict(
        capacity,
        overhead,
        worst,
        tuple(worst_ranks),
        tuple(oom),
        userbuffer_bytes(job),
        binding,
        tuple(binding_ranks),
        expandable_oom,
        expandable_room,
    )
