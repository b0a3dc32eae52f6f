"""Which dispatched operators are collectives, and where their tensors and group are.

A declarative table keyed by operator name (as `str(OpOverload)` minus the overload, e.g.
`c10d._allgather_base_`). Each entry names the normalised kind, the argument that holds the
message (the full tensor: the gathered output of an all-gather, the input of a reduce-scatter),
the argument that holds the process group, and for point-to-point ops the peer.

Signatures are those of torch 2.13 (`torch._C._jit_get_all_schemas()`, namespace c10d and
_c10d_functional). An operator in these namespaces that the table does not list is reported as
unclassified by the recorder, never dropped.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CollectiveSpec:
    kind: str
    message_arg: int | None
    """Argument index of the message tensor(s) (a tensor, a list, or a list of lists)."""
    group_arg: int
    """Argument index of the ProcessGroup (c10d) or group name (_c10d_functional)."""
    peer_arg: int | None = None
    """Argument index of the peer's rank within the group (send, recv)."""


COLLECTIVES: dict[str, CollectiveSpec] = {
    # c10d: in-place ops on ProcessGroup script objects.
    "c10d.allreduce_": CollectiveSpec("all_reduce", 0, 1),
    "c10d.allreduce_coalesced_": CollectiveSpec("all_reduce", 0, 1),
    "c10d.allgather_": CollectiveSpec("all_gather", 0, 2),
    "c10d._allgather_base_": CollectiveSpec("all_gather", 0, 2),
    "c10d.allgather_coalesced_": CollectiveSpec("all_gather", 0, 2),
    "c10d.allgather_into_tensor_coalesced_": CollectiveSpec("all_gather", 0, 2),
    "c10d.reduce_scatter_": CollectiveSpec("reduce_scatter", 1, 2),
    "c10d._reduce_scatter_base_": CollectiveSpec("reduce_scatter", 1, 2),
    "c10d.reduce_scatter_tensor_coalesced_": CollectiveSpec("reduce_scatter", 1, 2),
    "c10d.alltoall_": CollectiveSpec("all_to_all", 1, 2),
    "c10d.alltoall_base_": CollectiveSpec("all_to_all", 1, 2),
    "c10d.broadcast_": CollectiveSpec("broadcast", 0, 1),
    "c10d.reduce_": CollectiveSpec("reduce", 0, 1),
    "c10d.gather_": CollectiveSpec("gather", 1, 2),
    "c10d.scatter_": CollectiveSpec("scatter", 0, 2),
    "c10d.send": CollectiveSpec("send", 0, 1, peer_arg=2),
    "c10d.recv_": CollectiveSpec("recv", 0, 1, peer_arg=2),
    "c10d.recv_any_source_": CollectiveSpec("recv", 0, 1),
    "c10d.barrier": CollectiveSpec("barrier", None, 1),
    "c10d.monitored_barrier_": CollectiveSpec("barrier", None, 1),
    # _c10d_functional: out-of-place ops naming their group by string.
    "_c10d_functional.all_reduce": CollectiveSpec("all_reduce", 0, 2),
    "_c10d_functional.all_reduce_": CollectiveSpec("all_reduce", 0, 2),
    "_c10d_functional.all_reduce_coalesced": CollectiveSpec("all_reduce", 0, 2),
    "_c10d_functional.all_gather_into_tensor": CollectiveSpec("all_gather", None, 2),
    "_c10d_functional.all_gather_into_tensor_coalesced": CollectiveSpec("all_gather", None, 2),
    "_c10d_functional.reduce_scatter_tensor": CollectiveSpec("reduce_scatter", 0, 3),
    "_c10d_functional.reduce_scatter_tensor_coalesced": CollectiveSpec("reduce_scatter", 0, 3),
    "_c10d_functional.all_to_all_single": CollectiveSpec("all_to_all", 0, 3),
    "_c10d_functional.broadcast": CollectiveSpec("broadcast", 0, 2),
}

# Operators of the collective namespaces that move no data.
NOT_COLLECTIVES = frozenset(
    {"c10d.check_for_nan", "_c10d_functional.wait_tensor", "c10d_functional.wait_tensor"}
)
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
# Namespaces whose operators are ordinary compute (counted, not classified further).
COMPUTE_NAMESPACES = ("aten", "prim", "prims")


def op_key(func) -> str:
    """`c10d._allgather_base_.default` -> `c10d._allgather_base_`."""
    return f"{func.namespace}.{func._opname}"


def message_tensors(spec: CollectiveSpec, args, outputs) -> list[torch.Tensor]:
    """The tensors that make up the message of a call."""
    if spec.message_arg is None:
        # all_gather_into_tensor returns the gathered tensor(s).
        found = outputs
    else:
        found = args[spec.message_arg]
    flat = []
    stack = [found]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            flat.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return flat


def resolve_group(handle) -> dist.ProcessGroup | None:
    """The ProcessGroup behind a dispatched argument (a script object or a group name)."""
    if isinstance(handle, str):
        try:
            return dist.distributed_c10d._resolve_process_group(handle)
        except (KeyError, RuntimeError, ValueError):
            return None
    if isinstance(handle, dist.ProcessGroup):
        return handle
    try:
        return dist.ProcessGroup.unbox(handle)
    except (RuntimeError, TypeError):
        return None


@contextlib.contextmanager
def _pushed(stack: list, value):
    """`value` on top of `stack` while inside: what the recorder reads for the collectives
    issued there."""
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()


_OVERLAP: list[str] = []


def overlapped(what: str):
    """Collectives issued inside run beside `what` (e.g. Transformer Engine's userbuffers
    overlap them with the GEMM): the recorder marks them so."""
    return _pushed(_OVERLAP, what)


def current_overlap() -> str | None:
    return _OVERLAP[-1] if _OVERLAP else None


_CROSSING: list[int] = []


def crossing(nbytes: int):
    """A collective issued inside sends `nbytes` of its message out of the rank's NVLink domain
    (a kernel that forwards inside the domain, e.g. DeepEP's internode dispatch sending a token
    once per node): the recorder marks it so."""
    return _pushed(_CROSSING, int(nbytes))


def current_crossing() -> int | None:
    return _CROSSING[-1] if _CROSSING else None


_DOMAIN: list[int | None] = [None]


def set_nvlink_domain(gpus: int | None) -> None:
    """The simulated cluster's GPUs per NVLink domain (hooks/fake_world.py sets it)."""
    _DOMAIN[0] = gpus


def nvlink_domain() -> int | None:
    """GPUs per NVLink domain of the simulated cluster (World.nvlink_domain: ranks in order),
    for stand-ins of kernels that route by it (HybridEP); None outside a fake world."""
    return _DOMAIN[0]


_LIBRARY: list[str] = []


def by_library(name: str):
    """Collectives issued inside stand for a library's kernels that move the data through
    buffers of their own (DeepEP, HybridEP), not an NCCL communicator: the recorder marks them
    so."""
    return _pushed(_LIBRARY, name)


def current_library() -> str | None:
    return _LIBRARY[-1] if _LIBRARY else None
