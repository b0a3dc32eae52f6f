"""Measure the kernels the time model prices, on a CUDA GPU (not part of CI: it needs one).

    python bench/gpu_kernels.py OUT.json [--quick] [--only=FAMILY ...]

Times, with CUDA events over back-to-back launches (the way a training step queues them):
- bf16 GEMMs [m, k] x [k, n] over a grid of m, n, k, in Megatron's three layouts (forward
  x @ w.T, data gradient dy @ w, weight gradient dy.T @ x) on a sub-grid;
- FP8 GEMMs (torch._scaled_mm, e4m3 x e4m3, per-tensor scales, bf16 out) over the same grid;
- fused attention (scaled_dot_product_attention through cuDNN and flash), bf16, causal and not,
  forward and forward + backward, by sequence length, heads and head dim;
- grouped GEMMs (torch._grouped_mm, bf16) by experts and tokens per expert;
- memory-bound element-wise work (copy, add, GeLU, SwiGLU, layer norm, RMS norm, softmax, Adam's
  update) by bytes moved;
- layouts: memory-bound ATen kernels by operand layout (contiguous, a broadcast bias or mask,
  transposed, cast) and PyTorch's softmax, dropout, GeLU and layer norm, at attention-score and
  activation shapes.
Writes one JSON object: the device, the software versions, and each family's rows. The time
model's GPU tables (metatrace/config/kernels.py) cite such a file.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F


def timed(fn, *, reps: int = 10, warmup: int = 3) -> float:
    """Seconds per call: the median of three batches of `reps` back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / reps)
    return sorted(out)[1]


def reps_for(flops: float) -> int:
    return max(2, min(50, int(2e13 / max(flops, 1.0))))


SIZES = [256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 28672]
TOKENS = [128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]


def gemms(quick: bool):
    dev, rows = "cuda", []
    ms = TOKENS[::2] if quick else TOKENS
    ns = SIZES[::2] if quick else SIZES
    for m in ms:
        for n in ns:
            for k in ns:
                flops = 2.0 * m * n * k
                if flops > 6e12:
                    continue
                a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                sec = timed(lambda a=a, w=w: a @ w.t(), reps=reps_for(flops))
                rows.append({"m": m, "n": n, "k": k, "layout": "nt", "dtype": "bf16", "s": sec})
                af = a.to(torch.float8_e4m3fn)
                wf = w.to(torch.float8_e4m3fn)
                one = torch.ones((), device=dev)
                if k % 16 == 0 and n % 16 == 0:
                    sec8 = timed(
                        lambda af=af, wf=wf, one=one: torch._scaled_mm(
                            af, wf.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
                        ),
                        reps=reps_for(flops / 2),
                    )
                    rows.append({"m": m, "n": n, "k": k, "layout": "nt", "dtype": "fp8", "s": sec8})
                del a, w, af, wf
    # The backward layouts on a sub-grid: dgrad [m, n] @ [n, k]; wgrad [n, m]^T... as Megatron runs them.
    for m in (2048, 8192, 32768):
        for n in (1024, 4096, 8192, 28672):
            for k in (1024, 4096, 8192):
                dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
                w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                flops = 2.0 * m * n * k
                sec = timed(lambda dy=dy, w=w: dy @ w, reps=reps_for(flops))
                rows.append({"m": m, "n": k, "k": n, "layout": "nn", "dtype": "bf16", "s": sec})
                sec = timed(lambda dy=dy, x=x: dy.t() @ x, reps=reps_for(flops))
                rows.append({"m": n, "n": k, "k": m, "layout": "tn", "dtype": "bf16", "s": sec})
                del dy, w, x
    torch.cuda.empty_cache()
    return rows


def attention(quick: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    seqs = [1024, 4096, 16384] if quick else [512, 1024, 2048, 4096, 8192, 16384, 32768]
    for backend, name in (
        (SDPBackend.CUDNN_ATTENTION, "cudnn"),
        (SDPBackend.FLASH_ATTENTION, "flash"),
    ):
        for d, dv in ((64, 64), (128, 128), (192, 128)):
            for heads in (8, 16, 32, 64):
                for s in seqs:
                    b = max(1, 16384 // s)
                    for causal in (True, False):
                        shape = {"backend": name, "b": b, "heads": heads, "s": s}
                        shape.update(d=d, dv=dv, causal=causal)
                        try:
                            q = torch.randn(
                                b,
                                heads,
                                s,
                                d,
                                device="cuda",
                                dtype=torch.bfloat16,
                                requires_grad=True,
                            )
                            k = torch.randn(
                                b,
                                heads,
                                s,
                                d,
                                device="cuda",
                                dtype=torch.bfloat16,
                                requires_grad=True,
                            )
                            v = torch.randn(
                                b,
                                heads,
                                s,
                                dv,
                                device="cuda",
                                dtype=torch.bfloat16,
                                requires_grad=True,
                            )
                            with sdpa_kernel([backend]):
                                fwd = timed(
                                    lambda q=q, k=k, v=v, c=causal: F.scaled_dot_product_attention(
                                        q, k, v, is_causal=c
                                    ),
                                    reps=5,
                                )
                                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                                g = torch.randn_like(o)

                                def fb(q=q, k=k, v=v, c=causal, g=g):
                                    out = F.scaled_dot_product_attention(q, k, v, is_causal=c)
                                    torch.autograd.grad(out, (q, k, v), g)

                                both = timed(fb, reps=5)
                        except Exception as e:  # a backend that refuses the shape
                            rows.append({**shape, "error": str(e)[:120]})
                            continue
                        rows.append({**shape, "fwd_s": fwd, "fwd_bwd_s": both})
                        del q, k, v, o, g
    torch.cuda.empty_cache()
    return rows


def grouped(quick: bool):
    rows = []
    if not hasattr(torch, "_grouped_mm"):
        return rows
    for e in (8, 32, 64) if quick else (4, 8, 16, 32, 64, 128):
        for per in (
            (64, 256, 1024, 4096) if quick else (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
        ):
            for k, n in ((4096, 14336), (14336, 4096), (7168, 4096), (2048, 7168), (2880, 5760)):
                if e * n * k * 2 > 24e9 or e * per * (k + n) * 2 > 16e9:
                    continue
                x = torch.randn(e * per, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
                offs = torch.arange(per, e * per + 1, per, device="cuda", dtype=torch.int32)
                try:
                    sec = timed(
                        lambda x=x, w=w, offs=offs: torch._grouped_mm(x, w, offs=offs),
                        reps=reps_for(2.0 * e * per * n * k),
                    )
                except Exception as exc:
                    rows.append(
                        {"experts": e, "per_expert": per, "k": k, "n": n, "error": str(exc)[:120]}
                    )
                    continue
                rows.append({"experts": e, "per_expert": per, "k": k, "n": n, "s": sec})
                del x, w
    torch.cuda.empty_cache()
    return rows


def _elementwise_rows(numel: int):
    h = 8192
    x = torch.randn(numel // h, h, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    w = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    two = torch.randn(numel // h, 2 * h, device="cuda", dtype=torch.bfloat16)
    b = x.numel() * 2
    cases = {
        "copy": (lambda: x.clone(), 2 * b),
        "add": (lambda: x + y, 3 * b),
        "gelu": (lambda: F.gelu(x), 2 * b),
        "swiglu": (lambda: F.silu(two[:, :h]) * two[:, h:], 3 * b),
        "layer_norm": (lambda: F.layer_norm(x, (h,), w, w), 2 * b),
        "rms_norm": (lambda: F.rms_norm(x, (h,), w), 2 * b),
        "softmax": (lambda: torch.softmax(x, -1), 2 * b),
    }
    rows = [
        {"op": name, "numel": numel, "bytes": moved, "s": timed(fn, reps=20)}
        for name, (fn, moved) in cases.items()
    ]
    p = torch.randn(numel, device="cuda", dtype=torch.float32)
    p.grad = torch.randn_like(p)
    opt = torch.optim.Adam([p], lr=1e-4, fused=True)
    sec = timed(opt.step, reps=10)
    rows.append({"op": "adam_fused_fp32", "numel": numel, "bytes": numel * 4 * 7, "s": sec})
    return rows


def elementwise(quick: bool):
    sizes = [1 << 22, 1 << 26] if quick else [1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28]
    rows = [row for numel in sizes for row in _elementwise_rows(numel)]
    torch.cuda.empty_cache()
    return rows


def _layout_rows(rows_: int, cols: int) -> list:
    """Memory-bound ATen kernels by operand layout: contiguous operands of one shape take
    PyTorch's vectorised path; a broadcast, strided or cast operand the generic one."""
    x = torch.randn(rows_, cols, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    bias = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    heads = 16
    x4 = x.view(-1, heads, cols, cols) if rows_ % (heads * cols) == 0 else None
    full_mask = torch.rand(rows_, cols, device="cuda") < 0.5
    mask4 = torch.rand(x4.shape[0], 1, cols, cols, device="cuda") < 0.5 if x4 is not None else None
    probs = torch.softmax(x, -1)
    _, keep = torch.native_dropout(x, 0.1, True)
    g32 = torch.zeros(rows_, cols, device="cuda", dtype=torch.float32)
    t3 = x.view(cols, rows_ // cols, cols) if rows_ % cols == 0 else None
    b = x.numel() * 2
    cases = {
        "copy": (lambda: x.clone(), 2 * b),
        "add": (lambda: x + y, 3 * b),
        "mul_scalar": (lambda: x * 0.5, 2 * b),
        "add_broadcast_bias": (lambda: x + bias, 2 * b),
        "masked_fill_full_mask": (lambda: x.masked_fill(full_mask, -1e4), 2 * b + b // 2),
        "cast_bf16_to_fp32": (lambda: x.float(), 3 * b),
        "add_fp32_plus_bf16": (lambda: g32.add_(x), 5 * b),
        "softmax_forward": (lambda: torch.softmax(x, -1), 2 * b),
        "softmax_backward": (
            lambda: torch._softmax_backward_data(y, probs, -1, torch.bfloat16),
            3 * b,
        ),
        "dropout_forward": (lambda: torch.native_dropout(x, 0.1, True), 2 * b + b // 2),
        "dropout_backward": (
            lambda: torch.ops.aten.native_dropout_backward(y, keep, 1 / 0.9),
            2 * b + b // 2,
        ),
        "gelu_forward": (lambda: torch.nn.functional.gelu(x), 2 * b),
        "layer_norm_forward": (
            lambda: torch.nn.functional.layer_norm(x, (cols,), bias, bias),
            2 * b,
        ),
    }
    if x4 is not None:
        cases["masked_fill_broadcast_mask"] = (
            lambda: x4.masked_fill_(mask4, -1e4),
            2 * b + mask4.numel(),
        )
    if t3 is not None:
        cases["copy_transposed"] = (lambda: t3.transpose(0, 1).contiguous(), 2 * b)
    return [
        {"op": name, "rows": rows_, "cols": cols, "bytes": moved, "s": timed(fn, reps=20)}
        for name, (fn, moved) in cases.items()
    ]


def layouts(quick: bool):
    shapes = [(8192, 2048), (64 * 2048, 2048), (32 * 4096, 4096)]
    rows = [row for r, c in (shapes[1:2] if quick else shapes) for row in _layout_rows(r, c)]
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    out = sys.argv[1]
    quick = "--quick" in sys.argv
    only = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")]
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }
    for name, fn in (
        ("elementwise", elementwise),
        ("gemm", gemms),
        ("attention", attention),
        ("grouped_gemm", grouped),
        ("layouts", layouts),
    ):
        if only and name not in only:
            continue
        result[name] = fn(quick)
        print(name, len(result[name]), flush=True)
        with open(out, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
