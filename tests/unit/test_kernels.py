"""The per-kernel time model (metatrace.config.kernels) against the kernels measured on an H100
(bench/gpu_kernels.py -> bench/data/h100_kernels.json), and the recorder's use of it."""

import json
import math
import os
import statistics

import pytest
import torch

from metatrace.config.kernels import (
    attention_seconds,
    gemm_seconds,
    grouped_gemm_seconds,
    kernel_model,
    memory_seconds,
)

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "data", "h100_kernels.json")
H100 = kernel_model("h100")
# Calls shorter than this were bound by the host's launches in the measurement (a 1024^3 GEMM
# took 17 us back to back), not by the GPU.
HOST_BOUND = 50e-6


@pytest.fixture(scope="module")
def measured():
    with open(DATA) as f:
        return json.load(f)


def errors(pairs):
    """|log(predicted / measured)| of each pair."""
    return [abs(math.log(p / m)) for p, m in pairs]


def quantile(xs, q):
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gemms_within_a_tenth_of_the_h100(measured, dtype):
    rows = [r for r in measured["gemm"] if r["dtype"] == dtype and r["s"] > HOST_BOUND]
    assert len(rows) > 500
    e = errors(
        (gemm_seconds(H100, r["m"], r["n"], r["k"], fp8=dtype == "fp8"), r["s"]) for r in rows
    )
    assert statistics.median(e) < 0.10
    assert quantile(e, 0.9) < 0.25


def test_grouped_gemms_by_tokens_per_expert(measured):
    rows = [r for r in measured["grouped_gemm"] if "s" in r]
    e = errors(
        (grouped_gemm_seconds(H100, (r["per_expert"],) * r["experts"], r["n"], r["k"]), r["s"])
        for r in rows
    )
    assert statistics.median(e) < 0.10
    assert quantile(e, 0.9) < 0.2


def _attention_flops(r):
    f = 2 * r["b"] * r["heads"] * r["s"] * r["s"] * (r["d"] + r["dv"])
    return f // 2 if r["causal"] else f


@pytest.mark.parametrize("backward", [False, True])
def test_fused_attention_by_sequence_length(measured, backward):
    rows = [r for r in measured["attention"] if r["backend"] == "cudnn" and "fwd_s" in r]
    pairs = []
    for r in rows:
        flops, took = _attention_flops(r), r["fwd_s"]
        if backward:
            flops, took = int(2.5 * _attention_flops(r)), r["fwd_bwd_s"] - r["fwd_s"]
        seconds = attention_seconds(
            H100, flops, r["s"], r["d"], causal=r["causal"], backward=backward
        )
        pairs.append((seconds, took))
    e = errors(pairs)
    assert statistics.median(e) < (0.15 if backward else 0.10)


def test_streaming_operators_by_bytes(measured):
    # PyTorch's own norms and softmax run at 0.3-0.6 of the bandwidth (not timed as such: the
    # model's rate is that of streaming kernels, which Transformer Engine's fused ones approach).
    rows = [
        r
        for r in measured["elementwise"]
        if r["op"] in ("copy", "add", "gelu") and r["numel"] >= 1 << 24
    ]
    e = errors((memory_seconds(H100, r["bytes"]), r["s"]) for r in rows)
    assert max(e) < 0.2


def test_tiles_and_waves():
    # 133 tiles on 132 multiprocessors take two waves.
    one_wave = gemm_seconds(H100, 128 * 12, 128 * 11, 8192)  # 132 tiles
    two_waves = gemm_seconds(H100, 128 * 7, 128 * 19, 8192)  # 133 tiles
    assert two_waves > 1.6 * one_wave
    # Experts with few tokens each: a GEMM per 32 rows runs at a fraction of one over all.
    few = grouped_gemm_seconds(H100, (32,) * 64, 4096, 4096)
    assert few > 3 * gemm_seconds(H100, 32 * 64, 4096, 4096)


def test_unknown_gpu_has_no_rates():
    assert kernel_model("tpu-v5") is None


def test_the_recorder_times_each_kernel_of_a_window():
    from metatrace.hooks.recorder import Recorder

    module = torch.nn.Linear(4, 4, device="meta")
    a = torch.empty(2048, 4096, device="meta", dtype=torch.bfloat16)
    b = torch.empty(4096, 1024, device="meta", dtype=torch.bfloat16)
    rec = Recorder(chunks={"": module}, devices=("meta",), groups={}, rank=0, kernels=H100)
    with rec, rec.window("forward", 0):
        y = torch.mm(a, b)  # [2048, 1024]
        y.add(y)  # reads two, writes one
        y.t()  # a view moves nothing
    (w,) = rec.trace().windows
    gemm = round(gemm_seconds(H100, 2048, 1024, 4096) * 1e12)
    add = round(memory_seconds(H100, 3 * 2048 * 1024 * 2) * 1e12)
    assert w.flops == 2 * 2048 * 1024 * 4096
    assert w.kernel_ps == gemm + add


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_large_gemms_unbiased(measured, dtype):
    """The products that carry a training step (2^37 FLOPs and more) in all take what they took
    on the H100: a fit to every size that leaves them fast predicts every step fast."""
    rows = [
        r for r in measured["gemm"] if r["dtype"] == dtype and r["m"] * r["n"] * r["k"] >= 2**36
    ]
    assert len(rows) > 300
    model = sum(gemm_seconds(H100, r["m"], r["n"], r["k"], fp8=dtype == "fp8") for r in rows)
    assert model / sum(r["s"] for r in rows) == pytest.approx(1.0, abs=0.03)


def test_a_gemm_beside_a_collective_runs_on_the_other_multiprocessors():
    """TE's set_sm_margin: 16 of the H100's 132 multiprocessors run the collective; a large GEMM
    takes about 132/116 as long."""
    full = gemm_seconds(H100, 8192, 8192, 8192)
    narrow = gemm_seconds(H100, 8192, 8192, 8192, margin=16)
    assert narrow / full == pytest.approx(132 / 116, rel=0.03)


def _timed(fn):
    """The kernel picoseconds `fn` reports inside a FlopCount with the H100's rates."""
    from metatrace.hooks import flops

    count = flops.FlopCount(H100)
    flops.push(count)
    try:
        fn()
    finally:
        flops.pop(count)
    return count.ps


def test_fused_kernels_of_stand_ins_are_timed_by_their_bytes():
    """A compiled SwiGLU, a norm fused into one kernel and an FP8 cast dispatch nothing that moves
    data: each reports what the real kernel reads and writes, once."""
    from metatrace.models import compiled
    from metatrace.models.norm import norm_forward
    from metatrace.models.te_fp8 import quantize

    def ps(nbytes):
        return round(memory_seconds(H100, nbytes) * 1e12)

    rows, h, f = 4096, 4096, 11008
    y = torch.empty(rows, 2 * f, dtype=torch.bfloat16, device="meta")
    assert _timed(lambda: compiled.swiglu(y)) == ps(rows * 2 * f * 2 + rows * f * 2)
    x = torch.empty(rows, h, dtype=torch.bfloat16, device="meta")
    w = torch.empty(h, dtype=torch.bfloat16, device="meta")
    # reads x and the weight, writes y and fp32 1/rms: not the unfused operators' 3x the bytes
    assert _timed(lambda: norm_forward(x, w, None, 1e-5, True)) == ps(
        2 * rows * h * 2 + h * 2 + rows * 4
    )
    cast = lambda: quantize(
        (rows, h), "delayed", "sm90", rowwise=True, columnwise=True, device="meta", cast=x
    )
    assert _timed(cast) == ps(rows * h * 2 + 2 * rows * h + 4)  # bf16 in; FP8 and transpose out
    buffers = lambda: quantize(
        (rows, h), "delayed", "sm90", rowwise=True, columnwise=True, device="meta"
    )
    assert _timed(buffers) == 0  # a collective's destination: not a kernel


def test_an_unsafe_view_is_a_view():
    """torch.matmul of a [s, b, h] input returns the 2-D product reshaped by aten._unsafe_view,
    which its schema does not mark as a view: no kernel runs, nothing is timed."""
    from metatrace.hooks.recorder import Recorder

    module = torch.nn.Linear(4, 4, device="meta")
    x = torch.empty(2048, 1, 4096, device="meta", dtype=torch.bfloat16)
    w = torch.empty(4096, 1024, device="meta", dtype=torch.bfloat16)
    rec = Recorder(chunks={"": module}, devices=("meta",), groups={}, rank=0, kernels=H100)
    with rec, rec.window("forward", 0):
        torch.matmul(x, w)
    (w_,) = rec.trace().windows
    assert w_.kernel_ps == round(gemm_seconds(H100, 2048, 1024, 4096) * 1e12)


def test_megatrons_fused_softmax_is_one_kernel_each_way():
    """Apex's scaled (upper-triangular) masked softmax reads the scores and writes the
    probabilities in one kernel; its backward reads dy and y and writes dx in place."""
    from metatrace.models.standins import FusedSoftmaxKernels as K

    scores = torch.empty(32, 2048, 2048, dtype=torch.float16, device="meta")
    n = scores.nbytes
    ps = round(memory_seconds(H100, 2 * n) * 1e12)
    assert _timed(lambda: K.causal_forward(scores, 0.125)) == ps
    y = torch.empty_like(scores)
    assert _timed(lambda: K.backward(torch.empty_like(scores), y, 0.125)) == round(
        memory_seconds(H100, 3 * n) * 1e12
    )


def test_a_weight_gradient_accumulated_into_main_grad_reads_and_writes_it():
    """Gradient-accumulation fusion: the wgrad GEMM adds into the fp32 main_grad (beta = 1), which
    it reads and writes, 8 bytes an element instead of a fresh bf16 output's 2. A short-K product
    (few tokens) is bound by those bytes."""
    from metatrace.hooks import flops

    out, tokens, inp = 8192, 256, 8192
    main_grad = torch.empty(out, inp, dtype=torch.float32, device="meta")
    fresh = _timed(lambda: flops.report_gemm(out, tokens, inp))
    into = _timed(lambda: flops.report_gemm(out, tokens, inp, into=main_grad))
    assert fresh == round(gemm_seconds(H100, out, inp, tokens) * 1e12)
    # at least the time to read and write the fp32 [out, in] at the HBM rate, which a fresh bf16
    # output's GEMM takes less than
    moved = 8 * out * inp / (H100.hbm_bytes_per_s * 0.9)
    assert fresh / 1e12 < moved < into / 1e12 < 1.2 * moved


H200_DATA = os.path.join(os.path.dirname(DATA), "h200_kernels.json")
H200 = kernel_model("h200")


def _layouts():
    with open(H200_DATA) as f:
        return [r for r in json.load(f)["layouts"] if r["rows"] * r["cols"] >= 1 << 28]


@pytest.mark.parametrize(
    ("op", "path"),
    [
        ("copy", None),
        ("add", None),
        ("mul_scalar", None),
        ("masked_fill_broadcast_mask", "generic"),
        ("add_broadcast_bias", "generic"),
        ("copy_transposed", "generic"),
        ("softmax_forward", "softmax"),
    ],
)
def test_memory_bound_kernels_by_path(op, path):
    """Streaming kernels at the bandwidth, the generic element-wise path and PyTorch's softmax
    forward at their element rates, each within 20 % of what it took on the H200; the generic
    path takes more than twice the streaming time of its bytes (a bytes-only model is off)."""
    rows = [r for r in _layouts() if r["op"] == op]
    assert rows
    for r in rows:
        kind = path
        if path == "softmax":
            kind = "softmax_warp" if r["cols"] <= 2048 else "softmax_block"
        n = r["rows"] * r["cols"]
        seconds = memory_seconds(H200, r["bytes"], kind, n)
        assert abs(math.log(seconds / r["s"])) < 0.2, (r, seconds)
        if path == "generic":
            assert seconds > 2 * memory_seconds(H200, r["bytes"])


def test_the_recorder_prices_broadcast_and_strided_operands_on_the_generic_path():
    """A mask broadcast over the heads, a bias added over rows, a transposed copy and a
    concatenation along the last dimension take TensorIterator's generic path; the same
    operators on operands laid out as their output stream."""
    from metatrace.hooks.recorder import Recorder

    module = torch.nn.Linear(4, 4, device="meta")

    def timed(fn):
        rec = Recorder(chunks={"": module}, devices=("meta",), groups={}, rank=0, kernels=H100)
        with rec, rec.window("forward", 0):
            fn()
        return rec.trace().windows[0].kernel_ps / 1e12

    bf16 = {"device": "meta", "dtype": torch.bfloat16}
    scores = torch.empty(4, 16, 2048, 2048, **bf16)
    n = scores.numel()
    bytes_ = 2 * scores.nbytes
    mask = torch.empty(4, 1, 2048, 2048, dtype=torch.bool, device="meta")
    full = torch.empty(4, 16, 2048, 2048, dtype=torch.bool, device="meta")
    generic = memory_seconds(H100, bytes_ + mask.nbytes, "generic", n)
    assert timed(lambda: scores.masked_fill_(mask, -1e4)) == pytest.approx(generic, rel=1e-6)
    streaming = memory_seconds(H100, bytes_ + full.nbytes)
    assert timed(lambda: scores.masked_fill_(full, -1e4)) == pytest.approx(streaming, rel=1e-6)
    x = torch.empty(8192, 4096, **bf16)
    bias = torch.empty(4096, **bf16)
    assert timed(lambda: x + bias) == pytest.approx(
        memory_seconds(H100, 2 * x.nbytes + bias.nbytes, "generic", x.numel()), rel=1e-6
    )
    assert timed(lambda: x + x) == pytest.approx(memory_seconds(H100, 3 * x.nbytes), rel=1e-6)
    assert timed(lambda: x.t().contiguous()) == pytest.approx(
        memory_seconds(H100, 2 * x.nbytes, "generic", x.numel()), rel=1e-6
    )
    assert timed(lambda: x.clone()) == pytest.approx(memory_seconds(H100, 2 * x.nbytes), rel=1e-6)
    q = torch.empty(2048, 4, 16, 128, **bf16)
    assert timed(lambda: torch.cat([q, q, q], -1)) == pytest.approx(
        memory_seconds(H100, 6 * q.nbytes, "generic", 3 * q.numel()), rel=1e-6
    )
    assert timed(lambda: torch.cat([q, q], 0)) == pytest.approx(
        memory_seconds(H100, 4 * q.nbytes), rel=1e-6
    )
    # softmax forward: a warp per row up to 2,048 elements, a block per row beyond
    for row, kind in ((2048, "softmax_warp"), (4096, "softmax_block")):
        s = torch.empty(64, 1024, row, **bf16)
        assert timed(lambda s=s: torch.softmax(s, -1)) == pytest.approx(
            memory_seconds(H100, 2 * s.nbytes, kind, s.numel()), rel=1e-6
        )


def test_fp4_gemms_run_at_the_fp4_peak():
    """An NVFP4 GEMM on a B200 (148 SMs, dense FP4 9,000 TFLOP/s, FP8 4,500): 8192^3 is 64 x 64
    tiles in 28 waves; FP8's efficiency (0.68, not measured for FP4) and per-tile cost in FP4
    steps (192 x 9000 / 4500 = 384); operands of half a byte plus an E4M3 scale per 16
    elements (0.5625 bytes), a bf16 output."""
    from metatrace.config.hardware import GPU_HBM_TBPS

    b200 = kernel_model("b200")
    assert (b200.peak_flops, b200.fp8_flops, b200.fp4_flops) == (2250e12, 4500e12, 9000e12)
    n = 8192
    filled = 64 * 64 / (28 * 148)
    compute = 2 * n**3 * (n + 384) / n / (9000e12 * 0.68 * filled)
    memory = (2 * n * n * 0.5625 + n * n * 2) / (GPU_HBM_TBPS["b200"] * 1e12 * 0.9)
    expected = math.hypot(compute, memory) + 4e-6
    assert gemm_seconds(b200, n, n, n, fp4=True) == pytest.approx(expected, rel=1e-12)
    # about half of FP8's time at this size; a GPU without FP4 runs it at its FP8 rate
    assert 0.5 < expected / gemm_seconds(b200, n, n, n, fp8=True) < 0.56
    grouped = grouped_gemm_seconds(b200, (n,), n, n, fp4=True)
    assert grouped == gemm_seconds(b200, n, n, n, fp4=True)
    assert kernel_model("h100").fp4_flops == kernel_model("h100").fp8_flops


def test_fp4_flops_are_counted_apart_from_fp8():
    from metatrace.hooks import flops

    count = flops.FlopCount(kernel_model("b200"))
    flops.push(count)
    try:
        flops.report_gemm(128, 256, 512, fp4=True)
        flops.report_gemm(128, 256, 512, fp8=True)
        flops.report_grouped([64, 64], 256, 512, fp4=True, times=2)
        flops.report(1000, fp4=True)
    finally:
        flops.pop(count)
    one = 2 * 128 * 256 * 512
    assert (count.total, count.fp8, count.fp4) == (4 * one + 1000, one, 3 * one + 1000)
