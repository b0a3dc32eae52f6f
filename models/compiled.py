"""Stand-ins for megatron-core's @jit_fuser functions as torch.compile (inductor) runs them.

megatron.core.jit.jit_fuser is torch.compile (torch >= 2.2); metatrace runs megatron-core with
dynamo disabled (hooks/patches.py `_dynamo_disabled`), i.e. these functions eagerly, which is not
what a GPU run allocates (measured with torch 2.13 inductor on CPU tensors; tests/tracing/test_compiled.py keeps it so):

- fused_cross_entropy.calculate_gradients allocates MORE when compiled: its
  `grad_2d[arange, target] -= update` is a functional index_put on a view of the saved softmax
  whose result is not what is copied back into that input (the later mul_'s is), so
  torch/_inductor/fx_passes/reinplace.py does not reinplace it and torch/_inductor/lowering.py
  `index_put` lowers it as clone(x) + scatter: an fp32 [s, b, V/t] copy (4*s*b*V/t bytes) lives
  with the bf16 gradient (2*s*b*V/t) until the kernel returns.
- the pointwise functions (bias_gelu, bias_gelu_back, ...) allocate LESS when compiled: one
  kernel, one output; eager allocates every intermediate (bias_gelu_back: 6 tensors of the
  output's size at once).
- Gated DeltaNet's _apply_gated_norm and _compute_g_and_beta SAVE less when compiled: the min-cut
  partition keeps the bf16 inputs and recomputes the activations in backward, where eager keeps
  fp32 copies and activations (tests/tracing/test_compiled_gdn.py).

Values: on meta nothing is computed (only the allocations matter); on real tensors (metatrace
measure) the values are computed in row chunks so the temporaries stay 1/_CHUNKS of the eager ones.
"""

from __future__ import annotations

import torch

from metatrace.config import release
from metatrace.hooks import flops

_CHUNKS = 64


def _chunked(out: torch.Tensor, fn, *args: torch.Tensor, timed: bool = True) -> torch.Tensor:
    """out = fn(*args), computed by row chunks; args are out-shaped or broadcast (e.g. a bias).
    The compiled kernel reads `args` and writes `out` once (timed by those bytes unless `timed`
    is false: a kernel another call times)."""
    if timed:
        flops.report_moved(out, *args)
    if out.is_meta:
        return out
    with flops.uncounted():  # the chunks' eager operators are not the kernel
        return _compute(out, fn, *args)


def _compute(out: torch.Tensor, fn, *args: torch.Tensor) -> torch.Tensor:
    width = out.shape[-1]
    o2 = out.view(-1, width)
    rows = o2.shape[0]
    flat = [a.reshape(-1, a.shape[-1]) if a.dim() > 1 else a for a in args]
    step = max(1, -(-rows // _CHUNKS))
    for i in range(0, rows, step):
        j = min(i + step, rows)
        o2[i:j] = fn(*[a[i:j] if a.dim() > 1 else a for a in flat])
    return out


# megatron/core/fusions/fused_bias_gelu.py ----------------------------------------------------


def _bias_gelu(bias, y):
    """Copied from megatron.core.fusions.fused_bias_gelu.bias_gelu (source sha256: 11c2736a603c)."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def _bias_gelu_back(g, bias, y):
    """Copied from megatron.core.fusions.fused_bias_gelu.bias_gelu_back
    (source sha256: 045b7d08a5f6)."""
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (
        1 + tanh_out
    )
    return ff * g


def bias_gelu(bias, y):
    """fused_bias_gelu.bias_gelu compiled: one output of y's shape and the promoted dtype."""
    out = torch.empty(y.shape, dtype=torch.promote_types(bias.dtype, y.dtype), device=y.device)
    return _chunked(out, lambda yy: _bias_gelu(bias, yy), y)


def bias_gelu_back(g, bias, y):
    """fused_bias_gelu.bias_gelu_back compiled: one output (the input gradient)."""
    dtype = torch.promote_types(torch.promote_types(bias.dtype, y.dtype), g.dtype)
    out = torch.empty(y.shape, dtype=dtype, device=y.device)
    return _chunked(out, lambda gg, yy: _bias_gelu_back(gg, bias, yy), g, y)


# megatron/core/fusions/fused_bias_swiglu.py ---------------------------------------------------


def _swiglu(y):
    """Copied from megatron.core.fusions.fused_bias_swiglu.swiglu (source sha256: 10565780d26b)."""
    y_1, y_2 = torch.chunk(y, 2, -1)
    return torch.nn.functional.silu(y_1) * y_2


def _swiglu_back(g, y):
    """megatron-core's, with sigmoid(y_1) computed once. Restates
    megatron.core.fusions.fused_bias_swiglu.swiglu_back (source sha256: 510af73ef1db)."""
    y_1, y_2 = torch.chunk(y, 2, -1)
    sig = torch.sigmoid(y_1)
    return torch.cat((g * sig * (1 + y_1 * (1 - sig)) * y_2, g * y_1 * sig), -1)


def swiglu(y):
    """fused_bias_swiglu.swiglu compiled: one output [..., f] (half of y's last dimension)."""
    out = torch.empty((*y.shape[:-1], y.shape[-1] // 2), dtype=y.dtype, device=y.device)
    return _chunked(out, _swiglu, y)


def bias_swiglu(y, bias):
    """fused_bias_swiglu.bias_swiglu compiled: one output, none of eager's y + bias. Restates
    megatron.core.fusions.fused_bias_swiglu.bias_swiglu (source sha256: 1b02560ab57f)."""
    dtype = torch.promote_types(y.dtype, bias.dtype)
    out = torch.empty((*y.shape[:-1], y.shape[-1] // 2), dtype=dtype, device=y.device)
    return _chunked(out, lambda yy: _swiglu(yy + bias), y)


def swiglu_back(g, y):
    """fused_bias_swiglu.swiglu_back compiled: one output of y's shape (the input gradient)."""
    out = torch.empty(y.shape, dtype=torch.promote_types(g.dtype, y.dtype), device=y.device)
    return _chunked(out, _swiglu_back, g, y)


def bias_swiglu_back(g, y, bias):
    """fused_bias_swiglu.bias_swiglu_back compiled: one output of y's shape. Restates
    megatron.core.fusions.fused_bias_swiglu.bias_swiglu_back (source sha256: f40b40b4cda8)."""
    dtype = torch.promote_types(torch.promote_types(g.dtype, y.dtype), bias.dtype)
    out = torch.empty(y.shape, dtype=dtype, device=y.device)
    return _chunked(out, lambda gg, yy: _swiglu_back(gg, yy + bias), g, y)


def weighted_swiglu(y, weights):
    """fused_bias_swiglu.weighted_swiglu compiled (the MoE experts' activation weighted by the
    routing probabilities, moe_apply_probs_on_input off): one output [..., f] in y's dtype.
    Restates megatron.core.fusions.fused_bias_swiglu.weighted_swiglu (source sha256: cc06bb98c982)."""
    out = torch.empty((*y.shape[:-1], y.shape[-1] // 2), dtype=y.dtype, device=y.device)
    return _chunked(out, lambda yy, ww: (_swiglu(yy) * ww).to(y.dtype), y, weights)


def _promoted_cat(y, weights):
    """The buffer inductor realises in the weighted backward kernels: the input gradient's two
    halves concatenated in the weights' (fp32) precision before the cast to y's dtype (measured
    on CPU tensors, tests/tracing/test_compiled.py); freed when the kernel returns."""
    return torch.empty(y.shape, dtype=torch.promote_types(y.dtype, weights.dtype), device=y.device)


def weighted_swiglu_back(g, y, weights):
    """fused_bias_swiglu.weighted_swiglu_back compiled: the input gradient (y's shape and dtype)
    and the weights' gradient [..., 1] (their dtype), the row sum fused into the kernel; the
    promoted concatenation (_promoted_cat) lives while they are written. Restates
    megatron.core.fusions.fused_bias_swiglu.weighted_swiglu_back (source sha256: c72e1f7820f5)."""
    (grad,), wgrad = _weighted_back(g, y, weights, _swiglu, _swiglu_back)
    return grad, wgrad


def _weighted_back(g, y, weights, act, act_back, bias=None):
    """The compiled backward of a weighted activation `act` (its input gradient `act_back`):
    the input gradient, with a bias its gradient (the same values in a buffer of its own:
    inductor writes each output), and the weights' gradient, beside the promoted concatenation.
    Returns ((input gradient[, bias gradient]), weights' gradient)."""
    grad = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    bias_grad = torch.empty(y.shape, dtype=y.dtype, device=y.device) if bias is not None else None
    wgrad = torch.empty((*y.shape[:-1], 1), dtype=weights.dtype, device=y.device)
    cat = _promoted_cat(y, weights)
    written = (grad, bias_grad) if bias_grad is not None else (grad,)
    flops.report_moved(*written, wgrad, g, y, weights)
    del cat
    if grad.is_meta:
        return written, wgrad
    shift = (lambda yy: yy + bias) if bias is not None else (lambda yy: yy)
    with flops.uncounted():
        _compute(grad, lambda gg, yy, ww: act_back(gg * ww, shift(yy)).to(y.dtype), g, y, weights)
        _compute(
            wgrad,
            lambda gg, yy: (act(shift(yy)) * gg.to(weights.dtype)).sum(-1, keepdim=True),
            g,
            y,
        )
        if bias_grad is not None:
            bias_grad.copy_(grad)
    return written, wgrad


# megatron/core/fusions/fused_bias_geglu.py (GPT-OSS's experts) --------------------------------


def _quick_geglu(y, offset):
    """Restates megatron.core.fusions.fused_bias_geglu.quick_geglu (source sha256: 488c3ff83c87)."""
    y_1, y_2 = torch.chunk(y, 2, -1)
    return y_1 * torch.sigmoid(1.702 * y_1) * (y_2 + offset)


def _quick_geglu_back(g, y, offset):
    """Restates megatron.core.fusions.fused_bias_geglu.quick_geglu_back
    (source sha256: 7485d96bbf1a)."""
    y_1, y_2 = torch.chunk(y, 2, -1)
    sig = torch.sigmoid(1.702 * y_1)
    dy_1 = g * sig * (1 + 1.702 * y_1 * (1 - sig)) * (y_2 + offset)
    return torch.cat((dy_1, g * y_1 * sig), -1)


def weighted_quick_geglu(y, weights, linear_offset=0.0):
    """fused_bias_geglu.weighted_quick_geglu compiled: one output [..., f] in y's dtype. Restates
    megatron.core.fusions.fused_bias_geglu.weighted_quick_geglu (source sha256: 1a55b0f0975a)."""
    out = torch.empty((*y.shape[:-1], y.shape[-1] // 2), dtype=y.dtype, device=y.device)
    return _chunked(
        out, lambda yy, ww: (_quick_geglu(yy, linear_offset) * ww).to(y.dtype), y, weights
    )


def weighted_bias_quick_geglu(y, bias, weights, linear_offset=0.0):
    """fused_bias_geglu.weighted_bias_quick_geglu compiled: one output, none of eager's y + bias.
    Restates megatron.core.fusions.fused_bias_geglu.weighted_bias_quick_geglu
    (source sha256: 15baf5103294)."""
    out = torch.empty((*y.shape[:-1], y.shape[-1] // 2), dtype=y.dtype, device=y.device)
    return _chunked(
        out,
        lambda yy, ww: (_quick_geglu(yy + bias, linear_offset) * ww).to(y.dtype),
        y,
        weights,
    )


def weighted_quick_geglu_back(g, y, weights, linear_offset=0.0):
    """fused_bias_geglu.weighted_quick_geglu_back compiled: the input gradient and the weights'
    gradient [..., 1]. Restates megatron.core.fusions.fused_bias_geglu.weighted_quick_geglu_back
    (source sha256: 3ee00d3c9d85)."""
    (grad,), wgrad = _weighted_back(
        g,
        y,
        weights,
        lambda yy: _quick_geglu(yy, linear_offset),
        lambda gg, yy: _quick_geglu_back(gg, yy, linear_offset),
    )
    return grad, wgrad


def weighted_bias_quick_geglu_back(g, y, bias, weights, linear_offset=0.0):
    """fused_bias_geglu.weighted_bias_quick_geglu_back compiled: the input gradient, the bias
    gradient (the same values in a buffer of its own: inductor writes each output) and the
    weights' gradient. Restates
    megatron.core.fusions.fused_bias_geglu.weighted_bias_quick_geglu_back
    (source sha256: f977cd3d51ac)."""
    (grad, bias_grad), wgrad = _weighted_back(
        g,
        y,
        weights,
        lambda yy: _quick_geglu(yy, linear_offset),
        lambda gg, yy: _quick_geglu_back(gg, yy, linear_offset),
        bias,
    )
    return grad, bias_grad, wgrad


# megatron/core/fusions/fused_cross_entropy.py -------------------------------------------------


def fused_ce_calculate_gradients(softmax, grad_output, target_mask, masked_target_1d):
    """fused_cross_entropy.calculate_gradients compiled (inductor's graph, torch 2.13):
        buf0 = clone(softmax)            fp32 [s, b, V/t]   <- the buffer eager does not allocate
        buf2 = empty(bf16 [s, b, V/t])                      (the returned gradient)
        kernel: buf0[rows, target] -= 1 - mask; buf2 = bf16(buf0 * grad_output); softmax = buf0 * grad_output
        return buf2                      (buf0 freed on return)
    The write-back into the saved softmax (an input mutation) allocates nothing.
    Restates megatron.core.fusions.fused_cross_entropy.calculate_gradients
    (source sha256: b3a030da2d15), and the two functions it calls: Restates
    megatron.core.tensor_parallel.cross_entropy.VocabParallelCrossEntropy.prepare_gradient_calculation_operands
    (source sha256: 608f96aabf20). Restates
    megatron.core.tensor_parallel.cross_entropy.VocabParallelCrossEntropy.calculate_gradients
    (source sha256: 65c51cede5b3)."""
    with flops.uncounted():  # one kernel: timed below by what it reads and writes
        work = softmax.clone()
        grad_2d = work.view(-1, softmax.size()[-1])
        arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
        softmax_update = 1.0 - target_mask.view(-1).float()
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        work.mul_(grad_output.unsqueeze(dim=-1))
        grad_input = work.to(torch.bfloat16)
        softmax.copy_(work)
    flops.report_moved(softmax, softmax, grad_input, grad_output)  # read, written back, out
    return grad_input


# megatron/core/fusions/fused_bias_dropout.py --------------------------------------------------


class _BiasDropoutAdd(torch.autograd.Function):
    """bias_dropout_add_fused_train compiled: AOT autograd's partition of
    residual + dropout(x + bias) saves only the bool keep-mask (1 byte an element, as CUDA's
    native_dropout); forward allocates the output and the mask, none of eager's x + bias and
    dropout(x + bias) temporaries; backward allocates the input gradient (and the bias'), the
    residual's gradient is the incoming one. Where the residual's dtype differs from x's
    (fp32_residual_connection), 0.16.1 casts the residual to x's dtype and 0.19 casts x to the
    residual's: the output is in that dtype. Restates
    megatron.core.fusions.fused_bias_dropout.bias_dropout_add_fused_train
    (source sha256: ab126512fde9) and what it calls: Restates
    megatron.core.fusions.fused_bias_dropout._bias_dropout_add_func
    (source sha256: 6de7c86aa6ac, 502e6802e32d)."""

    @staticmethod
    def forward(ctx, x, bias, residual, prob):
        keep = 1.0 - prob
        shape = torch.broadcast_shapes(x.shape, residual.shape)
        ctx.keep, ctx.has_bias, ctx.x_dtype = keep, bias is not None, x.dtype
        dtype = residual.dtype if release.since(0, 19) else x.dtype
        if prob == 0:
            # dropout(p=0) is the identity: one kernel writes residual + x + bias, nothing is
            # saved, and the gradients of x and the residual are the incoming one.
            ctx.save_for_backward()
            out = torch.empty(shape, dtype=dtype, device=x.device)
            b = (
                bias
                if bias is not None
                else flops.unpriced(torch.zeros, (), dtype=x.dtype, device=x.device)
            )
            return _chunked(out, lambda xx, rr: rr.to(dtype) + xx.to(dtype) + b, x, residual)
        mask = torch.empty(shape, dtype=torch.bool, device=x.device)
        if not mask.is_meta:
            # One kernel writes the mask and the output (timed with the output below).
            _chunked(mask, lambda xx: torch.rand(xx.shape, device=xx.device) < keep, x, timed=False)
        out = torch.empty(shape, dtype=dtype, device=x.device)
        b = (
            bias
            if bias is not None
            else flops.unpriced(torch.zeros, (), dtype=x.dtype, device=x.device)
        )
        _chunked(
            out, lambda xx, mm, rr: rr.to(dtype) + (xx + b).to(dtype) * mm / keep, x, mask, residual
        )
        ctx.save_for_backward(mask)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.keep == 1.0:
            grad_bias = grad.sum(dim=tuple(range(grad.dim() - 1))) if ctx.has_bias else None
            return grad, grad_bias, grad, None
        (mask,) = ctx.saved_tensors
        grad_x = torch.empty(grad.shape, dtype=ctx.x_dtype, device=grad.device)
        _chunked(grad_x, lambda gg, mm: gg * mm / ctx.keep, grad, mask)
        grad_bias = grad_x.sum(dim=tuple(range(grad_x.dim() - 1))) if ctx.has_bias else None
        return grad_x, grad_bias, grad, None


def bias_dropout_add_fused_train(x_with_bias, residual, prob):
    x, bias = x_with_bias
    return _BiasDropoutAdd.apply(x, bias, residual, prob)


# megatron/core/ssm/gated_delta_net (Gated DeltaNet) -------------------------------------------


class _GatedAct(torch.autograd.Function):
    """(y * act(gate.float())).to(dtype) compiled, y and gate [rows, D]: AOT autograd's min-cut
    partition saves y and gate as given (bf16) and recomputes act(gate) in backward; forward
    allocates the output only, backward the two input gradients (y's and gate's dtypes). Eager
    saves gate.float() and act(gate.float()) (fp32 [rows, D] each) besides y."""

    @staticmethod
    def forward(ctx, y, gate, act, dtype):
        ctx.act = act
        ctx.save_for_backward(y, gate)
        out = torch.empty(y.shape, dtype=dtype, device=y.device)
        return _chunked(out, lambda yy, gg: (yy * act(gg.float())).to(dtype), y, gate)

    @staticmethod
    def backward(ctx, grad):
        y, gate = ctx.saved_tensors
        dy = torch.empty_like(y)
        dgate = torch.empty_like(gate)
        flops.report_moved(grad, y, gate, dy, dgate)  # one kernel
        if dy.is_meta:
            return dy, dgate, None, None
        step = max(1, -(-y.shape[0] // _CHUNKS))
        with flops.uncounted(), torch.enable_grad():
            for i in range(0, y.shape[0], step):
                rows = slice(i, i + step)
                g = gate[rows].detach().float().requires_grad_()
                a = ctx.act(g)
                dout = grad[rows].float()
                dy[rows] = dout * a.detach()
                (dg,) = torch.autograd.grad(a, g, dout * y[rows].float())
                dgate[rows] = dg
        return dy, dgate, None, None


def gdn_apply_gated_norm(self, x, gate):
    """GatedDeltaNet._apply_gated_norm compiled: dynamo breaks the graph at the output norm
    (Transformer Engine's norm runs its C++ kernels: the norm stand-in runs as it does, eagerly),
    and compiles the gate multiply after it (_GatedAct): the gate's fp32 copy and its activation
    are not kept. Restates megatron.core.ssm.gated_delta_net.GatedDeltaNet._apply_gated_norm
    (source sha256: b1ce8409786a).

    Known limitations: a norm dynamo can trace (torch.nn.RMSNorm of the local spec) would fuse
    with the gate multiply on a GPU; every norm is taken to break the graph."""
    x_dtype = x.dtype
    x = x.reshape(-1, x.shape[-1])
    y = self.out_norm(x)
    gate = gate.reshape(-1, gate.shape[-1])
    return _GatedAct.apply(y, gate, self.act_fn, x_dtype)


class _GAndBeta(torch.autograd.Function):
    """g = -exp(A_log) * softplus(alpha.float() + dt_bias), beta.sigmoid(), compiled: saves
    A_log, dt_bias, alpha (as given) and the sigmoid's output; forward allocates g (fp32) and
    the sigmoid (beta's dtype), backward the four gradients and an fp32 buffer like alpha (the
    elementwise gradient the reductions over tokens read). Eager saves alpha.float() + dt_bias
    and the softplus (fp32, alpha's shape each) in place of alpha."""

    @staticmethod
    def forward(ctx, A_log, dt_bias, alpha, beta):
        dtype = torch.promote_types(torch.promote_types(A_log.dtype, dt_bias.dtype), torch.float32)
        g = torch.empty(alpha.shape, dtype=dtype, device=alpha.device)
        sig = torch.empty_like(beta)
        flops.report_moved(A_log, dt_bias, alpha, beta, g, sig)  # one kernel
        if not g.is_meta:
            with flops.uncounted():  # by row chunks, as _chunked
                a = -A_log.exp()
                _compute(
                    g, lambda al: a * torch.nn.functional.softplus(al.float() + dt_bias), alpha
                )
                _compute(sig, torch.sigmoid, beta)
        ctx.save_for_backward(A_log, dt_bias, alpha, sig)
        return g, sig

    @staticmethod
    def backward(ctx, dg, dsig):
        A_log, dt_bias, alpha, sig = ctx.saved_tensors
        dz = torch.empty(alpha.shape, dtype=torch.float32, device=alpha.device)  # d/d(alpha+dt)
        dalpha, dbeta = torch.empty_like(alpha), torch.empty_like(sig)
        dA, ddt = torch.empty_like(A_log), torch.empty_like(dt_bias)
        flops.report_moved(dg, dsig, A_log, dt_bias, alpha, sig, dz, dalpha, dbeta, dA, ddt)
        if not dz.is_meta:
            with flops.uncounted():  # by row chunks, as _chunked
                a = -A_log.float().exp()
                _compute(
                    dz,
                    lambda gg, al: gg.float() * a * torch.sigmoid(al.float() + dt_bias),
                    dg,
                    alpha,
                )
                dalpha.copy_(dz)
                ddt.copy_(dz.view(-1, dz.shape[-1]).sum(0))
                dA.zero_()
                dg2, al2 = dg.reshape(-1, dg.shape[-1]), alpha.reshape(-1, alpha.shape[-1])
                step = max(1, -(-dg2.shape[0] // _CHUNKS))
                for i in range(0, dg2.shape[0], step):
                    z = al2[i : i + step].float() + dt_bias
                    dA += (dg2[i : i + step].float() * a * torch.nn.functional.softplus(z)).sum(0)
                _compute(dbeta, lambda gg, ss: gg * ss * (1 - ss), dsig, sig)
        del dz
        return dA, ddt, dalpha, dbeta


def gdn_compute_g_and_beta(self, A_log_local_cp, dt_bias_local_cp, alpha, beta):
    """_GDNBase._compute_g_and_beta compiled (0.19; 0.16.1 computes g and beta in forward,
    eagerly): _GAndBeta. Restates
    megatron.core.ssm.gated_delta_net.common._GDNBase._compute_g_and_beta
    (source sha256: 43e14d050562; since 0.19)."""
    return _GAndBeta.apply(A_log_local_cp, dt_bias_local_cp, alpha, beta)
