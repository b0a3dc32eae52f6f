"""The megatron-core config fields that 0.19.2 adds to 0.16.1, and what metatrace does with each.

`TransformerConfig` (with `ModelParallelConfig`'s fields), `OptimizerConfig` and
`DistributedDataParallelConfig` of megatron-core 0.19.2 have 93 fields that 0.16.1's have not
(bench/megatron_fields.py lists them from the two releases' sources). Megatron-LM sets most of
them from a flag of the same meaning: such a field takes that flag's class
(metatrace.config.megatron.flags), so that the two tables cannot disagree. The others are set by
Megatron-LM's training code from other flags, or only by programs that build the configs
themselves (Megatron-Bridge); they are classed here, each from where megatron-core 0.19.2 reads
it. The classes are the flags' (modelled, no_effect, not_modelled); none is refused.

Known limitations: megatron-core 0.16.1, the release metatrace traces, has none of these fields;
the table says what a job that sets them would need, it changes nothing in a trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from metatrace.config.megatron.flags import FLAGS, Class, Direction

Config = Literal["TransformerConfig", "OptimizerConfig", "DistributedDataParallelConfig"]


@dataclass(frozen=True)
class Field:
    """One field new in megatron-core 0.19.2, and its class."""

    config: Config
    name: str
    cls: Class
    reason: str
    """As a flag's: the job key or "derived", why it has no effect, or the feature."""
    direction: Direction | None = None
    flag: str | None = None
    """The Megatron-LM flag that sets it, whose class it takes; None: classed here."""


_TC = "TransformerConfig"
_OPT = "OptimizerConfig"
_DDP = "DistributedDataParallelConfig"

# config -> "field:flag" (or "field" where the flag is --field-with-dashes), the flag whose class
# the field takes.
_BY_FLAG: dict[Config, str] = {
    "TransformerConfig": (
        "tensor_parallel_num_weight_shards expert_tensor_parallel_num_weight_shards "
        "overlap_dispatch_backward_with_experts_wgrad cpu_offloading_retain_pinned_cpu_buffers "
        "mtp_use_repeated_layer mtp_detach_heads mtp_hybrid_override_pattern "
        "flash_attention_version dsa_indexer_topk_freq dsa_indexer_skip_topk_offset "
        "dsa_kernel_backend dsa_indexer_rope_interleaved "
        "dsa_indexer_rotate_activation:--no-dsa-indexer-rotate-activation "
        "dsa_indexer_scoring_relu:--no-dsa-indexer-scoring-relu dsa_indexer_k_norm_epsilon "
        "dsa_indexer_k_norm_fp32 use_mup mup_width_mult mup_base_hidden_size mup_embedding_mult "
        "mup_output_mult mup_base_head_dim mup_attn_scale_power fused_residual_rmsnorm "
        "use_transformer_engine_op_fuser fp8_output_proj high_priority_a2a_comm_stream "
        "use_grouped_gemm_for_shared_expert moe_shared_expert_glu_interleave_size "
        "moe_router_quantile_balancing_ema moe_router_force_biased use_grouped_gemm_for_dense_mlp "
        "moe_single_grouped_weight moe_single_grouped_bias moe_permute_fusion_into_hybridep "
        "moe_hybridep_pad_uneven_dispatch_inputs moe_pad_experts_for_cuda_graph_inference "
        "moe_flex_dispatcher_num_sms moe_hybridep_num_blocks_permute "
        "moe_hybridep_num_blocks_unpermute moe_hybridep_num_sms_preprocessing "
        "moe_ncclep_static_shape moe_ncclep_zero_copy moe_mlp_glu_interleave_size "
        "moe_expert_rank_capacity_factor cuda_graph_modules inference_cuda_graph_scope "
        "nccl_all_reduce_for_prefill inference_disable_triton_nvls_kernels "
        "inference_grouped_gemm_backend inference_moe_disable_fused_quant_kernels "
        "inference_moe_token_dispatcher_type mamba_training_ssm_states_dtype "
        "mlp_chunks_for_training delay_offload_until_cuda_graph "
        "delta_offload_bytes_across_pp_ranks activation_offload_fraction moe_paged_stash "
        "moe_paged_stash_page_size moe_paged_stash_buffer_size_factor_cuda "
        "moe_paged_stash_buffer_size_factor_cpu fine_grained_offloading_max_inflight_offloads"
    ),
    "OptimizerConfig": (
        "muon_nesterov muon_coefficient_type muon_scalar_optimizer lion_beta1 lion_beta2 "
        "optimizer_cuda_graph"
    ),
    "DistributedDataParallelConfig": (
        "num_buckets:--ddp-num-buckets "
        "param_name_patterns_for_fp32_local_accumulation:"
        "--ddp-param-name-patterns-for-fp32-local-accumulation "
        "fp4_param_gather fsdp_db_use_persist_buf_on_alloc_fail megatron_fsdp_main_params_dtype "
        "megatron_fsdp_main_grads_dtype megatron_fsdp_grad_comm_dtype "
        "megatron_fsdp_enable_fine_grained_param_gather megatron_fsdp_max_pool_double_buffer"
    ),
}

_SCALARS = "learning rate, weight decay, loss scale and optimizer hyper-parameters: scalars"
_GTP = "GTP weight rematerialisation (weights sharded beyond TP)"
_FSDP = "FSDP options"
_OPTIMIZERS = "the SOAP and adaptive-Muon optimizers' options"

# Fields no flag sets as it is: (config, field, class, reason, direction).
_OWN: tuple[tuple[Config, str, Class, str, Direction | None], ...] = (
    # validate_args derives them from --(expert-)tensor-parallel-num-weight-shards
    (_TC, "gtp_weight_remat_size", "not_modelled", _GTP, "either"),
    (_TC, "expert_gtp_weight_remat_size", "not_modelled", _GTP, "either"),
    # schedules.py: scalars the MoE auxiliary and MTP losses' gradients are multiplied by
    (_TC, "moe_grad_scale_func", "no_effect", "values only: the same tensors and shapes", None),
    (_TC, "mtp_grad_scale_func", "no_effect", "values only: the same tensors and shapes", None),
    (
        _TC,
        "experimental_attention_variant_loss_scale_func",
        "no_effect",
        "values only: the same tensors and shapes",
        None,
    ),
    # optimizer/__init__.py: hyper-parameters of optimizers metatrace does not model
    (_OPT, "soap_shampoo_beta", "no_effect", _SCALARS, None),
    (_OPT, "adaptive_muon_beta2", "no_effect", _SCALARS, None),
    (_OPT, "adaptive_muon_eps", "no_effect", _SCALARS, None),
    # ... and their variants (KL-Shampoo's and the second-moment method's own state)
    (_OPT, "soap_precondition_frequency", "not_modelled", _OPTIMIZERS, "either"),
    (_OPT, "soap_use_kl_shampoo", "not_modelled", _OPTIMIZERS, "either"),
    (_OPT, "adaptive_muon_moment2_method", "not_modelled", _OPTIMIZERS, "either"),
    # validate_args sets it for --optimizer muon/lion/soap/... with --use-distributed-optimizer
    # (and dist_muon): LayerWiseDistributedOptimizer in place of megatron-core's own
    (
        _OPT,
        "use_layer_wise_distributed_optimizer",
        "not_modelled",
        "the layer-wise distributed optimizer (of Muon, Lion, SOAP)",
        "either",
    ),
    # optimizer.py: the step is skipped when the gradient norm exceeds it
    (_OPT, "grad_norm_skip_threshold", "no_effect", _SCALARS, None),
    # training.py get_megatron_ddp_config: set from --use-precision-aware-optimizer and
    # --cuda-graph-impl under Megatron-FSDP, read by megatron_fsdp's buffers
    (_DDP, "megatron_fsdp_use_decoupled_grad", "not_modelled", _FSDP, "either"),
    (_DDP, "megatron_fsdp_cuda_graph_mode", "not_modelled", _FSDP, "either"),
    (_DDP, "fsdp_all_gather_in_start_param_sync", "not_modelled", _FSDP, "either"),
)


def _build() -> tuple[Field, ...]:
    out = []
    for config, text in _BY_FLAG.items():
        for item in text.split():
            name, _, flag = item.partition(":")
            flag = flag or "--" + name.replace("_", "-")
            spec = FLAGS[flag]
            out.append(Field(config, name, spec.cls, spec.reason, spec.direction, flag))
    out += [Field(c, n, cls, reason, direction) for c, n, cls, reason, direction in _OWN]
    return tuple(out)


FIELDS_0_19_2: tuple[Field, ...] = _build()
"""Every field of TransformerConfig, OptimizerConfig and DistributedDataParallelConfig that
megatron-core 0.19.2 has and 0.16.1 has not, with its class."""
