"""The JSON report of traced jobs against its schema, metatrace/export/report.schema.json (shipped
in the package; the schema against the README is in tests/unit/test_report_schema.py)."""

import copy
import json
from importlib import resources

import jsonschema
import pytest

from metatrace.analysis.analyze import analyze
from metatrace.export.report import job_report, search_report
from metatrace.tracing.trace import JobTrace, trace_job, trace_role
from metatrace.world import World
from tests.helpers import MOE, report_validator, small_job


@pytest.fixture(scope="module")
def validator():
    return report_validator()


@pytest.fixture(scope="module")
def debug_report(debug_analysis):
    # Through JSON, as a reader of the file sees it (tuples become lists, keys strings).
    return json.loads(json.dumps(job_report(debug_analysis)))


def errors(validator, report) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(report)
    ]


def test_tp2_pp2_report_with_the_full_model_is_valid(validator, debug_report):
    assert errors(validator, debug_report) == []
    assert "full_model" in debug_report and "memory_verdict" in debug_report
    assert "moe_routing" not in debug_report


def test_moe_report_is_valid_and_names_its_routing(validator):
    job = small_job(
        model=MOE, parallel={"ep": 2}, training={"global_batch_size": 4}, cluster={"num_gpus": 2}
    )
    report = json.loads(
        json.dumps(job_report(analyze(trace_job(job, full_model=False, workers=1))))
    )
    assert errors(validator, report) == []
    # the verdict's routing: random top-k, 2 sources of s·b = 128 tokens, top-2 of 4 experts
    assert report["moe_routing"] == (
        "random top-k at initialisation: the hottest of 4 experts 1.074x its share "
        "(2 x 128 tokens, top-2), on every rank"
    )
    del report["moe_routing"]
    assert any("moe_routing" in e for e in errors(validator, report))


def test_max_mbs_report_is_valid():
    from metatrace.planning.search import max_micro_batch

    schema = json.loads(
        resources.files("metatrace.export").joinpath("report.schema.json").read_text()
    )
    job = small_job(training={"micro_batch_size": 1, "global_batch_size": 4})
    search = max_micro_batch(job, lambda j: trace_job(j, full_model=False, workers=1))
    report = job_report(search.analysis)
    report["max_micro_batch"] = search_report(search)
    report = json.loads(json.dumps(report))
    jsonschema.validate(report, schema, cls=jsonschema.Draft202012Validator)
    assert report["max_micro_batch"]["candidates"] == [1, 2, 4]
    report["max_micro_batch"]["probes"][0]["fits"] = "yes"
    with pytest.raises(jsonschema.ValidationError, match="'yes' is not of type 'boolean'"):
        jsonschema.validate(report, schema, cls=jsonschema.Draft202012Validator)


def test_report_without_an_iteration_has_no_memory_and_no_comm(validator):
    # What a role traced without its iteration (as `metatrace tree` does) reports.
    job = small_job()
    world = World.from_job(job)
    (role,) = world.roles()
    rt = trace_role(job, world, role, iteration=False)
    job_trace = JobTrace(job=job, world=world, roles=(rt,), full=None)
    report = json.loads(json.dumps(job_report(analyze(job_trace))))
    assert not {"memory_verdict", "full_model"} & report.keys()
    assert not {"memory", "comm"} & report["roles"][0].keys() and "comm" not in report["cluster"]
    assert errors(validator, report) == []
    # A verdict needs the memory and communication it sums up.
    report["memory_verdict"] = {
        "fits": True,
        "gpu_memory_bytes": 1,
        "reserved_overhead_bytes": 0,
        "highest_peak_bytes": 1,
        "highest_peak_ranks": [0],
        "headroom_bytes": 0,
        "out_of_memory_ranks": [],
    }
    found = errors(validator, report)
    assert any("'comm' is a required property" in e for e in found), found
    assert any("'memory' is a required property" in e for e in found), found


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("roles", 0, "memory", "peak_bytes"), "97.6 MiB", "is not of type 'integer'"),
        (("world", "vpp"), "none", "is not of type 'integer', 'null'"),
        (("cluster", "comm", "tp", "seconds"), None, "is not of type 'number'"),
        (("roles", 1, "comm_collectives", 0, "dimension"), "nvlink", "is not one of"),
        (("memory_verdict", "fits"), 1, "is not of type 'boolean'"),
        (("schema_version",), 2, "3 was expected"),
        (("roles",), [], "should be non-empty"),
    ],
)
def test_a_wrong_type_is_rejected(validator, debug_report, path, value, message):
    report = copy.deepcopy(debug_report)
    target = report
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    found = errors(validator, report)
    assert len(found) == 1 and message in found[0], found


@pytest.mark.parametrize(
    "path",
    [
        ("world", "dp"),
        ("roles", 0, "memory", "peak_at"),
        ("roles", 1, "comm", "pp"),
        ("roles", 0, "gpus"),
        ("full_model", "modules", 0, "activation_bytes_total"),
        ("cluster", "comm", "total"),
        ("model", "padded_vocab_size"),
        ("training", "recompute", "granularity"),
        ("groups", "embedding"),
        ("notes",),
    ],
)
def test_a_missing_required_field_is_rejected(validator, debug_report, path):
    report = copy.deepcopy(debug_report)
    target = report
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    found = errors(validator, report)
    assert found == [f"{'/'.join(map(str, path[:-1]))}: '{path[-1]}' is a required property"]


def test_fields_added_later_are_allowed(validator, debug_report):
    report = copy.deepcopy(debug_report)
    report["a_new_section"] = {"x": 1}
    report["roles"][0]["memory"]["a_new_part_bytes"] = 0
    assert errors(validator, report) == []
