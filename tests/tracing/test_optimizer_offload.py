"""megatron-core's optimizer CPU offload (--optimizer-cpu-offload, HybridDeviceOptimizer as
metatrace.hooks.optimizer_offload restates its split and step for meta), in closed form from
hybrid_optimizer.py and get_megatron_optimizer (megatron-core 0.16.1):

- the distributed optimizer hands it the rank's bf16 shards (precision-aware optimizer); shards
  are offloaded in order until `fraction` of the shard's elements are;
- an offloaded element keeps on the host an fp32 copy, exp_avg, exp_avg_sq (torch's AdamW) and
  an fp32 pinned gradient buffer (16 bytes; plus AdamW's fp32 `step` per shard), and nothing of
  the optimizer on the GPU;
- an element left on the GPU gets an fp32 copy and TE FusedAdam's fp32 moments (12 bytes; the
  precision-aware optimizer alone keeps 10: int16 remainders and the moments), and with bf16
  main gradients an fp32 copy of its gradient the step leaves behind (16);
- each step copies the offloaded gradients to the host in the host copy's dtype (fp32) and the
  updated parameters back in the GPU shard's (bf16)."""

import pytest

from metatrace.analysis.memory import role_memory
from metatrace.errors import ConfigError
from metatrace.tracing.trace import trace_role
from metatrace.world import World
from tests.helpers import small_job

BLOCK = 512
F32, BF16 = 4, 2


def offload_job(fraction=None, **training):
    if fraction is not None:
        training.update(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction)
    return small_job(
        model={"hidden_size": 256, "ffn_hidden_size": 1024},  # shards far above the rounding
        implementation={"transformer_impl": "transformer_engine"},
        training={
            "distributed_optimizer": True,
            "use_precision_aware_optimizer": True,
            "global_batch_size": 8,
            **training,
        },
        cluster={"num_gpus": 2},
    )


def traced(job):
    world = World.from_job(job)
    rt = trace_role(job, world, world.roles()[0])
    return rt, role_memory(rt.trace, rt.iteration)


def param_numels(rt) -> list[int]:
    return [p.numel for m in rt.trace.modules for p in m.params]


@pytest.fixture(scope="module")
def baseline():
    """The precision-aware optimizer without the offload."""
    return traced(offload_job())


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_gpu_and_host_state_per_offloaded_element(baseline, fraction):
    rt, m = traced(offload_job(fraction))
    _, base = baseline
    h = rt.host_optimizer
    total, off = h.total_numel, h.offloaded_numel
    params = param_numels(rt)
    slack = 3 * BLOCK * len(params) + 8 * BLOCK  # a block of rounding per tensor
    assert total > 2 * slack  # a byte per element off would show
    # Offloaded in order until the fraction is reached: at most one parameter's shard beyond.
    largest = max(params)
    assert fraction * total <= off < fraction * total + largest + 1
    assert (off == 0) == (fraction == 0.0) and (off == total) == (fraction == 1.0)
    assert 0 <= m.optimizer - 12 * (total - off) <= slack
    assert 0 <= base.optimizer - 10 * total <= slack
    assert m.params == base.params and m.grads == base.grads
    shards = h.host_bytes - 16 * off
    assert shards % F32 == 0 and 0 <= shards // F32 <= len(params)  # AdamW's steps
    assert h.d2h_bytes == F32 * off
    assert h.h2d_bytes == BF16 * off


def test_bf16_main_gradients_leave_an_fp32_copy_on_the_gpu():
    bf16 = {"main_grads_dtype": "bf16", "grad_reduce_in_fp32": False}
    rt, m = traced(offload_job(0.5, **bf16))
    h = rt.host_optimizer
    slack = 4 * BLOCK * len(param_numels(rt)) + 8 * BLOCK
    assert 0 <= m.optimizer - 16 * (h.total_numel - h.offloaded_numel) <= slack
    assert h.d2h_bytes == F32 * h.offloaded_numel  # the host copy's dtype crosses the link
    assert h.h2d_bytes == BF16 * h.offloaded_numel


def test_the_time_model_adds_the_copies_to_the_optimizer_step():
    from metatrace.analysis.analyze import analyze
    from metatrace.analysis.timing import host_optimizer_seconds
    from metatrace.tracing.trace import trace_job

    gpu, ends = {}, {}
    for overlap in (False, True):
        job = offload_job(1.0, overlap_cpu_optimizer_d2h_h2d=overlap)
        a = analyze(trace_job(job, full_model=False, workers=1))
        h = a.roles[0].traced.host_optimizer
        gbps = job.cluster.host_link_gbps
        moved = max(h.d2h_bytes, h.h2d_bytes) if overlap else h.d2h_bytes + h.h2d_bytes
        assert host_optimizer_seconds(job, h) == pytest.approx(moved * 8 / (gbps * 1e9))
        (opt,) = [sp for sp in a.timing.stages[0].spans if sp.phase == "optimizer"]
        assert opt.offload_seconds == host_optimizer_seconds(job, h)
        # The step ends when the GPU has done its part and no earlier than the host has issued
        # it (metatrace.config.host): its GPU side is what the step lasts beyond the wait.
        gpu[overlap] = opt.end - opt.start - opt.host_wait_seconds
        ends[overlap] = (opt.end - opt.start, opt.host_wait_seconds)
    # The GPU side saves the shorter direction's copies.
    assert gpu[False] - gpu[True] == pytest.approx(min(h.d2h_bytes, h.h2d_bytes) * 8 / (gbps * 1e9))
    # The host issues the same work in both: where a step waits for it, the host is done at its
    # end, and the other step lasts as long as the longer of its GPU side and that.
    # The overlapped copies' step, shorter on the GPU, waits (under megatron-core 0.19, whose
    # optimizer step issues more from the host, the other one may too).
    assert ends[True][1] > 0
    host_done = ends[True][0]
    for overlap in (False, True):
        assert ends[overlap][0] == pytest.approx(max(gpu[overlap], host_done))


@pytest.mark.parametrize(
    "training, message",
    [
        ({"use_precision_aware_optimizer": False}, "needs training.use_precision_aware_optimizer"),
        ({"optimizer_offload_fraction": 1.5}, "must be between 0 and 1"),
        (
            {"precision": "fp8", "fp8_recipe": "tensorwise", "fp8_param_gather": True},
            "FP8 parameters' shards",
        ),
        ({"megatron_fsdp": True}, "with training.megatron_fsdp is not modelled"),
    ],
)
def test_what_megatron_refuses_or_fails_on(training, message):
    with pytest.raises(ConfigError, match=message):
        offload_job(**{"optimizer_cpu_offload": True, **training})


def test_sub_options_without_the_offload_are_noted():
    job = offload_job(optimizer_offload_fraction=0.5)
    assert any("optimizer_offload_fraction changes nothing without" in n for n in job.notes)
    assert job.training.optimizer_offload_fraction == 1.0
