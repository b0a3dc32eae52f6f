"""What megatron-core's own configuration refuses reaches the user as a ConfigError."""

import pytest

from metatrace.errors import ConfigError
from tests.helpers import small_job


def test_megatron_core_refusals_become_config_errors(monkeypatch):
    # Whatever megatron-core's own TransformerConfig refuses reaches the user as a ConfigError.
    import megatron.core.transformer as mt

    from metatrace.models.build import transformer_config

    class Refusing:
        def __init__(self, **fields):
            raise ValueError("num_layers_in_first_pipeline_stage must be larger than 0")

    monkeypatch.setattr(mt, "TransformerConfig", Refusing)
    with pytest.raises(ConfigError, match="megatron-core rejects this configuration: num_layers"):
        transformer_config(small_job())


def test_megatron_cores_verdicts_are_asked_once_per_process(monkeypatch):
    """check_with_megatron remembers megatron-core's verdict by the configs' arguments (the
    planner checks thousands of layouts): a job asked again, or one that differs only where the
    configs do not look (the micro-batch size), is answered without building them, with the
    same refusal."""
    import dataclasses

    import megatron.core.optimizer as mo
    import megatron.core.transformer as mt

    from metatrace.models import build
    from metatrace.tracing.checks import check_with_megatron

    built = []

    def counting(real):
        def make(**fields):
            built.append(real.__name__)
            return real(**fields)

        return make

    monkeypatch.setattr(build, "_VERDICTS", {})
    monkeypatch.setattr(mt, "TransformerConfig", counting(mt.TransformerConfig))
    monkeypatch.setattr(mo, "OptimizerConfig", counting(mo.OptimizerConfig))
    refused = small_job(
        training={"seq_length": 64, "use_precision_aware_optimizer": True},
        implementation={"transformer_impl": "transformer_engine"},
    )
    messages = []
    for job in (refused, refused, dataclasses.replace(refused, num_microbatches=7)):
        with pytest.raises(ConfigError) as e:
            check_with_megatron(job)
        messages.append(str(e.value))
    assert built == ["TransformerConfig", "OptimizerConfig"]
    assert len(set(messages)) == 1 and "only supported with distributed optimizer" in messages[0]
    # Without the precision-aware optimizer: megatron-core's TransformerConfig gets the same
    # arguments (its verdict is known), its OptimizerConfig new ones, asked once.
    accepted = dataclasses.replace(
        refused, training=dataclasses.replace(refused.training, use_precision_aware_optimizer=False)
    )
    check_with_megatron(accepted)
    check_with_megatron(accepted)
    assert built[2:] == ["OptimizerConfig"]
