"""megatron-core 0.16.1 raises at the first forward where a fused bias-activation kernel is
missing (mlp.py, moe/experts.py, fusions/fused_bias_swiglu.py); metatrace refuses those jobs
before tracing, with the setting that fixes them, and traces the ones that run."""

import pytest

from metatrace.errors import ConfigError
from tests.helpers import small_job

MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64}


@pytest.mark.parametrize(
    "model, impl, message",
    [
        # SequentialMLP and TEGroupedMLP apply the routing probabilities in the kernel.
        ({**MOE, "activation": "gelu", "add_bias_linear": True}, {}, "--no-bias-gelu-fusion"),
        (
            {**MOE, "activation": "gelu", "add_bias_linear": True},
            {"moe_grouped_gemm": True, "bias_dropout_fusion": False},
            "fuses the routing probabilities only into swiglu and quick_geglu",
        ),
        # weighted_bias_swiglu_impl takes no bias; TEGroupedMLP adds it in the GEMM.
        ({**MOE, "activation": "swiglu", "add_bias_linear": True}, {}, "takes no bias"),
        # The dense MLP has no quick-GEGLU kernel.
        ({"activation": "quick_geglu"}, {}, "quick_geglu in dense MLPs"),
        (
            {**MOE, "activation": "quick_geglu", "moe_shared_expert_intermediate_size": 64},
            {},
            "quick_geglu in shared experts",
        ),
    ],
)
def test_missing_fused_kernels_are_refused(model, impl, message):
    with pytest.raises(ConfigError, match=message):
        small_job(model=model, implementation=impl)


@pytest.mark.parametrize(
    "model, impl",
    [
        ({**MOE, "activation": "gelu", "add_bias_linear": True}, {"bias_activation_fusion": False}),
        ({**MOE, "activation": "gelu", "add_bias_linear": False}, {}),
        (
            {**MOE, "activation": "swiglu", "add_bias_linear": True},
            {"moe_grouped_gemm": True, "bias_dropout_fusion": False},
        ),
        ({**MOE, "activation": "quick_geglu", "add_bias_linear": True}, {}),
        ({"activation": "gelu", "add_bias_linear": True}, {}),
    ],
)
def test_jobs_megatron_runs_are_accepted(model, impl):
    job = small_job(model=model, implementation=impl)
    # GeLU without biases has no fused kernel: Megatron-LM turns it off.
    assert job.bias_activation_fusion == (
        impl.get("bias_activation_fusion", True)
        and (model["activation"] != "gelu" or model["add_bias_linear"])
    )
