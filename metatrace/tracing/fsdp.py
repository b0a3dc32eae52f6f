"""What Megatron-FSDP (megatron-core 0.16.1 and 0.19) does once per iteration around the
micro-batch that metatrace traces, restated for the replayed iteration
(metatrace.tracing.iteration).

The traced micro-batch runs megatron-core's own hooks: the all-gathers within the sharding group
before each unit's forward and backward, and the reduce-scatters after each backward. It stands
for a micro-batch that is neither the first nor the last of its iteration. What only the first
or the last one does is here:

- the parameters every step after the first finds gathered with the optim and optim_grads
  strategies (gathered_once);
- the modules' training states the run's first backward leaves, in which the forward steps
  after it gather (past_first_backward, megatron-core 0.19);
- without sharded gradients, the reduction of the whole gradients in the last micro-batch
  (reduce_unsharded);
- with hybrid sharding (HSDP, num_distributed_optimizer_instances > 1), the reduction across the
  instances in the last micro-batch (outer_reduce) and, with --outer-dp-sharding-strategy optim,
  the all-gathers across the instances in the first one (outer_gather).

The optimizer step runs megatron-core's own code (the all-gathers it starts ahead for the next
iteration included).
"""

from __future__ import annotations

import torch

from metatrace.hooks import guards
from metatrace.models.build import is_fsdp


def gathered_once(model) -> None:
    """Megatron-FSDP's state from the second iteration on, for strategies that keep whole
    parameters (optim, optim_grads): the previous optimizer step gathered them into the
    model-weight buffers (in place) and the steps gather nothing more. Run once after building,
    before anything is traced. (optim_grads_params gathers each layer in every step.)"""
    for chunk in model:
        if is_fsdp(chunk) and chunk.ddp_config.data_parallel_sharding_strategy in (
            "optim",
            "optim_grads",
        ):
            chunk.start_param_sync(force_sync=True)


def past_first_microbatch(model) -> None:
    """Make the next micro-batch one after the first of its iteration (and of the run), as
    megatron-core's hooks see it. Run before the traced micro-batch, whose records stand for
    every micro-batch.

    - With outer sharding, MegatronFSDP.all_gather_and_wait_parameters_ready gathers across the
      instances only while its microbatch_count is 0 (the first micro-batch, and the optimizer
      step after finish_grad_sync has reset it); the replay issues the first one's gathers
      (outer_gather).
    - The modules' training states the first backward leaves (past_first_backward)."""
    for chunk in model:
        if _outer_sharded(chunk):
            chunk.module.microbatch_count = max(1, chunk.module.microbatch_count)
        if is_fsdp(chunk):
            past_first_backward(chunk)


def past_first_backward(chunk) -> None:
    """The _training_state in which the run's first backward leaves the modules outside FSDP
    units (megatron-core 0.19 with optim_grads_params): the root pre-backward hook sets every
    module to PRE_BACKWARD, and each unit's post-backward hook sets its own modules back to
    IDLE; the others (the embedding, the final norm, the output layer, the model around them)
    stay PRE_BACKWARD for the rest of the run. Their forward pre-hooks then gather their own
    bucket without prefetching the buckets after it (prefetching is for the forward only,
    and PRE_BACKWARD means an activation recomputation to them), so that from the second
    micro-batch on the final norm no longer gathers the transformer layers' buckets, which
    their forward released, ahead of the backward at the end of the forward: each layer's
    pre-backward hook gathers them. The run's first micro-batch alone (which the traced one
    would otherwise be) holds them through the output layer and the loss.
    megatron-core 0.16.1's root hook sets the units alone (which their post-backward hooks set
    back), so the first micro-batch is like the others: nothing to do. The states restated:
    Restates
    megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp.MegatronFSDP._register_fsdp_hooks
    (source sha256: 4a2ad8c46cd5, 29f389789017)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import TrainingState

    fsdp = chunk.module
    strategy = chunk.ddp_config.data_parallel_sharding_strategy
    if not guards.since(0, 19) or strategy != "optim_grads_params":
        return
    units = tuple(fsdp.fsdp_unit_modules)
    in_units = {
        id(m) for unit in fsdp.module.modules() if isinstance(unit, units) for m in unit.modules()
    }
    for module in fsdp.module.modules():
        if id(module) not in in_units:
            module._training_state = TrainingState.PRE_BACKWARD


def new_iteration(model) -> None:
    """The state the previous iteration's finish_grad_sync leaves: microbatch_count 0, so that
    megatron-core's own hooks (an iteration whose steps run for real) gather across the
    instances in the first micro-batch again."""
    for chunk in model:
        if is_fsdp(chunk):
            chunk.module.microbatch_count = 0


def reduce_unsharded(chunk) -> None:
    """Megatron-FSDP without sharded gradients (no_shard, optim) and with overlap_grad_reduce:
    its post-backward hooks of the iteration's last micro-batch hand every parameter's gradient
    to its reduction pipeline, which reduces each bucket once all of its gradients are in."""
    fsdp = chunk.module
    params = [p for p in fsdp.raw_param.values() if p.requires_grad]
    fsdp.grad_reduce_pipeline.reduce_gradients(
        params, suggested_queue_capacity=fsdp.suggested_RS_queue_capacity
    )


def hybrid(chunk) -> bool:
    """Whether `chunk` is Megatron-FSDP with hybrid sharding (HSDP)."""
    return is_fsdp(chunk) and chunk.module.dist_index.use_hybrid_fsdp


def last_microbatch(chunk) -> bool:
    """Whether Megatron-FSDP takes the running backward for the iteration's last micro-batch
    (the schedule runs the others under its no_sync)."""
    return getattr(chunk.module, "is_last_microbatch", False)


def _outer_sharded(chunk) -> bool:
    return hybrid(chunk) and chunk.ddp_config.outer_dp_sharding_strategy != "no_shard"


def outer_reduce(chunk) -> None:
    """HSDP's reduction across the instances in the iteration's last micro-batch, bucket group
    by bucket group in backward order (each right after its reduce-scatter within the instance
    in megatron-core, here after the step's), as GradReducePipeline._bucket_group_gradient_reduce
    does with outer_fsdp_group_grad_reduce. Its outer part: Restates
    megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer.GradReducePipeline._bucket_group_gradient_reduce
    (source sha256: 47d931b5a957, 5107b750da73):
    - outer no_shard: the gradient buffer's shard (sharded within the instance) all-reduced in
      place across the instances;
    - outer optim, megatron-core 0.16.1: the instance's shard (the hybrid buffer hsdp_gbuf)
      reduce-scattered across the instances into a new tensor of the rank's shard over the whole
      data-parallel group, copied into the main-gradient buffer (a view into hsdp_gbuf) and
      freed;
    - outer optim, megatron-core 0.19: the instance's shard (the helper buffer
      hfsdp_helper_gbuf) reduce-scattered across the instances straight into the main-gradient
      buffer's shard (a view into the helper buffer): nothing allocated.
    Under 0.19 with a gradient communication dtype other than the main gradients'
    (fsdp_grad_comm_dtype), the reduced tensor is first copied into a bucket of that dtype
    (hsdp_comm_gbuf.allocate_bucket_storage), reduced there, copied back and the bucket freed."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    buffer = chunk.module.param_and_grad_buffer
    group = buffer.dist_index.get_outer_fsdp_group()
    op = (
        torch.distributed.ReduceOp.AVG
        if buffer.ddp_config.average_in_collective
        else torch.distributed.ReduceOp.SUM
    )
    sharded = buffer.ddp_config.outer_dp_sharding_strategy != "no_shard"
    helpers = guards.since(0, 19)
    comm_dtype = buffer.mp_policy.grad_comm_dtype if helpers else None
    groups = buffer.parameter_groups
    for ids in reversed(_bucket_groups(buffer)):
        ids = [
            i
            for i in ids
            if groups[i].requires_grad
            and groups[i].main_grad_buffer is not None
            and groups[i].main_grad_buffer.data is not None
        ]
        if not ids:
            continue
        copies = []  # (destination, reduced): copied once the coalesced calls are done
        with _coalescing_manager(group):
            for i in ids:
                main = groups[i].main_grad_buffer
                local = _instance_grads(groups[i]) if sharded else main
                grads = local.data
                if comm_dtype is not None and grads.dtype != comm_dtype:
                    grads = (
                        groups[i]
                        .hsdp_comm_gbuf.allocate_bucket_storage(
                            shard=local.is_data_distributed,
                            dtype=comm_dtype,
                            device=grads.device,
                            init_values=grads,
                        )
                        .data
                    )
                if not sharded:
                    torch.distributed.all_reduce(grads, group=group, op=op)
                    if grads is not local.data:
                        copies.append((main.data, grads))
                    continue
                shard = main.get_shard_from_local_buffer()
                if not helpers:
                    out = torch.empty_like(shard)
                elif grads is local.data:
                    out = shard  # in place: the shard is the rank's slice of the helper buffer
                else:
                    rank = group.rank()
                    out = grads[rank * shard.numel() : (rank + 1) * shard.numel()]
                torch.distributed.reduce_scatter_tensor(output=out, input=grads, op=op, group=group)
                if out is not shard:
                    copies.append((shard, out))
        for destination, reduced in copies:
            destination.copy_(reduced)
        del copies
        if comm_dtype is not None:
            for i in ids:
                groups[i].hsdp_comm_gbuf.free_bucket_storage()


def _instance_grads(group):
    """The gradient buffer of the instance's shard: hsdp_gbuf (megatron-core 0.16.1),
    hfsdp_helper_gbuf (0.19)."""
    return group.hfsdp_helper_gbuf if guards.since(0, 19) else group.hsdp_gbuf


def _instance_weights(group, *, backward: bool):
    """The weight buffer of the instance's shard: hsdp_wbuf (megatron-core 0.16.1),
    hfsdp_helper_wbuf (0.19; for the backward of weights that keep a transpose, such as MXFP8's,
    hfsdp_helper_wtbuf, as AllGatherPipeline.get_fsdp_buffer picks with bwd)."""
    if not guards.since(0, 19):
        return group.hsdp_wbuf
    if backward and group.transpose_weight_buffer is not None:
        return group.hfsdp_helper_wtbuf
    return group.hfsdp_helper_wbuf


def outer_gather(chunk, *, backward: bool) -> None:
    """HSDP with outer optim in the iteration's first micro-batch: before a bucket is gathered
    within the instance, the rank's shard over the whole data-parallel group (which the
    optimizer step updated) is all-gathered across the instances into the instance's shard, in
    place, a coalesced call per bucket group (AllGatherPipeline.all_gather_params with
    outer_fsdp_group_param_gather): in megatron-core 0.16.1 from the model-weight buffer into
    hsdp_wbuf, of which it is a view; in 0.19 from the rank's slice of the helper buffer
    hfsdp_helper_wbuf into the whole of it (the model-weight buffer is that slice). The forward
    gathers every bucket but those the optimizer step gathered ahead; the transformer layers'
    buckets, released after their forward, are gathered once more (in megatron-core in the
    backward, or ahead at the end of the forward): here in the backward."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    if not _outer_sharded(chunk):
        return
    fsdp = chunk.module
    buffer = fsdp.param_and_grad_buffer
    group = buffer.dist_index.get_outer_fsdp_group()
    groups = buffer.parameter_groups
    if backward:
        skip = set()
        order = reversed(_bucket_groups(buffer))
    else:
        skip = _gathered_ahead(fsdp)
        order = _bucket_groups(buffer)
    for ids in order:
        ids = [
            i
            for i in ids
            if i not in skip
            and _instance_weights(groups[i], backward=backward) is not None
            and (not backward or groups[i].fsdp_unit_id is not None)
        ]
        if not ids:
            continue
        with _coalescing_manager(group, async_ops=False):
            for i in ids:
                whole = _instance_weights(groups[i], backward=backward).data
                if guards.since(0, 19):
                    size = whole.numel() // group.size()
                    mine = whole[group.rank() * size : (group.rank() + 1) * size]
                else:
                    mine = groups[i].model_weight_buffer.data
                torch.distributed.all_gather_into_tensor(
                    output_tensor=whole, input_tensor=mine, group=group
                )


def combined_extra(chunk) -> int:
    """Bytes a combined 1F1B step (overlap_moe_expert_parallel_comm, megatron-core 0.19) holds
    beyond the backward and forward steps run one after the other, with Megatron-FSDP sharding
    the parameters (optim_grads_params): the forward layer's parameters are gathered beside
    the backward layer's. combined_1f1b.py wires each layer's release to its last forward node
    (moe_combine or mlp) and to the backward of its first (pre_dispatch_computation,
    model_chunk_schedule_plan.set_fsdp_reshard_hooks), and the schedule runs layer i's forward
    nodes between layer L-1-i's backward nodes (model_chunk_schedule_plan.py: attn_fwd, mlp_bwd,
    mlp_fwd, attn_bwd): the largest FSDP unit's gathered buckets, each a block of its own."""
    if not is_fsdp(chunk) or chunk.ddp_config.data_parallel_sharding_strategy != (
        "optim_grads_params"
    ):
        return 0
    buffer = chunk.module.param_and_grad_buffer
    units: dict[int, int] = {}
    for group in buffer.parameter_groups:
        weights = group.model_weight_buffer
        if group.fsdp_unit_id is None or weights is None:
            continue
        nbytes = weights.bucket_index.size * weights.dtype.itemsize
        units[group.fsdp_unit_id] = units.get(group.fsdp_unit_id, 0) + -(-nbytes // 512) * 512
    return max(units.values(), default=0)


def _bucket_groups(buffer) -> list[list[int]]:
    """The bucket groups (buckets of one FSDP unit, communicated in one coalesced call), in
    bucket order."""
    seen, out = set(), []
    for i in range(len(buffer.parameter_groups)):
        ids = buffer.bucket_to_bucket_group[i]
        if ids[0] not in seen:
            seen.update(ids)
            out.append(list(ids))
    return out


def _gathered_ahead(fsdp) -> set[int]:
    """The buckets MegatronFSDP.start_param_sync gathers in the optimizer step for the next
    iteration, which its first micro-batch then finds gathered: the first parameter's bucket,
    then the bucket groups after it while fewer than suggested_AG_prefetch_size elements are
    added (with fsdp_double_buffer, within two FSDP units). megatron-core 0.19 gathers nothing
    ahead without fsdp_all_gather_in_start_param_sync, and with fsdp_double_buffer prefetches
    nothing after a first bucket outside the FSDP units. The prefetch: Restates
    megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer.AllGatherPipeline.all_gather_params
    (source sha256: 8d0f74c98658, d9bec6fa4c5b); as the optimizer step calls it: Restates
    megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp.MegatronFSDP.start_param_sync
    (source sha256: 5e31687b9af6, 087a12223fbb)."""
    buffer = fsdp.param_and_grad_buffer
    groups = buffer.parameter_groups
    since_19 = guards.since(0, 19)
    if since_19 and not fsdp.ddp_config.fsdp_all_gather_in_start_param_sync:
        return set()

    def size(ids):
        return sum(groups[i].model_weight_buffer.bucket_index.size for i in ids)

    first = next(iter(fsdp.raw_param.values()))
    ahead = [buffer.param_to_param_group[first]]
    base = size(ahead)
    double = buffer.ddp_config.fsdp_double_buffer
    units = {
        groups[i].fsdp_unit_id for i in ahead if groups[i].fsdp_unit_id in buffer.double_buf_units
    }
    outside = all(groups[i].fsdp_unit_id is None or groups[i].fsdp_unit_id < 0 for i in ahead)
    if since_19 and double and outside:
        return set(ahead)
    nxt = ahead[-1] + 1
    while nxt < len(groups) and size(ahead) - base < fsdp.suggested_AG_prefetch_size:
        if double:
            units.add(groups[nxt].fsdp_unit_id)
            if len(units) > 2:
                break
        ahead = sorted(set(ahead) | set(buffer.bucket_to_bucket_group[nxt]))
        nxt = ahead[0] + 1
        while nxt in ahead:  # the first bucket after the run of gathered ones
            nxt += 1
    return set(ahead)
