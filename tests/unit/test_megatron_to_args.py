"""A job -> Megatron-LM arguments -> the same model and layout (metatrace.config.megatron.to_args),
and a job -> its YAML job file -> the same job (metatrace.planning.job_file)."""

import dataclasses
import os

import pytest
import yaml

from metatrace.config import job_from_dict, load_job
from metatrace.config.megatron.args import job_from_args, split_args
from metatrace.config.megatron.to_args import (
    LAYOUT_FIELDS,
    command_lines,
    launcher,
    layout_args,
    megatron_command,
)
from metatrace.planning.job_file import _differences, job_file_data
from tests.helpers import EXAMPLES

# A small dense GPT's model flags (no layout, batch or precision flags).
MODEL = (
    "--num-layers 12 --hidden-size 512 --num-attention-heads 8 --max-position-embeddings 4096 "
    "--vocab-file vocab.json --merge-file merges.txt"
)
MOE = (
    " --num-experts 8 --moe-ffn-hidden-size 256 --moe-router-topk 2 --swiglu --disable-bias-linear"
)


@pytest.mark.parametrize(
    "layout, world, model",
    [
        (
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
            "--num-virtual-stages-per-pipeline-rank 3 --seq-length 1024 --micro-batch-size 2 "
            "--global-batch-size 32 --bf16 --recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 1 --use-distributed-optimizer --overlap-grad-reduce "
            "--overlap-param-gather",
            8,
            MODEL,
        ),
        (
            "--context-parallel-size 2 --seq-length 2048 --micro-batch-size 1 --global-batch-size 8 "
            "--fp16 --recompute-activations --use-tp-pp-dp-mapping",
            4,
            MODEL,
        ),
        (
            "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4 "
            "--expert-tensor-parallel-size 1 --seq-length 512 --micro-batch-size 1 "
            "--global-batch-size 16 --bf16 --fp8-format e4m3 --fp8-recipe tensorwise "
            "--use-distributed-optimizer --num-distributed-optimizer-instances 2",
            8,
            MODEL + MOE,
        ),
        ("--seq-length 256 --micro-batch-size 4 --global-batch-size 8", 2, MODEL),
    ],
)
def test_layout_args_parse_back_to_the_same_layout(layout, world, model):
    job, _ = job_from_args(split_args(model + " " + layout), world_size=world)
    args = layout_args(job)
    back, _ = job_from_args(split_args(model) + args, world_size=world)
    for section, name in LAYOUT_FIELDS:
        want, got = getattr(getattr(job, section), name), getattr(getattr(back, section), name)
        assert got == want, f"{section}.{name}: {args}"
    # Flags only for what is set: no expert flags without experts, no optimizer flags without it.
    assert ("--expert-model-parallel-size" in args) == (job.parallel.ep > 1)
    assert ("--overlap-grad-reduce" in args) == job.training.overlap_grad_reduce


# A dense Llama, GQA Llama-3s (FP8, FSDP with offloading, CUDA graphs, NVFP4), MoEs (Mixtral, Qwen3),
# DeepSeek-V3 (MLA, MTP, a pipeline layout), GPT-OSS (YaRN, sinks, windows), a Hugging Face
# config, the local spec; and what each has that no flag gives.
EVERY_FLAG = {
    "llama2-7b-tp2-pp2.yaml": [],
    "llama3-8b-h100-fp8.yaml": [],
    "llama3-70b-gb200-fsdp-offload-fp8.yaml": [],
    "llama3-8b-gb200-cuda-graphs.yaml": [],
    "llama3-70b-gb200-nvfp4.yaml": [],
    "mixtral-8x7b-64gpu.yaml": [],
    "qwen3-235b-a22b-h100-fp8.yaml": [],
    "deepseek-v3-h100-fp8.yaml": [],
    # The forward path turns RoPE fusion off for yarn; the job resolves it on.
    "gpt-oss-120b-64gpu.yaml": ["implementation.rope_fusion"],
    "llama3-70b-h100-tp-overlap.yaml": ["parallel.tp_comm_overlap_cfg"],
    "qwen3-8b-hf.yaml": [],
    "debug-local.yaml": [],
}


@pytest.mark.parametrize("name", list(EVERY_FLAG))
def test_megatron_args_parse_back_to_the_same_model_and_layout(name):
    job = load_job(os.path.join(EXAMPLES, name))
    command = megatron_command(job)
    # The printed text, as a shell reads it (quotes, continuations, comment lines).
    text = "\n".join(command_lines(command))
    back, _ = job_from_args(
        split_args(text),
        world_size=job.cluster.num_gpus,
        gpu=job.cluster.gpu,
        gpus_per_node=job.cluster.gpus_per_node,
        env=command.env,
    )
    assert back.model == dataclasses.replace(job.model, preset=None, hf_config=None)
    assert back.padded_vocab_size == job.padded_vocab_size
    for section, name_ in LAYOUT_FIELDS:
        want, got = getattr(getattr(job, section), name_), getattr(getattr(back, section), name_)
        assert got == want, f"{section}.{name_}"
    # Every other setting of the run comes back too, or is named in a comment line.
    differ = [
        f"{section}.{f.name}"
        for section in ("parallel", "training", "implementation")
        for f in dataclasses.fields(getattr(job, section))
        if getattr(getattr(back, section), f.name) != getattr(getattr(job, section), f.name)
        and f.name != "moe_hottest_expert_load"  # metatrace's assumption, not a setting
    ]
    assert differ == EVERY_FLAG[name]
    assert [n.split(" ")[0] for n in command.no_flag] == differ
    assert ("# no Megatron-LM flag gives: " in text) == bool(differ)
    assert not back.not_modelled
    # One subject a line: the model's flags are not on the layout's line.
    lines = text.splitlines()
    model_line = next(line for line in lines if "--num-layers" in line)
    assert "--hidden-size" in model_line and "--tensor-model-parallel-size" not in model_line


def test_a_setting_without_a_flag_is_named():
    job = job_from_dict(
        {
            "model": {"preset": "debug", "activation": "geglu"},
            "training": {"seq_length": 64, "global_batch_size": 8},
            "cluster": {"num_gpus": 2},
        }
    )
    command = megatron_command(job)
    assert command.no_flag == ["model.activation = geglu"]
    assert "# no Megatron-LM flag gives: model.activation = geglu" in command_lines(command)


@pytest.mark.parametrize(
    "parallel, gpu, training, env",
    [
        ({"tp": 2}, "h100", {}, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
        ({"cp": 2}, "a100", {}, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
        ({"tp": 1}, "h100", {}, {}),
        ({"tp": 2}, "gb200", {}, {}),  # Megatron-LM asserts it only before Blackwell
        ({"tp": 2}, "h100", {"megatron_fsdp": True}, {}),  # Megatron FSDP refuses 1
    ],
)
def test_environment_megatron_lm_asserts(parallel, gpu, training, env):
    job = job_from_dict(
        {
            "model": {"preset": "debug"},
            "parallel": parallel,
            "training": {"seq_length": 64, "global_batch_size": 8, **training},
            "cluster": {"num_gpus": 2, "gpu": gpu},
        }
    )
    assert megatron_command(job).env == env


def test_null_tokenizer_gives_the_vocabulary_back():
    """core_v0.16.1's NullTokenizer has --vocab-size + 1 tokens: V - 1 is written."""
    job = load_job(os.path.join(EXAMPLES, "llama2-7b-tp2-pp2.yaml"))
    args = megatron_command(job).args
    i = args.index("--vocab-size")
    assert args[i - 2 : i + 2] == ["--tokenizer-type", "NullTokenizer", "--vocab-size", "31999"]


def test_launcher_fills_nodes():
    job, _ = job_from_args(
        split_args(MODEL + " --seq-length 64 --micro-batch-size 1"), world_size=16
    )
    assert launcher(job) == [
        "torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "pretrain_gpt.py",
    ]


@pytest.mark.parametrize(
    "name",
    [
        "llama2-7b-tp2-pp2.yaml",
        "deepseek-v3-h100-fp8.yaml",
        "llama3-70b-gb200-fsdp-offload-fp8.yaml",
        "qwen3-8b-hf.yaml",
    ],
)
def test_job_file_resolves_to_the_same_job(tmp_path, name):
    path = os.path.join(EXAMPLES, name)
    job = load_job(path)
    data = job_file_data(job, base_dir=EXAMPLES, out_dir=str(tmp_path))
    out = tmp_path / "job.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    assert _differences(load_job(out), job) == []
    # Only keys a user sets: the model by its preset or config.json, no derived sizes.
    assert set(data["model"]) <= {"preset", "hf_config"}
    assert "dp" not in data["parallel"] and "padded_vocab_size" not in data["model"]


def test_job_file_of_an_example_is_the_example():
    path = os.path.join(EXAMPLES, "llama2-7b-tp2-pp2.yaml")
    with open(path) as f:
        written = yaml.safe_load(f)
    assert job_file_data(load_job(path), base_dir=EXAMPLES) == written


def test_job_file_keeps_explicit_model_keys():
    job = job_from_dict(
        {
            "model": {"preset": "debug", "num_layers": 4},
            "training": {"seq_length": 64, "global_batch_size": 8},
            "cluster": {"num_gpus": 2},
        }
    )
    data = job_file_data(job)
    assert data["model"] == {"preset": "debug", "num_layers": 4}
    assert data["cluster"]["num_gpus"] == 2 and data["parallel"]["tp"] == 1
