"""The HTML page's pieces that need no trace: axis ticks, timeline columns, the bars' scale and
capacity lines, module trees from report rows, refused output paths (the page of a traced job is
in tests/tracing/test_html.py)."""

import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from metatrace.export import html as page_html
from metatrace.export import svg
from metatrace.render.format import GiB, MiB
from tests.helpers import DEBUG, metatrace

SVG = ""  # inline SVG in HTML: no namespace, none needed


def test_long_timelines_are_drawn_as_the_highest_level_of_their_steps():
    steps = [("forward", i) for i in range(1000)] + [("backward", 5000), ("optimizer", 1)]
    cols = svg.columns(steps)
    assert len(cols) == 501 and cols[0] == ("forward", 1)
    assert cols[-1] == (None, 5000)  # a backward and the optimizer step: mixed


@pytest.mark.parametrize(
    "raw, step", [(16, 20), (5.4, 10), (2.3, 2.5), (0.54, 1), (0.2, 0.2), (3e-5, 5e-5)]
)
def test_a_nice_step_is_1_2_2_5_or_5_times_a_power_of_ten(raw, step):
    assert svg.nice_step(raw) == pytest.approx(step)


def test_byte_ticks_reach_the_top_in_its_largest_unit():
    values, labels = svg.byte_ticks(int(27.19 * GiB))
    assert labels == ["0 GiB", "10 GiB", "20 GiB", "30 GiB"]
    assert values == [0, 10 * GiB, 20 * GiB, 30 * GiB]
    assert svg.byte_ticks(int(79.1 * GiB))[1] == ["0 GiB", "20 GiB", "40 GiB", "60 GiB", "80 GiB"]
    assert svg.byte_ticks(int(97.6 * MiB))[1][-2:] == ["80 MiB", "100 MiB"]
    assert svg.byte_ticks(20 * GiB)[1][-1] == "20 GiB"  # a top on a tick ends there
    assert svg.step_ticks(66) == [0, 20, 40, 60] and svg.step_ticks(3) == [0, 1, 2, 3]


def _role(stage, peak, params=GiB):
    memory = {key: 0 for key, *_ in svg.PARTS}
    memory.update(params_bytes=params, activations_bytes=peak - params, peak_bytes=peak)
    return {"pp_stage": stage, "memory": memory}


def _texts(root) -> list[str]:
    return [t.text or "" for t in root.iter(f"{SVG}text")]


def test_bars_share_an_axis_with_values_and_labelled_capacity_lines():
    roles = [_role(0, 27 * GiB), _role(1, 24 * GiB)]
    chart, on_scale = svg.memory_bars(roles, 80 * GiB, 76 * GiB)
    root = ET.fromstring(chart)
    assert on_scale
    ticks = [t for t in root.iter(f"{SVG}text") if t.get("class") == "tick"]
    assert [t.text for t in ticks] == ["0 GiB", "20 GiB", "40 GiB", "60 GiB", "80 GiB"]
    plot = svg.WIDTH - svg.LEFT - 76
    # Ticks, bars and capacity lines on one scale: 80 GiB spans the plot.
    assert [float(t.get("x")) - svg.LEFT for t in ticks] == pytest.approx(
        [0, plot / 4, plot / 2, 3 * plot / 4, plot]
    )
    widths = {"0": 0.0, "1": 0.0}
    for rect in root.iter(f"{SVG}rect"):
        widths[rect.get("data-stage")] += float(rect.get("width"))
    assert widths == pytest.approx({"0": plot * 27 / 80, "1": plot * 24 / 80})
    lines = [ln for ln in root.iter(f"{SVG}line") if ln.get("class") == "capacity"]
    assert [float(ln.get("x1")) - svg.LEFT for ln in lines] == pytest.approx([plot, plot * 0.95])
    labels = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "capacity"]
    assert labels == ["GPU capacity 80.00 GiB", "less outside the allocator 76.00 GiB"]


def test_capacity_far_beyond_the_peaks_is_named_not_drawn():
    chart, on_scale = svg.memory_bars([_role(0, 2 * GiB)], 80 * GiB, 76 * GiB)
    root = ET.fromstring(chart)
    assert not on_scale and "capacity" not in " ".join(_texts(root))
    ticks = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "tick"]
    assert ticks[-1] == "2 GiB"  # the axis ends at the peak


def test_a_timeline_is_drawn_on_the_scale_it_is_given():
    steps = [("forward", 10 * MiB), ("backward", 30 * MiB), ("optimizer", 20 * MiB)]
    root = ET.fromstring(svg.timeline_chart(0, 30 * MiB, steps, 95 * MiB))
    ticks = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "tick"]
    # Value axis 0-100 MiB (above the 95 MiB of another stage), step axis 0-3.
    assert ticks == ["0 MiB", "25 MiB", "50 MiB", "75 MiB", "100 MiB", "0", "1", "2", "3"]
    (line,) = root.iter(f"{SVG}polyline")
    ys = [float(p.split(",")[1]) for p in line.get("points").split()]
    # 100 px of plot from y=116 up: 30 MiB is 30 px above the base.
    assert ys[2:4] == pytest.approx([116 - 30, 116 - 30])
    assert "peak 30.0 MiB" in _texts(root)


class Tree(HTMLParser):
    """The tree's lines as (depth, name, opened or None for a leaf)."""

    def __init__(self):
        super().__init__()
        self.depth, self.lines, self.opened, self.name = 0, [], None, False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "details":
            self.depth += 1
            self.opened = "open" in attrs
        elif tag == "div" and attrs.get("class") == "row":
            self.opened = None
        self.name = tag == "span" and attrs.get("class") == "name"

    def handle_endtag(self, tag):
        self.depth -= tag == "details"
        self.name = False

    def handle_data(self, data):
        if self.name:
            leaf = self.opened is None
            self.lines.append((self.depth + leaf, data, self.opened))


def _module(fqn, type_, params=0, act=0, shapes=None):
    return {
        "fqn": fqn,
        "type": type_,
        "layer": None,
        "params": params,
        "param_bytes": 2 * params,
        "param_shapes": shapes or {},
        "params_total": params,
        "param_bytes_total": 2 * params,
        "activation_bytes": act,
        "activation_bytes_total": act,
        "peak_bytes": {},
    }


def test_module_trees_nest_fold_identical_layers_and_leave_out_idle_slots():
    layer = [("", "TransformerLayer"), (".mlp", "MLP"), (".noop", "IdentityOp")]
    rows = [_module("", "GPTModel"), _module("decoder", "TransformerBlock")]
    rows.append(_module("decoder.layers", "ModuleList"))
    for i in range(3):
        rows += [_module(f"decoder.layers.{i}{s}", t) for s, t in layer]
        rows[-2].update(params=8, params_total=8, param_shapes={"weight": [2, 4]})
    rows.append(_module("output_layer", "ColumnParallelLinear", 6, 64, {"weight": [3, 2]}))
    tree = page_html.module_tree({"modules": rows, "collectives_per_microbatch": []})
    parsed = Tree()
    parsed.feed(tree)
    assert parsed.lines == [
        (1, "Module", None),  # the column titles
        (1, "model", True),
        (2, "decoder", True),
        (3, "layers", True),
        (4, "0-2 (× 3)", False),  # three identical layers, folded, closed
        (5, "mlp", None),
        (2, "output_layer", None),
    ]
    assert "w [3, 2]" in tree and "IdentityOp" not in tree
    assert tree.count("<details") == tree.count("</details>") == 4


@pytest.mark.parametrize("flag", ["--html", "--json"])
def test_bad_output_paths_exit_2_naming_the_flag(tmp_path, flag):
    missing = metatrace("run", "--config", DEBUG, flag, "/nonexistent/dir/out")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    message = f"{flag} /nonexistent/dir/out: directory /nonexistent/dir does not exist"
    assert message in missing.stderr
    directory = metatrace("run", "--config", DEBUG, flag, str(tmp_path))
    assert directory.returncode == 2
    assert f"{flag} {tmp_path} is a directory" in directory.stderr
