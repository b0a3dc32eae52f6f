"""Layer specs from a backend spec provider, the way megatron-core intends backends to plug in.

megatron-core builds a GPT layer from a `BackendSpecProvider` (megatron/core/models/backends.py:
`LocalSpecProvider`, `TESpecProvider`). `MetaLocalSpecProvider` is megatron-core's local provider
with a norm that runs on meta (see `standins.LocalNorm`); a Transformer Engine stand-in provider
plugs into `gpt_layer_spec` the same way.

`gpt_layer_spec` mirrors megatron-core 0.16.1's `get_gpt_layer_local_spec` and
`get_gpt_layer_with_transformer_engine_spec` for dense layers: with a provider that fuses the
norm into the following linear (`fuse_layernorm_and_linear()`), input_layernorm and
pre_mlp_layernorm become identities and linear_qkv / linear_fc1 take the norm, as in the TE spec.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from metatrace.models.standins import LocalNorm


class MetaLocalSpecProvider(LocalSpecProvider):
    """megatron-core's local modules; the norm is `LocalNorm` (Apex / fused-kernel behaviour)."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return LocalNorm


def gpt_layer_spec(provider, *, qk_layernorm: bool = False) -> ModuleSpec:
    """A dense GPT layer spec built from `provider`."""
    fused = provider.fuse_layernorm_and_linear()
    norm = provider.layer_norm()
    qk_norm = provider.layer_norm(for_qk=True) if qk_layernorm else IdentityOp
    linear_qkv = provider.column_parallel_layer_norm_linear() if fused else (
        provider.column_parallel_linear()
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
            pre_mlp_layernorm=IdentityOp if fused else norm,
            mlp=get_mlp_module_spec_for_backend(backend=provider),
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


def provider_for(transformer_impl: str):
    """The backend spec provider for `implementation.transformer_impl`."""
    if transformer_impl == "local":
        return MetaLocalSpecProvider()
    raise NotImplementedError(f"transformer_impl {transformer_impl!r} has no stand-in provider")
