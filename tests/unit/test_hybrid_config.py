"""Hybrid models' layer patterns: parsing as megatron-core parses them, what a job derives from
a pattern, and the pipeline checks of hybrid stacks."""

import pytest

from metatrace.config import hybrid, job_from_dict, release
from metatrace.config.checks import chunk_layer_counts
from metatrace.errors import ConfigError

SINCE_0_19 = release.since(0, 19)


def _job(pattern: str, *, pp: int = 1, vpp=None, gpus: int = 8, **model):
    parallel = {"tp": 1, "pp": pp}
    if vpp:
        parallel["vpp"] = vpp
    return job_from_dict(
        {
            "model": {
                "hybrid_layer_pattern": pattern,
                "hidden_size": 256,
                "num_attention_heads": 8,
                "vocab_size": 1024,
                "activation": "swiglu",
                "normalization": "RMSNorm",
                "position_embedding_type": "none",
                "add_bias_linear": False,
                **model,
            },
            "parallel": parallel,
            "training": {"seq_length": 128, "micro_batch_size": 1, "global_batch_size": 64},
            "cluster": {"num_gpus": gpus, "gpus_per_node": 8},
        }
    )


def test_pattern_parse_counts_layers_stages_and_prediction_depths():
    p = hybrid.parse("M*M-|MEM*/*E/*E", since_0_19=True)
    assert p.layers == "M*M-MEM*"
    assert p.stages == ("M*M-", "MEM*")
    assert (p.mtp, p.mtp_depths) == ("*E", 2)
    assert (p.count("M"), p.count("E"), p.count("*")) == (4, 1, 2)
    plain = hybrid.parse("MEMEM*E", since_0_19=False)
    assert (plain.stages, plain.mtp, plain.mtp_depths) == (None, None, 0)


@pytest.mark.parametrize(
    "text, needs",
    [("M*|M*", "'|'"), ("M*M*/MM", "'/'"), ("MGM*", "G (Gated DeltaNet)")],
)
def test_pattern_features_of_0_19_are_refused_under_0_16(text, needs):
    with pytest.raises(ConfigError) as info:
        hybrid.parse(text, since_0_19=False)
    assert needs in str(info.value) and "0.19" in str(info.value)
    hybrid.parse(text, since_0_19=True)  # and taken under 0.19


@pytest.mark.parametrize(
    "text, says",
    [
        ("M*X", "unknown layer symbol 'X'"),
        ("M*/MM/M*", "must be the same"),
        ("|", "has no layers"),
    ],
)
def test_pattern_errors_name_the_problem(text, says):
    with pytest.raises(ConfigError) as info:
        hybrid.parse(text, since_0_19=True)
    assert says in str(info.value)


def test_job_derives_layers_experts_and_mamba_heads_from_the_pattern():
    job = _job("MEM*MEM-", num_experts=8, moe_ffn_hidden_size=64)
    m = job.model
    assert m.num_layers == 8
    assert m.moe_layer_freq == [0, 1, 0, 0, 0, 1, 0, 0]
    # MambaMixer: d_inner = 2 x hidden, heads = d_inner / head dim (64 by default)
    assert m.mamba_num_heads == 2 * 256 // 64


def test_job_pattern_and_num_layers_must_agree():
    with pytest.raises(ConfigError) as info:
        _job("M*M*", num_layers=6)
    assert "num_layers = 6" in str(info.value) and "4 layers" in str(info.value)


def test_moe_layers_need_experts():
    with pytest.raises(ConfigError) as info:
        _job("MEM*")
    assert "model.num_experts" in str(info.value)


@pytest.mark.skipif(not SINCE_0_19, reason="'|' in a pattern needs megatron-core 0.19")
def test_pattern_segments_are_the_pipeline_chunks():
    job = _job("M*M|MM*M-|M*|MM", pp=2, vpp=2)
    assert chunk_layer_counts(job) == [3, 5, 2, 2]
    with pytest.raises(ConfigError) as info:
        _job("M*M|MM*M-|M*", pp=2)
    assert "3 pipeline segments" in str(info.value) and "2 model chunks" in str(info.value)


def test_virtual_pipeline_without_segments_is_refused():
    with pytest.raises(ConfigError) as info:
        _job("M*M*M*M*", pp=2, vpp=2)
    assert "parallel.vpp with a hybrid model" in str(info.value)


def test_even_pipeline_split_of_a_pattern_without_segments():
    job = _job("M*M*M*M*", pp=2)
    assert chunk_layer_counts(job) == [4, 4]


@pytest.mark.parametrize(
    "training, says",
    [
        (
            {"recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}},
            "nothing is",
        ),
        ({"precision": "fp4", "fp4_recipe": "nvfp4"}, "its layers run in bf16"),
    ],
)
def test_what_0_16_s_mamba_stack_does_not_do_is_a_warning(training, says):
    """megatron-core 0.16.1's MambaStack (ssm/mamba_block.py) neither checkpoints its layers
    under full recompute nor enters an FP4 context; 0.19's HybridStack does both."""
    job = job_from_dict(
        {
            "model": {
                "hybrid_layer_pattern": "M*M-",
                "hidden_size": 256,
                "num_attention_heads": 8,
                "vocab_size": 1024,
                "activation": "squared_relu",
                "normalization": "RMSNorm",
                "position_embedding_type": "none",
                "add_bias_linear": False,
            },
            "training": {"seq_length": 128, "micro_batch_size": 1, **training},
            "cluster": {"num_gpus": 8, "gpu": "b200"},
        }
    )
    warned = [n for n in job.notes if n.startswith("warning") and says in n]
    assert len(warned) == (0 if SINCE_0_19 else 1)
