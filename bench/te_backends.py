"""Transformer Engine stand-ins against the local spec, and what each attention backend keeps.

1. Trace time of llama2-7b at tp 2 with sequence parallelism: the TE spec with cp 2 and fused
   attention (8 GPUs) against the local spec without CP (4 GPUs; the local spec refuses CP), seq
   4096, micro-batch 1, one pipeline stage (median of 3 in-process runs each).
2. Bytes one middle layer keeps for backward per micro-batch with fused, flash and unfused
   attention (llama2-7b, tp 2, sp, no CP, micro-batch 1 and 2), and with FP8 recipes on fused
   attention. (TE's flash path returns `out.transpose(0, 1).contiguous()`, a second copy of the
   output only when the micro-batch is larger than 1: with b = 1 the transpose is contiguous.)
"""

import statistics
import time
import warnings

warnings.filterwarnings("ignore")

from metatrace import aggregate as agg  # noqa: E402
from metatrace.config import job_from_dict  # noqa: E402
from metatrace.tracing.trace import trace_job  # noqa: E402

MiB = 2**20


def job(**sections):
    data = {
        "model": {"preset": "llama2-7b"},
        "parallel": {"tp": 2, "sequence_parallel": True},
        "training": {"seq_length": 4096, "micro_batch_size": 1},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return job_from_dict(data)


def timed(j, runs=3):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jt = trace_job(j, full_model=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times), jt


def layer_bytes(jt, layer="decoder.layers.1"):
    rows = {r.fqn: r for r in agg.walk(agg.module_tree(jt.roles[0].trace))}
    return rows[layer].activation_bytes_total, rows[layer]


def main():
    te_time, _ = timed(job(parallel={"cp": 2}))
    local_time, _ = timed(job(implementation={"transformer_impl": "local"}))
    print("llama2-7b, tp 2, sp, seq 4096, mbs 1, 32 layers on one stage (median of 3)")
    print(f"  TE spec, cp 2, fused attention: {te_time:.2f} s")
    print(f"  local spec, no cp:              {local_time:.2f} s")
    print(f"  ratio TE / local:               {te_time / local_time:.2f}")
    print()
    print("bytes kept for backward by one middle layer, per micro-batch (llama2-7b, tp 2, sp)")
    print(f"  {'backend':28s} {'MiB':>9s}   core_attention  linear_qkv  linear_fc1  rest")
    cases = [
        (f"{b}, mbs {m}", {"micro_batch_size": m})
        for m in (1, 2)
        for b in ("fused", "flash", "unfused")
    ]
    cases += [
        (f"fused, fp8 {r}", {"precision": "fp8", "fp8_recipe": r})
        for r in ("delayed", "tensorwise", "blockwise")
    ]
    for name, training in cases:
        backend = name.split(",")[0]
        _, jt = timed(job(implementation={"attention_backend": backend}, training=training), runs=1)
        total, row = layer_bytes(jt)
        sub = {
            r.fqn.rsplit(".", 2)[-2] + "." + r.name: r.activation_bytes_total
            for r in agg.walk([row])
        }
        core = sub.get("self_attention.core_attention", 0)
        qkv = sub.get("self_attention.linear_qkv", 0)
        fc1 = sub.get("mlp.linear_fc1", 0)
        mlp_rest = (
            row.activation_bytes_total
            - core
            - qkv
            - fc1
            - sum(r.activation_bytes for r in agg.walk([row]) if r.fqn.endswith("self_attention"))
        )
        print(
            f"  {name:28s} {total / MiB:9.1f}   {core / MiB:14.1f}  {qkv / MiB:10.1f}  "
            f"{fc1 / MiB:10.1f}  {mlp_rest / MiB:7.1f}"
        )


if __name__ == "__main__":
    main()
