"""The compute-time model without a trace: transfers in the pipeline simulation, the compute rate
and its checks, a refused Chrome trace path (traced jobs are in tests/tracing/test_timing.py)."""

import pytest

from metatrace.analysis.timing import compute_seconds, peak_flops, simulate
from metatrace.cli import main
from metatrace.errors import ConfigError
from tests.helpers import DEBUG, small_job


def test_transfers_delay_the_receiver_by_their_time():
    # Two stages, one micro-batch: F0, F1, B1, B0 in a chain, each waiting for the transfer.
    orders = [[("forward", 0, 0), ("backward", 0, 0)], [("forward", 0, 0), ("backward", 0, 0)]]
    sim = simulate(
        orders,
        lambda s, phase, c: 1.0 if phase == "forward" else 2.0,
        pp=2,
        p2p=lambda s, phase: 0.25,
    )
    assert [(start, end) for start, end, *_ in sim[1]] == [(1.25, 2.25), (2.25, 4.25)]
    assert [(start, end) for start, end, *_ in sim[0]] == [(0.0, 1.0), (4.5, 6.5)]


def test_compute_rate_follows_the_gpu_the_precision_and_the_efficiency():
    h100 = small_job(cluster={"gpu": "h100", "compute_efficiency": 0.25})
    a100 = small_job(cluster={"gpu": "a100"})
    assert peak_flops(h100) == (989e12, 2 * 989e12)  # FP8 at twice the bf16 rate on Hopper
    assert peak_flops(a100) == (312e12, 312e12)  # no FP8 tensor cores on Ampere
    # 1 TFLOP of bf16 and 1 TFLOP of FP8 at a quarter of the H100's peak.
    seconds = compute_seconds(2 * 10**12, 10**12, peak_flops(h100), 0.25)
    assert seconds == pytest.approx((1 / 989 + 1 / 1978) * 4)


@pytest.mark.parametrize("value", [0, -0.5, 1.5])
def test_compute_efficiency_outside_0_1_is_refused(value):
    with pytest.raises(ConfigError, match=r"cluster\.compute_efficiency"):
        small_job(cluster={"compute_efficiency": value})


def test_cli_refuses_a_bad_chrome_trace_path_before_tracing(tmp_path, capsys, monkeypatch):
    import metatrace.tracing.trace

    monkeypatch.setattr(metatrace.tracing.trace, "trace_job", lambda *a, **k: pytest.fail("traced"))
    missing = tmp_path / "nowhere" / "trace.json"
    assert main(["run", "--config", DEBUG, "--chrome-trace", str(missing)]) == 2
    assert "--chrome-trace" in capsys.readouterr().err


def test_a_step_waits_for_its_parameters_relative_or_from_the_start():
    """overlap_param_gather: a first forward lasts at least its gather (`least`), or, aligned
    across stages, ends no earlier than the gather started with the iteration (`ends_after`)."""
    orders = [[("forward", 0, 0), ("forward", 0, 1)], [("forward", 0, 0), ("forward", 0, 1)]]

    def run(**kw):
        sim = simulate(orders, lambda s, phase, c: 1.0, pp=2, **kw)
        return [[(start, end) for start, end, *_ in stage] for stage in sim]

    first = lambda s, phase, c, mb: 2.5 if mb == 0 else 0.0
    # each stage's first step waits its own 2.5 s: stage 1 starts it after stage 0's
    assert run(least=first) == [[(0.0, 2.5), (2.5, 3.5)], [(2.5, 5.0), (5.0, 6.0)]]
    # started together at 0: stage 1's first step (from 2.5) is not held up
    assert run(ends_after=first) == [[(0.0, 2.5), (2.5, 3.5)], [(2.5, 3.5), (3.5, 4.5)]]


def test_gradient_reductions_run_one_after_another_from_each_chunks_last_backward():
    from metatrace.analysis.timing import _reduced_by

    steps = [
        (0.0, 1.0, "backward", 1, 3),  # chunk 1's last backward
        (1.0, 2.0, "backward", 0, 3),  # chunk 0's, the stage's last step
    ]
    # chunk 1: 3 s from 0; chunk 0 after it (from 3), 0.5 s; its last bucket after the step
    assert _reduced_by(steps, {1: (3.0, 1.0), 0: (0.5, 0.1)}) == 3.5
    # short reductions: the last bucket, only after its step ends, is what remains exposed
    assert _reduced_by(steps, {1: (0.2, 0.1), 0: (0.2, 0.1)}) == pytest.approx(2.1)


def test_compute_beside_the_flex_dispatch_runs_on_the_sms_it_leaves():
    """Combined 1F1B: a step's compute runs beside its all-to-alls; DeepEP's kernels hold 20 of
    an H100's 132 SMs while they run, so 1 ms of dispatch beside 10 ms of compute adds
    1 ms x 20/132; a dispatch that outlasts the compute adds the difference (12 - 10 ms beats
    12 x 20/132 = 1.82 ms). HybridEP takes moe_hybridep_num_sms, NCCL's all-to-all nothing."""
    from metatrace.analysis.timing import _beside_dispatch, dispatch_sms_share

    deepep = small_job(
        model={"num_experts": 4, "moe_router_topk": 2},
        parallel={"ep": 2, "moe_token_dispatcher_type": "flex"},
        cluster={"gpu": "h100", "num_gpus": 2},
    )
    taken = dispatch_sms_share(deepep)
    assert taken == 20 / 132
    assert _beside_dispatch(1e-3, 10e-3, taken) == pytest.approx(1e-3 * 20 / 132)
    assert _beside_dispatch(12e-3, 10e-3, taken) == pytest.approx(2e-3)
    hybrid = small_job(
        model={"num_experts": 4, "moe_router_topk": 2},
        parallel={
            "ep": 2,
            "moe_token_dispatcher_type": "flex",
            "moe_flex_dispatcher_backend": "hybridep",
            "moe_hybridep_num_sms": 32,
        },
        cluster={"gpu": "b200", "num_gpus": 2},
    )
    assert dispatch_sms_share(hybrid) == 32 / 148
    nccl = small_job(
        model={"num_experts": 4, "moe_router_topk": 2},
        parallel={"ep": 2, "moe_token_dispatcher_type": "alltoall"},
        cluster={"num_gpus": 2},
    )
    assert dispatch_sms_share(nccl) == 0.0
