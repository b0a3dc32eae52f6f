"""Hybrid models' parameters as metatrace traces them (the Analysis's counts) against the closed
form of tests/helpers.hybrid_params, exactly: Mamba-2, attention, MLP and MoE layers of a
pattern, LatentMoE, Gated DeltaNet in a pattern (0.19) and in a GPT model with gated attention,
at tp 2 (the mixers' vectors are TP-sharded and count twice), with Transformer Engine's spec and
the local one (metatrace's models.hybrid builds hybrid stacks from both)."""

import pytest

from metatrace.analysis.analyze import analyze
from metatrace.config import job_from_dict, release
from metatrace.tracing.trace import trace_job
from tests.helpers import hybrid_params

_BASE = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_query_groups": 2,
    "vocab_size": 1000,
    "ffn_hidden_size": 512,
    "normalization": "RMSNorm",
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
    "num_experts": 4,
    "moe_ffn_hidden_size": 128,
    "moe_shared_expert_intermediate_size": 256,
}
_MAMBA = {
    **_BASE,
    "position_embedding_type": "none",
    "activation": "squared_relu",
    "mamba_head_dim": 32,
    "mamba_num_groups": 2,
    "mamba_state_dim": 16,
}
_GDN = {
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
}
CASES = {
    "mamba-attention-mlp-moe": {**_MAMBA, "hybrid_layer_pattern": "M*M-MEM*"},
    # Nemotron 3 Super's LatentMoE: routed experts over a 64-wide latent, the projections h x 64
    "latent-moe": {**_MAMBA, "hybrid_layer_pattern": "ME*E", "moe_latent_size": 64},
    # Qwen3-Next's shape: GDN in 3 of 4 layers, gated attention with q/k norms, partial RoPE
    "gpt-gdn-gated-attention": {
        **_BASE,
        **_GDN,
        "num_layers": 4,
        "kv_channels": 64,
        "activation": "swiglu",
        "position_embedding_type": "rope",
        "rotary_percent": 0.25,
        "qk_layernorm": True,
        "attention_output_gate": True,
        "linear_attention_freq": 2,
        "moe_shared_expert_gate": True,
    },
}
if release.since(0, 19):
    CASES["pattern-gdn"] = {
        **_MAMBA,
        **_GDN,
        "activation": "swiglu",
        "hybrid_layer_pattern": "M*G-MEG*",
    }


def _job(model, impl="transformer_engine"):
    return job_from_dict(
        {
            "model": model,
            "implementation": {"transformer_impl": impl},
            "parallel": {"tp": 2, "sequence_parallel": True},
            "training": {"seq_length": 128, "micro_batch_size": 1, "global_batch_size": 4},
            "cluster": {"num_gpus": 4, "gpus_per_node": 4},
        }
    )


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
@pytest.mark.parametrize("name", list(CASES))
def test_traced_parameters_equal_the_closed_form(name, impl):
    job = _job(CASES[name], impl)
    analysis = analyze(trace_job(job))
    total, active = hybrid_params(job.model, job.padded_vocab_size)
    assert (analysis.total_params, analysis.active_params) == (total, active)
    assert active < total  # top-2 of 4 experts
