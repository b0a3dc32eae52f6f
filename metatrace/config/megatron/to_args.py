"""A job -> Megatron-LM `pretrain_gpt.py` arguments: the reverse of metatrace.config.megatron.args.

`megatron_command(job)` gives every flag of the job, grouped by subject (one group a line when
printed): the model (dimensions, attention, positions, norm, activation, biases), its
vocabulary as a null tokenizer, the experts, multi-latent attention and multi-token prediction,
the layout (`layout_arg_groups`: parallel sizes, batch, precision, recompute, data-parallel
optimizer), the settings kept from the base job (offloading, Megatron FSDP, CUDA graphs, TP
communication overlap, kernels), synthetic data; the environment Megatron-LM asserts (one CUDA
connection with tp or cp before Blackwell); and the job's settings that no flag carries.
`job_from_args(megatron_args(job))` gives back the job's model section and `LAYOUT_FIELDS`
(tests/unit/test_megatron_to_args.py); `launcher(job)` is the torchrun command line of its GPUs.

How: the model's dimensions, vocabulary, experts and layout are written outright; every other
setting is found by parsing the flags back (metatrace.config.megatron.args) and writing a flag
for each key that comes back different (the flag that sets the key, `metatrace.config.megatron
.flags.FLAGS`, or one of the derivations in `_DERIVED`), until nothing changes. A key that still
differs has no flag: it is listed in `MegatronCommand.no_flag`.

Known limitations: the vocabulary is written as `--tokenizer-type NullTokenizer --vocab-size
V - 1` (core_v0.16.1's null tokenizer adds its end-of-document token; a newer Megatron-LM's
does not, one token fewer, the same padded vocabulary unless V - 1 is a multiple of the
padding); a real run gives its own tokenizer and `--data-path` instead of `--mock-data`, and
its own `--train-iters` and `--lr` (placeholders). A rank order other than Megatron-LM's two
(`--use-tp-pp-dp-mapping`) has no flag, nor has `parallel.tp_comm_overlap_cfg` a flag that holds
it inline (`--tp-comm-overlap-cfg` reads a YAML file).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from metatrace.config.checks import YARN_KEYS
from metatrace.config.hardware import GPU_ARCH
from metatrace.config.job import FSDP_DTYPES, OFFLOAD_KNOBS, SECTIONS, changed_from_default
from metatrace.config.megatron.flags import FLAGS, NEWER
from metatrace.errors import ConfigError

# (section, field) that layout_args reproduces through job_from_args.
LAYOUT_FIELDS = (
    ("parallel", "tp"),
    ("parallel", "pp"),
    ("parallel", "vpp"),
    ("parallel", "cp"),
    ("parallel", "ep"),
    ("parallel", "etp"),
    ("parallel", "dp"),
    ("parallel", "sequence_parallel"),
    ("parallel", "rank_order"),
    ("training", "seq_length"),
    ("training", "micro_batch_size"),
    ("training", "global_batch_size"),
    ("training", "precision"),
    ("training", "fp8_format"),
    ("training", "fp8_recipe"),
    ("training", "fp8_param_gather"),
    ("training", "fp4_recipe"),
    ("training", "recompute"),
    ("training", "distributed_optimizer"),
    ("training", "overlap_grad_reduce"),
    ("training", "overlap_param_gather"),
    ("training", "num_distributed_optimizer_instances"),
)

# Megatron-LM's --use-tp-pp-dp-mapping (metatrace.config.megatron.flags._CONST).
_TP_PP_DP = "tp-cp-ep-pp-dp"


def layout_arg_groups(job) -> list[list[str]]:
    """The flags of `job`'s layout, batch, precision, recompute and optimizer, by subject."""
    p, t = job.parallel, job.training
    parallel = [
        "--tensor-model-parallel-size",
        str(p.tp),
        "--pipeline-model-parallel-size",
        str(p.pp),
    ]
    if p.layout is not None:  # it gives the virtual stages (Megatron-LM refuses both)
        parallel += ["--pipeline-model-parallel-layout", p.layout]
    elif p.vpp:
        parallel += ["--num-virtual-stages-per-pipeline-rank", str(p.vpp)]
    if p.cp > 1:
        parallel += ["--context-parallel-size", str(p.cp)]
    if p.ep > 1:
        parallel += ["--expert-model-parallel-size", str(p.ep)]
    if p.etp is not None and p.etp != p.tp:
        parallel += ["--expert-tensor-parallel-size", str(p.etp)]
    if p.sequence_parallel:
        parallel.append("--sequence-parallel")
    if p.rank_order == _TP_PP_DP:
        parallel.append("--use-tp-pp-dp-mapping")
    batch = [
        "--seq-length",
        str(t.seq_length),
        "--micro-batch-size",
        str(t.micro_batch_size),
        "--global-batch-size",
        str(t.global_batch_size),
    ]
    batch += _precision(t)
    groups = [parallel, batch]
    recompute = _recompute(t.recompute)
    if recompute:
        groups.append(recompute)
    optimizer = []
    if t.distributed_optimizer:
        optimizer.append("--use-distributed-optimizer")
    if t.overlap_grad_reduce:
        optimizer.append("--overlap-grad-reduce")
    if t.overlap_param_gather:
        optimizer.append("--overlap-param-gather")
    if t.num_distributed_optimizer_instances > 1:
        optimizer += [
            "--num-distributed-optimizer-instances",
            str(t.num_distributed_optimizer_instances),
        ]
    if optimizer:
        groups.append(optimizer)
    return groups


def layout_args(job) -> list[str]:
    """`layout_arg_groups` as one token list."""
    return [token for group in layout_arg_groups(job) for token in group]


def launcher(job) -> list[str]:
    """torchrun's arguments for the job's GPUs (ranks fill nodes in order)."""
    gpus, per_node = job.cluster.num_gpus, job.cluster.gpus_per_node
    return [
        "torchrun",
        "--nnodes",
        str(math.ceil(gpus / per_node)),
        "--nproc-per-node",
        str(min(gpus, per_node)),
        "pretrain_gpt.py",
    ]


def _precision(t) -> list[str]:
    if t.precision == "fp32":
        return []
    if t.precision == "fp16":
        return ["--fp16"]
    out = ["--bf16"]
    if t.precision == "fp8":
        out += ["--fp8-format", t.fp8_format or "hybrid"]
        if t.fp8_recipe is not None:
            out += ["--fp8-recipe", t.fp8_recipe]
        if t.fp8_param_gather:
            out.append("--fp8-param-gather")
    if t.precision == "fp4":
        out += ["--fp4-format", "e2m1", "--fp4-recipe", t.fp4_recipe or "nvfp4"]
    return out


def _recompute(r) -> list[str]:
    if r.granularity is None:
        return []
    out = ["--recompute-granularity", r.granularity]
    if r.method is not None:
        out += ["--recompute-method", r.method]
    if r.num_layers is not None:
        out += ["--recompute-num-layers", str(r.num_layers)]
    if r.modules is not None:
        out += ["--recompute-modules", *r.modules]
    if r.distribute_saved_activations:
        out.append("--distribute-saved-activations")
    return out


# --------------------------------------------------------------------------- the whole job

# Subjects, in the order their lines are printed.
SUBJECTS = (
    "launch",
    "model",
    "tokenizer",
    "experts",
    "latent",
    "parallel",
    "batch",
    "recompute",
    "optimizer",
    "memory",
    "tp_overlap",
    "implementation",
    "data",
)

# The data: synthetic batches (--mock-data), so the line runs as it is; --train-iters and --lr
# are placeholders Megatron-LM needs (it refuses to run without them).
DATA_ARGS = ["--mock-data", "--train-iters", "100", "--lr", "0.0001"]

# Keys that are metatrace's assumptions or hardware, not settings of the run: no flag is looked
# for. The cluster's size and GPUs are torchrun's, its CUBLAS_WORKSPACE_CONFIG the environment's.
_NOT_RUN_SETTINGS = {
    ("model", "preset"),
    ("model", "hf_config"),
    ("training", "moe_hottest_expert_load"),
}

_NO_FLAG_HINTS = {
    ("parallel", "tp_comm_overlap_cfg"): "parallel.tp_comm_overlap_cfg (--tp-comm-overlap-cfg "
    "reads it from a YAML file: write the job file's parallel.tp_comm_overlap_cfg to one)",
    ("parallel", "rank_order"): "parallel.rank_order other than tp-cp-ep-dp-pp and tp-cp-ep-pp-dp",
}


@dataclasses.dataclass(frozen=True)
class MegatronCommand:
    """A job as Megatron-LM's launch: torchrun and pretrain_gpt.py's flags by subject."""

    groups: list[tuple[str, list[str]]]
    """(subject, flags), in `SUBJECTS` order; the first is torchrun's."""
    env: dict[str, str]
    """Environment variables the run needs or the job sets."""
    no_flag: list[str]
    """'section.key = value' for each setting of the job that no Megatron-LM flag gives."""
    newer: list[str]
    """Flags of a Megatron-LM newer than core_v0.16.1 (core_v0.19.2's and HEAD's)."""

    @property
    def args(self) -> list[str]:
        """pretrain_gpt.py's flags (without torchrun's)."""
        return [t for subject, group in self.groups if subject != "launch" for t in group]


def megatron_args(job) -> list[str]:
    """Every flag of `job` for pretrain_gpt.py (see `megatron_command`)."""
    return megatron_command(job).args


def megatron_command(job) -> MegatronCommand:
    """The launch of `job` (the module docstring says how the flags are found)."""
    groups: dict[str, list[str]] = {s: [] for s in SUBJECTS}
    groups["launch"] = launcher(job)
    for subject, tokens in _model_groups(job).items():
        groups[subject] += tokens
    for subject, group in zip(("parallel", "batch", "recompute", "optimizer"), _layout(job)):
        groups[subject] += group
    groups["data"] = list(DATA_ARGS)
    env = megatron_env(job)
    handled: set[tuple[str, str]] = set()
    no_flag: list[str] = []
    while True:
        args = [t for s in SUBJECTS if s != "launch" for t in groups[s]]
        try:
            back = _parse_back(job, args, env)
        except ConfigError as e:
            no_flag.append(f"(the flags do not parse back: {e})")
            break
        added = False
        for section, name, value in _differences(back, job):
            if (section, name) in handled:
                continue
            handled.add((section, name))
            flags = _flag_for(job, section, name, value)
            if flags:
                groups[_subject(section, name)] += flags
                added = True
        if not added:
            no_flag += [
                _NO_FLAG_HINTS.get((s, n), f"{s}.{n} = {_show(v)}")
                for s, n, v in _differences(back, job)
            ]
            break
    args = [t for s in SUBJECTS if s != "launch" for t in groups[s]]
    newer = [t for t in args if t in FLAGS and FLAGS[t].versions in NEWER]
    return MegatronCommand([(s, groups[s]) for s in SUBJECTS if groups[s]], env, no_flag, newer)


def command_lines(command: MegatronCommand, width: int | None = None) -> list[str]:
    """The launch as shell text: comment lines (the data, what needs a newer Megatron-LM, what
    has no flag), then the command, one subject a line continued with backslashes; with
    `width`, lines longer than that broken between words (a subject over several lines, a
    comment over several comment lines; a word wider than `width` stays whole)."""
    import shlex

    comments = [
        "# Megatron-LM core_v0.16.1 pretrain_gpt.py on synthetic data (--mock-data) with a null "
        "tokenizer of the model's vocabulary;",
        "# for real data give --data-path PREFIX and the tokenizer's flags instead; --train-iters "
        "and --lr are placeholders",
    ]
    if command.newer:
        comments.append(
            "# needs a Megatron-LM newer than core_v0.16.1 for " + ", ".join(command.newer)
        )
    if command.no_flag:
        comments.append("# no Megatron-LM flag gives: " + "; ".join(command.no_flag))
    lines = [part for c in comments for part in _fold(c[2:].split(" "), width, "# ", "# ")]
    env = [f"{k}={shlex.quote(v)}" for k, v in command.env.items()]
    groups = [group for _, group in command.groups]
    for i, group in enumerate(groups):
        words = (env if i == 0 else []) + [shlex.quote(t) for t in group]
        last = i == len(groups) - 1
        folded = _fold(words, None if width is None else width - 2, "    " if i else "", "    ")
        lines += [
            line + ("" if last and k == len(folded) - 1 else " \\") for k, line in enumerate(folded)
        ]
    return lines


def _fold(words: list[str], width: int | None, first: str, rest: str) -> list[str]:
    """`words` on lines of at most `width` columns (None: one line), the first line starting
    with `first`, the others with `rest`."""
    lines = [first + words[0]]
    for word in words[1:]:
        if width is not None and len(lines[-1]) + 1 + len(word) > width:
            lines.append(rest + word)
        else:
            lines[-1] += " " + word
    return lines


def megatron_env(job) -> dict[str, str]:
    """The environment of the run: CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron-LM asserts
    with tp or cp before Blackwell (and refuses with Megatron FSDP), and the variables through
    which the job's settings reach Megatron-LM."""
    p, t = job.parallel, job.training
    env = {}
    arch = GPU_ARCH.get(job.cluster.gpu, "")
    before_blackwell = arch.startswith("sm") and int(arch[2:]) < 100
    if (p.tp > 1 or p.cp > 1) and before_blackwell and not t.megatron_fsdp:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    if job.cluster.cublas_workspace_config is not None:
        env["CUBLAS_WORKSPACE_CONFIG"] = job.cluster.cublas_workspace_config
    if not job.implementation.torch_compile:
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def _layout(job) -> list[list[str]]:
    """layout_arg_groups by subject: parallel, batch, recompute (or none), optimizer (or none)."""
    groups = layout_arg_groups(job)
    out = groups[:2]
    rest = groups[2:]
    out.append(rest.pop(0) if rest and rest[0][0].startswith("--recompute") else [])
    out.append(rest.pop(0) if rest else [])
    return out


def _model_groups(job) -> dict[str, list[str]]:
    """The flags always written: the model's dimensions and structure (those without which
    megatron-core would build another model, or refuse it), its vocabulary, its experts."""
    m = job.model
    model = [
        "--num-layers",
        str(m.num_layers),
        "--hidden-size",
        str(m.hidden_size),
        "--ffn-hidden-size",
        str(m.ffn_hidden_size),
        "--num-attention-heads",
        str(m.num_attention_heads),
    ]
    if m.num_query_groups != m.num_attention_heads:
        model += _query_groups(job, m.num_query_groups) or []
    model += ["--max-position-embeddings", str(m.max_position_embeddings)]
    if m.position_embedding_type != "learned_absolute":
        model += ["--position-embedding-type", m.position_embedding_type]
    if m.normalization != "LayerNorm":
        model += ["--normalization", m.normalization]
    model += _activation(job, m.activation) or []
    if not m.add_bias_linear:
        model.append("--disable-bias-linear")
        if m.add_qkv_bias:
            model.append("--add-qkv-bias")
    if m.untie_embeddings_and_output_weights:
        model.append("--untie-embeddings-and-output-weights")
    # core_v0.16.1's null tokenizer has --vocab-size + 1 tokens (its end of document is V).
    tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(m.vocab_size - 1)]
    experts = []
    if m.num_experts is not None:
        experts = [
            "--num-experts",
            str(m.num_experts),
            "--moe-ffn-hidden-size",
            str(m.moe_ffn_hidden_size),
            "--moe-router-topk",
            str(m.moe_router_topk),
        ]
        if set(m.moe_layer_freq) != {1}:
            experts += ["--moe-layer-freq", _expression(m.moe_layer_freq)]
    latent = ["--multi-latent-attention"] if m.multi_latent_attention else []
    if m.mtp_num_layers:
        latent += ["--mtp-num-layers", str(m.mtp_num_layers)]
    implementation = _bias_fusion(job, job.implementation.bias_activation_fusion) or []
    return {
        "model": model,
        "tokenizer": tokenizer,
        "experts": experts,
        "latent": latent,
        "implementation": implementation,
    }


def _parse_back(job, args: list[str], env: dict[str, str]):
    from metatrace.config.megatron.args import job_from_args

    back, _ = job_from_args(
        args,
        world_size=job.cluster.num_gpus,
        gpu=job.cluster.gpu,
        gpus_per_node=job.cluster.gpus_per_node,
        env=env,
    )
    return back


def _differences(got, want) -> list[tuple[str, str, Any]]:
    """(section, key, wanted value) of the run's settings that differ."""
    out = []
    for section in SECTIONS:
        if section == "cluster":
            continue  # torchrun's and the environment's
        a, b = getattr(got, section), getattr(want, section)
        for f in dataclasses.fields(b):
            if (section, f.name) in _NOT_RUN_SETTINGS:
                continue
            if getattr(a, f.name) != getattr(b, f.name):
                out.append((section, f.name, getattr(b, f.name)))
    return out


def _flag_for(job, section: str, name: str, value) -> list[str] | None:
    """The flags that set `section.name` to `value`, or None where none does."""
    derive = _DERIVED.get((section, name))
    if derive is not None:
        return derive(job, value)
    flag = _SETTERS.get(f"{section}.{name}")
    if flag is None:
        return None
    spec = FLAGS[flag]
    if spec.switch:
        opposite = _OPPOSITE.get(f"{section}.{name}")
        if value == spec.const:
            return [flag]
        return [opposite] if opposite and FLAGS[opposite].const == value else None
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [flag, *map(str, value)]
    return [flag, str(value)]


# Flags never written: a mapping flag with no single key value, and deprecated aliases of others.
_NOT_SETTERS = ("--use-tp-pp-dp-mapping", "--moe-router-padding-for-fp8")


def _setters() -> tuple[dict[str, str], dict[str, str]]:
    """Job key -> the flag that sets it as it is (core_v0.16.1's spelling first), and for
    switches a second flag that stores the other value."""
    setters: dict[str, str] = {}
    for spec in FLAGS.values():
        if spec.cls != "modelled" or spec.key is None or spec.name in _NOT_SETTERS:
            continue
        known = setters.get(spec.key)
        if known is None or (FLAGS[known].versions in NEWER and spec.versions not in NEWER):
            setters[spec.key] = spec.name
    opposite = {
        spec.key: spec.name
        for spec in FLAGS.values()
        if spec.cls == "modelled"
        and spec.key in setters
        and spec.switch
        and FLAGS[setters[spec.key]].switch
        and spec.const != FLAGS[setters[spec.key]].const
    }
    return setters, opposite


_SETTERS, _OPPOSITE = _setters()


def _expression(pattern: list[int]) -> str:
    """A 0/1 list per layer as Megatron-LM's layer-pattern expression, e.g. ([0]*3+[1]*58)."""
    runs: list[list[int]] = []
    for x in pattern:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return "(" + "+".join(f"[{x}]*{n}" if n > 1 else f"[{x}]" for x, n in runs) + ")"


def _activation(job, value) -> list[str] | None:
    return {"swiglu": ["--swiglu"], "squared_relu": ["--squared-relu"]}.get(
        value, ["--quick-geglu"] if value == "quick_geglu" else None
    )


def _query_groups(job, value) -> list[str] | None:
    if job.model.multi_latent_attention:
        return None
    return ["--group-query-attention", "--num-query-groups", str(value)]


def _bias_fusion(job, value) -> list[str] | None:
    if value:
        return None
    return [
        "--no-bias-swiglu-fusion" if job.model.activation == "swiglu" else "--no-bias-gelu-fusion"
    ]


def _cuda_graphs(job, value) -> list[str] | None:
    t = job.training
    if t.cuda_graph_impl == "none":
        return None
    return ["--cuda-graph-impl", t.cuda_graph_impl] + (
        ["--cuda-graph-scope", *t.cuda_graph_scope] if t.cuda_graph_scope else []
    )


def _fsdp(job, value) -> list[str] | None:
    t = job.training
    if not t.megatron_fsdp:
        return None
    # Always the strategy: core_v0.16.1's default (no_shard) is not metatrace's.
    out = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", t.fsdp_sharding_strategy]
    if t.fsdp_outer_sharding_strategy != "no_shard":
        out += ["--outer-dp-sharding-strategy", t.fsdp_outer_sharding_strategy]
    if t.fsdp_double_buffer:
        out.append("--fsdp-double-buffer")
    if t.fsdp_communication_unit_size is not None:
        out += ["--suggested-communication-unit-size", str(t.fsdp_communication_unit_size)]
    for key in changed_from_default(t, FSDP_DTYPES):
        out += ["--megatron-" + key.replace("_", "-"), getattr(t, key)]
    return out


def _offloading(job, value) -> list[str] | None:
    t = job.training
    if not t.activation_offload_modules:
        return None
    out = ["--fine-grained-activation-offloading", "--offload-modules"]
    out += list(t.activation_offload_modules)
    for key in changed_from_default(t, ("min_offloaded_tensor_size", *OFFLOAD_KNOBS)):
        out += ["--" + key.replace("_", "-"), str(getattr(t, key))]
    return out


def _pattern_flag() -> str:
    """The hybrid pattern's flag of the installed release's Megatron-LM (core_v0.19 renamed
    --hybrid-override-pattern, which it still forwards)."""
    from metatrace.config.release import since

    return "--hybrid-layer-pattern" if since(0, 19) else "--hybrid-override-pattern"


def _one(flag: str, show: Callable[[Any], str] = str) -> Callable[[Any, Any], list[str] | None]:
    return lambda job, value: None if value is None else [flag, show(value)]


# Keys that a derivation of metatrace.config.megatron.args reads (no flag sets them as they
# are): job, wanted value -> the flags, or None where no flag gives the value.
_DERIVED: dict[tuple[str, str], Callable[[Any, Any], list[str] | None]] = {
    ("model", "num_query_groups"): _query_groups,
    ("model", "position_embedding_type"): _one("--position-embedding-type"),
    ("model", "activation"): _activation,
    ("model", "add_qkv_bias"): lambda job, v: ["--add-qkv-bias"] if v else None,
    ("model", "window_size"): _one("--window-size", lambda w: f"{w[0]},{w[1]}"),
    (
        "model",
        "window_attn_skip_freq",
    ): _one("--window-attn-skip-freq", lambda f: str(f) if isinstance(f, int) else _expression(f)),
    ("model", "hybrid_layer_pattern"): lambda job, v: None if v is None else [_pattern_flag(), v],
    ("model", "linear_attention_freq"): lambda job, v: (
        None
        if v is None
        else [
            "--experimental-attention-variant",
            "gated_delta_net",
            "--linear-attention-freq",
            str(v) if isinstance(v, int) else _expression(v),
        ]
    ),
    ("model", "num_experts"): _one("--num-experts"),
    ("model", "moe_layer_freq"): _one("--moe-layer-freq", _expression),
    ("model", "moe_router_load_balancing_type"): _one("--moe-router-load-balancing-type"),
    ("model", "moe_aux_loss_coeff"): _one("--moe-aux-loss-coeff"),
    ("training", "moe_routing"): lambda job, v: (
        ["--moe-pad-expert-input-to-capacity"] if v == "capacity" else None
    ),
    ("parallel", "cp_comm_type"): _one(
        "--cp-comm-type", lambda k: k.replace("all_gather", "allgather")
    ),
    ("parallel", "layout"): _one("--pipeline-model-parallel-layout"),
    ("parallel", "etp"): _one("--expert-tensor-parallel-size"),
    ("training", "grad_reduce_in_fp32"): lambda job, v: (
        ["--accumulate-allreduce-grads-in-fp32"] if v else ["--grad-reduce-in-bf16"]
    ),
    ("training", "optimizer"): _one("--optimizer"),
    ("training", "activation_offload_modules"): _offloading,
    **{  # with _offloading
        ("training", key): lambda job, v: None
        for key in ("min_offloaded_tensor_size", *OFFLOAD_KNOBS)
    },
    ("training", "megatron_fsdp"): _fsdp,
    ("training", "fsdp_sharding_strategy"): lambda job, v: None,  # with _fsdp
    ("training", "fsdp_outer_sharding_strategy"): lambda job, v: None,
    ("training", "fsdp_double_buffer"): lambda job, v: None,
    ("training", "fsdp_communication_unit_size"): lambda job, v: None,
    ("training", "fsdp_main_grads_dtype"): lambda job, v: None,  # with _fsdp
    ("training", "fsdp_main_params_dtype"): lambda job, v: None,
    ("training", "fsdp_grad_comm_dtype"): lambda job, v: None,
    ("training", "cuda_graph_impl"): _cuda_graphs,
    ("training", "cuda_graph_scope"): lambda job, v: None,  # with _cuda_graphs
    ("implementation", "transformer_impl"): _one("--transformer-impl"),
    ("implementation", "attention_backend"): _one("--attention-backend"),
    ("implementation", "rope_fusion"): lambda job, v: None if v else ["--no-rope-fusion"],
    ("implementation", "bias_activation_fusion"): _bias_fusion,
}

# Model keys of multi-latent attention, YaRN and multi-token prediction (their own line).
_LATENT = {
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    *YARN_KEYS,
    "mtp_num_layers",
    "mtp_loss_scaling_factor",
}
_MEMORY = (
    "activation_offload",
    "min_offloaded",
    "cpu_offloading",
    "megatron_fsdp",
    "fsdp_",
    "cuda_graph",
)
_OPTIMIZER = (
    "distributed_optimizer",
    "overlap_",
    "num_distributed_optimizer_instances",
    "grad_reduce_in_fp32",
    "ddp_",
    "optimizer",
    "sgd_momentum",
    "use_precision_aware_optimizer",
    "main_",
    "exp_avg",
    "clip_grad",
    "log_num_zeros_in_grad",
)


def _subject(section: str, name: str) -> str:
    """The line a key's flag is printed on."""
    if name.startswith("moe_") or name in (
        "num_experts",
        "overlap_moe_expert_parallel_comm",
        "delay_wgrad_compute",
    ):
        return "experts"
    if section == "model":
        if name in ("vocab_size", "make_vocab_size_divisible_by"):
            return "tokenizer"
        return "latent" if name in _LATENT else "model"
    if section == "parallel":
        return "tp_overlap" if name.startswith("tp_comm") else "parallel"
    if section == "training":
        if name.startswith(_MEMORY):
            return "memory"
        return "optimizer" if name.startswith(_OPTIMIZER) else "batch"
    return "implementation"


def _show(value) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (
            "{"
            + ", ".join(
                f"{f.name}: {_show(getattr(value, f.name))}"
                for f in dataclasses.fields(value)
                if getattr(value, f.name) is not None
            )
            + "}"
        )
    return str(value).lower() if isinstance(value, bool) else str(value)
