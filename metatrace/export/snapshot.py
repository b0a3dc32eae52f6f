"""A rank's predicted memory as a PyTorch memory snapshot, laid out by the simulated caching
allocator (pure, no torch).

`torch.cuda.memory._snapshot()` returns `{"segments": [...], "device_traces": [[entry, ...]]}`;
pickled, it opens in PyTorch's memory visualizer (https://pytorch.org/memory_viz) and in
`torch.cuda._memory_viz`. Writing the prediction in that format lets it be browsed with the
tools used on measured snapshots: memory over time, the segments and the holes between blocks,
and for every allocation a "stack" saying what allocated it.

The device trace (device 0, stream 0) is the allocations the verdict's allocator simulation
replays (metatrace.analysis.device.allocations: the static storages, the traced micro-batch,
the iteration twice, each replayed step run as the traced step ran it), through the simulated
allocator under the job's PYTORCH_ALLOC_CONF (metatrace.analysis.allocator): every
`segment_alloc` (or `segment_map` with expandable segments) where it reserves memory, every
`alloc` at its block's address and size (512-byte rounded, a block it does not split whole),
every free as `free_requested` then `free_completed`. The highest allocated bytes of the trace
is the simulation's allocated peak (at least `role_memory(...).peak`, the blocks' rounding
aside); the segments' sum at its most is the predicted `max_memory_reserved()`. The final
`segments` hold every block then, allocated or cached (inactive).

Frames, innermost first, are `{"filename": what the frame is, "line": 0, "name": its value}`
(the viewer shows `filename:line:name`): `static` (the part: params, grads, optimizer) or
`workspace` (kept from the first micro-batch), `module` (FQN and phase), `step` (set-up; the
first micro-batch; iteration i's forward or backward of micro-batch m, chunk c, its optimizer
step or the schedule's work between steps), and `metatrace` (rank and pipeline stage).
`time_us` is the event's index, not a time.
"""

from __future__ import annotations

import bisect
import pickle
from typing import TYPE_CHECKING

from metatrace.analysis.allocator import CachingAllocator
from metatrace.analysis.device import (
    allocations,
    simulate,
    simulated_iteration,
)
from metatrace.analysis.memory import lifetimes, role_memory
from metatrace.config.allocator import AllocatorConfig
from metatrace.records import Trace, Window

if TYPE_CHECKING:
    from metatrace.records import RoleTrace

STAGE = "{stage}"
"""In a snapshot path: write one file per pipeline stage, this replaced by the stage number."""
SETUP = "set-up (the model, DDP's buffers, the optimizer)"
FIRST = "the first micro-batch"


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


class _Labels:
    """The frames of an allocation, by its key in analysis.device.allocations."""

    def __init__(self, stacks: _Stacks, micro: Trace, iteration: Trace | None):
        self.stacks = stacks
        self.parts: list[tuple[int, str]] = []  # (first static index of the part, part)
        start = 0
        sizes = list(micro.static_sizes)
        for part, nbytes in micro.static_parts.items():
            self.parts.append((start, part))
            while start < len(sizes) and nbytes > 0:
                nbytes -= sizes[start]
                start += 1
        self.micro = _first_events(micro)
        self.persistent = lifetimes(micro.memory).persistent()
        self.micro_windows = _windows(micro)
        self.iteration = _first_events(iteration) if iteration is not None else {}
        self.iteration_windows = _windows(iteration) if iteration is not None else ((), [])

    def frames(self, key) -> list:
        if key[0] == "grown":
            key = key[1]
        kind = key[0]
        if kind == "static":
            i = bisect.bisect_right([first for first, _ in self.parts], key[1]) - 1
            part = self.parts[i][1] if i >= 0 else "static"
            return self.stacks.get(("static", part), ("step", SETUP))
        if kind == "iteration":
            module, phase, seq = self.iteration.get(key[-1], ("", "", 0))
            where = _window_label(*self.iteration_windows, seq)
            return self.stacks.get(
                ("module", f"{module or '(model)'} ({phase})"),
                ("step", f"iteration {key[1] + 1}: {where}"),
            )
        module, phase, seq = self.micro.get(key[-1], ("", "", 0))
        labels = ("module", f"{module or '(model)'} ({phase})")
        if kind == "micro":
            if key[1] in self.persistent:
                return self.stacks.get(("workspace", f"{labels[1]}, kept"), ("step", FIRST))
            where = _window_label(*self.micro_windows, seq)
            return self.stacks.get(labels, ("step", f"{FIRST}: {where}"))
        rep, microbatch = key[1], key[2]  # ("step", rep, micro-batch, storage)
        windows, firsts = self.micro_windows
        i = bisect.bisect_right(firsts, seq) - 1
        w = windows[i] if i >= 0 else None
        step = f"{w.phase} of micro-batch {microbatch}, chunk {w.chunk}" if w else "a step"
        return self.stacks.get(labels, ("step", f"iteration {rep + 1}: {step}"))


def _first_events(trace: Trace) -> dict:
    """{storage: (module, phase, seq) of its first allocation}."""
    cols = trace.columns("memory", ("storage", "delta", "module", "phase", "seq"))
    out: dict = {}
    for sid, delta, module, phase, seq in zip(
        *(cols[n].tolist() for n in ("storage", "delta", "module", "phase", "seq"))
    ):
        if delta > 0 and sid not in out:
            out[sid] = (module, phase, seq)
    return out


def _windows(trace: Trace) -> tuple[tuple[Window, ...], list[int]]:
    windows = tuple(sorted(trace.windows, key=lambda w: w.first))
    return windows, [w.first for w in windows]


class _Recording(CachingAllocator):
    """The simulated allocator, writing the snapshot's device trace as it goes."""

    def __init__(self, config: AllocatorConfig, labels: _Labels):
        super().__init__(config)
        self.labels = labels
        self.entries: list[dict] = []
        self.segment_log = []
        self.frames: dict = {}  # key -> frames of what it holds

    def _entry(self, action: str, addr: int, size: int, frames: list) -> None:
        self.entries.append(
            {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": 0,
                "time_us": len(self.entries),
                "frames": frames,
            }
        )

    def malloc(self, key, size: int, stream: int = 0) -> None:
        super().malloc(key, size, stream)
        for action, addr, nbytes in self.segment_log:
            self._entry(action, addr, nbytes, [])
        self.segment_log.clear()
        block = self.live[key][0]
        frames = self.frames[key] = self.labels.frames(key)
        self._entry("alloc", block.addr, block.size, frames)

    def free(self, key) -> None:
        block = self.live[key][0]
        frames = self.frames.pop(key)
        # The caching allocator logs both; on one stream the second follows at once.
        self._entry("free_requested", block.addr, block.size, frames)
        self._entry("free_completed", block.addr, block.size, frames)
        super().free(key)

    def rename(self, old, new) -> None:
        super().rename(old, new)
        self.frames[new] = self.frames.pop(old)

    def final_segments(self) -> list[dict]:
        """The segments at the end, every block in them allocated or cached."""
        out = []
        for blocks in self.segment_blocks():
            total = sum(b.size for b in blocks)
            allocated = sum(b.size for b in blocks if b.allocated)
            out.append(
                {
                    "device": 0,
                    "address": blocks[0].addr,
                    "total_size": total,
                    "allocated_size": allocated,
                    "active_size": allocated,
                    "requested_size": allocated,
                    "stream": 0,
                    "segment_type": "small" if total == 2 << 20 else "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": self.config.expandable_segments,
                    "frames": [],
                    "blocks": [_block(b, self.frames.get(b.key)) for b in blocks],
                }
            )
        return out


def _block(b, frames) -> dict:
    if b.allocated:
        return {
            "address": b.addr,
            "size": b.size,
            "requested_size": b.size,
            "state": "active_allocated",
            "frames": frames,
        }
    return {
        "address": b.addr,
        "size": b.size,
        "requested_size": 0,
        "state": "inactive",
        "frames": [],
    }


def role_snapshot(
    micro: Trace,
    iteration: Trace,
    *,
    rank: int,
    stage: int,
    config: AllocatorConfig | None = None,
    steady=None,
) -> dict:
    """The memory snapshot of one role (see the module docstring): `micro` is the role's
    one-micro-batch trace, `iteration` the whole iteration; `config` the allocator's settings
    (PyTorch's defaults); `steady` as analysis.device.allocations takes it."""
    stacks = _Stacks(
        f"rank {rank}, pipeline stage {stage}: set-up, the first micro-batch, two iterations"
    )
    labels = _Labels(stacks, micro, simulated_iteration(iteration))
    alloc = _Recording(config or AllocatorConfig(), labels)
    simulate(allocations(micro, iteration, steady=steady), alloc.config, alloc=alloc)
    return {"segments": alloc.final_segments(), "device_traces": [alloc.entries]}


def _window_label(windows: tuple[Window, ...], firsts: list[int], seq: int) -> str:
    """What the trace was doing at `seq`: a chunk's step, another step, or neither."""
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


def write_snapshots(
    job, roles: tuple[RoleTrace, ...], template: str, config: AllocatorConfig | None = None
) -> list[str]:
    """Write the snapshot file(s) `template` names, the allocator under `config`; returns what
    to tell the user."""
    from metatrace.analysis.memory import steady_microbatches
    from metatrace.errors import ConfigError
    from metatrace.render.format import size

    lines = []
    for path, rt, peak in chosen_roles(roles, template):
        snap = role_snapshot(
            rt.trace,
            rt.iteration,
            rank=rt.role.rank,
            stage=rt.role.pp_stage,
            config=config,
            steady=steady_microbatches(job, rt),
        )
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
    lines.append(
        "(open with https://pytorch.org/memory_viz; segments and addresses are the simulated "
        "caching allocator's)"
    )
    return lines
