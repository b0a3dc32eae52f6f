"""The report's JSON Schema, metatrace/export/report.schema.json, against its documentation
(docs/json-report.md, docs/job-files.md) and the job's keys (traced reports against the schema are in tests/tracing/test_report_schema.py)."""

import os
import re

import pytest

from metatrace.export.report import SCHEMA_VERSION
from tests.helpers import ROOT, report_validator


@pytest.fixture(scope="module")
def validator():
    return report_validator()


def test_schema_version_is_pinned_to_the_reports(validator):
    assert validator.schema["properties"]["schema_version"] == {
        "description": validator.schema["properties"]["schema_version"]["description"],
        "const": SCHEMA_VERSION,
    }
    with open(os.path.join(ROOT, "docs", "json-report.md")) as f:
        readme = f.read()
    assert f"# The JSON report (schema version {SCHEMA_VERSION})" in readme
    assert "metatrace/export/report.schema.json" in readme


def test_every_top_level_field_the_readme_documents_is_in_the_schema(validator):
    with open(os.path.join(ROOT, "docs", "json-report.md")) as f:
        readme = f.read()
    block = readme.split("# The JSON report", 1)[1].split("```")[1]
    documented = set()
    for line in block.splitlines():
        m = re.match(r"^([a-z_.]+(?:, [a-z_]+)*)(\[\])?(?:  |$)", line)
        if m:
            documented.update(name.strip() for name in m.group(1).split(","))
    documented.discard("cluster.comm")
    assert {"schema_version", "roles", "memory_verdict", "max_micro_batch"} <= documented
    missing = documented - set(validator.schema["properties"])
    assert not missing, (
        f"docs/json-report.md documents {missing}: add them to metatrace/export/report.schema.json"
    )
    assert "comm" in validator.schema["properties"]["cluster"]["properties"]


@pytest.mark.parametrize("section", ["model", "parallel", "training", "implementation", "cluster"])
def test_every_job_key_is_in_the_schema_and_the_readme(validator, section):
    """A job key added to metatrace/config.py is described in the schema (a required property
    of its section) and named in docs/job-files.md's table of job-file keys."""
    import dataclasses
    import typing

    from metatrace.config import Job

    fields = [f.name for f in dataclasses.fields(typing.get_type_hints(Job)[section])]
    node = validator.schema["properties"][section]
    assert [f for f in fields if f not in node["properties"]] == []
    assert [f for f in fields if f not in node["required"]] == []
    with open(os.path.join(ROOT, "docs", "job-files.md")) as f:
        row = next(line for line in f if line.startswith(f"| `{section}` |"))
    assert [f for f in fields if f"`{f}`" not in row] == []
