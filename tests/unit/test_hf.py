"""Hugging Face config.json files as the model section (`model.hf_config`): agreement with the
presets written from the same files, overrides, paths, and one clear error per kind of bad
input (the published parameter counts are traced in tests/tracing/test_hf.py)."""

import dataclasses
import json
import os
import shutil

import pytest

from metatrace.config import job_from_dict, load_job
from metatrace.config.hf import IGNORED, read_hf_config
from metatrace.errors import ConfigError
from tests.helpers import EXAMPLES, HF, hf_job, hf_path, metatrace


def edited(tmp_path, repo: str, **changes) -> str:
    """A copy of a published config with fields changed (None removes a field)."""
    with open(hf_path(repo)) as f:
        data = json.load(f)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp_path / f"{repo}.json"
    path.write_text(json.dumps(data))
    return str(path)


def model_section(job) -> dict:
    """The resolved model section without the key that says where it came from."""
    values = dataclasses.asdict(job.model)
    del values["preset"], values["hf_config"]
    return values


# ----------------------------------------------------------------------------- parameter counts


# Presets whose published totals tests already trace (tests/tracing: test_params.py: llama2-7b;
# test_moe.py: mixtral-8x7b 46,702,792,704, qwen3-30b-a3b 30,532,122,624 and qwen3-235b-a22b
# 235,093,634,560; test_mla.py:
# deepseek-v3 671,026,404,352): the HF import must give the same resolved model section, hence
# the same model. llama3-8b is traced in tests/tracing/test_hf.py and compared here too.
@pytest.mark.parametrize(
    "repo, preset",
    [
        ("Llama-2-7b-hf", "llama2-7b"),
        ("Meta-Llama-3-8B", "llama3-8b"),
        ("Mixtral-8x7B-v0.1", "mixtral-8x7b"),
        ("Qwen3-30B-A3B", "qwen3-30b-a3b"),
        ("Qwen3-235B-A22B", "qwen3-235b-a22b"),
    ],
)
def test_hf_import_is_the_preset(repo, preset):
    job = hf_job(repo)
    assert model_section(job) == model_section(
        job_from_dict(
            {"model": {"preset": preset}, "training": {"seq_length": 64, "micro_batch_size": 1}}
        )
    )
    assert job.notes == ()  # every published field is in a table


def test_deepseek_v3_import_is_the_preset_but_for_the_aux_loss_weight():
    # The preset takes the sequence-wise balance weight from the paper (alpha = 0.0001,
    # section 4.2); config.json says aux_loss_alpha 0.001, and the import reads the file. Both
    # are non-zero, so megatron-core computes the same seq_aux_loss (it skips it only at 0).
    job = hf_job("DeepSeek-V3")
    preset = job_from_dict(
        {"model": {"preset": "deepseek-v3"}, "training": {"seq_length": 64, "micro_batch_size": 1}}
    )
    hf, ref = model_section(job), model_section(preset)
    assert {k for k in hf if hf[k] != ref[k]} == {"moe_aux_loss_coeff"}
    assert (hf["moe_aux_loss_coeff"], ref["moe_aux_loss_coeff"]) == (0.001, 0.0001)
    m = job.model
    assert m.moe_layer_freq == [0] * 3 + [1] * 58 and m.mtp_num_layers == 1
    assert m.moe_shared_expert_intermediate_size == 2048 and m.rotary_scaling_factor == 40.0
    assert job.notes == ()


def test_every_published_field_is_in_a_table():
    # No published file leaves a field for the warning; and the ignored table declares only
    # fields that change nothing measured (no dimension hides in it).
    for repo in os.listdir(HF):
        if not os.path.isdir(os.path.join(HF, repo)):
            continue  # README.md
        _, notes = read_hf_config(hf_path(repo), seq_length=64)
        assert not [n for n in notes if n.startswith("warning")], repo
    assert not {"hidden_size", "num_hidden_layers", "vocab_size", "sliding_window"} & set(IGNORED)


# ----------------------------------------------------------------------------- mapping rules


def test_explicit_keys_override_the_hf_config():
    job = hf_job(
        "Qwen3-8B",
        model={
            "num_layers": 4,
            "rotary_base": 5000,
            "add_qkv_bias": True,
            "untie_embeddings_and_output_weights": False,
        },
    )
    m = job.model
    assert (m.num_layers, m.rotary_base, m.add_qkv_bias) == (4, 5000, True)
    assert m.untie_embeddings_and_output_weights is False
    # the rest comes from the file
    assert (m.ffn_hidden_size, m.num_query_groups, m.kv_channels) == (12288, 8, 128)


def test_relative_path_is_relative_to_the_job_file(tmp_path, monkeypatch):
    (tmp_path / "hf").mkdir()
    (tmp_path / "jobs").mkdir()
    shutil.copyfile(hf_path("Qwen2-7B"), tmp_path / "hf" / "config.json")
    job_file = tmp_path / "jobs" / "job.yaml"
    job_file.write_text("model: {hf_config: ../hf/config.json}\ntraining: {seq_length: 128}\n")
    monkeypatch.chdir(tmp_path / "hf")  # from here, ../hf/config.json does not exist
    job = load_job(job_file)
    m = job.model
    assert (m.hidden_size, m.add_qkv_bias, m.add_bias_linear) == (3584, True, False)
    assert job.model.hf_config == "../hf/config.json"  # as the user wrote it


def test_moe_layer_patterns_and_routers(tmp_path):
    # Qwen3-MoE: sparse where (i + 1) % step == 0 and i is not MLP-only; without norm_topk_prob
    # the router softmaxes before the top k.
    path = edited(
        tmp_path,
        "Qwen3-30B-A3B",
        num_hidden_layers=6,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=False,
    )
    m = hf_job(path).model
    assert m.moe_layer_freq == [0, 1, 0, 0, 0, 1] and m.moe_router_pre_softmax is True
    # DeepSeek: dense before first_k_dense_replace, then every moe_layer_freq-th layer.
    path = edited(
        tmp_path,
        "DeepSeek-V3",
        num_hidden_layers=8,
        first_k_dense_replace=2,
        moe_layer_freq=3,
        num_nextn_predict_layers=0,
        n_shared_experts=2,
    )
    m = hf_job(path).model
    assert m.moe_layer_freq == [0, 0, 0, 1, 0, 0, 1, 0] and m.mtp_num_layers is None
    assert m.moe_shared_expert_intermediate_size == 2 * 2048
    # Mixtral with output_router_logits trains with its aux loss; without, with none.
    path = edited(tmp_path, "Mixtral-8x7B-v0.1", output_router_logits=True)
    assert hf_job(path).model.moe_aux_loss_coeff == 0.02
    assert hf_job("Mixtral-8x7B-v0.1").model.moe_aux_loss_coeff == 0.0


def test_biases_ties_and_head_dims(tmp_path):
    path = edited(
        tmp_path,
        "Meta-Llama-3-8B",
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        head_dim=64,
        num_key_value_heads=None,
    )
    m = hf_job(path).model
    assert (m.add_bias_linear, m.add_qkv_bias) == (True, True)
    assert m.untie_embeddings_and_output_weights is False
    assert (m.kv_channels, m.num_query_groups) == (64, 32)  # no num_key_value_heads: multi-head
    m = hf_job("Qwen2-7B").model  # Qwen2's hard-wired q, k, v biases
    assert (m.add_bias_linear, m.add_qkv_bias, m.qk_layernorm) == (False, True, False)
    m = hf_job("Qwen3-8B").model
    assert (m.add_qkv_bias, m.qk_layernorm, m.norm_epsilon) == (False, True, 1e-6)


def test_frequency_only_rope_scaling_is_accepted(tmp_path):
    # Llama 3.1's rope_scaling only changes the rotary frequencies (Megatron-LM's
    # --use-rope-scaling, which changes nothing metatrace measures).
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }
    job = hf_job(edited(tmp_path, "Meta-Llama-3-8B", rope_scaling=scaling))
    assert job.model.position_embedding_type == "rope" and job.notes == ()


def test_sliding_window_covering_the_sequence_is_a_note():
    # Mistral-7B's 4096-token window masks nothing in a 4096-token sequence.
    job = hf_job("Mistral-7B-v0.1", training={"seq_length": 4096})
    assert [n for n in job.notes if "sliding_window 4096 covers" in n]
    # Qwen2's window is off (use_sliding_window false): no note.
    notes = hf_job("Qwen2-7B", training={"seq_length": 8192}).notes
    assert not [n for n in notes if "sliding" in n]


def test_unknown_fields_are_named_in_one_warning(tmp_path):
    scaling = {"type": "yarn", "factor": 40, "extrapolation": 2}
    path = edited(
        tmp_path, "DeepSeek-V3", flux_capacitor=1, attn_softcap=30.0, rope_scaling=scaling
    )
    job = hf_job(path)
    (warning,) = [n for n in job.notes if n.startswith("warning")]
    assert path in warning
    assert warning.endswith("attn_softcap, flux_capacitor, rope_scaling.extrapolation")
    assert job.model.rotary_scaling_factor == 40.0 and job.model.beta_fast == 32.0  # default


# ----------------------------------------------------------------------------- bad input


def problem(data) -> str:
    with pytest.raises(ConfigError) as info:
        job_from_dict(data)
    return str(info.value)


BAD = [
    # (repo, changes, training, words the message must hold besides the file's path)
    ("Qwen3-8B", {"model_type": "gpt2"}, {}, ["'model_type' 'gpt2' is not supported", "qwen3_moe"]),
    ("Qwen3-8B", {"model_type": None}, {}, ["no 'model_type' (supported: llama, mistral"]),
    ("Meta-Llama-3-8B", {"hidden_act": "relu2"}, {}, ["'hidden_act' = \"relu2\"", "not modelled"]),
    (
        "Meta-Llama-3-8B",
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
        {},
        ["'rope_scaling'", "type 'dynamic' is not modelled"],
    ),
    (
        "Qwen2-7B",
        {"rope_scaling": {"type": "yarn", "factor": 4.0}},
        {},
        ["'rope_scaling'", "type 'yarn' is not modelled"],
    ),
    (
        "DeepSeek-V3",
        {"rope_scaling": {"type": "linear", "factor": 4.0}},
        {},
        ["'rope_scaling'", "with multi-latent attention"],
    ),
    (
        "Mistral-7B-v0.1",
        {},
        {"seq_length": 8192},
        ["'sliding_window' = 4096", "32 of 32 layers", "training.seq_length = 8192"],
    ),
    (
        "Qwen2-7B",
        {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20},
        {"seq_length": 8192},
        ["'sliding_window' = 4096", "8 of 28 layers"],
    ),
    ("Qwen3-8B", {"attention_bias": True}, {}, ["'attention_bias' = true", "megatron-core has no"]),
    ("Meta-Llama-3-8B", {"mlp_bias": True}, {}, ["'mlp_bias' = true"]),
    ("Qwen3-8B", {"hidden_size": "4096"}, {}, ["'hidden_size' = \"4096\"", "whole number"]),
    ("Qwen3-8B", {"rope_theta": 1e6 + 0.5}, {}, ["'rope_theta'", "whole number"]),
    ("Qwen3-8B", {"intermediate_size": None}, {}, ["'intermediate_size' missing"]),
    ("DeepSeek-V3", {"norm_topk_prob": False}, {}, ["'norm_topk_prob' = false", "renormalises"]),
    ("DeepSeek-V3", {"topk_method": "random"}, {}, ["'topk_method' = \"random\"", "noaux_tc"]),
    (
        "DeepSeek-V3",
        {"rope_scaling": {"type": "yarn", "factor": "big"}},
        {},
        ["'rope_scaling.factor'", "must be a number"],
    ),
    ("Mixtral-8x7B-v0.1", {"router_jitter_noise": 0.1}, {}, ["'router_jitter_noise' = 0.1"]),
]


@pytest.mark.parametrize(
    "repo, changes, training, words", BAD, ids=[f"{r}-{'-'.join(c) or 'seq'}" for r, c, _, _ in BAD]
)
def test_bad_hf_config_is_one_clear_error(tmp_path, repo, changes, training, words):
    path = edited(tmp_path, repo, **changes)
    message = problem({"model": {"hf_config": path}, "training": {"seq_length": 64, **training}})
    assert message.startswith(path)
    for word in words:
        assert word in message


def test_unreadable_files_and_bad_keys(tmp_path):
    missing = str(tmp_path / "nope" / "config.json")
    assert f"cannot read Hugging Face config {missing}" in problem(
        {"model": {"hf_config": missing}, "training": {"seq_length": 64}}
    )
    broken = tmp_path / "broken.json"
    broken.write_text('{"model_type": "llama",\n "hidden_size": }')
    assert problem(
        {"model": {"hf_config": str(broken)}, "training": {"seq_length": 64}}
    ).startswith(f"{broken}: not valid JSON (line 2)")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert "is a JSON object, got list" in problem(
        {"model": {"hf_config": str(listed)}, "training": {"seq_length": 64}}
    )
    assert "'model.preset' and 'model.hf_config' both give the model" in problem(
        {
            "model": {"preset": "llama2-7b", "hf_config": hf_path("Qwen3-8B")},
            "training": {"seq_length": 64},
        }
    )
    assert "'model.hf_config' must be the path of a config.json, got int 3" in problem(
        {"model": {"hf_config": 3}, "training": {"seq_length": 64}}
    )


def test_cli_exits_2_on_a_bad_hf_config(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("model: {hf_config: missing/config.json}\ntraining: {seq_length: 64}\n")
    result = metatrace("run", "--config", str(job))
    assert result.returncode == 2 and result.stdout == ""
    missing = tmp_path / "missing" / "config.json"
    assert f"cannot read Hugging Face config {missing}" in result.stderr
    assert "Traceback" not in result.stderr


def test_example_job_reads_its_hf_config():
    job = load_job(os.path.join(EXAMPLES, "qwen3-8b-hf.yaml"))
    assert model_section(job) == model_section(hf_job("Qwen3-8B", training={"seq_length": 4096}))
