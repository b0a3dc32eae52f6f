"""The FP8 path of the grouped-expert stand-in (TE 2.8 module/grouped_linear.py under
fp8_autocast), and TE's Fp8Padding / Fp8Unpadding (module/fp8_padding.py, fp8_unpadding.py),
which megatron-core's TEGroupedMLP puts around its grouped GEMMs under FP8 (experts.py:603-606,
646-653, 761-762). Quantized layouts are metatrace.models.te_fp8's.

Forward (grouped_linear.py:61-260): the input is quantized per expert in one split_quantize
(Float8 recipes: tensors per expert; MXFP8 / blockwise: one buffer per usage), with the
column-wise usage when the weights need gradients; each expert's weight comes from a workspace
the module keeps for the run ("weight{i}", or none with FP8 parameters; a copy per call, saved,
with disable_parameter_transpose_cache); the output is bf16 [T, N]. After the GEMM the row-wise
usage is dropped: what is saved is the column-wise input (on Blackwell Float8 the one buffer),
or, with save_original_input (megatron-core's moe_act recompute and expert_fc1 offloading), the
bf16 input itself and nothing quantized. Current scaling reduces no amax in a GroupedLinear
(megatron-core gives it tp 1; grouped_linear.py:674-678); delayed scaling adds 3 (forward) and
2 (backward) amaxes per expert to the region's reduction.

Backward (grouped_linear.py:262-486): the output gradient is quantized per expert with both
usages (the grad quantizers are never given a usage); dgrad [T, K] bf16; with
save_original_input the input is quantized again (Float8 row and column, others column only);
the wgrad GEMM; then `clear_tensor_data` frees the saved quantized input before the weight
gradients are returned (with gradient-accumulation fusion a new tensor of main_grad's shape per
expert, as in bf16).

NVFP4 (TE 2.8 has no bulk allocation for it, cast.cpp:546-568): each expert's input and output
gradient is an NVFP4 tensor of its own, quantized by its own quantizer (the amax pass, the
Hadamard kernels, stochastic rounding for the gradients; timed by their bytes); a bias's
gradient is each expert's rows summed apart (grouped_linear.py:286-303).

Every recipe's split_quantize kernels are timed by the bytes they move (models/te_fp8.py
_price_split; NVFP4's by its own kernels). Not modelled: the transient MXFP8 / NVFP4 scale
swizzles of the GEMMs (as for dense layers).
"""

from __future__ import annotations

import torch

from metatrace.hooks import flops
from metatrace.models import te_wgrad
from metatrace.models.te_fp8 import (
    gemm_kind,
    module_state,
    reduce_amax,
    register,
    split_quantize,
    weight_workspace,
)

_FLOAT8 = ("delayed", "tensorwise")


def fp8_forward(ctx, x2, m_splits, module, weights, biases, recipe, arch, grad_enabled):
    """The quantized forward; returns the bf16 output [T, N] and sets what backward reads."""
    device = x2.device
    region = register(module)
    module_state(module, recipe, device)
    needs_wgrad = weights[0].requires_grad
    original = module.save_original_input and needs_wgrad
    inputs = split_quantize(
        m_splits,
        module.in_features,
        recipe,
        arch,
        rowwise=True,
        columnwise=grad_enabled and needs_wgrad and not original,
        device=device,
        x=x2,
    )
    per_call = []
    if weights[0].element_size() > 1:  # FP8 parameters are their own quantized weights
        for i, w in enumerate(weights):
            if getattr(module.config, "disable_parameter_transpose_cache", False):
                per_call.append(weight_workspace(_Scratch(), w, recipe, arch))
            else:
                weight_workspace(module, w, recipe, arch, key=f"weight{i}")
    out = torch.empty((x2.shape[0], module.out_features), dtype=x2.dtype, device=device)
    flops.report_grouped(m_splits, module.in_features, module.out_features, **gemm_kind(recipe))
    if original:
        inputs, kept = [], [x2]
    elif needs_wgrad:
        for q in inputs:
            q.drop_rowwise()
        kept = [t for q in inputs for t in q.tensors()]
    else:
        inputs, kept = [], []
    del inputs
    quantized_weights = [t for q in per_call for t in q.tensors()]
    ctx.save_for_backward(*kept, *quantized_weights, *weights, *biases)
    ctx.kept, ctx.per_call, ctx.original = len(kept), len(quantized_weights), original
    ctx.region = region
    ctx.first_in_region = region is not None and region.modules[:1] == [module]
    ctx.fp8 = (recipe, arch)
    return out


class _Scratch:
    """A workspace owner that is dropped after use (disable_parameter_transpose_cache)."""


def fp8_backward(ctx, grad, wgrad):
    """The quantized backward; returns (dgrad [T, K] or None, weight gradients, bias gradients)."""
    module, m_splits = ctx.module, ctx.m_splits
    recipe, arch = ctx.fp8
    n = module.num_gemms
    saved = ctx.saved_tensors
    kept = saved[: ctx.kept]
    weights = saved[ctx.kept + ctx.per_call : ctx.kept + ctx.per_call + n]
    biases = saved[ctx.kept + ctx.per_call + n :]
    device = grad.device
    dy = grad.contiguous().view(-1, grad.shape[-1])
    # bgrad_quantize: a bias TE adds gets its gradient [N] per expert; a returned one none.
    # NVFP4 (and blockwise) sum each expert's rows apart instead (grouped_linear.py:286-303).
    applied = getattr(module, "apply_bias", True)
    if recipe == "nvfp4":
        bgrads = [
            part.sum(dim=0) if applied else None for part, _ in zip(dy.split(m_splits), biases)
        ]
    else:
        bgrads = [
            torch.empty(b.shape, dtype=b.dtype, device=device) if applied else None for b in biases
        ]
    grads = split_quantize(  # both usages, always
        m_splits,
        module.out_features,
        recipe,
        arch,
        rowwise=True,
        columnwise=True,
        device=device,
        x=dy,
        grad=True,
    )
    dgrad = None
    if ctx.needs_input_grad[0]:
        dgrad = torch.empty((dy.shape[0], module.in_features), dtype=dy.dtype, device=device)
    needs_wgrad = weights[0].requires_grad
    gemm = flops.gemm(dy.shape[0], module.out_features, module.in_features)
    delayed = needs_wgrad and te_wgrad.delays(module)
    times = (dgrad is not None) + (needs_wgrad and not delayed)
    kind = gemm_kind(recipe)
    flops.report_grouped(m_splits, module.out_features, module.in_features, **kind, times=times)
    wgrads = [None] * n
    requantized = []
    if needs_wgrad and ctx.original:  # save_original_input: the bf16 input is quantized now
        requantized = split_quantize(
            m_splits,
            module.in_features,
            recipe,
            arch,
            rowwise=recipe in _FLOAT8,
            columnwise=True,
            device=device,
            x=saved[0],
        )
    fused = needs_wgrad and _fused(module, weights)
    if delayed:
        # delay_wgrad_compute (grouped_linear.py:408-409): the saved input (or its new copy),
        # both usages of the quantized output gradient and the non-fused wgrad buffers wait in
        # TE's WeightGradStore for backward_dw; nothing is cleared now
        wgrads = [wgrad(module, w, dy) for w in weights]
        buffers = [] if fused else wgrads
        stored = [*kept, *(t for q in requantized + grads for t in q.tensors()), *buffers]
        te_wgrad.put(module, stored, gemm, **kind)
    elif needs_wgrad:
        if not fused:  # the wgrad GEMM's outputs, before it runs
            wgrads = [wgrad(module, w, dy) for w in weights]
        # clear_tensor_data: the quantized input is freed right after the wgrad GEMM
        for t in kept if not ctx.original else ():
            if t.dtype == torch.uint8:  # (a Float8 scale-inverse [1] stays with ctx)
                t.untyped_storage().resize_(0)
        requantized = []  # (the copy made now goes the same way)
        if fused:
            wgrads = [wgrad(module, w, dy) for w in weights]
    del grads, requantized
    if recipe == "delayed" and ctx.first_in_region:
        reduce_amax(ctx.region, 2, device)
    return dgrad, wgrads, bgrads


def _fused(module, weights) -> bool:
    from metatrace.models.te_runtime import fuses_wgrad

    return fuses_wgrad(module, weights[0])


# ----------------------------------------------------------------------------- padding


def align_size(recipe: str) -> int:
    """Fp8Padding's alignment: 32 rows per expert for MXFP8, 16 otherwise."""
    return 32 if recipe == "mxfp8" else 16


class _Pad(torch.autograd.Function):
    """_Fp8Padding / _Fp8Unpadding: a new [sum(rows_out), h] tensor each way, nothing saved."""

    @staticmethod
    def forward(ctx, inp, rows_in, rows_out):
        ctx.rows_in = rows_in
        return torch.empty((sum(rows_out), inp.shape[-1]), dtype=inp.dtype, device=inp.device)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        return (
            torch.empty((sum(ctx.rows_in), grad.shape[-1]), dtype=grad.dtype, device=grad.device),
            None,
            None,
        )


class Fp8Padding(torch.nn.Module):
    """TE's Fp8Padding: pads each expert's rows to the recipe's alignment; the input itself when
    every count is aligned already."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        self.num_gemms, self.align_size = num_gemms, align_size

    def _padded(self, m_splits):
        if self.align_size is None:
            from metatrace.models.te_fp8 import active_recipe

            self.align_size = align_size(active_recipe() or "delayed")
        a = self.align_size
        return [-(-m // a) * a for m in m_splits]

    def forward(self, inp, m_splits):
        padded = self._padded(m_splits)
        if padded == list(m_splits):
            return inp, m_splits
        return _pad(inp, list(m_splits), padded), padded


class Fp8Unpadding(Fp8Padding):
    """TE's Fp8Unpadding: the padded rows back to each expert's count."""

    def forward(self, inp, m_splits):
        padded = self._padded(m_splits)
        if padded == list(m_splits):
            return inp
        return _pad(inp, padded, list(m_splits))


def _pad(inp, rows_in, rows_out):
    inp = inp.view(-1, inp.shape[-1])
    if torch.is_grad_enabled():
        return _Pad.apply(inp, rows_in, rows_out)
    return torch.empty((sum(rows_out), inp.shape[-1]), dtype=inp.dtype, device=inp.device)
