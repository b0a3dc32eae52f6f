"""Rendered output at 80 columns (what piped output gets by default) and no colour, against
golden files."""

import io

from rich.console import Console

from metatrace.cli import main
from tests.helpers import DEBUG


def render(argv, width=80) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False)
    assert main(argv, console=console) == 0
    return out.getvalue()


def test_run_output(golden):
    golden("run_debug.txt", render(["run", "--config", DEBUG, "--detail"]))  # everything


def test_groups_tables(golden):
    text = render(["groups", "--config", DEBUG])
    golden("groups_debug.txt", text)
    assert "[0,2] [n0_g0 n1_g0]" in text  # pp group: across the two 2-GPU nodes
    mine = render(["groups", "--config", DEBUG, "--rank", "3"])
    assert "[1,3] [n0_g1 n1_g1]" in mine and "[0,2]" not in mine


def test_comm_of_one_dimension():
    text = render(["comm", "--config", DEBUG, "--dim", "pp"], width=150)
    assert "Communication per iteration" in text and "Pipeline parallel (pp 2)" in text
    assert "Tensor parallel" not in text and "[64,2,64] bf16 16.0 KiB" in text


def test_tree_of_one_rank_to_a_depth(golden):
    text = render(["tree", "--config", DEBUG, "--rank", "3", "--depth", "3"])
    golden("tree_debug_rank3_depth3.txt", text)
    assert "traced rank 3" in text and "linear_qkv" not in text  # depth 3 stops at the layer


def test_expand_shows_every_layer_and_placeholder():
    folded = render(["tree", "--config", DEBUG, "--rank", "0"], width=150)
    expanded = render(["tree", "--config", DEBUG, "--rank", "0", "--expand"], width=150)
    assert "IdentityOp" not in folded and "IdentityOp" in expanded
