"""Communication per iteration against hand-derived closed forms, cluster totals against the
sum over ranks, and node classification against gpus_per_node."""

import pytest

from metatrace.analysis.comm import job_comm
from metatrace.tracing.trace import trace_job
from metatrace.world import World
from tests.helpers import small_job

# The debug preset: hidden 64, 2 layers; the tests run sequences of 64, micro-batches of 2.
H, S, B = 64, 64, 2
BF16, FP32 = 2, 4


def comm_of(**sections):
    job = small_job(**sections)
    return job, job_comm(trace_job(job, full_model=False, workers=1))


def layer_items(comm, dim="tp"):
    return [it for it in comm.items if it.dimension == dim and it.layers]


def test_tensor_parallel_without_sequence_parallel():
    # Per layer and micro-batch, TP without SP: two all-reduces of s·b·h elements in forward
    # (after the attention projection and the second MLP linear) and two in backward (the input
    # gradients of linear_qkv and linear_fc1). tp 4: a rank sends 2·3/4 of each message.
    job, jc = comm_of(
        model={"num_query_groups": 4},
        parallel={"tp": 4},
        training={"global_batch_size": 8},
        cluster={"num_gpus": 4},
    )
    ((rt, comm),) = jc.roles
    m, layers = job.num_microbatches, 2
    items = layer_items(comm)
    assert {it.op for it in items} == {"all_reduce"}
    for phase in ("forward", "backward"):
        assert sum(it.count for it in items if it.phase == phase) == 2 * layers * m
    for it in items:
        assert it.message == S * B * H * BF16
        assert (it.sent, it.received) == (S * B * H * BF16 * 3 // 2,) * 2
    # Outside the layers: the embedding's forward all-reduce, the output layer's backward
    # all-reduce (both s·b·h) and the vocabulary-parallel cross entropy's three all-reduces of
    # s·b fp32 (max logit, target logit, sum of exponentials).
    rest = [
        it
        for it in comm.items
        if it.dimension == "tp" and not it.layers and it.op == "all_reduce" and it.per_microbatch
    ]
    assert sorted((it.message, it.count // m) for it in rest) == sorted(
        [(S * B * H * BF16, 1), (S * B * H * BF16, 1), (S * B * FP32, 3)]
    )


def test_tensor_parallel_with_sequence_parallel():
    # Per layer and micro-batch with SP: forward all-gathers before linear_qkv and linear_fc1,
    # reduce-scatters after linear_proj and linear_fc2; backward re-gathers the two saved
    # local inputs, gathers the two output gradients and reduce-scatters the two input
    # gradients. Messages are the full [s, b, h]; a rank sends (n-1)/n of each.
    job, jc = comm_of(
        parallel={"tp": 2, "sequence_parallel": True},
        training={"global_batch_size": 4},
        cluster={"num_gpus": 2},
    )
    ((rt, comm),) = jc.roles
    m, layers = job.num_microbatches, 2
    counts = {}
    for it in layer_items(comm):
        counts[(it.phase, it.op)] = counts.get((it.phase, it.op), 0) + it.count
        assert it.message == S * B * H * BF16 and it.sent == it.message // 2
    assert counts == {
        ("forward", "all_gather"): 2 * layers * m,
        ("forward", "reduce_scatter"): 2 * layers * m,
        ("backward", "all_gather"): 4 * layers * m,
        ("backward", "reduce_scatter"): 2 * layers * m,
    }
    # Once per iteration: the layer-norm gradients (replicated under SP) all-reduced over tp.
    once = [it for it in comm.items if it.dimension == "tp" and not it.per_microbatch]
    assert [(it.op, it.count, it.phase) for it in once] == [("all_reduce", 1, "grad sync")]


@pytest.mark.parametrize(
    "sections, sp",
    [
        ({"parallel": {"pp": 4}, "training": {"global_batch_size": 16}}, False),
        ({"parallel": {"pp": 2, "vpp": 2}, "training": {"global_batch_size": 8}}, False),
        (
            {
                "parallel": {"pp": 2, "tp": 2, "sequence_parallel": True},
                "training": {"global_batch_size": 8},
            },
            True,
        ),
    ],
    ids=["1f1b-pp4", "interleaved-pp2-vpp2", "1f1b-tp2-sp"],
)
def test_pipeline_sends_and_receives(sections, sp):
    # Per iteration, with m micro-batches and v virtual stages per rank: a rank sends every
    # virtual stage's output forward except the model's last, and every input gradient back
    # except the model's first: sends = (m·v - m·[last rank]) + (m·v - m·[first rank]), and as
    # many receives. The boundary tensor is [s/(tp with SP), b, h] in bf16.
    job, jc = comm_of(
        model={"num_layers": 4},
        cluster={"num_gpus": 2 * sections["parallel"]["pp"] if sp else sections["parallel"]["pp"]},
        **sections,
    )
    m, v, pp = job.num_microbatches, job.parallel.vpp or 1, job.parallel.pp
    message = (S // (2 if sp else 1)) * B * H * BF16
    for rt, comm in jc.roles:
        stage = rt.role.pp_stage
        expected = (m * v - m * (stage == pp - 1)) + (m * v - m * (stage == 0))
        p2p = [it for it in comm.items if it.dimension == "pp" and it.peer is not None]
        assert sum(it.count for it in p2p if it.op == "send") == expected, stage
        assert sum(it.count for it in p2p if it.op == "recv") == expected, stage
        assert {it.message for it in p2p} == {message}
        assert all(it.sent == it.message for it in p2p if it.op == "send")


def test_tied_embedding_gradient_all_reduce():
    # Tied embeddings over pp 2: the first and last stage all-reduce the word embedding's fp32
    # main gradient (padded vocab 1008 × h) once per iteration over the embedding group.
    job, jc = comm_of(
        model={"untie_embeddings_and_output_weights": False},
        parallel={"pp": 2},
        training={"global_batch_size": 4},
        cluster={"num_gpus": 2},
    )
    for _, comm in jc.roles:
        emb = [it for it in comm.items if it.group == "embedding"]
        assert [(it.op, it.count, it.message, it.ranks) for it in emb] == [
            ("all_reduce", 1, job.padded_vocab_size * H * FP32, (0, 1))
        ]


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_data_parallel_gradient_reduction(distributed_optimizer):
    # dp 2, no overlap (one bucket): without the distributed optimizer one all-reduce of the
    # fp32 gradient buffer, exactly 4 bytes per parameter; with it a reduce-scatter of the
    # (padded) fp32 buffer and an all-gather of the same number of bf16 parameters. A rank of
    # two sends 2·1/2 of an all-reduce's message, 1/2 of the others'.
    job, jc = comm_of(
        parallel={"pp": 2, "dp": 2},
        training={"global_batch_size": 8, "distributed_optimizer": distributed_optimizer},
        cluster={"num_gpus": 4},
    )
    for rt, comm in jc.roles:
        params = sum(p.numel for mod in rt.trace.modules for p in mod.params)
        big = [it for it in comm.items if it.dimension == "dp" and it.message > 1024]
        if not distributed_optimizer:
            assert [(it.op, it.count, it.message, it.sent) for it in big] == [
                ("all_reduce", 1, FP32 * params, FP32 * params)
            ]
            continue
        (rs,), (ag,) = (
            [it for it in big if it.op == op] for op in ("reduce_scatter", "all_gather")
        )
        assert rs.count == ag.count == 1
        # megatron-core pads each parameter's start to 64 elements and the bucket to a multiple
        # of lcm(dp, 128) for the distributed optimizer.
        tensors = sum(len(mod.params) for mod in rt.trace.modules)
        assert FP32 * params <= rs.message < FP32 * (params + 64 * tensors + 128)
        assert ag.message * 2 == rs.message and rs.sent == rs.message // 2
        assert list(rs.ranks) == World.from_job(job).group_of("dp_cp", rt.trace.rank)


@pytest.mark.parametrize("overlap", [False, True])
def test_distributed_optimizer_instances(overlap):
    # dp 4 in 2 optimizer instances: the fp32 gradient buffer is reduce-scattered over the 2
    # ranks of an instance (intra_dp_cp), this rank's half all-reduced with the rank holding
    # the same half in the other instance (inter_dist_opt), the bf16 parameters all-gathered
    # over the instance; megatron-core overlaps the first two with backward on a stream of
    # their own (synchronous calls) when overlap_grad_reduce is on.
    training = {
        "global_batch_size": 8,
        "distributed_optimizer": True,
        "num_distributed_optimizer_instances": 2,
        "overlap_grad_reduce": overlap,
        "overlap_param_gather": overlap,
    }
    job, jc = comm_of(training=training, cluster={"num_gpus": 4})
    world = World.from_job(job)
    ((rt, comm),) = jc.roles
    rank = rt.trace.rank
    big = {(it.op, it.group): it for it in comm.items if it.dimension == "dp" and it.message > 1024}
    assert set(big) == {
        ("reduce_scatter", "intra_dp_cp"),
        ("all_reduce", "inter_dist_opt"),
        ("all_gather", "intra_dp_cp"),
    }
    rs, ar, ag = (
        big[k]
        for k in (
            ("reduce_scatter", "intra_dp_cp"),
            ("all_reduce", "inter_dist_opt"),
            ("all_gather", "intra_dp_cp"),
        )
    )
    assert list(rs.ranks) == list(ag.ranks) == world.group_of("intra_dp_cp", rank) == [0, 1]
    assert list(ar.ranks) == world.group_of("inter_dist_opt", rank) == [0, 2]
    assert ar.message * 2 == rs.message == ag.message * 2  # half the fp32 buffer; all bf16 params
    assert (rs.sent, ar.sent, ag.sent) == (rs.message // 2, ar.message, ag.message // 2)
    assert {it.overlapped for it in (rs, ar)} == {"backward" if overlap else None}


def test_cluster_totals_are_the_sum_over_ranks_and_nodes_follow_gpus_per_node():
    sections = dict(parallel={"tp": 2, "pp": 2, "dp": 2}, training={"global_batch_size": 8})
    _, two = comm_of(cluster={"num_gpus": 8, "gpus_per_node": 2}, **sections)
    _, eight = comm_of(cluster={"num_gpus": 8, "gpus_per_node": 8}, **sections)
    for name in ("count", "bytes_sent", "bytes_received", "message_bytes"):
        for dim, total in two.cluster.items():
            expected = sum(len(rt.role.ranks) * getattr(c.dims[dim], name) for rt, c in two.roles)
            assert getattr(total, name) == expected, (dim, name)
        assert getattr(two.total, name) == sum(getattr(t, name) for t in two.cluster.values())
    # Two GPUs per node: tp groups (0,1) stay inside a node; pp (0,4) and dp (0,2) cross.
    assert two.cluster["tp"].inter == 0 and two.cluster["tp"].intra > 0
    assert two.cluster["pp"].intra == 0 and two.cluster["pp"].inter > 0
    assert two.cluster["dp"].intra == 0 and two.cluster["dp"].inter > 0
    # One node of eight: nothing crosses.
    assert eight.total.inter == 0 and eight.total.intra == eight.total.bytes_sent
    for t in two.cluster.values():
        assert t.intra + t.inter == t.bytes_sent
    # Crossing nodes is slower: the same traffic takes longer with two GPUs per node.
    assert two.total.seconds > eight.total.seconds


def test_context_parallel_ring_crosses_nodes_for_every_rank():
    # cp 2 over two 2-GPU nodes: cp groups (0, 2), (1, 3); every rank's ring peer is on the
    # other node, whichever end of its group the rank is (the traced rank 0 stands for all four).
    _, jc = comm_of(
        parallel={"tp": 2, "cp": 2},
        training={"global_batch_size": 2},
        cluster={"num_gpus": 4, "gpus_per_node": 2},
    )
    cp = jc.cluster["cp"]
    assert cp.count > 0 and cp.intra == 0 and cp.inter == cp.bytes_sent
    assert jc.cluster["tp"].inter == 0


def test_overlapped_param_gather_without_overlapped_grad_reduce():
    # megatron-core (as Megatron-Bridge runs it) all-gathers the parameters in the next
    # forward, overlapped, while the gradients are still reduce-scattered after the backward.
    from metatrace.analysis.analyze import analyze

    def dp_calls(**training):
        job = small_job(
            training={"distributed_optimizer": True, "global_batch_size": 8, **training},
            cluster={"num_gpus": 2},
        )
        (ra,) = analyze(trace_job(job, full_model=False, workers=1)).roles
        return {
            (it.op, it.phase, it.overlapped): it.message
            for it in ra.comm.items
            if it.dimension == "dp" and it.op != "all_reduce"
        }

    plain = dp_calls()
    assert set(plain) == {("reduce_scatter", "grad sync", None), ("all_gather", "optimizer", None)}
    gathered = dp_calls(overlap_param_gather=True)
    assert set(gathered) == {
        ("reduce_scatter", "grad sync", None),
        ("all_gather", "forward", "forward"),
    }
    # The same message, moved from the optimizer step into the forward.
    assert (
        gathered[("all_gather", "forward", "forward")] == plain[("all_gather", "optimizer", None)]
    )
