"""A rank's predicted memory over one iteration as a PyTorch memory snapshot (pure, no torch).

`torch.cuda.memory._snapshot()` returns `{"segments": [...], "device_traces": [[entry, ...]]}`;
pickled, it opens in PyTorch's memory visualizer (https://pytorch.org/memory_viz) and in
`torch.cuda._memory_viz`. Writing the prediction in that format lets it be browsed with the
tools used on measured snapshots: memory over time, and for every allocation a "stack" saying
what allocated it.

The device trace (device 0, stream 0) holds, in order:
1. one `segment_alloc` of the whole synthetic segment;
2. what exists before the iteration (`memory.role_memory` counts it from the start): one
   `alloc` per static part (params, grads, optimizer) and one per workspace storage the traced
   micro-batch allocated and kept (`memory.persistent_bytes`);
3. every MemEvent of the iteration trace: `alloc` of a new storage, `free_requested` then
   `free_completed` of a freed one, and a free then an alloc at the new size for a storage that
   changed size (resize_). After each event the allocated bytes are the recorded `live` plus
   the workspaces, so the highest allocated bytes of the trace is `role_memory(...).peak`
   (the free before the re-alloc of a resize only dips below it).

Frames, innermost first, are `{"filename": what the frame is, "line": 0, "name": its value}`
(the viewer shows `filename:line:name`): `tensor` (the activations a replayed forward step keeps,
or its output handed on), `module` (FQN and phase), `step` (the window: forward or backward of
micro-batch m, chunk c; optimizer; before the iteration; between steps), and `metatrace` (rank
and pipeline stage). The final `segments` hold the blocks still allocated at the end.

Known limitations: addresses and the segment are synthetic. They come from a first-fit
allocator over one segment; the CUDA caching allocator's pools, block splitting, rounding and
caching are not simulated (sizes are the records' 512-byte blocks), so the segment size,
fragmentation and "reserved" memory the viewer shows mean nothing; allocated ("active") memory
is the prediction. `time_us` is the event's sequence number, not a time.
"""

from __future__ import annotations

import bisect
import pickle
from typing import TYPE_CHECKING

from metatrace.analysis.memory import lifetimes, role_memory
from metatrace.records import MemEvent, Trace, Window

if TYPE_CHECKING:
    from metatrace.records import RoleTrace

STAGE = "{stage}"
"""In a snapshot path: write one file per pipeline stage, this replaced by the stage number."""
BASE = 0x7F0000000000
"""Address of the synthetic segment (where CUDA allocations typically live)."""
SEGMENT_ROUND = 2 * 2**20
"""The caching allocator rounds large segments to 2 MiB; the synthetic segment too."""
BEFORE = "before the iteration"


class _Arena:
    """First-fit over one address range: a sorted, coalesced free list below a bump pointer."""

    def __init__(self):
        self.free: list[tuple[int, int]] = []  # (offset, size)
        self.end = 0
        self.high = 0
        """The furthest end ever used: the segment's size."""

    def alloc(self, size: int) -> int:
        for i, (start, room) in enumerate(self.free):
            if room >= size:
                if room == size:
                    del self.free[i]
                else:
                    self.free[i] = (start + size, room - size)
                return start
        start, self.end = self.end, self.end + size
        self.high = max(self.high, self.end)
        return start

    def release(self, start: int, size: int) -> None:
        i = bisect.bisect(self.free, (start, size))
        if i < len(self.free) and start + size == self.free[i][0]:
            size += self.free.pop(i)[1]
        if i > 0 and sum(self.free[i - 1]) == start:
            i -= 1
            start, before = self.free.pop(i)
            size += before
        if start + size == self.end:
            self.end = start  # the top of the range is free again: bump from there
        else:
            self.free.insert(i, (start, size))


class _Timeline:
    """The device trace being written and the blocks allocated now, by key."""

    def __init__(self):
        self.arena = _Arena()
        self.entries: list[dict] = []
        self.blocks: dict[object, tuple[int, int, list]] = {}  # key -> (offset, size, frames)

    def _entry(self, action: str, offset: int, size: int, frames: list, time: int) -> None:
        self.entries.append(
            {
                "action": action,
                "addr": BASE + offset,
                "size": size,
                "stream": 0,
                "time_us": time,
                "frames": frames,
            }
        )

    def alloc(self, key, size: int, frames: list, time: int) -> None:
        offset = self.arena.alloc(size)
        self.blocks[key] = (offset, size, frames)
        self._entry("alloc", offset, size, frames, time)

    def free(self, key, frames: list, time: int) -> None:
        offset, size, _ = self.blocks.pop(key)
        self.arena.release(offset, size)
        # The caching allocator logs both; on one stream the second follows at once.
        self._entry("free_requested", offset, size, frames, time)
        self._entry("free_completed", offset, size, frames, time)

    def snapshot(self) -> dict:
        total = max(SEGMENT_ROUND, -(-self.arena.high // SEGMENT_ROUND) * SEGMENT_ROUND)
        start = {
            "action": "segment_alloc",
            "addr": BASE,
            "size": total,
            "stream": 0,
            "time_us": 0,
            "frames": [],
        }
        return {"segments": [self._segment(total)], "device_traces": [[start, *self.entries]]}

    def _segment(self, total: int) -> dict:
        """The segment at the end of the trace: allocated blocks, and the gaps as inactive."""
        blocks, at = [], 0
        for offset, size, frames in sorted(self.blocks.values(), key=lambda b: b[0]):
            if offset > at:
                blocks.append(_inactive(at, offset - at))
            blocks.append(
                {
                    "address": BASE + offset,
                    "size": size,
                    "requested_size": size,
                    "state": "active_allocated",
                    "frames": frames,
                }
            )
            at = offset + size
        if at < total:
            blocks.append(_inactive(at, total - at))
        allocated = sum(size for _, size, _ in self.blocks.values())
        return {
            "device": 0,
            "address": BASE,
            "total_size": total,
            "allocated_size": allocated,
            "active_size": allocated,
            "requested_size": allocated,
            "stream": 0,
            "segment_type": "large",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": [],
            "blocks": blocks,
        }


def _inactive(offset: int, size: int) -> dict:
    return {
        "address": BASE + offset,
        "size": size,
        "requested_size": 0,
        "state": "inactive",
        "frames": [],
    }


class _Stacks:
    """Frame lists by their labels, built once: entries share them (pickle stores each once)."""

    def __init__(self, root: str):
        self.root = root
        self._cache: dict[tuple, list] = {}

    def get(self, *labels: tuple[str, str]) -> list:
        """`labels`: (kind, value) pairs, innermost first; the rank's frame goes last."""
        frames = self._cache.get(labels)
        if frames is None:
            frames = [{"filename": kind, "line": 0, "name": value} for kind, value in labels]
            frames.append({"filename": "metatrace", "line": 0, "name": self.root})
            self._cache[labels] = frames
        return frames


def role_snapshot(micro: Trace, iteration: Trace, *, rank: int, stage: int) -> dict:
    """The memory snapshot of one role's iteration (see the module docstring).

    `micro` is the role's one-micro-batch trace (its kept workspaces exist before the
    iteration, as in role_memory), `iteration` the whole iteration."""
    stacks = _Stacks(f"rank {rank}, pipeline stage {stage}: one training iteration")
    timeline = _Timeline()
    _before_iteration(timeline, stacks, micro, iteration)
    _iteration(timeline, stacks, iteration)
    return timeline.snapshot()


def _before_iteration(timeline: _Timeline, stacks: _Stacks, micro: Trace, iteration: Trace):
    """Static parts and workspaces: allocated before the iteration, held throughout."""
    parts = dict(iteration.static_parts)
    rest = iteration.static_bytes - sum(parts.values())
    if rest > 0:  # static memory the tracer did not split into parts
        parts["static"] = rest
    for part, size in parts.items():
        if size > 0:
            frames = stacks.get(("static", part), ("step", BEFORE))
            timeline.alloc(("static", part), size, frames, 0)
    life = lifetimes(micro.memory)
    first: dict[int, MemEvent] = {}
    for e in micro.memory:
        if e.delta > 0:
            first.setdefault(e.storage, e)
    for sid in sorted(life.persistent(), key=life.allocated.get):
        e = first[sid]
        frames = stacks.get(
            ("workspace", f"{_module(e)} ({e.phase}), kept from earlier iterations"),
            ("step", BEFORE),
        )
        timeline.alloc(("workspace", sid), life.bytes[sid], frames, 0)


def _iteration(timeline: _Timeline, stacks: _Stacks, iteration: Trace) -> None:
    """Every MemEvent as an alloc or free of its storage, labelled with module and window."""
    windows = iteration.windows
    firsts = [w.first for w in windows]
    tensors = {w.held: "activations kept for backward" for w in windows if w.held is not None}
    tensors.update(
        (w.output, "output handed to the next stage") for w in windows if w.output is not None
    )
    size: dict[int, int] = {}
    for e in iteration.memory:
        if e.delta == 0:
            continue
        old = size.get(e.storage, 0)
        new = old + e.delta
        if new < 0:
            raise ValueError(
                f"event {e.seq} frees {-e.delta} bytes of storage {e.storage}, which holds {old}"
            )
        labels = (
            ("module", f"{_module(e)} ({e.phase})"),
            ("step", _window_label(windows, firsts, e.seq)),
        )
        if e.storage in tensors:
            labels = (("tensor", tensors[e.storage]), *labels)
        frames = stacks.get(*labels)
        key = ("storage", e.storage)
        if old:
            timeline.free(key, frames, e.seq)
        if new:
            timeline.alloc(key, new, frames, e.seq)
        size[e.storage] = new


def _module(e: MemEvent) -> str:
    return e.module or "(model)"


def _window_label(windows: tuple[Window, ...], firsts: list[int], seq: int) -> str:
    """What the iteration was doing at `seq`: a chunk's step, another step, or neither."""
    i = bisect.bisect_right(firsts, seq) - 1
    if i < 0 or seq > windows[i].last:
        return "between steps (the schedule's own work)"
    w = windows[i]
    if w.chunk is None:
        return w.phase
    if w.microbatch is None:
        return f"{w.phase} of chunk {w.chunk}"
    return f"{w.phase} of micro-batch {w.microbatch}, chunk {w.chunk}"


# ----------------------------------------------------------------------------- files


def stage_paths(template: str, stages: int) -> list[str]:
    """The files `template` names: one per pipeline stage with {stage}, else itself."""
    if STAGE not in template:
        return [template]
    return [template.replace(STAGE, str(s)) for s in range(stages)]


def chosen_roles(roles: tuple[RoleTrace, ...], template: str) -> list[tuple[str, RoleTrace, int]]:
    """(path, role, peak) to write: every pipeline stage's role when `template` holds {stage},
    else the role with the highest peak (the first stage among equals): the rank that decides
    whether the job fits."""
    peaks = [role_memory(rt.trace, rt.iteration).peak for rt in roles]
    if STAGE in template:
        return [
            (template.replace(STAGE, str(rt.role.pp_stage)), rt, peak)
            for rt, peak in zip(roles, peaks)
        ]
    best = max(range(len(roles)), key=lambda i: (peaks[i], -i))
    return [(template, roles[best], peaks[best])]


def write_snapshots(roles: tuple[RoleTrace, ...], template: str) -> list[str]:
    """Write the snapshot file(s) `template` names; returns what to tell the user."""
    from metatrace.errors import ConfigError
    from metatrace.render.format import size

    lines = []
    for path, rt, peak in chosen_roles(roles, template):
        snap = role_snapshot(rt.trace, rt.iteration, rank=rt.role.rank, stage=rt.role.pp_stage)
        try:
            with open(path, "wb") as f:
                pickle.dump(snap, f)
        except OSError as e:
            raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None
        which = "" if STAGE in template else ", the highest peak"
        lines.append(
            f"Memory snapshot of rank {rt.role.rank} (pipeline stage {rt.role.pp_stage}{which}: "
            f"{size(peak)}) written to {path}"
        )
    lines.append("(open with https://pytorch.org/memory_viz; addresses and segments are synthetic)")
    return lines
