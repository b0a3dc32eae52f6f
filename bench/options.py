"""What each option modelled since issue 14 changes, on one reference run.

    python bench/options.py [--only SUBSTRING]

The reference is Megatron-LM's functional-test GPT (12 layers, hidden 512, 8 heads, sequence
1,024, micro-batch 4, global batch 32, bf16, Transformer Engine) at tp 2, pp 2 on 8 H100s
(dp 2). Each row traces the run with one option (and what it needs) against the same run
without it, and prints each pipeline stage's predicted peak and the change, with where the peak
is; the optimizer-instance and bucket-padding rows also print the optimizer state and gradient
buffers, the offloading row the PCIe traffic.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

BASE = (
    "--num-layers 12 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 32 --bf16 "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --vocab-file v "
    "--merge-file m"
)
FP8 = " --fp8-format hybrid --fp8-recipe delayed"
MOE = (
    " --num-experts 8 --moe-router-topk 2 --moe-grouped-gemm --sequence-parallel "
    "--disable-bias-linear --moe-token-dispatcher-type alltoall --expert-model-parallel-size 2"
)
DISTOPT = " --use-distributed-optimizer"

# Megatron-LM options modelled since issue 14 (bench/calibration.py lists the cases using them).
NEWLY_COVERED = (
    "--cross-entropy-loss-fusion",
    "--cross-entropy-fusion-impl",
    "--defer-embedding-wgrad-compute",
    "--wgrad-deferral-limit",
    "--num-distributed-optimizer-instances",
    "--moe-permute-fusion",
    "--moe-router-fusion",
    "--use-transformer-engine-op-fuser",
    "--fine-grained-activation-offloading",
    "--offload-modules",
    "--min-offloaded-tensor-size",
    "--fp8-amax-history-len",
    "--ddp-pad-buckets-for-high-nccl-busbw",
    "--deterministic-mode",
    "--tp-comm-overlap",
    "--optimizer-cpu-offload",
    "--optimizer-offload-fraction",
)

# (name, base extra, option extra, gpu)
CASES = (
    (
        "optimizer CPU offload (all of the state on the host)",
        DISTOPT + " --use-precision-aware-optimizer",
        " --optimizer-cpu-offload",
        "h100",
    ),
    (
        "optimizer CPU offload (half of it)",
        DISTOPT + " --use-precision-aware-optimizer",
        " --optimizer-cpu-offload --optimizer-offload-fraction 0.5",
        "h100",
    ),
    (
        "TP overlap with userbuffers (the buffers themselves are outside the allocator)",
        " --sequence-parallel",
        " --tp-comm-overlap",
        "h100",
    ),
    ("fused cross entropy (native, compiled)", "", " --cross-entropy-loss-fusion", "h100"),
    (
        "fused cross entropy (Transformer Engine)",
        "",
        " --cross-entropy-loss-fusion --cross-entropy-fusion-impl te",
        "h100",
    ),
    (
        "deferred embedding wgrad (all micro-batches)",
        "",
        " --defer-embedding-wgrad-compute",
        "h100",
    ),
    (
        "deferred embedding wgrad (limit 2)",
        "",
        " --defer-embedding-wgrad-compute --wgrad-deferral-limit 2",
        "h100",
    ),
    (
        "2 distributed-optimizer instances",
        DISTOPT,
        " --num-distributed-optimizer-instances 2",
        "h100",
    ),
    ("padded DDP buckets", DISTOPT, " --ddp-pad-buckets-for-high-nccl-busbw", "h100"),
    (
        "TE op fuser, bf16",
        " --swiglu --disable-bias-linear",
        " --use-transformer-engine-op-fuser",
        "h100",
    ),
    (
        "TE op fuser, FP8 delayed",
        " --swiglu --disable-bias-linear" + FP8,
        " --use-transformer-engine-op-fuser",
        "h100",
    ),
    ("FP8 amax history 1024", FP8, " --fp8-amax-history-len 1024", "h100"),
    (
        "activation offloading (core_attn, attn_proj)",
        "",
        " --fine-grained-activation-offloading --offload-modules core_attn attn_proj",
        "h100",
    ),
    ("MoE permutation and router fusion", MOE, " --moe-permute-fusion --moe-router-fusion", "h100"),
    ("deterministic mode on A100 (flash attention)", "", " --deterministic-mode", "a100"),
)


@functools.cache  # the base runs repeat between cases
def run(args: str, gpu: str):
    from metatrace.analysis.memory import role_memory, role_offload
    from metatrace.config.megatron.args import job_from_args, split_args
    from metatrace.tracing.trace import trace_job

    job, _ = job_from_args(split_args(args), world_size=8, gpu=gpu)
    jt = trace_job(job, full_model=False)
    return [(rt, role_memory(rt.trace, rt.iteration), role_offload(job, rt)) for rt in jt.roles]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the cases whose name contains this")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    MiB = 2**20
    for name, extra, option, gpu in CASES:
        if args.only and args.only not in name:
            continue
        before, after = run(BASE + extra, gpu), run(BASE + extra + option, gpu)
        print(f"{name}: {option.strip()}")
        for (rt, a, _), (_, b, off) in zip(before, after):
            change = 100 * (b.peak - a.peak) / a.peak
            print(
                f"  stage {rt.role.pp_stage}: {a.peak / MiB:8.1f} -> {b.peak / MiB:8.1f} MiB "
                f"({change:+.2f} %), peak at {b.peak_at.phase} {b.peak_at.module or '(step)'}"
                f"; optimizer {a.optimizer / MiB:.1f} -> {b.optimizer / MiB:.1f}, "
                f"grads {a.grads / MiB:.1f} -> {b.grads / MiB:.1f} MiB"
            )
            if off is not None:
                print(
                    f"           PCIe {off.d2h_per_microbatch / MiB:.1f} MiB each way "
                    f"per micro-batch, {off.d2h_per_iteration / MiB:.1f} per iteration; "
                    f"pinned host {off.pinned_host / MiB:.1f} MiB"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
