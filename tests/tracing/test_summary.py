"""The answer first: `metatrace run` opens with a summary of one screen (verdict, per-stage
peaks, iteration time, communication) at 80 and 200 columns, piped; `--summary` prints it alone,
`--quiet` only the verdict, `--detail` everything."""

import functools
import io
import re

import pytest
from rich.console import Console

from metatrace.analysis.analyze import analyze
from metatrace.cli import main
from metatrace.render.format import seconds, size
from metatrace.render.run import render_run
from metatrace.render.summary import build_run_summary
from metatrace.tracing.trace import trace_job
from tests.helpers import DEBUG, small_job

SCREEN = 25
# tp 2 x pp 2 on 4 GPUs, 2 per node: the pipeline crosses nodes; 4 micro-batches.
LAYOUT = dict(
    parallel={"tp": 2, "pp": 2},
    cluster={"num_gpus": 4, "gpus_per_node": 2},
    training={"global_batch_size": 8},
)


@functools.cache
def analysis(memory_gib: float = 80.0):
    job = small_job(**{**LAYOUT, "cluster": {**LAYOUT["cluster"], "gpu_memory_gib": memory_gib}})
    return analyze(trace_job(job, full_model=False, workers=1))


def printed(renderable_or_fn, width: int) -> str:
    """Rendered as when piped (`| cat`): no terminal, no colour."""
    out = io.StringIO()
    console = Console(width=width, force_terminal=False, color_system=None, file=out)
    if callable(renderable_or_fn):
        renderable_or_fn(console)
    else:
        console.print(renderable_or_fn)
    return out.getvalue()


def cli(argv, width: int = 80) -> tuple[int, str]:
    out = io.StringIO()
    console = Console(width=width, force_terminal=False, color_system=None, file=out)
    return main(argv, console=console), out.getvalue()


def stage_row(lines, stage: int) -> str:
    return next(line for line in lines if re.match(rf"\s*{stage}\s+\d", line))


@pytest.mark.parametrize("width", [80, 200])
def test_the_report_opens_with_the_verdict_peaks_and_time(width):
    a = analysis()
    text = printed(lambda console: render_run(a, console), width)
    summary = printed(build_run_summary(a), width)
    assert text.startswith(summary) and len(text) > len(summary)  # the summary comes first
    lines = summary.splitlines()
    assert len(lines) <= SCREEN
    screen = "\n".join(lines)
    assert lines[0].startswith("debug, ") and "on 4 × h100" in lines[0]
    assert "tp 2 · pp 2 · cp 1 · ep 1 · dp 1" in screen
    assert "Fits on h100 (80 GiB)" in screen
    # Each stage's row: its peak and its own headroom (capacity less the margin and what the
    # rank takes of its GPU: the allocator's reserve and what lives outside it), and the
    # micro-batches in flight at the peak (1F1B: pp - stage).
    capacity = 80 * 2**30 - round(a.job.cluster.reserved_overhead_gib * 2**30)
    for ra in a.roles:
        row = stage_row(lines, ra.role.pp_stage)
        m, d = ra.memory, ra.device
        assert d.total == d.reserve.reserved + d.outside > m.peak
        assert size(m.peak) in row and size(capacity - d.total) in row, row
        assert re.search(r"GiB\s+(\d+)\s+(fwd|bwd)", row)[1] == str(2 - ra.role.pp_stage), row
    timing = a.timing
    assert f"Estimated iteration time {seconds(timing.iteration_seconds)}" in " ".join(lines)
    assert f"pipeline bubble {timing.bubble_fraction:.1%}" in " ".join(lines)
    # Communication per dimension, the pipeline's crossing nodes (2 GPUs per node).
    pp = next(line for line in lines if line.startswith("PP "))
    assert pp.count("KiB") == 2  # sent, all of it across nodes
    assert not re.search(r"\d…|…\d", screen)  # no number cut


def test_out_of_memory_names_the_ranks_and_the_missing_room():
    a = analysis(memory_gib=0.05)  # 51 MiB: less than the reserved overhead alone
    lines = printed(build_run_summary(a), 80).splitlines()
    text = " ".join(lines)
    assert "Out of memory on h100 (0.05 GiB)" in text and "on ranks 0-3" in text
    for ra in a.roles:
        row = stage_row(lines, ra.role.pp_stage)
        assert re.search(r"\s-\d+\.\d+ GiB\s", row), row  # a negative headroom, whole


def test_summary_alone_and_quiet_verdict_alone(tmp_path):
    rc, full = cli(["run", "--config", DEBUG, "--no-full-model"])
    assert rc == 0
    rc, summary = cli(["run", "--config", DEBUG, "--no-full-model", "--summary"])
    assert rc == 0 and full.startswith(summary)
    assert "Memory per GPU" in full and "Memory per GPU" not in summary
    assert "Estimated iteration time" in summary and len(summary.splitlines()) <= SCREEN
    out = tmp_path / "out.json"
    rc, quiet = cli(["run", "--config", DEBUG, "--no-full-model", "-q", "--json", str(out)])
    assert rc == 0 and out.exists()
    verdict, written = quiet.split("\n\n")  # the verdict, then where the JSON went
    assert verdict.startswith("Fits on h100 (79.1 GiB): ranks 2-3 take")
    assert verdict.endswith("GiB.") and len(verdict.splitlines()) <= 3  # nothing else
    assert written.split() == ["JSON", "report", "written", "to", str(out)]
    assert cli(["run", "--config", DEBUG, "--quiet", "--summary"])[0] == 2


def test_detail_adds_the_trees_and_ends_with_the_verdict():
    rc, text = cli(["run", "--config", DEBUG, "--no-full-model", "--detail"], width=150)
    assert rc == 0
    summary_end = text.index("Estimated iteration time")
    configuration = text.index("\nConfiguration\n")
    tree = text.index("Pipeline stage 0 ·")
    memory = text.index("Memory per GPU over one training iteration")
    assert summary_end < configuration < tree < memory
    last = text.rstrip().split("\n\n")[-1]
    assert last.startswith("Fits on h100") and len(last.splitlines()) <= 2  # at 150 columns
