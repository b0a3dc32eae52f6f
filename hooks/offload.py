"""megatron-core's fine-grained activation offloading on meta: the stand-ins hooks/patches.py
installs, and the log of what the offload manager moved.

megatron-core 0.16.1 (pipeline_parallel/fine_grained_activation_offload.py, --fine-grained-
activation-offloading --offload-modules ...) runs unchanged; what fails without a GPU, or would be
recorded wrongly, is replaced (measured with torch 2.13's CPU build):
- ChunkOffloadHandler.offload: its pinned host buffer (`torch.empty(..., pin_memory=True)`)
  needs an accelerator, `copy_` out of a meta tensor raises, and a real host copy would take
  host RAM in the tracer. A `HostCopy` (shape, dtype) stands for it: no device storage, so the
  recorder sees the GPU source die when the manager drops it (or resize_(0)s it), where a GPU
  frees it. The `.contiguous()` temporary stays (a GPU makes it too);
- ChunkOffloadHandler.reload: the GPU copy is `torch.empty` on the source device (the
  allocation the caching allocator sees), without the copy;
- PipelineOffloadManager.on_save_for_backward: torch applies only the innermost pair of
  saved-tensor hooks, so the recorder's (or `metatrace measure`'s) hooks would not see what is
  saved inside an offload group. The hooks that were on top when the manager pushed its own are
  called first, and what they return is kept as long as the manager keeps the GPU tensor;
- on CUDA tensors (`metatrace measure --device cuda`) the original offload and reload run.

Known limitations: reloads are not timed (a GPU waits for late ones, `on_group_commit_backward`);
the pinned host figure assumes PyTorch's caching host allocator rounding every block up to a
power of two (torch 2.x default) and no sharing of blocks between sizes.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, replace

import torch

from metatrace.hooks import remap
from metatrace.records import Moved, OffloadRecord

_OUTER = "_metatrace_outer"  # attribute on the manager (a stack) and on offload groups (a dict)


@dataclass(frozen=True)
class HostCopy:
    """The pinned host buffer of one offloaded tensor, without the host memory."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    moved: int | None = None
    """Its place in the OffloadLog's `moved` (None when no log was open)."""


_LOGS: list[OffloadLog] = []


class OffloadLog:
    """While entered, the offload stand-ins log into it; `record()` returns what they saw.
    `recorder` gives the storage ids (metatrace.hooks.recorder.Recorder)."""

    def __init__(self, recorder=None):
        self.recorder = recorder
        self.moved: list[Moved] = []
        self.reloads: set[int] = set()
        self.groups: tuple[tuple[str, ...], ...] = ()

    def __enter__(self) -> OffloadLog:
        _LOGS.append(self)
        return self

    def __exit__(self, *exc) -> bool:
        _LOGS.remove(self)
        manager = _manager_class().OFFLOAD_MGR
        handlers = manager._cached_chunks_forward if manager is not None else []
        self.groups = tuple(tuple(g._name for g in h.offload_groups) for h in handlers)
        return False

    def storage(self, t: torch.Tensor) -> int | None:
        return self.recorder.storage_of(t) if self.recorder is not None else None

    def record(self) -> OffloadRecord:
        return OffloadRecord(tuple(self.moved), self.groups, frozenset(self.reloads))


def _manager_class():
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    return fgo.PipelineOffloadManager


def reset_manager() -> None:
    """Forget megatron-core's offload manager (a process-wide singleton): its handlers cache the
    group order of the micro-batches it saw, and its warm-up flag says whether it learnt it."""
    _manager_class().OFFLOAD_MGR = None


_DEPTH = [0]


@contextlib.contextmanager
def fresh_manager():
    """A new offload manager for what runs inside (megatron_patches nests: only the outermost
    resets)."""
    if not _DEPTH[0]:
        reset_manager()
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1
        if not _DEPTH[0]:
            reset_manager()


# ----------------------------------------------------------------------------- the stand-ins
# Each takes the original it replaces (hooks/patches.py keeps it and puts it back).


def offload(orig):
    def offload(self, src_tensor, pin_memory=True, use_cpu_pool=True):
        moved = _log_moved(self, src_tensor) if _LOGS else None
        if src_tensor.is_cuda:
            return orig(self, src_tensor, pin_memory=pin_memory, use_cpu_pool=use_cpu_pool)
        if not src_tensor.is_contiguous():
            src_tensor = src_tensor.contiguous()  # a device temporary, as on the GPU
        host = HostCopy(tuple(src_tensor.shape), src_tensor.dtype, moved)
        return (src_tensor.device, host, use_cpu_pool)

    return offload


def _log_moved(handler, t: torch.Tensor) -> int:
    """Log `t` as moved by `handler`'s pending group; its place in the log."""
    manager = _manager_class().get_instance()
    handlers = manager._cached_chunks_forward
    group = handler._groups_to_offload[-1]
    chunk = handlers.index(handler) if handler in handlers else -1
    _append(chunk, handler.offload_groups.index(group), group._name, t)
    return len(_LOGS[-1].moved) - 1


def log_layer_offload(group: int, t: torch.Tensor) -> None:
    """Transformer Engine's layer-wise offloading (metatrace.models.te_cpu_offload) copies `t`,
    saved by transformer layer `group`, to the host."""
    if _LOGS:
        _append(0, group, "layer", t)


def _append(chunk: int, group: int, name: str, t: torch.Tensor) -> None:
    log = _LOGS[-1]
    log.moved.append(
        Moved(
            chunk=chunk,
            group=group,
            name=name,
            shape=tuple(t.shape),
            dtype=str(t.dtype).removeprefix("torch."),
            bytes=t.numel() * t.element_size(),
            source=log.storage(t),
        )
    )


def reload(orig):
    def reload(self, state, non_blocking=None):
        device, host, _ = state
        if isinstance(host, HostCopy):
            gpu_tensor = torch.empty(host.shape, dtype=host.dtype, device=device)
        else:
            gpu_tensor = orig(self, state, non_blocking=non_blocking)
        if _LOGS:
            log = _LOGS[-1]
            sid = log.storage(gpu_tensor)
            if sid is not None:
                log.reloads.add(sid)
                if isinstance(host, HostCopy) and host.moved is not None:
                    log.moved[host.moved] = replace(log.moved[host.moved], reload=sid)
        return gpu_tensor

    return reload


def manager_enter(orig):
    def __enter__(self):
        # The hooks on top now are the ones the manager's own will hide (when the manager
        # nests in itself, the ones it found the first time).
        stack = self.__dict__.setdefault(_OUTER, [])
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and isinstance(getattr(top[0], "__self__", None), type(self)):
            top = stack[-1] if stack else None
        stack.append(top)
        return orig(self)

    return __enter__


def manager_exit(orig):
    def __exit__(self, *args):
        try:
            return orig(self, *args)
        finally:
            stack = self.__dict__.get(_OUTER)
            if stack:
                stack.pop()

    return __exit__


def manageable(orig):
    """megatron-core 0.19's ChunkOffloadHandler._can_manage_tensor_for_offload with the tensors
    that stand for CUDA ones (meta in a trace, CPU in `metatrace measure`) taken for them (the
    check keeps host tensors and parameters out of the offload groups). Restates
    megatron.core.pipeline_parallel.fine_grained_activation_offload.ChunkOffloadHandler._can_manage_tensor_for_offload
    (source sha256: 2211880f4e3e; since 0.19)."""

    def _can_manage_tensor_for_offload(tensor):
        stray = (
            torch._subclasses.fake_tensor.FakeTensor,
            torch._subclasses.functional_tensor.FunctionalTensor,
        )
        return (
            not isinstance(tensor, torch.nn.Parameter)
            and not isinstance(tensor, stray)
            and remap.is_cuda(tensor.device)
        )

    return staticmethod(_can_manage_tensor_for_offload)


def on_save(orig):
    def on_save_for_backward(self, tensor):
        stack = self.__dict__.get(_OUTER)
        outer = stack[-1] if stack else None
        packed = outer[0](tensor) if outer is not None else None
        tag = orig(self, tensor)
        if outer is not None and isinstance(tag, tuple):  # 0.19 passes parameters through
            group = self.cur_forward_chunk().offload_groups[tag[0] - 1]
            group.__dict__.setdefault(_OUTER, {})[tag] = packed
        return tag

    return on_save_for_backward


def push_tensor(orig):
    def push_tensor(self, tag, tensor):
        orig(self, tag, tensor)
        if isinstance(tensor, tuple):  # offloaded: the GPU tensor is no longer the group's
            self.__dict__.get(_OUTER, {}).pop(tag, None)

    return push_tensor


def pop_tensor(orig):
    def pop_tensor(self, tag):
        self.__dict__.get(_OUTER, {}).pop(tag, None)
        return orig(self, tag)

    return pop_tensor


def cpu_offload(orig):
    # TE 2.20's own modules read another flag unless NVTE_CPU_OFFLOAD_V1=1, so the one
    # megatron-core sets changes nothing they save.
    return orig if orig is not None else types.SimpleNamespace(CPUOffloadEnabled=False)
