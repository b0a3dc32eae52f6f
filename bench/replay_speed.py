"""Speed of the replayed iteration against the micro-batch count: examples/debug.yaml (tp 2, pp 2)
and a MoE variant of it (4 experts, top-2, ep 2, dp 2) with 1,000, 10,000 and 100,000
micro-batches, traced and analysed (metatrace.analysis.analyze).
Prints the wall time of the trace (the steady-state extension, iteration.replayed_iteration) and of
the analysis, and every stage's peak; with --full also the whole replay's time and peaks, which
must be the same peaks (1,000 and 10,000 micro-batches: the whole replay of 100,000 takes many
minutes)."""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


MOE = {
    "model": {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 96},
    "parallel": {"tp": 1, "pp": 2, "ep": 2},
    "cluster": {"num_gpus": 8, "gpus_per_node": 8},
}


def run(microbatches: int, extend, moe: bool = False):
    import yaml

    from metatrace.analysis.analyze import analyze
    from metatrace.config import job_from_dict
    from metatrace.records import JobTrace
    from metatrace.tracing.trace import trace_role
    from metatrace.world import World

    with open(os.path.join(ROOT, "examples", "debug.yaml")) as f:
        data = yaml.safe_load(f)
    for section, values in (MOE if moe else {}).items():
        data[section].update(values)
    dp = 4 if moe else 1
    data["training"]["global_batch_size"] = 2 * dp * microbatches
    job = job_from_dict(data)
    world = World.from_job(job)
    start = time.perf_counter()
    roles = tuple(trace_role(job, world, r, extend=extend) for r in world.roles())
    traced = time.perf_counter()
    analysis = analyze(JobTrace(job=job, world=world, roles=roles, full=None))
    done = time.perf_counter()
    return traced - start, done - traced, [ra.memory.peak for ra in analysis.roles]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true", help="also the whole replay (slow)")
    args = parser.parse_args()
    run(4, None)  # imports and first-use costs out of the figures
    for moe in (False, True):
        print("MoE (ep 2, pp 2, dp 4)" if moe else "dense (tp 2, pp 2)")
        for m in (1_000, 10_000, 100_000):
            trace_s, analyse_s, peaks = run(m, None, moe)
            print(
                f"{m:>9,} micro-batches: trace {trace_s:5.2f} s, analyse {analyse_s:5.2f} s, "
                f"peaks {peaks}"
            )
            if args.full and m <= 10_000:
                full_s, _, full_peaks = run(m, False, moe)
                same = "same" if full_peaks == peaks else "DIFFERENT"
                print(f"{'':>9} whole replay: trace {full_s:5.2f} s, peaks {full_peaks} ({same})")


if __name__ == "__main__":
    main()
