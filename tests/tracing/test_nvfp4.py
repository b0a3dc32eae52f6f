"""NVFP4 (training.precision fp4): Transformer Engine 2.8's NVFP4BlockScaling as the stand-ins
keep it, against closed forms from TE's sources (tensor/nvfp4_tensor.py, csrc/quantizer.cpp,
distributed.py; TE cannot run without CUDA, so these are restated)."""

import pytest
import torch

from metatrace.analysis import aggregate as agg
from metatrace.tracing.trace import trace_job
from tests.helpers import BALANCED, MOE, small_job
from tests.tracing.test_te import A, B, D, F, H, S, traced_layer_bytes


def rnd(x, m=512):
    return -(-x // m) * m


# ---------------------------------------------------------------------------- one quantized tensor


def _quantize(shape, **kw):
    from metatrace.models.te_fp8 import quantize

    return quantize(shape, "nvfp4", "sm100", device="meta", **kw)


def test_nvfp4_buffers_are_what_create_tensor_allocates():
    """[48, 80]: rows and columns multiples of 16 (as TE requires) but of neither 64 nor 128, and
    K/16 = 5, M/16 = 3 not multiples of 4: every padding rule shows. quantizer.cpp:1172-1273,
    get_scale_shape 1671-1700: row-wise data u8 [M, K/2], scales u8 [rnd(M, 128),
    rnd(K/16, 4)], amax fp32 [1]; column-wise data u8 [K, M/2], scales u8 [rnd(K, 128),
    rnd(M/16, 4)], amax fp32 [1]."""
    q = _quantize((48, 80), rowwise=True, columnwise=True)
    shapes = [(tuple(t.shape), t.dtype) for t in q.rowwise + q.columnwise]
    assert shapes == [
        ((48, 40), torch.uint8),  # two E2M1 values a byte
        ((128, 8), torch.uint8),  # 48 rows padded to 128; 5 scales a row padded to 8
        ((1,), torch.float32),
        ((80, 24), torch.uint8),  # transposed, two a byte
        ((128, 4), torch.uint8),  # 80 columns padded to 128; 3 scales a column padded to 4
        ((1,), torch.float32),
    ]
    assert sum(t.nbytes for t in q.tensors()) == 1920 + 1024 + 4 + 1920 + 512 + 4
    # 1x16 and 16x16 blocks (weights) have the same buffers: a 2D block's scale is repeated
    weight = _quantize((48, 80), rowwise=True, columnwise=True, weight=True)
    assert [t.shape for t in weight.tensors()] == [t.shape for t in q.tensors()]
    only_columns = _quantize((48, 80), rowwise=False, columnwise=True)
    assert [tuple(t.shape) for t in only_columns.tensors()] == [(80, 24), (128, 4), (1,)]


@pytest.mark.parametrize("shape", [(40, 80), (48, 72)])
def test_nvfp4_refuses_dims_not_multiples_of_16(shape):
    from metatrace.errors import ConfigError

    with pytest.raises(ConfigError, match="divisible by 16"):  # one message, exit 2
        _quantize(shape, rowwise=True, columnwise=True)


def _moved(monkeypatch, shape, **kw):
    """The bytes of each kernel `quantize` prices (flops.report_moved calls), in order."""
    from metatrace.hooks import flops

    calls = []
    monkeypatch.setattr(flops, "report_moved", lambda *ts: calls.append(sum(t.nbytes for t in ts)))
    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    _quantize(shape, rowwise=True, columnwise=True, cast=x, **kw)
    return calls


def test_nvfp4_casts_move_what_te_reads_and_writes(monkeypatch):
    """NVFP4Quantizer::quantize_impl (quantizer.cpp:1438-1640) on a bf16 [48, 80] input
    (7,680 bytes): the amax pass reads it (and writes the two fp32 amaxes); an activation's
    row-wise usage in one kernel; its column-wise usage, rows not a multiple of 64, through the
    bf16 [80, 48] Hadamard output (written, then read by the cast). A weight (no transform):
    one kernel writes both usages."""
    x = 48 * 80 * 2
    assert _moved(monkeypatch, (48, 80)) == [
        x + 8,  # amax pass
        x + 1920 + 1024,  # row-wise data + scales
        x + x,  # RHT(x^T) into bf16 [80, 48]
        x + 1920 + 512,  # that, cast to column-wise data + scales
    ]
    assert _moved(monkeypatch, (48, 80), weight=True) == [x + 8, x + 1920 + 1024 + 1920 + 512]
    # rows a multiple of 64 and columns of 128: the fused Hadamard cast, no bf16 transient
    y = 64 * 128 * 2
    col = 128 * 32 + 128 * 4  # data [128, 32], scales [128, rnd(4, 4)]
    assert _moved(monkeypatch, (64, 128)) == [y + 8, y + 64 * 64 + 128 * 8, y + col]


def test_stochastic_rounding_draws_a_philox_state_per_gradient_cast():
    """quantizer.cpp:1460-1471: a gradient quantizer (stochastic rounding) allocates an int64 [2]
    for the Philox state each quantize; activations and weights do not; the non-fused Hadamard
    path allocates its bf16 [K, M] output."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.empty.memory_format and out.dtype != torch.uint8:
                self.seen.append((tuple(out.shape), out.dtype))
            return out

    def allocations(**kw):
        x = torch.empty((48, 80), dtype=torch.bfloat16, device="meta")
        with Allocations() as mode:
            _quantize((48, 80), rowwise=True, columnwise=True, cast=x, **kw)
        return mode.seen

    amaxes = [((1,), torch.float32)] * 2
    transient = [((80, 48), torch.bfloat16)]
    assert allocations(grad=True) == amaxes + [((2,), torch.int64)] + transient
    assert allocations() == amaxes + transient
    assert allocations(weight=True) == amaxes


# ---------------------------------------------------------------------------- a traced layer


def test_fp4_layer_keeps_half_a_byte_against_mxfp8():
    """The middle layer of S 256 x B 2 = 512 tokens, H 128, F 192, on a b200: what each recipe
    keeps of the three inputs it quantizes for wgrad (the column-wise usage; linear_proj keeps
    its bf16 input under both, save_original_input). Worked by hand, each storage in 512-byte
    blocks:
      qkv, fc1 input [512, 128]: MXFP8 data 65,536 + scales [16, 128] 2,048 = 67,584;
                                 NVFP4 data [128, 256] 32,768 + scales [128, 32] 4,096
                                       + amax 512 = 37,376;
      fc2 input [512, 192]:      MXFP8 98,304 + scales [16, 256] 4,096 = 102,400;
                                 NVFP4 [192, 256] 49,152 + [256, 32] 8,192 + 512 = 57,856.
    Difference: 2 x 30,208 + 44,544 = 104,960 bytes."""
    common = dict(model={"num_query_groups": 8}, cluster={"gpu": "b200"})
    mxfp8 = traced_layer_bytes(**common, training={"precision": "fp8", "fp8_recipe": "mxfp8"})
    fp4 = traced_layer_bytes(**common, training={"precision": "fp4"})
    assert mxfp8 - fp4 == 104_960
    n = S * B
    bf16 = traced_layer_bytes(**common)
    # against bf16: the two ln_out and fc2's input [n, 2 bytes] replaced by the NVFP4 buffers
    kept_bf16 = 2 * rnd(n * H * 2) + rnd(n * F * 2)
    assert bf16 - fp4 == kept_bf16 - (2 * 37_376 + 57_856)
    assert A * D == H  # (the attention output, kept in bf16 by both, is H wide)


def _job(training=None, **sections):
    return small_job(
        model={"num_layers": 3, "hidden_size": H, "num_attention_heads": A, "ffn_hidden_size": F},
        training={"seq_length": S, "micro_batch_size": B, "precision": "fp4", **(training or {})},
        cluster={"gpu": "b200"},
        **sections,
    )


def _trace(job):
    return trace_job(job, full_model=False, workers=1).roles[0].trace


def test_fp4_sequence_parallel_gathers_fp4_data_and_scales():
    """Column parallel + SP (linear_qkv, tp 2): the local [256, 128] input's two amaxes
    all-reduced (MAX, coalesced) over TP (linear.py:1663-1672, quantizer.cpp:1516-1535), then
    its row-wise scales and data gathered in one coalesced call into [512, 128]: scales
    [512, 8] (the padding rows sliced off) and data [512, 64]. In backward the saved column-wise
    copy is gathered for wgrad: scales [2 x 128, 16] and data [2 x 128, 128], interleaved.
    Row parallel + SP (linear_fc2): the output gradient [256, 128] with both usages gathered
    the same way (four tensors)."""
    trace = _trace(_job(parallel={"tp": 2, "sequence_parallel": True}))

    def calls(module, phase):
        name = f"decoder.layers.1.{module}"
        return [
            (c.op, c.count, c.bytes)
            for c in trace.collectives
            if c.module == name and c.phase == phase and c.group == "tp"
        ]

    qkv_fwd = calls("self_attention.linear_qkv", "forward")
    assert qkv_fwd == [("all_reduce", 2, 8), ("all_gather", 2, 512 * 8 + 512 * 64)]
    qkv_bwd = calls("self_attention.linear_qkv", "backward")
    assert ("all_gather", 2, 256 * 16 + 256 * 128) in qkv_bwd
    fc2_bwd = calls("mlp.linear_fc2", "backward")
    assert fc2_bwd[:2] == [
        ("all_reduce", 2, 8),
        ("all_gather", 4, 512 * 8 + 512 * 64 + 256 * 16 + 256 * 128),
    ]


def test_fp4_flops_are_kept_apart_from_fp8():
    """The FLOP counters keep FP4 GEMMs apart: a window's fp8_flops has none of them, its flops
    all (the same FLOPs as under MXFP8, where fp8_flops holds the GEMMs')."""
    fp4 = _trace(_job())
    mxfp8 = _trace(_job(training={"precision": "fp8", "fp8_recipe": "mxfp8"}))
    steps = [(w.flops, w.fp8_flops) for w in fp4.windows if w.chunk is not None]
    assert steps and all(f > 0 and f8 == 0 for f, f8 in steps)
    assert [w.flops for w in mxfp8.windows] == [w.flops for w in fp4.windows]
    assert any(w.fp8_flops for w in mxfp8.windows)


def test_first_last_layers_bf16_run_the_first_and_last_layers_unquantized():
    """first_last_layers_bf16 (get_fp4_context, fp4_utils.py:122-136): layers 0 and 2 of 3 run
    outside the autocast, keeping what bf16 keeps; layer 1 what FP4 keeps."""

    def layers(trace):
        rows = {r.fqn: r for r in agg.walk(agg.module_tree(trace))}
        return [rows[f"decoder.layers.{i}"].activation_bytes_total for i in range(3)]

    bf16 = layers(_trace(_job(training={"precision": "bf16"})))
    fp4 = layers(_trace(_job()))
    mixed = layers(_trace(_job(training={"first_last_layers_bf16": True})))
    assert fp4[1] < bf16[1]
    assert mixed == [bf16[0], fp4[1], bf16[2]]
    two_last = layers(
        _trace(
            _job(
                training={
                    "first_last_layers_bf16": True,
                    "num_layers_at_start_in_bf16": 0,
                    "num_layers_at_end_in_bf16": 2,
                }
            )
        )
    )
    assert two_last == [fp4[0], bf16[1], bf16[2]]


# ---------------------------------------------------------------------------- grouped experts

E, MH, MF = 2, 64, 96  # local experts, the debug preset's hidden size, the expert FFN size


def test_fp4_experts_keep_each_experts_nvfp4_input():
    """GroupedLinear under NVFP4 (TE 2.8): split_quantize creates and quantizes each expert's
    tensor apart (cast.cpp:553-568, 145-148), no bulk buffer. Balanced routing gives each of the
    2 local experts s·b = 80 rows (a multiple of Fp8Padding's 16 already, fp8_padding.py:113-114,
    as every NVFP4 job's tokens per rank are). Kept per expert: column-wise data [K, 40], scales
    [rnd(K, 128), rnd(80 / 16, 4)] = [128, 8], amax [1]."""
    job = small_job(
        model={**MOE, "moe_ffn_hidden_size": MF},
        parallel={"ep": 2},
        training={**BALANCED, "seq_length": 40, "global_batch_size": 4, "precision": "fp4"},
        implementation={"moe_grouped_gemm": True},
        cluster={"num_gpus": 2, "gpu": "b200"},
    )
    trace = _trace(job)

    def saved(module):
        name = f"decoder.layers.0.mlp.experts.{module}"
        return sum(s.bytes for s in trace.saved if s.module == name and s.dtype != "bfloat16")

    def closed_form(k):
        return E * (rnd(k * 40) + rnd(128 * 8) + rnd(4))

    assert saved("linear_fc1") == closed_form(MH) == 2 * (2560 + 1024 + 512)
    assert saved("linear_fc2") == closed_form(MF) == 2 * (4096 + 1024 + 512)


def test_the_saved_input_is_reordered_when_the_wgrad_gemm_waits():
    """Column parallel + SP backward (linear_qkv, tp 2, its saved [256, 128] column-wise input):
    _all_gather_nvfp4 runs asynchronously (linear.py:651-656); make_empty's column-wise buffers
    (data [128, 256], scales [128, 32], amax) and the interleaved ones (scales [256, 16], data
    [256, 128]) are live across the dgrad GEMM (its bf16 [512, 128] output, reduce-scattered into
    [256, 128]); only when the wgrad GEMM waits are they reordered (tex.swap_first_dims: scales
    then data, each replacing make_empty's) and the scales padded (a new [128, 32])."""
    trace = _trace(_job(parallel={"tp": 2, "sequence_parallel": True}))
    deltas = [
        e.delta
        for e in trace.memory
        if e.module == "decoder.layers.1.self_attention.linear_qkv" and e.phase == "backward"
    ]
    gather = [32768, 4096, 512, 4096, 32768, -512]  # make_empty, interleaved, amax replaced
    dgrad = [131072, 65536]
    reorder = [4096, -4096, 32768, -32768, 4096, -4096]
    start = deltas.index(32768)
    assert deltas[start : start + 14] == gather + dgrad + reorder


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "mxfp8"])
def test_full_recompute_reruns_the_layers_in_fp8(recipe):
    """Full recompute under FP8 goes through TE's checkpoint: the recompute runs each layer in
    FP8 again, under its own context (tensorwise, MXFP8: megatron-core 0.19 runs the chunks in
    megatron.core.recompute, which binds te_checkpoint and the contexts at import) or under the
    region the forward ran in, which TE's checkpoint re-enters (delayed scaling's is the
    block's, outside which the backward runs). The backward computes the forward's FP8 GEMMs
    once more."""
    training = {"precision": "fp8", "fp8_recipe": recipe}

    def quantized(job, phase):
        return sum(w.fp8_flops for w in _trace(job).windows if w.phase == phase)

    recompute = {"granularity": "full", "method": "uniform", "num_layers": 1}
    eager, checkpointed = _job(training), _job({**training, "recompute": recompute})
    forward = quantized(eager, "forward")
    assert forward > 0
    assert quantized(checkpointed, "backward") - quantized(eager, "backward") == forward
