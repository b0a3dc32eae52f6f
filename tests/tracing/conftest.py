"""Fixtures of the tracing tier: traced jobs shared by its tests."""

import os

import pytest

from tests.helpers import EXAMPLES


@pytest.fixture(scope="session")
def debug_trace():
    """The traced examples/debug.yaml job (tp 2, pp 2 on 4 GPUs), full model included."""
    from metatrace.config import load_job
    from metatrace.tracing.trace import trace_job

    return trace_job(load_job(os.path.join(EXAMPLES, "debug.yaml")))


@pytest.fixture(scope="session")
def debug_analysis(debug_trace):
    """debug_trace, analysed (metatrace.analysis.analyze)."""
    from metatrace.analysis.analyze import analyze

    return analyze(debug_trace)
