"""training.optimizer_impl: torch.optim's AdamW (megatron-core's fallback without Transformer
Engine and Apex) against the fused stand-ins: its foreach step's sqrt of every second moment is
one temporary the size of the optimizer's parameters, which sets the peak when activations are
small (full recompute), and megatron-core running for real on the CPU allocates the same."""

import pytest

from metatrace.config import resolve
from metatrace.tracing.measure import measure_rank, predict
from tests.helpers import small_job

FULL = {"recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}}
MODEL = {
    "num_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 8,
    "ffn_hidden_size": 1024,
    "vocab_size": 2000,
}


def job(impl):
    return resolve(
        small_job(
            implementation={"transformer_impl": "local"},
            model=MODEL,
            training={"optimizer_impl": impl, "global_batch_size": 4, **FULL},
        )
    )


def test_torch_adamw_holds_a_temporary_of_every_main_parameter_in_its_step():
    from metatrace.analysis.memory import role_memory
    from metatrace.tracing.trace import trace_job

    fused, torch_ = (trace_job(job(impl), full_model=False).roles[0] for impl in ("te", "torch"))
    te, torch_memory = (role_memory(rt.trace, rt.iteration) for rt in (fused, torch_))
    assert te.peak_at.phase == "backward" and torch_memory.peak_at.phase == "optimizer"
    # The fp32 main parameters, one 512-byte block each at least, as the sqrt list holds them.
    sizes = [
        -(-p.numel * 4 // 512) * 512
        for m in torch_.trace.modules
        for p in m.params
        if not p.embedding_copy
    ]
    assert len(sizes) > 10
    # above the static memory at the step: the sqrt list (measured: 19,300,352 of 19,309,568)
    assert torch_memory.peak - torch_memory.static == pytest.approx(sum(sizes), abs=16384)
    assert te.peak - te.static < sum(sizes) / 5  # the fused step allocates nothing of the kind


def test_megatron_core_running_torch_adamw_on_the_cpu_allocates_what_is_predicted():
    j = job("torch")
    predicted = predict(j, 0)
    measured = measure_rank(j, 0, iterations=3, device="cpu")
    # measured: 106,351,104 against 106,334,208 predicted (-0.02 %)
    assert predicted.peak - predicted.cuda_only == pytest.approx(measured.peak_blocks, rel=0.001)
