"""The hybrid presets (Nemotron-H, Nemotron 3, Qwen3-Next): their parameter counts from a closed
form of megatron-core's module shapes (tests/helpers.hybrid_params, which
tests/tracing/test_hybrid_params.py checks against traced models exactly) against the model
cards; the planner's estimate against the closed form; the checks of the new model keys.

How close a card's figure must be: a card's figure is a rounded number, so the count must round
to it at the digits the card gives ("8.1 B": 8.05 to 8.15 B). Where the card gives only the
model's name (Nemotron 3 Super "120B-A12B", Qwen3-Next "80B-A3B"), the name's figure is read the
same way at its last digit: 119.5 to 120.5 B is too narrow for a name (Nemotron 3 Nano's name
says 30B for 31.6 B), so the total is held to 1% of the named figure and the active count to
half a billion.
What an active count counts differs by vendor and is stated at each figure.
"""

import pytest

from metatrace.config import job_from_dict
from metatrace.errors import ConfigError
from metatrace.planning.estimates import parameter_counts
from tests.helpers import hybrid_params

HYBRID = ("nemotron-h-8b", "nemotron-3-nano-30b-a3b", "nemotron-3-super-120b-a12b")
ALL = (*HYBRID, "qwen3-next-80b-a3b")


def _job(preset, **model):
    return job_from_dict(
        {
            "model": {"preset": preset, **model},
            "training": {"seq_length": 4096, "micro_batch_size": 1},
            "cluster": {"num_gpus": 8},
        }
    )


def _counts(preset) -> tuple[float, float, float]:
    """(total, active, one embedding table) in billions."""
    job = _job(preset)
    total, active = hybrid_params(job.model, job.padded_vocab_size)
    return total / 1e9, active / 1e9, job.padded_vocab_size * job.model.hidden_size / 1e9


def test_closed_forms_of_the_presets():
    # the counts the report gives, to the weight: a change of a preset's dimension shows here
    expected = {
        "nemotron-h-8b": (8_100_852_736, 8_100_852_736),
        "nemotron-3-nano-30b-a3b": (31_577_937_344, 3_580_073_408),
        "nemotron-3-super-120b-a12b": (120_668_687_360, 12_770_216_960),
        "qwen3-next-80b-a3b": (79_674_391_296, 3_874_929_408),  # with the 48 x 2,048 gate weights
    }
    for name, counts in expected.items():
        job = _job(name)
        assert hybrid_params(job.model, job.padded_vocab_size) == counts, name


def test_nemotron_h_8b_is_the_card_s_8_1_billion():
    total, active, _ = _counts("nemotron-h-8b")
    assert round(total, 1) == 8.1 and active == total  # dense


def test_nemotron_3_nano_is_the_card_s_31_6_b_with_3_6_b_active():
    # card: 31.6 B total, 3.2 B active (3.6 B with the embeddings): 3.2 B leaves out the input
    # embedding only (the output layer runs for every token)
    total, active, table = _counts("nemotron-3-nano-30b-a3b")
    assert round(total, 1) == 31.6
    assert round(active, 1) == 3.6
    assert round(active - table, 1) == 3.2


def test_nemotron_3_super_is_120b_a12b():
    # named figures only; active counted as Nano's card counts it (without the input
    # embedding): 12.23 B; with it 12.77 B. The MTP block (about 2.9 B) is not in the preset.
    total, active, table = _counts("nemotron-3-super-120b-a12b")
    assert total == pytest.approx(120, rel=0.01)
    assert abs(active - table - 12) < 0.5


def test_qwen3_next_is_80b_a3b():
    # named figures ("80B in total and 3B activated"); the 3 B counts no embedding table
    # (3.25 B; 3.87 B with both)
    total, active, table = _counts("qwen3-next-80b-a3b")
    assert total == pytest.approx(80, rel=0.01)
    assert abs(active - 2 * table - 3) < 0.5


@pytest.mark.parametrize("name", ALL)
def test_planner_estimate_is_the_closed_form_less_norms(name):
    # metatrace.planning.estimates leaves out the Mamba-2 / Gated DeltaNet vectors and some
    # norms: under half a per mille
    job = _job(name)
    exact = hybrid_params(job.model, job.padded_vocab_size)
    estimate = parameter_counts(job)
    for e, x in zip(estimate, exact):
        assert e == pytest.approx(x, rel=5e-4) and e <= x, name


@pytest.mark.parametrize(
    "preset, model, message",
    [
        (
            "qwen3-next-80b-a3b",
            {"activation": "gelu"},
            "Gated DeltaNet layers need model.activation swiglu or silu",
        ),
        (
            "nemotron-3-nano-30b-a3b",
            {"mamba_num_heads": 60},
            "mamba_num_heads = 60 is not divisible by model.mamba_num_groups = 8",
        ),
        (
            "qwen3-next-80b-a3b",
            {"linear_num_value_heads": 24},
            "is not divisible by model.linear_num_key_heads = 16",
        ),
        ("qwen3-next-80b-a3b", {"linear_attention_freq": [1, 0]}, "one 0 or 1 per layer (48)"),
        ("deepseek-v3", {"attention_output_gate": True}, "no output gate for MLA"),
    ],
)
def test_checks_refuse_what_megatron_core_refuses(preset, model, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        job_from_dict(
            {
                "model": {"preset": preset, **model},
                "training": {"seq_length": 4096, "micro_batch_size": 1},
                "cluster": {"num_gpus": 8},
            }
        )


def test_latent_moe_refuses_shared_expert_overlap():
    base = {
        "model": {"preset": "nemotron-3-super-120b-a12b"},
        "training": {"seq_length": 4096, "micro_batch_size": 1},
        "cluster": {"num_gpus": 8},
    }
    with pytest.raises(ConfigError, match="moe_shared_expert_overlap: megatron-core refuses"):
        job_from_dict({**base, "parallel": {"moe_shared_expert_overlap": True}})


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_every_preset_passes_its_checks_at_tp_2(impl):
    # the local spec too: metatrace's models.hybrid builds hybrid stacks from the local modules
    for name in ALL:
        job_from_dict(
            {
                "model": {"preset": name},
                "implementation": {"transformer_impl": impl},
                "parallel": {"tp": 2, "sequence_parallel": True},
                "training": {"seq_length": 4096, "micro_batch_size": 1},
                "cluster": {"num_gpus": 8},
            }
        )
