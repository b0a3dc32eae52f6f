"""Memory over an iteration, from the records (pure functions, no torch).

Two traces per role feed it (metatrace.trace):
1. one micro-batch through the rank's chunks under megatron-core's forward_step/backward_step,
   with a Window around each chunk's forward and backward step;
2. the whole iteration under megatron-core's own schedule, each step replayed from what (1)
   measured (metatrace.iteration), then the optimizer step.

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

from dataclasses import dataclass

from metatrace.hooks.records import STEP, MemEvent, Trace, Window


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
    size: dict[int, int] = {}
    largest: dict[int, int] = {}
    allocated: dict[int, int] = {}
    freed: dict[int, int] = {}
    for e in memory:
        now = size.get(e.storage, 0) + e.delta
        size[e.storage] = now
        if e.delta > 0:
            allocated.setdefault(e.storage, e.seq)
            largest[e.storage] = max(largest.get(e.storage, 0), now)
        elif now <= 0 and e.storage in allocated:
            freed[e.storage] = e.seq
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


def step_profiles(trace: Trace) -> dict[tuple[str, int], StepProfile]:
    """{(phase, chunk): StepProfile} from a one-micro-batch trace with Windows."""
    life = lifetimes(trace.memory)
    persistent = life.persistent()
    windows = {(w.phase, w.chunk): w for w in trace.windows if w.chunk is not None}
    profiles = {}
    for (phase, chunk), w in windows.items():
        excess, module = _window_excess(trace, w, persistent)
        held = output = 0
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
                elif sid == w.output:
                    output += life.bytes[sid]
            excess = max(excess, held + output)
        profiles[(phase, chunk)] = StepProfile(phase, chunk, held, output, excess, module)
    return profiles


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
    """The iteration's peak and its parts, from the two traces of a role (see module doc)."""
    workspaces = persistent_bytes(micro)
    life = lifetimes(iteration.memory)
    best = None
    for e in iteration.memory:
        if best is None or e.live > best.live:
            best = e
    peak = (best.live if best is not None else iteration.static_bytes) + workspaces
    window = None
    if best is not None:
        for w in iteration.windows:
            if w.first <= best.seq <= w.last:
                window = w
                break
    held = {w.held: w for w in iteration.windows if w.held is not None}
    activations = temporary = 0
    inflight = set()
    if best is not None:
        # Storages alive right after the peak event, the static ones aside.
        since = window.first if window is not None else _last_window_end(iteration, best.seq)
        for sid, seq in life.allocated.items():
            if seq > best.seq or life.freed.get(sid, best.seq + 1) <= best.seq:
                continue
            size = life.bytes[sid]
            if sid in held:
                activations += size
                inflight.add(held[sid].microbatch)
            elif seq >= since:
                temporary += size
            else:
                activations += size
    parts = iteration.static_parts
    if window is not None and window.phase == "forward" and window.microbatch is not None:
        inflight.add(window.microbatch)
    at = PeakAt(
        phase=window.phase if window is not None else (best.phase if best else "forward"),
        microbatch=window.microbatch if window is not None else None,
        chunk=window.chunk if window is not None else None,
        module=best.module if best is not None else STEP,
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
        timeline=_timeline(iteration, workspaces),
        most_steps_held=_most_held(iteration, life),
    )


def _most_held(trace: Trace, life: Lifetimes) -> int:
    changes = []
    for w in trace.windows:
        if w.held is not None and w.held in life.allocated:
            changes.append((life.allocated[w.held], 1))
            changes.append((life.freed.get(w.held, 1 << 62), -1))
    most = now = 0
    for _, delta in sorted(changes):
        now += delta
        most = max(most, now)
    return most


def _timeline(trace: Trace, workspaces: int) -> tuple[tuple[str, int], ...]:
    """Highest live bytes of each window, in order (a window without events keeps the level)."""
    out = []
    events = trace.memory
    i, live = 0, trace.static_bytes
    for w in trace.windows:
        while i < len(events) and events[i].seq < w.first:
            live = events[i].live
            i += 1
        top = live
        while i < len(events) and events[i].seq <= w.last:
            live = events[i].live
            top = max(top, live)
            i += 1
        out.append((w.phase, top + workspaces))
    return tuple(out)


def _last_window_end(trace: Trace, seq: int) -> int:
    end = 0
    for w in trace.windows:
        if w.last < seq:
            end = max(end, w.last + 1)
    return end


# ----------------------------------------------------------------------------- the verdict

GiB = 2**30


@dataclass(frozen=True)
class Verdict:
    """Whether every GPU holds its peak plus the reserved overhead (bytes)."""

    capacity: int
    """Memory of one GPU (cluster.gpu_memory_gib)."""
    overhead: int
    """Reserved for what the caching allocator does not hand out (cluster.reserved_overhead_gib)."""
    worst: int
    """The highest predicted peak of any rank."""
    worst_ranks: tuple[int, ...]
    """Ranks with that peak."""
    oom_ranks: tuple[int, ...]
    """Ranks whose peak plus the overhead exceeds the capacity."""

    @property
    def fits(self) -> bool:
        return not self.oom_ranks

    @property
    def headroom(self) -> int:
        """Capacity left on the tightest rank (negative: how much is missing)."""
        return self.capacity - self.overhead - self.worst


def verdict(job, roles) -> Verdict:
    """`roles`: (ranks, RoleMemory) for every role."""
    capacity = round(job.cluster.gpu_memory_gib * GiB)
    overhead = round(job.cluster.reserved_overhead_gib * GiB)
    worst = max(m.peak for _, m in roles)
    worst_ranks = sorted(r for ranks, m in roles if m.peak == worst for r in ranks)
    oom = sorted(r for ranks, m in roles if m.peak + overhead > capacity for r in ranks)
    return Verdict(capacity, overhead, worst, tuple(worst_ranks), tuple(oom))
