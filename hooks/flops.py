"""Floating-point operations of a trace: torch.utils.flop_counter's shape formulas per operator,
and what stand-ins for library kernels report for themselves.

The recorder asks `formula(func)` once per operator and calls it on every dispatch (they take
shapes only, so they work on meta tensors and on the fresh outputs `hooks/fastmeta.py` makes for
repeated layers). PyTorch's registry knows the matrix products (mm, addmm, bmm, baddbmm,
_scaled_mm), convolutions and the scaled-dot-product attention kernels; element-wise operators,
norms, softmax and reductions are not counted (a few percent of a transformer's FLOPs). A
multiply-add counts two.

Kernels that the stand-ins run without dispatching their GEMMs (Transformer Engine's fused and
flash attention, FP8 and grouped GEMMs, GEMMs accumulating straight into DDP's main_grad)
report what the real kernel computes with `report(flops)`; operators that only stand for such a
kernel's side work (the [1, 1] placeholder GEMM of Apex's fused weight gradient, the row sums of
the fused softmax's backward) run inside `uncounted()`.
"""

from __future__ import annotations

import contextlib

from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count


class FlopCount:
    """A running count: all FLOPs, and of them those of FP8 GEMMs."""

    __slots__ = ("fp8", "total")

    def __init__(self):
        self.total = 0
        self.fp8 = 0


_ACTIVE: list[FlopCount] = []  # the counts of the recorders running now (innermost last)
_UNCOUNTED = [0]


def formula(func):
    """flop_counter's formula for an operator (called as formula(*args, out_val=out,
    **kwargs)), or None when it has none."""
    return flop_registry.get(getattr(func, "_overloadpacket", None))


def counting() -> bool:
    return not _UNCOUNTED[0]


def push(count: FlopCount) -> None:
    _ACTIVE.append(count)


def pop(count: FlopCount) -> None:
    if count in _ACTIVE:
        _ACTIVE.remove(count)


def report(flops: int, *, fp8: bool = False) -> None:
    """A stand-in's kernel computes `flops` (FP8 GEMMs: `fp8`) that no dispatched operator
    shows. Nothing happens outside a recorder."""
    if _ACTIVE and not _UNCOUNTED[0]:
        count = _ACTIVE[-1]
        count.total += int(flops)
        if fp8:
            count.fp8 += int(flops)


@contextlib.contextmanager
def uncounted():
    """Operators run inside stand for work that is not counted (or is reported otherwise)."""
    _UNCOUNTED[0] += 1
    try:
        yield
    finally:
        _UNCOUNTED[0] -= 1


def gemm(m: int, k: int, n: int) -> int:
    """[m, k] @ [k, n]."""
    return 2 * m * k * n


def attention(
    b: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    v_dim: int,
    kv_heads: int | None = None,
    *,
    causal: bool,
    backward: bool,
    window: int | None = None,
) -> int:
    """FLOPs of a flash / cuDNN fused attention kernel: flop_counter's formulas for
    _scaled_dot_product_flash_attention (forward: Q K^T and P V; backward: the scores again,
    dV, dP, dQ, dK, 2.5 times the forward), halved under a causal mask, whose fully masked tiles
    these kernels skip (Megatron-LM's own FLOPs formula halves them too; the diagonal tiles,
    computed whole, make the real count slightly higher for short sequences)."""
    kv_heads = kv_heads or heads
    q = (b, heads, q_len, head_dim)
    k = (b, kv_heads, kv_len, head_dim)
    v = (b, kv_heads, kv_len, v_dim)
    if backward:
        flops = sdpa_backward_flop_count((b, heads, q_len, v_dim), q, k, v)
    else:
        flops = sdpa_flop_count(q, k, v)
    if causal and window is not None and window < kv_len:
        # A causal sliding window [w, 0] (TE's window_size): each query sees its last w keys
        # (w + 1 with itself). Counted like the causal halving, as the area under the band:
        # s^2/2 - (s - w)^2/2 = s*w - w^2/2 of the s^2 pairs (for sq = sk = s; about s*w for
        # w << s). The kernels compute the tiles the band crosses whole (128-wide: about two
        # key tiles per query tile for w = 128), so they do up to ~2x this useful work.
        s = kv_len
        return flops * (2 * s * window - window * window) // (2 * s * s)
    return flops // 2 if causal else flops
