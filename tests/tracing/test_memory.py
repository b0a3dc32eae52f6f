"""Memory over a training iteration: static memory in closed form, the schedule's in-flight
micro-batches against megatron-core's own warm-up formulas, recompute, the replayed iteration
against the model running every step, and the parts adding up to the peak."""

import dataclasses

import pytest

from metatrace.analysis.memory import persistent_bytes, role_memory
from metatrace.tracing.trace import trace_job, trace_role
from metatrace.world import World
from tests.helpers import small_job

BLOCK = 512


def rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def memories(job, **kwargs):
    world = World.from_job(job)
    out = []
    for role in world.roles():
        rt = trace_role(job, world, role, **kwargs)
        out.append((rt, role_memory(rt.trace, rt.iteration)))
    return out


def param_numels(trace) -> list[int]:
    return [p.numel for m in trace.modules for p in m.params]


# Bytes per element: model parameters, main gradients; the optimizer keeps per parameter an
# fp32 main copy (16-bit training) and its state tensors.
@pytest.mark.parametrize(
    "training, param_bytes, grad_bytes, fp32_tensors",
    [
        ({}, 2, 4, 3),  # bf16: fp32 grads (Megatron-LM's default), main params, exp_avg, exp_avg_sq
        ({"grad_reduce_in_fp32": False}, 2, 2, 3),
        ({"precision": "fp16"}, 2, 2, 3),  # fp16 reduces gradients in fp16
        ({"precision": "fp32"}, 4, 4, 2),  # no main copy: Adam's two moments
        ({"optimizer": "sgd"}, 2, 4, 2),  # main params and the momentum buffer
        ({"optimizer": "sgd", "sgd_momentum": 0.0}, 2, 4, 1),
    ],
    ids=["bf16-adam", "bf16-grads", "fp16", "fp32", "sgd", "sgd-no-momentum"],
)
def test_static_memory_in_closed_form(training, param_bytes, grad_bytes, fp32_tensors):
    job = small_job(training=training)
    ((rt, m),) = memories(job)
    numels = param_numels(rt.trace)
    # Without the distributed optimizer parameters stay separate tensors (each rounded to the
    # allocator's 512-byte blocks); DDP keeps one contiguous gradient buffer.
    assert m.params == sum(rounded(param_bytes * n) for n in numels)
    assert m.grads == rounded(grad_bytes * sum(numels))
    state = sum(fp32_tensors * rounded(4 * n) for n in numels)
    # Beside the per-parameter state: megatron-core's one-element flag tensors (found_inf,
    # _dummy_overflow_buf) and, with fp16, the loss scaler's.
    small = m.optimizer - state
    assert 0 < small <= 8 * BLOCK, small


def test_distributed_optimizer_shards_the_state_over_data_parallel_ranks():
    one = small_job(training={"distributed_optimizer": True})
    four = small_job(training={"distributed_optimizer": True}, cluster={"num_gpus": 4})
    ((rt1, m1),) = memories(one)
    ((rt4, m4),) = memories(four)
    p = sum(param_numels(rt1.trace))
    # The parameters live in DDP's contiguous buffer now: one allocation.
    assert m1.params == rounded(2 * p)
    assert m1.grads == m4.grads == rounded(4 * p) or m4.grads > m1.grads  # dp pads the buffer
    # 12 bytes (main param, exp_avg, exp_avg_sq) per element of this rank's quarter of the
    # buffer; each parameter's shard is three tensors of its own (at most 3 x 511 bytes of
    # rounding each) and the buffer pads to a multiple of lcm(dp, 128) elements.
    tensors = len(param_numels(rt1.trace))
    assert abs(4 * m4.optimizer - m1.optimizer) <= 4 * (3 * BLOCK * tensors + 12 * 128 + 8 * BLOCK)
    assert m4.optimizer < m1.optimizer / 3


# Transformer Engine's FusedAdam with megatron-core's precision-aware optimizer (TE 2.8
# fused_adam.py): per element of the rank's shard, exp_avg and exp_avg_sq in their dtypes and
# the master copy of a bf16 parameter as int16 remainders (store_param_remainders, on by default
# from TE 2.1), or in main_params_dtype; no megatron-core fp32 main copy beside it.
@pytest.mark.parametrize(
    "training, grad_bytes, state_bytes",
    [
        ({}, 4, 12),  # megatron-core's own fp32 main params, fp32 moments
        ({"use_precision_aware_optimizer": True}, 4, 4 + 4 + 2),
        (
            {
                "use_precision_aware_optimizer": True,
                "exp_avg_dtype": "bf16",
                "exp_avg_sq_dtype": "bf16",
                "main_grads_dtype": "bf16",
                "grad_reduce_in_fp32": False,
            },
            2,
            2 + 2 + 2,
        ),
        ({"use_precision_aware_optimizer": True, "main_params_dtype": "fp16"}, 4, 4 + 4 + 2),
    ],
    ids=["fp32-main", "precision-aware", "bf16-states", "fp16-master"],
)
def test_precision_aware_optimizer_in_closed_form(training, grad_bytes, state_bytes):
    job = small_job(
        implementation={"transformer_impl": "transformer_engine"},
        training={"distributed_optimizer": True, "global_batch_size": 8, **training},
        cluster={"num_gpus": 2},
    )
    rt, m = memories(job)[0]
    p = sum(param_numels(rt.trace))
    assert m.grads == rounded(grad_bytes * p)  # (a multiple of lcm(dp, 128) elements already)
    shard = p // 2
    tensors = len(param_numels(rt.trace))
    # Each parameter's shard is a tensor per state (rounded to 512-byte blocks), beside
    # one-element flags and the one-element scales of the states stored below fp32 (up to two
    # blocks a parameter more); a byte per element off would be far more (shard > 100,000).
    slack = 5 * BLOCK * tensors + 8 * BLOCK
    assert shard > 2 * slack
    assert 0 <= m.optimizer - state_bytes * shard <= slack, m.optimizer - state_bytes * shard


def test_optimizer_instances_shard_the_state_over_an_instance():
    # dp 4 in 2 instances: each rank keeps the state of half the buffer (2 ranks per instance)
    # instead of a quarter; parameters and gradient buffers stay whole. MoE: the expert buffers
    # shard over the instance's expert dp ranks likewise.
    for model, parallel in (({}, {}), ({"num_experts": 4, "moe_router_topk": 2}, {"ep": 2})):
        jobs = [
            small_job(
                model=model,
                parallel=parallel,
                cluster={"num_gpus": 4},
                training={
                    "distributed_optimizer": True,
                    "global_batch_size": 8,
                    "num_distributed_optimizer_instances": n,
                },
            )
            for n in (1, 2)
        ]
        ((rt1, m1),) = memories(jobs[0])
        ((rt2, m2),) = memories(jobs[1])
        assert (m1.params, m1.grads) == (m2.params, m2.grads)
        tensors = len(param_numels(rt1.trace))
        assert abs(m2.optimizer - 2 * m1.optimizer) <= 2 * (3 * BLOCK * tensors + 8 * BLOCK)
        assert m2.optimizer > 1.8 * m1.optimizer


def _warmup(job, stage: int) -> int:
    """megatron-core's own warm-up count for a pipeline rank (its schedules' functions)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    from metatrace.hooks.fake_world import fake_world
    from metatrace.hooks.patches import megatron_patches
    from metatrace.hooks.remap import remap_cuda

    world = World.from_job(job)
    rank = world.roles()[stage].rank
    with megatron_patches(), remap_cuda("meta"), fake_world(world.layout, rank):
        m, pp = job.num_microbatches, job.parallel.pp
        if job.parallel.vpp is None:
            # forward_backward_pipelining_without_interleaving
            return min(pp - ps.get_pipeline_model_parallel_rank() - 1, m)
        _, _, warmup, _ = get_pp_rank_microbatches(m, job.parallel.vpp, pp, forward_only=False)
        return warmup


@pytest.mark.parametrize(
    "sections",
    [
        {"model": {"num_layers": 4}, "parallel": {"pp": 4}, "training": {"global_batch_size": 16}},
        {
            "model": {"num_layers": 4},
            "parallel": {"pp": 2, "vpp": 2},
            "training": {"global_batch_size": 16},
        },
        {
            "model": {"num_layers": 8},
            "parallel": {"pp": 2, "vpp": 4},
            "training": {"global_batch_size": 8},
        },
    ],
    ids=["1f1b-pp4", "interleaved-pp2-vpp2", "interleaved-all-warmup"],
)
def test_steps_in_flight_follow_megatron_warmup(sections):
    job = small_job(**sections)
    for rt, m in memories(job):
        expected = _warmup(job, rt.role.pp_stage) + 1
        total = job.num_microbatches * (job.parallel.vpp or 1)
        assert m.most_steps_held == min(expected, total), rt.role.pp_stage


def test_full_recompute_holds_one_input_per_layer():
    from metatrace.analysis.memory import step_profiles

    def held(layers, **recompute):
        job = small_job(
            model={"num_layers": layers},
            training={"global_batch_size": 2, "seq_length": 256, "recompute": recompute},
            implementation={"attention_backend": "unfused"},
        )
        ((rt, m),) = memories(job)
        return step_profiles(rt.trace)[("forward", 0)].held, m, job

    full = dict(granularity="full", method="uniform", num_layers=1)
    (h2, m2, job), (h4, _, _) = held(2, **full), held(4, **full)
    tr, h = job.training, job.model.hidden_size
    # Each extra checkpointed layer keeps only its input [s, b, h] in bf16 until backward.
    layer_input = rounded(tr.seq_length * tr.micro_batch_size * h * 2)
    assert h4 - h2 == 2 * layer_input
    none2, m_none, _ = held(2)
    selective2, m_sel, _ = held(2, granularity="selective")
    # Unfused attention keeps scores-sized tensors per layer; recomputing core_attn drops them,
    # full recompute drops everything but the layer inputs.
    assert none2 > selective2 > h2
    assert m_none.peak > m_sel.peak > m2.peak


@pytest.mark.parametrize(
    "sections",
    [
        {"training": {"global_batch_size": 4}},
        {"parallel": {"pp": 2}, "training": {"global_batch_size": 8}},
        {
            "model": {"num_layers": 4},
            "parallel": {"pp": 2, "vpp": 2},
            "training": {"global_batch_size": 8},
        },
        {
            "parallel": {"tp": 2},
            "training": {
                "global_batch_size": 4,
                "distributed_optimizer": True,
                "overlap_grad_reduce": True,
            },
            "cluster": {"num_gpus": 4},
        },
    ],
    ids=["no-pp", "1f1b", "interleaved", "tp2-dp2-distopt-overlap"],
)
def test_replayed_iteration_matches_running_every_step(sections):
    """The replay against megatron-core's schedule running the model in every step: the same
    peak, to within a few 512-byte blocks (small tensors of megatron-core's backward_step)."""
    job = small_job(**sections)
    world = World.from_job(job)
    for role in world.roles():
        replayed = trace_role(job, world, role)
        real = trace_role(job, world, role, real_steps=True)
        predicted = role_memory(replayed.trace, replayed.iteration).peak
        it = real.iteration
        measured = (
            max(e.live for e in it.memory)
            - it.static_parts.get("existing", 0)
            + persistent_bytes(replayed.trace)
        )
        assert abs(predicted - measured) <= 2 * BLOCK, (role.pp_stage, predicted, measured)
        assert predicted > replayed.iteration.static_bytes


def test_the_parts_add_up_to_the_peak_and_the_verdict_follows():
    from metatrace.analysis.analyze import analyze
    from metatrace.analysis.memory import verdict

    nothing_outside = {"context_gib": 0, "nccl_gib": 0}
    job = small_job(
        parallel={"pp": 2},
        training={"global_batch_size": 8},
        cluster={"gpu_memory_gib": 1.0, "reserved_overhead_gib": 0.5, **nothing_outside},
    )
    jt = trace_job(job, full_model=False)
    roles = [(ra.role.ranks, ra.memory, ra.device) for ra in analyze(jt).roles]
    for _, m, d in roles:
        parts = m.params + m.grads + m.optimizer + m.workspaces + m.activations + m.temporary
        assert parts == m.peak
        assert max(level for _, level in m.timeline) == m.peak
        # the allocator reserves whole segments: at least the peak, in 2 MiB steps at least
        assert d.total == d.reserve.reserved >= m.peak and d.reserve.reserved % 2**21 == 0
    v = verdict(job, roles)
    assert v.fits and v.headroom == 2**30 - 2**29 - max(d.total for _, _, d in roles)
    tight = small_job(
        parallel={"pp": 2},
        training={"global_batch_size": 8},
        cluster={"gpu_memory_gib": 0.5, "reserved_overhead_gib": 0.45, **nothing_outside},
    )
    v = analyze(dataclasses.replace(jt, job=tight)).verdict
    # Stage 1 (the output layer, 96 MiB of cuBLAS and TE workspaces) does not fit in 50 MiB.
    assert not v.fits and v.oom_ranks == tuple(jt.roles[1].role.ranks)


def test_peak_of_one_micro_batch_without_pipeline_in_closed_form():
    """tp 1, pp 1, one micro-batch, every layer recomputed: the peak is the cross entropy of
    the only micro-batch, and everything live then is known tensor by tensor."""
    job = small_job(
        model={
            "num_layers": 2,
            "vocab_size": 4000,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "position_embedding_type": "learned_absolute",
        },
        training={
            "seq_length": 128,
            "micro_batch_size": 2,
            "global_batch_size": 2,
            "gradient_accumulation_fusion": False,
            "create_attention_mask_in_dataloader": False,
            "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1},
        },
    )
    ((rt, m),) = memories(job)
    s, b, h, v = 128, 2, job.model.hidden_size, job.padded_vocab_size
    numels = param_numels(rt.trace)
    static = (
        sum(rounded(2 * n) for n in numels)  # bf16 parameters
        + rounded(4 * sum(numels))  # fp32 main-grad buffer
        + sum(3 * rounded(4 * n) for n in numels)  # fp32 main params, exp_avg, exp_avg_sq
        + 2 * BLOCK  # the optimizer's found_inf and overflow flag
    )
    mib = 2**20
    workspaces = (
        32 * mib
        + 1024  # Transformer Engine's cuBLAS workspace on Hopper
        + 2 * 32 * mib  # PyTorch's cuBLAS workspaces, forward and autograd threads (:4096:8)
        + BLOCK  # fused attention's cached cu_seqlens
    )
    tokens = rounded(8 * s * b)  # int64 [b, s]
    hidden = rounded(2 * s * b * h)  # bf16 [s, b, h]
    row = rounded(4 * s * b)  # fp32 [s, b]
    live_at_loss = (
        3 * tokens
        + row  # the batch: tokens, labels, position ids; loss mask
        + BLOCK  # the schedule's total_num_tokens
        + hidden  # embedding output, the first checkpointed input
        + 2 * hidden  # layer outputs: the second checkpointed input, the final norm's input
        + row
        + hidden  # final norm: rsigma and its output, the output layer's input
        + rounded(2 * s * b * v)  # logits, bf16
        + tokens  # labels transposed to [s, b]
        + rounded(4 * s * b * v)  # logits in fp32, exp'ed in place
        + row
        + BLOCK
        + tokens  # cross entropy: logits max, target mask, masked target
        + tokens
        + row
        + row  # arange index, predicted logits, sum of exponentials
    )
    assert m.peak_at.phase == "forward" and m.peak_at.module == ""
    assert m.peak == static + workspaces + live_at_loss


@pytest.mark.parametrize("limit", [0, 2])
def test_deferred_embedding_wgrad_keeps_the_logits_gradient_of_each_deferred_micro_batch(limit):
    """--defer-embedding-wgrad-compute on the last of two stages, 4 micro-batches: each deferred
    micro-batch keeps, from its backward until the pipeline flush, the logits gradient
    [s, b, V/t], the output layer's input [s, b, h] and (through that input's autograd graph)
    the received pipeline input and its gradient, 2 x [s, b, h]. The peak (the last
    micro-batch's cross entropy) sees min(K, m - 1) of them, K = m or the limit; when the
    micro-batch just before is one of them, its received input and gradient were live at the
    peak anyway. The replay matches megatron-core's schedule running the model in every step."""
    base = dict(
        parallel={"pp": 2, "tp": 2},
        cluster={"num_gpus": 4},
        training={"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 64},
    )
    job0 = small_job(**base)
    deferred = {
        **base,
        "training": {
            **base["training"],
            "defer_embedding_wgrad_compute": True,
            "wgrad_deferral_limit": limit,
        },
    }
    job = small_job(**deferred)
    world = World.from_job(job)
    last = [r for r in world.roles() if r.pp_stage == 1][0]
    before = trace_role(job0, World.from_job(job0), last)
    after = trace_role(job, world, last)
    real = trace_role(job, world, last, real_steps=True)
    peak0 = role_memory(before.trace, before.iteration).peak
    peak = role_memory(after.trace, after.iteration).peak
    it = real.iteration
    measured = (
        max(e.live for e in it.memory)
        - it.static_parts.get("existing", 0)
        + persistent_bytes(after.trace)
    )
    assert abs(peak - measured) <= 2 * BLOCK
    tr, m = job.training, job.num_microbatches
    s, b, h, vt = (
        tr.seq_length,
        tr.micro_batch_size,
        job.model.hidden_size,
        job.padded_vocab_size // 2,
    )
    layer = rounded(s * b * h * 2)
    per_mb = rounded(s * b * vt * 2) + 3 * layer
    k = m if limit == 0 else min(limit, m)
    overlap = 2 * layer if k >= m - 1 else 0
    assert peak - peak0 == min(k, m - 1) * per_mb - overlap


def test_padded_buckets_for_nccl_bus_bandwidth():
    """training.ddp_pad_buckets_for_high_nccl_busbw (--ddp-pad-buckets-for-high-nccl-busbw): with
    the distributed optimizer megatron-core pads each bucket's end to lcm(dp, 128, 2**16)
    elements instead of lcm(dp, 128): the fp32 gradient buffer (one bucket here) grows to the
    next multiple of 2**16 elements, less than one such multiple above the unpadded one."""
    from metatrace.tracing.trace import trace_role
    from metatrace.world import World
    from tests.helpers import small_job

    def grads(pad):
        job = small_job(
            training={"distributed_optimizer": True, "ddp_pad_buckets_for_high_nccl_busbw": pad},
            cluster={"num_gpus": 2},
        )
        world = World.from_job(job)
        rt = trace_role(job, world, world.roles()[0])
        return role_memory(rt.trace, rt.iteration).grads

    plain, padded = grads(False), grads(True)
    assert plain % (4 * 128) == 0 and padded % (4 * 2**16) == 0
    assert 0 < padded - plain < 4 * 2**16


def test_fp8_parameters_have_gradients_of_their_nominal_dtype():
    # TE's FP8 parameters (fp8_param_gather) report their nominal dtype, bf16, and
    # DistributedDataParallel gives their gradients that dtype: 2 bytes each without
    # grad_reduce_in_fp32, as for bf16 parameters (the stand-ins hold float8_e4m3fn data).
    grads = {}
    for gather in (False, True):
        job = small_job(
            implementation={"transformer_impl": "transformer_engine"},
            training={
                "precision": "fp8",
                "fp8_param_gather": gather,
                "grad_reduce_in_fp32": False,
                "distributed_optimizer": True,
                "global_batch_size": 8,
            },
            cluster={"num_gpus": 2},
        )
        rt, m = memories(job)[0]
        grads[gather] = m.grads
        assert (
            any(p.dtype == "float8_e4m3fn" for mod in rt.trace.modules for p in mod.params)
            == gather
        )
    p = sum(param_numels(rt.trace))
    assert grads[True] == grads[False] == rounded(2 * p)
