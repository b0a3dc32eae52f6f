"""Resolving a job: every default and derived value the way Megatron-LM derives it (ffn size,
kv channels, padded vocabulary, data-parallel size, micro-batches, attention kernel, ...), then
the rules Megatron-LM and megatron-core enforce (metatrace.config.checks). megatron-core's own
TransformerConfig checks run before a trace (metatrace.tracing.checks)."""

from __future__ import annotations

import dataclasses
import difflib
import math

from metatrace.config.checks import (
    check_job,
    idle_keys,
    idle_modules,
    key_default,
    layout_stages,
)
from metatrace.config.hardware import (
    GPU_HOST_GBPS,
    GPU_LINKS_GBPS,
    GPU_MEMORY_GIB,
    GPU_NVLINK_DOMAIN,
)
from metatrace.config.job import (
    GATED_ACTIVATIONS,
    Job,
    Model,
    NotModelled,
    Recompute,
    replace,
)
from metatrace.config.release import since as release_since
from metatrace.errors import ConfigError


def resolve(job: Job) -> Job:
    """Apply the preset, derive every default the way Megatron-LM does, and check the result."""
    job, ignored = _drop_idle(replace(job, model=_resolve_model(job.model)))
    model = job.model
    training = job.training
    if training.seq_length is None:
        raise ConfigError("'training.seq_length' is required")
    if model.max_position_embeddings is None:
        model = replace(model, max_position_embeddings=training.seq_length)

    par = job.parallel
    cl = job.cluster
    if par.etp is None:
        par = replace(par, etp=par.tp)
    if par.vpp == 1:
        par = replace(par, vpp=None)
    model_size = par.tp * par.pp * par.cp
    for name in ("tp", "pp", "cp", "ep", "etp"):
        if getattr(par, name) < 1:
            raise ConfigError(f"'parallel.{name}' must be at least 1, got {getattr(par, name)}")
    if par.vpp is not None and par.vpp < 1:
        raise ConfigError(f"'parallel.vpp' must be at least 1, got {par.vpp}")
    if par.dp is not None and par.dp < 1:
        raise ConfigError(f"'parallel.dp' must be at least 1, got {par.dp}")
    if cl.num_gpus is None:
        cl = replace(cl, num_gpus=model_size * (par.dp or 1))
    if cl.num_gpus < 1:
        raise ConfigError(f"'cluster.num_gpus' must be at least 1, got {cl.num_gpus}")
    if cl.gpus_per_node < 1:
        raise ConfigError(f"'cluster.gpus_per_node' must be at least 1, got {cl.gpus_per_node}")
    if cl.nvlink_domain is None:
        cl = replace(cl, nvlink_domain=GPU_NVLINK_DOMAIN.get(cl.gpu, cl.gpus_per_node))
    if cl.nvlink_domain < cl.gpus_per_node or cl.nvlink_domain % cl.gpus_per_node:
        raise ConfigError(
            f"'cluster.nvlink_domain' ({cl.nvlink_domain}) must be a multiple of "
            f"cluster.gpus_per_node ({cl.gpus_per_node})"
        )
    if par.dp is None:
        if cl.num_gpus % model_size:
            raise ConfigError(
                f"cluster.num_gpus = {cl.num_gpus} is not divisible by "
                f"tp x pp x cp = {par.tp} x {par.pp} x {par.cp} = {model_size}"
            )
        par = replace(par, dp=cl.num_gpus // model_size)
    elif model_size * par.dp != cl.num_gpus:
        raise ConfigError(
            f"tp x pp x cp x dp = {par.tp} x {par.pp} x {par.cp} x {par.dp} = "
            f"{model_size * par.dp}, but cluster.num_gpus = {cl.num_gpus}"
        )
    if cl.gpu_memory_gib is None:
        if cl.gpu not in GPU_MEMORY_GIB:
            close = difflib.get_close_matches(cl.gpu, list(GPU_MEMORY_GIB), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown 'cluster.gpu' {cl.gpu!r}{hint} (known: {', '.join(GPU_MEMORY_GIB)}); "
                "or give cluster.gpu_memory_gib"
            )
        cl = replace(cl, gpu_memory_gib=GPU_MEMORY_GIB[cl.gpu])
    intra, inter = GPU_LINKS_GBPS.get(cl.gpu, (None, None))
    if cl.intra_node_gbps is None or cl.inter_node_gbps is None:
        if intra is None:
            raise ConfigError(
                f"no link bandwidths are known for cluster.gpu {cl.gpu!r}; give "
                "cluster.intra_node_gbps and cluster.inter_node_gbps"
            )
        cl = replace(
            cl,
            intra_node_gbps=cl.intra_node_gbps if cl.intra_node_gbps is not None else intra,
            inter_node_gbps=cl.inter_node_gbps if cl.inter_node_gbps is not None else inter,
        )
    if cl.host_link_gbps is None and cl.gpu in GPU_HOST_GBPS:
        cl = replace(cl, host_link_gbps=float(GPU_HOST_GBPS[cl.gpu]))
    for name in ("intra_node_gbps", "inter_node_gbps", "host_link_gbps"):
        if getattr(cl, name) is not None and getattr(cl, name) <= 0:
            raise ConfigError(f"'cluster.{name}' must be positive, got {getattr(cl, name)}")

    if training.global_batch_size is None:
        training = replace(training, global_batch_size=training.micro_batch_size * par.dp)
    notes = ignored + _cublas_notes(cl)
    not_modelled = list(job.not_modelled)
    for item in _allocator_unknown(cl):
        if item.startswith("backend:"):
            missing = NotModelled(
                f"PYTORCH_ALLOC_CONF {item}",
                "CUDA's asynchronous allocator (the verdict simulates PyTorch's)",
                "either",
            )
            if missing not in not_modelled:
                not_modelled.append(missing)
        else:
            notes.append(f"PYTORCH_ALLOC_CONF {item}: no effect on what metatrace predicts")
    if par.moe_token_dispatcher_type == "flex" and model.num_experts:
        notes.append(
            "warning: DeepEP's and HybridEP's communication buffers (cudaMalloc / NVSHMEM, "
            "outside PyTorch's allocator, sized by DeepEP's C++ configs) are not in the peaks or "
            "the verdict: the reserved overhead must hold them"
        )
    if par.etp != par.tp and model.num_experts is None:
        notes.append(
            f"parallel.etp = {par.etp} only lays out the expert process groups (megatron-core "
            "builds them for every model); this model has no experts"
        )
    if model.hybrid_layer_pattern is not None and not release_since(0, 19):
        if training.recompute.granularity == "full":
            notes.append(
                "warning: training.recompute full: megatron-core 0.16.1's MambaStack runs its "
                "layers without checkpointing them (0.19's HybridStack does), so nothing is "
                "recomputed"
            )
        if training.precision == "fp4":
            notes.append(
                "warning: training.precision fp4: megatron-core 0.16.1's MambaStack enters no FP4 "
                "context (0.19's HybridStack does), so its layers run in bf16"
            )
    if par.sequence_parallel and par.tp == 1:
        par = replace(par, sequence_parallel=False)
        notes.append(
            "parallel.sequence_parallel changes nothing at tp = 1 (Megatron-LM turns it off): ignored"
        )
    if training.grad_reduce_in_fp32 is None:
        # Megatron-LM's validate_args: bf16 accumulates and reduces gradients in fp32 unless
        # the main grads are asked for in bf16 (--grad-reduce-in-bf16 / --main-grads-dtype).
        training = replace(
            training,
            grad_reduce_in_fp32=training.precision in ("bf16", "fp8", "fp4")
            and training.main_grads_dtype == "fp32",
        )
    if training.megatron_fsdp:
        training = _megatron_fsdp(training, notes)
    if par.overlap_p2p_comm is None:
        par = replace(par, overlap_p2p_comm=par.vpp is not None)
    if par.microbatch_group_size is None and par.vpp is not None:
        par = replace(par, microbatch_group_size=par.pp)
    if par.layout is not None:
        stages = layout_stages(par.layout, par.pp)
        vpp = len(stages) // par.pp
        if par.vpp is not None and par.vpp != vpp:
            raise ConfigError(
                f"parallel.vpp = {par.vpp}, but parallel.layout has {len(stages)} stages = "
                f"pp {par.pp} x {vpp} virtual stages"
            )
        par = replace(par, vpp=vpp if vpp > 1 else None)
        if par.vpp is not None:
            par = replace(
                par,
                overlap_p2p_comm=True
                if job.parallel.overlap_p2p_comm is None
                else par.overlap_p2p_comm,
                microbatch_group_size=par.microbatch_group_size or par.pp,
            )
    impl = job.implementation
    te = impl.transformer_impl == "transformer_engine"
    if impl.rope_fusion is None:
        # Megatron-LM's default with Transformer Engine, turned off without RoPE.
        # megatron-core fuses MLA's RoPE only for yarn (MLATransformerConfig refuses the rest).
        impl = replace(
            impl,
            rope_fusion=te
            and (
                model.position_embedding_type == "yarn"
                or (
                    model.position_embedding_type == "rope"
                    and (not model.multi_latent_attention or model.rope_type == "yarn")
                )
            ),
        )
    kernel = impl.attention_backend
    if kernel == "auto":
        # Transformer Engine 2.8 prefers cuDNN fused attention on sm90+ and, without a
        # flash-attn it accepts (2.1.1-2.8.1), on sm80 too; the local spec has one attention.
        kernel = "fused" if te else "local"
        window = model.window_size
        shaped = window is not None and len(window) == 2  # checks.py refuses other shapes
        if te and shaped and (window[1] not in (-1, 0) or model.attention_dropout):
            # TE 2.8 (utils.py, "Filter: Sliding window attention") turns cuDNN off for these
            # windows; flash-attn takes them, but not softmax sinks ("Filter: Softmax type").
            kernel = "flash" if model.softmax_type == "vanilla" else "unfused"
    if not te and kernel == "unfused":
        kernel = "local"  # megatron-core's own attention is the unfused one
    if training.precision == "fp8":
        training = replace(
            training,
            fp8_format=training.fp8_format or "hybrid",
            fp8_recipe=training.fp8_recipe or "delayed",
        )
    if training.precision == "fp4":
        training = replace(training, fp4_recipe=training.fp4_recipe or "nvfp4")
    rec = training.recompute
    if rec.granularity == "selective" and rec.modules is None:
        rec = replace(rec, modules=["core_attn"])
        training = replace(training, recompute=rec)
    training = _graph_warmup_recompute(training, notes)

    multiple = max(model.make_vocab_size_divisible_by, 1) * par.tp  # < 1: refused by checks
    padded = math.ceil(model.vocab_size / multiple) * multiple
    job = replace(
        job,
        model=model,
        parallel=par,
        training=training,
        cluster=cl,
        implementation=impl,
        padded_vocab_size=padded,
        notes=tuple(notes),
        not_modelled=tuple(not_modelled),
        attention_kernel=kernel,
    )
    check_job(job)
    micro = training.micro_batch_size * par.dp
    return replace(job, num_microbatches=training.global_batch_size // micro)


# Megatron-LM's command-line defaults for the model section when neither a preset nor the
# file sets them (../shared/notes/megatron-args.md, sections 2 and 4).
_MODEL_DEFAULTS = {
    "position_embedding_type": "learned_absolute",
    "rotary_base": 10000,
    "normalization": "LayerNorm",
    "activation": "gelu",
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "untie_embeddings_and_output_weights": False,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
}
_REQUIRED_MODEL = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


def _reset(values, path: list[str]):
    """`values` (a dataclass instance) with the key at `path` (names, outermost first) set back
    to what it is when not given."""
    name, *rest = path
    if rest:
        return replace(values, **{name: _reset(getattr(values, name), rest)})
    default = key_default(type(values), name)
    if isinstance(values, Model):  # where neither a preset nor the file sets it
        default = _MODEL_DEFAULTS.get(name, default)
    return replace(values, **{name: default})


def _drop_idle(job: Job) -> tuple[Job, list[str]]:
    """`job` without the keys that act only with a setting it does not have (checks.idle_keys),
    each reset to its default, and a note for each group saying so."""
    notes, idle = [], idle_modules(job)
    for keys, parent in idle_keys(job):
        for path in keys:
            job = _reset(job, path.split("."))
        notes.append(f"{', '.join(keys)} {_change(keys)} nothing without {parent}: ignored")
    if idle is not None:
        names, parent = idle
        rec = job.training.recompute
        kept = [name for name in rec.modules if name not in names]
        job = replace(job, training=replace(job.training, recompute=replace(rec, modules=kept)))
        given = ", ".join(repr(name) for name in names)
        notes.append(
            f"training.recompute.modules {given} {_change(names)} nothing without {parent}: ignored"
        )
    return job, notes


def _change(keys: list[str]) -> str:
    return "changes" if len(keys) == 1 else "change"


def _megatron_fsdp(tr, notes: list[str]):
    """What Megatron-FSDP sets around it: the distributed optimizer (Megatron-LM forces it), the
    overlapped gradient reduce-scatter when gradients are sharded and the overlapped parameter
    all-gather when parameters are (megatron-core's MegatronFSDP.__init__ sets both in its
    DDP config), and no gradient-accumulation fusion or averaging in the collective
    (Megatron-Bridge turns both off; megatron-core 0.16.1's own linear layers would run
    `torch.matmul(bf16, bf16, out=fp32 main_grad)`, which torch refuses)."""
    strategy = tr.fsdp_sharding_strategy
    changes = {"distributed_optimizer": True}
    if strategy in ("optim_grads", "optim_grads_params"):
        changes["overlap_grad_reduce"] = True
    if strategy == "optim_grads_params":
        changes["overlap_param_gather"] = True
    changes["gradient_accumulation_fusion"] = False
    changes["ddp_average_in_collective"] = False
    turned = [k for k, value in changes.items() if getattr(tr, k) != value]
    if turned:
        notes.append(
            f"Megatron-FSDP ({strategy}) sets "
            + ", ".join(f"training.{k} = {str(changes[k]).lower()}" for k in turned)
            + " (megatron-core and Megatron-LM/Bridge do)"
        )
    return replace(tr, **changes)


def _resolve_model(model: Model) -> Model:
    values = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    if values["hybrid_layer_pattern"] is not None:
        _resolve_hybrid(values)
    for name, value in _MODEL_DEFAULTS.items():
        if values[name] is None:
            values[name] = value
    missing = [n for n in _REQUIRED_MODEL if values[n] is None]
    if missing:
        raise ConfigError(
            "model needs "
            + ", ".join(f"'model.{n}'" for n in missing)
            + " (or a model.preset or model.hf_config)"
        )
    for name in _REQUIRED_MODEL + ("ffn_hidden_size", "num_query_groups", "kv_channels"):
        if values[name] is not None and values[name] < 1:
            raise ConfigError(f"'model.{name}' must be at least 1, got {values[name]}")
    if values["add_bias_linear"]:
        values["add_qkv_bias"] = True  # Megatron-LM: linear biases include the QKV bias
    h = values["hidden_size"]
    if values["ffn_hidden_size"] is None:
        # Megatron-LM: 4h, or for SwiGLU floor(8h/3 / 64) * 64 (arguments.py, validate_args).
        gated = values["activation"] in GATED_ACTIVATIONS
        values["ffn_hidden_size"] = (4 * h * 2 // 3 // 64) * 64 if gated else 4 * h
    if values["kv_channels"] is None:
        if h % values["num_attention_heads"]:
            raise ConfigError(
                f"model.hidden_size = {h} is not divisible by model.num_attention_heads = "
                f"{values['num_attention_heads']}; give model.kv_channels"
            )
        values["kv_channels"] = h // values["num_attention_heads"]
    if values["num_query_groups"] is None:
        values["num_query_groups"] = values["num_attention_heads"]
    if values["rope_type"] is None:
        # megatron-core's MLATransformerConfig defaults to yarn; other attention rotates plainly.
        values["rope_type"] = "yarn" if values["multi_latent_attention"] else "rope"
    if values["num_experts"] is not None:
        if values["num_experts"] < 1:
            raise ConfigError(
                f"'model.num_experts' must be at least 1, got {values['num_experts']}"
            )
        if values["moe_ffn_hidden_size"] is None:
            values["moe_ffn_hidden_size"] = values["ffn_hidden_size"]
        values["moe_layer_freq"] = moe_layer_pattern(values["moe_layer_freq"], values["num_layers"])
    if values["mamba_num_heads"] is None and values["hybrid_layer_pattern"] is not None:
        # MambaMixer: d_inner = expand (2) x hidden_size, nheads = d_inner / headdim
        values["mamba_num_heads"] = 2 * h // values["mamba_head_dim"]
    return Model(**values)


def _resolve_hybrid(values: dict) -> None:
    """A hybrid layer pattern gives the number of layers, which layers are MoE layers and the
    multi-token-prediction depths (megatron-core counts them from the pattern)."""
    from metatrace.config.hybrid import MOE, parse

    pattern = parse(values["hybrid_layer_pattern"], since_0_19=release_since(0, 19))
    n = len(pattern.layers)
    if values["num_layers"] not in (None, n):
        raise ConfigError(
            f"model.num_layers = {values['num_layers']} but model.hybrid_layer_pattern has {n} "
            "layers; give one of them (megatron-core counts the pattern's symbols)"
        )
    values["num_layers"] = n
    moe = [1 if s == MOE else 0 for s in pattern.layers]
    if any(moe):
        if not values["num_experts"]:
            raise ConfigError(
                "model.hybrid_layer_pattern has mixture-of-experts layers (E): give "
                "model.num_experts"
            )
        values["moe_layer_freq"] = moe
    if pattern.mtp_depths:
        if values["mtp_num_layers"] not in (None, pattern.mtp_depths):
            raise ConfigError(
                f"model.mtp_num_layers = {values['mtp_num_layers']} but "
                f"model.hybrid_layer_pattern has {pattern.mtp_depths} prediction depths"
            )
        values["mtp_num_layers"] = pattern.mtp_depths


def _allocator_unknown(cl) -> tuple[str, ...]:
    """What the allocator simulation leaves out of cluster.allocator_conf (AllocatorConfig
    .unknown); a malformed one is left to the checks, which name its key."""
    from metatrace.config.allocator import parse_alloc_conf

    if not cl.allocator_conf:
        return ()
    try:
        return parse_alloc_conf(cl.allocator_conf).unknown
    except ConfigError:
        return ()


def _cublas_notes(cl) -> list[str]:
    """What PyTorch makes of cluster.cublas_workspace_config where it is not plain pairs."""
    from metatrace.config.hardware import CUBLAS_PAIR, cublas_default

    spec = cl.cublas_workspace_config
    if spec is None:
        return []
    pairs = CUBLAS_PAIR.findall(spec)
    if any(int(n) > 2**31 - 1 for pair in pairs for n in pair):
        raise ConfigError(
            f"CUBLAS_WORKSPACE_CONFIG {spec[:40]!r}: a number beyond 2**31 - 1, which "
            "PyTorch cannot read (std::stoi) and the run fails on"
        )
    if not pairs:
        return [
            f"CUBLAS_WORKSPACE_CONFIG {spec[:40]!r} has no ':SIZE:COUNT' pair: PyTorch warns and "
            f"uses its default {cublas_default(cl.gpu)}, as predicted here"
        ]
    return []


_MAX_PATTERN = 1 << 20  # entries of a layer-pattern expression (one per layer)


def list_expression(text: str):
    """Megatron-LM's layer-pattern expressions without eval: an integer, or integer lists joined
    by + and * (e.g. "([0]*3+[1]*58)"). ValueError for anything else."""
    import ast

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Mult):
                lists = [x for x in (left, right) if isinstance(x, list)]
                times = right if isinstance(left, list) else left
                if lists and isinstance(times, int) and len(lists[0]) * times > _MAX_PATTERN:
                    raise ValueError(text)  # more entries than any model has layers
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(text)

    try:
        return value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, TypeError):
        raise ValueError(text) from None


def moe_layer_pattern(freq, num_layers: int) -> list[int]:
    """model.moe_layer_freq as a 0/1 list per layer (1: MoE), as Megatron-LM reads it: every
    n-th layer from the first, a list, or an expression of lists such as "([0]*3+[1]*58)"."""
    where = "'model.moe_layer_freq'"
    if isinstance(freq, str):
        try:
            freq = list_expression(freq)
        except ValueError:
            raise ConfigError(
                f"{where} {freq!r} is not an integer, a list or an expression such as "
                '"([0]*3+[1]*58)"'
            ) from None
    if isinstance(freq, int):
        if freq < 1:
            raise ConfigError(f"{where} must be at least 1, got {freq}")
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    if len(freq) != num_layers or any(v not in (0, 1) for v in freq):
        raise ConfigError(
            f"{where} must give 0 (dense) or 1 (MoE) for each of the {num_layers} layers, got "
            f"{len(freq)} values"
        )
    return list(freq)


# Recompute that megatron-core runs through CheckpointWithoutOutput, which does nothing while
# cuda_graphs.is_graph_warmup() holds.
_OUTPUT_DISCARDING = ("layernorm", "moe_act", "mla_up_proj")


def _graph_warmup_recompute(tr, notes: list[str]):
    """megatron-core 0.16.1's per-layer local graphs set _IS_GRAPH_WARMUP at their first capture
    and never clear it (_set_warmup_end does nothing), so from then on the selective recompute
    that discards outputs is off: the captured layers save those outputs, and the capture's
    pool holds them."""
    rec = tr.recompute
    if not tr.local_layer_graphs or rec.granularity != "selective":
        return tr
    off = [m for m in rec.modules if m in _OUTPUT_DISCARDING]
    if not off:
        return tr
    kept = [m for m in rec.modules if m not in _OUTPUT_DISCARDING]
    notes.append(
        f"selective recompute of {', '.join(off)} is off once megatron-core 0.16.1's per-layer "
        "local CUDA graphs are captured (it never clears its graph warm-up flag, which turns "
        "CheckpointWithoutOutput off): traced without it"
    )
    rec = replace(rec, modules=kept) if kept else Recompute()
    return replace(tr, recompute=rec)
