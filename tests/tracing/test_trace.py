"""Traces of tiny models: collective sequences, what is saved, and meta against real tensors."""

import json

import pytest

from metatrace.analysis import aggregate as agg
from metatrace.tracing.trace import trace_job, trace_role
from metatrace.world import World
from tests.helpers import assert_meta_matches_real, collective_rows, small_job


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_golden_collective_sequence_tp2(golden, impl):
    # One stage, tp 2, two layers: the sequence megatron-core 0.16.1 issues for one micro-batch,
    # with its local modules or Transformer Engine's (the same collectives without SP).
    job = small_job(parallel={"tp": 2}, implementation={"transformer_impl": impl})
    jt = trace_job(job, full_model=False)
    rows = collective_rows(jt.roles[0].trace)
    golden(f"collectives_tp2_{impl}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    # The notes' observation (../shared/notes/megatron-on-meta.md): 13 all-reduces = 2 per
    # layer forward (linear_proj, linear_fc2) and 2 backward (linear_qkv, linear_fc1),
    # 1 embedding, 3 fp32 [s, b] in the vocab-parallel cross entropy, 1 output-layer input grad.
    all_reduces = [r for r in rows if r[0] == "all_reduce"]
    assert len(all_reduces) == 13
    s, b, h = 64, 2, 64
    per_layer = [r for r in all_reduces if ".layers." in r[6]]
    # [s, b, h] bf16 (Transformer Engine reduces the flattened GEMM output [s b, h]).
    assert len(per_layer) == 8 and all(r[4] == s * b * h * 2 for r in per_layer)
    assert sum(r[5] == "forward" for r in per_layer) == 4
    cross_entropy = [r for r in all_reduces if r[3] == "float32"]
    assert len(cross_entropy) == 3 and all(r[2] == [s, b] for r in cross_entropy)
    # The batch goes from TP rank 0 to the others: tokens, labels, loss mask, mask, positions.
    assert [r[0] for r in rows].count("broadcast") == 5


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_sequence_parallel_collectives_match_the_notes(impl):
    # TP 4 with SP, one layer (notes: forward 3 reduce-scatters and 3 all-gathers; backward
    # 6 all-gathers, the re-gathers for weight gradients included, and 3 reduce-scatters).
    job = small_job(
        model={"num_layers": 1, "num_attention_heads": 4, "num_query_groups": 4},
        parallel={"tp": 4, "sequence_parallel": True},
        implementation={"transformer_impl": impl},
    )
    trace = trace_job(job, full_model=False).roles[0].trace
    ops = [(c.op, c.phase) for c in trace.collectives if c.group == "tp"]
    assert ops.count(("reduce_scatter", "forward")) == 3
    assert ops.count(("all_gather", "forward")) == 3
    assert ops.count(("all_gather", "backward")) == 6
    assert ops.count(("reduce_scatter", "backward")) == 3
    gathered = [c for c in trace.collectives if c.op == "all_gather"]
    assert all(c.bytes == 64 * 2 * 64 * 2 for c in gathered)  # [s, b, h] bf16, from s / 4


def test_pipeline_sends_and_receives():
    job = small_job(parallel={"pp": 2})
    jt = trace_job(job, full_model=False)
    first, last = (rt.trace for rt in jt.roles)
    p2p = lambda t: [
        (c.op, c.phase, c.peer, list(c.shape)) for c in t.collectives if c.group == "pp"
    ]
    # Activations [s, b, h] forward, their gradients backward, between global ranks 0 and 1.
    assert p2p(first) == [("send", "forward", 1, [64, 2, 64]), ("recv", "backward", 1, [64, 2, 64])]
    assert p2p(last) == [("recv", "forward", 0, [64, 2, 64]), ("send", "backward", 0, [64, 2, 64])]


def test_interleaved_stages_hold_their_virtual_chunks():
    job = small_job(
        model={"num_layers": 8}, parallel={"pp": 2, "vpp": 2}, training={"global_batch_size": 4}
    )
    jt = trace_job(job, full_model=False)
    assert [agg.role_summary(rt.trace).layers for rt in jt.roles] == [(1, 2, 5, 6), (3, 4, 7, 8)]
    assert jt.roles[0].chunks == ("chunk0", "chunk1")
    sends = [c for c in jt.roles[0].trace.collectives if c.op == "send"]
    assert (
        len(sends) == 3
    )  # chunk0 forward, chunk1 forward (to rank 1), chunk1 backward (to rank 1)


def test_tp_peers_are_symmetric():
    # Only one rank per pipeline stage is traced; its TP peer records the same work.
    job = small_job(parallel={"tp": 2, "pp": 2}, model={"num_layers": 2})
    world = World.from_job(job)
    role = world.roles()[1]
    a = trace_role(job, world, role, rank=role.ranks[0]).trace
    b = trace_role(job, world, role, rank=role.ranks[1]).trace
    strip = lambda t: [(c.op, c.group, c.shape, c.bytes, c.phase, c.module) for c in t.collectives]
    assert strip(a) == strip(b)
    assert [c.ranks for c in a.collectives if c.group == "tp"][0] == (2, 3)
    assert [(s.module, s.bytes, s.phase) for s in a.saved] == [
        (s.module, s.bytes, s.phase) for s in b.saved
    ]
    assert agg.peak(a).bytes == agg.peak(b).bytes


@pytest.mark.parametrize(
    "sections",
    [
        {"parallel": {"tp": 2, "pp": 2}},
        {
            "model": {
                "normalization": "LayerNorm",
                "activation": "gelu",
                "add_bias_linear": True,
                "hidden_dropout": 0.1,
                "attention_dropout": 0.1,
                "position_embedding_type": "learned_absolute",
                "untie_embeddings_and_output_weights": False,
            },
            "parallel": {"tp": 2, "sequence_parallel": True},
        },
        {
            "parallel": {"tp": 2},
            "training": {
                "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}
            },
        },
        {"parallel": {"tp": 2, "pp": 2}, "implementation": {"transformer_impl": "local"}},
        {
            "model": {"hidden_dropout": 0.1, "attention_dropout": 0.1},
            "parallel": {"tp": 2, "sequence_parallel": True},
            "implementation": {"attention_backend": "unfused"},
        },
        {"parallel": {"tp": 2}, "implementation": {"attention_backend": "flash"}},
        {
            "model": {"num_attention_heads": 4, "num_query_groups": 4},
            "parallel": {"cp": 2, "cp_comm_type": "a2a"},
        },
        {"parallel": {"cp": 2, "tp": 2, "sequence_parallel": True}},
    ],
    ids=[
        "te-tp2-pp2",
        "te-gpt-sp-dropout",
        "te-full-recompute",
        "local-tp2-pp2",
        "te-unfused-dropout",
        "te-flash",
        "te-cp2-a2a",
        "te-cp2-p2p",
    ],
)
def test_meta_tells_the_truth(sections):
    """The same tiny model on real CPU tensors and on meta keeps the same tensors for backward
    and issues the same collectives (host tensors are followed on meta too: the CPU run cannot
    tell them apart)."""
    job = small_job(**sections)
    world = World.from_job(job)
    for role in world.roles():
        assert_meta_matches_real(job, world, role)


def test_nothing_is_unclassified(debug_trace):
    for rt in debug_trace.roles + (debug_trace.full,):
        assert rt.trace.unclassified == {}
        assert sum(rt.trace.op_counts.values()) > 100


def test_mlp_recompute_with_biases_really_recurses_in_megatron_core():
    """Why the configuration check refuses selective 'mlp' recompute with biases: on real CPU
    tensors megatron-core 0.16.1's checkpointed MLP returns its fc2 bias parameter, autograd
    gives that parameter the checkpoint's backward as grad_fn, and backward re-enters it."""
    import dataclasses

    import torch

    from metatrace.config import Recompute

    job = small_job(model={"add_bias_linear": True}, parallel={"tp": 2})
    job = dataclasses.replace(
        job,
        training=dataclasses.replace(
            job.training, recompute=Recompute(granularity="selective", modules=["mlp"])
        ),
    )
    world = World.from_job(job)
    calls = []

    def count(module, args):
        calls.append(module)
        if len(calls) > 20:
            raise RecursionError("the checkpointed MLP ran again and again in backward")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: count(m, a) if type(m).__name__ == "MLP" else None
    )
    try:
        with pytest.raises(RecursionError):
            trace_role(job, world, world.roles()[0], device="cpu")
    finally:
        handle.remove()
    with pytest.raises(Exception, match="recurses without end"):
        small_job(
            model={"add_bias_linear": True},
            training={"recompute": {"granularity": "selective", "modules": ["mlp"]}},
        )


@pytest.mark.parametrize(
    "sections",
    [
        {
            "model": {"num_layers": 8},
            "parallel": {"pp": 2, "vpp": 2},
            "training": {"global_batch_size": 4},
        },
        {
            "model": {"num_layers": 6},
            "parallel": {"pp": 4, "account_for_embedding": True, "account_for_loss": True},
        },
        {
            "model": {"num_layers": 7},
            "parallel": {"pp": 3, "first_stage_layers": 1, "last_stage_layers": 2},
        },
        {
            "model": {"num_layers": 6},
            "parallel": {"pp": 2, "layout": "Ett|tt|t|tL"},
            "training": {"global_batch_size": 4},
        },
    ],
    ids=["vpp", "account", "uneven", "layout"],
)
def test_pipeline_split_is_megatron_cores(sections):
    """The checks' closed-form split equals what megatron-core builds on each rank."""
    from metatrace.config.checks import chunk_layer_counts

    job = small_job(**sections)
    jt = trace_job(job, full_model=False)
    pp = job.parallel.pp
    built = {}
    for rt in jt.roles:
        for v, prefix in enumerate(rt.chunks):
            layers = [
                m
                for m in rt.trace.modules
                if m.type == "TransformerLayer" and m.fqn.startswith(prefix)
            ]
            built[v * pp + rt.role.pp_stage] = len(layers)
    assert [built[i] for i in range(len(built))] == chunk_layer_counts(job)


def test_the_same_role_traced_twice_in_one_process_peaks_the_same():
    """A storage is live until its StorageImpl dies. MLA's fused YaRN RoPE (megatron-core's
    Triton kernels, stood in by no-ops) changes tensors' storages beneath them; counting the
    tensor objects missed those frees, a new storage at the same address passed for the old
    one, and the peak depended on what the process had traced before."""
    from metatrace.analysis.memory import role_memory

    job = small_job(
        model={
            "num_layers": 2,
            "hidden_size": 512,
            "ffn_hidden_size": 1024,
            "num_attention_heads": 8,
            "num_query_groups": 8,
            "kv_channels": 64,
            "multi_latent_attention": True,
            "q_lora_rank": 128,
            "kv_lora_rank": 64,
            "qk_head_dim": 64,
            "qk_pos_emb_head_dim": 32,
            "v_head_dim": 64,
            "rotary_scaling_factor": 40.0,
            "mscale_all_dim": 1.0,
        },
        training={"seq_length": 256, "global_batch_size": 2, "micro_batch_size": 2},
    )
    assert job.model.rope_type == "yarn"
    assert job.implementation.rope_fusion
    world = World.from_job(job)
    peaks = set()
    for _ in range(3):
        rt = trace_role(job, world, world.roles()[0])
        peaks.add(role_memory(rt.trace, rt.iteration).peak)
    assert len(peaks) == 1


def test_optimizer_instances_trace_with_the_full_model():
    # num_distributed_optimizer_instances > 1: the roles trace in megatron-core's instance
    # groups, and the one-GPU view of the full model runs with a single instance.
    job = small_job(
        training={
            "distributed_optimizer": True,
            "global_batch_size": 8,
            "num_distributed_optimizer_instances": 2,
        },
        cluster={"num_gpus": 4},
    )
    jt = trace_job(job, workers=1)
    assert jt.full is not None and all(rt.iteration is not None for rt in jt.roles)


def test_shared_workers_trace_jobs_in_the_same_processes_with_the_same_records():
    """Inside shared_workers() one pool serves successive trace_jobs: the second job runs in
    the processes the first forked, and every role's records are those of a job traced in a
    pool of its own."""
    from metatrace.tracing import trace as tracing

    jobs = [small_job(parallel={"pp": 2}), small_job(parallel={"tp": 2, "pp": 2})]
    alone = [trace_job(job, full_model=False, workers=2) for job in jobs]
    shared, pids = [], []
    with tracing.shared_workers():
        for job in jobs:
            shared.append(trace_job(job, full_model=False, workers=2))
            pids.append(set(tracing._SHARED["pool"]._processes))
    assert tracing._SHARED["pool"] is None  # shut down on exit
    assert len(pids[0]) == 2 and pids[0] == pids[1]
    for a, b in zip(alone, shared):
        for x, y in zip(a.roles, b.roles):
            assert x.trace == y.trace and x.iteration == y.iteration
