"""The HTML page of `metatrace run --html`: built from the JSON report, self-contained."""

import copy
import json
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from metatrace.analysis.analyze import analyze
from metatrace.export import html as page_html
from metatrace.export.report import job_report
from metatrace.render.format import DIM_TITLES, seconds, size
from metatrace.tracing.trace import JobTrace, trace_role
from metatrace.world import World
from tests.helpers import DEBUG, metatrace, small_job

VOID = {"meta", "br", "hr", "img", "input", "link", "wbr", "col", "area", "base", "source"}


class Strict(HTMLParser):
    """Fails on what html.parser lets pass: an end tag that closes nothing open, an element
    left open, a declaration other than the doctype, a stray '<'."""

    def __init__(self):
        super().__init__(convert_charrefs=False)  # raw text: a bare "<" shows
        self.open: list[str] = []
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in VOID:
            self.open.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, f"</{tag}> closes {self.open[-1:]}"
        self.open.pop()

    def handle_decl(self, decl):
        assert decl == "DOCTYPE html", decl

    def handle_data(self, data):
        if self.open[-1:] == ["style"]:  # CSS: child combinators (">") are its own
            assert "<" not in data, data[:80]
            return
        assert "<" not in data and ">" not in data, data[:80]
        self.text.append(data)

    def unknown_decl(self, data):
        raise AssertionError(data)


def parse(text: str) -> Strict:
    parser = Strict()
    parser.feed(text)
    parser.close()
    assert parser.open == [], parser.open
    return parser


@pytest.fixture(scope="module")
def report(debug_analysis):
    return json.loads(json.dumps(job_report(debug_analysis)))


@pytest.fixture(scope="module")
def timelines(debug_analysis):
    return page_html.role_timelines(debug_analysis)


@pytest.fixture(scope="module")
def page(report, timelines):
    return page_html.page(report, timelines)


def table_after(page: str, heading: str) -> list[list[str]]:
    """Rows of cells (text) of the first table after `heading`."""
    rest = page.split(heading, 1)[1]
    body = rest.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return [
        [re.sub("<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body)
    ]


def test_the_page_is_well_formed_and_a_pure_function_of_the_report(report, timelines, page):
    before = copy.deepcopy(report)
    assert page_html.page(report, timelines) == page
    assert report == before
    parsed = parse(page)
    assert page.startswith("<!DOCTYPE html>") and parsed.tags[0][0] == "html"
    assert [t for t, _ in parsed.tags].count("svg") == 1 + len(report["roles"])


def test_nothing_is_fetched_from_the_network(page):
    assert not re.search(r"https?://|//[a-z]", page, re.I)
    assert not re.search(r"<(script|link|img|iframe|object|embed)\b", page, re.I)
    assert not re.search(r"\b(src|href)=|url\(|@import", page, re.I)


def test_each_stage_peak_is_shown_as_printed(report, page):
    rows = table_after(page, "<h2>Memory per GPU")
    assert [row[0] for row in rows] == [str(r["pp_stage"]) for r in report["roles"]]
    for row, role in zip(rows, report["roles"]):
        m = role["memory"]
        # Stage, Ranks, Params, Grads, Optim, Wkspc, Activ, µb, Temp, Peak, Peak at.
        assert row[9] == size(m["peak_bytes"]) and row[7] == str(m["inflight_microbatches"])
        assert row[2] == size(m["params_bytes"]) and row[5] == size(m["workspace_bytes"])
        assert f"Stage {role['pp_stage']} · peak {size(m['peak_bytes'])}" in page
    # The debug job: stage 1 (output layer, its cuBLAS and TE workspaces) peaks highest.
    v = report["memory_verdict"]
    assert v["highest_peak_ranks"] == [2, 3]
    assert f"Fits on h100 (79.1 GiB): ranks 2-3 take {size(v['device_bytes'])}" in page
    assert f"peak {size(v['allocated_peak_bytes'])} allocated" in page


def test_every_dimension_has_a_row_with_its_figures(report, page):
    rows = table_after(page, "<h2>Communication per iteration</h2>")
    comm = report["cluster"]["comm"]
    dims = [d for d in comm if d != "total"]
    assert [row[0] for row in rows] == [DIM_TITLES[d] for d in dims] + ["Total"]
    for row, dim in zip(rows, dims + ["total"]):
        assert row[1] == f"{comm[dim]['count']:,}"
    assert rows[-1][1] == "188" and rows[-1][3] == "100%"
    assert '<tr class="zero"><td>CP</td>' in page  # no context parallelism: greyed


UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def charts(page: str) -> list[ET.Element]:
    """Every <svg> of the page, parsed."""
    return [ET.fromstring(m) for m in re.findall(r"<svg\b.*?</svg>", page, re.S)]


def ticks(chart: ET.Element) -> list[str]:
    return [t.text or "" for t in chart.iter("text") if t.get("class") == "tick"]


def value_ticks(chart: ET.Element) -> list[int]:
    """Bytes of the value axis's ticks, from labels such as "20 MiB"."""
    out = []
    for label in ticks(chart):
        number, _, unit = label.partition(" ")
        if unit:
            out.append(round(float(number) * UNITS[unit]))
    return out


def test_bars_are_as_long_as_the_peaks_on_an_axis_with_values(report, page):
    bars = charts(page)[0]
    widths: dict[str, float] = {}
    for rect in bars.iter("rect"):
        stage = rect.get("data-stage")
        widths[stage] = widths.get(stage, 0) + float(rect.get("width"))
    peaks = {str(r["pp_stage"]): r["memory"]["peak_bytes"] for r in report["roles"]}
    assert widths.keys() == peaks.keys()
    # Capacity is far off the scale here: the axis ends at the first tick above the highest
    # peak, 97.6 MiB.
    assert ticks(bars) == ["0 MiB", "20 MiB", "40 MiB", "60 MiB", "80 MiB", "100 MiB"]
    for stage, width in widths.items():
        assert width == pytest.approx((760 - 64 - 76) * peaks[stage] / (100 * 2**20), abs=0.05)
    outside = report["memory_verdict"]["outside_allocator_bytes"]
    usable = size(round(79.1 * 2**30) - outside)
    assert f"GPU capacity 79.10 GiB (less what lives outside the allocator: {usable}) lies" in page


def test_capacity_lines_when_they_fall_on_the_scale(report):
    tight = copy.deepcopy(report)
    peak = tight["memory_verdict"]["highest_peak_bytes"]
    tight["memory_verdict"].update(
        gpu_memory_bytes=2 * peak,
        reserved_overhead_bytes=peak // 4,
        outside_allocator_bytes=peak // 4,
    )
    bars = ET.fromstring(re.search(r"<svg\b.*?</svg>", page_html.memory_bars(tight), re.S)[0])
    assert ticks(bars)[-1] == "200 MiB"  # the capacity, 195.2 MiB, is on the scale
    lines = [a for a in bars.iter("line") if a.get("class") == "capacity"]
    x = [float(a.get("x1")) - 64 for a in lines]
    expected = [620 * 2 * peak / (200 * 2**20), 620 * 1.5 * peak / (200 * 2**20)]
    assert x == pytest.approx(expected, abs=0.01)
    labels = [t.text for t in bars.iter("text") if t.get("class") == "capacity"]
    assert labels == [
        f"GPU capacity {size(2 * peak)}",
        f"less outside the allocator {size(2 * peak - peak // 4 - peak // 4)}",
    ]
    assert "beyond the scale" not in page_html.memory_bars(tight)


def test_the_stages_timelines_share_one_scale(report, page):
    peaks = [r["memory"]["peak_bytes"] for r in report["roles"]]
    lines = charts(page)[1:]
    assert len(lines) == len(peaks) == 2
    scales = [value_ticks(chart) for chart in lines]
    # The same axis for both stages, up to the first tick above the higher peak (97.6 MiB),
    # though stage 0 peaks at a third of it.
    assert scales[0] == scales[1] == [0, 25 * 2**20, 50 * 2**20, 75 * 2**20, 100 * 2**20]
    assert peaks[0] < peaks[1] / 2
    heights = []
    for chart in lines:
        (peak_line,) = [ln for ln in chart.iter("line") if ln.get("stroke-dasharray")]
        heights.append(116 - float(peak_line.get("y1")))  # the plot's base is at y=116
        # The step axis: 10 steps (test_one_timeline_per_stage_with_every_step).
        assert [t for t in ticks(chart) if " " not in t] == ["0", "2", "4", "6", "8", "10"]
    assert heights == pytest.approx([100 * p / (100 * 2**20) for p in peaks], abs=0.01)


def test_the_iteration_time_and_the_bubble(report, page):
    t = report["timing"]
    (line,) = re.findall(r'<p class="timing"[^>]*>(.*?)</p>', page)
    text, where = re.sub("<[^>]+>", "", line.replace("<br>", "\n")).split("\n")
    assert text.startswith(f"Estimated iteration time {seconds(t['iteration_seconds'])} (")
    assert text.endswith(f"1F1B), pipeline bubble {t['bubble_fraction']:.1%}")
    # where the last stage's iteration goes, largest term first, as the terminal says it: the
    # debug model's tiny kernels wait for the host (metatrace.config.host) more than they run,
    # which makes the iteration host-bound (the GPU waits 1 % of it or more)
    b = t["breakdown"]
    assert b["host_seconds"] > b["compute_seconds"] > 0
    assert b["host_seconds"] >= 0.01 * t["iteration_seconds"]
    terms = {
        "compute": b["compute_seconds"],
        "communication in the steps": b["communication_seconds"],
        "pipeline idle": b["idle_seconds"],
        "optimizer step": b["optimizer_seconds"],
        "waiting for the host": b["host_seconds"],
    }
    name, largest = max(terms.items(), key=lambda kv: kv[1])
    assert where.startswith(
        f"Where it goes (stage {b['stage']}, the last to finish; host-bound): {name} "
        f"{seconds(largest)} ("
    )
    assert f"compute {seconds(b['compute_seconds'])} (" in where
    assert "kernels at their modelled rates" in text
    # The debug model is tiny: its few hundred kernels each take the launch's 4 µs.
    assert seconds(t["iteration_seconds"]).endswith(" ms")
    rows = table_after(page, '<p class="timing"')
    assert [row[4] for row in rows] == [
        f"{r['timing']['bubble_fraction']:.1%}" for r in report["roles"]
    ]
    assert rows[0][1] == seconds(report["roles"][0]["timing"]["iteration_seconds"])


class TreeNames(HTMLParser):
    """Names of the modules in each tree (<div class="tree">), and how many are <details>."""

    def __init__(self):
        super().__init__()
        self.trees: list[list[str]] = []
        self.details = 0
        self.name = False

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class")
        if tag == "div" and cls == "tree":
            self.trees.append([])
        self.details += tag == "details"
        self.name = tag == "span" and cls == "name"

    def handle_endtag(self, tag):
        self.name = False

    def handle_data(self, data):
        if self.name:
            self.trees[-1].append(data)


def test_each_stage_has_its_module_tree(report, page):
    parsed = TreeNames()
    parsed.feed(page)
    assert len(parsed.trees) == len(report["roles"]) + ("full_model" in report)
    for names, role in zip(parsed.trees, report["roles"]):
        # Every module but megatron-core's empty Identity slots, once (one layer per stage).
        expected = [
            m["fqn"].rsplit(".", 1)[-1] or "model"
            for m in role["modules"]
            if not m["type"].startswith("Identity")
        ]
        assert names[0] == "Module" and sorted(names[1:]) == sorted(expected)
        assert {"model", "decoder", "layers", "0", "linear_qkv"} <= set(names)
    assert "embedding" in parsed.trees[0] and "output_layer" in parsed.trees[1]
    assert parsed.details >= 2 * 6  # model, decoder, layers, layer, attention, mlp


def test_one_timeline_per_stage_with_every_step(report, timelines, page):
    polylines = re.findall(r'<polyline[^>]*points="([^"]*)"', page)
    assert len(polylines) == len(report["roles"]) == len(timelines)
    for points, steps in zip(polylines, timelines):
        assert len(points.split()) == 2 * len(steps)
    # 1F1B, 4 micro-batches: a forward and a backward step each, grad sync, optimizer.
    assert [len(t) for t in timelines] == [10, 10]
    assert [p for p, _ in timelines[0]][-2:] == ["grad sync", "optimizer"]


def test_text_from_the_report_is_escaped(report, timelines):
    evil = copy.deepcopy(report)
    evil["source"] = "<script>alert('x')</script>.yaml"
    evil["notes"] = ["a & b <i>"]
    out = page_html.page(evil, timelines)
    parse(out)
    assert "<script" not in out and "&lt;script&gt;alert(&#x27;x&#x27;)" in out
    assert "a &amp; b &lt;i&gt;" in out


def test_out_of_memory_moe_and_micro_batch_search(report, timelines):
    r = copy.deepcopy(report)
    r["memory_verdict"].update(fits=False, headroom_bytes=-3 * 2**30, out_of_memory_ranks=[2, 3])
    r["model"].update(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96)
    r["moe_routing"] = "balanced (every expert gets tokens x topk / experts)"
    r["max_micro_batch"] = {
        "best": 2,
        "candidates": [1, 2, 4],
        "probes": [
            {
                "micro_batch_size": 4,
                "num_microbatches": 2,
                "highest_peak_bytes": 5 * 2**30,
                "headroom_bytes": -(2**30),
                "fits": False,
                "highest_peak_ranks": [2, 3],
            },
            {
                "micro_batch_size": 2,
                "num_microbatches": 4,
                "highest_peak_bytes": 2**30,
                "headroom_bytes": 2**30,
                "fits": True,
                "highest_peak_ranks": [2, 3],
            },
        ],
    }
    out = page_html.page(r, timelines)
    parse(out)
    assert '<p class="verdict oom">Out of memory on h100 (79.1 GiB) by 3.00 GiB on ranks 2-3' in out
    assert "8 experts, top-2, expert ffn 96; routing assumed balanced" in out
    rows = table_after(out, "Largest micro-batch size that fits")
    assert rows == [
        ["2", "4", "1.00 GiB", "1.00 GiB", "fits"],
        ["4", "2", "5.00 GiB", "-1.00 GiB", "out of memory"],
    ]


def test_a_report_without_an_iteration_has_no_memory_sections():
    job = small_job()
    world = World.from_job(job)
    (role,) = world.roles()
    rt = trace_role(job, world, role, iteration=False)
    report = job_report(analyze(JobTrace(job=job, world=world, roles=(rt,), full=None)))
    out = page_html.page(report, None)
    parse(out)
    assert "No iteration was traced" in out
    assert "Memory per GPU" not in out and "Communication per iteration" not in out
    assert "<h3>Pipeline stage 0 · ranks 0 · layers 1-2 · traced rank 0</h3>" in out


def test_the_cli_writes_the_page_next_to_the_json(tmp_path):
    html_path, json_path = tmp_path / "report.html", tmp_path / "report.json"
    result = metatrace(
        "run",
        "--config",
        DEBUG,
        "--no-full-model",
        "-q",
        "--html",
        str(html_path),
        "--json",
        str(json_path),
    )
    assert result.returncode == 0, result.stderr
    # However the terminal wraps the line: compare without whitespace (the path has none).
    squeezed = re.sub(r"\s+", "", result.stdout)
    assert f"HTMLreportwrittento{html_path}" in squeezed
    report = json.loads(json_path.read_text())
    text = html_path.read_text(encoding="utf-8")
    parse(text)
    for role in report["roles"]:
        assert f"<td class=n>{size(role['memory']['peak_bytes'])}</td>" in text
    assert text.count("<polyline") == len(report["roles"]) == 2


def test_the_advice_is_under_the_verdict(report, timelines):
    """A report with advice (the changes that make it fit, each traced) shows them under the
    verdict as the terminal does: the change, its peak, headroom, step and the step's change."""
    advised = json.loads(json.dumps(report))
    advised["advice"] = {
        "given_as": "job_file",
        "iteration_seconds": 2.0,
        "changes": [
            {
                "kind": "micro_batch",
                "change": "training.micro_batch_size: 1",
                "keys": {"training.micro_batch_size": 1},
                "megatron_args": ["--micro-batch-size", "1"],
                "highest_peak_bytes": 3 * 2**30,
                "headroom_bytes": 5 * 2**30,
                "fits": True,
                "within_error_band": False,
                "iteration_seconds": 2.5,
                "delta_seconds": 0.5,
                "estimated_peak_bytes": 3 * 2**30,
                "traced": True,
            }
        ],
        "misses": [],
        "failed": [],
        "considered": 3,
        "pruned": 1,
    }
    html = page_html.page(advised, timelines)
    assert "change one thing" in html
    rows = table_after(html, "change one thing")
    assert rows == [["training.micro_batch_size: 1", "3.00 GiB", "5.00 GiB", "2.50 s", "+25.0%"]]
    assert "change one thing" not in page_html.page(report, timelines)
