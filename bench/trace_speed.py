"""Speed of whole-cluster traces against `python -c "import megatron.core"` on the same machine.

    python bench/trace_speed.py [--runs N] [--only TEXT]

Cases (issue 20's targets in brackets): Llama-2 70B, tp 8, pp 4, 32 GPUs, full model included
(examples/llama2-70b-tp8-pp4.yaml) [ratio <= 1.3]; Llama-2 70B on 64 GPUs, dp 2
(examples/llama2-70b-64gpu.yaml); Llama 3.1 405B on 16,384 GPUs, tp 8, pp 16, vpp 8, cp 2,
without the full model (examples/llama3.1-405b-16k.yaml) [<= 1.5]; DeepSeek-V3 on 2,048 GPUs
without the full model (examples/deepseek-v3-2048gpu.yaml) [<= 2]; Mixtral 8x7B on 64 GPUs,
pp 4, ep 8 (examples/mixtral-8x7b-64gpu.yaml); `metatrace plan` for Llama-2 70B on 256 H100s
[under 20 s]; `metatrace plan` for Qwen3-30B-A3B on 16 H100s and DeepSeek-V3 on 1,024 H100s [under
30 s each]; `metatrace groups` of the 70B job (traces nothing); the README's out-of-memory
examples with the changes their advice traces [under 30 s each on 2 cores]. Prints each command's wall
time (median of --runs), its ratio to the import, and the peak RSS of its processes; then the
trace counts per role of the first case.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example(name: str) -> str:
    return os.path.join(ROOT, "examples", name)


CASES = [
    (
        "llama2-70b tp8 pp4, 32 GPUs",
        "1.3",
        ["run", "--config", _example("llama2-70b-tp8-pp4.yaml")],
    ),
    ("llama2-70b tp8 pp4 dp2, 64 GPUs", "", ["run", "--config", _example("llama2-70b-64gpu.yaml")]),
    (
        "llama3.1-405b tp8 pp16 vpp8 cp2, 16,384 GPUs",
        "1.5",
        ["run", "--config", _example("llama3.1-405b-16k.yaml"), "--no-full-model"],
    ),
    (
        "deepseek-v3, 2,048 GPUs",
        "2",
        # out of memory by 33 GiB: its advice (several traces more) is not what this times
        ["run", "--config", _example("deepseek-v3-2048gpu.yaml"), "--no-full-model", "--no-advice"],
    ),
    ("mixtral-8x7b pp4 ep8, 64 GPUs", "", ["run", "--config", _example("mixtral-8x7b-64gpu.yaml")]),
    (
        "plan llama2-70b, 256 H100s",
        "20 s",
        [
            "plan",
            "--model",
            "llama2-70b",
            "--num-gpus",
            "256",
            "--gpu",
            "h100",
            "--seq",
            "4096",
            "--global-batch",
            "512",
        ],
    ),
    # Issue 44: plans of mixture-of-experts models [under 30 s each on 2 cores].
    (
        "plan qwen3-30b-a3b, 16 H100s",
        "30 s",
        ["plan", "--model", "qwen3-30b-a3b", "--num-gpus", "16", "--gpu", "h100"]
        + ["--seq", "4096", "--global-batch", "256"],
    ),
    (
        "plan deepseek-v3, 1,024 H100s",
        "30 s",
        ["plan", "--model", "deepseek-v3", "--num-gpus", "1024", "--gpu", "h100"]
        + ["--seq", "4096", "--global-batch", "4096"],
    ),
    ("groups llama2-70b, 32 GPUs", "", ["groups", "--config", _example("llama2-70b-tp8-pp4.yaml")]),
]
# Issue 44: the README's out-of-memory examples, each with its advice (the changes that make it
# fit, traced) [under 30 s on 2 cores].
ADVICE = [
    (
        "advice: llama3-8b fp8, 8 H100s",
        "30 s",
        ["run", "--config", _example("llama3-8b-h100-fp8.yaml")],
    ),
    (
        "advice: llama3-70b fsdp offload fp8, 64 GB200s",
        "30 s",
        ["run", "--config", _example("llama3-70b-gb200-fsdp-offload-fp8.yaml")],
    ),
    (
        "advice: llama2-7b script mbs 8, 16 H100s",
        "30 s",
        ["run", _example("pretrain_llama2_7b_mbs8.sh")],
    ),
]


def timed(args) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB of the process and the children it waited for)."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(args)}")
    return seconds, usage.ru_maxrss / 1024


def _print_advice(path: str) -> None:
    """The changes a report's advice lists (those that fit, with their traced peak)."""
    with open(path) as f:
        advice = json.load(f).get("advice")
    if not advice:
        return
    traced = [c for c in advice["changes"] if c["traced"]]
    print(f"  {len(traced)} traced changes fit ({len(advice['misses'])} traced do not):")
    for c in advice["changes"]:
        mark = " (within the error band)" if c["within_error_band"] else ""
        print(f"    {c['change']}: peak {c['highest_peak_bytes'] / 2**30:.2f} GiB{mark}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="runs per command (median)")
    parser.add_argument("--only", help="cases whose name contains this")
    args = parser.parse_args()
    python = sys.executable
    imports = [timed([python, "-W", "ignore", "-c", "import megatron.core"])[0] for _ in range(3)]
    base = statistics.median(imports)
    print(f"python -c 'import megatron.core': {base:.2f} s (median of 3)")
    first = None
    for name, target, argv in CASES + ADVICE:
        if args.only and args.only not in name:
            continue
        out = os.path.join(tempfile.mkdtemp(), "report.json")
        cmd = [python, "-m", "metatrace", *argv] + (["--json", out] if argv[0] != "groups" else [])
        runs = [timed(cmd) for _ in range(args.runs)]
        wall = statistics.median(r[0] for r in runs)
        rss = max(r[1] for r in runs)
        goal = f" (target {'<= ' if 's' not in target else 'under '}{target})" if target else ""
        print(
            f"{name:<46} {wall:7.2f} s  ratio {wall / base:5.2f}{goal:<17} peak RSS {rss:6.0f} MiB",
            flush=True,
        )
        if first is None and argv[0] == "run":
            first = out
        if argv[0] == "run":
            _print_advice(out)
    if first is None:
        return
    with open(first) as f:
        report = json.load(f)
    print("first case, per role:")
    full = [dict(report["full_model"], pp_stage="full")] if report.get("full_model") else []
    for role in report["roles"] + full:
        ops = sum(role["op_counts"].values())
        print(
            f"  stage {role['pp_stage']}: layers {len(role['layers'])}, operators {ops}, "
            f"collectives {len(role['collectives_per_microbatch'])}, modules "
            f"{len(role['modules'])}, trace {role['trace_seconds']:.2f} s"
        )


if __name__ == "__main__":
    main()
