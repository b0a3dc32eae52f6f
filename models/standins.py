"""Meta-capable stand-ins for the CUDA kernels of megatron-core's local layer spec.

`LocalNorm` replaces the norm of the local spec. On a GPU that spec uses Apex's
`FusedLayerNorm` for LayerNorm and torch's `RMSNorm` (the fused CUDA kernel `_fused_rms_norm`)
for RMSNorm, which keep and allocate what `metatrace.models.norm` describes. Run eagerly on meta
or the CPU, `torch.nn.RMSNorm` instead decomposes into an fp32 copy of x and keeps several
[tokens, hidden] intermediates, and megatron-core's `WrappedTorchNorm` refuses sequence
parallelism without Apex. `LocalNorm` tags its weights `sequence_parallel` as Apex's
`FusedLayerNorm` does.

`FusedSoftmaxKernels` stands in for Apex's fused softmax extensions, `FusedWeightGradient` for
its gradient-accumulation-fusion extension.
"""

from __future__ import annotations

import torch

from metatrace.hooks import flops
from metatrace.models.norm import NormBase


class LocalNorm(NormBase):
    """LayerNorm or RMSNorm (from config.normalization), as the local spec's CUDA kernels run it.

    Takes megatron-core's norm constructor arguments (config, hidden_size, eps, ...).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"unsupported normalization {config.normalization!r}")
        super().__init__(
            config,
            hidden_size,
            eps,
            rms=config.normalization == "RMSNorm",
            sequence_parallel=config.sequence_parallel,
        )


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
        with flops.uncounted():  # one kernel: timed below by what it reads and writes
            out = inputs.mul(float(scale))  # [attn_batches, sq, sk], the one allocation
            out.tril_()  # keeps masked entries out of the row maximum
            cls._softmax_(out).tril_()
            out.div_(out.sum(-1, keepdim=True))
        flops.report_moved(inputs, out)
        return out

    @classmethod
    def masked_forward(cls, inputs: torch.Tensor, mask: torch.Tensor, scale) -> torch.Tensor:
        with flops.uncounted():
            out = inputs.mul(float(scale))  # [b, np, sq, sk]
            out.masked_fill_(mask, -10000.0)
            cls._softmax_(out)
            out.div_(out.sum(-1, keepdim=True))
        flops.report_moved(inputs, mask, out)
        return out

    @staticmethod
    def backward(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale):
        """dx = scale * y * (dy - sum(dy * y)), written into dy as the kernels do."""
        from metatrace.hooks.remap import library_kernel

        sk = output_grads.shape[-1]
        # One kernel (its row sums are not a cuBLAS call): it reads dy and y and writes dx.
        with library_kernel(), flops.uncounted():
            dot = torch.bmm(output_grads.reshape(-1, 1, sk), softmax_results.reshape(-1, sk, 1))
            dot = dot.view(*output_grads.shape[:-1], 1)
            output_grads.sub_(dot).mul_(softmax_results).mul_(float(scale))
        flops.report_moved(output_grads, softmax_results, output_grads)
        return output_grads


class FusedWeightGradient:
    """Stand-in for Apex's `fused_weight_gradient_mlp_cuda`, which megatron-core's own linear
    layers call with gradient-accumulation fusion: `wgrad_gemm_accum_fp32(input, grad_output,
    main_grad)` (and `_fp16`) accumulates the weight gradient into main_grad in place with a
    cuBLAS GEMM on PyTorch's handle. Nothing is allocated; megatron-core then allocates an
    empty [out, in] placeholder gradient itself (tensor_parallel/layers.py)."""

    @classmethod
    def module(cls):
        import types

        module = types.ModuleType("fused_weight_gradient_mlp_cuda")
        module.wgrad_gemm_accum_fp32 = cls.accumulate
        module.wgrad_gemm_accum_fp16 = cls.accumulate
        return module

    @staticmethod
    def accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor):
        # The GEMM, on PyTorch's cuBLAS handle: its [1, 1] output stands for the call, and the
        # FLOPs of the real one ([out, N] @ [N, in] into main_grad) are reported.
        with flops.uncounted():
            torch.mm(grad_output[:1].reshape(1, -1)[:, :1], total_input[:1].reshape(1, -1)[:, :1])
        rows = total_input.numel() // total_input.shape[-1]
        flops.report_gemm(grad_output.shape[-1], rows, total_input.shape[-1], into=main_grad)
