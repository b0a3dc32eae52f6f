"""The command line as a user runs it on jobs it traces: exit codes, JSON output, the micro-batch
search and --fail-on-oom."""

import json

from tests.helpers import DEBUG, GPT_ARGS, metatrace, write_job


def test_run_writes_the_documented_json(tmp_path):
    out = tmp_path / "out.json"
    result = metatrace("run", "--config", DEBUG, "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["schema_version"] == 3
    # The one-GPU model pads the vocabulary to 1008 (a multiple of 16), the tp 2 job to 1024
    # (of 32): embedding and output layer each hold 16 more rows of 64.
    assert report["full_model"]["params"]["count"] == 203_072
    assert (
        report["model"]["total_params"] == report["model"]["active_params"] == 203_072 + 2 * 16 * 64
    )
    assert report["world"]["dp"] == 1 and report["world"]["num_microbatches"] == 4
    roles = report["roles"]
    assert [r["ranks"] for r in roles] == [[0, 1], [2, 3]]
    for role in roles:
        assert {
            "params",
            "activations_per_microbatch_bytes",
            "collectives_per_microbatch",
            "modules",
            "pp_stage",
            "vpp_chunks",
        } <= role.keys()
        ops = {c["op"] for c in role["collectives_per_microbatch"]}
        assert ops <= {"all_reduce", "broadcast", "send", "recv"}
        root = role["modules"][0]
        assert root["fqn"] == "" and root["activation_bytes_total"] == sum(
            m["activation_bytes"] for m in role["modules"]
        )
        assert root["activation_bytes_total"] <= role["activations_per_microbatch_bytes"]
        mem = role["memory"]
        parts = (
            "params_bytes",
            "grads_bytes",
            "optimizer_bytes",
            "workspace_bytes",
            "activations_bytes",
            "temporary_bytes",
        )
        assert sum(mem[k] for k in parts) == mem["peak_bytes"]
        assert mem["peak_at"]["phase"] in ("forward", "backward", "optimizer")
    # 1F1B on 2 stages: stage 0 holds its warm-up micro-batch and the one it runs.
    assert [r["memory"]["inflight_microbatches"] for r in roles] == [2, 1]
    verdict = report["memory_verdict"]
    assert verdict["fits"] and verdict["highest_peak_bytes"] == max(
        r["memory"]["peak_bytes"] for r in roles
    )
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
    assert cluster["total"]["bytes_sent"] == sum(
        cluster[d]["bytes_sent"] for d in cluster if d != "total"
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
    r = metatrace(
        "run",
        "--megatron-args",
        GPT_ARGS,
        "--world-size",
        "8",
        "--gpu",
        "a100",
        "--no-full-model",
        "--json",
        str(a),
    )
    assert r.returncode == 0, r.stderr
    r = metatrace(
        "run", "--config", write_job(tmp_path, GPT_YAML), "--no-full-model", "--json", str(b)
    )
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


def test_max_mbs_finds_the_largest_micro_batch_that_fits(tmp_path):
    out = tmp_path / "search.json"
    # 64 samples per replica; a 0.6 GiB GPU with no reserve.
    config = write_job(
        tmp_path,
        GPT_YAML.replace("global_batch_size: 16", "global_batch_size: 128").replace(
            "gpu: a100", "gpu: a100, gpu_memory_gib: 0.6, context_gib: 0, nccl_gib: 0"
        ),
    )
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
    small = write_job(
        tmp_path,
        "model: {preset: debug}\ntraining: {seq_length: 64}\n"
        "cluster: {gpu_memory_gib: 0.05, context_gib: 0, nccl_gib: 0}",
    )
    fits = metatrace("run", "--config", DEBUG, "--no-full-model", "--fail-on-oom", "--quiet")
    assert fits.returncode == 0, fits.stderr
    oom = metatrace("run", "--config", small, "--no-full-model", "--fail-on-oom", "-q")
    assert oom.returncode == 1 and "Out of memory" in oom.stdout
    assert metatrace("run", "--config", small, "--no-full-model").returncode == 0


def test_megatron_core_refusing_the_optimizer_is_exit_2(tmp_path):
    # megatron-core's OptimizerConfig checks run with its TransformerConfig checks.
    path = write_job(
        tmp_path,
        "model: {preset: debug}\n"
        "training: {seq_length: 64, use_precision_aware_optimizer: true}\n"
        "implementation: {transformer_impl: transformer_engine}\n",
    )
    result = metatrace("run", "--config", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        "megatron-core rejects this optimizer configuration: --use-precision-aware-optimizer "
        "only supported with distributed optimizer" in result.stderr
    )
