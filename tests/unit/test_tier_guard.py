"""tests/unit/conftest.py's promise can fail: run in a scratch session, it names the test that
imported (a stand-in) megatron-core, and stays quiet when the session also runs tracing tests."""

import os
import shutil
import subprocess
import sys

CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")
PURE = "def test_pure():\n    assert True\n"
IMPORTS = "def test_imports_it():\n    import megatron  # noqa: F401\n"
IMPORTS_AT_COLLECTION = "import megatron  # noqa: F401\n\n\n" + PURE


def session(tmp_path, *paths, b=IMPORTS):
    """A scratch layout: unit/ with the tier's conftest, a pure test, test_b.py (`b`, importing
    a fake `megatron` package), another pure test; tracing/ with one test. Runs pytest on
    `paths`."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("")
    unit = tmp_path / "unit"
    unit.mkdir()
    shutil.copy(CONFTEST, unit / "conftest.py")
    (unit / "test_a.py").write_text(PURE)
    (unit / "test_b.py").write_text(b)
    (unit / "test_c.py").write_text(PURE)
    (tmp_path / "tracing").mkdir()
    (tmp_path / "tracing" / "test_t.py").write_text(PURE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            *paths,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )


def test_the_unit_tier_alone_names_the_test_that_imported_megatron_core(tmp_path):
    result = session(tmp_path, "unit")
    assert result.returncode == 1, result.stdout
    assert "unit/test_b.py::test_imports_it imported megatron-core" in result.stdout
    assert "3 passed, 1 error" in result.stdout  # the later test_c is not blamed


def test_with_the_tracing_tier_nothing_is_checked(tmp_path):
    result = session(tmp_path, "unit", "tracing")
    assert result.returncode == 0, result.stdout
    assert "4 passed" in result.stdout


def test_an_import_while_collecting_names_the_module(tmp_path):
    result = session(tmp_path, "unit", b=IMPORTS_AT_COLLECTION)
    assert result.returncode == 1, result.stdout
    assert "collecting unit/test_b.py imported megatron-core" in result.stdout
    assert "2 passed, 1 error" in result.stdout
