"""The time model against published training throughput (issue 21).

    python bench/throughput.py [--only TEXT] [--calibration FILE] [--json OUT]

Every row of ../shared/calibration/throughput.jsonl is laid out as a job (its model, GPUs and
parallel degrees as printed; what the source leaves out filled by one rule per source family,
listed in ASSUMED below, never per row), traced without the full model, and its iteration time
predicted (metatrace.analysis.timing). The published step time is the row's own (printed or
derived from tokens/s), else the row's TFLOP/s per GPU turned into seconds with the FLOP formula
its source uses (FORMULAS). Prints predicted / published per row with the shares of the predicted
iteration (metatrace.analysis.timing.breakdown: compute, communication in the steps, pipeline
idle, optimizer step), then the median |error| and the worst row, dense and MoE apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALIBRATION = os.path.join(ROOT, "..", "shared", "calibration", "throughput.jsonl")

# What each source family leaves out, filled the same way for every row of the family.
ASSUMED = {
    "megatron-lm-h100": "GPT (LayerNorm, GeLU, learned positions, biases, tied embeddings), "
    "FFN 4h, bf16, micro-batch 1, sequence parallel, TP communication overlap, the "
    "distributed optimizer with overlapped gradient reduce and parameter gather (as printed)",
    "megatron-lm-a100": "GPT as above, attention heads as the paper's Table 1 prints them "
    "(PAPER_HEADS; head dim 128 where neither prints them), vocab 51,200 where not printed, "
    "fp16, full recompute (the paper counts its FLOPs), micro-batch 1, the distributed "
    "optimizer off (2021), no sequence parallel (2021), megatron-core's local layers with "
    "Megatron's own attention and fused softmax (2021: no Transformer Engine, no flash "
    "attention)",
    "llama3": "Llama 3 405B, micro-batch 1, the paper's interleaved schedule at its least "
    "degree (2 virtual stages per rank: the paper does not print it) with one layer fewer on "
    "the first and last stages (the paper), the distributed optimizer with overlap, context "
    "parallel by all-gathering K and V (the paper, Sec. 3.3.2: its latency exposed)",
    "deepseek-v3": "examples/deepseek-v3-2048gpu.yaml's interleaved layout (the MTP layer with "
    "the loss: metatrace does not trace megatron-core's 'Et*3|(tt|)*29,m|L'), "
    "FP8 blockwise, micro-batch 1; DualPipe's overlap of the expert all-to-alls with the other "
    "micro-batch's compute (the report, Sec. 3.2.1) as megatron-core's counterpart, "
    "overlap_moe_expert_parallel_comm; the report's dispatch kernels (Sec. 3.2.2: a token "
    "crosses IB once per target node, then NVLink) as megatron-core's, the flex dispatcher "
    "with DeepEP",
    "mixtral": "the Megatron-Core MoE README's mapping, all-to-all dispatcher, grouped GEMM, "
    "balanced routing, the distributed optimizer with overlap",
    "nemo": "the NeMo model configs (Llama presets, GPT-3 as above, Nemotron: squared ReLU, "
    "LayerNorm, RoPE, no biases, vocab 256,000), FP8 delayed scaling, sequence parallel and TP "
    "communication overlap where tp > 1, the distributed optimizer with overlap",
}


# Narayanan et al. 2021, Table 1: attention heads by hidden size (the README's table omits them).
PAPER_HEADS = {
    2304: 24,
    3072: 32,
    4096: 32,
    6144: 48,
    8192: 64,
    10240: 80,
    12288: 96,
    16384: 128,
    20480: 128,
    25600: 160,
}


def family(name: str) -> str:
    for key in ("megatron-lm-h100", "megatron-lm-a100", "llama3", "deepseek-v3", "nemo"):
        if name.startswith(key):
            return key
    return "mixtral" if "mixtral" in name else "other"


def _gpu(text: str) -> str:
    text = text.lower()
    for name in ("h100", "h800", "a100", "h200", "b200", "gb200"):
        if name in text:
            return name
    raise ValueError(text)


def _gpt(m: dict, *, vocab: int) -> dict:
    """GPT-3's architecture (the gpt3-175b preset's) with the row's dimensions."""
    from metatrace.config.presets import PRESETS

    h = m["hidden_size"]
    base = dict(PRESETS["gpt3-175b"].dims)
    del base["max_position_embeddings"]  # the sequence length
    return {
        **base,
        "num_layers": m["num_layers"],
        "hidden_size": h,
        "ffn_hidden_size": m.get("ffn_hidden_size") or 4 * h,
        "num_attention_heads": m.get("num_attention_heads") or h // 128,
        "vocab_size": m.get("vocab_size") or vocab,
    }


def job_for(row: dict) -> dict:
    """The job dict of a calibration row (see ASSUMED)."""
    fam, m, par, tr = family(row["name"]), row["model"], row["parallel"], row["training"]
    derived = row.get("derived") or {}
    tp = par.get("tp") or derived.get("tp") or 1
    pp = par.get("pp") or derived.get("pp") or 1
    vpp = par.get("vpp") if (par.get("vpp") or 1) > 1 else None
    cp = par.get("cp") or 1
    ep = par.get("ep") or 1
    gbs = tr.get("global_batch_size") or derived.get("global_batch_size")
    parallel = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "sequence_parallel": tp > 1}
    if vpp:
        parallel["vpp"] = vpp
    training = {
        "seq_length": tr["seq_length"],
        "micro_batch_size": tr.get("micro_batch_size") or 1,
        "global_batch_size": gbs,
        "distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    }
    cluster = {"num_gpus": row["num_gpus"], "gpus_per_node": 8, "gpu": _gpu(row["gpu"])}
    impl: dict = {}
    if fam == "megatron-lm-h100":
        model = _gpt(m, vocab=131072)
        parallel["tp_comm_overlap"] = tp > 1
    elif fam == "megatron-lm-a100":
        h = m["hidden_size"]
        model = _gpt(
            {**m, "num_attention_heads": m["num_attention_heads"] or PAPER_HEADS.get(h)},
            vocab=51200,
        )
        parallel["sequence_parallel"] = False
        impl = {"transformer_impl": "local", "attention_backend": "local"}
        training.update(
            precision="fp16",
            recompute={"granularity": "full", "method": "uniform", "num_layers": 1},
            distributed_optimizer=False,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
        )
    elif fam == "llama3":
        model = {"preset": "llama3.1-405b", "vocab_size": m["vocab_size"]}
        if cp > 1:
            parallel["cp_comm_type"] = "all_gather"
        if pp > 1:  # 2 virtual stages per rank; the first and the last one layer short
            per = -(-m["num_layers"] // pp) // 2
            if (2 * pp * per - m["num_layers"]) != 2:
                raise ValueError(f"{m['num_layers']} layers are not {2 * pp} x {per} - 2")
            short = "t" * (per - 1)
            parallel["layout"] = f"E{short}|({'t' * per}|)*{2 * pp - 2}{short}L"
    elif fam == "deepseek-v3":
        model = {"preset": "deepseek-v3"}
        # 120 micro-batches: interleaved groups of 24 (a multiple of none of pp's 16)
        parallel.update(
            layout="Et|(tt|)*30mL",
            moe_token_dispatcher_type="flex",
            moe_flex_dispatcher_backend="deepep",
            microbatch_group_size=24,
            overlap_moe_expert_parallel_comm=True,
        )
        training.update(
            precision="fp8",
            fp8_recipe="blockwise",
            moe_router_dtype="fp32",
            recompute={"granularity": "selective", "modules": ["layernorm", "mla_up_proj"]},
        )
        impl = {"moe_grouped_gemm": True, "moe_permute_fusion": True}
    elif fam == "mixtral":
        model = {"preset": "mixtral-8x7b"}
        parallel["moe_token_dispatcher_type"] = "alltoall"
        impl = {"moe_grouped_gemm": True}
    else:  # nemo
        name = m["name"].lower()
        if name.startswith("llama"):
            preset = {
                "llama2-7b": "llama2-7b",
                "llama2-13b": "llama2-13b",
                "llama2-70b": "llama2-70b",
                "llama3-8b": "llama3-8b",
                "llama3-70b": "llama3-70b",
            }[name]
            model = {"preset": preset}
        elif name.startswith("gpt3"):
            model = _gpt(m, vocab=51200)
        else:  # Nemotron
            model = {
                "num_layers": m["num_layers"],
                "hidden_size": m["hidden_size"],
                "ffn_hidden_size": m["ffn_hidden_size"],
                "num_attention_heads": m["num_attention_heads"],
                "num_query_groups": m.get("num_query_groups"),
                "vocab_size": m.get("vocab_size") or 256000,
                "position_embedding_type": "rope",
                "normalization": "LayerNorm",
                "activation": "squared_relu",
                "add_bias_linear": False,
                "untie_embeddings_and_output_weights": True,
                "hidden_dropout": 0.0,
                "attention_dropout": 0.0,
            }
        parallel["tp_comm_overlap"] = tp > 1
        training.update(precision="fp8", fp8_recipe="delayed")
    model = {k: v for k, v in model.items() if v is not None}
    job = {"model": model, "parallel": parallel, "training": training, "cluster": cluster}
    if impl:
        job["implementation"] = impl
    return job


def megatron_flops(job) -> float:
    """Megatron-LM's num_floating_point_operations (training.py, core_r0.8): forward and
    backward, per iteration, causal attention not halved, SwiGLU's three matrices counted as
    3/2 of a plain MLP's two (gated_linear_multiplier; megatron-bridge's flop_utils.py keeps
    the same)."""
    m, tr = job.model, job.training
    h, L, s = m.hidden_size, m.num_layers, tr.seq_length
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    gated = 3 / 2 if m.activation == "swiglu" else 1
    routed = m.moe_router_topk if m.num_experts else 1
    ffn = (m.moe_ffn_hidden_size or m.ffn_hidden_size) if m.num_experts else m.ffn_hidden_size
    q_ratio = m.kv_channels * heads / h
    return (
        12
        * tr.global_batch_size
        * s
        * L
        * h
        * h
        * (
            (1 + groups / heads + s / h) * q_ratio
            + ffn / h * routed * gated
            + job.padded_vocab_size / (2 * L * h)
        )
    )


def narayanan_flops(job) -> float:
    """Narayanan et al. 2021, Sec. 5.1: 96 B s l h^2 (1 + s/6h + V/16lh), with the recompute
    forward."""
    m, tr = job.model, job.training
    h, L, s, V = m.hidden_size, m.num_layers, tr.seq_length, m.vocab_size
    return 96 * tr.global_batch_size * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


FORMULAS = {"megatron-lm-a100": narayanan_flops}


def published_seconds(row: dict, job) -> tuple[float, str]:
    pub, derived = row["published"], row.get("derived") or {}
    if pub.get("time_per_step_s"):
        return pub["time_per_step_s"], "printed"
    if derived.get("time_per_step_s"):
        return derived["time_per_step_s"], "derived"
    fam = family(row["name"])
    flops = FORMULAS.get(fam, megatron_flops)(job)
    return flops / (pub["tflops_per_gpu"] * 1e12 * row["num_gpus"]), "TFLOP/s"


def predict(job_dict: dict):
    from metatrace.analysis.timing import job_timing
    from metatrace.config import job_from_dict, resolve
    from metatrace.tracing.trace import trace_job

    job = resolve(job_from_dict(job_dict))
    traced = trace_job(job, full_model=False)
    return job, job_timing(traced)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="rows whose name contains this")
    parser.add_argument("--calibration", default=CALIBRATION)
    parser.add_argument("--json", help="write the rows' figures here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # megatron-core's advice for real runs
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # fake process groups warn in C++
    from metatrace.analysis.timing import breakdown
    from metatrace.tracing.trace import shared_workers

    rows = [json.loads(line) for line in open(args.calibration) if line.strip()]
    rows = [r for r in rows if args.only in r["name"]]
    out = []
    print(
        f"{'row':44} {'GPUs':>6} {'published':>10} {'predicted':>10} {'ratio':>6}  "
        "comp comm idle  opt  trace"
    )
    with shared_workers():
        for row in rows:
            start = time.perf_counter()
            job_dict = job_for(row)
            try:
                job, timing = predict(job_dict)
            except Exception as exc:  # a row metatrace cannot lay out: say so, go on
                print(f"{row['name']:44} {row['num_gpus']:>6} failed: {exc}")
                out.append({"name": row["name"], "error": str(exc)})
                continue
            pub, how = published_seconds(row, job)
            pred = timing.iteration_seconds
            ratio = pred / pub
            took = time.perf_counter() - start
            b = breakdown(timing)
            shares = [b.compute, b.communication, b.idle, b.optimizer + b.offload]
            parts = " ".join(f"{x / pred:>4.0%}" for x in shares)  # of the predicted time
            print(
                f"{row['name']:44} {row['num_gpus']:>6} {pub:>9.3f}s {pred:>9.3f}s "
                f"{ratio:>6.2f}  {parts}  {took:.0f} s ({how})",
                flush=True,
            )
            moe = bool(job.model.num_experts)
            out.append(
                {
                    "name": row["name"],
                    "moe": moe,
                    "published_s": pub,
                    "predicted_s": pred,
                    "ratio": ratio,
                    "published_from": how,
                    "bubble": timing.bubble_fraction,
                    "breakdown": b.to_json(),
                }
            )
    good = [r for r in out if "ratio" in r]
    for label, pick in (("all", good), ("dense", [r for r in good if not r["moe"]])):
        _summary(label, pick)
    _summary("MoE", [r for r in good if r["moe"]])
    failed = [r["name"] for r in out if "error" in r]
    if failed:
        print(f"failed: {', '.join(failed)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _summary(label: str, rows: list) -> None:
    if not rows:
        return
    errors = [abs(r["ratio"] - 1) for r in rows]
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    print(
        f"{label}: {len(rows)} rows, median |error| {statistics.median(errors):.1%} "
        f"worst {worst['name']} at {worst['ratio']:.2f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
