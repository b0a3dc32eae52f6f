"""Model presets: name -> dimensions (keys of the `model` section), with their source.

Dimensions are those of the published Hugging Face `config.json` of each model (or the paper
for GPT-3), written as Megatron-LM arguments: Llama uses RMSNorm, SwiGLU, RoPE, no biases, no
dropout and untied output weights. `model.hf_config` (models/hf.py) reads such files directly;
tests/unit/test_hf.py checks that it gives these presets from the published files.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    dims: dict
    source: str


_LLAMA = {
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "position_embedding_type": "rope",
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}

# What the Qwen3 MoE models share (their config.json files).
_QWEN3_MOE = {
    **_LLAMA,
    "num_query_groups": 4,
    "kv_channels": 128,
    "qk_layernorm": True,
    "norm_epsilon": 1e-6,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rotary_base": 1000000,
    "num_experts": 128,
    "moe_router_topk": 8,
}

# What both GPT-OSS models share (openai/gpt-oss-{20b,120b} config.json, as Megatron-Bridge's
# GPTOSSProvider builds them): biases on every linear (attention_bias; the experts' gate_up and
# down biases), attention sinks (a learnable logit per head), a 128-token sliding window on
# every other layer from the first (layer_types), YaRN (rope_scaling), and the clamped GLU
# (up + 1) * gate * sigmoid(1.702 gate) with swiglu_limit 7 (quick_geglu).
_GPT_OSS = {
    **_LLAMA,
    "add_bias_linear": True,
    "hidden_size": 2880,
    "ffn_hidden_size": 2880,
    "moe_ffn_hidden_size": 2880,
    "num_attention_heads": 64,
    "num_query_groups": 8,
    "kv_channels": 64,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "norm_epsilon": 1e-5,
    "activation": "quick_geglu",
    "glu_linear_offset": 1.0,
    "activation_func_clamp_value": 7.0,
    "softmax_type": "learnable",
    # Megatron-Bridge's (128, 0) (HF's mask keeps 128 keys with the query's own, TE's (127, 0))
    "window_size": [128, 0],
    "window_attn_skip_freq": 2,
    "position_embedding_type": "yarn",
    "rotary_base": 150000,
    "rotary_scaling_factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "moe_router_topk": 4,
}

# What NVIDIA's hybrid Mamba-2 models share (Nemotron-H, Nemotron 3): RMSNorm, squared ReLU,
# no biases, untied output layer, no position embedding (the Mamba layers carry position),
# Mamba-2 heads of 64 channels, 8 groups, state 128, and the 131072-token vocabulary.
_NEMOTRON_H = {
    "normalization": "RMSNorm",
    "activation": "squared_relu",
    "position_embedding_type": "none",
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "kv_channels": 128,
    "vocab_size": 131072,
    "mamba_head_dim": 64,
    "mamba_num_groups": 8,
    "mamba_state_dim": 128,
}

# Nemotron 3 Super's 88 layers, 40 Mamba-2 (M), 40 LatentMoE (E) and 8 attention (*): the order
# is not in any source at hand; assumed Nano's structure (M and E alternating, an attention
# layer between the M and E of a pair) with its unit MEMEM*E widened to MEMEMEMEM*E, 8 times.
_SUPER_PATTERN = "MEMEMEMEM*E" * 8

PRESETS: dict[str, Preset] = {
    "debug": Preset(
        {
            **_LLAMA,
            "num_layers": 2,
            "hidden_size": 64,
            "ffn_hidden_size": 128,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "vocab_size": 1000,
            "make_vocab_size_divisible_by": 16,
        },
        "tiny Llama-shaped model for tests",
    ),
    "llama2-7b": Preset(
        {
            **_LLAMA,
            "num_layers": 32,
            "hidden_size": 4096,
            "ffn_hidden_size": 11008,
            "num_attention_heads": 32,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "rotary_base": 10000,
        },
        "meta-llama/Llama-2-7b-hf config.json",
    ),
    "llama2-13b": Preset(
        {
            **_LLAMA,
            "num_layers": 40,
            "hidden_size": 5120,
            "ffn_hidden_size": 13824,
            "num_attention_heads": 40,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "rotary_base": 10000,
        },
        "meta-llama/Llama-2-13b-hf config.json",
    ),
    "llama2-70b": Preset(
        {
            **_LLAMA,
            "num_layers": 80,
            "hidden_size": 8192,
            "ffn_hidden_size": 28672,
            "num_attention_heads": 64,
            "num_query_groups": 8,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "rotary_base": 10000,
        },
        "meta-llama/Llama-2-70b-hf config.json",
    ),
    "llama3-8b": Preset(
        {
            **_LLAMA,
            "num_layers": 32,
            "hidden_size": 4096,
            "ffn_hidden_size": 14336,
            "num_attention_heads": 32,
            "num_query_groups": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "rotary_base": 500000,
        },
        "meta-llama/Meta-Llama-3-8B config.json",
    ),
    "llama3-70b": Preset(
        {
            **_LLAMA,
            "num_layers": 80,
            "hidden_size": 8192,
            "ffn_hidden_size": 28672,
            "num_attention_heads": 64,
            "num_query_groups": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "rotary_base": 500000,
        },
        "meta-llama/Meta-Llama-3-70B config.json",
    ),
    "llama3.1-405b": Preset(
        {
            **_LLAMA,
            "num_layers": 126,
            "hidden_size": 16384,
            "ffn_hidden_size": 53248,
            "num_attention_heads": 128,
            "num_query_groups": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rotary_base": 500000,
        },
        "meta-llama/Llama-3.1-405B config.json",
    ),
    "gpt3-175b": Preset(
        {
            "num_layers": 96,
            "hidden_size": 12288,
            "ffn_hidden_size": 49152,
            "num_attention_heads": 96,
            "vocab_size": 50257,
            "max_position_embeddings": 2048,
            "position_embedding_type": "learned_absolute",
            "normalization": "LayerNorm",
            "activation": "gelu",
            "add_bias_linear": True,
            "untie_embeddings_and_output_weights": False,
            "hidden_dropout": 0.1,
            "attention_dropout": 0.1,
        },
        "Brown et al. 2020 (GPT-3 175B), GPT-2 BPE vocabulary",
    ),
    "mixtral-8x7b": Preset(
        {
            **_LLAMA,
            "num_layers": 32,
            "hidden_size": 4096,
            "ffn_hidden_size": 14336,
            "num_attention_heads": 32,
            "num_query_groups": 8,
            "vocab_size": 32000,
            "max_position_embeddings": 32768,
            "rotary_base": 1000000,
            "num_experts": 8,
            "moe_router_topk": 2,
            "moe_ffn_hidden_size": 14336,
        },
        "mistralai/Mixtral-8x7B-v0.1 config.json",
    ),
    "mixtral-8x22b": Preset(
        {
            **_LLAMA,
            "num_layers": 56,
            "hidden_size": 6144,
            "ffn_hidden_size": 16384,
            "num_attention_heads": 48,
            "num_query_groups": 8,
            "vocab_size": 32768,
            "max_position_embeddings": 65536,
            "rotary_base": 1000000,
            "num_experts": 8,
            "moe_router_topk": 2,
            "moe_ffn_hidden_size": 16384,
        },
        "mistralai/Mixtral-8x22B-v0.1 config.json",
    ),
    "qwen3-30b-a3b": Preset(
        {
            **_QWEN3_MOE,
            "num_layers": 48,
            "hidden_size": 2048,
            "ffn_hidden_size": 6144,
            "num_attention_heads": 32,
            "moe_ffn_hidden_size": 768,
        },
        "Qwen/Qwen3-30B-A3B config.json (every layer sparse: decoder_sparse_step 1)",
    ),
    "qwen3-235b-a22b": Preset(
        {
            **_QWEN3_MOE,
            "num_layers": 94,
            "hidden_size": 4096,
            "ffn_hidden_size": 12288,
            "num_attention_heads": 64,
            "moe_ffn_hidden_size": 1536,
        },
        "Qwen/Qwen3-235B-A22B config.json (every layer sparse: decoder_sparse_step 1)",
    ),
    "gpt-oss-120b": Preset(
        {**_GPT_OSS, "num_layers": 36, "num_experts": 128},
        "openai/gpt-oss-120b config.json",
    ),
    "gpt-oss-20b": Preset(
        {**_GPT_OSS, "num_layers": 24, "num_experts": 32},
        "openai/gpt-oss-20b config.json",
    ),
    "nemotron-h-8b": Preset(
        {
            **_NEMOTRON_H,
            "hybrid_layer_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
            "hidden_size": 4096,
            "ffn_hidden_size": 21504,
            "num_attention_heads": 32,
            "num_query_groups": 8,
            "mamba_num_heads": 128,
        },
        "nvidia/Nemotron-H-8B-Base-8K config.json as the issue gives it (52 layers: 24 Mamba-2, "
        "4 attention, 24 MLP; reconstructed, not read from the file)",
    ),
    "nemotron-3-nano-30b-a3b": Preset(
        {
            **_NEMOTRON_H,
            "hybrid_layer_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
            "hidden_size": 2688,
            "ffn_hidden_size": 1856,
            "num_attention_heads": 32,
            "num_query_groups": 2,
            "mamba_num_heads": 64,
            "num_experts": 128,
            "moe_ffn_hidden_size": 1856,
            "moe_router_topk": 6,
            "moe_shared_expert_intermediate_size": 3712,
            # sigmoid scores with a correction bias, top-k weights normalised and scaled 2.5
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_topk_scaling_factor": 2.5,
        },
        "Megatron-Bridge v0.5.0 recipes/nemotronh/nemotron_3_nano.py (MambaModelProvider), as "
        "recorded in shared/calibration/throughput-2026.jsonl; nvidia/NVIDIA-Nemotron-3-Nano-"
        "30B-A3B-BF16 (52 layers: 23 Mamba-2, 23 MoE, 6 attention); router settings from the "
        "public config.json as remembered (values only)",
    ),
    "nemotron-3-super-120b-a12b": Preset(
        {
            **_NEMOTRON_H,
            "hybrid_layer_pattern": _SUPER_PATTERN,
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_query_groups": 2,
            "mamba_num_heads": 128,
            "num_experts": 512,
            "moe_ffn_hidden_size": 2688,
            "moe_router_topk": 22,
            "moe_latent_size": 1024,
            "moe_shared_expert_intermediate_size": 5376,
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
        },
        "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 dimensions as recorded in "
        "shared/calibration/throughput-2026.jsonl (88 layers: 40 Mamba-2, 40 LatentMoE with "
        "latent 1024, 8 attention). ASSUMED: the layer order (not in the file; Nano's structure "
        "repeated, MEMEMEMEM*E x 8) and the router (sigmoid with expert bias, as Nano). Left "
        "out: the multi-token-prediction block (*E, applied twice with shared weights), which "
        "megatron-core 0.16.1 cannot build",
    ),
    "qwen3-next-80b-a3b": Preset(
        {
            **_LLAMA,
            "num_layers": 48,
            "hidden_size": 2048,
            "ffn_hidden_size": 5120,  # intermediate_size: no dense layer uses it
            "num_attention_heads": 16,
            "num_query_groups": 2,
            "kv_channels": 256,
            "qk_layernorm": True,
            "attention_output_gate": True,
            "norm_epsilon": 1e-6,
            "vocab_size": 151936,
            "max_position_embeddings": 262144,
            "rotary_base": 10000000,
            "rotary_percent": 0.25,
            # Gated DeltaNet in three of every four layers (full_attention_interval 4)
            "linear_attention_freq": 4,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            # every layer sparse (decoder_sparse_step 1, mlp_only_layers [])
            "num_experts": 512,
            "moe_router_topk": 10,
            "moe_ffn_hidden_size": 512,
            "moe_shared_expert_intermediate_size": 512,
            "moe_shared_expert_gate": True,
        },
        "Qwen/Qwen3-Next-80B-A3B-Instruct config.json, reconstructed (tests/data/hf) (RMSNorm "
        "zero-centred in the model, the same parameters; not modelled: the "
        "multi-token-prediction weights the checkpoint carries, mtp_num_layers: 1 adds them)",
    ),
    "deepseek-v3": Preset(
        {
            **_LLAMA,
            "num_layers": 61,
            "hidden_size": 7168,
            "ffn_hidden_size": 18432,  # intermediate_size: the 3 dense layers
            "num_attention_heads": 128,
            "kv_channels": 128,  # Megatron-LM's DeepSeek-V3 recipe; MLA uses the dims below
            "norm_epsilon": 1e-6,
            "vocab_size": 129280,
            "max_position_embeddings": 163840,
            "rotary_base": 10000,
            # multi-latent attention; q_a_layernorm / kv_a_layernorm are its qk_layernorm
            "multi_latent_attention": True,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_head_dim": 128,  # qk_nope_head_dim
            "qk_pos_emb_head_dim": 64,  # qk_rope_head_dim
            "v_head_dim": 128,
            "qk_layernorm": True,
            "rope_type": "yarn",
            "rotary_scaling_factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            # mixture of experts: first_k_dense_replace 3, n_routed_experts 256, top 8,
            # n_shared_experts 1 x moe_intermediate_size, noaux_tc (sigmoid, expert bias)
            "num_experts": 256,
            "moe_router_topk": 8,
            "moe_ffn_hidden_size": 2048,
            "moe_shared_expert_intermediate_size": 2048,
            "moe_layer_freq": "([0]*3+[1]*58)",
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": 8,
            "moe_router_group_topk": 4,
            "moe_router_topk_scaling_factor": 2.5,
            "moe_router_load_balancing_type": "seq_aux_loss",
            "moe_aux_loss_coeff": 1e-4,
            # multi-token prediction: num_nextn_predict_layers 1
            "mtp_num_layers": 1,
            "mtp_loss_scaling_factor": 0.1,
        },
        "deepseek-ai/DeepSeek-V3 config.json (sequence-wise balance weight 1e-4, where the file "
        "says aux_loss_alpha 0.001, and MTP loss weight 0.1 from the paper, section 4.2)",
    ),
}
