"""Keys that act only with a setting the job does not have (checks.idle_keys): the job is
described without them, as Megatron-LM ignores their flags, and a note says so; nothing is
refused for them."""

import dataclasses
from types import SimpleNamespace

import pytest

from metatrace.errors import ConfigError
from metatrace.render.summary import build_assumptions
from tests.helpers import MLA, MOE, small_job

B200 = {"cluster": {"gpu": "b200"}}
FP4 = {"training": {"precision": "fp4"}, **B200}


@pytest.mark.parametrize(
    "base, given, note",
    [
        (
            {},
            {"model": {"moe_router_num_groups": 4}, "training": {"moe_hottest_expert_load": 2}},
            "model.moe_router_num_groups, training.moe_hottest_expert_load change nothing "
            "without mixture-of-experts layers (model.num_experts): ignored",
        ),
        (
            {},
            {
                "model": {
                    "moe_router_score_function": "sigmoid",
                    "moe_router_enable_expert_bias": True,
                    "moe_aux_loss_coeff": 0.01,
                }
            },
            "model.moe_router_score_function, model.moe_aux_loss_coeff, "
            "model.moe_router_enable_expert_bias change nothing without mixture-of-experts "
            "layers (model.num_experts): ignored",
        ),
        (
            {"model": MOE, "parallel": {"ep": 2}, "cluster": {"num_gpus": 2}},
            {"parallel": {"moe_flex_dispatcher_backend": "hybridep"}},
            "parallel.moe_flex_dispatcher_backend changes nothing without "
            "parallel.moe_token_dispatcher_type flex: ignored",
        ),
        (
            {},
            {"model": {"kv_lora_rank": 64}},
            "model.kv_lora_rank changes nothing without model.multi_latent_attention: ignored",
        ),
        (
            {},
            {"model": {"mamba_state_dim": 64, "mamba_num_heads": 8}},
            "model.mamba_state_dim, model.mamba_num_heads change nothing without Mamba-2 "
            "layers (M in model.hybrid_layer_pattern): ignored",
        ),
        (
            {},
            {"model": {"linear_num_key_heads": 8}},
            "model.linear_num_key_heads changes nothing without Gated DeltaNet layers",
        ),
        (
            {"model": MOE},
            {
                "model": {"moe_shared_expert_gate": True},
                "parallel": {"moe_shared_expert_overlap": True},
            },
            "parallel.moe_shared_expert_overlap, model.moe_shared_expert_gate change nothing "
            "without shared experts (model.moe_shared_expert_intermediate_size): ignored",
        ),
        (
            {
                "model": MOE,
                "training": {"moe_routing": "capacity", "moe_expert_capacity_factor": 1.0},
            },
            {"training": {"moe_hottest_expert_load": 2.0}},
            "training.moe_hottest_expert_load changes nothing without balanced routing: ignored",
        ),
        (
            {"parallel": {"cp": 2}, "cluster": {"num_gpus": 2}},
            {"parallel": {"hierarchical_cp_sizes": [2, 1]}},
            "parallel.hierarchical_cp_sizes changes nothing without parallel.cp_comm_type "
            "a2a+p2p: ignored",
        ),
        (
            {"model": MLA, "implementation": {"transformer_impl": "local"}},
            {"model": {"mla_down_proj_fusion": True}},
            "model.mla_down_proj_fusion changes nothing without "
            "implementation.transformer_impl transformer_engine: ignored",
        ),
        (
            {"training": {"recompute": {"granularity": "selective", "modules": ["core_attn"]}}},
            {"training": {"recompute": {"modules": ["core_attn", "moe", "shared_experts"]}}},
            "training.recompute.modules 'moe', 'shared_experts' change nothing without "
            "mixture-of-experts layers (model.num_experts): ignored",
        ),
        (
            {"training": {"recompute": {"granularity": "selective", "modules": ["core_attn"]}}},
            {
                "training": {"recompute": {"modules": ["core_attn", "moe_act"]}},
                "implementation": {"moe_grouped_gemm": True},
            },
            "training.recompute.modules 'moe_act' changes nothing without mixture-of-experts",
        ),
        (
            {"implementation": {"transformer_impl": "local"}},
            {"implementation": {"attention_backend": "flash"}},
            "implementation.attention_backend changes nothing without "
            "implementation.transformer_impl transformer_engine: ignored",
        ),
        (
            {"model": {"preset": "nemotron-h-8b"}},
            {"model": {"qk_layernorm": True}},
            "model.qk_layernorm changes nothing without a GPT model's attention: ignored",
        ),
        (
            {},
            {"parallel": {"microbatch_group_size": 2, "overlap_p2p_comm": True}},
            "parallel.microbatch_group_size, parallel.overlap_p2p_comm change nothing without "
            "parallel.vpp: ignored",
        ),
        (
            {},
            {"training": {"recompute": {"method": "uniform", "num_layers": 1}}},
            "training.recompute.method, training.recompute.num_layers change nothing without "
            "training.recompute.granularity: ignored",
        ),
        (
            {
                "training": {
                    "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}
                }
            },
            {"training": {"recompute": {"modules": ["mlp"]}}},
            "training.recompute.modules changes nothing without selective recompute: ignored",
        ),
        (
            {},
            {"training": {"fp8_recipe": "delayed", "fp8_format": "e4m3"}},
            "training.fp8_format, training.fp8_recipe change nothing without "
            "training.precision fp8: ignored",
        ),
        (
            {"training": {"precision": "fp8", "fp8_recipe": "tensorwise"}},
            {"training": {"fp8_amax_history_len": 16}},
            "training.fp8_amax_history_len changes nothing without training.precision fp8 with "
            "fp8_recipe delayed: ignored",
        ),
        (
            {},
            {"training": {"first_last_layers_bf16": True, "num_layers_at_end_in_bf16": 0}},
            "training.first_last_layers_bf16 changes nothing without training.precision fp8 "
            "or fp4: ignored",
        ),
        (
            FP4,
            {"training": {"num_layers_at_end_in_bf16": 0}},
            "training.num_layers_at_end_in_bf16 changes nothing without "
            "training.first_last_layers_bf16: ignored",
        ),
        (
            B200,
            {"training": {"fp4_recipe": "nvfp4"}},
            "training.fp4_recipe changes nothing without training.precision fp4: ignored",
        ),
        (
            {},
            {"model": {"mtp_use_repeated_layer": True}},
            "model.mtp_use_repeated_layer changes nothing without model.mtp_num_layers",
        ),
        (
            {},
            {"model": {"window_attn_skip_freq": 2}},
            "model.window_attn_skip_freq changes nothing without model.window_size: ignored",
        ),
        (
            {"model": {"activation": "gelu", "add_bias_linear": False}},  # no fused kernel
            {"model": {"glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0}},
            "model.activation_func_clamp_value, model.glu_linear_offset change nothing without "
            "a gated activation",
        ),
        (
            {},
            {"training": {"cuda_graph_scope": ["attn"]}},
            "training.cuda_graph_scope changes nothing without training.cuda_graph_impl",
        ),
        (
            {},
            {"training": {"fsdp_double_buffer": True, "fsdp_communication_unit_size": 1000}},
            "training.fsdp_double_buffer, training.fsdp_communication_unit_size change nothing "
            "without training.megatron_fsdp: ignored",
        ),
        (
            {},
            {"training": {"min_offloaded_tensor_size": 4096, "activation_offload_fraction": 0.5}},
            "training.min_offloaded_tensor_size, training.activation_offload_fraction change "
            "nothing without training.activation_offload_modules: ignored",
        ),
        (
            {},
            {"parallel": {"tp_comm_overlap_ag": False}},
            "parallel.tp_comm_overlap_ag changes nothing without parallel.tp_comm_overlap",
        ),
        (
            {},
            {"training": {"optimizer_offload_fraction": 0.5}},
            "training.optimizer_offload_fraction changes nothing without "
            "training.optimizer_cpu_offload: ignored",
        ),
    ],
)
def test_a_key_without_what_it_acts_with_is_noted_and_changes_nothing(base, given, note):
    plain = small_job(**base)
    sections = {name: dict(values) for name, values in base.items()}
    for name, values in given.items():
        section = sections.setdefault(name, {})
        for key, value in values.items():
            section[key] = {**section.get(key, {}), **value} if isinstance(value, dict) else value
    job = small_job(**sections)
    assert any(note in n for n in job.notes), job.notes
    # Described exactly as without the keys: every value downstream is the plain job's.
    assert dataclasses.replace(job, notes=()) == dataclasses.replace(plain, notes=())
    # And the summary says it, not only --detail.
    shown = build_assumptions(SimpleNamespace(job=job)).plain
    assert note.split(" change")[0] in shown


def test_a_key_with_what_it_acts_with_is_kept():
    job = small_job(training={"precision": "fp8", "fp8_recipe": "tensorwise"})
    assert job.training.fp8_recipe == "tensorwise"
    assert not [n for n in job.notes if "ignored" in n]


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"model": {"moe_ffn_hidden_size": 64}}, "model.moe_ffn_hidden_size needs mixture-of"),
        ({"model": {"moe_router_enable_expert_bias": True}}, "expert_bias needs mixture-of"),
        ({"model": {"moe_router_topk": 1}}, "model.moe_router_topk needs mixture-of"),
        (
            {
                "model": {"moe_router_load_balancing_type": "sinkhorn"},
                "training": {"moe_expert_capacity_factor": 1.0},
            },
            "training.moe_expert_capacity_factor needs mixture-of-experts layers",
        ),
        (
            {"training": {"recompute": {"granularity": "selective", "modules": ["moe_act"]}}},
            "'moe_act' needs mixture-of-experts layers",
        ),
        ({"training": {"moe_routing": "capacity"}}, "training.moe_routing needs mixture-of"),
        (
            {"training": {"fp8_param_gather": True, "distributed_optimizer": True}},
            "fp8_param_gather applies with training.precision: fp8 only",
        ),
        ({"model": {"mla_down_proj_fusion": True}}, "needs model.multi_latent_attention"),
        (
            {"training": {"recompute": {"distribute_saved_activations": True}}},
            "distribute_saved_activations needs training.recompute.granularity",
        ),
    ],
)
def test_what_megatron_refuses_is_not_idle(sections, message):
    """megatron-core or Megatron-LM refuse these without the setting they act with, whatever
    else is given: metatrace refuses them too."""
    with pytest.raises(ConfigError, match=message):
        small_job(**sections)
