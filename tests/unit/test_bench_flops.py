"""bench/throughput.py's FLOP formula (Megatron-LM's num_floating_point_operations), which turns
a published TFLOP/s into the step time the time model is checked against."""

import importlib.util
import os

import pytest

from metatrace.config import job_from_dict

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "throughput.py")


@pytest.fixture(scope="module")
def throughput():
    spec = importlib.util.spec_from_file_location("throughput_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("preset", ["llama3-8b", "mixtral-8x7b", "gpt3-175b"])
def test_megatron_flops_are_six_per_matmul_parameter_and_token(throughput, preset):
    """Without the attention scores, 6 FLOPs per token for every weight of the layers' matrix
    products (SwiGLU: three matrices of h x ffn; experts: the top-k routed to) and the output
    layer's."""
    job = job_from_dict(
        {
            "model": {"preset": preset},
            "training": {"seq_length": 2048, "global_batch_size": 2},
            "cluster": {"num_gpus": 1},
        }
    )
    m = job.model
    h, d, heads = m.hidden_size, m.kv_channels, m.num_attention_heads
    groups = m.num_query_groups or heads
    matrices = 3 if m.activation == "swiglu" else 2
    ffn = m.moe_ffn_hidden_size * m.moe_router_topk if m.num_experts else m.ffn_hidden_size
    layer = h * (heads + 2 * groups) * d + heads * d * h + matrices * h * ffn
    per_token = 6 * (m.num_layers * layer + job.padded_vocab_size * h)
    scores = 12 * m.num_layers * h * h * 2048 / h * (heads * d / h)  # not halved (core_r0.8)
    tokens = 2 * 2048
    assert throughput.megatron_flops(job) == pytest.approx(tokens * (per_token + scores), rel=1e-9)
