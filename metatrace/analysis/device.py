"""A rank's device memory: the caching allocator's reserve, simulated over the rank's recorded
allocations (analysis.allocator), and what lives outside the allocator (pure, no torch).

The allocations a rank makes, in order (`allocations`):
1. its static storages (parameters and buffers module by module, DDP's buffers, the
   optimizer's main parameters and state), as the recorder first saw them (Trace.static_sizes);
2. the traced micro-batch as it ran: every storage at its own size and moment;
3. the iteration, twice: its schedule's own work (pipeline transfers, the loss, the gradient
   synchronisation, the optimizer step) as recorded, and each chunk's forward and backward step
   of each micro-batch as the traced micro-batch's step ran it (the iteration replays a step as
   a few lumps of the same bytes; the allocator sees the step's every tensor). A long
   iteration's steady state repeats: the simulation runs its first micro-batches and two
   periods of its steady state (metatrace.tracing.steady).

A storage that grows in place (resize_) is a new allocation and the old one's free, as
PyTorch's resize_ does; one that shrinks keeps its block.
"""

from __future__ import annotations

from dataclasses import dataclass

from metatrace.analysis.allocator import (
    AllocatorConfig,
    CachingAllocator,
    OutOfMemory,
    Peak,
)
from metatrace.records import Trace

FREE = -(1 << 62)
"""The delta of a free whatever the storage's size."""
STEADY_PERIODS = 2
"""Periods of a long iteration's steady state the simulation runs (their allocations repeat:
the reserve the first period leaves serves the next)."""


def _window_of(windows: dict, seq: int):
    """Index of the chunk step window holding `seq` (windows sorted by first), or None."""
    import bisect

    i = bisect.bisect_right(windows["first"], seq) - 1
    if i >= 0 and seq <= windows["last"][i]:
        return i
    return None


def _columns(trace: Trace):
    ev = trace.columns("memory", ("seq", "delta", "storage"))
    win = trace.columns("windows", ("phase", "chunk", "microbatch", "first", "last", "output"))
    steps = [
        i
        for i in range(len(win["first"]))
        if win["chunk"][i] is not None and win["phase"][i] in ("forward", "backward")
    ]
    windows = {name: [win[name][i] for i in steps] for name in win}
    order = sorted(range(len(steps)), key=lambda j: windows["first"][j])
    windows = {name: [values[j] for j in order] for name, values in windows.items()}
    return (
        ev["seq"].tolist(),
        ev["delta"].tolist(),
        ev["storage"].tolist(),
        windows,
    )


@dataclass
class _Step:
    """A traced micro-batch's chunk step, as the iteration's replay of it must run it."""

    events: list
    """[(delta, storage)] of the storages the micro-batch's chunk steps allocated."""
    after: list
    """Storages the step allocated that the micro-batch freed outside any chunk step (but its
    output, which the schedule frees): freed right after the step."""
    output: int | None


def _micro_steps(micro: Trace) -> tuple[dict, set]:
    """{(phase, chunk): _Step} of the traced micro-batch, and its persistent storages."""
    seqs, deltas, sids, win = _columns(micro)
    owner: dict = {}  # storage -> window index that allocated it
    freed_in: dict = {}  # storage -> window index where freed (None: outside windows)
    size: dict = {}
    for seq, delta, sid in zip(seqs, deltas, sids):
        now = size.get(sid, 0) + delta
        size[sid] = now
        if delta > 0 and sid not in owner and now == delta:
            owner[sid] = _window_of(win, seq)
        elif now <= 0 and sid in owner:
            freed_in[sid] = _window_of(win, seq)
    persistent = {sid for sid in owner if sid not in freed_in}
    steps: dict = {}
    for i in range(len(win["first"])):
        key = (win["phase"][i], win["chunk"][i])
        steps[key] = _Step([], [], win["output"][i])
    for seq, delta, sid in zip(seqs, deltas, sids):
        i = _window_of(win, seq)
        if i is None or sid in persistent or owner.get(sid) is None:
            continue
        steps[(win["phase"][i], win["chunk"][i])].events.append((delta, sid))
    for sid, i in owner.items():
        if i is not None and sid in freed_in and freed_in[sid] is None:
            step = steps[(win["phase"][i], win["chunk"][i])]
            if sid != step.output:
                step.after.append(sid)
    return steps, persistent


def allocations(micro: Trace, iteration: Trace | None):
    """The rank's allocations in order: (delta bytes, key) with keys unique per tensor life
    (see the module docstring); a positive delta is an allocation."""
    yield from ((n, ("static", i)) for i, n in enumerate(micro.static_sizes))
    seqs, deltas, sids, _ = _columns(micro)
    for delta, sid in zip(deltas, sids):
        yield delta, ("micro", sid)
    if iteration is None:
        return
    recipe = getattr(iteration, "recipe", None)
    if recipe is not None:  # a long iteration: its first micro-batches and two periods
        steady, n = recipe
        iteration = steady.trace(min(n, STEADY_PERIODS))
    steps, _ = _micro_steps(micro)
    seqs, deltas, sids, win = _columns(iteration)
    coarse = set()  # the replay's lumps: storages allocated inside a chunk step
    size: dict = {}
    for seq, delta, sid in zip(seqs, deltas, sids):
        now = size.get(sid, 0) + delta
        size[sid] = now
        if delta > 0 and now == delta and _window_of(win, seq) is not None:
            coarse.add(sid)
    freed_in_iteration = {sid for sid, now in size.items() if now <= 0}
    count = len(win["first"])
    for rep in range(2):
        outputs: dict = {}  # the replay's output lump -> the traced step's output
        j = 0

        def step_events(i, rep=rep, outputs=outputs):
            mb, step = win["microbatch"][i], steps.get((win["phase"][i], win["chunk"][i]))
            if step is None:
                return
            for d, s in step.events:
                yield d, ("step", rep, mb, s)
            for s in step.after:
                yield FREE, ("step", rep, mb, s)
            if win["output"][i] is not None and step.output is not None:
                outputs[win["output"][i]] = ("step", rep, mb, step.output)

        for seq, delta, sid in zip(seqs, deltas, sids):
            while j < count and win["first"][j] <= seq:
                yield from step_events(j)
                j += 1
            if sid in outputs:
                if delta < 0:
                    yield FREE, outputs[sid]
                continue
            if sid in coarse:
                continue
            if rep and sid not in freed_in_iteration:
                continue  # kept from the first iteration (workspaces made there)
            yield delta, ("iteration", rep, sid)
        while j < count:
            yield from step_events(j)
            j += 1


@dataclass(frozen=True)
class Reserve:
    """What the simulated allocator reserved for a rank (bytes)."""

    reserved: int
    """Peak of the segments (torch.cuda.max_memory_reserved())."""
    allocated: int
    """Peak of the blocks allocated (torch.cuda.max_memory_allocated(), at block sizes)."""
    at_peak_allocated: int
    """Blocks allocated when the reserve reached its peak."""
    holes: tuple[tuple[int, object], ...]
    """The largest cached free blocks at the peak of the reserve: (bytes, key of the tensor
    whose free left them)."""
    segments: int
    oom: OutOfMemory | None = None
    """Where the allocator ran out of `capacity`, if it did."""
    retries: int = 0
    """Times it freed its cache to find room (num_alloc_retries)."""


def simulate(events, config: AllocatorConfig, capacity: int | None = None) -> Reserve:
    """Run `events` ((delta, key) as allocations() gives) through the allocator."""
    alloc = CachingAllocator(config, capacity)
    size: dict = {}
    generation: dict = {}
    oom = None
    try:
        for delta, key in events:
            now = size.get(key, 0)
            if delta > 0:
                if now:  # grown in place: a new block, the old one freed
                    gen = generation.get(key, 0)
                    alloc.malloc((key, gen + 1), now + delta)
                    alloc.free((key, gen))
                    generation[key] = gen + 1
                else:
                    alloc.malloc((key, generation.get(key, 0)), delta)
                size[key] = now + delta
            elif now:
                if now + delta <= 0:
                    alloc.free((key, generation.get(key, 0)))
                    generation[key] = generation.get(key, 0) + 1
                    del size[key]
                else:
                    size[key] = now + delta
    except OutOfMemory as e:
        oom = e
    peak: Peak = alloc.peak
    return Reserve(
        reserved=peak.reserved,
        allocated=alloc.peak_allocated,
        at_peak_allocated=peak.allocated,
        holes=tuple(peak.holes),
        segments=alloc.segments,
        oom=oom,
        retries=alloc.retries,
    )
