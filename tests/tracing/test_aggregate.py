"""Aggregation invariants on a real trace: module trees, owners and timelines add up."""

from metatrace.analysis import aggregate as agg
from metatrace.records import STEP


def test_invariants_of_a_real_trace(debug_trace):
    for rt in debug_trace.roles + (debug_trace.full,):
        t = rt.trace
        roots = agg.module_tree(t, rt.chunks)
        owners = agg.activation_owners(t)
        in_model = sum(b for m, b in owners.values() if m != STEP)
        assert sum(r.activation_bytes_total for r in roots) == in_model
        assert sum(r.activation_bytes for r in agg.walk(roots)) == in_model
        assert sum(r.params_total for r in roots) == agg.role_summary(t).params
        live = t.static_bytes
        for e in t.memory:  # the timeline is a running sum of its deltas
            live += e.delta
            assert e.live == live
        assert agg.peak(t).bytes >= t.static_bytes + 0
    ranks = sorted(r for rt in debug_trace.roles for r in rt.role.ranks)
    assert ranks == list(range(debug_trace.world.size))
