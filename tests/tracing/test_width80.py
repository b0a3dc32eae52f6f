"""Piped output is 80 columns wide and never wider, for the README's commands (a job file, an
interleaved layout, a Megatron-LM script, comm, diff, a small plan, groups, tree, presets);
the summary's stage table and the plan's table take one line a row."""

import re

import pytest
from rich.cells import cell_len

from metatrace.cli import main
from tests.helpers import EXAMPLES

SMALL = f"{EXAMPLES}/llama2-7b-tp2-pp2.yaml"
COMMANDS = {
    "run": ["run", SMALL],
    "interleaved": ["run", f"{EXAMPLES}/llama3-70b-gb200-nvfp4.yaml", "--summary"],
    "script": ["run", f"{EXAMPLES}/pretrain_llama2_7b.sh", "--summary"],
    "comm": ["comm", SMALL, "--dim", "pp"],
    "diff": ["diff", f"{EXAMPLES}/debug.yaml", f"{EXAMPLES}/debug-local.yaml"],
    "plan": ["plan", "--model", "debug", "--num-gpus", "2", "--seq", "128", "--global-batch", "4"],
    "groups": ["groups", f"{EXAMPLES}/llama2-70b-64gpu.yaml", "--rank", "9"],
    "tree": ["tree", SMALL, "--rank", "5", "--depth", "4"],
    "presets": ["presets"],
}


def _rows(lines: list[str], header: str) -> list[str]:
    """The lines of the table whose header starts with `header`, from its rule to the first
    line that is not a row of it (its legend)."""
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rule = next(i for i in range(start, len(lines)) if lines[i].startswith("───"))
    rows = []
    for line in lines[rule + 1 :]:
        if not line.strip() or not re.match(r"^\s*\d+\s", line):
            break
        rows.append(line)
    return rows, lines[rule + 1 + len(rows)]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_piped_output_fits_80_columns(name, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    argv = COMMANDS[name] + (["--max-traces", "2", "--quiet"] if name == "plan" else [])
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    wide = [line for line in lines if cell_len(line) > 80]
    assert wide == [], name
    assert not any(re.search(r"\d…|…\d", line) for line in lines)  # no number cut
    if name in ("run", "interleaved", "script"):
        rows, after = _rows(lines, "Stage ")
        stages = {"run": 2, "interleaved": 4, "script": 2}[name]
        assert len(rows) == stages, rows  # one line a stage: nothing wrapped onto another
        assert after.startswith(("µb:", "Modules at the peaks:"))
        assert all(re.search(r"GiB\s+\d+\s+(fwd|bwd|optimizer)", row) for row in rows)
    if name == "interleaved":
        assert "Modules at the peaks:" in " ".join(lines)  # moved below the table at 80
        text = "\n".join(lines)
        assert " 1-4 … 65-68 " in text and " 13-16 … 77-80 " in text  # first and last runs
    if name == "run":
        schedule = [line.strip() for line in lines if re.match(r"^\s+F", line)]
        assert schedule and all(
            re.fullmatch(r"F[─]*1F1B─*(B|bwd)?─*(GO|G─*O─*)?", s) for s in schedule
        ), schedule
    if name == "plan":
        rows, after = _rows(lines, "#")
        assert len(rows) >= 1 and after.startswith("Layout:")
        command = lines[lines.index(next(line for line in lines if line.startswith("torchrun"))) :]
        assert all(line.endswith("\\") for line in command[:-1])  # folded, still one command


def test_columns_and_width_widen_it(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    assert main(["groups", f"{EXAMPLES}/llama2-70b-64gpu.yaml"]) == 0
    assert max(cell_len(line) for line in capsys.readouterr().out.splitlines()) > 80
    monkeypatch.delenv("COLUMNS")
    assert main(["groups", f"{EXAMPLES}/llama2-70b-64gpu.yaml", "--width", "60"]) == 0
    assert max(cell_len(line) for line in capsys.readouterr().out.splitlines()) <= 60
