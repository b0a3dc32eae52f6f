"""Sustained GEMM throughput on a CUDA GPU: bf16 and FP8 8192^3 products back to back for
SECONDS each, the rate per 5-second window with the SM clock and power nvidia-smi reads then.
What bench/gpu_kernels.py's short bursts do not show: the clock a GPU holds under training's
continuous load (metatrace.config.kernels cites the result).

    python bench/gpu_sustained.py OUT.json [SECONDS]
"""

import json
import subprocess
import sys
import time

import torch


def smi() -> str:
    q = "clocks.sm,power.draw,temperature.gpu"
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True
    )
    return out.stdout.strip()


def run(fn, flops: float, seconds: float) -> list:
    rows, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n, w0 = 0, time.perf_counter()
        start.record()
        while time.perf_counter() - w0 < 5:
            for _ in range(20):
                fn()
            n += 20
            torch.cuda.synchronize()
        end.record()
        end.synchronize()
        sec = start.elapsed_time(end) / 1e3
        rows.append(
            {
                "t": round(time.perf_counter() - t0, 1),
                "tflops": flops * n / sec / 1e12,
                "smi": smi(),
            }
        )
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    out, seconds = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 60
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    result = {"device": torch.cuda.get_device_name(0), "idle": smi()}
    result["bf16"] = run(lambda: a @ b.t(), 2.0 * n**3, seconds)
    af, bf = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    result["fp8"] = run(
        lambda: torch._scaled_mm(af, bf.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        2.0 * n**3,
        seconds,
    )
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
