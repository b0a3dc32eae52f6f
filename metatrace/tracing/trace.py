"""Tracing orchestration: for every distinct role, build the rank's model chunks inside the fake
world, as Megatron-LM builds them for training (DDP around each chunk, megatron-core's
optimizer), and record two things:

1. one micro-batch, forward and backward, as megatron-core's schedules run it for that rank: for
   each model chunk in order, receive the input from the previous stage, megatron-core's
   `forward_step` (with Megatron-LM's batch and loss on the first and last stages), send the
   output on and free it (`deallocate_output_tensor`); then for each chunk in reverse, receive
   the output gradient, megatron-core's `backward_step`, send the input gradient back.
   Point-to-point transfers go through megatron-core's `P2PCommunicator`, so they are recorded
   as the pipeline issues them. It runs as a micro-batch that is not the last of its iteration
   (under DDP's no_sync), so its records hold no gradient reduction, nor the first (Megatron-FSDP
   gathers across HSDP's instances there; metatrace.tracing.fsdp);
2. a whole training iteration under megatron-core's own schedule, with every forward and
   backward step replayed from (1) (metatrace.tracing.iteration), then the optimizer step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from metatrace.config.hardware import cublas_workspace_bytes
from metatrace.config.kernels import kernel_model
from metatrace.config.userbuffers import userbuffers
from metatrace.hooks import guards
from metatrace.records import JobTrace, RoleTrace
from metatrace.world import Role, World


def trace_job(
    job,
    *,
    device: str = "meta",
    full_model: bool = True,
    progress=None,
    workers: int | None = None,
    derive: bool = True,
) -> JobTrace:
    """Trace every role of `job` (and the unparallelised model when `full_model`).

    Roles are independent: with `workers` > 1 they are traced in that many forked processes
    (default: the CPUs available, at most 4). With `derive`, a middle pipeline stage that does
    the same work as one traced is derived from it (metatrace.tracing.stages)."""
    from metatrace.models.build import single_gpu_job, transformer_config
    from metatrace.tracing import stages

    progress = progress or (lambda message: None)
    start = time.perf_counter()
    world = World.from_job(job)
    keys = (
        stages.stage_keys(job, world, transformer_config(job))
        if derive and world.layout.pp > 2
        else {}
    )
    traced: list[Role] = []
    like: dict[int, Role] = {}  # a stage -> the traced stage it is derived from
    for role in world.roles():
        same = next(
            (t for t in traced if stages.same_work(keys.get(t.pp_stage), keys.get(role.pp_stage))),
            None,
        )
        if same is None:
            traced.append(role)
        else:
            like[role.pp_stage] = same
    tasks = [
        (
            f"pipeline stage {role.pp_stage} (rank {role.rank})",
            (job, world, role, device, True, None, bool(like)),
        )
        for role in traced
    ]
    if full_model:
        # First: the whole model on one GPU is the longest trace (all layers, all experts),
        # so it runs beside the roles rather than after them.
        single = single_gpu_job(job)
        single_world = World.from_job(single)
        tasks.insert(
            0,
            (
                "the full model on one GPU",
                (single, single_world, single_world.roles()[0], device, False, None, False),
            ),
        )
    if workers is None:
        workers = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)

    def derived(i: int, result) -> list:
        """The stages that do the same work as the one task i traced: their micro-batch
        derived, their iteration replayed (it depends on the stage)."""
        if not like or (full_model and i == 0):
            return []
        first, micro = result
        out = []
        for role in world.roles():
            if like.get(role.pp_stage) != first.role:
                continue
            source = first.role.pp_stage
            shifts = [b[0] - a[0] for a, b in zip(keys[source], keys[role.pp_stage])]
            trace = stages.derive(first.trace, role.rank, world, shifts, first.chunks)
            given = micro._replace(trace=trace) if trace is not None else None
            label = f"pipeline stage {role.pp_stage} (rank {role.rank})"
            out.append((label, (job, world, role, device, True, given, False)))
        return out

    pool = max(1, min(workers, len(tasks) + len(like)))
    results = _run_tasks(tasks, pool, progress, then=derived)
    full = results.pop(0) if full_model else None
    by_stage = {}
    for result in results:
        rt = result[0] if isinstance(result, tuple) else result
        by_stage[rt.role.pp_stage] = rt
    roles = [by_stage[role.pp_stage] for role in world.roles()]
    return JobTrace(
        job=job,
        world=world,
        roles=tuple(roles),
        full=full,
        seconds={"trace": time.perf_counter() - start},
        megatron_core=guards.release_text(),
    )


def trace_jobs(jobs, *, workers: int | None = None, **options) -> list[JobTrace]:
    """trace_job of every one of `jobs`, at once: their roles share one pool of `workers`
    processes (so a job of one role does not leave the other CPUs idle while it traces), each
    job waited on by a thread of this process. Inside shared_workers(), that pool is kept."""
    if workers is None:
        workers = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if workers == 1 or len(jobs) < 2:
        return [trace_job(job, workers=workers, **options) for job in jobs]
    from concurrent.futures import ThreadPoolExecutor

    # The pool exists before the threads start: every trace_job then hands its roles to it
    # (none traces in this process, whose patches of megatron-core and torch are not for two
    # threads at once).
    with shared_workers(), _executor(workers), ThreadPoolExecutor(len(jobs)) as threads:
        return list(threads.map(lambda job: trace_job(job, workers=workers, **options), jobs))


def _trace_task(args):
    job, world, role, device, iteration, micro, keep = args
    import torch

    torch.set_num_threads(1)
    return trace_role(job, world, role, device=device, iteration=iteration, micro=micro, keep=keep)


_SHARED: dict = {"depth": 0, "pool": None, "workers": 0}


@contextlib.contextmanager
def shared_workers():
    """Inside, every trace_job reuses one pool of worker processes, forked when the first needs
    it: what a worker imports and learns in its first trace (about 2 s: megatron-core's model,
    optimizer and schedule modules, torch's dynamo, the meta memo) serves the traces after it.
    For commands that trace one job after another (`plan`, `--max-mbs`, `diff`); a worker is
    forked from the process as it is then, so nothing changed after that reaches it."""
    _SHARED["depth"] += 1
    failed = True
    try:
        yield
        failed = False
    finally:
        _SHARED["depth"] -= 1
        if not _SHARED["depth"] and _SHARED["pool"] is not None:
            _close(_SHARED["pool"], failed)
            _SHARED["pool"] = None


@contextlib.contextmanager
def _executor(workers: int):
    """A process pool of at least `workers` forked workers: the shared one inside
    shared_workers(), else one of its own."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    def start():
        return ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("fork"),
            initializer=signal.signal,  # Ctrl-C: the parent ends its workers (_close)
            initargs=(signal.SIGINT, signal.SIG_IGN),
        )

    if not _SHARED["depth"]:
        pool, failed = start(), True
        try:
            yield pool
            failed = False
        finally:
            _close(pool, failed)
        return
    if _SHARED["pool"] is None or _SHARED["workers"] < workers:
        if _SHARED["pool"] is not None:
            _SHARED["pool"].shutdown()
        _SHARED["pool"] = start()
        _SHARED["workers"] = workers
    yield _SHARED["pool"]


def _close(pool, failed: bool) -> None:
    """Shut `pool` down; after an error or a KeyboardInterrupt, kill its workers first rather
    than wait for their traces (and for the queued ones) to finish: they ignore SIGINT, and a
    shutdown that waits on a worker the signal had killed would wait on its pipe for good."""
    if failed:
        for process in list((pool._processes or {}).values()):  # the executor's own table
            process.kill()
    pool.shutdown(wait=not failed, cancel_futures=failed)


def _run_tasks(tasks, workers: int, progress, then=None) -> list:
    """Results of `tasks` in order, in this process or in `workers` forked ones; then those of
    the tasks `then(i, result)` adds once task i is done (in the order they were added)."""
    then = then or (lambda i, result: [])
    if workers == 1 and not (_SHARED["depth"] and _SHARED["pool"] is not None):
        out, more = [], []
        for i, (label, args) in enumerate(tasks):
            progress(f"tracing {label}")
            out.append(_trace_task(args))
            more += then(i, out[-1])
        for label, args in more:
            progress(f"tracing {label}")
            out.append(_trace_task(args))
        return out
    from concurrent.futures import FIRST_COMPLETED, wait

    progress(f"tracing {len(tasks)} roles in {workers} processes")
    with _executor(workers) as pool:
        futures = [pool.submit(_trace_task, args) for _, args in tasks]
        labels = [label for label, _ in tasks]
        first = len(futures)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                i = futures.index(future)
                progress(f"traced {labels[i]}")
                for label, args in then(i, future.result()) if i < first else []:
                    futures.append(pool.submit(_trace_task, args))
                    labels.append(label)
                    pending.add(futures[-1])
        return [future.result() for future in futures]


class _Whole(Exception):
    """The kept layers of a run recorded different things: trace the micro-batch whole."""


def trace_role(job, world: World, role: Role, **options):
    """Build `role`'s chunks, trace a micro-batch and an iteration (`_trace_role` says how):
    the micro-batch with the repeated decoder layers traced once (metatrace.tracing.layers),
    or whole where their records say they are not the same."""
    try:
        return _trace_role(job, world, role, **options)
    except _Whole:
        return _trace_role(job, world, role, **options, whole=True)


def _trace_role(
    job,
    world: World,
    role: Role,
    *,
    device: str = "meta",
    rank: int | None = None,
    also_track: tuple[str, ...] = (),
    iteration: bool = True,
    real_steps: bool = False,
    extend: bool | None = None,
    micro: Microbatch | None = None,
    keep: bool = False,
    whole: bool = False,
):
    """Build `role`'s chunks for global `rank` (default: the role's own), trace a micro-batch
    and, when `iteration`, a whole iteration.

    `micro`: the micro-batch's records and what the replay needs of it, derived from a stage
    that does the same work (metatrace.tracing.stages), instead of tracing it; with `keep`,
    return (RoleTrace, Microbatch).

    `device` is where the model runs (meta, or cpu for real tensors); `also_track` names more
    device types whose tensors the recorder follows (e.g. "cpu" on meta, to compare a meta trace
    with a CPU one that cannot tell host tensors from device tensors). `real_steps` runs the
    model in every step of the iteration instead of replaying the traced micro-batch (the
    reference for tests; with activation offloading after an unrecorded first iteration, the
    offload manager's warm-up). `whole`: trace every decoder layer. `extend`: build the
    replayed iteration from a few short replays of its steady state
    (iteration.replayed_iteration): None where that saves time, False never (the whole
    iteration replayed), True wherever the micro-batch count allows (for tests).
    """
    import torch

    from metatrace.analysis.memory import (
        deferred_bytes,
        keeps_more,
        offload_profiles,
        offload_slots,
        role_steady,
        step_profiles,
    )
    from metatrace.hooks.fake_world import fake_world, named_groups
    from metatrace.hooks.offload import reset_manager
    from metatrace.hooks.optimizer_offload import offload_record
    from metatrace.hooks.patches import megatron_patches
    from metatrace.hooks.recorder import Recorder
    from metatrace.hooks.remap import remap_cuda
    from metatrace.models.build import (
        build_model_chunks,
        build_optimizer,
        static_tensors,
        transformer_config,
        unwrap,
        wrap_ddp,
    )
    from metatrace.models.te_runtime import te_process
    from metatrace.tracing.fsdp import gathered_once, past_first_microbatch
    from metatrace.tracing.graphs import capture_plan, captured_by_graphs
    from metatrace.tracing.iteration import Unrecorded, replayed_iteration, run_iteration
    from metatrace.tracing.layers import eligible, runs

    rank = role.rank if rank is None else rank
    start = time.perf_counter()
    config = transformer_config(job)
    offloading = config.fine_grained_activation_offloading
    layer_offloading = config.cpu_offloading  # TE's: the traced micro-batch is the steady state
    workspace = cublas_workspace_bytes(job)
    te = job.implementation.transformer_impl == "transformer_engine"
    compiled = job.implementation.torch_compile
    with (
        megatron_patches(compiled=compiled, optimizer=job.training.optimizer_impl),
        remap_cuda(device),
        fake_world(world.layout, rank, nvlink_domain=world.nvlink_domain),
        te_process(te, userbuffers(job), device) as te_state,
    ):
        chunks = build_model_chunks(job=job, config=config, device=device)
        model = wrap_ddp(job, config, chunks)
        optimizer = build_optimizer(job, model)
        static = static_tensors(model, optimizer)
        plan = capture_plan(job, config, model)  # CUDA graphs' static inputs (graphs.py)
        gathered_once(model)
        past_first_microbatch(model)  # nor the first (HSDP's outer gathers: the replay's)
        prefixes = [f"chunk{v}" if len(chunks) > 1 else "" for v in range(len(chunks))]
        models = {p: unwrap(c) for p, c in zip(prefixes, chunks)}
        devices = (device, *also_track)
        groups = named_groups()
        # With overlap_param_gather, DDP's forward pre-hooks all-gather the parameters once per
        # iteration: not part of a micro-batch (the iteration below issues them).
        hooked = [chunk for chunk in model if getattr(chunk, "use_forward_hook", False)]
        for chunk in hooked:
            chunk.disable_forward_pre_hook(param_sync=False)
        # The micro-batch's recorder and the iteration's see the same model and world; TE's
        # userbuffers are outside PyTorch's allocator.
        recorder = functools.partial(
            Recorder,
            chunks=models,
            devices=devices,
            groups=groups,
            rank=rank,
            outside=list(te_state.userbuffers.values()),
            captured=captured_by_graphs(
                job,
                [
                    ".".join(filter(None, (p, n)))
                    for p, m in models.items()
                    for n, _ in m.named_modules()
                ],
            ),
        )
        if micro is not None:
            trace, shapes, deferred, record = micro
        else:
            cut = [] if whole or not eligible(job, config, device) else runs(config, models)
            trace, shapes, deferred, record = _microbatch(
                job,
                config,
                model,
                recorder,
                static,
                device,
                workspace,
                plan,
                offloading or layer_offloading,
                (models, cut),
            )
        reset_manager()  # the iteration starts with a new one, as training does
        steady = None
        if iteration:
            last_stage = role.pp_stage == job.parallel.pp - 1
            fine_grained = record if offloading else None
            on_gpu = (
                role_steady(job, record, pp_stage=role.pp_stage)
                if fine_grained and keeps_more(job)
                else None
            )
            slots = (
                offload_slots(trace, record, last_stage=last_stage, steady=on_gpu)
                if fine_grained
                else ()
            )
            if real_steps:
                for chunk in hooked:
                    chunk.enable_forward_pre_hook()
                if fine_grained is not None:
                    # The offload manager learns the group order in the first iteration and
                    # runs its steady state from the second on.
                    run_iteration(
                        job,
                        config,
                        model,
                        optimizer,
                        rec=Unrecorded(),
                        device=torch.device(device),
                        real_steps=True,
                    )
                # The model's steps reach tensors the micro-batch left behind (caches,
                # workspaces): already allocated, not allocations of this iteration.
                static = {**static, "existing": _live_tensors(devices)}
            profiles = (
                offload_profiles(trace, record, on_gpu) if fine_grained else step_profiles(trace)
            )
            kept = deferred and dataclasses.replace(deferred, kept=deferred_bytes(trace))

            def replay(microbatches: int, reduced: int | None = None):
                with recorder(static=static) as rec:
                    run_iteration(
                        dataclasses.replace(job, num_microbatches=microbatches),
                        config,
                        model,
                        optimizer,
                        rec=rec,
                        profiles=profiles,
                        deferred=kept,
                        shapes=shapes,
                        device=torch.device(device),
                        real_steps=real_steps,
                        slots=() if real_steps else slots,
                        reduced=reduced,
                    )
                return rec.trace()

            if real_steps:
                steady = replay(job.num_microbatches)
            else:  # from a few short replays where the steady state allows (iteration.py)
                steady = replayed_iteration(job, config, replay, deferred=kept, extend=extend)
    traced = RoleTrace(
        role=role,
        trace=trace,
        chunks=tuple(prefixes),
        seconds=time.perf_counter() - start,
        iteration=steady,
        offload=record,
        host_optimizer=offload_record(optimizer) if steady is not None else None,
    )
    return (traced, Microbatch(trace, shapes, deferred, record)) if keep else traced


class Microbatch(NamedTuple):
    """A traced micro-batch and what the iteration's replay takes from it."""

    trace: Any
    shapes: Any
    """iteration.StepShape per chunk."""
    deferred: Any
    """iteration.Deferred, or None."""
    record: Any
    """The OffloadRecord of activation offloading, or None."""


def _microbatch(job, config, model, recorder, static, device, workspace, plan, logged, cut):
    """Trace one micro-batch of `model` (run_microbatch under a recorder): a Microbatch.
    `cut`: ({chunk prefix: GPTModel}, the runs of layers traced in part)."""
    from metatrace.hooks.offload import OffloadLog
    from metatrace.hooks.remap import cublas_workspaces
    from metatrace.tracing import layers
    from metatrace.tracing.graphs import static_buffers
    from metatrace.tracing.overlap import delayed_wgrad

    models, runs = cut

    # The micro-batch's kernels are priced (the time model reads its windows); a replayed
    # iteration's steps are not (they stand for work the micro-batch's windows price).
    with recorder(static=static, kernels=kernel_model(job.cluster.gpu)) as rec:
        with contextlib.ExitStack() as stack:
            # The workspaces live on after the recorder stops, as they do on a GPU.
            workspaces = stack.enter_context(cublas_workspaces(device, workspace))
            # So do CUDA graphs' static buffers.
            captured = stack.enter_context(static_buffers(job, plan, device))
            for chunk in model:
                stack.enter_context(chunk.no_sync())
            # What megatron-core's activation offloading moves, in its warm-up mode (every
            # group offloaded, reloads on demand; memory.offload_slots has the steady state).
            log = stack.enter_context(OffloadLog(rec)) if logged else None
            # delay_wgrad_compute: backward_dw where the combined 1F1B calls it.
            stack.enter_context(delayed_wgrad(model))
            stack.enter_context(_routing_graphs_dropped(model))
            marks = stack.enter_context(layers.truncated(models, runs, rec)) if runs else None
            shapes, deferred = run_microbatch(job, config, model, rec=rec, data=captured.data())
    held = tuple(rec.known_storage(t) for t in workspaces.held.values())
    trace = dataclasses.replace(rec.trace(), workspaces=held)
    if runs:
        trace = layers.expand(trace, runs, marks)
        if trace is None or not layers.mirror(models, runs):
            raise _Whole
    traced = Microbatch(trace, shapes, deferred, log.record() if log is not None else None)
    del workspaces, captured  # after the recorder: not freed in the micro-batch
    return traced


def _live_tensors(devices) -> list:
    import gc

    import torch

    return [
        o
        for o in gc.get_objects()
        # type(), not isinstance(): isinstance reads __class__, which deprecated objects such
        # as torch.distributed.reduce_op answer with a FutureWarning.
        if issubclass(type(o), torch.Tensor) and o.device.type in devices
    ]


def run_microbatch(
    job, config, model, *, rec=None, forward_step_func: Callable | None = None, data=None
):
    """One micro-batch through this rank's chunks, forward then backward (see module docstring).

    With a recorder `rec`, each chunk's forward and backward step is marked as a Window and the
    steps outside the model are told their phase. Returns each chunk's output shape, and with
    --defer-embedding-wgrad-compute on the last stage what the output layer deferred (a
    "deferred" window frees what one deferred micro-batch keeps until the pipeline flush).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.utils import get_attr_wrapped_model, get_model_type

    from metatrace.tracing.iteration import StepShape
    from metatrace.tracing.steps import make_forward_step, synthetic_batches

    tr = job.training
    par = job.parallel
    if forward_step_func is None:
        forward_step_func = make_forward_step(
            micro_batch_size=tr.micro_batch_size,
            seq_length=tr.seq_length,
            attention_mask=tr.create_attention_mask_in_dataloader,
        )
    if data is None:  # else: the batches a whole-iteration CUDA graph keeps on the GPU
        data = synthetic_batches(
            micro_batch_size=tr.micro_batch_size,
            seq_length=tr.seq_length,
            attention_mask=tr.create_attention_mask_in_dataloader,
        )
    comm = P2PCommunicator(pp_group=ps.get_pipeline_model_parallel_group(), config=config)
    seq = tr.seq_length // par.cp // (par.tp if par.sequence_parallel else 1)
    tensor_shape = (seq, tr.micro_batch_size, config.hidden_size)
    # megatron-core 0.19's backward_step no longer takes the model type
    model_type = () if guards.since(0, 19) else (get_model_type(model[0]),)

    def window(phase, v):
        return rec.window(phase, v, 0) if rec is not None else contextlib.nullcontext({})

    def on_phase(phase):
        if rec is not None:
            rec.set_step_phase(phase)

    on_phase("forward")
    stash, shapes = [], []
    for v, chunk in enumerate(model):
        vp_stage = v if par.vpp else None
        first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        input_tensor = comm.recv_forward(tensor_shape, is_first_stage=first)

        def model_step(data_iterator, model, v=v):
            # The window holds the batch and the model's forward; the loss function and the
            # schedule's own work around it run outside, as in the replay.
            with window("forward", v) as marks:
                output, loss_func = forward_step_func(data_iterator, model)
                marks["output"] = output
            shapes.append(StepShape(tuple(output.shape), output.dtype))
            return output, loss_func

        output_tensor, _ = schedules.forward_step(
            model_step,
            data,
            chunk,
            job.num_microbatches,
            input_tensor,
            [],
            config,
            par.cp,
            is_first_microbatch=True,
            current_microbatch=0,
            vp_stage=vp_stage,
            is_last_stage=last,
        )
        last_output = output_tensor  # the backward loop below rebinds output_tensor
        comm.send_forward(output_tensor, is_last_stage=last)
        if not last:
            schedules.deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)
        stash.append((v, input_tensor, output_tensor, first, last))

    on_phase("backward")
    for v, input_tensor, output_tensor, first, last in reversed(stash):
        output_grad = comm.recv_backward(tensor_shape, is_last_stage=last)
        with window("backward", v):
            input_grad = schedules.backward_step(
                input_tensor, output_tensor, output_grad, *model_type, config
            )
        comm.send_backward(input_grad, is_first_stage=first)
    # megatron-core's forward_step hands each chunk its input with set_input_tensor, and the
    # model keeps that reference until the next micro-batch replaces it. Drop it here, so that
    # the last input (and its gradient) does not look like memory the rank keeps for good; the
    # replayed iteration sets the inputs again.
    for chunk in model:
        get_attr_wrapped_model(chunk, "set_input_tensor")(None)
    # --defer-embedding-wgrad-compute: the last stage's output layer appended its input (forward)
    # and the logits gradient (backward) to the model's buffers, and the input's autograd graph
    # (down to the received pipeline input and its .grad) lives as long as the buffer holds it.
    # megatron-core computes the deferred weight gradient at the pipeline flush and empties the
    # buffers (schedules.finish_embedding_wgrad_compute; its drain fails on a single entry in
    # 0.16.1, so the traced micro-batch releases them itself). The "deferred" window frees
    # exactly what one deferred micro-batch keeps until the flush.
    if not (config.defer_embedding_wgrad_compute and stash[-1][4]):
        return shapes, None
    v = stash[-1][0]
    del stash, input_tensor, output_tensor, input_grad, output_grad, last_output
    with window("deferred", v):
        deferred = _release_deferred(config, model[-1])
    return shapes, deferred


@contextlib.contextmanager
def _routing_graphs_dropped(model):
    """While inside, each MoE layer's token dispatcher lets go of its autograd graph once the
    layer's backward is done (when the gradient of the layer's input is ready).

    megatron-core's dispatchers keep tensors of their last forward as attributes (the allgather
    dispatcher's `local_probs`, the all-to-all one's `probs`, the flex one's manager's
    probabilities) until the layer's next forward replaces them, and with them their autograd
    graph. With selective recompute of `moe` that graph is the one the backward step recomputes
    from CheckpointFunction's detached input: its router node leads to the AccumulateGrad of
    that input, which holds it, so the input (a view of the pre-MLP layernorm's output), its
    gradient and the router's recomputed temporaries outlive the micro-batch. On a GPU they go
    at the layer's next forward; the iteration replay, which repeats steps and not layers,
    would keep them once per micro-batch (with layernorm recompute, whose storage the backward
    step regrows, the allocator's reserve then grows with the micro-batches). Here they go at
    the end of the layer's backward, inside its records (tracing.layers copies them): the
    attributes keep their values, detached, and lose only the graph. The traced micro-batch
    runs its forward and backward in turn, so no other micro-batch's forward is in between.

    Only for layers that recompute (`moe_layer_recompute`): without recompute the graph is the
    forward's, whose saved tensors the backward releases; what it still holds (the stage's
    received input and its gradient, where the layer leads back to it) stays as on a GPU, until
    the replay's end (measured: dropping it there too took the four MoE calibration cases it
    touched 0.18-0.29 points further below their measured peaks). With recompute the GPU holds one layer's input and
    gradient more until that layer's next forward, which this leaves out."""
    import torch

    def drop(dispatcher):
        for holder in (dispatcher, getattr(dispatcher, "_comm_manager", None)):
            for name, value in list(vars(holder).items()) if holder is not None else ():
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(holder, name, value.detach())

    def on_forward(module, args, kwargs, output):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            dispatcher = module.token_dispatcher
            hidden.register_hook(lambda grad: drop(dispatcher))

    handles = [
        module.register_forward_hook(on_forward, with_kwargs=True)
        for chunk in model
        for module in chunk.modules()
        if getattr(module, "token_dispatcher", None) is not None
        and getattr(module, "moe_layer_recompute", False)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _release_deferred(config, chunk):
    """Empty the last chunk's deferral buffers (what megatron-core's pipeline flush does), and
    return what they held."""
    from megatron.core.utils import get_attr_wrapped_model

    from metatrace.tracing.iteration import Deferred, StepShape

    last_model = get_attr_wrapped_model(chunk, "post_process", return_model_obj=True)
    acts, grads = last_model.embedding_activation_buffer, last_model.grad_output_buffer
    deferred = Deferred(
        activations=tuple(StepShape(tuple(t.shape), t.dtype) for t in acts),
        grads=tuple(StepShape(tuple(t.shape), t.dtype) for t in grads),
    )
    acts.clear()
    grads.clear()
    if config.sequence_parallel:
        _drain_gather_buffers(deferred.activations[0])
    return deferred


def _drain_gather_buffers(shape) -> None:
    """With sequence parallelism megatron-core's drain (utils.drain_embedding_wgrad_compute)
    all-gathers each deferred input into two global memory buffers, "mpu_0" and "mpu_1"
    ([s, b, h] each), which it keeps for good: allocate them here, so that they count among the
    kept buffers (from the second iteration on they exist before it starts)."""
    from megatron.core.parallel_state import (
        get_global_memory_buffer,
        get_tensor_model_parallel_world_size,
    )

    dim = [shape.shape[0] * get_tensor_model_parallel_world_size(), *shape.shape[1:]]
    for name in ("mpu_0", "mpu_1"):
        get_global_memory_buffer().get_tensor(dim, shape.dtype, name)
