"""Stand-ins for the flash-linear-attention (fla 0.6.0) kernels megatron-core's Gated DeltaNet
calls: `chunk_gated_delta_rule` (fla.ops.gated_delta_rule), `l2norm` (fla.modules.l2norm) and,
under megatron-core 0.19, `causal_conv1d` (fla.modules.convolution; 0.16.1 calls
causal-conv1d's causal_conv1d_fn: models/ssm_kernels.py).

Both releases call chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None,
output_final_state=False, use_qk_l2norm_in_kernel=False) after their own l2norm and
repeat_interleave of q and k to the value heads (0.19 adds cu_seqlens for packed sequences).

As in models/ssm_kernels.py, each is an autograd Function with the real one's signature that
allocates, in the order of fla's Python wrappers, the outputs and transients and saves what
ChunkGatedDeltaRuleFunction / L2NormFunction / CausalConv1dFunction save; on real tensors it
fills them from fla's PyTorch reference (ops/gated_delta_rule/naive.py,
naive_chunk_gated_delta_rule, restated with a triangular solve in place of its row loop) and
its backward recomputes that reference under autograd.

Shapes: B batch, T seqlen, H heads (q, k and v: megatron-core repeats q and k to the value
heads), K key dim, V value dim, BT chunk_size (64), NT = ceil(T / BT).

Known limitations: the chunk path only (fla's default Triton backend, state_v_first False, no
context parallelism, no gate or beta sigmoid in the kernel); q and k with as many heads as v;
varlen (cu_seqlens) on meta only.
"""

from __future__ import annotations

import torch

from metatrace.hooks import flops
from metatrace.models.ssm_reference import (
    causal_conv1d_reference,
    cdiv,
    chunk_local_cumsum,
    fill,
    gdn_reference,
    grads,
    l2_reference,
    next_pow2,
    real,
    reference_values,
)

RCP_LN2 = 1.4426950216
"""fla.ops.utils.constant.RCP_LN2: chunk_local_cumsum(scale=RCP_LN2) keeps log2 gates."""


# --- FLOPs -----------------------------------------------------------------------------------


def _report_gdn(B, T, H, K, V, BT, *, backward: bool) -> None:
    """Per chunk and head: chunk_scaled_dot_kkt (k_beta k^T [BT, K] @ [K, BT]) and solve_tril
    (an inverse of [BT, BT] lower-triangular, counted as a third of a [BT, BT] @ [BT, BT]);
    recompute_w_u (A @ k, A @ v); chunk_gated_delta_rule_fwd_h (w @ h, k^T @ v_new);
    chunk_fwd_o (q @ h, q k^T, P @ v_new). The backward recomputes w, u and h (four), and runs
    chunk_bwd_dv_local (k q^T, P^T do), chunk_gated_delta_rule_bwd_dhu (q^T do, w^T dv,
    k dh), chunk_bwd_dqkwg (do h^T, do v^T, ds k, ds^T q, v_new dh^T, dv h^T) and
    prepare_wy_repr_bwd (dw k^T, du v^T, A^T dw, A^T du, dA k twice)."""
    rows = B * cdiv(T, BT) * H * BT  # every chunk's rows, batched
    kk, kv = (K, BT), (K, V)
    # [k, n] of [rows, k] @ [k, n], rows BT a chunk: k^T @ v_new is [K, BT] @ [BT, V]
    fwd = [kk, (BT, K), (BT, V), kv, kv, kv, kk, (BT, V)]
    flops.report(2 * rows * BT * BT // 3)  # solve_tril
    for k, n in fwd:
        flops.report_gemm(rows, k, n)
    if not backward:
        return
    bwd = [(BT, K), (BT, V), kv, kv]  # recomputed w, u, h
    bwd += [kk, (BT, V), kv, kv, kv]  # dv_local, dhu
    bwd += [(V, K), (V, BT), (BT, K), (BT, K), (V, K), (V, K)]  # dqkwg
    bwd += [(K, BT), (V, BT), (BT, K), (BT, V), (BT, K), (BT, K)]  # wy_repr_bwd
    for k, n in bwd:
        flops.report_gemm(rows, k, n)


# --- chunk_gated_delta_rule --------------------------------------------------------------------


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """fla.ops.gated_delta_rule.chunk.ChunkGatedDeltaRuleFunction (chunk.py lines 253-392).

    Forward (chunk_gated_delta_rule_fwd): g, the chunk-local cumsum of the gates, fp32
    [B, T, H]; A, the solved (I + A)^-1 of each chunk, [B, T, H, BT] in k's dtype (zeros, the
    fused kkt + solve kernel for BT 64; else an fp32 [B, T, H, BT] first, dropped); w
    [B, T, H, K] and u like v (recompute_w_u_fwd); h [B, NT, H, K, V] in k's dtype and v_new
    like u (chunk_gated_delta_rule_fwd_h); o like v (chunk_fwd_o). Saves q, q_rstd, k, k_rstd,
    v, g, beta_raw, beta, A, initial_state, cu_seqlens, chunk_indices, g_input, A_log, dt_bias:
    with megatron-core's arguments q, k, v, g (the cumsum), beta and A; h, w, u and v_new are
    recomputed in backward (chunk_gated_delta_rule_bwd)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state,
                cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=64):  # fmt: skip
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))  # input_guard
        B, T, H, K = k.shape
        V, dev, f32, BT = v.shape[-1], k.device, torch.float32, chunk_size
        if q.shape[2] != v.shape[2] or k.shape[2] != v.shape[2]:
            raise NotImplementedError("the GDN stand-in models q, k and v with equal heads")
        if initial_state is not None or output_final_state:
            raise NotImplementedError("the GDN stand-in models no recurrent state in or out")
        if cu_seqlens is not None and real(q):
            raise NotImplementedError("the GDN stand-in's CPU reference has no packed sequences")
        q_rstd = k_rstd = None
        if use_qk_l2norm_in_kernel:
            q, q_rstd = _l2norm_fwd(q)
            k, k_rstd = _l2norm_fwd(k)
        nt = cdiv(T, BT)
        g_cum = torch.empty_like(g, dtype=f32)  # chunk_local_cumsum(output_dtype=float)
        flops.report_moved(g, g_cum)
        if BT == 64:
            A = torch.zeros(B, T, H, BT, device=dev, dtype=k.dtype)
        else:  # chunk_scaled_dot_kkt_fwd in fp32, then solve_tril into k's dtype
            A = torch.zeros_like(torch.empty(B, T, H, BT, device=dev, dtype=f32), dtype=k.dtype)
        w, u = k.new_empty(B, T, H, K), torch.empty_like(v)
        h, v_new = k.new_empty(B, nt, H, K, V), torch.empty_like(u)
        o = torch.empty_like(v_new)
        del w, u, h, v_new
        _report_gdn(B, T, H, K, V, BT, backward=False)
        if real(q):
            with reference_values():
                with torch.no_grad(), flops.uncounted():
                    gc = chunk_local_cumsum(g, BT)
                    g_cum.copy_(gc * RCP_LN2)
                    o.copy_(gdn_reference(q, k, v, gc, beta, scale, BT))
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g_cum, beta, beta, A, initial_state,
                              cu_seqlens, None, None, None, None)  # fmt: skip
        ctx.scale, ctx.chunk_size, ctx.l2norm = scale, BT, use_qk_l2norm_in_kernel
        return o.to(q.dtype), None

    @staticmethod
    def backward(ctx, do, dht):
        q, q_rstd, k, k_rstd, v, g, beta, _, A, *_ = ctx.saved_tensors
        B, T, H, K = k.shape
        V, f32, BT = v.shape[-1], torch.float32, ctx.chunk_size
        nt = cdiv(T, BT)
        do = do.contiguous()
        # chunk_gated_delta_rule_bwd: w, u and h (with v_new) recomputed
        w, u = k.new_empty(B, T, H, K), torch.empty_like(v)
        h, v_new = k.new_empty(B, nt, H, K, V), torch.empty_like(u)
        dv = torch.empty_like(do)  # chunk_bwd_dv_local
        dh, dv = q.new_empty(B, nt, H, K, V), torch.empty_like(dv)  # bwd_dhu: dh, dv2
        # chunk_bwd_dqkwg: NK fp32 partials of dg ([NK, B, T, H], NK = ceil(K / BK), BK
        # min(next_pow2(K), 128) on Hopper)
        nk = cdiv(K, min(max(next_pow2(K), 16), 128))
        dq, dk = q.new_empty(B, T, H, K), k.new_empty(B, T, H, K)
        dg = torch.empty(nk, B, T, H, dtype=f32, device=g.device)
        dw = torch.empty_like(w)
        dg = dg.sum(0)
        del h, dh, v_new, u
        # prepare_wy_repr_bwd: dk2, dv, dg2, db
        dk2, dv_out = k.new_empty(B, T, H, K), torch.empty_like(v)
        dg2, db = torch.empty_like(g), torch.empty_like(beta)
        del w, dw, dv
        dk.add_(dk2)
        dg.add_(dg2)
        del dk2, dg2
        dg = torch.empty_like(dg)  # chunk_local_cumsum(dg, reverse=True)
        if ctx.l2norm:
            dq, dk = torch.empty_like(q), torch.empty_like(k)  # l2norm_bwd
        _report_gdn(B, T, H, K, V, BT, backward=True)
        if real(q):
            with reference_values():
                scale = ctx.scale
                if ctx.l2norm:  # back to the inputs: x = y / rstd
                    q, k = q / q_rstd[..., None], k / k_rstd[..., None]

                def fn(q, k, v, gc, beta):
                    if ctx.l2norm:
                        q, k = l2_reference(q), l2_reference(k)
                    return gdn_reference(q, k, v, gc, beta, scale, BT).to(v.dtype)

                gc = g.float() / RCP_LN2
                got = grads(fn, (q, k, v, gc, beta), do)
                got[3] = chunk_local_cumsum(got[3], BT, reverse=True)  # d/dg of the cumsum
                for buf, value in zip((dq, dk, dv_out, dg, db), got):
                    fill(buf, value)
        return dq, dk, dv_out, dg, db, *(None,) * 6


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                           chunk_indices=None, cp_context=None, **kwargs):  # fmt: skip
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule: q, k [B, T, H, K], v [B, T, H, V],
    g and beta [B, T, H] -> (o [B, T, H, V], final_state None)."""
    if use_beta_sigmoid_in_kernel or state_v_first or cp_context is not None:
        raise NotImplementedError("the GDN stand-in models fla's default chunk path")
    if kwargs.get("use_gate_in_kernel"):
        raise NotImplementedError("the GDN stand-in models gates computed outside the kernel")
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")  # fmt: skip
    if scale is None:
        scale = k.shape[-1] ** -0.5
    return ChunkGatedDeltaRuleFunction.apply(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
        use_qk_l2norm_in_kernel, chunk_size,
    )  # fmt: skip


# --- l2norm ------------------------------------------------------------------------------------


def _l2norm_fwd(x, eps=1e-6, output_dtype=None):
    """fla.modules.norm.l2norm.l2norm_fwd: y like x (or output_dtype), rstd fp32 [rows]."""
    shape = x.shape
    x2 = x.view(-1, shape[-1])
    y = torch.empty_like(x2, dtype=output_dtype or x2.dtype)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    flops.report_moved(x2, y, rstd)
    if real(x):
        with reference_values():
            with torch.no_grad(), flops.uncounted():
                xf = x2.float()
                rstd.copy_(torch.rsqrt(xf.square().sum(-1) + eps))
                y.copy_(xf * rstd[:, None])
    return y.view(shape), rstd.view(shape[:-1])


class L2NormFunction(torch.autograd.Function):
    """fla.modules.norm.l2norm.L2NormFunction: saves y and rstd fp32 [rows] (not x); backward
    (l2norm_bwd) allocates dx = dy * rstd - sum(dy * y) * y * rstd like y."""

    @staticmethod
    def forward(ctx, x, eps=1e-6, output_dtype=None):
        y, rstd = _l2norm_fwd(x.contiguous(), eps, output_dtype)
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(y)
        flops.report_moved(y, dy, rstd, dx)
        if real(y):
            with reference_values():
                with flops.uncounted():
                    yf, dyf, r = y.float(), dy.float(), rstd.unsqueeze(-1)
                    dx.copy_(dyf * r - (dyf * yf).sum(-1, keepdim=True) * yf * r)
        return dx, None, None


def l2norm(x, eps=1e-6, output_dtype=None):
    """fla.modules.l2norm.l2norm: x / sqrt(sum(x^2) + eps) over the last dimension."""
    return L2NormFunction.apply(x, eps, output_dtype)


# --- causal_conv1d -----------------------------------------------------------------------------


class CausalConv1dFunction(torch.autograd.Function):
    """fla.modules.causal_conv1d.ops.CausalConv1dFunction (Triton backend): x [B, T, D] kept as
    given (input_guard skips x: a strided view of the input projection stays one, and keeps that
    whole storage); saves x, weight, bias, residual, initial_state; y a contiguous [B, T, D].
    Backward (causal_conv1d_bwd): y recomputed without the activation when there is one, dx
    like x, fp32 per-chunk partials of dw [B * NT, D, W] and db [B * NT, D] (NT = ceil(T / 64)),
    summed and cast to the parameters' dtypes."""

    @staticmethod
    def forward(ctx, x, weight, bias=None, residual=None, initial_state=None,
                output_final_state=False, activation=None, cu_seqlens=None,
                cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64):  # fmt: skip
        if residual is not None or initial_state is not None or output_final_state:
            raise NotImplementedError("the fla causal_conv1d stand-in models no residual or state")
        if cu_seqlens is not None and real(x):
            raise NotImplementedError("the fla causal_conv1d stand-in's CPU path has no varlen")
        weight = weight.contiguous()
        bias = bias.contiguous() if bias is not None else None
        ctx.activation, ctx.chunk_size = activation, chunk_size
        ctx.save_for_backward(x, weight, bias, residual, initial_state)
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        flops.report_moved(x, weight, bias, y)
        if real(x):
            with reference_values():
                with torch.no_grad(), flops.uncounted():
                    y.copy_(_conv_reference(x, weight, bias, activation))
        return y, None

    @staticmethod
    def backward(ctx, dy, dht):
        x, weight, bias, _, _ = ctx.saved_tensors
        B, T, D = x.shape
        nt = cdiv(T, ctx.chunk_size)
        y = torch.empty_like(x, memory_format=torch.contiguous_format) if ctx.activation else None
        dx = torch.empty_like(x)
        dw = weight.new_empty(B * nt, *weight.shape, dtype=torch.float32)
        db = bias.new_empty(B * nt, *bias.shape, dtype=torch.float32) if bias is not None else None
        flops.report_moved(x, y, dy, dx, dw, db)
        dw = dw.sum(0).to(weight)
        db = db.sum(0).to(bias) if bias is not None else None
        del y
        if real(x):
            with reference_values():
                act = ctx.activation
                fn = lambda x, w, b: _conv_reference(x, w, b, act)
                for buf, value in zip((dx, dw, db), grads(fn, (x, weight, bias), dy)):
                    fill(buf, value)
        return dx, dw, db, *(None,) * 8


def _conv_reference(x, weight, bias, activation):
    """[B, T, D]: causal-conv1d's causal_conv1d_ref over the channels-first transpose."""
    act = "silu" if activation in ("silu", "swish") else None
    return causal_conv1d_reference(x.transpose(1, 2), weight, bias, act).transpose(1, 2)


def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None,
                  output_final_state=False, activation=None, backend="triton", cu_seqlens=None,
                  cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs):  # fmt: skip
    """fla.modules.convolution.causal_conv1d: x [B, T, D], weight [D, W], bias [D] ->
    (y [B, T, D], final_state None)."""
    if backend != "triton" or cp_context is not None:
        raise NotImplementedError("the fla causal_conv1d stand-in models the Triton backend")
    return CausalConv1dFunction.apply(x, weight, bias, residual, initial_state,
                                      output_final_state, activation, cu_seqlens,
                                      cu_seqlens_cpu, chunk_indices)  # fmt: skip


# --- what each forward saves, in closed form ---------------------------------------------------


def chunk_gated_delta_rule_saved_bytes(*, batch, seqlen, heads, key_dim, value_dim,
                                       chunk_size=64, dtype_bytes=2, beta_bytes=None,
                                       qk_l2norm_in_kernel=False) -> int:  # fmt: skip
    """ChunkGatedDeltaRuleFunction.forward's ctx.save_for_backward (chunk.py lines 310-326):
    q and k [B, T, H, K] (the l2-normalised copies with use_qk_l2norm_in_kernel, plus their
    fp32 rstd [B, T, H]), v [B, T, H, V], g fp32 [B, T, H] (utils/cumsum.py line 278), beta
    [B, T, H] (beta_bytes: megatron-core's beta.sigmoid() keeps the projection's dtype), and A
    [B, T, H, BT] in k's dtype (chunk_fwd.py line 385); no h (recomputed)."""
    bt = batch * seqlen * heads
    bb = dtype_bytes if beta_bytes is None else beta_bytes
    total = bt * (2 * key_dim + value_dim + chunk_size) * dtype_bytes + bt * (4 + bb)
    return total + (2 * bt * 4 if qk_l2norm_in_kernel else 0)


def l2norm_saved_bytes(*, rows, dim, dtype_bytes=2) -> int:
    """L2NormFunction.forward's ctx.save_for_backward (l2norm.py line 178): y [rows, D] (not x)
    and rstd fp32 [rows]."""
    return rows * dim * dtype_bytes + rows * 4


def causal_conv1d_saved_bytes(*, batch, seqlen, dim, width=4, dtype_bytes=2, weight_bytes=None,
                              bias=True, params=True) -> int:  # fmt: skip
    """CausalConv1dFunction.forward's ctx.save_for_backward (causal_conv1d/ops.py line 957): x
    [B, T, D] as given (for a view: the storage it views, which this form does not know), and
    with `params` weight [D, W] and bias [D]."""
    wb = dtype_bytes if weight_bytes is None else weight_bytes
    act = batch * seqlen * dim * dtype_bytes
    return act + ((dim * width + (dim if bias else 0)) * wb if params else 0)


SAVED_BYTES = {
    "chunk_gated_delta_rule": chunk_gated_delta_rule_saved_bytes,
    "l2norm": l2norm_saved_bytes,
    "causal_conv1d": causal_conv1d_saved_bytes,
}


def saved_bytes(kernel: str, **dims) -> int:
    """Bytes `kernel`'s forward saves for backward (SAVED_BYTES' closed forms)."""
    return SAVED_BYTES[kernel](**dims)
