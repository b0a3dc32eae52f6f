"""`metatrace run`'s advice when a job does not fit (metatrace.planning.advice): every change it
lists, applied as the user would write it and traced again, fits with the peak it reported;
`--no-advice` turns it off; the JSON report carries it."""

import io
import json
import shlex

import pytest
import yaml
from rich.console import Console

from metatrace.cli import main

# A small job that does not fit 0.3 GiB (nothing outside the allocator): its activations and
# logits for 8 sequences of 2,048 tokens take 338 MiB at the peak.
JOB = {
    "model": {"preset": "debug", "num_layers": 4},
    "parallel": {"tp": 1, "pp": 1},
    "training": {"seq_length": 2048, "micro_batch_size": 8, "global_batch_size": 32},
    "cluster": {
        "num_gpus": 4,
        "gpus_per_node": 4,
        "gpu_memory_gib": 0.3,
        "context_gib": 0,
        "nccl_gib": 0,
    },
}
# Megatron-LM arguments of a job 22 GiB over an A100 40GB (8 layers, 16 sequences of 8,192).
ARGS = (
    "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 8192 "
    "--max-position-embeddings 8192 --micro-batch-size 16 --global-batch-size 128 --bf16 "
    "--tokenizer-type NullTokenizer --vocab-size 31999 --lr 1e-4 --train-iters 10"
)
MEGATRON = ["--world-size", "8", "--gpu", "a100-40gb"]


def run(*argv) -> str:
    out = io.StringIO()
    assert main(["run", *argv], console=Console(file=out, width=80, no_color=True)) == 0
    return out.getvalue()


def write(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def with_keys(data: dict, keys: dict) -> dict:
    """The job file with the change's dotted keys set."""
    out = json.loads(json.dumps(data))
    for dotted, value in keys.items():
        section, name = dotted.split(".", 1)
        out.setdefault(section, {})[name] = value
    return out


def report(tmp_path, *argv, name="out.json") -> dict:
    path = tmp_path / name
    run(*argv, "--summary", "--json", str(path))
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def advised(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("advice")
    job = write(tmp / "job.yaml", JOB)
    text = run("--config", job, "--summary")
    return text, report(tmp, "--config", job)


def test_the_summary_lists_traced_changes_that_fit(advised):
    text, data = advised
    advice = data["advice"]
    assert not data["memory_verdict"]["fits"]
    fits = [c for c in advice["changes"] if c["traced"]]
    assert len(fits) >= 2 and all(c["fits"] for c in advice["changes"])
    assert "To make it fit, change one thing" in text
    for c in fits:
        assert c["change"].split(":")[0] in text
    seconds = [c["iteration_seconds"] for c in advice["changes"] if not c["within_error_band"]]
    assert seconds == sorted(seconds)
    assert advice["given_as"] == "job_file"


def test_each_change_applied_to_the_job_file_fits_with_the_peak_it_reported(advised, tmp_path):
    _, data = advised
    for i, c in enumerate(data["advice"]["changes"]):
        job = write(tmp_path / f"job{i}.yaml", with_keys(JOB, c["keys"]))
        again = report(tmp_path, "--config", job, "--no-advice", name=f"out{i}.json")
        verdict = again["memory_verdict"]
        assert verdict["fits"], c["change"]
        assert verdict["highest_peak_bytes"] == c["highest_peak_bytes"]
        assert verdict["headroom_bytes"] == c["headroom_bytes"]
        assert again["timing"]["iteration_seconds"] == pytest.approx(c["iteration_seconds"])


def test_the_json_report_with_advice_follows_the_schema(advised):
    from metatrace.export.report import check_report

    _, data = advised
    check_report(data, "advice report")  # raises on a field the schema does not allow
    first = data["advice"]["changes"][0]
    assert first["delta_seconds"] == pytest.approx(
        first["iteration_seconds"] - data["timing"]["iteration_seconds"]
    )


def test_no_advice_turns_it_off(tmp_path):
    job = write(tmp_path / "job.yaml", JOB)
    text = run("--config", job, "--summary", "--no-advice")
    assert "Out of memory" in text and "To make it fit" not in text
    assert "advice" not in report(tmp_path, "--config", job, "--no-advice")


def test_a_job_that_fits_beyond_the_band_gets_none(tmp_path):
    job = write(tmp_path / "job.yaml", with_keys(JOB, {"cluster.gpu_memory_gib": 1.0}))
    data = report(tmp_path, "--config", job)
    assert data["memory_verdict"]["fits"] and not data["memory_verdict"]["error_band"]["within"]
    assert data["advice"] is None


def test_megatron_arguments_get_their_flags_which_fit_with_the_peak_reported(tmp_path):
    text = run("--megatron-args", ARGS, *MEGATRON, "--summary")
    data = report(tmp_path, "--megatron-args", ARGS, *MEGATRON)
    advice = data["advice"]
    assert advice["given_as"] == "megatron_args"
    assert len(advice["changes"]) >= 2
    base = shlex.split(ARGS)
    for i, c in enumerate(advice["changes"]):
        assert c["change"] == " ".join(c["megatron_args"])
        assert c["megatron_args"][0].split()[0] in text
        env, args = [], list(base)
        for item in c["megatron_args"]:
            flag, *values = item.split()
            if flag == "no":  # a flag dropped
                args.remove(values[0])
            elif "=" in flag:
                env += ["--env", flag]
            elif flag in args:  # a flag given: its value(s) replaced
                at = args.index(flag)
                end = at + 1
                while end < len(args) and not args[end].startswith("--"):
                    end += 1
                args[at:end] = [flag, *values]
            else:
                args += [flag, *values]
        again = report(
            tmp_path,
            "--megatron-args",
            " ".join(args),
            *MEGATRON,
            *env,
            "--no-advice",
            name=f"out{i}.json",
        )
        assert again["memory_verdict"]["fits"], c["change"]
        assert again["memory_verdict"]["highest_peak_bytes"] == c["highest_peak_bytes"]
