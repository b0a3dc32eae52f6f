"""Transformer Engine's userbuffers for TP communication overlap (--tp-comm-overlap): which
buffers TE 2.8's `initialize_ub` (pytorch/module/base.py) allocates, their methods and sizes.

Megatron-LM (and Megatron-Bridge) call `initialize_ub(shape=[seq * mbs / cp, hidden], tp_size,
quantization_modes=[FP8 if fp8 else NONE], ub_cfgs)` once per process, before the model is
built. TE then creates one communicator per GEMM of a transformer layer, each with its own
buffer registered with the userbuffers library (cudaMalloc or CUDA VMM; not PyTorch's caching
allocator, so `torch.cuda.max_memory_allocated` does not see it):
- an all-gather GEMM (qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad, and qkv_dgrad, fc1_dgrad,
  proj_wgrad, fc2_wgrad) has a buffer of the full shape, FP8 (1 byte) under FP8, else bf16;
- a reduce-scatter GEMM (proj_fprop, fc2_fprop, qkv_wgrad, fc1_wgrad) a bf16 buffer of the
  full shape (FP8 if its configuration asks for fp8_buf and its method is pipeline), and with
  the ring-exchange method 2·tp - 1 chunks of 1/tp of it (CommOverlapP2PBase keeps the received
  chunks for the final reduction);
- a dgrad configured with a method other than bulk becomes a reduce-scatter GEMM (and its wgrad
  an all-gather one with a bf16 buffer).
TE also widens its cuBLAS workspace to three streams (`get_workspace().repeat(3)`), inside
PyTorch's allocator. Not counted: what the userbuffers library keeps besides (its one shared
communicator's flags) and CUDA VMM's rounding of multicast buffers to its allocation
granularity. The 2·tp−1 chunks of a ring-exchange reduce-scatter are TE's C++ allocation
(CommOverlapP2PBase); its sources are not on the package index, and the headers here show the
chunk count (`_num_ubuf_chunks`) but not the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from metatrace.errors import ConfigError

UB_STREAMS = 3
"""TE's _NUM_MAX_UB_STREAMS: the cuBLAS workspace is repeated this many times."""

_ALL_GATHER = [
    "qkv_fprop",
    "qkv_dgrad",
    "proj_dgrad",
    "proj_wgrad",
    "fc1_fprop",
    "fc1_dgrad",
    "fc2_dgrad",
    "fc2_wgrad",
]
_REDUCE_SCATTER = ["proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad"]
_METHODS = {
    "ring_exchange": ["qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"],
    "pipeline": ["proj_fprop", "fc2_fprop"],
    "bulk": ["qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad"],
    "external": ["proj_wgrad", "fc2_wgrad"],
}
_EXTERNAL = {"proj_wgrad": "proj_dgrad", "fc2_wgrad": "fc2_dgrad"}


class UbError(ConfigError):
    """A userbuffers configuration Transformer Engine refuses."""


@dataclass(frozen=True)
class Userbuffer:
    name: str
    """TE's GEMM name, e.g. qkv_fprop."""
    method: str
    reduce_scatter: bool
    fp8: bool
    """A 1-byte buffer."""
    shape: tuple[int, int]
    """initialize_ub's shape: [seq * mbs / cp, hidden]."""
    nbytes: int
    margin: int = 0
    """Multiprocessors the GEMM leaves to the collective beside it (num_sm with set_sm_margin;
    TE's defaults: 16 for pipeline, bulk and external, none for ring_exchange, which copies with
    the copy engines)."""


def ub_shape(job) -> tuple[int, int]:
    tr, par = job.training, job.parallel
    return (tr.seq_length * tr.micro_batch_size // par.cp, job.model.hidden_size)


def userbuffers(job) -> list[Userbuffer]:
    """The buffers initialize_ub allocates on every rank of `job` (none without
    parallel.tp_comm_overlap). Raises UbError where TE would refuse the configuration."""
    par = job.parallel
    if not par.tp_comm_overlap:
        return []
    tp = par.tp
    fp8 = job.training.precision == "fp8"
    cfg = {}
    if par.tp_comm_overlap_cfg is not None:
        cfg = {
            name: gemm for name, gemm in vars(par.tp_comm_overlap_cfg).items() if gemm is not None
        }
    all_gather, reduce_scatter = list(_ALL_GATHER), list(_REDUCE_SCATTER)
    methods = {k: list(v) for k, v in _METHODS.items()}
    for name in ("qkv_dgrad", "fc1_dgrad"):
        method = cfg[name].method if name in cfg else None
        if method is not None and method != "bulk":
            wgrad = name.replace("dgrad", "wgrad")
            if wgrad in cfg:
                raise UbError(
                    f"parallel.tp_comm_overlap_cfg: with {name} overlapped by {method}, "
                    f"Transformer Engine takes no {wgrad} entry"
                )
            reduce_scatter.remove(wgrad)
            all_gather.remove(name)
            reduce_scatter.append(name)
            methods["bulk"].remove(name)
            methods[method].append(name)
    rows, hidden = ub_shape(job)
    out = []
    for name in (
        methods["ring_exchange"] + methods["pipeline"] + methods["bulk"] + methods["external"]
    ):
        method = next(m for m, names in methods.items() if name in names)
        user = cfg.get(name)
        if user is not None and user.method is not None:
            method = user.method
        is_rs = name in reduce_scatter
        if user is not None and user.is_reduce_scatter is not None:
            is_rs = user.is_reduce_scatter
        fp8_buf = name in all_gather
        if user is not None:
            fp8_buf = name in all_gather or bool(user.fp8_buf and name in methods["pipeline"])
        if not is_rs and method == "pipeline":
            raise UbError(
                f"parallel.tp_comm_overlap_cfg.{name}: the pipeline method cannot all-gather "
                "(Transformer Engine refuses it); use ring_exchange or bulk"
            )
        if name in _EXTERNAL and method != "external":
            raise UbError(
                f"parallel.tp_comm_overlap_cfg.{name}: Transformer Engine overlaps it with "
                f"{_EXTERNAL[name]}'s ring exchange only (method external)"
            )
        nbytes = rows * hidden * (1 if fp8 and fp8_buf else 2)
        if method == "ring_exchange" and is_rs:
            nbytes = nbytes // tp * (2 * tp - 1)
        ring = method == "ring_exchange"  # TE's get_default_config
        num_sm = user.num_sm if user is not None and user.num_sm is not None else 1 if ring else 16
        set_margin = not ring
        if user is not None and user.set_sm_margin is not None:
            set_margin = user.set_sm_margin
        margin = num_sm if set_margin else 0
        out.append(Userbuffer(name, method, is_rs, fp8 and fp8_buf, (rows, hidden), nbytes, margin))
    return out


def userbuffer_bytes(job) -> int:
    """Bytes of every userbuffer on one rank (outside PyTorch's allocator)."""
    return sum(b.nbytes for b in userbuffers(job))
