"""training.moe_router_padding_for_quantization: the job key, the Megatron-LM flags that set it,
and what megatron-core 0.16.1 refuses with it (transformer_config.py:1613-1631). The traced
padding is in tests/tracing/test_moe_router_padding.py."""

import io

import pytest

from metatrace.config.megatron.args import job_dict_from_args, job_from_args, not_modelled
from metatrace.config.megatron.flags import FLAGS, NEEDS
from metatrace.config.megatron.script import split_args
from metatrace.errors import ConfigError
from tests.helpers import MOE, small_job, write_job

KEY = "training.moe_router_padding_for_quantization"

# A small MoE run in FP8 with the alltoall dispatcher, on 2 GPUs (ep 2).
MOE_ARGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --bf16 "
    "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 "
    "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --swiglu --disable-bias-linear "
    "--vocab-size 1000 "
    "--tokenizer-type NullTokenizer"
)


def fp8_moe(dispatcher="alltoall", precision="fp8", pad=True):
    return small_job(
        model=MOE,
        parallel={"ep": 2, "moe_token_dispatcher_type": dispatcher},
        training={
            "global_batch_size": 4,
            "precision": precision,
            **({} if not pad else {"moe_router_padding_for_quantization": True}),
        },
        cluster={"num_gpus": 2, "gpu": "h100"},
    )


def test_the_key_reaches_the_job():
    assert fp8_moe().training.moe_router_padding_for_quantization is True
    assert fp8_moe(pad=False).training.moe_router_padding_for_quantization is False


@pytest.mark.parametrize(
    "flag", ["--moe-router-padding-for-quantization", "--moe-router-padding-for-fp8"]
)
def test_both_flags_set_the_key_and_are_modelled(flag):
    spec = FLAGS[flag]
    assert (spec.cls, spec.key) == ("modelled", KEY)
    assert flag not in NEEDS  # NEEDS lists options that are not modelled
    args = split_args(f"{MOE_ARGS} --fp8-format hybrid --fp8-recipe tensorwise {flag}")
    assert not_modelled(args) == []
    job, _ = job_from_args(args, world_size=2, gpu="h100")
    assert job.training.moe_router_padding_for_quantization is True
    assert job.not_modelled == ()
    plain, _ = job_from_args(
        split_args(MOE_ARGS + " --fp8-format hybrid"), world_size=2, gpu="h100"
    )
    assert plain.training.moe_router_padding_for_quantization is False


def test_padding_for_fp4_is_kept_with_fp4():
    """FP4 is modelled: the padding aligns for its GEMMs (megatron-core's
    get_fp4_align_size, 128 rows) and nothing is left out."""
    args = split_args(f"{MOE_ARGS} --bf16 --fp4-format e2m1 --moe-router-padding-for-quantization")
    data, notes = job_dict_from_args(args, world_size=2, gpu="b200")
    assert data["training"]["moe_router_padding_for_quantization"] is True
    assert data["training"]["precision"] == "fp4"
    assert not_modelled(args) == []


@pytest.mark.parametrize(
    "job, message",
    [
        (
            lambda: fp8_moe(precision="bf16"),
            "training.moe_router_padding_for_quantization pads for FP8 or FP4 GEMMs and needs "
            "training.precision: fp8 or fp4 (megatron-core refuses it with bf16)",
        ),
        (
            lambda: fp8_moe(dispatcher="allgather"),
            "training.moe_router_padding_for_quantization needs "
            "parallel.moe_token_dispatcher_type alltoall or flex (megatron-core refuses it "
            "with the allgather dispatcher)",
        ),
    ],
)
def test_refusals(job, message):
    with pytest.raises(ConfigError) as info:
        job()
    assert [p for p in info.value.problems if "moe_router_padding" in p] == [message]


def test_refusal_exits_2_with_one_message(tmp_path, capsys):
    from rich.console import Console

    from metatrace.cli import main

    path = write_job(
        tmp_path,
        "model: {preset: debug, num_experts: 4, moe_router_topk: 2}\n"
        "parallel: {ep: 2, moe_token_dispatcher_type: allgather}\n"
        "training: {seq_length: 64, precision: fp8, moe_router_padding_for_quantization: true}\n"
        "cluster: {num_gpus: 2, gpu: h100}\n",
    )
    code = main(["run", "--config", path], Console(file=io.StringIO(), color_system=None))
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("moe_router_padding_for_quantization") == 1
    assert "allgather dispatcher" in err and "Traceback" not in err
