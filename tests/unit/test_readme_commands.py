"""The README's commands stay runnable as written: every `metatrace ...` line of its code blocks
parses with the command line's own parser, and every file it reads exists (the files it writes,
and out.json / best.yaml that an earlier line writes, excepted). Tracing them all would take
minutes; tests/tracing traces the examples."""

import os
import re
import shlex

import pytest

from tests.helpers import ROOT

WRITTEN = {"out.json", "best.yaml"}  # made by an earlier README command


def _commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = re.findall(r"```\n(.*?)```", text, flags=re.S)
    lines = [line for block in blocks for line in block.splitlines()]
    return [line.split("   #", 1)[0].strip() for line in lines if line.startswith("metatrace ")]


def test_the_readme_has_commands():
    assert len(_commands()) >= 20


@pytest.mark.parametrize("line", _commands())
def test_readme_command_parses_and_its_inputs_exist(line, monkeypatch):
    from metatrace.cli import _parser

    monkeypatch.chdir(ROOT)
    argv = shlex.split(line)[1:]
    args = _parser().parse_args(argv)
    inputs = [getattr(args, name, None) for name in ("job", "config", "megatron_args_file")]
    inputs += [p for p in (getattr(args, "a", None), getattr(args, "b", None)) if p]
    for path in inputs:
        if path and path not in WRITTEN:
            assert os.path.isfile(path), f"{line}: {path} does not exist"
