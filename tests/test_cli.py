"""The command line as a user runs it: exit codes, one-line errors, JSON output."""

import json
import os
import subprocess
import sys

import pytest

from conftest import EXAMPLES, ROOT

DEBUG = os.path.join(EXAMPLES, "debug.yaml")


def metatrace(*args, cwd=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "metatrace", *args],
        capture_output=True, text=True, cwd=cwd or ROOT, env=env, timeout=300,
    )


def write(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


BAD = [
    ("model: {preset: debug, hiden_size: 8}\ntraining: {seq_length: 64}",
     "unknown key 'model.hiden_size'; did you mean 'model.hidden_size'?"),
    ("model: {preset: debug}\nparallel: {tp: 2, pp: 2, dp: 3}\ntraining: {seq_length: 64}\ncluster: {num_gpus: 16}",
     "tp x pp x cp x dp = 2 x 2 x 1 x 3 = 12, but cluster.num_gpus = 16"),
    ("model: {preset: debug}\nparallel: {tp: 8}\ntraining: {seq_length: 64}",
     "model.num_attention_heads = 4 is not divisible by parallel.tp = 8"),
    ("model: {preset: debug}\nparallel: {tp: 4}\ntraining: {seq_length: 64}",
     "model.num_query_groups = 2 is not divisible by parallel.tp = 4"),
    ("model: {preset: debug, num_layers: 3}\nparallel: {pp: 2}\ntraining: {seq_length: 64}",
     "model.num_layers = 3 is not divisible by parallel.pp = 2"),
    ("model: {preset: debug, num_layers: 4}\nparallel: {pp: 2, vpp: 4}\ntraining: {seq_length: 64, global_batch_size: 2}",
     "layers per pipeline rank are not divisible by parallel.vpp = 4"),
    ("model: {preset: debug}\nparallel: {cp: 2}\ntraining: {seq_length: 66}",
     "training.seq_length = 66 is not divisible by 2 x parallel.cp = 4"),
    ("model: {preset: debug}\nparallel: {dp: 4}\ntraining: {seq_length: 64, micro_batch_size: 2, global_batch_size: 12}",
     "global_batch_size = 12 is not a multiple of micro_batch_size x dp = 2 x 4 = 8"),
    ("model: {preset: debug}\ntraining: {seq_length: 64, precision: fp4}", "'training.precision' must be one of"),
    ("model: [oops", "not valid YAML"),
]


@pytest.mark.parametrize("text, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_config_is_one_message_and_exit_code_2(tmp_path, text, message):
    result = metatrace("run", "--config", write(tmp_path, text))
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_contradictory_pipeline_options_exit_2(tmp_path):
    text = ("model: {preset: debug, num_layers: 4}\nparallel: {pp: 2, account_for_embedding: true,"
            " first_stage_layers: 1}\ntraining: {seq_length: 64}")
    result = metatrace("run", "--config", write(tmp_path, text))
    assert result.returncode == 2 and "cannot be combined" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["run"], "give the job as one of --config"),
        (["run", "--config", "does-not-exist.yaml"], "cannot read config file"),
        (["tree", "--config", DEBUG, "--rank", "4"], "--rank 4 is not a rank of this job (0 to 3)"),
        (["run", "--config", DEBUG, "--depth", "-1"], "--depth must be 0 or more"),
        (["run", "--config", DEBUG, "--json", "/nonexistent/dir/out.json"], "does not exist"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_flags_exit_2(args, message):
    result = metatrace(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_version_and_module_entry_point():
    result = metatrace("--version")
    assert result.returncode == 0 and result.stdout.startswith("metatrace ")


def test_run_writes_the_documented_json(tmp_path):
    out = tmp_path / "out.json"
    result = metatrace("run", "--config", DEBUG, "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["schema_version"] == 3
    # The one-GPU model pads the vocabulary to 1008 (a multiple of 16), the tp 2 job to 1024
    # (of 32): embedding and output layer each hold 16 more rows of 64.
    assert report["full_model"]["params"]["count"] == 203_072
    assert report["model"]["total_params"] == report["model"]["active_params"] == 203_072 + 2 * 16 * 64
    assert report["world"]["dp"] == 1 and report["world"]["num_microbatches"] == 4
    roles = report["roles"]
    assert [r["ranks"] for r in roles] == [[0, 1], [2, 3]]
    for role in roles:
        assert {"params", "activations_per_microbatch_bytes", "collectives_per_microbatch",
                "modules", "pp_stage", "vpp_chunks"} <= role.keys()
        ops = {c["op"] for c in role["collectives_per_microbatch"]}
        assert ops <= {"all_reduce", "broadcast", "send", "recv"}
        root = role["modules"][0]
        assert root["fqn"] == "" and root["activation_bytes_total"] == sum(
            m["activation_bytes"] for m in role["modules"])
        assert root["activation_bytes_total"] <= role["activations_per_microbatch_bytes"]
        mem = role["memory"]
        parts = ("params_bytes", "grads_bytes", "optimizer_bytes", "workspace_bytes",
                 "activations_bytes", "temporary_bytes")
        assert sum(mem[k] for k in parts) == mem["peak_bytes"]
        assert mem["peak_at"]["phase"] in ("forward", "backward", "optimizer")
    # 1F1B on 2 stages: stage 0 holds its warm-up micro-batch and the one it runs.
    assert [r["memory"]["inflight_microbatches"] for r in roles] == [2, 1]
    verdict = report["memory_verdict"]
    assert verdict["fits"] and verdict["highest_peak_bytes"] == max(
        r["memory"]["peak_bytes"] for r in roles)
    assert "full_model" in report
    # Communication: per role and dimension, the cluster's sums over every rank, the groups.
    assert report["groups"]["tp"] == [[0, 1], [2, 3]] and report["groups"]["pp"] == [[0, 2], [1, 3]]
    cluster = report["cluster"]["comm"]
    for dim in ("tp", "cp", "ep", "dp", "pp"):
        for key in ("count", "bytes_sent", "bytes_received", "message_bytes"):
            assert cluster[dim][key] == sum(len(r["ranks"]) * r["comm"][dim][key] for r in roles)
    assert cluster["tp"]["count"] > 0 and cluster["cp"]["count"] == 0
    # 1F1B, 4 micro-batches, 2 stages: each stage sends 4 and receives 4.
    assert [r["comm"]["pp"]["count"] for r in roles] == [8, 8]
    assert cluster["total"]["bytes_sent"] == sum(cluster[d]["bytes_sent"] for d in cluster if d != "total")


GPT_ARGS = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 16 "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
    "--bf16 --use-distributed-optimizer --vocab-file vocab.json --merge-file merges.txt "
    "--lr 1e-4 --train-iters 10 --no-gradient-accumulation-fusion"
)
GPT_YAML = """\
model: {num_layers: 4, hidden_size: 128, num_attention_heads: 4, vocab_size: 50257,
        max_position_embeddings: 256}
parallel: {tp: 2, pp: 2, sequence_parallel: true}
training: {seq_length: 256, micro_batch_size: 2, global_batch_size: 16, precision: bf16,
           distributed_optimizer: true, gradient_accumulation_fusion: false}
cluster: {num_gpus: 8, gpu: a100}
"""


def test_megatron_args_and_the_yaml_job_give_the_same_report(tmp_path):
    a, b = tmp_path / "args.json", tmp_path / "yaml.json"
    r = metatrace("run", "--megatron-args", GPT_ARGS, "--world-size", "8", "--gpu", "a100",
                  "--no-full-model", "--json", str(a))
    assert r.returncode == 0, r.stderr
    r = metatrace("run", "--config", write(tmp_path, GPT_YAML), "--no-full-model", "--json", str(b))
    assert r.returncode == 0, r.stderr
    reports = [json.loads(p.read_text()) for p in (a, b)]
    for report in reports:
        report.pop("source")
        for role in report["roles"]:
            role.pop("trace_seconds")
    assert reports[0] == reports[1]
    assert reports[0]["world"]["dp"] == 2 and reports[0]["model"]["padded_vocab_size"] == 50432


def test_comm_and_groups_flags():
    result = metatrace("comm", "--config", DEBUG, "--dim", "xx")
    assert result.returncode == 2 and "invalid choice" in result.stderr
    result = metatrace("groups", "--config", DEBUG, "--rank", "4")
    assert result.returncode == 2 and "--rank 4 is not a rank of this job" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--megatron-args", "--num-layers 2"], "need --world-size"),
        (["run", "--config", DEBUG, "--world-size", "8"], "--world-size applies to Megatron-LM"),
        (["run", "--megatron-args", GPT_ARGS + " --num-layer 4", "--world-size", "8"],
         "--num-layer (did you mean --num-layers?)"),
        (["run", "--megatron-args", GPT_ARGS, "--world-size", "8", "--env", "FOO"],
         "--env 'FOO' must be NAME=VALUE"),
    ],
)
def test_megatron_args_errors(args, message):
    result = metatrace(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_max_mbs_finds_the_largest_micro_batch_that_fits(tmp_path):
    out = tmp_path / "search.json"
    # 64 samples per replica; a 0.6 GiB GPU with no reserve.
    config = write(tmp_path, GPT_YAML.replace("global_batch_size: 16", "global_batch_size: 128")
                   .replace("gpu: a100", "gpu: a100, gpu_memory_gib: 0.6, reserved_overhead_gib: 0"))
    result = metatrace("run", "--config", config, "--max-mbs", "--json", str(out))
    assert result.returncode == 0, result.stderr
    search = json.loads(out.read_text())["max_micro_batch"]
    probes = {p["micro_batch_size"]: p for p in search["probes"]}
    best = search["best"]
    assert search["candidates"] == [1, 2, 4, 8, 16, 32, 64]
    assert probes[best]["fits"]
    # The next larger size was tried and does not fit (or best is the largest candidate).
    larger = [c for c in search["candidates"] if c > best]
    assert not larger or not probes[larger[0]]["fits"]
    assert "Micro-batch size" in result.stdout


def test_fail_on_oom_exit_code_follows_the_verdict(tmp_path):
    # The debug job peaks near 100 MiB per GPU: it fits on an H100 and not on a GPU of
    # 0.05 GiB with no reserved overhead; --fail-on-oom turns that verdict into exit status 1.
    small = write(tmp_path, "model: {preset: debug}\ntraining: {seq_length: 64}\n"
                  "cluster: {gpu_memory_gib: 0.05, reserved_overhead_gib: 0}")
    fits = metatrace("run", "--config", DEBUG, "--no-full-model", "--fail-on-oom", "--quiet")
    assert fits.returncode == 0, fits.stderr
    oom = metatrace("run", "--config", small, "--no-full-model", "--fail-on-oom", "-q")
    assert oom.returncode == 1 and "Out of memory" in oom.stdout
    assert metatrace("run", "--config", small, "--no-full-model").returncode == 0
