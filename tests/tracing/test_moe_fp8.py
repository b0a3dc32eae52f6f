"""FP8 grouped experts (models/te_fp8_grouped.py): what TE 2.8's GroupedLinear keeps under each
recipe, against closed forms from its sources (grouped_linear.py, extensions/cast.cpp; TE cannot
run without CUDA, so these are restated, with balanced routing giving every expert's rows)."""

import pytest

from metatrace.analysis.memory import persistent_bytes
from metatrace.tracing.trace import trace_job
from tests.helpers import BALANCED, MOE, small_job

H, F = 64, 96  # the debug preset's hidden size; MOE's expert FFN size
E, LAYERS = 2, 2  # local experts (4 over ep 2); the debug preset's layers


def rnd(x, m=512):
    return -(-x // m) * m


def cdiv(a, b):
    return -(-a // b)


def fp8_job(
    recipe="tensorwise",
    gpu="h100",
    seq=64,
    ffn=F,
    training=None,
    parallel=None,
    model=None,
    **sections,
):
    return small_job(
        model={**MOE, "moe_ffn_hidden_size": ffn, **(model or {})},
        parallel={"ep": 2, **(parallel or {})},
        training={
            **BALANCED,
            "seq_length": seq,
            "global_batch_size": 4,
            "precision": "fp8",
            "fp8_recipe": recipe,
            **(training or {}),
        },
        implementation={"moe_grouped_gemm": True},
        cluster={"num_gpus": 2, "gpu": gpu},
        **sections,
    )


def traced(job):
    return trace_job(job, full_model=False, workers=1).roles[0].trace


def quantized_saved(trace, module):
    """Bytes of the quantized tensors `module` of layer 0 saves (not its bf16 weights)."""
    name = f"decoder.layers.0.mlp.experts.{module}"
    return sum(s.bytes for s in trace.saved if s.module == name and s.dtype != "bfloat16")


def saved_closed_form(recipe, gpu, rows, k):
    """grouped_linear.py:192-218: the column-wise usage of each expert's input (K x t_e bytes);
    a Float8 tensor has its own allocations and a scale-inverse [1] per expert; MXFP8 and
    blockwise one buffer for all experts (cast.cpp:245-265: data 256-byte aligned, then scales
    16-byte aligned)."""
    if recipe in ("delayed", "tensorwise"):
        return sum(rnd(k * t) + rnd(4) for t in rows)
    offset = 0
    for t in rows:
        offset = rnd(offset, 256) + k * t
    for t in rows:
        if recipe == "mxfp8":  # u8 [rnd(t/32, 4), rnd(K, 128)]
            scale = rnd(cdiv(t, 32), 4) * rnd(k, 128)
        else:  # fp32 [cdiv(t, 128), rnd(K, 4)]
            scale = 4 * cdiv(t, 128) * rnd(k, 4)
        offset = rnd(offset, 16) + scale
    return rnd(offset)


@pytest.mark.parametrize(
    "recipe, gpu, seq",
    [
        ("tensorwise", "h100", 64),
        ("delayed", "h100", 36),
        ("tensorwise", "b200", 36),
        ("mxfp8", "b200", 36),
        ("blockwise", "h100", 64),
        ("blockwise", "h100", 36),
    ],
)
def test_fp8_experts_keep_each_experts_quantized_input(recipe, gpu, seq):
    # Balanced routing: each rank routes s·b tokens x top-2 evenly over 4 experts, and each of
    # its 2 local experts receives s·b·2/4 from each of the 2 ranks = s·b rows. Fp8Padding pads
    # them to 32 (MXFP8) or 16 rows: seq 36, mbs 2 gives 72 -> 96 or 80.
    rows = seq * 2
    align = 32 if recipe == "mxfp8" else 16
    padded = [rnd(rows, align)] * E
    trace = traced(fp8_job(recipe, gpu, seq))
    assert quantized_saved(trace, "linear_fc1") == saved_closed_form(recipe, gpu, padded, H)
    assert quantized_saved(trace, "linear_fc2") == saved_closed_form(recipe, gpu, padded, F)


def test_fp8_padding_allocates_the_padded_rows_only_when_unaligned():
    def allocations(trace, module, phase):  # new tensors, in order
        name = f"decoder.layers.0.mlp.experts.{module}"
        return [
            e.delta for e in trace.memory if e.module == name and e.phase == phase and e.delta > 0
        ]

    aligned, unaligned = traced(fp8_job(seq=64)), traced(fp8_job(seq=36))
    n, padded = 2 * 72, 2 * 80  # 2 local experts x 72 rows, padded to 80
    # Forward pads the hidden states (bf16 [.., h]) and the probabilities (bf16 [.., 1]) and
    # unpads the output; backward allocates the gradients the other way round.
    pad, unpad = "quantization_padding", "quantization_unpadding"
    assert allocations(unaligned, pad, "forward") == [rnd(padded * H * 2), rnd(padded * 2)]
    assert allocations(unaligned, pad, "backward") == [rnd(n * 2), rnd(n * H * 2)]
    assert allocations(unaligned, unpad, "forward") == [rnd(n * H * 2)]
    assert allocations(unaligned, unpad, "backward") == [rnd(padded * H * 2)]
    assert allocations(aligned, pad, "forward") == allocations(aligned, unpad, "forward") == []


@pytest.mark.parametrize(
    "recipe, gpu",
    [("tensorwise", "h100"), ("tensorwise", "b200"), ("mxfp8", "b200"), ("blockwise", "h100")],
)
def test_fp8_experts_keep_a_weight_workspace_per_expert(recipe, gpu):
    """_fp8_workspaces["weight{i}"] (module/base.py:1329-1447): each expert's weight quantized
    with both usages, kept for the run. Two expert FFN sizes differ in these only (the scaling
    state is per GEMM, not per size)."""

    def workspace(n, k):
        if recipe == "tensorwise":
            return rnd(n * k) * (1 if gpu == "b200" else 2) + rnd(4)
        if recipe == "mxfp8":
            return (
                2 * rnd(n * k)
                + rnd(rnd(n, 128) * rnd(cdiv(k, 32), 4))
                + rnd(rnd(cdiv(n, 32), 4) * rnd(k, 128))
            )
        return (
            2 * rnd(n * k)
            + rnd(4 * cdiv(n, 128) * rnd(cdiv(k, 128), 4))
            + rnd(4 * cdiv(k, 128) * rnd(cdiv(n, 128), 4))
        )

    def expected(ffn):  # fc1 [2·ffn, h] (SwiGLU), fc2 [h, ffn], per local expert and layer
        return LAYERS * E * (workspace(2 * ffn, H) + workspace(H, ffn))

    small = persistent_bytes(traced(fp8_job(recipe, gpu, ffn=96)))
    large = persistent_bytes(traced(fp8_job(recipe, gpu, ffn=256)))
    assert large - small == expected(256) - expected(96)


def test_fp8_parameters_replace_the_expert_workspaces():
    """FP8 primary weights (fp8_param_gather): each expert weight is TE's quantized tensor and no
    workspace is made (base.py:1369-1376)."""
    cached = persistent_bytes(traced(fp8_job()))
    params = persistent_bytes(
        traced(fp8_job(training={"fp8_param_gather": True, "distributed_optimizer": True}))
    )
    workspaces = LAYERS * E * ((2 * rnd(2 * F * H) + rnd(4)) + (2 * rnd(H * F) + rnd(4)))
    assert cached - params >= workspaces


def test_delayed_scaling_reduces_three_amaxes_per_expert():
    """Delayed scaling: the decoder's autocast region MAX-all-reduces the forward amaxes of its
    modules over the amax-reduction group (TP x DP x CP) when it exits: 3 per dense GEMM
    (linear_qkv, linear_proj) and 3 per expert GEMM of fc1 and fc2 (fp8.py:409-433); 2 each
    when the backward of the region's first module ends."""
    trace = traced(fp8_job("delayed"))
    maxes = [
        (c.phase, c.shape[0], c.group)
        for c in trace.collectives
        if c.op == "all_reduce" and c.dtype == "float32" and c.group == "tp_dp_cp"
    ]
    gemms = LAYERS * (2 + 2 * E)
    assert maxes == [("forward", 3 * gemms, "tp_dp_cp"), ("backward", 2 * gemms, "tp_dp_cp")]


def test_moe_act_recompute_keeps_no_quantized_input_for_fc2():
    """moe_act recompute under FP8: megatron-core sets save_original_input on fc2
    (experts.py:592-595), whose bf16 input the checkpoint discards; fc2 keeps nothing
    quantized and quantizes the recomputed input again in backward."""
    recompute = {"granularity": "selective", "modules": ["moe_act"]}
    plain, rec = traced(fp8_job()), traced(fp8_job(training={"recompute": recompute}))
    assert quantized_saved(plain, "linear_fc2") == saved_closed_form(
        "tensorwise", "h100", [128] * E, F
    )
    assert quantized_saved(rec, "linear_fc2") == 0
    assert quantized_saved(rec, "linear_fc1") == quantized_saved(plain, "linear_fc1")


def test_delayed_wgrad_keeps_the_quantized_input_and_both_grad_usages(monkeypatch):
    """delay_wgrad_compute under FP8 (grouped_linear.py:408-409): the column-wise input and the
    output gradient quantized with both usages wait for backward_dw, nothing cleared before."""
    from metatrace.models import te_wgrad

    kept, put = [], te_wgrad.put

    def record_put(module, tensors, wgrad_flops, fp8=False):
        kept.append((module.in_features, sum(rnd(t.numel() * t.element_size()) for t in tensors)))
        put(module, tensors, wgrad_flops, fp8)

    monkeypatch.setattr(te_wgrad, "put", record_put)
    overlap = {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}
    traced(fp8_job(parallel={"moe_token_dispatcher_type": "alltoall", **overlap}))
    rows = [128] * E  # s·b rows per local expert (see above); Hopper Float8, no wgrad buffers
    grads = lambda n: sum(2 * rnd(n * t) + rnd(4) for t in rows)  # data, transpose, scale
    fc1 = (H, saved_closed_form("tensorwise", "h100", rows, H) + grads(2 * F))
    fc2 = (F, saved_closed_form("tensorwise", "h100", rows, F) + grads(H))
    assert sorted(kept) == sorted([fc1, fc2] * LAYERS)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_output_projection_and_shared_fc1_keep_their_bf16_inputs(recipe):
    """Under non-delayed FP8 megatron-core has TE keep the bf16 input of MLA's linear_proj
    (multi_latent_attention.py:183-199) and of the shared experts' linear_fc1
    (shared_experts.py:64-90), which other tensors keep anyway, instead of a quantized copy
    (TE's save_original_input; delayed scaling cannot, linear.py:170-173)."""
    from tests.helpers import MLA

    trace = traced(fp8_job(recipe, model={**MLA, **MOE, "moe_shared_expert_intermediate_size": 64}))

    def quantized(module):
        name = f"decoder.layers.0.{module}"
        return sum(s.bytes for s in trace.saved if s.module == name and s.dtype == "uint8")

    rows = 64 * 2  # s·b tokens, tp 1
    delayed = recipe == "delayed"
    heads, v = 4, MLA["v_head_dim"]  # the debug preset's heads
    assert quantized("self_attention.linear_proj") == (rnd(rows * heads * v) if delayed else 0)
    assert quantized("mlp.shared_experts.linear_fc1") == (rnd(rows * H) if delayed else 0)
    # the down-projections keep their column-wise FP8 input either way
    assert quantized("self_attention.linear_kv_down_proj") == rnd(rows * H)


def test_fp8_recompute_of_the_norms_and_mla_up_projections():
    """layernorm and mla_up_proj recompute under FP8 run megatron-core's
    CheckpointWithoutOutput(fp8=True) (TE's FP8 state and autocast re-entered for the recompute);
    with the input norm recomputed, MLA's down-projections keep its bf16 output, which the
    checkpoint discards, rather than a quantized copy (multi_latent_attention.py:969-975)."""
    from tests.helpers import MLA

    def kv_down_quantized(modules):
        trace = traced(
            fp8_job(
                model={**MLA, **MOE},
                training={"recompute": {"granularity": "selective", "modules": modules}},
            )
        )
        name = "decoder.layers.0.self_attention.linear_kv_down_proj"
        return sum(s.bytes for s in trace.saved if s.module == name and s.dtype == "uint8")

    assert kv_down_quantized(["mla_up_proj"]) == rnd(64 * 2 * H)
    assert kv_down_quantized(["layernorm", "mla_up_proj"]) == 0


@pytest.mark.parametrize(
    "recipe, arch, columnwise, kernels",
    [
        ("delayed", "sm90", True, 1),  # one nvte_multi_cast_transpose for all experts
        ("delayed", "sm90", False, 3),  # without the column-wise usage: each expert's quantize
        ("mxfp8", "sm100", True, 3),
        ("blockwise", "sm90", True, 3),
        ("tensorwise", "sm90", True, 3 + 2 * 3),  # per expert its amax and scale, then its cast
    ],
)
def test_split_quantize_launches_each_experts_kernels_unless_fused(
    recipe, arch, columnwise, kernels
):
    """TE 2.8's split_quantize (cast.cpp:103-150, quantizer.cpp:497-535) over three experts
    with rows and one without: the kernels launched, each with its fixed cost on the GPU beside
    the bytes it moves."""
    import torch

    from metatrace.config.kernels import LAUNCH_SECONDS, kernel_model, memory_seconds
    from metatrace.models.te_fp8 import split_quantize
    from tests.helpers import priced

    x = torch.empty(256, 128, dtype=torch.bfloat16, device="meta")
    out = []
    ps, launched = priced(
        lambda: out.extend(
            split_quantize(
                [64, 0, 64, 128],
                128,
                recipe,
                arch,
                rowwise=True,
                columnwise=columnwise,
                device="meta",
                x=x,
            )
        )
    )
    assert launched == kernels
    written = sum(t.nbytes for q in out for t in q.tensors())
    model = kernel_model("h100")
    moved = [x.nbytes + written] + ([x.nbytes] if recipe == "tensorwise" else [])
    want = sum(memory_seconds(model, n) for n in moved) + (kernels - len(moved)) * LAUNCH_SECONDS
    assert ps == pytest.approx(want * 1e12, abs=len(moved))
