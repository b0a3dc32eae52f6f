"""Selective recompute of the MoE layer: what megatron-core's CheckpointFunction recomputes in
backward goes with the micro-batch (the token dispatcher's kept probabilities hold the
recomputed graph, and through it the checkpoint's detached input and its gradient, until the
layer's next forward; metatrace.tracing.trace drops that graph at the end of the layer's
backward), and the iteration's allocator reserve does not grow with the micro-batches."""

import pytest

from metatrace.analysis.analyze import analyze
from metatrace.tracing.trace import trace_job, trace_role
from metatrace.world import World
from tests.helpers import MOE, small_job

H, S, B = 64, 256, 2  # the debug preset's hidden size; the sequence and micro-batch here
BF16 = 2
ALLTOALL = {
    "parallel": {"ep": 2, "moe_token_dispatcher_type": "alltoall"},
    "cluster": {"num_gpus": 2},
}


def recompute_job(modules, num_layers=2, global_batch_size=8, **sections):
    return small_job(
        model={**MOE, "num_layers": num_layers},
        training={
            "recompute": {"granularity": "selective", "modules": modules},
            "global_batch_size": global_batch_size,
            "seq_length": S,
            "micro_batch_size": B,
        },
        **sections,
    )


@pytest.mark.parametrize("dispatcher", [{}, ALLTOALL], ids=["allgather", "alltoall"])
@pytest.mark.parametrize("modules", [["moe"], ["moe", "layernorm"]])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_nothing_of_the_moe_layer_outlives_the_micro_batch(modules, dispatcher, device):
    job = recompute_job(modules, **dispatcher)
    world = World.from_job(job)
    trace = trace_role(job, world, world.roles()[0], device=device).trace
    alive, first = {}, {}
    for e in trace.memory:
        alive[e.storage] = alive.get(e.storage, 0) + e.delta
        first.setdefault(e.storage, (e.module, e.phase))
    left = [
        (first[s], n)
        for s, n in alive.items()
        if n > 0 and (".pre_mlp_layernorm" in first[s][0] or ".mlp" in first[s][0])
    ]
    # The dispatcher's last probabilities (tokens x top-k of them) stay, as on a GPU until the
    # next forward; the layer's input (S x B x H), its gradient and recomputed activations go.
    assert left and all(n < S * B * H * BF16 for _, n in left), left


@pytest.mark.parametrize("modules", [["moe"], ["moe", "layernorm"]])
def test_the_reserve_does_not_grow_with_the_micro_batches(modules):
    """8 layers (tracing.layers builds the middle ones' records from the traced ones): the
    iteration's reserve with 32 micro-batches is that of 2."""

    def device(micro_batches):
        job = recompute_job(modules, num_layers=8, global_batch_size=B * micro_batches)
        (role,) = analyze(trace_job(job, full_model=False, workers=1)).roles
        return role.memory.peak, role.device.reserve

    peak2, reserve2 = device(2)
    peak32, reserve32 = device(32)
    # (each micro-batch's loss, kept for the iteration's report, is a 512-byte block)
    assert peak2 <= peak32 <= peak2 + 30 * 512
    assert reserve2.allocated <= reserve32.allocated <= reserve2.allocated + 30 * 512
    assert reserve32.reserved <= reserve2.reserved + 2**21, (reserve2, reserve32)
