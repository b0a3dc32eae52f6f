"""Stand-in for megatron-core's TEDotProductAttention over Transformer Engine 2.8's attention.

The backend is `config.attention_backend` (megatron-core's enum, resolved by metatrace from
`implementation.attention_backend`): fused (cuDNN), flash (flash-attn 2 through TE) or unfused.
What each keeps and allocates, from TE 2.8's attention/dot_product_attention/{backends,utils}.py
and flash-attn 2.8.3's flash_attn_interface.py (sbhd layout, no packed sequences):

- TE's get_qkv_layout first keeps q/k/v when they are views of one buffer in a layout it knows
  (megatron's split of the fused QKV projection for multi-head attention without RoPE gives
  "sbh3d"); otherwise it makes each contiguous (a copy of v after RoPE, of k and v for GQA).
- fused: saves q, k, v as they arrive, the new output [s, b, h, d], fp32 softmax statistics
  [b, h, s, 1], an int64 rng state [2] and two cached int32 cu_seqlens [b + 1]; no dropout mask
  (philox is replayed in backward); returns a view of its output, so linear_proj's saved input
  shares it. Backward allocates dq, dk, dv (one [s, b, h, 3, d] buffer for sbh3d).
- flash: bshd contiguous copies of q, k, v (one [3, b, s, h, d] buffer when head dim is 128,
  s x b >= 512 and the layout is sbh3d), head dims padded to a multiple of 8; flash-attn saves
  them, out_padded [b, s, h, d], fp32 lse [b, h, s] and rng [2]; TE returns a new contiguous sbhd
  copy of the output, so the output is held twice. Backward allocates dq, dk, dv, and for the
  kernel's duration softmax_d fp32 [b, h, round128(s)], dq_accum fp32 [b, round128(s), h,
  round32(d)] and, with GQA, dk/dv expanded to all query heads.
- unfused: TE's UnfusedDotProductAttention in torch operators (mask, repeat_interleave for GQA,
  baddbmm into a preallocated buffer, fused masked softmax saving the probabilities when its
  kernel applies, else fp32 probabilities and the mask, dropout keeping a bool mask, bmm,
  permute + contiguous of the context).

Context parallelism is in metatrace.models.te_cp.

Sliding windows (megatron-core's window_size on the layers is_layer_window_attention picks)
change what fused and flash attention compute (their FLOPs: about s x w per head instead of
s^2 / 2), not what they keep. Softmax sinks (softmax_type off-by-one / learnable, GPT-OSS):
one offset per local head (a parameter when learnable); fused attention saves it as fp32
[1, h, 1, 1] with its aux tensors and its backward allocates an fp32 gradient of that shape;
unfused attention appends it as a last score column ([b, h, sq, sk + 1] and a padded mask).

Known limitations: cuDNN's and flash-attn's own workspaces (sizes decided in C++ that is not in
the sources) are not modelled; outputs hold zeros, not attention values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from metatrace.hooks import flops
from metatrace.models.te_attention_kernel import cu_seqlens, report_backward, sbhd_flops
from metatrace.models.te_cp import context_parallel_attention
from metatrace.models.te_cpu_offload import mark_if_offloading


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def is_sbh3d(q, k, v) -> bool:
    """q, k, v are views [s, b, h, d] of one [s, b, h, 3, d] buffer (TE's sbh3d layout)."""
    if not (_storage(q) == _storage(k) == _storage(v)):
        return False
    if not (q.shape == k.shape == v.shape and q.stride() == k.stride() == v.stride()):
        return False
    d = q.shape[-1]
    return (
        q.stride(-1) == 1
        and q.stride(2) == 3 * d
        and k.storage_offset() == q.storage_offset() + d
        and v.storage_offset() == q.storage_offset() + 2 * d
    )


def qkv_layout(q, k, v):
    """TE's get_qkv_layout: keep a known layout, else make q, k, v contiguous."""
    if is_sbh3d(q, k, v):
        return q, k, v, "sbh3d"
    return q.contiguous(), k.contiguous(), v.contiguous(), "sbhd_sbhd_sbhd"


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, config, layout, causal=True, window=None, offset=None):
        sbhd_flops(ctx, q.shape, v.shape, causal, window)
        s, b, h, _ = q.shape
        out = flops.unpriced(torch.zeros, (s, b, h, v.shape[-1]), dtype=q.dtype, device=q.device)
        stats = torch.empty((b, h, s, 1), dtype=torch.float32, device=q.device)
        rng = torch.empty(2, dtype=torch.int64, device=q.device)
        cu = cu_seqlens(config, b, s, q.device)
        cu_kv = cu_seqlens(config, b, k.shape[0], q.device)
        # Softmax sinks: the fp32 offsets [1, h, 1, 1] are the last of the aux tensors TE saves
        # (csrc/extensions/attention.cpp, fused_attn_fwd: S, rng_state, SoftmaxOffset).
        aux = (stats, rng) if offset is None else (stats, rng, offset)
        mark_if_offloading(q, k, v, out, *aux)  # TE's FusedAttnFunc under cpu_offloading
        ctx.save_for_backward(q, k, v, out, cu, cu_kv, *aux)
        ctx.layout, ctx.sink = layout, offset is not None
        return out.view(s, b, h * v.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        report_backward(ctx)
        # Read once, as TE's FusedAttnFunc.backward does: megatron-core's fine-grained
        # offloading hands each saved tensor back once (a second read finds it gone).
        q, k, v, out, *aux = ctx.saved_tensors
        if ctx.layout == "sbh3d":
            s, b, h, d = q.shape
            buf = torch.empty((s, b, h, 3, d), dtype=q.dtype, device=q.device)
            dq, dk, dv = buf.select(3, 0), buf.select(3, 1), buf.select(3, 2)
        else:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # fused_attn_bwd allocates dSoftmaxOffset fp32 [1, h, 1, 1] for softmax sinks.
        d_offset = torch.empty_like(aux[-1]) if ctx.sink else None
        return dq, dk, dv, None, None, None, None, d_offset


class _FlashAttnFunc(torch.autograd.Function):
    """flash-attn 2's FlashAttnFunc on bshd inputs."""

    @staticmethod
    def forward(ctx, q, k, v, head_dim, causal=True, window=None):
        b, s, h, d_pad = q.shape
        # FLOPs of the unpadded head dimension (the padding to a multiple of 8 is the kernel's).
        shape_q, shape_v = (s, b, h, head_dim), (k.shape[1], b, k.shape[2], head_dim)
        sbhd_flops(ctx, shape_q, shape_v, causal, window)
        out_padded = flops.unpriced(torch.zeros, (b, s, h, d_pad), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
        rng = torch.empty(2, dtype=torch.int64, device=q.device)
        ctx.save_for_backward(q, k, v, out_padded, lse, rng)
        ctx.head_dim = head_dim
        return out_padded[..., :head_dim]

    @staticmethod
    def backward(ctx, grad):
        report_backward(ctx)
        q, k, v, *_ = ctx.saved_tensors
        b, s, h, d = q.shape
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # Kernel temporaries (flash_api.cpp mha_bwd): softmax_d, dq_accum, GQA expansions.
        scratch = [
            torch.empty((b, h, _round(s, 128)), dtype=torch.float32, device=q.device),
            torch.empty(
                (b, _round(s, 128), h, _round(d, 32)), dtype=torch.float32, device=q.device
            ),
        ]
        if k.shape[2] != h:
            for _ in range(2):  # dk_expanded, dv_expanded
                scratch.append(torch.empty((b, k.shape[1], h, d), dtype=q.dtype, device=q.device))
        del scratch
        d = ctx.head_dim
        return dq[..., :d], dk[..., :d], dv[..., :d], None, None, None


def _round(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def flash_attention(q, k, v, layout, causal=True, window=None):
    """TE's FlashAttention on sbhd q/k/v: bshd copies in, a contiguous sbhd copy out."""
    s, b, h, d = q.shape
    if layout == "sbh3d" and d == 128 and s * b >= 512:
        qkv = torch.empty((3, b, s, h, d), dtype=q.dtype, device=q.device)  # fa_prepare_fwd
        for i, x in enumerate((q, k, v)):
            qkv[i].copy_(x.transpose(0, 1))
        qb, kb, vb = qkv[0], qkv[1], qkv[2]
    else:
        qb, kb, vb = (x.transpose(0, 1).contiguous() for x in (q, k, v))
    mark_if_offloading(qb, kb, vb)  # TE's FlashAttention under cpu_offloading
    if d % 8:
        qb, kb, vb = (F.pad(x, (0, 8 - d % 8)) for x in (qb, kb, vb))
    out = _FlashAttnFunc.apply(qb, kb, vb, d, causal, window)  # [b, s, h, d]
    return out.reshape(b, s, -1).transpose(0, 1).contiguous()  # [s, b, h * d], a second copy


class _MaskedSoftmax(torch.autograd.Function):
    """TE's ScaledMaskedSoftmax kernel (softmax.py): saves the probabilities, backward in place."""

    @staticmethod
    def forward(ctx, scores, mask, scale):
        from metatrace.models.standins import FusedSoftmaxKernels

        probs = FusedSoftmaxKernels.masked_forward(scores, mask, scale)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, grad):
        from metatrace.models.standins import FusedSoftmaxKernels

        (probs,) = ctx.saved_tensors
        return FusedSoftmaxKernels.backward(grad.contiguous(), probs, ctx.scale), None, None


def _fused_softmax_applies(b, np_, sq, sk, dtype) -> bool:
    """TE softmax.py is_kernel_available for a mask tensor."""
    from metatrace.models.standins import FusedSoftmaxKernels

    if dtype not in (torch.float16, torch.bfloat16):
        return False
    if not (16 < sk < 16384 and sk % 8 == 0 and sq > 1 and sq % 4 == 0 and (b * np_) % 4 == 0):
        return False
    return sq % FusedSoftmaxKernels.get_batch_per_block(sq, sk, b, np_) == 0


def unfused_attention(q, k, v, scale: float, dropout: float, training: bool, offset=None):
    """TE's UnfusedDotProductAttention for sbhd, causal, no bias; `offset`: softmax sinks
    [1, np, 1, 1] (a sliding window changes the mask's values, not its shape)."""
    sq, b, np_, hn = q.shape
    sk, ng = k.shape[0], k.shape[2]
    # get_full_mask: arange difference and the boolean causal mask [1, 1, sq, sk].
    diff = torch.arange(sk, dtype=torch.int32, device=q.device).view(1, 1, 1, sk) - torch.arange(
        sq, dtype=torch.int32, device=q.device
    ).view(1, 1, sq, 1)
    mask = diff > (sk - sq)
    del diff
    if ng != np_:
        k = k.repeat_interleave(np_ // ng, dim=2)
        v = v.repeat_interleave(np_ // ng, dim=2)
    q2 = q.reshape(sq, b * np_, hn).transpose(0, 1)
    k2 = k.reshape(sk, b * np_, hn).transpose(0, 1)
    buffer = torch.empty((b * np_, sq, sk), dtype=q.dtype, device=q.device)
    scores = torch.baddbmm(buffer, q2, k2.transpose(1, 2), beta=0.0, alpha=scale)
    del buffer
    scores = scores.view(b, np_, sq, sk)
    kv = sk
    if offset is not None:
        # backends.py: the sink as a last column of the scores [b, np, sq, sk + 1], the mask
        # padded with it; the probabilities' last column dropped again (a view).
        sink = offset.to(dtype=scores.dtype).expand(b, -1, sq, -1)
        scores = torch.cat([scores, sink], dim=-1)
        mask = F.pad(mask, (0, 1), mode="constant", value=False)
        kv = sk + 1
    if _fused_softmax_applies(b, np_, sq, kv, q.dtype):
        probs = _MaskedSoftmax.apply(scores, mask, 1.0)
    else:
        probs = torch.softmax(scores.float().masked_fill_(mask, -10000.0), dim=-1).to(q.dtype)
    if offset is not None:
        probs = probs[..., :-1]
    if training and dropout > 0:
        probs = F.dropout(probs, p=dropout, training=True)
    hv = v.shape[-1]  # the value head dimension (MLA: v_head_dim, not the query's)
    v2 = v.reshape(sk, b * np_, hv).transpose(0, 1)
    context = torch.bmm(probs.reshape(b * np_, sq, sk), v2)  # [b*np, sq, hv]
    context = context.view(b, np_, sq, hv).permute(2, 0, 1, 3).contiguous()
    return context.view(sq, b, np_ * hv)


class TEDotProductAttention(torch.nn.Module):
    """megatron-core's TEDotProductAttention: no parameters; forward(q, k, v, mask, ...) on sbhd
    tensors [s, b, heads, head_dim] returns [s, b, heads * head_dim]."""

    cp_stream = None

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        k_channels=None,
        v_channels=None,
        num_splits=None,
        cp_comm_type="p2p",
        pg_collection=None,
    ):
        super().__init__()
        from megatron.core import parallel_state as ps

        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type.name
        self.attention_type = attention_type
        self.qkv_format = "sbhd"
        self.backend = config.attention_backend.name
        self.attention_dropout = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        kv = config.kv_channels if k_channels is None else k_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv)
        self.num_attention_heads = config.num_attention_heads
        self.num_gqa_groups = config.num_query_groups
        self.cp_comm_type = cp_comm_type or "p2p"
        self.cp_size = config.context_parallel_size
        self._attention_variants(config, layer_number)
        self.cp_group = None
        if self.cp_size > 1:
            if self.cp_comm_type == "a2a+p2p":
                self.cp_group = ps.get_hierarchical_context_parallel_groups()
            else:
                self.cp_group = (
                    pg_collection.cp
                    if pg_collection is not None
                    else ps.get_context_parallel_group()
                )

    def _attention_variants(self, config, layer_number) -> None:
        """Sliding window and softmax sinks, as megatron-core's TEDotProductAttention passes them
        to TE 2.8's DotProductAttention (window_size on the layers is_layer_window_attention
        picks; softmax_type)."""
        from megatron.core.transformer.utils import is_layer_window_attention

        window = None
        if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        ):
            window = config.window_size[0] if config.window_size[0] >= 0 else None
        self.window = window  # the left size of a causal window (TE makes (w, x) (w, 0))
        self.softmax_type = config.softmax_type
        heads = self.num_attention_heads // config.tensor_model_parallel_size
        device = torch.cuda.current_device()
        if self.softmax_type == "learnable":
            # DotProductAttention.__init__: fp32 on the GPU (Float16Module casts it to bf16);
            # one logit per local head, sharded over TP with the heads.
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, device=device))
        elif self.softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(heads, device=device)  # a plain fp32 attribute
        else:
            self.softmax_offset = None

    def _offset(self):
        """DotProductAttention.forward: softmax_offset.reshape(1, -1, 1, 1).to(torch.float32)."""
        if self.softmax_offset is None:
            return None
        return self.softmax_offset.reshape(1, -1, 1, 1).to(torch.float32)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        num_splits=None,
    ):
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences (thd) are not modelled")
        if self.cp_size > 1:
            return context_parallel_attention(self, query, key, value)
        offset = self._offset()
        if self.backend == "unfused":
            dropout = self.attention_dropout
            return unfused_attention(
                query, key, value, self.softmax_scale, dropout, self.training, offset
            )
        q, k, v, layout = qkv_layout(query, key, value)
        causal = "causal" in getattr(attn_mask_type, "name", self.attn_mask_type)
        window = self.window if causal else None
        if self.backend == "flash":
            if offset is not None:
                raise NotImplementedError("TE 2.8 has no flash attention with softmax sinks")
            return flash_attention(q, k, v, layout, causal, window)
        return _FusedAttention.apply(q, k, v, self.config, layout, causal, window, offset)
