"""The world size of Megatron-LM arguments from a training script's launcher line (torchrun,
python -m torch.distributed.run, srun with #SBATCH, mpirun), for every command alike; what the
script leaves to the environment, and a --world-size that disagrees with it, exit 2 with one
message. Nothing here traces (`groups` answers without megatron-core)."""

import io
import os

import pytest
from rich.console import Console

from metatrace.cli import main
from metatrace.config.megatron.launch import read_launch, world_of
from metatrace.errors import ConfigError
from tests.helpers import EXAMPLES

ARGS = "pretrain_gpt.py --num-layers 2 --bf16"


@pytest.mark.parametrize(
    "script, world, per_node",
    [
        (f"torchrun --nproc_per_node 8 --nnodes 2 {ARGS}", 16, 8),
        (f"torchrun --nproc-per-node=4 --nnodes=3:3 {ARGS}", 12, 4),
        (f"torchrun {ARGS}", 1, 1),  # torchrun's defaults: one process on one node
        (f"CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --standalone --nproc_per_node 8 {ARGS}", 8, 8),
        (f"python -m torch.distributed.run --nproc_per_node=2 --nnodes 2 {ARGS}", 4, 2),
        (f"python3 -m torch.distributed.launch --nproc_per_node 4 {ARGS}", 4, 4),
        # Variables the script sets, one from another, exported or not.
        (
            f"GPUS=8\nexport NODES=4\nN=$NODES\ntorchrun --nproc_per_node $GPUS --nnodes ${{N}} {ARGS}",
            32,
            8,
        ),
        # Slurm: the directives size srun and the variables torchrun reads.
        (f"#SBATCH --nodes=4\n#SBATCH --ntasks-per-node=8\nsrun python {ARGS}", 32, 8),
        (f"#SBATCH -N 2\n#SBATCH --gpus-per-node=h100:8\nsrun python {ARGS}", 16, 8),
        (f"#SBATCH -N 2\nsrun -N3 --ntasks-per-node 4 python {ARGS}", 12, 4),
        (f"srun -N2 -n 16 python {ARGS}", 16, None),
        (
            f"#SBATCH --nodes 4\nsrun --ntasks-per-node=1 torchrun --nproc_per_node 8 "
            f"--nnodes $SLURM_NNODES {ARGS}",
            32,
            8,
        ),
        (f"mpirun -np 16 python {ARGS}", 16, None),
    ],
)
def test_the_launcher_line_gives_the_world_size(script, world, per_node):
    launch = read_launch(script)
    assert launch is not None and launch.problem is None, launch
    assert (launch.world_size, launch.per_node) == (world, per_node)
    assert world_of(launch, None, None, "x.sh") == (world, per_node)
    assert world_of(launch, world, per_node, "x.sh") == (world, per_node)  # agreeing flags


@pytest.mark.parametrize(
    "script, problem",
    [
        (f"torchrun --nproc_per_node 8 --nnodes $NNODES {ARGS}", "--nnodes is $NNODES, which"),
        (f"NNODES=${{NNODES:-2}}\ntorchrun --nnodes $NNODES {ARGS}", "--nnodes is $NNODES"),
        (f"torchrun --nproc_per_node $((4*2)) {ARGS}", "which the shell expands"),
        (f"torchrun --nproc_per_node gpu {ARGS}", "gpu is not a number of processes"),
        (f"torchrun --nproc_per_node 8 --nnodes 1:4 {ARGS}", "--nnodes 1:4 is elastic"),
        (f"#SBATCH -N 4\nsrun python {ARGS}", "srun without --ntasks-per-node"),
        (f"srun --ntasks-per-node 8 python {ARGS}", "srun without --nodes"),
        (f"mpirun python {ARGS}", "mpirun without -np"),
    ],
)
def test_what_the_environment_decides_is_named(script, problem):
    launch = read_launch(script)
    assert launch.world_size is None and problem in launch.problem
    with pytest.raises(ConfigError, match="give the world size with --world-size N"):
        world_of(launch, None, None, "x.sh")
    assert world_of(launch, 24, None, "x.sh") == (24, None)  # the flag says what it cannot


@pytest.mark.parametrize(
    "text", ["--num-layers 2 --bf16", f"python {ARGS}", "echo hi\n--num-layers 2"]
)
def test_no_launcher_no_world_size(text):
    assert read_launch(text) is None
    assert world_of(None, 8, None, "x") == (8, None)


def test_a_disagreeing_flag_is_refused():
    launch = read_launch(f"torchrun --nproc_per_node 8 --nnodes 2 {ARGS}")
    with pytest.raises(ConfigError) as e:
        world_of(launch, 8, None, "x.sh")
    assert e.value.problems == [
        "--world-size 8 disagrees with x.sh line 1: torchrun --nproc_per_node 8 --nnodes 2, "
        "which starts 16 processes: drop --world-size, or change the script"
    ]
    with pytest.raises(ConfigError, match="--gpus-per-node 4 disagrees with x.sh line 1"):
        world_of(launch, None, 4, "x.sh")


def _groups(argv, capsys) -> tuple[int, str, str]:
    out = io.StringIO()
    code = main(["groups", *argv], Console(file=out, width=100, color_system=None))
    return code, out.getvalue(), capsys.readouterr().err


SCRIPT = os.path.join(EXAMPLES, "pretrain_llama2_7b.sh")


@pytest.mark.parametrize(
    "argv",
    [
        [SCRIPT],
        ["--config", SCRIPT],
        ["--megatron-args-file", SCRIPT],
        [SCRIPT, "--world-size", "16"],
    ],
)
def test_every_form_reads_the_script_and_its_world(argv, capsys):
    code, out, err = _groups(argv, capsys)
    assert code == 0, err
    assert "16 GPUs, 8 per node (2 nodes)" in out


def test_the_command_line_refuses_a_world_the_script_does_not_start(capsys):
    code, out, err = _groups([SCRIPT, "--world-size", "8"], capsys)
    assert (code, out) == (2, "")
    assert (
        err.startswith("metatrace: error: --world-size 8 disagrees with ") and "16 processes" in err
    )
    assert len(err.splitlines()) == 1


def test_a_script_without_a_launcher_needs_the_world_size(tmp_path, capsys):
    script = tmp_path / "train.sh"
    script.write_text(
        "python pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --bf16 "
        "--tokenizer-type NullTokenizer --vocab-size 999\n"
    )
    code, _, err = _groups([str(script)], capsys)
    assert code == 2 and "need --world-size N" in err
    code, out, err = _groups([str(script), "--world-size", "4"], capsys)
    assert code == 0 and "4 GPUs" in out, err
    unset = tmp_path / "unset.sh"
    unset.write_text("torchrun --nnodes $NNODES " + script.read_text().removeprefix("python "))
    code, _, err = _groups([str(unset)], capsys)
    assert code == 2
    assert err == (
        f"metatrace: error: {unset} line 1: torchrun --nnodes $NNODES: torchrun --nnodes is "
        "$NNODES, which the script does not set to a plain value; give the world size with "
        "--world-size N\n"
    )


def test_job_files_and_configs_are_told_apart(tmp_path, capsys):
    from metatrace.config.source import file_kind

    yaml_args = tmp_path / "args.yaml"
    yaml_args.write_text("--num-layers: 2\n")
    hf = os.path.join(os.path.dirname(EXAMPLES), "tests", "data", "hf", "Qwen3-8B", "config.json")
    assert file_kind(os.path.join(EXAMPLES, "debug.yaml")) == "job"
    assert file_kind(SCRIPT) == "megatron" and file_kind(str(yaml_args)) == "megatron"
    assert file_kind(hf) == "hf_config"
    code, _, err = _groups([hf], capsys)
    assert code == 2 and "is a Hugging Face config.json" in err and "plan --model" in err
    code, _, err = _groups([os.path.join(EXAMPLES, "debug.yaml"), "--config", SCRIPT], capsys)
    assert code == 2 and "give the job once" in err
    code, _, err = _groups([os.path.join(EXAMPLES, "debug.yaml"), "--world-size", "4"], capsys)
    assert code == 2 and "--world-size applies to Megatron-LM arguments" in err


def test_the_script_exports_the_runs_environment():
    """`export NAME=value` before the arguments and assignments in front of the launcher are
    the run's environment (a later one wins); plain shell variables are not; an export from a
    shell variable is named."""
    from metatrace.config.megatron.script import environment

    text = (
        "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n"
        "GPUS=8\n"
        "export NCCL_BUFFSIZE=1048576 NCCL_NVLS_ENABLE=1\n"
        "export NCCL_NVLS_ENABLE=0\n"
        "export HOME_DIR=$HOME/x\n"
        f"CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc_per_node 8 {ARGS}\n"
    )
    env, unexpanded = environment(text)
    assert env == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "NCCL_BUFFSIZE": "1048576",
        "NCCL_NVLS_ENABLE": "0",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }
    assert unexpanded == ["HOME_DIR"]


def test_a_scripts_allocator_setting_reaches_the_verdict(tmp_path):
    """The CUDA-graph example exports PYTORCH_CUDA_ALLOC_CONF: the job's allocator is it,
    unless --env overrides it; an export from a shell variable exits 2 naming --env."""
    from metatrace.config.source import MegatronOptions, read_job

    script = os.path.join(EXAMPLES, "pretrain_llama3_8b_gb200_cuda_graphs.sh")
    job, _ = read_job(
        config=script, megatron_args=None, megatron_args_file=None, options=MegatronOptions()
    )
    assert job.cluster.allocator_conf.startswith("expandable_segments:True")
    options = MegatronOptions(env=("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False",))
    job, _ = read_job(config=script, megatron_args=None, megatron_args_file=None, options=options)
    assert job.cluster.allocator_conf == "expandable_segments:False"
    bad = tmp_path / "x.sh"
    bad.write_text(f"export NCCL_BUFFSIZE=$SIZE\ntorchrun --nproc_per_node 2 {ARGS}\n")
    with pytest.raises(ConfigError, match="exports NCCL_BUFFSIZE from shell variables"):
        read_job(
            config=str(bad), megatron_args=None, megatron_args_file=None, options=MegatronOptions()
        )
