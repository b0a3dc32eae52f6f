"""Fidelity harness: predicted per-GPU peak memory against measured Megatron runs.

    python bench/calibration.py [--cases DIR] [--only SUBSTRING] [--show-parts]

Reads ../shared/calibration (or --cases): every case of megatron_ci_calibration.jsonl (the
complete pretrain_gpt.py arguments of a Megatron-LM functional test, world size 8, the peak of
`torch.cuda.max_memory_allocated()` on the last rank) and the cases of third_party.jsonl whose
configuration is complete. For each it prints the predicted and measured peak and the error;
cases that use features metatrace does not model yet are listed as "not modelled" with the
reason. At the end: median, 90th percentile and maximum absolute error over the modelled dense
cases, and the signed errors of the mixture-of-experts cases (their runs route by the data;
metatrace assumes the job's routing, by default random top-k routing as at the start of
training).

The prediction is the traced peak of the role holding the measured rank, nothing else: no
per-case or per-dataset factor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CASES = os.path.join(HERE, "..", "..", "shared", "calibration")
MiB = 2**20


def ci_cases(path):
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            yield {
                "name": row["case"],
                "args": row["args"],
                "world_size": row["world_size"],
                "gpu": row["hardware"],
                "env": {k: str(v) for k, v in (row.get("env_vars") or {}).items()},
                "measured": row["measured_peak_bytes"],
                "rank": row["world_size"] - 1,
                "family": row.get("family", "gpt"),
            }


# third_party.jsonl holds published logs, not argument lists: the cases whose configuration is
# complete are written out here as Megatron-LM arguments (what the log states, with Megatron-LM's
# defaults for what it does not), the others say why they cannot be predicted.
THIRD_PARTY = {
    "llama2-70b-shape-tp4-pp4-dp2-local": dict(
        args=(
            "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --seq-length 4096 "
            "--max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 512 "
            "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --bf16 "
            "--transformer-impl local --recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 1 --tokenizer-type NullTokenizer --vocab-size 31999"
        ),
        world_size=32,
        gpu="h100",
        # "ranks 0-3 (first stage)": 47104 MiB; the others shown: 44566 MiB
        measured={0: 47104 * MiB, 31: 44566 * MiB},
        note="vocabulary 32000 (NullTokenizer adds one to --vocab-size in 0.16.1); 96 GB GPUs "
        "(capacity does not enter the peak)",
    ),
}
THIRD_PARTY_SKIPPED = {
    "seed-llama2-7b-dp8": "sequence length and exact dimensions not stated",
    "seed-llama2-7b-tp2-dp4": "sequence length and exact dimensions not stated",
    "seed-llama2-7b-pp2-dp4": "sequence length and exact dimensions not stated",
    "seed-llama2-7b-tp8": "sequence length and exact dimensions not stated",
    "7b-fp8-dp8": "Megatron-LM's legacy (non-mcore) models, core_r0.8.0",
    "gpt2-345m-tp4-sp": "V100 (no bf16, sm70) with TE 1.10 / core_r0.5.0: GPU and versions not modelled",
    "llama3.2-1b-dp8": "Megatron-Bridge recipe: its fusions and defaults are not stated in the log",
}


def third_party_cases(path):
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            spec = THIRD_PARTY.get(row["id"])
            if spec is None:
                yield {
                    "name": row["id"],
                    "skip": THIRD_PARTY_SKIPPED.get(row["id"], "no complete configuration"),
                }
                continue
            for rank, measured in spec["measured"].items():
                yield {
                    "name": f"{row['id']} (rank {rank})",
                    "args": spec["args"],
                    "world_size": spec["world_size"],
                    "gpu": spec["gpu"],
                    "env": {},
                    "measured": measured,
                    "rank": rank,
                    "family": "gpt",
                    "note": spec["note"],
                }


def predict(case):
    """(predicted peak bytes, RoleMemory) or raises NotModelled / ConfigError."""
    from metatrace.analysis.memory import role_memory
    from metatrace.config.megatron.args import job_from_args, not_modelled, split_args
    from metatrace.tracing.trace import trace_role
    from metatrace.world import World

    args = case["args"]
    if isinstance(args, str):
        args = split_args(args)
    args = repo_files_dropped(args)
    reasons = not_modelled(args)
    if reasons:
        raise NotModelled("; ".join(reasons))
    job, _ = job_from_args(
        args, world_size=case["world_size"], gpu=case["gpu"], env=case["env"], source=case["name"]
    )
    world = World.from_job(job)
    role = next(r for r in world.roles() if case["rank"] in r.ranks)
    rt = trace_role(job, world, role)
    return role_memory(rt.trace, rt.iteration)


class NotModelled(Exception):
    pass


REPO_FILES = {"--tp-comm-overlap-cfg": "Transformer Engine's default userbuffers configuration"}
"""Flags naming a file of Megatron-LM's repository (not here), and what runs in its place."""
DROPPED: dict[str, str] = {}


def repo_files_dropped(args):
    """`args` without the flags of REPO_FILES whose file is not here (noted in DROPPED)."""
    if not isinstance(args, dict):
        return args
    missing = [f for f in REPO_FILES if f in args and not os.path.exists(str(args[f]))]
    for flag in missing:
        DROPPED[flag] = f"{args[flag]} is not here: {REPO_FILES[flag]}"
    return {k: v for k, v in args.items() if k not in missing}


def newly_covered(cases, predicted: dict, skipped: dict) -> list[str]:
    """A line per newly modelled option: the cases that use it, their error, or what keeps them
    out of the figures."""
    from options import NEWLY_COVERED  # bench/options.py, beside this script

    lines = []
    for flag in NEWLY_COVERED:
        using = [
            c["name"][:72]
            for c in cases
            if isinstance(c.get("args"), dict) and c["args"].get(flag) not in (None, False)
        ]
        shown = [
            f"{n} {predicted[n]}" if n in predicted else f"{n} (not modelled: {skipped[n][:90]}...)"
            for n in using
        ]
        lines.append(
            f"  {flag}: {len(using)} cases"
            + (": " + "; ".join(shown[:4]) if shown else "")
            + (f"; ... {len(shown) - 4} more" if len(shown) > 4 else "")
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT_CASES, help="calibration directory")
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--show-parts", action="store_true", help="print each peak's parts")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from metatrace.errors import ConfigError

    cases = list(ci_cases(os.path.join(args.cases, "megatron_ci_calibration.jsonl")))
    cases += list(third_party_cases(os.path.join(args.cases, "third_party.jsonl")))
    if args.only:
        cases = [c for c in cases if args.only in c["name"]]
    errors, moe_errors, skipped, inconsistent = [], [], [], []
    predicted = {}
    start = time.perf_counter()
    print(f"{'case':72} {'predicted':>10} {'measured':>10} {'error':>8}")
    for case in cases:
        name = case["name"][:72]
        if "skip" in case:
            skipped.append((name, case["skip"]))
            continue
        try:
            m = predict(case)
        except (NotModelled, ConfigError) as e:
            skipped.append((name, str(e)))
            continue
        measured = case["measured"]
        err = (m.peak - measured) / measured
        predicted[name] = f"{100 * err:+.2f}%"
        static = m.params + m.grads + m.optimizer
        print(f"{name:72} {m.peak / MiB:10.1f} {measured / MiB:10.1f} {100 * err:+7.2f}%")
        if static > measured:
            # No prediction can be right: the stated configuration's parameters, gradient
            # buffers and optimizer state alone exceed what was measured.
            inconsistent.append((name, static))
        elif case["family"] == "gpt":
            errors.append(abs(err))
        elif case["family"] == "moe":
            moe_errors.append(err)
        if args.show_parts:
            print(
                f"{'':8}params {m.params / MiB:.1f}  grads {m.grads / MiB:.1f}  optimizer "
                f"{m.optimizer / MiB:.1f}  workspaces {m.workspaces / MiB:.1f}  activations "
                f"{m.activations / MiB:.1f} ({m.inflight} µb)  temporary {m.temporary / MiB:.1f}  "
                f"at {m.peak_at.phase} µb {m.peak_at.microbatch} {m.peak_at.module}"
            )
    if inconsistent:
        print(
            "\nleft out of the figures below, the configuration as stated cannot be what was measured:"
        )
        for name, static in inconsistent:
            print(
                f"  {name}: parameters, gradients and optimizer state alone need "
                f"{static / MiB:.0f} MiB"
            )
    if skipped:
        print("\nnot modelled:")
        for name, reason in skipped:
            print(f"  {name}: {reason}")
    for flag, what in DROPPED.items():
        print(f"\n{flag} {what}")
    print("\nnewly modelled options in these cases:")
    print("\n".join(newly_covered(cases, predicted, dict(skipped))))
    if errors:
        errors.sort()
        p90 = errors[min(len(errors) - 1, round(0.9 * (len(errors) - 1)))]
        print(
            f"\n{len(errors)} dense cases: median |error| {100 * statistics.median(errors):.2f}%, "
            f"90th percentile {100 * p90:.2f}%, max {100 * errors[-1]:.2f}%  "
            f"({time.perf_counter() - start:.0f} s)"
        )
    if moe_errors:
        # Dropless routing in these runs: the prediction assumes random top-k routing (the
        # hottest expert's expected load on every rank); signed errors show on which side.
        print(
            f"{len(moe_errors)} MoE cases (random top-k routing assumed): signed errors "
            + ", ".join(f"{100 * e:+.2f}%" for e in sorted(moe_errors))
            + f"; median |error| {100 * statistics.median(abs(e) for e in moe_errors):.2f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
