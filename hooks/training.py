"""Patches applied around a training iteration (metatrace.tracing.iteration, .measure).

- megatron-core's `schedules.backward_step`, replaced by the replay's backward step or wrapped to
  mark each real one; through hooks/patches.py's `patched`, so its target is checked as every
  patch's is;
- for `metatrace measure` on the CPU: the batch broadcast made local, and CPU dropout kernels
  that allocate what the CUDA kernels do.

Each restores what it replaced on exit, also on error.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from metatrace.hooks.guards import EVERY_RELEASE
from metatrace.hooks.patches import Patch, patched


def _backward_step(make) -> Patch:
    return Patch(
        "megatron.core.pipeline_parallel.schedules",
        "backward_step",
        make,
        EVERY_RELEASE,
        "the schedules call the module's backward_step for each micro-batch's backward: the "
        "replay stands in for it, or each real call is marked.",
    )


def combined_schedules(no_pipelining, interleaved):
    """megatron-core's combined 1F1B steps (overlap_moe_expert_parallel_comm), which run a
    GPTModel's fine-grained schedule plan on CUDA streams, replaced by `no_pipelining` and
    `interleaved` (same signatures; metatrace.tracing.overlap's); the schedules around them
    (warm-up counts, sends, grad sync) stay megatron-core's."""
    return patched(_combined_patches(no_pipelining, interleaved))


def _combined_patches(no_pipelining, interleaved) -> tuple[Patch, ...]:
    module = "megatron.core.pipeline_parallel.schedules"
    why = (
        "schedules.py imports the combined 1F1B steps from combined_1f1b.py; they need streams "
        "and a schedule plan: the replay runs each as a backward then a forward step."
    )
    return (
        Patch(
            module,
            "combined_1f1b_schedule_for_no_pipelining",
            lambda orig: no_pipelining,
            EVERY_RELEASE,
            why,
        ),
        Patch(
            module,
            "combined_1f1b_schedule_for_interleaved_pipelining",
            lambda orig: interleaved,
            EVERY_RELEASE,
            why,
        ),
    )


def replayed_backward(step):
    """schedules.backward_step replaced by `step` (the replay's, same signature) while active."""
    return patched((_backward_step(lambda orig: step),))


def marked_backward(rec):
    """schedules.backward_step with each call inside a backward Window of `rec` (the real
    steps)."""

    def make(_orig_backward_step):
        def step(*args):
            with rec.window("backward"):
                return _orig_backward_step(*args)

        return step

    return patched((_backward_step(make),))


@contextlib.contextmanager
def local_broadcasts():
    """The batch broadcast (Megatron-LM's get_batch_on_this_tp_rank) moves nothing in the fake
    world: a receiving TP rank would embed uninitialised token ids. Generate what it receives
    locally instead: zeros (token ids, labels, positions, the mask), ones for float tensors (the
    loss mask). Memory does not depend on the values."""
    import torch.distributed as dist

    _orig_broadcast = dist.broadcast

    def broadcast(tensor, *args, **kwargs):
        work = _orig_broadcast(tensor, *args, **kwargs)
        if dist.get_rank() != (args[0] if args else kwargs.get("src")):
            tensor.fill_(1 if tensor.is_floating_point() else 0)
        return work

    dist.broadcast = broadcast
    try:
        yield
    finally:
        dist.broadcast = _orig_broadcast


@contextlib.contextmanager
def cuda_like_dropout():
    """CPU kernels for dropout that allocate what the CUDA kernels do. ATen's CPU dropout
    multiplies by the bool mask through TensorIterator, which first copies the mask to the
    input's dtype (a second activation-sized buffer, [b, heads, s, s] for attention dropout),
    and its backward keeps `grad * mask` alive while `* scale` allocates the result; the CUDA
    kernels (fused_dropout, masked_scale) allocate only the output and the mask. Kernel
    scratch is not what the prediction models, so the CPU run is made to allocate like the GPU:
    output and mask, nothing else (the 0-dim zero is a 512-byte host scalar per call)."""

    def native_dropout(input, p, train):
        if train is False or p == 0:
            return input.clone(), torch.ones_like(input, dtype=torch.bool)
        mask = torch.empty_like(input, dtype=torch.bool).bernoulli_(1 - p)
        out = input.mul(1 / (1 - p)) if p < 1 else torch.zeros_like(input)
        torch.where(mask, out, torch.zeros((), dtype=out.dtype), out=out)
        return out, mask

    def native_dropout_backward(grad_output, mask, scale):
        out = grad_output.mul(scale)
        torch.where(mask, out, torch.zeros((), dtype=out.dtype), out=out)
        return out

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        lib.impl("native_dropout", native_dropout, "CPU")
        lib.impl("native_dropout_backward", native_dropout_backward, "CPU")
    try:
        yield
    finally:
        lib._destroy()


MIXED_ADD_CHUNK = 1024
"""Elements of the other operand cast at a time by cuda_like_mixed_adds (a 4 KiB fp32
temporary)."""


@contextlib.contextmanager
def cuda_like_mixed_adds():
    """A CPU `add_` that allocates what the CUDA kernel does when its operand has another dtype
    than the tensor it adds into: megatron-core's DDP adds each bf16 gradient into its fp32
    main_grad (param.main_grad.add_(param.grad.data)). CUDA's TensorIterator casts the operand
    inside the kernel; the CPU's first copies all of it to fp32 (TensorIteratorBase::compute_types
    on a CPU common device: a gradient-sized temporary, an embedding's [vocab, hidden] in fp32,
    which sets the peak of a first pipeline stage). Here the operand is cast a chunk of
    MIXED_ADD_CHUNK elements at a time; same-dtype adds, and adds with broadcasting, run as
    before (add.out into the tensor itself)."""

    def add_(self, other, *, alpha=1):
        mixed = (
            isinstance(other, torch.Tensor)
            and other.dtype != self.dtype
            and other.shape == self.shape
            and self.is_contiguous()
            and other.is_contiguous()
            and self.numel() > MIXED_ADD_CHUNK
        )
        if not mixed:
            return torch.add(self, other, alpha=alpha, out=self)
        flat, part = self.view(-1), other.reshape(-1)
        for i in range(0, flat.numel(), MIXED_ADD_CHUNK):
            piece = flat[i : i + MIXED_ADD_CHUNK]
            torch.add(piece, part[i : i + MIXED_ADD_CHUNK], alpha=alpha, out=piece)
        return self

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        lib.impl("add_.Tensor", add_, "CPU")
    try:
        yield
    finally:
        lib._destroy()
