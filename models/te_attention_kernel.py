"""What a Transformer Engine 2.8 fused or flash attention kernel call shares, whether
metatrace.models.te_attention makes it on one rank or metatrace.models.te_cp makes it per step
of context-parallel attention: TE's cached cu_seqlens and the kernel's FLOPs. It sits below
both, so that te_attention can hand context parallelism to te_cp without a cycle.
"""

from __future__ import annotations

import torch

from metatrace.hooks import flops


def cu_seqlens(config, batch: int, seqlen: int, device) -> torch.Tensor:
    """TE's get_full_cu_seqlens: one cached int32 [b + 1] per (b, s), shared by all layers.
    TE caches it per process; here per model config, so that each traced rank has its own."""
    cache = config.__dict__.setdefault("_metatrace_cu_seqlens", {})
    key = (batch, seqlen, str(device))
    if key not in cache:
        cache[key] = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
    return cache[key]


def sbhd_flops(ctx, q_shape, v_shape, causal: bool, window: int | None = None) -> None:
    """Report a fused / flash attention kernel's forward FLOPs for sbhd q and v shapes
    (hooks/flops.py says what is counted: causal masks halve them, a sliding `window` (the left
    size) leaves about s x w), and keep its shape on `ctx` for report_backward."""
    sq, b, h, d = q_shape
    sk, _, h_kv, dv = v_shape
    shape = (b, h, sq, sk, d, dv, h_kv)
    flops.report_attention(shape, causal=causal, backward=False, window=window)
    ctx.attention = (shape, causal, window)


def report_backward(ctx) -> None:
    """Report the backward kernel of the attention `sbhd_flops` reported on `ctx`."""
    shape, causal, window = ctx.attention
    flops.report_attention(shape, causal=causal, backward=True, window=window)
