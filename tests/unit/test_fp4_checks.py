"""training.precision fp4 (NVFP4): what the checks refuse before any model is built, each with
one message (the traced NVFP4 layers are in tests/tracing/test_nvfp4.py)."""

import pytest

from metatrace.errors import ConfigError
from tests.helpers import metatrace, small_job

B200 = {"cluster": {"gpu": "b200"}}


def fp4(training=None, **sections):
    return small_job(training={"precision": "fp4", **(training or {})}, **{**B200, **sections})


def test_fp4_job_resolves_to_nvfp4():
    tr = fp4().training
    assert (tr.precision, tr.fp4_recipe, tr.grad_reduce_in_fp32) == ("fp4", "nvfp4", True)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: small_job(training={"precision": "fp4"}, cluster={"gpu": "h200"}),
            "training.precision fp4 (NVFP4) needs a Blackwell GPU (compute capability 10.0: "
            "b200, gb200, b300, gb300), not h200",
        ),
        (
            lambda: fp4({"seq_length": 72, "micro_batch_size": 1}),
            "training.precision fp4: seq_length / cp x micro_batch_size = 72 tokens per rank; "
            "Transformer Engine quantizes to NVFP4 only row counts that are multiples of 16",
        ),
        (
            lambda: fp4(
                {"seq_length": 96, "micro_batch_size": 1},
                parallel={"tp": 4, "sequence_parallel": True},
                model={"num_query_groups": 4},
            ),
            "seq_length / cp x micro_batch_size / tp = 24 tokens per rank",
        ),
        (
            lambda: fp4(model={"ffn_hidden_size": 200}),
            "training.precision fp4: model.ffn_hidden_size / tp = 200; Transformer Engine "
            "quantizes to NVFP4 only widths that are multiples of 16",
        ),
        (
            lambda: fp4(
                parallel={"tp": 2, "sequence_parallel": True, "tp_comm_overlap": True},
            ),
            "parallel.tp_comm_overlap with training.precision fp4 is not modelled yet",
        ),
        (
            lambda: fp4(implementation={"te_op_fuser": True}),
            "implementation.te_op_fuser with training.precision fp4 is not modelled yet",
        ),
        (
            lambda: fp4(cluster={"gpu": "b200", "compute_efficiency": 0.5}),
            "cluster.compute_efficiency with training.precision fp4 is not modelled yet",
        ),
        (
            lambda: fp4({"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 3}),
            "training.num_layers_at_start_in_bf16 = 3 must be between 0 and the layers per "
            "pipeline stage (model.num_layers // parallel.pp = 2",
        ),
        (
            lambda: small_job(
                training={
                    "precision": "fp8",
                    "fp8_recipe": "tensorwise",
                    "fp8_param_gather": True,
                    "distributed_optimizer": True,
                    "first_last_layers_bf16": True,
                },
                cluster={"gpu": "h100"},
            ),
            "training.first_last_layers_bf16 with training.fp8_param_gather is not modelled yet",
        ),
    ],
)
def test_checks_refuse_what_nvfp4_cannot_run(make, message):
    with pytest.raises(ConfigError) as info:
        make()
    assert message in str(info.value)
    assert len(info.value.problems) == 1


def test_fp8_and_fp4_at_once_is_exit_code_2():
    """The Megatron-LM flags of both (megatron-core refuses fp8 and fp4 together): one message,
    exit code 2 (a job file's fp4 on an h100 is tests/unit/test_cli.py's case)."""
    flags = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 1 --bf16 --vocab-size 1000 "
        "--fp8-format hybrid --fp4-format e2m1"
    )
    result = metatrace("run", "--megatron-args", flags, "--world-size", "1", "--gpu", "b200")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "metatrace: error: --fp8-format and --fp4-format exclude each other (megatron-core "
        "refuses fp8 and fp4 at once)"
    )
