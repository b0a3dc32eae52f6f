"""Stand-ins for Transformer Engine's fused kernels that megatron-core calls as functions.

megatron-core binds these by name at import time (`rope_utils.fused_apply_rotary_pos_emb`,
`language_module.te_parallel_cross_entropy`); `metatrace.hooks.patches` puts these stand-ins in
those places. Each keeps and allocates what the TE 2.8 kernel does (read from its sources):

- fused RoPE (`transformer_engine/pytorch/attention/rope.py`, FusedRoPEFunc): the output is a new
  contiguous tensor; only the frequencies are saved for backward; backward allocates the input
  gradient.
- TE cross entropy (`transformer_engine/pytorch/cross_entropy.py` and its triton kernel): per
  token fp32 loss [N] and statistics [3N], all-gathered over the TP group into [3N x tp]; the
  logits are overwritten in place with their gradient and are the only tensor saved; backward
  scales them in place and returns that same storage.

Values are not computed (the output of RoPE is a copy of the input, the loss is zero): metatrace
needs shapes, storages and collectives, which these keep exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _FusedRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs):
        ctx.save_for_backward(freqs)
        return t.clone(memory_format=torch.contiguous_format)  # at::empty(input.sizes()) filled

    @staticmethod
    def backward(ctx, grad):
        return grad.clone(memory_format=torch.contiguous_format), None


def fused_apply_rotary_pos_emb(t, freqs, interleaved: bool = False, transpose_output_memory=False):
    """megatron.core.extensions.transformer_engine.fused_apply_rotary_pos_emb, sbhd layout."""
    if freqs.dtype != torch.float32:
        freqs = freqs.float()  # TE's freqs.float(): a copy only when not fp32
    return _FusedRoPE.apply(t, freqs)


class _TECrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group):
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        n = logits.numel() // logits.shape[-1]
        loss = torch.zeros(n, dtype=torch.float32, device=logits.device)
        stats = torch.empty(3 * n, dtype=torch.float32, device=logits.device)  # m, d, X_y
        world = dist.get_world_size(tp_group) if tp_group is not None else 1
        if world > 1:
            gathered = torch.empty(3 * n * world, dtype=torch.float32, device=logits.device)
            dist.all_gather_into_tensor(gathered, stats, group=tp_group)
            del gathered
        del stats
        # The kernel writes d(loss)/d(logits) into the logits buffer.
        ctx.save_for_backward(logits.detach())
        return loss.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad, None, None  # element_mul by grad_output happens in place


def te_parallel_cross_entropy(logits, labels, tp_group, is_cg_capturable=False):
    """megatron.core.extensions.transformer_engine.te_parallel_cross_entropy."""
    return _TECrossEntropy.apply(logits, labels, tp_group)


class NoKernel:
    """Stands for a Triton kernel launched as `kernel[grid](...)`: it does nothing (meta tensors
    hold no values). The autograd Function around it allocates and saves in Python exactly what
    it does on a GPU, so only the kernel's writes are skipped (megatron-core's fused MLA yarn
    RoPE, fusions/fused_mla_yarn_rope_apply.py: q is rotated in place, key and value are new
    tensors, cos and sin are saved)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None
