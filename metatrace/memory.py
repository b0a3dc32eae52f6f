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
