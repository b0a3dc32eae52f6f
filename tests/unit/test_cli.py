"""The command line as a user runs it: exit codes and one-line errors for what is refused
before any model is built (the commands that trace are in tests/tracing/test_cli.py)."""

import pytest

from tests.helpers import DEBUG, GPT_ARGS, metatrace, write_job

BAD = [
    (
        "model: {preset: debug, hiden_size: 8}\ntraining: {seq_length: 64}",
        "unknown key 'model.hiden_size'; did you mean 'model.hidden_size'?",
    ),
    (
        "model: {preset: debug}\nparallel: {tp: 2, pp: 2, dp: 3}\ntraining: {seq_length: 64}\ncluster: {num_gpus: 16}",
        "tp x pp x cp x dp = 2 x 2 x 1 x 3 = 12, but cluster.num_gpus = 16",
    ),
    (
        "model: {preset: debug}\nparallel: {tp: 8}\ntraining: {seq_length: 64}",
        "model.num_attention_heads = 4 is not divisible by parallel.tp = 8",
    ),
    (
        "model: {preset: debug}\nparallel: {tp: 4}\ntraining: {seq_length: 64}",
        "model.num_query_groups = 2 is not divisible by parallel.tp = 4",
    ),
    (
        "model: {preset: debug, num_layers: 3}\nparallel: {pp: 2}\ntraining: {seq_length: 64}",
        "model.num_layers = 3 is not divisible by parallel.pp = 2",
    ),
    (
        "model: {preset: debug, num_layers: 4}\nparallel: {pp: 2, vpp: 4}\ntraining: {seq_length: 64, global_batch_size: 2}",
        "layers per pipeline rank are not divisible by parallel.vpp = 4",
    ),
    (
        "model: {preset: debug}\nparallel: {cp: 2}\ntraining: {seq_length: 66}",
        "training.seq_length = 66 is not divisible by 2 x parallel.cp = 4",
    ),
    (
        "model: {preset: debug}\nparallel: {dp: 4}\ntraining: {seq_length: 64, micro_batch_size: 2, global_batch_size: 12}",
        "global_batch_size = 12 is not a multiple of micro_batch_size x dp = 2 x 4 = 8",
    ),
    (
        "model: {preset: debug}\ntraining: {seq_length: 64, precision: int8}",
        "'training.precision' must be one of",
    ),
    (
        "model: {preset: debug}\ntraining: {seq_length: 64, precision: fp4}",
        "training.precision fp4 (NVFP4) needs a Blackwell GPU (compute capability 10.0: b200, "
        "gb200, b300, gb300), not h100",
    ),
    (
        "model: {preset: debug}\ncluster: {num_gpus: 4}\ntraining: {seq_length: 64, megatron_fsdp: "
        "true, num_distributed_optimizer_instances: 2, fsdp_sharding_strategy: optim, "
        "fsdp_outer_sharding_strategy: optim}",
        "training.fsdp_outer_sharding_strategy optim needs training.fsdp_sharding_strategy "
        "optim_grads_params",
    ),
    ("model: [oops", "not valid YAML"),
]


@pytest.mark.parametrize("text, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_config_is_one_message_and_exit_code_2(tmp_path, text, message):
    result = metatrace("run", "--config", write_job(tmp_path, text))
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_contradictory_pipeline_options_exit_2(tmp_path):
    text = (
        "model: {preset: debug, num_layers: 4}\nparallel: {pp: 2, account_for_embedding: true,"
        " first_stage_layers: 1}\ntraining: {seq_length: 64}"
    )
    result = metatrace("run", "--config", write_job(tmp_path, text))
    assert result.returncode == 2 and "cannot be combined" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["run"], "give the job as one of FILE (a job file or a training script), --config"),
        (["run", "--config", "does-not-exist.yaml"], "cannot read config file"),
        (["run", "--config", DEBUG, "--depth", "-1"], "--depth must be 0 or more"),
        (["run", "--config", DEBUG, "--json", "/nonexistent/dir/out.json"], "does not exist"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_flags_exit_2(args, message):
    result = metatrace(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_version_and_module_entry_point():
    result = metatrace("--version")
    assert result.returncode == 0 and result.stdout.startswith("metatrace ")


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--megatron-args", "--num-layers 2"], "need --world-size"),
        (["run", "--config", DEBUG, "--world-size", "8"], "--world-size applies to Megatron-LM"),
        (
            ["run", "--megatron-args", GPT_ARGS + " --num-layer 4", "--world-size", "8"],
            "--num-layer (did you mean --num-layers?)",
        ),
        (
            ["run", "--megatron-args", GPT_ARGS, "--world-size", "8", "--env", "FOO"],
            "--env 'FOO' must be NAME=VALUE",
        ),
    ],
)
def test_megatron_args_errors(args, message):
    result = metatrace(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def in_process(*argv):
    """main() in this process: (exit code, what it printed)."""
    import io

    from rich.console import Console

    from metatrace.cli import main

    out = io.StringIO()
    return main(list(argv), Console(file=out, width=120, color_system=None)), out.getvalue()


@pytest.fixture
def no_megatron_checks(monkeypatch):
    """megatron-core's checks (seconds: they import it) must not run before the command line
    is checked; they fail the test if they do."""
    import metatrace.cli

    def checked(job):
        raise AssertionError("megatron-core's checks ran before the command line was checked")

    monkeypatch.setattr(metatrace.cli, "_check_with_megatron", checked)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["tree", "--config", DEBUG, "--rank", "4"], "--rank 4 is not a rank of this job (0 to 3)"),
        (
            ["groups", "--config", DEBUG, "--rank", "9"],
            "--rank 9 is not a rank of this job (0 to 3)",
        ),
        (["diff", DEBUG, "{tmp}/missing.yaml"], "no such file"),
        (["diff", DEBUG, "{tmp}/not_report.json"], "is not a JSON report"),
        (
            ["run", "--config", DEBUG, "--memory-snapshot", "{tmp}/missing/snap.pickle"],
            "--memory-snapshot {tmp}/missing/snap.pickle: directory",
        ),
        (
            ["run", "--config", DEBUG, "--memory-snapshot", "{tmp}"],
            "--memory-snapshot {tmp} is a directory",
        ),
        (
            ["run", "--config", DEBUG, "--memory-snapshot", "{tmp}/stage{{stage}}/snap.pickle"],
            "--memory-snapshot {tmp}/stage0/snap.pickle: directory",
        ),
    ],
)
def test_bad_command_lines_exit_2_before_megatron_core(
    tmp_path, capsys, no_megatron_checks, argv, message
):
    (tmp_path / "not_report.json").write_text('{"a": 1}')
    code, _ = in_process(*(a.format(tmp=tmp_path) for a in argv))
    assert code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_groups_does_not_import_megatron_core():
    """`groups` traces nothing: it answers without megatron-core's import (seconds)."""
    import subprocess
    import sys

    code = (
        "import sys; from metatrace.cli import main; "
        f"rc = main(['groups', '--config', {DEBUG!r}]); "
        "print(rc, 'megatron.core' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == "0 False"
