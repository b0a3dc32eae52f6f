"""Every patch of megatron-core (and of its surroundings) metatrace needs, in one place.

- PATCHES: attributes of megatron-core replaced by stand-ins, each with the megatron-core releases
  that need it (guards.EVERY_RELEASE, RELEASE_0_16: only 0.16.1, RELEASE_0_19: only 0.19) and
  why; the originals are kept (`_orig`) and put back;
- the CUDA extensions megatron-core imports by name, torch.compile switched off, Meta kernels for
  the coalesced c10d operators, and the NVTE_*_ATTN variables megatron-core writes.

`megatron_patches()` applies them all and restores everything on exit, also on error. On entry it
checks the installed megatron-core: a release outside MEGATRON_CORE is refused (ConfigError), a
patch whose `versions` exclude the installed release is not applied, and a target that does not
exist is an error naming the patch (PatchError), unless the patch declares that it `creates` it.
hooks/training.py has the patches applied around a training iteration.

Measured with megatron-core 0.16.1 and 0.19.2 and torch 2.13.0
(../shared/notes/megatron-on-meta.md; docs/megatron-core-releases.md).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from metatrace.hooks import guards, meta_kernels
from metatrace.hooks import host as _host
from metatrace.hooks.guards import (
    EVERY_RELEASE,
    RELEASE_0_16,
    RELEASE_0_19,
    PatchError,
    Versions,
    check_megatron_core,
    installed_release,
)
from metatrace.world import orthogonal_array


@dataclass(frozen=True)
class Patch:
    module: str
    target: str
    """Attribute path inside the module, e.g. "CudaRNGStatesTracker.fork"."""
    make: Callable[[Any], Any]
    """Builds the replacement from the original."""
    versions: Versions
    """The megatron-core releases that need it; on others it is not applied."""
    why: str
    creates: bool = False
    """The target may not exist (megatron-core binds it only when Transformer Engine or Apex
    imports; `why` says so): the patch then creates it and deletes it on exit. Any other missing
    target is a PatchError."""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.target}"


def _null_fork(orig):
    """fork's check of the name, without the CUDA state swap. Restates
    megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork (source sha256: a9e307b04fe7).
    """

    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        return contextlib.nullcontext()

    return fork


def _fixed_checkpoint_init(orig):
    def __init__(self, fp8=False):
        orig(self, fp8=fp8)
        self.fp8 = bool(fp8)

    return __init__


def _rng_state(orig):
    return lambda *args, **kwargs: torch.zeros(16, dtype=torch.uint8)


def _no_op(orig):
    return lambda *args, **kwargs: None


def _true(orig):
    return True


def _standin_factory(module: str, name: str):
    """A patch's `make` from `module.name(orig)`, imported when the patch is applied."""

    def make(orig):
        return getattr(importlib.import_module(module), name)(orig)

    return make


def _standin(module: str, name: str):
    """A replacement that is metatrace's stand-in `name` from `module`, whatever the original."""

    def make(orig):
        return getattr(importlib.import_module(module), name)

    return make


PATCHES = (
    Patch(
        "megatron.core.tensor_parallel.random",
        "CudaRNGStatesTracker.fork",
        _null_fork,
        EVERY_RELEASE,
        "fork swaps the CUDA generator's state (torch.cuda.default_generators), which does not "
        "exist without CUDA; random numbers do not matter on meta.",
    ),
    Patch(
        "megatron.core.tensor_parallel.random",
        "_get_cuda_rng_state",
        _rng_state,
        EVERY_RELEASE,
        "activation checkpointing saves the CUDA RNG state before a checkpointed forward.",
    ),
    Patch(
        "megatron.core.tensor_parallel.random",
        "_set_cuda_rng_state",
        _no_op,
        EVERY_RELEASE,
        "activation checkpointing restores the CUDA RNG state before recomputing.",
    ),
    Patch(
        "megatron.core.tensor_parallel.random",
        "CheckpointWithoutOutput.__init__",
        _fixed_checkpoint_init,
        EVERY_RELEASE,
        "bug: `self.fp8 = fp8 is not None` is True for fp8=False, which then reaches Transformer "
        "Engine's FP8GlobalStateManager (a NameError without TE); force bool(fp8).",
    ),
    Patch(
        "megatron.core.models.common.embeddings.rope_utils",
        "fused_apply_rotary_pos_emb",
        _standin("metatrace.models.fusions", "fused_apply_rotary_pos_emb"),
        EVERY_RELEASE,
        "bound from Transformer Engine at import (None without it); RoPE fusion, on by default "
        "in Megatron-LM, calls it.",
    ),
    Patch(
        "megatron.core.models.common.language_module.language_module",
        "te_parallel_cross_entropy",
        _standin("metatrace.models.fusions", "te_parallel_cross_entropy"),
        EVERY_RELEASE,
        "bound from Transformer Engine at import (None without it); used with "
        "cross_entropy_fusion_impl='te'.",
    ),
    Patch(
        "megatron.core.extensions.transformer_engine",
        "TEFusedMLP",
        _standin("metatrace.models.te_fused_mlp", "TEFusedMLP"),
        EVERY_RELEASE,
        "TransformerLayer imports TEFusedMLP from here to hand the MLP its tp_group; without TE "
        "it is None, and the op fuser's stand-in is an 'Unknown MLP type' (a warning per layer).",
    ),
)

# Optimizers (models/te_optim.py): megatron-core takes FusedAdam/FusedSGD and the multi-tensor
# kernels from Transformer Engine (else Apex) at import; without them it falls back to torch.optim
# and to Python loops whose temporaries the CUDA kernels do not allocate. FUSED_OPTIMIZER_PATCHES
# stand in for TE's (Apex's keep the same states and allocate the same); a job whose run has
# neither (training.optimizer_impl: torch) keeps megatron-core's fallback, with
# TORCH_OPTIMIZER_PATCHES.
FUSED_OPTIMIZER_PATCHES: tuple[Patch, ...] = (
    Patch(
        "megatron.core.optimizer",
        "Adam",
        _standin("metatrace.models.te_optim", "FusedAdam"),
        EVERY_RELEASE,
        "bound at import to TE's FusedAdam on a GPU; torch's AdamW keeps the same states but its "
        "step allocates temporaries the fused kernel does not.",
    ),
    Patch(
        "megatron.core.optimizer.distrib_optimizer",
        "Adam",
        _standin("metatrace.models.te_optim", "FusedAdam"),
        EVERY_RELEASE,
        "bound at import like megatron.core.optimizer.Adam; the distributed optimizer asserts "
        "that its optimizer is one.",
    ),
    Patch(
        "megatron.core.optimizer",
        "SGD",
        _standin("metatrace.models.te_optim", "FusedSGD"),
        EVERY_RELEASE,
        "bound at import to TE's FusedSGD on a GPU.",
    ),
    Patch(
        "megatron.core.optimizer",
        "USING_PYTORCH_OPTIMIZER",
        lambda orig: False,
        EVERY_RELEASE,
        "True after the torch.optim fallback; it switches the Adam class and its arguments.",
    ),
    Patch(
        "megatron.core.optimizer.optimizer_config",
        "is_te_min_version",
        lambda orig: _te_min_version(orig),
        EVERY_RELEASE,
        "OptimizerConfig.__post_init__ compares Transformer Engine's release with 2.1 for the "
        "precision-aware optimizer (store_param_remainders); without TE the release is None and "
        "the comparison a TypeError. The stand-ins restate TE_RELEASE.",
    ),
    Patch(
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBuffer.__init__",
        lambda orig: _nominal_fp8_grad_dtype(orig),
        EVERY_RELEASE,
        "DistributedDataParallel gives a parameter's gradients its dtype (without "
        "grad_reduce_in_fp32); TE's FP8 parameters (fp8_param_gather) report their nominal "
        "dtype, bf16, while the stand-ins' are float8_e4m3fn tensors: 2 bytes a gradient, not 1.",
    ),
    Patch(
        "megatron.core.transformer.transformer_config",
        "is_te_min_version",
        lambda orig: _te_min_version(orig),
        EVERY_RELEASE,
        "TransformerConfig.__post_init__ compares Transformer Engine's release for MoE FP8 "
        "(1.7), FP8 grouped GEMMs (1.11) and moe_act / layernorm recompute under FP8 (2.6): "
        "a TypeError without TE (as optimizer_config's check above).",
    ),
    Patch(
        "megatron.core.optimizer",
        "is_te_min_version",
        lambda orig: _te_min_version(orig),
        EVERY_RELEASE,
        "get_megatron_optimizer passes the precision-aware arguments to FusedAdam from TE 2.1 on "
        "(as optimizer_config's check above).",
    ),
)
for _module, _names in (
    (
        "megatron.core.optimizer.clip_grads",
        ("multi_tensor_applier", "l2_norm_impl", "multi_tensor_scale_impl"),
    ),
    ("megatron.core.optimizer.optimizer", ("multi_tensor_applier", "multi_tensor_scale_impl")),
):
    for _name in _names:
        FUSED_OPTIMIZER_PATCHES += (
            Patch(
                _module,
                _name,
                _standin(
                    "metatrace.models.te_optim",
                    {
                        "l2_norm_impl": "multi_tensor_l2norm",
                        "multi_tensor_scale_impl": "multi_tensor_scale",
                    }.get(_name, _name),
                ),
                EVERY_RELEASE,
                "bound at import to TE's (or Apex's) multi-tensor kernels; the local fallback "
                "copies every gradient (src * scale) and reads norms back to the host.",
            ),
        )


def _foreach_default(orig):
    """torch.optim's Adam/AdamW with foreach on, as torch picks it for CUDA tensors (the
    multi-tensor step: its sqrt of every second moment at once is one state-sized temporary);
    on meta tensors torch would take the per-parameter loop."""

    class Foreach(orig):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("foreach", True)
            super().__init__(*args, **kwargs)

    Foreach.__name__ = Foreach.__qualname__ = orig.__name__
    return Foreach


TORCH_OPTIMIZER_PATCHES = tuple(
    Patch(
        "torch.optim",
        name,
        _foreach_default,
        EVERY_RELEASE,
        "get_megatron_optimizer's fallback (no TE, no Apex) builds torch.optim.AdamW or Adam; on "
        "a GPU torch runs their foreach step, on meta tensors its per-parameter loop.",
    )
    for name in ("AdamW", "Adam")
) + (
    Patch(
        "megatron.core.optimizer.clip_grads",
        "l2_norm_impl",
        _standin("metatrace.models.te_optim", "local_multi_tensor_l2_norm"),
        EVERY_RELEASE,
        "bound at import to megatron-core's local_multi_tensor_l2_norm without TE and Apex, "
        "which reads every norm to the host (not on meta); its scale and applier run as they are.",
    ),
)


def _wgrad_extension(orig):
    from metatrace.models.standins import FusedWeightGradient

    return FusedWeightGradient.module()


PATCHES += (
    Patch(
        "megatron.core.tensor_parallel.layers",
        "fused_weight_gradient_mlp_cuda",
        _wgrad_extension,
        EVERY_RELEASE,
        "Apex's extension for gradient-accumulation fusion (Megatron-LM's default), imported at "
        "module import (no attribute without Apex, unless the module was first imported inside "
        "_extension_modules: created); without it the linear layers refuse the fusion.",
        creates=True,
    ),
    Patch(
        "megatron.core.tensor_parallel.layers",
        "_grad_accum_fusion_available",
        _true,
        EVERY_RELEASE,
        "set at import from whether the extension above imported.",
    ),
    Patch(
        "megatron.core.tensor_parallel.layers",
        "get_dummy_wgrad",
        _standin("metatrace.models.te_runtime", "get_dummy_wgrad"),
        EVERY_RELEASE,
        "imported from TE at import (no attribute without TE: created); with "
        "gradient-accumulation fusion the linear layers return it as the weight gradient (the "
        "stand-in also covers runs without TE).",
        creates=True,
    ),
    Patch(
        "megatron.core.tensor_parallel.layers",
        "HAVE_TE",
        _true,
        EVERY_RELEASE,
        "selects get_dummy_wgrad above; whether the run has TE is the stand-in's to say.",
    ),
)


def _member_groups_only(orig):
    """megatron-core creates every group of every rank (each rank must call new_group for all
    of them); in a simulated world only the simulated rank's groups matter, and creating the
    others costs seconds at thousands of GPUs."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    known = {}  # default process group -> this process's rank in it

    def create_group(ranks=None, *args, **kwargs):
        if ranks is not None:
            world = c10d._world.default_pg
            rank = known.get(world)
            if rank is None:
                rank = known[world] = dist.get_rank()
            if rank not in ranks:
                return dist.GroupMember.NON_GROUP_MEMBER
        return orig(ranks, *args, **kwargs)

    return create_group


def _cached_rank_groups(orig):
    """The rank groups are a pure function of the world's sizes: computed once per process, by
    metatrace.world.orthogonal_array (megatron-core's loops enumerate every rank for every
    group kind: 2.3 s per process at 16,384 GPUs, in each worker)."""

    def generate(world_size, parallel_size, mask):
        if world_size != math.prod(parallel_size):
            return orig(world_size, parallel_size, mask)
        return orthogonal_array(tuple(parallel_size), tuple(mask)).tolist()

    return generate


# initialize_model_parallel's loops over every group of a kind do nothing for a group without
# the rank (create_group above, then `if rank in ranks`), except these: "pp" (the decoder's and
# the experts' groups are compared whole, parallel_state.py:814) and "tp-ep-pp" (the groups are
# counted, to join consecutive ones: parallel_state.py:1336).
_EVERY_GROUP = {"pp", "tp-ep-pp"}


def _rank_member_groups(orig):
    """RankGenerator.get_ranks, the groups that hold the simulated rank only (every group of the
    kinds in _EVERY_GROUP): the same groups reach the simulated rank, and the tens of thousands
    of others at 16,384 GPUs are neither listed nor passed to create_group."""
    import torch.distributed as dist

    def get_ranks(self, token):
        if (
            self.rank_offset
            or token in _EVERY_GROUP
            or self.world_size != math.prod(self.ordered_size)
        ):
            return orig(self, token)
        mask = self.get_mask(self.order, token)
        groups = orthogonal_array(tuple(self.ordered_size), tuple(mask))
        return groups[(groups == dist.get_rank()).any(axis=1)].tolist()

    return get_ranks


class _Shards:
    """megatron-core's shard_buffer list, each view made when first read: DDP reads one shard of
    a bucket (its rank's), and making all of them was an eighth of a derived stage's trace at
    dp x cp = 128 (2,048 slices of 16 buckets)."""

    def __init__(self, buffer, count: int):
        self.buffer = buffer
        self.size = buffer.numel() // count
        self.count = count
        self.made: dict[int, object] = {}

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, r: int):
        if r < 0:
            r += self.count
        if not 0 <= r < self.count:
            raise IndexError(r)
        view = self.made.get(r)
        if view is None:
            view = self.made[r] = self.buffer[r * self.size : (r + 1) * self.size]
        return view

    def __iter__(self):
        return (self[r] for r in range(self.count))


def _lazy_shards(orig):
    """Restates megatron.core.distributed.param_and_grad_buffer.shard_buffer
    (source sha256: 4ba2cc53483b), its list made lazy."""

    def shard_buffer(buffer, data_parallel_world_size: int):
        assert buffer.numel() % data_parallel_world_size == 0
        return _Shards(buffer, data_parallel_world_size)

    return shard_buffer


PATCHES += (
    Patch(
        "megatron.core.parallel_state",
        "create_group",
        _member_groups_only,
        EVERY_RELEASE,
        "speed only: the simulated rank gets the same groups; the others are not created.",
    ),
    Patch(
        "megatron.core.parallel_state",
        "generate_masked_orthogonal_rank_groups",
        _cached_rank_groups,
        EVERY_RELEASE,
        "speed only: the same groups, vectorised and computed once per world shape instead of "
        "once per role.",
    ),
    Patch(
        "megatron.core.parallel_state",
        "RankGenerator.get_ranks",
        _rank_member_groups,
        EVERY_RELEASE,
        "speed only: the simulated rank gets the same groups; the groups without it are not "
        "listed (but for the kinds whose loops use them: _EVERY_GROUP).",
    ),
    Patch(
        "megatron.core.distributed.param_and_grad_buffer",
        "shard_buffer",
        _lazy_shards,
        EVERY_RELEASE,
        "speed only: the same views of the bucket, each made when DDP first reads it "
        "(param_and_grad_buffer.py:279, 437, 474 read their rank's).",
    ),
)

# FP8 (models/te_fp8.py): megatron-core's get_fp8_context returns a null context without TE and
# te_checkpoint raises; these are their stand-ins, bound where megatron-core looks them up.
for _module in ("megatron.core.fp8_utils", "megatron.core.transformer.transformer_block"):
    PATCHES += (
        Patch(
            _module,
            "get_fp8_context",
            _standin("metatrace.models.te_fp8", "get_fp8_context"),
            EVERY_RELEASE,
            "without Transformer Engine it returns a null context, so FP8 would never start.",
        ),
    )
# FP4 (NVFP4): get_fp4_context likewise; TE runs NVFP4 through the same autocast.
for _module in ("megatron.core.fp4_utils", "megatron.core.transformer.transformer_block"):
    PATCHES += (
        Patch(
            _module,
            "get_fp4_context",
            _standin("metatrace.models.te_fp8", "get_fp4_context"),
            EVERY_RELEASE,
            "without Transformer Engine it returns a null context, so NVFP4 would never start.",
        ),
    )
for _module in (
    "megatron.core.transformer.transformer_block",
    "megatron.core.extensions.transformer_engine",
    "megatron.core.transformer.moe.moe_layer",
):
    PATCHES += (
        Patch(
            _module,
            "te_checkpoint",
            _standin("metatrace.models.te_fp8", "checkpoint"),
            EVERY_RELEASE,
            "recompute under FP8 goes through TE's checkpoint, None or raising without TE "
            "(the MoE layer's, with recompute of moe or shared experts, is bound only with TE).",
            creates=_module == "megatron.core.transformer.moe.moe_layer",
        ),
    )
# megatron-core 0.19 runs full recompute's checkpointed chunks in megatron.core.recompute
# (TransformerBlock's and HybridStack's), which binds all three at import.
PATCHES += tuple(
    Patch(
        "megatron.core.recompute",
        name,
        _standin("metatrace.models.te_fp8", standin),
        RELEASE_0_19,
        "full recompute's chunks run under these (0.19 moved them out of transformer_block): "
        "without Transformer Engine te_checkpoint is None and the FP8 and FP4 contexts null.",
    )
    for name, standin in (
        ("te_checkpoint", "checkpoint"),
        ("get_fp8_context", "get_fp8_context"),
        ("get_fp4_context", "get_fp4_context"),
    )
)
PATCHES += (
    Patch(
        "megatron.core.transformer.moe.moe_layer",
        "TELinear",
        _standin("metatrace.models.te_linear", "TELinear"),
        EVERY_RELEASE,
        "bound from Transformer Engine at import (absent or None without it); the latent "
        "projections of moe_latent_size (Nemotron 3 Super's LatentMoE) are TELinear.",
        creates=True,
    ),
    *(
        Patch(
            "megatron.core.transformer.moe.moe_layer",
            f"MoELayer.{method}",
            _standin_factory("metatrace.models.moe_graphs", factory),
            EVERY_RELEASE,
            "Transformer Engine's graphs of a MoE layer's router part (cuda_graph_scope "
            "moe_router, moe_preprocess) end in these methods: the graph's outputs, whose "
            "static gradients it keeps, and the preprocessing the time model counts as "
            "captured (metatrace.models.moe_graphs; unchanged without such graphs).",
        )
        for method, factory in (
            ("route", "moe_route"),
            ("preprocess", "moe_preprocess"),
            ("shared_experts_compute", "moe_shared_experts"),
        )
    ),
    Patch(
        "megatron.core.transformer.moe.moe_layer",
        "HAVE_TE",
        _true,
        EVERY_RELEASE,
        "gates only the latent projections' TELinear, stood in for above (moe_layer.py:171 in "
        "0.16.1, :266 in 0.19).",
    ),
)


# Mixture of experts (metatrace.models.moe): token counts per expert come from the routing
# assumption where megatron-core reads them from the device.
def _counted_permute(orig):
    # megatron-core 0.19 added tokens_per_expert and align_size (for TE's fused permute-and-pad)
    # and replaced the masked select by an argsort of the whole map, which needs no count.
    arguments = inspect.signature(orig).bind

    def permute(*args, **kwargs):
        given = arguments(*args, **kwargs).arguments
        num_out_tokens = given.get("num_out_tokens")
        count = int(num_out_tokens) if num_out_tokens is not None else given["routing_map"].size(0)
        with meta_kernels.selecting(count):
            return orig(*args, **kwargs)

    return permute


def _counted_unpermute(orig):
    arguments = inspect.signature(orig).bind  # 0.19 added pad_offsets

    def unpermute(*args, **kwargs):
        with meta_kernels.selecting(arguments(*args, **kwargs).arguments["sorted_indices"].size(0)):
            return orig(*args, **kwargs)

    return unpermute


def _alltoall_preprocess(orig):
    def preprocess(self, routing_map):
        if self.drop_and_pad:  # static counts: megatron-core's own path runs on meta
            return orig(self, routing_map)
        return _moe().alltoall_preprocess(self, routing_map)

    return preprocess


def _allgather_dispatch_postprocess(orig):
    def dispatch_postprocess(self, hidden_states, probs):
        # megatron-core's body (0.16.1, 0.19), with the host copy of the local map's column
        # sums replaced by the routing assumption's counts. Copied from
        # megatron.core.transformer.moe.token_dispatcher.MoEAllGatherTokenDispatcher.dispatch_postprocess
        # (source sha256: 99773af53a46, e2603120ec87).
        from megatron.core.transformer.moe import token_dispatcher as td

        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()
        self.local_probs = probs[:, first:last].contiguous()
        tokens_per_expert = _moe().allgather_local_counts(self, hidden_states.shape[0])
        _moe().route_local_as_assumed(self.local_map, tokens_per_expert.tolist())
        _host.sync()  # megatron-core copies the counts to the host: .cpu()
        total = int(tokens_per_expert.sum())
        # 0.19's permute also returns the padding offsets and padded counts
        permuted, _, self.reversed_local_input_permutation_mapping, *_ = td.permute(
            hidden_states,
            self.local_map,
            num_out_tokens=total,
            fused=self.config.moe_permute_fusion,
        )
        with meta_kernels.selecting(total):
            self.local_probs = self.local_probs.T.contiguous().masked_select(
                self.local_map.T.contiguous()
            )
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs

    return dispatch_postprocess


def _alltoall_synchronize(orig):
    def maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        # The host waits at cuda_sync_point for the copies of the counts megatron-core issued
        # at cuda_dtoh_point (taken here as a wait for everything issued so far). Dropless
        # only: with drop_and_pad the counts are static.
        if not self.drop_and_pad and point == self.cuda_sync_point:
            _host.sync()
        return orig(self, point, tokens_per_expert)

    return maybe_dtoh_and_synchronize


def _balanced_routing(orig):
    def routing(self, logits, padding_mask=None):
        probs, routing_map = orig(self, logits, padding_mask=padding_mask)
        routing = _moe().Routing.of(self.config)
        # Token dropping makes the real map's counts data-dependent: balanced, every source
        # rank sends each expert its share (at most its capacity), as the assumption has it.
        dropping = self.config.moe_expert_capacity_factor is not None
        if dropping or (routing.policy == "balanced" and routing.balanced_load == 1.0):
            routing_map = _moe().balanced_routing_map(routing_map, self.topk)
        return probs, routing_map

    return routing


def _moe():
    return importlib.import_module("metatrace.models.moe")


PATCHES += (
    Patch(
        "megatron.core.transformer.moe.token_dispatcher",
        "permute",
        _counted_permute,
        EVERY_RELEASE,
        "masked_select by the routing map selects as many tokens as the map has True entries, "
        "which meta tensors do not hold: the dispatcher's num_out_tokens says how many.",
    ),
    Patch(
        "megatron.core.transformer.moe.token_dispatcher",
        "unpermute",
        _counted_unpermute,
        EVERY_RELEASE,
        "as permute: the probabilities selected by the routing map number the permuted tokens.",
    ),
    Patch(
        "megatron.core.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher.preprocess",
        _alltoall_preprocess,
        EVERY_RELEASE,
        "dropless routing reads the tokens per expert and the all-to-all splits on the host "
        "(.cpu(), .tolist()); they come from the routing assumption (models/moe.py), padded "
        "per source rank with moe_router_padding_for_quantization.",
    ),
    Patch(
        "megatron.core.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
        _alltoall_synchronize,
        EVERY_RELEASE,
        "the host waits for the token counts' copies at cuda_sync_point (an event's "
        "synchronize, which does nothing on meta): the time model's synchronisation.",
    ),
    Patch(
        "megatron.core.transformer.moe.token_dispatcher",
        "MoEAllGatherTokenDispatcher.dispatch_postprocess",
        _allgather_dispatch_postprocess,
        EVERY_RELEASE,
        "reads the tokens per local expert on the host (.cpu()); they come from the routing "
        "assumption (on real tensors the local map is made to route them).",
    ),
    Patch(
        "megatron.core.transformer.moe.router",
        "TopKRouter.routing",
        _balanced_routing,
        EVERY_RELEASE,
        "on real tensors (the CPU check of a meta trace) under balanced routing, or where the "
        "router drops tokens, the routing map is made the balanced one metatrace assumes "
        "(random routing otherwise keeps the router's own draw); on meta it holds no values "
        "and is left alone.",
    ),
    Patch(
        "megatron.core.transformer.moe.router",
        "sinkhorn",
        _standin("metatrace.models.moe", "sinkhorn"),
        EVERY_RELEASE,
        "iterates until the values converge, which meta tensors cannot tell.",
    ),
    Patch(
        "megatron.core.transformer.moe.moe_utils",
        "te_general_gemm",
        _standin("metatrace.models.moe", "te_general_gemm"),
        EVERY_RELEASE,
        "bound from Transformer Engine at import, and referenced without it (a NameError: "
        "created); the router's gating GEMM calls it.",
        creates=True,
    ),
    Patch(
        "megatron.core.transformer.moe.moe_utils",
        "MoEAuxLossAutoScaler.main_loss_backward_scale",
        lambda orig: None,
        EVERY_RELEASE,
        "a class attribute megatron-core creates on the device of the first backward (or "
        "set_loss_scale) and keeps: a trace on another device then mixes devices (a real CPU run "
        "after a meta trace fails in backward, metatrace measure with an aux loss).",
    ),
)


# The flex token dispatcher's kernels (DeepEP, HybridEP; metatrace.models.deepep): token_dispatcher
# binds them from fused_a2a at import, None without deep_ep, and raises ImportError then.
def _remembering_flex_init(orig):
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        _deepep().remember(self)

    return __init__


def _flex_multihot(orig):
    def _indices_to_multihot(self, indices, probs):
        return _deepep().indices_to_multihot(self, indices, probs)

    return _indices_to_multihot


def _deepep():
    return importlib.import_module("metatrace.models.deepep")


_TD = "megatron.core.transformer.moe.token_dispatcher"
PATCHES += tuple(
    Patch(
        _TD,
        name,
        _standin("metatrace.models.deepep", name),
        EVERY_RELEASE,
        "bound from fused_a2a at import (None without deep_ep, which needs a GPU); the flex "
        "dispatcher calls it.",
    )
    for name in (
        "fused_dispatch",
        "fused_combine",
        "set_deepep_num_sms",
        "hybrid_ep_dispatch",
        "hybrid_ep_combine",
    )
) + (
    Patch(
        _TD,
        "MoEFlexTokenDispatcher.__init__",
        _remembering_flex_init,
        EVERY_RELEASE,
        "the kernels' arguments carry neither topk nor the expert-TP size the stand-ins size "
        "their outputs by; the dispatcher's config is kept for them.",
    ),
    Patch(
        _TD,
        "_DeepepManager._indices_to_multihot",
        _flex_multihot,
        EVERY_RELEASE,
        "indexes by a boolean mask (indices[mask]), whose size depends on the data; the tokens "
        "per expert say how many.",
    ),
)

# Transformer Engine's fused MoE kernels (--moe-permute-fusion, --moe-router-fusion;
# metatrace.models.te_moe): moe_utils binds them from TE at import, and only when TE imports
# (no attribute at all without it), and checks HAVE_TE before calling them.
_TE_MOE = (
    "fused_permute",
    "fused_permute_with_probs",
    "fused_unpermute",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
)
PATCHES += tuple(
    Patch(
        "megatron.core.transformer.moe.moe_utils",
        name,
        _standin("metatrace.models.te_moe", name),
        EVERY_RELEASE,
        "bound from Transformer Engine at import (missing without it); called with "
        "moe_permute_fusion / moe_router_fusion, and looked up by TransformerConfig's checks.",
        creates=True,
    )
    for name in _TE_MOE
) + (
    Patch(
        "megatron.core.transformer.moe.moe_utils",
        "HAVE_TE",
        _true,
        EVERY_RELEASE,
        "gates only the fused_* calls above (moe_utils.py:118, 322, 330, 414, 491, 498, 653, "
        "772); each is also gated by its config flag.",
    ),
)


# torch.compile: megatron.core.jit.jit_fuser is torch.compile (inductor) on a GPU, and traces run
# the functions it decorates eagerly (_dynamo_disabled below). Where the compiled kernel allocates
# other buffers than the eager ops, a stand-in allocates what the kernel does (models/compiled.py;
# measured against inductor on CPU tensors by tests/tracing/test_compiled.py). Applied unless the job runs
# them eagerly (implementation.torch_compile false).
COMPILED_PATCHES: tuple[Patch, ...] = ()
for _module, _name, _standin_name, _why in (
    (
        "megatron.core.fusions.fused_cross_entropy",
        "calculate_gradients",
        "fused_ce_calculate_gradients",
        "compiled, the functional index_put on the saved softmax lowers to clone + scatter: an fp32 "
        "[s, b, V/t] copy lives with the bf16 gradient (+4*s*b*V/t bytes over eager).",
    ),
    (
        "megatron.core.fusions.fused_bias_gelu",
        "bias_gelu",
        "bias_gelu",
        "compiled, one kernel writes the output; eager allocates 4 more output-sized temporaries.",
    ),
    (
        "megatron.core.fusions.fused_bias_gelu",
        "bias_gelu_back",
        "bias_gelu_back",
        "compiled, one kernel writes the input gradient; eager allocates 5 more output-sized "
        "temporaries.",
    ),
    (
        "megatron.core.fusions.fused_bias_swiglu",
        "swiglu",
        "swiglu",
        "compiled, one kernel writes the output; eager allocates silu(y1) too.",
    ),
    (
        "megatron.core.fusions.fused_bias_swiglu",
        "bias_swiglu",
        "bias_swiglu",
        "compiled, one kernel writes the output; eager allocates y + bias and silu(y1) too.",
    ),
    (
        "megatron.core.fusions.fused_bias_swiglu",
        "swiglu_back",
        "swiglu_back",
        "compiled, one kernel writes the input gradient; eager allocates every factor and both "
        "halves before the cat.",
    ),
    (
        "megatron.core.fusions.fused_bias_swiglu",
        "bias_swiglu_back",
        "bias_swiglu_back",
        "compiled, one kernel writes the input gradient; eager allocates y + bias and the factors.",
    ),
    *(
        (
            f"megatron.core.fusions.fused_bias_{family}",
            name,
            name,
            "compiled (the MoE experts' activation weighted by the routing probabilities), one "
            "kernel writes each output; eager allocates every intermediate and runs a kernel "
            "for each"
            + (
                "; the backward realises the gradient's halves concatenated in fp32 (y's shape)"
                if name.endswith("_back")
                else ""
            )
            + ".",
        )
        for family, name in (
            ("swiglu", "weighted_swiglu"),
            ("swiglu", "weighted_swiglu_back"),
            ("geglu", "weighted_quick_geglu"),
            ("geglu", "weighted_quick_geglu_back"),
            ("geglu", "weighted_bias_quick_geglu"),
            ("geglu", "weighted_bias_quick_geglu_back"),
        )
    ),
    (
        "megatron.core.fusions.fused_bias_dropout",
        "bias_dropout_add_fused_train",
        "bias_dropout_add_fused_train",
        "compiled, forward allocates the output and the bool mask only (eager: x + bias and the "
        "dropout output too); the same mask is saved.",
    ),
):
    COMPILED_PATCHES += (
        Patch(
            _module,
            _name,
            _standin("metatrace.models.compiled", _standin_name),
            EVERY_RELEASE,
            _why,
        ),
    )

# Gated DeltaNet's @jit_fuser methods. _prepare_input_for_gated_delta_rule (0.19) is left eager:
# compiled (a graph break at fla's l2norm) it allocates and saves what eager does, measured.
_GATED_NORM_WHY = (
    "compiled, the graph breaks at the output norm (Transformer Engine's C++ kernels) and the "
    "gate multiply saves y and the gate (bf16), not eager's y with the fp32 gate and its "
    "activation: 4 bytes an element of [tokens, heads x value_dim] instead of 10 (measured)."
)
COMPILED_PATCHES += (
    Patch(
        "megatron.core.ssm.gated_delta_net",
        "GatedDeltaNet._apply_gated_norm",
        _standin("metatrace.models.compiled", "gdn_apply_gated_norm"),
        RELEASE_0_16,
        _GATED_NORM_WHY,
    ),
    Patch(
        "megatron.core.ssm.gated_delta_net.common",
        "_GDNBase._apply_gated_norm",
        _standin("metatrace.models.compiled", "gdn_apply_gated_norm"),
        RELEASE_0_19,
        _GATED_NORM_WHY,
    ),
    Patch(
        "megatron.core.ssm.gated_delta_net.common",
        "_GDNBase._compute_g_and_beta",
        _standin("metatrace.models.compiled", "gdn_compute_g_and_beta"),
        RELEASE_0_19,
        "compiled, saves alpha (bf16) and the sigmoid, not eager's fp32 alpha + dt_bias and its "
        "softplus.",
    ),
)


# Multi-latent attention and multi-token prediction (DeepSeek-V3).
def _kv_channels_per_tensor(orig):
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        orig(self, *args, **kwargs)
        if v_channels is not None:  # the output is heads x v_channels wide
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels

    return __init__


def _no_kernel(orig):
    from metatrace.models.fusions import NoKernel

    return NoKernel()


PATCHES += (
    Patch(
        "megatron.core.transformer.multi_latent_attention",
        "TELinear",
        _standin("metatrace.models.te_linear", "TELinear"),
        EVERY_RELEASE,
        "imported from megatron.core.extensions.transformer_engine, whose classes without TE "
        "are MagicMock instances: `isinstance(linear_proj, TELinear)` raises TypeError, and the "
        "down-projections' `in [TELinear]` test never matches the stand-in.",
    ),
    Patch(
        "megatron.core.transformer.multi_latent_attention",
        "TEColumnParallelLinear",
        _standin("metatrace.models.te_linear", "TEColumnParallelLinear"),
        EVERY_RELEASE,
        "as TELinear: the down-projections' class test.",
    ),
    Patch(
        "megatron.core.transformer.multi_latent_attention",
        "TELayerNormColumnParallelLinear",
        _standin("metatrace.models.te_linear", "TELayerNormColumnParallelLinear"),
        RELEASE_0_19,
        "as TELinear: FusedMLASelfAttention's class test of its fused down-projection "
        "(mla_down_proj_fusion), which takes the input norm.",
    ),
    Patch(
        "megatron.core.transformer.dot_product_attention",
        "DotProductAttention.__init__",
        _kv_channels_per_tensor,
        EVERY_RELEASE,
        "MLA builds its core attention with k_channels / v_channels (TEDotProductAttention's "
        "signature); the local DotProductAttention takes neither (TypeError) and sizes its "
        "output by kv_channels. Accept both; the output is v_channels per head.",
    ),
)


def _meta_backend(orig):
    def get_backend(transformer_impl):
        from metatrace.models.specs import provider_for

        return provider_for(transformer_impl)

    return get_backend


PATCHES += (
    Patch(
        "megatron.core.transformer.mla_qk_norm_config",
        "get_backend",
        _meta_backend,
        RELEASE_0_19,
        "MLA resolves its latent norms and up-projections against the backend of "
        "transformer_impl (megatron-core's TESpecProvider, whose classes without TE are "
        "MagicMock instances): metatrace's provider, whose modules the layer spec holds.",
    ),
)


for _name in (
    "rotary_fwd_q_kernel",
    "rotary_bwd_q_kernel",
    "rotary_fwd_kv_kernel",
    "rotary_bwd_kv_kernel",
):
    PATCHES += (
        Patch(
            "megatron.core.fusions.fused_mla_yarn_rope_apply",
            _name,
            _no_kernel,
            EVERY_RELEASE,
            "a Triton kernel (MLA's fused yarn RoPE, on by default with TE); without Triton the "
            "module imports with a mocked triton and `kernel[grid](...)` raises TypeError.",
        ),
    )


# Recompute under FP8 (CheckpointWithoutOutput(fp8=True): layernorm, mla_up_proj): random.py
# binds these from Transformer Engine at import (missing without it).
PATCHES += tuple(
    Patch(
        "megatron.core.tensor_parallel.random",
        name,
        _standin("metatrace.models.te_fp8", standin),
        EVERY_RELEASE,
        "imported from Transformer Engine (missing without it); CheckpointWithoutOutput with "
        "fp8 reads the FP8 state and recomputes under the first pass's recipe.",
        creates=True,
    )
    for name, standin in (
        ("FP8GlobalStateManager", "FP8GlobalStateManager"),
        ("fp8_autocast", "recompute_autocast"),
        ("activation_recompute_forward", "activation_recompute_forward"),
    )
)


def _meta_share_storage(orig):
    """megatron-core 0.19's output-discarding recompute (CheckpointWithoutOutput) makes each
    discarded output's storage point at its recomputed output's (a C++ extension it compiles
    with load_inline on first use), where 0.16.1 resized the storage again and copied: nothing is
    allocated. On meta there is no data to point at: the discarded output keeps its empty
    storage and the recomputed one lives on, which is what the GPU holds; real tensors (measure)
    take megatron-core's own extension."""

    def get_share_storage():
        real = None

        def share_storage(dst, src):
            nonlocal real
            if dst.is_meta:
                return
            real = real or orig()
            real(dst, src)

        return share_storage

    return get_share_storage


PATCHES += (
    Patch(
        "megatron.core.tensor_parallel.random",
        "_get_share_storage",
        _meta_share_storage,
        RELEASE_0_19,
        "compiles a C++ extension (torch.utils.cpp_extension.load_inline) on first use, which a "
        "trace needs not: a meta tensor has no data to share.",
    ),
)


# save_original_input (TE >= 2.6 Linear): megatron-core sets it under non-delayed FP8 on
# attention's linear_proj, shared experts' linear_fc1 and MLA's linear_proj, each behind a test
# that TE imported and is recent enough; the stand-ins implement it (models/te_fp8_linear.py).
def _real_set_save_original_input(orig):
    from megatron.core.extensions.transformer_engine import set_save_original_input

    return set_save_original_input


PATCHES += (
    tuple(
        Patch(
            module,
            name,
            make,
            EVERY_RELEASE,
            why,
            creates=creates,
        )
        for module in (
            "megatron.core.transformer.attention",
            "megatron.core.transformer.multi_latent_attention",
        )
        for name, make, why, creates in (
            (
                "HAVE_TE",
                _true,
                "gates only set_save_original_input on linear_proj (attention.py:364, "
                "multi_latent_attention.py:184).",
                False,
            ),
            (
                "set_save_original_input",
                _real_set_save_original_input,
                "None when the TE import fails (megatron-core's own function works on the stand-ins).",
                False,
            ),
            (
                "is_te_min_version",
                lambda orig: _te_min_version(orig),
                "TE >= 2.6 for save_original_input: a TypeError without TE (as optimizer_config's).",
                False,
            ),
        )
    )
    + (
        Patch(
            "megatron.core.transformer.attention",
            "TELinear",
            _standin("metatrace.models.te_linear", "TELinear"),
            EVERY_RELEASE,
            "None without TE: `isinstance(linear_proj, TELinear)` needs the stand-in class.",
        ),
        Patch(
            "megatron.core.extensions.transformer_engine",
            "TELinear",
            _standin("metatrace.models.te_linear", "TELinear"),
            EVERY_RELEASE,
            "a MagicMock without TE; SharedExpertMLP imports it at construction for "
            "`isinstance(linear_fc1, TELinear)` (shared_experts.py:80-90), a TypeError with a mock.",
        ),
        Patch(
            "megatron.core.transformer.moe.shared_experts",
            "is_te_min_version",
            lambda orig: _te_min_version(orig),
            EVERY_RELEASE,
            "TE >= 2.6 for save_original_input under FP8 (shared_experts.py:64-69).",
        ),
    )
    + tuple(
        # 0.19 imports them at the module's load, behind HAVE_TE (shared_experts.py:34-42, 155)
        Patch("megatron.core.transformer.moe.shared_experts", name, make, RELEASE_0_19, why)
        for name, make, why in (
            (
                "HAVE_TE",
                _true,
                "gates set_save_original_input on linear_fc1 (and the fused grouped SwiGLU, which "
                "needs TE 2.14 and is refused by the release check).",
            ),
            (
                "TELinear",
                _standin("metatrace.models.te_linear", "TELinear"),
                "None without TE: `isinstance(linear_fc1, TELinear)` needs the stand-in class.",
            ),
            (
                "set_save_original_input",
                _real_set_save_original_input,
                "None without TE (megatron-core's own function works on the stand-ins).",
            ),
        )
    )
)


# FP8 grouped experts (metatrace.models.te_fp8_grouped): TEGroupedMLP pads each expert's tokens
# with TE's Fp8Padding / Fp8Unpadding, imported from the TE extension only when TE imports.
PATCHES += tuple(
    Patch(
        "megatron.core.transformer.moe.experts",
        name,
        _standin("metatrace.models.te_fp8_grouped", name),
        EVERY_RELEASE,
        "imported from megatron.core.extensions.transformer_engine when TE imports (missing "
        "without it); TEGroupedMLP builds it under FP8 (experts.py:603-606).",
        creates=True,
    )
    for name in ("Fp8Padding", "Fp8Unpadding")
) + (
    Patch(
        "megatron.core.transformer.moe.experts",
        "HAVE_TE",
        _true,
        EVERY_RELEASE,
        "gates only the FP8 padding above (TEGroupedMLP asserts it under FP8, experts.py:604).",
    ),
)


# Fine-grained activation offloading (--fine-grained-activation-offloading; metatrace.hooks.offload
# has the stand-ins, their reasons, and the log of what moved).
def _offload_standin(name: str):
    return _standin_factory("metatrace.hooks.offload", name)


# Transformer Engine's layer-wise CPU activation offloading (--cpu-offloading-num-layers;
# metatrace.models.te_cpu_offload restates TE 2.8's handler).
PATCHES += (
    Patch(
        "megatron.core.transformer.transformer_block",
        "get_cpu_offload_context",
        _standin("metatrace.models.te_cpu_offload", "get_cpu_offload_context"),
        EVERY_RELEASE,
        "bound from Transformer Engine at import (None without it, and TransformerBlock then "
        "asserts cpu_offloading off); the stand-in's context sees what metatrace's TE stand-ins "
        "mark for offloading.",
    ),
    Patch(
        "megatron.core.transformer.mlp",
        "HAVE_TE",
        _true,
        EVERY_RELEASE,
        "gates only whether the fused SwiGLU marks its input for TE's layer-wise offloading "
        "(mlp.py:210), itself gated by cpu_offloading.",
    ),
)

# Optimizer CPU offload (--optimizer-cpu-offload; metatrace.hooks.optimizer_offload restates
# the split and the step for meta).
_HDO = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"
PATCHES += (
    Patch(
        _HDO,
        "HybridDeviceOptimizer._get_sub_optimizer_param_groups",
        _standin_factory("metatrace.hooks.optimizer_offload", "split"),
        EVERY_RELEASE,
        "decides host or GPU by `param.is_cuda`, False on meta: every shard would be taken for "
        "a host one and nothing offloaded; host copies would take host memory in the tracer.",
    ),
    Patch(
        _HDO,
        "HybridDeviceOptimizer.step",
        _standin_factory("metatrace.hooks.optimizer_offload", "step"),
        EVERY_RELEASE,
        "runs the host optimizers and the copies between host and GPU, which have no meta "
        "stand-in; the GPU part runs, the copies are logged.",
    ),
)

_FGO = "megatron.core.pipeline_parallel.fine_grained_activation_offload"
PATCHES += (
    Patch(
        _FGO,
        "ChunkOffloadHandler.offload",
        _offload_standin("offload"),
        EVERY_RELEASE,
        "copies into a pinned host buffer: no pinned memory without an accelerator, and no copy "
        "out of a meta tensor; a HostCopy record stands for the buffer.",
    ),
    Patch(
        _FGO,
        "ChunkOffloadHandler.reload",
        _offload_standin("reload"),
        EVERY_RELEASE,
        "copies the host buffer back: the GPU allocation is made, the copy is not.",
    ),
    Patch(
        _FGO,
        "PipelineOffloadManager.__enter__",
        _offload_standin("manager_enter"),
        EVERY_RELEASE,
        "pushes its saved-tensor hooks over metatrace's, which torch then no longer calls: note "
        "the hooks it hides.",
    ),
    Patch(
        _FGO,
        "PipelineOffloadManager.__exit__",
        _offload_standin("manager_exit"),
        EVERY_RELEASE,
        "pops them again.",
    ),
    Patch(
        _FGO,
        "ChunkOffloadHandler._can_manage_tensor_for_offload",
        _offload_standin("manageable"),
        RELEASE_0_19,
        "0.19 offloads only tensors on a CUDA device: no tensor of a trace would be offloaded; "
        "meta tensors stand for CUDA ones.",
    ),
    Patch(
        _FGO,
        "PipelineOffloadManager.on_save_for_backward",
        _offload_standin("on_save"),
        EVERY_RELEASE,
        "calls the hidden pack hook first (the recorder's, measure's), so that tensors saved "
        "inside an offload group are still seen.",
    ),
    Patch(
        _FGO,
        "OffloadTensorGroup.push_tensor",
        _offload_standin("push_tensor"),
        EVERY_RELEASE,
        "drops what the hidden pack hook returned once the tensor is offloaded.",
    ),
    Patch(
        _FGO,
        "OffloadTensorGroup.pop_tensor",
        _offload_standin("pop_tensor"),
        EVERY_RELEASE,
        "drops it when autograd takes the tensor back.",
    ),
    Patch(
        _FGO,
        "print_offload_summary_table",
        _no_op,
        EVERY_RELEASE,
        "all_gather_object and a barrier over the world at the end of the first iteration, for "
        "a printed table.",
    ),
    Patch(
        "megatron.core.extensions.transformer_engine",
        "cpu_offload",
        _offload_standin("cpu_offload"),
        EVERY_RELEASE,
        "TE's cpu_offload module, None without TE: the offload manager raises 'TE CPU offload "
        "is not available' even with the local spec.",
    ),
    Patch(
        "torch.cuda.nvtx",
        "range_push",
        _no_op,
        EVERY_RELEASE,
        "the offload handler marks its copies with NVTX ranges; a CPU build of torch raises "
        "'NVTX functions not installed'. Profiling markers only.",
    ),
    Patch(
        "torch.cuda.nvtx",
        "range_pop",
        _no_op,
        EVERY_RELEASE,
        "as range_push.",
    ),
)


# Megatron-FSDP with tensor parallelism: its adapter bound megatron-core's TELinear at import.
PATCHES += (
    Patch(
        "megatron.core.distributed.fsdp.mcore_fsdp_adapter",
        "TELinear",
        _standin("metatrace.models.te_linear", "TELinear"),
        RELEASE_0_16,
        "bound at import from megatron-core's TE extensions (a class over a MagicMock without "
        "TE); with tp > 1 _fix_tensor_parallel_attributes tests every module against it to mark "
        "duplicated linear layers' parameters.",
    ),
)

# Megatron-FSDP with tensor parallelism copies TP rank 0's RNG states to the other TP ranks.
PATCHES += (
    Patch(
        "megatron.core.distributed.fsdp.mcore_fsdp_adapter",
        "FullyShardedDataParallel.sync_rng_states_across_tp_group",
        _no_op,
        EVERY_RELEASE,
        "broadcasts TP rank 0's pickled RNG states with broadcast_object_list, which in a world "
        "of one simulated rank delivers nothing to the others (on the CPU of `metatrace "
        "measure` a TP rank > 0 read an uninitialised size: a 94 TB allocation); the simulated "
        "rank keeps its own states, which hold no device memory.",
    ),
)

# Megatron-FSDP with FP8 parameters (fp8_param_gather): metatrace's FP8 weights are TE's
# Float8Tensor to it (metatrace.models.te_fp8_param).
_MFSDP = "megatron.core.distributed.fsdp.src.megatron_fsdp"
PATCHES += tuple(
    Patch(
        f"{_MFSDP}.{module}",
        "is_float8tensor",
        _standin("metatrace.models.te_fp8_param", "is_float8tensor"),
        EVERY_RELEASE,
        "tests for Transformer Engine's QuantizedTensor (False without TE): metatrace's FP8 "
        "weights then get a gradient buffer of their FP8 dtype, for which FSDP has no entry.",
    )
    for module in ("mixed_precision", "param_and_grad_buffer", "megatron_fsdp")
) + (
    Patch(
        f"{_MFSDP}.param_and_grad_buffer",
        "fp8_quantize",
        _standin("metatrace.models.te_fp8_param", "fp8_quantize"),
        EVERY_RELEASE,
        "casts the main weights into the FP8 shards with TE's cast_master_weights_to_fp8, or "
        "without TE a fallback that needs TE's Float8Tensor; restated for meta.",
    ),
)


_RECOMPILED: dict = {}
"""(original function, statement) -> the code of its source without the statement."""


def _without_statement(statement: str):
    """The original function recompiled from its source without `statement` (one line that must
    occur exactly once, else PatchError: the source changed and the patch needs a look)."""

    def make(orig):
        import inspect
        import textwrap

        if getattr(orig, "_metatrace_without", None) == statement:
            return orig  # megatron_patches nested: already the patched function
        code = _RECOMPILED.get((orig, statement))
        if code is None:  # reading and compiling the source: milliseconds, once per process
            source = textwrap.dedent(inspect.getsource(orig))
            if source.count(statement) != 1:
                raise PatchError(
                    f"{orig.__qualname__}: expected the statement {statement!r} once in its "
                    f"source, found it {source.count(statement)} times; update the patch"
                )
            indent = source[: source.index(statement)].rsplit("\n", 1)[1]
            source = source.replace(indent + statement, indent + "pass", 1)
            code = compile(source, inspect.getsourcefile(orig) or "<patched>", "exec")
            _RECOMPILED[(orig, statement)] = code
        # The module's globals as they are now (other patches of the same module applied).
        namespace = dict(vars(inspect.getmodule(orig)))
        exec(code, namespace)
        replacement = namespace[orig.__name__]
        replacement.__qualname__ = orig.__qualname__
        replacement._metatrace_without = statement
        return replacement

    return make


_FSDP = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
PATCHES += (
    Patch(
        _FSDP,
        "ParamAndGradBuffer._init_each_parameter_group_buffers",
        _without_statement("assert not p.is_meta, (self.param_to_name[p], module_reset_flag)"),
        EVERY_RELEASE,
        "Megatron-FSDP asserts that no parameter is left on meta once its buffers exist (it "
        "initialises meta parameters with --init-model-with-meta-device); on meta they all are, "
        "and the buffers are built from them all the same.",
    ),
    Patch(
        _FSDP,
        "validate_uneven_dtensor",
        _no_op,
        EVERY_RELEASE,
        "checks each sharded parameter's DTensor chunk boundaries by all-gathering them and "
        "reading the result (.item() on meta); a check only, nothing is allocated or kept.",
    ),
)

_NVTE_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def _resolve(patch: Patch):
    """(owner, attribute name) of the patch's target; PatchError when its module or any
    attribute on the way is missing (the last one too, unless the patch `creates` it)."""
    try:  # sys.modules first: megatron_patches is entered thousands of times by `plan`
        guards.inference_triton_ops()  # MambaMixer's imports, where Triton is missing
        owner = sys.modules.get(patch.module) or importlib.import_module(patch.module)
    except ImportError as e:
        raise _missing(patch, f"module {patch.module} does not import ({e})") from e
    *path, attr = patch.target.split(".")
    for i, name in enumerate(path):
        if not hasattr(owner, name):
            raise _missing(patch, f"{patch.module} has no {'.'.join(path[: i + 1])}")
        owner = getattr(owner, name)
    if not patch.creates and not hasattr(owner, attr):
        raise _missing(patch, f"{patch.module} has no {patch.target}")
    return owner, attr


def _missing(patch: Patch, what: str) -> PatchError:
    return PatchError(
        f"patch {patch.name} (megatron-core {patch.versions}): {what} in megatron-core "
        f"{guards.release_text()}; patching it would add an attribute nothing reads (renamed or removed? "
        f"update the patch). Why it is patched: {patch.why}"
    )


# Globals megatron-core 0.16.1's destroy_model_parallel() leaves set, so that the next
# initialize_model_parallel() in the same process would return the previous world's groups
# (seen with hierarchical context parallelism: a stale group, KeyError in torch).
_PARALLEL_STATE_LEFTOVERS = (
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_HYBRID_DP_CP_GROUPS",
)


def clear_parallel_state_leftovers() -> None:
    """Finish megatron-core's destroy_model_parallel (0.16.1): reset what it forgets, and the
    multi-token-prediction class globals one traced role would leave to the next (0.16.1:
    MTPLossLoggingHelper.tracker keeps the previous role's loss tensor and groups;
    MTPLossAutoScaler.main_loss_backward_scale the scale a schedule set)."""
    from megatron.core import parallel_state as ps

    for name in _PARALLEL_STATE_LEFTOVERS:
        if hasattr(ps, name):
            setattr(ps, name, None if name != "_HYBRID_DP_CP_GROUPS" else {})
    mtp = sys.modules.get("megatron.core.transformer.multi_token_prediction")
    if mtp is not None:
        mtp.MTPLossLoggingHelper.tracker = {}
        mtp.MTPLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)


_MIXER = "megatron.core.ssm.mamba_mixer"
_GDN_16 = "megatron.core.ssm.gated_delta_net"
_GDN_19 = "megatron.core.ssm.gated_delta_net.gdn"
_GDN_19_COMMON = "megatron.core.ssm.gated_delta_net.common"
_NO_MAMBA_SSM = "bound from mamba_ssm at import (absent without it: a CUDA-only package)"
_NO_FLA = "bound from flash-linear-attention at import (None without it: Triton kernels for CUDA)"

# Hybrid models' mixers: Mamba-2 (mamba_ssm, causal_conv1d) and Gated DeltaNet (fla).
PATCHES += (
    Patch(
        _MIXER,
        "HAVE_MAMBA_SSM",
        _true,
        EVERY_RELEASE,
        "MambaMixer refuses to build without mamba_ssm; its kernels are stood in for below.",
    ),
    Patch(
        _MIXER,
        "mamba_split_conv1d_scan_combined",
        _standin("metatrace.models.ssm_kernels", "mamba_split_conv1d_scan_combined"),
        EVERY_RELEASE,
        f"{_NO_MAMBA_SSM}; MambaMixer's training path (use_mamba_mem_eff_path) calls it.",
        creates=True,
    ),
    Patch(
        _MIXER,
        "mamba_chunk_scan_combined",
        _standin("metatrace.models.ssm_kernels", "mamba_chunk_scan_combined"),
        EVERY_RELEASE,
        f"{_NO_MAMBA_SSM}; MambaMixer's path without the memory-efficient kernel calls it.",
        creates=True,
    ),
    Patch(
        _MIXER,
        "causal_conv1d_fn",
        _standin("metatrace.models.ssm_kernels", "causal_conv1d_fn"),
        EVERY_RELEASE,
        "bound from causal_conv1d at import (None without it; a CUDA extension).",
    ),
    Patch(
        _MIXER,
        "ExtendedRMSNorm",
        _standin("metatrace.models.ssm_kernels", "RMSNormGated"),
        EVERY_RELEASE,
        "derived at import from mamba_ssm's gated RMSNorm (a MagicMock without mamba_ssm); it "
        "adds only a sharded state dict for checkpoints, which are not traced.",
    ),
    Patch(
        "megatron.core.ssm.mamba_block",
        "TENorm",
        _standin("metatrace.models.te_linear", "TENorm"),
        RELEASE_0_16,
        "bound from Transformer Engine at import; MambaStack's final norm.",
    ),
    Patch(
        "megatron.core.models.hybrid.hybrid_block",
        "TENorm",
        _standin("metatrace.models.te_linear", "TENorm"),
        RELEASE_0_19,
        "bound from Transformer Engine at import; HybridStack's final norm.",
    ),
    Patch(
        _GDN_16,
        "HAVE_FLA",
        _true,
        RELEASE_0_16,
        "GatedDeltaNet refuses to build without flash-linear-attention; its kernels are stood in "
        "for below.",
    ),
    Patch(
        _GDN_16,
        "l2norm",
        _standin("metatrace.models.gdn_kernels", "l2norm"),
        RELEASE_0_16,
        f"{_NO_FLA}; GatedDeltaNet normalises queries and keys with it.",
        creates=True,
    ),
    Patch(
        _GDN_16,
        "chunk_gated_delta_rule",
        _standin("metatrace.models.gdn_kernels", "chunk_gated_delta_rule"),
        RELEASE_0_16,
        f"{_NO_FLA}; GatedDeltaNet's recurrence.",
    ),
    Patch(
        _GDN_16,
        "causal_conv1d_fn",
        _standin("metatrace.models.ssm_kernels", "causal_conv1d_fn"),
        RELEASE_0_16,
        "bound from causal_conv1d at import (None without it: GatedDeltaNet then runs torch's "
        "Conv1d, which is not what a GPU with causal_conv1d runs).",
    ),
    Patch(
        _GDN_19_COMMON,
        "HAVE_FLA",
        _true,
        RELEASE_0_19,
        "GatedDeltaNet refuses to build without flash-linear-attention; its kernels are stood in "
        "for below.",
    ),
    Patch(
        _GDN_19_COMMON,
        "l2norm",
        _standin("metatrace.models.gdn_kernels", "l2norm"),
        RELEASE_0_19,
        f"{_NO_FLA}; GatedDeltaNet normalises queries and keys with it.",
    ),
    Patch(
        _GDN_19,
        "chunk_gated_delta_rule",
        _standin("metatrace.models.gdn_kernels", "chunk_gated_delta_rule"),
        RELEASE_0_19,
        f"{_NO_FLA}; GatedDeltaNet takes its recurrence from here when it is built.",
    ),
    Patch(
        _GDN_19,
        "causal_conv1d",
        _standin("metatrace.models.gdn_kernels", "causal_conv1d"),
        RELEASE_0_19,
        f"{_NO_FLA}; GatedDeltaNet's short convolution.",
    ),
)


@contextlib.contextmanager
def patched(patches, release: tuple[int, ...] | None = None):
    """`patches` applied, those whose versions include `release` (by default the installed
    megatron-core's), and restored in reverse on exit, also on error: an attribute a patch
    created (or one it found on a base class) is deleted, any other gets its original back."""
    release = installed_release()[1] if release is None else release
    applied = []
    try:
        for patch in patches:
            if release not in patch.versions:
                continue
            owner, attr = _resolve(patch)
            owned = attr in owner.__dict__
            _orig = owner.__dict__[attr] if owned else getattr(owner, attr, None)
            setattr(owner, attr, patch.make(_orig))
            applied.append((owner, attr, owned, _orig))
        yield
    finally:
        for owner, attr, owned, _orig in reversed(applied):
            if owned:
                setattr(owner, attr, _orig)
            else:
                delattr(owner, attr)


@contextlib.contextmanager
def _extension_modules():
    """megatron-core 0.12-0.16 import Apex's fused softmax extensions by name inside
    FusedScaleMaskSoftmax (fusions/fused_softmax.py); without them the local spec's attention
    cannot run. The stand-ins come from metatrace.models.standins."""
    from metatrace.models.standins import FusedSoftmaxKernels, FusedWeightGradient

    _orig_modules = {}
    # megatron.core.utils.drain_embedding_wgrad_compute (--defer-embedding-wgrad-compute)
    # imports Apex's extension by name at call time.
    modules = {
        **FusedSoftmaxKernels.modules(),
        "fused_weight_gradient_mlp_cuda": FusedWeightGradient.module(),
    }
    try:
        for name, module in modules.items():
            _orig_modules[name] = sys.modules.get(name)
            sys.modules[name] = module
        yield
    finally:
        for name, module in _orig_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@contextlib.contextmanager
def _dynamo_disabled():
    """megatron-core decorates its fused kernels with torch.compile (megatron.core.jit);
    compiling for meta tensors is slow and pointless, and the autograd functions around those
    kernels decide what is saved for backward, so eager execution keeps the same tensors.
    Deferred ones (guards.import_megatron_core) run eagerly; with megatron-core imported before,
    dynamo is disabled (never imported here: that alone takes a second)."""
    dynamo = guards.imported_dynamo()
    _orig_disable = dynamo.config.disable if dynamo is not None else None
    if dynamo is not None:
        dynamo.config.disable = True
    guards.EAGER[0] += 1
    try:
        yield
    finally:
        guards.EAGER[0] -= 1
        if dynamo is not None:
            dynamo.config.disable = _orig_disable


_COALESCED = (
    "allreduce_coalesced_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_tensor_coalesced_",
)
_META_DEPTH = [0]  # megatron_patches nests when a config is checked inside a trace


@contextlib.contextmanager
def _meta_kernels():
    """Meta kernels torch 2.13 lacks: the coalesced c10d collectives (it registers 16 c10d
    operators, see torch/distributed/_meta_registrations.py; Transformer Engine's FP8
    all-gathers and megatron-core's DDP issue them), aten::masked_select, whose output size
    depends on the mask's values (metatrace.models.moe sizes it for MoE routing maps), and
    fast weight initialisation (meta_kernels.init_fills_meta_library)."""
    from torch.distributed._meta_registrations import create_fakework

    libs = []
    if not _META_DEPTH[0]:
        lib = torch.library.Library("c10d", "IMPL")
        for op in _COALESCED:
            lib.impl(op, lambda *args: create_fakework(args, return_first_arg=False), "Meta")
        libs = [
            lib,
            meta_kernels.masked_select_meta_library(),
            meta_kernels.init_fills_meta_library(),
        ]
    _META_DEPTH[0] += 1
    try:
        yield
    finally:
        _META_DEPTH[0] -= 1
        for lib in libs:
            lib._destroy()


@contextlib.contextmanager
def _nvte_env_isolated():
    """megatron-core's LanguageModule writes NVTE_*_ATTN from config.attention_backend and
    asserts that values already set agree; one trace must not leak them into the next."""
    _orig_env = {name: os.environ.pop(name, None) for name in _NVTE_ENV}
    try:
        yield
    finally:
        for name, value in _orig_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _nominal_fp8_grad_dtype(orig):
    def __init__(self, ddp_config, param_dtype, grad_dtype, *args, **kwargs):
        if grad_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            grad_dtype = torch.bfloat16  # metatrace's FP8 training is over bf16 parameters
        orig(self, ddp_config, param_dtype, grad_dtype, *args, **kwargs)

    return __init__


TE_RELEASE = (2, 8)
"""The Transformer Engine release metatrace's stand-ins restate (models/te_*.py)."""


def _te_min_version(orig):
    def is_te_min_version(version, check_equality=True):
        if _te_installed():  # a real run on a GPU
            return orig(version, check_equality)
        wanted = tuple(int(n) for n in str(version).split(".")[:2])
        return TE_RELEASE >= wanted if check_equality else TE_RELEASE > wanted

    return is_te_min_version


def _te_installed() -> bool:
    """Whether Transformer Engine itself is installed (not te_optimizers_importable's modules)."""
    import importlib.util

    te = sys.modules.get("transformer_engine")
    if te is not None:
        return not getattr(te, "metatrace_standin", False)
    return importlib.util.find_spec("transformer_engine") is not None


@contextlib.contextmanager
def te_optimizers_importable():
    """megatron-core 0.16.1's OptimizerConfig.__post_init__ imports Transformer Engine's FusedAdam
    for the precision-aware optimizer, to check that it takes master_weight_dtype,
    exp_avg_dtype, exp_avg_sq_dtype and use_decoupled_grad; metatrace's stand-in
    (models/te_optim.py) does. The modules exist only while the config is built: elsewhere
    megatron-core decides by importing transformer_engine whether TE is there. Nothing changes
    where TE is installed."""
    import types

    if _te_installed():
        yield
        return
    from metatrace.models.te_optim import FusedAdam

    names = (
        "transformer_engine",
        "transformer_engine.pytorch",
        "transformer_engine.pytorch.optimizers",
    )
    modules = {name: types.ModuleType(name) for name in names}
    for module in modules.values():
        module.metatrace_standin = True
    modules["transformer_engine"].pytorch = modules["transformer_engine.pytorch"]
    modules["transformer_engine.pytorch"].optimizers = modules[
        "transformer_engine.pytorch.optimizers"
    ]
    modules["transformer_engine.pytorch.optimizers"].FusedAdam = FusedAdam
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


def _fresh_offload_manager():
    """megatron-core's offload manager is a process-wide singleton that learns the group order of
    the micro-batches it sees: one trace must not hand it on to the next."""
    from metatrace.hooks.offload import fresh_manager

    return fresh_manager()


@contextlib.contextmanager
def megatron_patches(*, compiled: bool = True, optimizer: str = "te"):
    """Everything above, applied together and restored on exit (also on error), once the
    installed megatron-core is checked (check_megatron_core); `compiled`: megatron-core's
    torch.compile'd kernels allocate as compiled (COMPILED_PATCHES); `optimizer`: the run's
    optimizer implementation (training.optimizer_impl): te and apex run the fused stand-ins,
    torch megatron-core's fallback to torch.optim (TORCH_OPTIMIZER_PATCHES)."""
    release = check_megatron_core()
    attributes = (
        PATCHES
        + (COMPILED_PATCHES if compiled else ())
        + (TORCH_OPTIMIZER_PATCHES if optimizer == "torch" else FUSED_OPTIMIZER_PATCHES)
    )
    with contextlib.ExitStack() as stack:
        for instrument in (
            _nvte_env_isolated,
            _meta_kernels,
            _extension_modules,
            _dynamo_disabled,
            functools.partial(patched, attributes, release),
            _fresh_offload_manager,
        ):
            stack.enter_context(instrument())
        yield
