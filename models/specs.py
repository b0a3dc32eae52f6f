"""Layer specs from a backend spec provider, the way megatron-core intends backends to plug in.

megatron-core builds a GPT layer from a `BackendSpecProvider` (megatron/core/models/backends.py:
`LocalSpecProvider`, `TESpecProvider`). `MetaLocalSpecProvider` is megatron-core's local provider
with a norm that runs on meta (see `standins.LocalNorm`); a Transformer Engine stand-in provider
plugs into `gpt_layer_spec` the same way.

`MetaTESpecProvider` is megatron-core's `TESpecProvider` with the Transformer Engine stand-ins of
`metatrace.models.te_linear` and `metatrace.models.te_attention`.

`gpt_layer_spec` mirrors megatron-core 0.16.1's `get_gpt_layer_local_spec` and
`get_gpt_layer_with_transformer_engine_spec` for dense layers: with a provider that fuses the
norm into the following linear (`fuse_layernorm_and_linear()`), input_layernorm and
pre_mlp_layernorm become identities and linear_qkv / linear_fc1 take the norm, as in the TE spec.
megatron-core 0.19 builds the same modules through its `*_submodules` functions: its norms'
`has_residual` fuses the residual add only with `fused_residual_rmsnorm`, which no job sets;
`mla_down_proj_fusion` (model.mla_down_proj_fusion) builds FusedMLASelfAttention.
"""

from __future__ import annotations

import functools

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from metatrace.config import release
from metatrace.models.standins import LocalNorm
from metatrace.models.te_attention import TEDotProductAttention
from metatrace.models.te_fused_mlp import TEFusedMLP
from metatrace.models.te_linear import (
    TEColumnParallelLinear,
    TELayerNormColumnParallelLinear,
    TELinear,
    TENorm,
    TERowParallelLinear,
)


class MetaLocalSpecProvider(LocalSpecProvider):
    """megatron-core's local modules; the norm is `LocalNorm` (Apex / fused-kernel behaviour)."""

    def layer_norm(
        self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False
    ) -> type:
        return LocalNorm


def mla_attention_spec(provider, *, qk_layernorm: bool, fused_down: bool = False) -> ModuleSpec:
    """megatron-core 0.16.1's MLASelfAttention spec, as get_gpt_layer_with_transformer_engine_spec
    (a provider that fuses norms: down-projections replicated (TELinear), the latent norms fused
    into the up-projections) and get_gpt_layer_local_spec (column-parallel projections, separate
    latent norms) build it with multi_latent_attention=True. Restates
    megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
    (source sha256: 15eb8848f25b, 952ee2781ae2). Restates
    megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec
    (source sha256: d2c4230163a4, 2530dc133326).

    `fused_down` (megatron-core 0.19's mla_down_proj_fusion, a provider that fuses norms): one
    down-projection for the query and the key-value latents that takes the layer's input norm
    (FusedMLASelfAttention; the layer's input norm is then an identity), the latent norms fused
    into the up-projections as before."""
    if provider.fuse_layernorm_and_linear():
        up = (
            provider.column_parallel_layer_norm_linear()
            if qk_layernorm
            else (provider.column_parallel_linear())
        )
        down, latent_norm = provider.linear(), IdentityOp
    else:
        up = down = provider.column_parallel_linear()
        latent_norm = provider.layer_norm(for_qk=True) if qk_layernorm else IdentityOp
    module, downs = MLASelfAttention, {"linear_q_down_proj": down, "linear_kv_down_proj": down}
    if fused_down:
        from megatron.core.transformer.multi_latent_attention import FusedMLASelfAttention

        module = FusedMLASelfAttention
        downs = {"linear_qkv_down_proj": provider.column_parallel_layer_norm_linear()}
    return ModuleSpec(
        module=module,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=provider.column_parallel_linear(),
            linear_q_up_proj=up,
            linear_kv_up_proj=up,
            core_attention=provider.core_attention(),
            linear_proj=provider.row_parallel_linear(),
            q_layernorm=latent_norm,
            kv_layernorm=latent_norm,
            **downs,
        ),
    )


def gpt_layer_spec(
    provider,
    *,
    qk_layernorm: bool = False,
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    multi_latent_attention: bool = False,
    te_op_fuser: bool = False,
    gated_delta_net: bool = False,
    mla_down_proj_fusion: bool = False,
) -> ModuleSpec:
    """A GPT layer spec built from `provider`: dense, or with `num_experts` a MoE layer
    (megatron-core's MoELayer from get_moe_module_spec_for_backend; the pre-MLP norm is then a
    module of its own, as the MoE layer cannot fuse it); with `multi_latent_attention` its
    attention is MLA (`mla_attention_spec`), whose input norm is never fused. With
    `te_op_fuser` a dense layer's MLP is TEFusedMLP (MoE layers ignore it, as megatron-core's
    get_mlp_module_spec_for_backend does). With `gated_delta_net` its attention is Gated
    DeltaNet (models.hybrid.gdn_attention_spec), whose input projection takes the norm, as
    megatron-core's get_transformer_block_with_experimental_attention_variant_spec builds it.
    Restates
    megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
    (source sha256: 15eb8848f25b, 952ee2781ae2). Restates
    megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec
    (source sha256: d2c4230163a4, 2530dc133326)."""
    fused = provider.fuse_layernorm_and_linear()
    norm = provider.layer_norm()
    if num_experts is not None:
        # 0.19 dropped the legacy grouped GEMM (and its argument)
        legacy = {} if release.since(0, 19) else {"moe_use_legacy_grouped_gemm": False}
        mlp = get_moe_module_spec_for_backend(
            backend=provider, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, **legacy
        )
    else:
        mlp = get_mlp_module_spec_for_backend(backend=provider)
        if te_op_fuser:
            # get_mlp_module_spec_for_backend(use_te_op_fuser=True): the same submodules under
            # TEFusedMLP, whose megatron-core class is None without Transformer Engine.
            if release.since(0, 19):  # a builder (MLP.as_mlp_submodule) in place of a spec
                submodules = mlp.keywords["submodules"]
                mlp = functools.partial(TEFusedMLP.as_mlp_submodule, submodules=submodules)
            else:
                mlp = ModuleSpec(module=TEFusedMLP, submodules=mlp.submodules)
    if gated_delta_net:
        from metatrace.models.hybrid import gdn_attention_spec

        return ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=IdentityOp if fused else norm,
                self_attention=gdn_attention_spec(provider),
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=IdentityOp if fused and num_experts is None else norm,
                mlp=mlp,
                mlp_bda=get_bias_dropout_add,
            ),
        )
    if multi_latent_attention:
        fused_down = mla_down_proj_fusion and fused  # megatron-core 0.19's TE spec
        return ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=IdentityOp if fused_down else norm,
                self_attention=mla_attention_spec(
                    provider, qk_layernorm=qk_layernorm, fused_down=fused_down
                ),
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=IdentityOp if fused and num_experts is None else norm,
                mlp=mlp,
                mlp_bda=get_bias_dropout_add,
            ),
        )
    qk_norm = provider.layer_norm(for_qk=True) if qk_layernorm else IdentityOp
    linear_qkv = (
        provider.column_parallel_layer_norm_linear()
        if fused
        else (provider.column_parallel_linear())
    )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if fused else norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=linear_qkv,
                    core_attention=provider.core_attention(),
                    linear_proj=provider.row_parallel_linear(),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp if fused and num_experts is None else norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=(
                {}
                if fused
                else {
                    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
                }
            ),
        ),
    )


def decoder_layer_specs(config, provider, *, vp_stage=None) -> list[ModuleSpec]:
    """The layer specs of the decoder layers one model chunk builds, as megatron-core's
    get_gpt_decoder_block_spec selects them: dense or MoE per layer from
    config.moe_layer_freq, sliced by the pipeline layout or the chunk's layer offset. Restates
    megatron.core.models.gpt.gpt_layer_specs.get_gpt_decoder_block_spec
    (source sha256: 0fa0e2d15e04, 3a6beff80b1d). Restates
    megatron.core.models.gpt.gpt_layer_specs.get_gpt_decoder_layer_specs
    (source sha256: 3a05e1158089, 5bf3e5a8bc2a). With Gated DeltaNet layers
    (experimental_attention_variant) the attention of each layer follows megatron-core's
    linear-attention pattern. Restates
    megatron.core.models.gpt.experimental_attention_variant_module_specs.get_transformer_block_with_experimental_attention_variant_spec
    (source sha256: 45e9125e3e52, a8f353cff3bb)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    # metatrace.config resolved moe_layer_freq to a 0/1 list per layer.
    moe = config.moe_layer_freq if config.num_moe_experts else [0] * config.num_layers
    gdn = [0] * config.num_layers
    if config.experimental_attention_variant == "gated_delta_net":
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_linear_attention_pattern,
        )

        gdn = get_linear_attention_pattern(config)
    pattern = list(zip(moe, gdn))
    kinds = {p: _layer_spec(config, provider, moe=p[0], gdn=p[1]) for p in set(pattern)}
    specs = [kinds[p] for p in pattern]
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        ids = layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage)
        return [specs[i] for i in ids]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return specs[offset : offset + get_num_layers_to_build(config, vp_stage=vp_stage)]


def _layer_spec(config, provider, *, moe: bool, gdn: bool = False) -> ModuleSpec:
    """The model's dense or MoE layer spec, with attention or Gated DeltaNet."""
    return gpt_layer_spec(
        provider,
        gated_delta_net=bool(gdn),
        qk_layernorm=config.qk_layernorm,
        num_experts=config.num_moe_experts if moe else None,
        moe_grouped_gemm=config.moe_grouped_gemm,
        multi_latent_attention=config.multi_latent_attention,
        te_op_fuser=getattr(config, "use_transformer_engine_op_fuser", False),
        mla_down_proj_fusion=getattr(config, "mla_down_proj_fusion", False),
    )


def mtp_block_spec(config, provider, block, *, vp_stage=None):
    """The multi-token-prediction block of the chunk `block` belongs to (None where it holds no
    MTP layer), as Megatron-LM's model provider builds it: megatron-core's
    get_gpt_mtp_block_spec_for_backend with the chunk's last decoder layer as the MTP layer's
    transformer layer, or, on a chunk without decoder layers, the model's layer spec (MoE when
    the model has experts)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend

    if not config.mtp_num_layers:
        return None
    spec = block
    if not block.layer_specs:
        spec = _layer_spec(config, provider, moe=bool(config.num_moe_experts))
    return get_gpt_mtp_block_spec_for_backend(config, spec, backend=provider, vp_stage=vp_stage)


class MetaTESpecProvider(BackendSpecProvider):
    """megatron-core's TESpecProvider with metatrace's Transformer Engine stand-ins."""

    def linear(self) -> type:
        return TELinear

    def column_parallel_linear(self) -> type:
        return TEColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return TERowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self) -> type:
        return TELayerNormColumnParallelLinear

    def layer_norm(
        self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False
    ) -> type:
        # has_residual (0.19): TENorm fuses the residual add only with fused_residual_rmsnorm,
        # which no job sets
        return TENorm

    def core_attention(self) -> type:
        return TEDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm=False):
        """TESpecProvider's choice with TE >= 1.7: TEGroupedMLP over grouped linears, or one
        MLP of TE linears per expert (SequentialMLP); a (module, submodules) pair in 0.16.1, a
        builder in 0.19 (which has no legacy grouped GEMM). Restates
        megatron.core.extensions.transformer_engine_spec_provider.TESpecProvider.grouped_mlp_modules
        (source sha256: 6ee0db2a2177, fa3ad8693ffa)."""
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

        from metatrace.models.te_grouped import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
        )

        if moe_use_grouped_gemm and moe_use_legacy_grouped_gemm:
            raise NotImplementedError(
                "the legacy GroupedMLP (grouped_gemm package) is not modelled"
            )
        if moe_use_grouped_gemm:
            module, fc1, fc2 = (
                TEGroupedMLP,
                TEColumnParallelGroupedLinear,
                TERowParallelGroupedLinear,
            )
        else:
            module, fc1, fc2 = SequentialMLP, TEColumnParallelLinear, TERowParallelLinear
        if not release.since(0, 19):
            return module, MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)
        from megatron.core.transformer.moe.experts import GroupedMLPSubmodules

        kind = GroupedMLPSubmodules if moe_use_grouped_gemm else MLPSubmodules
        return functools.partial(module, submodules=kind(linear_fc1=fc1, linear_fc2=fc2))

    def activation_func(self) -> type:
        return None  # TEActivationOp is used only with use_te_activation_func


def provider_for(transformer_impl: str):
    """The backend spec provider for `implementation.transformer_impl`."""
    if transformer_impl == "local":
        return MetaLocalSpecProvider()
    if transformer_impl == "transformer_engine":
        return MetaTESpecProvider()
    raise ValueError(f"unknown transformer_impl {transformer_impl!r}")
