"""The allocations metatrace feeds the allocator simulation against those megatron-core makes
running for real on the CPU (the profiler's every allocation and free, addresses and all), both
through the same simulated caching allocator: the reserve must agree."""

import pytest

from metatrace.config.allocator import AllocatorConfig
from metatrace.tracing.measure import measure_rank, reserves
from metatrace.tracing.trace import trace_role
from metatrace.world import World
from tests.helpers import small_job

# Large enough that activations leave the small pool (h 384, s 512: 1.5 MiB a tensor).
BIG = {
    "model": {
        "num_layers": 4,
        "hidden_size": 384,
        "num_attention_heads": 8,
        "ffn_hidden_size": 1536,
        "vocab_size": 4000,
        "max_position_embeddings": 512,
    },
    "training": {"seq_length": 512, "micro_batch_size": 2, "global_batch_size": 8},
    "implementation": {"transformer_impl": "local"},
}
CASES = {
    "tp1": ({}, 0),
    "pp2 first stage (two micro-batches in flight)": ({"pp": 2}, 0),
    "pp2 vpp2 first stage": ({"pp": 2, "vpp": 2}, 0),
}


@pytest.mark.parametrize("case", CASES)
def test_reserve_of_the_traced_allocations_matches_the_real_ones(case):
    parallel, rank = CASES[case]
    from metatrace.config import resolve

    job = resolve(small_job(**BIG, parallel=parallel))
    world = World.from_job(job)
    role = next(r for r in world.roles() if rank in r.ranks)
    rt = trace_role(job, world, role, rank=rank)
    measured = measure_rank(job, rank, iterations=3, device="cpu")
    for config in (AllocatorConfig(), AllocatorConfig(expandable_segments=True)):
        predicted, real = reserves(job, rt, measured, config)
        # measured with these cases: within 0.8 %, default and expandable segments alike
        assert predicted.reserved == pytest.approx(real.reserved, rel=0.02), config
        assert predicted.allocated == pytest.approx(real.allocated, rel=0.02), config
        assert predicted.reserved > predicted.allocated


def _live_peak(events) -> int:
    """The highest sum of the live allocations of a stream of (delta, key)."""
    size: dict = {}
    live = best = 0
    for delta, key in events:
        now = size.get(key, 0)
        change = delta if delta > 0 else -min(now, -delta)
        size[key] = now + change
        live += change
        best = max(best, live)
    return best


LAYOUTS = {
    "dense, pp 2 with virtual stages": {
        "model": {"num_layers": 4},
        "parallel": {"pp": 2, "vpp": 2},
        "training": {"global_batch_size": 8},
    },
    "fp8 weights gathered by the distributed optimizer": {
        "parallel": {"dp": 2},
        "training": {
            "precision": "fp8",
            "fp8_recipe": "tensorwise",
            "fp8_param_gather": True,
            "distributed_optimizer": True,
            "global_batch_size": 8,
        },
    },
    "Megatron-FSDP": {
        "parallel": {"dp": 2},
        "training": {"megatron_fsdp": True, "global_batch_size": 8},
    },
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_simulated_allocations_peak_where_the_iteration_does(layout):
    """The allocations the simulation replays hold at their highest what the analysis calls
    the peak: nothing counted twice (the replay's lumps and the traced step's tensors, what one
    iteration keeps for the next) and nothing left out."""
    from metatrace.analysis.device import allocations
    from metatrace.analysis.memory import role_memory
    from metatrace.config import resolve
    from metatrace.tracing.trace import trace_job

    sections = LAYOUTS[layout]
    job = resolve(small_job(**sections))
    for rt in trace_job(job, full_model=False).roles:
        peak = role_memory(rt.trace, rt.iteration).peak
        assert _live_peak(allocations(rt.trace, rt.iteration)) == pytest.approx(peak, rel=0.002)


def test_the_report_says_when_the_reserve_peaks_and_which_frees_left_its_holes():
    from metatrace.analysis.analyze import analyze
    from metatrace.config import resolve
    from metatrace.export.report import job_report
    from metatrace.tracing.trace import trace_job

    job = resolve(small_job(**BIG))
    report = job_report(analyze(trace_job(job, full_model=False)))
    (role,) = report["roles"]
    device = role["device"]
    modules = {m["fqn"] for m in role["modules"]} | {"(step)", "(static)", "model"}
    assert device["allocator_reserve_bytes"] > device["allocated_peak_bytes"] > 0
    module, _, step = device["reserve_peak_at"].partition(" (")
    assert module in modules or module.startswith("decoder.") or module == "", device
    assert step.rstrip(")") in {"set-up", "the first micro-batch"} or step.startswith("iteration")
    holes = device["holes"]
    assert holes and [h["bytes"] for h in holes] == sorted(
        (h["bytes"] for h in holes), reverse=True
    )
    assert all(isinstance(h["left_by"], str) and h["left_by"] for h in holes)
    verdict = report["memory_verdict"]
    assert verdict["device_bytes"] == device["total_bytes"]
    assert verdict["device_bytes"] == device["allocator_reserve_bytes"] + sum(
        t["bytes"] for t in verdict["outside_terms"]
    )
