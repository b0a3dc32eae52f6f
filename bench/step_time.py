"""Predicted against measured iteration time of megatron-core running for real on one GPU.

    python bench/step_time.py [--device cuda|cpu] [--gpu NAME] [--only SUBSTRING] [--json FILE]
                              [--profile] [--measured FILE]

Each case is a one-GPU job (no communication: the time model's kernels and optimizer step
alone) on megatron-core's local layer spec, which runs without Transformer Engine or Apex. The
prediction is `metatrace run`'s iteration time for the job on `--gpu` (default: the GPU found,
h100 or h200); the measurement is `metatrace measure`'s: the job's model and optimizer built
for real, whole iterations timed from one synchronisation to the next (the median after the
first), and the peak memory against torch.cuda.max_memory_allocated(). Megatron's fusions are
off on both sides (Apex's fused softmax and gradient-accumulation fusion; the torch.compile'd
bias-activation and bias-dropout-add, which a measured run would execute as metatrace's eager
stand-ins), so that the run executes the PyTorch operators the prediction prices one by one.

On the CPU (`--device cpu`) the prediction is printed, against the measurements of an earlier
GPU run with `--measured FILE` (bench/data/h200_step_time.json: an H200, 2026-11-28).
`--profile` also runs each case under the PyTorch profiler and gives the GPU's own kernel time
of the last iteration: where the measured iteration takes longer, the host did not keep the GPU
busy. The prediction's host line: the kernels one iteration launches, its synchronisations,
the host's work and how long the GPU waits for it (metatrace.config.host); the profile's kernel
count is the measured counterpart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
import warnings

# The local spec as Megatron-LM runs it without Apex and Transformer Engine.
BASE = {
    "implementation": {
        "transformer_impl": "local",
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
    },
    "training": {"gradient_accumulation_fusion": False},
}
GPT_1B = {  # GPT-3 XL-like: 24 layers, h 2048, 16 heads, learned positions, GeLU with biases
    "model": {
        "num_layers": 24,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "vocab_size": 50257,
        "max_position_embeddings": 2048,
    },
    "training": {"seq_length": 2048, "micro_batch_size": 4, "global_batch_size": 32},
}
LLAMA_LIKE = {  # 8 layers of a 7B-like model: h 4096, SwiGLU, RMSNorm, RoPE, no biases
    "model": {
        "num_layers": 8,
        "hidden_size": 4096,
        "ffn_hidden_size": 11008,
        "num_attention_heads": 32,
        "vocab_size": 32000,
        "position_embedding_type": "rope",
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": True,
        "max_position_embeddings": 4096,
    },
    "training": {"seq_length": 4096, "micro_batch_size": 1, "global_batch_size": 8},
}
MOE = {  # 8 experts, top 2, on the local spec (one MLP per expert)
    "model": {
        "num_layers": 8,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "vocab_size": 32000,
        "position_embedding_type": "rope",
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "add_bias_linear": False,
        "num_experts": 8,
        "moe_ffn_hidden_size": 4096,
        "moe_router_topk": 2,
        "max_position_embeddings": 4096,
    },
    "training": {"seq_length": 4096, "micro_batch_size": 2, "global_batch_size": 16},
}
FINE_MOE = {  # 16 small experts (FFN 512), top 4, the alltoall dispatcher on one GPU
    "model": {
        "num_layers": 8,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "vocab_size": 32000,
        "position_embedding_type": "rope",
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "add_bias_linear": False,
        "num_experts": 16,
        "moe_ffn_hidden_size": 512,
        "moe_router_topk": 4,
        "max_position_embeddings": 4096,
    },
    "parallel": {"moe_token_dispatcher_type": "alltoall"},
    "training": {"seq_length": 4096, "micro_batch_size": 1, "global_batch_size": 16},
}
GQA_128K = {  # Llama 3-like: 8 layers, h 4096, 8 KV groups, a 128k vocabulary
    "model": {
        "num_layers": 8,
        "hidden_size": 4096,
        "ffn_hidden_size": 14336,
        "num_attention_heads": 32,
        "num_query_groups": 8,
        "vocab_size": 128256,
        "position_embedding_type": "rope",
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": True,
        "max_position_embeddings": 8192,
    },
    "training": {"seq_length": 8192, "micro_batch_size": 1, "global_batch_size": 8},
}
CASES = {
    "gpt 1.3b, mbs 4": (GPT_1B, {}),
    "gpt 1.3b, mbs 1": (GPT_1B, {"training": {"micro_batch_size": 1}}),
    "gpt 1.3b, selective recompute": (
        GPT_1B,
        {"training": {"recompute": {"granularity": "selective"}}},
    ),
    "gpt 1.3b, full recompute": (
        GPT_1B,
        {"training": {"recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}}},
    ),
    "gpt 1.3b, mbs 2": (GPT_1B, {"training": {"micro_batch_size": 2}}),
    "llama-like h4096, s4096": (LLAMA_LIKE, {}),
    "llama-like h4096, mbs 2": (LLAMA_LIKE, {"training": {"micro_batch_size": 2}}),
    "moe 8x top2, local experts": (MOE, {}),
    # Not yet measured on a GPU (issue 43): the host's share where kernels are many and small,
    # and a large vocabulary's output layer and loss.
    "moe 16x top4 ffn512, alltoall": (FINE_MOE, {}),
    "gqa 8 groups, vocab 128k, s8192": (GQA_128K, {}),
}


def merged(*dicts: dict) -> dict:
    out: dict = {}
    for d in dicts:
        for key, value in d.items():
            out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def job_dict(name: str, gpu: str) -> dict:
    model, extra = CASES[name]
    cluster = {"cluster": {"gpu": gpu, "num_gpus": 1, "gpus_per_node": 1}}
    return merged(BASE, model, extra, cluster, {"training": {"precision": "bf16"}})


def predict(job):
    """(iteration seconds, their breakdown, the peak bytes, the host's side) of the one-GPU
    job, from one trace."""
    from metatrace.analysis.timing import breakdown, job_timing
    from metatrace.tracing.measure import predicted
    from metatrace.tracing.trace import trace_job

    traced = trace_job(job, full_model=False)
    timing = job_timing(traced)
    peak = predicted(job, traced.roles[0]).peak
    return timing.iteration_seconds, breakdown(timing), peak, timing.host


def profiled(job) -> dict:
    """One measured run under the PyTorch profiler: the kernels of the last iteration (its
    wall time, the GPU's busy time, and the kernels by name)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from metatrace.tracing.measure import measure_rank

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        measure_rank(job, 0, iterations=2, device="cuda")
    events = prof.profiler.kineto_results.events()
    marks = sorted(
        e.start_ns() for e in events if e.name() == "metatrace.tracing.measure.iteration"
    )
    kernels = sorted(
        (e.start_ns(), e.duration_ns(), e.name())
        for e in events
        # on the GPU's timeline the profiler also shows the iteration's range: not a kernel
        if e.device_type() == DeviceType.CUDA
        and e.start_ns() >= marks[-1]
        and not e.name().startswith("metatrace.")
    )
    busy, end = 0, 0
    for start, dur, _ in kernels:
        busy += max(0, start + dur - max(start, end))
        end = max(end, start + dur)
    names: dict = {}
    for _, dur, name in kernels:
        total, count = names.get(name, (0, 0))
        names[name] = (total + dur, count + 1)
    return {
        "wall_s": (end - marks[-1]) / 1e9,
        "busy_s": busy / 1e9,
        "kernel_s": sum(d for _, d, _ in kernels) / 1e9,
        "kernels": len(kernels),
        "by_name": sorted(
            ([name, t / 1e9, n] for name, (t, n) in names.items()), key=lambda r: -r[1]
        ),
    }


def detected_gpu() -> str:
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    for gpu in ("h200", "h100", "a100", "b200", "gb200"):
        if gpu in name.lower():
            return gpu
    return "h100"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="where to measure (default: cuda if there is one)"
    )
    parser.add_argument("--gpu", help="GPU of the prediction (default: the one found, or h100)")
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument(
        "--measured",
        metavar="FILE",
        help="with --device cpu: compare with the measurements in FILE (a --json of a GPU run, "
        "e.g. bench/data/h200_step_time.json)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile each case's last iteration: the GPU's busy time and the kernels",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch reads it
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.measured and args.device == "cuda":
        parser.error("--measured compares with an earlier run: use it with --device cpu")
    from metatrace.config import job_from_dict, resolve
    from metatrace.tracing.measure import measure_rank

    stored = {}
    if args.measured:
        with open(args.measured) as f:
            data = json.load(f)
        stored = {r["case"]: r for r in data["rows"]}
    gpu = args.gpu or (data["gpu"] if args.measured else detected_gpu())
    rows = []
    print(
        f"{'case':32} {'predicted':>9} {'measured':>9} {'ratio':>6}  "
        f"{'peak GiB':>8} {'measured':>8} {'error':>7}  where it goes (predicted)"
    )
    for name in CASES:
        if args.only not in name:
            continue
        job = resolve(job_from_dict(job_dict(name, gpu)))
        start = time.perf_counter()
        seconds, terms, peak, host = predict(job)
        traced = time.perf_counter() - start
        measured = None
        if args.device == "cuda":
            measured = measure_rank(job, 0, iterations=4, device="cuda")
        elif name in stored:
            measured = types.SimpleNamespace(
                seconds=stored[name]["measured_s"], peak=stored[name]["measured_peak_bytes"]
            )
        shares = ", ".join(
            f"{label} {value / seconds:.0%}"
            for label, value in terms.terms()
            if value >= 0.005 * seconds
        )
        time_cols = (
            f"{measured.seconds:9.3f} {seconds / measured.seconds:6.3f}"
            if measured
            else f"{'-':>9} {'-':>6}"
        )
        peak_cols = (
            f"{measured.peak / 2**30:8.2f} {(peak - measured.peak) / measured.peak:+7.2%}"
            if measured
            else f"{'-':>8} {'-':>7}"
        )
        print(
            f"{name:32} {seconds:9.3f} {time_cols}  {peak / 2**30:8.2f} {peak_cols}  {shares} "
            f"(traced in {traced:.1f} s)",
            flush=True,
        )
        if host is not None:
            print(
                f"{'':32} host: {host.kernels:,} kernels, {host.syncs:,} synchronisation(s), "
                f"{host.seconds:.3f} s of host work; the GPU waits {host.wait_seconds:.3f} s",
                flush=True,
            )
        profile = profiled(job) if args.profile and args.device == "cuda" else None
        profile = profile or stored.get(name, {}).get("profile")
        if profile:
            print(
                f"{'':32} profiled: the GPU's kernels took {profile['kernel_s']:.3f} s "
                f"(predicted / kernels {seconds / profile['kernel_s']:.3f}), "
                f"{profile['kernels']:,} kernels",
                flush=True,
            )
        rows.append(
            {
                "profile": profile,
                "case": name,
                "gpu": gpu,
                "job": job_dict(name, gpu),
                "predicted_s": seconds,
                "measured_s": measured.seconds if measured else None,
                "predicted_peak_bytes": peak,
                "measured_peak_bytes": measured.peak if measured else None,
                "breakdown": terms.to_json(),
                "host": host.to_json() if host is not None else None,
            }
        )
    measured_rows = [r for r in rows if r["measured_s"]]
    if measured_rows:
        ratios = [r["predicted_s"] / r["measured_s"] for r in measured_rows]
        errors = sorted(abs(x - 1) for x in ratios)
        print(
            f"{len(ratios)} cases: predicted / measured {min(ratios):.3f}-{max(ratios):.3f}, "
            f"median |error| {statistics.median(errors):.1%}; peaks "
            + ", ".join(
                f"{(r['predicted_peak_bytes'] - r['measured_peak_bytes']) / r['measured_peak_bytes']:+.2%}"
                for r in measured_rows
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
