"""Multi-latent attention and multi-token prediction: DeepSeek-V3's published parameter count,
MLA layer parameters against the closed form, the MTP layer and loss on the last stage (the
config checks are in tests/unit/test_mla.py)."""

import pytest

from metatrace.analysis import aggregate as agg
from metatrace.hooks import guards
from metatrace.tracing.trace import trace_job
from tests.helpers import MLA, small_job


def _mtp_params(traces, ep: int) -> int:
    """model_params' count restricted to the MTP block (tp 1)."""
    return sum(
        p.numel * (ep if p.expert else 1)
        for trace in traces
        for m in trace.modules
        if m.fqn.startswith("mtp.")
        for p in m.params
        if not p.embedding_copy
    )


def test_deepseek_v3_total_is_the_published_count():
    # deepseek-ai/DeepSeek-V3: "671B total parameters, 37B activated" (model card; the 685B on
    # the hub adds the 14B MTP module). From its config.json (h 7168, 128 heads, q_lora 1536,
    # kv_lora 512, qk_nope 128, qk_rope 64, v_head 128, vocab 129280 untied, 3 dense layers
    # ffn 18432, 58 MoE layers of 256 routed + 1 shared expert of 2048):
    #   MLA per layer   q_a 7168·1536 + q_a_norm 1536 + q_b 1536·128·192 + kv_a 7168·576
    #                   + kv_a_norm 512 + kv_b 512·128·256 + o 128·128·7168 = 187,107,328
    #   norms per layer 2·7168 = 14,336
    #   dense MLP       3·7168·18432 = 396,361,728
    #   MoE MLP         257·3·7168·2048 + router 256·7168 = 11,320,164,352 (megatron-core keeps
    #                   the expert bias as a buffer, not a parameter)
    #   layers          3·583,483,392 + 58·11,507,286,016 = 669,173,039,104
    #   embedding, output layer 2·129280·7168, final norm 7168    -> 671,026,404,352
    # MTP (megatron-core shares the embedding and output layer): enorm, hnorm, final norm 3·7168
    # + eh_proj 14336·7168 + one MoE layer = 11,610,067,968 (the hub's 14B stores the embedding
    # and head once more: + 1,853,358,080 = 13.46B).
    # Activated per token: 8 of 256 routed experts, 37,552,282,624 (37B without the input
    # embedding's 0.93B, which is a lookup).
    job = small_job(
        model={"preset": "deepseek-v3"},
        parallel={"pp": 16, "ep": 8, "first_stage_layers": 3, "last_stage_layers": 2},
        training={"seq_length": 64, "micro_batch_size": 1, "global_batch_size": 8},
        implementation={"moe_grouped_gemm": True},
        cluster={"num_gpus": 128},
    )
    traces = [rt.trace for rt in trace_job(job, full_model=False).roles]
    par = job.parallel
    mtp = _mtp_params(traces, par.ep)
    assert mtp == 11_610_067_968
    assert agg.model_params(traces, par.tp, par.ep, par.etp) - mtp == 671_026_404_352
    mtp_active = mtp - 11_274_289_152 * 248 // 256  # the MTP layer's idle routed experts
    active = agg.model_params(traces, par.tp, par.ep, par.etp, expert_share=8 / 256)
    assert active - mtp_active == 37_552_282_624


def mla_layer_closed_form(job, fused: bool) -> int:
    """One dense MLA layer's parameters on one TP rank (megatron-core's layout of them)."""
    m, tp = job.model, job.parallel.tp
    h, f, heads = m.hidden_size, m.ffn_hidden_size, m.num_attention_heads // tp
    qr, kvr, pe = m.q_lora_rank, m.kv_lora_rank, m.qk_pos_emb_head_dim
    q_head, v = m.qk_head_dim + pe, m.v_head_dim
    # TE spec: the down-projections are replicated (TELinear, parallel_mode duplicated); the
    # local spec shards them as column-parallel linears. The latent norms are replicated.
    down = h * (qr + kvr + pe) // (1 if fused else tp)
    attention = (
        h  # input_layernorm (never fused with MLA)
        + down
        + qr
        + heads * q_head * qr  # q latent norm, q up-projection
        + kvr
        + heads * (m.qk_head_dim + v) * kvr  # kv latent norm, kv up-projection
        + heads * v * h  # linear_proj
    )
    return attention + h + 2 * f // tp * h + f // tp * h  # pre-MLP norm, SwiGLU fc1, fc2


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_mla_layer_params_match_closed_form(impl):
    job = small_job(model=MLA, parallel={"tp": 2}, implementation={"transformer_impl": impl})
    (rt,) = trace_job(job, full_model=False, workers=1).roles
    expected = mla_layer_closed_form(job, fused=impl == "transformer_engine")
    for layer in (0, 1):
        prefix = f"decoder.layers.{layer}."
        got = sum(p.numel for m in rt.trace.modules if m.fqn.startswith(prefix) for p in m.params)
        assert got == expected, (impl, layer)


def _loss_reductions(trace) -> int:
    """Forward all-reduces of fp32 [s, b] over TP: megatron-core's vocab-parallel cross
    entropy makes three per loss (logits max, predicted logit, sum of exponentials)."""
    return sum(
        1
        for c in trace.collectives
        if c.phase == "forward"
        and c.op == "all_reduce"
        and c.group == "tp"
        and c.dtype == "float32"
        and c.shape == (64, 2)
    )


# MultiTokenPredictionLayer's transformer layer: renamed mtp_model_layer in megatron-core 0.19
MTP_LAYER = "mtp_model_layer" if guards.since(0, 19) else "transformer_layer"


@pytest.mark.parametrize(
    "parallel",
    [
        {"tp": 2, "pp": 2},
        {"tp": 2, "pp": 2, "vpp": 2, "layout": "Et|t|t|tmL"},
    ],
    ids=["last-stage", "layout"],
)
def test_mtp_adds_its_layer_and_loss_on_the_last_stage(parallel):
    model = {**MLA, "num_layers": 4 if "layout" in parallel else 2}
    without = {
        **parallel,
        **({"layout": parallel["layout"].replace("m", "")} if "layout" in parallel else {}),
    }
    base = small_job(model=model, parallel=without, training={"global_batch_size": 4})
    job = small_job(
        model={**model, "mtp_num_layers": 1}, parallel=parallel, training={"global_batch_size": 4}
    )
    (first, last), (first0, last0) = (
        [rt.trace for rt in trace_job(j, full_model=False, workers=1).roles] for j in (job, base)
    )
    mtp = {
        m.fqn.split(".", 1)[1] if m.fqn.startswith("chunk") else m.fqn: m
        for m in last.modules
        if ".mtp." in f".{m.fqn}"
    }
    assert {
        "mtp.layers.0.enorm",
        "mtp.layers.0.hnorm",
        "mtp.layers.0.eh_proj",
        "mtp.layers.0.final_layernorm",
        f"mtp.layers.0.{MTP_LAYER}.self_attention.linear_kv_up_proj",
    } <= set(mtp)
    assert not [m for m in first.modules if ".mtp." in f".{m.fqn}"]
    # eh_proj: [e; h] (2h) -> h, column-parallel over tp 2
    assert mtp["mtp.layers.0.eh_proj"].params[0].shape == (32, 128)
    # the MTP stage keeps a copy of the word embedding, tied to the first stage's
    copies = [
        p for m in last.modules if m.fqn.endswith("embedding.word_embeddings") for p in m.params
    ]
    assert copies and all(p.embedding_copy for p in copies)
    # one more loss: the output layer and cross entropy run again for the MTP depth
    assert _loss_reductions(last0) == 3
    assert _loss_reductions(last) == 6
    assert _loss_reductions(first) == _loss_reductions(first0) == 0


def _fused_down(fused):
    job = small_job(
        model={**MLA, "mla_down_proj_fusion": fused}, parallel={"tp": 2}, cluster={"num_gpus": 2}
    )
    return job, trace_job(job, full_model=False, workers=1).roles[0]


@pytest.mark.skipif(not guards.since(0, 19), reason="mla_down_proj_fusion is megatron-core 0.19's")
def test_fused_down_projection_is_column_parallel_and_gathers_the_latents():
    """megatron-core 0.19's mla_down_proj_fusion (FusedMLASelfAttention, run on meta): one
    down-projection [h, q_lora + kv_lora + rope] that takes the input norm and is
    column-parallel (tp 2): a layer has h (q_lora + kv_lora + rope) / 2 weights fewer on a rank
    than the replicated pair; each forward all-gathers the query latent [s, b, q_lora / 2] and
    the key-value latent [s, b, (kv_lora + rope) / 2] over TP, and its backward all-reduces the
    input's gradient [s b, h]."""
    from collections import Counter

    (plain_job, plain), (_, fused) = _fused_down(False), _fused_down(True)
    m, s, b = plain_job.model, plain_job.training.seq_length, plain_job.training.micro_batch_size
    down = m.hidden_size * (m.q_lora_rank + m.kv_lora_rank + m.qk_pos_emb_head_dim)
    expected = mla_layer_closed_form(plain_job, fused=True) - down // 2
    for layer in range(m.num_layers):
        prefix = f"decoder.layers.{layer}."
        got = sum(
            p.numel for x in fused.trace.modules if x.fqn.startswith(prefix) for p in x.params
        )
        assert got == expected

    def tp(rt):
        return Counter((c.phase, c.op, c.shape) for c in rt.trace.collectives if c.group == "tp")

    latents = (m.q_lora_rank // 2, (m.kv_lora_rank + m.qk_pos_emb_head_dim) // 2)
    added = {("forward", "all_gather", (2 * s, b, n)): m.num_layers for n in latents}
    added[("backward", "all_reduce", (s * b, m.hidden_size))] = m.num_layers
    assert tp(fused) - tp(plain) == Counter(added)
    assert not tp(plain) - tp(fused)


@pytest.mark.skipif(guards.since(0, 19), reason="megatron-core 0.19 has mla_down_proj_fusion")
def test_fused_down_projection_is_refused_before_0_19():
    from metatrace.errors import ConfigError
    from metatrace.tracing.checks import check_with_megatron

    job = small_job(model={**MLA, "mla_down_proj_fusion": True})
    with pytest.raises(ConfigError, match="mla_down_proj_fusion needs megatron-core 0.19"):
        check_with_megatron(job)
