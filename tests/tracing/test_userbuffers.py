"""Transformer Engine's TP communication overlap traced (parallel.tp_comm_overlap): the linear
stand-ins gather into and reduce-scatter out of TE's userbuffers as TE 2.8 does, so the
gathered inputs and output gradients and the bulk-overlapped dgrad never reach PyTorch's
allocator; the buffers themselves count in the verdict; the overlapped collectives move what
they moved without the overlap but are no longer exposed.

Sizes of the debug preset: h 64, s 64, b 2 (N = 128 tokens), tp 2 with sequence parallelism
(Ns = 64), bf16 (2 bytes) or FP8 (1 byte)."""

import dataclasses

import pytest

from metatrace.analysis.analyze import analyze
from metatrace.config.userbuffers import userbuffer_bytes
from metatrace.models.te_runtime import UB_OVERLAP
from metatrace.tracing.trace import trace_job
from tests.helpers import small_job

N, H, TP = 128, 64, 2
TE_WORKSPACE = 32 * 1024 * 1024 + 1024  # sm90


def ub_job(overlap: bool, precision="bf16"):
    training = {"global_batch_size": 8, "precision": precision}
    if precision == "fp8":
        training["fp8_recipe"] = "tensorwise"
    return small_job(
        parallel={"tp": TP, "sequence_parallel": True, "tp_comm_overlap": overlap},
        training=training,
        implementation={"transformer_impl": "transformer_engine"},
        cluster={"num_gpus": TP, "gpus_per_node": TP, "gpu": "h100"},
    )


def _analysis(overlap, precision="bf16"):
    return analyze(trace_job(ub_job(overlap, precision), full_model=False, workers=1))


@pytest.fixture(scope="module")
def bf16():
    return {overlap: _analysis(overlap) for overlap in (False, True)}


def module_transient(trace, module: str, phase: str) -> int:
    """The highest allocated memory inside `module`'s `phase` above what was live at its start."""
    start = best = None
    for e in trace.memory:
        if e.module == module and e.phase == phase:
            start = e.live - e.delta if start is None else start
            best = max(best or 0, e.live - start)
    return best


LAYER = "decoder.layers.0."


@pytest.mark.parametrize(
    "module, phase, gone",
    [
        # the norm output all-gathered for the column-parallel GEMM
        ("mlp.linear_fc1", "forward", N * H * 2),
        # the output gradient all-gathered for the row-parallel dgrad GEMM
        ("mlp.linear_fc2", "backward", N * H * 2),
        ("self_attention.linear_proj", "backward", N * H * 2),
    ],
)
def test_gathered_tensors_live_in_the_userbuffers(bf16, module, phase, gone):
    without, with_ = (bf16[o].roles[0].trace for o in (False, True))
    assert (
        module_transient(without, LAYER + module, phase)
        - module_transient(with_, LAYER + module, phase)
        == gone
    )


@pytest.mark.parametrize("module", ["mlp.linear_fc1", "self_attention.linear_qkv"])
def test_column_backward_keeps_no_full_size_tensor(bf16, module):
    """Without the overlap the gathered norm output, dgrad [N, h] and its reduce-scattered
    [Ns, h] are live together; with it the first two are userbuffers (bulk overlaps)."""
    without, with_ = (bf16[o].roles[0].trace for o in (False, True))
    local = N // TP * H * 2
    assert module_transient(without, LAYER + module, "backward") == 2 * N * H * 2 + local
    # With it: the clone of dgrad's local chunk (after the wgrad GEMM) and the norm's backward
    # (its input gradient, and a block for the norm weight's gradient).
    assert module_transient(with_, LAYER + module, "backward") == local + local + 512


def test_workspace_grows_to_three_streams_and_buffers_join_the_verdict(bf16):
    without, with_ = (bf16[o] for o in (False, True))
    assert with_.roles[0].memory.workspaces - without.roles[0].memory.workspaces == 2 * TE_WORKSPACE
    ub = userbuffer_bytes(ub_job(True))
    assert ub == 12 * N * H * 2
    assert with_.verdict.userbuffers == ub


def test_the_userbuffers_can_make_a_job_not_fit(bf16):
    """A GPU that holds the rest of the rank's device memory with less room than the buffers:
    out of memory by what is missing."""
    job = ub_job(True)
    ra = bf16[True].roles[0]
    ub = 12 * N * H * 2
    assert ra.device.userbuffers == ub and ra.device.outside >= ub
    room = ub // 2  # half the buffers
    gib = (ra.device.total - ub + room) / 2**30
    small = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, gpu_memory_gib=gib))
    v = analyze(dataclasses.replace(bf16[True].traced, job=small)).verdict
    assert not v.fits and v.oom_ranks == (0, 1)
    # short by what the allocator would reserve beyond the room (its reserve is the same)
    assert v.binding.reserve.reserved == ra.device.reserve.reserved
    assert v.headroom == pytest.approx(room - ub, abs=2**21)


def test_same_traffic_but_the_linear_layers_tp_collectives_are_overlapped(bf16):
    without, with_ = (bf16[o].comm.roles[0][1] for o in (False, True))
    assert with_.dims["tp"].bytes_sent == without.dims["tp"].bytes_sent
    linear = [it for it in with_.items if it.dimension == "tp" and "linear_" in it.module]
    assert linear and all(it.overlapped == UB_OVERLAP for it in linear)
    others = [it for it in with_.items if it.dimension == "tp" and "linear_" not in it.module]
    assert others and all(it.overlapped is None for it in others)  # embedding, output layer
    assert with_.dims["tp"].exposed_seconds < without.dims["tp"].exposed_seconds


def test_fp8_gathers_one_byte_data_into_the_userbuffers():
    without, with_ = (_analysis(o, "fp8").roles[0].trace for o in (False, True))

    def gone(module, phase):
        module = LAYER + module
        return module_transient(without, module, phase) - module_transient(with_, module, phase)

    assert gone("mlp.linear_fc1", "forward") == N * H  # the gathered FP8 norm output
    # Row parallel backward: the gathered FP8 output gradient lives in the userbuffer, and the
    # local FP8 copy goes once gathered (each had a 512-byte scale block).
    assert gone("mlp.linear_fc2", "backward") == N * H + N // TP * H + 2 * 512
    assert userbuffer_bytes(ub_job(True, "fp8")) == 8 * N * H + 4 * N * H * 2


def test_a_bf16_layer_cannot_gather_into_the_fp8_userbuffers():
    # TE 2.8's copy_into_buffer refuses elements of another size than the buffer's: a layer
    # that first_last_layers_bf16 runs in bf16 gathers 2-byte elements into the 1-byte buffers
    # initialize_ub made for FP8, and the real run fails there. Without the bf16 layers the
    # same job traces.
    from metatrace.config.userbuffers import UbError

    job = ub_job(True, "fp8")
    trace_job(job, full_model=False, workers=1)
    bf16_ends = dataclasses.replace(
        job,
        training=dataclasses.replace(
            job.training,
            first_last_layers_bf16=True,
            num_layers_at_start_in_bf16=1,
            num_layers_at_end_in_bf16=0,
        ),
    )
    with pytest.raises(UbError, match="userbuffer qkv_fprop holds 1-byte FP8 elements"):
        trace_job(bf16_ends, full_model=False, workers=1)
