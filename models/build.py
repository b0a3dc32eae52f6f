"""Build the model chunks one rank holds, as Megatron-LM's pretrain_gpt.py would, on meta.

`transformer_config(job)` maps a job to megatron-core's `TransformerConfig` the way Megatron-LM's
`core_transformer_config_from_args` does with its command-line defaults
(../shared/notes/megatron-args.md). `build_model_chunks(...)` must run inside a fake world
(`metatrace.hooks.fake_world`) and the CUDA remap (`metatrace.hooks.remap`), for the rank whose
chunks are wanted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback

import torch
import torch.nn.functional as F

from metatrace.config import release
from metatrace.config.hybrid import GDN
from metatrace.config.job import FSDP_DTYPES, OFFLOAD_KNOBS, changed_from_default
from metatrace.errors import ConfigError

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.bfloat16,  # FP8 GEMMs over bf16 parameters (--fp8-format with --bf16)
    "fp4": torch.bfloat16,  # NVFP4 GEMMs over bf16 parameters (--fp4-format with --bf16)
}


def _activations():
    from megatron.core.activations import squared_relu

    # Megatron-LM's --quick-geglu takes fused_bias_geglu's quick_gelu, the one TransformerConfig
    # and TEGroupedMLP compare with (activations.quick_gelu is another function).
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    # name -> (activation_func, gated_linear_unit)
    return {
        "gelu": (F.gelu, False),
        "swiglu": (F.silu, True),
        "geglu": (F.gelu, True),
        "quick_geglu": (quick_gelu, True),  # Megatron-LM's --quick-geglu
        "relu": (F.relu, False),
        "squared_relu": (squared_relu, False),
        "silu": (F.silu, False),
    }


_VERDICTS: dict = {}
"""{the arguments of a TransformerConfig or OptimizerConfig: megatron-core's refusal, or None}:
its checks read nothing else, so a process asks once (the planner checks thousands of layouts
that differ only in what the configs do not hold, such as dp and the micro-batch size)."""


def _arguments(config_class, fields: dict) -> tuple:
    """`fields` as a key of _VERDICTS (lists as tuples)."""

    def frozen(value):
        if isinstance(value, (list, tuple)):
            value = tuple(value)
            try:
                hash(value)
            except TypeError:
                return tuple(frozen(v) for v in value)
        return value

    return (
        config_class,
        # (most values are scalars, and the planner asks thousands of times: no call for them)
        tuple((k, frozen(v) if isinstance(v, (list, tuple)) else v) for k, v in fields.items()),
    )


def transformer_config(job, *, cuda_graphs: bool = False, check_only: bool = False):
    """megatron-core's TransformerConfig for `job`; megatron-core's own checks become ConfigError.
    The model is traced eagerly: its CUDA-graph settings are in the config only with
    `cuda_graphs` (megatron-core's checks of them, and the capture's static inputs:
    metatrace.tracing.graphs). `check_only`: the checks alone (None; remembered, _VERDICTS)."""
    from metatrace.hooks.guards import import_megatron_core

    import_megatron_core()  # before any other import of megatron-core: it defers torch.compile
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    m, par, tr, impl = job.model, job.parallel, job.training, job.implementation
    activation_func, gated = _activations()[m.activation]
    dtype = DTYPES[tr.precision]
    rec = tr.recompute
    fields = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        activation_func=activation_func,
        gated_linear_unit=gated,
        glu_linear_offset=m.glu_linear_offset,
        activation_func_clamp_value=m.activation_func_clamp_value,
        softmax_type=m.softmax_type,
        window_size=tuple(m.window_size) if m.window_size is not None else None,
        window_attn_skip_freq=m.window_attn_skip_freq,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp,
        sequence_parallel=par.sequence_parallel,
        tp_comm_overlap=par.tp_comm_overlap,
        tp_comm_overlap_ag=par.tp_comm_overlap_ag,
        tp_comm_overlap_rs=par.tp_comm_overlap_rs,
        tp_comm_overlap_rs_dgrad=par.tp_comm_overlap_rs_dgrad,
        tp_comm_bulk_dgrad=par.tp_comm_bulk_dgrad,
        tp_comm_bulk_wgrad=par.tp_comm_bulk_wgrad,
        num_layers_in_first_pipeline_stage=par.first_stage_layers,
        num_layers_in_last_pipeline_stage=par.last_stage_layers,
        account_for_embedding_in_pipeline_split=par.account_for_embedding,
        account_for_loss_in_pipeline_split=par.account_for_loss,
        pipeline_model_parallel_layout=par.layout,
        bf16=tr.precision in ("bf16", "fp8", "fp4"),
        fp8=tr.fp8_format if tr.precision == "fp8" else None,
        fp8_recipe=tr.fp8_recipe or "delayed",
        fp8_param=tr.precision == "fp8" and tr.fp8_param_gather,
        fp8_amax_history_len=tr.fp8_amax_history_len,
        fp4="e2m1" if tr.precision == "fp4" else None,
        fp4_recipe=tr.fp4_recipe or "nvfp4",
        first_last_layers_bf16=tr.first_last_layers_bf16,
        num_layers_at_start_in_bf16=tr.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=tr.num_layers_at_end_in_bf16,
        fp16=tr.precision == "fp16",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        recompute_granularity=rec.granularity,
        recompute_method=rec.method,
        recompute_num_layers=rec.num_layers,
        recompute_modules=rec.modules,
        distribute_saved_activations=rec.distribute_saved_activations,
        # Fine-grained activation offloading: megatron-core checks the module names and that
        # attn_proj comes with core_attn (transformer_config.py, __post_init__).
        fine_grained_activation_offloading=bool(tr.activation_offload_modules),
        offload_modules=list(tr.activation_offload_modules or ()),
        min_offloaded_tensor_size=tr.min_offloaded_tensor_size,
        # Layer-wise offloading through Transformer Engine (Megatron-LM: activations only; the
        # weights' option does nothing in TE 2.8).
        cpu_offloading=tr.cpu_offloading_num_layers > 0,
        cpu_offloading_num_layers=tr.cpu_offloading_num_layers,
        cpu_offloading_activations=True,
        cpu_offloading_weights=False,
        transformer_impl=impl.transformer_impl,
        attention_backend=AttnBackend[job.attention_kernel],
        # With yarn's concentration factor != 1 megatron-core's apply_rotary_pos_emb falls back
        # to the unfused RoPE itself (rope_utils.py, "mscale=... is not supported").
        apply_rope_fusion=impl.rope_fusion and m.position_embedding_type in ("rope", "yarn"),
        cross_entropy_loss_fusion=impl.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=impl.cross_entropy_fusion_impl,
        cp_comm_type=par.cp_comm_type if par.cp > 1 else None,
        hierarchical_context_parallel_sizes=par.hierarchical_cp_sizes,
        # Megatron-LM command-line defaults.
        bias_activation_fusion=job.bias_activation_fusion,
        masked_softmax_fusion=impl.masked_softmax_fusion,
        bias_dropout_fusion=impl.bias_dropout_fusion,
        attention_softmax_in_fp32=impl.attention_softmax_in_fp32
        or impl.apply_query_key_layer_scaling,
        apply_query_key_layer_scaling=impl.apply_query_key_layer_scaling,
        calculate_per_token_loss=tr.calculate_per_token_loss,
        deallocate_pipeline_outputs=True,
        overlap_p2p_comm=bool(par.overlap_p2p_comm),
        batch_p2p_comm=not par.overlap_p2p_comm,
        overlap_p2p_comm_warmup_flush=par.overlap_p2p_comm_warmup_flush,
        microbatch_group_size_per_vp_stage=par.microbatch_group_size,
        gradient_accumulation_fusion=tr.gradient_accumulation_fusion,
        defer_embedding_wgrad_compute=tr.defer_embedding_wgrad_compute,
        wgrad_deferral_limit=tr.wgrad_deferral_limit,
        persist_layer_norm=False,
        # Mixture of experts (inert for dense models).
        num_moe_experts=m.num_experts,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size if m.num_experts else None,
        moe_router_topk=m.moe_router_topk,
        moe_layer_freq=m.moe_layer_freq if m.num_experts else 1,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=m.moe_shared_expert_gate,
        moe_shared_expert_overlap=par.moe_shared_expert_overlap,
        overlap_moe_expert_parallel_comm=par.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=par.delay_wgrad_compute,
        moe_router_score_function=m.moe_router_score_function,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_router_num_groups=m.moe_router_num_groups,
        moe_router_group_topk=m.moe_router_group_topk,
        moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_z_loss_coeff=m.moe_z_loss_coeff,
        moe_token_dispatcher_type=par.moe_token_dispatcher_type,
        moe_flex_dispatcher_backend=par.moe_flex_dispatcher_backend,
        moe_deepep_num_sms=par.moe_deepep_num_sms,
        moe_grouped_gemm=impl.moe_grouped_gemm,
        moe_permute_fusion=impl.moe_permute_fusion,
        moe_router_fusion=impl.moe_router_fusion,
        moe_router_dtype=tr.moe_router_dtype,
        moe_router_padding_for_quantization=tr.moe_router_padding_for_quantization,
        moe_expert_capacity_factor=tr.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=tr.moe_routing == "capacity",
        # Multi-token prediction (inert without it).
        mtp_num_layers=m.mtp_num_layers,
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
        # Gated attention (Qwen3-Next) and LatentMoE (Nemotron 3 Super).
        attention_output_gate=m.attention_output_gate,
        moe_latent_size=m.moe_latent_size,
        # Hybrid models (Megatron-LM's --is-hybrid-model): Mamba-2 mixers' sizes.
        is_hybrid_model=m.hybrid_layer_pattern is not None,
        mamba_state_dim=m.mamba_state_dim,
        mamba_head_dim=m.mamba_head_dim,
        mamba_num_groups=m.mamba_num_groups,
        mamba_num_heads=m.mamba_num_heads,
        # Megatron-LM initialises (on meta it costs nothing); megatron-core only marks weights
        # `tensor_model_parallel` when it initialises them.
        perform_initialization=True,
        use_cpu_initialization=False,
    )
    if m.linear_attention_freq is not None:
        # Gated DeltaNet in a GPT model (megatron-core's experimental attention variant)
        fields.update(
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=m.linear_attention_freq,
        )
    if m.linear_attention_freq is not None or GDN in (m.hybrid_layer_pattern or ""):
        fields.update(
            linear_conv_kernel_dim=m.linear_conv_kernel_dim,
            linear_key_head_dim=m.linear_key_head_dim,
            linear_value_head_dim=m.linear_value_head_dim,
            linear_num_key_heads=m.linear_num_key_heads,
            linear_num_value_heads=m.linear_num_value_heads,
        )
    if cuda_graphs and tr.cuda_graph_impl != "none":
        fields.update(
            cuda_graph_impl=tr.cuda_graph_impl, cuda_graph_scope=tr.cuda_graph_scope or []
        )
    if m.mtp_use_repeated_layer:  # a 0.19 field (tracing.checks refuses it under 0.16.1)
        fields.update(mtp_use_repeated_layer=True)
    if m.mla_down_proj_fusion:  # as mtp_use_repeated_layer
        fields.update(mla_down_proj_fusion=True)
    # 0.19 fields (tracing.checks refuses other values than their defaults under 0.16.1).
    fields.update({key: getattr(tr, key) for key in changed_from_default(tr, OFFLOAD_KNOBS)})
    config_class = TransformerConfig
    if m.multi_latent_attention:
        # Megatron-LM's core_transformer_config_from_args switches the class for MLA.
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class = MLATransformerConfig
        fields.update(
            multi_latent_attention=True,
            q_lora_rank=m.q_lora_rank,
            kv_lora_rank=m.kv_lora_rank,
            qk_head_dim=m.qk_head_dim,
            qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
            v_head_dim=m.v_head_dim,
            rope_type=m.rope_type,
            rotary_base=m.rotary_base,
            rotary_percent=m.rotary_percent,
            rotary_scaling_factor=m.rotary_scaling_factor,
            original_max_position_embeddings=m.original_max_position_embeddings,
            beta_fast=m.beta_fast,
            beta_slow=m.beta_slow,
            mscale=m.mscale,
            mscale_all_dim=m.mscale_all_dim,
        )
    from metatrace.config import GPU_ARCH
    from metatrace.hooks.patches import megatron_patches

    key = _arguments(config_class, fields)
    if key in _VERDICTS:
        if _VERDICTS[key] is not None:
            raise ConfigError(_VERDICTS[key])
        if check_only:
            return None
    with megatron_patches():  # its checks look for the fused kernels metatrace stands in for
        try:
            config = config_class(**fields)
        except (ValueError, AssertionError, TypeError) as e:
            _VERDICTS[key] = f"megatron-core rejects this configuration: {e}"
            raise ConfigError(_VERDICTS[key]) from None
    _VERDICTS[key] = None
    if check_only:
        return None
    # What the Transformer Engine stand-ins choose by (FP8 layouts differ between Hopper and
    # Blackwell); not a megatron-core field.
    config.metatrace_gpu_arch = GPU_ARCH.get(job.cluster.gpu, "sm90")
    if m.position_embedding_type == "yarn":
        # megatron-core 0.16.1's GPTModel reads YaRN's settings as config attributes that
        # TransformerConfig does not declare (gpt_model.py, getattr(config, "yarn_...");
        # Megatron-Bridge's GPT-OSS provider declares them); attention.py's RoPE then scales q
        # and k by the concentration factor (_yarn_get_concentration_factor_from_config).
        config.yarn_rotary_scaling_factor = m.rotary_scaling_factor
        config.yarn_original_max_position_embeddings = m.original_max_position_embeddings
        config.yarn_beta_fast = m.beta_fast
        config.yarn_beta_slow = m.beta_slow
        config.yarn_mscale = m.mscale
        config.yarn_mscale_all_dim = m.mscale_all_dim
        config.yarn_correction_range_round_to_int = True  # values only
    # Megatron-FSDP's sharding strategy: FP8 weights are then TE's Float8Tensor as FSDP sees it.
    tr = job.training
    config.metatrace_fsdp_strategy = tr.fsdp_sharding_strategy if tr.megatron_fsdp else None
    # The TransformerConfig field of Megatron-LM after core_v0.16.1 (megatron-core 0.16.1 takes
    # it only as a spec argument); models.specs builds dense MLPs as TEFusedMLP with it.
    config.use_transformer_engine_op_fuser = job.implementation.te_op_fuser
    from metatrace.config.routing import Routing

    config.metatrace_routing = Routing.of_job(job)
    return config


def build_model_chunks(*, job, config, device="meta") -> list[torch.nn.Module]:
    """The GPTModel chunks of the simulated rank, wrapped as Megatron-LM's get_model wraps them.

    The steps, in this order (each needs the previous):
    1. the backend spec provider for `implementation.transformer_impl`, and from it the layer
       specs (megatron-core's structure, the provider's modules) and, on the chunk that holds
       them, the multi-token-prediction layers' spec;
    2. for every virtual stage v of this rank: its place in the pipeline (pre_process /
       post_process from megatron-core's parallel_state) and the number of layers it builds
       (megatron-core's get_num_layers_to_build, which applies uneven splits and layouts);
    3. GPTModel(vp_stage=v) on `device` (meta; the CPU to check meta against real tensors);
    4. the Float16Module wrapper for bf16/fp16, as Megatron-LM's get_model does.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from metatrace.models.specs import decoder_layer_specs, mtp_block_spec, provider_for

    m = job.model
    provider = provider_for(job.implementation.transformer_impl)
    chunks = []
    for v in range(job.parallel.vpp or 1):
        vp_stage = v if job.parallel.vpp else None
        # what GPTModel and the hybrid models take alike, as Megatron-LM's model providers
        # (pretrain_gpt.py, pretrain_mamba.py) give it
        common = dict(
            config=config,
            vocab_size=job.padded_vocab_size,
            max_sequence_length=m.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
            position_embedding_type=m.position_embedding_type,
            rotary_percent=m.rotary_percent,
            rotary_base=m.rotary_base,
        )
        if m.hybrid_layer_pattern is not None:
            from metatrace.models.hybrid import build_hybrid_model

            with torch.device(device), _refused_by_megatron_core():
                model = build_hybrid_model(job, provider, vp_stage, **common)
        else:
            block = TransformerBlockSubmodules(
                layer_specs=decoder_layer_specs(config, provider, vp_stage=vp_stage),
                layer_norm=provider.layer_norm(),
            )
            mtp_block = mtp_block_spec(config, provider, block, vp_stage=vp_stage)
            with torch.device(device), _refused_by_megatron_core():
                model = GPTModel(
                    transformer_layer_spec=block,
                    mtp_block_spec=mtp_block,
                    vp_stage=vp_stage,
                    **common,
                )
        if config.fp16 or config.bf16:
            model = Float16Module(config, model)
        chunks.append(model)
    return chunks


@contextlib.contextmanager
def _refused_by_megatron_core():
    """megatron-core's own assertions while its modules are built (a layer's checks of its
    dimensions, e.g. Gated DeltaNet's FP8 alignment of its input projection) are its refusal of
    the configuration: one message (ConfigError), not a traceback. An assertion raised outside
    megatron-core's sources is a defect here and propagates."""
    try:
        yield
    except AssertionError as e:
        raised_in = traceback.extract_tb(e.__traceback__)[-1].filename
        if os.path.join("megatron", "core", "") not in raised_in:
            raise
        raise ConfigError(f"megatron-core rejects this configuration: {e}") from None


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron's wrappers (Float16Module, DDP)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def single_gpu_job(job):
    """The same model and micro-batch on one GPU: no parallelism and no optimizer sharding (the
    "full model" view)."""
    par = dataclasses.replace(
        job.parallel,
        tp=1,
        pp=1,
        vpp=None,
        cp=1,
        ep=1,
        etp=1,
        dp=1,
        sequence_parallel=False,
        first_stage_layers=None,
        last_stage_layers=None,
        account_for_embedding=False,
        account_for_loss=False,
        layout=None,
        # megatron-core refuses the EP all-to-all overlap without expert parallelism; one GPU
        # has no all-to-alls to overlap.
        overlap_moe_expert_parallel_comm=False,
        delay_wgrad_compute=False,
        # and the flex dispatcher (DeepEP, HybridEP) without TP x EP > 1
        moe_token_dispatcher_type=(
            "alltoall"
            if job.parallel.moe_token_dispatcher_type == "flex"
            else job.parallel.moe_token_dispatcher_type
        ),
    )
    tr = dataclasses.replace(
        job.training,
        global_batch_size=job.training.micro_batch_size,
        num_distributed_optimizer_instances=1,  # one GPU: one instance
        defer_embedding_wgrad_compute=False,  # megatron-core refuses it without pipelining
    )
    # One GPU shards nothing: Megatron-FSDP there is DDP with a replicated optimizer. The view
    # is the eager model (no CUDA graphs' static buffers).
    tr = dataclasses.replace(tr, megatron_fsdp=False, cuda_graph_impl="none", cuda_graph_scope=None)
    if not tr.fp8_param_gather:
        # On one GPU the distributed optimizer shards nothing and the view shows no optimizer
        # state; megatron-core maps parameters to its buckets in O(buckets x parameters), which
        # takes minutes for a whole DeepSeek-V3 on one rank.
        tr = dataclasses.replace(
            tr,
            distributed_optimizer=False,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            overlap_param_gather_with_optimizer_step=False,
            # megatron-core's precision-aware optimizer (and the CPU offload on it) needs the
            # distributed optimizer.
            use_precision_aware_optimizer=False,
            main_grads_dtype="fp32",
            main_params_dtype="fp32",
            exp_avg_dtype="fp32",
            exp_avg_sq_dtype="fp32",
            optimizer_cpu_offload=False,
        )
    cl = dataclasses.replace(job.cluster, num_gpus=1)
    multiple = job.model.make_vocab_size_divisible_by
    padded = -(-job.model.vocab_size // multiple) * multiple
    return dataclasses.replace(
        job, parallel=par, training=tr, cluster=cl, padded_vocab_size=padded, num_microbatches=1
    )


_OPT_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": torch.uint8,  # Transformer Engine's FusedAdam keeps FP8 moments as uint8 data
}


def ddp_config(job):
    """megatron-core's DistributedDataParallelConfig as Megatron-LM's get_model fills it."""
    from megatron.core.distributed import DistributedDataParallelConfig

    tr = job.training
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=tr.grad_reduce_in_fp32,
        overlap_grad_reduce=tr.overlap_grad_reduce,
        overlap_param_gather=tr.overlap_param_gather,
        # Megatron-LM forces align_param_gather off without virtual pipeline stages.
        align_param_gather=tr.overlap_param_gather and job.parallel.vpp is not None,
        use_distributed_optimizer=tr.distributed_optimizer,
        num_distributed_optimizer_instances=tr.num_distributed_optimizer_instances,
        # Megatron-LM's --check-for-nan-in-loss-and-grad is on by default; the check reads
        # values (a norm per bucket) and allocates nothing that matters.
        check_for_nan_in_grad=False,
        # Megatron-LM fills the DDP config from its arguments by field name.
        delay_wgrad_compute=job.parallel.delay_wgrad_compute,
        bucket_size=tr.ddp_bucket_size,
        average_in_collective=tr.ddp_average_in_collective,
        pad_buckets_for_high_nccl_busbw=tr.ddp_pad_buckets_for_high_nccl_busbw,
        fp8_param_gather=tr.precision == "fp8" and tr.fp8_param_gather,
        use_megatron_fsdp=tr.megatron_fsdp,
        data_parallel_sharding_strategy=tr.fsdp_sharding_strategy
        if tr.megatron_fsdp
        else "no_shard",
        # Megatron-FSDP's options; the DDP config's own defaults without it.
        outer_dp_sharding_strategy=tr.fsdp_outer_sharding_strategy
        if tr.megatron_fsdp
        else "no_shard",
        fsdp_double_buffer=tr.megatron_fsdp and tr.fsdp_double_buffer,
        suggested_communication_unit_size=tr.fsdp_communication_unit_size
        if tr.megatron_fsdp
        else None,
        **_fsdp_dtypes(job),
    )


def _fsdp_dtypes(job) -> dict:
    """Megatron-FSDP's buffer and communication dtypes (megatron-core 0.19's DDP config fields;
    0.16.1 has none, and checks.check_with_megatron refuses them there), as Megatron-LM maps its
    flags ("auto" is None)."""
    if not release.since(0, 19):
        return {}
    dtypes = {"auto": None, **_OPT_DTYPES}
    return {f"megatron_{key}": dtypes[getattr(job.training, key)] for key in FSDP_DTYPES}


def wrap_ddp(job, config, chunks):
    """megatron-core's DistributedDataParallel around each chunk, as Megatron-LM's get_model
    wraps them: its contiguous gradient buffers (and parameter buffers with the distributed
    optimizer) are allocated here, and bucketing is off for every chunk after the first. With
    Megatron-FSDP, megatron-core's FullyShardedDataParallel instead (transformer layers as its
    units with optim_grads_params), which allocates its sharded buffers here."""
    from megatron.core.distributed import DistributedDataParallel

    wrapper = DistributedDataParallel
    if job.training.megatron_fsdp:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        wrapper = FullyShardedDataParallel
    with _refused_by_megatron_core():  # its DDP's own assertions about the configuration
        return [
            wrapper(
                config=config,
                ddp_config=ddp_config(job),  # MegatronFSDP writes its overlap settings into it
                module=chunk,
                disable_bucketing=index > 0
                or job.training.overlap_param_gather_with_optimizer_step,
            )
            for index, chunk in enumerate(chunks)
        ]


def is_fsdp(chunk) -> bool:
    """Whether `chunk` is wrapped in megatron-core's Megatron-FSDP."""
    return hasattr(chunk, "megatron_fsdp_dist_index")


_FSDP_BUFFERS = {
    # ParameterGroup attribute -> part of the static memory
    "model_weight_buffer": "params",
    "transpose_weight_buffer": "params",
    "hsdp_wbuf": "params",
    "main_weight_buffer": "optimizer",
    "main_grad_buffer": "grads",
    "hsdp_gbuf": "grads",
}


def optimizer_config(job, *, check_only: bool = False):
    """megatron-core's OptimizerConfig as Megatron-LM's get_megatron_optimizer_config fills it.
    `check_only`: megatron-core's checks alone, its refusal a ConfigError (remembered,
    _VERDICTS)."""
    from megatron.core.optimizer import OptimizerConfig

    from metatrace.hooks.patches import megatron_patches, te_optimizers_importable

    tr = job.training
    fields = dict(
        optimizer=tr.optimizer,
        lr=1e-4,  # values do not matter on meta; the learning rate allocates nothing
        bf16=tr.precision in ("bf16", "fp8", "fp4"),
        fp16=tr.precision == "fp16",
        params_dtype=DTYPES[tr.precision],
        use_distributed_optimizer=tr.distributed_optimizer,
        overlap_param_gather=tr.overlap_param_gather,
        overlap_param_gather_with_optimizer_step=tr.overlap_param_gather_with_optimizer_step,
        use_precision_aware_optimizer=tr.use_precision_aware_optimizer,
        main_grads_dtype=_OPT_DTYPES[tr.main_grads_dtype],
        main_params_dtype=_OPT_DTYPES[tr.main_params_dtype],
        exp_avg_dtype=_OPT_DTYPES[tr.exp_avg_dtype],
        exp_avg_sq_dtype=_OPT_DTYPES[tr.exp_avg_sq_dtype],
        sgd_momentum=tr.sgd_momentum,
        clip_grad=tr.clip_grad,
        log_num_zeros_in_grad=tr.log_num_zeros_in_grad,
        fp8_recipe=tr.fp8_recipe if tr.precision == "fp8" else None,
        optimizer_cpu_offload=tr.optimizer_cpu_offload,
        optimizer_offload_fraction=tr.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=tr.overlap_cpu_optimizer_d2h_h2d,
    )
    if not check_only:
        with te_optimizers_importable():
            return OptimizerConfig(**fields)
    key = _arguments(OptimizerConfig, fields)
    if key not in _VERDICTS:
        _VERDICTS[key] = None
        with megatron_patches(), te_optimizers_importable():
            try:
                OptimizerConfig(**fields)
            except (ValueError, AssertionError, TypeError) as e:
                _VERDICTS[key] = f"megatron-core rejects this optimizer configuration: {e}"
    if _VERDICTS[key] is not None:
        raise ConfigError(_VERDICTS[key])
    return None


def _grad_norm_groups_known(optimizer) -> None:
    """megatron-core 0.19's step asks whether any rank of the grad-stats group holds parameters
    of a separate gradient-norm group: a flag all-reduced and read on the host in the first step
    only, then cached, which every step after the first finds. Only MTP's layers with
    mtp_detach_heads (which no job sets) tag theirs: no rank holds any. Restates
    megatron.core.optimizer.optimizer.MegatronOptimizer.has_grad_norm_group
    (source sha256: 4485e60b1c6f; since 0.19). Restates
    megatron.core.optimizer.optimizer.ChainedOptimizer.has_grad_norm_group
    (source sha256: 7572064c3666; since 0.19)."""
    from megatron.core.optimizer.optimizer import SEPARATE_GRAD_NORM_GROUPS

    for opt in (optimizer, *getattr(optimizer, "chained_optimizers", ())):
        opt._has_grad_norm_group_cache = dict.fromkeys(SEPARATE_GRAD_NORM_GROUPS, False)


def build_optimizer(job, model):
    """megatron-core's optimizer over the DDP-wrapped chunks (its fp32 main parameters are
    built here), with the optimizer state every step after the first holds: megatron-core's
    own init_state_fn creates it, as for loading a checkpoint."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from metatrace.hooks.optimizer_offload import initialize_state

    optimizer = get_megatron_optimizer(optimizer_config(job), model, use_gloo_process_groups=False)
    if release.since(0, 19):
        _grad_norm_groups_known(optimizer)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if inner.optimizer is None:
            continue
        if isinstance(inner.optimizer, HybridDeviceOptimizer):
            initialize_state(inner.optimizer, inner.config.main_grads_dtype)
        elif inner.config.use_precision_aware_optimizer:
            # As TE's FusedAdam.step creates the state (TE 2.8 fused_adam.py): the master copy
            # of a bf16 parameter as int16 remainders when store_param_remainders. (megatron-core
            # 0.16.1's init_state_fn calls initialize_state(p) without that argument, which TE
            # 2.8 requires; its checkpoint shapes say int16 too, distrib_optimizer.py.)
            opt = inner.optimizer
            for group in opt.param_groups:
                for p in group["params"]:
                    opt.initialize_state(
                        p, opt.store_param_remainders and p.dtype == torch.bfloat16
                    )
        elif inner.init_state_fn is not None:
            inner.init_state_fn(inner.optimizer, inner.config)
            if isinstance(inner.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                # torch.optim (training.optimizer_impl: torch) counts steps in a state of its
                # own, a CPU scalar its first step creates beside the moments; the steady
                # state's is past that step.
                from metatrace.hooks.remap import KNOWN

                for group in inner.optimizer.param_groups:
                    for p in group["params"]:
                        step = torch.tensor(1.0, device="cpu")
                        setattr(step, KNOWN, True)  # its reads give the count (measure's CPU run)
                        inner.optimizer.state[p].setdefault("step", step)
        elif hasattr(
            inner.optimizer, "initialize_state"
        ):  # SGD: megatron-core has no init_state_fn
            for group in inner.optimizer.param_groups:
                for p in group["params"]:
                    inner.optimizer.initialize_state(p)
    return optimizer


def static_tensors(model, optimizer) -> dict[str, list[torch.Tensor]]:
    """Device tensors that live for the whole run beside the modules' parameters and buffers,
    by part: "grads" (DDP's gradient buffers; its parameter buffers hold the parameters
    themselves), "optimizer" (main parameters, optimizer state, scaler and flag tensors)."""
    from metatrace.hooks.optimizer_offload import is_host

    grads, state = [], []
    if any(is_fsdp(chunk) for chunk in model):
        return _fsdp_static_tensors(model, optimizer)
    for chunk in model:
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            grads.append(buffer.grad_data)
            if buffer.param_data is not None:
                grads.append(buffer.param_data)  # counted with the parameters it holds
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        scaler = getattr(inner, "grad_scaler", None)
        owners = [inner, scaler] if scaler is not None else [inner]
        state.extend(t for owner in owners for t in vars(owner).values() if torch.is_tensor(t))
        if inner.optimizer is None:
            continue
        opt = inner.optimizer
        for owner in [opt, *getattr(opt, "sub_optimizers", [])]:  # HybridDeviceOptimizer's
            state.extend(t for t in vars(owner).values() if torch.is_tensor(t))
        for group in opt.param_groups:
            for p in group["params"]:
                state.append(p)
                state.extend(v for v in opt.state[p].values() if torch.is_tensor(v))
                # HybridDeviceOptimizer: the fp32 copy's gradient the last step left.
                fp32 = getattr(opt, "param_to_fp32_param", {}).get(p)
                state.append(getattr(fp32, "grad", None))
    state = [t for t in state if torch.is_tensor(t) and not is_host(t)]
    return {"grads": grads, "optimizer": state}


def _fsdp_static_tensors(model, optimizer) -> dict[str, list[torch.Tensor]]:
    """static_tensors under Megatron-FSDP, whose chunks' parameters are DTensors over the main
    weights between iterations: "params" are the model-weight buffers (the shard each rank keeps,
    or every parameter without parameter sharding) and the modules' own buffers, "grads" the
    main-gradient buffers, "optimizer" the main-weight buffers and the optimizer's state. With
    HSDP's outer sharding the instance's shards (hsdp_wbuf, hsdp_gbuf) hold the model-weight and
    main-gradient buffers as views, which count once (by storage)."""
    parts: dict[str, list[torch.Tensor]] = {"params": [], "grads": [], "optimizer": []}
    for chunk in model:
        buffers = chunk.param_and_grad_buffer
        for group in buffers.parameter_groups:
            for name, part in _FSDP_BUFFERS.items():
                buffer = getattr(group, name, None)
                if buffer is not None and buffer.data is not None:
                    parts[part].append(buffer.data)
        parts["params"].extend(chunk.module.buffers())
    rest = static_tensors([], optimizer)  # the optimizer's tensors, DTensors among them
    parts["optimizer"].extend(getattr(t, "_local_tensor", t) for t in rest["optimizer"])
    return parts
