"""Every example job traced under the installed megatron-core, against its golden figures.

    python bench/examples.py [--only TEXT] [--write]
    python bench/examples.py --compare 0.16 0.19

Traces each job of examples/ (the YAML job files and the Megatron-LM scripts) with `metatrace run
--json` and reduces each report to the figures a user acts on (`figures`): per pipeline stage the
peak, parameters, gradients and optimizer state, the micro-batches in flight; the job's
communication per iteration and estimated iteration time. They are compared with
bench/data/examples-<series>.json, the golden figures of the installed megatron-core's series
(0.16, 0.19): a difference is printed and the exit status is 1. `--write` records this run as
the golden figures. `--compare A B` traces nothing: it prints what changes between the two
series' golden figures, example by example (what a team sees when it upgrades).

Tracing every example takes about 7 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "bench", "data")


def examples() -> list[str]:
    """The example jobs: YAML job files and Megatron-LM scripts (not the userbuffers table)."""
    paths = sorted(glob.glob(os.path.join(ROOT, "examples", "*.yaml")))
    paths += sorted(glob.glob(os.path.join(ROOT, "examples", "*.sh")))
    return [p for p in paths if not os.path.basename(p).startswith("userbuffers_")]


def figures(report: dict) -> dict:
    """The figures of a JSON report that golden files hold."""
    stages = []
    for role in report["roles"]:
        m = role.get("memory") or {}
        stages.append(
            {
                key: m.get(key)
                for key in (
                    "peak_bytes",
                    "params_bytes",
                    "grads_bytes",
                    "optimizer_bytes",
                    "activations_bytes",
                    "inflight_microbatches",
                )
            }
        )
    total = report["cluster"]["comm"]["total"]
    return {
        "megatron_core": report.get("megatron_core"),
        "stages": stages,
        "comm_bytes": total["bytes_received"],
        "comm_calls": total["count"],
        "iteration_seconds": round(report["timing"]["iteration_seconds"], 6),
    }


def trace(path: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        done = subprocess.run(
            [sys.executable, "-m", "metatrace", "run", path, "--json", out, "--no-advice"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if done.returncode != 0:
            raise SystemExit(f"{path}: metatrace exited {done.returncode}\n{done.stderr[-2000:]}")
        with open(out) as f:
            return figures(json.load(f))


def series() -> str:
    from metatrace.config import release

    return release.series()


def golden_path(name: str) -> str:
    return os.path.join(DATA, f"examples-{name}.json")


def differences(a: dict, b: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(path, a's value, b's value) wherever the two figures differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in [*a, *(k for k in b if k not in a)]:
            out += differences(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{prefix}[{i}]")
        ]
    return [] if a == b else [(prefix, a, b)]


def change(a, b) -> str:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a:
        return f"{a:,} -> {b:,} ({(b - a) / a * 100:+.2f} %)"
    return f"{a} -> {b}"


def compare(first: str, second: str) -> int:
    with open(golden_path(first)) as f:
        a = json.load(f)
    with open(golden_path(second)) as f:
        b = json.load(f)
    for name in sorted(set(a) | set(b)):
        rows = [d for d in differences(a.get(name), b.get(name)) if d[0] != "megatron_core"]
        print(f"{name}: {'same figures' if not rows else ''}")
        for path, x, y in rows:
            print(f"  {path}: {change(x, y)}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="only the examples whose file name contains TEXT")
    parser.add_argument("--write", action="store_true", help="record the golden figures")
    parser.add_argument("--compare", nargs=2, metavar="SERIES", help="two series' golden figures")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    path = golden_path(series())
    golden = {}
    if os.path.exists(path):
        with open(path) as f:
            golden = json.load(f)
    failed = 0
    for example in examples():
        name = os.path.basename(example)
        if args.only and args.only not in name:
            continue
        got = trace(example)
        rows = differences(golden.get(name), got) if name in golden else []
        status = "new" if name not in golden else "same" if not rows else "DIFFERS"
        print(f"{name:45} {status}")
        for where, x, y in rows:
            print(f"  {where}: {change(x, y)}")
        failed += status == "DIFFERS"
        golden[name] = got
    if args.write:
        with open(path, "w") as f:
            json.dump(golden, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"written {path}")
    return 1 if failed and not args.write else 0


if __name__ == "__main__":
    raise SystemExit(main())
