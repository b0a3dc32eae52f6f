"""The host in the step time: what issuing a step's kernels costs the CPU, and the model of a
GPU that runs no kernel before the host has issued it (pure: no torch).

The model. The host issues kernels one after another; issuing kernel i costs the host its
share of PyTorch's and megatron-core's work before it (HOST_SECONDS below) and the launch
itself. The GPU runs each kernel when the one before it has ended and no earlier than it was
issued; at a synchronisation (a device-to-host copy that `.item()`, `.tolist()` or `.cpu()`
makes, an operator whose output size depends on the data: nonzero, masked_select, unique) the
host waits until the GPU has run everything issued so far. With h the time the host is done
issuing and g the time the GPU is done running:

    host work x:       h <- h + x
    a kernel of d:     g <- max(g, h) + d
    a synchronisation: h <- max(h, g)

Every one of these is linear in the max-plus algebra (max for addition, + for
multiplication), so a stretch of them is one 2 x 2 max-plus matrix M = (a, b, c, d):

    h' = max(h + a, g + b),   g' = max(h + c, g + d)

(None stands for minus infinity: no path). The recorder folds a step's operators into such
matrices as it sees them (`Piece`); composing them is exact, in integer picoseconds, so a
step's matrix is the same however its operators were grouped (metatrace.tracing.layers copies
a layer's piece for the layers it did not trace). The time model (metatrace.analysis.timing)
applies a step's matrix to the host's and the GPU's clocks where the step starts: a step that
issues its kernels faster than the GPU runs them ends when its kernels do (GPU-bound); one
whose host work is longer keeps the GPU waiting (host-bound), and a synchronisation empties the
GPU's queue, so that what follows it waits for the host as well.

The constants, per dispatched operator and per module (HOST_SECONDS), were measured with
bench/host_overhead.py on this project's development machine, a 2-core AMD EPYC (Zen 5) virtual
machine (torch 2.13.0, megatron-core 0.16.1, one thread), 2026-11-29, stored in
bench/data/cpu_host_overhead.json (tests/unit/test_host.py holds the constants to it):
PyTorch's dispatcher and autograd and megatron-core's Python are the same code on the CPU as on
a GPU, and on 8 x 8 tensors their kernels take next to nothing, so the wall time is the host's
work:
- "operator": a small ATen operator called from Python with autograd recording (add, mul, mm,
  gelu, softmax, sum, a cast, layer_norm): 1.6-6.4 us, median 2.1 us;
- "view": a view or metadata operator (view, transpose, unsqueeze): 1.1 us;
- "module": a megatron-core module's forward beyond its operators (its __call__, its Python:
  config reads, parallel_state look-ups, the layer's control flow), measured on the local
  spec's GPT, Llama-like and 8-expert MoE layers (bench/step_time.py's cases, hidden size 64):
  the forward's wall time less its operators' at the costs above, over its module calls: 66,
  81 and 82 us, median 81 us (runs on this shared machine vary by 15 %);
- "backward": an operator the autograd engine runs in backward, the engine's work per node and
  megatron-core's custom autograd functions' Python included (the backward's wall time over
  its operators): 7.5, 9.9 and 9.5 us, median 9.5 us.
- "launch": the CUDA runtime's own cost of a launch (cudaLaunchKernel), which a CPU run cannot
  show: 3.8 us, from NVIDIA's "Getting Started with CUDA Graphs" (A. Gray, NVIDIA Developer
  Blog, 2019), where back-to-back launches of a 2.9 us kernel took 3.8 us each (host-bound:
  the launches) and 3.4 us once captured in a graph. A captured graph's launch counts one.

A GPU measurement replaces all five: `bench/host_overhead.py --device cuda` (also run by
bench/device_memory.py --device cuda) times the same operators on CUDA tensors of small shapes
(each one's GPU time beside its host time, so that only host-bound ones count) and on CPU
tensors in the same process, and the same layers on the GPU, and writes the constants to
bench/data/GPU_host_overhead.json: "operator" and "view" of that machine's CPU, "launch" the
CUDA operators' extra per kernel (PyTorch's CUDA path: the device guard, the caching allocator,
the CUDA TensorIterator, and cudaLaunchKernel), "module" and "backward" from the layers on the
GPU less their operators and launches. None has run on a GPU yet.

Known limitations: the host's speed is the measuring machine's (a data-centre CPU of lower
clock runs the same code slower: the constants do not scale with it); until a GPU measurement
replaces them, PyTorch's CUDA path (the caching allocator, cuBLAS's host-side set-up of a
GEMM) is only the published launch's cost; the CPU's other threads (the data loader, NCCL's
proxy) are not modelled; Transformer Engine's modules take megatron-core's per-module cost
(Transformer Engine does not run here); work outside the steps (the schedule's own Python, the
loss function) is not counted; kernels no dispatched operator shows are not counted (PyTorch's
multi-block reductions zero their semaphores with a memset first: H200 profiles of
bench/step_time.py count about one a reduction, and more, docs/figures.md).
"""

from __future__ import annotations

from collections.abc import Iterable

from metatrace.config.kernels import LAUNCH_SECONDS

HOST_SECONDS = {
    "operator": 2.1e-6,
    "view": 1.1e-6,
    "backward": 9.5e-6,
    "module": 81e-6,
    "launch": 3.8e-6,
}
"""Host seconds per dispatched operator (from Python, a view, in backward), per module forward
call and per kernel launch: see the module docstring for their sources."""

D2H_COPY_SECONDS = LAUNCH_SECONDS
"""GPU time of a small device-to-host copy (the count a synchronisation reads): a kernel's
fixed cost."""

# ATen operators (by overload packet name) that allocate, alias or describe and move no data
# (views are told by their schema; _unsafe_view is a view its schema does not mark: a reshape of
# a fresh tensor). The recorder times none of them by bytes.
NO_DATA = frozenset(
    {
        "_unsafe_view",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "set_",
        "resize_",
        "record_stream",
        "_local_scalar_dense",  # the copy it makes is the synchronisation's (SYNC)
        "lift_fresh",
        "detach",
        "alias",
    }
)

VIEW_LIKE = frozenset({"_unsafe_view"})
"""Operators that make a view without their schema saying so (autograd does not track it as
one): a view's host cost ("view" above)."""

# ATen operators that launch no kernel although they are not views: NO_DATA and those that only
# read metadata.
NO_KERNEL = NO_DATA | {
    "is_nonzero",
    "size",
    "stride",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "numel",
    "dim",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
    "_reshape_alias",
    "_nested_tensor_size",
}

# ATen operators whose CUDA implementation launches more than one kernel (PyTorch 2.x sources):
# nonzero counts the non-zeros (a reduction), copies the count to the host and writes the
# indices (cub's select); masked_select and boolean indexing run nonzero and then a gather;
# embedding's backward sorts the indices (radix sort: several passes) and reduces by segments;
# unique sorts and compacts.
KERNELS = {
    "nonzero": 3,
    "nonzero_static": 3,
    "masked_select": 4,
    "embedding_dense_backward": 8,
    "_unique2": 6,
    "unique_consecutive": 4,
    "_embedding_bag": 4,
    "native_layer_norm_backward": 2,  # the input gradient, then gamma's and beta's
    "native_group_norm_backward": 2,
    "_fused_rms_norm_backward": 2,
}

# Operators whose output size depends on the values (the host must read a count before it can
# allocate it) or that read a value back: the host waits for the GPU.
SYNC = frozenset(
    {
        "nonzero",
        "masked_select",
        "_local_scalar_dense",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "repeat_interleave",  # with a tensor of repeats and no output_size
        "item",
    }
)


def kernels_of(name: str, *, view: bool) -> int:
    """Kernels an ATen operator launches on a GPU (0 for views and metadata operators); some
    launch a number that depends on their arguments (`shaped_kernels`)."""
    if view or name in NO_KERNEL:
        return 0
    return KERNELS.get(name, 1)


EMBEDDING_DIRECT = 3072
"""embedding_dense_backward_cuda (PyTorch's Embedding.cu) takes its direct path up to this many
indices (without scale_grad_by_freq): the gradient zeroed (a fill) and one
embedding_backward_feature_kernel; past it, it sorts the indices (KERNELS above)."""


def embedding_backward_kernels(indices: int, scale_grad_by_freq: bool) -> int:
    """Kernels of embedding_dense_backward over `indices` token ids."""
    if indices <= EMBEDDING_DIRECT and not scale_grad_by_freq:
        return 2
    return KERNELS["embedding_dense_backward"]


# Multi-tensor kernels: PyTorch's foreach operators (aten/src/ATen/native/cuda/
# MultiTensorApply.cuh) and Apex's and Transformer Engine's multi_tensor_applier
# (csrc/multi_tensor_apply.cuh, transformer_engine/common/multi_tensor/multi_tensor_apply.cuh)
# pack the tensors of `depth` lists into launches of at most MAX_BLOCKS chunks of CHUNK
# elements and of MAX_TENSORS[depth - 1] tensors.
MULTI_TENSOR_CHUNK = 2048 * 32
"""Elements per chunk: PyTorch's kChunkSize; Apex's and TE's multi_tensor_applier(2048 * 32),
with which FusedAdam and megatron-core call them."""
MULTI_TENSOR_MAX_TENSORS = (110, 64, 48, 36, 30, 24)
MULTI_TENSOR_MAX_BLOCKS = 320


def multi_tensor_launches(
    numels: Iterable[int], depth: int, chunk: int = MULTI_TENSOR_CHUNK
) -> int:
    """Kernel launches of one multi-tensor call over tensors of `numels` elements in `depth`
    lists. Restates multi_tensor_apply's loop (PyTorch 2.x, Apex, TE 2.x alike): each tensor's
    chunks fill the launch's blocks; a launch goes when its blocks are full, or its tensors are
    and a tensor's last chunk is in, and the rest goes in a last launch. Empty tensors are
    skipped (as PyTorch does)."""
    max_tensors = MULTI_TENSOR_MAX_TENSORS[min(depth, len(MULTI_TENSOR_MAX_TENSORS)) - 1]
    launches = blocks = tensors = 0
    for n in numels:
        if n == 0:
            continue
        tensors += 1
        chunks = -(-n // chunk)
        for c in range(chunks):
            blocks += 1
            if blocks == MULTI_TENSOR_MAX_BLOCKS or (tensors == max_tensors and c == chunks - 1):
                launches += 1
                blocks = 0
                tensors = 0 if c == chunks - 1 else 1  # a tensor cut in two goes on
    return launches + (blocks > 0)


# ----------------------------------------------------------------------------- max-plus


Matrix = tuple
"""(a, b, c, d), ints (picoseconds) or None (minus infinity): h' = max(h + a, g + b),
g' = max(h + c, g + d)."""

IDENTITY: Matrix = (0, None, None, 0)


def _add(x, y):
    return None if x is None or y is None else x + y


def _max(x, y):
    if x is None:
        return y
    if y is None:
        return x
    return x if x >= y else y


def then(first: Matrix, second: Matrix) -> Matrix:
    """The matrix of `first` followed by `second`."""
    a1, b1, c1, d1 = first
    a2, b2, c2, d2 = second
    return (
        _max(_add(a2, a1), _add(b2, c1)),
        _max(_add(a2, b1), _add(b2, d1)),
        _max(_add(c2, a1), _add(d2, c1)),
        _max(_add(c2, b1), _add(d2, d1)),
    )


def product(pieces: Iterable[Matrix]) -> Matrix:
    """The matrix of `pieces` one after another."""
    out = IDENTITY
    for p in pieces:
        out = then(out, p)
    return out


def power(m: Matrix, n: int) -> Matrix:
    """`m` repeated n times."""
    out, base = IDENTITY, m
    while n > 0:
        if n & 1:
            out = then(out, base)
        base = then(base, base)
        n >>= 1
    return out


def apply(m: Matrix, host: float, gpu: float) -> tuple[float, float]:
    """(host, GPU) clocks after the stretch `m` (in the same unit as the clocks)."""
    a, b, c, d = m
    h = _max(_add(host, a), _add(gpu, b))
    g = _max(_add(host, c), _add(gpu, d))
    return h, g


def scaled(m: Matrix, factor: float) -> tuple:
    """`m`'s entries times `factor` (picoseconds to seconds: 1e-12)."""
    return tuple(None if x is None else x * factor for x in m)


class Piece:
    """A stretch of host work, kernels and synchronisations folded into a Matrix as it is
    seen: the two columns of the matrix, each the (host, GPU) clocks of a start where only the
    host (column 0) or only the GPU (column 1) was at time 0."""

    __slots__ = ("a", "b", "c", "d")

    def __init__(self):
        self.a, self.b, self.c, self.d = 0, None, None, 0

    def host(self, ps: int) -> None:
        self.a += ps
        if self.b is not None:
            self.b += ps

    def kernel(self, ps: int) -> None:
        self.c = _max(self.c, self.a) + ps
        self.d = _max(self.d, self.b) + ps  # type: ignore[operator]

    def sync(self) -> None:
        self.a = _max(self.a, self.c)
        self.b = _max(self.b, self.d)

    def matrix(self) -> Matrix:
        return (self.a, self.b, self.c, self.d)
