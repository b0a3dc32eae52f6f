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

Time (with a GPU's kernel rates): the recorder prices every dispatched operator that moves data
by its bytes. Stand-ins whose fused kernel dispatches nothing that moves data (a compiled
activation, the norm fused into a linear layer, an FP8 cast) report the bytes it reads and
writes with `report_moved`; a kernel output a stand-in fills (torch.zeros) while the kernel's own
time already covers writing it is allocated with `unpriced`.
"""

from __future__ import annotations

import contextlib

from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from metatrace.config import kernels


class FlopCount:
    """A running count: all FLOPs, and of them those of FP8 GEMMs and, apart, those of FP4
    (NVFP4) GEMMs; and, with a GPU's kernel rates (metatrace.config.kernels), the picoseconds
    its kernels take (`ps`: GEMMs and attention from their shapes, memory-bound operators from
    the bytes they move; an integer, so that counts of identical work are equal)."""

    __slots__ = ("attention_ps", "fp4", "fp8", "host", "margin", "model", "ps", "total")

    def __init__(self, model=None, host=None):
        self.total = 0
        self.fp8 = 0
        self.fp4 = 0
        """FLOPs of FP4 GEMMs (not in `fp8`)."""
        self.ps = 0
        self.attention_ps = 0
        """Of `ps`, the fused attention kernels' (what the context-parallel ring runs beside)."""
        self.model = model
        self.margin = 0
        """Multiprocessors the GEMMs running now leave to a collective beside them."""
        self.host = host
        """The recorder's hooks.host.HostCount: a stand-in's reported kernel is a launch."""

    def add_seconds(self, seconds: float, *, attention: bool = False, launches: int = 1) -> int:
        """Kernels taking `seconds` in all, `launches` of them launched by the host on their
        own (a stand-in's report; 0 where the recorder counts a dispatched operator's launches
        itself). Their picoseconds."""
        ps = round(seconds * 1e12)
        self.ps += ps
        if attention:
            self.attention_ps += ps
        if launches and self.host is not None:
            self.host.kernel(ps, launches)
        return ps

    def unpriced_launch(self, launches: int = 1) -> None:
        """Kernels a stand-in reports where there are no rates to price them (a replay)."""
        if self.model is None and self.host is not None:
            self.host.kernel(0, launches)


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


def _count() -> FlopCount | None:
    return _ACTIVE[-1] if _ACTIVE and not _UNCOUNTED[0] else None


def report(flops: int, *, fp8: bool = False, fp4: bool = False) -> None:
    """A stand-in's kernel computes `flops` (FP8 GEMMs: `fp8`, FP4 GEMMs: `fp4`) that no
    dispatched operator shows, of no known shape (timed at the large-GEMM rate). Nothing
    happens outside a recorder."""
    count = _count()
    if count is not None:
        _add(count, int(flops), fp8, fp4)
        if count.model is not None:
            count.add_seconds(kernels.flops_seconds(count.model, int(flops), fp8=fp8, fp4=fp4))
        count.unpriced_launch()


def _add(count: FlopCount, flops: int, fp8: bool, fp4: bool = False) -> None:
    count.total += flops
    if fp4:
        count.fp4 += flops
    elif fp8:
        count.fp8 += flops


def report_gemm(m: int, k: int, n: int, *, fp8: bool = False, fp4: bool = False, into=None) -> None:
    """A stand-in's kernel runs the GEMM [m, k] @ [k, n] (operands in FP8: `fp8`, in NVFP4:
    `fp4`); `into`: the tensor it adds the product into (DDP's main_grad under
    gradient-accumulation fusion), else a fresh output."""
    count = _count()
    if count is not None:
        _add(count, gemm(m, k, n), fp8, fp4)
        if count.model is not None:
            acc = into.element_size() if into is not None else 0
            sec = kernels.gemm_seconds(
                count.model, m, n, k, fp8=fp8, fp4=fp4, margin=count.margin, accumulate=acc
            )
            count.add_seconds(sec)
        count.unpriced_launch()


def report_grouped(
    rows, k: int, n: int, *, fp8: bool = False, fp4: bool = False, times: int = 1
) -> None:
    """A stand-in's grouped GEMM: [rows[i], k] @ [k, n] per group, `times` such calls (the
    backward's data and weight gradients are timed as the forward's shape). Transformer Engine
    2.8 runs a call as one cuBLAS GEMM per group with rows (te_general_grouped_gemm hands
    nvte_multi_tensor_gemm the non-empty ones: "For now, we only have multi-stream cublas
    backend", spread over its compute streams): as many launches; their GPU time is the groups'
    tiles together (kernels.grouped_gemm_seconds)."""
    count = _count()
    if count is not None and times > 0:
        rows = tuple(int(r) for r in rows)
        launches = times * sum(1 for r in rows if r > 0)
        _add(count, times * gemm(sum(rows), k, n), fp8, fp4)
        if count.model is not None:
            sec = kernels.grouped_gemm_seconds(
                count.model, rows, n, k, fp8=fp8, fp4=fp4, margin=count.margin
            )
            count.add_seconds(times * sec, launches=launches)
        count.unpriced_launch(launches)


def report_attention(shape: tuple, *, causal: bool, backward: bool, window: int | None) -> int:
    """A stand-in's fused attention kernel over `shape` = attention()'s (b, heads, q_len,
    kv_len, head_dim, v_dim, kv_heads); returns its FLOPs."""
    flops = attention(*shape, causal=causal, backward=backward, window=window)
    count = _count()
    if count is not None:
        _add(count, flops, False)
        if count.model is not None:
            _, _, q_len, _, head_dim, *_ = shape
            sec = kernels.attention_seconds(
                count.model, flops, q_len, head_dim, causal=causal, backward=backward
            )
            count.add_seconds(sec, attention=True)
        count.unpriced_launch()
    return flops


def op_seconds(model, func, args, out, flops: int, margin: int = 0) -> float:
    """A dispatched operator with a FLOP formula (matrix products, PyTorch's attention);
    `margin`: FlopCount.margin."""
    name = func._overloadpacket.__name__
    if "attention" in name:  # PyTorch's fused kernels (the stand-ins report TE's themselves)
        q = args[1] if "backward" in name else args[0]
        return kernels.attention_seconds(
            model, flops, q.shape[-2], q.shape[-1], causal=False, backward="backward" in name
        )
    shape = out.shape if hasattr(out, "shape") else out[0].shape
    m, n = shape[-2], shape[-1]
    batch = 1
    for d in shape[:-2]:
        batch *= d
    if not m or not n or not batch:
        return 0.0
    k = flops // (2 * m * n * batch)
    return kernels.gemm_seconds(
        model, m, n, k, fp8=name == "_scaled_mm", batch=batch, margin=margin
    )


def report_moved(*tensors, launches: int = 1) -> None:
    """A stand-in's memory-bound kernel reads or writes each of `tensors` (None: left out) once;
    `launches`: the kernels that work takes one after another (a multi-tensor kernel's launches,
    config.host), each with its fixed cost (kernels.LAUNCH_SECONDS)."""
    count = _count()
    if count is not None:
        n = sum(t.nbytes for t in tensors if t is not None)
        if n and count.model is not None:
            fixed = max(launches - 1, 0) * kernels.LAUNCH_SECONDS  # memory_seconds has one
            count.add_seconds(kernels.memory_seconds(count.model, n) + fixed, launches=launches)
        elif n:
            count.unpriced_launch(launches)


def unpriced(factory, *args, **kwargs):
    """`factory(*args, **kwargs)` (torch.zeros, ...) allocating a kernel's output whose writing
    is timed with the kernel (a GEMM's, attention's): not timed again as a fill."""
    with uncounted():
        return factory(*args, **kwargs)


@contextlib.contextmanager
def sm_margin(sms: int):
    """GEMMs run inside leave `sms` multiprocessors to a collective beside them (Transformer
    Engine's userbuffers with set_sm_margin)."""
    count = _count()
    if count is None or not sms:
        yield
        return
    saved, count.margin = count.margin, sms
    try:
        yield
    finally:
        count.margin = saved


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
