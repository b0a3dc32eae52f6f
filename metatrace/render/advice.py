"""The advice `metatrace run` prints after the verdict when a job does not fit, or fits by
less than the prediction's error band (formatting only; the figures are the report's
`advice`, metatrace.export.advice)."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from metatrace.analysis.margins import ErrorBand
from metatrace.render.format import seconds, size


def step_delta(change: dict, now: float | None) -> str:
    if change["iteration_seconds"] is None or not now:
        return "-"
    share = round(change["delta_seconds"] / now, 3)
    return f"{share + 0.0:+.1%}"  # + 0.0: no "-0.0%"


def signed_size(nbytes: int) -> str:
    return size(nbytes) if nbytes >= 0 else f"-{size(-nbytes)}"


def build_advice(advice: dict, verdict: dict) -> Group:
    """A title, one row per change that fits (its traced peak, headroom, step time and the
    step's change), then in a line or two what was traced and does not fit or could not be
    traced. `verdict`: the report's memory_verdict (its error band)."""
    band = verdict["error_band"]
    phrase = ErrorBand(band["kind"], band["fraction"], band["source"]).phrase()
    now = advice["iteration_seconds"]
    goal = "fit" if not verdict["fits"] else "fit beyond that error"
    step = f"; the step now {seconds(now)}" if now is not None else ""
    parts: list = [Text(f"To make it {goal}, change one thing (each traced{step}):", style="bold")]
    if advice["changes"]:
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
        table.add_column("Change", overflow="fold", ratio=1)
        for col in ("Peak", "Headroom", "Step", "Step Δ"):
            table.add_column(col, justify="right", no_wrap=True)
        for c in advice["changes"]:
            mark = "*" if c["within_error_band"] else ""
            table.add_row(
                Text(c["change"]),
                size(c["highest_peak_bytes"]),
                signed_size(c["headroom_bytes"]) + mark,
                seconds(c["iteration_seconds"]) if c["iteration_seconds"] is not None else "-",
                step_delta(c, now),
            )
        parts.append(table)
        if any(c["within_error_band"] for c in advice["changes"]):
            parts.append(Text(f"*: within {phrase}; listed last.", style="dim"))
    else:
        parts.append(Text("No single change found that fits.", style="bold red"))
    notes = []
    if advice["misses"]:
        notes.append(
            "Traced, still out of memory: "
            + "; ".join(
                f"{c['change']} (short by {size(-c['headroom_bytes'])})" for c in advice["misses"]
            )
            + "."
        )
    if advice["failed"]:
        notes.append(
            "Not traced, metatrace failed on: "
            + "; ".join(f"{f['change']} ({f['error']})" for f in advice["failed"])
            + "."
        )
    if notes:
        parts.append(Text(" ".join(notes), style="dim"))
    return Group(*parts)
