"""`metatrace plan`: bad input exits 2 before any candidate is built (the traced search is in
tests/tracing/test_plan.py)."""

import pytest

from metatrace.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "debug", "--num-gpus", "2"], "plan --model needs --seq, --global-batch"),
        (
            ["--model", "debug", "--num-gpus", "0", "--seq", "64", "--global-batch", "2"],
            "--num-gpus must be at least 1",
        ),
        (["--model", "nope", "--num-gpus", "2", "--seq", "64", "--global-batch", "2"], "nope"),
    ],
)
def test_plan_bad_input_exit_2(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err
