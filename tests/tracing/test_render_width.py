"""The report at 80 and 200 columns and piped: no number, shape or module name cut with "…",
no trailing blanks, the module tree's figures kept, the memory picture from 0."""

import io
import re

import pytest
from rich.console import Console

from metatrace.cli import main
from tests.helpers import DEBUG

# A "…" glued to what precedes it cut that cell; allowed: a shortened class name (Type column).
_CUT = re.compile(r"(\S+)…")


def _cuts(text: str) -> list[str]:
    return [m.group(0) for m in _CUT.finditer(text) if not m.group(1)[0].isupper()]


def _render(argv, width) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False)
    assert main(argv, console=console) == 0
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 200])
def test_run_report_cuts_nothing(width):
    text = _render(["run", "--detail", "--config", DEBUG], width)
    assert _cuts(text) == []
    assert "Param" in text and "Act MiB" in text
    assert "Boundary" in text  # the pipeline table keeps its boundary tensor column


def test_piped_report_takes_the_content_width(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["run", "--detail", "--config", DEBUG]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert _cuts(text) == []
    assert all(line == line.rstrip() for line in lines)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["tree", "--config", DEBUG, "--rank", "3"]) == 0
    tree = capsys.readouterr().out
    assert max(len(line) for line in tree.splitlines()) <= 80
    assert re.search(r"\d+\.\d+\s+\d+\.\d+", tree)  # Param and Act MiB side by side
    assert all(line == line.rstrip() for line in tree.splitlines())


def test_memory_picture_starts_at_zero_and_uses_the_width():
    narrow = _render(["run", "--config", DEBUG], 80)
    wide = _render(["run", "--config", DEBUG], 200)
    assert "Scale 0 to" in narrow and "shared by all stages" in narrow

    def bars(text):
        return [
            line
            for line in text.splitlines()
            if line.startswith("stage ") and ("█" in line or "▇" in line)
        ]

    assert max(len(b) for b in bars(wide)) > max(len(b) for b in bars(narrow)) > 40
