"""Fine-grained activation offloading: module names are checked when the job is loaded (what
offloading moves is traced in tests/tracing/test_offload.py)."""

import pytest

from metatrace.errors import ConfigError
from tests.helpers import small_job


def test_unknown_module_names_are_refused_at_load():
    with pytest.raises(ConfigError, match="did you mean 'core_attn'"):
        small_job(training={"activation_offload_modules": ["core_atn"]})
