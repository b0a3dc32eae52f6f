"""Fine-grained activation offloading (megatron-core 0.16.1, --offload-modules): what each module
choice moves in closed form, the replayed iteration against megatron-core's own offload manager
running the model in every step (its warm-up iteration first, then the steady state), the PCIe
traffic and pinned host memory, and what the checks refuse (those at load time are in
tests/unit/test_offload.py).

Sizes of the debug preset: h 64, a 4 heads, g 2 query groups, d 16, s 64, b 2 (N = s b = 128
tokens), bf16; min_offloaded_tensor_size 1024 elements unless said otherwise."""

import json

import pytest

from metatrace.analysis.memory import persistent_bytes, role_memory, role_offload
from metatrace.config import release
from metatrace.errors import ConfigError
from metatrace.tracing.trace import JobTrace, trace_role
from metatrace.world import World
from tests.helpers import MOE, small_job

SINCE_0_19 = release.since(0, 19)

BLOCK = 512
S, B, H, A, G, D = 64, 2, 64, 4, 2, 16
N = S * B
T, FE = N * 2, 96  # tokens routed to this rank's experts (top-2, ep 1), expert ffn hidden
TP2 = {"parallel": {"tp": 2, "sequence_parallel": True}, "cluster": {"num_gpus": 2}}


def offload_job(modules, min_size=1024, **sections):
    training = {"global_batch_size": 8, **sections.pop("training", {})}
    if modules:
        training.update(
            activation_offload_modules=list(modules), min_offloaded_tensor_size=min_size
        )
    return small_job(training=training, **sections)


def moved_per_group(job, name):
    """{group index: bytes moved} of module `name` in stage 0's traced micro-batch."""
    world = World.from_job(job)
    record = trace_role(job, world, world.roles()[0], iteration=False).offload
    per = {}
    for m in record.moved:
        if m.name == name:
            per[m.group] = per.get(m.group, 0) + m.bytes
    return per, record


# Bytes one layer's group moves to the host (and back), per module (findings A.3).
@pytest.mark.parametrize(
    "modules, name, sections, per_layer",
    [
        # x [Ns, h] and the norm output [Ns, h] of the fused LayerNormLinear (Ns = N / tp).
        (["qkv_linear"], "qkv_linear", TP2, 4 * (N // 2) * H),
        # q, out [s, b, a/t, d] and k, v [s, b, g/t, d]; the softmax statistics [b, a/t, s]
        # (fp32, 256 elements) stay below the minimum.
        (["core_attn"], "core_attn", TP2, 4 * N * (A + G) * D // 2),
        # The projection's input [N, a d / t] (the storage core_attn's `out` already moved).
        (["core_attn", "attn_proj"], "attn_proj", TP2, 2 * N * A * D // 2),
        # Transformer Engine fuses both norms into the next linear: no group at all.
        (["attn_norm"], "attn_norm", TP2, 0),
        (["mlp_norm"], "mlp_norm", TP2, 0),
        # The local spec's input norm keeps its input [s, b, h].
        (["attn_norm"], "attn_norm", {"implementation": {"transformer_impl": "local"}}, 2 * N * H),
        # A MoE layer's pre-MLP norm (TENorm) input [s, b, h].
        (
            ["mlp_norm"],
            "mlp_norm",
            {"model": MOE, "implementation": {"moe_grouped_gemm": True}},
            2 * N * H,
        ),
        # The grouped fc1's whole input [T, h], one tensor (save_original_input).
        (
            ["expert_fc1"],
            "expert_fc1",
            {"model": MOE, "implementation": {"moe_grouped_gemm": True}},
            2 * T * H,
        ),
        # The activation's input, fc1's output [T, 2 f_e] (SwiGLU).
        (
            ["moe_act"],
            "moe_act",
            {"model": MOE, "implementation": {"moe_grouped_gemm": True}},
            2 * T * 2 * FE,
        ),
    ],
    ids=[
        "qkv_linear",
        "core_attn",
        "attn_proj",
        "attn_norm-te",
        "mlp_norm-te",
        "attn_norm-local",
        "mlp_norm-moe",
        "expert_fc1",
        "moe_act",
    ],
)
def test_each_module_moves_its_closed_form(modules, name, sections, per_layer):
    job = offload_job(modules, **sections)
    per, record = moved_per_group(job, name)
    layers = job.model.num_layers
    if per_layer == 0:
        assert per == {} and name not in record.groups[0]
        return
    assert len(per) == layers and set(per.values()) == {per_layer}
    # One group per module and layer, in forward order.
    assert record.groups[0].count(name) == layers


def test_the_minimum_size_keeps_small_tensors_on_the_gpu():
    # At 4096 elements k and v [s, b, g/t, d] (2048 each) stay; q and out (4096) move.
    per, _ = moved_per_group(offload_job(["core_attn"], min_size=4096, **TP2), "core_attn")
    assert set(per.values()) == {2 * 2 * N * (A // 2) * D}  # q, out: [s, b, a/t, d] bf16


def test_the_recorder_still_sees_what_offload_groups_save():
    """The offload manager's saved-tensor hooks hide the recorder's: the stand-in calls them,
    so the same tensors are recorded as saved; what moved to the host is no longer held."""
    world = World.from_job(small_job())
    plain = trace_role(small_job(), world, world.roles()[0], iteration=False).trace
    rt = trace_role(
        offload_job(["qkv_linear", "core_attn", "attn_proj"]),
        world,
        world.roles()[0],
        iteration=False,
    )
    saved = rt.trace.saved
    assert [(s.shape, s.dtype, s.module) for s in saved] == [
        (s.shape, s.dtype, s.module) for s in plain.saved
    ]
    from metatrace.analysis.aggregate import activation_bytes

    # Freed by offloading, per layer: the layer input and the norm output [s, b, h] (the
    # residual still holds the input until the attention's bias-dropout-add, not until
    # backward), the fused qkv buffer [s, b, (a + 2g) d] (q, k, v are views of it, released by
    # resize_(0)), the attention output [s, b, a d].
    freed = 2 * (2 * 2 * N * H + 2 * N * (A + 2 * G) * D + 2 * N * A * D)
    assert activation_bytes(plain) - activation_bytes(rt.trace) == freed


CASES = {
    "pp1": dict(modules=["core_attn", "attn_proj"], training={"global_batch_size": 4}),
    "pp2": dict(modules=["core_attn", "attn_proj"], model={"num_layers": 4}, parallel={"pp": 2}),
    "vpp": dict(
        modules=["core_attn", "attn_proj"],
        model={"num_layers": 8},
        parallel={"pp": 2, "vpp": 2, "overlap_p2p_comm": True},
    ),
    "pp2-qkv": dict(modules=["qkv_linear"], model={"num_layers": 4}, parallel={"pp": 2}),
    # fc1's output [T, 2 f_e] at f_e 384 makes the backward's peak fall where the traced
    # (warm-up) micro-batch had reloaded moe_act's input on demand: left out of the backward
    # excess, or the replay counts it beside the slot.
    "moe": dict(
        modules=["mlp_norm", "expert_fc1", "moe_act"],
        model={**MOE, "moe_ffn_hidden_size": 384},
        implementation={"moe_grouped_gemm": True},
        training={"global_batch_size": 4},
    ),
}
# megatron-core 0.19's activation_offload_fraction on some of them: {name: (case, fraction)}.
FRACTIONS = {"pp2-quarter": ("pp2", 0.25), "vpp-half": ("vpp", 0.5), "moe-half": ("moe", 0.5)}
_TRACES: dict = {}


def traces(case, offload: bool, real: bool):
    """RoleTraces of every role (cached: the tests below share them), and, with `real`, the
    bytes megatron-core's manager moved in the recorded (steady-state) iteration per role."""
    key = (case, offload, real)
    if key not in _TRACES:
        import metatrace.tracing.iteration as iteration
        from metatrace.hooks.offload import OffloadLog

        base, fraction = FRACTIONS.get(case, (case, None))
        if fraction is not None and not offload:
            return traces(base, offload, real)
        spec = dict(CASES[base])
        if fraction is not None:
            training = spec.get("training", {})
            spec["training"] = {**training, "activation_offload_fraction": fraction}
        modules = spec.pop("modules")
        job = offload_job(modules if offload else None, **spec)
        world = World.from_job(job)
        out = []
        run = iteration.run_iteration
        for role in world.roles():
            logs = []

            def logged(*args, logs=logs, **kwargs):
                with OffloadLog() as log:
                    run(*args, **kwargs)
                logs.append(sum(m.bytes for m in log.moved))

            iteration.run_iteration = logged
            try:
                out.append((trace_role(job, world, role, real_steps=real), logs[-1:]))
            finally:
                iteration.run_iteration = run
        _TRACES[key] = (job, world, out)
    return _TRACES[key]


def peaks(case, offload, real):
    job, _, roles = traces(case, offload, real)
    out = []
    for rt, _ in roles:
        if real:
            it = rt.iteration
            out.append(
                max(e.live for e in it.memory)
                - it.static_parts.get("existing", 0)
                + persistent_bytes(rt.trace)
            )
        else:
            out.append(role_memory(rt.trace, rt.iteration).peak)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_replay_matches_the_offload_manager_running_every_step(case):
    """The replay (the traced warm-up micro-batch's steps, reloads left out of the backward
    excess, plus the steady state's slot) against megatron-core's manager running the model in
    every step of a steady-state iteration: offloading changes both peaks by exactly the same
    bytes (the replay and the real steps differ by the same few blocks with and without it:
    small tensors of megatron-core's backward_step, MoE's)."""
    replay, real = peaks(case, True, False), peaks(case, True, True)
    replay0, real0 = peaks(case, False, False), peaks(case, False, True)
    for stage, (p, m, p0, m0) in enumerate(zip(replay, real, replay0, real0)):
        assert p - p0 == m - m0, (stage, p - p0, m - m0)
        assert p != p0
        assert abs(p - m) <= (2 if case != "moe" else 12) * BLOCK


@pytest.mark.skipif(not SINCE_0_19, reason="activation_offload_fraction is megatron-core 0.19's")
@pytest.mark.parametrize("case", list(FRACTIONS))
def test_a_fraction_offloaded_matches_the_offload_manager_running_every_step(case):
    """megatron-core 0.19's activation_offload_fraction: the later groups of each micro-batch
    stay on the GPU from the second iteration on (post_warmup_callback). The replay (each
    micro-batch's steps as if those groups had stayed, the slot the last offloaded group of each
    module) against the manager running every step: the same change of each stage's peak (MoE:
    within one block), and the same bytes moved."""
    replay, real = peaks(case, True, False), peaks(case, True, True)
    replay0, real0 = peaks(case, False, False), peaks(case, False, True)
    full = peaks(FRACTIONS[case][0], True, False)
    for stage, (p, m, p0, m0, f) in enumerate(zip(replay, real, replay0, real0, full)):
        assert abs((p - p0) - (m - m0)) <= (0 if case != "moe-half" else BLOCK), (stage, p, m)
        assert p > f  # less offloaded, a higher peak
    job, _, replayed = traces(case, True, False)
    for (rt, _), (_, moved) in zip(replayed, traces(case, True, True)[2]):
        assert role_offload(job, rt).d2h_per_iteration == moved[0] > 0


@pytest.mark.skipif(not SINCE_0_19, reason="activation_offload_fraction is megatron-core 0.19's")
def test_a_fraction_offloaded_moves_its_closed_form():
    """pp2, fraction 0.5: four groups a micro-batch (core_attn C = 49,152 bytes, attn_proj
    P = 16,384 bytes, per layer). Stage 0: the first micro-batch to run backward keeps layer 1
    (the margin) and of the two groups left the later (int(2 x 0.5) = 1 kept), moving C; the
    other three keep int(4 x 0.5) = 2 groups, layer 1's, moving a layer each. The last stage
    moves the same: its last layer stays in every micro-batch anyway."""
    job = offload_job(
        ["core_attn", "attn_proj"],
        model={"num_layers": 4},
        parallel={"pp": 2},
        training={"activation_offload_fraction": 0.5},
    )
    world = World.from_job(job)
    c = 2 * N * A * D * 2 + 2 * N * G * D * 2
    for role in world.roles():
        summary = role_offload(job, trace_role(job, world, role))
        assert summary.d2h_per_microbatch == LAYER
        assert summary.d2h_per_iteration == 3 * LAYER + c


@pytest.mark.skipif(SINCE_0_19, reason="megatron-core 0.19 has activation_offload_fraction")
def test_a_fraction_offloaded_is_refused_before_0_19():
    from metatrace.tracing.checks import check_with_megatron

    job = offload_job(["core_attn"], training={"activation_offload_fraction": 0.5})
    with pytest.raises(ConfigError, match="activation_offload_fraction: 0.5 needs megatron-core"):
        check_with_megatron(job)


# Stage 0 / stage 1 of pp2 (2 layers a stage, 4 micro-batches): a layer moves
# D = q, out [s, b, a, d] + k, v [s, b, g, d] + the projection input [N, a d] = 65,536 bytes.
LAYER = 2 * N * A * D * 2 + 2 * N * G * D * 2 + 2 * N * A * D


def test_pcie_traffic_and_pinned_host_memory_in_closed_form():
    job, _, roles = traces("pp2", True, False)
    first, last = (role_offload(job, rt) for rt, _ in roles)
    m, layers = job.num_microbatches, 2
    # Every micro-batch moves both layers; the steady state keeps the last layer of the first
    # micro-batch to run backward on the GPU.
    assert first.d2h_per_microbatch == layers * LAYER
    assert first.d2h_per_iteration == m * layers * LAYER - LAYER
    # The last stage keeps its last layer in every micro-batch (its backward follows at once).
    assert last.d2h_per_microbatch == (layers - 1) * LAYER
    assert last.d2h_per_iteration == m * (layers - 1) * LAYER
    # Pinned buffers for the micro-batches in flight in the warm-up iteration (pp - stage).
    assert first.pinned_host == 2 * layers * LAYER
    assert last.pinned_host == 1 * layers * LAYER


@pytest.mark.parametrize("case", ["pp2", "vpp", "moe"])
def test_traffic_per_iteration_is_what_the_manager_moves_in_the_steady_state(case):
    job, _, replayed = traces(case, True, False)
    _, _, real = traces(case, True, True)
    for (rt, _), (_, moved) in zip(replayed, real):
        assert role_offload(job, rt).d2h_per_iteration == moved[0] > 0


def test_report_and_terminal_show_the_offload_figures():
    from rich.console import Console

    from metatrace.analysis.analyze import analyze
    from metatrace.export.report import job_report
    from metatrace.render.run import build_offload_lines

    job, world, roles = traces("pp2", True, False)
    job_trace = JobTrace(job=job, world=world, roles=tuple(rt for rt, _ in roles), full=None)
    analysis = analyze(job_trace)
    report = json.loads(json.dumps(job_report(analysis)))
    assert report["roles"][0]["offload"] == {
        "d2h_bytes_per_microbatch": 2 * LAYER,
        "d2h_bytes_per_iteration": 7 * LAYER,
        "pinned_host_bytes": 4 * LAYER,
    }
    from importlib import resources

    import jsonschema

    schema = json.loads(
        resources.files("metatrace.export").joinpath("report.schema.json").read_text()
    )
    jsonschema.validate(report, schema, cls=jsonschema.Draft202012Validator)
    console = Console(width=200, record=True, color_system=None)
    for line in build_offload_lines(analysis):
        console.print(line)
    text = console.export_text()
    assert "Activation offloading (core_attn, attn_proj)" in text
    assert "stage 0 0.125 MiB per micro-batch, 0.438 MiB per iteration, 0.250 MiB pinned" in text
    _, _, plain = traces("pp2", False, False)
    plain_trace = JobTrace(job=job, world=world, roles=tuple(rt for rt, _ in plain), full=None)
    assert build_offload_lines(analyze(plain_trace)) == []


def test_measure_sees_the_same_saved_activations_on_cpu_tensors():
    """`metatrace measure` runs the offload manager on real CPU tensors (the stand-ins keep a
    record instead of a host copy) and counts saved tensors with its own hooks, which the
    manager's hide too."""
    import torch

    from metatrace.tracing.measure import measure_rank, predict

    torch.set_num_threads(1)
    job = offload_job(
        ["core_attn", "attn_proj"],
        training={"global_batch_size": 4},
        implementation={"transformer_impl": "local"},
    )
    predicted, measured = predict(job, 0), measure_rank(job, 0, iterations=2)
    assert measured.saved_blocks == predicted.saved > 0
    peak = predicted.peak - predicted.cuda_only
    assert abs(peak - measured.peak_blocks) <= 0.01 * measured.peak_blocks


@pytest.mark.parametrize(
    "training, sections, message",
    [
        (
            {"recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}},
            {},
            "with full recompute",
        ),
        (
            {"activation_offload_modules": ["attn_proj"]},
            {},
            "attn_proj cannot be set to offload_modules alone",
        ),
    ],
    ids=["full-recompute", "attn_proj-alone"],
)
def test_what_cannot_run_is_refused(training, sections, message):
    training = {
        "activation_offload_modules": ["core_attn"],
        "min_offloaded_tensor_size": 1024,
        **training,
    }
    from metatrace.tracing.checks import check_with_megatron

    with pytest.raises(ConfigError, match=message):  # the job's rules, or megatron-core's
        check_with_megatron(small_job(training=training, **sections))


@pytest.mark.parametrize(
    "case", ["pp2", "vpp"] + ([*FRACTIONS] if SINCE_0_19 else []), ids=lambda c: c
)
def test_the_allocator_simulation_reaches_the_replayed_peak(case):
    """The caching allocator's simulation (analysis.device) replays each step as the traced
    micro-batch ran it: with offloading, as the steady micro-batches run it (the groups kept by
    the fraction, memory.steady_microbatches) beside the offload slot, an allocation of its own.
    Its allocated peak is the replay's within the blocks' rounding, as without offloading
    (tests/tracing/test_snapshot.py)."""
    from metatrace.analysis.device import role_allocations, simulate
    from metatrace.config.allocator import AllocatorConfig

    job, _, roles = traces(case, True, False)
    for rt, _ in roles:
        reserve = simulate(role_allocations(job, rt), AllocatorConfig())
        assert reserve.allocated == pytest.approx(
            role_memory(rt.trace, rt.iteration).peak, rel=0.002
        )
