"""Property-based: mutated job files and Megatron-LM argument lists either load or raise one
ConfigError (the command line's exit 2); never another exception. Tracing is not run here
(seconds per job): what reaches it has passed every check these mutations aim at."""

from __future__ import annotations

import dataclasses
import math
import os
import typing

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metatrace.config.job import Job
from metatrace.config.load import job_from_dict
from metatrace.config.megatron.args import job_from_args
from metatrace.config.megatron.script import split_args
from metatrace.errors import ConfigError
from tests.helpers import EXAMPLES, GPT_ARGS

with open(os.path.join(EXAMPLES, "llama2-7b-tp2-pp2.yaml")) as f:
    BASE = yaml.safe_load(f)
SECTIONS = {
    name: typing.get_type_hints(Job)[name]
    for name in ("model", "parallel", "training", "cluster", "implementation")
}
FIELDS = {
    (section, f.name): f for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
}
KEYS = list(FIELDS)

VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 3, 7, 4096]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["[1]*1000000000000", "([0]*3+[1]*5)", ":4096:8", "garbage", "h100"]),
    st.lists(st.integers(min_value=-3, max_value=100), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _loads_or_config_error(load):
    try:
        job = load()
    except ConfigError as e:
        assert e.problems and all(isinstance(p, str) and len(p) < 2000 for p in e.problems)
        return
    for section in ("cluster", "training", "model"):
        for value in vars(getattr(job, section)).values():
            if isinstance(value, float):
                assert math.isfinite(value)


@SETTINGS
@given(mutations=st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=3))
def test_mutated_job_files_load_or_give_one_config_error(mutations):
    data = {section: dict(values) for section, values in BASE.items()}
    for (section, key), value in mutations:
        data.setdefault(section, {})[key] = value
    _loads_or_config_error(lambda: job_from_dict(data))


FLAG_VALUES = st.one_of(
    st.sampled_from(["0", "-1", "1e30", "nan", "inf", "", "abc", "99999999999999999999", "3"]),
    st.integers(min_value=-(2**40), max_value=2**40).map(str),
)


@SETTINGS
@given(
    changes=st.lists(st.tuples(st.integers(min_value=0, max_value=40), FLAG_VALUES), max_size=3),
    extra=st.lists(
        st.sampled_from(
            ["--num-experts", "--moe-router-topk", "--context-parallel-size", "--fp8-format"]
        ),
        max_size=2,
    ),
    value=FLAG_VALUES,
)
def test_mutated_megatron_arguments_load_or_give_one_config_error(changes, extra, value):
    args = split_args(GPT_ARGS)
    values = [i for i, a in enumerate(args) if not a.startswith("--")]
    for index, new in changes:
        args[values[index % len(values)]] = new
    for flag in extra:
        args += [flag, value]
    _loads_or_config_error(lambda: job_from_args(args, world_size=8)[0])


FLOAT_KEYS = [key for key, f in FIELDS.items() if "float" in str(f.type)]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("section, key", FLOAT_KEYS)
def test_no_number_of_a_job_may_be_nan_or_infinite(section, key, value):
    data = {s: dict(values) for s, values in BASE.items()}
    data.setdefault(section, {})[key] = value
    with pytest.raises(ConfigError, match="must be a finite number"):
        job_from_dict(data)
