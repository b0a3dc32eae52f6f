"""The HTML page's charts as inline SVG (metatrace.export.html): memory per stage as stacked bars
and memory over the iteration, each with axes whose ticks carry values.

Pure functions of figures the report holds; nothing is computed here but positions on a scale.
Every chart is drawn WIDTH wide in its viewBox; the page's CSS shrinks it to fit narrow windows.

Known limitations: timelines longer than MAX_COLUMNS steps are drawn as MAX_COLUMNS columns,
each the highest level of its steps, as the terminal does; the step axis is then approximate
by up to one column.
"""

from __future__ import annotations

import html
import math

from metatrace.render.format import GiB, MiB, size

PARTS = (
    ("params_bytes", "Params", "parameters and module buffers", "#4e79a7"),
    ("grads_bytes", "Grads", "DDP's main-gradient buffers", "#f28e2b"),
    ("optimizer_bytes", "Optim", "main parameters and optimizer state", "#e15759"),
    ("workspace_bytes", "Wkspc", "kernel workspaces and buffers kept for good", "#76b7b2"),
    ("activations_bytes", "Activ", "held for the micro-batches in flight", "#59a14f"),
    ("temporary_bytes", "Temp", "the running step's own", "#b07aa1"),
)
PHASE_COLOURS = {
    "forward": "#4e79a7",
    "backward": "#f28e2b",
    "grad sync": "#9c755f",
    "optimizer": "#e15759",
}
MIXED = "#bab0ac"
CAPACITY = "#b71c1c"
GRID = "#e0e0e0"
WIDTH = 760
LEFT = 64
"""Room for the stage names and the value axis's labels."""
MAX_COLUMNS = 600
_UNITS = ((GiB, "GiB"), (MiB, "MiB"), (1024, "KiB"), (1, "B"))


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def nice_step(raw: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten at or above `raw` (> 0)."""
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))


def byte_ticks(top: float, count: int = 5) -> tuple[list[float], list[str]]:
    """Ticks from 0 to the first at or above `top` bytes, about `count` intervals, in the
    largest unit `top` reaches: (bytes of each tick, its label)."""
    unit, name = next((u, n) for u, n in _UNITS if top >= u)
    step = nice_step(max(top, 1) / unit / count)
    n = max(1, math.ceil(top / unit / step - 1e-9))
    values = [i * step for i in range(n + 1)]
    return [v * unit for v in values], [f"{v:g} {name}" for v in values]


def step_ticks(n: int, count: int = 6) -> list[int]:
    """Whole-step ticks from 0 to at most `n`, about `count` intervals."""
    step = max(1, int(nice_step(max(n, 1) / count)))
    return list(range(0, n + 1, step))


def _svg(height: int, label: str) -> str:
    return (
        f'<svg width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" '
        f'aria-label="{esc(label)}">'
    )


# ----------------------------------------------------------------------------- memory per stage


def memory_bars(roles, capacity: int, usable: int) -> tuple[str, bool]:
    """One stacked horizontal bar per pipeline stage on a value axis; GPU capacity and capacity
    less the margin kept free and what lives outside the allocator as labelled vertical lines
    when they fall on the scale.
    Returns (svg, whether the capacity lines are drawn)."""
    top = max(r["memory"]["peak_bytes"] for r in roles)
    # Capacity far above every peak would squash the bars: then it is named, not drawn.
    on_scale = capacity <= 4 * top
    ticks, labels = byte_ticks(max(top, capacity) if on_scale else top)
    scale = ticks[-1]
    right, row, head = 76, 26, 34 if on_scale else 6
    plot = WIDTH - LEFT - right
    axis = head + row * len(roles)
    height = axis + 20

    def x(value) -> float:
        return LEFT + plot * value / scale

    out = [_svg(height, "memory per pipeline stage")]
    for value, text in zip(ticks, labels):
        out.append(
            f'<line class="grid" x1="{x(value):.2f}" y1="{head - 4}" x2="{x(value):.2f}" '
            f'y2="{axis}" stroke="{GRID}"/><text class="tick" x="{x(value):.2f}" '
            f'y="{axis + 14}" text-anchor="middle">{esc(text)}</text>'
        )
    for i, r in enumerate(roles):
        y, left, mem = head + i * row, float(LEFT), r["memory"]
        stage = esc(r["pp_stage"])
        out.append(f'<text x="{LEFT - 6}" y="{y + 16}" text-anchor="end">stage {stage}</text>')
        for key, label, _, colour in PARTS:
            w = plot * mem[key] / scale
            out.append(
                f'<rect class="seg" data-stage="{stage}" x="{left:.2f}" y="{y + 4}" '
                f'width="{w:.2f}" height="{row - 8}" fill="{colour}"><title>stage {stage} · '
                f"{esc(label)} {esc(size(mem[key]))}</title></rect>"
            )
            left += w
        out.append(
            f'<text class="value" x="{left + 5:.2f}" y="{y + 16}">'
            f"{esc(size(mem['peak_bytes']))}</text>"
        )
    out.append(f'<line x1="{LEFT}" y1="{axis}" x2="{LEFT + plot}" y2="{axis}" stroke="#888"/>')
    if on_scale:
        # Each label on its own row above the bars, on the side of its line with more room:
        # the two lines are often a few pixels apart.
        for j, (value, label, dash) in enumerate(
            (
                (capacity, "GPU capacity", ""),
                (usable, "less outside the allocator", ' stroke-dasharray="4 3"'),
            )
        ):
            anchor, dx = ("end", -3) if x(value) - LEFT > plot / 2 else ("start", 3)
            out.append(
                f'<line class="capacity" x1="{x(value):.2f}" y1="{j * 14 + 2}" '
                f'x2="{x(value):.2f}" y2="{axis}" stroke="{CAPACITY}"{dash}/>'
                f'<text class="capacity" x="{x(value) + dx:.2f}" y="{j * 14 + 11}" '
                f'text-anchor="{anchor}">{esc(label)} {esc(size(value))}</text>'
            )
    out.append("</svg>")
    return "".join(out), on_scale


# ----------------------------------------------------------------------------- over the iteration


def columns(steps):
    """At most MAX_COLUMNS (phase or None when mixed, highest level) columns."""
    n = max(1, -(-len(steps) // MAX_COLUMNS))
    out = []
    for i in range(0, len(steps), n):
        group = steps[i : i + n]
        phases = {p for p, _ in group}
        out.append((phases.pop() if len(phases) == 1 else None, max(b for _, b in group)))
    return out


def timeline_chart(stage, peak: int, steps, top: float) -> str:
    """Memory over the iteration of one stage on a scale from 0 to `top` bytes (the same for
    every stage): a step line, the peak as a labelled dashed line, a strip below coloured by
    phase, a value axis on the left and a step axis below."""
    right, strip = 12, 8
    plot_w, plot_top, plot_h = WIDTH - LEFT - right, 16, 100
    ticks, labels = byte_ticks(top, count=4)
    scale = ticks[-1]
    cols = columns(steps)
    base = plot_top + plot_h
    height = base + strip + 24

    def y(level) -> float:
        return base - plot_h * level / scale

    dx = plot_w / max(1, len(cols))
    points = []
    for i, (_, level) in enumerate(cols):
        points += [
            f"{LEFT + i * dx:.2f},{y(level):.2f}",
            f"{LEFT + (i + 1) * dx:.2f},{y(level):.2f}",
        ]
    out = [_svg(height, f"memory over the iteration, stage {stage}")]
    for value, text in zip(ticks, labels):
        out.append(
            f'<line class="grid" x1="{LEFT}" y1="{y(value):.2f}" x2="{WIDTH - right}" '
            f'y2="{y(value):.2f}" stroke="{GRID}"/><text class="tick" x="{LEFT - 6}" '
            f'y="{y(value) + 4:.2f}" text-anchor="end">{esc(text)}</text>'
        )
    out += [
        f'<line x1="{LEFT}" y1="{y(peak):.2f}" x2="{WIDTH - right}" y2="{y(peak):.2f}" '
        f'stroke="{CAPACITY}" stroke-dasharray="4 3"/><text class="peak" x="{WIDTH - right}" '
        f'y="{y(peak) - 4:.2f}" text-anchor="end">peak {esc(size(peak))}</text>',
        f'<polyline fill="none" stroke="#222" stroke-width="1.2" points="{" ".join(points)}"/>',
    ]
    for i, (phase, _) in enumerate(cols):
        out.append(
            f'<rect x="{LEFT + i * dx:.2f}" y="{base + 2}" width="{dx:.2f}" height="{strip}" '
            f'fill="{PHASE_COLOURS.get(phase, MIXED)}"/>'
        )
    for s in step_ticks(len(steps)):
        sx = LEFT + plot_w * s / len(steps)
        out.append(
            f'<line x1="{sx:.2f}" y1="{base + strip + 2}" x2="{sx:.2f}" y2="{base + strip + 6}" '
            f'stroke="#888"/><text class="tick" x="{sx:.2f}" y="{base + strip + 18}" '
            f'text-anchor="middle">{s}</text>'
        )
    out.append(
        f'<text class="axis" x="{LEFT - 6}" y="{base + strip + 18}" text-anchor="end">step</text>'
        "</svg>"
    )
    return "".join(out)
