"""CUDA-to-meta remapping: run code written for CUDA on another device (meta, or the CPU).

megatron-core allocates with `device=torch.cuda.current_device()`, hard-codes `device="cuda"`,
calls `Tensor.cuda()`, pins memory, and uses CUDA streams and events in pipeline schedules.
`remap_cuda(device)` is a context manager that, while active,

- rewrites every CUDA device argument of a torch function (and `Tensor.cuda()` / `.to("cuda")`,
  and `torch.device("cuda")` / `torch.device(0)` themselves) to `device`, drops
  `pin_memory=True`; `Tensor.cuda()` of a host tensor makes a device copy;
  `Tensor.type()` of a device tensor answers with the CUDA type name;
- replaces the CUDA runtime entry points megatron-core calls (current_device, streams, events,
  synchronize, record_stream, RNG state) with stand-ins that do nothing;
- maps training-mode `F.dropout` with 0 < p < 1 to `torch.native_dropout`, the kernel CUDA runs
  for it, which keeps a 1-byte mask (eager dropout on meta or CPU keeps a noise tensor of the
  input's dtype instead).

Pitfall handled here: a TorchFunctionMode is off while its own handler runs, and backward passes
through the handler, so `Tensor.backward` / `torch.autograd.backward` are run from inside the
re-entered mode by calling the autograd engine directly (recomputed forwards in backward then
stay remapped).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
from torch.autograd import graph as _graph
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class _NullStream:
    """Stands in for torch.cuda.Stream and torch.cuda.Event: every call does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def query(self):
        return True


def _null_stream_ctx(*args, **kwargs):
    return contextlib.nullcontext()


# torch.cuda attributes replaced while remapping, with their stand-ins.
_CUDA_STANDINS = {
    "current_device": lambda: 0,
    "Stream": _NullStream,
    "Event": _NullStream,
    "current_stream": lambda *a, **k: _NullStream(),
    "default_stream": lambda *a, **k: _NullStream(),
    "stream": _null_stream_ctx,
    "synchronize": lambda *a, **k: None,
    "set_device": lambda *a, **k: None,
    "empty_cache": lambda *a, **k: None,
    "manual_seed": lambda *a, **k: None,
    "manual_seed_all": lambda *a, **k: None,
    "get_rng_state": lambda *a, **k: torch.zeros(16, dtype=torch.uint8),
    "set_rng_state": lambda *a, **k: None,
}


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _run_backward(func, args, kwargs):
    """`Tensor.backward` / `torch.autograd.backward` without passing through torch functions."""
    if func is torch.Tensor.backward:
        tensors = args[0]
        grads = kwargs.get("gradient", args[1] if len(args) > 1 else None)
        retain = kwargs.get("retain_graph", args[2] if len(args) > 2 else None)
        create = kwargs.get("create_graph", args[3] if len(args) > 3 else False)
    else:
        tensors = args[0] if args else kwargs["tensors"]
        grads = kwargs.get("grad_tensors", args[1] if len(args) > 1 else None)
        retain = kwargs.get("retain_graph", args[2] if len(args) > 2 else None)
        create = kwargs.get("create_graph", args[3] if len(args) > 3 else False)
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    grads = _make_grads(
        tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)), is_grads_batched=False
    )
    if retain is None:
        retain = create
    inputs = kwargs.get("inputs")
    if inputs is None:
        inputs = ()
    elif isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    else:
        inputs = tuple(inputs)
    _graph._engine_run_backward(
        tensors, grads, retain, create, inputs, allow_unreachable=True, accumulate_grad=True
    )


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class _RemapMode(TorchFunctionMode):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def factory_kwargs(self, kwargs: dict) -> dict:
        """A call's keyword arguments with a CUDA device made this mode's, pinning dropped."""
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": self.device}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return kwargs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = self.factory_kwargs(kwargs or {})
        if func is torch.device and args and _is_cuda(args[0]):
            # torch.device(torch.cuda.current_device()) (megatron-core's YarnRotaryEmbedding
            # enters it as a default-device context); torch.device(0) means "accelerator 0"
            # and raises without one.
            return self.device
        if func is torch.Tensor.cuda:
            return self._cuda(args[0], kwargs)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], self.device, *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return self._type_name(args[0])
        if func is torch.Tensor.record_stream or func is torch.Tensor.pin_memory:
            return None if func is torch.Tensor.record_stream else args[0]
        if func is F.dropout:
            return self._dropout(args, kwargs)
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            with self:
                return _run_backward(func, args, kwargs)
        return func(*args, **kwargs)

    def _cuda(self, t: torch.Tensor, kwargs) -> torch.Tensor:
        """`Tensor.cuda()`: a host tensor gets a device copy, a device tensor is returned as is.
        When the stand-in device is the CPU, host and device tensors look alike; every call then
        copies, as the host-to-device copies of the data loader do."""
        if t.device == self.device and self.device.type != "cpu":
            return t
        return t.to(self.device, copy=True, non_blocking=kwargs.get("non_blocking", False))

    def _type_name(self, t: torch.Tensor) -> str:
        """`Tensor.type()`: a tensor on the stand-in device names itself a CUDA tensor
        (megatron-core's optimizers accept only torch.cuda.{Half,BFloat16,Float}Tensor)."""
        name = torch.Tensor.type(t)
        if t.device != self.device:
            return name
        if t.dtype in _FP8_DTYPES:
            # metatrace's FP8 parameters stand for Transformer Engine's Float8Tensor, which the
            # optimizers put with the 16-bit parameters (an fp32 main copy per shard).
            return "torch.cuda.BFloat16Tensor"
        return "torch.cuda." + name.rsplit(".", 1)[-1]

    def _dropout(self, args, kwargs):
        x = args[0]
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
        inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
        if training and 0.0 < p < 1.0 and not inplace and x.device == self.device:
            return torch.native_dropout(x, p, True)[0]
        return F.dropout(*args, **kwargs)


def remap_mode(mode) -> bool:
    """Whether a torch-function mode is remap_cuda's."""
    return isinstance(mode, _RemapMode)


_STANDING_IN: list[str] = []


def is_cuda(device: torch.device) -> bool:
    """Whether a tensor on `device` is, for the code running, on a CUDA device: a CUDA device,
    or the one that stands in for CUDA while remap_cuda is active (meta in a trace, the CPU in
    `metatrace measure`)."""
    return device.type == "cuda" or (bool(_STANDING_IN) and device.type == _STANDING_IN[-1])


@contextlib.contextmanager
def remap_cuda(device: str | torch.device = "meta"):
    """While active, code written for CUDA runs on `device`. Restores everything on exit."""
    device = torch.device(device)
    _orig_cuda = {name: getattr(torch.cuda, name) for name in _CUDA_STANDINS}
    for name, standin in _CUDA_STANDINS.items():
        setattr(torch.cuda, name, standin)
    _STANDING_IN.append(device.type)
    try:
        with _RemapMode(device):
            yield device
    finally:
        _STANDING_IN.pop()
        for name, orig in _orig_cuda.items():
            setattr(torch.cuda, name, orig)
        _forget_null_streams()


# Streams megatron-core 0.16.1 creates once and keeps on a class: a stand-in created while
# remapping would outlive it and break a later run on a GPU in the same process (metatrace
# measure traces on meta, then runs on CUDA). (module, class, attribute)
_CLASS_STREAMS = (
    (
        "megatron.core.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher",
        "cuda_dtoh_stream",
    ),
    ("megatron.core.extensions.transformer_engine", "TEDotProductAttention", "cp_stream"),
)


def _forget_null_streams() -> None:
    import sys

    for module, cls, attr in _CLASS_STREAMS:
        owner = getattr(sys.modules.get(module), cls, None)
        if isinstance(getattr(owner, attr, None), _NullStream):
            setattr(owner, attr, None)


KNOWN = "_metatrace_known_value"
"""A tensor attribute: its value is set by metatrace and meaningful (torch.optim's step count),
so reading it on the stand-in device gives the value, not zero."""
_READ_BACK = {
    torch.Tensor.item: lambda zero: zero,
    torch.Tensor.__bool__: bool,
    torch.Tensor.__int__: int,
    torch.Tensor.__float__: float,
}


class _UnknownValues(TorchFunctionMode):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READ_BACK and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            if t.device == self.device and not getattr(t, KNOWN, False):
                from metatrace.hooks import host

                host.sync()  # a GPU would copy the value to the host and wait for it
                zero = False if t.dtype == torch.bool else 0.0 if t.is_floating_point() else 0
                return _READ_BACK[func](zero)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def unknown_values(device: str | torch.device = "meta"):
    """While active, reading a value of a tensor on `device` (which has none) back to the host
    (`item()`, `bool()`, `int()`, `float()`) answers 0.

    For code that reads a statistic back and only branches on it (the optimizer step's gradient
    norm, zero count and overflow flag; the token count of per-token loss): 0 means no overflow,
    no clipping, no rescaling, work that is in place and allocates nothing. Not for the model's
    own code, where a value could decide a shape."""
    with _UnknownValues(torch.device(device)):
        yield


# ATen operators that run on PyTorch's cuBLAS (or cuBLASLt) handle on a GPU.
_CUBLAS_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "mv",
        "addmv",
        "dot",
        "vdot",
        "_addmm_activation",
        "_scaled_mm",
        "_int_mm",
    }
)


_LIBRARY_KERNEL = [0]


@contextlib.contextmanager
def library_kernel():
    """Operators run inside stand for another library's kernel (a Transformer Engine GEMM on
    its own cuBLASLt handle and workspace, an Apex softmax), not for PyTorch's cuBLAS calls."""
    _LIBRARY_KERNEL[0] += 1
    try:
        yield
    finally:
        _LIBRARY_KERNEL[0] -= 1


class _CublasWorkspaces(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless this says no:
        # nothing here is compiled, and the wrapper costs microseconds on every operator.
        return False

    def __init__(self, device: torch.device, nbytes: int):
        super().__init__()
        self.device = device
        self.nbytes = nbytes
        self.held: dict[str, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._opname in _CUBLAS_OPS and self.nbytes and not _LIBRARY_KERNEL[0]:
            # Forward runs on the Python thread; backward (and recomputation inside it) on the
            # autograd engine's device thread, which has a cuBLAS handle of its own.
            thread = "autograd" if torch._C._current_graph_task_id() != -1 else "main"
            if thread not in self.held:
                self.held[thread] = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def cublas_workspaces(device: str | torch.device, nbytes: int):
    """PyTorch's cuBLAS workspaces: on a GPU, the first GEMM a thread runs on a stream takes a
    workspace of `nbytes` (sized by CUBLAS_WORKSPACE_CONFIG) from the caching allocator and keeps
    it for the life of the process (aten/src/ATen/cuda/CublasHandlePool.cpp: one per handle and
    stream, handles are per thread). Enter it inside the recorder, which then sees them."""
    mode = _CublasWorkspaces(torch.device(device), nbytes)
    with mode:
        yield mode
