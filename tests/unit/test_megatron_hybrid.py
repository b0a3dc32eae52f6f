"""Megatron-LM flags of hybrid models, Gated DeltaNet, gated attention and LatentMoE: the job
keys they set, what they refuse, and the job written back as flags parsing back to itself."""

import dataclasses

import pytest

from metatrace.config import job_from_dict, release
from metatrace.config.megatron.args import job_from_args, split_args
from metatrace.config.megatron.flags import FLAGS
from metatrace.config.megatron.to_args import megatron_args
from tests.unit.test_megatron_args import error, job

SINCE_0_19 = release.since(0, 19)
HYBRID = (
    "--hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
    "--seq-length 512 --max-position-embeddings 512 --micro-batch-size 1 --global-batch-size 8 "
    "--bf16 --vocab-size 1000 --tokenizer-type NullTokenizer --squared-relu "
    "--disable-bias-linear --normalization RMSNorm --position-embedding-type none "
    "--untie-embeddings-and-output-weights --num-experts 4 --moe-ffn-hidden-size 128 "
    "--mamba-state-dim 16 --mamba-head-dim 32 --mamba-num-groups 2 --mamba-num-heads 16 "
    "--is-hybrid-model --moe-latent-size 64 "
)
GDN = (
    "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --group-query-attention "
    "--num-query-groups 2 --kv-channels 64 --seq-length 512 --max-position-embeddings 512 "
    "--micro-batch-size 1 --global-batch-size 8 --bf16 --vocab-size 1000 "
    "--tokenizer-type NullTokenizer --swiglu --disable-bias-linear --normalization RMSNorm "
    "--position-embedding-type rope --qk-layernorm --attention-output-gate "
    "--experimental-attention-variant gated_delta_net --linear-conv-kernel-dim 4 "
    "--linear-key-head-dim 32 --linear-value-head-dim 32 --linear-num-key-heads 4 "
    "--linear-num-value-heads 8 "
)
FLAG = "--hybrid-layer-pattern" if SINCE_0_19 else "--hybrid-override-pattern"


def test_the_flags_are_modelled_with_their_keys():
    """Every Mamba and Gated DeltaNet size, the gated attention and LatentMoE: Megatron-LM's flag
    of the same name sets the job key."""
    import dataclasses

    from metatrace.config.job import Model

    names = [
        f.name
        for f in dataclasses.fields(Model)
        if f.name.startswith(("mamba_", "linear_")) and f.name != "linear_attention_freq"
    ]
    names += ["attention_output_gate", "moe_latent_size"]
    assert len(names) == 11
    for name in names:
        flag = "--" + name.replace("_", "-")
        assert (FLAGS[flag].cls, FLAGS[flag].key) == ("modelled", f"model.{name}"), flag


def test_hybrid_pattern_and_mamba_sizes():
    j, notes = job(HYBRID + f"{FLAG} M*M-MEM*", world_size=8)
    m = j.model
    assert (m.hybrid_layer_pattern, m.num_layers) == ("M*M-MEM*", 8)
    assert (m.mamba_state_dim, m.mamba_head_dim, m.mamba_num_groups, m.mamba_num_heads) == (
        16,
        32,
        2,
        16,
    )
    assert m.moe_latent_size == 64 and m.moe_layer_freq == [0, 0, 0, 0, 0, 1, 0, 0]
    assert not j.not_modelled


def test_num_layers_with_a_pattern():
    if SINCE_0_19:  # core_v0.19 takes the pattern's count
        j, notes = job(HYBRID + f"{FLAG} M*M- --num-layers 6")
        assert j.model.num_layers == 4 and any("--num-layers 6 is ignored" in n for n in notes)
    else:  # core_v0.16.1's MambaModel asserts that they agree
        assert "model.num_layers = 6 but model.hybrid_layer_pattern has 4" in _resolve_error(
            HYBRID + f"{FLAG} M*M- --num-layers 6"
        )


def _resolve_error(text):
    from metatrace.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        job(text)
    return str(info.value)


def test_refusals():
    both = "--hybrid-override-pattern M*M- --hybrid-layer-pattern M*M-"
    assert "cannot both be given" in error(HYBRID + both)
    assert "--disable-mamba-mem-eff-path: the unfused Mamba-2 path" in error(
        HYBRID + f"{FLAG} M*M- --disable-mamba-mem-eff-path"
    )
    assert "needs --linear-attention-freq" in error(GDN)


def test_mamba_flags_without_a_pattern_are_ignored():
    base = GDN.replace("--experimental-attention-variant gated_delta_net ", "")
    j, notes = job(base + "--mamba-state-dim 64 --is-hybrid-model")
    assert j.model.mamba_state_dim == 128 and j.model.hybrid_layer_pattern is None
    assert any("--mamba-state-dim" in n and "ignored" in n for n in notes)
    assert any("--is-hybrid-model without a hybrid layer pattern" in n for n in notes)
    # the GDN sizes without the variant: ignored too
    assert j.model.linear_num_key_heads == 16 and j.model.linear_attention_freq is None
    assert any("--linear-conv-kernel-dim" in n and "ignored" in n for n in notes)


def test_legacy_mtp_pattern():
    text = HYBRID + f"{FLAG} M*M-E --mtp-num-layers 2 --mtp-hybrid-override-pattern *E"
    if not SINCE_0_19:  # MambaModel of 0.16.1 has no multi-token prediction
        assert "needs megatron-core 0.19" in _resolve_error(text)
        return
    j, _ = job(text)
    assert (j.model.hybrid_layer_pattern, j.model.mtp_num_layers) == ("M*M-E/*E/*E", 2)


def test_gated_delta_net_and_gated_attention():
    j, _ = job(GDN + "--linear-attention-freq 4")
    m = j.model
    assert (m.linear_attention_freq, m.attention_output_gate, m.linear_num_value_heads) == (
        4,
        True,
        8,
    )
    j, _ = job(GDN + '--linear-attention-freq "([1]*3+[0]*1)*2"')
    assert j.model.linear_attention_freq == [1, 1, 1, 0] * 2
    assert "expects an integer or a list expression" in error(GDN + "--linear-attention-freq x")


def test_unmodelled_attention_variants_are_reported():
    j, _ = job(GDN.replace("gated_delta_net", "dsa"))
    assert [n.option for n in j.not_modelled] == ["--experimental-attention-variant dsa"]


@pytest.mark.parametrize("preset", ["nemotron-3-nano-30b-a3b", "qwen3-next-80b-a3b"])
def test_presets_written_as_flags_parse_back(preset):
    original = job_from_dict(
        {
            "model": {"preset": preset},
            "training": {"seq_length": 4096, "micro_batch_size": 1},
            "cluster": {"num_gpus": 8},
        }
    )
    back, _ = job_from_args(megatron_args(original), world_size=8)
    assert back.model == dataclasses.replace(original.model, preset=None)
    assert not back.not_modelled
    assert FLAG in megatron_args(original) or preset.startswith("qwen")


def test_split_args_keeps_the_pattern():
    assert split_args(f"{FLAG} 'M*M-'") == [FLAG, "M*M-"]
