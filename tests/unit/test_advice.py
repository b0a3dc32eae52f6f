"""The error bands by kind of job (metatrace.analysis.margins), the verdict and the planner
that use them, and the advice's rendering (the traced advice: tests/tracing/test_advice.py)."""

import io
import os
import re

import pytest
from rich.console import Console

from metatrace.analysis.margins import DENSE_BAND, MOE_BAND, OFFLOAD_CPU_BAND, error_band
from metatrace.render.advice import build_advice
from tests.helpers import MOE, ROOT, small_job

GIB = 2**30


def test_the_bands_are_the_calibration_figures_the_readme_states():
    """README's "Accuracy" states the calibration; the bands must be its largest errors."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = " ".join(f.read().split())
    dense = re.search(
        r"(\d+) dense cases, median error [\d.]+ %, 90th percentile [\d.]+ %, "
        r"largest ([\d.]+) %",
        text,
    )
    moe = re.search(r"(\d+) mixture-of-experts cases (-?[\d.]+) % to \+([\d.]+) %", text)
    assert dense and moe
    assert DENSE_BAND == pytest.approx(float(dense.group(2)) / 100)
    assert MOE_BAND == pytest.approx(max(abs(float(moe.group(2))), float(moe.group(3))) / 100)


@pytest.mark.parametrize(
    "sections, kind, fraction",
    [
        ({}, "dense", DENSE_BAND),
        ({"model": MOE}, "MoE", MOE_BAND),
        (
            {"parallel": {"pp": 1}, "training": {"cpu_offloading_num_layers": 1}},
            "offloading",
            DENSE_BAND + OFFLOAD_CPU_BAND,
        ),
    ],
)
def test_a_job_gets_the_band_of_its_kind(sections, kind, fraction):
    band = error_band(small_job(**sections))
    assert (band.kind, band.fraction) == (kind, pytest.approx(fraction))
    assert band.percent == f"±{100 * fraction:.1f} %"


def test_within_compares_the_headroom_or_the_shortfall_with_the_band():
    band = error_band(small_job())
    peak = 100 * GIB  # a band of 4.6 GiB
    assert band.bytes_of(peak) == round(0.046 * peak)
    assert band.within(4 * GIB, peak) and band.within(-4 * GIB, peak)
    assert not band.within(5 * GIB, peak) and not band.within(-5 * GIB, peak)


def _verdict(headroom: int, within: bool) -> dict:
    device = 80 * GIB - headroom
    return {
        "fits": headroom >= 0,
        "device_bytes": device,
        "device_ranks": [0],
        "out_of_memory_ranks": [] if headroom >= 0 else [0],
        "headroom_bytes": headroom,
        "reserved_overhead_bytes": 0,
        "allocated_peak_bytes": device - 4 * GIB,
        "allocator_reserve_bytes": device - 3 * GIB,
        "allocator_retries": 0,
        "outside_allocator_bytes": 3 * GIB,
        "outside_terms": [],
        "expandable_segments": None,
        "error_band": {
            "kind": "MoE",
            "fraction": 0.0293,
            "bytes": 2 * GIB,
            "within": within,
            "source": "7 mixture-of-experts calibration cases",
        },
    }


@pytest.mark.parametrize(
    "headroom, within, said",
    [
        (
            GIB,
            True,
            "That headroom is within the ±2.9 % the prediction errs for MoE jobs "
            "(2.00 GiB): it may not fit.",
        ),
        (
            -GIB,
            True,
            "That shortfall is within the ±2.9 % the prediction errs for MoE jobs "
            "(2.00 GiB): it may fit.",
        ),
        (3 * GIB, False, None),
    ],
)
def test_the_verdict_says_when_it_lies_within_the_band(headroom, within, said):
    from metatrace.render.format import verdict_text

    text = verdict_text("h100 (80 GiB)", _verdict(headroom, within))
    if said:
        assert text.endswith(said)
    else:
        assert "within" not in text


def test_the_planner_ranks_layouts_within_the_band_after_the_others():
    from types import SimpleNamespace

    from metatrace.planning.plan import Plan, Traced

    def traced(seconds, within, fits=True):
        report = {"memory_verdict": {"error_band": {"within": within}}}
        estimate = SimpleNamespace(seconds=seconds)
        return Traced(None, 0, 0, fits, estimate, report)

    fast_edge, slow_safe, slower_safe = traced(1.0, True), traced(2.0, False), traced(3.0, False)
    plan = Plan(layouts=4, invalid=0, pruned_memory=0)
    plan.traced = [fast_edge, slower_safe, slow_safe, traced(0.5, False, fits=False)]
    assert plan.ranked() == [slow_safe, slower_safe, fast_edge]
    assert fast_edge.within_error and not slow_safe.within_error


def _change(change, peak, headroom, seconds, within=False):
    return {
        "kind": "micro-batch",
        "change": change,
        "keys": {},
        "megatron_args": [],
        "highest_peak_bytes": peak,
        "headroom_bytes": headroom,
        "fits": headroom >= 0,
        "within_error_band": within,
        "iteration_seconds": seconds,
        "delta_seconds": seconds - 2.0,
        "estimated_peak_bytes": peak,
        "traced": True,
    }


def printed(renderable, width=80) -> str:
    out = io.StringIO()
    Console(file=out, width=width, no_color=True, force_terminal=False).print(renderable)
    return out.getvalue()


def test_the_advice_fits_80_columns_with_its_figures():
    advice = {
        "given_as": "job_file",
        "iteration_seconds": 2.0,
        "changes": [
            _change(
                "training.recompute: {granularity: full, method: block, num_layers: 12}",
                70 * GIB,
                5 * GIB,
                2.5,
            ),
            _change("training.micro_batch_size: 1", 77 * GIB, GIB, 2.2, within=True),
        ],
        "misses": [_change("parallel.tp: 2; parallel.dp: 4", 81 * GIB, -2 * GIB, 2.1)],
        "failed": [],
        "considered": 20,
        "pruned": 1,
    }
    text = printed(build_advice(advice, _verdict(-GIB, False)))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "[granularity" not in text  # the braces and brackets are text, not markup
    rows = [line for line in text.splitlines() if "GiB" in line and "+" in line]
    assert "70.00 GiB" in rows[0] and "5.00 GiB" in rows[0] and "2.50 s" in rows[0]
    assert "+25.0%" in rows[0]
    assert "1.00 GiB*" in rows[1] and "+10.0%" in rows[1]
    assert "*: within the ±2.9 % the prediction errs for MoE jobs" in text
    assert "Traced, still out of memory: parallel.tp: 2; parallel.dp: 4 (short by 2.00 GiB)" in (
        " ".join(text.split())
    )


def test_no_change_found_says_so():
    advice = {
        "given_as": "megatron_args",
        "iteration_seconds": None,
        "changes": [],
        "misses": [],
        "failed": [{"change": "--use-megatron-fsdp", "error": "RuntimeError: x"}],
        "considered": 3,
        "pruned": 2,
    }
    text = " ".join(printed(build_advice(advice, _verdict(-GIB, False))).split())
    assert "No single change found that fits." in text
    assert "metatrace failed on: --use-megatron-fsdp (RuntimeError: x)" in text


def test_the_advice_is_written_as_the_job_was_given():
    """Flags for Megatron-LM arguments however given (a string, --megatron-args-file, a script
    as FILE or --config), job-file keys for a job file."""
    from argparse import Namespace

    from metatrace.cli import _given_as_flags
    from tests.helpers import DEBUG, EXAMPLES

    script = os.path.join(EXAMPLES, "pretrain_llama2_7b_mbs8.sh")

    def given(**sources):
        none = {"job": None, "config": None, "megatron_args": None, "megatron_args_file": None}
        return _given_as_flags(Namespace(**{**none, **sources}))

    assert given(job=script) and given(config=script) and given(megatron_args_file=script)
    assert given(megatron_args="--num-layers 2")
    assert not given(job=DEBUG) and not given(config=DEBUG)
