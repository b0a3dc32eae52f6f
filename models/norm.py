"""Normalisation as the CUDA kernels run it: Apex's FusedLayerNorm, torch's fused RMSNorm kernel,
and Transformer Engine's LayerNorm / RMSNorm (alone or fused into LayerNormLinear).

All of them make the input contiguous, keep it (no copy when it already was), keep fp32
statistics per row (mean and 1/std for LayerNorm, 1/rms for RMSNorm), and allocate nothing but
their output and those statistics; their backward allocates dx, dweight (and dbias).
`norm_forward` / `norm_backward` compute the same with those allocations on any device;
`NormFunction` is the autograd function of a standalone norm and `NormBase` its module.

Known limitations: the statistics are computed as E[x^2] - E[x]^2 in fp32 (values are close to
the kernels', not bit-identical). Where no fused RMSNorm backward kernel exists (the CPU), the
backward uses a formula with [tokens, hidden] temporaries that the CUDA kernel does not have.
"""

from __future__ import annotations

import torch

from metatrace.hooks import flops
from metatrace.models.te_cpu_offload import mark_if_offloading


def norm_forward(x2: torch.Tensor, weight, bias, eps: float, rms: bool):
    """x2 [rows, h] -> (y [rows, h] in x2's dtype, mean [rows] fp32 or None, rstd [rows] fp32).
    Timed as the one fused kernel that reads x2 and the parameters and writes the three."""
    with flops.uncounted():
        y, mean, rstd = _norm_forward(x2, weight, bias, eps, rms)
    flops.report_moved(x2, weight, bias, y, mean, rstd)
    return y, mean, rstd


def _norm_forward(x2: torch.Tensor, weight, bias, eps: float, rms: bool):
    h = x2.shape[-1]
    if x2.is_cuda:
        # A measured run on a GPU (metatrace measure, bench/step_time.py) runs the fused kernel
        # itself, one launch, as Apex's FusedLayerNorm and torch's RMSNorm do: the formula
        # below is 15 kernels for LayerNorm and 8 for RMSNorm (the H200 profiles of 2026-11-28
        # counted them), and temporaries the kernel does not have.
        if rms:
            y, rstd = torch.ops.aten._fused_rms_norm(x2, [h], weight, eps)
            return y, None, rstd.view(-1)
        y, mean, rstd = torch.ops.aten.native_layer_norm(x2, [h], weight, bias, eps)
        return y, mean.view(-1), rstd.view(-1)
    sq = torch.linalg.vector_norm(x2, dim=-1, dtype=torch.float32).square_().div_(h)  # [rows]
    dt = x2.dtype
    if rms:
        mean, rstd = None, sq.add_(eps).rsqrt_()
        y = x2.mul(rstd.to(dt).unsqueeze(-1))
    else:
        mean = x2.mean(dim=-1, dtype=torch.float32)
        rstd = sq.sub_(mean.square()).clamp_(min=0.0).add_(eps).rsqrt_()
        y = x2.sub(mean.to(dt).unsqueeze(-1)).mul_(rstd.to(dt).unsqueeze(-1))
    y.mul_(weight)
    if bias is not None:
        y.add_(bias)
    return y, mean, rstd


def norm_backward(dy2, x2, weight, bias, mean, rstd, rms: bool):
    """Gradients (dx [rows, h], dweight, dbias or None) of norm_forward."""
    h = x2.shape[-1]
    if rms:
        return (*_rms_backward(dy2, x2, rstd.unsqueeze(-1), weight), None)
    mean, rstd = mean.unsqueeze(-1), rstd.unsqueeze(-1)
    if x2.device.type == "cpu":
        # The CPU kernel wants statistics in the input dtype (CUDA and meta take fp32).
        mean, rstd = mean.to(x2.dtype), rstd.to(x2.dtype)
    return torch.ops.aten.native_layer_norm_backward(
        dy2, x2, [h], mean, rstd, weight, bias, [True, True, bias is not None]
    )


def _rms_backward(dy2, x2, rstd, weight):
    h = x2.shape[-1]
    try:
        return torch.ops.aten._fused_rms_norm_backward(dy2, x2, [h], rstd, weight, [True, True])
    except NotImplementedError:
        pass
    # No fused kernel on this device (the CPU): d/dx of x * rstd * w, written out.
    dt = x2.dtype
    xhat = x2.mul(rstd.to(dt))
    dw = dy2.mul(xhat).sum(0)
    g = dy2.mul(weight)
    c = g.mul(xhat).sum(-1, keepdim=True, dtype=torch.float32).div_(h)
    dx = g.sub_(xhat.mul_(c.to(dt))).mul_(rstd.to(dt))
    return dx, dw


class NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, te=False):
        # The kernels' input.contiguous() (a copy only for a strided input), as a view of its
        # own: TE's norm ops save and mark a reshaped view, not the caller's tensor.
        x = x.contiguous().view(x.shape)
        x2 = x.view(-1, x.shape[-1])
        y, mean, rstd = norm_forward(x2, weight, bias, eps, rms)
        if te:
            mark_if_offloading(x, mean, rstd)  # TE's norm ops under cpu_offloading
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.rms = rms
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        h = x.shape[-1]
        dx, dw, db = norm_backward(
            dy.reshape(-1, h), x.view(-1, h), weight, bias, mean, rstd, ctx.rms
        )
        return dx.view(x.shape), dw, db, None, None, None


class NormBase(torch.nn.Module):
    """A LayerNorm or RMSNorm with parameters `weight` (and `bias` for LayerNorm) of shape
    [hidden_size] in the config's params_dtype, on the (remapped) CUDA device."""

    te = False
    """Transformer Engine's: marks what it saves for TE's layer-wise CPU offloading."""

    def __init__(self, config, hidden_size: int, eps: float, rms: bool, sequence_parallel: bool):
        super().__init__()
        self.rms = rms
        self.eps = eps
        self.sequence_parallel = sequence_parallel
        device = torch.cuda.current_device()  # remapped to the traced device
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=device)
        )
        self.bias = (
            None
            if rms
            else torch.nn.Parameter(
                torch.zeros(hidden_size, dtype=config.params_dtype, device=device)
            )
        )
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NormFunction.apply(x, self.weight, self.bias, self.eps, self.rms, self.te)
