"""Mixture-of-experts config checks (the traced MoE layers are in tests/tracing/test_moe.py)."""

import pytest

from metatrace.errors import ConfigError
from tests.helpers import MOE, small_job


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"parallel": {"ep": 2}}, "needs a mixture-of-experts model"),
        ({"model": {**MOE, "moe_layer_freq": "([0]*1+[1]*3)"}}, "for each of the 2 layers"),
        ({"model": {**MOE, "moe_layer_freq": "import os"}}, "not an integer, a list"),
    ],
)
def test_moe_config_errors(sections, message):
    with pytest.raises(ConfigError, match=message):
        small_job(**sections)
