"""Device memory of megatron-core running for real on one GPU: the allocator's reserve and what
lives outside it, beside the allocated peak.

    python bench/device_memory.py --device cuda --json FILE [--traces FILE.npz] [--only S]
    python bench/device_memory.py [--measured bench/data/h200_device_memory.json] [--only S]

Each case is a one-GPU job on megatron-core's local layer spec (no Transformer Engine or Apex;
the optimizer is metatrace's stand-in for TE's FusedAdam, or torch's foreach AdamW where the case
sets training.optimizer_impl: torch), run in a process of its own as a training process runs: `metatrace measure`'s model and optimizer, its counted micro-batch and three iterations,
under the case's PYTORCH_CUDA_ALLOC_CONF. Per case it stores torch.cuda.max_memory_allocated(),
max_memory_reserved(), the allocator's statistics, the device's use from
torch.cuda.mem_get_info() (right after the CUDA context exists, after the first GEMM, at the
end), the iteration time, and the allocator's own trace of the run
(torch.cuda.memory._record_memory_history: every request, free and segment, reduced to
arrays) for testing an allocator model against the real one without a GPU. The host's cost per
PyTorch operator, view, kernel launch, module and backward operator is measured once
(bench/host_overhead.py --device cuda), into the JSON and bench/data/GPU_host_overhead.json.

Without a GPU, it prints the prediction of each case against the stored measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time import BASE, GPT_1B, GQA_128K, LLAMA_LIKE, MOE, merged

TINY = merged(  # step_time's Llama-like layers, small enough for a test's stored allocator trace
    LLAMA_LIKE,
    {
        "model": {
            "num_layers": 4,
            "hidden_size": 1024,
            "ffn_hidden_size": 2816,
            "num_attention_heads": 16,
            "max_position_embeddings": 1024,
        },
        "training": {"seq_length": 1024, "micro_batch_size": 2, "global_batch_size": 8},
    },
)
# fine-grained experts: step_time's MoE with 16 experts of a small FFN, top 4
MOE_FINE = merged(
    MOE, {"model": {"num_experts": 16, "moe_ffn_hidden_size": 1024, "moe_router_topk": 4}}
)
GQA_128K = merged(GQA_128K, {"model": {"num_layers": 4}})  # step_time's, 4 layers
EXPANDABLE = "expandable_segments:True"
FULL = {"training": {"recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}}}
# name: (model, changes, PYTORCH_CUDA_ALLOC_CONF)
CASES = {
    "tiny": (TINY, {}, ""),
    "tiny, expandable": (TINY, {}, EXPANDABLE),
    "tiny, max split 64 MiB": (TINY, {}, "max_split_size_mb:64,roundup_power2_divisions:4"),
    "gpt 1.3b, mbs 4": (GPT_1B, {}, ""),
    "gpt 1.3b, mbs 4, expandable": (GPT_1B, {}, EXPANDABLE),
    "gpt 1.3b, selective recompute": (
        GPT_1B,
        {"training": {"recompute": {"granularity": "selective"}}},
        "",
    ),
    "gpt 1.3b, full recompute": (GPT_1B, FULL, ""),
    # megatron-core's fallback without TE and Apex: torch's foreach AdamW (as the GPU machine
    # runs it); the cases above run the fused stand-in's step
    "gpt 1.3b, full recompute, torch adamw": (
        GPT_1B,
        merged(FULL, {"training": {"optimizer_impl": "torch"}}),
        "",
    ),
    "llama-like h4096, s8192, full recompute": (
        LLAMA_LIKE,
        merged(
            FULL, {"training": {"seq_length": 8192}, "model": {"max_position_embeddings": 8192}}
        ),
        "",
    ),
    "moe 16x top4, local experts": (MOE_FINE, {}, ""),
    "moe 16x top4, local experts, expandable": (MOE_FINE, {}, EXPANDABLE),
    "gqa, vocab 128k, s8192": (GQA_128K, {}, ""),
}
PROFILED = ("moe 16x top4, local experts", "gqa, vocab 128k, s8192")
ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
)


def job_dict(name: str, gpu: str) -> dict:
    model, extra, conf = CASES[name]
    cluster = {
        "cluster": {"gpu": gpu, "num_gpus": 1, "gpus_per_node": 1, "allocator_conf": conf or None}
    }
    return merged(BASE, model, extra, cluster, {"training": {"precision": "bf16"}})


def used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def reduced_trace(snapshot) -> dict:
    """The allocator's trace as arrays: action (index in ACTIONS), address, size (the request
    for alloc, the block's for frees, the segment's for segment events), stream."""
    import numpy as np

    entries = snapshot["device_traces"][0]
    return {
        "action": np.array([ACTIONS.index(e["action"]) for e in entries], dtype=np.int8),
        "addr": np.array([e["addr"] for e in entries], dtype=np.int64),
        "size": np.array([e["size"] for e in entries], dtype=np.int64),
        "stream": np.array([e["stream"] for e in entries], dtype=np.int64),
    }


def run_one(name: str, gpu: str, out: str, trace_file: str | None) -> None:
    """Measure one case in this (fresh) process; write its row to `out`."""
    import torch

    row: dict = {"case": name, "alloc_conf": CASES[name][2], "job": job_dict(name, gpu)}
    row["device_context"] = used()  # mem_get_info made the CUDA context, nothing allocated
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    del a
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    row["device_after_first_gemm"] = used()
    from metatrace.config import job_from_dict, resolve
    from metatrace.tracing.measure import measure_rank

    job = resolve(job_from_dict(job_dict(name, gpu)))
    if trace_file:
        torch.cuda.memory._record_memory_history(context=None, stacks="python")
    start = time.perf_counter()
    measured = measure_rank(job, 0, iterations=3, device="cuda")
    row["wall_s"] = time.perf_counter() - start
    if trace_file:
        import numpy as np

        np.savez(trace_file, **reduced_trace(torch.cuda.memory._snapshot()))
        torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats()
    row.update(
        measured_peak_bytes=measured.peak,
        measured_s=measured.seconds,
        max_reserved=measured.reserved,
        device_used=measured.device_used,
        device_before=measured.device_before,
        reserved_end=torch.cuda.memory_reserved(),
        device_total=torch.cuda.mem_get_info()[1],
        stats={
            k: v
            for k, v in stats.items()
            if k.startswith(("num_", "max_split", "segment.", "inactive_split"))
            or k.endswith((".all.peak", ".all.current"))
        },
    )
    if name in PROFILED:
        from step_time import profiled

        row["profile"] = profiled(job)
        row["profile"]["by_name"] = row["profile"]["by_name"][:40]
    with open(out, "w") as f:
        json.dump(row, f)


def host_costs() -> dict:
    """The host's cost per PyTorch operator, view, launch, module and backward operator on this
    machine's CPU driving its GPU (bench/host_overhead.py --device cuda: CUDA tensors of small
    shapes, timed on the host, each operator's GPU time beside it), and per synchronisation."""
    import host_overhead

    return {**host_overhead.described("cuda"), **host_overhead.measure("cuda")}


def nccl_one_rank() -> dict:
    """Device bytes a one-rank NCCL communicator takes: at creation and after its first
    all-reduce (mem_get_info before and after; nothing else runs)."""
    import torch
    import torch.distributed as dist

    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    before = used()
    dist.init_process_group(
        "nccl",
        init_method="tcp://127.0.0.1:29517",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    torch.cuda.synchronize()
    created = used()
    dist.all_reduce(x)
    torch.cuda.synchronize()
    reduced = used()
    dist.destroy_process_group()
    return {"created": created - before, "after_all_reduce": reduced - before}


def measure_all(args) -> int:
    import numpy as np
    import torch

    gpu = args.gpu or detected_gpu()
    result = {
        "gpu": gpu,
        "device": f"{torch.cuda.get_device_name()}, torch {torch.__version__}",
        "nvidia_smi_before": subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used,memory.total,driver_version", "--format=csv"],
            capture_output=True,
            text=True,
        ).stdout,
        "rows": [],
    }
    traces = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(n for n in CASES if args.only in n):
            out, trace = os.path.join(tmp, f"{i}.json"), os.path.join(tmp, f"{i}.npz")
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=CASES[name][2])
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, __file__, "--one", name, "--gpu", gpu, "--out", out]
                + (["--trace", trace] if args.traces else []),
                env=env,
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            took = time.perf_counter() - start
            if proc.returncode or not os.path.exists(out):
                row = {"case": name, "error": proc.stderr[-3000:]}
            else:
                with open(out) as f:
                    row = json.load(f)
                if args.traces and os.path.exists(trace):
                    with np.load(trace) as z:
                        traces.update({f"{name}|{k}": z[k] for k in z.files})
            row["process_s"] = took
            result["rows"].append(row)
            print(
                f"{name:42} {took:5.1f} s  "
                + (
                    f"allocated {row['measured_peak_bytes'] / 1e9:6.2f} GB  "
                    f"reserved {row['max_reserved'] / 1e9:6.2f} GB  "
                    f"device {row['device_used'] / 1e9:6.2f} GB  "
                    f"context {row['device_context'] / 1e9:.2f} GB  "
                    f"iteration {row['measured_s']:.3f} s"
                    if "error" not in row
                    else "failed: " + row["error"].strip().splitlines()[-1]
                ),
                flush=True,
            )
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    try:
        host = host_costs()
        # The measurement that replaces config/host.py's constants (docs/figures.md).
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
        with open(os.path.join(path, f"{gpu}_host_overhead.json"), "w") as f:
            json.dump(host, f, indent=1)
    except Exception as e:
        host = {"error": repr(e)}
    result["host_overhead"] = host
    try:
        result["nccl_one_rank"] = nccl_one_rank()
    except Exception as e:
        result["nccl_one_rank"] = {"error": repr(e)}
    print("NCCL, one rank:", result["nccl_one_rank"], flush=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.traces:
        np.savez_compressed(args.traces, **traces)
    return 0


def detected_gpu() -> str:
    from step_time import detected_gpu as detect

    return detect()


def compare(args) -> int:
    """The prediction of each case (allocated peak, the simulated allocator's reserve, the
    device's use: the reserve and the CUDA context, the fake world running no NCCL) against the
    stored measurement where there is one (no GPU needed)."""
    from metatrace.config import job_from_dict, resolve
    from metatrace.tracing.measure import predicted
    from metatrace.tracing.trace import trace_job

    stored: dict = {}
    gpu = args.gpu or "h200"
    if os.path.exists(args.measured):
        with open(args.measured) as f:
            data = json.load(f)
        stored = {r["case"]: r for r in data["rows"] if "error" not in r}
        gpu = args.gpu or data["gpu"]
    else:
        print(f"{args.measured}: no stored measurements; predictions only")
    print(
        f"{'case':42} {'allocated GiB':>17} {'error':>7}  {'reserved GiB':>17} {'error':>7}  "
        f"{'device GiB (no NCCL)':>17} {'error':>7}"
    )

    def pair(p: float, m: float | None) -> str:
        return (
            f"{p / 2**30:8.2f} {m / 2**30:8.2f} {(p - m) / m:+7.2%}"
            if m
            else f"{p / 2**30:8.2f} {'-':>8} {'-':>7}"
        )

    for name in CASES:
        if args.only not in name:
            continue
        job = resolve(job_from_dict(job_dict(name, gpu)))
        p = predicted(job, trace_job(job, full_model=False).roles[0])
        row = stored.get(name, {})
        print(
            f"{name:42} {pair(p.peak, row.get('measured_peak_bytes'))}  "
            f"{pair(p.reserved, row.get('max_reserved'))}  "
            f"{pair(p.device, row.get('device_used'))}",
            flush=True,
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--gpu", help="GPU of the jobs (default: the one found)")
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument("--json", help="with --device cuda: write the measurements here")
    parser.add_argument("--traces", help="with --device cuda: the allocator traces (.npz)")
    parser.add_argument(
        "--measured", default="bench/data/h200_device_memory.json", help="stored measurements"
    )
    parser.add_argument("--timeout", type=float, default=150, help="seconds per case")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--trace", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if args.one:
        run_one(args.one, args.gpu, args.out, args.trace)
        return 0
    if args.device == "cuda":
        if not args.json:
            parser.error("--device cuda needs --json FILE")
        return measure_all(args)
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
