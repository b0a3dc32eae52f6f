"""The FP8 path of the Transformer Engine linear stand-ins (TE 2.8 module/linear.py and
module/layernorm_linear.py under fp8_autocast; quantized layouts in metatrace.models.te_fp8).

Forward: the input (LayerNormLinear: the norm output, written in FP8 directly by delayed
scaling, through a transient bf16 buffer otherwise) is quantized; under sequence parallelism a
column-parallel layer all-gathers it in FP8 (current scaling first all-reduces the amax; MXFP8
and blockwise gather data and scales in one coalesced call) and frees the gathered copy after
the GEMM; the weight comes from the module's persistent FP8 workspace. What is kept: only the
quantized input's column-wise usage (Float8 under SP: the local row-wise copy), not the bf16
input; LayerNormLinear also keeps its bf16 input x (the norm needs it) and fp32 mu / rsigma.

Backward: the output gradient is quantized (gathered in FP8 for row parallel + SP), the saved
input is gathered again in FP8 for column parallel + SP (and transposed on Hopper), dgrad and
wgrad come out in bf16, dgrad is reduce-scattered or all-reduced as in bf16. Delayed scaling
reduces the amaxes when the backward of the region's first module ends.

NVFP4 takes the same path (TE runs it under fp8_autocast): its gathers are TE's
_all_gather_nvfp4 (`_gather_nvfp4`: data and scales in one coalesced call, the column-wise
copy interleaved and reordered after, for the saved input only when the wgrad GEMM waits on the
asynchronous gather), its amaxes all-reduced over TP before a gathered tensor is quantized, a
bias's gradient summed apart from the cast (base.py:1224-1229).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from metatrace.hooks import flops
from metatrace.models.norm import norm_backward, norm_forward
from metatrace.models.te_cpu_offload import mark_if_offloading
from metatrace.models.te_fp8 import (
    F32,
    U8,
    Quantized,
    gemm_kind,
    module_state,
    quantize,
    reduce_amax,
    register,
    weight_workspace,
)
from metatrace.models.te_fp8_param import drop_blackwell_transpose, ensure_transpose
from metatrace.models.te_runtime import (
    bulk_reduced,
    dgrad_and_input,
    gemm_output,
    te_wgrad,
    ub_margin,
    ub_reduce_scatter,
    wgrad_into,
)


def _coalesced_gather(pairs, mode, device):
    """all_gather_into_tensor of several (output, input) pairs in one coalesced call."""
    with dist._coalescing_manager(group=mode.group, device=device):
        for out, inp in pairs:
            dist.all_gather_into_tensor(out, inp, group=mode.group)


def _amax_all_reduce(mode, device):
    """Current scaling: the amax of a tensor about to be all-gathered, MAX over TP."""
    amax = torch.zeros(1, dtype=F32, device=device)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mode.group)


def _gather_nvfp4(local: Quantized, local_shape, mode, device) -> tuple[Quantized, list]:
    """TE 2.8's _all_gather_nvfp4 (distributed.py:1275-1446) of the usages `local` has, from
    [M, K] on each rank into [M x tp, K]: make_empty allocates the output; the row-wise scales
    are gathered into the output's own with their padding rows sliced off, the column-wise ones
    (padding columns copied away where there are any) and the column-wise data into interleaved
    [K x tp, ...] buffers, all in one coalesced call; the amaxes are the input's. Returns the
    output and the interleaved column-wise buffers (scales, data) for `_nvfp4_post_gather`."""
    m, k = local_shape
    rowwise, columnwise = bool(local.rowwise), bool(local.columnwise)
    out = quantize(
        (m * mode.tp, k), "nvfp4", "sm100", rowwise=rowwise, columnwise=columnwise, device=device
    )
    pairs, interleaved = [], []
    if rowwise:
        data, scale, amax = local.rowwise
        pairs += [(out.rowwise[1][: m * mode.tp], scale[:m]), (out.rowwise[0], data)]
        out.rowwise[2] = amax
    if columnwise:
        data, scale, amax = local.columnwise
        unpadded = scale[:k, : m // 16]
        if unpadded.shape[1] != scale.shape[1]:
            unpadded = unpadded.contiguous()
        interleaved = [
            torch.empty((k * mode.tp, m // 16), dtype=U8, device=device),
            torch.empty((k * mode.tp, m // 2), dtype=U8, device=device),
        ]
        pairs += [(interleaved[0], unpadded), (interleaved[1], data)]
        out.columnwise[2] = amax
    _coalesced_gather(pairs, mode, device)
    return out, interleaved


def _nvfp4_post_gather(out: Quantized, interleaved: list, tp: int) -> None:
    """_post_process_nvfp4_gather (distributed.py:1230-1248): the interleaved column-wise scales
    and data de-interleaved into new tensors (tex.swap_first_dims, out=None), replacing the
    output's; the scales then padded into another (pad_columnwise_scale_inv, triton/pad.py:64-94,
    which always allocates)."""
    scale_i, data_i = interleaved
    k = scale_i.shape[0] // tp
    device = scale_i.device
    scale = torch.empty((k, tp * scale_i.shape[1]), dtype=U8, device=device)
    flops.report_moved(scale_i, scale)
    out.columnwise[1] = scale
    data = torch.empty((k, tp * data_i.shape[1]), dtype=U8, device=device)
    flops.report_moved(data_i, data)
    out.columnwise[0] = data
    padded = torch.empty((_rnd(k, 128), _rnd(scale.shape[1], 4)), dtype=U8, device=device)
    flops.report_moved(scale, padded)
    out.columnwise[1] = padded


def _rnd(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _gather_rowwise(q, local_shape, mode, recipe, arch, device):
    """All-gather the row-wise usage of a quantized [M, K] tensor into a new quantized
    [M x tp, K]; returns the gathered buffers."""
    m, k = local_shape
    full = (m * mode.tp, k)
    if recipe == "nvfp4":  # the input quantizer is set to row-wise usage for the gather
        rows_only = Quantized(rowwise=q.rowwise)
        gathered, _ = _gather_nvfp4(rows_only, local_shape, mode, device)
        return gathered.tensors()
    if recipe in ("delayed", "tensorwise"):
        data = torch.empty(full, dtype=U8, device=device)
        dist.all_gather_into_tensor(data, q.row_data(), group=mode.group)
        return [data]
    gathered = quantize(
        full,
        recipe,
        arch,
        rowwise=True,
        columnwise=False,
        device=device,
        compact=recipe == "blockwise",
    )
    data, scale = gathered.rowwise
    # TE strips the scale padding before gathering: the local scale's gathered copy.
    local_scale = q.rowwise[1]
    scale_out = torch.empty(
        (local_scale.shape[0] * mode.tp, *local_scale.shape[1:]),
        dtype=local_scale.dtype,
        device=device,
    )
    _coalesced_gather([(scale_out, local_scale), (data, q.rowwise[0])], mode, device)
    return [data, scale, scale_out]


def fp8_forward(ctx, x2, weight, bias, ln_weight, ln_bias):
    mode, module = ctx.mode, ctx.module
    recipe, arch, device = mode.fp8, mode.arch, x2.device
    region = register(module)
    module_state(module, recipe, device)
    float8 = recipe in ("delayed", "tensorwise")
    column_sp = mode.parallel == "column" and mode.sequence_parallel
    needs_wgrad = weight.requires_grad
    # save_original_input (TE Linear only): the bf16 input is saved, nothing quantized is kept
    original = getattr(module, "save_original_input", False) and needs_wgrad
    # Float8 cannot gather transposes: under SP only the row-wise copy is made and kept.
    columnwise = needs_wgrad and not (float8 and column_sp) and not original
    shape = tuple(x2.shape)
    usage = dict(
        rowwise=True,
        columnwise=columnwise,
        device=device,
        compact=column_sp and recipe == "blockwise",
        # NVFP4 all-reduces the input's amaxes over TP before it is gathered (linear.py:1663-1672)
        amax_group=mode.group if column_sp and recipe == "nvfp4" else None,
    )
    mu = rsigma = None
    if mode.norm is not None:
        rms = mode.norm == "RMSNorm"
        if recipe == "delayed":  # the fused norm kernel writes FP8 directly
            q = quantize(shape, recipe, arch, **usage, cast=x2)
            rsigma = torch.empty(shape[0], dtype=F32, device=device)
            mu = None if rms else torch.empty(shape[0], dtype=F32, device=device)
        else:  # norm in bf16, then quantize
            ln_out, mu, rsigma = norm_forward(x2, ln_weight, ln_bias, mode.eps, rms)
            q = quantize(shape, recipe, arch, **usage, cast=ln_out)
            del ln_out
    else:
        q = quantize(shape, recipe, arch, **usage, cast=x2)
    gathered = []
    if column_sp:
        if recipe == "tensorwise":
            _amax_all_reduce(mode, device)
        if "ag_fprop" in mode.ub:  # the FP8 data into the userbuffer (per-tensor recipes only)
            mode.ub_gather(q.row_data(), "fprop")
        else:
            gathered = _gather_rowwise(q, shape, mode, recipe, arch, device)
    rs_out = None
    if "rs_fprop" in mode.ub:  # TE allocates the reduce-scatter's output before the GEMM
        rs_out = torch.empty((shape[0] // mode.tp, weight.shape[0]), dtype=x2.dtype, device=device)
    if weight.element_size() > 1:
        weight_workspace(module, weight, recipe, arch)  # FP8 parameters need none
    elif needs_wgrad and torch.is_grad_enabled():
        ensure_transpose(weight, arch)  # after Megatron-FSDP discarded it
    rows = shape[0] * (mode.tp if column_sp else 1)
    out = gemm_output((rows, weight.shape[0]), dtype=x2.dtype, device=device)  # bf16 GEMM output
    with flops.sm_margin(ub_margin(mode, "fprop")):
        flops.report_gemm(rows, weight.shape[1], weight.shape[0], **gemm_kind(recipe))
    del gathered
    if not (float8 and column_sp):
        q.drop_rowwise()
    if rs_out is not None:
        ub_reduce_scatter(rs_out, out, mode.group)
        out = rs_out
    elif mode.parallel == "row" and mode.tp > 1:
        if mode.sequence_parallel:
            local = torch.empty((rows // mode.tp, out.shape[1]), dtype=out.dtype, device=device)
            dist.reduce_scatter_tensor(local, out, group=mode.group)
            out = local
        else:
            dist.all_reduce(out, group=mode.group)
    kept, data = (q.tensors(), q.data()) if not original else ([], [])
    del q
    saved_x = x2 if mode.norm is not None or original else None
    mark_if_offloading(saved_x, mu, rsigma, *data)
    ctx.save_for_backward(saved_x, weight, bias, ln_weight, ln_bias, mu, rsigma, *kept)
    ctx.original = original
    ctx.region = region
    ctx.first_in_region = region is not None and region.modules[:1] == [module]
    ctx.local_rows = shape[0]
    return out


def _quantized_grad(dy, mode, recipe, arch, needs_wgrad):
    """The output gradient in FP8 (gathered for row parallel + SP); returns its buffers."""
    device = dy.device
    nvfp4 = recipe == "nvfp4"
    if not (mode.parallel == "row" and mode.sequence_parallel):
        return quantize(
            tuple(dy.shape),
            recipe,
            arch,
            rowwise=True,
            columnwise=needs_wgrad,
            device=device,
            grad=nvfp4,
            cast=dy,
        ).tensors()
    local_shape = tuple(dy.shape)
    full = (local_shape[0] * mode.tp, local_shape[1])
    if nvfp4:  # gather_along_first_dim quantizes (amaxes all-reduced over TP), then gathers
        local = quantize(
            local_shape,
            recipe,
            arch,
            rowwise=True,
            columnwise=True,
            device=device,
            grad=True,
            cast=dy,
            amax_group=mode.group,
        )
        gathered, interleaved = _gather_nvfp4(local, local_shape, mode, device)
        _nvfp4_post_gather(gathered, interleaved, mode.tp)
        del local, interleaved  # locals of _all_gather_nvfp4
        return gathered.tensors()
    if recipe in ("delayed", "tensorwise"):
        local = quantize(
            local_shape, recipe, arch, rowwise=True, columnwise=False, device=device, cast=dy
        )
        if recipe == "tensorwise":
            _amax_all_reduce(mode, device)
        if "ag_dgrad" in mode.ub:
            # Gathered into the userbuffer for dgrad (the local copy goes when
            # grad_output_preprocess returns); wgrad's column-wise copy (a transpose on Hopper;
            # Blackwell's GEMM reads the row-wise data) is made from it.
            mode.ub_gather(local.row_data(), "dgrad")
            del local
            if needs_wgrad and arch != "sm100":
                return [torch.empty(full[::-1], dtype=U8, device=device)]
            return []
        # make_empty allocates the data and, for column-wise use on Hopper, the transpose.
        gathered = quantize(full, recipe, arch, rowwise=True, columnwise=True, device=device)
        dist.all_gather_into_tensor(gathered.row_data(), local.row_data(), group=mode.group)
        return [*local.tensors(), *gathered.tensors()]
    compact = recipe == "blockwise"
    local = quantize(
        local_shape,
        recipe,
        arch,
        rowwise=True,
        columnwise=True,
        device=device,
        compact=compact,
        cast=dy,
    )
    gathered = quantize(
        full, recipe, arch, rowwise=True, columnwise=True, device=device, compact=compact
    )
    pairs = []
    for usage in ("rowwise", "columnwise"):
        for out, inp in zip(getattr(gathered, usage)[::-1], getattr(local, usage)[::-1]):
            if out.shape[0] != inp.shape[0] * mode.tp:  # scales are gathered unpadded
                out = torch.empty(
                    (inp.shape[0] * mode.tp, *inp.shape[1:]), dtype=inp.dtype, device=device
                )
            pairs.append((out, inp))
    _coalesced_gather(pairs, mode, device)
    extra = []
    if compact and arch != "sm100":  # COMPACT column-wise data transposed for Hopper's GEMM
        extra.append(torch.empty(full[::-1], dtype=U8, device=device))
    return [*local.tensors(), *gathered.tensors(), *[o for o, _ in pairs], *extra]


def _gathered_input(kept, local_rows, in_features, mode, recipe, arch, device):
    """Column parallel + SP: the saved local input gathered again in FP8 for wgrad. Returns
    its buffers and what runs when the wgrad GEMM waits for the gather (the buffers then)."""
    if recipe == "nvfp4":
        # async_op=True (linear.py:651-656): the interleaved buffers wait in the handle until
        # the wgrad GEMM waits on it (linear.py:735-738), after the dgrad GEMM
        local = Quantized(columnwise=list(kept[:3]))
        gathered, interleaved = _gather_nvfp4(local, (local_rows, in_features), mode, device)

        def finish():
            _nvfp4_post_gather(gathered, interleaved, mode.tp)
            interleaved.clear()
            return gathered.tensors()

        return [], finish  # (what finish holds: the output's buffers alone, as TE's)
    buffers = _gathered_fp8_input(kept, local_rows, in_features, mode, recipe, arch, device)
    return buffers, lambda: buffers


def _gathered_fp8_input(kept, local_rows, in_features, mode, recipe, arch, device):
    full = (local_rows * mode.tp, in_features)
    if recipe in ("delayed", "tensorwise"):
        if "bulk_dgrad" in mode.ub:  # into the userbuffer, beside the dgrad GEMM
            data = mode.ub_gather(kept[0], "dgrad")
        else:
            data = torch.empty(full, dtype=U8, device=device)
            dist.all_gather_into_tensor(data, kept[0], group=mode.group)
        return [data] + (
            [torch.empty(full[::-1], dtype=U8, device=device)] if arch != "sm100" else []
        )
    if recipe == "mxfp8":  # make_empty allocates the row-wise buffers too
        gathered = quantize(full, recipe, arch, rowwise=True, columnwise=True, device=device)
        col_data, col_scale = kept[0], kept[1]
        scale_out = torch.empty(
            (col_scale.shape[0] * mode.tp, *col_scale.shape[1:]),
            dtype=col_scale.dtype,
            device=device,
        )
        _coalesced_gather(
            [(scale_out, col_scale), (gathered.columnwise[0], col_data)], mode, device
        )
        return [*gathered.tensors(), scale_out]
    gathered = quantize(
        full, recipe, arch, rowwise=False, columnwise=True, device=device, compact=True
    )
    col_data, col_scale = kept[0], kept[1]
    scale_out = torch.empty(
        (col_scale.shape[0] * mode.tp, *col_scale.shape[1:]), dtype=col_scale.dtype, device=device
    )
    _coalesced_gather([(scale_out, col_scale), (gathered.columnwise[0], col_data)], mode, device)
    transposed = torch.empty(full[::-1], dtype=U8, device=device)  # the GEMM-ready layout
    return [*gathered.tensors(), scale_out, transposed]


def _requantized_input(x2, mode, recipe, arch):
    """save_original_input: TE quantizes the saved input in backward with the usage the wgrad
    GEMM reads (linear.py:640-648, 766-770): column-wise, or row-wise for Float8 when it is
    all-gathered (column parallel + SP)."""
    column_sp = mode.parallel == "column" and mode.sequence_parallel
    rowwise = column_sp and recipe in ("delayed", "tensorwise")
    q = quantize(
        tuple(x2.shape),
        recipe,
        arch,
        rowwise=rowwise,
        columnwise=not rowwise,
        device=x2.device,
        compact=column_sp and recipe == "blockwise",
        cast=x2,
        amax_group=mode.group if column_sp and recipe == "nvfp4" else None,
    )
    return q.tensors()


def fp8_backward(ctx, grad):
    mode = ctx.mode
    x2, weight, bias, ln_weight, ln_bias, mu, rsigma, *kept = ctx.saved_tensors
    recipe, arch, device = mode.fp8, mode.arch, grad.device
    dy = grad.contiguous().view(-1, grad.shape[-1])
    needs_wgrad = weight.requires_grad
    dy_buffers = _quantized_grad(dy, mode, recipe, arch, needs_wgrad)
    if ctx.original and needs_wgrad:  # the saved bf16 input, quantized again for wgrad
        kept = _requantized_input(x2, mode, recipe, arch)
    ensure_transpose(weight, arch)  # dgrad reads it (recomputed layers: discarded since)
    bgrad = None
    if bias is not None and recipe == "nvfp4":  # unfused for NVFP4 (base.py:1224-1229)
        bgrad = dy.sum(dim=0)
    elif bias is not None:
        bgrad = torch.zeros_like(bias)  # fused into bgrad_quantize
    column_sp = mode.parallel == "column" and mode.sequence_parallel
    in_features = weight.shape[1]
    inputs, finish = [], list
    if column_sp and needs_wgrad:
        inputs, finish = _gathered_input(
            kept, ctx.local_rows, in_features, mode, recipe, arch, device
        )
    rows = ctx.local_rows * (mode.tp if column_sp else 1)
    # bf16 dgrad (into the wgrad GEMM's bf16 userbuffer under bulk_wgrad)
    dgrad, dinput = dgrad_and_input(
        mode,
        rows,
        in_features,
        grad.dtype,
        device,
        lambda out: (
            flops.unpriced(out.zero_)
            if out is not None
            else gemm_output((rows, in_features), dtype=grad.dtype, device=device)
        ),
    )
    # The FP8 dgrad and wgrad GEMMs (wgrad over the gathered rows, as dgrad).
    kind = gemm_kind(recipe)
    with flops.sm_margin(ub_margin(mode, "dgrad")):
        flops.report_gemm(rows, weight.shape[0], in_features, **kind)
    if needs_wgrad:
        inputs = finish()  # the gathered input waited on before the wgrad GEMM
        with flops.sm_margin(ub_margin(mode, "wgrad")):
            flops.report_gemm(
                weight.shape[0], rows, in_features, **kind, into=wgrad_into(ctx.module, weight)
            )
    # bf16 wgrad (autograd casts it to an FP8 parameter's dtype; with megatron-core's DDP, TE
    # accumulates it into main_grad instead)
    wgrad = (
        te_wgrad(ctx.module, weight, gemm_output, weight.shape, dtype=dgrad.dtype, device=device)
        if needs_wgrad
        else None
    )
    dinput = bulk_reduced(mode, dgrad, dinput)
    del dy_buffers, inputs, finish
    dln_w = dln_b = None
    if mode.norm is not None:
        dinput, dln_w, dln_b = norm_backward(
            dinput, x2, ln_weight, ln_bias, mu, rsigma, mode.norm == "RMSNorm"
        )
    drop_blackwell_transpose(weight, arch)
    if recipe == "delayed" and ctx.first_in_region:
        reduce_amax(ctx.region, 2, device)
    return dinput.view(ctx.x_shape), wgrad, bgrad, dln_w, dln_b
