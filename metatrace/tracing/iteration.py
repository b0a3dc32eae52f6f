"""One training iteration of a rank, under megatron-core's own schedule, its steps replayed.

megatron-core's `get_forward_backward_func()` runs with the job's number of micro-batches, wired
as Megatron-LM's train()/train_step() wire it (no_sync / grad_sync / param_sync functions,
finalize_model_grads, the gradient buffers zeroed first, the optimizer step after). Everything
around the model is megatron-core's own code: the warm-up and chunk order of 1F1B or the
interleaved schedule, the pipeline sends and receives (P2PCommunicator), the deallocation of
sent outputs, the DDP gradient synchronisation, the optimizer step.

Only the two functions that run the model are replaced while the schedule runs,
`schedules.forward_step` and `schedules.backward_step` (hooks/training.py): each replays what the same step did to
memory in the traced micro-batch (metatrace.analysis.memory.StepProfile), with placeholder tensors:
- forward: the output (handed on, then freed by the schedule), the activations the step keeps
  until its backward (one tensor of that size), and its temporaries (allocated and freed at the
  highest point the step reached);
- backward: its temporaries at their highest point, then the activations are freed, the DDP
  gradient hooks of the chunk's parameters run (they accumulate into the main-grad buffers and,
  with overlap_grad_reduce, launch the bucket reductions), and the gradient of the input is
  handed back;
- with fine-grained activation offloading, beside them, the activations megatron-core's offload
  manager keeps on the GPU or brings back ahead of a backward step in its steady state (one
  tensor, memory.offload_slots, allocated outside the step's window); with megatron-core 0.19's
  activation_offload_fraction, each forward step keeps what its micro-batch's handler keeps
  (memory.offload_profiles: ("forward", chunk, micro-batch) where it differs from the chunk's).
A step's micro-batches all have the same shapes, so one traced micro-batch stands for all; this
keeps an iteration of hundreds of micro-batches at the cost of a few operators per step.

Past a few hundred micro-batches, `replayed_iteration` replays four short iterations instead (of
M0, M0+P, M0+2P and M0+3P micro-batches, P the schedule's group, each from the state the whole
replay would start from) and builds the job's iteration from their steady state
(metatrace.tracing.steady, which says why the result is exactly the whole replay's and checks
it); where the check fails, it replays the whole iteration. Every output (memory, timeline,
communication, time model, Chrome trace, memory snapshot) reads the same records either way.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from dataclasses import dataclass

import torch

from metatrace.analysis.memory import StepProfile
from metatrace.models.build import is_fsdp
from metatrace.tracing import fsdp


@dataclass(frozen=True)
class StepShape:
    """What a chunk's forward step hands on (the output's shape and dtype)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Deferred:
    """--defer-embedding-wgrad-compute, as the traced micro-batch did it on the last stage: what
    it appended to the output layer's buffers (megatron-core's embedding_activation_buffer and
    grad_output_buffer), and the bytes it kept until the pipeline flush."""

    activations: tuple[StepShape, ...]
    grads: tuple[StepShape, ...]
    kept: int = 0


OFFLOAD_SLOT = "activation offloading: the steady state's reloads ahead"
"""Module name of the replay's offload slot."""
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
    config.finalize_model_grads_func = _reading_unknown_values(finalize_model_grads)


def _reading_unknown_values(func):
    """`func` run where values read back to the host are 0 (per-token loss branches on the
    token count)."""
    from metatrace.hooks.remap import unknown_values

    def run(*args, **kwargs):
        with unknown_values(_device_of(args)):
            return func(*args, **kwargs)

    return run


def _device_of(args):
    model = args[0]
    chunk = model[0] if isinstance(model, list) else model
    return next(chunk.parameters()).device


class _Replay:
    """What runs the model in megatron-core's schedule, replayed for one rank: the
    forward_step_func handed to the schedule (batch and model forward; megatron-core's own
    forward_step around it does the rest), and a replacement for schedules.backward_step."""

    def __init__(
        self, *, rec, model, profiles, shapes, device, deferred=None, slots=(), microbatches=0
    ):
        self.rec = rec
        self.model = model
        self.device = device
        self.profiles = profiles
        self.shapes = shapes
        self.chunk_of = {id(chunk): v for v, chunk in enumerate(model)}
        self.calls = [0] * len(model)
        self.places: dict[int, tuple] = {}  # chunk -> (the last virtual stage?, its decoder)
        self.combined: dict[int, int] = {}  # chunk -> fsdp.combined_extra
        # DDP's gradient hooks per chunk, in backward order (last parameter first).
        self.hooks = [_gradient_hooks(chunk) for chunk in model]
        self.launches = [_launches_reductions(chunk) for chunk in model]
        # --defer-embedding-wgrad-compute (trace.run_microbatch): the entries one micro-batch
        # appends to the last chunk's buffers, and the bytes it keeps until the flush.
        self.deferred: Deferred | None = deferred
        # Fine-grained activation offloading (memory.offload_slots): the activations the steady
        # state keeps on the GPU or brings back ahead of a backward step, about one chunk's
        # last layer, from the first forward step to the last backward step; its size follows
        # the chunk whose step runs.
        self.slots = slots
        self.slot = None
        self.backward_steps = 0
        self.microbatches = microbatches
        self.last_backward = microbatches * len(model)

    def _empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def forward_step_func(self, data_iterator, model):
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_attr_wrapped_model

        from metatrace.tracing.steps import loss_func

        v = self.chunk_of[id(model)]
        microbatch = self.calls[v]
        self.calls[v] += 1
        if v == 0 and self.microbatches >= _LONG and microbatch and microbatch % 1000 == 0:
            print(f"  {microbatch}/{self.microbatches} micro-batches", file=sys.stderr)
        self.rec.set_step_phase("forward")
        if microbatch == 0:
            self._gather_params(model)
            if fsdp.hybrid(model):
                fsdp.outer_gather(model, backward=False)
        prof: StepProfile = (
            self.profiles.get(("forward", v, microbatch)) or self.profiles[("forward", v)]
        )
        shape = self.shapes[v]
        if v not in self.places:  # (the same for every micro-batch)
            vp_stage = get_attr_wrapped_model(model, "vp_stage")
            self.places[v] = (
                ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                get_attr_wrapped_model(model, "decoder"),
            )
        last, decoder = self.places[v]
        mask_shape = StepShape((shape.shape[0], shape.shape[-1]), torch.float32)
        self._hold_slot(v, "forward")
        with self.rec.window("forward", v, microbatch) as window:
            with self.rec.label(prof.module, "forward"):
                held_bytes = prof.held
                acts = self._defers(model, "embedding_activation_buffer") if last else None
                if acts is not None:
                    # The output layer's input, kept by the buffer past the backward step.
                    buffer, room = acts
                    for entry in self.deferred.activations[:room]:
                        buffer.append(
                            torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
                        )
                        held_bytes -= _nbytes(entry)
                held = self._empty(held_bytes) if held_bytes else None
                # The loss mask Megatron-LM's loss function keeps for backward, and the output
                # when it is kept too, are views into `held`; an output handed on (or dropped
                # after the loss) is a tensor of its own.
                kept = [mask_shape] if last else []
                if prof.output:
                    output = torch.empty(shape.shape, dtype=shape.dtype, device=self.device)
                    extra = prof.excess - prof.held - _nbytes(shape)
                else:
                    kept.insert(0, shape)
                    extra = prof.excess - prof.held
                views = _carve(held, kept, self._empty)
                if not prof.output:
                    output = views.pop(0)
                if extra > 0:
                    self._empty(extra)  # the step's temporaries at its highest point
            window["output"] = output
            window["held"] = held
        # The output's autograd graph ends in the input's AccumulateGrad node, which keeps the
        # received input alive for as long as the schedule holds the output (or the loss).
        received = decoder.input_tensor
        tag = (v, microbatch, held, received)
        setattr(output, _HELD, tag)
        if not last:
            return output, None

        def loss(output_tensor, mask=views[0], tag=tag):
            # The schedule runs backward from the loss: it carries the step's tag.
            result = loss_func(mask, output_tensor)
            setattr(result[0], _HELD, tag)
            return result

        return output, loss

    def hold_overlap(self, v: int):
        """overlap_moe_expert_parallel_comm: the extra of a combined step whose forward runs
        chunk v (StepProfile.overlap; with Megatron-FSDP sharding the parameters, one layer's
        gathered parameters more, fsdp.combined_extra), alive while the caller holds it."""
        n = self.profiles[("forward", v)].overlap
        if v not in self.combined:  # (the same for every step)
            self.combined[v] = fsdp.combined_extra(self.model[v])
        extra = self.combined[v]
        held = [self._empty(b) for b in (n, extra) if b]
        return held or None

    def _hold_slot(self, v: int, phase: str) -> None:
        """The offload slot of chunk `v` (memory.offload_slots), allocated before the step's
        window: not the step's own memory, which the allocator simulation takes from the traced
        micro-batch (analysis.device), but an allocation of its own."""
        if not self.slots or self.backward_steps >= self.last_backward:
            return
        if self.slot is None or self.slot.numel() != self.slots[v]:
            self.slot = None  # freed before its successor is allocated, as the GPU reuses it
            with self.rec.label(OFFLOAD_SLOT, phase):
                self.slot = self._empty(self.slots[v]) if self.slots[v] else None

    def _defers(self, chunk, name):
        """(buffer, how many of this step's entries megatron-core appends to it) for the chunk's
        deferral buffer `name`, or None: each output-layer call appends while
        wgrad_deferral_limit is 0 or the buffer holds fewer entries than the limit (the limit
        counts calls, e.g. 1 + mtp_num_layers per micro-batch)."""
        if self.deferred is None:
            return None
        from megatron.core.utils import get_attr_wrapped_model

        gpt = get_attr_wrapped_model(chunk, "post_process", return_model_obj=True)
        buffer = getattr(gpt, name, None)
        if buffer is None or not gpt.post_process:
            return None
        entries = len(self.deferred.activations)
        limit = gpt.config.wgrad_deferral_limit
        room = entries if limit == 0 else max(0, min(entries, limit - len(buffer)))
        return (buffer, room) if room else None

    def _defer_grads(self, buffer, room, inputs) -> None:
        """Append the logits gradient(s) of a deferred micro-batch to megatron-core's
        grad_output_buffer. The output layer's kept input holds its autograd graph, which holds
        the received pipeline input and its gradient (AccumulateGrad): the first entry keeps
        references to them, and a storage of its own stands for anything else the traced
        micro-batch kept until the flush; all of it goes when megatron-core's drain pops it."""
        d = self.deferred
        rest = d.kept - sum(_nbytes(e) for e in (*d.activations, *d.grads))
        rest -= sum(_storage_bytes(x) + _storage_bytes(x.grad) for x in inputs)
        for i, entry in enumerate(d.grads[:room]):
            n = _nbytes(entry)
            if i == 0 and rest > 0:
                t = _carve(self._empty(n + rest), [entry], self._empty)[0]
            else:
                t = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
            if i == 0:
                t._metatrace_kept = inputs
            buffer.append(t)

    def _gather_params(self, chunk) -> None:
        """What DDP's forward pre-hooks do in the first forward of an iteration with
        overlap_param_gather: finish (dispatching where not yet dispatched) the parameter
        all-gather of every bucket, in the order the forward reaches them."""
        if not getattr(chunk, "use_forward_hook", False):  # Megatron-FSDP: in the steps
            return
        skip_next = (
            chunk.ddp_config.align_param_gather or chunk.overlap_param_gather_with_optimizer_step
        )
        seen = set()
        for param in chunk.module.parameters():
            group = chunk.param_to_bucket_group.get(param)
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                group.finish_param_sync(skip_next_bucket_dispatch=skip_next)

    def backward_step(self, input_tensor, output_tensor, output_tensor_grad, *_):
        # *_: (model_type, config) in megatron-core 0.16.1, (config,) in 0.19
        self.rec.set_step_phase("backward")
        out = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
        v, microbatch, held, _ = out.__dict__[_HELD]
        out.__dict__[_HELD] = out.__dict__[_HELD][3:]  # the input stays referenced, as by the graph
        prof: StepProfile = self.profiles[("backward", v)]
        unwrap = not isinstance(input_tensor, list)
        inputs = [input_tensor] if unwrap else input_tensor
        self._hold_slot(v, "backward")
        with self.rec.window("backward", v, microbatch):
            if microbatch == 0 and fsdp.hybrid(self.model[v]):
                fsdp.outer_gather(self.model[v], backward=True)
            with self.rec.label(prof.module, "backward"):
                if prof.excess:
                    self._empty(prof.excess)  # the step's temporaries at its highest point
                del held
                deferring = self._defers(self.model[v], "grad_output_buffer")
            zeros = {}
            # The hooks accumulate into main_grad (in place, nothing allocated) and, with
            # overlap_grad_reduce, launch a bucket's reduction once every parameter of the last
            # micro-batch has its gradient: only that micro-batch needs them run.
            launches = self.launches[v]()
            for param, hook in self.hooks[v] if launches else ():
                if param.requires_grad:
                    zero = zeros.get(param.dtype)
                    if zero is None:
                        zero = zeros[param.dtype] = torch.zeros(
                            (), dtype=param.dtype, device=self.device
                        )
                    param.grad = zero.expand(param.shape)
                    hook()
            del zeros
            if launches and is_fsdp(self.model[v]):
                fsdp.reduce_unsharded(self.model[v])
            if fsdp.hybrid(self.model[v]) and fsdp.last_microbatch(self.model[v]):
                fsdp.outer_reduce(self.model[v])
            grads = []
            for x in inputs:
                if x is None:
                    grads.append(None)
                    continue
                x.grad = torch.empty_like(x)
                grads.append(x.grad)
            if deferring is not None:
                self._defer_grads(*deferring, [x for x in inputs if x is not None])
            self.backward_steps += 1
            if self.backward_steps == self.last_backward:
                self.slot = None
        return grads[0] if unwrap else grads


class Unrecorded:
    """What run_iteration tells a recorder, for an iteration nobody records (one that only
    brings megatron-core's state to its steady state)."""

    def set_step_phase(self, phase: str) -> None:
        pass

    @contextlib.contextmanager
    def window(self, *args, **kwargs):
        yield {}

    label = window


def _gradient_hooks(chunk) -> list:
    """(parameter, DDP's gradient hook) of `chunk`, in backward order (last parameter first).
    Megatron-FSDP has none to run: its gradient handling is in the traced steps (their
    temporaries, and the reduce-scatters of sharded gradients among the micro-batch's
    collectives), but for metatrace.tracing.fsdp."""
    if is_fsdp(chunk):
        return []
    return [(p, chunk._make_backward_post_hook(p)) for p in reversed(list(chunk.parameters()))]


def _steady_state(chunk) -> None:
    """Make the iteration a steady-state one (the second or later). In its first iteration,
    megatron-core's DDP (0.13 and later) counts which gradient hooks fire and launches every
    bucket reduction only when the gradients are finalized; from the second on, a bucket's
    reduction launches from the hooks in backward, as soon as its gradients are ready. Each hook
    fires once per parameter in the last micro-batch (as the replay runs them)."""
    if is_fsdp(chunk):
        return
    for group in [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]:
        if hasattr(group, "golden_per_param_grad_ready_counts") and group.is_first_batch:
            group.golden_per_param_grad_ready_counts = {p: 1 for p in group.params}
            group.is_first_batch = False


def _launches_reductions(chunk):
    """Whether a backward step of `chunk` now would launch DDP's bucket reductions (Megatron-
    FSDP's, for gradients it reduces after the last micro-batch only)."""
    if is_fsdp(chunk):
        wrapped = chunk.module
        delayed = wrapped.is_delay_grad_reduce and chunk.ddp_config.overlap_grad_reduce
        return lambda: delayed and getattr(wrapped, "is_last_microbatch", False)
    groups = [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]
    overlap = chunk.ddp_config.overlap_grad_reduce
    return lambda: overlap and any(g.is_last_microbatch for g in groups)


def _storage_bytes(t) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def _nbytes(shape: StepShape) -> int:
    n = 1
    for d in shape.shape:
        n *= d
    return n * shape.dtype.itemsize


def _carve(held, shapes, empty):
    """Tensors of `shapes` laid one after another in `held`'s storage (views, nothing
    allocated); a fresh tensor for any that does not fit."""
    out, offset = [], 0
    for shape in shapes:
        n = _nbytes(shape)
        if held is not None and offset + n <= held.numel():
            t = held[offset : offset + n]
        else:
            t = empty(n)
        out.append(t.view(shape.dtype).view(shape.shape))
        offset += n
    return out


def _marked(rec, model, forward_step_func):
    """`forward_step_func` with each call marked as a forward Window (the real steps)."""
    chunk_of = {id(chunk): v for v, chunk in enumerate(model)}
    calls = [0] * len(model)

    def step(data_iterator, chunk):
        v = chunk_of[id(chunk)]
        calls[v] += 1
        with rec.window("forward", v, calls[v] - 1) as window:
            output, loss = forward_step_func(data_iterator, chunk)
            window["output"] = output
        return output, loss

    return step


def run_iteration(
    job,
    config,
    model,
    optimizer,
    *,
    rec,
    profiles=None,
    shapes=None,
    device,
    real_steps=False,
    batches=None,
    deferred: Deferred | None = None,
    slots=(),
    reduced: int | None = None,
) -> None:
    """One iteration as Megatron-LM's train_step runs it, recorded by `rec`.

    With `real_steps` the model itself runs every step (Megatron-LM's forward_step on synthetic
    batches, or on the iterators `batches()` makes, one per chunk): slow, but the reference the
    replay is tested against, and what `metatrace measure` runs.

    `reduced`: how many micro-batches' losses Megatron-LM's train_step reduces after the
    optimizer step (default: this iteration's). The short replays of replayed_iteration reduce
    the whole iteration's: the stacked losses are the one allocation outside the schedule's
    loop whose size follows the micro-batch count (rounded to blocks, so not in steps); they
    stack their own losses into a stack of the whole iteration's size (steps.reduce_losses)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from metatrace.hooks.remap import unknown_values
    from metatrace.hooks.training import combined_schedules, marked_backward, replayed_backward
    from metatrace.tracing import overlap
    from metatrace.tracing.steps import make_forward_step, reduce_losses, synthetic_batches

    tr = job.training
    wire_training_config(job, config, model, optimizer)
    finalize = config.finalize_model_grads_func

    def finalize_in_window(*args, **kwargs):
        rec.set_step_phase("grad sync")
        with rec.window("grad sync"):
            return finalize(*args, **kwargs)

    config.finalize_model_grads_func = finalize_in_window
    fsdp.new_iteration(model)
    for chunk in model:
        _steady_state(chunk)
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    rec.set_step_phase("forward")
    if real_steps:
        shape = dict(
            micro_batch_size=tr.micro_batch_size,
            seq_length=tr.seq_length,
            attention_mask=tr.create_attention_mask_in_dataloader,
        )
        step_func = _marked(rec, model, make_forward_step(**shape))
        iterators = [(batches or (lambda: synthetic_batches(**shape)))() for _ in model]
        context = marked_backward(rec)
        hold = lambda v: None
    else:
        replay = _Replay(
            rec=rec,
            model=model,
            profiles=profiles,
            shapes=shapes,
            device=device,
            deferred=deferred,
            slots=slots,
            microbatches=job.num_microbatches,
        )
        step_func, iterators = replay.forward_step_func, [None] * len(model)
        context = replayed_backward(replay.backward_step)
        hold = replay.hold_overlap
    combined = contextlib.nullcontext()
    if config.overlap_moe_expert_parallel_comm:  # metatrace.tracing.overlap
        combined = combined_schedules(
            overlap.combined_no_pipelining(hold), overlap.combined_interleaved(hold)
        )
    delayed = overlap.delayed_wgrad(model) if real_steps else contextlib.nullcontext()
    with context, combined, delayed:
        losses = get_forward_backward_func()(
            forward_step_func=step_func,
            data_iterator=iterators,
            model=model,
            num_microbatches=job.num_microbatches,
            seq_length=tr.seq_length,
            micro_batch_size=tr.micro_batch_size,
            forward_only=False,
        )
    rec.set_step_phase("optimizer")
    with rec.window("optimizer"), unknown_values(device):
        optimizer.step()
        reduce_losses(losses, rows=reduced)


# ----------------------------------------------------------------------------- many micro-batches


def steady_counts(job, config, deferred: Deferred | None = None) -> list[int] | None:
    """The micro-batch counts M0 + n*P (n = 0..3) whose replays steady.fit extends to the job's
    count M (M0 = M modulo P), or None when M is below M0.

    P is the group the schedule repeats: one micro-batch (no pipelining, 1F1B), or the
    interleaved schedule's microbatch_group_size_per_vp_stage (its last group takes what is
    left, so M0 keeps M's remainder). M0 is past every counter the replay turns on: the warm-up
    (at most 2*pp + P micro-batches of the interleaved schedule, one more with the combined
    1F1B) and, with --defer-embedding-wgrad-compute and a limit, the micro-batches that fill the
    deferral buffers."""
    chunks = job.parallel.vpp or 1
    period = config.microbatch_group_size_per_vp_stage if chunks > 1 else 1
    least = 2 * job.parallel.pp + 2 * period + 2
    limit = getattr(config, "wgrad_deferral_limit", 0)
    if deferred is not None and deferred.activations and limit:
        least += -(-limit // len(deferred.activations))
    total = job.num_microbatches
    if total < least:
        return None
    first = least + (total - least) % period
    return [first + n * period for n in range(4)]


def replayed_iteration(job, config, replay, *, deferred=None, extend: bool | None = None):
    """The replayed iteration of the job's micro-batches: `replay(m)` records one of m
    micro-batches (run_iteration under a new recorder; `replay(m, reduced)` one whose optimizer
    step reduces `reduced` micro-batches' losses) and returns its Trace.

    From steady.fit of four short replays, each in a forked process so that it starts from the
    state the whole replay starts from, where that is shorter (`extend` None) or wherever the
    count allows (True); else, or when the steady state does not check out, the whole
    iteration, with progress on stderr when it is long."""
    from metatrace.tracing import steady

    total = job.num_microbatches
    counts = steady_counts(job, config, deferred) if extend is not False else None
    tried = counts is not None and (extend or total > sum(counts) + _FORKS) and hasattr(os, "fork")
    if tried:
        samples = [_forked(replay, m, total) for m in counts]
        fitted = steady.fit(samples) if all(s is not None for s in samples) else None
        if fitted is not None:
            return fitted.trace((total - counts[0]) // (counts[1] - counts[0]))
    if total >= _LONG:
        why = " (its steady state did not check out)" if tried else ""
        print(
            f"metatrace: replaying all {total} micro-batches of the iteration{why}; "
            "this takes a while",
            file=sys.stderr,
        )
    return replay(total)


_FORKS = 200
"""What the four short replays cost beyond their micro-batches (a fork each, and each its
optimizer step), in micro-batches of a whole replay: Llama-2 70B's stage of 20 layers replays
128 micro-batches whole in 0.29 s, 256 in 0.51 s, 512 in 0.92 s, and extends from 4 x 12-15 in
0.45-0.49 s at any count (the debug model: 1,000 whole in 2.3 s per stage, extended 0.36 s)."""

_LONG = 2000
"""Micro-batches from which a whole replay says so on stderr (about 3 ms each on the debug
model)."""


def _forked(run, *args):
    """run(*args) in a forked child, which leaves this process as it was: its (pickled) result,
    or None when it failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(read)
            data = pickle.dumps(run(*args), protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(write, "wb") as out:
                out.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as src:
        data = src.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not data:
        return None
    return pickle.loads(data)
