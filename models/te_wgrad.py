"""Transformer Engine 2.8's WeightGradStore (module/_common.py) for the stand-ins.

With megatron-core's delay_wgrad_compute (only with overlap_moe_expert_parallel_comm) TE's
GroupedLinear backward computes the input gradient only and `put`s what the weight gradients
need: the per-expert inputs it saved, the output gradient and the wgrad list (main_grad itself
under gradient-accumulation fusion; grouped_linear.py:408). They stay alive until megatron-core's
combined 1F1B calls the module's `backward_dw` (model_chunk_schedule_plan.py:250,
fine_grained_callables.py:303), which `pop`s them, runs the GEMMs and then DDP's gradient hook
(registered on the module: distributed_data_parallel.py:328, the parameters marked
skip_backward_post_hook, grouped_linear.py:662).

The stand-ins call `put(module, tensors, flops)` in backward when `delays(module)`, and `pop` in
backward_dw: the tensors live in between, and the wgrad FLOPs are counted when they run.
"""

from __future__ import annotations

from collections import deque

from metatrace.hooks import flops

_STORE = "_metatrace_wgrad_store"
_HOOKS = "_metatrace_wgrad_hooks"


def delays(module) -> bool:
    """Whether `module` (a stand-in with a megatron-core config) delays its weight gradients."""
    return bool(getattr(getattr(module, "config", None), "delay_wgrad_compute", False))


def mark(module, params) -> None:
    """TE marks the delayed parameters so that megatron-core's DDP hooks the module instead."""
    for p in params:
        p.skip_backward_post_hook = True


def put(module, tensors, wgrad_flops: int, fp8: bool = False, fp4: bool = False) -> None:
    """Keep `tensors` until the module's backward_dw; count `wgrad_flops` (FP8 or FP4 GEMMs or
    neither) then."""
    store = module.__dict__.setdefault(_STORE, deque())
    store.append((tuple(tensors), wgrad_flops, fp8, fp4))


def register_hook(module, hook) -> None:
    """megatron-core's DDP registers its gradient hook of a skipped parameter here."""
    module.__dict__.setdefault(_HOOKS, []).append(hook)


def pop(module) -> None:
    """backward_dw: the oldest stored weight-gradient computation runs (its FLOPs counted, its
    tensors released), then DDP's gradient hooks."""
    store = module.__dict__.get(_STORE)
    if not store:
        return
    tensors, wgrad_flops, fp8, fp4 = store.popleft()
    flops.report(wgrad_flops, fp8=fp8, fp4=fp4)
    del tensors
    for hook in module.__dict__.get(_HOOKS, ()):
        hook()


def pending(module) -> int:
    """Stored computations not yet run (tests: every put has its backward_dw)."""
    return len(module.__dict__.get(_STORE, ()))
