"""What Transformer Engine 2.8 keeps for the life of a process, and the weight gradient its
linear modules return (module/base.py: get_workspace, get_dummy_wgrad; fuse_wgrad_accumulation).

Shared by the linear stand-ins of metatrace.models.te_linear and their FP8 path
(metatrace.models.te_fp8_linear), TE's grouped and fused-MLP ops, and megatron-core's router
GEMM (metatrace.models.moe); it sits below all of them so that none needs another's module.
"""

from __future__ import annotations

import contextlib

import torch


class _Process:
    """What Transformer Engine keeps in module globals for the life of a process (module/base.py):
    the cuBLAS workspace and the dummy weight gradients. One per traced rank (`te_process`)."""

    installed = True
    workspace: torch.Tensor | None = None
    dummy_wgrads: dict = {}


_PROCESS = _Process()


@contextlib.contextmanager
def te_process(installed: bool = True):
    """A fresh TE process state while active; `installed` says whether the simulated run has
    Transformer Engine (megatron-core's own layers then take TE's dummy weight gradients)."""
    global _PROCESS
    saved, _PROCESS = _PROCESS, _Process()
    _PROCESS.installed = installed
    _PROCESS.dummy_wgrads = {}
    try:
        yield _PROCESS
    finally:
        _PROCESS = saved


def te_installed() -> bool:
    """Whether the simulated run has Transformer Engine (see te_process)."""
    return _PROCESS.installed


def te_workspace(module, device) -> None:
    """Transformer Engine's cuBLAS workspace (get_workspace): allocated by the first TE GEMM and
    kept: 32 MiB + 1 KiB on sm90 and later, 4 MiB before (TE 2.8)."""
    if _PROCESS.workspace is not None:
        return
    config = getattr(module, "config", None)
    arch = getattr(config, "metatrace_gpu_arch", "sm90")
    hopper_or_later = arch.startswith("sm") and int(arch[2:]) >= 90
    nbytes = 32 * 1024 * 1024 + 1024 if hopper_or_later else 4_194_304
    _PROCESS.workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)


def get_dummy_wgrad(shape: list, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """TE's get_dummy_wgrad: one [out, in] tensor per shape and dtype, allocated once and kept.
    Without TE (`te_process(installed=False)`), megatron-core allocates a new one per call."""
    if not _PROCESS.installed:
        make = torch.zeros if zero else torch.empty
        return make(tuple(shape), dtype=dtype, device=torch.cuda.current_device())
    key = (*shape, dtype)
    if key not in _PROCESS.dummy_wgrads:
        _PROCESS.dummy_wgrads[key] = torch.empty(
            tuple(shape), dtype=dtype, device=torch.cuda.current_device()
        )
    return _PROCESS.dummy_wgrads[key].detach()


def te_wgrad(module, weight, compute, *args, **kwargs):
    """The weight gradient TE's backward returns. With gradient-accumulation fusion
    (fuse_wgrad_accumulation, on when megatron-core's DDP gives the weight a main_grad) the
    wgrad GEMM accumulates into main_grad in place and TE returns get_dummy_wgrad's tensor;
    megatron-core's DDP hook then skips its own accumulation (grad_added_to_main_grad).
    Otherwise `compute(*args, **kwargs)` makes the gradient."""
    if not fuses_wgrad(module, weight):
        return compute(*args, **kwargs)
    weight.grad_added_to_main_grad = True
    return get_dummy_wgrad(list(weight.main_grad.shape), weight.dtype)


def fuses_wgrad(module, weight) -> bool:
    """Whether TE accumulates `weight`'s gradient straight into DDP's main_grad
    (fuse_wgrad_accumulation, with megatron-core's DDP having given the weight one)."""
    config = getattr(module, "config", None)
    return (
        config is not None
        and config.gradient_accumulation_fusion
        and hasattr(weight, "main_grad")
        and hasattr(weight, "grad_added_to_main_grad")
    )
