"""Hybrid models traced: a Mamba-2 layer keeps what megatron-core's MambaMixer and the kernels'
sources say (a closed form), the meta trace keeps what real CPU tensors keep, and megatron-core's
hybrid stacks split their pattern over the pipeline as the pattern says."""

import pytest

from metatrace.config import job_from_dict, release
from metatrace.models import ssm_kernels

SINCE_0_19 = release.since(0, 19)
BLOCK = 512


def blocks(n: int) -> int:
    """Bytes in the CUDA caching allocator's 512-byte blocks."""
    return -(-n // BLOCK) * BLOCK


# The small hybrid model of these tests (its pattern and width given per test).
HYBRID = {
    "num_attention_heads": 8,
    "num_query_groups": 2,
    "ffn_hidden_size": 512,
    "vocab_size": 1024,
    "normalization": "RMSNorm",
    "activation": "squared_relu",
    "position_embedding_type": "none",
    "add_bias_linear": False,
    "mamba_head_dim": 32,
    "mamba_num_groups": 2,
    "mamba_state_dim": 16,
}


def hybrid_job(
    pattern="M*M-", *, tp=2, pp=1, cp=1, seq=256, mbs=2, hidden=256, impl="transformer_engine"
):
    return job_from_dict(
        {
            "model": {**HYBRID, "hybrid_layer_pattern": pattern, "hidden_size": hidden},
            "parallel": {"tp": tp, "pp": pp, "cp": cp, "sequence_parallel": tp > 1},
            "training": {"seq_length": seq, "micro_batch_size": mbs, "global_batch_size": 4 * mbs},
            "implementation": (
                {"transformer_impl": "local", "attention_backend": "local"}
                if impl == "local"
                else {}
            ),
            "cluster": {"num_gpus": 2 * tp * pp * cp, "gpus_per_node": 8},
        }
    )


def mamba_layer_closed_form(job) -> int:
    """Bytes one Mamba layer keeps for backward with the Transformer Engine spec and sequence
    parallelism, from the sources:
    - in_proj (TE's LayerNormLinear, sequence parallel): the norm's input and output on this
      rank's s/(c t) tokens, bf16 [s/(c t) * b, h] each, and the fp32 rstd;
    - MambaMixer._ssm_training on the heads and groups of this tensor- and context-parallel
      rank (MambaContextParallel: the full sequence after its all-to-all; groups repeated where
      fewer than the context-parallel ranks): A = -exp(A_log.float()) (exp keeps its fp32
      output, the kernel keeps A), dt_bias.float(), with context parallelism the conv weight and
      bias sliced into new tensors the kernel keeps, and the kernel's own
      (ssm_kernels.split_conv1d_scan_saved_bytes: zxbcdt and out_x);
    - the gated RMSNorm (called without z) on s/c tokens: y bf16 [s/c * b, d/t] and its fp32
      rstd per group;
    - out_proj: its input bf16 [s/c * b, d/t];
    - the layer's hidden dropout: a bool mask [s/(c t), b, h]."""
    m, tp, cp = job.model, job.parallel.tp, job.parallel.cp
    s, b, h = job.training.seq_length, job.training.micro_batch_size, m.hidden_size
    p, n = m.mamba_head_dim, m.mamba_state_dim
    heads = m.mamba_num_heads // (tp * cp)
    groups_tp = m.mamba_num_groups // tp
    groups = max(groups_tp // cp, 1)
    d_tp = m.mamba_num_heads // tp * p
    local, rows = s * b // (cp * tp), s * b // cp
    in_proj = 2 * blocks(local * h * 2) + blocks(local * 4)
    scan = ssm_kernels.split_conv1d_scan_saved_bytes(
        batch=b, seqlen=s, nheads=heads, headdim=p, ngroups=groups, dstate=n, params=False
    )
    conv, d_conv = heads * p + 2 * groups * n, 4  # MambaMixer's kernel width (its default)
    sliced = blocks(conv * d_conv * 2) + blocks(conv * 2) if cp > 1 else 0
    mixer = 3 * blocks(4 * heads) + sliced + scan
    norm = ssm_kernels.rmsnorm_gated_saved_bytes(
        rows=rows, hidden=d_tp, group_size=d_tp // groups_tp, params=False
    )
    out_proj = blocks(rows * d_tp * 2)
    dropout = blocks(local * h)
    return in_proj + mixer + norm + out_proj + dropout


@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 1), (2, 2)])
def test_a_mamba_layer_keeps_the_closed_form_of_its_kernels(tp, cp):
    """Per layer and micro-batch, the traced Mamba-2 layer's activations equal the closed form
    (what TE's linears, megatron-core's MambaMixer and MambaContextParallel and mamba_ssm's
    kernels keep), with tensor and context parallelism."""
    from metatrace.analysis.aggregate import module_tree, walk
    from metatrace.tracing.trace import trace_job

    job = hybrid_job("M*M-", tp=tp, cp=cp)
    traced = trace_job(job, workers=1, full_model=False)
    tree = {n.fqn: n for n in walk(module_tree(traced.roles[0].trace))}
    expected = mamba_layer_closed_form(job)
    for layer in (0, 2):
        assert tree[f"decoder.layers.{layer}"].activation_bytes_total == expected
    # (2 * d + 2 * g * n + h) + d per token: the kernel's input and output dominate
    assert expected > 2 * 256 * 2 * (3 * 512 // (tp * cp))


def test_hybrid_meta_matches_real_cpu_tensors():
    """The local-spec hybrid model traced on meta and on real CPU tensors (the kernels' PyTorch
    references computing): the same tensors kept for backward, the same collectives."""
    from metatrace.world import World
    from tests.helpers import assert_meta_matches_real

    job = hybrid_job("M*-M", tp=1, seq=64, mbs=1, hidden=128, impl="local")
    world = World.from_job(job)
    assert_meta_matches_real(job, world, world.roles()[0])


def test_measure_keeps_the_predicted_activations_of_a_hybrid_model():
    """metatrace measure runs the local-spec hybrid model for real on the CPU: the storages one
    micro-batch's forward keeps are the prediction's, byte for byte, and the peak is within 1 %."""
    import torch

    from metatrace.tracing.measure import measure_rank, predict

    torch.set_num_threads(1)
    job = hybrid_job("M*M-", tp=1, seq=64, mbs=2, hidden=128, impl="local")
    predicted, measured = predict(job, 0), measure_rank(job, 0, iterations=2)
    assert measured.saved_blocks == predicted.saved > 0
    # The peak too, once the references' own fp32 intermediates (the stand-ins' CPU values,
    # REFERENCE_RANGE) are left out of the measurement: with them this job's prediction was
    # 32 % below the measured peak.
    peak = predicted.peak - predicted.cuda_only
    assert abs(peak - measured.peak_blocks) <= 0.01 * measured.peak_blocks


@pytest.mark.skipif(not SINCE_0_19, reason="'|' in the pattern needs megatron-core 0.19")
def test_pattern_segments_place_the_layers_on_pipeline_stages():
    """megatron-core 0.19's HybridStack builds segment k of "M*M|MM-E..." on pipeline rank k."""
    from metatrace.tracing.trace import trace_job

    job = hybrid_job("M*M-|M-", tp=1, pp=2)
    traced = trace_job(job, workers=1, full_model=False)
    layers = [r.trace for r in traced.roles]
    kinds = [
        sorted({m.type for m in t.modules if m.fqn.count(".") == 2 and ".layers." in m.fqn})
        for t in layers
    ]
    assert kinds == [["MLPLayer", "MambaLayer", "TransformerLayer"], ["MLPLayer", "MambaLayer"]]
    counts = [
        sum(1 for m in t.modules if m.fqn.count(".") == 2 and ".layers." in m.fqn) for t in layers
    ]
    assert counts == [4, 2]


def gdn_job(tp=2, *, cp=1, seq=256, impl="transformer_engine"):
    return job_from_dict(
        {
            "model": {
                "num_layers": 4,
                "linear_attention_freq": 4,
                "hidden_size": 256,
                "num_attention_heads": 8,
                "num_query_groups": 2,
                "ffn_hidden_size": 512,
                "vocab_size": 1024,
                "normalization": "RMSNorm",
                "activation": "swiglu",
                "position_embedding_type": "rope",
                "add_bias_linear": False,
                "linear_num_key_heads": 4,
                "linear_num_value_heads": 8,
                "linear_key_head_dim": 32,
                "linear_value_head_dim": 48,
            },
            "parallel": {"tp": tp, "cp": cp, "sequence_parallel": tp > 1},
            "training": {"seq_length": seq, "micro_batch_size": 2, "global_batch_size": 8},
            "implementation": (
                {"transformer_impl": "local", "attention_backend": "local"}
                if impl == "local"
                else {}
            ),
            "cluster": {"num_gpus": 2 * tp * cp, "gpus_per_node": 8},
        }
    )


def gdn_closed_form(job) -> int:
    """Bytes a Gated DeltaNet attention keeps for backward (Transformer Engine spec, sequence
    parallel, megatron-core's jit_fuser methods as compiled), from the sources:
    - in_proj (TE's LayerNormLinear): norm input and output on s/t tokens, its fp32 rstd;
    - the short convolution: 0.16.1's causal_conv1d_fn keeps its contiguous input [b, conv, s];
      0.19's fla causal_conv1d keeps the view it is given, so the whole in_proj output
      [b, s, conv + v + 2 heads] stays;
    - l2norm of queries and keys (fla: output and fp32 rstd), 0.16.1 one call each, 0.19 one
      call over both;
    - g and beta: 0.16.1 computes them eagerly (exp of A_log and the neg before the multiply,
      bf16 [heads]; softplus's fp32 input and output; the sigmoid's output), 0.19 in a compiled
      method that keeps alpha and the sigmoid's output;
    - chunk_gated_delta_rule (gdn_kernels' closed form), whose beta is the sigmoid's output
      already counted;
    - the output norm (x and fp32 rstd per row), the compiled gate (y and the gate, bf16), and
      out_proj's input.
    With context parallelism (0.19, gdn.py: in_proj and out_proj on the rank's s/cp tokens,
    all-to-alls between them to the whole sequence with the heads split over tp x cp) the
    same on heads / (tp cp), and besides: the int64 index of in_proj's output features that
    index_select's backward keeps (the heads permuted for one all-to-all), and the conv
    weight's slice of the rank's channels (get_parameter_local_cp), which the kernel keeps."""
    from metatrace.models import gdn_kernels

    m, tp, cp = job.model, job.parallel.tp, job.parallel.cp
    s, b, h = job.training.seq_length, job.training.micro_batch_size, m.hidden_size
    hk, hv = m.linear_num_key_heads // (tp * cp), m.linear_num_value_heads // (tp * cp)
    K, V = m.linear_key_head_dim, m.linear_value_head_dim
    T, local = s * b, s * b // (tp * cp)
    conv = 2 * hk * K + hv * V
    in_proj = 2 * blocks(local * h * 2) + blocks(local * 4)
    kernel = gdn_kernels.chunk_gated_delta_rule_saved_bytes(
        batch=b, seqlen=s, heads=hv, key_dim=K, value_dim=V
    )
    beta = T * hv * 2
    rows = T * hv  # the output norm's rows, V wide
    out = (rows * V * 2 + rows * 4) + 2 * rows * V * 2 + rows * V * 2  # norm, gate, out_proj
    if SINCE_0_19:
        conv_kept = T * (conv + hv * V + 2 * hv) * 2
        l2 = gdn_kernels.l2norm_saved_bytes(rows=T * 2 * hk, dim=K)
        g_beta = T * hv * 2 + beta
    else:
        conv_kept = ssm_kernels.causal_conv1d_saved_bytes(batch=b, dim=conv, seqlen=s, params=False)
        l2 = 2 * gdn_kernels.l2norm_saved_bytes(rows=T * hk, dim=K)
        g_beta = 2 * blocks(hv * 2) + 2 * T * hv * 4 + beta
    extra = 0
    if cp > 1:
        features = cp * (conv + hv * V + 2 * hv)  # in_proj's output columns on a TP rank
        extra = blocks(features * 8) + blocks(conv * m.linear_conv_kernel_dim * 2)
    return in_proj + conv_kept + l2 + g_beta + kernel - beta + out + extra


def test_a_gated_deltanet_attention_keeps_the_closed_form_of_its_kernels():
    """A Gated DeltaNet layer's attention in a GPT model (Qwen3-Next's layers): its activations
    per micro-batch equal the closed form of TE's linears, megatron-core's GatedDeltaNet, the
    fla kernels and the compiled gate."""
    from metatrace.analysis.aggregate import module_tree, walk
    from metatrace.tracing.trace import trace_job

    job = gdn_job()
    traced = trace_job(job, workers=1, full_model=False)
    tree = {n.fqn: n for n in walk(module_tree(traced.roles[0].trace))}
    for layer in (0, 1, 2):  # the fourth is attention
        node = tree[f"decoder.layers.{layer}.self_attention"]
        assert node.type == "GatedDeltaNet"
        assert node.activation_bytes_total == gdn_closed_form(job)
    assert tree["decoder.layers.3.self_attention"].type == "SelfAttention"


@pytest.mark.parametrize("tp", [1, 2])
def test_gated_deltanet_under_context_parallelism(tp):
    """megatron-core 0.19's Gated DeltaNet splits its heads over tp x cp on the whole sequence
    (all-to-alls after in_proj and before out_proj): per micro-batch it keeps the closed form
    on heads / (tp cp) and the rank's s / cp tokens, plus the index and the conv slice.
    megatron-core 0.16.1 refuses context parallelism for it."""
    from metatrace.analysis.aggregate import module_tree, walk
    from metatrace.errors import ConfigError
    from metatrace.tracing.trace import trace_job

    job = gdn_job(tp, cp=2)
    if not SINCE_0_19:
        with pytest.raises(ConfigError, match="does not support context parallel"):
            trace_job(job, workers=1, full_model=False)
        return
    traced = trace_job(job, workers=1, full_model=False)
    tree = {n.fqn: n for n in walk(module_tree(traced.roles[0].trace))}
    node = tree["decoder.layers.0.self_attention"]
    assert node.type == "GatedDeltaNet"
    assert node.activation_bytes_total == gdn_closed_form(job)


def test_measure_keeps_the_predicted_activations_of_gated_deltanet_layers():
    """metatrace measure runs a local-spec GPT model with Gated DeltaNet layers for real on the
    CPU (fla's kernels by their PyTorch references, the compiled gate by its stand-in): the
    storages one micro-batch's forward keeps are the prediction's, byte for byte."""
    import torch

    from metatrace.tracing.measure import measure_rank, predict

    torch.set_num_threads(1)
    job = gdn_job(tp=1, seq=128, impl="local")
    predicted, measured = predict(job, 0), measure_rank(job, 0, iterations=2)
    assert measured.saved_blocks == predicted.saved > 0
    peak = predicted.peak - predicted.cuda_only  # the references' intermediates left out
    assert abs(peak - measured.peak_blocks) <= 0.01 * measured.peak_blocks


def _mtp_job(model, repeated):
    return job_from_dict(
        {
            "model": {**model, "mtp_use_repeated_layer": repeated},
            "parallel": {"pp": 2},
            "training": {"seq_length": 128, "micro_batch_size": 2, "global_batch_size": 8},
            "cluster": {"num_gpus": 2, "gpus_per_node": 8},
        }
    )


_MTP_HYBRID = {
    **HYBRID,
    "hybrid_layer_pattern": "M*M-/*-/*-",
    "hidden_size": 128,
    "num_attention_heads": 4,
    "ffn_hidden_size": 256,
}


def _mtp_figures(job):
    """(the model's parameters, the last stage's MTP block's activations per micro-batch)."""
    from metatrace.analysis.aggregate import module_tree, walk
    from metatrace.analysis.analyze import analyze
    from metatrace.tracing.trace import trace_job

    traced = trace_job(job, workers=1, full_model=False)
    tree = {n.fqn: n for n in walk(module_tree(traced.roles[-1].trace))}
    return analyze(traced).total_params, tree["mtp"].activation_bytes_total


@pytest.mark.skipif(not SINCE_0_19, reason="mtp_use_repeated_layer is megatron-core 0.19's")
def test_a_repeated_mtp_layer_shares_its_weights_across_the_depths():
    """megatron-core 0.19's mtp_use_repeated_layer (Nemotron 3 Super's MTP): one layer applied
    at each depth. Of a pattern's two depths '/*-' the model keeps one depth's weights: its
    norms (enorm, hnorm, the final one: h each), eh_proj (2h x h), the attention (its fused
    norm, qkv h x (a + 2g) d, the projection a d x h) and the MLP (its fused norm, h x f and f x
    h); the activations are both depths', as without sharing. In a GPT model the same: two
    repeated depths hold the weights of one and the activations of two."""
    h, a, g, d, f = 128, 4, 2, 32, 256
    depth = 3 * h + 2 * h * h + (h + h * (a + 2 * g) * d + a * d * h) + (h + 2 * h * f)
    per_depth = _mtp_figures(_mtp_job(_MTP_HYBRID, False))
    shared = _mtp_figures(_mtp_job(_MTP_HYBRID, True))
    assert per_depth[0] - shared[0] == depth
    assert shared[1] == per_depth[1] > 0
    gpt = {"preset": "debug", "num_layers": 4, "position_embedding_type": "rope"}
    one = _mtp_figures(_mtp_job({**gpt, "mtp_num_layers": 1}, False))
    two = _mtp_figures(_mtp_job({**gpt, "mtp_num_layers": 2}, False))
    repeated = _mtp_figures(_mtp_job({**gpt, "mtp_num_layers": 2}, True))
    assert repeated == (one[0], two[1]) and two[1] > one[1]


@pytest.mark.skipif(SINCE_0_19, reason="megatron-core 0.19 has mtp_use_repeated_layer")
def test_a_repeated_mtp_layer_is_refused_under_0_16():
    from metatrace.errors import ConfigError
    from metatrace.tracing.checks import check_with_megatron

    gpt = {"preset": "debug", "num_layers": 4, "position_embedding_type": "rope"}
    with pytest.raises(ConfigError, match="mtp_use_repeated_layer needs megatron-core 0.19"):
        check_with_megatron(_mtp_job({**gpt, "mtp_num_layers": 2}, True))


def test_megatron_core_refusing_a_layer_it_builds_is_one_message():
    """megatron-core's own assertion while it builds a layer is its refusal of the
    configuration: Gated DeltaNet under FP8 wants its input projection's output width a multiple
    of 16 (here 2 x 2 x 16 + 2 x 4 x 16 + 2 x 4 = 200). One message (ConfigError: exit 2), not
    a traceback."""
    from metatrace.errors import ConfigError
    from metatrace.tracing.trace import trace_job

    job = job_from_dict(
        {
            "model": {
                "preset": "debug",
                "num_layers": 4,
                "linear_attention_freq": 2,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
            },
            "training": {
                "seq_length": 128,
                "micro_batch_size": 1,
                "global_batch_size": 1,
                "precision": "fp8",
                "fp8_recipe": "tensorwise",
            },
            "cluster": {"num_gpus": 1},
        }
    )
    with pytest.raises(ConfigError, match="megatron-core rejects this configuration: For FP8"):
        trace_job(job, workers=1, full_model=False)
