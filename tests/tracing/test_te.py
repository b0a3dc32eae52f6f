"""The Transformer Engine stand-ins: parameters as megatron-core's TE spec creates them, saved
bytes against closed forms, context-parallel traffic against hand-derived counts."""

import pytest

from metatrace.analysis import aggregate as agg
from metatrace.tracing.trace import trace_job
from tests.helpers import small_job


def rnd(nbytes: int) -> int:
    """The caching allocator's 512-byte blocks."""
    return -(-nbytes // 512) * 512


# ---------------------------------------------------------------------------- parameters


def _build_layer(job, spec_fn):
    """One TransformerLayer on meta from `spec_fn(config)`, in a fake world for rank 0."""
    from megatron.core.transformer.spec_utils import build_module

    from metatrace.hooks.fake_world import fake_world
    from metatrace.hooks.patches import megatron_patches
    from metatrace.hooks.remap import remap_cuda
    from metatrace.models.build import transformer_config
    from metatrace.world import World

    config = transformer_config(job)
    with megatron_patches(), remap_cuda("meta"), fake_world(World.from_job(job).layout, 0):
        layer = build_module(spec_fn(config), config=config, layer_number=1)
    return {name: tuple(p.shape) for name, p in layer.named_parameters()}, layer


def _megatron_te_spec(monkeypatch):
    """megatron-core's own get_gpt_layer_with_transformer_engine_spec, its TESpecProvider (only
    defined when Transformer Engine imports) replaced by metatrace's provider."""
    from megatron.core.models.gpt import gpt_layer_specs

    from metatrace.models.specs import MetaTESpecProvider

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", MetaTESpecProvider, raising=False)
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec


@pytest.mark.parametrize("norm, bias", [("RMSNorm", False), ("LayerNorm", True)])
def test_te_layer_parameters_are_megatron_te_specs(monkeypatch, norm, bias):
    job = small_job(
        model={
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "ffn_hidden_size": 96,
            "normalization": norm,
            "add_bias_linear": bias,
            "qk_layernorm": True,
        },
        parallel={"tp": 2},
    )
    te_spec = _megatron_te_spec(monkeypatch)
    megatron, layer = _build_layer(job, lambda c: te_spec(qk_layernorm=True))
    from metatrace.models.specs import MetaTESpecProvider, gpt_layer_spec

    ours, _ = _build_layer(job, lambda c: gpt_layer_spec(MetaTESpecProvider(), qk_layernorm=True))
    assert ours == megatron
    # The names TE's modules register (LayerNormLinear: layer_norm_weight, layer_norm_bias for
    # LayerNorm, weight, bias; Linear: weight, bias; LayerNorm / RMSNorm: weight, bias), with
    # h = 64, heads 4 / 2 groups of 16 at tp 2, SwiGLU ffn 96 at tp 2.
    h, d, t = 64, 16, 2
    qkv_out = (4 + 2 * 2) * d // t
    expected = {
        "self_attention.linear_qkv.layer_norm_weight": (h,),
        "self_attention.linear_qkv.weight": (qkv_out, h),
        "self_attention.linear_proj.weight": (h, 4 * d // t),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "mlp.linear_fc1.layer_norm_weight": (h,),
        "mlp.linear_fc1.weight": (2 * 96 // t, h),
        "mlp.linear_fc2.weight": (h, 96 // t),
    }
    if norm == "LayerNorm":
        expected.update(
            {
                "self_attention.linear_qkv.layer_norm_bias": (h,),
                "self_attention.q_layernorm.bias": (d,),
                "self_attention.k_layernorm.bias": (d,),
                "mlp.linear_fc1.layer_norm_bias": (h,),
            }
        )
    if bias:
        expected.update(
            {
                "self_attention.linear_qkv.bias": (qkv_out,),
                "self_attention.linear_proj.bias": (h,),
                "mlp.linear_fc1.bias": (2 * 96 // t,),
                "mlp.linear_fc2.bias": (h,),
            }
        )
    assert megatron == expected
    qkv = layer.self_attention.linear_qkv
    assert type(qkv).__name__ == "TELayerNormColumnParallelLinear"
    assert type(layer.self_attention.core_attention).__name__ == "TEDotProductAttention"
    order = (
        ["layer_norm_weight"]
        + ["layer_norm_bias"] * (norm == "LayerNorm")
        + ["weight"]
        + ["bias"] * bias
    )
    assert [name for name, _ in qkv.named_parameters()] == order  # TE's registration order
    assert qkv.weight.tensor_model_parallel and qkv.weight.partition_dim == 0
    assert layer.self_attention.linear_proj.weight.partition_dim == 1


# ---------------------------------------------------------------------------- saved bytes

S, B, H, A, F = 256, 2, 128, 8, 192  # sequence, micro-batch, hidden, heads, ffn
D = H // A


def dense_layer_storages(*, t, sp, c, g, backend="fused", norm="RMSNorm", dropout=False):
    """Storages one middle TE-spec layer keeps for backward (bf16, SwiGLU, no bias), per the
    closed form of ../shared/notes/te-flash-saved-tensors.md, storage by storage."""
    n = S * B // c  # tokens per rank
    ns = n // t if sp else n
    stats = [ns * 4] * (2 if norm == "LayerNorm" else 1)  # rsigma (and mu) fp32
    q, kv, out = n * A * D // t * 2, n * g * D // t * 2, n * A * D // t * 2
    attn = {
        "fused": [q, kv, kv, out, B * (A // t) * (S // c) * 4, 16],
        # flash: bshd copies of q, k, v, out_padded, lse, rng, and TE's sbhd copy of out
        "flash": [q, kv, kv, out, B * (A // t) * (S // c) * 4, 16, out],
    }[backend]
    if c > 1:  # p2p ring: q, the last received K+V buffer, out, lse, one rng per step
        attn = [q, 2 * kv, out, B * (A // t) * (S // c) * 4] + [16] * c
    layer = [ns * H * 2, ns * H * 2, *stats]  # linear_qkv: x, ln_out, stats
    layer += attn
    layer += [ns * H * 2, ns * H * 2, *stats]  # linear_fc1: x, ln_out, stats
    layer += [n * 2 * F // t * 2, n * F // t * 2]  # SwiGLU input, linear_fc2 input
    if dropout:
        layer += [ns * H, ns * H]  # bias-dropout-add masks (bool)
    return layer


def traced_layer_bytes(**sections) -> int:
    job = small_job(
        model={
            "num_layers": 3,
            "hidden_size": H,
            "num_attention_heads": A,
            "ffn_hidden_size": F,
            **sections.pop("model", {}),
        },
        training={"seq_length": S, "micro_batch_size": B, **sections.pop("training", {})},
        **sections,
    )
    trace = trace_job(job, full_model=False).roles[0].trace
    # The middle layer: the first keeps the storages all layers share (RoPE frequencies).
    rows = {r.fqn: r for r in agg.walk(agg.module_tree(trace))}
    return rows["decoder.layers.1"].activation_bytes_total


@pytest.mark.parametrize(
    "t, sp, c, g",
    [
        (1, False, 1, 8),
        (2, False, 1, 8),
        (2, True, 1, 2),
        (4, True, 1, 4),
        (2, True, 2, 2),
        (1, False, 2, 8),
    ],
)
def test_fused_dense_layer_keeps_the_closed_form(t, sp, c, g):
    parallel = {"tp": t, "sequence_parallel": sp, "cp": c}
    got = traced_layer_bytes(model={"num_query_groups": g}, parallel=parallel)
    expected = sum(rnd(x) for x in dense_layer_storages(t=t, sp=sp, c=c, g=g))
    assert got == expected
    # and the note's aggregate formula, unrounded, within the 512-byte rounding of 20 storages
    n, ns = S * B // c, S * B // c // (t if sp else 1)
    note = ns * (8 * H + 8) + n * (4 * A * D + 4 * g * D + 6 * F) // t + 4 * B * (A // t) * (S // c)
    assert abs(got - note) <= 20 * 512


def test_documented_differences_between_backends_and_options():
    base = dict(t=2, sp=True, c=1, g=2)
    fused = traced_layer_bytes(
        model={"num_query_groups": 2}, parallel={"tp": 2, "sequence_parallel": True}
    )
    flash = traced_layer_bytes(
        model={"num_query_groups": 2},
        parallel={"tp": 2, "sequence_parallel": True},
        implementation={"attention_backend": "flash"},
    )
    assert flash == sum(rnd(x) for x in dense_layer_storages(**base, backend="flash"))
    assert flash - fused == rnd(S * B * A * D // 2 * 2)  # + N 2ad / t: the second output copy
    layernorm = traced_layer_bytes(
        model={"num_query_groups": 2, "normalization": "LayerNorm"},
        parallel={"tp": 2, "sequence_parallel": True},
    )
    assert layernorm - fused == 2 * rnd(S * B // 2 * 4)  # mu fp32 in both fused norms
    dropout = traced_layer_bytes(
        model={"num_query_groups": 2, "hidden_dropout": 0.1},
        parallel={"tp": 2, "sequence_parallel": True},
    )
    assert dropout - fused == 2 * rnd(S * B // 2 * H)  # + Ns 2h: two bool dropout masks
    unfused = traced_layer_bytes(
        model={"num_query_groups": 2},
        parallel={"tp": 2, "sequence_parallel": True},
        implementation={"attention_backend": "unfused"},
    )
    # unfused keeps the [b, heads/t, s, s] probabilities and k, v repeated to all query heads
    probs = B * (A // 2) * S * S * 2
    assert unfused - fused >= rnd(probs)


@pytest.mark.parametrize(
    "recipe, gpu",
    [("delayed", "h100"), ("tensorwise", "h100"), ("mxfp8", "b200"), ("blockwise", "h100")],
)
def test_fp8_keeps_one_byte_inputs(recipe, gpu):
    """FP8: the two ln_out and fc2's input are kept in 1 byte instead of 2, and proj keeps a
    1-byte copy of the attention output (which core attention keeps in bf16 anyway)."""
    common = dict(model={"num_query_groups": 8}, cluster={"gpu": gpu})
    bf16 = traced_layer_bytes(**common)
    fp8 = traced_layer_bytes(**common, training={"precision": "fp8", "fp8_recipe": recipe})
    n = S * B
    saved_bf16 = 2 * rnd(n * H * 2) + rnd(n * F * 2)
    saved_fp8 = 2 * rnd(n * H) + rnd(n * F) + (rnd(n * A * D) if recipe == "delayed" else 0)
    scales = 16 * 1024  # scale_inv [1] per tensor, or MXFP8 / blockwise scales
    assert 0 <= (bf16 - fp8) - (saved_bf16 - saved_fp8) + scales <= 2 * scales


# ---------------------------------------------------------------------------- context parallel


def cp_traffic(comm, c, t=1, g=4):
    par = {"tp": t, "cp": c, "cp_comm_type": comm}
    if comm == "a2a+p2p":
        par["hierarchical_cp_sizes"] = [2, c // 2]
    job = small_job(
        model={
            "num_layers": 1,
            "hidden_size": H,
            "num_attention_heads": A,
            "num_query_groups": g,
            "ffn_hidden_size": F,
        },
        parallel=par,
        training={"seq_length": S, "micro_batch_size": B},
    )
    trace = trace_job(job, full_model=False).roles[0].trace
    return [(x.op, x.phase, x.bytes) for x in trace.collectives if x.group.startswith("cp")]


@pytest.mark.parametrize("c", [2, 4])
def test_p2p_ring_sends_kv_forward_and_kv_dkv_backward(c):
    # kvn = 2 L b h_kv d elements of K and V per rank, L = s / c.
    kvn = 2 * (S // c) * B * 4 * D * 2
    got = cp_traffic("p2p", c)
    fwd = [x for x in got if x[1] == "forward"]
    bwd = [x for x in got if x[1] == "backward"]
    assert fwd == [("send", "forward", kvn), ("recv", "forward", kvn)] * (c - 1)
    sizes = [kvn] + [2 * kvn] * (c - 2) + [kvn]
    assert [b for op, _, b in bwd if op == "send"] == sizes
    assert [b for op, _, b in bwd if op == "recv"] == sizes


def test_all_gather_gathers_kv_twice_forward_and_reduce_scatters_backward():
    full_kv = S * B * 4 * D * 2  # [s, b, h_kv, d] bf16
    got = cp_traffic("all_gather", 2)
    assert (
        got
        == [("all_gather", "forward", full_kv)] * 2
        + [("all_gather", "backward", full_kv)] * 2
        + [("reduce_scatter", "backward", full_kv)] * 2
    )


def test_a2a_moves_q_k_v_out_forward_and_their_gradients_backward():
    L = S // 2
    q, kv = L * B * A * D * 2, L * B * 4 * D * 2
    got = cp_traffic("a2a", 2)
    assert got == [("all_to_all", "forward", x) for x in (q, kv, kv, q)] + [
        ("all_to_all", "backward", x) for x in (q, q, kv, kv)
    ]


def test_hierarchical_a2a_p2p_uses_both_levels():
    got = cp_traffic("a2a+p2p", 4)
    ops = {(op, phase) for op, phase, _ in got}
    assert (
        ("all_to_all", "forward") in ops
        and ("send", "forward") in ops
        and ("send", "backward") in ops
    )


# ---------------------------------------------------------------------------- fusions


def _saved_by(trace, module):
    return [
        (s.shape, s.dtype, s.bytes)
        for s in trace.saved
        if s.phase == "forward" and not s.static and s.module == module
    ]


@pytest.mark.parametrize("fusion, impl", [(False, "native"), (True, "native"), (True, "te")])
def test_cross_entropy_keeps_softmax_or_the_logits(fusion, impl):
    job = small_job(
        parallel={"tp": 2},
        implementation={"cross_entropy_loss_fusion": fusion, "cross_entropy_fusion_impl": impl},
    )
    trace = trace_job(job, full_model=False).roles[0].trace
    s, b, v = 64, 2, 1024 // 2  # the root module computes the loss: [s, b, V/t]
    saved = _saved_by(trace, "")
    if impl == "te":
        assert saved == [((s, b, v), "bfloat16", s * b * v * 2)]  # the logits, now gradients
        assert [c.op for c in trace.collectives if c.module == ""] == ["all_gather"]
    else:
        assert ((s, b, v), "float32", s * b * v * 4) in saved  # the fp32 softmax
        reduces = [c for c in trace.collectives if c.module == "" and c.op == "all_reduce"]
        assert len(reduces) == (2 if fusion else 3)  # the fused kernel batches two


@pytest.mark.parametrize("fusion", [True, False])
def test_rope_fusion_keeps_only_the_frequencies(fusion):
    job = small_job(implementation={"rope_fusion": fusion})
    trace = trace_job(job, full_model=False).roles[0].trace
    rope = _saved_by(trace, "decoder.layers.1.self_attention")  # saved by SelfAttention itself
    if fusion:  # the fp32 frequencies [s, 1, 1, d] for q and k: one storage shared by all layers
        assert {x for x in rope} == {((64, 1, 1, 16), "float32", 4096)}
        owners = agg.activation_owners(trace)
        assert sum(b for m, b in owners.values() if m.endswith("self_attention")) == 4096
    else:  # unfused: cos and sin [s, 1, 1, d] in bf16 for q and for k, in every layer
        assert [x[1] for x in rope] == ["bfloat16"] * 4


def test_fp8_parameters_are_the_quantized_weights():
    """fp8_param_gather: TE's primary weights are FP8 (1 B, plus a transposed copy on Hopper),
    kept whole through Float16Module, with no per-module FP8 weight workspace."""

    def trace(param, gpu):
        job = small_job(
            model={"num_layers": 1, "hidden_size": 128, "ffn_hidden_size": 256},
            training={"precision": "fp8", "fp8_param_gather": param, "distributed_optimizer": True},
            cluster={"gpu": gpu},
        )
        return trace_job(job, full_model=False).roles[0].trace

    linear = {
        "linear_qkv": (128 + 2 * 64) * 128,
        "linear_proj": 128 * 128,
        "linear_fc1": 512 * 128,
        "linear_fc2": 128 * 256,
    }
    for gpu in ("h100", "b200"):
        bf16, fp8 = trace(False, gpu), trace(True, gpu)
        weights = {
            m.fqn.split(".")[-1]: p
            for m in fp8.modules
            for p in m.params
            if p.name == "weight" and m.fqn.split(".")[-1] in linear
        }
        assert {k: (p.dtype, p.numel) for k, p in weights.items()} == {
            k: ("float8_e4m3fn", n) for k, n in linear.items()
        }
        saved_by_weights = sum(linear.values())  # bf16 2 B -> FP8 data 1 B
        transposes = sum(rnd(n) for n in linear.values()) if gpu == "h100" else 0
        assert bf16.static_bytes - fp8.static_bytes == saved_by_weights - transposes - 4 * 512
        # no FP8 weight workspace is built in the forward pass
        assert agg.peak(bf16).bytes - agg.peak(fp8).bytes >= saved_by_weights


def test_fp8_amax_history_is_kept_per_module():
    """training.fp8_amax_history_len (--fp8-amax-history-len): with the delayed recipe each TE
    module keeps an amax history fp32 [H, 3] and [H, 2] beside its scales [3] and [2]; 1024
    instead of Megatron-LM's default 1 adds (12288 - 512) + (8192 - 512) bytes (512-byte blocks)
    per module: 4 TE linears per layer, 2 layers on the debug model's one stage."""
    from metatrace.analysis.memory import role_memory
    from metatrace.tracing.trace import trace_role
    from metatrace.world import World
    from tests.helpers import small_job

    def kept(history):
        job = small_job(
            training={"precision": "fp8", "fp8_recipe": "delayed", "fp8_amax_history_len": history},
            cluster={"gpu": "h100"},
        )
        world = World.from_job(job)
        rt = trace_role(job, world, world.roles()[0])
        return job, role_memory(rt.trace, rt.iteration).workspaces

    job, one = kept(1)
    _, long = kept(1024)
    per_module = (4 * 3 * 1024 - 512) + (4 * 2 * 1024 - 512)
    assert long - one == 4 * job.model.num_layers * per_module
