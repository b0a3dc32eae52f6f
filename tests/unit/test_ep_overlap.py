"""overlap_moe_expert_parallel_comm / delay_wgrad_compute: the config checks that mirror
megatron-core 0.16.1's asserts (transformer_config.py:1852-1921) and the Megatron-LM flags."""

import pytest

from metatrace.errors import ConfigError
from tests.helpers import MOE, small_job

OVERLAP = {
    "ep": 2,
    "moe_token_dispatcher_type": "alltoall",
    "overlap_moe_expert_parallel_comm": True,
}


def job(parallel=None, **sections):
    return small_job(
        model={**MOE, **sections.pop("model", {})},
        parallel={**OVERLAP, **(parallel or {})},
        cluster={"num_gpus": 2 * (parallel or {}).get("pp", 1)},
        **sections,
    )


@pytest.mark.parametrize(
    "parallel, sections, message",
    [
        (
            {"overlap_moe_expert_parallel_comm": False, "delay_wgrad_compute": True},
            {},
            "delay_wgrad_compute needs parallel.overlap_moe_expert_parallel_comm",
        ),
        ({"pp": 2}, {"model": {"num_layers": 4}}, "needs virtual pipeline stages"),
        ({"moe_token_dispatcher_type": "allgather"}, {}, "alltoall"),
        (
            {},
            {
                "training": {
                    "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}
                }
            },
            "no full recompute",
        ),
        ({}, {"training": {"precision": "fp32"}}, "needs bf16 or fp16"),
        (
            {"moe_shared_expert_overlap": True},
            {"model": {"moe_shared_expert_intermediate_size": 64}},
            "exclude each other",
        ),
    ],
)
def test_ep_overlap_config_errors(parallel, sections, message):
    with pytest.raises(ConfigError, match=message):
        job(parallel, **sections)


def test_ep_overlap_needs_expert_parallelism():
    with pytest.raises(ConfigError, match="needs expert parallelism"):
        small_job(model=MOE, parallel={**OVERLAP, "ep": 1})


def test_ep_overlap_flags_map_to_the_parallel_keys():
    from metatrace.config.megatron.flags import FLAGS

    assert FLAGS["--overlap-moe-expert-parallel-comm"].key == (
        "parallel.overlap_moe_expert_parallel_comm"
    )
    assert FLAGS["--delay-wgrad-compute"].key == "parallel.delay_wgrad_compute"
