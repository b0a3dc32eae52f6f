"""Speed of whole-cluster traces against `python -c "import megatron.core"` on the same machine.

Cases: Llama-2 70B, tp 8, pp 4 (32 GPUs), seq 4096, micro-batch 1 (every pipeline stage, the
full model, one training iteration each); Llama-2 70B on 64 GPUs, tp 8, pp 4, dp 2
(examples/llama2-70b-64gpu.yaml); Llama 3.1 405B on 16,384 GPUs, tp 8, pp 16, vpp 8,
cp 2 (examples/llama3.1-405b-16k.yaml, without the full model); Mixtral 8x7B on 64 GPUs, pp 4,
ep 8 (examples/mixtral-8x7b-64gpu.yaml). Prints the wall time of
`metatrace run` (import, traces, iteration replay, memory and communication tables, JSON), the ratio to the import,
the peak RSS of any process of the run, and the trace counts per role of the first case.
Targets (the 70B case on 32 GPUs): ratio <= 3, RSS < 1.5 GB.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [
    ("llama2-70b tp8 pp4, 32 GPUs", os.path.join(ROOT, "examples", "llama2-70b-tp8-pp4.yaml"), []),
    (
        "llama2-70b tp8 pp4 dp2, 64 GPUs",
        os.path.join(ROOT, "examples", "llama2-70b-64gpu.yaml"),
        [],
    ),
    (
        "llama3.1-405b tp8 pp16 vpp8 cp2, 16,384 GPUs",
        os.path.join(ROOT, "examples", "llama3.1-405b-16k.yaml"),
        ["--no-full-model"],
    ),
    (
        "mixtral-8x7b pp4 ep8, 64 GPUs",
        os.path.join(ROOT, "examples", "mixtral-8x7b-64gpu.yaml"),
        [],
    ),
]
RUNS = 3


def timed(args):
    start = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main():
    env_python = sys.executable
    imports = [
        timed([env_python, "-W", "ignore", "-c", "import megatron.core"]) for _ in range(RUNS)
    ]
    base = statistics.median(imports)
    print(f"python -c 'import megatron.core': {base:.2f} s (median of {RUNS})")
    for name, config, extra in CASES:
        out = os.path.join(tempfile.mkdtemp(), "report.json")
        cmd = [env_python, "-m", "metatrace", "run", "--config", config, "--json", out, *extra]
        run = statistics.median(timed(cmd) for _ in range(RUNS))
        target = " (target <= 3)" if config == CASES[0][1] else ""
        print(
            f"metatrace run ({name}): {run:.2f} s (median of {RUNS}), ratio {run / base:.2f}"
            + target
        )
        if config == CASES[0][1]:
            first = out
    rss_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"peak RSS of any process: {rss_mib:.0f} MiB (target < 1536)")
    out = first
    report = json.load(open(out))
    for role in report["roles"] + [dict(report["full_model"], pp_stage="full")]:
        ops = sum(role["op_counts"].values())
        print(
            f"  stage {role['pp_stage']}: layers {len(role['layers'])}, operators {ops}, "
            f"collectives {len(role['collectives_per_microbatch'])}, modules "
            f"{len(role['modules'])}, trace {role['trace_seconds']:.2f} s"
        )


if __name__ == "__main__":
    main()
