"""MoE router padding for FP8 (training.moe_router_padding_for_quantization) against closed forms.

Layout: the debug preset (h 64), 8 experts, top 2, ep 2 (4 local experts), micro-batch 2. Under
balanced routing a rank of N = s·b tokens sends each expert c = N·2/8 tokens; with router padding
megatron-core's pad_routing_map makes that round_up(c, A) per source rank and expert (A = 16, 32
with MXFP8), so the alltoall dispatcher sends 8·round_up(c, A) rows and each local expert gets
2·round_up(c, A), aligned already, where without it TE's Fp8Padding pads the 2·c rows the expert
gets to round_up(2·c, A). The flex dispatcher pads what arrived: the traffic does not change.
s = 40: c = 20 -> 32, so 256 rows leave a rank instead of 160, and an expert computes 64 rows
instead of round_up(40, 16) = 48.
"""

import pytest

from metatrace.tracing.trace import trace_job
from tests.helpers import BALANCED, assert_meta_matches_real, collective_rows, small_job
from tests.tracing.test_moe_fp8 import quantized_saved, rnd, saved_closed_form

H, F, EXPERTS, TOPK, EP, MBS = 64, 96, 8, 2, 2, 2
LOCAL = EXPERTS // EP
BF16 = 2


def job(pad, seq=40, dispatcher="alltoall", recipe="tensorwise", gpu="h100", training=None):
    return small_job(
        model={"num_experts": EXPERTS, "moe_router_topk": TOPK, "moe_ffn_hidden_size": F},
        parallel={"ep": EP, "moe_token_dispatcher_type": dispatcher},
        training={
            **BALANCED,
            "seq_length": seq,
            "micro_batch_size": MBS,
            "global_batch_size": 2 * MBS,
            "precision": "fp8",
            "fp8_recipe": recipe,
            "moe_router_padding_for_quantization": pad,
            **(training or {}),
        },
        implementation={"moe_grouped_gemm": True},
        cluster={"num_gpus": EP, "gpu": gpu},
    )


def traced(j):
    return trace_job(j, full_model=False, workers=1).roles[0].trace


def up(n, a):
    return -(-n // a) * a


def dispatch_rows(trace, phase="forward"):
    """Rows of the layer-0 token all-to-alls ([rows, h] bf16) in order: dispatch, combine."""
    return [
        c.shape[0]
        for c in trace.collectives
        if c.op == "all_to_all"
        and c.phase == phase
        and c.shape[1:] == (H,)
        and c.module.startswith("decoder.layers.0.")
    ]


def padding_allocations(trace):
    """What TE's Fp8Padding allocates in layer 0's forward (nothing when the rows are aligned)."""
    name = "decoder.layers.0.mlp.experts.quantization_padding"
    return [
        e.delta for e in trace.memory if e.module == name and e.phase == "forward" and e.delta > 0
    ]


def test_padded_is_pad_routing_map_on_real_maps():
    """models.moe.padded against megatron-core's pad_routing_map on real maps: the next
    multiple, or every row of the map when it has fewer."""
    import torch
    from megatron.core.transformer.moe.moe_utils import pad_routing_map

    from metatrace.models.moe import padded

    for tokens, count, align in [
        (100, 25, 16),
        (100, 32, 16),
        (80, 20, 32),
        (8, 2, 16),
        (40, 0, 16),
    ]:
        routing_map = torch.zeros(tokens, 1, dtype=torch.bool)
        routing_map[:count] = True
        real = int(pad_routing_map(routing_map, align).sum())
        assert padded(count, align, tokens) == real


@pytest.mark.parametrize(
    "recipe, gpu, seq",
    [("tensorwise", "h100", 40), ("blockwise", "h100", 40), ("mxfp8", "b200", 20)],
)
def test_alltoall_sends_the_padding_and_the_experts_get_aligned_rows(recipe, gpu, seq):
    align = 32 if recipe == "mxfp8" else 16
    c = seq * MBS * TOPK // EXPERTS  # 20 or 10: a source rank's tokens for one expert
    plain, pad = (
        traced(job(False, seq, recipe=recipe, gpu=gpu)),
        traced(job(True, seq, recipe=recipe, gpu=gpu)),
    )
    # every rank sends round_up(c, A) rows per expert, and gets as many back (ep 2, balanced)
    assert dispatch_rows(pad) == [EXPERTS * up(c, align)] * 2
    assert dispatch_rows(plain) == [EXPERTS * c] * 2
    for trace, rows in ((pad, EXPERTS * up(c, align)), (plain, EXPERTS * c)):
        (message,) = {
            x.bytes for x in trace.collectives if x.op == "all_to_all" and x.shape == (rows, H)
        }
        assert message == rows * H * BF16
    # each local expert: 2 sources x round_up(c, A) rows, aligned, so Fp8Padding has nothing to
    # do; without router padding it pads the 2·c rows to round_up(2·c, A)
    assert quantized_saved(pad, "linear_fc1") == saved_closed_form(
        recipe, gpu, [EP * up(c, align)] * LOCAL, H
    )
    assert quantized_saved(plain, "linear_fc1") == saved_closed_form(
        recipe, gpu, [up(EP * c, align)] * LOCAL, H
    )
    assert padding_allocations(pad) == []
    assert padding_allocations(plain) == [
        rnd(LOCAL * up(EP * c, align) * H * BF16),
        rnd(LOCAL * up(EP * c, align) * BF16),
    ]


def test_figures_of_the_default_case():
    """The figures of the module docstring, written out (s 40, tensorwise)."""
    pad, plain = traced(job(True)), traced(job(False))
    assert dispatch_rows(pad) == [256, 256] and dispatch_rows(plain) == [160, 160]
    assert quantized_saved(pad, "linear_fc1") == LOCAL * (rnd(64 * H) + rnd(4))
    assert quantized_saved(plain, "linear_fc1") == LOCAL * (rnd(48 * H) + rnd(4))
    assert quantized_saved(pad, "linear_fc1") > quantized_saved(plain, "linear_fc1")


def test_hottest_expert_is_padded_after_its_scaling():
    """s 50: c = 25. With moe_hottest_expert_load 1.5 the first local expert gets
    ceil(1.5·25) = 38 rows from each source, padded to 48; the others 25 -> 32. A rank sends
    8·32 = 256 rows and receives 2·(48 + 3·32) = 288 (the combine sends those back)."""
    trace = traced(job(True, seq=50, training={"moe_hottest_expert_load": 1.5}))
    assert dispatch_rows(trace) == [256, 288]
    plain = traced(job(False, seq=50, training={"moe_hottest_expert_load": 1.5}))
    assert dispatch_rows(plain) == [200, 2 * (38 + 3 * 25)]


def test_flex_pads_on_the_receiving_side_and_moves_the_same_bytes():
    """DeepEP: the dispatched routing map is padded per local expert after the dispatch
    (_DeepepManager._pad_routing_map): each expert gets 2·20 = 40 rows, padded to 48 before
    the permutation. Every collective is the same with and without router padding, the experts
    compute 48 rows each either way, and Fp8Padding has nothing left to pad."""
    pad, plain = traced(job(True, dispatcher="flex")), traced(job(False, dispatcher="flex"))
    assert collective_rows(pad) == collective_rows(plain)
    rows = [up(EP * 20, 16)] * LOCAL
    assert quantized_saved(pad, "linear_fc1") == saved_closed_form("tensorwise", "h100", rows, H)
    assert quantized_saved(plain, "linear_fc1") == quantized_saved(pad, "linear_fc1")
    assert padding_allocations(pad) == []
    # (DeepEP's probabilities are fp32)
    assert padding_allocations(plain) == [rnd(LOCAL * 48 * H * BF16), rnd(LOCAL * 48 * 4)]


@pytest.mark.parametrize("seq", [40, 4])
def test_meta_matches_real_cpu_tensors_with_router_padding(seq):
    """On real CPU tensors megatron-core's own pad_routing_map pads the balanced routing map and
    permute counts what it selected: the same saved tensors and collectives as the meta trace,
    whose counts come from models.moe. s 4: c = 2 of N = 8 tokens, so an expert can only be
    padded to all 8 rows (pad_routing_map turns zeros into ones, no more)."""
    from metatrace.world import World

    j = job(True, seq=seq)
    world = World.from_job(j)
    assert_meta_matches_real(j, world, world.roles()[0])
    if seq == 4:
        assert dispatch_rows(traced(j)) == [EXPERTS * 8] * 2
