"""implementation.te_op_fuser: megatron-core's TEFusedMLP over Transformer Engine's operation
fuser (models/te_fused_mlp.py) against the unfused TE MLP and closed forms: what a dense MLP
saves, the TP / SP collectives it issues, its FLOPs, and under FP8 the quantized weight copies
it keeps per micro-batch instead of the modules' persistent FP8 workspaces (the checks are in
tests/unit/test_te_fused_mlp.py)."""

import pytest

from metatrace.analysis import aggregate as agg
from metatrace.analysis.memory import persistent_bytes, step_profiles
from metatrace.tracing.trace import trace_job
from tests.helpers import small_job

S, B, H, A, F = 256, 2, 128, 8, 192  # sequence, micro-batch, hidden, heads, ffn (SwiGLU)
N = S * B  # tokens per rank
LAYERS = 3


def rnd(nbytes: int) -> int:
    """The caching allocator's 512-byte blocks."""
    return -(-nbytes // 512) * 512


def trace(fuser: bool, **sections):
    job = small_job(
        model={
            "num_layers": LAYERS,
            "hidden_size": H,
            "num_attention_heads": A,
            "ffn_hidden_size": F,
            **sections.pop("model", {}),
        },
        training={"seq_length": S, "micro_batch_size": B, **sections.pop("training", {})},
        implementation={"te_op_fuser": fuser},
        **sections,
    )
    return trace_job(job, full_model=False).roles[0].trace


def mlp_saved(t, layer: int = 1) -> int:
    """Bytes the MLP of decoder layer `layer` keeps for backward (its own modules' saves)."""
    prefix = f"decoder.layers.{layer}.mlp"
    return sum(b for m, b in agg.activation_owners(t).values() if m.startswith(prefix))


def mlp_collectives(t, layer: int = 1) -> list:
    prefix = f"decoder.layers.{layer}.mlp"
    return [(c.op, c.phase, c.bytes) for c in t.collectives if c.module.startswith(prefix)]


def window_flops(t) -> dict:
    out = {}
    for w in t.windows:
        if w.phase in ("forward", "backward"):
            total, fp8 = out.get(w.phase, (0, 0))
            out[w.phase] = (total + w.flops, fp8 + w.fp8_flops)
    return out


# ---------------------------------------------------------------------------- bf16


@pytest.mark.parametrize(
    "t, sp, gaf", [(1, False, True), (2, True, True), (2, False, True), (2, True, False)]
)
def test_bf16_saves_issues_and_computes_what_the_unfused_mlp_does(t, sp, gaf):
    sections = dict(
        parallel={"tp": t, "sequence_parallel": sp}, training={"gradient_accumulation_fusion": gaf}
    )
    unfused, fused = trace(False, **sections), trace(True, **sections)
    assert {m.type for m in fused.modules if m.fqn.endswith(".mlp")} == {"TEFusedMLP"}
    ns = N // t if sp else N
    # x and the norm output [Ns, h], rstd [Ns] fp32, the fc1 output [N, 2f/t], fc2's input
    closed = 2 * rnd(2 * ns * H) + rnd(4 * ns) + rnd(4 * N * F // t) + rnd(2 * N * F // t)
    assert mlp_saved(fused) == mlp_saved(unfused) == closed
    assert step_profiles(fused)[("forward", 0)].held == step_profiles(unfused)[("forward", 0)].held
    full = N * H * 2  # every MLP collective moves a whole [N, h] bf16 tensor
    expected = {
        (1, False): [],
        (2, True): [
            ("all_gather", "forward", full),
            ("reduce_scatter", "forward", full),
            ("all_gather", "backward", full),
            ("all_gather", "backward", full),
            ("reduce_scatter", "backward", full),
        ],
        (2, False): [("all_reduce", "forward", full), ("all_reduce", "backward", full)],
    }[(t, sp)]
    assert mlp_collectives(fused) == mlp_collectives(unfused) == expected
    assert window_flops(fused) == window_flops(unfused)
    # and the MLP's share, by the GEMMs: forward 2N h 2f/t + 2N f/t h, backward twice that
    mlp_forward = 6 * N * H * F // t
    dense = trace(False, model={"ffn_hidden_size": F // 2}, **sections)
    assert window_flops(fused)["forward"][0] - window_flops(dense)["forward"][0] == (
        LAYERS * mlp_forward // 2
    )
    assert window_flops(fused)["backward"][0] - window_flops(dense)["backward"][0] == (
        LAYERS * mlp_forward
    )


def mlp_backward_excess(t, layer: int = 1) -> int:
    """Highest bytes the MLP's own backward allocates above what it started with."""
    prefix, live, top = f"decoder.layers.{layer}.mlp", 0, 0
    for e in t.memory:
        if e.phase == "backward" and e.module.startswith(prefix):
            live += e.delta
            top = max(top, live)
    return top


@pytest.mark.parametrize("gaf", [True, False])
def test_backward_clears_saved_inputs_and_returns_weight_gradients_at_the_end(gaf):
    """tp 1: fc2's dgrad [N, f] is allocated, the activation output it kept is cleared, then
    dact's output [N, 2f] is allocated: 4Nf at the top. Without gradient-accumulation fusion
    fc2's weight gradient [h, f] is still there, handed back only when the MLP backward ends."""
    fused = trace(True, training={"gradient_accumulation_fusion": gaf})
    assert mlp_backward_excess(fused) == 4 * N * F + (0 if gaf else 2 * H * F)


@pytest.mark.parametrize(
    "activation, difference",
    [
        ("gelu", 0),
        ("silu", 0),
        # F.relu keeps only its output (fc2's input); TE's ReLU op keeps its input as well
        ("relu", 2 * N * F),
        # megatron-core's eager GEGLU keeps gelu(a) and b + glu_linear_offset; TE's GEGLU op neither
        ("geglu", -4 * N * F),
    ],
)
def test_activation_ops_save_their_input(activation, difference):
    model = {"activation": activation}
    assert mlp_saved(trace(True, model=model)) - mlp_saved(trace(False, model=model)) == difference


def test_only_dense_mlps_are_fused():
    moe = {
        "num_experts": 4,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 96,
        "moe_shared_expert_intermediate_size": 96,
        "moe_layer_freq": [0, 1, 1],
    }
    types = {m.fqn: m.type for m in trace(True, model=moe).modules}
    assert types["decoder.layers.0.mlp"] == "TEFusedMLP"
    assert types["decoder.layers.1.mlp"] == "MoELayer"
    assert types["decoder.layers.1.mlp.shared_experts"] == "SharedExpertMLP"
    assert types["decoder.layers.1.mlp.shared_experts.linear_fc1"] == "TEColumnParallelLinear"


# ---------------------------------------------------------------------------- FP8


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def up(a: int, b: int) -> int:
    return cdiv(a, b) * b


MATRICES = lambda t: ((2 * F // t, H), (H, F // t))


def weight_copies(recipe: str, gpu: str, t: int) -> int:
    """Bytes of the column-wise FP8 copies of fc1 [2f/t, h] and fc2 [h, f/t] one micro-batch
    keeps (te_fp8's layouts: 1 B per element, plus scales)."""
    out = 0
    for m, k in MATRICES(t):
        if recipe in ("delayed", "tensorwise"):  # the transpose (Blackwell: the data) + scale_inv
            out += rnd(m * k) + rnd(4)
        elif recipe == "mxfp8":  # data [M, K] + E8M0 scales [rnd(M/32, 4), rnd(K, 128)]
            out += rnd(m * k) + rnd(up(cdiv(m, 32), 4) * up(k, 128))
        else:  # blockwise 128x128: data [K, M] + fp32 scales [K/128, rnd(M/128, 4)]
            out += rnd(m * k) + rnd(4 * cdiv(k, 128) * up(cdiv(m, 128), 4))
    return out


def weight_workspaces(recipe: str, gpu: str, t: int) -> int:
    """Bytes of the persistent FP8 weights the unfused fc1 and fc2 keep (both usages), and the
    scaling state they keep beyond the fuser's two BasicLinear ops (current scaling: a scale and
    an amax for 5 quantizers per module against 3 per op)."""
    out = 0
    for m, k in MATRICES(t):
        if recipe in ("delayed", "tensorwise"):
            out += rnd(m * k) * (1 if gpu == "b200" else 2) + rnd(4)
        elif recipe == "mxfp8":
            out += 2 * rnd(m * k) + rnd(up(m, 128) * up(cdiv(k, 32), 4))
            out += rnd(up(cdiv(m, 32), 4) * up(k, 128))
        else:
            out += 2 * rnd(m * k) + rnd(4 * cdiv(m, 128) * up(cdiv(k, 128), 4))
            out += rnd(4 * cdiv(k, 128) * up(cdiv(m, 128), 4))
    return out + (2 * 4 * rnd(4) if recipe == "tensorwise" else 0)


@pytest.mark.parametrize(
    "recipe, gpu, t, sp",
    [
        ("delayed", "h100", 1, False),
        ("delayed", "h100", 2, True),
        ("tensorwise", "h100", 2, False),
        ("mxfp8", "b200", 1, False),
        ("mxfp8", "b200", 2, True),
        ("blockwise", "h100", 1, False),
        ("delayed", "b200", 2, True),
    ],
)
def test_fp8_keeps_a_quantized_weight_copy_per_microbatch(recipe, gpu, t, sp):
    sections = dict(
        parallel={"tp": t, "sequence_parallel": sp},
        cluster={"gpu": gpu},
        training={"precision": "fp8", "fp8_recipe": recipe},
    )
    unfused, fused = trace(False, **sections), trace(True, **sections)
    copies = weight_copies(recipe, gpu, t)
    # Under SP, Float8 on Hopper keeps the norm output's transpose beside the row-wise data it
    # gathers: the fuser sets both usages before the norm runs.
    float8_hopper = gpu == "h100" and recipe in ("delayed", "tensorwise")
    transpose = rnd(N // t * H) if sp and float8_hopper else 0
    assert mlp_saved(fused) - mlp_saved(unfused) == copies + transpose
    # what a forward step holds: the iteration replay keeps it per micro-batch in flight
    held = step_profiles(fused)[("forward", 0)].held - step_profiles(unfused)[("forward", 0)].held
    assert held == LAYERS * (copies + transpose)
    # ... and no persistent FP8 weight per module
    assert persistent_bytes(unfused) - persistent_bytes(fused) == LAYERS * weight_workspaces(
        recipe, gpu, t
    )
    assert window_flops(fused) == window_flops(unfused)  # the same FP8 GEMMs
    if sp:  # fc2 has no TP mode: the ReduceScatter op gathers the output gradient in bf16

        def gathers(tr):
            return [c for c in mlp_collectives(tr) if c[:2] == ("all_gather", "backward")]

        assert gathers(fused)[0] == ("all_gather", "backward", N * H * 2)
        assert gathers(unfused)[0][2] != N * H * 2  # the unfused row-parallel Linear: in FP8


def test_fp8_parameters_need_no_copy():
    sections = dict(
        training={"precision": "fp8", "fp8_param_gather": True, "distributed_optimizer": True}
    )
    assert mlp_saved(trace(True, **sections)) == mlp_saved(trace(False, **sections))
