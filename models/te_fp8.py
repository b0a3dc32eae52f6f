"""FP8 as Transformer Engine 2.8 runs it for its Linear / LayerNormLinear modules.

What quantized copies exist, from TE's tensor/ and module/ sources (shapes for a tensor [M, K]):

| recipe | row-wise usage | column-wise usage |
|---|---|---|
| delayed, tensorwise (Float8), sm89/sm90 | data u8 [M, K] | transpose u8 [K, M] |
| delayed, tensorwise (Float8), sm100 | data u8 [M, K] serves both | |
| mxfp8 (32-element blocks) | data u8 [M, K] + scales u8 [rnd(M,128), rnd(K/32,4)] | data u8 [M, K] + scales u8 [rnd(M/32,4), rnd(K,128)] |
| blockwise, activations and gradients (1x128) | data u8 [M, K] + fp32 [K/128, rnd(M,4)] | data u8 [K, M] + fp32 [M/128, rnd(K,4)] |
| blockwise, weights (128x128) | data u8 [M, K] + fp32 [M/128, rnd(K/128,4)] | data u8 [K, M] + fp32 [K/128, rnd(M/128,4)] |
| nvfp4 (16-element blocks, sm100) | data u8 [M, K/2] + E4M3 u8 [rnd(M,128), rnd(K/16,4)] + amax fp32 [1] | data u8 [K, M/2] + E4M3 u8 [rnd(K,128), rnd(M/16,4)] + amax fp32 [1] |

Every Float8 tensor also has a scale_inv fp32 [1].

NVFP4 (TE 2.8 NVFP4BlockScaling, common/recipe/__init__.py:381-445; NVFP4Quantizer::create_tensor,
csrc/quantizer.cpp:1172-1273; get_scale_shape, quantizer.cpp:1671-1700): two E2M1 values a byte,
an E4M3 scale per 16 elements of a row (row-wise) or of a column (column-wise, the data
transposed), the scales padded to 128 rows and 4 columns for cuBLAS's swizzle, and a per-tensor
fp32 amax per usage; both dimensions must be multiples of 16 (quantizer.cpp:1186-1191). Weights
are quantized in 16x16 blocks (fp4_quant_fwd_weight: the same buffers, each block's scale
repeated over its 16 rows), activations and gradients in 1x16 blocks with a random Hadamard
transform on their column-wise (wgrad) copy, gradients with stochastic rounding. A quantize
(NVFP4Quantizer::quantize_impl, quantizer.cpp:1438-1640) first reads the input for its amaxes
(with the Hadamard transform: nvte_hadamard_transform_amax, the column-wise amax after it;
weights: nvte_compute_amax), all-reduces them over TP where the tensor is about to be
all-gathered, then writes the usages: weights in one kernel (cast_kernels.cuh:2097-2138), the
others row-wise in one kernel and column-wise in a fused Hadamard-and-cast kernel (bf16 input,
rows a multiple of 64, columns of 128), else through a bf16 [K, M] Hadamard output quantized in
turn. Stochastic rounding draws a Philox state into an int64 [2] for each quantize. Per module, delayed scaling keeps fp8_meta
(scale [3], amax_history [H, 3], scale [2], amax_history [H, 2], fp32; H is megatron-core's
fp8_amax_history_len, which it passes to TE's DelayedScaling: 1 by default) and current
scaling a scale and an amax [1] per quantizer (five); the weight is quantized once into a
workspace the module keeps (megatron passes is_first_microbatch). Delayed scaling reduces the
amaxes of all modules of an autocast region over the amax-reduction group (torch.cat, then a MAX
all-reduce): once when the region exits and once at the end of the backward of the region's
first module. Current scaling all-reduces a [1] amax over the TP group before each FP8
all-gather of activations or gradients.

`fp8_autocast` and `get_fp8_context` stand in for TE's fp8_autocast and megatron-core's
get_fp8_context (which returns a null context without TE); `metatrace.hooks.patches` installs
them.

Known limitations: FP8 attention (fp8_dot_product_attention), NVFP4 primary weights
(fp4_param: megatron-core 0.16.1's DDP and distributed optimizer have no NVFP4 path), the
transient swizzled copies of MXFP8 / NVFP4 scales each GEMM makes (gemm.cpp:229-236), the
weight workspaces' casts (made once, not timed, for every recipe),
the amax-history clones kept for FP8 activation recompute, the bf16 fallback for MXFP8 /
blockwise tensors whose dimensions are not multiples of 32 / 128, and GEMM workspaces are not
modelled.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from metatrace.errors import ConfigError
from metatrace.hooks import flops

U8 = torch.uint8
F32 = torch.float32


def _rnd(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Quantized:
    """The buffers of one quantized tensor, by usage."""

    rowwise: list = field(default_factory=list)
    columnwise: list = field(default_factory=list)
    shared: list = field(default_factory=list)

    def row_data(self) -> torch.Tensor:
        """The row-wise data buffer (on sm100 Float8 the one buffer both usages share)."""
        return (self.rowwise or self.columnwise)[0]

    def drop_rowwise(self) -> None:
        self.rowwise = []

    def drop_columnwise(self) -> None:
        self.columnwise = []

    def tensors(self) -> list:
        return [*self.rowwise, *self.columnwise, *self.shared]

    def data(self) -> list:
        """TE's get_data_tensors: the FP8 data buffers (each usage's first), not the scales."""
        return [*self.rowwise[:1], *self.columnwise[:1]]


def gemm_kind(recipe: str) -> dict:
    """The keyword flops.report_gemm / report_grouped take for a recipe's GEMMs."""
    return {"fp4": True} if recipe == "nvfp4" else {"fp8": True}


def quantize(
    shape,
    recipe: str,
    arch: str,
    *,
    rowwise: bool,
    columnwise: bool,
    device,
    weight: bool = False,
    grad: bool = False,
    compact: bool = False,
    cast: torch.Tensor | None = None,
    amax_group=None,
) -> Quantized:
    """Allocate what TE's quantizer allocates for a [M, K] tensor. `cast`: the high-precision
    tensor a quantizing kernel (cast, cast-transpose, a norm writing FP8) reads to fill these
    buffers, timed by the bytes read and written; None where they are a collective's destination
    or timed elsewhere. NVFP4: `weight` (16x16 blocks, no Hadamard transform) or `grad`
    (stochastic rounding) pick the quantizer's settings; `amax_group`: the TP group its amaxes
    are all-reduced over (an input about to be all-gathered)."""
    m, k = shape
    empty = lambda *s, dtype=U8: torch.empty(s, dtype=dtype, device=device)
    q = Quantized()
    if recipe == "nvfp4":
        if m % 16 or k % 16:  # quantizer.cpp:1186-1191
            # TE's own words first ("NVFP4 requires tensor dims that are divisible by 16"),
            # then what it means for the job: the real run fails at this tensor.
            raise ConfigError(
                f"training.precision fp4: NVFP4 requires tensor dims that are divisible by 16 "
                f"(got shape={[m, k]}): Transformer Engine 2.8 refuses to quantize this "
                "tensor of the model, so the run fails there; make the layer's widths "
                "multiples of 16 or train in fp8"
            )
        if rowwise:
            q.rowwise += [
                empty(m, k // 2),
                empty(_rnd(m, 128), _rnd(k // 16, 4)),
                empty(1, dtype=F32),
            ]
        if columnwise:
            q.columnwise += [
                empty(k, m // 2),
                empty(_rnd(k, 128), _rnd(m // 16, 4)),
                empty(1, dtype=F32),
            ]
        if cast is not None:
            _nvfp4_kernels(cast, q, rht=not weight, stochastic=grad, group=amax_group)
        return q
    if recipe in ("delayed", "tensorwise"):
        if arch == "sm100":  # one [M, K] buffer serves both usages
            if rowwise or columnwise:
                (q.columnwise if columnwise else q.rowwise).append(empty(m, k))
        else:
            if rowwise:
                q.rowwise.append(empty(m, k))
            if columnwise:
                q.columnwise.append(empty(k, m))
        q.shared.append(empty(1, dtype=F32))
    elif recipe == "mxfp8":
        if rowwise:
            q.rowwise += [empty(m, k), empty(_rnd(m, 128), _rnd(_cdiv(k, 32), 4))]
        if columnwise:
            q.columnwise += [empty(m, k), empty(_rnd(_cdiv(m, 32), 4), _rnd(k, 128))]
    elif recipe == "blockwise":
        if weight:
            row_scale = (_cdiv(m, 128), _rnd(_cdiv(k, 128), 4))
            col_scale = (_cdiv(k, 128), _rnd(_cdiv(m, 128), 4))
        else:
            row_scale = (_cdiv(k, 128), _rnd(m, 4))
            col_scale = (_cdiv(m, 128), _rnd(k, 4)) if not compact else (_cdiv(m, 128), k)
        if rowwise:
            q.rowwise += [empty(m, k), empty(*row_scale, dtype=F32)]
        if columnwise:
            col_data = (m, k) if compact else (k, m)
            q.columnwise += [empty(*col_data), empty(*col_scale, dtype=F32)]
    else:
        raise ValueError(f"unknown fp8 recipe {recipe!r}")
    if cast is not None:
        flops.report_moved(cast, *q.tensors())
        if recipe == "tensorwise":  # its amax first, then the scale (quantizer.cpp:497-535)
            flops.report_moved(cast, launches=2)
    return q


def _nvfp4_kernels(x: torch.Tensor, q: Quantized, *, rht: bool, stochastic: bool, group) -> None:
    """What NVFP4Quantizer::quantize_impl (quantizer.cpp:1438-1640) runs to fill `q` from the
    bf16 [rows, cols] `x`: the kernels' bytes, the transient buffers, the amax all-reduce."""
    if x.numel() == 0:  # quantizer.cpp:1442-1444
        return
    rows, cols = x.shape
    # quantizer.cpp:1460-1471: a Philox state per quantize with stochastic rounding
    rng = torch.empty(2, dtype=torch.int64, device=x.device) if stochastic else None
    amaxes = q.rowwise[2:] + q.columnwise[2:]
    flops.report_moved(x, *amaxes)  # the amax pass (1476-1514): reads the whole input
    if group is not None and dist.get_world_size(group) > 1:
        # quantizer.cpp:1516-1535: allreduce_coalesced (MAX) of the usages' amaxes
        with dist._coalescing_manager(group=group, device=x.device):
            for amax in amaxes:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    if not rht:  # one kernel writes both usages (cast_kernels.cuh:2097-2138)
        flops.report_moved(x, *q.rowwise[:2], *q.columnwise[:2])
        del rng
        return
    if q.rowwise:  # the row-wise usage without the transform (quantizer.cpp:1537-1555)
        flops.report_moved(x, *q.rowwise[:2])
    if q.columnwise:
        if rows % 64 == 0 and cols % 128 == 0:  # the fused Hadamard cast (1570, 1622-1631)
            flops.report_moved(x, *q.columnwise[:2])
        else:  # RHT(x^T) into a bf16 [cols, rows] buffer, then quantized (1594-1621)
            transformed = torch.empty((cols, rows), dtype=x.dtype, device=x.device)
            flops.report_moved(x, transformed)
            flops.report_moved(transformed, *q.columnwise[:2])
            del transformed
    del rng


# ----------------------------------------------------------------------------- autocast state


@dataclass
class _Region:
    recipe: str
    group: object
    modules: list = field(default_factory=list)


class _State:
    region: _Region | None = None


STATE = _State()


def active_recipe() -> str | None:
    return STATE.region.recipe if STATE.region is not None else None


def register(module) -> _Region | None:
    """A TE module runs a forward in the current region; it is the region's first if so."""
    region = STATE.region
    if region is not None and module not in region.modules:
        region.modules.append(module)
    return region


def reduce_amax(region: _Region, per_module: int, device) -> None:
    """Delayed scaling: concatenate the amaxes of the region's modules, MAX-all-reduce them."""
    if region is None or region.recipe != "delayed" or not region.modules:
        return
    # `per_module` is a TE module's count per GEMM (a GroupedLinear has num_gemms); the op
    # fuser's BasicLinear keeps one fewer (te_fused_mlp.BasicLinearState.fp8_amax_fewer).
    count = sum(
        per_module * getattr(m, "num_gemms", 1) - getattr(m, "fp8_amax_fewer", 0)
        for m in region.modules
    )
    amax = torch.empty(count, dtype=F32, device=device)
    if region.group is not None and dist.get_world_size(region.group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=region.group)


@contextlib.contextmanager
def fp8_autocast(recipe: str, group):
    """TE's fp8_autocast: FP8 GEMMs inside; the delayed-scaling forward amax reduction on exit."""
    outer = STATE.region
    region = _Region(recipe, group)
    STATE.region = region
    try:
        yield
    finally:
        STATE.region = outer
        device = next((_device(m) for m in region.modules), None)
        if device is not None:
            reduce_amax(region, 3, device)


def _device(module):
    """A TE module's device (GroupedLinear has weight0.. rather than weight)."""
    weight = getattr(module, "weight", None)
    return weight.device if weight is not None else next(module.parameters()).device


def bf16_layer(config, layer_no: int) -> bool:
    """Whether the global layer `layer_no` (0-based) runs in bf16 under first_last_layers_bf16:
    restates megatron-core 0.16.1 fp8_utils.py:511-530 (is_first_last_bf16_layer), which
    fp4_utils.py:122-136 repeats."""
    if layer_no < 0 or not config.first_last_layers_bf16:
        return False
    return (
        layer_no < config.num_layers_at_start_in_bf16
        or layer_no >= config.num_layers - config.num_layers_at_end_in_bf16
    )


def _amax_group(config):
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return ps.get_amax_reduction_group(
        with_context_parallel=True, tp_only_amax_red=config.tp_only_amax_red
    )


def _value(recipe) -> str:
    return str(recipe.value if hasattr(recipe, "value") else recipe)


def get_fp8_context(config, layer_no: int = -1, is_init: bool = False):
    """megatron-core's get_fp8_context with metatrace's fp8_autocast; the first and last layers
    in bf16 where first_last_layers_bf16 asks (fp8_utils.py:516-526)."""
    if is_init or not config.fp8 or bf16_layer(config, layer_no):
        return contextlib.nullcontext()
    return fp8_autocast(_value(config.fp8_recipe), _amax_group(config))


def get_fp4_context(config, layer_no: int = -1, is_init: bool = False):
    """megatron-core's get_fp4_context (fp4_utils.py:120-161) with metatrace's fp8_autocast:
    TE runs NVFP4 through the same autocast (fp8_recipe=NVFP4BlockScaling). At init it would
    enter fp8_model_init for fp4_param, which metatrace refuses (Megatron-LM's
    --fp4-param-gather is not modelled): a null context."""
    if is_init or not config.fp4 or bf16_layer(config, layer_no):
        return contextlib.nullcontext()
    return fp8_autocast(_value(config.fp4_recipe), _amax_group(config))


def module_state(module, recipe: str, device) -> None:
    """Per-module scaling state TE creates on the module's first FP8 forward (kept); a
    GroupedLinear has the quantizers of its num_gemms GEMMs (grouped_linear.py:590-594)."""
    if getattr(module, "_fp8_meta_tensors", None) is not None:
        return
    n = getattr(module, "num_gemms", 1)
    if recipe == "delayed":
        history = getattr(getattr(module, "config", None), "fp8_amax_history_len", 1)
        shapes = [(3 * n,), (history, 3 * n), (2 * n,), (history, 2 * n)]
    elif recipe == "tensorwise":
        shapes = [(1,)] * (10 * n)  # scale and amax for each of the five quantizers
    else:
        shapes = []
    module._fp8_meta_tensors = [torch.zeros(s, dtype=F32, device=device) for s in shapes]


def weight_workspace(module, weight, recipe: str, arch: str, key: str = "weight") -> Quantized:
    """The FP8 weight the module keeps between micro-batches (TE's _fp8_workspaces[key]:
    "weight", or "weight{i}" per expert of a GroupedLinear), made with both usages."""
    workspaces = module.__dict__.setdefault("_fp8_workspaces", {})
    cached = workspaces.get(key)
    if cached is None or cached[0] != recipe:
        quantized = quantize(
            tuple(weight.shape),
            recipe,
            arch,
            rowwise=True,
            columnwise=True,
            device=weight.device,
            weight=True,
        )
        cached = workspaces[key] = (recipe, quantized)
    return cached[1]


def fp8_param_buffers(shape, recipe: str, arch: str, device) -> list:
    """FP8 primary weights (fp8_model_init): the parameter is the quantized row-wise data; the
    other buffers of TE's quantized parameter (the column-wise copy, scales) live with it for the
    whole run. Created with grad enabled, so both usages exist. Returns those other buffers."""
    q = quantize(
        tuple(shape), recipe, arch, rowwise=True, columnwise=True, device=device, weight=True
    )
    # The row-wise data is the parameter itself (sm100 Float8: the one shared buffer).
    rest = q.rowwise[1:] + q.columnwise[(1 if arch == "sm100" and not q.rowwise else 0) :]
    return rest + q.shared


def register_fp8_param_buffers(module, config, shape, device, prefix: str) -> None:
    """fp8_param_buffers of a weight of `shape`, under the job's recipe and GPU, as `module`'s
    non-persistent buffers `{prefix}0`, `{prefix}1`, ..."""
    recipe = str(getattr(config.fp8_recipe, "value", config.fp8_recipe))
    arch = getattr(config, "metatrace_gpu_arch", "sm90")
    for i, t in enumerate(fp8_param_buffers(shape, recipe, arch, device)):
        module.register_buffer(f"{prefix}{i}", t, persistent=False)


def split_quantize(
    m_splits,
    cols: int,
    recipe: str,
    arch: str,
    *,
    rowwise: bool,
    columnwise: bool,
    device,
    x: torch.Tensor | None = None,
    grad: bool = False,
) -> list[Quantized]:
    """TE's tex.split_quantize of a [sum(m_splits), cols] tensor, one quantizer per expert
    (extensions/cast.cpp:496-598). Float8 (delayed, tensorwise) and NVFP4 quantize each expert's
    rows into tensors of their own (create_tensor, then each quantizer's own quantize:
    cast.cpp:560-568, 145-148; NVFP4 with its amax pass and Hadamard kernels, priced from `x`,
    the [sum(m_splits), cols] input; `grad`: gradient quantizers); MXFP8 and blockwise allocate
    one uint8 buffer per usage for all experts (each expert's data 256-byte aligned, then each
    expert's scales 16-byte aligned, cast.cpp:245-265, 288-308) and hand out views of it:
    returned as one Quantized holding the bulk buffers."""
    if recipe == "nvfp4":
        out, start = [], 0
        for m in m_splits:
            cast = x[start : start + m] if x is not None else None
            start += m
            out.append(
                quantize(
                    (m, cols),
                    recipe,
                    arch,
                    rowwise=rowwise,
                    columnwise=columnwise,
                    device=device,
                    grad=grad,
                    cast=cast,
                )
            )
        return out
    experts = sum(1 for m in m_splits if m)  # the kernels of a quantization an expert
    if recipe in ("delayed", "tensorwise"):
        out = [
            quantize((m, cols), recipe, arch, rowwise=rowwise, columnwise=columnwise, device=device)
            for m in m_splits
        ]
        fused = recipe == "delayed" and rowwise and columnwise and arch != "sm100"
        _price_split(x, recipe, [t for q in out for t in q.tensors()], 1 if fused else experts)
        return out
    out = Quantized()
    for usage, wanted in (("rowwise", rowwise), ("columnwise", columnwise)):
        if not wanted:
            continue
        per_expert = [
            quantize((m, cols), recipe, "sm90", device="meta", **{usage: True}, **_other(usage))
            for m in m_splits
            if m
        ]
        offset = 0
        for q in per_expert:  # the data, then the scales
            offset = _rnd(offset, 256) + _nbytes(getattr(q, usage)[0])
        for q in per_expert:
            offset = _rnd(offset, 16) + _nbytes(getattr(q, usage)[1])
        getattr(out, usage).append(torch.empty(offset, dtype=U8, device=device))
    _price_split(x, recipe, out.tensors(), experts)
    return [out]


def _price_split(x, recipe: str, written: list, kernels: int) -> None:
    """The split quantization's kernels, by the bytes they move: they read the experts' rows of
    `x` once and write their quantized buffers, in `kernels` launches: TE 2.8's
    multi_tensor_quantize_impl (cast.cpp:103-150) runs one fused nvte_multi_cast_transpose
    for delayed scaling with both usages (off Blackwell), else each expert's quantizer in turn
    (MXFP8, blockwise and Float8 alike: one kernel an expert with rows); current scaling
    (tensorwise) reads each expert's rows once more before, for its amax, and computes its
    scale in a kernel of its own (Float8CurrentScalingQuantizer::quantize_impl, quantizer.cpp:
    497-535). Nothing without `x` (a quantization timed elsewhere)."""
    if x is None:
        return
    flops.report_moved(x, *written, launches=kernels)
    if recipe == "tensorwise":
        flops.report_moved(x, launches=2 * kernels)


def _other(usage: str) -> dict:
    return {"columnwise" if usage == "rowwise" else "rowwise": False}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def checkpoint(
    function, distribute_saved_activations, get_rng_state_tracker, tp_group, *args, **kwargs
):
    """megatron-core's te_checkpoint (used for recompute under FP8) with megatron-core's own
    activation checkpointing, which saves the same inputs; the recompute runs under the FP8
    region the forward ran in, as TE's _CheckpointFunction re-enters it (TE 2.8
    distributed.py:372-379, 418-425: fp8_autocast(enabled=ctx.fp8, fp8_recipe=ctx.fp8_recipe)).
    Under delayed scaling that region is the block's outer one, which the backward is not in."""
    from functools import partial

    from megatron.core import tensor_parallel

    fn = partial(function, **kwargs) if kwargs else function
    recipe = active_recipe()
    recomputing = False

    def run(*inputs):
        nonlocal recomputing
        region = recompute_autocast(True, recipe) if recomputing else contextlib.nullcontext()
        recomputing = True  # the first call is the forward, the others recompute it
        with region:
            return fn(*inputs)

    return tensor_parallel.checkpoint(run, distribute_saved_activations, *args)


# ----------------------------------------------------------------------------- FP8 recompute


class FP8GlobalStateManager:
    """What megatron-core's CheckpointWithoutOutput(fp8=True) reads of TE's global FP8 state
    (tensor_parallel/random.py: layernorm and MLA up-projection recompute under FP8): whether a
    region is active and its recipe, to recompute under the same."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return STATE.region is not None

    @staticmethod
    def get_fp8_recipe() -> str | None:
        return active_recipe()


def recompute_autocast(enabled: bool = True, fp8_recipe: str | None = None, **_):
    """TE's fp8_autocast as CheckpointWithoutOutput re-enters it for the recompute: the recipe of
    the first pass; TE restores that pass's scaling state instead of reducing amaxes again
    (fp8.py:524-568), so the region reduces nothing (no group)."""
    if not enabled or fp8_recipe is None:
        return contextlib.nullcontext()
    return fp8_autocast(fp8_recipe, None)


def activation_recompute_forward(**_):
    """TE's activation_recompute_forward (distributed.py:243-248): it marks the passes of an FP8
    activation recompute for TE's scaling-state bookkeeping, whose copies are not modelled."""
    return contextlib.nullcontext()
