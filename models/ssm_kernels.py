"""Stand-ins for the Mamba-2 kernels megatron-core's MambaMixer calls: mamba_ssm 2.3.2's
`mamba_split_conv1d_scan_combined` (training), `mamba_chunk_scan_combined` (prefill), gated
`RMSNorm` (ops/triton/layernorm_gated.py) and causal-conv1d 1.7.0's `causal_conv1d_fn`.

Each is an autograd Function with the real one's signature. Its forward allocates, in the
order of the kernel's Python wrappers (`_mamba_chunk_scan_combined_fwd` and the `_chunk_*`
functions it calls), the outputs and the transients, drops the transients where the wrapper
does, and saves exactly the tensors the real Function saves; its backward allocates what
`_mamba_chunk_scan_combined_bwd` allocates. On meta that is all it does. On real tensors (the
CPU of `metatrace measure`) it also fills the outputs with the values of mamba_ssm's PyTorch
references (`chunk_state_ref`, `state_passing_ref`, `chunk_scan_ref`, `rms_norm_ref`,
`causal_conv1d_ref`, restated in models/ssm_reference.py: the packages cannot be installed
without CUDA), and its
backward recomputes that reference from the saved tensors under autograd.

Shapes: b batch, l seqlen, h heads, p headdim, g ngroups, n dstate, L chunk_size,
c = ceil(l / L) chunks, d = h * p.

Known limitations: the default paths megatron-core takes only (rmsnorm_weight / outproj_weight
None, no d_nonssm, no initial states; seq_idx is saved on meta but refused on the CPU); the
deterministic-mode workspaces (MAMBA_DETERMINISTIC) are not modelled; the dB / dC / dCB
partial sums have `nsplits` copies chosen from the GPU's multiprocessor count, taken as
SM_COUNT; the Triton kernels' autotuned block sizes only shape [.., blocks] scratch a few
kilobytes large, taken at their minimum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metatrace.hooks import flops
from metatrace.models.ssm_reference import (
    causal_conv1d_reference,
    cdiv,
    fill,
    grads,
    next_pow2,
    real,
    reference_values,
    rms_norm_reference,
    ssd_reference,
)

SM_COUNT = 132
"""Multiprocessors of an H100 / H200 SXM: torch.cuda.get_device_properties(...).
multi_processor_count in _chunk_state_bwd_db, _chunk_scan_bwd_dC, _chunk_scan_bwd_dcb and
layernorm_gated._layer_norm_bwd (on meta there is no device to ask)."""

_NO_LIMIT = (0.0, float("inf"))


def nsplits(batch: int, nchunks: int, nheads: int, ngroups: int, sm_count: int = SM_COUNT) -> int:
    """Partial copies of dB / dC / dCB (ssd_chunk_state._chunk_state_bwd_db, lines 936-939)."""
    ratio = nheads // ngroups
    per_program = max(min(cdiv(batch * nchunks * nheads, sm_count), ratio), 1)
    return cdiv(ratio, per_program)


# --- FLOPs ---------------------------------------------------------------------------------


def _report_ssd(b, sl, h, g, p, n, L, *, backward: bool) -> None:
    """The chunked scan's batched matrix products (per chunk, batched over b, c and h or g):
    _bmm_chunk_fwd C B^T [L, n] @ [n, L] per group; _chunk_state_fwd x^T (B * decay * dt)
    [p, L] @ [L, n] per head; _chunk_scan_fwd C @ states [L, n] @ [n, p] and (C B^T * decay)
    @ x [L, L] @ [L, p] per head. The backward recomputes the first two and runs, per head,
    _chunk_scan_bwd_dstates (dout^T C), _chunk_scan_chunk_state_bwd_dx (CB^T dout, B dstates),
    _chunk_state_bwd_db (x dstates), _chunk_scan_bwd_dC (dout states), _chunk_scan_bwd_dcb and
    _chunk_scan_bwd_ddAcs_stable (dout x^T each), and per group two _bmm_chunk_bwd (dCB @ C,
    dCB^T @ B). The causal [L, L] products are counted whole (the kernels skip the tiles above
    the diagonal: up to half of those)."""
    c = cdiv(sl, L)
    bch, bcg = b * c * h, b * c * g
    flops.report_gemm(bcg * L, n, L)
    flops.report_gemm(bch * p, L, n)
    if not backward:
        flops.report_gemm(bch * L, n, p)
        flops.report_gemm(bch * L, L, p)
        return
    flops.report_gemm(bch * p, L, n)  # dstates
    flops.report_gemm(bch * L, L, p)  # dx from CB
    flops.report_gemm(bch * L, n, p)  # dx from dstates
    flops.report_gemm(bch * L, p, n)  # dB
    flops.report_gemm(bch * L, p, n)  # dC
    flops.report_gemm(bch * L, p, L)  # dCB
    flops.report_gemm(bch * L, p, L)  # ddA_cumsum
    flops.report_gemm(bcg * L, L, n)  # dB += dCB @ C
    flops.report_gemm(bcg * L, L, n)  # dC += dCB^T @ B


# --- the chunked scan's allocations ------------------------------------------------------------


def _scan_fwd(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
              dt_limit=_NO_LIMIT):  # fmt: skip
    """ssd_combined._mamba_chunk_scan_combined_fwd (lines 343-393, cu_seqlens None):
    (out, out_x, dt_out, dA_cumsum, states, final_states)."""
    if B.stride(-1) != 1:
        B = B.contiguous()
    if C.stride(-1) != 1:
        C = C.contiguous()
    if x.stride(-1) != 1 and x.stride(1) != 1:
        x = x.contiguous()
    if z is not None and z.stride(-1) != 1 and z.stride(1) != 1:
        z = z.contiguous()
    b, sl, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    L, c, dev, f32 = chunk_size, cdiv(sl, chunk_size), x.device, torch.float32
    # _chunk_cumsum_fwd: dt after bias / softplus and its cumsum times A, fp32 [b, h, c, L]
    dt_out = torch.empty(b, h, c, L, device=dev, dtype=f32)
    dA_cumsum = torch.empty(b, h, c, L, device=dev, dtype=f32)
    flops.report_moved(dt, dt_out, dA_cumsum)
    # _chunk_state_fwd (states_in_fp32): each chunk's own state, fp32 [b, c, h, p, n]
    states = torch.empty(b, c, h, p, n, device=dev, dtype=f32)
    # _state_passing_fwd(out_dtype=C.dtype): the states entering the chunks, in C's dtype, and
    # the final state, fp32; the chunk states are dropped when `states` is rebound
    passed = torch.empty(b, c, h, p * n, device=dev, dtype=C.dtype)
    final_states = torch.empty(b, h, p * n, device=dev, dtype=f32)
    flops.report_moved(states, passed, final_states)
    del states
    # _bmm_chunk_fwd(C, B, output_dtype=fp32): C B^T within each chunk, [b, c, g, L, L]
    cb = torch.empty(b, c, g, L, L, device=dev, dtype=f32)
    # _chunk_scan_fwd: out, and out_x (before the z gate) when z is given
    out = torch.empty(b, sl, h, p, device=dev, dtype=x.dtype)
    out_x = torch.empty_like(out) if z is not None else None
    del cb
    _report_ssd(b, sl, h, g, p, n, L, backward=False)
    if real(x):
        with reference_values():
            with torch.no_grad(), flops.uncounted():
                ref = ssd_reference(x, dt, A, B, C, L, D, z, dt_bias, dt_softplus, dt_limit)
                for buf, value in zip((out, out_x, dt_out, dA_cumsum, final_states), ref):
                    fill(buf, value)
    final_states = final_states.view(b, h, p, n)
    return out, out_x, dt_out, dA_cumsum, passed.view(b, c, h, p, n), final_states


def _scan_bwd(dout, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
              dx=None, ddt=None, dB=None, dC=None, dz=None):  # fmt: skip
    """The allocations of ssd_combined._mamba_chunk_scan_combined_bwd (lines 396-513, no initial
    or final states, recompute_output False), in order: the gradients (dx, ddt, dA, dB, dC, dD,
    dz, ddt_bias), written where the caller gives buffers (the split-conv Function's views of
    one dzxbcdt), and the transients, dropped where the source rebinds or leaves them."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    b, sl, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    L, c, dev, f32 = chunk_size, cdiv(sl, chunk_size), x.device, torch.float32
    dB = dB if dB is not None else torch.empty_like(B)
    dC = dC if dC is not None else torch.empty_like(C)
    ddt = ddt if ddt is not None else torch.empty_like(dt)
    dt_in = dt.clone()
    # recomputed: _chunk_cumsum_fwd, _bmm_chunk_fwd, _chunk_state_fwd, _state_passing_fwd (fp32)
    dA_cumsum = torch.empty(b, h, c, L, device=dev, dtype=f32)
    dt_out = torch.empty(b, h, c, L, device=dev, dtype=f32)
    cb = torch.empty(b, c, g, L, L, device=dev, dtype=f32)
    states = torch.empty(b, c, h, p, n, device=dev, dtype=f32)
    passed = torch.empty(b, c, h, p * n, device=dev, dtype=f32)
    torch.empty(b, h, p * n, device=dev, dtype=f32)  # the final state, discarded
    del states
    d_shape = (cdiv(L, 32), b, c, h, p if D is not None and D.dim() == 2 else 1)
    dD = None
    if z is not None:  # _chunk_scan_bwd_dz: dz, and dout_x that replaces dout
        partial = torch.empty(d_shape, device=dev, dtype=f32) if D is not None else None
        dz = dz if dz is not None else torch.empty_like(z)
        dout_x = torch.empty_like(dout)
        # the kernel reads dout, out_x (x's size), z and x, and writes dz and dout_x
        flops.report_moved(dout, x, z, x, dz, dout_x)
        dout = dout_x
        if partial is not None:
            dD = partial.sum(dim=(0, 1, 2)).to(D.dtype).view(D.shape)
        del partial
    dstates = torch.empty(b, c, h, p, n, device=dev, dtype=f32)  # _chunk_scan_bwd_dstates
    # _state_passing_bwd: dstates and states in x's dtype, the chunk-decay gradient
    dstates_x = torch.empty(b, c, h, p * n, device=dev, dtype=x.dtype)
    states_x = torch.empty(b, c, h, p * n, device=dev, dtype=x.dtype)
    blocks = torch.empty(b, h, c, cdiv(p * n, 64), device=dev, dtype=f32)
    ddA_chunk = blocks.sum(dim=-1)
    flops.report_moved(passed, dstates, dstates_x, states_x)
    del blocks, dstates, passed
    # _chunk_scan_chunk_state_bwd_dx: dD partials, dx, ddt (fp32 [b, h, c, L])
    partial = torch.zeros(d_shape, device=dev, dtype=f32) if D is not None else None
    dx = dx if dx is not None else torch.empty_like(x)
    ddt_x = torch.zeros(b, h, c, L, device=dev, dtype=f32)
    if partial is not None:
        dD_x = partial.sum(dim=(0, 1, 2))
        dD_x = (dD_x.sum(dim=-1) if D.dim() == 1 else dD_x).to(D.dtype)
        dD = dD if z is not None else dD_x
    del partial
    split = nsplits(b, c, h, g)
    # _chunk_state_bwd_db and _chunk_scan_bwd_dC: per-split fp32 partials, summed
    ddA_next = torch.empty(b, h, c, L, device=dev, dtype=f32)
    db_f32 = torch.empty(b, sl, split, g, n, device=dev, dtype=f32).sum(2)
    ddA_prev = torch.empty(b, h, c, L, device=dev, dtype=f32)
    dc_f32 = torch.empty(b, sl, split, g, n, device=dev, dtype=f32).sum(2)
    # _chunk_scan_bwd_dcb, then _bmm_chunk_bwd into dB and dC with the fp32 partials added
    dcb = torch.empty(b, c, split, g, L, L, device=dev, dtype=f32).sum(2)
    flops.report_moved(db_f32, dB, dc_f32, dC)
    del dcb, db_f32, dc_f32
    ddA_prev = ddA_prev.flip([-1]).cumsum(dim=-1).flip([-1])
    ddA = torch.empty(b, h, c, cdiv(L, 32), L, device=dev, dtype=f32).sum(dim=3)
    ddA += ddA_next + ddA_prev
    del ddA_next, ddA_prev, ddA_chunk
    # _chunk_cumsum_bwd: ddt (into the given buffer), dA and ddt_bias, fp32 [h]
    ddt_bias = torch.empty_like(dt_bias, dtype=f32) if dt_bias is not None else None
    dA = torch.empty_like(A, dtype=f32)
    flops.report_moved(ddA, ddt_x, dt_in, ddt)
    del ddA, ddt_x, dt_in, dA_cumsum, dt_out, cb, states_x, dstates_x
    _report_ssd(b, sl, h, g, p, n, L, backward=True)
    return dx, ddt, dA, dB, dC, dD, dz, ddt_bias


# --- mamba_chunk_scan_combined --------------------------------------------------------------


class MambaChunkScanCombinedFn(torch.autograd.Function):
    """ssd_combined.MambaChunkScanCombinedFn (lines 593-621): saves out (out_x when z is given),
    x, dt, dA_cumsum, A, B, C, D, z, dt_bias, initial_states, seq_idx."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                dt_limit=_NO_LIMIT, return_final_states=False, return_varlen_states=False):  # fmt: skip
        _check_default_path(x, initial_states, seq_idx, return_varlen_states)
        out, out_x, _, dA_cumsum, _, final_states = _scan_fwd(
            x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit
        )
        ctx.save_for_backward(out if z is None else out_x, x, dt, dA_cumsum, A, B, C, D, z,
                              dt_bias, initial_states, seq_idx)  # fmt: skip
        ctx.chunk_size, ctx.dt_softplus, ctx.dt_limit = chunk_size, dt_softplus, dt_limit
        ctx.return_final_states = return_final_states
        return (out, final_states) if return_final_states else out

    @staticmethod
    def backward(ctx, dout, *args):
        _, x, dt, _, A, B, C, D, z, dt_bias, _, _ = ctx.saved_tensors
        bufs = _scan_bwd(dout, x, dt, A, B, C, ctx.chunk_size, D, z, dt_bias)
        dx, ddt, dA, dB, dC, dD, dz, ddt_bias = bufs
        if real(x):
            with reference_values():
                L, sp, lim = ctx.chunk_size, ctx.dt_softplus, ctx.dt_limit
                fn = lambda x, dt, A, B, C, D, z, dt_bias: ssd_reference(
                    x, dt, A, B, C, L, D, z, dt_bias, sp, lim
                )[0].to(x.dtype)
                got = grads(fn, (x, dt, A, B, C, D, z, dt_bias), dout)
                for buf, value in zip((dx, ddt, dA, dB, dC, dD, dz, ddt_bias), got):
                    fill(buf, value)
        return dx, ddt, dA, dB, dC, None, dD, dz, ddt_bias, *(None,) * 7


def _check_default_path(x, initial_states, seq_idx, return_varlen_states=False):
    if initial_states is not None or return_varlen_states:
        raise NotImplementedError("the SSD stand-ins model no initial or varlen states")
    if seq_idx is not None and real(x):
        raise NotImplementedError("the SSD stand-ins' CPU reference has no packed sequences")


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=_NO_LIMIT, return_final_states=False,
                              return_varlen_states=False):  # fmt: skip
    """mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined: x [b, l, h, p], dt
    [b, l, h], A [h], B / C [b, l, g, n], D [h] or [h, p], z like x -> out like x."""
    return MambaChunkScanCombinedFn.apply(x, dt, A, B, C, chunk_size, D, z, dt_bias,
                                          initial_states, seq_idx, cu_seqlens, dt_softplus,
                                          dt_limit, return_final_states, return_varlen_states)  # fmt: skip


# --- mamba_split_conv1d_scan_combined ----------------------------------------------------------


def _split_dims(zxbcdt, conv1d_weight, D, headdim, ngroups):
    nheads, headdim = (D.shape[0], headdim) if D.dim() == 1 else D.shape
    dim = nheads * headdim
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - nheads) // 2
    if d_nonssm:
        raise NotImplementedError("the split-conv stand-in models d_nonssm == 0 only")
    return nheads, headdim, dim, dstate


def _split_conv_reference(*args):
    """The split-conv Function's output [b, l, d] (for autograd in backward)."""
    return _split_conv_ref_parts(*args)[0]


def _conv_fwd(xbc_t, weight, bias):
    """causal_conv1d cpp_functions.causal_conv1d_fwd_function: out = empty_like(x)."""
    out = torch.empty_like(xbc_t)
    flops.report_moved(xbc_t, weight, bias, out)
    return out


class MambaSplitConv1dScanCombinedFn(torch.autograd.Function):
    """ssd_combined.MambaSplitConv1dScanCombinedFn (lines 815-974) on megatron-core's path
    (rmsnorm_weight and outproj_weight None): the conv output x|B|C [b, l, d + 2 g n] is a
    transient, recomputed in backward; saves zxbcdt, conv1d_weight, conv1d_bias, out_x (the
    scan's output before the z gate, [b, l, h, p]), A, D, dt_bias, initial_states, seq_idx,
    rmsnorm_weight, rstd, outproj_weight, outproj_bias (None where not given)."""

    @staticmethod
    def forward(ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                initial_states=None, seq_idx=None, dt_limit=_NO_LIMIT, return_final_states=False,
                activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None,
                outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True):  # fmt: skip
        if rmsnorm_weight is not None or outproj_weight is not None:
            raise NotImplementedError("the split-conv stand-in models megatron-core's path only")
        _check_default_path(zxbcdt, initial_states, seq_idx)
        nheads, headdim, dim, dstate = _split_dims(zxbcdt, conv1d_weight, D, headdim, ngroups)
        b, sl, _ = zxbcdt.shape
        z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
        xbc_conv = _conv_fwd(_ensure_stride(xbc).transpose(1, 2), conv1d_weight, conv1d_bias)
        gn = ngroups * dstate
        x, B, C = torch.split(xbc_conv.transpose(1, 2), [dim, gn, gn], dim=-1)
        x = x.unflatten(-1, (nheads, headdim))
        B, C = B.unflatten(-1, (ngroups, dstate)), C.unflatten(-1, (ngroups, dstate))
        z = z.unflatten(-1, (nheads, headdim))
        out, out_x, _, _, _, final_states = _scan_fwd(
            x, dt, A, B, C, chunk_size, D, z, dt_bias, True, dt_limit
        )
        del xbc_conv, x, B, C
        out = out.view(b, sl, dim)
        if real(zxbcdt):  # the conv's values: the reference of the whole Function
            with reference_values():
                with torch.no_grad(), flops.uncounted():
                    args = (zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size)
                    ref = _split_conv_ref_parts(*args, dt_limit, activation, headdim, ngroups)
                    out.copy_(ref[0])
                    out_x.copy_(ref[1])
        ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias,
                              initial_states, seq_idx, None, None, None, None)  # fmt: skip
        ctx.chunk_size, ctx.dt_limit, ctx.activation = chunk_size, dt_limit, activation
        ctx.headdim, ctx.ngroups = headdim, ngroups
        return (out, final_states) if return_final_states else out

    @staticmethod
    def backward(ctx, dout, *args):
        zxbcdt, weight, bias, out_x, A, D, dt_bias, *_ = ctx.saved_tensors
        nheads, headdim, dim, dstate = _split_dims(zxbcdt, weight, D, ctx.headdim, ctx.ngroups)
        g = ctx.ngroups
        b, sl, _ = zxbcdt.shape
        z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * g * dstate, nheads], dim=-1)
        xbc_conv = _conv_fwd(_ensure_stride(xbc).transpose(1, 2), weight, bias)  # recomputed
        x, B, C = torch.split(xbc_conv.transpose(1, 2), [dim, g * dstate, g * dstate], dim=-1)
        x, B, C = x.unflatten(-1, (nheads, headdim)), B.unflatten(-1, (g, dstate)), C.unflatten(-1, (g, dstate))  # fmt: skip
        dzxbcdt = torch.empty_like(zxbcdt)
        dz, dxbc_given, ddt_given = torch.split(dzxbcdt, [dim, dim + 2 * g * dstate, nheads], dim=-1)  # fmt: skip
        dxbc = torch.empty_like(xbc)
        dx, dB, dC = torch.split(dxbc, [dim, g * dstate, g * dstate], dim=-1)
        dout = dout.unflatten(-1, (nheads, headdim))
        bufs = _scan_bwd(dout, x, dt, A, B, C, ctx.chunk_size, D, z.unflatten(-1, (nheads, headdim)), dt_bias,
                          dx=dx.unflatten(-1, (nheads, headdim)), ddt=ddt_given,
                          dB=dB.unflatten(-1, (g, dstate)), dC=dC.unflatten(-1, (g, dstate)),
                          dz=dz.unflatten(-1, (nheads, headdim)))  # fmt: skip
        _, _, dA, _, _, dD, _, ddt_bias = bufs
        del xbc_conv, x, B, C
        # causal_conv1d_bwd_function: dx into dxBC_given (a view of dzxbcdt), fp32 dweight and
        # dbias zeroed, then cast to the parameters' dtypes (type_as)
        dweight = torch.zeros_like(weight, dtype=torch.float32)
        dbias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None else None
        flops.report_moved(xbc, dxbc, dxbc_given, weight)
        dweight = dweight.type_as(weight)
        dbias = dbias.type_as(bias) if bias is not None else None
        del dxbc
        if real(zxbcdt):
            with reference_values():
                L, lim, act, hd = ctx.chunk_size, ctx.dt_limit, ctx.activation, ctx.headdim
                fn = lambda zx, w, bi, dtb, A, D: _split_conv_reference(
                    zx, w, bi, dtb, A, D, L, lim, act, hd, g
                )
                got = grads(fn, (zxbcdt, weight, bias, dt_bias, A, D), dout.flatten(-2))
                for buf, value in zip((dzxbcdt, dweight, dbias, ddt_bias, dA, dD), got):
                    fill(buf, value)
        return (dzxbcdt, dweight, dbias, ddt_bias, dA, dD, *(None,) * 13)


def _split_conv_ref_parts(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                          dt_limit, activation, headdim, ngroups):  # fmt: skip
    """(out [b, l, d], out_x [b, l, h, p]) in zxbcdt's dtype."""
    nheads, headdim, dim, dstate = _split_dims(zxbcdt, conv1d_weight, D, headdim, ngroups)
    b, sl, _ = zxbcdt.shape
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    act = "silu" if activation in ("silu", "swish") else None
    xbc = causal_conv1d_reference(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, act)
    x, B, C = torch.split(xbc.transpose(1, 2), [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    out, out_x, *_ = ssd_reference(
        x.unflatten(-1, (nheads, headdim)), dt, A, B.unflatten(-1, (ngroups, dstate)),
        C.unflatten(-1, (ngroups, dstate)), chunk_size, D, z.unflatten(-1, (nheads, headdim)),
        dt_bias, True, dt_limit,
    )  # fmt: skip
    return out.reshape(b, sl, dim).to(zxbcdt.dtype), out_x.to(zxbcdt.dtype)


def _ensure_stride(t):
    """ssd_combined.ensure_stride: a copy when stride(1) is not a multiple of 8."""
    return t if t.stride(1) % 8 == 0 else t.contiguous()


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                                     chunk_size, initial_states=None, seq_idx=None,
                                     dt_limit=_NO_LIMIT, return_final_states=False,
                                     activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6,
                                     outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):  # fmt: skip
    """mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined: zxbcdt
    [b, l, 2 d + 2 g n + h] -> [b, l, d] (the scan's output gated by silu(z))."""
    return MambaSplitConv1dScanCombinedFn.apply(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A,
                                                D, chunk_size, initial_states, seq_idx,
                                                dt_limit, return_final_states, activation,
                                                rmsnorm_weight, rmsnorm_eps, outproj_weight,
                                                outproj_bias, headdim, ngroups,
                                                norm_before_gate)  # fmt: skip


# --- causal_conv1d_fn --------------------------------------------------------------------------


class CausalConv1dFn(torch.autograd.Function):
    """causal_conv1d_interface.CausalConv1dFn (causal-conv1d 1.7.0): x [b, d, s] made
    contiguous unless its channels or its sequence are unit-stride; out = empty_like(x); saves
    x, weight, bias, seq_idx, initial_states. Backward: dx = empty_like(x), dweight and dbias
    fp32 zeros cast back to the parameters' dtypes (cpp_functions.causal_conv1d_bwd_function)."""

    @staticmethod
    def forward(ctx, x, weight, bias=None, seq_idx=None, initial_states=None,
                return_final_states=False, final_states_out=None, activation=None):  # fmt: skip
        if activation not in (None, "silu", "swish"):
            raise NotImplementedError("activation must be None, silu, or swish")
        if initial_states is not None or return_final_states:
            raise NotImplementedError("the causal_conv1d stand-in models no conv states")
        _check_default_path(x, None, seq_idx)
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        bias = bias.contiguous() if bias is not None else None
        out = _conv_fwd(x, weight, bias)
        ctx.activation = "silu" if activation in ("silu", "swish") else None
        if real(x):
            with reference_values():
                with torch.no_grad(), flops.uncounted():
                    out.copy_(causal_conv1d_reference(x, weight, bias, ctx.activation))
        ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
        return out

    @staticmethod
    def backward(ctx, dout, *args):
        x, weight, bias, _, _ = ctx.saved_tensors
        if dout.stride(2) != 1 and dout.stride(1) != 1:
            dout = dout.contiguous()
        dx = torch.empty_like(x)
        dweight = torch.zeros_like(weight, dtype=torch.float32)
        dbias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None else None
        flops.report_moved(x, dout, dx, weight)
        dweight = dweight.type_as(weight)
        dbias = dbias.type_as(bias) if bias is not None else None
        if real(x):
            with reference_values():
                act = ctx.activation
                fn = lambda x, w, b: causal_conv1d_reference(x, w, b, act)
                for buf, value in zip((dx, dweight, dbias), grads(fn, (x, weight, bias), dout)):
                    fill(buf, value)
        return dx, dweight, dbias, None, None, None, None, None


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                     return_final_states=False, final_states_out=None, activation=None):  # fmt: skip
    """causal_conv1d.causal_conv1d_fn: x [b, d, s], weight [d, w], bias [d] -> [b, d, s]."""
    return CausalConv1dFn.apply(x, weight, bias, seq_idx, initial_states, return_final_states,
                                final_states_out, activation)  # fmt: skip


# --- the gated RMSNorm -------------------------------------------------------------------------


class LayerNormFn(torch.autograd.Function):
    """layernorm_gated.LayerNormFn (lines 338-377) with is_rms_norm: x and z as [rows, N] views
    (copies only when not unit-stride), y = empty_like(x), rstd fp32 [ngroups * rows]; saves x,
    weight, bias, mean (None), rstd, z. Backward (_layer_norm_bwd): dx, dz, and fp32 partial
    weight gradients [nrow_groups, N] summed and cast to the weight's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True,
                is_rms_norm=False):  # fmt: skip
        if not is_rms_norm or bias is not None:
            raise NotImplementedError("the gated-norm stand-in models RMSNorm without bias")
        shape = x.shape
        x = x.reshape(-1, x.shape[-1])
        if x.stride(-1) != 1:
            x = x.contiguous()
        if z is not None:
            z = z.reshape(-1, z.shape[-1])
            if z.stride(-1) != 1:
                z = z.contiguous()
        weight = weight.contiguous()
        rows, N = x.shape
        gs = group_size or N
        y = torch.empty_like(x)
        rstd = torch.empty(N // gs * rows, dtype=torch.float32, device=x.device)
        flops.report_moved(x, z, weight, y, rstd)
        if real(x):
            with reference_values():
                with torch.no_grad(), flops.uncounted():
                    y.copy_(rms_norm_reference(x, weight, z, eps, gs, norm_before_gate))
                    xz = (
                        x.float() * F.silu(z.float())
                        if z is not None and not norm_before_gate
                        else x
                    )
                    xg = xz.float().view(rows, N // gs, gs)
                    rstd.copy_(torch.rsqrt(xg.square().mean(-1) + eps).view(-1))
        ctx.save_for_backward(x, weight, bias, None, rstd, z)
        ctx.shape, ctx.eps, ctx.group_size = shape, eps, gs
        ctx.norm_before_gate = norm_before_gate
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, _, _, _, z = ctx.saved_tensors
        dy = dy.reshape(-1, dy.shape[-1])
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        rows, N = x.shape
        gs = ctx.group_size
        dx = torch.empty_like(x)
        dz = torch.empty_like(z) if z is not None else None
        block_n = min(65536 // x.element_size(), next_pow2(gs))
        num_warps = min(max(block_n // 256, 1), 8)
        nrow_groups = cdiv(SM_COUNT * cdiv(4, num_warps), N // gs)
        dw_partial = torch.empty(nrow_groups, N, dtype=torch.float32, device=weight.device)
        flops.report_moved(x, z, dy, dx, dz, dw_partial)
        dw = dw_partial.sum(0).to(weight.dtype)
        del dw_partial
        if real(x):
            with reference_values():
                eps, nbg = ctx.eps, ctx.norm_before_gate
                fn = lambda x, w, z: rms_norm_reference(x, w, z, eps, gs, nbg)
                for buf, value in zip((dx, dw, dz), grads(fn, (x, weight, z), dy)):
                    fill(buf, value)
        dz = dz.reshape(ctx.shape) if dz is not None else None
        return dx.reshape(ctx.shape), dw, None, dz, None, None, None, None


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn."""
    return LayerNormFn.apply(x, weight, bias, z, eps, group_size, norm_before_gate, True)


class RMSNormGated(torch.nn.Module):
    """mamba_ssm.ops.triton.layernorm_gated.RMSNorm (megatron-core's RMSNormGated): a grouped
    RMSNorm, gated by silu(z) after (norm_before_gate) or before the norm; weight [hidden_size]
    set to ones, no bias."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True,
                 device=None, dtype=None):  # fmt: skip
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        return rmsnorm_fn(x, self.weight, self.bias, z=z, eps=self.eps,
                          group_size=self.group_size, norm_before_gate=self.norm_before_gate)  # fmt: skip


# --- what each forward saves, in closed form ---------------------------------------------------


def split_conv1d_scan_saved_bytes(*, batch, seqlen, nheads, headdim, ngroups, dstate,
                                  d_conv=4, dtype_bytes=2, weight_bytes=None,
                                  params=True) -> int:  # fmt: skip
    """MambaSplitConv1dScanCombinedFn.forward's ctx.save_for_backward (ssd_combined.py lines
    883-884) on megatron-core's path: zxbcdt [b, l, 2 d + 2 g n + h] and out_x [b, l, h, p]
    (ssd_chunk_scan._chunk_scan_fwd, line 1278) in the activations' dtype; with `params`, also
    conv1d_weight [d + 2 g n, w] and conv1d_bias [d + 2 g n] (weight_bytes each element) and
    A, D, dt_bias fp32 [h] (megatron-core passes fp32 tensors: D a 1-D [h])."""
    d = nheads * headdim
    conv = d + 2 * ngroups * dstate
    act = batch * seqlen * ((2 * d + 2 * ngroups * dstate + nheads) + d) * dtype_bytes
    if not params:
        return act
    wb = dtype_bytes if weight_bytes is None else weight_bytes
    return act + conv * (d_conv + 1) * wb + 3 * nheads * 4


def chunk_scan_saved_bytes(*, batch, seqlen, nheads, headdim, ngroups, dstate, chunk_size,
                           dtype_bytes=2, dt_bytes=None, gated=True, params=True) -> int:  # fmt: skip
    """MambaChunkScanCombinedFn.forward's ctx.save_for_backward (ssd_combined.py line 603):
    out or out_x [b, l, h, p], x [b, l, h, p], dt [b, l, h] (dt_bytes), dA_cumsum fp32
    [b, h, c, L] (_chunk_cumsum_fwd, ssd_chunk_state.py line 725), B and C [b, l, g, n], z
    [b, l, h, p] when `gated`; with `params`, A, D and dt_bias fp32 [h]."""
    c = cdiv(seqlen, chunk_size)
    dtb = dtype_bytes if dt_bytes is None else dt_bytes
    xs = batch * seqlen * nheads * headdim * dtype_bytes
    total = (3 if gated else 2) * xs
    total += batch * seqlen * nheads * dtb + batch * nheads * c * chunk_size * 4
    total += 2 * batch * seqlen * ngroups * dstate * dtype_bytes
    return total + (3 * nheads * 4 if params else 0)


def causal_conv1d_saved_bytes(*, batch, dim, seqlen, width=4, dtype_bytes=2, weight_bytes=None,
                              bias=True, params=True) -> int:  # fmt: skip
    """CausalConv1dFn.forward's ctx.save_for_backward (causal_conv1d_interface.py line 56):
    x [b, d, s] (the caller's tensor when contiguous); with `params`, weight [d, w] and bias
    [d]."""
    act = batch * dim * seqlen * dtype_bytes
    wb = dtype_bytes if weight_bytes is None else weight_bytes
    return act + ((dim * width + (dim if bias else 0)) * wb if params else 0)


def rmsnorm_gated_saved_bytes(*, rows, hidden, group_size=None, dtype_bytes=2, gated=False,
                              weight_bytes=None, params=True) -> int:  # fmt: skip
    """LayerNormFn.forward's ctx.save_for_backward (layernorm_gated.py line 360): x [rows, N]
    (the caller's tensor, viewed), rstd fp32 [N / group_size * rows] (line 130), z [rows, N]
    when `gated`; with `params`, weight [N]."""
    ngroups = hidden // (group_size or hidden)
    total = rows * hidden * dtype_bytes * (2 if gated else 1) + ngroups * rows * 4
    wb = dtype_bytes if weight_bytes is None else weight_bytes
    return total + (hidden * wb if params else 0)


SAVED_BYTES = {
    "mamba_split_conv1d_scan_combined": split_conv1d_scan_saved_bytes,
    "mamba_chunk_scan_combined": chunk_scan_saved_bytes,
    "causal_conv1d_fn": causal_conv1d_saved_bytes,
    "rmsnorm_fn": rmsnorm_gated_saved_bytes,
}


def saved_bytes(kernel: str, **dims) -> int:
    """Bytes `kernel`'s forward saves for backward (SAVED_BYTES' closed forms)."""
    return SAVED_BYTES[kernel](**dims)
