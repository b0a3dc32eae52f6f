"""How long one GPU kernel takes, from its shape: the time model's per-kernel rates.

GEMMs: a roofline with tile and wave quantisation. The output is cut into tiles of
TILE[0] x TILE[1]; the tiles (of every matrix of a batched or grouped GEMM) run in waves over the
GPU's multiprocessors, each at GEMM_EFFICIENCY of the tensor cores' peak over its K loop plus a
fixed cost per tile worth TILE_OVERHEAD_K more steps of K (prologue and epilogue: what makes
short-K products slow); where there are fewer tiles than multiprocessors, cuBLAS splits K across
them (up to one split per 512 of K). The compute time and the time to read both operands and
write the output at HBM bandwidth (HBM_EFFICIENCY of the data sheet's) combine as a 2-norm
(neither hides the other completely), plus LAUNCH_SECONDS. A GEMM that adds its product into an
existing output (a weight gradient accumulated into DDP's fp32 main_grad under
gradient-accumulation fusion: cuBLAS with beta = 1) reads and writes that output at its dtype.

Fused attention (cuDNN / flash): the counted FLOPs (hooks/flops.py) at a fraction of peak that
grows with the sequence length, ATTENTION[phase] = (top fraction, s0 for causal, s0 without):
fraction = top * s / (s + s0), times min(1, 1/2 + head_dim / 256) (a 64-wide head runs at 3/4
of a 128-wide one).

Memory-bound work (element-wise operators, norms, softmax, casts, copies): bytes read and
written at HBM_EFFICIENCY of the HBM bandwidth, plus LAUNCH_SECONDS. Some PyTorch kernels are
bound by the elements they process instead, at ELEMENTS_PER_SM_SECOND on each multiprocessor
(whichever takes longer counts): an element-wise operator with an operand broadcast against the
output or laid out otherwise (a bias over rows, an attention mask over heads, a row maximum, a
transposed copy) takes TensorIterator's generic, unvectorised path; PyTorch's softmax forward
runs a warp per row up to rows of 2,048 and a block per row beyond.

Source of the constants: bench/gpu_kernels.py on an H100 80GB HBM3 (SXM, 700 W; torch 2.11.0,
CUDA 13.0, cuDNN 9.19), 2026-11-24, stored in bench/data/h100_kernels.json: 2,108 GEMMs
(bf16 and FP8, three layouts), 336 attention runs (56 of them shapes the flash backend refused),
261 grouped GEMMs, 48 element-wise runs.
tests/unit/test_kernels.py holds this model to that file. The large bf16 GEMMs ran at 650-770
TFLOP/s (0.66-0.78 of the 989 peak), FP8 at 1,200-1,280 (0.61-0.65 of 1,979). Fitted: median
|log(model / measured)| 4.4 % bf16, 3.8 % FP8; the GEMMs of 2^37 FLOPs or more, which carry a
training step, 1 % slow in all (without the per-tile cost the best fit was 4 % and 8 % fast on them).

The element rates: bench/gpu_kernels.py's layouts family on an H200 (torch 2.11.0, CUDA 13.0),
2026-11-28, stored in bench/data/h200_kernels.json. At 2^28 elements, where the contiguous copy,
add and scaling stream at 0.87-0.91 of the data sheet's 4.8 TB/s, the generic path processed
325 (a masked_fill_ whose mask is broadcast over the heads), 421 (a bias added over rows) and
410 (a transposed copy) billion bf16 elements a second, and the fp32 division of the logits by
their row sums in the cross entropy 321 (profiled in a megatron-core run: bench/step_time.py
--profile): the same rate at twice the bytes. Softmax forward: 465 (rows of 2,048, the warp
kernel), 324 (4,096) and, on the H100 (h100_kernels.json), 257 (8,192). The H200 and the H100
have the same 132 multiprocessors and boost clock; other GPUs scale by their multiprocessors.
These rates explain what a one-GPU megatron-core run on the local spec spends beyond the
streaming rate (bench/step_time.py).

FP4 (NVFP4) GEMMs run at the GPU's dense FP4 peak (hardware.GPU_FP4_TFLOPS) at FP8's
GEMM_EFFICIENCY, their per-tile cost FP8's time in FP4 steps, their operands half a byte per
element plus an E4M3 scale per 16 elements: none of it is measured (no Blackwell GPU was at
hand), all of it assumed from FP8.

Known limitations: measured on Hopper only; other GPUs use the same fractions of their own
peaks, multiprocessor counts and bandwidths (an assumption, stated in the report). The host's
side of a launch is metatrace.config.host's (LAUNCH_SECONDS is the GPU's per kernel). A
grouped GEMM's weight gradients are timed at the forward's shape, without main_grad's reads.
The rates are those of the libraries measured (2026: cuBLAS of CUDA 13.0, cuDNN 9.19); the
published runs of 2021-2024 ran older kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from metatrace.config.hardware import (
    GPU_ARCH,
    GPU_FP4_TFLOPS,
    GPU_FP8_ARCHS,
    GPU_HBM_TBPS,
    GPU_PEAK_TFLOPS,
)

# Streaming multiprocessors (compute units on AMD), from the data sheets.
GPU_SMS = {
    "a100-40gb": 108,
    "a100": 108,
    "h100": 132,
    "h800": 132,
    "h200": 132,
    "b200": 148,
    "gb200": 152,
    "b300": 160,  # Blackwell Ultra: 160 SMs (NVIDIA's "Inside Blackwell Ultra", 2025)
    "gb300": 160,
    "l40s": 142,
    "mi300x": 304,
}

GEMM_EFFICIENCY = {"bf16": 0.74, "fp8": 0.68, "fp4": 0.68}
"""fp4 is not measured (no Blackwell GPU was at hand): FP8's fraction of peak, assumed."""
TILE = (128, 128)
TILE_OVERHEAD_K = {"bf16": 96, "fp8": 192}
"""fp4: FP8's fixed time per tile, in steps of the GPU's FP4 rate (fp8 x fp4 peak / fp8 peak)."""
# Bytes per operand element read by a GEMM: NVFP4 packs two E2M1 values in a byte and adds one
# E4M3 scale per 16 (Transformer Engine 2.8 nvfp4_tensor.py:186-220, 249-253).
OPERAND_BYTES = {"bf16": 2.0, "fp8": 1.0, "fp4": 0.5 + 1 / 16}
SPLIT_K_CHUNK = 512
HBM_EFFICIENCY = {"gemm": 0.9, "memory": 0.8}
ELEMENTS_PER_SM_SECOND = {"generic": 2.75e9, "softmax_warp": 3.5e9, "softmax_block": 2.2e9}
SOFTMAX_WARP_ROW = 2048  # elements of a row up to which PyTorch's softmax runs a warp per row
LAUNCH_SECONDS = 4e-6
ATTENTION = {"forward": (0.68, 600, 300), "backward": (0.56, 800, 400)}


@dataclass(frozen=True)
class KernelModel:
    """The rates of one GPU model."""

    gpu: str
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s."""
    fp8_flops: float
    """Dense FP8 FLOP/s (the bf16 peak on GPUs without FP8 tensor cores)."""
    sms: int
    hbm_bytes_per_s: float
    fp4_flops: float = 0.0
    """Dense FP4 FLOP/s (hardware.GPU_FP4_TFLOPS; the FP8 rate on GPUs without FP4 tensor
    cores, where metatrace.config.checks refuses FP4 anyway)."""


def _dtype(fp8: bool, fp4: bool) -> str:
    return "fp4" if fp4 else "fp8" if fp8 else "bf16"


def _peak(model: KernelModel, dtype: str) -> float:
    return {"bf16": model.peak_flops, "fp8": model.fp8_flops, "fp4": model.fp4_flops}[dtype]


def kernel_model(gpu: str) -> KernelModel | None:
    """The rates of `gpu`, or None when a table lacks it."""
    if gpu not in GPU_PEAK_TFLOPS or gpu not in GPU_SMS or gpu not in GPU_HBM_TBPS:
        return None
    peak = GPU_PEAK_TFLOPS[gpu] * 1e12
    fp8 = 2 * peak if GPU_ARCH.get(gpu) in GPU_FP8_ARCHS else peak
    fp4 = GPU_FP4_TFLOPS[gpu] * 1e12 if gpu in GPU_FP4_TFLOPS else fp8
    return KernelModel(gpu, peak, fp8, GPU_SMS[gpu], GPU_HBM_TBPS[gpu] * 1e12, fp4)


@functools.lru_cache(maxsize=65536)
def gemm_seconds(
    model: KernelModel,
    m: int,
    n: int,
    k: int,
    *,
    fp8: bool = False,
    fp4: bool = False,
    batch: int = 1,
    margin: int = 0,
    accumulate: int = 0,
) -> float:
    """[m, k] x [k, n], `batch` times in one kernel (bmm, a grouped GEMM's equal groups); `fp8`
    / `fp4`: operands in FP8 / NVFP4 (fp4 wins); `margin` multiprocessors left to a
    communication kernel beside it; `accumulate`: bytes per element of an output the product is
    added into (read and written), 0 for a fresh bf16 output."""
    return grouped_gemm_seconds(
        model, (m,) * batch, n, k, fp8=fp8, fp4=fp4, margin=margin, accumulate=accumulate
    )


@functools.lru_cache(maxsize=65536)
def grouped_gemm_seconds(
    model: KernelModel,
    ms: tuple[int, ...],
    n: int,
    k: int,
    *,
    fp8: bool = False,
    fp4: bool = False,
    margin: int = 0,
    accumulate: int = 0,
) -> float:
    """One kernel of GEMMs [m_i, k] x [k, n] (a grouped GEMM: one per expert), on the GPU's
    multiprocessors but `margin` (Transformer Engine's set_sm_margin: those run the collective
    its userbuffers overlap with the GEMM); `accumulate` as gemm_seconds'."""
    ms = tuple(m for m in ms if m > 0)
    if not ms or n <= 0 or k <= 0:
        return 0.0
    if margin:
        sms = max(1, model.sms - margin)
        model = dataclasses.replace(
            model,
            sms=sms,
            peak_flops=model.peak_flops * sms / model.sms,
            fp8_flops=model.fp8_flops * sms / model.sms,
            fp4_flops=model.fp4_flops * sms / model.sms,
        )
    tm, tn = TILE
    cols = math.ceil(n / tn)
    tiles = sum(math.ceil(m / tm) for m in ms) * cols
    m = sum(ms)
    useful = m * n / (tiles * tm * tn)
    split = 1
    if tiles < model.sms:
        split = max(1, min(model.sms // tiles, k // SPLIT_K_CHUNK))
    work = tiles * split
    waves = math.ceil(work / model.sms)
    filled = work / (waves * model.sms)
    dtype = _dtype(fp8, fp4)
    peak = _peak(model, dtype)
    # A tile's work outside its K loop (the pipeline's prologue, the epilogue's output write) as
    # TILE_OVERHEAD_K more steps of K: the same time in FP8 is twice the steps, in FP4 the FP8
    # steps times the FP4 / FP8 peak ratio.
    steps = k / split
    overhead = (steps + _tile_overhead(model, dtype)) / steps
    compute = 2.0 * m * n * k * overhead / (peak * GEMM_EFFICIENCY[dtype] * useful * filled)
    operand = OPERAND_BYTES[dtype]
    output = 2 * accumulate if accumulate else 2  # bytes per output element: read + written
    moved = (m * k + len(ms) * k * n) * operand + m * n * output
    memory = moved / (model.hbm_bytes_per_s * HBM_EFFICIENCY["gemm"])
    return math.hypot(compute, memory) + LAUNCH_SECONDS


def _tile_overhead(model: KernelModel, dtype: str) -> float:
    if dtype == "fp4":
        return TILE_OVERHEAD_K["fp8"] * model.fp4_flops / model.fp8_flops
    return TILE_OVERHEAD_K[dtype]


@functools.lru_cache(maxsize=4096)
def attention_seconds(
    model: KernelModel, flops: int, seq: int, head_dim: int, *, causal: bool, backward: bool
) -> float:
    """A fused attention kernel computing `flops` (hooks/flops.py's count) over sequences of
    `seq` queries with heads `head_dim` wide."""
    if flops <= 0:
        return 0.0
    top, s0_causal, s0_full = ATTENTION["backward" if backward else "forward"]
    s0 = s0_causal if causal else s0_full
    fraction = top * seq / (seq + s0) * min(1.0, 0.5 + head_dim / 256)
    return flops / (model.peak_flops * fraction) + LAUNCH_SECONDS


def memory_seconds(
    model: KernelModel, nbytes: int, path: str | None = None, elements: int = 0
) -> float:
    """A memory-bound kernel reading and writing `nbytes` in all; with `path` (a key of
    ELEMENTS_PER_SM_SECOND), one that processes `elements` at that rate if that takes longer."""
    if nbytes <= 0:
        return 0.0
    seconds = nbytes / (model.hbm_bytes_per_s * HBM_EFFICIENCY["memory"])
    if path is not None:
        seconds = max(seconds, elements / (ELEMENTS_PER_SM_SECOND[path] * model.sms))
    return seconds + LAUNCH_SECONDS


def flops_seconds(model: KernelModel, flops: int, *, fp8: bool = False, fp4: bool = False) -> float:
    """FLOPs reported without a shape: at the large-GEMM rate."""
    dtype = _dtype(fp8, fp4)
    return flops / (_peak(model, dtype) * GEMM_EFFICIENCY[dtype])
