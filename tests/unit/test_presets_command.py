"""`metatrace presets`: every preset with its size (no tracing), one preset's every dimension."""

import io

import pytest
from rich.cells import cell_len
from rich.console import Console

from metatrace.cli import main
from metatrace.config.presets import PRESETS


def _run(*argv, width: int = 80) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["presets", *argv], Console(file=out, width=width, color_system=None))
    return code, out.getvalue()


def test_every_preset_on_one_line_with_its_sizes():
    # 100 columns: the hybrid presets' names (nemotron-3-super-120b-a12b) fold at 80
    code, text = _run(width=100)
    assert code == 0
    lines = text.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.split()[0] in PRESETS}
    assert list(rows) == list(PRESETS)
    assert max(cell_len(line) for line in _run()[1].splitlines()) <= 80
    # Parameters as `metatrace run` counts them for the examples (its summary's first line):
    # the closed form leaves out norms and biases only.
    for name, traced in (
        ("llama2-7b", 6.74e9),
        ("llama2-70b", 68.99e9),
        ("llama3.1-405b", 405.88e9),
        ("qwen3-235b-a22b", 235.09e9),
        ("gpt-oss-120b", 116.83e9),
        ("deepseek-v3", 682.64e9),
        # tests/unit/test_hybrid_presets.py's closed forms (norms and the small Mamba-2 and
        # Gated DeltaNet vectors in): 8,100,852,736 and 79,674,292,992
        ("nemotron-h-8b", 8.1009e9),
        ("qwen3-next-80b-a3b", 79.674e9),
    ):
        assert float(rows[name][1]) * 1e9 == pytest.approx(traced, rel=1e-3), name
    assert rows["mixtral-8x7b"][1:4] == ["46.70", "B", "12.88"]  # total and active
    assert rows["llama3-70b"][3:] == ["80", "8192", "28672", "64", "8"]
    assert rows["deepseek-v3"][-3:] == ["MLA", "256", "top-8"]


def test_one_preset_and_an_unknown_name():
    code, text = _run("llama3-8b")
    assert code == 0
    assert text.startswith("llama3-8b: meta-llama/Meta-Llama-3-8B config.json\nmodel:\n")
    assert "  preset: llama3-8b\n" in text and "  # num_query_groups: 8\n" in text
    assert "  # add_bias_linear: false\n" in text  # as YAML writes it
    assert _run("llama9")[0] == 2
