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
