"""`metatrace diff` of traced jobs: an identical pair has no change and prints one line, every
row is the difference of the two JSON reports, roles pair up by layers when the pipelines
differ, bad sides exit 2 (after the good side is traced)."""

import io
import json

import pytest
from rich.console import Console

from metatrace.cli import main
from tests.helpers import DEBUG


def run(*argv):
    out = io.StringIO()
    code = main(list(argv), Console(file=out, width=120, color_system=None))
    return code, out.getvalue()


def job(tmp_path, name, parallel, num_layers=2, gpus=4):
    path = tmp_path / name
    path.write_text(
        f"model: {{preset: debug, num_layers: {num_layers}}}\n"
        f"parallel: {parallel}\n"
        "training: {seq_length: 64, global_batch_size: 8, micro_batch_size: 2}\n"
        f"cluster: {{num_gpus: {gpus}, gpus_per_node: 2}}\n"
    )
    return str(path)


def _at(data, path):
    for part in path.split("."):
        data = data[part]
    return data


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Two traced jobs with different pipelines (tp 2 pp 2 against tp 1 pp 4 with 4 layers),
    their JSON reports and the diff of the two files."""
    tmp = tmp_path_factory.mktemp("diff")
    a = job(tmp, "a.yaml", "{tp: 2, pp: 2}", num_layers=4)
    b = job(tmp, "b.yaml", "{tp: 1, pp: 4}", num_layers=4)
    paths = {}
    for name, side in (("a", a), ("b", b)):
        paths[name] = str(tmp / f"{name}.json")
        assert run("run", "--config", side, "--no-full-model", "--json", paths[name])[0] == 0
    out = str(tmp / "diff.json")
    code, text = run("diff", paths["a"], paths["b"], "--json", out)
    assert code == 0
    with open(paths["a"]) as fa, open(paths["b"]) as fb, open(out) as fd:
        return json.load(fa), json.load(fb), json.load(fd), text


def test_a_job_diffed_with_its_report_has_no_change_and_is_one_line(tmp_path):
    report, out = str(tmp_path / "debug.json"), str(tmp_path / "same.json")
    assert run("run", "--config", DEBUG, "--no-full-model", "--json", report, "--quiet")[0] == 0
    code, text = run("diff", report, DEBUG, "--json", out, "--quiet")
    assert code == 0
    with open(out) as f:
        diff = json.load(f)
    assert diff["changes"] == [] and diff["config"] == []
    assert all(not row["changed"] for row in diff["cluster"])
    # Each side as the user gave it: the JSON file with the job it came from, the job file.
    assert (diff["a"]["label"], diff["b"]["label"]) == (f"{report} (from {DEBUG})", DEBUG)
    assert (
        text.splitlines()[0]
        == f"Same configuration and figures: {report} (from {DEBUG}) and {DEBUG}"
    )
    assert len([line for line in text.splitlines() if line]) == 2  # and the JSON's path


def test_every_row_is_the_difference_of_the_two_reports(reports):
    a, b, diff, _ = reports
    rows = [(a, b, row) for row in diff["cluster"]]
    for pair in diff["roles"]:
        ra, rb = a["roles"][pair["a"]["index"]], b["roles"][pair["b"]["index"]]
        rows += [(ra, rb, row) for row in pair["figures"]]
    checked = 0
    for ra, rb, row in rows:
        va, vb = _at(ra, row["figure"]), _at(rb, row["figure"])
        if isinstance(va, (int, float)) and not isinstance(va, bool):
            assert (row["a"], row["b"], row["delta"]) == (va, vb, vb - va), row["figure"]
            assert row["changed"] == (va != vb)
            checked += 1
    assert checked > 50
    peak = next(r for r in diff["cluster"] if r["figure"] == "memory_verdict.highest_peak_bytes")
    assert peak["delta"] == (
        b["memory_verdict"]["highest_peak_bytes"] - a["memory_verdict"]["highest_peak_bytes"]
    )


def test_changes_list_config_keys_first_then_figures(reports):
    a, b, diff, text = reports
    paths = [c["path"] for c in diff["changes"]]
    n = len(diff["config"])
    assert all(p.startswith("config.") for p in paths[:n])
    assert not any(p.startswith("config.") for p in paths[n:])
    keys = {c["key"]: (c["a"], c["b"]) for c in diff["config"]}
    # tp 2 pads the vocabulary to a multiple of 16 x 2 (1024), tp 1 to 16 (1008).
    assert keys["parallel.tp"] == (2, 1) and keys["parallel.pp"] == (2, 4)
    assert keys["model.padded_vocab_size"] == (1024, 1008)
    changed = [r for r in diff["cluster"] if r["changed"]]
    assert len([p for p in paths if p.startswith("cluster.")]) == len(changed)
    # tp 2 -> 1 halves no linear weight shard: the column-parallel fc1 doubles its rows.
    pair = diff["roles"][0]
    fc1 = next(m for m in pair["modules"] if m["module"] == "decoder.layers.*.mlp.linear_fc1")
    rows_a = fc1["a"]["param_shapes"]["weight"][0]
    assert fc1["b"]["param_shapes"]["weight"][0] == 2 * rows_a
    assert any("all_reduce tp" in call for call in fc1["a"]["collectives"])
    assert fc1["b"]["collectives"] == {}
    assert "Configuration changes" in text and "parallel.pp" in text


def test_roles_pair_by_layers_when_pipelines_differ(reports):
    a, b, diff, _ = reports
    # a: 2 stages of layers 1-2, 3-4; b: 4 stages of one layer each.
    assert [(p["a"]["pp_stage"], p["b"]["pp_stage"]) for p in diff["roles"]] == [
        (0, 0),
        (0, 1),
        (1, 2),
        (1, 3),
    ]
    assert [p["label"] for p in diff["roles"]] == ["stage 0", "stage 0/1", "stage 1/2", "stage 1/3"]


def test_megatron_arguments_as_a_side(tmp_path):
    args = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --bf16 "
        "--tensor-model-parallel-size 2 --vocab-size 1000 --tokenizer-type NullTokenizer"
    )
    out = str(tmp_path / "d.json")
    code, text = run("diff", args, DEBUG, "--world-size", "2", "--json", out, "--quiet")
    assert code == 0
    with open(out) as f:
        diff = json.load(f)
    keys = {c["key"]: (c["a"], c["b"]) for c in diff["config"]}
    assert keys["parallel.pp"] == (1, 2)
    assert diff["a"]["source"] == "--megatron-args"
    assert diff["a"]["label"] == args[:59] + "…" and text.startswith(f"A {args[:59]}…\n")
