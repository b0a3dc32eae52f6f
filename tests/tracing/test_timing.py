"""The compute-time model: FLOPs per step against closed forms, the pipeline simulation against
Megatron's bubble formulas, the time of a traced job against its parts, and the Chrome trace
(the timing model on its own, without a trace, is in tests/unit/test_timing.py)."""

import functools
import itertools
import json

import pytest

from metatrace.analysis.timing import bubble, simulate
from metatrace.cli import main
from metatrace.tracing.trace import trace_job
from tests.helpers import DEBUG, small_job

# The debug preset (Llama-shaped): hidden 64, 4 heads in 2 query groups of head dim 16, SwiGLU
# ffn 128, vocabulary 1000 (padded to a multiple of 16 x tp); the tests run sequences of 64,
# micro-batches of 2.
H, GROUPS, KV, FFN, S, B = 64, 2, 16, 128, 64, 2
VOCAB = {1: 1008, 2: 1024}


def windows(job):
    """{(phase, chunk): FLOPs} of the first stage's traced micro-batch."""
    jt = trace_job(job, full_model=False, workers=1)
    return {(w.phase, w.chunk): w.flops for w in jt.roles[0].trace.windows if w.chunk is not None}


def layer_forward(tp: int, *, causal_half: bool) -> int:
    """One layer's forward FLOPs on one rank: 2·s·b·(weights of its linear layers) for the
    GEMMs, 2·2·s²·b·h for attention (scores and context), halved when causal tiles are
    skipped."""
    weights = (H * (H + 2 * GROUPS * KV) + H * H + H * 2 * FFN + FFN * H) // tp
    attention = 2 * 2 * S * S * B * H // tp
    return 2 * S * B * weights + (attention // 2 if causal_half else attention)


@pytest.mark.parametrize(
    "impl, tp, causal_half, attention_backward",
    [
        # megatron-core's local spec: its own unfused attention (baddbmm + bmm) computes the
        # masked half too; backward is twice forward for every matrix product.
        ("local", 1, False, 2.0),
        # Transformer Engine's cuDNN fused attention skips masked tiles; its backward recomputes
        # the scores (flop_counter's flash formulas: 2.5 x forward).
        ("transformer_engine", 1, True, 2.5),
        ("transformer_engine", 2, True, 2.5),  # sequence parallel: gathered inputs, shards
    ],
)
def test_flops_of_one_layer_in_closed_form(impl, tp, causal_half, attention_backward):
    from metatrace.hooks.recorder import _MEMO

    hits = _MEMO.hits

    def job(layers):
        return small_job(
            model={"num_layers": layers},
            parallel={"tp": tp, "sequence_parallel": tp > 1},
            implementation={"transformer_impl": impl},
            cluster={"num_gpus": tp},
        )

    one, two = windows(job(1)), windows(job(2))
    layer = layer_forward(tp, causal_half=causal_half)
    assert two[("forward", 0)] - one[("forward", 0)] == layer
    attention = 2 * 2 * S * S * B * H // tp // (2 if causal_half else 1)
    gemms = layer - attention
    assert two[("backward", 0)] - one[("backward", 0)] == 2 * gemms + attention_backward * attention
    # Outside the layers, forward: the output layer's logits [s·b, h] @ [h, V/tp].
    assert one[("forward", 0)] == layer + 2 * S * B * H * VOCAB[tp] // tp
    # The second layer's operators came from fastmeta's memo (their outputs' metadata reused)
    # and were counted all the same.
    assert _MEMO.hits > hits


def test_stand_ins_that_dispatch_no_gemm_report_the_same_flops():
    from metatrace.tracing.trace import trace_job as trace

    def steps(**sections):
        jt = trace(small_job(**sections), full_model=False, workers=1)
        return [
            (w.phase, w.flops, w.fp8_flops)
            for w in jt.roles[0].trace.windows
            if w.chunk is not None
        ]

    fused = steps()
    assert steps(implementation={"attention_backend": "flash"}) == fused
    # FP8: the layers' linear GEMMs (not the output layer, nor attention) at the FP8 rate.
    gemms = 2 * (layer_forward(1, causal_half=False) - 2 * 2 * S * S * B * H)  # 2 layers
    assert steps(training={"precision": "fp8"}) == [
        (phase, flops, gemms * (1 if phase == "forward" else 2)) for phase, flops, _ in fused
    ]
    # Context parallel: each of 2 ranks computes half the tokens, and half the causal attention.
    for kind in ("p2p", "all_gather"):
        cp = steps(parallel={"cp": 2, "cp_comm_type": kind}, cluster={"num_gpus": 2})
        assert cp == [(phase, flops // 2, 0) for phase, flops, _ in fused]
    moe = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 96}
    assert steps(model=moe, implementation={"moe_grouped_gemm": True}) == steps(model=moe)


def test_full_recompute_runs_the_layers_forward_again_inside_backward():
    def job(**recompute):
        return small_job(
            training={"recompute": recompute}, implementation={"transformer_impl": "local"}
        )

    plain = windows(job())
    full = windows(job(granularity="full", method="uniform", num_layers=1))
    assert full[("forward", 0)] == plain[("forward", 0)]
    assert full[("backward", 0)] - plain[("backward", 0)] == 2 * layer_forward(1, causal_half=False)


# ----------------------------------------------------------------------------- the pipeline


@functools.cache
def step_orders(pp, vpp, m):
    """Each stage's steps in the order megatron-core's schedule ran them (the replayed
    iteration of a traced job)."""
    job = small_job(
        model={"num_layers": pp * (vpp or 1)},
        parallel={"pp": pp, "vpp": vpp},
        training={"global_batch_size": B * m},
        cluster={"num_gpus": pp},
    )
    jt = trace_job(job, full_model=False, workers=1)
    return [
        [(w.phase, w.chunk, w.microbatch) for w in rt.iteration.windows if w.chunk is not None]
        for rt in sorted(jt.roles, key=lambda rt: rt.role.pp_stage)
    ]


@pytest.mark.parametrize("pp, vpp, m", [(4, None, 8), (2, None, 3), (4, 2, 8), (4, 2, 12)])
@pytest.mark.parametrize("forward, backward", [(1.0, 1.0), (1.0, 2.0)])
def test_bubble_of_megatron_schedules_in_closed_form(pp, vpp, m, forward, backward):
    # Equal stages, no communication: Megatron's bubble, (pp - 1) / (m + pp - 1) of the
    # iteration for 1F1B and (pp - 1) / (vpp·m + pp - 1) interleaved (a chunk's step takes
    # 1/vpp of a stage's), on every stage, exactly.
    orders = step_orders(pp, vpp, m)
    v = vpp or 1
    assert [len(o) for o in orders] == [2 * m * v] * pp
    sim = simulate(
        orders,
        lambda s, phase, c: (forward if phase == "forward" else backward) / v,
        pp=pp,
        vpp=vpp,
    )
    pipeline = max(end for stage in sim for _, end, *_ in stage)
    assert pipeline == pytest.approx((m + (pp - 1) / v) * (forward + backward))
    closed = (pp - 1) / (v * m + pp - 1)
    for stage in sim:
        assert bubble(stage, pipeline) == pytest.approx(closed, rel=1e-12)
        starts = [start for start, *_ in stage]
        assert starts == sorted(starts)


# ----------------------------------------------------------------------------- a traced job


@pytest.fixture(scope="module")
def debug_timing(debug_analysis):
    return debug_analysis, debug_analysis.timing


def test_step_time_is_its_kernels_plus_exposed_communication(debug_timing):
    jt, timing = debug_timing
    job = jt.job
    assert job.cluster.compute_efficiency is None and timing.peak_tflops == 989
    by_stage = {rt.role.pp_stage: rt for rt in jt.traced.roles}
    jc = {rt.role.pp_stage: comm for rt, comm in jt.comm.roles}
    for st in timing.stages:
        rt = by_stage[st.stage]
        flops = {(w.phase, w.chunk): w.flops for w in rt.trace.windows if w.chunk is not None}
        kernels = {
            (w.phase, w.chunk): w.kernel_ps / 1e12 for w in rt.trace.windows if w.chunk is not None
        }
        steps = [sp for sp in st.spans if sp.chunk is not None]
        assert len(steps) == 2 * job.num_microbatches
        exposed = 0.0
        for sp in steps:
            assert sp.flops == flops[(sp.phase, sp.chunk)] > 0
            # Slower than every FLOP at the best GEMM rate: the kernels' own rates, element-wise
            # work included.
            assert sp.compute_seconds == kernels[(sp.phase, sp.chunk)]
            assert sp.compute_seconds > sp.flops / (989e12 * 0.75)
            # The debug model's tiny kernels wait for the host (metatrace.config.host).
            assert sp.host_wait_seconds > 0
            assert sp.end - sp.start == pytest.approx(
                sp.compute_seconds + sp.comm_seconds + sp.host_wait_seconds
            )
            assert sp.comm_seconds == pytest.approx(sum(c.seconds for c in sp.calls))
            assert all(c.offset + c.seconds <= sp.end - sp.start + 1e-15 for c in sp.calls)
            exposed += sp.comm_seconds
        # The steps' exposed communication adds up to the comm tables' exposed seconds per
        # iteration of what the micro-batches issue (tensor parallel only in this job).
        comm = jc[st.stage]
        assert all(it.per_microbatch for it in comm.items if it.dimension == "tp")
        assert {it.dimension for it in comm.items if it.per_microbatch} == {"tp"}
        assert exposed == pytest.approx(comm.dims["tp"].exposed_seconds) and exposed > 0
        optimizer = st.spans[-1]
        assert optimizer.phase == "optimizer" and optimizer.start == timing.pipeline_seconds
        assert st.iteration_seconds == pytest.approx(timing.pipeline_seconds + st.optimizer_seconds)
        assert 0 < st.bubble_fraction < 1
    assert timing.iteration_seconds == max(st.iteration_seconds for st in timing.stages)


# ----------------------------------------------------------------------------- Chrome trace


def test_chrome_trace_has_a_process_per_stage_and_ordered_steps(debug_timing):
    from metatrace.export.chrome import chrome_trace

    jt, timing = debug_timing
    trace = json.loads(json.dumps(chrome_trace(jt)))
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "stage 0 (ranks 0-1)", 1: "stage 1 (ranks 2-3)"}
    m = jt.job.num_microbatches
    for pid in names:
        for tid in (1, 2):  # compute, communication: complete events one after another
            spans = sorted(
                (e["ts"], e["ts"] + e["dur"])
                for e in events
                if e["ph"] == "X" and e["pid"] == pid and e["tid"] == tid
            )
            assert spans and all(a[1] <= b[0] + 1e-9 for a, b in itertools.pairwise(spans))
        steps = [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["tid"] == 1]
        assert len(steps) == 2 * m + 1 and steps[-1]["name"] == "optimizer"
        expected = {f"{p} m{i} c0" for p in "FB" for i in range(m)} | {"optimizer"}
        assert {e["name"] for e in steps} == expected
        first = next(e for e in steps if e["name"] == "F m0 c0")
        assert first["args"]["flops"] > 0 and first["args"]["peak_bytes"] > 0
        # Microseconds from the simulation.
        assert steps[-1]["ts"] + steps[-1]["dur"] == pytest.approx(
            timing.stages[pid].iteration_seconds * 1e6, abs=2e-3
        )
    # Stage 1 receives micro-batch 0's activations after stage 0 sent them.
    sends = [e for e in events if e["ph"] == "b" and e["name"].startswith("send F m0")]
    recvs = [e for e in events if e["ph"] == "b" and e["name"].startswith("recv F m0")]
    assert [e["pid"] for e in sends] == [0] and [e["pid"] for e in recvs] == [1]
    f0 = next(e for e in events if e["pid"] == 1 and e.get("name") == "F m0 c0")
    end = next(e for e in events if e["ph"] == "e" and e["name"] == recvs[0]["name"])
    assert f0["ts"] == pytest.approx(end["ts"], abs=2e-3)


def test_cli_writes_the_chrome_trace(tmp_path, capsys):
    path = tmp_path / "trace.json"
    assert (
        main(["run", "--config", DEBUG, "--no-full-model", "--quiet", "--chrome-trace", str(path)])
        == 0
    )
    trace = json.loads(path.read_text())
    assert sum(e.get("name") == "process_name" for e in trace["traceEvents"]) == 2
    assert "Chrome trace written to" in capsys.readouterr().out


def test_json_report_carries_the_timing(debug_timing):
    from metatrace.export.report import job_report

    jt, timing = debug_timing
    report = json.loads(json.dumps(job_report(jt)))
    parts = report["timing"].pop("breakdown")
    host = report["timing"].pop("host")
    assert report["timing"] == {
        "iteration_seconds": timing.iteration_seconds,
        "bubble_fraction": timing.bubble_fraction,
        "pipeline_seconds": timing.pipeline_seconds,
        "peak_tflops": 989.0,
        "compute_efficiency": None,
    }
    # Where the last stage's iteration goes: its steps' kernels, their exposed communication, its
    # idle share of the pipeline, its optimizer step, the GPU's waits for the host; the terms
    # add up to the iteration.
    last = max(timing.stages, key=lambda st: st.iteration_seconds)
    steps = [sp for sp in last.spans if sp.chunk is not None]
    # The host's side of that stage's iteration: the steps' counts per micro-batch (the traced
    # micro-batch's windows) and the optimizer step's (the replayed iteration's), and the
    # pipeline's synchronisations (1F1B over two stages: stage 0 after its warm-up forward's
    # send and before each backward's receive, stage 1 before each forward's receive and after
    # its last backward's send; m + 1 either way).
    rt = next(rt for rt in jt.traced.roles if rt.role.pp_stage == last.stage)
    per_mb = [w for w in rt.trace.windows if w.chunk is not None]
    outside = [w for w in rt.iteration.windows if w.chunk is None]
    m = jt.job.num_microbatches
    p2p = m + 1
    assert host == {
        "stage": last.stage,
        "seconds": pytest.approx(
            (m * sum(w.host_ps for w in per_mb) + sum(w.host_ps for w in outside)) / 1e12
        ),
        "wait_seconds": pytest.approx(sum(sp.host_wait_seconds for sp in last.spans)),
        "kernels": m * sum(w.kernels for w in per_mb) + sum(w.kernels for w in outside),
        "syncs": m * sum(w.syncs for w in per_mb) + sum(w.syncs for w in outside) + p2p,
    }
    assert sum(w.kernels for w in outside) > 0 and host["wait_seconds"] > 0
    assert parts["host_seconds"] == pytest.approx(host["wait_seconds"])
    assert parts["stage"] == last.stage
    assert parts["compute_seconds"] == pytest.approx(sum(sp.compute_seconds for sp in steps))
    assert parts["communication_seconds"] == pytest.approx(sum(sp.comm_seconds for sp in steps))
    assert parts["communication_seconds"] > 0 and parts["offload_seconds"] == 0
    assert parts["idle_seconds"] == pytest.approx(last.bubble_fraction * timing.pipeline_seconds)
    # The optimizer step's wait for the host is the host's term.
    opt = last.spans[-1]
    assert opt.phase == "optimizer"
    assert parts["optimizer_seconds"] == pytest.approx(
        last.optimizer_seconds - opt.host_wait_seconds
    )
    assert parts["optimizer_seconds"] > 0
    total = sum(v for k, v in parts.items() if k != "stage")
    assert total == pytest.approx(timing.iteration_seconds)
    stages = {st.stage: st for st in timing.stages}
    for role, rt in zip(report["roles"], jt.roles):
        st = stages[role["pp_stage"]]
        assert role["timing"]["bubble_fraction"] == st.bubble_fraction
        assert role["timing"]["iteration_seconds"] == st.iteration_seconds
        # Forward and backward of one micro-batch: three times the forward's matrix products
        # and more (the fused attention's backward recomputes the scores).
        forward = next(w.flops for w in rt.trace.windows if w.phase == "forward")
        assert role["timing"]["flops_per_microbatch"] > 3 * forward


def test_overlapped_data_parallel_traffic_shows_past_the_steps_beside_it():
    """overlap_grad_reduce and overlap_param_gather hide the data-parallel collectives only as far
    as the last backward and the first forward last: over a slow network the rest lengthens the
    iteration (Timing.dp_exposed_seconds), by what the collectives outlast those steps."""
    from metatrace.analysis.timing import job_timing

    def timing(inter_node_gbps, overlap=True):
        job = small_job(
            training={
                "global_batch_size": 8,
                "distributed_optimizer": True,
                "overlap_grad_reduce": overlap,
                "overlap_param_gather": overlap,
            },
            cluster={"num_gpus": 4, "gpus_per_node": 1, "inter_node_gbps": inter_node_gbps},
        )
        return job_timing(trace_job(job, full_model=False, workers=1))

    fast, slow = timing(1e6), timing(0.05)
    assert fast.dp_exposed_seconds < 0.01 * fast.iteration_seconds  # the last bucket only
    assert slow.dp_exposed_seconds > 10 * fast.iteration_seconds
    # The small model's steps wait for the host over the fast network; over the slow one the
    # host issues them while the GPU waits for the gathers (metatrace.config.host), so the
    # exposed traffic replaces the host's wait.
    assert fast.host.wait_seconds > 0.5 * fast.iteration_seconds
    assert slow.host.wait_seconds == 0
    assert slow.iteration_seconds == pytest.approx(
        fast.iteration_seconds - fast.host.wait_seconds + slow.dp_exposed_seconds, rel=0.02
    )
    # the first forward waits for the gather, the optimizer for the reductions
    (stage,) = slow.stages
    first = next(sp for sp in stage.spans if sp.phase == "forward")
    assert first.comm_seconds > first.compute_seconds
    assert stage.spans[-1].comm_seconds > 0.5 * slow.dp_exposed_seconds
    # without the overlap the collectives are the optimizer step's, and nothing is past a step
    assert timing(0.05, overlap=False).dp_exposed_seconds == 0.0


def test_the_context_parallel_ring_hides_behind_the_attention_kernels_only():
    """Transformer Engine's ring exchange runs beside the attention kernels of the step, not
    beside its GEMMs: over a slow link a step's exposed time is the ring (sends and receives at
    once) less the step's attention kernels (Window.attention_ps, as many per layer as the
    traced layers have when the others are derived)."""
    from metatrace.analysis.timing import job_timing

    def traced(layers):
        job = small_job(
            model={"num_layers": layers},
            parallel={"cp": 2},
            implementation={"transformer_impl": "transformer_engine"},
            cluster={"num_gpus": 2, "intra_node_gbps": 0.5},
        )
        return trace_job(job, full_model=False, workers=1)

    small, large = traced(4), traced(8)
    steps = {(w.phase, w.chunk): w for w in large.roles[0].trace.windows if w.chunk is not None}
    for w in small.roles[0].trace.windows:
        if w.chunk is not None:
            assert 0 < w.attention_ps < w.kernel_ps
            assert steps[(w.phase, w.chunk)].attention_ps == 2 * w.attention_ps
    timing = job_timing(large)
    for sp in timing.stages[0].spans[:2]:
        w = steps[(sp.phase, sp.chunk)]
        ring = {
            op: sum(c.seconds for c in sp.calls if c.dimension == "cp" and c.op == op)
            for op in ("send", "recv")
        }
        assert ring["send"] == ring["recv"] > 0
        attention = w.attention_ps / 1e12
        assert ring["send"] > attention  # the slow link: the ring outlasts the attention
        exposed = sum(c.seconds for c in sp.calls if c.overlapped is None)
        assert sp.comm_seconds == pytest.approx(exposed + ring["send"] - attention)
