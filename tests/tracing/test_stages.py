"""Middle pipeline stages whose micro-batch is derived from one traced stage
(metatrace.tracing.stages), their iteration replayed from it, against tracing every stage: the
same records, field for field (modules with their global layer numbers, collectives with their
groups and peers, memory, saved tensors, windows, operator counts, the replayed iteration), on
dense layouts with virtual stages, with the embedding and loss counted in the split, with data
and context parallelism, with a steady-state iteration; a layer pattern (windowed attention)
that makes two stages differ is traced, not derived; MoE jobs are traced stage by stage."""

import dataclasses

import pytest

from metatrace.records import Trace
from metatrace.tracing import stages
from metatrace.tracing.trace import trace_job
from tests.helpers import MOE, small_job

LAYOUTS = {
    # name: (sections, stages derived)
    "dense-pp4": (
        {"model": {"num_layers": 8}, "parallel": {"tp": 2, "pp": 4}, "cluster": {"num_gpus": 8}},
        {2},
    ),
    "vpp2-embedding-loss-dp2-cp2": (
        {
            "model": {"num_layers": 6},
            "parallel": {
                "pp": 4,
                "vpp": 2,
                "cp": 2,
                "account_for_embedding": True,
                "account_for_loss": True,
            },
            "training": {
                "global_batch_size": 16,
                "distributed_optimizer": True,
                "overlap_grad_reduce": True,
            },
            "cluster": {"num_gpus": 16},
        },
        {2},
    ),
    "moe-pp5-ep2": (
        {
            # Stages 1 and 3 hold MoE and dense layers alike, but MoE's micro-batch leaves
            # state its iteration reads (the aux-loss tracker): every stage is traced.
            "model": {**MOE, "num_layers": 10, "moe_layer_freq": [0, 0, 0, 1, 1, 1, 0, 1, 1, 1]},
            "parallel": {"pp": 5, "ep": 2},
            "cluster": {"num_gpus": 10, "gpus_per_node": 10},
        },
        set(),
    ),
    "window-every-2nd-full-steady": (
        {
            # Full attention on even layers (1-based): stage 1 (layers 4-6) and stage 3
            # (10-12) are full, windowed, full; stage 2 (7-9) windowed, full, windowed. 300
            # micro-batches: the iteration comes from its steady state.
            "model": {"num_layers": 15, "window_size": [8, 0], "window_attn_skip_freq": 2},
            "parallel": {"pp": 5},
            "training": {"global_batch_size": 2 * 300},
            "cluster": {"num_gpus": 5, "gpus_per_node": 5},
        },
        {3},
    ),
}


def _fields(rt) -> dict:
    out = {f.name: getattr(rt, f.name) for f in dataclasses.fields(rt) if f.name != "seconds"}
    for name in ("trace", "iteration"):
        t = out.pop(name)
        out[name] = {f.name: getattr(t, f.name) for f in dataclasses.fields(Trace)}
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_derived_stages_are_the_traced_ones(layout, monkeypatch):
    sections, expected = LAYOUTS[layout]
    job = small_job(**sections)
    derived = []
    real = stages.derive

    def spy(trace, rank, world, shifts, chunks):
        out = real(trace, rank, world, shifts, chunks)
        if out is not None:
            derived.append(world.pp_stage_of[rank])
        return out

    monkeypatch.setattr(stages, "derive", spy)
    fast = trace_job(job, full_model=False, workers=2)  # the derived stages follow in the pool
    full = trace_job(job, full_model=False, workers=1, derive=False)
    assert set(derived) == expected
    for a, b in zip(fast.roles, full.roles):
        assert _fields(a) == _fields(b), a.role
