"""CUDA graphs (training.cuda_graph_impl): the static buffers beside the eager run's memory
(metatrace.tracing.graphs), in closed form from megatron-core 0.16.1 (TECudaGraphHelper,
full_cuda_graph.py) and Transformer Engine 2.8 (make_graphed_callables).

Debug preset: h 64, 4 heads of 16 (RoPE over all 16), seq s 64, micro-batch b 2; tp 2 with
sequence parallelism (s' = 32), pp 2, dp 2 on 8 GPUs, global batch 16: M = 4 micro-batches."""

import pytest

from metatrace.analysis.memory import role_memory
from metatrace.errors import ConfigError
from metatrace.hooks import guards
from metatrace.tracing.trace import trace_job, trace_role
from metatrace.world import World
from tests.helpers import BALANCED, MOE, small_job

BLOCK = 512
S, B, H, D, M = 64, 2, 64, 16, 4
X = (S // 2) * B * H * 2  # the hidden states [s', b, h] in bf16
MASK = B * S * S  # bool [b, 1, s, s]
ROPE = S * D * 4  # fp32 [s, 1, 1, d]


def rounded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def graph_job(layers=4, vpp=None, **training):
    return small_job(
        model={"num_layers": layers},
        parallel={"tp": 2, "pp": 2, "sequence_parallel": True, "vpp": vpp},
        training={"global_batch_size": 16, **training},
        cluster={"num_gpus": 8, "gpus_per_node": 8},
    )


def workspaces(job) -> dict[int, int]:
    """{pipeline stage: workspace bytes} (the kept buffers, the static ones among them)."""
    world = World.from_job(job)
    out = {}
    for role in world.roles():
        rt = trace_role(job, world, role)
        out[role.pp_stage] = role_memory(rt.trace, rt.iteration).workspaces
    return out


@pytest.fixture(scope="module")
def eager():
    return {vpp: workspaces(graph_job(4 * (vpp or 1), vpp)) for vpp in (None, 2)}


def test_te_layer_graphs_keep_a_static_input_per_layer_forward_in_flight(eager):
    # 1F1B: stage r has min(p - r, M) micro-batches in flight, 2 layers each; every static
    # input is the hidden states and the causal mask; one rotary table, one output gradient.
    got = workspaces(graph_job(cuda_graph_impl="transformer_engine"))
    for stage, inflight in ((0, 2), (1, 1)):
        sets = 2 * inflight
        want = sets * (X + rounded(MASK)) + rounded(ROPE) + X
        assert got[stage] - eager[None][stage] == want


def test_te_mlp_scope_has_no_mask_or_rotary_table(eager):
    got = workspaces(graph_job(cuda_graph_impl="transformer_engine", cuda_graph_scope=["mlp"]))
    for stage, inflight in ((0, 2), (1, 1)):
        assert got[stage] - eager[None][stage] == 2 * inflight * X + X


def test_te_graphs_follow_the_interleaved_schedule(eager):
    # Interleaved, v = 2 chunks of 2 layers: warm-up W = 2 (p - r - 1) + (v - 1) g with
    # g = p = 2 chunk-forwards, W + 1 in flight at most: stage 0 5, stage 1 3.
    got = workspaces(graph_job(8, 2, cuda_graph_impl="transformer_engine"))
    for stage, inflight in ((0, 5), (1, 3)):
        want = 2 * inflight * (X + rounded(MASK)) + rounded(ROPE) + X
        assert got[stage] - eager[2][stage] == want


def test_local_layer_graphs_keep_every_runner_output(eager):
    # megatron-core's per-layer local graphs with pipelining: a runner per (layer, micro-batch),
    # each holding its output, 2 x M = 8 per stage, where eager mode holds, at most, 2 outputs:
    # stage 0 has 2 micro-batches in flight and frees the one it sends (1 each), stage 1 one
    # with both. The attention mask of each of the M micro-batches on the stages that read
    # data, the chunk's one rotary table, and one pooled buffer for the chunk's input and
    # output gradient.
    got = workspaces(graph_job(cuda_graph_impl="local"))
    for stage in (0, 1):
        want = (8 - 2) * X + M * rounded(MASK) + rounded(ROPE) + X
        assert got[stage] - eager[None][stage] == want


def test_local_layer_graphs_follow_the_interleaved_schedule(eager):
    # 2 chunks x 2 layers x M runners = 16 outputs. Stage 0 sends both chunks' outputs: 5
    # chunk-forwards in flight hold 1 each. Stage 1, forwards c0 c0 then c1 with its backward:
    # c0, c0, c1 in flight hold 1 + 1 + 2. Masks only on the first chunk of stage 0 and the
    # last chunk of stage 1 (the middle chunks get no batch); a rotary table per chunk.
    got = workspaces(graph_job(8, 2, cuda_graph_impl="local"))
    for stage, held in ((0, 5), (1, 4)):
        want = (16 - held) * X + M * rounded(MASK) + 2 * rounded(ROPE) + X
        assert got[stage] - eager[2][stage] == want


def test_local_layer_graphs_without_pipelining_reuse_one_runner_per_layer():
    # pp 1: runners are reused, only the first micro-batch is captured, and its outputs are
    # what eager mode holds too: one mask, one rotary table, one pooled buffer are left.
    def job(**training):
        return small_job(
            model={"num_layers": 4},
            parallel={"tp": 2, "sequence_parallel": True},
            training={"global_batch_size": 16, **training},
            cluster={"num_gpus": 4, "gpus_per_node": 4},
        )

    assert workspaces(job(cuda_graph_impl="local"))[0] - workspaces(job())[0] == (
        rounded(MASK) + rounded(ROPE) + X
    )


def test_local_layer_graphs_turn_output_discarding_recompute_off():
    # megatron-core 0.16.1 never clears its graph warm-up flag: CheckpointWithoutOutput stops
    # discarding (layernorm, moe_act, mla_up_proj); core_attn recompute stays.
    rec = {"granularity": "selective", "modules": ["core_attn", "layernorm"]}
    job = small_job(training={"cuda_graph_impl": "local", "recompute": rec})
    assert job.training.recompute.modules == ["core_attn"]
    assert any("layernorm is off" in n for n in job.notes)
    rec = {"granularity": "selective", "modules": ["layernorm"]}
    job = small_job(training={"cuda_graph_impl": "local", "recompute": rec})
    assert job.training.recompute.granularity is None
    whole = {"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]}
    assert small_job(training={**whole, "recompute": rec}).training.recompute.modules == [
        "layernorm"
    ]


def test_full_iteration_graph_keeps_every_micro_batch_of_the_batch(eager):
    # StaticBufferLoader: M copies of the data loader's dict on the ranks that read data
    # (tensor-parallel rank 0 of both stages here): tokens, labels, positions int64 [b, s],
    # loss mask fp32, attention mask bool [b, 1, s, s]; eager mode holds them per micro-batch.
    job = graph_job(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"])
    got = workspaces(job)
    batch = 3 * rounded(B * S * 8) + rounded(B * S * 4) + rounded(MASK)
    for stage in (0, 1):
        assert got[stage] - eager[None][stage] == M * batch


@pytest.mark.parametrize(
    "training, implementation, message",
    [
        ({"cuda_graph_impl": "local"}, {"transformer_impl": "local"}, "per layer without"),
        ({"cuda_graph_impl": "transformer_engine"}, {"transformer_impl": "local"}, "needs"),
    ],
)
def test_what_is_refused(training, implementation, message):
    with pytest.raises(ConfigError, match=message):
        small_job(training=training, implementation=implementation)


def test_a_moe_scope_without_graphs_is_refused():
    """megatron-core reads the MoE layer's scopes without an implementation (the router's
    pre-MLP norm recompute, the EP overlap's dispatch input): not an idle key there."""
    with pytest.raises(ConfigError, match="needs training.cuda_graph_impl"):
        small_job(model=MOE, training={"cuda_graph_scope": ["moe_router"]})
    assert small_job(training={"cuda_graph_scope": ["attn"]}).training.cuda_graph_scope is None


def test_whole_moe_layers_are_captured_with_drop_and_pad_only():
    te = {"transformer_impl": "transformer_engine"}
    graphs = {"cuda_graph_impl": "transformer_engine"}
    with pytest.raises(ConfigError, match="over whole MoE layers needs"):
        small_job(model=MOE, training=graphs, implementation=te)
    padded = {**graphs, "moe_routing": "capacity", "moe_expert_capacity_factor": 1.0}
    assert (
        small_job(model=MOE, training=padded, implementation=te).training.cuda_graph_scope is None
    )
    with pytest.raises(ConfigError, match="mixture-of-experts model is not modelled yet"):
        small_job(model=MOE, training={"cuda_graph_impl": "local"}, implementation=te)


@pytest.mark.parametrize(
    "training, message",
    [
        ({"recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}}, "full"),
        ({"cpu_offloading_num_layers": 1}, "CPU offloading"),
    ],
)
def test_megatron_core_refuses(training, message):
    from metatrace.tracing.checks import check_with_megatron

    job = small_job(training={"cuda_graph_impl": "transformer_engine", **training})
    with pytest.raises(ConfigError, match=message):
        check_with_megatron(job)


# --------------------------------------------------------------------------- MoE layers

E, K = 4, 2  # experts, top-k (tests.helpers.MOE)
T = (S // 2) * B  # tokens a rank routes (sequence parallel)
PROBS = rounded(T * E * 2)  # the router's probabilities [T, E], bf16 (no moe_router_dtype)


def moe_job(scope=None, shared=False):
    training = {"global_batch_size": 16, **BALANCED}
    if scope is not None:
        training.update(cuda_graph_impl="transformer_engine", cuda_graph_scope=scope)
    experts = {"moe_shared_expert_intermediate_size": 64} if shared else {}
    return small_job(
        model={**MOE, "num_layers": 4, **experts},
        parallel={
            "tp": 2,
            "pp": 2,
            "ep": 2,
            "sequence_parallel": True,
            "moe_token_dispatcher_type": "alltoall",
        },
        training=training,
        implementation={"transformer_impl": "transformer_engine", "moe_grouped_gemm": True},
        cluster={"num_gpus": 8, "gpus_per_node": 8},
    )


@pytest.fixture(scope="module")
def moe_eager():
    return workspaces(moe_job())


@pytest.mark.parametrize(
    "scope, gradients",
    [
        # The attention part: as a dense layer's, the layer output's gradient buffer.
        (["attn"], X),
        # With the router: the graph returns the MoE input [s', b, h], the probabilities and
        # the routing map (bool, no gradient), and the residual: one buffer each but the map's.
        (["attn", "moe_router"], X + PROBS + X),
        # With the preprocessing (the alltoall dispatcher's permutation): the permuted tokens
        # [T k, h] and probabilities [T k] (bf16), the dispatcher's counts and maps (no
        # gradient; 0.19's cudagraph_attrs add its probabilities [T, E]), the residual.
        (["attn", "moe_router", "moe_preprocess"], rounded(T * K * H * 2) + rounded(T * K * 2) + X),
    ],
)
def test_te_moe_graphs_keep_a_gradient_per_output_of_their_signature(moe_eager, scope, gradients):
    if "moe_preprocess" in scope and guards.since(0, 19):
        gradients += PROBS
    got = workspaces(moe_job(scope))
    for stage, inflight in ((0, 2), (1, 1)):
        sets = 2 * inflight  # static inputs: hidden states and mask per layer-forward in flight
        want = sets * (X + rounded(MASK)) + rounded(ROPE) + gradients
        assert got[stage] - moe_eager[stage] == want


def test_te_moe_router_graphs_return_the_shared_experts_output():
    """Shared experts not overlapped run inside the router graph: their output [s', b, h] is
    one more output, one more gradient buffer."""
    eager = workspaces(moe_job(shared=True))
    got = workspaces(moe_job(["attn", "moe_router"], shared=True))
    for stage, inflight in ((0, 2), (1, 1)):
        want = 2 * inflight * (X + rounded(MASK)) + rounded(ROPE) + X + PROBS + X + X
        assert got[stage] - eager[stage] == want


def test_te_moe_graphs_launch_their_parts_once():
    """The host issues nothing of what the router graphs capture: the same kernels on the GPU,
    less host work; the preprocessing is recorded as a module of its own."""
    eager = trace_job(moe_job(), full_model=False).roles[0].trace
    graphed = (
        trace_job(moe_job(["attn", "moe_router", "moe_preprocess"]), full_model=False)
        .roles[0]
        .trace
    )

    def totals(trace):
        steps = [w for w in trace.windows if w.phase in ("forward", "backward")]
        return [sum(getattr(w, f) for w in steps) for f in ("kernels", "kernel_ps", "syncs")]

    assert totals(graphed) == totals(eager)
    host = [sum(w.host_ps for w in t.windows) for t in (eager, graphed)]
    assert host[1] < host[0]
    modules = {s.module for s in graphed.saved}
    assert "decoder.layers.0.mlp.preprocess" in modules
    assert "decoder.layers.0.mlp.preprocess" not in {s.module for s in eager.saved}


def test_te_mamba_graphs_keep_a_static_input_per_mamba_layer():
    """A hybrid stack M*M- (two Mamba layers, an attention layer, an MLP layer) without
    pipelining: one capture per graphed layer, its hidden states [s/tp, b, h] as the static input
    (the attention layer's also its causal mask), one gradient buffer for the layers' output;
    the Mamba layers' work launches with their graphs."""
    from metatrace.config import job_from_dict
    from tests.tracing.test_hybrid import HYBRID

    seq, mbs, hidden = 256, 2, 256
    x = (seq // 2) * mbs * hidden * 2
    mask = mbs * seq * seq

    def job(scope=None):
        training = {"seq_length": seq, "micro_batch_size": mbs, "global_batch_size": 4 * mbs}
        if scope:
            training.update(cuda_graph_impl="transformer_engine", cuda_graph_scope=scope)
        return job_from_dict(
            {
                "model": {**HYBRID, "hybrid_layer_pattern": "M*M-", "hidden_size": hidden},
                "parallel": {"tp": 2, "sequence_parallel": True},
                "training": training,
                "cluster": {"num_gpus": 4},
            }
        )

    def traced(scope=None):
        rt = trace_job(job(scope), full_model=False).roles[0]
        steps = [w for w in rt.trace.windows if w.phase in ("forward", "backward")]
        return role_memory(rt.trace, rt.iteration).workspaces, sum(w.host_ps for w in steps)

    eager, eager_host = traced()
    for scope, want in ((["mamba"], 2 * x + x), (["attn", "mamba"], 3 * x + mask + x)):
        workspaces, host = traced(scope)
        assert workspaces - eager == want
        assert host < eager_host
