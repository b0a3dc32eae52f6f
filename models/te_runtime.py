"""What Transformer Engine 2.8 keeps for the life of a process, and the weight gradient its
linear modules return (module/base.py: get_workspace, get_dummy_wgrad; fuse_wgrad_accumulation).

Shared by the linear stand-ins of metatrace.models.te_linear and their FP8 path
(metatrace.models.te_fp8_linear), TE's grouped and fused-MLP ops, and megatron-core's router
GEMM (metatrace.models.moe); it sits below all of them so that none needs another's module.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from metatrace.config.hardware import te_workspace_bytes
from metatrace.config.userbuffers import UbError
from metatrace.hooks import flops
from metatrace.hooks.collectives import overlapped

UB_OVERLAP = "GEMM (userbuffers)"
"""What TE's userbuffers overlap their collectives with (the recorder's mark)."""


class _Process:
    """What Transformer Engine keeps in module globals for the life of a process (module/base.py):
    the cuBLAS workspace and the dummy weight gradients. One per traced rank (`te_process`)."""

    installed = True
    workspace: torch.Tensor | None = None
    dummy_wgrads: dict = {}
    userbuffers: dict[str, torch.Tensor] = {}
    """TE's userbuffers by GEMM name (initialize_ub): flat byte buffers outside PyTorch's
    allocator; the linear stand-ins gather into views of them."""
    margins: dict[str, int] = {}
    """Multiprocessors each userbuffer's GEMM leaves to its collective, by GEMM name."""
    element_bytes: dict[str, int] = {}
    """Bytes of each userbuffer's elements, by GEMM name: 1 for FP8 buffers, else 2 (bf16)."""


_PROCESS = _Process()


@contextlib.contextmanager
def te_process(installed: bool = True, userbuffers=(), device=None):
    """A fresh TE process state while active; `installed` says whether the simulated run has
    Transformer Engine (megatron-core's own layers then take TE's dummy weight gradients).
    `userbuffers`: the buffers initialize_ub allocates (metatrace.config.userbuffers), made on
    `device` here, before any model exists, as Megatron-LM does."""
    global _PROCESS
    saved, _PROCESS = _PROCESS, _Process()
    _PROCESS.installed = installed
    _PROCESS.dummy_wgrads = {}
    _PROCESS.userbuffers = {
        b.name: torch.empty(b.nbytes, dtype=torch.uint8, device=device) for b in userbuffers
    }
    _PROCESS.margins = {b.name: b.margin for b in userbuffers}
    _PROCESS.element_bytes = {b.name: 1 if b.fp8 else 2 for b in userbuffers}
    try:
        yield _PROCESS
    finally:
        _PROCESS = saved


def te_installed() -> bool:
    """Whether the simulated run has Transformer Engine (see te_process)."""
    return _PROCESS.installed


def te_workspace(module, device) -> None:
    """Transformer Engine's cuBLAS workspace (get_workspace): allocated by the first TE GEMM and
    kept: 32 MiB + 1 KiB on sm90 and later, 4 MiB before (TE 2.8); with userbuffers,
    initialize_ub repeats it for its three streams."""
    if _PROCESS.workspace is not None:
        return
    config = getattr(module, "config", None)
    nbytes = te_workspace_bytes(getattr(config, "metatrace_gpu_arch", "sm90"))
    if _PROCESS.userbuffers:
        from metatrace.config.userbuffers import UB_STREAMS

        nbytes *= UB_STREAMS
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


def gemm_output(*args, **kwargs) -> torch.Tensor:
    """torch.zeros(*args, **kwargs) standing for a GEMM's output: written by the GEMM, whose
    time covers it (not timed again as a fill)."""
    return flops.unpriced(torch.zeros, *args, **kwargs)


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


def wgrad_into(module, weight):
    """What the wgrad GEMM adds its product into: main_grad under gradient-accumulation fusion
    (read and written at its dtype), else None (a fresh output)."""
    return weight.main_grad if fuses_wgrad(module, weight) else None


def userbuffer_tensors() -> list[torch.Tensor]:
    """The userbuffers of the current TE process: memory outside PyTorch's allocator."""
    return list(_PROCESS.userbuffers.values())


def ub_margin(mode, gemm: str) -> int:
    """Multiprocessors a linear stand-in's `gemm` (fprop, dgrad, wgrad) leaves to the collective
    its userbuffers run beside it (`mode`: the stand-in's _Mode; 0 where none does)."""
    beside = {
        "fprop": ("ag_fprop", "rs_fprop"),
        "dgrad": ("ag_dgrad", "rs_dgrad", "bulk_dgrad"),
        "wgrad": ("bulk_wgrad",),
    }[gemm]
    if mode.ub_name is None or not any(k in mode.ub for k in beside):
        return 0
    return _PROCESS.margins.get(f"{mode.ub_name}_{gemm}", 0)


def userbuffer(name: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """A `shape` view of userbuffer `name` (TE's get_buffer): no allocation."""
    buf = _PROCESS.userbuffers[name]
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    if nbytes > buf.numel():
        raise RuntimeError(f"userbuffer {name} holds {buf.numel()} bytes, {nbytes} asked")
    return buf[:nbytes].view(dtype).view(tuple(shape))


def ub_all_gather(name: str, local: torch.Tensor, group, tp: int) -> torch.Tensor:
    """TE's fill_userbuffers_buffer_for_all_gather and the overlapped all-gather: `local`
    [M, ...] gathered into a [M x tp, ...] view of userbuffer `name`. TE copies `local` in
    with copy_into_buffer, which refuses elements of another size than the buffer's (an FP8
    buffer's 1 byte, a bf16 layer's 2: TE 2.8 csrc/extensions/comm_gemm_overlap.cpp:150-155);
    so does this, with the reason in the user's terms."""
    held = _PROCESS.element_bytes.get(name)
    if held is not None and local.element_size() != held:
        dtype = str(local.dtype).removeprefix("torch.")
        why = (
            "a layer that runs in bf16 (training.first_last_layers_bf16)"
            if held == 1
            else "a layer"
        )
        raise UbError(
            f"parallel.tp_comm_overlap: Transformer Engine's userbuffer {name} holds "
            f"{held}-byte {'FP8' if held == 1 else 'bf16'} elements, and {why} gathers "
            f"{local.element_size()}-byte {dtype} ones into it; TE 2.8 refuses the copy "
            "('dtypes are not compatible', comm_gemm_overlap.cpp), so the run fails at that "
            "layer. Turn off parallel.tp_comm_overlap"
            + (" or training.first_last_layers_bf16" if held == 1 else "")
        )
    out = userbuffer(name, (local.shape[0] * tp, *local.shape[1:]), local.dtype)
    with overlapped(UB_OVERLAP):
        dist.all_gather_into_tensor(out, local, group=group)
    return out


def ub_reduce_scatter(out: torch.Tensor, full: torch.Tensor, group) -> None:
    """A reduce-scatter TE's userbuffers run beside a GEMM."""
    with overlapped(UB_OVERLAP):
        dist.reduce_scatter_tensor(out, full, group=group)


def dgrad_and_input(mode, rows: int, in_features: int, dtype, device, gemm):
    """The dgrad GEMM of a TE linear stand-in (`mode`: its _Mode) and what becomes of it before
    the wgrad GEMM, as TE 2.8 does: returns (dgrad [rows, in], the input gradient). `gemm(out)`
    runs the GEMM into `out` (the wgrad userbuffer under bulk_wgrad) or, with out None, into a
    new tensor. With ub_overlap_rs_dgrad the reduce-scatter's output comes before the GEMM;
    under bulk_wgrad the input gradient is None: `bulk_reduced` makes it after the wgrad GEMM.
    Column parallel otherwise reduce-scatters (SP) or all-reduces dgrad in place."""
    dinput = None
    if "rs_dgrad" in mode.ub:
        dinput = torch.empty((rows // mode.tp, in_features), dtype=dtype, device=device)
    bulk = "bulk_wgrad" in mode.ub
    dgrad = gemm(userbuffer(f"{mode.ub_name}_wgrad", (rows, in_features), dtype) if bulk else None)
    if dinput is not None:
        ub_reduce_scatter(dinput, dgrad, mode.group)
    elif bulk:
        pass
    elif mode.parallel == "column" and mode.tp > 1 and mode.sequence_parallel:
        dinput = torch.empty((rows // mode.tp, in_features), dtype=dtype, device=device)
        dist.reduce_scatter_tensor(dinput, dgrad, group=mode.group)
    else:
        if mode.parallel == "column" and mode.tp > 1:
            dist.all_reduce(dgrad, group=mode.group)
        dinput = dgrad
    return dgrad, dinput


def bulk_reduced(mode, dgrad, dinput):
    """After the wgrad GEMM: under bulk_wgrad (dinput None) the reduce-scatter TE ran beside it,
    and the clone of the local chunk out of the userbuffer."""
    if dinput is not None:
        return dinput
    out = torch.empty(
        (dgrad.shape[0] // mode.tp, dgrad.shape[1]), dtype=dgrad.dtype, device=dgrad.device
    )
    ub_reduce_scatter(out, dgrad, mode.group)
    return out
