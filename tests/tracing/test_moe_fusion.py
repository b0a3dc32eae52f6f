"""Transformer Engine's fused MoE permutation and router kernels (models/te_moe.py): what the
stand-ins save against closed forms, the same outputs and gradients as megatron-core's unfused
path on real tensors, the per-layer difference in a trace, and meta against real CPU tensors."""

import pytest
import torch

from metatrace.hooks import guards
from metatrace.models import te_moe as S
from tests.helpers import BALANCED, priced, saved_storages, small_job

BF16, FP32 = torch.bfloat16, torch.float32
SIZE = {torch.bfloat16: 2, torch.float32: 4, torch.int32: 4, torch.int64: 8, torch.bool: 1}


# ----------------------------------------------------------------- closed forms, on meta


@pytest.mark.parametrize("T, h, E, k", [(2048, 512, 8, 2), (1000, 64, 6, 3), (4096, 128, 64, 8)])
@pytest.mark.parametrize("pdtype", [BF16, FP32])
def test_permute_saves_the_row_id_map_only(T, h, E, k, pdtype):
    x = torch.empty(T, h, dtype=BF16, device="meta", requires_grad=True)
    probs = torch.empty(T, E, dtype=pdtype, device="meta", requires_grad=True)
    rmap = torch.empty(T, E, dtype=torch.bool, device="meta")
    (out, pprobs, row_id), saved = saved_storages(
        lambda: S.moe_permute_with_probs(x, probs, rmap, T * k)
    )
    assert (out.shape, out.dtype) == ((T * k, h), BF16)
    assert (pprobs.shape, pprobs.dtype) == ((T * k,), pdtype)
    assert (row_id.shape, row_id.dtype) == ((T, 2 * E + 1), torch.int32)
    assert list(saved.values()) == [4 * T * (2 * E + 1)]
    torch.autograd.backward([out, pprobs], [torch.empty_like(out), torch.empty_like(pprobs)])
    assert x.grad.shape == x.shape and probs.grad.shape == probs.shape
    assert probs.grad.dtype == pdtype


@pytest.mark.parametrize("with_probs", [False, True])
def test_unpermute_saves_input_and_probs_only_when_merging(with_probs):
    T, h, E, k = 2048, 512, 8, 2
    row_id = torch.empty(T, 2 * E + 1, dtype=torch.int32, device="meta")
    inp = torch.empty(T * k, h, dtype=BF16, device="meta", requires_grad=True)
    probs = torch.empty(T, E, dtype=FP32, device="meta", requires_grad=True) if with_probs else None
    out, saved = saved_storages(
        lambda: S.moe_unpermute(inp, row_id, merging_probs=probs, restore_shape=(T, h))
    )
    assert (out.shape, out.dtype) == ((T, h), BF16)
    expected = 4 * T * (2 * E + 1) + (T * k * h * 2 + T * E * 4 if with_probs else 0)
    assert sum(saved.values()) == expected
    out.backward(torch.empty_like(out))
    assert inp.grad.shape == inp.shape


@pytest.mark.parametrize("with_probs", [False, True])
def test_sort_chunks_saves_an_int32_map_per_row(with_probs):
    N, h = 4096, 256
    x = torch.empty(N, h, dtype=BF16, device="meta", requires_grad=True)
    split, idx = torch.full((8,), N // 8), torch.arange(8)
    if with_probs:
        p = torch.empty(N, dtype=FP32, device="meta", requires_grad=True)
        (out, pp), saved = saved_storages(
            lambda: S.moe_sort_chunks_by_index_with_probs(x, p, split, idx)
        )
        assert (pp.shape, pp.dtype) == ((N,), FP32)
    else:
        out, saved = saved_storages(lambda: S.moe_sort_chunks_by_index(x, split, idx))
    assert out.shape == x.shape and list(saved.values()) == [4 * N]


def test_router_fusion_saves_map_and_fp32_intermediates():
    T, E, k = 2048, 16, 4
    logits = torch.empty(T, E, dtype=BF16, device="meta", requires_grad=True)
    (probs, rmap), saved = saved_storages(
        lambda: S.fused_topk_with_score_function(
            logits, k, False, None, None, None, "softmax", None
        )
    )
    assert (probs.shape, probs.dtype, rmap.dtype) == ((T, E), BF16, torch.bool)
    assert sorted(saved.values()) == [T * E, 4 * T * E]
    (rmap2, scores), saved2 = saved_storages(
        lambda: S.fused_compute_score_for_moe_aux_loss(logits, k, "softmax")
    )
    assert scores.dtype == FP32 and list(saved2.values()) == [4 * T * E]
    tpe = torch.empty(E, dtype=torch.int64, device="meta")
    loss, saved3 = saved_storages(lambda: S.fused_moe_aux_loss(scores, tpe, T, E, k, 0.01))
    assert loss.shape == () and loss.dtype == FP32 and sorted(saved3.values()) == [8, 8 * E]
    with pytest.raises(ValueError, match="float64"):
        S.fused_topk_with_score_function(
            logits.double(), k, False, None, None, None, "softmax", None
        )


# ------------------------------------- same outputs and gradients as megatron's unfused path


def test_fused_and_unfused_permutation_agree_on_what_flows():
    """megatron-core's unfused permute / unpermute / sort_chunks on real CPU tensors are the
    reference for what must be equal: outputs and input gradients (shapes, dtypes). What is
    saved differs by design (the index structures)."""
    from megatron.core.transformer.moe import moe_utils as mu

    T, h, E, k = 256, 32, 8, 2
    x = torch.randn(T, h, dtype=BF16, requires_grad=True)
    choice = (torch.arange(T).unsqueeze(1) * k + torch.arange(k)) % E
    rmap = torch.zeros(T, E, dtype=torch.bool).scatter_(1, choice, True)
    probs = torch.rand(T, E, dtype=FP32).requires_grad_(True)
    ref = mu.permute(x, rmap, probs=probs, num_out_tokens=T * k, fused=False)
    got = S.moe_permute_with_probs(x, probs, rmap, T * k)
    for a, b in [(ref[0], got[0]), (ref[1], got[1])]:
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    un_ref = mu.unpermute(ref[0], ref[2], restore_shape=x.shape, routing_map=rmap)
    un_got = S.moe_unpermute(got[0], got[2], restore_shape=x.shape)
    assert (un_ref.shape, un_ref.dtype) == (un_got.shape, un_got.dtype)
    grads = []
    for out, pp in [(un_ref, ref[1]), (un_got, got[1])]:
        x.grad = probs.grad = None
        torch.autograd.backward([out, pp], [torch.ones_like(out), torch.ones_like(pp)])
        grads.append((x.grad.shape, x.grad.dtype, probs.grad.shape, probs.grad.dtype))
    assert grads[0] == grads[1]
    split, idx = torch.full((E,), T * k // E), torch.arange(E).reshape(-1, 2).T.ravel()
    s_ref = mu.sort_chunks_by_idxs(ref[0], split, idx, probs=ref[1])
    s_got = S.moe_sort_chunks_by_index_with_probs(got[0], got[1], split, idx)
    for a, b in zip(s_ref, s_got):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)


def test_fused_and_unfused_router_agree_on_what_flows():
    from megatron.core.transformer.moe import moe_utils as mu

    T, E, k = 128, 8, 2
    logits = torch.randn(T, E, dtype=FP32, requires_grad=True)
    for score in ("softmax", "sigmoid"):
        ref = mu.topk_routing_with_score_function(logits, k, score_function=score)
        got = S.fused_topk_with_score_function(logits, k, False, None, None, None, score, None)
        for a, b in zip(ref, got):
            assert (a.shape, a.dtype) == (b.shape, b.dtype)
    ref = mu.compute_routing_scores_for_aux_loss(logits, k, "softmax")
    got = S.fused_compute_score_for_moe_aux_loss(logits, k, "softmax")
    for a, b in zip(ref, got):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)


# ----------------------------------------------------------------- trace level (metatrace)


def fusion_job(fused, **parallel):
    return small_job(
        model={
            "num_experts": 4,
            "moe_router_topk": 2,
            "moe_ffn_hidden_size": 96,
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": 0.01,
        },
        parallel={"tp": 2, "ep": 2, "sequence_parallel": True, **parallel},
        implementation={
            "moe_grouped_gemm": True,
            "moe_permute_fusion": fused,
            "moe_router_fusion": fused,
        },
        training={"global_batch_size": 8, **BALANCED},
        cluster={"num_gpus": 4},
    )


def _layer0_mlp_saved(job):
    from metatrace.tracing.trace import trace_role
    from metatrace.world import World

    world = World.from_job(job)
    rt = trace_role(job, world, world.roles()[-1])
    seen = {}
    for s in rt.trace.saved:
        if not s.static and s.module.startswith("decoder.layers.0.mlp"):
            seen.setdefault(s.storage, s.bytes)
    return sum(seen.values())


def rounded(n):
    return -(-n // 512) * 512


def test_trace_saved_difference_is_the_closed_form():
    """alltoall, tp 2 (SP), ep 2, etp 1, 4 experts (2 local), topk 2, aux loss: per MoE layer the
    fused path saves row_id_map int32 [T, 2E+1] and two int32 [M] chunk-sort maps instead of
    the unfused permute's bool mask [E, T], probs copy [E, T] and int64 [T k] indices; the fused
    router saves bool [T, E] + fp32 [T, E] (top-k) + fp32 [T, E] (aux scores) + fp32 [2]
    instead of int64 [T, k] + fp32 [T, k] (top-k) + fp32 [T, E] + int64 [T, k] (aux).
    megatron-core 0.19's unfused permute sorts the whole map instead of selecting from it: the
    probabilities' gather keeps the int64 argsort [E T] and the tokens' the int64 [T k] indices
    in place of the mask, the probabilities' copy and the indices."""
    T, E, k = 64 * 2 // 2, 4, 2  # s*b/tp
    M = T * k  # received per rank under balanced routing (etp 1)
    jobs = [fusion_job(f, etp=1, moe_token_dispatcher_type="alltoall") for f in (False, True)]
    p = 2  # probs bf16 (no moe_router_dtype)
    if guards.since(0, 19):
        permute = rounded(8 * E * T) + rounded(8 * T * k)
    else:
        permute = rounded(E * T) + rounded(E * T * p) + rounded(8 * T * k)
    unfused = (
        permute + rounded(8 * T * k) + rounded(4 * T * k) + rounded(4 * T * E) + rounded(8 * T * k)
    )
    fused = (
        rounded(4 * T * (2 * E + 1))
        + 2 * rounded(4 * M)
        + rounded(T * E)
        + 2 * rounded(4 * T * E)
        + rounded(8)
    )
    assert _layer0_mlp_saved(jobs[1]) - _layer0_mlp_saved(jobs[0]) == fused - unfused


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_fused_meta_matches_real_cpu_tensors(dispatcher):
    """With both fusions on, the meta trace and a real CPU run keep the same tensors and issue
    the same collectives: megatron-core's fused path reads no value metatrace does not supply."""
    from metatrace.world import World
    from tests.helpers import assert_meta_matches_real

    job = fusion_job(True, moe_token_dispatcher_type=dispatcher)
    world = World.from_job(job)
    assert_meta_matches_real(job, world, world.roles()[0])


# ---------------------------------------------------------------- what the kernels take


def _ps(*nbytes):
    from metatrace.config.kernels import kernel_model, memory_seconds

    return sum(round(memory_seconds(kernel_model("h100"), n) * 1e12) for n in nbytes)


def test_permutation_kernels_move_their_closed_form_bytes():
    """TE's Triton permutation (permutation.py): make_row_id_map's three passes over the
    [T, 2E+1] int32 map, the permute kernel reading each token once and writing its k rows, the
    backward summing them back; unpermute with merging probabilities reads its forward input
    again in the backward; a chunk sort moves every row each way."""
    from metatrace.config.kernels import LAUNCH_SECONDS

    T, h, E, k = 2048, 512, 8, 2
    N, b, f = T * k, 2, 4
    x = torch.empty(T, h, dtype=BF16, device="meta", requires_grad=True)
    probs = torch.empty(T, E, dtype=FP32, device="meta", requires_grad=True)
    rmap = torch.empty(T, E, dtype=torch.bool, device="meta")
    out = {}

    def permute():
        out["p"] = S.moe_permute_with_probs(x, probs, rmap, N)

    row_map = 3 * 4 * T * (2 * E + 1) + T * E + 4 * E * 2  # + the [E, T/1024] workspace
    passes = 2 * round(LAUNCH_SECONDS * 1e12)  # the map's three kernels: two more fixed costs
    assert priced(permute) == (_ps(row_map, T * h * b + N * h * b + 2 * N * f) + passes, 4)
    o, pp, row_id = out["p"]
    back = priced(
        lambda: torch.autograd.backward([o, pp], [torch.empty_like(o), torch.empty_like(pp)])
    )
    assert back == (_ps(N * h * b + T * h * b + N * f + T * E * f), 1)

    inp = torch.empty(N, h, dtype=BF16, device="meta", requires_grad=True)
    merge = torch.empty(T, E, dtype=FP32, device="meta", requires_grad=True)

    def unpermute():
        out["u"] = S.moe_unpermute(inp, row_id, merging_probs=merge, restore_shape=(T, h))

    assert priced(unpermute) == (_ps(N * h * b + T * h * b + T * E * f), 1)
    back = priced(lambda: out["u"].backward(torch.empty_like(out["u"])))
    assert back == (_ps(T * h * b + N * h * b + N * h * b + 2 * T * E * f), 1)

    y = torch.empty(N, h, dtype=BF16, device="meta", requires_grad=True)
    split, idx = torch.full((8,), N // 8), torch.arange(8)
    assert priced(lambda: out.update(s=S.moe_sort_chunks_by_index(y, split, idx))) == (
        _ps(4 * N, 2 * N * h * b),
        2,
    )
    assert priced(lambda: out["s"].backward(torch.empty_like(out["s"]))) == (
        _ps(2 * N * h * b),
        1,
    )
