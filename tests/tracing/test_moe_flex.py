"""megatron-core's flex token dispatcher on meta (models/deepep.py): what its DeepEP kernels
allocate and keep, against DeepEP's source, and what they move, against the closed form of
per-rank deduplication; beside the all-to-all dispatcher on the same model. deep_ep needs a GPU:
no CPU run to compare with."""

import math

import pytest

from metatrace.analysis.comm import job_comm
from metatrace.hooks import guards
from metatrace.records import Saved
from metatrace.tracing.trace import trace_job
from tests.helpers import BALANCED, MOE, small_job

H, S, B = 64, 64, 2  # the debug preset's hidden size; sequence, micro-batch
E, K, EP = 8, 2, 4  # two experts a rank: a token's two experts may share one
N = S * B  # tokens entering a MoE layer on a rank (no TP)
SMS = 20  # moe_deepep_num_sms (megatron-core's default): DeepEP runs SMS / 2 channels
BF16 = 2


def job(dispatcher, backend="deepep"):
    par = {"ep": EP, "moe_token_dispatcher_type": dispatcher}
    if dispatcher == "flex":
        par["moe_flex_dispatcher_backend"] = backend
    return small_job(
        model={**MOE, "num_experts": E, "moe_router_topk": K},
        parallel=par,
        training={"global_batch_size": 8, "seq_length": S, "micro_batch_size": B, **BALANCED},
        implementation={"moe_grouped_gemm": True},
        cluster={"num_gpus": EP},
    )


@pytest.fixture(scope="module")
def traced():
    return {
        name: trace_job(job(*args), full_model=False)
        for name, args in {
            "deepep": ("flex",),
            "hybridep": ("flex", "hybridep"),
            "alltoall": ("alltoall",),
        }.items()
    }


def per_peer() -> int:
    """Tokens a rank sends to each rank: N x P(one of the rank's E/EP experts among the K),
    the K drawn uniformly: 1 - C(E - E/EP, K) / C(E, K) = 1 - 15/28."""
    return math.ceil(N * (1 - math.comb(E - E // EP, K) / math.comb(E, K)))


def layer0(trace, phase):
    return [
        c
        for c in trace.collectives
        if c.module == "decoder.layers.0.mlp" and c.phase == phase and c.op == "all_to_all"
    ]


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_dispatch_moves_each_token_once_per_destination_rank(traced, backend):
    trace = traced[backend].roles[0].trace
    sent = per_peer() * EP  # 60 x 4 = 240 rows, not N x K = 256
    assert sent == 240
    hidden = [c for c in layer0(trace, "forward") if c.dtype == "bfloat16"]
    # dispatch, then combine: each carries the rank's deduplicated tokens x hidden in bf16
    assert [(c.group, c.bytes, c.output_bytes) for c in hidden] == [
        ("tp_ep", sent * H * BF16, sent * H * BF16)
    ] * 2
    if backend == "deepep":  # the top-k indices (int64) and weights (fp32) travel with them
        meta = {c.dtype: c.bytes for c in layer0(trace, "forward") if c.dtype != "bfloat16"}
        assert meta == {"int64": sent * K * 8, "float32": sent * K * 4}


def test_alltoall_moves_each_token_once_per_expert(traced):
    trace = traced["alltoall"].roles[0].trace
    hidden = [c.bytes for c in layer0(trace, "forward") if c.shape == (N * K, H)]
    assert hidden == [N * K * H * BF16] * 2


def test_deepep_keeps_its_handle(traced):
    """The intranode handle (deep_ep buffer.py:310; shapes deep_ep.cpp:244, 395-442) kept from
    dispatch to the backward of the layer."""
    trace = traced["deepep"].roles[0].trace
    saved = {
        (s.shape, s.dtype)
        for s in trace.saved
        if isinstance(s, Saved) and s.module.startswith("decoder.layers.0.mlp")
    }
    received = per_peer() * EP
    channels = SMS // 2
    for shape, dtype in [
        ((EP, EP), "int32"),  # rank_prefix_matrix
        ((EP, channels), "int32"),  # channel / recv_channel prefix matrices
        ((received,), "int32"),  # recv_src_idx
        ((N, EP), "bool"),  # is_token_in_rank
        ((N, EP), "int32"),  # send_head
    ]:
        assert (shape, dtype) in saved


def test_deepep_layer_traffic_is_the_closed_form(traced):
    """One layer, forward and backward: dispatch (hidden + top-k indices and weights),
    combine, and their backward (combine of the gradients with the weights' gradients,
    dispatch of the gradient), each of the rank's deduplicated tokens."""
    trace = traced["deepep"].roles[0].trace
    sent = per_peer() * EP
    total = sum(c.bytes for c in layer0(trace, "forward") + layer0(trace, "backward"))
    assert total == 4 * sent * H * BF16 + sent * K * (8 + 4) + sent * K * 4


def test_flex_sends_less_over_ep_than_alltoall(traced):
    """The report's EP traffic: DeepEP's deduplicated tokens against one copy per expert."""
    sent = {name: _ep_sent(t) for name, t in traced.items()}
    assert sent["deepep"] < sent["alltoall"]
    assert sent["hybridep"] < sent["deepep"]  # no top-k metadata beside the tokens


def _ep_sent(job_trace) -> int:
    return job_comm(job_trace).cluster["ep"].bytes_sent


def test_internode_deepep_marks_what_leaves_the_node():
    """EP 16 over two nodes of 8: DeepEP sends a token over RDMA once to the other node when it
    hosts one of the token's K experts (P = 1 - C(E/2, K) / C(E, K)) and forwards it over
    NVLink there; the dispatch and combine are marked with those bytes, the intranode run
    (EP 4 above) with none."""
    e, k, ep = 32, 4, 16
    internode = small_job(
        model={**MOE, "num_experts": e, "moe_router_topk": k},
        parallel={"ep": ep, "moe_token_dispatcher_type": "flex"},
        training={"global_batch_size": 32, "seq_length": S, "micro_batch_size": B, **BALANCED},
        implementation={"moe_grouped_gemm": True},
        cluster={"num_gpus": ep, "gpus_per_node": 8},
    )
    trace = trace_job(internode, full_model=False).roles[0].trace
    rows = math.ceil(N * (1 - math.comb(e - e // 2, k) / math.comb(e, k)))  # to the other node
    assert rows == 122  # 128 x (1 - 1820 / 35960)
    hidden = [c for c in layer0(trace, "forward") if c.dtype == "bfloat16"]
    assert [c.inter_bytes for c in hidden] == [rows * H * BF16] * 2
    intranode = trace_job(job("flex"), full_model=False).roles[0].trace
    assert all(c.inter_bytes is None for c in layer0(intranode, "forward"))


@pytest.mark.parametrize(
    "cluster, domains, near",
    [
        ({"gpus_per_node": 8}, 2, 8),  # two nodes of 8
        ({"gpus_per_node": 4}, 4, 4),  # four nodes of 4
        ({"gpus_per_node": 4, "nvlink_domain": 16}, 1, 16),  # one NVLink domain of 4 nodes
    ],
)
def test_hybridep_marks_what_leaves_the_nvlink_domain(cluster, domains, near):
    """EP 16 over NVLink domains of `near` GPUs: HybridEP's dispatch and combine send a token
    once to each other domain hosting one of its K experts (P = 1 - C(E - E near / EP, K) /
    C(E, K)), in forward and backward alike; inside one domain nothing is marked. The
    probabilities beside the tokens (fp32) stay unmarked."""
    e, k, ep = 32, 4, 16
    hybrid = small_job(
        model={**MOE, "num_experts": e, "moe_router_topk": k},
        parallel={
            "ep": ep,
            "moe_token_dispatcher_type": "flex",
            "moe_flex_dispatcher_backend": "hybridep",
        },
        training={"global_batch_size": 32, "seq_length": S, "micro_batch_size": B, **BALANCED},
        implementation={"moe_grouped_gemm": True},
        cluster={"num_gpus": ep, **cluster},
    )
    trace = trace_job(hybrid, full_model=False).roles[0].trace
    for phase in ("forward", "backward"):
        calls = layer0(trace, phase)
        hidden = [c.inter_bytes for c in calls if c.dtype == "bfloat16"]
        assert len(hidden) == 2 and all(
            c.inter_bytes is None for c in calls if c.dtype == "float32"
        )
        if domains == 1:
            assert hidden == [None, None]
            continue
        local = e * near // ep  # experts in the rank's domain
        rows = (domains - 1) * math.ceil(N * (1 - math.comb(e - local, k) / math.comb(e, k)))
        assert rows == {2: 122, 4: 273}[domains]  # 128 x (1 - 1820/35960); 3 x ceil(128 x 0.7045)
        assert hidden == [rows * H * BF16] * 2


def test_every_dispatcher_waits_for_the_counts_once_a_layer(traced):
    """Dropless, the host learns the received tokens once per MoE layer's forward: DeepEP's
    dispatch busy-waits for the counts (deep_ep.cpp), HybridEP without num_permuted_tokens
    copies them to pinned memory and waits (fused_a2a.py), the alltoall dispatcher waits at
    its cuda_sync_point (before the EP all-to-all); the backward reuses the forward's layout.
    Unfused, megatron-core 0.16.1's permute's two masked_selects also read data-dependent
    sizes (0.19's argsort-based permute has a fixed size), and DeepEP's _indices_to_multihot
    three more (indices[mask], repeat_interleave of the counts, probs[mask])."""
    permute = 0 if guards.since(0, 19) else 2
    for name, per_layer in {
        "hybridep": 1,
        "alltoall": 1 + permute,
        "deepep": 1 + permute + 3,
    }.items():
        job_trace = traced[name]
        windows = job_trace.roles[0].trace.windows
        layers = job_trace.job.model.num_layers
        fwd = [w for w in windows if w.phase == "forward" and w.microbatch == 0]
        bwd = [w for w in windows if w.phase == "backward" and w.microbatch == 0]
        assert sum(w.syncs for w in fwd) == per_layer * layers, name
        assert sum(w.syncs for w in bwd) == 0, name
