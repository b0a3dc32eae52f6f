"""`metatrace diff` without tracing: how roles pair up, which direction is better (diffs of
traced jobs are in tests/tracing/test_diff.py)."""

import json

import pytest

from metatrace.analysis.diff import diff_reports, pair_roles


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
