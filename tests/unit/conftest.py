"""The fast tier's promise, checked: none of its tests imports megatron-core, directly or through
metatrace.tracing, .models or .hooks.

When a session runs this tier alone, the first test after which `megatron` is in sys.modules
fails at teardown, named (or, if a test module imported it while being collected, the first
test fails naming that module). When the session also runs tests/tracing, those import
megatron-core legitimately and nothing is checked. Subprocesses (the command line run by
`tests.helpers.metatrace`) are not watched.
"""

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
# unit_only: the session collected this tier alone; collected_by: the first collector after
# which megatron-core was imported ("" once reported).
_STATE = {"unit_only": False, "collected_by": None}


def _megatron_loaded() -> bool:
    return "megatron" in sys.modules


def pytest_collectreport(report):
    if _STATE["collected_by"] is None and _megatron_loaded():
        _STATE["collected_by"] = report.nodeid


def pytest_collection_modifyitems(config, items):
    _STATE["unit_only"] = all(str(item.path).startswith(_HERE + os.sep) for item in items)


@pytest.fixture(autouse=True)
def _no_megatron_core(request):
    state = _STATE
    before = _megatron_loaded()
    if state["unit_only"] and before and state["collected_by"]:
        culprit, state["collected_by"] = state["collected_by"], ""
        pytest.fail(
            f"collecting {culprit} imported megatron-core: the fast tier must not "
            "(move the import into a tracing test, tests/tracing)",
            pytrace=False,
        )
    yield
    if state["unit_only"] and not before and _megatron_loaded():
        pytest.fail(
            f"{request.node.nodeid} imported megatron-core: move it to tests/tracing "
            "(the fast tier must not import it)",
            pytrace=False,
        )
