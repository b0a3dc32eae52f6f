"""Every patch of megatron-core (and the one torch setting) metatrace needs, in one place.

Each patch says which versions need it and why. `megatron_patches()` applies them all and
restores every original on exit, also on error. The originals are kept next to the patches
(`_orig`), so nothing is lost by applying twice.

Measured with megatron-core 0.16.1 and torch 2.13.0 (../shared/notes/megatron-on-meta.md).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Patch:
    module: str
    target: str
    """Attribute path inside the module, e.g. "CudaRNGStatesTracker.fork"."""
    make: Callable[[Any], Any]
    """Builds the replacement from the original."""
    versions: str
    why: str


def _null_fork(orig):
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
        "0.12-0.16",
        "fork swaps the CUDA generator's state (torch.cuda.default_generators), which does not "
        "exist without CUDA; random numbers do not matter on meta.",
    ),
    Patch(
        "megatron.core.tensor_parallel.random",
        "_get_cuda_rng_state",
        _rng_state,
        "0.12-0.16",
        "activation checkpointing saves the CUDA RNG state before a checkpointed forward.",
    ),
    Patch(
        "megatron.core.tensor_parallel.random",
        "_set_cuda_rng_state",
        _no_op,
        "0.12-0.16",
        "activation checkpointing restores the CUDA RNG state before recomputing.",
    ),
    Patch(
        "megatron.core.tensor_parallel.random",
        "CheckpointWithoutOutput.__init__",
        _fixed_checkpoint_init,
        "0.16.1",
        "bug: `self.fp8 = fp8 is not None` is True for fp8=False, which then reaches Transformer "
        "Engine's FP8GlobalStateManager (a NameError without TE); force bool(fp8).",
    ),
    Patch(
        "megatron.core.models.common.embeddings.rope_utils",
        "fused_apply_rotary_pos_emb",
        _standin("metatrace.models.fusions", "fused_apply_rotary_pos_emb"),
        "0.12-0.16",
        "bound from Transformer Engine at import (None without it); RoPE fusion, on by default "
        "in Megatron-LM, calls it.",
    ),
    Patch(
        "megatron.core.models.common.language_module.language_module",
        "te_parallel_cross_entropy",
        _standin("metatrace.models.fusions", "te_parallel_cross_entropy"),
        "0.14-0.16",
        "bound from Transformer Engine at import (None without it); used with "
        "cross_entropy_fusion_impl='te'.",
    ),
)

# megatron-core's LanguageModule writes these from config.attention_backend and asserts that
# any value already set agrees; one trace must not leak them into the next.
_NVTE_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def _resolve(patch: Patch):
    owner = importlib.import_module(patch.module)
    *path, attr = patch.target.split(".")
    for name in path:
        owner = getattr(owner, name)
    return owner, attr


@contextlib.contextmanager
def megatron_patches():
    """Apply every patch in PATCHES, provide the CUDA extensions megatron-core imports by name
    (stand-ins from metatrace.models.standins) and disable torch.compile; restore all on exit."""
    import sys

    import torch._dynamo

    from metatrace.models.standins import FusedSoftmaxKernels

    import os

    applied = []
    _orig_env = {name: os.environ.pop(name, None) for name in _NVTE_ENV}
    # megatron-core 0.12-0.16 import Apex's fused softmax extensions inside FusedScaleMaskSoftmax
    # (fusions/fused_softmax.py); without them the local spec's attention cannot run.
    _orig_modules = {}
    for name, module in FusedSoftmaxKernels.modules().items():
        _orig_modules[name] = sys.modules.get(name)
        sys.modules[name] = module
    # megatron-core decorates its fused kernels with torch.compile (megatron.core.jit); compiling
    # for meta tensors is slow and pointless, and the autograd functions around those kernels
    # decide what is saved for backward, so eager execution keeps the same tensors.
    _orig_dynamo_disable = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        for patch in PATCHES:
            owner, attr = _resolve(patch)
            _orig = owner.__dict__[attr] if attr in owner.__dict__ else getattr(owner, attr)
            setattr(owner, attr, patch.make(_orig))
            applied.append((owner, attr, _orig))
        yield
    finally:
        for owner, attr, _orig in reversed(applied):
            setattr(owner, attr, _orig)
        torch._dynamo.config.disable = _orig_dynamo_disable
        for name, module in _orig_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        for name, value in _orig_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
