"""Mixture of experts: published parameter counts, token-dispatch traffic against closed forms
under the balanced-routing assumption, expert-parallel sharding of the optimizer (the config
checks are in tests/unit/test_moe.py)."""

import pytest

from metatrace.analysis import aggregate as agg
from metatrace.analysis.comm import job_comm
from metatrace.analysis.memory import role_memory
from metatrace.config import release
from metatrace.tracing.trace import trace_job
from tests.helpers import BALANCED, MOE, assert_meta_matches_real, small_job

H, S, B = 64, 64, 2  # the debug preset's hidden size; the tests' sequence and micro-batch
BF16, FP32 = 2, 4


def moe_job(model=None, parallel=None, training=None, **sections):
    return small_job(
        model={**MOE, **(model or {})},
        parallel=parallel or {},
        training={"global_batch_size": 4, **BALANCED, **(training or {})},
        **sections,
    )


def merged(*parts):
    out: dict = {}
    for part in parts:
        for name, values in part.items():
            out[name] = {**out.get(name, {}), **values}
    return out


@pytest.mark.parametrize(
    "preset, layout, total, active",
    [
        # Mixtral 8x7B: "46.7B total parameters, 12.9B active" (Mistral AI, mistral.ai/news/
        # mixtral-of-experts); exactly 46,702,792,704 from its config.json (32 layers of 8
        # SwiGLU experts 4096 -> 14336, GQA 32/8 heads, untied 32000 vocabulary).
        ("mixtral-8x7b", {"pp": 4, "ep": 8}, 46_702_792_704, 12_879_925_248),
        # Qwen3-30B-A3B: "30.5B total, 3.3B activated" (Qwen/Qwen3-30B-A3B model card): 48 layers
        # of 128 experts 2048 -> 768, top 8, QK norm, untied 151936 vocabulary.
        ("qwen3-30b-a3b", {"pp": 4, "ep": 8}, 30_532_122_624, 3_353_032_704),
        # Qwen3-235B-A22B: "235B in total and 22B activated" (Qwen/Qwen3-235B-A22B model
        # card): 94 layers of 128 experts 4096 -> 1536, top 8, 64 query heads and 4 KV heads of
        # 128, QK norm, untied 151936 vocabulary.
        ("qwen3-235b-a22b", {"pp": 2, "ep": 8}, 235_093_634_560, 22_190_763_520),
    ],
)
def test_moe_preset_totals_are_the_published_counts(preset, layout, total, active):
    job = small_job(
        model={"preset": preset},
        parallel=layout,
        training={"seq_length": 64, "micro_batch_size": 1, "global_batch_size": 8},
        implementation={"moe_grouped_gemm": True},
        cluster={"num_gpus": layout["pp"] * layout["ep"]},
    )
    traces = [rt.trace for rt in trace_job(job, full_model=False).roles]
    m, par = job.model, job.parallel
    assert agg.model_params(traces, par.tp, par.ep, par.etp) == total
    share = m.moe_router_topk / m.num_experts
    assert agg.model_params(traces, par.tp, par.ep, par.etp, expert_share=share) == active


def ep_items(job):
    ((rt, comm),) = job_comm(trace_job(job, full_model=False, workers=1)).roles
    return [it for it in comm.items if it.dimension == "ep" and it.layers]


def per_layer(items, op, phase, message):
    """Calls per layer and micro-batch of `op` with this message size."""
    return sum(it.count for it in items if (it.op, it.phase, it.message) == (op, phase, message))


@pytest.mark.parametrize("tp", [1, 2])
def test_alltoall_dispatch_bytes_are_the_closed_form(tp):
    # Balanced routing, alltoall dispatcher, ep 4: per MoE layer and micro-batch a rank holds
    # T = s·b/tp tokens (sequence parallel shards them), sends its T·k routed copies of
    # [h] bf16 to the experts' ranks (dispatch) and gets them back (combine); each all-to-all
    # moves T·k·h·2 bytes, of which (ep-1)/ep leave the rank. Backward runs the same two
    # transposed. The routing probabilities [T·k] travel with the dispatch (and back).
    ep = 4
    job = moe_job(
        parallel={
            "tp": tp,
            "ep": ep,
            "sequence_parallel": tp > 1,
            "moe_token_dispatcher_type": "alltoall",
        },
        training={"global_batch_size": 2 * B * ep},
        cluster={"num_gpus": tp * ep},
    )
    m, layers, k = job.num_microbatches, 2, MOE["moe_router_topk"]
    tokens = S * B // tp
    hidden = tokens * k * H * BF16
    items = ep_items(job)
    for phase in ("forward", "backward"):
        assert per_layer(items, "all_to_all", phase, hidden) == 2 * layers * m
        assert per_layer(items, "all_to_all", phase, tokens * k * BF16) == layers * m
    for it in items:
        if it.op == "all_to_all":
            assert it.sent == it.received == it.message * (ep - 1) // ep


def test_allgather_dispatch_bytes_are_the_closed_form():
    # allgather dispatcher, tp 2 with SP, ep 2: every rank gathers the hidden states of the
    # whole TP x EP group ([s·b·ep, h] bf16, tp·ep = 4 ranks) and its routing probabilities
    # [s·b·ep, experts], works on its local experts' tokens and reduce-scatters the result back
    # (the same [s·b·ep, h]). Backward: the reduce-scatter's gradient is all-gathered and the
    # all-gather's reduce-scattered; a rank sends (n-1)/n of each message.
    job = moe_job(parallel={"tp": 2, "ep": 2, "sequence_parallel": True}, cluster={"num_gpus": 4})
    m, layers, n = job.num_microbatches, 2, 4
    hidden = S * B * 2 * H * BF16
    items = ep_items(job)
    for phase in ("forward", "backward"):
        assert per_layer(items, "all_gather", phase, hidden) == layers * m
        assert per_layer(items, "reduce_scatter", phase, hidden) == layers * m
    probs = S * B * 2 * MOE["num_experts"] * BF16
    assert per_layer(items, "all_gather", "forward", probs) == layers * m
    for it in items:
        if it.message == hidden:
            assert it.sent == it.message * (n - 1) // n


def test_hottest_expert_load_raises_what_arrives():
    # ep 2, two local experts per rank: the hottest gets 1.5x its share from every source, so
    # what arrives at a rank's experts grows from 2 shares to 2.5 (the dispatch receives and
    # the combine sends 5/4 as much); what the rank's own tokens send and get back does not.
    tokens = S * B * MOE["moe_router_topk"]

    def alltoalls(load):
        job = moe_job(
            parallel={"ep": 2, "moe_token_dispatcher_type": "alltoall"},
            training={"moe_hottest_expert_load": load},
            cluster={"num_gpus": 2},
        )
        return [
            it
            for it in ep_items(job)
            if it.op == "all_to_all" and it.phase == "forward" and len(it.shape) == 2
        ]

    (even,) = alltoalls(1.0)  # dispatch and combine alike: T·k tokens each way
    assert even.shape[0] == tokens and even.sent == even.received
    (dispatch,) = [it for it in alltoalls(1.5) if it.shape[0] == tokens]
    (combine,) = [it for it in alltoalls(1.5) if it.shape[0] != tokens]
    assert combine.shape[0] == tokens * 5 // 4
    assert dispatch.sent == even.sent and dispatch.received == even.received * 5 // 4
    assert combine.sent == even.sent * 5 // 4 and combine.received == even.received


def test_random_routing_gives_the_hottest_expert_its_expected_load():
    # The default routing, ep 2, alltoall: each of the 2 sources routes T = s·b = 128 tokens to
    # 2 of 4 experts, a share of 64 per expert; the hottest expert's expected count is 1.0742x
    # its share (config.routing.expected_hottest(256, 4, 2), checked against a Monte-Carlo draw
    # in tests/unit/test_routing.py). A rank's first expert gets ceil(64 x 1.0742) = 69 from
    # each source, the second 64: the combine sends 2 x (69 + 64) = 266 rows (balanced: 256).
    def forward_alltoalls(training):
        job = moe_job(
            parallel={"ep": 2, "moe_token_dispatcher_type": "alltoall"},
            training=training,
            cluster={"num_gpus": 2},
        )
        return [
            it
            for it in ep_items(job)
            if it.op == "all_to_all" and it.phase == "forward" and len(it.shape) == 2
        ]

    tokens = S * B * MOE["moe_router_topk"]
    (even,) = forward_alltoalls({})
    random = forward_alltoalls({"moe_routing": "random"})
    (combine,) = [it for it in random if it.shape[0] != tokens]
    assert combine.shape[0] == 266
    assert combine.received == even.received


def test_allgather_local_counts_of_random_routing():
    # allgather, tp 1, ep 2: the rank routes the 2 x 128 gathered tokens itself, 128 per expert
    # and top-2 of 4 (the hottest 1.0742x its share): its first expert ceil(128 x 1.0742) = 138.
    from types import SimpleNamespace

    from metatrace.config.routing import Routing
    from models.moe import allgather_local_counts

    def dispatcher(routing):
        config = SimpleNamespace(metatrace_routing=routing, num_moe_experts=4)
        return SimpleNamespace(
            config=config, router_topk=2, local_expert_indices=[2, 3], tp_size=1, ep_size=2
        )

    assert allgather_local_counts(dispatcher(Routing()), 256).tolist() == [138, 128]
    assert allgather_local_counts(dispatcher(Routing("balanced")), 256).tolist() == [128, 128]


def test_a_real_local_map_routes_the_assumed_counts():
    # The all-gather dispatcher's map of 6 gathered tokens to 2 local experts, made to route
    # 5 and 3 (more than half the tokens each: they wrap around), each token at most once per
    # expert; a meta map is left alone.
    import torch

    from models.moe import route_local_as_assumed

    local = torch.ones(6, 2, dtype=torch.bool)
    route_local_as_assumed(local, [5, 3])
    assert local.sum(dim=0).tolist() == [5, 3]
    assert local[:, 0].tolist() == [True] * 5 + [False]
    assert local[:, 1].tolist() == [True, True, False, False, False, True]
    meta = torch.empty(6, 2, dtype=torch.bool, device="meta")
    route_local_as_assumed(meta, [5, 3])


def test_expert_and_dense_optimizer_state_shard_over_their_own_groups():
    # tp 2, ep 4, etp 1, pp 2 on 16 GPUs: dense parameters shard over dp = 16/(2·2) = 4, the
    # experts' over expert dp = 16/(1·4·2) = 2 (megatron-core's groups). Adam with the
    # distributed optimizer keeps fp32 main parameters and two moments: 12 bytes per element
    # of the rank's shard (buckets are padded, hence the tolerance).
    job = moe_job(
        model={"num_layers": 4},
        parallel={
            "tp": 2,
            "pp": 2,
            "ep": 4,
            "etp": 1,
            "sequence_parallel": True,
            "moe_token_dispatcher_type": "alltoall",
        },
        training={"distributed_optimizer": True, "global_batch_size": 8},
        cluster={"num_gpus": 16},
    )
    dp, edp = 4, 2
    for rt in trace_job(job, full_model=False).roles:
        expert = dense = 0
        for mod in rt.trace.modules:
            for p in mod.params:
                if p.expert:
                    expert += p.numel
                else:
                    dense += p.numel
        assert expert and dense
        optim = role_memory(rt.trace, rt.iteration).optimizer
        expected = 12 * (dense / dp + expert / edp)
        assert abs(optim - expected) < 12 * 4096, (rt.role, optim, expected)
        # sharding experts over the dense group would be off by far more than the padding
        assert abs(12 * (dense + expert) / dp - expected) > 12 * 4096


@pytest.mark.parametrize(
    "sections",
    [
        {
            "parallel": {
                "tp": 2,
                "ep": 2,
                "sequence_parallel": True,
                "moe_token_dispatcher_type": "alltoall",
            },
            "implementation": {"moe_grouped_gemm": True},
            "cluster": {"num_gpus": 4},
        },
        {
            "parallel": {"tp": 2, "ep": 2, "sequence_parallel": True},
            "implementation": {"transformer_impl": "local"},
            "cluster": {"num_gpus": 4},
        },
        {
            "model": {"moe_shared_expert_intermediate_size": 128},
            "parallel": {"ep": 2, "moe_token_dispatcher_type": "alltoall"},
            "training": {"recompute": {"granularity": "selective", "modules": ["moe_act"]}},
            "implementation": {"moe_grouped_gemm": True},
            "cluster": {"num_gpus": 2},
        },
    ],
    ids=["alltoall-te-grouped-tp2", "allgather-local-tp2", "shared-experts-moe-act-recompute"],
)
def test_moe_meta_matches_real_cpu_tensors_under_balanced_routing(sections):
    """On real CPU tensors the router's choices are overwritten with the balanced routing the
    meta trace assumes (and masked_select counts for itself): both keep the same tensors for
    backward and issue the same collectives, so the counts metatrace supplies on meta are the
    ones the real code derives."""
    from metatrace.world import World

    job = moe_job(**merged({"training": {"global_batch_size": 8}}, sections))
    world = World.from_job(job)
    assert_meta_matches_real(job, world, world.roles()[0])


@pytest.mark.parametrize(
    "sections",
    [
        {
            "parallel": {"tp": 2, "ep": 2, "sequence_parallel": True},
            "implementation": {"transformer_impl": "local"},
            "cluster": {"num_gpus": 4},
        },
        {
            "parallel": {"ep": 2, "moe_token_dispatcher_type": "alltoall"},
            "training": {"moe_expert_capacity_factor": 1.0},
            "cluster": {"num_gpus": 2},
        },
        {
            "parallel": {
                "tp": 2,
                "sequence_parallel": True,
                "moe_token_dispatcher_type": "alltoall",
            },
            "cluster": {"num_gpus": 2},
        },
    ],
    ids=["allgather-local-tp2", "alltoall-token-dropping", "alltoall-tp2-every-expert-local"],
)
def test_real_cpu_run_routes_as_assumed_under_random_routing(sections):
    """metatrace measure of random routing, where the real router's choices cannot be the
    assumed counts: the all-gather dispatcher's experts get the hottest expert's counts on
    real tensors too (its map of the gathered tokens is overwritten; the fake world's
    all-gather leaves the other ranks' rows as the allocator gave them), and a router that
    drops tokens routes its source's balanced share (a new map: the router saved its own for
    backward). The real run then keeps what the meta trace does, instead of failing to split
    its tokens. Without expert parallelism every expert is on the rank: what the hottest one
    gains from a source the others lose (the trace failed in backward when each TP source's
    all-gathered share held the gain on top: 132 rows against the 128 it sent)."""
    import torch

    from metatrace.config.routing import Routing
    from metatrace.tracing.measure import measure_rank, predict

    torch.set_num_threads(1)
    job = moe_job(**merged({"training": {"moe_routing": "random"}}, sections))
    par = job.parallel
    draws = S * B // par.tp * par.tp * par.ep  # the dispatch's tokens over its sources
    # The hottest expert above its share: more than the all-gather's even split, more than a
    # capacity of 1.0 (real random choices would drop some)
    assert Routing.of_job(job).hottest(draws, MOE["num_experts"], MOE["moe_router_topk"]) > 1
    predicted, measured = predict(job, 0), measure_rank(job, 0, iterations=2)
    assert measured.saved_blocks == predicted.saved > 0
    peak = predicted.peak - predicted.cuda_only
    assert abs(peak - measured.peak_blocks) <= 0.01 * measured.peak_blocks


def test_moe_act_recompute_against_megatron_core_running_on_cpu():
    """Selective recompute of moe_act: megatron-core's CheckpointWithoutOutput frees the
    activation's output after the forward (untyped_storage().resize_(0)) and recomputes it in
    backward, so a layer keeps T·k rows of the activation [moe_ffn] bf16 less: 2 layers x 128
    tokens x top 2 x 96 here. Measured on real CPU tensors by metatrace measure (saved tensors
    by saved_tensors_hooks, the peak by the profiler's allocations), not by the recorder."""
    import torch

    from metatrace.tracing.measure import measure_rank, predict

    torch.set_num_threads(1)
    saved = {}
    for recompute in (False, True):
        training = {"global_batch_size": 4}
        if recompute:
            training["recompute"] = {"granularity": "selective", "modules": ["moe_act"]}
        job = moe_job(training=training, implementation={"moe_grouped_gemm": True})
        predicted, measured = predict(job, 0), measure_rank(job, 0, iterations=2)
        assert measured.saved_blocks == predicted.saved > 0
        peak = predicted.peak - predicted.cuda_only
        assert abs(peak - measured.peak_blocks) <= 0.01 * measured.peak_blocks
        saved[recompute] = measured.saved_blocks
    layers, k = 2, MOE["moe_router_topk"]
    assert saved[False] - saved[True] == layers * S * B * k * MOE["moe_ffn_hidden_size"] * BF16


def test_moe_recompute_keeps_only_the_layer_input():
    # Selective recompute of "moe": megatron-core checkpoints the whole MoE layer (router,
    # dispatch, experts, combine), which keeps only its input, the pre-MLP norm's output
    # [s, b, h] bf16, per layer; without it the layer keeps far more.
    def kept(recompute):
        training = (
            {"recompute": {"granularity": "selective", "modules": ["moe"]}} if recompute else {}
        )
        job = moe_job(
            parallel={"ep": 2, "moe_token_dispatcher_type": "alltoall"},
            training=training,
            cluster={"num_gpus": 2},
        )
        trace = trace_job(job, full_model=False, workers=1).roles[0].trace
        return sum(
            s.bytes
            for s in trace.saved
            if not s.static and s.phase == "forward" and s.module.startswith("decoder.layers.0.mlp")
        )

    assert kept(True) == S * B * H * BF16
    assert kept(False) > 4 * S * B * H * BF16


@pytest.mark.parametrize("tp", [1, 2])
def test_the_shared_expert_gate_keeps_the_gated_output_and_its_score(tp):
    """megatron-core's SharedExpertMLP with moe_shared_expert_gate (Qwen3-Next): sigmoid(x w)
    keeps its [s, b, 1] score, and the product with the shared experts' output keeps that
    output ([s/tp, b, h] with sequence parallelism) besides; the gate's linear keeps the layer's
    input, which the router already keeps. The layer holds exactly those two tensors more."""
    from metatrace.analysis.aggregate import module_tree, walk

    def shared_bytes(gate: bool) -> int:
        job = moe_job(
            model={"moe_shared_expert_intermediate_size": 128, "moe_shared_expert_gate": gate},
            parallel={"tp": tp, "sequence_parallel": tp > 1},
            cluster={"num_gpus": tp, "gpus_per_node": 8},
        )
        trace = trace_job(job, workers=1, full_model=False).roles[0].trace
        nodes = {n.fqn: n for n in walk(module_tree(trace))}
        return nodes["decoder.layers.0"].activation_bytes_total

    tokens = S // tp * B
    block = 512  # the caching allocator's smallest block
    score = -(-tokens * BF16 // block) * block
    assert shared_bytes(True) - shared_bytes(False) == tokens * H * BF16 + score


def _quantile_job(balancing):
    return moe_job(
        model={"num_layers": 2, "moe_router_load_balancing_type": balancing},
        parallel={"ep": 2, "moe_token_dispatcher_type": "alltoall"},
        training={"global_batch_size": 8},
        cluster={"num_gpus": 4},
    )


@pytest.mark.skipif(not release.since(0, 19), reason="quantile balancing is megatron-core 0.19's")
def test_quantile_balancing_keeps_its_bias_and_averages_it_once_per_iteration():
    """megatron-core 0.19's quantile-balancing routing (router.py quantile_balancing, run on
    meta): each router keeps three fp32 buffers (qb_beta, qb_beta_accum [E], qb_beta_count),
    a block each, and finalize_model_grads averages the layers' accumulated quantiles across
    data parallelism once per iteration, one [moe layers, E] fp32 all-reduce; the meta trace
    keeps what real CPU tensors keep."""
    from metatrace.analysis.analyze import analyze
    from metatrace.world import World

    layers, experts = 2, MOE["num_experts"]
    runs = {
        b: analyze(trace_job(_quantile_job(b), full_model=False, workers=1))
        for b in ("none", "quantile_balancing")
    }
    plain, quantile = (runs[b].roles[0].memory.params for b in ("none", "quantile_balancing"))
    assert quantile - plain == 3 * layers * 512

    def reduced(analysis):
        rt = analysis.traced.roles[0]
        return [
            (c.shape, c.dtype, c.group)
            for c, _ in rt.iteration.tally("collectives")
            if c.op == "all_reduce"
        ]

    added = list(reduced(runs["quantile_balancing"]))
    for entry in reduced(runs["none"]):
        added.remove(entry)
    assert added == [((layers, experts), "float32", "dp_cp")]
    job = _quantile_job("quantile_balancing")
    world = World.from_job(job)
    assert_meta_matches_real(job, world, world.roles()[0])


@pytest.mark.skipif(release.since(0, 19), reason="megatron-core 0.19 has quantile balancing")
def test_quantile_balancing_is_refused_before_0_19():
    from metatrace.errors import ConfigError
    from metatrace.tracing.checks import check_with_megatron

    with pytest.raises(ConfigError, match="quantile_balancing needs megatron-core 0.19"):
        check_with_megatron(_quantile_job("quantile_balancing"))
