"""implementation.te_op_fuser: what the checks refuse and accept before any model is built (the
fused MLP traced is in tests/tracing/test_te_fused_mlp.py)."""

import pytest

from metatrace.errors import ConfigError
from tests.helpers import small_job


@pytest.mark.parametrize(
    "sections, message",
    [
        (
            {"implementation": {"transformer_impl": "local"}},
            "needs implementation.transformer_impl",
        ),
        (
            {"model": {"activation": "squared_relu"}},
            "does not support model.activation squared_relu",
        ),
        (
            {
                "training": {"precision": "fp8", "fp8_recipe": "blockwise"},
                "parallel": {"tp": 2, "sequence_parallel": True},
            },
            "compact layout",
        ),
    ],
)
def test_checks_refuse_what_the_fuser_cannot_run(sections, message):
    implementation = {"te_op_fuser": True, **sections.pop("implementation", {})}
    with pytest.raises(ConfigError, match=message):
        small_job(implementation=implementation, **sections)
    small_job(**sections)  # without the fuser the job is fine


def test_checks_accept_block_scaling_without_sequence_parallel():
    job = small_job(
        implementation={"te_op_fuser": True},
        parallel={"tp": 2},
        training={"precision": "fp8", "fp8_recipe": "blockwise"},
    )
    assert job.implementation.te_op_fuser
