"""GPT-OSS (issue 17): the presets' parameter counts against the published ones, a small
GPT-OSS-shaped model (biased experts, attention sinks, alternating sliding windows, YaRN,
clamped quick-GEGLU) against megatron-core on real CPU tensors, and the Transformer Engine
stand-ins' sinks, biases and window FLOPs against closed forms."""

import pytest

from metatrace.analysis import aggregate as agg
from metatrace.tracing.trace import trace_job
from tests.helpers import assert_meta_matches_real, small_job

# On the debug preset (h 64, 4 heads in 2 groups of 16): 4 experts of 96, top 2, every feature.
GPT_OSS = {
    "num_layers": 2,
    "add_bias_linear": True,
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 96,
    "activation": "quick_geglu",
    "glu_linear_offset": 1.0,
    "activation_func_clamp_value": 7.0,
    "softmax_type": "learnable",
    "window_size": [16, 0],
    "window_attn_skip_freq": 2,
    "position_embedding_type": "yarn",
    "rotary_scaling_factor": 32.0,
    "original_max_position_embeddings": 16,
}
H, HEADS, S, B = 64, 4, 64, 2


def gpt_oss_job(impl="transformer_engine", model=None, **sections):
    implementation = {"transformer_impl": impl, "bias_dropout_fusion": False}
    if impl == "transformer_engine":
        implementation["moe_grouped_gemm"] = True
    implementation.update(sections.pop("implementation", {}))
    return small_job(
        model={**GPT_OSS, **(model or {})},
        parallel={"ep": 2, "moe_token_dispatcher_type": "alltoall"},
        training={"global_batch_size": 4},
        implementation=implementation,
        cluster={"num_gpus": 2},
        **sections,
    )


@pytest.mark.parametrize(
    "preset, gpus, total, active",
    [
        # openai/gpt-oss-120b model card: 116.83B total, 5.13B active (without the input
        # embedding). Per layer: attention q 2880·4096 + 4096, k and v 2880·512 + 512 each,
        # o 4096·2880 + 2880, sinks 64 = 26,550,144; router 2880·128 + its bias 128 (megatron-
        # core's TopKRouter has one with add_bias_linear, as HF's) = 368,768; 128 experts of
        # 2880·5760 + 5760 + 2880·2880 + 2880 = 24,891,840; norms 5,760. 36 layers + embedding
        # and output layer 2·201088·2880 + final norm 2880 = 116,829,156,672. Active: 4 experts
        # per layer, 5,132,849,472 + the input embedding 579,133,440.
        ("gpt-oss-120b", 32, 116_829_156_672, 5_132_849_472 + 579_133_440),
        # openai/gpt-oss-20b: 20.91B total, 3.61B active; 24 layers of 32 experts (router
        # 2880·32 + 32).
        ("gpt-oss-20b", 8, 20_914_757_184, 3_608_307_264 + 579_133_440),
    ],
)
def test_gpt_oss_preset_totals_are_the_published_counts(preset, gpus, total, active):
    job = small_job(
        model={"preset": preset},
        parallel={"pp": 4, "ep": gpus // 4, "moe_token_dispatcher_type": "alltoall"},
        training={"seq_length": 256, "micro_batch_size": 1, "global_batch_size": 8},
        implementation={"moe_grouped_gemm": True, "bias_dropout_fusion": False},
        cluster={"num_gpus": gpus},
    )
    traces = [rt.trace for rt in trace_job(job, full_model=False).roles]
    par, m = job.parallel, job.model
    assert agg.model_params(traces, par.tp, par.ep, par.etp) == total
    share = m.moe_router_topk / m.num_experts
    assert agg.model_params(traces, par.tp, par.ep, par.etp, expert_share=share) == active


def test_gpt_oss_small_against_megatron_core_running_on_cpu():
    """megatron-core's local spec (its DotProductAttention with the learnable offset and the
    sliding-window mask, SequentialMLP with biases and the fused quick-GEGLU) on real CPU
    tensors, measured by metatrace measure: the saved bytes equal, the peak within 1 %."""
    import torch

    from metatrace.tracing.measure import measure_rank, predict

    torch.set_num_threads(1)
    job = gpt_oss_job("local")
    predicted, measured = predict(job, 0), measure_rank(job, 0, iterations=2)
    assert measured.saved_blocks == predicted.saved > 0
    peak = predicted.peak - predicted.cuda_only
    assert abs(peak - measured.peak_blocks) <= 0.01 * measured.peak_blocks


@pytest.mark.parametrize("backend", ["fused", "unfused"])
def test_te_stand_ins_on_meta_match_real_cpu_tensors(backend):
    from metatrace.world import World

    job = gpt_oss_job(implementation={"attention_backend": backend})
    world = World.from_job(job)
    assert_meta_matches_real(job, world, world.roles()[0])


def test_sequential_experts_with_biases_on_meta_match_real_cpu_tensors():
    """Experts one TE linear pair each (no grouped GEMM), with biases: megatron-core 0.19 adds
    an expert's fc2 bias, scaled by its routing probability, into the fc2 output in place
    (mlp.py:350), which autograd allows only on a GEMM output that is no view (TE writes the
    N-d shape itself); both sides keep the same tensors."""
    from metatrace.world import World

    job = gpt_oss_job(implementation={"moe_grouped_gemm": False})
    world = World.from_job(job)
    assert_meta_matches_real(job, world, world.roles()[0])


def _trace(job):
    return trace_job(job, full_model=False, workers=1).roles[0].trace


def test_sinks_and_expert_biases_in_closed_form():
    """Learnable sinks: one parameter per head per layer (bf16), and fused attention saves the
    fp32 offsets [1, heads, 1, 1] per layer. Expert biases: fc1 [2·96] and fc2 [64] per local
    expert (2 of 4 at ep 2)."""
    sink = _trace(gpt_oss_job())
    plain = _trace(gpt_oss_job(model={"softmax_type": "vanilla"}))
    params = lambda t, name: sum(
        p.numel for m in t.modules for p in m.params if p.name.startswith(name)
    )
    assert params(sink, "softmax_offset") == 2 * HEADS
    assert params(plain, "softmax_offset") == 0
    assert params(sink, "bias") - params(plain, "bias") == 0
    saved = lambda t: [(s.shape, s.dtype) for s in t.saved if s.module.endswith("core_attention")]
    extra = list(saved(sink))
    for item in saved(plain):
        extra.remove(item)
    assert extra == [((1, HEADS, 1, 1), "float32")] * 2
    experts = [
        p
        for m in sink.modules
        if ".experts.linear_fc" in m.fqn
        for p in m.params
        if p.name.startswith("bias")
    ]
    assert sorted(p.numel for p in experts) == sorted([2 * 96] * 2 * 2 + [H] * 2 * 2)


def _attention_flops(job) -> dict:
    t = _trace(job)
    return {w.phase: w.flops for w in t.windows if w.chunk is not None}


@pytest.mark.parametrize("backend", ["fused", "flash"])
def test_window_flops_in_closed_form(backend):
    """Layer 1 of 2 windowed (window_attn_skip_freq 2), w = 16 of s = 64: its attention counts
    s·w - w²/2 = 896 of the s² = 4096 query-key pairs instead of the causal 2048, forward
    2·2·s²·b·h (scores, context) scaled so, backward 2.5 times that."""
    softmax = "vanilla" if backend == "flash" else "learnable"
    model = {"softmax_type": softmax}
    full = _attention_flops(
        gpt_oss_job(
            model={**model, "window_size": None, "window_attn_skip_freq": None},
            implementation={"attention_backend": backend},
        )
    )
    windowed = _attention_flops(
        gpt_oss_job(model=model, implementation={"attention_backend": backend})
    )
    square = 2 * 2 * S * S * B * H
    w = 16
    saved = square // 2 - square * (2 * S * w - w * w) // (2 * S * S)
    assert saved == 1_048_576 - 458_752
    assert full["forward"] - windowed["forward"] == saved
    assert full["backward"] - windowed["backward"] == saved * 5 // 2


def test_core_attention_with_sinks_offloads_its_saved_tensors():
    """Fine-grained offloading of core_attn with softmax sinks: the stand-in's backward reads its
    saved tensors once, as TE's does (megatron-core's offload manager hands each back once);
    each layer moves q and out [s, b, 4, 16] and k and v [s, b, 2, 16] in bf16 (the sink offsets
    and softmax statistics stay below the minimum size of 1024 elements)."""
    from tests.tracing.test_offload import moved_per_group

    job = small_job(
        model=GPT_OSS,
        parallel={"ep": 2, "moe_token_dispatcher_type": "alltoall"},
        training={
            "global_batch_size": 4,
            "activation_offload_modules": ["core_attn"],
            "min_offloaded_tensor_size": 1024,
        },
        implementation={
            "transformer_impl": "transformer_engine",
            "bias_dropout_fusion": False,
            "moe_grouped_gemm": True,
        },
        cluster={"num_gpus": 2},
    )
    per, _ = moved_per_group(job, "core_attn")
    assert per and set(per.values()) == {2 * S * B * (2 * HEADS + 2 * 2) * 16}
