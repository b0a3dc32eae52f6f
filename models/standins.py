"""Meta-capable stand-ins for the CUDA kernels of megatron-core's local layer spec.

`LocalNorm` replaces the norm of the local spec. On a GPU that spec uses Apex's
`FusedLayerNorm` for LayerNorm and torch's `RMSNorm` (the fused CUDA kernel `_fused_rms_norm`)
for RMSNorm. Both keep, for backward, the input x (no copy), the weight (and bias) and fp32
statistics per row (mean and 1/std for LayerNorm, 1/rms for RMSNorm), and allocate nothing but
their outputs. Run eagerly on meta or the CPU, `torch.nn.RMSNorm` instead decomposes into an fp32
copy of x and keeps several [tokens, hidden] intermediates, and megatron-core's
`WrappedTorchNorm` refuses sequence parallelism without Apex. `LocalNorm` keeps what the CUDA
kernels keep, computes in a way that allocates only its outputs and per-row statistics, and tags
its weights `sequence_parallel` as Apex's `FusedLayerNorm` does.

Known limitations: the statistics are computed as E[x^2] - E[x]^2 in fp32 (values are close to
the kernels', not bit-identical). Where no fused RMSNorm backward kernel exists (the CPU), the
backward uses a formula with [tokens, hidden] temporaries that the CUDA kernel does not have.
"""

from __future__ import annotations

import torch


def _row_stats(x2: torch.Tensor, eps: float, rms: bool):
    """Per-row fp32 statistics of x2 [rows, h] without materialising an fp32 copy of it."""
    h = x2.shape[-1]
    sq = torch.linalg.vector_norm(x2, dim=-1, dtype=torch.float32).square_().div_(h)  # [rows]
    if rms:
        return None, sq.add_(eps).rsqrt_().unsqueeze_(-1)  # rstd [rows, 1]
    mean = x2.mean(dim=-1, dtype=torch.float32)  # [rows]
    var = sq.sub_(mean.square())
    return mean.unsqueeze_(-1), var.clamp_(min=0.0).add_(eps).rsqrt_().unsqueeze_(-1)


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        h = x.shape[-1]
        x2 = x.reshape(-1, h)  # [rows, h], a view when x is contiguous
        mean, rstd = _row_stats(x2, eps, rms)
        dt = x.dtype
        y = x2.sub(mean.to(dt)) if mean is not None else x2.mul(rstd.to(dt))
        if mean is not None:
            y.mul_(rstd.to(dt))
        y.mul_(weight)
        if bias is not None:
            y.add_(bias)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.rms = rms
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        h = x.shape[-1]
        x2, dy2 = x.reshape(-1, h), dy.reshape(-1, h)
        if ctx.rms:
            dx, dw = _rms_backward(dy2, x2, rstd, weight)
            db = None
        else:
            if x.device.type == "cpu":
                # The CPU kernel wants statistics in the input dtype (CUDA and meta take fp32).
                mean, rstd = mean.to(x.dtype), rstd.to(x.dtype)
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(
                dy2, x2, [h], mean, rstd, weight, bias, [True, True, bias is not None]
            )
        return dx.view(x.shape), dw, db, None, None


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


class LocalNorm(torch.nn.Module):
    """LayerNorm or RMSNorm (from config.normalization), as the local spec's CUDA kernels run it.

    Takes megatron-core's norm constructor arguments (config, hidden_size, eps, ...).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"unsupported normalization {config.normalization!r}")
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        device = torch.cuda.current_device()  # remapped to the traced device
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=device)
        )
        self.bias = (
            None
            if self.rms
            else torch.nn.Parameter(
                torch.zeros(hidden_size, dtype=config.params_dtype, device=device)
            )
        )
        for p in self.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NormFunction.apply(x, self.weight, self.bias, self.eps, self.rms)


class FusedSoftmaxKernels:
    """Stand-ins for the CUDA extensions behind megatron-core's FusedScaleMaskSoftmax.

    With Apex installed (the usual set-up for the local spec), megatron-core imports the modules
    `scaled_upper_triang_masked_softmax_cuda` (causal) and `scaled_masked_softmax_cuda` (explicit
    mask; it also answers `get_batch_per_block`). Their forward allocates only the probabilities
    [attn_batches, sq, sk] in the input dtype, which megatron-core saves for backward; their
    backward writes the input gradient into the output-gradient buffer in place. These stand-ins
    compute the same with in-place operations, so that they allocate what the kernels allocate
    (plus per-row [.., sq, 1] reductions).
    """

    WARP_SIZE = 32  # C10_WARP_SIZE on NVIDIA GPUs

    @classmethod
    def modules(cls) -> dict:
        """Module objects to place in sys.modules under the extensions' names."""
        import types

        causal = types.ModuleType("scaled_upper_triang_masked_softmax_cuda")
        causal.forward = cls.causal_forward
        causal.backward = cls.backward
        masked = types.ModuleType("scaled_masked_softmax_cuda")
        masked.forward = cls.masked_forward
        masked.backward = cls.backward
        masked.get_batch_per_block = cls.get_batch_per_block
        return {causal.__name__: causal, masked.__name__: masked}

    @classmethod
    def get_batch_per_block(cls, sq: int, sk: int, b: int, np: int) -> int:
        """The kernels' launch arithmetic (scaled_masked_softmax.h, get_batch_per_block)."""
        next_power_of_two = 1 << max(0, (sk - 1).bit_length())
        warp_size = min(next_power_of_two, cls.WARP_SIZE)
        batches_per_warp = 2 if next_power_of_two <= 128 else 1
        return (128 // warp_size) * batches_per_warp

    @staticmethod
    def _softmax_(out: torch.Tensor) -> torch.Tensor:
        """Row softmax of `out` in place; entries already set to zero after exp stay masked."""
        out.sub_(out.amax(-1, keepdim=True)).exp_()
        return out

    @classmethod
    def causal_forward(cls, inputs: torch.Tensor, scale) -> torch.Tensor:
        out = inputs.mul(float(scale))  # [attn_batches, sq, sk], the one allocation
        out.tril_()  # keeps masked entries out of the row maximum
        cls._softmax_(out).tril_()
        return out.div_(out.sum(-1, keepdim=True))

    @classmethod
    def masked_forward(cls, inputs: torch.Tensor, mask: torch.Tensor, scale) -> torch.Tensor:
        out = inputs.mul(float(scale))  # [b, np, sq, sk]
        out.masked_fill_(mask, -10000.0)
        cls._softmax_(out)
        return out.div_(out.sum(-1, keepdim=True))

    @staticmethod
    def backward(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale):
        """dx = scale * y * (dy - sum(dy * y)), written into dy as the kernels do."""
        sk = output_grads.shape[-1]
        dot = torch.bmm(output_grads.reshape(-1, 1, sk), softmax_results.reshape(-1, sk, 1))
        dot = dot.view(*output_grads.shape[:-1], 1)
        return output_grads.sub_(dot).mul_(softmax_results).mul_(float(scale))
