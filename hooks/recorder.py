"""The recorder: runs around one micro-batch of one rank and returns a `Trace` of plain records.

One context manager installs, and on exit (also on error) removes:
- global module forward hooks, which keep the stack of active modules by FQN and, when a module
  finishes, label the autograd nodes it created with its FQN (so that backward work, including
  collectives issued inside custom autograd functions, is attributed to the module that ran the
  forward);
- saved-tensor hooks, which note every tensor autograd keeps for backward;
- a private `TorchDispatchMode`, which counts every operator, follows every tensor to its
  storage (allocations, and frees when the last tensor using a storage dies, rounded to the
  CUDA caching allocator's 512-byte blocks), records collectives from a declarative table, and
  counts floating-point operations per Window (hooks/flops.py: torch.utils.flop_counter's
  formulas, and what stand-ins for library kernels report);
- a private `TorchFunctionMode` that sees `tensor.data = ...` (storage swaps that are not
  dispatched operators, e.g. megatron-core's pipeline-output deallocation).

Known limitations: a storage kept alive only by C++ tensors that never passed through the
dispatcher (none are known in megatron-core's GPT path) is freed in the records when the last
tensor the recorder saw dies. Kernel workspaces (cuBLAS, NCCL) are not allocations of the
caching allocator's tracked tensors and are not modelled.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from metatrace.config.host import (
    NO_DATA,
    SYNC,
    VIEW_LIKE,
    embedding_backward_kernels,
    kernels_of,
    multi_tensor_launches,
)
from metatrace.config.kernels import SOFTMAX_WARP_ROW, KernelModel, memory_seconds
from metatrace.hooks import flops as _flops
from metatrace.hooks import host as _host
from metatrace.hooks.collectives import (
    COLLECTIVE_NAMESPACES,
    COLLECTIVES,
    COMPUTE_NAMESPACES,
    NOT_COLLECTIVES,
    current_crossing,
    current_library,
    current_overlap,
    message_tensors,
    op_key,
    resolve_group,
)
from metatrace.hooks.fastmeta import MetaMemo
from metatrace.records import (
    STEP,
    Collective,
    MemEvent,
    ModuleInfo,
    ParamInfo,
    Saved,
    Trace,
    Window,
    is_layer_type,
)

BLOCK = 512  # the CUDA caching allocator rounds every allocation up to 512-byte blocks
_NODE_KEY = "metatrace.module"
_DATA_SET = torch.Tensor.data.__set__


def round_block(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensors(obj):
    """Tensors in an operator's output or a module's output (tensors, lists, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


class _Storages:
    """Live storages on the traced device, found through the tensors that use them.

    A storage is live from first sight until its StorageImpl dies: a weak reference to the
    storage itself says when (the Python storage object lives as long as the StorageImpl). Counting the
    tensor objects that use a storage instead misses deaths where a tensor's storage changes
    beneath it without a dispatched operator, and a new storage at the dead one's address then
    passes for it (seen with megatron-core's fused MLA RoPE). Static storages (parameters,
    gradient buffers, optimizer state) count for the whole trace."""

    def __init__(self, device_types: tuple[str, ...], on_change):
        self.device_types = device_types
        self.meta_only = device_types == ("meta",)  # (Tensor.is_meta: no device object made)
        self.on_change = on_change  # on_change(delta_bytes, storage id)
        self.by_tensor: dict[int, tuple[weakref.ref, int]] = {}
        self.by_cdata: dict[int, int] = {}
        self.live: dict[int, list] = {}  # sid -> [weakref to the storage, rounded bytes, cdata]
        self.static: set[int] = set()
        self.outside: set[int] = set()
        """Storages (by _cdata) outside PyTorch's allocator (userbuffers): zero bytes here."""
        self.next_sid = 0

    def see(self, t: torch.Tensor) -> int | None:
        """Storage id of `t`, registering the tensor (and a new storage) on first sight."""
        if not t.is_meta if self.meta_only else t.device.type not in self.device_types:
            return None
        entry = self.by_tensor.get(id(t))
        if entry is not None and entry[1] in self.live:
            return entry[1]
        return self._bind(t)

    def _bind(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        cdata = storage._cdata
        sid = self.by_cdata.get(cdata)
        if sid is None:
            sid = self.next_sid
            self.next_sid += 1
            nbytes = 0 if cdata in self.outside else round_block(storage.nbytes())
            self.by_cdata[cdata] = sid
            self.live[sid] = [weakref.ref(storage, partial(self._storage_dead, sid)), nbytes, cdata]
            if nbytes:
                self.on_change(nbytes, sid)
        self.by_tensor[id(t)] = (weakref.ref(t, partial(self._dead, id(t))), sid)
        return sid

    def check(self, t: torch.Tensor) -> None:
        """After an operator wrote to `t`: it may use another storage now (out= variants resize
        their output, set_ swaps it) or its storage may have grown (resize_)."""
        entry = self.by_tensor.get(id(t))
        if entry is None or entry[1] not in self.live:
            self.see(t)
            return
        info = self.live[entry[1]]
        storage = t.untyped_storage()
        if storage._cdata != info[2]:
            self.rebind(t)
            return
        self.resized(entry[1], storage)

    def resized(self, sid: int, storage) -> None:
        """Storage `sid` may have grown or shrunk in place (resize_)."""
        info = self.live[sid]
        if info[2] in self.outside:
            return
        nbytes = round_block(storage.nbytes())
        if nbytes != info[1]:
            delta, info[1] = nbytes - info[1], nbytes
            self.on_change(delta, sid)

    def rebind(self, t: torch.Tensor) -> None:
        """`t` now uses another storage (tensor.data = ..., set_, a resized out= tensor)."""
        self.by_tensor.pop(id(t), None)
        if t.device.type in self.device_types:
            self._bind(t)

    def _dead(self, tid: int, _ref) -> None:
        self.by_tensor.pop(tid, None)

    def _storage_dead(self, sid: int, _ref=None) -> None:
        info = self.live.get(sid)
        if info is None:
            return
        if self.by_cdata.get(info[2]) == sid:
            del self.by_cdata[info[2]]  # the address may hold a new storage now
        if sid in self.static:
            return  # counted for the whole trace
        del self.live[sid]
        if info[1]:
            self.on_change(-info[1], sid)

    def nbytes(self, sid: int) -> int:
        return self.live[sid][1] if sid in self.live else 0


_UNCLASSIFIED = object()
"""_op_info's spec of an operator that is neither compute nor a known collective."""


def _op_info(func) -> list:
    """[calls, flop formula or None, written arguments, collective spec, moves data, kernels
    launched, synchronises, host cost kind]: the spec is None for compute and for what is known
    not to be a collective, _UNCLASSIFIED for the rest; an operator that moves data (not a view,
    an allocation, a matrix product or a collective) is timed by the bytes it reads and writes,
    and where its kernel can be bound by its elements instead, moves data names the kind
    ("_softmax", "cat", "iterated": see _memory_path; True otherwise). Kernels and
    synchronisations: metatrace.config.host (a known collective launches one, NCCL's)."""
    key = op_key(func)
    spec = None
    if func.namespace not in COMPUTE_NAMESPACES and key not in NOT_COLLECTIVES:
        spec = COLLECTIVES.get(key)
        if spec is None or func.namespace not in COLLECTIVE_NAMESPACES:
            spec = _UNCLASSIFIED
    formula = _flops.formula(func)
    name = func._overloadpacket.__name__
    moves: bool | str = (
        spec is None
        and formula is None
        and func.namespace == "aten"
        and not func.is_view
        and name not in NO_DATA
    )
    if moves:  # which kernel: see _memory_path
        if name in ("_softmax", "cat"):
            moves = name
        elif name in _ITERATED or torch.Tag.pointwise in func.tags:
            moves = "iterated"
    if func.namespace == "aten":
        launches = kernels_of(name, view=func.is_view)
        if launches and name in _SHAPED_KERNELS:
            launches = _SHAPED_KERNELS[name]
        elif launches and name.startswith("_foreach_"):
            launches = partial(_foreach_kernels, not name.endswith("_"))
    else:
        launches = 1 if spec is not None and spec is not _UNCLASSIFIED else 0
    sync = func.namespace == "aten" and name in SYNC
    view = func.is_view or name in VIEW_LIKE
    return [0, formula, _written_args(func), spec, moves, launches, sync, view]


def _empty(out) -> bool:
    """Whether an operator's outputs are all empty tensors."""
    if isinstance(out, torch.Tensor):
        return out.numel() == 0
    if isinstance(out, (list, tuple)) and out:
        return all(isinstance(t, torch.Tensor) and t.numel() == 0 for t in out)
    return False


def _foreach_kernels(out_of_place: bool, args, kwargs) -> int:
    """A foreach operator's multi-tensor launches (config.host.multi_tensor_launches): its
    tensor lists, and the list it writes when not in place."""
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and _is_tensor(a[0])]
    if not lists:
        return 1
    numels = [t.numel() for t in lists[0]]
    return multi_tensor_launches(numels, len(lists) + out_of_place)


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def _embedding_backward_kernels(args, kwargs) -> int:
    """embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)."""
    scale = args[4] if len(args) > 4 else kwargs.get("scale_grad_by_freq", False)
    return embedding_backward_kernels(args[1].numel(), bool(scale))


# ATen operators whose CUDA kernels' count depends on their arguments: (args, kwargs) -> kernels.
_SHAPED_KERNELS = {"embedding_dense_backward": _embedding_backward_kernels}


def _moved_bytes(args, out) -> int:
    """Bytes an operator reads (its tensor arguments) and writes (its outputs)."""
    n = 0
    for a in args:
        if isinstance(a, torch.Tensor):
            n += a.nbytes
        elif isinstance(a, (list, tuple)):
            n += sum(t.nbytes for t in a if isinstance(t, torch.Tensor))
    if isinstance(out, torch.Tensor):
        n += out.nbytes
    elif isinstance(out, (list, tuple)):
        n += sum(t.nbytes for t in out if isinstance(t, torch.Tensor))
    return n


# TensorIterator's element-wise operators (those ATen tags pointwise, and these): with every
# operand laid out as the output they run vectorised, otherwise on the generic path.
_ITERATED = frozenset({"masked_fill_", "copy_", "_to_copy"})


def _memory_path(kind, args, out) -> tuple[str | None, int]:
    """(the element-bound kernel a memory-bound operator of `kind` (_op_info's) runs, or None
    for a streaming one; the elements it processes): see
    metatrace.config.kernels.ELEMENTS_PER_SM_SECOND."""
    result = out[0] if isinstance(out, (list, tuple)) and out else out
    if kind is True or not isinstance(result, torch.Tensor):
        return None, 0
    if kind == "_softmax":
        row = result.shape[args[1]] if result.dim() else 1
        return ("softmax_warp" if row <= SOFTMAX_WARP_ROW else "softmax_block"), result.numel()
    strides = result.stride()
    if kind == "cat":
        # Each input is copied into its slice of the output.
        inputs = [t for t in args[0] if t.dim() == result.dim()]
    else:  # scalars are passed by value
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.numel() > 1]
        if any(a.shape != result.shape for a in inputs):
            return "generic", result.numel()  # broadcast
    if any(_laid_out_otherwise(t, strides) for t in inputs):
        return "generic", result.numel()
    return None, 0


def _laid_out_otherwise(t: torch.Tensor, strides) -> bool:
    """Whether `t` steps through memory otherwise than an output (or its slice) of `strides`."""
    return any(n > 1 and x != y for n, x, y in zip(t.shape, t.stride(), strides, strict=True))


def _by_name(counts: dict) -> dict[str, int]:
    named: dict[str, int] = {}
    for func, n in counts.items():
        name = str(func)
        named[name] = named.get(name, 0) + n
    return named


class _Dispatch(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless this says no:
        # nothing here is compiled, and the wrapper costs microseconds on every operator.
        return False

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.rec = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self.rec._run(func, args, kwargs)
        self.rec._on_op(func, args, kwargs, out)
        return out


_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot
)


class _DataSwaps(TorchFunctionMode):
    """Sees `tensor.data = ...`; and records the calls a pipeline schedule makes thousands of
    times (torch.empty, torch.distributed.isend / irecv) without passing them through the
    dispatch mode: each runs with torch's Python modes off and is recorded as _Dispatch records
    its dispatched operator (aten.empty.memory_format, c10d.send / recv_): a 405B pipeline
    stage's 512 replayed steps took 0.41 s through the dispatch mode, 0.32 s so. Only where the modes it skips are the recorder's own and remap_cuda's (`fast`, known on
    entry), and only in forms whose dispatched operator is certain (else the usual path)."""

    def __init__(self, recorder: Recorder, fast: bool, remap=None):
        super().__init__()
        self.rec = recorder
        self.remap = remap  # the remap_cuda mode beneath, whose device rewriting is repeated
        self.fast = {}
        if fast:
            self.fast = {torch.empty: self._empty, dist.isend: self._send, dist.irecv: self._recv}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fast = self.fast.get(func)
        if fast is not None and torch._C._len_torch_dispatch_stack() == 1:
            result = fast(func, args, kwargs)
            if result is not _SLOW:
                return result
        result = func(*args, **kwargs)
        if func == _DATA_SET:  # a new method-wrapper object on every access: compare, not `is`
            self.rec.storages.rebind(args[0])
        return result

    def _empty(self, func, args, kwargs):
        device = kwargs.get("device")
        if device is None or "out" in kwargs or "names" in kwargs:
            return _SLOW  # a default device (a mode may set it) or another overload
        if self.remap is not None:
            kwargs = self.remap.factory_kwargs(kwargs)
        elif kwargs.get("pin_memory"):
            return _SLOW
        device = kwargs["device"]
        kind = device.type if isinstance(device, torch.device) else device
        if not isinstance(kind, str) or kind.partition(":")[0] != self.rec.device_types[0]:
            return _SLOW
        with torch._C.DisableTorchFunction(), torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
            out = func(*args, **kwargs)
        self.rec._on_op(_EMPTY, (), {}, out)
        return out

    def _send(self, func, args, kwargs):
        return self._p2p(_SEND, "dst", "group_dst", args, kwargs)

    def _recv(self, func, args, kwargs):
        return self._p2p(_RECV, "src", "group_src", args, kwargs)

    def _p2p(self, op, peer, group_peer, args, kwargs):
        """isend / irecv (tensor, dst|src=, group=, tag=, group_dst|group_src=) as their body
        runs them for a tensor of the group's member: ProcessGroup.send / recv with the peer's
        rank in the group, which dispatch `op` ([tensor], the group, that rank, tag)."""
        if len(args) != 1 or set(kwargs) - {peer, "group", "tag", group_peer}:
            return _SLOW
        tensor = args[0]
        if kwargs.get(peer) is None or kwargs.get(group_peer) is not None:
            return _SLOW  # recv from any source, or a group rank given
        if type(tensor) is not torch.Tensor or tensor.device.type != self.rec.device_types[0]:
            return _SLOW
        group = _c10d._group_or_default_group(kwargs.get("group"))
        if _c10d._rank_not_in_group(group) or tensor.is_complex():
            return _SLOW
        rank = _c10d._canonicalize_group_rank(group, kwargs[peer], None)
        tag = kwargs.get("tag", 0)
        call = group.send if op is _SEND else group.recv
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
            work = call([tensor], rank, tag)
        self.rec._on_op(op, ([tensor], group, rank, tag), {}, work)
        return work


FAST_CALLS = True
"""Whether _DataSwaps records its frequent calls itself (tests compare with the usual path)."""
_SLOW = object()
_EMPTY = torch.ops.aten.empty.memory_format
_SEND = torch.ops.c10d.send.default
_RECV = torch.ops.c10d.recv_.default


def module_infos(chunks: dict[str, torch.nn.Module]) -> tuple[ModuleInfo, ...]:
    """ModuleInfo for every module of every chunk, FQNs prefixed by the chunk's prefix."""
    infos = []
    for prefix, root in chunks.items():
        layer_of: dict[int, int] = {}
        for name, mod in root.named_modules():
            number = getattr(mod, "layer_number", None)
            if is_layer_type(type(mod).__name__) and isinstance(number, int):
                for sub in mod.modules():
                    layer_of[id(sub)] = number
            params = tuple(
                ParamInfo(
                    name=p_name,
                    shape=tuple(p.shape),
                    dtype=dtype_name(p.dtype),
                    numel=p.numel(),
                    bytes=p.numel() * p.element_size(),
                    tp_sharded=bool(
                        getattr(p, "tensor_model_parallel", False)
                        or getattr(p, "metatrace_expert_tp_sharded", False)
                    ),
                    expert=".experts." in f".{_join(prefix, name)}.",
                    embedding_copy=bool(getattr(p, "shared", False))
                    and bool(getattr(p, "shared_embedding", False)),
                )
                for p_name, p in _model_params(mod)
            )
            fqn = _join(prefix, name)
            infos.append(ModuleInfo(fqn, type(mod).__name__, params, layer_of.get(id(mod))))
    return tuple(infos)


def _model_params(mod: torch.nn.Module):
    """(name, parameter) of `mod` as the model computes with them. Between its steps
    Megatron-FSDP puts DTensors over the optimizer's main weights in the modules' place; each
    keeps the model's own parameter (`orig_param`: its dtype, its tensor-parallel shape)."""
    for name, p in mod.named_parameters(recurse=False):
        yield name, getattr(p, "orig_param", p)


_ACTIVE: list[Recorder] = []


def current() -> Recorder | None:
    """The recorder recording now (the innermost), None outside one."""
    return _ACTIVE[-1] if _ACTIVE else None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


class Recorder:
    """Records one rank's work: a micro-batch, or a whole iteration.

    `chunks` maps an FQN prefix ("" for a single chunk, "chunk{v}" for virtual stages) to the
    GPTModel of that chunk; `devices` are the device types whose tensors count (the traced
    device first: meta, or cpu to check meta against real tensors); `groups` maps process-group
    names (torch's `group_name`) to (megatron-core name, global ranks). `static` maps a name
    (e.g. "grads", "optimizer") to more tensors that exist before the recording starts: like the
    chunks' parameters and buffers ("params"), they are memory already held, not allocations;
    the trace reports the bytes of each part (a storage counts in the first part naming it).
    """

    def __init__(
        self,
        *,
        chunks: dict[str, torch.nn.Module],
        devices: tuple[str, ...],
        groups: dict[str, tuple[str, tuple[int, ...]]],
        rank: int,
        static: dict[str, list[torch.Tensor]] | None = None,
        outside: list[torch.Tensor] = (),
        kernels: KernelModel | None = None,
        captured=None,
    ):
        self.chunks = chunks
        self._static_tensors = dict(static or {})
        self._static_parts: dict[str, int] = {}
        self._static_sizes: list[int] = []
        self.device_types = tuple(torch.device(d).type for d in devices)
        self.groups = groups
        self.rank = rank
        self.storages = _Storages(self.device_types, self._on_memory)
        self.storages.outside = {t.untyped_storage()._cdata for t in outside}
        self._fqn = {}
        for prefix, root in chunks.items():
            for name, mod in root.named_modules():
                self._fqn[id(mod)] = _join(prefix, name)
        self._stack: list[str] = []
        self._inputs: list[set] = []  # grad_fn nodes of the inputs of each module on _stack
        self._backward_module = STEP
        self._label: tuple[str, str] | None = None
        self._windows: list[Window] = []
        self.step_phase = "forward"
        """Phase of work outside autograd and outside the model; the schedule driver sets it."""
        self._seq = 0
        self._live = 0
        self._collectives: list[Collective] = []
        self._saved: list[Saved] = []
        self._memory: list[MemEvent] = []
        # Operator -> [calls, flop formula, written arguments, collective spec] (_op_info): one
        # lookup per operator call; named in trace() and mark() (str() of an operator costs).
        self._ops: dict = {}
        self._unclassified: Counter = Counter()
        self._handles = []
        self._modes = []
        self._static_bytes = 0
        self._run = _MEMO if self.device_types[0] == "meta" else _call
        # The host's side: kernels launched, host work, synchronisations (hooks/host.py);
        # `captured(module)`: a module whose work a CUDA graph replays.
        self._host = _host.HostCount(captured)
        self._flops = _flops.FlopCount(kernels, host=self._host)
        self._window_pieces: list[int] = []  # pieces closed when each open window began
        self._window_flops: list[int] = []  # FLOPs counted when each open window began
        self._collective_flops: dict[int, int] = {}

    # ------------------------------------------------------------------ install / remove

    def __enter__(self) -> Recorder:
        params = [t for root in self.chunks.values() for t in (*root.parameters(), *root.buffers())]
        for part, tensors in {"params": params, **self._static_tensors}.items():
            before = self._live
            for t in tensors:
                sid = self.storages.see(t)
                if sid is not None and sid not in self.storages.static:
                    self.storages.static.add(sid)
                    if self.storages.nbytes(sid):
                        self._static_sizes.append(self.storages.nbytes(sid))
            self._static_parts[part] = self._live - before
        self._static_tensors = {}  # the storages are known now; hold no tensors
        self._static_bytes = self._live
        self._memory.clear()
        try:
            self._handles.append(
                torch.nn.modules.module.register_module_forward_pre_hook(self._pre_forward)
            )
            self._handles.append(
                torch.nn.modules.module.register_module_forward_hook(
                    self._post_forward, always_call=True
                )
            )
            self._identity = SavedIdentity()
            self._identity.__enter__()
            self._modes.append(self._identity)
            saved = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            saved.__enter__()
            self._modes.append(saved)
            for mode in (self._function_mode(), _Dispatch(self), _StorageResizes(self)):
                mode.__enter__()
                self._modes.append(mode)
            _flops.push(self._flops)
            _host.push(self._host)
            _ACTIVE.append(self)
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self._remove()
        return False

    def _function_mode(self) -> _DataSwaps:
        """The recorder's torch-function mode, with its fast paths where every mode beneath
        it is remap_cuda's (at most one) and no dispatch mode is."""
        from metatrace.hooks.remap import remap_mode

        below = torch.overrides._get_current_function_mode_stack()
        remap = below[0] if len(below) == 1 and remap_mode(below[0]) else None
        fast = FAST_CALLS and not torch._C._len_torch_dispatch_stack()
        return _DataSwaps(self, fast and (not below or remap is not None), remap)

    def _remove(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        _flops.pop(self._flops)
        _host.pop(self._host)
        while self._modes:
            self._modes.pop().__exit__(None, None, None)
        while self._handles:
            self._handles.pop().remove()

    def trace(self) -> Trace:
        return Trace(
            rank=self.rank,
            modules=module_infos(self.chunks),
            collectives=tuple(self._collectives),
            saved=tuple(self._saved),
            memory=tuple(self._memory),
            static_bytes=self._static_bytes,
            op_counts=self._op_counts(),
            unclassified=_by_name(self._unclassified),
            windows=tuple(self._windows),
            static_parts=dict(self._static_parts),
            collective_flops=dict(self._collective_flops),
            static_sizes=tuple(self._static_sizes),
        )

    # ------------------------------------------------------------------ where are we

    def _where(self) -> tuple[str, str]:
        if self._label is not None:
            return self._label
        if torch._C._current_graph_task_id() != -1:
            if self._stack:
                return self._stack[-1], "recompute"
            node = torch._C._current_autograd_node()
            if node is not None:
                self._backward_module = node.metadata.get(_NODE_KEY, STEP)
            # No node: a tensor hook between nodes (e.g. megatron-core's CheckpointWithoutOutput
            # recomputing an activation), on behalf of the module whose node ran last.
            return self._backward_module, "backward"
        if self._stack:
            return self._stack[-1], "forward"
        return STEP, self.step_phase

    def set_step_phase(self, phase: str) -> None:
        self.step_phase = phase

    @contextlib.contextmanager
    def window(self, phase: str, chunk: int | None = None, microbatch: int | None = None):
        """Mark what runs inside as one step of the schedule (a Window record). The yielded
        dict takes "output", the tensor the step hands on, and "held", a tensor that stands for
        the activations it keeps."""
        first = self._seq + 1
        info: dict = {}
        count, host = self._flops, self._host
        total, fp8, ps, attention = count.total, count.fp8, count.ps, count.attention_ps
        kernels, host_ps, syncs = host.kernels, host.host_ps, host.syncs
        self._window_flops.append(total)
        self._window_pieces.append(host.cut())
        try:
            yield info
        finally:
            self._window_flops.pop()
            pieces = host.pieces[self._window_pieces.pop() : host.cut()]
            sids = {
                key: self.storages.see(info[key])
                if isinstance(info.get(key), torch.Tensor)
                else None
                for key in ("output", "held")
            }
            self._windows.append(
                Window(
                    phase,
                    chunk,
                    microbatch,
                    first,
                    self._seq,
                    **sids,
                    flops=count.total - total,
                    fp8_flops=count.fp8 - fp8,
                    kernel_ps=count.ps - ps,
                    attention_ps=count.attention_ps - attention,
                    # The time model reads the steps' host work from the traced micro-batch's
                    # priced windows (a replayed step stands for the traced one's work and
                    # carries none), and the rest of the iteration's (the gradient
                    # synchronisation, the optimizer step) from the replayed iteration's
                    # windows outside the steps: their counts only, which are affine in the
                    # micro-batches as steady.py extends a replay (the losses' reduction
                    # takes two views per micro-batch), where their pieces would not be.
                    **(
                        {
                            "kernels": host.kernels - kernels,
                            "host_ps": host.host_ps - host_ps,
                            "syncs": host.syncs - syncs,
                            "host": tuple(pieces) if count.model is not None else (),
                        }
                        if count.model is not None or chunk is None
                        else {}
                    ),
                )
            )

    @contextlib.contextmanager
    def label(self, module: str, phase: str):
        """Attribute what happens inside to `module` and `phase` (for work that stands in for a
        module's, e.g. a replayed step)."""
        saved, self._label = self._label, (module, phase)
        try:
            yield
        finally:
            self._label = saved

    def fqn_of(self, module) -> str | None:
        """The recorded name of a module of the traced chunks (None for others)."""
        return self._fqn.get(id(module))

    @contextlib.contextmanager
    def region(self, fqn: str, args=()):
        """Attribute what runs inside to a module `fqn` that is not an nn.Module of its own (a
        method of one that a CUDA graph captures apart from the rest, e.g. a MoE layer's
        preprocessing), as a module's forward is: its operators, and the autograd nodes of the
        outputs put in the yielded list (their backward)."""
        out: list = []
        self._enter(fqn, args, call=False)
        try:
            yield out
        finally:
            self._leave(fqn, out[0] if out else None)

    def storage_of(self, t: torch.Tensor) -> int | None:
        """The storage id of `t` (None when it is not on a recorded device)."""
        return self.storages.see(t)

    def known_storage(self, t: torch.Tensor) -> int | None:
        """The storage id of `t` if the recorder has seen its storage (it registers nothing:
        storage ids are numbered in order of first sight)."""
        return self.storages.by_cdata.get(t.untyped_storage()._cdata)

    def position(self) -> tuple[int, int, str, str]:
        """(the last seq, the live bytes, the module and phase a record would be attributed
        to) now; unlike mark(), the host's running piece goes on."""
        return (self._seq, self._live, *self._where())

    def mark(self) -> Mark:
        """Where the recording stands now (metatrace.tracing.layers cuts the records of one
        layer out between two marks). The host's running piece ends here."""
        host = self._host
        closed = host.cut()
        return Mark(
            self._seq,
            self.storages.next_sid,
            self._live,
            self._flops.total,
            self._flops.fp8,
            self._flops.ps,
            self._flops.attention_ps,
            Counter(self._op_counts()),
            Counter(_by_name(self._unclassified)),
            host.kernels,
            host.host_ps,
            host.syncs,
            closed - (self._window_pieces[-1] if self._window_pieces else 0),
        )

    def _op_counts(self) -> dict[str, int]:
        return _by_name({func: info[0] for func, info in self._ops.items()})

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------------ module hooks

    def _pre_forward(self, module, args):
        fqn = self._fqn.get(id(module))
        if fqn is not None:
            self._enter(fqn, args)

    def _enter(self, fqn: str, args, call: bool = True) -> None:
        if call and _flops.counting():  # a module's __call__ (a region is a method's)
            in_backward = torch._C._current_graph_task_id() != -1
            self._host.module(fqn, "recompute" if in_backward else "forward")
        self._stack.append(fqn)
        # Nodes behind the module's inputs were made before it ran (by its parent, e.g. a
        # MoE layer's dispatcher before its experts): not the module's to label.
        self._inputs.append({t.grad_fn for t in _tensors(args) if t.grad_fn is not None})

    def _post_forward(self, module, args, output):
        fqn = self._fqn.get(id(module))
        if fqn is not None:
            self._leave(fqn, output)

    def _leave(self, fqn: str, output) -> None:
        inputs = set()
        if self._stack and self._stack[-1] == fqn:
            self._stack.pop()
            inputs = self._inputs.pop()
        # Label the autograd nodes this module created: inner modules labelled theirs first,
        # and the walk goes on behind them (to what this module made before calling them), but
        # not behind the module's inputs or into nodes of modules that ran before it.
        inner = fqn + "." if fqn else ""
        pending = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        seen = set()
        while pending:
            node = pending.pop()
            if node in seen or node in inputs:
                continue
            seen.add(node)
            metadata = node.metadata
            owner = metadata.get(_NODE_KEY)
            if owner is None:
                metadata[_NODE_KEY] = fqn
            elif owner != fqn and not owner.startswith(inner):
                continue
            pending.extend(nxt for nxt, _ in node.next_functions if nxt is not None)

    # ------------------------------------------------------------------ saved tensors

    def _pack(self, t: torch.Tensor):
        self._identity.note(t)
        sid = self.storages.see(t)
        if sid is not None:
            module, phase = self._where()
            self._saved.append(
                Saved(
                    seq=self._next_seq(),
                    storage=sid,
                    bytes=self.storages.nbytes(sid),
                    shape=tuple(t.shape),
                    dtype=dtype_name(t.dtype),
                    module=module,
                    phase=phase,
                    static=sid in self.storages.static,
                )
            )
        return t

    # ------------------------------------------------------------------ operators

    def _on_memory(self, delta: int, sid: int) -> None:
        self._live += delta
        module, phase = self._where()
        self._memory.append(MemEvent(self._next_seq(), delta, self._live, module, phase, sid))

    def _on_op(self, func, args, kwargs, out) -> None:
        info = self._ops.get(func)
        if info is None:
            info = self._ops[func] = _op_info(func)
        info[0] += 1
        _, formula, written, spec, moves, launches, sync, view = info
        count = self._flops
        counting = _flops.counting()
        ps = 0
        if formula is not None and counting:
            # Shapes only: also right for the outputs fastmeta's memo makes for repeated layers.
            flops = formula(*args, out_val=out, **kwargs)
            count.total += flops
            if count.model is not None and flops:
                sec = _flops.op_seconds(count.model, func, args, out, flops, count.margin)
                attention = "attention" in func._overloadpacket.__name__
                ps = count.add_seconds(sec, attention=attention, launches=0)
        elif moves and count.model is not None and counting:
            nbytes = _moved_bytes(args, out)
            if nbytes:
                path, elements = _memory_path(moves, args, out)
                ps = count.add_seconds(
                    memory_seconds(count.model, nbytes, path, elements), launches=0
                )
        if counting:
            if (launches or sync) and not self._on_device(args, out):
                launches, sync = 0, False  # work on host tensors: no kernel, no wait
            elif launches and _empty(out):
                launches = 0  # CUDA operators return before launching on empty outputs
            elif callable(launches):
                launches = launches(args, kwargs)
            self._on_host(launches, ps, sync, view)
        if written:
            positions, names = written
            found = [args[i] for i in positions if i < len(args)]
            found += [kwargs[n] for n in names if n in kwargs]
            for t in _tensors(found):
                if t.device.type in self.device_types:
                    self.storages.check(t)
        if isinstance(out, torch.Tensor):
            self.storages.see(out)
        elif isinstance(out, (list, tuple)):
            for t in _tensors(out):
                self.storages.see(t)
        if spec is None:
            return
        if spec is _UNCLASSIFIED:
            self._unclassified[func] += 1
            return
        self._record_collective(func, spec, args, out)

    def _on_device(self, args, out) -> bool:
        """Whether an operator works on the traced device's tensors (its first tensor argument,
        or its output: a copy of host tensors to the device, as get_batch's .cuda(), is a
        copy the device runs), not on host tensors alone (a CPU scalar megatron-core reads
        back)."""
        device = self.device_types[0]
        t = args[0] if args else out
        if isinstance(t, (list, tuple)) and t:
            t = t[0]
        if not isinstance(t, torch.Tensor):
            t = out if isinstance(out, torch.Tensor) else None
        if t is None or t.device.type == device:
            return True
        return isinstance(out, torch.Tensor) and out.device.type == device

    def _on_host(self, launches: int, ps: int, sync: bool, view: bool) -> None:
        """The host's side of a dispatched operator (hooks/host.py): issued from Python, a view,
        or by the autograd engine in backward (a recomputed forward is Python's)."""
        host = self._host
        backward = torch._C._current_graph_task_id() != -1 and not self._stack
        kind = "backward" if backward else "view" if view else "operator"
        module, phase = self._where() if host.captured is not None else ("", "")
        host.operator(module, phase, kind, launches, ps, sync)

    def _record_collective(self, func, spec, args, out) -> None:
        tensors = message_tensors(spec, args, out)
        pg = resolve_group(args[spec.group_arg])
        name, ranks = "unnamed", ()
        if pg is not None:
            name, ranks = self.groups.get(pg.group_name, ("unnamed", ()))
            if not ranks:
                ranks = tuple(dist.get_process_group_ranks(pg))
        peer = None
        if spec.peer_arg is not None and pg is not None:
            peer = dist.get_global_rank(pg, args[spec.peer_arg])
        first = tensors[0] if tensors else None
        output_bytes = None
        if spec.kind == "all_to_all":
            arrived = out if spec.message_arg == 0 else args[0]
            if isinstance(arrived, torch.Tensor):
                output_bytes = arrived.numel() * arrived.element_size()
        module, phase = self._where()
        seq = self._next_seq()
        if self._window_flops:
            self._collective_flops[seq] = self._flops.total - self._window_flops[-1]
        self._collectives.append(
            Collective(
                seq=seq,
                op=spec.kind,
                aten=str(func),
                group=name,
                ranks=tuple(ranks),
                shape=tuple(first.shape) if first is not None else (),
                dtype=dtype_name(first.dtype) if first is not None else "",
                bytes=sum(t.numel() * t.element_size() for t in tensors),
                count=len(tensors),
                phase=phase,
                module=module,
                peer=peer,
                output_bytes=output_bytes,
                overlap=current_overlap(),
                inter_bytes=current_crossing(),
                library=current_library(),
            )
        )


def _unpack(t):
    return t


class Mark(NamedTuple):
    """A point of a recording: the last seq, the next storage id, the live bytes, the FLOPs
    counted and the kernels' modelled picoseconds, and the operator counts so far."""

    seq: int
    sid: int
    live: int
    flops: int
    fp8_flops: int
    ps: int
    attention_ps: int
    ops: Counter
    unclassified: Counter
    kernels: int = 0
    host_ps: int = 0
    syncs: int = 0
    piece: int = 0
    """Host pieces (hooks/host.py) closed in the window open at the mark before it (the
    index there of the piece that starts at the mark)."""


class _StorageResizes:
    """`UntypedStorage.resize_` is no dispatched operator: megatron-core's
    CheckpointWithoutOutput (selective recompute of layernorm, moe_act, mla_up_proj) frees its
    outputs with `untyped_storage().resize_(0)` and regrows them in backward. Seen here."""

    def __init__(self, recorder: Recorder):
        self.storages = recorder.storages
        self._orig = None

    def __enter__(self):
        self._orig = orig = torch.UntypedStorage.resize_
        storages = self.storages

        def resize_(storage, size):
            out = orig(storage, size)
            sid = storages.by_cdata.get(storage._cdata)
            if sid is not None:
                storages.resized(sid, storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return self

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig
        return False


_BASE_SAVED_TENSORS = torch._C._FunctionBase.__dict__["saved_tensors"]


def _saved_key(t: torch.Tensor):
    return (
        t.untyped_storage()._cdata,
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
    )


class SavedIdentity:
    """Saved-tensor hooks cost saved tensors their Python identity: autograd hands back a new
    tensor object for every saved tensor once a hook is installed (SavedVariable::unpack), so
    attributes set on the original (megatron-core's `weight.main_grad`,
    `grad_added_to_main_grad`, which its linear layers read from `ctx.saved_tensors`) would be
    missing in backward. While installed, custom autograd functions get the original objects back
    from `ctx.saved_tensors` for every saved tensor that carries attributes."""

    def __init__(self):
        self.originals: dict = {}

    def note(self, t: torch.Tensor) -> None:
        if t.__dict__ or type(t) is not torch.Tensor:
            self.originals[_saved_key(t)] = weakref.ref(t)

    def restore(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        ref = self.originals.get(_saved_key(t))
        original = ref() if ref is not None else None
        return original if original is not None else t

    def __enter__(self):
        identity = self

        def saved_tensors(ctx):
            return tuple(identity.restore(t) for t in _BASE_SAVED_TENSORS.__get__(ctx))

        torch.autograd.function.BackwardCFunction.saved_tensors = property(saved_tensors)
        return self

    def __exit__(self, *exc):
        del torch.autograd.function.BackwardCFunction.saved_tensors
        return False


def _call(func, args, kwargs):
    return func(*args, **kwargs)


# Shared by all traces in the process: layers and roles repeat the same operators.
_MEMO = MetaMemo()


def _written_args(func) -> tuple[tuple[int, ...], tuple[str, ...]] | tuple:
    """Positions and keyword names of the arguments an operator writes to (in-place ops, out=
    variants, set_, resize_, in-place collectives); () when it writes to none."""
    written = [
        (i, arg)
        for i, arg in enumerate(func._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    ]
    if not written:
        return ()
    positions = tuple(i for i, arg in written if not arg.kwarg_only)
    names = tuple(arg.name for _, arg in written if arg.kwarg_only)
    return positions, names
