"""Context-parallel attention as Transformer Engine 2.8 runs it (attention/dot_product_attention/
context_parallel.py), for the fused (cuDNN) kernel on sbhd tensors with a causal mask.

Each rank holds L = s/c tokens: chunks r and 2c-1-r of the sequence (megatron-core's
get_batch_on_this_cp_rank), so every step of the causal computation is half a tile. The
communication and what is kept follow the sources:

- p2p (ring over the CP group): K and V are packed into one flat buffer kvn = 2 L b h_kv d;
  forward sends it to rank r+1 and receives from r-1, c-1 times, keeping every received buffer
  until the output is merged; it saves q, the last received kvn buffer, the output, fp32 lse
  [b, h_q, L] and one rng state per step. Backward runs the ring the other way: kvn, then
  (c-2) x 2 kvn (K, V and the partial dK, dV), then kvn (dK, dV); dk and dv are returned as
  views into a [2, kvn] buffer.
- all_gather: K and V are all-gathered to [s, b, h_kv, d] (and reordered), two half-steps compute
  the output halves; saved are the local q, k, v, two output halves, two lse and two rng states,
  and the returned output is a separate tensor (held twice). Backward gathers K and V again and
  reduce-scatters dK and dV.
- a2a (Ulysses): all-to-all of q, k and v to the full sequence with h/c heads, attention, and an
  all-to-all of the output back; saved are the post-a2a q, k, v, the pre-a2a output, lse and rng,
  and the returned output is separate (held twice). Backward: all-to-all of dout, of dq, dk, dv.
- a2a+p2p: all-to-all over the inner group (hierarchical_cp_sizes[0]) around a p2p ring over
  the outer group; backward all-to-alls out and dout first.

Known limitations: kernel workspaces and the short-lived fp32 temporaries of the output merge
are not modelled; the flash backend under CP is modelled as the fused one plus its bshd copies of
q, k, v and its second output copy; CP rank 0's step sizes stand for every CP rank (they differ
only in which half-steps run).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from metatrace.hooks import flops
from metatrace.models.te_attention_kernel import cu_seqlens, report_backward, sbhd_flops


def _cp_flops(ctx, q, v, cp: int) -> None:
    """This rank's share of the causal attention FLOPs (forward reported, backward kept on
    `ctx`): its L = s/cp queries (local q, [L, b, h, d]) against all s keys, halved for the
    mask. The load-balanced chunk order gives every rank the same share, whichever way (ring,
    all-gather, all-to-all) the keys arrive."""
    L, b, h_kv, dv = v.shape
    sbhd_flops(ctx, q.shape, (L * cp, b, h_kv, dv), causal=True)


def _ring_exchange(send, recv, group, send_to: int, recv_from: int, batched: bool) -> None:
    """flash_attn_p2p_communicate: one send and one receive of equal size on the CP group."""
    if batched:
        ops = [
            dist.P2POp(dist.isend, send, send_to, group),
            dist.P2POp(dist.irecv, recv, recv_from, group),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    else:
        for req in (
            dist.isend(send, send_to, group=group),
            dist.irecv(recv, recv_from, group=group),
        ):
            req.wait()


def _step_outputs(q_len, b, h, d, dtype, device):
    """What one fused-attention call allocates: output, fp32 softmax stats, rng state."""
    return (
        flops.unpriced(torch.zeros, (q_len, b, h, d), dtype=dtype, device=device),  # the kernel's
        torch.empty((b, h, q_len, 1), dtype=torch.float32, device=device),
        torch.empty(2, dtype=torch.int64, device=device),
    )


class _Ring:
    """Where this rank sits in a CP ring: its rank, size, group and neighbours (global ranks)."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.next = ranks[(self.rank + 1) % self.size]
        self.prev = ranks[(self.rank - 1) % self.size]
        # TE batches the pair when c == 2 on pre-Blackwell GPUs (NVTE_BATCH_MHA_P2P_COMM).
        self.batched = self.size == 2


def _p2p_forward(q, k, v, ring: _Ring, config):
    """The ring's forward; returns the output and what backward needs (TE's saved tensors)."""
    L, b, h_q, d = q.shape
    c, r = ring.size, ring.rank
    kv = torch.cat((k.reshape(-1), v.reshape(-1)))  # flat kvn buffer
    buffers = [kv]
    steps, rngs = [], []
    for i in range(c):
        if i < c - 1:
            buffers.append(torch.empty_like(kv))
            _ring_exchange(
                buffers[i], buffers[i + 1], ring.group, ring.next, ring.prev, ring.batched
            )
        if i == 0:  # diagonal: own KV, causal
            q_len, temps = L, ()
        elif i <= r:  # lower triangle: the first half of the remote K and V
            half = k.shape[0] // 2
            temps, q_len = (k[:half].contiguous(), v[:half].contiguous()), L
        else:  # upper triangle: the second half of q against the remote K and V
            temps, q_len = (q[L // 2 :].contiguous(),), L // 2
        out_i, lse_i, rng_i = _step_outputs(q_len, b, h_q, d, q.dtype, q.device)
        steps.append((out_i, lse_i))
        rngs.append(rng_i)
        cu_seqlens(config, b, q_len, q.device)
        del temps
    lse = steps[0][1].squeeze(-1).clone()  # [b, h_q, L] fp32, merged in place
    out = torch.zeros((L, b, h_q, d), dtype=q.dtype, device=q.device)
    del steps
    return out, (buffers[-1], lse, *rngs)


def _p2p_backward(q, kv, lse, dout, ring: _Ring, kv_shapes):
    """The ring's backward: dq, and dk, dv as views into the last [2, kvn] buffer."""
    c, r = ring.size, ring.rank
    L = q.shape[0]
    dout = dout.contiguous()
    lse_half = lse[..., L // 2 :].contiguous() if r < c - 1 else None
    dq = torch.empty_like(q)
    bufs = [torch.empty((2, kv.numel()), dtype=kv.dtype, device=kv.device) for _ in range(2)]
    bufs[0][0].copy_(kv)
    for i in range(c):
        cur, nxt = bufs[i % 2], bufs[(i + 1) % 2]
        if i == 0:  # K and V
            _ring_exchange(cur[0], nxt[0], ring.group, ring.prev, ring.next, ring.batched)
        elif i < c - 1:  # K, V and the partial dK, dV
            _ring_exchange(cur, nxt, ring.group, ring.prev, ring.next, ring.batched)
        else:  # dK and dV
            _ring_exchange(cur[1], nxt[1], ring.group, ring.prev, ring.next, ring.batched)
        # The step's fused backward allocates dq_, dk_, dv_ at the step's section sizes.
        q_len = L // 2 if 0 < i < c - 1 - r else L
        step = [torch.empty((q_len, *q.shape[1:]), dtype=q.dtype, device=q.device)]
        step += [torch.empty(shape, dtype=q.dtype, device=q.device) for shape in kv_shapes]
        del step
    del lse_half
    dkv = bufs[(c - 1) % 2][1]
    k_shape, v_shape = kv_shapes
    half = dkv.numel() // 2
    return dq, dkv[:half].view(k_shape), dkv[half:].view(v_shape)


class _P2PAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, config):
        _cp_flops(ctx, q, v, ring.size)
        out, (kv, lse, *rngs) = _p2p_forward(q, k, v, ring, config)
        ctx.save_for_backward(q, kv, out, lse, *rngs)
        ctx.ring, ctx.kv_shapes = ring, (k.shape, v.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        report_backward(ctx)
        q, kv, out, lse, *_ = ctx.saved_tensors
        return (*_p2p_backward(q, kv, lse, dout, ctx.ring, ctx.kv_shapes), None, None)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, config):
        _cp_flops(ctx, q, v, ring.size)
        L, b, h_q, d = q.shape
        c = ring.size
        k_ag, v_ag = _gather_reordered(k, ring), _gather_reordered(v, ring)
        out = torch.empty_like(q)
        halves, stats = [], []
        for _ in range(2):
            q_half = q[: L // 2].contiguous()
            out_i, lse_i, rng_i = _step_outputs(L // 2, b, h_q, d, q.dtype, q.device)
            out[: L // 2].copy_(out_i)
            halves.append(out_i)
            stats += [lse_i, rng_i]
            del q_half
        del k_ag, v_ag
        cu_q = torch.empty(b + 1, dtype=torch.int32, device=q.device)
        cu_kv = cu_seqlens(config, b, c * L, q.device)
        ctx.save_for_backward(q, k, v, cu_q, cu_kv, *halves, *stats)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        report_backward(ctx)
        q, k, v, *_ = ctx.saved_tensors
        ring = ctx.ring
        L = q.shape[0]
        k_ag, v_ag = _gather_reordered(k, ring), _gather_reordered(v, ring)
        dq = torch.empty_like(q)
        dk_full, dv_full = torch.zeros_like(k_ag), torch.zeros_like(v_ag)
        for _ in range(2):
            step = [q[: L // 2].contiguous(), dout[: L // 2].contiguous()]
            step += [torch.empty_like(q[: L // 2]), torch.empty_like(k_ag), torch.empty_like(v_ag)]
            del step
        del k_ag, v_ag
        dk_full = dk_full.index_select(0, torch.arange(dk_full.shape[0], device=q.device))
        dv_full = dv_full.index_select(0, torch.arange(dv_full.shape[0], device=q.device))
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dist.reduce_scatter_tensor(dk, dk_full, group=ring.group)
        dist.reduce_scatter_tensor(dv, dv_full, group=ring.group)
        return dq, dk, dv, None, None


def _gather_reordered(x, ring):
    """all_gather_into_tensor along the sequence, then index_select back to natural order."""
    full = torch.empty((x.shape[0] * ring.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(full, x, group=ring.group)
    return full.index_select(0, torch.arange(full.shape[0], device=x.device))


def _a2a(x, group, seq_to_heads: bool):
    """TE's flash_attn_a2a_communicate for one tensor: a contiguous chunked copy of the input,
    all_to_all_single into a new buffer, and a reordering copy of the result."""
    c = dist.get_world_size(group)
    s, b, h, d = x.shape
    if seq_to_heads:  # [L, b, h, d] -> [c L, b, h / c, d]
        send = x.reshape(s, b, c, h // c, d).movedim(2, 0).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return recv.reshape(c * s, b, h // c, d).contiguous()
    send = x.reshape(c, s // c, b, h, d).contiguous()  # [s, b, h', d] -> [s / c, b, c h', d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.movedim(0, 2).reshape(s // c, b, c * h, d).contiguous()


class _A2AAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, config):
        _cp_flops(ctx, q, v, dist.get_world_size(group))
        q2, k2, v2 = (_a2a(x, group, True) for x in (q, k, v))
        s, b, h, d = q2.shape
        out_, lse, rng = _step_outputs(s, b, h, d, q.dtype, q.device)
        out = _a2a(out_, group, False)
        ctx.save_for_backward(q2, k2, v2, out_, lse, rng, cu_seqlens(config, b, s, q.device))
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        report_backward(ctx)
        q2, k2, v2, *_ = ctx.saved_tensors
        group = ctx.group
        dout2 = _a2a(dout.contiguous(), group, True)
        dq2, dk2, dv2 = torch.empty_like(q2), torch.empty_like(k2), torch.empty_like(v2)
        del dout2
        return (*(_a2a(x, group, False) for x in (dq2, dk2, dv2)), None, None)


class _A2AP2PAttention(torch.autograd.Function):
    """Hierarchical CP: all-to-all over the inner group around a p2p ring over the outer."""

    @staticmethod
    def forward(ctx, q, k, v, groups, config):
        inner, ring = groups[0], _Ring(groups[1])
        _cp_flops(ctx, q, v, dist.get_world_size(inner) * ring.size)
        q2, k2, v2 = (_a2a(x, inner, True) for x in (q, k, v))
        out2, (kv, lse, *rngs) = _p2p_forward(q2, k2, v2, ring, config)
        out = _a2a(out2, inner, False)
        del out2
        # TE saves the output as returned and brings it back to the ring layout in backward.
        ctx.save_for_backward(q2, kv, out, lse, *rngs)
        ctx.inner, ctx.ring, ctx.kv_shapes = inner, ring, (k2.shape, v2.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        report_backward(ctx)
        q2, kv, out, lse, *_ = ctx.saved_tensors
        inner = ctx.inner
        out2 = _a2a(out, inner, True)
        dout2 = _a2a(dout.contiguous(), inner, True)
        dq2, dk2, dv2 = _p2p_backward(q2, kv, lse, dout2, ctx.ring, ctx.kv_shapes)
        del out2, dout2
        return (*(_a2a(x, inner, False) for x in (dq2, dk2, dv2)), None, None)


def context_parallel_attention(module, query, key, value):
    """TEDotProductAttention.forward under context parallelism: [L, b, h, d] -> [L, b, h d]."""
    flash = module.backend == "flash"
    q, k, v = (x.contiguous() for x in (query, key, value))  # FusedAttention under CP
    if flash:  # FlashAttention transposes to bshd first: a copy of each
        q, k, v = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v))
    kind = module.cp_comm_type
    if kind == "p2p":
        out = _P2PAttention.apply(q, k, v, _Ring(module.cp_group), module.config)
    elif kind == "all_gather":
        out = _AllGatherAttention.apply(q, k, v, _Ring(module.cp_group), module.config)
    elif kind == "a2a":
        out = _A2AAttention.apply(q, k, v, module.cp_group, module.config)
    elif kind == "a2a+p2p":
        out = _A2AP2PAttention.apply(q, k, v, module.cp_group, module.config)
    else:
        raise ValueError(f"unknown cp_comm_type {kind!r}")
    L, b, h, d = out.shape
    if flash:
        return out.reshape(L, b, h * d).clone()  # TE's contiguous sbhd copy: the second one
    return out.view(L, b, h * d)
