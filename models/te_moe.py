"""Stand-ins for Transformer Engine's fused MoE permutation and router kernels
(--moe-permute-fusion, --moe-router-fusion), as megatron-core 0.16.1 calls them through
`megatron.core.transformer.moe.moe_utils.fused_*` (bound there at import from
megatron.core.extensions.transformer_engine when TE imports; `metatrace.hooks.patches` puts
these in their place). Read from TE 2.20.2 (transformer_engine/pytorch/permutation.py,
pytorch/triton/permutation.py, pytorch/router.py, csrc/extensions/router.cpp); TE 2.8 and 2.10
allocate and save the same (TE 2.1 to 2.5 kept an int64 [E, T] row-id map instead).

Each stand-in allocates, returns and saves for backward what the TE kernel does, with the same
shapes and dtypes, and reports to the time model the tensors each of its kernels reads and
writes (hooks/flops.report_moved, with the kernels it launches: make_row_id_map's three Triton
passes, the permute / unpermute / chunk-sort kernels, the router's one fused kernel each way);
values are not computed (kernels are skipped: meta tensors hold none, and on
real CPU tensors metatrace's balanced-routing patch overwrites the routing map after routing).
torch only; runs on meta and on CPU tensors.

Notation: T tokens entering the op (rows of the routing map), E experts (columns of the map), h
hidden, N = num_out_tokens (rows of the permuted buffer; T*k for dropless routing), k topk.

permute (mask map), TE `te_moe::permute_mask_map_fwd`:
  forward allocates row_id_map int32 [T, 2E+1] (make_row_id_map) and a transient int32
  workspace [E, ceil(T/1024)], output [N, h] (input dtype), permuted_probs [N] (probs dtype; an
  empty fp32 tensor without probs); saves row_id_map (and pad_offsets, None here).
  backward: act_grad [T, h] (grad dtype), probs_grad [T, E] (grad-of-probs dtype) when probs
  need a gradient.
unpermute (mask map), `te_moe::unpermute_mask_map_fwd`:
  forward allocates output [T, h] (T, h from restore_shape); saves row_id_map, and with merging
  probs also the input [N, h] and merging_probs [T, E].
  backward without probs: act_grad [N, h]; with probs: act_grad [N, h] and probs_grad [T, E]
  (merging_probs dtype).
sort_chunks, `te_moe::chunk_sort_fwd`:
  forward allocates row_id_map int32 [N] (make_chunk_sort_map), output [N, h], permuted_probs
  [N] (probs dtype) or empty; saves row_id_map. backward: act_grad [N, h], probs_grad [N].
fused_topk_with_score_function (FusedTopkScoreFunction, router.cpp):
  forward allocates probs [T, E] (logits dtype), routing_map bool [T, E], intermediate_output
  fp32 [T, E]; saves routing_map and intermediate_output. backward: grad_logits =
  empty_like(grad_probs) (after .contiguous() if needed). fp64 logits are refused.
fused_compute_score_for_moe_aux_loss (FusedComputeScoresForMoEAuxLoss):
  forward allocates scores fp32 [T, E], routing_map bool [T, E], intermediate_output fp32
  [T, E]; saves intermediate_output. backward: grad_logits [T, E] in the logits' dtype.
fused_moe_aux_loss (FusedAuxLoss):
  forward allocates aux_loss [] (probs dtype) and Const_buf fp32 [2]; saves Const_buf and
  tokens_per_expert. backward: grad_probs [rows, cols] (grad dtype).
"""

from __future__ import annotations

import math

import torch

from metatrace.hooks import flops


def _empty0(device):
    """TE returns torch.empty(0) (fp32) where an optional output is absent."""
    return torch.empty(0, device=device)


def _new(shape, dtype, device):
    """An output the kernel would fill: allocated like TE's torch.empty / at::empty. Values are
    not computed; on real (CPU) tensors it is zeroed in place (no further allocation) so that
    nothing downstream reads uninitialised memory (bool maps, NaNs)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type != "meta":
        t.zero_()
    return t


# ----------------------------------------------------------------------------- permutation


class _PermuteMaskMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, routing_map, num_out_tokens, probs):
        num_tokens, hidden = inp.shape
        num_experts = routing_map.size(1)
        ctx.num_tokens, ctx.num_experts, ctx.hidden = num_tokens, num_experts, hidden
        ctx.needs_probs_grad = probs is not None and probs.requires_grad
        ctx.probs_dtype = probs.dtype if probs is not None else None
        if num_tokens == 0:  # TE's empty-input path
            row_id_map = torch.empty((0, 2 * num_experts + 1), dtype=torch.int32, device=inp.device)
            ctx.mark_non_differentiable(row_id_map)
            ctx.save_for_backward(row_id_map)
            pp = torch.empty(
                0, dtype=probs.dtype if probs is not None else torch.float32, device=inp.device
            )
            return inp.clone(), row_id_map, pp
        if num_out_tokens <= 0:
            raise ValueError("moe_permute (mask map) requires num_out_tokens > 0")
        # make_row_id_map: the map and a per-(expert, 1024-token block) workspace.
        row_id_map = _new((num_tokens, 2 * num_experts + 1), torch.int32, inp.device)
        workspace = torch.empty(
            (num_experts, math.ceil(num_tokens / 1024)), dtype=torch.int32, device=inp.device
        )
        # Pass 1 reads the map and writes the blocks' sums into the map's first E columns, pass
        # 2 reads and rewrites them, pass 3 reads them and writes all 2E + 1 (permutation.py
        # make_row_id_map): about three passes over the map.
        flops.report_moved(routing_map, row_id_map, row_id_map, row_id_map, workspace, launches=3)
        del workspace
        output = _new((num_out_tokens, hidden), inp.dtype, inp.device)
        if probs is not None:
            permuted_probs = _new((num_out_tokens,), probs.dtype, inp.device)
        else:
            permuted_probs = _empty0(inp.device)
        # _permute_kernel: each token's row read once and written to each of its experts' rows.
        flops.report_moved(inp, output, permuted_probs, permuted_probs)
        ctx.mark_non_differentiable(row_id_map)
        ctx.save_for_backward(row_id_map)  # + pad_offsets (None without fused padding)
        return output, row_id_map, permuted_probs

    @staticmethod
    def backward(ctx, grad_output, _grad_row_id_map, grad_permuted_probs):
        (row_id_map,) = ctx.saved_tensors
        if ctx.num_tokens == 0:
            probs_grad = None
            if ctx.needs_probs_grad:
                probs_grad = torch.zeros(
                    (0, ctx.num_experts), dtype=grad_permuted_probs.dtype, device=grad_output.device
                )
            return grad_output, None, None, probs_grad
        # permute_mask_map_bwd -> unpermute_with_mask_map(grad, row_id_map, None, probs_grad)
        act_grad = _new((ctx.num_tokens, ctx.hidden), grad_output.dtype, grad_output.device)
        probs_grad = None
        if grad_permuted_probs is not None and grad_permuted_probs.numel() > 0:
            probs_grad = _new(
                (ctx.num_tokens, ctx.num_experts), grad_permuted_probs.dtype, grad_output.device
            )
        # unpermute_with_mask_map: the permuted gradient's rows summed back into each token's.
        flops.report_moved(grad_output, act_grad, grad_permuted_probs, probs_grad)
        if not ctx.needs_probs_grad:
            probs_grad = None
        return act_grad, None, None, probs_grad


class _UnpermuteMaskMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, row_id_map, merging_probs, num_tokens, num_experts, hidden):
        ctx.num_tokens, ctx.num_experts, ctx.hidden = num_tokens, num_experts, hidden
        ctx.num_permuted = inp.size(0)
        ctx.with_probs = merging_probs is not None
        ctx.needs_probs_grad = ctx.with_probs and merging_probs.requires_grad
        if ctx.with_probs:
            ctx.save_for_backward(inp, row_id_map, merging_probs)
        else:
            ctx.save_for_backward(row_id_map)
        if inp.numel() == 0:
            return inp.clone()
        out = _new((num_tokens, hidden), inp.dtype, inp.device)
        flops.report_moved(inp, out, merging_probs)  # _unpermute_kernel
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.num_permuted == 0:
            probs_grad = None
            if ctx.needs_probs_grad:
                probs_grad = torch.zeros_like(ctx.saved_tensors[2])
            return grad, None, probs_grad, None, None, None
        if not grad.is_contiguous():
            grad = grad.contiguous()
        act_grad = _new((ctx.num_permuted, ctx.hidden), grad.dtype, grad.device)
        probs_grad = None
        if ctx.with_probs:
            merging_probs = ctx.saved_tensors[2]
            probs_grad = _new((ctx.num_tokens, ctx.num_experts), merging_probs.dtype, grad.device)
            # _unpermute_bwd_with_merging_probs_kernel also reads the forward's input (the
            # probabilities' gradient is its dot product with the gradient).
            flops.report_moved(grad, ctx.saved_tensors[0], act_grad, merging_probs, probs_grad)
        else:
            flops.report_moved(grad, act_grad)  # permute_with_mask_map of the gradient
        if not ctx.needs_probs_grad:
            probs_grad = None
        return act_grad, None, probs_grad, None, None, None


class _ChunkSort(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, probs):
        num_tokens, hidden = inp.shape
        ctx.num_tokens, ctx.hidden = num_tokens, hidden
        ctx.needs_probs_grad = probs is not None and probs.requires_grad
        if inp.numel() == 0:
            row_id_map = torch.empty(0, dtype=torch.int32, device=inp.device)
            ctx.mark_non_differentiable(row_id_map)
            ctx.save_for_backward(row_id_map)
            return inp.clone(), (probs.clone() if probs is not None else _empty0(inp.device))
        row_id_map = _new((num_tokens,), torch.int32, inp.device)
        output = _new((num_tokens, hidden), inp.dtype, inp.device)
        if probs is not None:
            permuted_probs = _new((num_tokens,), probs.dtype, inp.device)
        else:
            permuted_probs = _empty0(inp.device)
        ctx.save_for_backward(row_id_map)
        flops.report_moved(row_id_map)  # make_chunk_sort_map
        flops.report_moved(inp, output, permuted_probs, permuted_probs)  # sort_chunks_by_map
        return output, permuted_probs

    @staticmethod
    def backward(ctx, grad, grad_probs):
        if ctx.num_tokens == 0:
            return grad, (grad_probs if ctx.needs_probs_grad else None)
        act_grad = _new((ctx.num_tokens, ctx.hidden), grad.dtype, grad.device)
        probs_grad = None
        if grad_probs is not None and grad_probs.numel() > 0:
            probs_grad = _new((ctx.num_tokens,), grad_probs.dtype, grad.device)
        flops.report_moved(grad, act_grad, grad_probs, probs_grad)  # sort_chunks_by_map back
        if not ctx.needs_probs_grad:
            probs_grad = None
        return act_grad, probs_grad


def moe_permute(inp, routing_map, num_out_tokens, max_token_num=-1, map_type="mask"):
    """TE moe_permute (mask map; megatron-core never passes map_type='index')."""
    if map_type != "mask":
        raise NotImplementedError("moe_permute with an index map is not modelled")
    output, row_id_map, _ = _PermuteMaskMap.apply(inp, routing_map, int(num_out_tokens), None)
    return output, row_id_map


def moe_permute_with_probs(inp, probs, routing_map, num_out_tokens):
    """TE moe_permute_with_probs: (output, permuted_probs, row_id_map)."""
    output, row_id_map, permuted_probs = _PermuteMaskMap.apply(
        inp, routing_map, int(num_out_tokens), probs
    )
    return output, permuted_probs, row_id_map


def moe_unpermute(
    inp,
    row_id_map,
    merging_probs=None,
    restore_shape=None,
    map_type="mask",
    probs=None,
    pad_offsets=None,
):
    """TE moe_unpermute (mask map)."""
    if probs is not None:
        merging_probs = probs
    if map_type != "mask" or pad_offsets is not None:
        raise NotImplementedError("moe_unpermute with an index map or fused padding")
    if restore_shape is None:
        restore_shape = inp.shape
    num_tokens, hidden = restore_shape
    num_experts = (row_id_map.size(1) - 1) // 2 if row_id_map.dim() > 1 else 0
    return _UnpermuteMaskMap.apply(inp, row_id_map, merging_probs, num_tokens, num_experts, hidden)


def moe_sort_chunks_by_index(inp, split_sizes, sorted_index):
    """TE moe_sort_chunks_by_index: the output only (split sizes are read on the device)."""
    output, _ = _ChunkSort.apply(inp, None)
    return output


def moe_sort_chunks_by_index_with_probs(inp, probs, split_sizes, sorted_index):
    """TE moe_sort_chunks_by_index_with_probs: (output, permuted_probs)."""
    return _ChunkSort.apply(inp, probs)


# ----------------------------------------------------------------------------- router


class _FusedTopkScoreFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk):
        shape = logits.shape
        probs = _new(shape, logits.dtype, logits.device)
        routing_map = _new(shape, torch.bool, logits.device)
        intermediate = _new(shape, torch.float32, logits.device)
        ctx.mark_non_differentiable(routing_map)
        ctx.save_for_backward(routing_map, intermediate)
        flops.report_moved(logits, probs, routing_map, intermediate)
        return probs, routing_map

    @staticmethod
    def backward(ctx, grad_probs, _):
        if not grad_probs.is_contiguous():
            grad_probs = grad_probs.contiguous()
        grad = _new(grad_probs.shape, grad_probs.dtype, grad_probs.device)
        flops.report_moved(grad_probs, *ctx.saved_tensors, grad)
        return grad, None


def fused_topk_with_score_function(
    logits,
    topk,
    use_pre_softmax,
    num_groups,
    group_topk,
    scaling_factor,
    score_function,
    expert_bias,
    routing_map_format=None,
    topk_indices=None,
    **qb,
):
    """TE fused_topk_with_score_function, as megatron-core 0.16.1 calls it (bool routing map)."""
    if logits.dtype == torch.float64:
        raise ValueError("Current TE does not support float64 router type.")
    if topk_indices is not None or any(v is not None for v in qb.values()):
        raise NotImplementedError("dense top-k indices and quantile balancing are not modelled")
    if score_function not in ("softmax", "sigmoid", "sqrtsoftplus"):
        raise ValueError(f"score_function {score_function!r} not supported by router fusion")
    if not logits.is_contiguous():
        raise RuntimeError("logits must be contiguous")  # TORCH_CHECK in router.cpp
    return _FusedTopkScoreFunction.apply(logits, topk)


class _FusedScoresForAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk):
        shape = logits.shape
        scores = _new(shape, torch.float32, logits.device)
        routing_map = _new(shape, torch.bool, logits.device)
        intermediate = _new(shape, torch.float32, logits.device)
        ctx.mark_non_differentiable(routing_map)
        ctx.save_for_backward(intermediate)
        ctx.logits_dtype = logits.dtype
        flops.report_moved(logits, scores, routing_map, intermediate)
        return routing_map, scores

    @staticmethod
    def backward(ctx, _, grad_scores):
        if not grad_scores.is_contiguous():
            grad_scores = grad_scores.contiguous()
        grad = _new(grad_scores.shape, ctx.logits_dtype, grad_scores.device)
        flops.report_moved(grad_scores, *ctx.saved_tensors, grad)
        return grad, None


def fused_compute_score_for_moe_aux_loss(logits, topk, score_function, routing_map_format=None):
    """TE fused_compute_score_for_moe_aux_loss: (routing_map bool [T, E], scores fp32 [T, E])."""
    if not logits.is_contiguous():
        raise RuntimeError("logits must be contiguous")
    return _FusedScoresForAuxLoss.apply(logits, topk)


class _FusedAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs, tokens_per_expert):
        aux_loss = _new((), probs.dtype, probs.device)
        const_buf = _new((2,), torch.float32, probs.device)
        ctx.save_for_backward(const_buf, tokens_per_expert)
        ctx.rows, ctx.cols = probs.size(0), probs.size(1)
        flops.report_moved(probs, tokens_per_expert, aux_loss)
        return aux_loss

    @staticmethod
    def backward(ctx, grad_aux_loss):
        grad = _new((ctx.rows, ctx.cols), grad_aux_loss.dtype, grad_aux_loss.device)
        flops.report_moved(grad)
        return grad, None


def fused_moe_aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    """TE fused_moe_aux_loss: a scalar in the probabilities' dtype."""
    return _FusedAuxLoss.apply(probs, tokens_per_expert)


# megatron-core's names (megatron/core/extensions/transformer_engine.py binds TE's functions
# under them, and megatron/core/transformer/moe/moe_utils.py imports them).
fused_permute = moe_permute
fused_permute_with_probs = moe_permute_with_probs
fused_unpermute = moe_unpermute
fused_sort_chunks_by_index = moe_sort_chunks_by_index
fused_sort_chunks_by_index_with_probs = moe_sort_chunks_by_index_with_probs
