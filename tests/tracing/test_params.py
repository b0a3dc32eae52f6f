"""Parameter counts per rank against the closed form, and published totals."""

import pytest

from metatrace.analysis import aggregate as agg
from metatrace.tracing.trace import trace_job
from tests.helpers import small_job


def closed_form(job, layers: int, first: bool, last: bool) -> int:
    """Parameters one rank holds, from the dimensions alone (megatron-core's layout of them)."""
    m, tp = job.model, job.parallel.tp
    h, f, a, g, d = (
        m.hidden_size,
        m.ffn_hidden_size,
        m.num_attention_heads,
        m.num_query_groups,
        m.kv_channels,
    )
    bias = m.add_bias_linear
    norm = h * (2 if m.normalization == "LayerNorm" else 1)
    qkv_out = (a + 2 * g) * d // tp
    fc1_out = (2 if m.activation in ("swiglu", "geglu") else 1) * f // tp
    layer = (
        norm  # input_layernorm
        + qkv_out * h
        + (qkv_out if bias or m.add_qkv_bias else 0)
        + h * (a * d // tp)
        + (h if bias else 0)  # linear_proj (bias replicated)
        + norm  # pre_mlp_layernorm
        + fc1_out * h
        + (fc1_out if bias else 0)
        + h * (f // tp)
        + (h if bias else 0)  # linear_fc2
    )
    total = layers * layer
    vocab = job.padded_vocab_size // tp * h
    if first:
        total += vocab
        if m.position_embedding_type == "learned_absolute":
            total += m.max_position_embeddings * h
    if last:
        total += norm
        tied_on_same_rank = not m.untie_embeddings_and_output_weights and first
        if not tied_on_same_rank:
            total += vocab
    return total


@pytest.mark.parametrize(
    "sections",
    [
        {"parallel": {"tp": 2, "pp": 2}},
        {"model": {"num_layers": 6}, "parallel": {"pp": 3}},
        {
            "model": {
                "normalization": "LayerNorm",
                "activation": "gelu",
                "add_bias_linear": True,
                "position_embedding_type": "learned_absolute",
                "untie_embeddings_and_output_weights": False,
            },
            "parallel": {"tp": 2, "pp": 2},
        },
        {"model": {"untie_embeddings_and_output_weights": False}, "parallel": {"tp": 2}},
        {
            "model": {"num_layers": 8, "add_qkv_bias": True},
            "parallel": {"tp": 2, "pp": 2, "vpp": 2},
            "training": {"global_batch_size": 4},
        },
        {
            "model": {"num_layers": 5},
            "parallel": {"pp": 3, "first_stage_layers": 1, "last_stage_layers": 2},
        },
    ],
    ids=["llama-tp2-pp2", "pp3", "gpt-tied-tp2-pp2", "tied-pp1", "vpp-qkv-bias", "uneven"],
)
def test_params_per_rank_match_closed_form(sections):
    job = small_job(**sections)
    jt = trace_job(job, full_model=False)
    for rt in jt.roles:
        s = agg.role_summary(rt.trace)
        first = rt.role.pp_stage == 0
        last = rt.role.pp_stage == job.parallel.pp - 1
        assert s.params == closed_form(job, len(s.layers), first, last), rt.role


def test_llama2_7b_total_is_the_published_count():
    # meta-llama/Llama-2-7b-hf: 6,738,415,616 parameters. Traced on one stage of tp 2 x pp 2
    # (vocabulary 32000 needs no padding at tp 2), summed over stages and TP shards.
    job = small_job(
        model={"preset": "llama2-7b", "num_layers": 32},
        parallel={"tp": 2, "pp": 2},
        training={"seq_length": 128, "micro_batch_size": 1},
    )
    jt = trace_job(job, full_model=False)
    assert agg.model_params([rt.trace for rt in jt.roles], tp=2) == 6_738_415_616


@pytest.mark.parametrize("grouped", [False, True])
def test_moe_total_is_the_same_under_expert_tensor_parallelism(grouped):
    """The model's parameters counted from the ranks' traces do not depend on the layout:
    experts under expert tensor parallelism (tp 2, ep 2), whether one TE Linear per expert
    (which megatron-core gives no parallel mode, so TE marks nothing sharded) or a grouped
    GEMM, count as many as on one GPU."""
    from tests.helpers import MOE

    def total(parallel, gpus):
        job = small_job(
            model={**MOE, "num_experts": 4},
            parallel=parallel,
            implementation={"moe_grouped_gemm": grouped},
            cluster={"num_gpus": gpus},
        )
        jt = trace_job(job, full_model=False)
        p, m = jt.job.parallel, jt.job.model
        # the embedding's rows are padded to a multiple of 128 x tp: left out
        tables = 1 + m.untie_embeddings_and_output_weights
        vocab = tables * jt.job.padded_vocab_size * m.hidden_size
        return agg.model_params([rt.trace for rt in jt.roles], tp=p.tp, ep=p.ep, etp=p.etp) - vocab

    one = total({}, 1)
    assert one > 0
    assert total({"tp": 2, "ep": 2, "sequence_parallel": True}, 4) == one
