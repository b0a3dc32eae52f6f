"""One training iteration of a rank, under megatron-core's own schedule, its steps replayed.

megatron-core's `get_forward_backward_func()` runs with the job's number of micro-batches, wired
as Megatron-LM's train()/train_step() wire it (no_sync / grad_sync / param_sync functions,
finalize_model_grads, the gradient buffers zeroed first, the optimizer step after). Everything
around the model is megatron-core's own code: the warm-up and chunk order of 1F1B or the
interleaved schedule, the pipeline sends and receives (P2PCommunicator), the deallocation of
sent outputs, the DDP gradient synchronisation, the optimizer step.

Only the two functions that run the model are replaced while the schedule runs,
`schedules.forward_step` and `schedules.backward_step`: each replays what the same step did to
memory in the traced micro-batch (metatrace.memory.StepProfile), with placeholder tensors:
- forward: the output (handed on, then freed by the schedule), the activations the step keeps
  until its backward (one tensor of that size), and its temporaries (allocated and freed at the
  highest point the step reached);
- backward: its temporaries at their highest point, then the activations are freed, the DDP
  gradient hooks of the chunk's parameters run (they accumulate into the main-grad buffers and,
  with overlap_grad_reduce, launch the bucket reductions), and the gradient of the input is
  handed back.
A step's micro-batches all have the same shapes, so one traced micro-batch stands for all; this
keeps an iteration of hundreds of micro-batches at the cost of a few operators per step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from metatrace.memory import StepProfile


@dataclass(frozen=True)
class StepShape:
    """What a chunk's forward step hands on (the output's shape and dtype)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


_HELD = "_metatrace_held"  # attribute of a replayed output: (chunk, micro-batch, held tensor)


def wire_training_config(job, config, model, optimizer) -> None:
    """Megatron-LM's train(): the schedule's hooks into DDP and the optimizer."""
    from megatron.core.distributed import finalize_model_grads

    tr = job.training
    config.grad_scale_func = optimizer.scale_loss
    config.timers = None
    if tr.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
        # --align-grad-reduce is on by default.
        grad_sync = [chunk.start_grad_sync for chunk in model]
        config.grad_sync_func = grad_sync[0] if len(model) == 1 else grad_sync
    if tr.overlap_param_gather and job.parallel.vpp is not None:  # align_param_gather
        param_sync = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = param_sync[0] if len(model) == 1 else param_sync
    config.finalize_model_grads_func = finalize_model_grads


class _Replay:
    """The replacements for schedules.forward_step / backward_step, for one rank."""

    def __init__(self, *, rec, model, profiles, shapes, device):
        self.rec = rec
        self.device = device
        self.profiles = profiles
        self.shapes = shapes
        self.chunk_of = {id(chunk): v for v, chunk in enumerate(model)}
        # DDP's gradient hooks per chunk, in backward order (last parameter first).
        self.hooks = [
            [(p, chunk._make_backward_post_hook(p)) for p in reversed(list(chunk.parameters()))]
            for chunk in model
        ]

    def _empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def forward_step(
        self,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        input_tensor,
        forward_data_store,
        config,
        cp_group_size,
        collect_non_loss_data=False,
        checkpoint_activations_microbatch=None,
        is_first_microbatch=False,
        current_microbatch=None,
        vp_stage=None,
        is_last_stage=True,
    ):
        v = self.chunk_of[id(model)]
        prof: StepProfile = self.profiles[("forward", v)]
        shape = self.shapes[v]
        with self.rec.window("forward", v, current_microbatch) as window:
            with self.rec.label(prof.module, "forward"):
                output = torch.empty(shape.shape, dtype=shape.dtype, device=self.device)
                output.requires_grad_()
                held = self._empty(prof.held) if prof.held else None
                extra = prof.excess - prof.held - output.untyped_storage().nbytes()
                if extra > 0:
                    del_me = self._empty(extra)
                    del del_me
            window["output"] = output
            window["held"] = held
        setattr(output, _HELD, (v, current_microbatch, held))
        if is_last_stage:
            num_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        else:
            num_tokens = torch.tensor(0, dtype=torch.int)
        if isinstance(input_tensor, list):
            return [output], num_tokens
        return output, num_tokens

    def backward_step(self, input_tensor, output_tensor, output_tensor_grad, model_type, config):
        out = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
        v, microbatch, held = out.__dict__.pop(_HELD)
        prof: StepProfile = self.profiles[("backward", v)]
        unwrap = not isinstance(input_tensor, list)
        inputs = [input_tensor] if unwrap else input_tensor
        with self.rec.window("backward", v, microbatch):
            with self.rec.label(prof.module, "backward"):
                if prof.excess:
                    temporaries = self._empty(prof.excess)
                    del temporaries
                del held
            zeros = {}
            for param, hook in self.hooks[v]:
                if param.requires_grad:
                    zero = zeros.get(param.dtype)
                    if zero is None:
                        zero = zeros[param.dtype] = torch.zeros((), dtype=param.dtype, device=self.device)
                    param.grad = zero.expand(param.shape)
                    hook()
            del zeros
            grads = []
            for x in inputs:
                if x is None:
                    grads.append(None)
                    continue
                x.grad = torch.empty_like(x)
                grads.append(x.grad)
        return grads[0] if unwrap else grads


@contextlib.contextmanager
def _replaying(replay: _Replay):
    from megatron.core.pipeline_parallel import schedules

    saved = schedules.forward_step, schedules.backward_step
    schedules.forward_step, schedules.backward_step = replay.forward_step, replay.backward_step
    try:
        yield
    finally:
        schedules.forward_step, schedules.backward_step = saved


def run_iteration(job, config, model, optimizer, *, rec, profiles, shapes, device) -> None:
    """One iteration as Megatron-LM's train_step runs it, recorded by `rec`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from metatrace.hooks.remap import unknown_values

    tr = job.training
    wire_training_config(job, config, model, optimizer)
    replay = _Replay(rec=rec, model=model, profiles=profiles, shapes=shapes, device=device)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    rec.set_step_phase("forward")
    iterators = [None] * len(model)
    with _replaying(replay):
        get_forward_backward_func()(
            forward_step_func=None,
            data_iterator=iterators if len(model) > 1 else iterators[0],
            model=model if len(model) > 1 else model[0],
            num_microbatches=job.num_microbatches,
            seq_length=tr.seq_length,
            micro_batch_size=tr.micro_batch_size,
            forward_only=False,
        )
    rec.set_step_phase("optimizer")
    with rec.window("optimizer"), unknown_values(device):
        optimizer.step()
