"""The flex token dispatcher (DeepEP / HybridEP): the per-rank deduplication against an
enumeration of every routing choice, megatron-core's and DeepEP's refusals, the flags (the
traced dispatcher is in tests/tracing/test_moe_flex.py)."""

import itertools
from fractions import Fraction

import pytest

from metatrace.config.megatron.args import job_dict_from_args, split_args
from metatrace.errors import ConfigError
from metatrace.models.deepep import rank_hit_probability
from tests.helpers import GPT_ARGS, MOE, small_job


def _enumerated(experts, topk, ep, groups=None, group_topk=None) -> Fraction:
    """Share of the equally likely choices (group_topk groups, then topk experts among theirs)
    that include one of EP rank 0's experts."""
    local = experts // ep
    per_group = experts // groups if groups else experts
    group_sets = itertools.combinations(range(groups or 1), group_topk or 1)
    hits = total = 0
    for chosen in group_sets:
        pool = [e for g in chosen for e in range(g * per_group, (g + 1) * per_group)]
        for picked in itertools.combinations(pool, topk):
            total += 1
            hits += any(e < local for e in picked)
    return Fraction(hits, total)


@pytest.mark.parametrize(
    "experts, topk, ep, groups, group_topk",
    [
        (8, 2, 4, None, None),
        (16, 4, 8, None, None),
        (12, 3, 3, None, None),
        (8, 6, 2, None, None),
        (16, 4, 8, 4, 2),
        (16, 2, 4, 4, 3),
    ],
)
def test_rank_hit_probability_is_the_enumerated_share(experts, topk, ep, groups, group_topk):
    want = _enumerated(experts, topk, ep, groups, group_topk)
    assert rank_hit_probability(experts, topk, ep, groups, group_topk) == pytest.approx(
        float(want), rel=1e-12
    )


FLEX = {"moe_token_dispatcher_type": "flex"}


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"parallel": FLEX}, r"flex needs parallel.ep x etp > 1"),
        (
            {
                "parallel": {**FLEX, "ep": 2},
                "training": {"moe_routing": "capacity", "moe_expert_capacity_factor": 1.0},
            },
            "refused by megatron-core with the flex dispatcher's deepep backend",
        ),
        ({"parallel": {**FLEX, "ep": 2}, "training": {"precision": "fp16"}}, "bf16 tokens only"),
        ({"parallel": {**FLEX, "ep": 2, "moe_deepep_num_sms": 7}}, "positive even"),
        (
            {
                "parallel": {**FLEX, "ep": 2, "moe_shared_expert_overlap": True},
                "model": {"moe_shared_expert_intermediate_size": 64},
            },
            "works only with moe_token_dispatcher_type: alltoall",
        ),
    ],
)
def test_flex_config_errors(sections, message):
    model = {**MOE, **sections.pop("model", {})}
    with pytest.raises(ConfigError, match=message):
        small_job(model=model, cluster={"num_gpus": 2}, **sections)


def test_deepep_group_sizes_are_its_configs():
    # 12 ranks: more than one NVLink domain, and not among get_dispatch_config's sizes.
    with pytest.raises(ConfigError, match="no configuration for 12 ranks"):
        small_job(
            model={**MOE, "num_experts": 12},
            parallel={**FLEX, "ep": 12},
            training={"global_batch_size": 12},
            cluster={"num_gpus": 12},
        )


def test_the_verdict_says_deepep_buffers_are_not_in_it():
    job = small_job(model=MOE, parallel={**FLEX, "ep": 2}, cluster={"num_gpus": 2})
    assert any(n.startswith("warning: DeepEP's and HybridEP's") for n in job.notes)
    assert not any("DeepEP" in n for n in small_job(model=MOE, cluster={"num_gpus": 2}).notes)


def _moe_args(extra: str) -> dict:
    args = split_args(
        GPT_ARGS + " --num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 " + extra
    )
    data, _ = job_dict_from_args(args, world_size=8)
    return data


def test_flex_flags_set_the_backend():
    hybrid = _moe_args("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep")
    assert hybrid["parallel"]["moe_token_dispatcher_type"] == "flex"
    assert hybrid["parallel"]["moe_flex_dispatcher_backend"] == "hybridep"
    deepep = _moe_args("--moe-token-dispatcher-type flex --moe-enable-deepep")
    assert deepep["parallel"]["moe_flex_dispatcher_backend"] == "deepep"


def test_enable_deepep_needs_the_flex_dispatcher():
    with pytest.raises(ConfigError, match="--moe-enable-deepep needs"):
        _moe_args("--moe-token-dispatcher-type alltoall --moe-enable-deepep")
