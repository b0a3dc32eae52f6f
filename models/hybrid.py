"""Hybrid models (Mamba-2, Gated DeltaNet, attention, MLP and MoE layers from a pattern), built as
Megatron-LM's pretrain_mamba.py / pretrain_hybrid.py build them, with metatrace's stand-ins.

megatron-core 0.16.1 builds them as `MambaModel` over a `MambaStack` (megatron/core/models/mamba),
0.19 as `HybridModel` over a `HybridStack` (megatron/core/models/hybrid; MambaModel is an alias
there). Both take a stack spec whose layer kinds use Transformer Engine's modules; `stack_spec`
restates megatron-core's spec with the Transformer Engine stand-ins of `models.specs`'s provider
(megatron-core has no local spec for them: "we had problems getting the non-TE spec working").
The Mamba-2 and Gated DeltaNet kernels (mamba_ssm, causal_conv1d, flash-linear-attention) are
stood in for by `models.ssm_kernels` and `models.gdn_kernels` (hooks/patches.py binds them).

Gated DeltaNet in a GPT model (megatron-core's experimental attention variant, Qwen3-Next) is
`gdn_attention_spec`, which `models.specs` uses for the layers `linear_attention_freq` selects.
"""

from __future__ import annotations

import functools

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from metatrace.config import release


def gdn_attention_spec(provider) -> ModuleSpec:
    """megatron-core's GatedDeltaNet as a layer's attention: its input projection takes the
    layer's norm, its output norm and projection follow. Restates
    megatron.core.models.gpt.experimental_attention_variant_module_specs.get_gated_delta_net_module_spec
    (source sha256: 452e783ea3ba)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules

    fused = provider.fuse_layernorm_and_linear()
    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=(
                provider.column_parallel_layer_norm_linear()
                if fused
                else provider.column_parallel_linear()
            ),
            out_norm=provider.layer_norm(),
            out_proj=provider.row_parallel_linear(),
        ),
        metainfo={"fuse_input_layernorm": fused},
    )


def stack_spec(config, provider) -> ModuleSpec:
    """megatron-core's stack spec of a hybrid model with `provider`'s modules: 0.16.1's
    mamba_stack_spec, 0.19's hybrid_stack_spec (to which 0.19's mamba_layer_specs points).
    Restates megatron.core.models.mamba.mamba_layer_specs (source sha256: 9146b4a3945f,
    149156bbbbe6). Restates megatron.core.models.hybrid.hybrid_layer_specs
    (source sha256: 71b133822996; since 0.19)."""
    fused = provider.fuse_layernorm_and_linear()
    ln_linear = (
        provider.column_parallel_layer_norm_linear() if fused else provider.column_parallel_linear()
    )
    # a provider that does not fuse the norm into the next linear (the local modules, which
    # `metatrace measure` runs for real) gets the layers' own norms
    norm = IdentityOp if fused else provider.layer_norm()
    row = provider.row_parallel_linear()
    mamba = ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=norm,
            mixer=ModuleSpec(
                module=MambaMixer,
                submodules=MambaMixerSubmodules(in_proj=ln_linear, out_proj=row),
            ),
            mamba_bda=get_bias_dropout_add,
        ),
    )
    attention = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ln_linear,
                    core_attention=provider.core_attention(),
                    linear_proj=row,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
        ),
    )
    fc = MLPSubmodules(linear_fc1=ln_linear, linear_fc2=row)
    dense = (
        functools.partial(MLP.as_mlp_submodule, submodules=fc)
        if release.since(0, 19)
        else ModuleSpec(module=MLP, submodules=fc)
    )
    mlp = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=dense, mlp_bda=get_bias_dropout_add
        ),
    )
    legacy = {} if release.since(0, 19) else {"moe_use_legacy_grouped_gemm": False}
    moe = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=provider.layer_norm(),
            mlp=get_moe_module_spec_for_backend(
                backend=provider,
                num_experts=config.num_moe_experts or 8,
                moe_grouped_gemm=config.moe_grouped_gemm,
                **legacy,
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    layers = dict(mamba_layer=mamba, attention_layer=attention, mlp_layer=mlp, moe_layer=moe)
    if not release.since(0, 19):
        from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules

        return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(**layers))
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules

    gdn = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=gdn_attention_spec(provider),
            self_attn_bda=get_bias_dropout_add,
        ),
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            **layers, gdn_layer=gdn, mtp_block_spec=_mtp_block_spec(provider)
        ),
    )


def _mtp_block_spec(provider) -> ModuleSpec:
    """0.19's multi-token-prediction block of a hybrid model: norms and the projection; its
    layers are built from the pattern: its _hybrid_mtp_block_spec. Restates
    megatron.core.models.hybrid.hybrid_layer_specs (source sha256: 71b133822996; since 0.19)."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )

    norm = provider.layer_norm()
    return ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[
                ModuleSpec(
                    module=MultiTokenPredictionLayer,
                    submodules=MultiTokenPredictionLayerSubmodules(
                        enorm=norm,
                        hnorm=norm,
                        eh_proj=provider.column_parallel_linear(),
                        mtp_model_layer=None,
                        layer_norm=norm,
                    ),
                )
            ]
        ),
    )


def build_hybrid_model(job, provider, vp_stage, **common):
    """The hybrid model of one chunk: MambaModel (0.16.1) or HybridModel (0.19), with `common`
    the arguments GPTModel takes too."""
    m, config = job.model, common["config"]
    spec = stack_spec(config, provider)
    if release.since(0, 19):
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        return HybridModel(
            hybrid_stack_spec=spec,
            hybrid_layer_pattern=m.hybrid_layer_pattern,
            vp_stage=vp_stage,
            **common,
        )
    from megatron.core.models.mamba import MambaModel

    return MambaModel(
        mamba_stack_spec=spec, hybrid_override_pattern=m.hybrid_layer_pattern, **common
    )
