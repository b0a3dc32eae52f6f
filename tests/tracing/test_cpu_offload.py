"""Transformer Engine's layer-wise CPU activation offloading (--cpu-offloading-num-layers, TE 2.8's
handler as metatrace.models.te_cpu_offload restates it): what one layer moves in closed form, the
PCIe traffic and pinned host memory, and the prediction against megatron-core running the local
spec on CPU tensors (`metatrace measure`), where only the linear layers' inputs and the SwiGLU
input are marked (megatron-core's own marks).

Sizes of the debug preset: h 64, a 4 heads, g 2 query groups, d 16, ffn 128 (SwiGLU: fc1 out
256), s 64, b 2 (N = s b = 128 tokens), bf16, tp 1, RMSNorm."""

import pytest
import torch

from metatrace.analysis.analyze import analyze
from metatrace.planning.estimates import memory_lower_bound
from metatrace.tracing.measure import measure_rank, predict
from metatrace.tracing.trace import trace_job
from tests.helpers import small_job

N, H, A, G, D, F = 128, 64, 4, 2, 16, 128
BF16, F32 = 2, 4

# What TE's modules and megatron-core mark in one layer of the TE spec (fused attention).
TE_LAYER = {
    "linear_qkv (x, ln_out, rsigma)": 2 * N * H * BF16 + N * F32,
    "core_attention (q, k, v, out, stats, rng)": (
        2 * N * A * D * BF16 + 2 * N * G * D * BF16 + A * N * F32 + 2 * 8
    ),
    "linear_proj (its input: a second copy of out)": N * A * D * BF16,
    "linear_fc1 (x, ln_out, rsigma)": 2 * N * H * BF16 + N * F32,
    "SwiGLU input": N * 2 * F * BF16,
    "linear_fc2 (its input)": N * F * BF16,
}
# The local spec: the linear layers' inputs (megatron-core's layers.py) and the SwiGLU input.
LOCAL_LAYER = N * H * BF16 * 3 + N * 2 * F * BF16 + N * F * BF16


def offload_job(layers, offloaded, **sections):
    training = {"global_batch_size": 8, "cpu_offloading_num_layers": offloaded}
    training.update(sections.pop("training", {}))
    return small_job(model={"num_layers": layers}, training=training, **sections)


def analysis(job):
    return analyze(trace_job(job, full_model=False, workers=1))


def test_te_spec_moves_what_te_marks_from_the_first_layers_only():
    job = offload_job(4, 3)
    rt = trace_job(job, full_model=False, workers=1).roles[0]
    per_layer = {}
    for m in rt.offload.moved:
        per_layer[m.group] = per_layer.get(m.group, 0) + m.bytes
    assert per_layer == {layer: sum(TE_LAYER.values()) for layer in range(3)}


def test_traffic_and_pinned_host_memory_per_iteration():
    job = offload_job(4, 2)  # one GPU: 4 micro-batches of 2
    o = analysis(job).roles[0].offload
    moved = 2 * sum(TE_LAYER.values())
    assert o.d2h_per_microbatch == moved
    assert o.d2h_per_iteration == job.num_microbatches * moved
    # Each host buffer is a power of two (PyTorch's caching host allocator).
    assert moved <= o.pinned_host < 2 * moved


def test_offloading_lowers_the_activations_by_the_layers_it_drops_before_the_backward():
    """With 2 of 4 layers, TE's windows drop group 0 after layer 1 and group 1 after layer 3:
    when the backward starts only the last two layers' marked tensors are on the GPU."""
    base = analysis(offload_job(4, 0, training={"cpu_offloading_num_layers": 0}))
    half = analysis(offload_job(4, 2))
    saved = base.roles[0].memory, half.roles[0].memory
    dropped = saved[0].activations - saved[1].activations
    # The GPU storages are fewer than the copies: linear_proj's input is out's storage (TE
    # copies it twice); the 16-byte rng state takes a 512-byte block.
    per_layer = sum(TE_LAYER.values()) - N * A * D * BF16 + (512 - 2 * 8)
    assert dropped == 2 * per_layer
    # The planner's bound leaves the offloaded layers' inputs out and stays a bound.
    job = offload_job(4, 3)
    bound = memory_lower_bound(job)
    assert memory_lower_bound(offload_job(4, 0)) - bound == 3 * N * H * BF16
    assert bound <= analysis(job).roles[0].memory.peak


@pytest.mark.parametrize("offloaded", [1, 3])
def test_prediction_matches_megatron_core_offloading_on_cpu(offloaded):
    """The local spec on CPU tensors: TE's handler (the stand-in) drops and re-creates what
    megatron-core marks; the saved bytes when the backward starts are exact, the peak within 1 %."""
    torch.set_num_threads(1)
    job = offload_job(4, offloaded, implementation={"transformer_impl": "local"})
    base = offload_job(4, 0, implementation={"transformer_impl": "local"})
    predicted, measured = predict(job, 0), measure_rank(job, 0, iterations=2)
    assert measured.saved_blocks == predicted.saved
    assert predict(base, 0).saved - predicted.saved == offloaded * LOCAL_LAYER
    peak = predicted.peak - predicted.cuda_only
    assert abs(peak - measured.peak_blocks) <= 0.01 * measured.peak_blocks


def test_fp8_moves_the_quantized_data_not_the_scales():
    """Under FP8 TE marks the quantized inputs' data tensors (get_data_tensors): the uint8
    copies go to the host, their fp32 scales stay on the GPU."""
    job = offload_job(2, 1, training={"precision": "fp8", "fp8_recipe": "tensorwise"})
    moved = trace_job(job, full_model=False, workers=1).roles[0].offload.moved
    fp8 = [m for m in moved if m.dtype == "uint8"]
    assert fp8 and all(m.shape[0] in (N, H, 2 * F, F) for m in fp8)
    assert not [m for m in moved if m.shape == (1,)]


def test_the_time_model_runs_the_copies_beside_the_steps():
    """Each step lasts at least its copies over the host link: a slow enough link makes them
    the steps' duration."""
    from metatrace.analysis.timing import offload_exposed_seconds

    fast = analysis(offload_job(4, 2, cluster={"host_link_gbps": 1e9}))
    slow = analysis(offload_job(4, 2, cluster={"host_link_gbps": 1e-3}))
    moved = 2 * sum(TE_LAYER.values())  # per micro-batch, each way
    copy = moved * 8 / (1e-3 * 1e9)
    steps = [sp for sp in slow.timing.stages[0].spans if sp.phase in ("forward", "backward")]
    assert all(sp.offload_seconds == pytest.approx(copy) for sp in steps)
    assert all(sp.end - sp.start == pytest.approx(copy) for sp in steps)
    assert offload_exposed_seconds(fast.timing) == 0.0
    assert slow.timing.iteration_seconds > fast.timing.iteration_seconds + len(steps) * copy * 0.9
