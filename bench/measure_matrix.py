"""Predicted against measured memory over a small matrix of configurations (`metatrace measure`).

    python bench/measure_matrix.py [--device cpu|cuda] [--out FILE.jsonl] [--only SUBSTRING]
                                   [--set=--FLAG=VALUE ...]

Each case is a set of Megatron-LM `pretrain_gpt.py` arguments and a world size; the measured
rank is the last one (world size - 1: last pipeline stage, last TP index), as in the cases of
../shared/calibration. For each case it prints the predicted and the measured peak and saved
activations per micro-batch, and the error. `--out` writes one JSON line per case in the
format of ../shared/calibration/megatron_ci_calibration.jsonl (case, hardware, world_size,
args, measured_peak_bytes, family, notes; plus predicted_peak_bytes and the saved activations),
so measurements on a GPU extend the calibration set.

On the CPU (default) only the local layer spec runs, and the figures leave out the cuBLAS
workspaces (GPU only; `hardware` is "cpu" and the note says so). With `--device cuda` the cases
that need Transformer Engine (fused and flash attention, FP8 where the GPU has it) run too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import warnings

BASE = {
    "--num-layers": 4,
    "--hidden-size": 256,
    "--num-attention-heads": 8,
    "--seq-length": 512,
    "--max-position-embeddings": 512,
    "--micro-batch-size": 2,
    "--global-batch-size": 8,
    "--bf16": True,
    "--tokenizer-type": "NullTokenizer",
    "--vocab-size": 4000,
    "--transformer-impl": "local",
}
TE = {"--transformer-impl": "transformer_engine"}
# Mixture of experts on the local spec (SequentialMLP), under Megatron-LM's default of random
# routing: where real choices could not give the assumed counts (the all-gather dispatcher's
# hottest expert, a router dropping tokens) the real map is made to (hooks.patches).
MOE = {
    "--swiglu": True,
    "--disable-bias-linear": True,
    "--num-experts": 4,
    "--moe-router-topk": 2,
    "--moe-ffn-hidden-size": 512,
}
# name: (extra arguments, world size, needs a GPU)
CASES = {
    "tp1": ({}, 1, False),
    "tp2 (one rank)": ({"--tensor-model-parallel-size": 2}, 2, False),
    "tp2 sp": ({"--tensor-model-parallel-size": 2, "--sequence-parallel": True}, 2, False),
    "pp2 last stage": ({"--pipeline-model-parallel-size": 2}, 2, False),
    "full recompute": (
        {
            "--recompute-granularity": "full",
            "--recompute-method": "uniform",
            "--recompute-num-layers": 1,
        },
        1,
        False,
    ),
    "selective recompute": ({"--recompute-granularity": "selective"}, 1, False),
    "dist-opt dp2": ({"--use-distributed-optimizer": True}, 2, False),
    "moe allgather": (MOE, 1, False),
    "moe alltoall ep2": (
        {**MOE, "--expert-model-parallel-size": 2, "--moe-token-dispatcher-type": "alltoall"},
        2,
        False,
    ),
    "moe allgather tp2 ep2": (
        {
            **MOE,
            "--tensor-model-parallel-size": 2,
            "--sequence-parallel": True,
            "--expert-model-parallel-size": 2,
        },
        4,
        False,
    ),
    "moe alltoall ep2 token dropping": (
        {
            **MOE,
            "--expert-model-parallel-size": 2,
            "--moe-token-dispatcher-type": "alltoall",
            "--moe-expert-capacity-factor": 1.0,
        },
        2,
        False,
    ),
    "moe shared experts": ({**MOE, "--moe-shared-expert-intermediate-size": 256}, 1, False),
    "te fused attention": ({**TE, "--attention-backend": "fused"}, 1, True),
    "te flash attention": ({**TE, "--attention-backend": "flash"}, 1, True),
    "te fp8": ({**TE, "--fp8-format": "hybrid"}, 1, True),
    # megatron-core allows moe_act recompute with grouped expert GEMMs only (TEGroupedMLP).
    "te moe moe_act recompute": (
        {
            **TE,
            **MOE,
            "--moe-grouped-gemm": True,
            "--recompute-granularity": "selective",
            "--recompute-modules": "moe_act",
        },
        1,
        True,
    ),
}


def _tokens(args: dict) -> list[str]:
    out = []
    for flag, value in args.items():
        out += [flag] if value is True else [flag, str(value)]
    return out


def run_case(name: str, extra: dict, world: int, device: str, gpu: str) -> dict:
    from metatrace.config.megatron.args import job_from_args
    from metatrace.tracing.measure import measure_rank, predict

    args = {**BASE, **extra}
    job, _ = job_from_args(_tokens(args), world_size=world, gpu=gpu, source=name)
    rank = world - 1
    predicted = predict(job, rank)
    measured = measure_rank(job, rank, iterations=3, device=device)
    cpu = device == "cpu"
    peak = predicted.peak - (predicted.cuda_only if cpu else 0)
    return {
        "case": f"metatrace-measure/{name.replace(' ', '_')}",
        "hardware": "cpu" if cpu else gpu,
        "world_size": world,
        "args": args,
        "measured_peak_bytes": measured.peak_blocks,
        "predicted_peak_bytes": peak,
        "measured_saved_bytes_per_microbatch": measured.saved_blocks,
        "predicted_saved_bytes_per_microbatch": predicted.saved,
        "family": "gpt",
        "notes": (
            "metatrace measure on real CPU tensors, the last rank; peaks in 512-byte blocks, "
            f"without the {predicted.cuda_only:,} bytes of cuBLAS workspaces a GPU allocates"
            if cpu
            else "metatrace measure on the GPU: torch.cuda.max_memory_allocated(), the "
            "last rank, iterations 2 and 3"
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--gpu", default="h100", help="GPU model of the prediction (default h100)")
    parser.add_argument("--out", metavar="FILE", help="write the cases as JSON lines")
    parser.add_argument("--only", metavar="SUBSTRING")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FLAG=VALUE",
        help="override a base argument, e.g. --set=--hidden-size=2048 (repeatable)",
    )
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    import torch

    if opts.device == "cpu":
        torch.set_num_threads(1)
    have_te = importlib.util.find_spec("transformer_engine") is not None
    for item in opts.set:
        flag, _, value = item.partition("=")
        BASE[flag] = int(value) if value.isdigit() else value
    rows = []
    print(f"{'case':<22} {'predicted':>12} {'measured':>12} {'error':>8}   saved/µb pred = meas")
    for name, (extra, world, needs_gpu) in CASES.items():
        if opts.only and opts.only not in name:
            continue
        if needs_gpu and (opts.device == "cpu" or not have_te):
            print(f"{name:<22} skipped: needs Transformer Engine on a GPU")
            continue
        start = time.perf_counter()
        row = run_case(name, extra, world, opts.device, opts.gpu)
        rows.append(row)
        p, m = row["predicted_peak_bytes"], row["measured_peak_bytes"]
        same = (
            row["predicted_saved_bytes_per_microbatch"]
            == row["measured_saved_bytes_per_microbatch"]
        )
        print(
            f"{name:<22} {p:>12,} {m:>12,} {(p - m) / m:>+8.2%}   "
            f"{row['predicted_saved_bytes_per_microbatch']:,} {'=' if same else '!='} "
            f"{row['measured_saved_bytes_per_microbatch']:,}  ({time.perf_counter() - start:.1f} s)"
        )
    if rows:
        errors = sorted(
            abs(r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
            for r in rows
        )
        print(
            f"{len(rows)} cases: largest peak error {errors[-1]:.2%}, "
            f"saved activations equal in {sum(r['predicted_saved_bytes_per_microbatch'] == r['measured_saved_bytes_per_microbatch'] for r in rows)}"
        )
    if opts.out:
        with open(opts.out, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"written to {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
