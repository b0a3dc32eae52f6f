"""Meta stand-ins for the kernels of megatron-core's flex token dispatcher (DeepEP, HybridEP).

megatron-core 0.16.1's MoEFlexTokenDispatcher (transformer/moe/token_dispatcher.py:1320) calls
`fused_dispatch` / `fused_combine` (DeepEP, transformer/moe/fused_a2a.py:209-243) or
`hybrid_ep_dispatch` / `hybrid_ep_combine` (HybridEP, fused_a2a.py:442-505) over the TP x EP
group (`tp_ep`), and reads the tokens per local expert on the host. These stand-ins allocate what
the kernels return and keep what the autograd functions keep, with the token counts of the
routing assumption, and issue one all-to-all over the group per kernel call so that the traffic
is recorded like any other collective.

What DeepEP moves (deep_ep 1.0.0, csrc/deep_ep.cpp): a token is sent once to every rank that
hosts one of its experts (deduplicated per rank, not per expert: `is_token_in_rank`
[tokens, ranks]); combine sends each rank's partial sums back and reduces them. The flex
dispatcher treats the TP x EP group as ranks of `num_local_experts` each: every TP replica of an
EP rank receives the token (token_dispatcher.py:1376-1402).

Token counts (balanced routing, `metatrace.config.routing`): every local expert receives its
balanced share N*k/E from every source rank (as models/moe.py); how often a token's k experts
share a rank is not fixed by that, and is taken as for k distinct experts drawn uniformly
(`rank_hit_probability`): a source sends ceil(N x p) tokens to each rank of the group.

Router padding for FP8 (moe_router_padding_for_quantization): DeepEP's path pads after the
dispatch, in megatron-core's own _DeepepManager._pad_routing_map (token_dispatcher.py:1251),
which reads the host counts these stand-ins return and runs pad_routing_map on the meta routing
map (no values needed): each local expert's rows round up to the alignment, the traffic does not
change. HybridEP pads whenever FP8 is on (megatron-core passes pad_multiple), with or without it.

Known limitations:
- one all-to-all over the whole group is recorded per call; inter-node DeepEP sends a token once
  per destination node over RDMA and forwards it over NVLink inside the node: the call is marked
  with the bytes that leave the node (FlexLayout.rdma_sent rows, from `node_hit_probability`),
  which the time model sends through the NIC (metatrace.analysis.comm.wire_seconds); the
  traffic tables count the whole message. HybridEP's dispatch and combine across NVLink domains
  (the cluster's: nvlink_domain) are marked the same way, once per other domain hosting one of
  a token's experts (FlexLayout.hybrid_across): its sources are not published (neither with
  megatron-core nor on PyPI), and its hierarchy is taken as DeepEP's. The probabilities
  HybridEP sends beside the tokens (the destination's local experts', fp32) stay a plain
  all-to-all of rank rows;
- the DeepEP / HybridEP communication buffers (deep_ep.Buffer's num_nvl_bytes and
  num_rdma_bytes, HybridEPBuffer) are allocated with cudaMalloc / NVSHMEM, outside PyTorch's
  allocator (deep_ep.cpp:45): not in the predicted peak, and not added to the verdict;
- HybridEP's handle (its routing metadata) is not modelled: its source is not in megatron-core.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from metatrace.config.routing import Routing
from metatrace.hooks import collectives
from metatrace.hooks import host as _host
from metatrace.models.moe import balanced_split, received_per_local_expert

NVL_PEERS = 8
"""GPUs one DeepEP NVLink domain spans (NUM_MAX_NVL_PEERS): above it the kernels go inter-node."""


def rank_hit_probability(
    experts: int, topk: int, ep: int, groups: int | None = None, group_topk: int | None = None
) -> float:
    """Probability that a token's topk experts include one of an EP rank's experts (experts/ep
    of them), the k experts drawn uniformly without repetition; with group-limited routing
    (`groups`, `group_topk`) from the experts of group_topk groups drawn uniformly, when a rank's
    experts lie in one group."""
    local = experts // ep
    pool, share = experts, 1.0
    if groups and group_topk and (experts // groups) % local == 0:
        pool, share = experts * group_topk // groups, group_topk / groups
    if topk > pool - local:
        return share
    return share * (1 - math.comb(pool - local, topk) / math.comb(pool, topk))


def node_hit_probability(experts: int, topk: int, ep: int, ranks_per_node: int) -> float:
    """As rank_hit_probability for a node of `ranks_per_node` EP ranks (DeepEP's RDMA dedup)."""
    return rank_hit_probability(experts, topk, max(ep // ranks_per_node, 1))


class FlexLayout:
    """Token counts of one flex dispatch on this rank, from the routing assumption."""

    def __init__(self, config, group, tokens: int):
        from megatron.core import parallel_state as ps

        self.ranks = group.size()
        self.rank = group.rank()
        self.tp = ps.get_expert_tensor_parallel_world_size()
        ep = self.ranks // self.tp
        experts, topk = config.num_moe_experts, config.moe_router_topk
        self.local_experts = experts // ep
        p = rank_hit_probability(
            experts, topk, ep, config.moe_router_num_groups, config.moe_router_group_topk
        )
        self.tokens = tokens
        self.per_peer = math.ceil(tokens * p)
        """Tokens one source sends to one rank of the group (and receives from it)."""
        ep_rank = self.rank // self.tp  # the tp_ep group is ordered TP-fastest
        first = ep_rank * self.local_experts
        sent = balanced_split(tokens * topk, experts)
        load = Routing.of(config).load(tokens, self.ranks, experts, topk)
        per_source = received_per_local_expert(
            load,
            sent,
            range(first, first + self.local_experts),
            alone=ep == 1,
        )
        self.per_expert = [n * self.ranks for n in per_source]
        """Tokens each local expert receives (one per token and expert, from every source)."""
        self.received = max(self.per_peer * self.ranks, max(self.per_expert, default=0))
        """Distinct tokens arriving (recv_x's rows)."""
        self.internode = self.ranks > NVL_PEERS
        self.rdma_ranks = max(self.ranks // NVL_PEERS, 1)
        p_node = node_hit_probability(experts, topk, ep, max(NVL_PEERS // self.tp, 1))
        self.rdma_received = self.rdma_ranks * math.ceil(tokens * p_node)
        self.rdma_sent = (self.rdma_ranks - 1) * math.ceil(tokens * p_node)
        """Rows a rank sends over RDMA (to the other nodes, once per node that hosts one of a
        token's experts; NVLink forwards it inside the node); the combine sends as many back."""
        self.hybrid_across = _hybrid_across(group, self.rank, self.tp, experts, topk, ep, tokens)
        """HybridEP's rows out of the rank's NVLink domain, None inside one (_hybrid_across)."""


def _hybrid_across(group, rank: int, tp: int, experts: int, topk: int, ep: int, tokens: int):
    """Rows a rank's HybridEP dispatch sends out of its NVLink domain (the cluster's: a node,
    or an NVL72 rack), once per other domain that hosts one of a token's experts, as DeepEP's
    internode kernels do per node (HybridEP's sources are not published with megatron-core or
    on PyPI: its hierarchy, RDMA between domains and NVLink inside them, is taken as DeepEP's);
    None when the group lies inside one domain."""
    domain = collectives.nvlink_domain()
    if not domain:
        return None
    ranks = dist.get_process_group_ranks(group)
    domains = {r // domain for r in ranks}
    if len(domains) < 2:
        return None
    home = ranks[rank] // domain
    near = sum(1 for r in ranks if r // domain == home)
    p_domain = node_hit_probability(experts, topk, ep, max(near // tp, 1))
    return (len(domains) - 1) * math.ceil(tokens * p_domain)


def _exchange(
    group,
    arrive: torch.Tensor,
    leave: torch.Tensor,
    rows_out: int,
    rows_in: int,
    across: int | None = None,
    library: str = "deepep",
):
    """One all-to-all carrying `rows_out` rows of `leave` to the group and `rows_in` rows of
    `arrive` from it, equal shares per peer; expanded views, so no memory is allocated; marked
    as `library`'s (its own buffers, no NCCL communicator's). `across`: the rows that leave the
    NVLink domain where the kernel forwards inside it (DeepEP's internode path: layout.rdma_sent;
    HybridEP's: layout.hybrid_across), marked with their bytes."""
    n = group.size()
    out = arrive.reshape(-1, arrive.shape[-1])[:1].expand(rows_in, arrive.shape[-1])
    inp = leave.reshape(-1, leave.shape[-1])[:1].expand(rows_out, leave.shape[-1])
    crossing = contextlib.nullcontext()
    if across is not None:
        crossing = collectives.crossing(across * leave.shape[-1] * leave.element_size())
    with crossing, collectives.by_library(library):
        dist.all_to_all_single(
            out, inp, balanced_split(rows_in, n), balanced_split(rows_out, n), group=group
        )


def _exchange_rows(group, arrive, leave, rows_out: int, rows_in: int, width: int):
    """As `_exchange` for rows of `width` elements of the tensors' dtype (views of their first
    element: no memory is allocated); HybridEP's."""
    n = group.size()
    out = arrive.reshape(-1)[:1].view(1, 1).expand(rows_in, width)
    inp = leave.reshape(-1)[:1].view(1, 1).expand(rows_out, width)
    with collectives.by_library("hybridep"):
        dist.all_to_all_single(
            out, inp, balanced_split(rows_in, n), balanced_split(rows_out, n), group=group
        )


def _rdma(layout) -> int | None:
    """DeepEP's rows out of the node (its internode kernels), None intranode."""
    return layout.rdma_sent if layout.internode else None


def _payload(group, x, idx, weights, rows_out, rows_in, layout):
    """The hidden states, then the top-k indices and weights beside them (DeepEP sends both
    with every token: intranode.cu dispatch's topk_idx / topk_weights buffers)."""
    _exchange(group, x, x, rows_out, rows_in, _rdma(layout))
    if idx is not None:
        _exchange(group, idx, idx, rows_out, rows_in, _rdma(layout))
        _exchange(group, weights, weights, rows_out, rows_in, _rdma(layout))


def _sms(num_sms: int) -> int:
    return num_sms // 2  # DeepEP runs num_sms / 2 channels (Config.num_sms, buffer.py:98)


class _Dispatch(torch.autograd.Function):
    """deep_ep.Buffer.get_dispatch_layout + dispatch (fused_a2a.FusedDispatch)."""

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, layout):
        n, w, k, dev = x.shape[0], layout.ranks, token_indices.shape[1], x.device
        i32 = dict(dtype=torch.int32, device=dev)
        # get_dispatch_layout (deep_ep.cpp:241-246); only is_token_in_rank outlives the call.
        per_rank = torch.empty((w,), **i32)  # num_tokens_per_rank
        per_rdma = torch.empty((layout.rdma_ranks,), **i32) if layout.internode else None
        per_expert = torch.empty((num_experts,), **i32)  # num_tokens_per_expert
        is_token_in_rank = torch.empty((n, w), dtype=torch.bool, device=dev)
        r, channels = layout.received, _sms(layout.num_sms)
        recv_x = torch.empty((r, x.shape[1]), dtype=x.dtype, device=dev)
        recv_idx = torch.empty((r, k), dtype=token_indices.dtype, device=dev)
        recv_weights = torch.empty((r, k), dtype=token_probs.dtype, device=dev)
        if not layout.internode:  # intranode_dispatch, deep_ep.cpp:395-450; buffer.py:310
            handle = (
                torch.empty((w, w), **i32),  # rank_prefix_matrix
                torch.empty((w, channels), **i32),  # channel_prefix_matrix
                torch.empty((w, channels), **i32),  # recv_channel_prefix_matrix
                torch.empty((r,), **i32),  # recv_src_idx
                is_token_in_rank,
                torch.empty((n, w), **i32),  # send_head
            )
        else:  # internode_dispatch, deep_ep.cpp:742-813; buffer.py:403
            rdma = layout.rdma_ranks
            handle = (
                is_token_in_rank,
                torch.empty((rdma, channels), **i32),  # rdma_channel_prefix_matrix
                torch.empty((w, channels), **i32),  # gbl_channel_prefix_matrix
                torch.empty((rdma, channels), **i32),  # recv_rdma_channel_prefix_matrix
                torch.empty((rdma,), **i32),  # recv_rdma_rank_prefix_sum
                torch.empty((w, channels), **i32),  # recv_gbl_channel_prefix_matrix
                torch.empty((w,), **i32),  # recv_gbl_rank_prefix_sum
                torch.empty((r, 8), dtype=torch.uint8, device=dev),  # recv_src_meta
                torch.empty((n, rdma), **i32),  # send_rdma_head
                torch.empty((layout.rdma_received, NVL_PEERS), **i32),  # send_nvl_head
            )
        sent = layout.per_peer * w
        _payload(group, x, token_indices, token_probs, sent, r, layout)
        # FusedDispatch keeps the handle on ctx (fused_a2a.py:130); saved here so that the
        # report lists it with the layer's activations (the same lifetime).
        ctx.save_for_backward(*handle)
        ctx.group, ctx.layout = group, layout
        tokens_per_expert = torch.tensor(layout.per_expert)  # on the host, fused_a2a.py:134
        # DeepEP's normal-mode dispatch without num_worst_tokens (megatron-core passes none)
        # busy-waits on the host for the received counts the GPU writes to mapped memory
        # (deep_ep.cpp intranode_dispatch / internode_dispatch, "Synchronize total received
        # tokens and tokens per expert"): the host waits for every kernel issued before.
        _host.sync()
        ctx.mark_non_differentiable(recv_idx, tokens_per_expert)
        del per_rank, per_rdma, per_expert  # FusedDispatch.forward's locals, freed on return
        return recv_x, recv_idx, recv_weights, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_x, grad_idx, grad_weights, grad_counts, *grad_handle):
        # buffer.combine of the gradients (fused_a2a.py:148-155): [n, h] and fp32 [n, k].
        handle, layout = ctx.saved_tensors, ctx.layout
        n = handle[0 if layout.internode else 4].shape[0]
        out = torch.empty((n, grad_x.shape[1]), dtype=grad_x.dtype, device=grad_x.device)
        weights = None
        if grad_weights is not None:
            weights = torch.empty(
                (n, grad_weights.shape[1]), dtype=torch.float32, device=out.device
            )
        back = layout.per_peer * layout.ranks
        _payload(ctx.group, grad_x, None, None, grad_x.shape[0], back, layout)
        if weights is not None:
            _exchange(ctx.group, weights, grad_weights, grad_x.shape[0], back, _rdma(layout))
        return out, None, weights, None, None, None


class _Combine(torch.autograd.Function):
    """deep_ep.Buffer.combine (fused_a2a.FusedCombine)."""

    @staticmethod
    def forward(ctx, x, group, handle, layout):
        n = handle[0 if layout.internode else 4].shape[0]
        combined = torch.empty((n, x.shape[1]), dtype=x.dtype, device=x.device)
        _exchange(group, combined, x, x.shape[0], layout.per_peer * layout.ranks, _rdma(layout))
        ctx.group, ctx.layout, ctx.n = group, layout, n
        return combined

    @staticmethod
    def backward(ctx, grad):
        # buffer.dispatch of the gradient with the cached handle (fused_a2a.py:197-203).
        layout = ctx.layout
        out = torch.empty((layout.received, grad.shape[1]), dtype=grad.dtype, device=grad.device)
        _exchange(
            ctx.group, out, grad, layout.per_peer * layout.ranks, layout.received, _rdma(layout)
        )
        return out, None, None, None


def _layout(group, tokens: int) -> FlexLayout:
    config = _CONFIG.get(id(group))
    if config is None:
        raise RuntimeError("flex dispatcher stand-in used outside a patched MoEFlexTokenDispatcher")
    layout = FlexLayout(config, group, tokens)
    layout.num_sms = config.moe_deepep_num_sms
    return layout


_CONFIG: dict[int, object] = {}
"""TransformerConfig of the flex dispatcher that last used a group (the kernels' own arguments
do not carry topk or the expert-tensor-parallel size); set by `remember`."""


def remember(dispatcher) -> None:
    _CONFIG[id(dispatcher.tp_ep_group)] = dispatcher.config


def fused_dispatch(
    x,
    token_indices,
    token_probs,
    num_experts,
    group,
    async_finish=False,
    allocate_on_comm_stream=False,
):
    """fused_a2a.fused_dispatch (DeepEP) on meta."""
    layout = _layout(group, x.shape[0])
    return _Dispatch.apply(x.contiguous(), token_indices, token_probs, num_experts, group, layout)


def fused_combine(x, group, handle, async_finish=False, allocate_on_comm_stream=False):
    """fused_a2a.fused_combine (DeepEP) on meta."""
    n = handle[0 if len(handle) == 10 else 4].shape[0]
    layout = _layout(group, n)
    return _Combine.apply(x, group, handle, layout), None


def set_deepep_num_sms(num_sms):
    """deep_ep.Buffer.set_num_sms: the kernels' SM count; read from the config by `_layout`."""


class _HybridDispatch(torch.autograd.Function):
    """HybridEPBuffer.dispatch_with_permute (fused_a2a.HybridEPDispatch): tokens arrive already
    permuted by local expert, with their probabilities ([P] fp32)."""

    @staticmethod
    def forward(ctx, x, routing_map, probs, group, layout, permuted):
        out = torch.empty((permuted, x.shape[1]), dtype=x.dtype, device=x.device)
        out_probs = torch.empty((permuted,), dtype=torch.float32, device=x.device)
        sent, received = layout.per_peer * layout.ranks, layout.received
        _exchange(group, out, x, sent, received, layout.hybrid_across, library="hybridep")
        # each token's probabilities for the destination's local experts (fp32) beside it
        _exchange_rows(group, out_probs, probs, sent, received, layout.local_experts)
        ctx.group, ctx.layout, ctx.n, ctx.probs_shape = group, layout, x.shape[0], probs.shape
        return out, out_probs

    @staticmethod
    def backward(ctx, grad, grad_probs):
        # combine_with_unpermute of the gradients (fused_a2a.py:367-372).
        out = torch.empty((ctx.n, grad.shape[1]), dtype=grad.dtype, device=grad.device)
        probs = torch.empty(ctx.probs_shape, dtype=torch.float32, device=grad.device)
        layout = ctx.layout
        sent, received = layout.received, layout.per_peer * layout.ranks
        _exchange(ctx.group, out, grad, sent, received, layout.hybrid_across, library="hybridep")
        if grad_probs is not None:
            _exchange_rows(ctx.group, probs, grad_probs, sent, received, layout.local_experts)
        return out, None, probs, None, None, None


class _HybridCombine(torch.autograd.Function):
    """HybridEPBuffer.combine_with_unpermute (fused_a2a.HybridEPCombine)."""

    @staticmethod
    def forward(ctx, x, group, layout, tokens):
        out = torch.empty((tokens, x.shape[1]), dtype=x.dtype, device=x.device)
        _exchange(
            group,
            out,
            x,
            layout.received,
            layout.per_peer * layout.ranks,
            layout.hybrid_across,
            library="hybridep",
        )
        ctx.group, ctx.layout, ctx.permuted = group, layout, x.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty((ctx.permuted, grad.shape[1]), dtype=grad.dtype, device=grad.device)
        _exchange(
            ctx.group,
            out,
            grad,
            ctx.layout.per_peer * ctx.layout.ranks,
            ctx.layout.received,
            ctx.layout.hybrid_across,
            library="hybridep",
        )
        return out, None, None, None


class HybridHandle:
    """What the stand-in passes from dispatch to combine in place of HybridEP's handle."""

    def __init__(self, group, layout, tokens: int):
        self.group, self.layout, self.tokens = group, layout, tokens


def _unfused(fused: bool) -> None:
    if fused:
        raise ValueError(
            "HybridEP with the permute fused into its kernels (moe_permute_fusion_into_hybridep) "
            "is not modelled"
        )


def hybrid_ep_dispatch(
    x,
    routing_map,
    probs,
    group,
    num_local_experts,
    num_sms_dispatch_api=24,
    num_sms_combine_api=24,
    num_permuted_tokens=None,
    pad_multiple=None,
    *,
    num_blocks_permute=None,
    num_blocks_unpermute=None,
    fused=False,
    num_sms_preprocessing_api=108,
):
    """fused_a2a.hybrid_ep_dispatch on meta: (tokens, probs, None, tokens per expert, handle).
    megatron-core 0.19 adds the kernels' block and SM counts (no memory) and `fused`, HybridEP's
    permute inside the dispatch kernel (moe_permute_fusion_into_hybridep), not modelled."""
    _unfused(fused)
    layout = _layout(group, x.shape[0])
    counts = list(layout.per_expert)
    if pad_multiple:  # each expert's rows padded for FP8 GEMMs
        counts = [-(-c // pad_multiple) * pad_multiple for c in counts]
    permuted = int(num_permuted_tokens) if num_permuted_tokens is not None else sum(counts)
    if num_permuted_tokens is None:
        # Without a bound on the permuted rows HybridEP waits on the host for the counts it
        # writes to pinned memory (fused_a2a.py:366-383, non_blocking=False): megatron-core's
        # dropless manager passes None on every forward (token_dispatcher.py:1070-1075 resets
        # it in combine).
        _host.sync()
    out, out_probs = _HybridDispatch.apply(x, routing_map, probs, group, layout, permuted)
    handle = HybridHandle(group, layout, x.shape[0])
    return out, out_probs, None, torch.tensor(counts), handle


def hybrid_ep_combine(x, handle, num_permuted_tokens, pad_multiple, fused=False):
    """fused_a2a.hybrid_ep_combine on meta: [tokens, hidden]."""
    _unfused(fused)
    return _HybridCombine.apply(x, handle.group, handle.layout, handle.tokens)


def indices_to_multihot(manager, indices, probs):
    """megatron-core's _DeepepManager._indices_to_multihot with the number of valid entries
    (`indices[mask]`, data-dependent) from the tokens per expert. Restates
    megatron.core.transformer.moe.token_dispatcher._DeepepManager._indices_to_multihot
    (token_dispatcher.py:1198-1226)."""
    from metatrace.hooks import meta_kernels

    batch = indices.shape[0]
    multihot_routing_map = torch.zeros(
        (batch, manager.num_local_experts), dtype=torch.long, device=indices.device
    )
    multihot_probs = torch.zeros(
        (batch, manager.num_local_experts), dtype=torch.float, device=indices.device
    )
    mask = indices != -1
    valid = int(manager.tokens_per_expert.sum())
    with meta_kernels.selecting(valid):
        valid_indices = indices.masked_select(mask)
        row_indices = torch.arange(batch, device=indices.device).repeat_interleave(
            mask.sum(dim=1), output_size=valid
        )
        multihot_routing_map[row_indices, valid_indices] = 1
        multihot_probs[row_indices, valid_indices] = probs.masked_select(mask)
    return multihot_routing_map.bool(), multihot_probs
