"""PyTorch references of the state-space and Gated DeltaNet kernels (the values the stand-ins
in models/ssm_kernels.py and models/gdn_kernels.py compute on real tensors), restated from the
packages' own references: mamba_ssm 2.3.2's ssd_chunk_scan_combined_ref (chunk_state_ref,
state_passing_ref, chunk_scan_ref) and layernorm_gated.rms_norm_ref, causal-conv1d 1.7.0's
causal_conv1d_ref, fla 0.6.0's naive_chunk_gated_delta_rule, chunk_local_cumsum and l2norm
kernels (the packages need CUDA to install). All compute in fp32; masks are applied before exp
so that autograd through them sees no inf * 0.

`grads` is the stand-ins' CPU backward: the reference recomputed under autograd.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from metatrace.hooks import flops

_NO_LIMIT = (0.0, float("inf"))


def cdiv(a: int, b: int) -> int:
    """triton.cdiv."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """triton.next_power_of_2."""
    return 1 << max(0, (x - 1).bit_length())


def _chunk(t: torch.Tensor, c: int, L: int) -> torch.Tensor:
    """[b, l, ...] -> [b, c, L, ...], zero-padded to c * L."""
    pad = c * L - t.shape[1]
    if pad:
        t = F.pad(t, (0,) * (2 * (t.dim() - 2)) + (0, pad))
    return t.reshape(t.shape[0], c, L, *t.shape[2:])


def ssd_reference(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                  dt_limit=_NO_LIMIT):  # fmt: skip
    """(out, out_x, dt [b, h, c, L], dA_cumsum [b, h, c, L], final_states [b, h, p, n]), fp32:
    mamba_ssm's ssd_chunk_scan_combined_ref (chunk_cumsum, chunk_state_ref, state_passing_ref,
    chunk_scan_ref) with the masks taken before exp so that autograd sees no inf * 0."""
    b, sl, h, p = x.shape
    g = B.shape[2]
    L = chunk_size
    c = cdiv(sl, L)
    x, B, C = x.float(), B.float(), C.float()
    dt = _chunk(dt.float(), c, L).permute(0, 3, 1, 2)  # [b, h, c, L]
    if dt_bias is not None:
        dt = dt + dt_bias.float().view(h, 1, 1)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != _NO_LIMIT:
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    if sl < c * L:  # the kernels mask the padded tail of the last chunk
        valid = torch.arange(c * L, device=x.device).view(c, L) < sl
        dt = dt * valid
    dA_cumsum = torch.cumsum(dt * A.float().view(h, 1, 1), dim=-1)  # [b, h, c, L]
    xc = _chunk(x, c, L)  # [b, c, L, h, p]
    Bh = _chunk(B.repeat_interleave(h // g, dim=2), c, L)  # [b, c, L, h, n]
    Ch = _chunk(C.repeat_interleave(h // g, dim=2), c, L)
    # chunk_state_ref: the states each chunk adds, [b, c, h, p, n]
    decay_states = torch.exp(dA_cumsum[..., -1:] - dA_cumsum)
    states = torch.einsum("bclhn,bhcl,bhcl,bclhp->bchpn", Bh, decay_states, dt, xc)
    # state_passing_ref: the state entering each chunk, and the final state
    chunk_decay = F.pad(dA_cumsum[..., -1], (1, 0)).cumsum(-1)  # [b, h, c + 1]
    seg = chunk_decay[..., :, None] - chunk_decay[..., None, :]
    causal = torch.ones(c + 1, c + 1, dtype=torch.bool, device=x.device).tril()
    decay_chunk = torch.exp(seg.masked_fill(~causal, -math.inf))
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    passed = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    prev_states, final_states = passed[:, :-1], passed[:, -1]
    # chunk_scan_ref: within the chunk through C B^T, across chunks through the passed states
    cb = torch.einsum("bclhn,bcshn->bchls", Ch, Bh)
    seg = dA_cumsum[..., :, None] - dA_cumsum[..., None, :]  # [b, h, c, L, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(seg.masked_fill(~causal, -math.inf)).permute(0, 2, 1, 3, 4)
    out = torch.einsum("bchls,bhcs,bcshp->bclhp", cb * decay, dt, xc)
    state_decay_out = torch.exp(dA_cumsum).permute(0, 2, 3, 1).unsqueeze(-1)  # [b, c, L, h, 1]
    out = out + torch.einsum("bclhn,bchpn->bclhp", Ch, prev_states) * state_decay_out
    out = out.reshape(b, c * L, h, p)[:, :sl]
    if D is not None:
        out = out + x * (D.float().view(h, 1) if D.dim() == 1 else D.float())
    out_z = out * F.silu(z.float()) if z is not None else out
    return out_z, out, dt, dA_cumsum, final_states


def causal_conv1d_reference(x, weight, bias=None, activation=None):
    """causal_conv1d_ref without states: x [b, d, s] -> [b, d, s] in x's dtype."""
    d, width = weight.shape
    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=width - 1, groups=d)
    out = out[..., : x.shape[-1]]
    return (out if activation is None else F.silu(out)).to(x.dtype)


def rms_norm_reference(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """layernorm_gated.rms_norm_ref (upcast, no bias): [.., N] in x's dtype."""
    dtype = x.dtype
    x, weight = x.float(), weight.float()
    z = z.float() if z is not None else None
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    gs = group_size or x.shape[-1]
    xg = x.reshape(*x.shape[:-1], x.shape[-1] // gs, gs)
    rstd = torch.rsqrt(xg.square().mean(dim=-1, keepdim=True) + eps)
    out = (xg * rstd).reshape(x.shape) * weight
    if z is not None and norm_before_gate:
        out = out * F.silu(z)
    return out.to(dtype)


def real(t) -> bool:
    """A tensor with values (not meta): the stand-ins compute the reference on it."""
    return t is not None and t.device.type != "meta"


def grads(fn, inputs, outputs_grad):
    """autograd.grad of fn(*inputs) (a tensor) against the inputs that are tensors (None
    elsewhere), recomputed under enable_grad: the CPU backward of every stand-in here. What the
    recomputation keeps for its own autograd is the reference's, not the kernel's: innermost
    identity hooks keep it from the saved-tensor hooks around (metatrace's recorder, measure's
    count)."""
    hidden = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with torch.enable_grad(), flops.uncounted(), hidden:
        leaves = [
            t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t
            for t in inputs
        ]  # fmt: skip
        out = fn(*leaves)
        wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        got = iter(torch.autograd.grad(out, wrt, outputs_grad, allow_unused=True))
    return [next(got) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves]


REFERENCE_RANGE = "metatrace.reference"
"""The profiler range (record_function) around a stand-in's reference computation."""


@contextlib.contextmanager
def reference_values():
    """Where a stand-in running on real tensors (the CPU of `metatrace measure`) computes the
    kernel's values with the PyTorch reference and copies them into the buffers the kernel
    writes, which it allocated before. Everything allocated inside is the reference's (fp32
    intermediates, its own autograd graph), not the kernel's: measure leaves those allocations
    out of the measured peak, from when they are made to when they are freed (the range is
    REFERENCE_RANGE in the profiler's log)."""
    with torch.profiler.record_function(REFERENCE_RANGE):
        yield


def fill(buf, value):
    """Copy a reference value into the buffer the kernel would have written (None: skipped)."""
    if buf is not None and value is not None:
        buf.copy_(value.reshape(buf.shape))
    return buf


def gdn_reference(q, k, v, gc, beta, scale, chunk_size=64):
    """o [B, T, H, V] in fp32 from gc, the chunk-local cumsum of the (natural-log) gates g
    [B, T, H]: fla's naive_chunk_gated_delta_rule. Within a chunk the delta rule's WY form
    T = (I + tril(diag(beta) K K^T * decay, -1))^-1 gives u = T (beta v) and w = T (beta k
    exp(gc)); across chunks the state S [K, V] carries the rest."""
    B, T, H, K = q.shape
    BT = chunk_size
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))  # [B, H, T, d]
    beta, gc = beta.transpose(1, 2).float(), gc.transpose(1, 2).float()  # [B, H, T]
    pad = (-T) % BT
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        beta = F.pad(beta, (0, pad))
        gc = F.pad(gc, (0, pad), mode="replicate")  # a zero gate after the last token
    n = (T + pad) // BT
    q, k, v = (t.reshape(B, H, n, BT, -1) for t in (q * scale, k, v))
    beta, decay = beta.reshape(B, H, n, BT, 1), gc.reshape(B, H, n, BT)
    k_beta = k * beta
    lower = torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril()
    seg = (decay[..., :, None] - decay[..., None, :]).masked_fill(~lower, -math.inf)
    l_mask = seg.exp()  # exp(gc_i - gc_j) for j <= i, else 0
    strict = torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril(-1)
    a = ((k_beta @ k.transpose(-1, -2)) * l_mask).masked_fill(~strict, 0)
    eye = torch.eye(BT, device=q.device)
    t_mat = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False)
    u = t_mat @ (v * beta)
    w = t_mat @ (k_beta * decay.exp()[..., None])
    S = q.new_zeros(B, H, k.shape[-1], v.shape[-1])
    outs = []
    for i in range(n):
        qi, ki, di = q[:, :, i], k[:, :, i], decay[:, :, i]
        attn = (qi @ ki.transpose(-1, -2) * l_mask[:, :, i]).masked_fill(~lower, 0)
        v_new = u[:, :, i] - w[:, :, i] @ S
        outs.append((qi * di.exp()[..., None]) @ S + attn @ v_new)
        last = di[..., -1:]
        S = (
            S * last.exp()[..., None]
            + (ki * (last - di).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    o = torch.cat(outs, dim=2)[:, :, :T]
    return o.transpose(1, 2)


def chunk_local_cumsum(g, chunk_size, reverse=False):
    """fla.ops.utils.cumsum.chunk_local_cumsum (scalar gates [B, T, H]) in fp32."""
    B, T, H = g.shape
    pad = (-T) % chunk_size
    x = F.pad(g.float(), (0, 0, 0, pad)).reshape(B, -1, chunk_size, H)
    x = x.flip(2).cumsum(2).flip(2) if reverse else x.cumsum(2)
    return x.reshape(B, -1, H)[:, :T]


def l2_reference(x, eps=1e-6):
    """fla's l2norm_fwd_kernel: x * rsqrt(sum(x^2) + eps) in fp32, in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)
