"""Fixtures for both tiers; helpers (paths, small_job, ...) are in tests/helpers.py.

    python -m pytest tests/unit    # the fast tier: no megatron-core, under a minute
    python -m pytest               # everything: tests/unit and tests/tracing

Golden files live in tests/golden/<megatron-core series> (0.16, 0.19: the traced output differs
between releases); regenerate them with --regen-golden under each.

Warnings: pyproject.toml filters only what importing megatron-core emits without CUDA, Transformer
Engine and Apex. Everything else stays in the summary: megatron-core's deprecations at run time
and torch's deprecations of calls we make are ours to act on, not to hide.
"""

import os

import pytest

pytest.register_assert_rewrite("tests.helpers")  # its assertions explain themselves too

from tests.helpers import GOLDEN  # noqa: E402

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def pytest_addoption(parser):
    parser.addoption(
        "--regen-golden", action="store_true", help="rewrite the golden files from this run"
    )


@pytest.fixture
def golden(request):
    """golden(name, text): compare `text` with tests/golden/<series>/name, the installed
    megatron-core's series (or rewrite it)."""
    from metatrace.config import release

    series = release.series()

    def check(name: str, text: str):
        path = os.path.join(GOLDEN, series, name)
        if request.config.getoption("--regen-golden") or not os.path.exists(path):
            if not request.config.getoption("--regen-golden"):
                pytest.fail(f"golden file {path} is missing; run pytest --regen-golden")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            return
        with open(path) as f:
            expected = f.read()
        assert text == expected, f"output differs from {path} (pytest --regen-golden rewrites it)"

    return check
