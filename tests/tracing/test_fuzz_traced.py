"""Property-based, through tracing: the debug job with a few settings changed to values a user
might write runs `metatrace run` to exit 0, 1 or 2 (no other exception), and a JSON report it
writes holds only finite numbers. The load-only tier (tests/unit/test_fuzz_inputs.py) tries
wilder values; bench/fuzz_inputs.py runs the whole command line on many more."""

from __future__ import annotations

import json
import os
import tempfile

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import DEBUG
from tests.unit.test_cli import in_process

SETTINGS = {
    ("training", "seq_length"): st.sampled_from([16, 64, 100, 4096]),
    ("training", "micro_batch_size"): st.sampled_from([1, 2, 3]),
    ("training", "global_batch_size"): st.sampled_from([4, 8, 12, 2000]),
    ("training", "recompute_granularity"): st.sampled_from(["full", "selective", None]),
    ("training", "distributed_optimizer"): st.booleans(),
    ("training", "precision"): st.sampled_from(["bf16", "fp16", "fp32"]),
    ("parallel", "tp"): st.sampled_from([1, 2, 4]),
    ("parallel", "pp"): st.sampled_from([1, 2]),
    ("parallel", "sequence_parallel"): st.booleans(),
    ("cluster", "gpu_memory_gib"): st.sampled_from([0.01, 0.5, 80.0, 1e5]),
    ("cluster", "reserved_overhead_gib"): st.sampled_from([0.0, 0.01, 50.0]),
    ("cluster", "intra_node_gbps"): st.sampled_from([1e-9, 1.0, 1e9]),
    ("cluster", "compute_efficiency"): st.sampled_from([0.001, 0.5, 1.0]),
    ("model", "num_layers"): st.sampled_from([1, 2, 3]),
}


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    st.lists(st.sampled_from(sorted(SETTINGS)), min_size=1, max_size=3).flatmap(
        lambda keys: st.tuples(*(st.tuples(st.just(k), SETTINGS[k]) for k in keys))
    )
)
def test_a_traced_mutated_job_keeps_the_contract(changes):
    with open(DEBUG) as f:
        data = yaml.safe_load(f)
    for (section, key), value in changes:
        data.setdefault(section, {})[key] = value
    with tempfile.TemporaryDirectory() as tmp:
        job, report = os.path.join(tmp, "job.yaml"), os.path.join(tmp, "report.json")
        with open(job, "w") as f:
            yaml.safe_dump(data, f)
        code, _ = in_process(
            "run", "--config", job, "--json", report, "--quiet", "--no-full-model", "--jobs", "1"
        )
        assert code in (0, 1, 2)
        if code != 2:
            with open(report) as f:
                json.dumps(json.load(f), allow_nan=False)  # raises on NaN or infinity
