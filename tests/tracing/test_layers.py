"""Decoder layers traced in part (metatrace.tracing.layers) against tracing every layer: the
same micro-batch records, field for field (memory events with their live bytes and storages,
saved tensors, collectives with their FLOPs offsets, windows, operator counts), on dense and
MoE layouts: tensor and sequence parallel, virtual pipeline chunks, expert parallel with a dense
run and a MoE run in one block, context parallel with selective recompute, full recompute of
each layer (dense, MoE, interleaved). The runs must really
be cut (the test fails if a case falls back to the whole trace), a run whose kept layers
differ is traced whole; layers that share a cache they fill (MLA's rotary embeddings) are cut
too, with the evictions of the layers skipped put back."""

import dataclasses

import pytest

from metatrace.records import Trace
from metatrace.tracing import layers
from metatrace.tracing.trace import _trace_role, trace_role
from metatrace.world import World
from tests.helpers import MLA, MOE, small_job

# each layer recomputed on its own (uniform, one layer a group)
FULL_RECOMPUTE = {"granularity": "full", "method": "uniform", "num_layers": 1}
LAYOUTS = {
    # name: (sections, runs cut per role)
    "dense-tp2-sp": (
        {
            "model": {"num_layers": 9},
            "parallel": {"tp": 2, "sequence_parallel": True},
            "cluster": {"num_gpus": 2},
        },
        [1],
    ),
    "pp2-vpp2-dp2": (
        {
            "model": {"num_layers": 32},
            "parallel": {"pp": 2, "vpp": 2},
            "training": {"global_batch_size": 8, "distributed_optimizer": True},
            "cluster": {"num_gpus": 4},
        },
        [2, 2],
    ),
    "moe-ep2-dense-then-moe": (
        {
            "model": {**MOE, "num_layers": 16, "moe_layer_freq": [0] * 7 + [1] * 9},
            "parallel": {"ep": 2, "tp": 2, "sequence_parallel": True},
            "cluster": {"num_gpus": 4},
        },
        [2],
    ),
    # 40 multi-latent attention layers: their rotary embeddings share megatron-core's cache of
    # 32 outputs, so from the 33rd layer on each forward frees the oldest entry, which the
    # truncated run never does (metatrace.tracing.caches puts the frees back).
    "mla-40-layers": ({"model": {**MLA, "num_layers": 40}}, [1]),
    # As DeepSeek-V3 is laid out: dense layers then MoE ones, a multi-token prediction layer
    # (one more instance of the cache), full recompute of each layer, tp 2 with sequence
    # parallelism.
    "mla-dense-then-moe-mtp-full-recompute": (
        {
            "model": {
                **MLA,
                **MOE,
                "num_layers": 40,
                "moe_layer_freq": [0] * 3 + [1] * 37,
                "mtp_num_layers": 1,
            },
            "parallel": {"tp": 2, "sequence_parallel": True},
            "training": {"recompute": FULL_RECOMPUTE},
            "cluster": {"num_gpus": 2},
        },
        [1],
    ),
    "full-recompute-uniform": (
        {
            "model": {"num_layers": 9},
            "parallel": {"tp": 2, "sequence_parallel": True},
            "training": {"recompute": FULL_RECOMPUTE},
            "cluster": {"num_gpus": 2},
        },
        [1],
    ),
    "moe-ep2-full-recompute": (
        {
            "model": {**MOE, "num_layers": 9},
            "parallel": {"ep": 2},
            "training": {"recompute": FULL_RECOMPUTE},
            "cluster": {"num_gpus": 2},
        },
        [1],
    ),
    "pp2-vpp2-full-recompute": (
        {
            "model": {"num_layers": 32},
            "parallel": {"pp": 2, "vpp": 2},
            "training": {
                "global_batch_size": 8,
                "recompute": FULL_RECOMPUTE,
            },
            "cluster": {"num_gpus": 2},
        },
        [2, 2],
    ),
    "cp2-selective-recompute": (
        {
            "model": {"num_layers": 8},
            "parallel": {"cp": 2},
            "training": {"recompute": {"granularity": "selective"}},
            "cluster": {"num_gpus": 2},
        },
        [1],
    ),
}


def _records(trace) -> dict:
    return {f.name: getattr(trace, f.name) for f in dataclasses.fields(Trace)}


def _counting_cuts(monkeypatch) -> list[int]:
    """The layers each cut trace expands, per micro-batch traced (0: traced whole)."""
    cut: list[int] = []
    expand = layers.expand

    def counted(trace, runs, marks):
        out = expand(trace, runs, marks)
        cut.append(len(runs) if out is not None else 0)
        return out

    monkeypatch.setattr(layers, "expand", counted)
    return cut


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layers_traced_in_part_give_the_whole_records(layout, monkeypatch):
    sections, expected = LAYOUTS[layout]
    job = small_job(**sections)
    world = World.from_job(job)
    cut = _counting_cuts(monkeypatch)
    for role in world.roles():
        part = _trace_role(job, world, role, iteration=False).trace
        whole = _trace_role(job, world, role, iteration=False, whole=True).trace
        assert _records(part) == _records(whole)
    assert cut == expected


def test_a_run_whose_kept_layers_differ_is_traced_whole(monkeypatch):
    sections, _ = LAYOUTS["dense-tp2-sp"]
    job = small_job(**sections)
    world = World.from_job(job)
    role = world.roles()[0]
    calls = []
    form = layers._Span.form

    def differs(span, trace):
        calls.append(span)
        return (len(calls), form(span, trace))

    monkeypatch.setattr(layers._Span, "form", differs)
    rt = trace_role(job, world, role)
    assert calls  # the kept layers were compared
    whole = _trace_role(job, world, role, whole=True)
    assert _records(rt.trace) == _records(whole.trace)
    assert _records(rt.iteration) == _records(whole.iteration)


def test_what_the_skipped_layers_forwards_change_is_changed_for_them_too(monkeypatch):
    """A layer's first forward replaces some of its buffers: megatron-core's router keeps its
    expert bias in float32 (Float16Module made it bf16), MLA's fused rotary embedding caches
    cos and sin in the input's dtype. The skipped layers get the same (layers.mirror), so
    that the iteration's replay sees the static memory tracing every layer leaves: its
    records equal, buffers' sizes included, and the run really cut."""
    job = small_job(
        model={
            **MLA,
            **MOE,
            "num_layers": 12,
            "moe_layer_freq": [0] * 2 + [1] * 10,
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
        },
        training={"recompute": FULL_RECOMPUTE},
    )
    world = World.from_job(job)
    role = world.roles()[0]
    cut = _counting_cuts(monkeypatch)
    part = _trace_role(job, world, role)
    whole = _trace_role(job, world, role, whole=True)
    assert cut == [1]
    assert _records(part.trace) == _records(whole.trace)
    assert _records(part.iteration) == _records(whole.iteration)
    # the expert bias of every MoE layer in float32 (4 experts: 16 bytes, a 512-byte block)
    assert part.iteration.static_sizes == whole.iteration.static_sizes
