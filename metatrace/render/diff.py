"""Rendering of `metatrace diff`: the diff dict of metatrace.analysis.diff as rich tables (formatting
only). Green marks a change for the better, red for the worse, by each figure's direction."""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from metatrace.render.format import (
    DIM_TITLES,
    DTYPE_SHORT,
    PARAM_SHORT,
    PHASE_SHORT,
    layer_span,
    op,
    rank_span,
    seconds,
    section,
    volume,
)


def _format(figure: str, value) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if figure == "layers":
        return layer_span(value)
    if "bytes" in figure.rsplit(".", 1)[-1]:
        return ("-" if value < 0 else "") + volume(abs(value))
    if figure.endswith("seconds"):
        return ("-" if value < 0 else "") + seconds(abs(value))
    if figure.endswith("fraction"):
        return f"{value:.1%}"
    if isinstance(value, float):
        return f"{value:,.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _style(row: dict) -> str:
    if not row["changed"]:
        return "dim"
    better, a, b = row["better"], row["a"], row["b"]
    if better is None or a is None or b is None:
        return "yellow"
    lower = b < a
    return "green" if lower == (better == "lower") else "red"


def _change(row: dict) -> tuple[str, str]:
    if not row["changed"] or "delta" not in row:
        return ("", "")
    delta = row["delta"]
    text = ("+" if delta > 0 else "") + _format(row["figure"], delta)
    percent = row.get("percent")
    return text, "" if percent is None else f"{percent:+.1f}%"


def _label(row: dict) -> str:
    label = row["label"]
    dim, colon, rest = label.partition(": ")
    if colon and dim in DIM_TITLES and row["figure"].split(".")[-2] == dim:
        return f"{DIM_TITLES[dim]} {rest}"
    if colon and dim == "total":
        return f"Total {rest}"
    return label


def build_figures(rows: list[dict], *, changed_only: bool = False) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, just in (
        ("Figure", "left"),
        ("A", "right"),
        ("B", "right"),
        ("Change", "right"),
        ("%", "right"),
    ):
        table.add_column(col, justify=just, no_wrap=True)
    for row in rows:
        if (changed_only and not row["changed"]) or isinstance(row["a"] or row["b"], str):
            continue
        style = _style(row)
        change, percent = _change(row)
        table.add_row(
            _label(row),
            _format(row["figure"], row["a"]),
            _format(row["figure"], row["b"]),
            Text(change, style=style),
            Text(percent, style=style),
            style="dim" if not row["changed"] else None,
        )
    return table


def build_text_figures(rows: list[dict], *, changed_only: bool = False) -> Table:
    """Figures that are phrases (where a stage peaks), one line per side."""
    table = Table.grid(padding=(0, 1))
    table.add_column(style="dim", no_wrap=True)
    table.add_column()
    for row in rows:
        if isinstance(row["a"] or row["b"], str) and (row["changed"] or not changed_only):
            style = "yellow" if row["changed"] else "dim"
            table.add_row(f"A {row['label']}", Text(_format(row["figure"], row["a"]), style=style))
            table.add_row(f"B {row['label']}", Text(_format(row["figure"], row["b"]), style=style))
    return table


def build_config_changes(config: list[dict]) -> Table | Text:
    if not config:
        return Text("Same configuration.", style="dim")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("Key", no_wrap=True)
    table.add_column("A")
    table.add_column("B")
    for c in config:
        table.add_row(c["key"], _plain(c["a"]), _plain(c["b"]))
    return table


def _plain(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _call(call: str) -> str:
    """ "forward all_reduce tp [128,64] bfloat16" as the communication tables write it."""
    phase, name, group, dims, dtype = call.split(" ")
    return (
        f"{PHASE_SHORT.get(phase, phase)} {op(name)} {group} {dims} {DTYPE_SHORT.get(dtype, dtype)}"
    )


def _module_side(entry: dict | None) -> str:
    if entry is None:
        return "(absent)"
    parts = [
        f"{PARAM_SHORT.get(k, k)} [{', '.join(map(str, v))}]"
        for k, v in entry["param_shapes"].items()
    ]
    acts = entry["activation_bytes"]
    if any(acts):
        parts.append("saves " + " / ".join(volume(x) for x in acts))
    parts += [f"{n}× {_call(call)}" for call, n in entry["collectives"].items()]
    return ";  ".join(parts) or entry["type"]


def _levels(pattern: str) -> list[str]:
    """ "decoder.layers.*.mlp" -> ["decoder", "layers.*", "mlp"]: all layers are one level."""
    out: list[str] = []
    for part in pattern.split("."):
        if part == "*" and out:
            out[-1] += ".*"
        else:
            out.append(part)
    return out


def build_module_changes(modules: list[dict]) -> Tree:
    """The module tree down to each changed module, with what A and B have under it; parents
    that did not change are dim. Modules come in tree order, so a changed parent is added
    before its children."""
    tree = Tree(Text("Modules that differ (per layer and micro-batch)", style="bold"))
    nodes: dict[tuple, Tree] = {}
    for mod in modules:
        levels = _levels(mod["module"])
        parent = tree
        for depth in range(1, len(levels) + 1):
            path = tuple(levels[:depth])
            if path not in nodes:
                style = "cyan" if depth == len(levels) else "dim"
                nodes[path] = parent.add(Text(levels[depth - 1], style=style))
            parent = nodes[path]
        parent.add(Text.assemble(("A ", "bold"), _module_side(mod["a"])))
        parent.add(Text.assemble(("B ", "bold"), _module_side(mod["b"])))
    return tree


def _role_title(pair: dict) -> str:
    a, b = pair["a"], pair["b"]
    return (
        f"A stage {a['pp_stage']} (ranks {rank_span(a['ranks'])}, layers "
        f"{layer_span(a['layers'])})  vs  B stage {b['pp_stage']} (ranks "
        f"{rank_span(b['ranks'])}, layers {layer_span(b['layers'])})"
    )


def _side_label(side: dict) -> str:
    return str(side.get("label", side["source"]))


def render_diff(diff: dict, console, *, all_rows: bool = False) -> None:
    """The diff; an identical pair is one line unless `all_rows` asks for every figure."""
    a, b = _side_label(diff["a"]), _side_label(diff["b"])
    if not diff["changes"] and not all_rows:
        line = Text.assemble(("Same configuration and figures: ", "bold"), f"{a} and {b}")
        console.print(line, soft_wrap=True)
        return
    console.print(Text.assemble(("A ", "bold"), a))
    console.print(Text.assemble(("B ", "bold"), b))
    console.print(section("Configuration changes"))
    console.print(build_config_changes(diff["config"]))
    console.print(section("Cluster (communication: all GPUs, one iteration)"))
    console.print(build_figures(diff["cluster"]))
    for pair in diff["roles"]:
        console.print(section(_role_title(pair)))
        changed = any(r["changed"] for r in pair["figures"])
        if changed or all_rows:
            console.print(build_figures(pair["figures"], changed_only=not all_rows))
            console.print(build_text_figures(pair["figures"], changed_only=not all_rows))
        else:
            console.print(Text("No figure differs.", style="dim"))
        if pair["modules"]:
            console.print(build_module_changes(pair["modules"]))
    n = len(diff["changes"])
    console.print()
    console.print(
        Text(f"{n:,} change{'s' if n != 1 else ''}." if n else "No differences.", style="bold")
    )
