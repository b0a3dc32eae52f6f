"""`metatrace diff` without tracing: how roles pair up, which direction is better, how sides
are labelled and an identical pair printed (diffs of traced jobs are in
tests/tracing/test_diff.py)."""

import io
import json

import pytest
from rich.console import Console

from metatrace.analysis.diff import diff_reports, pair_roles
from metatrace.render.diff import render_diff


def test_pairing_keeps_ends_together_when_no_layer_decides():
    roles = lambda *layers: [{"layers": list(x)} for x in layers]
    # The same layers on both sides: stage by stage.
    assert pair_roles(roles([1, 2], [3, 4]), roles([1, 2], [3, 4])) == [(0, 0), (1, 1)]
    # Three stages against two, uneven: the middle stage goes where most of its layers are.
    assert pair_roles(roles([1, 2], [3, 4, 5], [6]), roles([1, 2, 3], [4, 5, 6])) == [
        (0, 0),
        (1, 1),
        (2, 1),
    ]
    # No layers (an embedding-only first stage): the first stage pairs with the first.
    assert pair_roles(roles([], [1, 2], [3, 4]), roles([1, 2], [3, 4])) == [(0, 0), (1, 0), (2, 1)]


def test_direction_marks_better_and_worse():
    base = {
        "source": "a",
        "model": {},
        "parallel": {},
        "cluster": {},
        "world": {},
        "roles": [],
        "memory_verdict": {
            "fits": False,
            "highest_peak_bytes": 100,
            "headroom_bytes": -10,
            "out_of_memory_ranks": [1, 2],
        },
    }
    other = json.loads(json.dumps(base))
    other["memory_verdict"].update(
        fits=True, highest_peak_bytes=80, headroom_bytes=10, out_of_memory_ranks=[]
    )
    diff = diff_reports(base, other)
    rows = {r["figure"]: r for r in diff["cluster"]}
    assert rows["memory_verdict.highest_peak_bytes"]["percent"] == pytest.approx(-20.0)
    assert rows["memory_verdict.out_of_memory_ranks"]["delta"] == -2
    assert rows["memory_verdict.fits"]["better"] == "higher"
    assert [c["path"] for c in diff["changes"]] == [
        "cluster.memory_verdict.fits",
        "cluster.memory_verdict.highest_peak_bytes",
        "cluster.memory_verdict.headroom_bytes",
        "cluster.memory_verdict.out_of_memory_ranks",
    ]


def _report(source, peak=100):
    return {
        "source": source,
        "model": {},
        "parallel": {},
        "cluster": {},
        "world": {},
        "roles": [],
        "memory_verdict": {"highest_peak_bytes": peak},
    }


def _rendered(diff, **kw) -> str:
    out = io.StringIO()
    render_diff(diff, Console(file=out, width=100, color_system=None), **kw)
    return out.getvalue()


def test_sides_are_labelled_as_given_and_an_identical_pair_is_one_line():
    a, b = _report("job.yaml"), _report("job.yaml")
    diff = diff_reports(a, b, ("out.json (from job.yaml)", "job.yaml"))
    assert diff["a"]["label"] == "out.json (from job.yaml)" and diff["a"]["source"] == "job.yaml"
    assert _rendered(diff) == (
        "Same configuration and figures: out.json (from job.yaml) and job.yaml\n"
    )
    # --all still shows every figure; without labels a side is the job it came from.
    assert "highest peak" in _rendered(diff, all_rows=True)
    assert diff_reports(a, b)["b"]["label"] == "job.yaml"


def test_a_changed_pair_names_both_sides_and_its_changes():
    diff = diff_reports(
        _report("a.yaml"), _report("b.yaml", peak=80), ("a.json (from a.yaml)", "b.yaml")
    )
    text = _rendered(diff)
    assert text.startswith("A a.json (from a.yaml)\nB b.yaml\n")
    assert "Same configuration and figures" not in text and "1 change." in text
