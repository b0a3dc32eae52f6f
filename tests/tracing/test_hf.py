"""Hugging Face config.json files traced: the published parameter counts of dense models."""

import pytest

from metatrace.analysis import aggregate as agg
from metatrace.config.hf import read_hf_config
from metatrace.tracing.trace import trace_job
from tests.helpers import hf_job, hf_path


@pytest.mark.parametrize(
    "repo, published",
    [
        ("Meta-Llama-3-8B", 8_030_261_248),
        ("Mistral-7B-v0.1", 7_241_732_096),
        ("Qwen2-7B", 7_615_616_512),  # q, k, v biases
        ("Qwen3-8B", 8_190_735_360),  # per-head q / k norms, head_dim 128
    ],
)
def test_dense_totals_are_the_published_counts(repo, published):
    # The count is linear in the layers (identical layers between the embedding and the output
    # layer), so a 2-layer model of the same dimensions is traced (tp 1: no vocabulary padding,
    # every vocabulary here is a multiple of 128) and its per-layer count is scaled:
    #   total(L) = total(2) + (L - 2) * layer.
    # Both traced layers must hold the same count, or the scaling would not hold.
    layers = read_hf_config(hf_path(repo))[0]["num_layers"]
    job = hf_job(repo, model={"num_layers": 2})
    assert job.padded_vocab_size == job.model.vocab_size
    (rt,) = trace_job(job, full_model=False, workers=1).roles
    per_layer = {1: 0, 2: 0}
    for m in rt.trace.modules:
        if m.layer is not None:
            per_layer[m.layer] += sum(p.numel for p in m.params)
    assert per_layer[1] == per_layer[2] > 0
    total = agg.model_params([rt.trace], tp=1) + (layers - 2) * per_layer[1]
    assert total == published
