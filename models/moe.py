"""Token routing of mixture-of-experts layers on meta: token counts per expert, by assumption.

How many tokens each expert receives depends on the data (the router's choices), which meta
tensors do not have. megatron-core reads those counts on the host (`.tolist()`, `.cpu()`) to size
its all-to-alls, permutations and expert GEMMs, and `masked_select` sizes its output by the
routing map's values. metatrace supplies the counts from a stated assumption
(`training.moe_routing`):

- random (default, dropless routing): routing at the start of training
  (metatrace.config.routing). Every source rank routes its N tokens each to k distinct experts
  drawn uniformly (random router weights); per layer and micro-batch an expert's count from the
  S = tp x ep sources of the dispatcher's group is Binomial(S*N, k/E), and the hottest of the E
  experts gets L = E[max]/mean of its share (`Routing.load`, computed where the counts are made:
  N the routing map's rows, S the group's size; the all-gather dispatcher's rank routes the
  S*N gathered tokens itself). The binding rank is the one holding the hottest expert: what it
  holds is what a GPU must fit, and each rank is shown so, as below with hottest load L;
- balanced (dropless routing): every rank sends its N tokens x topk choices evenly over
  the E experts (N*k // E each, the remainder one more on the first experts); every expert gets
  the same share from every source rank. With `training.moe_hottest_expert_load` = L > 1 the
  first local expert of every rank receives ceil(L x its share) from every source, the others
  their share: each rank is shown in its worst case (globally this overcounts: the other
  ranks' experts do not lose what the hot one gains; without expert parallelism, every
  expert on the rank, they do: a source sends no more in all);
- capacity: megatron-core's own static path (moe_expert_capacity_factor with
  moe_pad_expert_input_to_capacity): every expert's input is padded to its capacity, no count
  depends on the data, and none of this module's substitutions are used.

With `training.moe_router_padding_for_quantization` (megatron-core's
moe_router_padding_for_quantization, alltoall dispatcher) every source rank pads its routing map
so that what it sends each expert is a multiple of the FP8 or FP4 GEMM alignment A (16, 32 for
MXFP8, 128 for FP4: megatron-core's get_align_size_for_quantization;
moe_utils.pad_routing_map turns the first zeros of the expert's column into ones, at most all N
of the rank's tokens). The counts above are rounded up per source and expert, after the hottest
expert's scaling: the hot expert gets round_up(ceil(L x share), A) from every source, the
others round_up(share, A). The padding rows are sent in the all-to-alls like routed tokens. The
flex dispatcher pads on the receiving side (megatron-core's _DeepepManager._pad_routing_map runs
as it is on the counts of metatrace.models.deepep), after the traffic. pad_routing_map itself
runs unpatched: on meta its cumsum and boolean index_put_ need no values and allocate what they
do on a GPU, less the [masked, 2] int64 index list a CUDA index_put_ builds from the mask (a
few KB, not modelled); on real tensors it pads the balanced map, which
tests/tracing/test_moe_router_padding.py compares with the meta trace.

`metatrace.hooks.patches` puts these into megatron-core's dispatchers (the version-specific
part); this module holds the arithmetic. `masked_select` is sized by metatrace.hooks.meta_kernels.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from metatrace.config.routing import Routing
from metatrace.hooks import flops
from metatrace.models.te_runtime import te_installed


def balanced_split(total: int, parts: int) -> list[int]:
    """`total` spread over `parts` as evenly as integers allow (the first ones get the rest)."""
    base, rest = divmod(total, parts)
    return [base + (1 if i < rest else 0) for i in range(parts)]


def received_per_local_expert(
    load: float, sent: list[int], local: range, *, alone: bool = False
) -> list[int]:
    """Tokens one source rank sends to each of this rank's local experts: its balanced share
    `sent[e]`, the first local expert scaled by the hottest expert's `load` (rounded up).
    `alone`: every expert is on this rank (no expert parallelism), so what the hottest expert
    gains from a source the others lose: the source sends no more in all."""
    out = [sent[e] for e in local]
    if load != 1.0 and out:
        total = sum(out)
        out[0] = math.ceil(out[0] * load)
        if alone:
            out[0] = min(out[0], total)
            out[1:] = balanced_split(total - out[0], len(out) - 1)
    return out


def balanced_routing_map(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """On real tensors (the CPU check of a meta trace): the router's choices replaced by the
    balanced assumption, token i going to experts (i·k + j) mod E for j < k, so that the real
    run routes as the meta trace assumes (a new tensor: the router may have saved its map for
    backward). Meta tensors hold no choices to replace: `routing_map` itself."""
    if routing_map.device.type == "meta":
        return routing_map
    tokens, experts = routing_map.shape
    choice = (torch.arange(tokens).unsqueeze(1) * topk + torch.arange(topk)) % experts
    balanced = torch.zeros(tokens, experts, dtype=torch.bool)
    balanced.scatter_(1, choice, True)
    return balanced.to(routing_map.device)


def route_local_as_assumed(local_map: torch.Tensor, counts: list[int]) -> None:
    """On real tensors (the CPU check of a meta trace): overwrite the all-gather dispatcher's
    map of the gathered tokens to its local experts so that local expert j gets counts[j] of
    them, the routing assumption's counts (`allgather_local_counts`), which the random
    policy's hottest expert makes uneven. Rows are taken consecutively from where the previous
    expert's stopped, wrapping around, so no token goes to one expert twice. Meta tensors hold
    no choices to overwrite."""
    if local_map.device.type == "meta":
        return
    tokens = local_map.size(0)
    assumed = torch.zeros(local_map.shape, dtype=torch.bool)
    start = 0
    for j, count in enumerate(counts):
        assumed[(start + torch.arange(min(count, tokens))) % tokens, j] = True
        start += count
    local_map.copy_(assumed.to(local_map.device))


def padded(count: int, align: int, tokens: int) -> int:
    """What moe_utils.pad_routing_map makes of `count` tokens of one expert in a map of
    `tokens` rows: the next multiple of `align`, or every row when there are not that many
    (only zeros are turned into ones)."""
    return min(-(-count // align) * align, max(count, tokens))


def alltoall_preprocess(dispatcher, routing_map: torch.Tensor) -> torch.Tensor:
    """megatron-core's MoEAlltoAllTokenDispatcher.preprocess for dropless routing, with the
    token counts of `Routing` on the host where megatron-core has them after its device-to-host
    copies; with moe_router_padding_for_quantization every source rank's count per expert is
    padded (`padded`), and num_out_tokens is their sum as megatron-core's
    num_local_tokens_per_expert.sum() is. Allocations and the all-gather of the counts over the
    TP x EP group stay as in megatron-core (their values are not read). Restates
    megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher.preprocess
    (source sha256: 3d97a9f12969)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    d = dispatcher
    routing = Routing.of(d.config)
    tokens, experts, topk = routing_map.size(0), d.num_experts, d.config.moe_router_topk
    num_local_tokens_per_expert = routing_map.sum(dim=0).long()
    sent = balanced_split(tokens * topk, experts)  # what every source rank sends per expert
    local = range(d.local_expert_indices[0], d.local_expert_indices[-1] + 1)
    sources = d.tp_size * d.ep_size
    load = routing.load(tokens, sources, experts, topk)
    per_source = received_per_local_expert(load, sent, local, alone=d.ep_size == 1)
    if d.ep_size == 1:  # every source sends this rank's experts what they receive
        sent = list(per_source)
    if d.config.moe_router_padding_for_quantization:
        from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

        align = get_align_size_for_quantization(d.config)
        sent = [padded(n, align, tokens) for n in sent]
        per_source = [padded(n, align, tokens) for n in per_source]
    d.num_out_tokens = sum(sent)  # tokens * topk unpadded
    # Where the host waits for the counts' device-to-host copies (cuda_sync_point, the earliest
    # point that needs them; the time model's synchronisation): as megatron-core decides it.
    if d.config.moe_expert_capacity_factor is not None or (
        d.config.moe_router_padding_for_quantization
    ):
        d._maybe_update_cuda_sync_point("before_permutation_1")  # the output size is dynamic
    d._maybe_update_cuda_sync_point(
        "before_ep_alltoall" if d.ep_size > 1 or d.tp_size > 1 else "before_finish"
    )
    if d.num_local_experts > 1 and not d.config.moe_permute_fusion:
        d._maybe_update_cuda_sync_point("before_permutation_2")
    if d.ep_size > 1 or d.tp_size > 1:
        gather_from_sequence_parallel_region(num_local_tokens_per_expert, group=d.tp_ep_group)
        d.input_splits = np.array(
            [
                sum(sent[r * d.num_local_experts : (r + 1) * d.num_local_experts])
                for r in range(d.ep_size)
            ],
            dtype=np.int64,
        )
        d.output_splits = np.full(d.ep_size, sum(per_source), dtype=np.int64)
        d.output_splits_tp = np.full(d.tp_size, d.ep_size * sum(per_source), dtype=np.int64)
    global_per_local = torch.tensor([per_source] * sources, dtype=torch.long)  # [tp*ep, local]
    if d.num_local_experts > 1:
        d.num_global_tokens_per_local_expert = global_per_local
    return global_per_local.sum(dim=0)


def allgather_local_counts(dispatcher, global_tokens: int) -> torch.Tensor:
    """Tokens each local expert of the all-gather dispatcher processes: its share of the
    gathered tokens x topk."""
    d = dispatcher
    routing = Routing.of(d.config)
    sent = balanced_split(global_tokens * d.router_topk, d.config.num_moe_experts)
    local = range(d.local_expert_indices[0], d.local_expert_indices[-1] + 1)
    alone = d.ep_size == 1
    # every rank routes the gathered tokens of the whole group: one source of them all
    load = routing.load(global_tokens, 1, d.config.num_moe_experts, d.router_topk)
    counts = received_per_local_expert(load, sent, local, alone=alone)
    return torch.tensor(counts, dtype=torch.long)


def te_general_gemm(A, B, out_dtype, layout="TN", bias=None, grad=False, **kwargs):
    """Transformer Engine's general_gemm as megatron-core's router calls it
    (moe_utils.RouterGatingLinearFunction): the product in `out_dtype` straight from the GEMM
    (the bias in its epilogue), no cast copies of the operands. layout "TN": B @ A^T,
    "NN": B @ A, "NT": B^T @ A. Where the simulated run has no Transformer Engine, the
    torch.mm path megatron-core then takes, with its casts."""
    if not te_installed():
        if layout == "TN":
            x, w = B.to(out_dtype), A.to(out_dtype).t()
            out = torch.mm(x, w) if bias is None else torch.addmm(bias.to(out_dtype), x, w)
        else:
            out = torch.mm(B, A) if layout == "NN" else torch.mm(B.t(), A)
        return (out,)
    rows = B.shape[-1] if layout == "NT" else B.shape[0]
    cols = A.shape[0] if layout == "TN" else A.shape[-1]
    inner = B.shape[0] if layout == "NT" else B.shape[-1]
    flops.report_gemm(rows, inner, cols)
    return (torch.empty((rows, cols), dtype=out_dtype, device=B.device),)


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    """megatron-core's Sinkhorn normalisation with one iteration: its loop runs until the
    values converge, which meta tensors cannot tell; every iteration allocates the same
    temporaries, and only the result leaves the function. Restates
    megatron.core.transformer.moe.moe_utils.sinkhorn (source sha256: 47691087d4c7)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps = 0.00000001
    d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
    d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
    return d1 * cost * d0.unsqueeze(1)
