"""Hugging Face `config.json` files as a metatrace model section, without `transformers`.

`read_hf_config(path, seq_length=...)` returns the `model` keys the file stands for and notes
for the user; `model.hf_config` in a job file merges them under the file's explicit keys, the
way `model.preset` merges a preset. One `Family` per supported `model_type` says which HF field
becomes which key. The presets in `models/presets.py` were written from the same published
files, so they are the reference for the mapping (tests/unit/test_hf.py checks that both agree).

Every field of a file is accounted for: mapped (a rename or a rule), declared as changing
nothing metatrace measures (`IGNORED`), or named in one warning note. A value metatrace cannot
model (an unknown activation, an unsupported `rope_scaling`, sliding-window attention that masks
something at the job's sequence length, a bias layout megatron-core has no switch for) is a
ConfigError naming the file and the field.

Known limitations: fields a file omits take the defaults of transformers' config classes
(v4.5x) as listed in each family's `defaults`; the mapping knows the published configs of the
supported families, not every variant saved by other tools.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metatrace.config.read import excerpt, parse_json, read_text
from metatrace.errors import ConfigError

_MISSING = object()


class _Source:
    """One config.json being read: typed access to its fields (with the family's defaults)
    that names the file and the field in every error, and the notes gathered on the way."""

    def __init__(self, path: Path, fields: dict, seq_length: int | None):
        self.path, self.fields, self.seq_length = path, fields, seq_length
        self.notes: list[str] = []
        self.unknown: list[str] = []  # sub-fields no table knows, for the one warning

    def error(self, field: str, problem: str) -> ConfigError:
        value = self.fields.get(field, _MISSING)
        shown = "" if value is _MISSING else f" = {json.dumps(value)}"
        return ConfigError(f"{self.path}: '{field}'{shown}: {problem}")

    def has(self, field: str) -> bool:
        return field in self.fields

    def get(self, field: str, kind: type, *, optional: bool = False) -> Any:
        """The field's value as `kind` (int, float, bool, str, list, dict); null only when
        `optional`. JSON writes some whole numbers as floats (rope_theta 500000.0): accepted."""
        if field not in self.fields:
            raise ConfigError(f"{self.path}: '{field}' is missing")
        value = self.fields[field]
        if value is None:
            if optional:
                return None
            raise self.error(field, "must be given (not null)")
        return _typed(value, kind, lambda problem: self.error(field, problem))


def _typed(value: Any, kind: type, fail: Callable[[str], ConfigError]) -> Any:
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("must be a whole number")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail("must be a number")
        return float(value)
    elif not isinstance(value, kind):
        raise fail(f"must be {'true or false' if kind is bool else 'a ' + kind.__name__}")
    return value


@dataclass(frozen=True)
class Rule:
    """HF fields that need more than a rename, and the function that maps them (reading any
    other field it needs through the source)."""

    fields: tuple[str, ...]
    apply: Callable[[_Source], dict]


@dataclass(frozen=True)
class Family:
    """How one `model_type` maps to metatrace model keys."""

    renames: dict[str, tuple[str, type]]
    """HF field -> (model key, type): copied after a type check."""
    rules: tuple[Rule, ...]
    fixed: dict[str, Any]
    """Model keys every model of the family has (RMSNorm, RoPE, no residual dropout, ...)."""
    defaults: dict[str, Any]
    """transformers' config-class defaults of optional fields a file may omit."""


# ----------------------------------------------------------------------------- field tables

# Fields that change nothing metatrace measures (memory, communication), accepted silently.
IGNORED = {
    "model_type": "read to pick the family",
    "architectures": "the HF class name; model_type names the family",
    "_name_or_path": "where the file came from",
    "auto_map": "remote-code class names",
    "bos_token_id": "token id",
    "eos_token_id": "token id",
    "pad_token_id": "token id",
    "torch_dtype": "checkpoint dtype; training.precision sets the training dtypes",
    "dtype": "checkpoint dtype (newer transformers); training.precision sets them",
    "transformers_version": "the writer's version",
    "initializer_range": "initialisation only",
    "use_cache": "inference KV cache",
    "pretraining_tp": "slices HF's projections for bit-exact replays; the same weights",
    "rope_interleave": "layout of the rotary pairs; the same tensors",
    "ep_size": "an HF inference hint; parallel.ep sets expert parallelism",
    "quantization_config": "checkpoint storage (DeepSeek-V3's FP8 blocks); training.precision "
    "sets what training holds",
}

# Dimensions without which the file describes no model (transformers would silently fill them
# with its class defaults, which describe some other model).
REQUIRED = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "vocab_size",
)

_RENAMES = {
    "num_hidden_layers": ("num_layers", int),
    "hidden_size": ("hidden_size", int),
    "intermediate_size": ("ffn_hidden_size", int),  # dense layers' MLP (Mixtral: every expert)
    "num_attention_heads": ("num_attention_heads", int),
    "vocab_size": ("vocab_size", int),
    "max_position_embeddings": ("max_position_embeddings", int),
    "rms_norm_eps": ("norm_epsilon", float),
    "attention_dropout": ("attention_dropout", float),
}

# Every supported family is a pre-norm RMSNorm decoder with RoPE and no residual dropout.
_FIXED = {"normalization": "RMSNorm", "position_embedding_type": "rope", "hidden_dropout": 0.0}

# HF's gated MLP is down(act(gate(x)) * up(x)): megatron-core's gated activations.
ACTIVATIONS = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu": "geglu",
    "gelu_pytorch_tanh": "geglu",
    "gelu_new": "geglu",
}

# rope_scaling kinds that only change the rotary frequencies, as Megatron-LM's
# --use-rope-scaling (llama3) and --rotary-seq-len-interpolation-factor (linear) do: nothing
# metatrace measures (megatron_flags.py accepts those flags the same way).
FREQUENCY_ONLY_ROPE = ("default", "linear", "llama3")
# The fields each of them needs (transformers' rope_config_validation raises without them, and
# the frequencies cannot be computed): numbers.
ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# DeepSeek's yarn fields -> model keys; omitted ones keep Megatron-LM's defaults.
YARN = {
    "factor": "rotary_scaling_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
}

# DeepSeek's topk_method -> (per-expert bias for aux-loss-free balancing, group-limited routing).
TOPK_METHODS = {
    "noaux_tc": (True, True),
    "group_limited_greedy": (False, True),
    "greedy": (False, False),
}


# ----------------------------------------------------------------------------- rules


def _query_groups(src: _Source) -> dict:
    groups = src.get("num_key_value_heads", int, optional=True)  # null: multi-head attention
    return {} if groups is None else {"num_query_groups": groups}


def _head_dim(src: _Source) -> dict:
    dim = src.get("head_dim", int, optional=True)  # null: hidden / heads, as megatron-core
    return {} if dim is None else {"kv_channels": dim}


def _rope_theta(src: _Source) -> dict:
    return {"rotary_base": src.get("rope_theta", int)}  # megatron-core's rotary_base is an int


def _activation(src: _Source) -> dict:
    act = src.get("hidden_act", str)
    if act not in ACTIVATIONS:
        raise src.error("hidden_act", f"not modelled; known: {', '.join(ACTIVATIONS)}")
    return {"activation": ACTIVATIONS[act]}


def _tied(src: _Source) -> dict:
    return {"untie_embeddings_and_output_weights": not src.get("tie_word_embeddings", bool)}


def _bias_keys(src: _Source, attention: bool, mlp: bool, field: str) -> dict:
    """megatron-core has biases on every linear (add_bias_linear) or on QKV only
    (add_qkv_bias); HF's attention_bias also biases the output projection, so it maps only
    together with mlp_bias."""
    if attention != mlp:
        raise src.error(
            field,
            "biases on the attention projections (output included) but not "
            "on the MLP (or the reverse): megatron-core has no such switch",
        )
    return {"add_bias_linear": attention, "add_qkv_bias": attention}


def _llama_biases(src: _Source) -> dict:
    attention, mlp = src.get("attention_bias", bool), src.get("mlp_bias", bool)
    return _bias_keys(src, attention, mlp, "attention_bias" if attention else "mlp_bias")


def _attention_biases(src: _Source) -> dict:
    # Qwen3 and DeepSeek have no MLP biases at all.
    return _bias_keys(src, src.get("attention_bias", bool), False, "attention_bias")


def _rope_scaling(src: _Source) -> dict:
    scaling = src.get("rope_scaling", dict, optional=True)
    if scaling is None:
        return {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in FREQUENCY_ONLY_ROPE:
        raise src.error(
            "rope_scaling",
            f"type {kind!r} is not modelled (supported: none, "
            f"{', '.join(FREQUENCY_ONLY_ROPE)}; yarn with multi-latent attention)",
        )
    _check_rope_fields(src, scaling, kind)
    return {}


def _check_rope_fields(src: _Source, scaling: dict, kind: str) -> None:
    """A frequency-only rope_scaling has the fields its kind needs (ROPE_FIELDS), as numbers."""
    missing = [f for f in ROPE_FIELDS[kind] if f not in scaling]
    if missing:
        raise src.error("rope_scaling", f"type {kind!r} needs {', '.join(missing)} (missing)")
    for field in ROPE_FIELDS[kind]:
        value = scaling[field]
        where = f"{src.path}: 'rope_scaling.{field}' = {json.dumps(value)}"
        want = int if field == "original_max_position_embeddings" else float
        _typed(value, want, lambda problem, where=where: ConfigError(f"{where}: {problem}"))


def _sliding_window(src: _Source) -> dict:
    """metatrace models full causal attention (megatron-core's window attention is not modelled
    yet). A window masks nothing where it covers the whole sequence: accepted with a note;
    otherwise refused. Qwen gates the window with use_sliding_window and keeps the first
    max_window_layers layers full; newer files list layer_types; Mistral always uses it."""
    window = _window(src)
    if window is None:
        return {}
    layers = src.get("num_hidden_layers", int)
    if src.has("layer_types"):
        windowed = sum(t == "sliding_attention" for t in src.get("layer_types", list))
    elif src.has("use_sliding_window") and not src.get("use_sliding_window", bool):
        windowed = 0
    else:
        full = src.get("max_window_layers", int) if src.has("max_window_layers") else 0
        windowed = max(0, layers - full)
    seq = src.seq_length
    if windowed == 0 or seq is None:  # no sequence: the job is refused for that anyway
        return {}
    if seq > window:
        raise src.error(
            "sliding_window",
            f"{windowed} of {layers} layers attend to the last "
            f"{window} tokens only, which masks part of training.seq_length = "
            f"{seq}; sliding-window attention is not modelled yet (a sequence of "
            f"at most {window} is plain causal attention)",
        )
    src.notes.append(
        f"{src.path}: sliding_window {window} covers training.seq_length {seq}: "
        "plain causal attention"
    )
    return {}


def _window(src: _Source) -> int | None:
    """sliding_window: null or absent (no window), else a number of tokens, at least 1."""
    window = src.get("sliding_window", int, optional=True) if src.has("sliding_window") else None
    if window is not None and window < 1:
        raise src.error("sliding_window", "must be a number of tokens, at least 1 (null: none)")
    return window


def _sparse(pattern: list[int]) -> int | list[int]:
    """moe_layer_freq: 1 when every layer is MoE (so that a reduced num_layers still fits),
    otherwise the 0/1 list per layer."""
    return 1 if all(pattern) else pattern


def _mixtral_moe(src: _Source) -> dict:
    if src.get("router_jitter_noise", float):
        raise src.error("router_jitter_noise", "router input jitter is not modelled")
    width = src.get("intermediate_size", int)
    # HF's Mixtral softmaxes over all experts and renormalises the top k: a softmax over the top
    # k logits, which is megatron-core's router without pre-softmax.
    return {
        "num_experts": src.get("num_local_experts", int),
        "moe_router_topk": src.get("num_experts_per_tok", int),
        "moe_ffn_hidden_size": width,
        "moe_router_pre_softmax": False,
    }


def _qwen3_moe(src: _Source) -> dict:
    layers = src.get("num_hidden_layers", int)
    step = src.get("decoder_sparse_step", int)
    dense = src.get("mlp_only_layers", list, optional=True) or []
    if step < 1:
        raise src.error("decoder_sparse_step", "must be at least 1")
    # HF's Qwen3MoeDecoderLayer: sparse where (i + 1) % step == 0 and i is not MLP-only.
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    return {
        "num_experts": src.get("num_experts", int),
        "moe_router_topk": src.get("num_experts_per_tok", int),
        "moe_ffn_hidden_size": src.get("moe_intermediate_size", int),
        "moe_layer_freq": _sparse(pattern),
        # renormalised top k = softmax over the top-k logits; otherwise softmax first
        "moe_router_pre_softmax": not src.get("norm_topk_prob", bool),
    }


def _router_aux_loss(src: _Source) -> dict:
    # HF computes the load-balancing loss only with output_router_logits; off, it trains
    # without one, which is megatron-core's default coefficient 0 (the presets agree).
    if not src.get("output_router_logits", bool):
        return {}
    return {"moe_aux_loss_coeff": src.get("router_aux_loss_coef", float)}


def _deepseek_moe(src: _Source) -> dict:
    layers = src.get("num_hidden_layers", int)
    first_dense = src.get("first_k_dense_replace", int)
    freq = src.get("moe_layer_freq", int)
    if freq < 1:
        raise src.error("moe_layer_freq", "must be at least 1")
    # DeepSeek's decoder layer: MoE from layer first_k_dense_replace on, every freq-th.
    pattern = [int(i >= first_dense and i % freq == 0) for i in range(layers)]
    width = src.get("moe_intermediate_size", int)
    shared = src.get("n_shared_experts", int, optional=True)
    out = {
        "num_experts": src.get("n_routed_experts", int),
        "moe_router_topk": src.get("num_experts_per_tok", int),
        "moe_ffn_hidden_size": width,
        "moe_layer_freq": _sparse(pattern),
    }
    if shared:  # megatron-core's shared experts are one MLP of their summed width
        out["moe_shared_expert_intermediate_size"] = shared * width
    return out


def _deepseek_router(src: _Source) -> dict:
    score = src.get("scoring_func", str)
    if score not in ("softmax", "sigmoid"):
        raise src.error(
            "scoring_func", "not modelled; megatron-core scores with softmax or sigmoid"
        )
    method = src.get("topk_method", str)
    if method not in TOPK_METHODS:
        raise src.error("topk_method", f"not modelled; known: {', '.join(TOPK_METHODS)}")
    bias, grouped = TOPK_METHODS[method]
    normalised = src.get("norm_topk_prob", bool)
    out = {
        "moe_router_score_function": score,
        "moe_router_enable_expert_bias": bias,
        "moe_router_topk_scaling_factor": src.get("routed_scaling_factor", float),
    }
    if score == "softmax":
        out["moe_router_pre_softmax"] = not normalised
    elif not normalised and src.get("num_experts_per_tok", int) > 1:
        raise src.error(
            "norm_topk_prob", "megatron-core always renormalises the top-k sigmoid scores"
        )
    if grouped:
        out["moe_router_num_groups"] = src.get("n_group", int)
        out["moe_router_group_topk"] = src.get("topk_group", int)
    # DeepSeek's sequence-wise balance loss is megatron-core's seq_aux_loss.
    balance = "seq_aux_loss" if src.get("seq_aux", bool) else "aux_loss"
    out["moe_router_load_balancing_type"] = balance
    out["moe_aux_loss_coeff"] = src.get("aux_loss_alpha", float)
    return out


def _mla(src: _Source) -> dict:
    """Multi-latent attention. num_key_value_heads and head_dim mean nothing to it (every head
    has its own keys from the latent; transformers sets head_dim to qk_rope_head_dim for its
    rotary cache); kv_channels is not read by megatron-core's MLA: Megatron-LM's DeepSeek-V3
    recipe gives 128, v_head_dim."""
    v = src.get("v_head_dim", int)
    return {
        "multi_latent_attention": True,
        "q_lora_rank": src.get("q_lora_rank", int, optional=True),  # null: no compression
        "kv_lora_rank": src.get("kv_lora_rank", int),
        "qk_head_dim": src.get("qk_nope_head_dim", int),
        "qk_pos_emb_head_dim": src.get("qk_rope_head_dim", int),
        "v_head_dim": v,
        "kv_channels": v,
        "qk_layernorm": True,
    }  # q_a_layernorm / kv_a_layernorm on the latents


def _mla_rope_scaling(src: _Source) -> dict:
    scaling = src.get("rope_scaling", dict, optional=True)
    if scaling is None:
        return {"rope_type": "rope"}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise src.error(
            "rope_scaling",
            f"type {kind!r} is not modelled with multi-latent attention (supported: none, yarn)",
        )
    return {"rope_type": "yarn", **_yarn_fields(src, scaling)}


def _yarn_fields(src: _Source, scaling: dict, ignored: tuple[str, ...] = ()) -> dict:
    """rope_scaling's YaRN fields as model keys; the others are reported as not read."""
    out = {}
    for field, value in scaling.items():
        if field in YARN:

            def fail(problem, where=f"{src.path}: 'rope_scaling.{field}'"):
                return ConfigError(f"{where}: {problem}")

            want = int if field == "original_max_position_embeddings" else float
            out[YARN[field]] = _typed(value, want, fail)
        elif field not in ("type", "rope_type", *ignored):
            src.unknown.append(f"rope_scaling.{field}")
    return out


def _gpt_oss_biases(src: _Source) -> dict:
    # The experts always have biases (gate_up_proj_bias, down_proj_bias).
    return _bias_keys(src, src.get("attention_bias", bool), True, "attention_bias")


def _gpt_oss_window(src: _Source) -> dict:
    """GPT-OSS: sliding_window on the layers layer_types marks sliding_attention, as megatron-core's
    window_size [w, 0] with window_attn_skip_freq (2 for HF's alternation from a windowed
    first layer, else the 0/1 list)."""
    window = _window(src)
    layers = src.get("num_hidden_layers", int)
    types = src.get("layer_types", list, optional=True)
    if types is None:  # transformers' GptOssConfig: alternating, sliding first
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise src.error(
            "layer_types", f"needs one of sliding_attention / full_attention per layer ({layers})"
        )
    pattern = [int(t == "sliding_attention") for t in types]
    if window is None or not any(pattern):
        return {}
    alternating = pattern == [int(i % 2 == 0) for i in range(layers)]
    return {"window_size": [window, 0], "window_attn_skip_freq": 2 if alternating else pattern}


def _gpt_oss_rope(src: _Source) -> dict:
    """YaRN on plain attention: megatron-core's GPTModel position_embedding_type yarn."""
    scaling = src.get("rope_scaling", dict, optional=True)
    if scaling is None:
        return {"position_embedding_type": "rope"}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in FREQUENCY_ONLY_ROPE:
        _check_rope_fields(src, scaling, kind)
        return {"position_embedding_type": "rope"}
    if kind != "yarn":
        raise src.error("rope_scaling", f"type {kind!r} is not modelled (supported: none, yarn)")
    # truncate changes the frequencies only
    return {"position_embedding_type": "yarn", **_yarn_fields(src, scaling, ("truncate",))}


def _gpt_oss_moe(src: _Source) -> dict:
    """128 / 32 experts of intermediate_size with biases, top-k then softmax over the k (HF's
    GptOssTopKRouter: megatron-core's router without pre-softmax; both routers have a bias
    [E], megatron-core's with add_bias_linear). GPT-OSS's activation:
    (up + 1) * gate * sigmoid(1.702 gate), gate and up clamped by swiglu_limit, is
    megatron-core's quick_geglu with glu_linear_offset 1 (hidden_act is not read by HF's
    GptOssExperts)."""
    limit = src.get("swiglu_limit", float, optional=True)
    out = {
        "num_experts": src.get("num_local_experts", int),
        "moe_router_topk": src.get("num_experts_per_tok", int),
        "moe_ffn_hidden_size": src.get("intermediate_size", int),
        "moe_router_pre_softmax": False,
        "activation": "quick_geglu",
        "glu_linear_offset": 1.0,
    }
    if limit is not None:
        out["activation_func_clamp_value"] = limit
    return out


def _mtp(src: _Source) -> dict:
    depth = src.get("num_nextn_predict_layers", int)
    return {"mtp_num_layers": depth} if depth else {}


# NemotronH's MLP activation (mlp_hidden_act): up -> act -> down, no gate.
NEMOTRON_H_ACTIVATIONS = {"relu2": "squared_relu", "relu": "relu", "gelu": "gelu", "silu": "silu"}


def _nemotron_h_pattern(src: _Source) -> dict:
    """hybrid_override_pattern, one symbol a layer as megatron-core reads it; multi-token
    prediction (num_nextn_predict_layers, its layers' pattern in mtp_hybrid_override_pattern)
    is the pattern's `/` part, once per depth (megatron-core 0.19's HybridModel)."""
    from metatrace.config.release import since

    pattern = src.get("hybrid_override_pattern", str)
    if len(pattern) != src.get("num_hidden_layers", int):
        raise src.error(
            "hybrid_override_pattern",
            f"has {len(pattern)} layers, num_hidden_layers says "
            f"{src.get('num_hidden_layers', int)}",
        )
    depth = src.get("num_nextn_predict_layers", int)
    if not depth:
        return {"hybrid_layer_pattern": pattern}
    if not since(0, 19):
        raise src.error(
            "num_nextn_predict_layers",
            "multi-token prediction in a hybrid model needs megatron-core 0.19 (0.16.1's "
            "MambaModel has none); set it to 0 in a copy of the file to leave it out",
        )
    mtp = src.get("mtp_hybrid_override_pattern", str, optional=True)
    if not mtp:
        raise src.error(
            "num_nextn_predict_layers",
            "the prediction layers' pattern is not in the file (mtp_hybrid_override_pattern); "
            "give model.hybrid_layer_pattern with its '/' part",
        )
    return {"hybrid_layer_pattern": pattern + ("/" + mtp) * depth}


def _nemotron_h_mamba(src: _Source) -> dict:
    """Mamba-2 mixers. megatron-core's MambaMixer takes heads x head_dim as its inner width
    (expand is then not read, as in transformers' NemotronH), a kernel-4 convolution with a
    bias, SiLU, and no projection biases."""
    if src.get("conv_kernel", int) != 4:
        raise src.error("conv_kernel", "megatron-core's Mamba layers convolve over 4 positions")
    if src.get("mamba_hidden_act", str) != "silu":
        raise src.error("mamba_hidden_act", "megatron-core's MambaMixer uses silu only")
    if not src.get("use_conv_bias", bool):
        raise src.error("use_conv_bias", "megatron-core's MambaMixer always has a conv bias")
    if src.get("mamba_proj_bias", bool):
        raise src.error("mamba_proj_bias", "megatron-core's MambaMixer has no projection bias")
    if src.get("residual_in_fp32", bool):
        raise src.error("residual_in_fp32", "an fp32 residual stream is not modelled")
    heads = src.get("mamba_num_heads", int, optional=True)
    out = {
        "mamba_head_dim": src.get("mamba_head_dim", int),
        "mamba_state_dim": src.get("ssm_state_size", int),
        "mamba_num_groups": src.get("n_groups", int),
    }
    if heads is None:  # inner width expand x hidden
        inner = src.get("expand", int) * src.get("hidden_size", int)
        heads = inner // out["mamba_head_dim"]
    return {**out, "mamba_num_heads": heads}


def _nemotron_h_dense(src: _Source) -> dict:
    act = src.get("mlp_hidden_act", str)
    if act not in NEMOTRON_H_ACTIVATIONS:
        raise src.error(
            "mlp_hidden_act", f"not modelled; known: {', '.join(NEMOTRON_H_ACTIVATIONS)}"
        )
    for field in ("attention_bias", "mlp_bias", "use_bias"):
        if src.get(field, bool):
            raise src.error(field, "biases in a hybrid model are not modelled")
    if src.get("sliding_window", int, optional=True) is not None:
        raise src.error("sliding_window", "sliding-window attention is not modelled here")
    dim = src.get("head_dim", int, optional=True)
    if dim is None:
        dim = src.get("attention_head_dim", int, optional=True)
    out = {
        "activation": NEMOTRON_H_ACTIVATIONS[act],
        "norm_epsilon": src.get("layer_norm_epsilon", float),
        "num_query_groups": src.get("num_key_value_heads", int),
    }
    return out if dim is None else {**out, "kv_channels": dim}


def _nemotron_h_moe(src: _Source) -> dict:
    """NemotronH's MoE layers (E): sigmoid scores with a correction bias (aux-loss-free
    balancing), top-k renormalised and scaled, shared experts of their summed width; LatentMoE
    (moe_latent_size)."""
    experts = src.get("n_routed_experts", int, optional=True)
    if not experts:
        return {}
    if not src.get("norm_topk_prob", bool) and src.get("num_experts_per_tok", int) > 1:
        raise src.error(
            "norm_topk_prob", "megatron-core always renormalises the top-k sigmoid scores"
        )
    shared = src.get("n_shared_experts", int) * src.get("moe_shared_expert_intermediate_size", int)
    out = {
        "num_experts": experts,
        "moe_router_topk": src.get("num_experts_per_tok", int),
        "moe_ffn_hidden_size": src.get("moe_intermediate_size", int),
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": src.get("routed_scaling_factor", float),
    }
    if shared:
        out["moe_shared_expert_intermediate_size"] = shared
    if src.get("n_group", int) > 1:
        out["moe_router_num_groups"] = src.get("n_group", int)
        out["moe_router_group_topk"] = src.get("topk_group", int)
    latent = src.get("moe_latent_size", int, optional=True)
    return out if latent is None else {**out, "moe_latent_size": latent}


def _qwen3_next_layers(src: _Source) -> dict:
    """Gated DeltaNet in the layers that keep no full attention: every full_attention_interval-
    th layer is attention (HF's layer_types, when given, says it per layer), as megatron-core's
    linear_attention_freq; the attention is gated (q_proj doubles for the gate)."""
    layers = src.get("num_hidden_layers", int)
    interval = src.get("full_attention_interval", int)
    if interval < 1:
        raise src.error("full_attention_interval", "must be at least 1")
    freq: int | list[int] = interval
    types = src.get("layer_types", list, optional=True) if src.has("layer_types") else None
    if types is not None:
        if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
            raise src.error(
                "layer_types",
                f"needs one of linear_attention / full_attention per layer ({layers})",
            )
        pattern = [int(t == "linear_attention") for t in types]
        if pattern != [0 if (i + 1) % interval == 0 else 1 for i in range(layers)]:
            freq = pattern
    return {
        "linear_attention_freq": freq,
        "linear_conv_kernel_dim": src.get("linear_conv_kernel_dim", int),
        "linear_key_head_dim": src.get("linear_key_head_dim", int),
        "linear_value_head_dim": src.get("linear_value_head_dim", int),
        "linear_num_key_heads": src.get("linear_num_key_heads", int),
        "linear_num_value_heads": src.get("linear_num_value_heads", int),
        "rotary_percent": src.get("partial_rotary_factor", float),
    }


def _qwen3_next_shared(src: _Source) -> dict:
    # one shared expert behind a sigmoid gate (Qwen3NextSparseMoeBlock.shared_expert_gate;
    # Megatron-Bridge's qwen3_next_bridge.py sets moe_shared_expert_gate)
    width = src.get("shared_expert_intermediate_size", int)
    return (
        {"moe_shared_expert_intermediate_size": width, "moe_shared_expert_gate": True}
        if width
        else {}
    )


# ----------------------------------------------------------------------------- families

_DENSE_RULES = (
    Rule(("num_key_value_heads",), _query_groups),
    Rule(("head_dim",), _head_dim),
    Rule(("rope_theta",), _rope_theta),
    Rule(("hidden_act",), _activation),
    Rule(("tie_word_embeddings",), _tied),
    Rule(("rope_scaling",), _rope_scaling),
)
_WINDOW = Rule(
    ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"), _sliding_window
)
_NO_BIASES = {"add_bias_linear": False, "add_qkv_bias": False}
_BASE_DEFAULTS = {
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "rope_scaling": None,
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-6,
}
_QWEN_DEFAULTS = {
    **_BASE_DEFAULTS,
    "rope_theta": 10000,
    "max_position_embeddings": 32768,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
_MOE_ROUTER = Rule(("output_router_logits", "router_aux_loss_coef"), _router_aux_loss)

# Fields of the hybrid families that change nothing metatrace measures.
_HYBRID_INERT = {
    "chunk_size": "the Mamba-2 scan's chunk: kernel tiling, the same tensors",
    "time_step_min": "initialisation",
    "time_step_max": "initialisation",
    "time_step_floor": "initialisation",
    "time_step_rank": "unused by Mamba-2",
    "rescale_prenorm_residual": "initialisation",
    "use_mamba_kernels": "HF's choice of kernels",
    "num_logits_to_keep": "inference",
    "max_position_embeddings": "no position embedding: no table of that length",
    "hidden_dropout": "0 in every published file (training.* has no residual dropout here)",
    "expand": "inner width heads x head_dim (mamba_num_heads given)",
}


def _inert(src: _Source) -> dict:
    if src.get("hidden_dropout", float):
        raise src.error("hidden_dropout", "residual dropout in a hybrid model is not modelled")
    return {}


_QWEN3_EXPERTS = Rule(
    (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "decoder_sparse_step",
        "mlp_only_layers",
        "norm_topk_prob",
    ),
    _qwen3_moe,
)
"""Qwen3-MoE's experts (Qwen3-MoE and Qwen3-Next)."""


FAMILIES: dict[str, Family] = {
    "llama": Family(
        _RENAMES,
        _DENSE_RULES + (Rule(("attention_bias", "mlp_bias"), _llama_biases),),
        _FIXED,
        {
            **_BASE_DEFAULTS,
            "rope_theta": 10000,
            "max_position_embeddings": 2048,
            "attention_bias": False,
            "mlp_bias": False,
        },
    ),
    "mistral": Family(
        _RENAMES,
        _DENSE_RULES + (_WINDOW,),
        {**_FIXED, **_NO_BIASES},
        {
            **_BASE_DEFAULTS,
            "rope_theta": 10000,
            "max_position_embeddings": 4096 * 32,
            "sliding_window": 4096,
        },
    ),
    "mixtral": Family(
        _RENAMES,
        _DENSE_RULES
        + (
            _WINDOW,
            _MOE_ROUTER,
            Rule(("num_local_experts", "num_experts_per_tok", "router_jitter_noise"), _mixtral_moe),
        ),
        {**_FIXED, **_NO_BIASES},
        {
            **_BASE_DEFAULTS,
            "rope_theta": 1000000,
            "max_position_embeddings": 4096 * 32,
            "rms_norm_eps": 1e-5,
            "sliding_window": None,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        },
    ),
    # Qwen2 has biases on q, k and v (hard-wired, no field) and none elsewhere.
    "qwen2": Family(
        _RENAMES,
        _DENSE_RULES + (_WINDOW,),
        {**_FIXED, "add_bias_linear": False, "add_qkv_bias": True},
        _QWEN_DEFAULTS,
    ),
    "qwen3": Family(
        _RENAMES,
        _DENSE_RULES + (_WINDOW, Rule(("attention_bias",), _attention_biases)),
        {**_FIXED, "qk_layernorm": True},
        {**_QWEN_DEFAULTS, "head_dim": 128},
    ),
    "qwen3_moe": Family(
        _RENAMES,
        _DENSE_RULES
        + (
            _WINDOW,
            Rule(("attention_bias",), _attention_biases),
            _MOE_ROUTER,
            _QWEN3_EXPERTS,
        ),
        {**_FIXED, "qk_layernorm": True},
        {
            **_QWEN_DEFAULTS,
            "decoder_sparse_step": 1,
            "mlp_only_layers": None,
            "norm_topk_prob": False,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        },
    ),
    # GPT-OSS: biases on every linear (attention_bias; the experts always have theirs),
    # attention sinks (HF's `sinks` parameter per head: softmax_type learnable).
    "gpt_oss": Family(
        _RENAMES,
        (
            Rule(("num_key_value_heads",), _query_groups),
            Rule(("head_dim",), _head_dim),
            Rule(("rope_theta",), _rope_theta),
            Rule(("tie_word_embeddings",), _tied),
            Rule(("attention_bias",), _gpt_oss_biases),
            Rule(("rope_scaling", "initial_context_length"), _gpt_oss_rope),
            Rule(("sliding_window", "layer_types"), _gpt_oss_window),
            _MOE_ROUTER,
            Rule(
                (
                    "num_local_experts",
                    "num_experts_per_tok",
                    "experts_per_token",
                    "swiglu_limit",
                    "hidden_act",
                ),
                _gpt_oss_moe,
            ),
        ),
        {**_FIXED, "softmax_type": "learnable"},
        # transformers' GptOssConfig defaults
        {
            **_BASE_DEFAULTS,
            "rope_theta": 150000,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "attention_bias": True,
            "sliding_window": 128,
            "layer_types": None,
            "num_local_experts": 128,
            "num_experts_per_tok": 4,
            "swiglu_limit": 7.0,
            "initial_context_length": 4096,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.9,
        },
    ),
    # Nemotron-H and Nemotron 3 (NemotronHForCausalLM): a hybrid pattern of Mamba-2 (M),
    # attention (*), MLP (-) and MoE (E) layers; no position embedding.
    "nemotron_h": Family(
        {k: v for k, v in _RENAMES.items() if k not in ("rms_norm_eps", "max_position_embeddings")},
        (
            Rule(
                (
                    "hybrid_override_pattern",
                    "num_nextn_predict_layers",
                    "mtp_hybrid_override_pattern",
                ),
                _nemotron_h_pattern,
            ),
            Rule(
                (
                    "mamba_num_heads",
                    "mamba_head_dim",
                    "ssm_state_size",
                    "n_groups",
                    "conv_kernel",
                    "mamba_hidden_act",
                    "use_conv_bias",
                    "mamba_proj_bias",
                    "residual_in_fp32",
                ),
                _nemotron_h_mamba,
            ),
            Rule(
                (
                    "mlp_hidden_act",
                    "attention_bias",
                    "mlp_bias",
                    "use_bias",
                    "sliding_window",
                    "head_dim",
                    "attention_head_dim",
                    "layer_norm_epsilon",
                    "rms_norm_eps",
                    "num_key_value_heads",
                ),
                _nemotron_h_dense,
            ),
            Rule(
                (
                    "n_routed_experts",
                    "n_shared_experts",
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                    "moe_shared_expert_intermediate_size",
                    "routed_scaling_factor",
                    "norm_topk_prob",
                    "n_group",
                    "topk_group",
                    "moe_latent_size",
                ),
                _nemotron_h_moe,
            ),
            Rule(("tie_word_embeddings",), _tied),
            Rule(tuple(_HYBRID_INERT), _inert),
        ),
        {
            "normalization": "RMSNorm",
            "position_embedding_type": "none",
            "hidden_dropout": 0.0,
            "add_bias_linear": False,
        },
        # transformers' NemotronHConfig defaults (v4.5x) of the fields a file may omit
        {
            "attention_dropout": 0.0,
            "hidden_dropout": 0.0,
            "tie_word_embeddings": False,
            "num_key_value_heads": 8,
            "head_dim": None,
            "attention_head_dim": None,
            "mlp_hidden_act": "relu2",
            "attention_bias": False,
            "mlp_bias": False,
            "use_bias": False,
            "sliding_window": None,
            "layer_norm_epsilon": 1e-5,
            "mamba_num_heads": 128,
            "mamba_head_dim": 64,
            "ssm_state_size": 128,
            "n_groups": 8,
            "conv_kernel": 4,
            "expand": 2,
            "mamba_hidden_act": "silu",
            "use_conv_bias": True,
            "mamba_proj_bias": False,
            "residual_in_fp32": False,
            "num_nextn_predict_layers": 0,
            "n_routed_experts": None,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 1024,
            "moe_shared_expert_intermediate_size": 1024,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": True,
            "n_group": 1,
            "topk_group": 1,
            "moe_latent_size": None,
        },
    ),
    # Qwen3-Next (Qwen3NextForCausalLM): Qwen3-MoE with Gated DeltaNet in three of four
    # layers, gated attention and partial RoPE; megatron-core's GPT model with
    # experimental_attention_variant gated_delta_net.
    "qwen3_next": Family(
        _RENAMES,
        _DENSE_RULES
        + (
            Rule(("attention_bias",), _attention_biases),
            Rule(("use_sliding_window", "sliding_window", "max_window_layers"), _sliding_window),
            _MOE_ROUTER,
            _QWEN3_EXPERTS,
            Rule(("shared_expert_intermediate_size",), _qwen3_next_shared),
            Rule(
                (
                    "full_attention_interval",
                    "layer_types",
                    "linear_conv_kernel_dim",
                    "linear_key_head_dim",
                    "linear_value_head_dim",
                    "linear_num_key_heads",
                    "linear_num_value_heads",
                    "partial_rotary_factor",
                ),
                _qwen3_next_layers,
            ),
            Rule(("num_nextn_predict_layers",), _mtp),
        ),
        {**_FIXED, "qk_layernorm": True, "attention_output_gate": True},
        # transformers' Qwen3NextConfig defaults
        {
            **_QWEN_DEFAULTS,
            "head_dim": 256,
            "partial_rotary_factor": 0.25,
            "full_attention_interval": 4,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "decoder_sparse_step": 1,
            "mlp_only_layers": None,
            "norm_topk_prob": True,
            "shared_expert_intermediate_size": 512,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            "num_nextn_predict_layers": 0,
        },
    ),
    "deepseek_v3": Family(
        _RENAMES,
        (
            Rule(("rope_theta",), _rope_theta),
            Rule(("hidden_act",), _activation),
            Rule(("tie_word_embeddings",), _tied),
            Rule(("attention_bias",), _attention_biases),
            Rule(
                (
                    "q_lora_rank",
                    "kv_lora_rank",
                    "qk_nope_head_dim",
                    "qk_rope_head_dim",
                    "v_head_dim",
                    "num_key_value_heads",
                    "head_dim",
                ),
                _mla,
            ),
            Rule(("rope_scaling",), _mla_rope_scaling),
            Rule(
                (
                    "n_routed_experts",
                    "n_shared_experts",
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                    "first_k_dense_replace",
                    "moe_layer_freq",
                ),
                _deepseek_moe,
            ),
            Rule(
                (
                    "scoring_func",
                    "topk_method",
                    "norm_topk_prob",
                    "routed_scaling_factor",
                    "n_group",
                    "topk_group",
                    "seq_aux",
                    "aux_loss_alpha",
                ),
                _deepseek_router,
            ),
            Rule(("num_nextn_predict_layers",), _mtp),
        ),
        _FIXED,
        # the remote-code DeepseekV3Config's defaults (transformers' own class agrees)
        {
            **_BASE_DEFAULTS,
            "rope_theta": 10000,
            "max_position_embeddings": 4096,
            "attention_bias": False,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048,
            "first_k_dense_replace": 3,
            "moe_layer_freq": 1,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "n_group": 8,
            "topk_group": 4,
            "seq_aux": True,
            "aux_loss_alpha": 0.001,
            "num_nextn_predict_layers": 1,
        },
    ),
}


# ----------------------------------------------------------------------------- reading


def _load(path: Path) -> dict:
    data = parse_json(read_text(path, "Hugging Face config"), str(path))
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a Hugging Face config is a JSON object, got {type(data).__name__}"
        )
    return data


def read_hf_config(
    path: str | Path, *, seq_length: int | None = None
) -> tuple[dict, tuple[str, ...]]:
    """The model keys a Hugging Face config.json stands for, and notes for the user (one
    warning names the fields no table knows). `seq_length` decides whether a sliding window
    masks anything."""
    path = Path(path)
    data = _load(path)
    model_type = data.get("model_type")
    if not isinstance(model_type, (str, type(None))):
        raise ConfigError(f"{path}: 'model_type' must be a string, got {excerpt(model_type)}")
    if model_type not in FAMILIES:
        what = (
            "no 'model_type'"
            if model_type is None
            else f"'model_type' {excerpt(model_type)} is not supported"
        )
        raise ConfigError(f"{path}: {what} (supported: {', '.join(FAMILIES)})")
    family = FAMILIES[model_type]
    missing = [f for f in REQUIRED if f not in data]
    if missing:
        raise ConfigError(
            f"{path}: {', '.join(repr(f) for f in missing)} missing "
            f"(a {model_type} config needs {', '.join(REQUIRED)})"
        )
    src = _Source(path, {**family.defaults, **data}, seq_length)
    dims = dict(family.fixed)
    for field, (key, kind) in family.renames.items():
        dims[key] = src.get(field, kind)
    for rule in family.rules:
        dims.update(rule.apply(src))
    known = set(IGNORED) | set(family.renames) | {f for r in family.rules for f in r.fields}
    unknown = sorted(set(data) - known) + src.unknown
    if unknown:
        src.notes.append(
            f"warning: {path}: fields metatrace does not know, not used: {', '.join(unknown)}"
        )
    return dims, tuple(src.notes)
