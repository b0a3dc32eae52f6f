"""GPT-OSS's configuration (issue 17): the Hugging Face import against the presets, and one
clear message per combination Transformer Engine 2.8 or megatron-core 0.16.1 refuses."""

import pytest

from metatrace.config import job_from_dict
from metatrace.errors import ConfigError
from tests.helpers import hf_path

TRAINING = {"seq_length": 4096, "micro_batch_size": 1}
OSS = {
    "preset": "gpt-oss-20b",
}
IMPL = {"moe_grouped_gemm": True, "bias_dropout_fusion": False}


def job(model=None, **sections):
    data = {
        "model": {**OSS, **(model or {})},
        "training": TRAINING,
        "implementation": {**IMPL, **sections.pop("implementation", {})},
    }
    data.update(sections)
    return job_from_dict(data)


def test_hf_import_is_the_preset():
    hf = job_from_dict(
        {
            "model": {"hf_config": hf_path("gpt-oss-120b")},
            "training": TRAINING,
            "implementation": IMPL,
        }
    )
    preset = job(model={"preset": "gpt-oss-120b"})
    import dataclasses

    same = lambda m: dataclasses.replace(m, preset=None, hf_config=None)
    assert same(hf.model) == same(preset.model)
    assert hf.model.window_size == [128, 0] and hf.model.window_attn_skip_freq == 2


@pytest.mark.parametrize(
    "model, sections, message",
    [
        (
            {},
            {"implementation": {"attention_backend": "flash"}},
            "turns flash-attn off for softmax sinks",
        ),
        (
            {"attention_dropout": 0.1},
            {"implementation": {"attention_backend": "fused"}},
            "cuDNN's fused attention takes windows",
        ),
        ({"window_attn_skip_freq": [1, 0]}, {}, "one 0 or 1 per layer"),
        # the fused bias-activation kernels read the offset (TransformerConfig refuses it)
        ({"activation": "gelu"}, {}, "model.glu_linear_offset needs a gated activation"),
        ({}, {"implementation": {"bias_dropout_fusion": True}}, "refuses bias-dropout fusion"),
        ({"rope_type": "yarn"}, {}, "set model.position_embedding_type: yarn"),
    ],
)
def test_config_errors(model, sections, message):
    with pytest.raises(ConfigError, match=message):
        job(model=model, **sections)


def test_window_with_dropout_leaves_auto_off_cudnn():
    """TE 2.8 turns cuDNN off for a window with dropout; sinks turn flash off: unfused."""
    assert job().attention_kernel == "fused"
    assert job(model={"attention_dropout": 0.1}).attention_kernel == "unfused"
    vanilla = {"attention_dropout": 0.1, "softmax_type": "vanilla"}
    assert job(model=vanilla).attention_kernel == "flash"
