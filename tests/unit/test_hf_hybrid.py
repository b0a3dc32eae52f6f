"""Hugging Face config.json files of hybrid models (NemotronHForCausalLM: Nemotron-H,
Nemotron 3; Qwen3NextForCausalLM) as the model section: the same resolved model as the presets,
and one clear error for what megatron-core cannot build. The files under tests/data/hf are
reconstructed (tests/data/hf/README.md)."""

import pytest

from metatrace.config import job_from_dict, release
from metatrace.errors import ConfigError
from tests.helpers import hf_job
from tests.unit.test_hf import edited, model_section


def _preset(name):
    return job_from_dict(
        {"model": {"preset": name}, "training": {"seq_length": 64, "micro_batch_size": 1}}
    )


@pytest.mark.parametrize(
    "repo, preset",
    [
        ("Nemotron-H-8B-Base-8K", "nemotron-h-8b"),
        ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "nemotron-3-nano-30b-a3b"),
        ("Qwen3-Next-80B-A3B-Instruct", "qwen3-next-80b-a3b"),
    ],
)
def test_hf_import_is_the_preset(repo, preset):
    job = hf_job(repo)
    assert model_section(job) == model_section(_preset(preset))
    # every field in a table, nothing left out
    assert job.notes == ()


def test_qwen3_next_maps_its_layers_and_gate():
    m = hf_job("Qwen3-Next-80B-A3B-Instruct").model
    assert (m.linear_attention_freq, m.rotary_percent, m.attention_output_gate) == (4, 0.25, True)
    assert (m.moe_shared_expert_intermediate_size, m.kv_channels, m.qk_layernorm) == (
        512,
        256,
        True,
    )
    assert m.moe_shared_expert_gate


def test_qwen3_next_layer_types_other_than_the_interval_are_a_list(tmp_path):
    types = ["linear_attention", "full_attention"] * 2
    path = edited(tmp_path, "Qwen3-Next-80B-A3B-Instruct", num_hidden_layers=4, layer_types=types)
    assert hf_job(path).model.linear_attention_freq == [1, 0, 1, 0]
    same = ["linear_attention"] * 3 + ["full_attention"]
    path = edited(tmp_path, "Qwen3-Next-80B-A3B-Instruct", num_hidden_layers=4, layer_types=same)
    assert hf_job(path).model.linear_attention_freq == 4


def test_nemotron_h_latent_moe_and_routing(tmp_path):
    path = edited(
        tmp_path,
        "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        moe_latent_size=1024,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
    )
    m = hf_job(path).model
    assert (m.moe_latent_size, m.moe_shared_expert_intermediate_size) == (1024, 2 * 3712)
    assert (m.moe_router_num_groups, m.moe_router_group_topk) == (4, 2)
    assert (m.moe_router_score_function, m.moe_router_enable_expert_bias) == ("sigmoid", True)
    # without mamba_num_heads: expand x hidden / head_dim
    m = hf_job(edited(tmp_path, "Nemotron-H-8B-Base-8K", mamba_num_heads=None)).model
    assert m.mamba_num_heads == 2 * 4096 // 64


def test_nemotron_h_multi_token_prediction(tmp_path):
    path = edited(
        tmp_path,
        "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        num_nextn_predict_layers=2,
        mtp_hybrid_override_pattern="*E",
    )
    if not release.since(0, 19):
        with pytest.raises(ConfigError, match="needs megatron-core 0.19"):
            hf_job(path)
        return
    m = hf_job(path).model
    assert m.hybrid_layer_pattern.endswith("/*E/*E") and m.mtp_num_layers == 2
    path = edited(tmp_path, "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", num_nextn_predict_layers=1)
    with pytest.raises(ConfigError, match="mtp_hybrid_override_pattern"):
        hf_job(path)


@pytest.mark.parametrize(
    "repo, changes, message",
    [
        ("Nemotron-H-8B-Base-8K", {"conv_kernel": 3}, "'conv_kernel' = 3: megatron-core's Mamba"),
        ("Nemotron-H-8B-Base-8K", {"mamba_hidden_act": "gelu"}, "uses silu only"),
        ("Nemotron-H-8B-Base-8K", {"use_conv_bias": False}, "always has a conv bias"),
        ("Nemotron-H-8B-Base-8K", {"mamba_proj_bias": True}, "no projection bias"),
        ("Nemotron-H-8B-Base-8K", {"mlp_bias": True}, "biases in a hybrid model"),
        (
            "Nemotron-H-8B-Base-8K",
            {"mlp_hidden_act": "tanh"},
            "'mlp_hidden_act' = \"tanh\": not modelled",
        ),
        ("Nemotron-H-8B-Base-8K", {"residual_in_fp32": True}, "fp32 residual"),
        (
            "Nemotron-H-8B-Base-8K",
            {"num_hidden_layers": 50},
            "has 52 layers, num_hidden_layers says 50",
        ),
        ("Nemotron-H-8B-Base-8K", {"sliding_window": 1024}, "sliding-window attention"),
        ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", {"norm_topk_prob": False}, "renormalises"),
        ("Qwen3-Next-80B-A3B-Instruct", {"full_attention_interval": 0}, "must be at least 1"),
        (
            "Qwen3-Next-80B-A3B-Instruct",
            {"layer_types": ["linear_attention"]},
            "per layer \\(48\\)",
        ),
    ],
)
def test_what_does_not_map_is_refused(tmp_path, repo, changes, message):
    with pytest.raises(ConfigError, match=message):
        hf_job(edited(tmp_path, repo, **changes))


def test_reconstructed_files_say_so():
    import os

    from tests.helpers import HF

    with open(os.path.join(HF, "README.md")) as f:
        text = f.read()
    for repo in ("Nemotron-H-8B-Base-8K", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"):
        assert repo in text and "RECONSTRUCTED" in text
