"""Memory over the iteration, per pipeline stage: two rows of blocks on one scale from 0 to the
highest peak, and the parts of the pipeline schedule below them (formatting only; the levels
are the Analysis' memory timelines)."""

from __future__ import annotations

from rich.text import Text

from metatrace.render.format import size

_BARS = " ▁▂▃▄▅▆▇█"
# The parts of a schedule under the bars: the warm-up's forward steps, the steady state's
# forward and backward steps in turn, the cool-down's backward steps, then the rest by phase.
# Each with its label and the short one for a run of fewer columns.
_PART = {
    "warm-up": ("fwd", "F"),
    "steady": ("1F1B", "FB"),
    "cool-down": ("bwd", "B"),
    "grad sync": ("G", "G"),
    "optimizer": ("O", "O"),
}


def build_timeline(roles, width: int | None = None) -> Timeline:
    """Memory over the iteration per stage, as wide as the console (or `width`). `roles`:
    RoleAnalysis with their memory."""
    return Timeline(
        [(f"stage {ra.role.pp_stage}", ra.memory.timeline, ra.memory.peak) for ra in roles],
        width,
    )


class Timeline:
    """Bars of memory over the iteration, one row of two-level blocks per stage on one scale
    from 0 to the highest peak of any stage; a column is one step (several columns a step when
    the width allows, the highest level of several steps when it does not). Below the bars the
    parts of the schedule, each labelled where it starts: fwd or F (the warm-up's forward
    steps), 1F1B (forward and backward steps in turn), bwd or B (the cool-down's backward
    steps), G (gradient sync), O (optimizer step)."""

    def __init__(self, stages, width: int | None = None) -> None:
        self.stages = stages  # (label, ((phase, bytes), ...), peak)
        self.width = width

    def __rich_console__(self, console, options):
        top = max(1, max(peak for _, _, peak in self.stages))
        label = max(len(name) for name, _, _ in self.stages)
        peaks = [size(peak) for _, _, peak in self.stages]
        room = (self.width or options.max_width) - label - max(len(p) for p in peaks) - 2
        room = max(8, room)
        for (name, steps, _), peak in zip(self.stages, peaks, strict=True):
            high, low, marks = _timeline_rows(steps, top, room)
            yield Text(f"{' ' * label} {high}".rstrip())
            yield Text(f"{name.rjust(label)} {low} {peak}")
            yield Text(f"{' ' * label} {marks}".rstrip(), style="dim")
        yield Text(
            f"Scale 0 to {size(top)} (the highest peak), shared by all stages; two rows of "
            "blocks a stage, a column the highest level of its steps. Below the bars the "
            "schedule: fwd (F) its warm-up's forward steps, 1F1B forward and backward steps in "
            "turn, bwd (B) its cool-down's backward steps, G gradient sync, O optimizer step.",
            style="dim",
        )


def schedule_parts(steps) -> list[str]:
    """Each step's part of the schedule: "warm-up" (a forward step before the first backward
    one), "steady" (from the first backward step to the last forward one), "cool-down" (a
    backward step after the last forward one), else its phase (grad sync, optimizer, ...)."""
    phases = [phase for phase, _ in steps]
    passes = [i for i, p in enumerate(phases) if p in ("forward", "backward")]
    first_b = next((i for i in passes if phases[i] == "backward"), len(phases))
    last_f = max((i for i in passes if phases[i] == "forward"), default=-1)
    parts = []
    for i, phase in enumerate(phases):
        if phase not in ("forward", "backward"):
            parts.append(phase)
        elif i < first_b:
            parts.append("warm-up")
        elif i > last_f:
            parts.append("cool-down")
        else:
            parts.append("steady")
    return parts


def _timeline_rows(steps, top: int, room: int) -> tuple[str, str, str]:
    """The upper and lower rows of blocks and the schedule's parts of one stage's steps in
    `room` columns (each step `room // len(steps)` columns when they fit, else consecutive
    steps of one part grouped: `_columns`)."""
    if not steps:
        return "", "", ""
    parts = schedule_parts(steps)
    if len(steps) <= room:
        each = room // len(steps)
        groups = [[i] for i in range(len(steps))]
    else:
        each, groups = 1, _columns(parts, room)
    high, low, columns = [], [], []
    for group in groups:
        at = max(group, key=lambda i: steps[i][1])
        level = steps[at][1]
        eighths = max(1, round(16 * level / top)) if level > 0 else 0
        low.append(_BARS[min(8, eighths)] * each)
        high.append(_BARS[max(0, eighths - 8)] * each)
        columns += [parts[at]] * each
    return "".join(high), "".join(low), _part_labels(columns)


def _columns(parts: list[str], room: int) -> list[list[int]]:
    """Step indices grouped into at most `room` columns: each run of one part (the warm-up,
    the optimizer step, ...) its share of the columns, at least one, so that every part shows;
    a run's steps spread evenly over its columns."""
    runs, start = [], 0
    for i in range(1, len(parts) + 1):
        if i == len(parts) or parts[i] != parts[start]:
            runs.append((start, i))
            start = i
    n = len(parts)
    share = [max(1, (b - a) * room // n) for a, b in runs]
    while sum(share) > room and max(share) > 1:
        share[share.index(max(share))] -= 1
    groups = []
    for (a, b), cols in zip(runs, share):
        cols = min(cols, b - a)
        groups += [
            list(range(a + c * (b - a) // cols, a + (c + 1) * (b - a) // cols)) for c in range(cols)
        ]
    return groups


def _part_labels(columns: list[str]) -> str:
    """Each run of columns of one part: its label where it starts (the short one, cut to the
    run, where the run is narrower), then "─" to its end."""
    out = []
    i = 0
    while i < len(columns):
        j = i
        while j < len(columns) and columns[j] == columns[i]:
            j += 1
        label, short = _PART.get(columns[i], ("·", "·"))
        label = label if len(label) <= j - i else short[: j - i]
        out.append(label.ljust(j - i, "─"))
        i = j
    return "".join(out)
