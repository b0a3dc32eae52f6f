"""The HTML page of `metatrace run --html`: built from the JSON report, self-contained."""

import copy
import json
import re
from html.parser import HTMLParser

import pytest

from metatrace.analysis.analyze import analyze
from metatrace.export import html as page_html
from metatrace.export.report import job_report
from metatrace.render.format import DIM_TITLES, size
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
    assert "Fits on h100 (79.1 GiB): highest peak 97.6 MiB on ranks 2-3" in page


def test_every_dimension_has_a_row_with_its_figures(report, page):
    rows = table_after(page, "<h2>Communication per iteration</h2>")
    comm = report["cluster"]["comm"]
    dims = [d for d in comm if d != "total"]
    assert [row[0] for row in rows] == [DIM_TITLES[d] for d in dims] + ["Total"]
    for row, dim in zip(rows, dims + ["total"]):
        assert row[1] == f"{comm[dim]['count']:,}"
    assert rows[-1][1] == "188" and rows[-1][3] == "100%"
    assert '<tr class="zero"><td>CP</td>' in page  # no context parallelism: greyed


def test_bars_are_as_long_as_the_peaks(report, page):
    parsed = parse(page)
    widths: dict[str, float] = {}
    for tag, attrs in parsed.tags:
        if tag == "rect" and attrs.get("class") == "seg":
            widths[attrs["data-stage"]] = widths.get(attrs["data-stage"], 0) + float(attrs["width"])
    peaks = {str(r["pp_stage"]): r["memory"]["peak_bytes"] for r in report["roles"]}
    assert widths.keys() == peaks.keys()
    top = max(peaks.values())
    for stage, width in widths.items():
        # The highest peak spans the plot (capacity is far off the scale here).
        assert width == pytest.approx((760 - 70 - 90) * peaks[stage] / top, abs=0.05)
    assert "GPU capacity 79.10 GiB (capacity − reserved 75.10 GiB) lies beyond the scale" in page


def test_capacity_lines_when_they_fall_on_the_scale(report):
    tight = copy.deepcopy(report)
    peak = tight["memory_verdict"]["highest_peak_bytes"]
    tight["memory_verdict"].update(gpu_memory_bytes=2 * peak, reserved_overhead_bytes=peak // 2)
    svg = page_html.memory_bars(tight).split("</svg>")[0]
    lines = [a for t, a in parse(svg + "</svg>").tags if t == "line"]
    # x of capacity at 600 px (the scale is the capacity), capacity minus reserved at 450 px.
    assert [float(a["x1"]) - 70 for a in lines] == pytest.approx([450, 600], abs=0.05)
    assert "GPU capacity" in svg and "beyond the scale" not in page_html.memory_bars(tight)


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
    assert f"HTML report written to {html_path}" in result.stdout.replace("\n", "")
    report = json.loads(json_path.read_text())
    text = html_path.read_text(encoding="utf-8")
    parse(text)
    for role in report["roles"]:
        assert f"<td class=n>{size(role['memory']['peak_bytes'])}</td>" in text
    assert text.count("<polyline") == len(report["roles"]) == 2
