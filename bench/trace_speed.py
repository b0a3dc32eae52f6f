"""Speed of a whole-cluster trace: Llama-2 70B, tp 8, pp 4 (32 GPUs), seq 4096, micro-batch 1.

Prints the wall time of `metatrace run` (import, trace of every pipeline stage and of the full
model, rendering, JSON) against `python -c "import megatron.core"` on the same machine, their
ratio, the peak RSS of the run, and the trace counts per role. Target: ratio <= 3, RSS < 1.5 GB.
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
CONFIG = os.path.join(ROOT, "examples", "llama2-70b-tp8-pp4.yaml")
RUNS = 3


def timed(args):
    start = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main():
    env_python = sys.executable
    imports = [timed([env_python, "-W", "ignore", "-c", "import megatron.core"]) for _ in range(RUNS)]
    out = os.path.join(tempfile.mkdtemp(), "report.json")
    runs = [
        timed([env_python, "-m", "metatrace", "run", "--config", CONFIG, "--json", out])
        for _ in range(RUNS)
    ]
    rss_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    base, run = statistics.median(imports), statistics.median(runs)
    print(f"python -c 'import megatron.core': {base:.2f} s (median of {RUNS})")
    print(f"metatrace run (llama2-70b tp8 pp4, 32 GPUs): {run:.2f} s (median of {RUNS})")
    print(f"ratio: {run / base:.2f} (target <= 3)")
    print(f"peak RSS of any run: {rss_mib:.0f} MiB (target < 1536)")
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
