"""Shared fixtures. Golden files live in tests/golden; regenerate them with --regen-golden."""

import os
import warnings

import pytest

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
warnings.filterwarnings("ignore")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
GOLDEN = os.path.join(ROOT, "tests", "golden")


def pytest_addoption(parser):
    parser.addoption(
        "--regen-golden", action="store_true", help="rewrite the golden files from this run"
    )


@pytest.fixture
def golden(request):
    """golden(name, text): compare `text` with tests/golden/name (or rewrite it)."""

    def check(name: str, text: str):
        path = os.path.join(GOLDEN, name)
        if request.config.getoption("--regen-golden") or not os.path.exists(path):
            if not request.config.getoption("--regen-golden"):
                pytest.fail(f"golden file {path} is missing; run pytest --regen-golden")
            with open(path, "w") as f:
                f.write(text)
            return
        with open(path) as f:
            expected = f.read()
        assert text == expected, f"output differs from {path} (pytest --regen-golden rewrites it)"

    return check


def small_job(**sections):
    """A resolved job on the debug preset with `sections` merged in (tests' building block)."""
    from metatrace.config import job_from_dict

    data = {
        "model": {"preset": "debug"},
        "training": {"seq_length": 64, "micro_batch_size": 2},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return job_from_dict(data)


@pytest.fixture(scope="session")
def debug_trace():
    """The traced examples/debug.yaml job (tp 2, pp 2 on 4 GPUs), full model included."""
    from metatrace.config import load_job
    from metatrace.tracing.trace import trace_job

    return trace_job(load_job(os.path.join(EXAMPLES, "debug.yaml")))
