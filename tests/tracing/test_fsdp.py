"""Megatron-FSDP (megatron-core 0.16.1's FullyShardedDataParallel, --use-megatron-fsdp): what each
rank keeps per sharding strategy in closed form, its all-gathers and reduce-scatters per
micro-batch and per iteration, and the prediction against megatron-core running it on CPU
tensors (`metatrace measure`).

The debug preset with dp 4 (tp = pp = 1): every rank holds all N parameters' shards. bf16
parameters, main gradients in fp32 under megatron-core 0.16.1 (grad_reduce_in_fp32, Megatron-LM's
default with bf16) and in the parameters' bf16 under 0.19 (megatron_fsdp_main_grads_dtype None,
its default), Adam: per parameter 2 bytes of weights, GRAD of gradients, 4 of main weights and 8
of moments, sharded over the 4 ranks or not as the strategy says. megatron-core pads each buffer to a multiple of
the data-parallel size (and the allocator to 512 bytes), which the bounds allow (1.5 %)."""

import pytest
import torch

from metatrace.analysis.analyze import analyze
from metatrace.errors import ConfigError
from metatrace.hooks import guards
from metatrace.tracing.measure import measure_rank, predict
from metatrace.tracing.trace import trace_job
from tests.helpers import small_job

DP = 4
GRAD, GRAD_DTYPE = (2, "bfloat16") if guards.since(0, 19) else (4, "float32")
# strategy -> (params, grads, optimizer) bytes per parameter on each rank
CLOSED = {
    "optim": (2, GRAD, 12 / DP),
    "optim_grads": (2, GRAD / DP, 12 / DP),
    "optim_grads_params": (2 / DP, GRAD / DP, 12 / DP),
}


def fsdp_job(strategy, **training):
    return small_job(
        cluster={"num_gpus": DP},
        training={
            "megatron_fsdp": True,
            "fsdp_sharding_strategy": strategy,
            "global_batch_size": 16,  # 2 micro-batches of 2 per rank
            **training,
        },
    )


@pytest.fixture(scope="module")
def analyses():
    return {
        strategy: analyze(trace_job(fsdp_job(strategy), full_model=False, workers=1))
        for strategy in CLOSED
    }


def dp_items(analysis):
    return [it for it in analysis.roles[0].comm.items if it.dimension == "dp"]


def within(actual, expected, slack=0.015):
    return expected <= actual <= expected * (1 + slack)


@pytest.mark.parametrize("strategy", list(CLOSED))
def test_each_rank_keeps_the_strategys_shards(analyses, strategy):
    a = analyses[strategy]
    n = a.total_params
    memory = a.roles[0].memory
    params, grads, optimizer = CLOSED[strategy]
    assert within(memory.params, params * n)
    assert within(memory.grads, grads * n)
    assert within(memory.optimizer, optimizer * n)


def test_optim_keeps_what_ddp_with_the_distributed_optimizer_keeps(analyses):
    ddp = (
        analyze(
            trace_job(
                small_job(
                    cluster={"num_gpus": DP},
                    training={
                        "distributed_optimizer": True,
                        "global_batch_size": 16,
                        "gradient_accumulation_fusion": False,
                    },
                ),
                full_model=False,
                workers=1,
            )
        )
        .roles[0]
        .memory
    )
    fsdp = analyses["optim"].roles[0].memory
    for part in ("params", "optimizer"):
        assert within(getattr(fsdp, part), getattr(ddp, part))
    assert within(fsdp.grads, ddp.grads * GRAD / 4)  # DDP's are fp32 (grad_reduce_in_fp32)


def test_optim_grads_params_gathers_each_layer_twice_and_reduces_every_micro_batch(analyses):
    """Per micro-batch: every parameter all-gathered in bf16 once (the embedding, output layer
    and final norm, outside any FSDP unit, stay gathered from forward to backward) and each
    transformer layer's again for its backward; every gradient reduce-scattered in its dtype. The
    optimizer step gathers the first buckets of the next iteration ahead."""
    a = analyses["optim_grads_params"]
    n, layers = a.total_params, 2
    per_layer = sum(
        p.numel for m in a.roles[0].traced.trace.modules if m.layer == 1 for p in m.params
    )
    m = a.job.num_microbatches
    items = dp_items(a)
    steps = [it for it in items if it.per_microbatch]
    gathered = sum(it.count * it.message for it in steps if it.op == "all_gather") / m
    reduced = sum(it.count * it.message for it in steps if it.op == "reduce_scatter") / m
    assert within(gathered, 2 * (n + layers * per_layer))
    assert within(reduced, GRAD * n)
    assert all(it.overlapped for it in steps)
    assert {it.dtype for it in steps if it.op == "all_gather"} == {"bfloat16"}
    # No reduction after the last micro-batch: every backward reduced its own gradients.
    assert not [it for it in items if not it.per_microbatch and it.op == "reduce_scatter"]


@pytest.mark.parametrize("overlap", [False, True])
def test_optim_reduces_the_gradients_once_per_iteration(overlap):
    """Whole gradients are reduce-scattered once: after the last micro-batch's backward with
    overlap_grad_reduce (its hooks), else by finalize_model_grads; the optimizer step gathers
    the whole parameters again, which the steps then use as they are."""
    a = analyze(trace_job(fsdp_job("optim", overlap_grad_reduce=overlap), full_model=False))
    items = dp_items(a)
    n = a.total_params
    rs = [it for it in items if it.op == "reduce_scatter"]
    assert [(it.count, it.per_microbatch) for it in rs] == [(1, False)]
    assert rs[0].phase == ("backward" if overlap else "grad sync")
    assert within(rs[0].message, GRAD * n)
    ag = [it for it in items if it.op == "all_gather"]
    assert [(it.count, it.phase) for it in ag] == [(1, "optimizer")]
    assert within(ag[0].message, 2 * n)


@pytest.mark.parametrize("strategy", list(CLOSED))
def test_prediction_matches_megatron_fsdp_running_on_cpu(strategy):
    """megatron-core's Megatron-FSDP on real CPU tensors (2 ranks' groups, rank 0 run): the
    same activations saved for backward, and the peak within 1 % (see test_measure for what
    the CPU run allocates beside).

    With optim_grads_params the layers save their gathered weights for backward; Megatron-FSDP
    frees those buckets after each layer's forward and gathers them again ahead of the backward.
    measure counts what is saved as it stands when the backward starts, the re-gathered weights
    included; the prediction counts them in the backward that gathers them, not as activations
    held since the forward: the two differ by the two layers' weights (within a block each)."""
    torch.set_num_threads(1)
    job = small_job(
        implementation={"transformer_impl": "local"},
        cluster={"num_gpus": 2},
        training={
            "megatron_fsdp": True,
            "fsdp_sharding_strategy": strategy,
            "global_batch_size": 8,
        },
    )
    predicted = predict(job, 0)
    measured = measure_rank(job, 0, iterations=2)
    regathered = 0
    if strategy == "optim_grads_params":
        # Each layer's bucket: its bf16 weights, gathered whole ahead of the backward.
        trace = trace_job(job, full_model=False, workers=1).roles[0].trace
        layer = sum(p.numel for m in trace.modules if m.layer == 1 for p in m.params)
        regathered = 2 * layer * 2
    assert abs(predicted.saved + regathered - measured.saved_blocks) <= 2 * 512
    assert predicted.saved > 0
    peak = predicted.peak - predicted.cuda_only
    assert abs(peak - measured.peak_blocks) <= 0.01 * measured.peak_blocks


def test_megatron_fsdp_runs_on_a_tensor_parallel_rank_other_than_the_first():
    """At tp 2 the adapter copies TP rank 0's RNG states to the others with
    broadcast_object_list, which in a world of one simulated rank delivers nothing: on the CPU
    TP rank 1 read an uninitialised size (a 94 TB allocation). The rank keeps its own states;
    what it saves and its peak are the prediction's."""
    torch.set_num_threads(1)
    job = small_job(
        implementation={"transformer_impl": "local"},
        parallel={"tp": 2, "sequence_parallel": True},
        cluster={"num_gpus": 4},
        training={
            "megatron_fsdp": True,
            "fsdp_sharding_strategy": "optim_grads",
            "global_batch_size": 8,
        },
    )
    predicted, measured = predict(job, 1), measure_rank(job, 1, iterations=2)
    assert measured.saved_blocks == predicted.saved > 0
    peak = predicted.peak - predicted.cuda_only
    assert abs(peak - measured.peak_blocks) <= 0.01 * measured.peak_blocks


def test_double_buffer_keeps_two_layers_of_parameters_and_gradients_for_good(analyses):
    """--fsdp-double-buffer: megatron-core's FixedPoolAllocator keeps two layer-sized buckets of
    gathered bf16 parameters and two of fp32 gradients for the whole run instead of allocating
    them per layer."""
    a = analyses["optim_grads_params"]
    layer = sum(p.numel for m in a.roles[0].traced.trace.modules if m.layer == 1 for p in m.params)
    double = analyze(
        trace_job(fsdp_job("optim_grads_params", fsdp_double_buffer=True), full_model=False)
    ).roles[0]
    kept = double.memory.workspaces - a.roles[0].memory.workspaces
    assert within(kept, 2 * layer * (2 + GRAD))


# ----------------------------------------------------------------------------- FP8 parameters

# FP8 weights of the debug preset's two layers: qkv 128x64, proj 64x64, fc1 256x64, fc2 64x128.
FP8_WEIGHTS, FP8_ELEMENTS = 8, 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128)
SCALE = 512  # each FP8 weight's fp32 scale_inv, one allocator block


def fp8_fsdp(strategy, gpu, fp8_params):
    job = small_job(
        cluster={"num_gpus": DP, "gpu": gpu},
        implementation={"transformer_impl": "transformer_engine"},
        training={
            "megatron_fsdp": True,
            "fsdp_sharding_strategy": strategy,
            "global_batch_size": 16,
            "precision": "fp8",
            "fp8_recipe": "tensorwise",
            "fp8_param_gather": fp8_params,
        },
    )
    return analyze(trace_job(job, full_model=False, workers=1))


@pytest.mark.parametrize(
    "strategy, gpu, params_change",
    [
        # uint8 data instead of bf16 (1/dp of it), a scale per weight
        ("optim_grads_params", "h100", -FP8_ELEMENTS // DP + FP8_WEIGHTS * SCALE),
        # whole uint8 data, and on Hopper its transpose kept beside it
        ("optim", "h100", FP8_WEIGHTS * SCALE),
        ("optim_grads", "h100", FP8_WEIGHTS * SCALE),
        ("optim", "b200", -FP8_ELEMENTS + FP8_WEIGHTS * SCALE),
    ],
)
def test_fp8_parameters_keep_one_byte_data_in_fsdps_buffers(strategy, gpu, params_change):
    bf16, fp8 = (fp8_fsdp(strategy, gpu, p) for p in (False, True))
    m16, m8 = bf16.roles[0].memory, fp8.roles[0].memory
    assert m8.params - m16.params == params_change
    assert m8.grads == pytest.approx(m16.grads, rel=0.01)  # fp32 main gradients either way
    assert m8.optimizer == pytest.approx(m16.optimizer, rel=0.01)


def test_fp8_parameters_are_gathered_as_uint8_and_their_amaxes_reduced_once():
    a = fp8_fsdp("optim_grads_params", "h100", True)
    items = dp_items(a)
    gathers = [it for it in items if it.op == "all_gather" and it.dtype == "uint8"]
    # One layer's FP8 weights (padded) per call: before each layer's forward and backward in
    # both micro-batches, and once more per layer after the optimizer step.
    assert {it.message for it in gathers} and all(
        within(it.message, FP8_ELEMENTS // 2) for it in gathers
    )
    assert sum(it.count for it in gathers if it.per_microbatch) == 2 * 2 * 2
    assert sum(it.count for it in gathers if not it.per_microbatch) == 2
    amax = [it for it in items if it.op == "all_reduce" and it.message == 4 * FP8_WEIGHTS]
    assert [(it.dtype, it.count) for it in amax] == [("float32", 1)]


@pytest.mark.parametrize("recipe, message", [("mxfp8", "fails"), ("blockwise", "not modelled")])
def test_fp8_parameters_other_recipes_are_refused(recipe, message):
    from metatrace.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        small_job(
            cluster={"num_gpus": DP, "gpu": "b200"},
            implementation={"transformer_impl": "transformer_engine"},
            training={
                "megatron_fsdp": True,
                "precision": "fp8",
                "fp8_recipe": recipe,
                "fp8_param_gather": True,
            },
        )


# ----------------------------------------------------------------------------- with tp


def test_with_tensor_parallelism_each_rank_keeps_its_shard_of_its_tp_slice():
    """tp 2 x dp 2: parameters sharded over tp and then over the 2 data-parallel ranks; every
    layer's all-gather moves the rank's tp slice."""
    tp, dp = 2, 2
    job = small_job(
        cluster={"num_gpus": tp * dp},
        parallel={"tp": tp, "sequence_parallel": True},
        implementation={"transformer_impl": "transformer_engine"},
        training={"megatron_fsdp": True, "global_batch_size": 16},
    )
    a = analyze(trace_job(job, full_model=False, workers=1))
    n = a.total_params  # every rank holds 1 / tp of them before sharding (the norms aside)
    memory = a.roles[0].memory
    params, grads, optimizer = CLOSED["optim_grads_params"]
    scale = DP / (tp * dp)  # CLOSED is per rank over dp 4
    assert within(memory.params, params * scale * n, slack=0.03)
    assert within(memory.grads, grads * scale * n, slack=0.03)
    assert within(memory.optimizer, optimizer * scale * n, slack=0.03)
    layer = [it for it in dp_items(a) if it.op == "all_gather" and it.per_microbatch]
    tp1 = [
        it for it in dp_items(fsdp_analysis_tp1()) if it.op == "all_gather" and it.per_microbatch
    ]
    assert min(it.message for it in layer) * tp == pytest.approx(
        min(it.message for it in tp1), rel=0.02
    )


def fsdp_analysis_tp1():
    job = small_job(
        cluster={"num_gpus": 4},
        implementation={"transformer_impl": "transformer_engine"},
        training={"megatron_fsdp": True, "global_batch_size": 16},
    )
    return analyze(trace_job(job, full_model=False, workers=1))


# ----------------------------------------------------------------------------- hybrid sharding


def test_hybrid_sharding_shards_within_an_instance_and_all_reduces_across():
    """HSDP (num_distributed_optimizer_instances 2 over dp 4): everything sharded over the 2
    ranks of an instance; in the last micro-batch each rank's gradient shard is all-reduced
    across the instances, once per iteration."""
    job = small_job(
        cluster={"num_gpus": DP},
        training={
            "megatron_fsdp": True,
            "num_distributed_optimizer_instances": 2,
            "global_batch_size": 16,
        },
    )
    a = analyze(trace_job(job, full_model=False, workers=1))
    n, memory = a.total_params, a.roles[0].memory
    params, grads, optimizer = CLOSED["optim_grads_params"]
    assert within(memory.params, 2 * params * n)
    assert within(memory.grads, 2 * grads * n)
    assert within(memory.optimizer, 2 * optimizer * n)
    items = dp_items(a)
    inner = {it.group for it in items if it.op in ("all_gather", "reduce_scatter")}
    assert inner == {"intra_dp_cp"}
    outer = [it for it in items if it.group == "inter_dist_opt"]
    assert {(it.op, it.dtype, it.per_microbatch) for it in outer} == {
        ("all_reduce", GRAD_DTYPE, False)
    }
    # every gradient buffer's shard once (the memory rounds each buffer to 512-byte blocks)
    reduced = sum(it.count * it.message for it in outer)
    assert 0 <= memory.grads - reduced < 512 * sum(it.count for it in outer)


def test_low_precision_adam_moments_are_kept_as_shards():
    """TE's FusedAdam with bf16 moments under Megatron-FSDP (FP8 parameters, whose states are
    DTensors): its step widens each moment's shard (the DTensor's local tensor) to fp32 and
    writes it back; each rank keeps the bf16 shards, 2 bytes per parameter and moment over the
    data-parallel ranks instead of 4 (the shards' 512-byte blocks aside)."""

    def optimizer(dtype):
        job = small_job(
            cluster={"num_gpus": DP},
            implementation={"transformer_impl": "transformer_engine"},
            training={
                "megatron_fsdp": True,
                "global_batch_size": 16,
                "precision": "fp8",
                "fp8_recipe": "tensorwise",
                "fp8_param_gather": True,
                "grad_reduce_in_fp32": False,
                "use_precision_aware_optimizer": True,
                "exp_avg_dtype": dtype,
                "exp_avg_sq_dtype": dtype,
            },
        )
        a = analyze(trace_job(job, full_model=False, workers=1))
        return a.roles[0].memory.optimizer, a.total_params

    (wide, n), (narrow, _) = optimizer("fp32"), optimizer("bf16")
    assert wide - narrow == pytest.approx(2 * 2 * n / DP, rel=0.005)


@pytest.mark.parametrize(
    "dtype, comm, size, sent, sent_size",
    [
        ("fp32", "auto", 4, "float32", 4),
        ("bf16", "auto", 2, "bfloat16", 2),
        ("fp32", "bf16", 4, "bfloat16", 2),
    ],
)
def test_main_gradients_take_megatron_fsdps_dtype(dtype, comm, size, sent, sent_size):
    """training.fsdp_main_grads_dtype is megatron-core 0.19's megatron_fsdp_main_grads_dtype:
    the sharded gradient buffer in that dtype (fp32 is what 0.16.1 did with grad_reduce_in_fp32),
    and the reduce-scatters too unless fsdp_grad_comm_dtype (megatron_fsdp_grad_comm_dtype) sends
    another. megatron-core 0.16.1 has no such options: refused, naming the first."""
    job = fsdp_job("optim_grads_params", fsdp_main_grads_dtype=dtype, fsdp_grad_comm_dtype=comm)
    if not guards.since(0, 19):
        with pytest.raises(ConfigError, match=r"^training\.fsdp_main_grads_dtype: .* 0\.19"):
            from metatrace.tracing.checks import check_with_megatron

            check_with_megatron(job)
        return
    a = analyze(trace_job(job, full_model=False, workers=1))
    n = a.total_params
    assert within(a.roles[0].memory.grads, size * n / DP)
    reduced = [it for it in dp_items(a) if it.op == "reduce_scatter"]
    assert {it.dtype for it in reduced} == {sent}
    m = a.job.num_microbatches
    assert within(sum(it.count * it.message for it in reduced) / m, sent_size * n)
