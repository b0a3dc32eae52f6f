"""Transformer Engine 2.8's layer-wise CPU activation offloading (pytorch/cpu_offload.py), the
one megatron-core 0.16.1 uses with --cpu-offloading-num-layers (TransformerBlock takes
`get_cpu_offload_context` from TE; without TE it asserts the option off).

TE's `AsyncDoubleBufferGroupOffloadHandler` is restated without its CUDA streams:
- each transformer layer is a group; what a layer saves for backward inside the context goes
  through the handler, which offloads the tensors marked with `activation_offloading` (TE's
  modules and megatron-core's mark them: `mark_activation_offload` below, called by the
  stand-ins where TE calls it) of the first `num_layers` groups. The others stay where autograd
  would keep them;
- offloads are issued group by group and the GPU copies dropped at the window TE computes
  (`layer_window_map`: with 40 of 80 layers, group j's copies die after layer 2j+1's forward);
- in backward the same windows bring a group back ahead of its use (group j comes back before
  layer 2j+1's backward and lives until layer j's): `torch.empty_like` on the device, the
  allocation TE's `bulk_reload_group` makes;
- a host copy is a `HostCopy` (no storage) on meta and CPU; on CUDA tensors the real pinned
  copy and reload run.

What the context hides: torch applies only the innermost pair of saved-tensor hooks, so the
recorder's (or `metatrace measure`'s) would not see what a layer saves. The pair on top when the
context is entered is called first, and what it returned is kept as long as the handler keeps
the GPU tensor (metatrace.hooks.offload does the same for megatron-core's fine-grained
offloading).

Not modelled: double buffering (megatron-core's cpu_offloading_double_buffering, no Megatron-LM
flag), deprecated weight offloading (TE 2.8 ignores it), the copies' timing.
"""

from __future__ import annotations

import torch

from metatrace.hooks.offload import HostCopy, log_layer_offload

CPUOffloadEnabled = False
"""TE's module flag: set while a layer runs inside the offload context."""


def is_cpu_offload_enabled() -> bool:
    return CPUOffloadEnabled


def mark_activation_offload(*tensors) -> None:
    """TE's mark_activation_offload: the handler offloads these when their layer is offloaded."""
    for t in tensors:
        if t is not None:
            t.activation_offloading = True


def mark_if_offloading(*tensors) -> None:
    """What TE's modules do: `if cpu_offloading: mark_activation_offload(...)`."""
    if CPUOffloadEnabled:
        mark_activation_offload(*tensors)


def _needs_offloading(t) -> bool:
    return hasattr(t, "activation_offloading")


def _window_map(num_offload_group: int, num_layers: int) -> dict[int, int]:
    """TE's layer_window_map: after which layer's forward group i's GPU copies are dropped (and
    before which layer's backward it comes back)."""
    windows, constant = {}, 0
    for i in range(num_offload_group):
        windows[i] = (num_layers // num_offload_group) * (i + 1) - 1
        if i < num_layers % num_offload_group:
            windows[i] += i + 1
            constant = i + 1
        else:
            windows[i] += constant
    return windows


def _offload(t: torch.Tensor):
    if t.is_cuda:
        host = torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        return (t.device, host)
    return (t.device, HostCopy(tuple(t.shape), t.dtype))


def _reload(state) -> torch.Tensor:
    device, host = state
    if isinstance(host, HostCopy):
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    return host.to(device, non_blocking=True)


class OffloadHandler:
    """TE 2.8's AsyncDoubleBufferGroupOffloadHandler (no double buffering, no streams)."""

    def __init__(self, num_offload_group: int, num_model_group: int):
        self.num_offload_group = num_offload_group
        self.num_layers = num_model_group
        self.layer_window_map = _window_map(num_offload_group, num_model_group)
        self.current_group = 0
        self.tensor_count_current_group = 0
        self.tensor_tag_to_state: dict = {}
        self.tensor_tag_to_buf: dict = {}
        self.offloaded_group_count = 0
        self.outer: dict = {}
        """{tag: what the saved-tensor hooks beneath returned}, while the GPU tensor is kept."""

    def tensor_push(self, tensor: torch.Tensor, outer=None):
        tag = (self.current_group, self.tensor_count_current_group)
        self.tensor_count_current_group += 1
        self.tensor_tag_to_state[tag] = tensor
        if self.current_group < self.num_offload_group and _needs_offloading(tensor):
            self.tensor_tag_to_buf[tag] = tensor
        if outer is not None:
            self.outer[tag] = outer
        return tag

    def tensor_pop(self, tag):
        tensor = self.tensor_tag_to_state.pop(tag)
        self.tensor_tag_to_buf.pop(tag, None)
        self.outer.pop(tag, None)
        assert not isinstance(tensor, tuple), "reloaded in on_group_commit_backward"
        return tensor

    def bulk_offload_group(self, group: int) -> None:
        for tag, state in self.tensor_tag_to_state.items():
            if tag[0] == group and _needs_offloading(state):
                log_layer_offload(group, state)
                self.tensor_tag_to_state[tag] = _offload(state)

    def on_group_commit_forward(self) -> None:
        current = self.current_group
        if current == 0:
            self.bulk_offload_group(0)
        if self.layer_window_map.get(self.offloaded_group_count) == current:
            for tag in self.tensor_tag_to_buf:
                if tag[0] == self.offloaded_group_count:
                    self.tensor_tag_to_buf[tag] = None  # the GPU copy is dropped here
                    self.outer.pop(tag, None)
            if self.offloaded_group_count < self.num_offload_group - 1:
                self.bulk_offload_group(self.offloaded_group_count + 1)
            self.offloaded_group_count += 1
        self.current_group += 1
        self.tensor_count_current_group = 0

    def bulk_reload_group(self, group: int) -> None:
        for tag, state in self.tensor_tag_to_state.items():
            if tag[0] == group and isinstance(state, tuple):
                self.tensor_tag_to_state[tag] = _reload(state)

    def on_group_commit_backward(self) -> None:
        self.current_group -= 1
        assert self.current_group >= 0
        count = self.offloaded_group_count
        if count and self.layer_window_map[count - 1] == self.current_group:
            self.bulk_reload_group(count - 1)
            self.offloaded_group_count -= 1 if count > 1 else 0
        if self.current_group == 0:
            self.offloaded_group_count = 0


class OffloadContext:
    """TE's CpuOffloadHookWithOffloadHandler: the saved-tensor hooks around a layer's forward."""

    def __init__(self, handler: OffloadHandler):
        self.handler = handler
        self.inside_context = False
        self._beneath: list = []

    def __enter__(self):
        global CPUOffloadEnabled
        CPUOffloadEnabled = True
        self.inside_context = True
        self._beneath.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)

    def __exit__(self, *args):
        global CPUOffloadEnabled
        CPUOffloadEnabled = False
        self.inside_context = False
        torch._C._autograd._pop_saved_tensors_default_hooks()
        self._beneath.pop()

    def _pack(self, tensor):
        beneath = self._beneath[-1] if self._beneath else None
        outer = beneath[0](tensor) if beneath is not None else None
        return self.handler.tensor_push(tensor, outer)

    def _unpack(self, tag):
        return self.handler.tensor_pop(tag)


class _GroupCommit(torch.autograd.Function):
    """TE's GroupCommitFunction: the identity, marking the end of a layer both ways."""

    @staticmethod
    def forward(ctx, tensor, handler):
        handler.on_group_commit_forward()
        ctx.handler = handler
        return tensor

    @staticmethod
    def backward(ctx, grad):
        ctx.handler.on_group_commit_backward()
        return grad, None


def get_cpu_offload_context(
    enabled,
    num_layers,
    model_layers,
    offload_activations,
    offload_weights,
    double_buffering,
    retain_pinned_cpu_buffers=False,
):
    """megatron-core's get_cpu_offload_context over TE >= 2.5 (extensions/transformer_engine.py):
    the context for each layer's forward and the commit after it. megatron-core 0.19 passes
    retain_pinned_cpu_buffers (TE >= 2.10 keeps its pinned host buffers between iterations):
    host memory only, nothing on the GPU."""
    from contextlib import nullcontext

    if not offload_weights and not offload_activations:
        raise ValueError(
            "CPU Offloading is enabled while it is not mentioned what to offload "
            "(weights/activations)"
        )
    if offload_weights and not offload_activations:
        return nullcontext(), lambda x: x  # deprecated: no effect in TE 2.8
    handler = OffloadHandler(num_layers, model_layers)

    def commit(tensor):
        return _GroupCommit.apply(tensor, handler)

    if enabled:
        return OffloadContext(handler), commit
    return nullcontext(), commit
