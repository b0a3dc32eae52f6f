"""FitTable's width policy and the piped console: never a cut number, shape or module name."""

import io
import re

from rich.console import Console

from metatrace.render.fit import FitTable, output_console, shorten_module, wrap
from metatrace.render.timeline import Timeline


def _render(renderable, width: int) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue()


def _tree() -> FitTable:
    table = FitTable()
    table.add_column("Module", "module")
    table.add_column("Type", "type")
    table.add_column("Parameters", "prose")
    table.add_column("Param MiB")
    table.add_column("TP communication (MiB)", "prose")
    table.add_row("model", "GPTModel", "", "12,852.5", "fwd 3× all_reduce [4096,1] 0.016")
    table.add_row(
        "│  │  └─ layers.*.self_attention.linear_qkv",
        "TELayerNormColumnParallelLinear",
        "ln.w [4096]  w [12288, 4096]",
        "96.0",
        "fwd all_gather [4096,4096] 32.0\nbwd reduce_scatter [4096,4096] 32.0",
    )
    table.add_row(
        "│  │  └─ layers.*.self_attention.linear_proj",
        "TERowParallelLinear",
        "w [4096, 4096]",
        "32.0",
        "",
    )
    return table


def test_every_figure_and_shape_whole_at_any_width():
    narrowest = _render(_tree(), 40)  # too narrow for the shapes: they fold, figures stay whole
    assert "12,852.5" in narrowest and "96.0" in narrowest
    for width in (60, 80, 120, 200):
        text = _render(_tree(), width)
        for token in ("12,852.5", "96.0", "[12288, 4096]", "[4096,4096]", "0.016", "linear_qkv"):
            assert token in text, (width, token, text)
        # a "…" only opens a shortened module path or ends a shortened class name
        cut = [m.group(1) for m in re.finditer(r"(\S+)…", text)]
        assert all(word[0].isupper() for word in cut), (width, cut)
        assert all(line == line.rstrip() for line in text.splitlines()), width


def test_policy_order_type_then_module_paths():
    wide = _render(_tree(), 200)
    assert "TELayerNormColumnParallelLinear" in wide and "layers.*.self_attention" in wide
    narrow = _render(_tree(), 80)
    assert "Type" not in narrow  # dropped before any number
    # module paths shortened from the left, the distinguishing tail kept
    assert "…linear_qkv" in narrow and "…linear_proj" in narrow
    assert max(len(line) for line in narrow.splitlines()) <= 80


def test_shorten_module_keeps_the_tail():
    path = "layers.*.self_attention.linear_qkv"
    assert shorten_module(path, 40) == path
    assert shorten_module(path, 26) == "…self_attention.linear_qkv"
    assert shorten_module(path, 5) == "…linear_qkv"
    assert shorten_module("│  ├─ a.b", 4) == "│  ├─ …b"


def test_wrap_breaks_between_items_only():
    assert wrap("[4096,4096] bf16 32.0 MiB", 12) == ["[4096,4096]", "bf16", "32.0 MiB"]
    assert wrap("ln.w [4096]  w [12288, 4096]", 16) == ["ln.w [4096]", "w [12288, 4096]"]


def test_piped_console_is_80_columns_without_trailing_blanks():
    table = FitTable()
    table.add_column("Name", "name")
    table.add_column("Value")
    table.add_row("x" * 150, "1,234.5")

    class Pipe(io.StringIO):
        def isatty(self):
            return False

    def lines(console_width, environ):
        out = Pipe()
        console = output_console(console_width, environ=environ, stream=out)
        console.print(table)
        console.print("a paragraph " * 20)
        return out.getvalue().splitlines()

    for width, environ, most in ((None, {}, 80), (None, {"COLUMNS": "60"}, 60), (120, {}, 120)):
        got = lines(width, environ)
        assert max(len(line) for line in got) == most, (width, environ)
        assert all(line == line.rstrip() for line in got)
        assert any(line.endswith("1,234.5") for line in got)  # the figure whole
        assert "".join(got).count("x") == 150  # the name folded, not cut


def test_joined_breaks_between_items_only():
    from metatrace.render.fit import Joined

    items = ["tp 4", "pp 4", "vpp 5", "micro-batch 1", "global batch 256"]
    text = _render(Joined(items), 40)
    assert text.splitlines() == ["tp 4 · pp 4 · vpp 5 · micro-batch 1", "global batch 256"]
    assert _render(Joined(["a" * 10, "b" * 10], ", "), 15).splitlines() == [
        "a" * 10 + ",",
        "b" * 10,
    ]


def test_timeline_from_zero_on_a_shared_scale():
    gib = 2**30
    stages = [
        (
            "stage 0",
            (("forward", 8 * gib), ("backward", 16 * gib), ("optimizer", 12 * gib)),
            16 * gib,
        ),
        ("stage 1", (("forward", 4 * gib), ("backward", 8 * gib), ("optimizer", 6 * gib)), 8 * gib),
    ]
    text = _render(Timeline(stages), 80)
    lines = text.splitlines()
    assert "Scale 0 to 16.00 GiB" in text
    # stage 0's backward is full (both rows); stage 1's backward half (lower row full only)
    s0, s1 = lines[1], lines[4]
    assert s0.startswith("stage 0 ") and s1.startswith("stage 1 ")
    assert lines[0].split()[0].startswith("▁") or "█" in lines[0]
    assert "█" not in lines[3]  # stage 1 never reaches the upper row's full block
    assert re.fullmatch(r"fwd─+bwd─+O─+", lines[2].strip()) and len(s0) > 60  # uses the width


def test_timeline_schedule_parts_show_even_when_steps_are_grouped():
    from metatrace.render.timeline import _timeline_rows, schedule_parts

    gib = 2**30
    # pp 2, stage 0: two forward steps of warm-up, 1F1B, two backward steps of cool-down,
    # then gradient sync and the optimizer step.
    phases = ["forward"] * 2 + ["backward", "forward"] * 39 + ["backward"] * 2
    phases += ["grad sync", "optimizer"]
    steps = [(p, (i % 7 + 1) * gib) for i, p in enumerate(phases)]
    parts = schedule_parts(steps)
    assert parts[:3] == ["warm-up", "warm-up", "steady"] and parts[-5:-2] == [
        "steady",
        "cool-down",
        "cool-down",
    ]
    assert parts[-2:] == ["grad sync", "optimizer"] and parts.count("steady") == 78
    high, low, marks = _timeline_rows(steps, 7 * gib, 30)
    assert len(low) == len(marks) == 30 < len(steps)
    assert re.fullmatch(r"F1F1B─+BGO", marks), marks  # each part at least a column
