"""Megatron-LM `pretrain_gpt.py` arguments -> a metatrace job.

Users may describe a run by the arguments they give Megatron-LM instead of a YAML job. This
module reads them (a token list, a line or training script, or a `{"--flag": value}` mapping),
checks every flag against one declarative table (`FLAGS`) and derives the job mapping that
`metatrace.config.job_from_dict` takes, the way Megatron-LM at tag core_v0.16.1 derives its
settings (../shared/notes/megatron-args.md, sections 1, 2, 4 and 6).

Every flag is in one class of metatrace.config.megatron.flags (which holds Megatron-LM's own parser
attributes, so values are read as argparse reads them):
1. modelled: it sets job keys (directly through `Flag.key`, or in the derivations below);
2. no effect: accepted silently (logging, data, checkpoints, the learning-rate schedule, ...);
3. not modelled yet: given with a value other than its default, it is listed in one warning and
   carried on the Job (`Job.not_modelled`) for the verdict; the job describes the run without it;
4. refused by Megatron-LM itself: an error with its message.
Environment variables are classified the same way (`_cluster`); a value the run could not parse
is an error (`_check_env`). A flag in no parser of the table is an error when it is close to one
(a misspelling), and otherwise too, unless the user names the newer Megatron-LM release it comes
from (`release`, the command line's --newer-megatron): then it is reported as not modelled, its
effect unknown.

Known limitations: flags that only Megatron-LM's own training code reads were classified from
their help and Megatron-Bridge's port of that code (those new in core_v0.19.2 from that release's
own training code); HEAD-only flags from their help alone.
"""

from __future__ import annotations

import difflib
from typing import Any

from metatrace.config import release as installed
from metatrace.config.checks import MOE_REFUSED_DENSE
from metatrace.config.job import NotModelled
from metatrace.config.megatron.flags import (
    ENV_FORMATS,
    ENV_MODELLED,
    ENV_NO_EFFECT,
    ENV_NO_EFFECT_PREFIXES,
    ENV_NOT_MODELLED,
    FLAGS,
    GPT2_VOCAB,
    NEEDS,
    NEWER,
    NVTE_ATTN,
    NVTE_FOR_BACKEND,
    UNMODELLED_VALUES,
    Flag,
)
from metatrace.config.megatron.script import args_from_mapping, read_args_file, split_args
from metatrace.errors import ConfigError

__all__ = [
    "NOT_MODELLED_REASONS",
    "args_from_mapping",
    "job_dict_from_args",
    "job_from_args",
    "not_modelled",
    "read_args_file",
    "split_args",
]


NOT_MODELLED_REASONS: dict[str, str] = {
    f.name: f.reason for f in FLAGS.values() if f.cls == "not_modelled"
}
"""Class-3 flag -> the feature metatrace does not model yet (for a calibration harness)."""


# --------------------------------------------------------------------------- parsing


def _parse(tokens: list[str], release: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Flag -> value as argparse would store it (a switch: what it stores, True or False; lists
    for several values); the last of a repeated flag wins. And the flags no parser in the table
    has that are not a misspelling of one, when the user named the newer Megatron-LM `release`
    they come from (a misspelt flag is an error that names the closest one; any other, without
    `release`, an error that asks for it). Every problem is reported in one ConfigError."""
    values: dict[str, Any] = {}
    unknown, problems = [], []
    i, previous = 0, None
    while i < len(tokens):
        token = tokens[i]
        i += 1
        name, eq, inline = token.partition("=")
        if not token.startswith("--") and name not in FLAGS:
            after = f" after {previous}, which takes no value" if previous else ""
            problems.append(f"unexpected value {token!r}{after}")
            continue
        spec = FLAGS.get(name)
        previous = name
        if spec is None:
            unknown.append(name)
            while i < len(tokens) and not _is_flag(tokens[i]):
                i += 1  # its values
            continue
        given = [inline] if eq else []
        if not eq and spec.nargs != 0:
            limit = spec.nargs if isinstance(spec.nargs, int) else len(tokens)
            limit = 1 if spec.nargs == "?" else limit
            while i < len(tokens) and not _is_flag(tokens[i]) and len(given) < limit:
                given.append(tokens[i])
                i += 1
        if spec.cls == "refused":
            problems.append(spec.reason)
            continue
        if spec.nargs == 0 or (spec.nargs == "?" and not given):
            if eq:
                problems.append(f"{name} takes no value, got {inline!r}")
            values[name] = spec.const
            continue
        previous = None
        if not given and spec.nargs != "*":
            problems.append(f"{name} needs a value")
            continue
        if isinstance(spec.nargs, int) and spec.nargs > 1 and len(given) != spec.nargs:
            problems.append(f"{name} takes {spec.nargs} values, got {len(given)}")
            continue
        try:
            converted = [_convert(name, spec, text) for text in given]
        except ConfigError as e:
            problems.append(str(e))
            continue
        values[name] = converted[0] if spec.nargs in (1, "?") else converted
    closest = {f: _closest(f) for f in unknown}
    misspelt = [f for f in unknown if closest[f] or f == "--"]
    if misspelt:
        problems.insert(
            0,
            "unknown Megatron-LM flags: "
            + ", ".join(
                f"{f} (did you mean {closest[f]}?)" if closest[f] else repr(f) for f in misspelt
            ),
        )
    strangers = [f for f in unknown if f not in misspelt]
    if strangers and release is None:
        many = len(strangers) > 1
        problems.insert(
            int(bool(misspelt)),
            f"unknown Megatron-LM flag{'s' * many} {', '.join(strangers)}: in no release "
            f"metatrace knows (core_v0.16.1, core_v0.19.2, HEAD of 2026-08-22), and no misspelling "
            "of theirs; "
            f"if {'they come' if many else 'it comes'} from a newer Megatron-LM, name the "
            "release (--newer-megatron RELEASE) to have it reported as not modelled",
        )
    if problems:
        raise ConfigError(problems)
    return values, strangers


def _is_flag(token: str) -> bool:
    return token.startswith("--") or token.partition("=")[0] in FLAGS


def _convert(name: str, spec: Flag, text: str):
    try:
        value = spec.type(text)
    except ValueError:
        kind = {int: "an integer", float: "a number"}.get(spec.type, "a value")
        raise ConfigError(f"{name} expects {kind}, got {text!r}") from None
    if spec.choices is not None and value not in spec.choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in spec.choices], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"{name} must be one of {', '.join(map(str, spec.choices))}; got {text!r}{hint}"
        )
    return value


def _closest(flag: str) -> str | None:
    """The known flag `flag` most likely misspells; never its negation (--x for --no-x)."""
    base = flag.replace("_", "-")
    for close in difflib.get_close_matches(base, list(FLAGS), n=3, cutoff=0.75):
        if close == base or _stem(close) != _stem(base):  # not --x for --no-x
            return close
    return None


def _stem(flag: str) -> str:
    return flag.removeprefix("--").removeprefix("no-").removeprefix("disable-")


# --------------------------------------------------------------------------- deriving


def job_dict_from_args(
    tokens: list[str] | dict,
    *,
    world_size: int,
    gpu: str | None = None,
    gpus_per_node: int | None = None,
    env: dict[str, str] | None = None,
    release: str | None = None,
) -> tuple[dict, list[str]]:
    """The job mapping for `job_from_dict` and notes for the user; the first note is the one
    warning that lists every given flag metatrace does not model yet. `release`: the newer
    Megatron-LM the arguments are for, whose flags no table has are then not modelled."""
    data, notes, _ = _derive(tokens, world_size, gpu, gpus_per_node, env, release)
    return data, notes


def _check_env(env: dict[str, str]) -> None:
    """Refuse the values of environment variables that the run could not parse
    (`ENV_FORMATS`), all of them in one error."""
    problems = []
    for name, value in env.items():
        kind = ENV_FORMATS.get(name)
        if kind == "int":
            try:
                int(value)
            except ValueError:
                problems.append(f"{name}={value!r}: the run reads it as a whole number")
        elif kind == "0/1" and value not in ("0", "1"):
            problems.append(
                f"{name}={value!r}: PyTorch takes only 1 as set (and anything else as unset); "
                "give 0 or 1"
            )
    if problems:
        raise ConfigError(problems)


def _tokens(tokens: list[str] | dict) -> list[str]:
    return args_from_mapping(tokens) if isinstance(tokens, dict) else list(tokens)


def _derive(tokens, world_size, gpu, gpus_per_node, env, release=None):
    """(job mapping, notes, what is not modelled) of a Megatron-LM command line."""
    v, strangers = _parse(_tokens(tokens), release)
    env = {k: str(val) for k, val in (env or {}).items()}
    _check_env(env)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"the world size must be a whole number >= 1, got {world_size!r}")
    job: dict = {s: {} for s in ("model", "parallel", "training", "implementation", "cluster")}
    notes: list[str] = []
    problems: list[str] = []
    unmodelled = _unmodelled(v, notes) + [
        (f, NotModelled(f, _stranger(release), "unknown")) for f in strangers
    ]
    skipped = {flag for flag, _ in unmodelled}
    for flag, value in v.items():
        spec = FLAGS[flag]
        if spec.key is not None and flag not in skipped:
            _put(job, spec.key, spec.const if spec.switch else value)
    _model(v, job, notes, problems)
    _vocabulary(v, job, notes, problems)
    _parallel(v, job, notes, problems, world_size)
    _training(v, job, notes, problems)
    _implementation(v, job, notes, problems, gpu, env)
    missing = [m for _, m in unmodelled]
    missing += _cluster(v, job, notes, problems, world_size, gpu, gpus_per_node, env)
    if problems:
        raise ConfigError(problems)
    newer = {r: sorted(f for f in v if FLAGS[f].versions == r) for r in NEWER}
    if any(newer.values()):
        notes.append(
            f"from a Megatron-LM newer than core_v0.16.1 (metatrace runs megatron-core "
            f"{installed.version()}): "
            + "; ".join(
                f"{'in core_v0.19.2' if r == 'core_v0.19.2' else 'after it (HEAD of 2026-08-22)'}"
                f": {', '.join(flags)}"
                for r, flags in newer.items()
                if flags
            )
        )
    older = sorted(f for f in v if FLAGS[f].versions == "older")
    if older:
        notes.append(f"from a Megatron-LM older than core_v0.16.1: {', '.join(older)}")
    if missing:
        notes.insert(0, _warning(missing))
    return {k: s for k, s in job.items() if s}, notes, missing


def job_from_args(
    tokens: list[str] | dict,
    *,
    world_size: int,
    gpu: str | None = None,
    gpus_per_node: int | None = None,
    env: dict[str, str] | None = None,
    source: str = "<megatron-args>",
    release: str | None = None,
):
    """`job_dict_from_args`, resolved and checked by `job_from_dict`: (Job, notes). The Job
    carries what is not modelled (`Job.not_modelled`), for the verdict."""
    import dataclasses

    from metatrace.config.load import job_from_dict

    data, notes, missing = _derive(tokens, world_size, gpu, gpus_per_node, env, release)
    job = job_from_dict(data, source=source)
    return dataclasses.replace(job, not_modelled=tuple(missing)), notes


def not_modelled(tokens: list[str] | dict, release: str | None = None) -> list[str]:
    """'option: what is not modelled' for every given flag (or value) metatrace does not model
    yet; empty when the run is fully modelled. Environment variables are not looked at."""
    v, strangers = _parse(_tokens(tokens), release)
    return [f"{m.option}: {m.feature}" for _, m in _unmodelled(v, [])] + [
        f"{f}: {_stranger(release)}" for f in strangers
    ]


def _put(job: dict, key: str, value) -> None:
    *path, leaf = key.split(".")
    node = job
    for part in path:
        node = node.setdefault(part, {})
    node[leaf] = value


def _ignored(flags: list[str]) -> str:
    """The start of a note on `flags` Megatron-LM ignores: "--a is ignored", "--a, --b are"."""
    return f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} ignored"


def _is_moe(v) -> bool:
    return bool(v.get("--num-experts"))  # --num-experts 0 means no experts


def _stranger(release: str | None) -> str:
    """What is not modelled about a flag of the newer Megatron-LM `release` no table has."""
    return (
        f"a flag of Megatron-LM {release}, in none of core_v0.16.1's, core_v0.19.2's and HEAD's "
        "parsers"
    )


def _unmodelled(v, notes: list[str]) -> list[tuple[str, NotModelled]]:
    """(flag, what is not modelled) for what the run gives that metatrace does not model:
    class-3 flags with a value other than their default, values of flags that are not
    modelled, and combinations. An option that acts only with another one that is not given
    changes nothing: it is noted as ignored instead."""
    out, idle = [], []
    for flag, value in v.items():
        spec = FLAGS[flag]
        if flag in UNMODELLED_VALUES:
            values, feature, direction = UNMODELLED_VALUES[flag]
            hit = any(x in values for x in (value if isinstance(value, list) else [value]))
        else:
            hit = spec.cls == "not_modelled" and not _is_default(spec, value)
            feature, direction = spec.reason, spec.direction
        if not hit:
            continue
        if flag in NEEDS and not any(_given(v, parent) for parent in NEEDS[flag]):
            idle.append((flag, NEEDS[flag]))
            continue
        out.append((flag, NotModelled(_show(flag, value), feature, direction)))
    for flag, parents in idle:
        notes.append(f"{flag} changes nothing without {' or '.join(parents)}")
    if _graphs_not_modelled(v):
        impl = _graph_flags(v)[0]
        out.append(
            (
                "--cuda-graph-impl",
                NotModelled(
                    f"--cuda-graph-impl {impl}",
                    "megatron-core's own CUDA graphs of mixture-of-experts models, MoE or "
                    "mamba scopes (the run is described without CUDA graphs)",
                    "raises",
                ),
            )
        )
    for flag, what in (("--fp8-format", "FP8"), ("--fp4-format", "FP4")):
        if flag in v and "--bf16" not in v:
            out.append(
                (
                    flag,
                    NotModelled(
                        f"{flag} without --bf16", f"{what} over fp16 or fp32 parameters", "unknown"
                    ),
                )
            )
    if len(set(v.get("--cp-comm-type", ()))) > 1:
        out.append(
            (
                "--cp-comm-type",
                NotModelled(
                    _show("--cp-comm-type", v["--cp-comm-type"]),
                    "a context-parallel communication type per layer",
                    "either",
                ),
            )
        )
    evaluation = v.get("--eval-micro-batch-size")
    if evaluation is not None and evaluation > v.get("--micro-batch-size", evaluation):
        # Between iterations, with the optimizer state resident: [s, b, V/t] fp32 logits and
        # every layer's transients at the larger micro-batch can exceed the training peak.
        out.append(
            (
                "--eval-micro-batch-size",
                NotModelled(
                    _show("--eval-micro-batch-size", evaluation),
                    "evaluation with a larger micro-batch than training (between iterations)",
                    "raises",
                ),
            )
        )
    return out


def _given(v, flag: str) -> bool:
    """The run gives `flag` with a value that turns something on (not its default, not 0)."""
    value = v.get(flag)
    return flag in v and not _is_default(FLAGS[flag], value) and value not in (0, "none", [])


def _is_default(spec: Flag, value) -> bool:
    default = spec.default
    if isinstance(value, list) and isinstance(default, (list, tuple)):
        return list(value) == list(default)
    return value == default


def _show(flag: str, value) -> str:
    if FLAGS[flag].switch or value is True:
        return flag
    if isinstance(value, list):
        return " ".join([flag, *map(str, value)])
    return f"{flag} {value}"


def _warning(missing: list[NotModelled]) -> str:
    by_reason: dict[str, list[str]] = {}
    for m in missing:
        by_reason.setdefault(m.feature, []).append(m.option)
    parts = [f"{feature} ({', '.join(options)})" for feature, options in by_reason.items()]
    return (
        "warning: metatrace does not model these yet, and predicts the run without them: "
        + "; ".join(parts)
    )


def _model(v, job, notes, problems) -> None:
    m = job["model"]
    for flag, alias, key in (
        ("--num-layers", "--encoder-num-layers", "model.num_layers"),
        ("--seq-length", "--encoder-seq-length", "training.seq_length"),
    ):
        if flag in v and alias in v:
            problems.append(f"give {flag} or {alias}, not both (Megatron-LM asserts it)")
        elif alias in v:
            _put(job, key, v[alias])
    decoder = v.get("--decoder-seq-length")
    seq = v.get("--seq-length", v.get("--encoder-seq-length"))
    if decoder is not None and decoder != seq and v.get("--pipeline-model-parallel-size", 1) > 1:
        problems.append(
            f"--decoder-seq-length {decoder} differs from --seq-length {seq}: "
            "megatron-core's pipeline schedule sizes its receive buffers from it "
            "(sends and receives would disagree)"
        )
    required = (
        "--num-layers",
        "--hidden-size",
        "--num-attention-heads",
        "--seq-length",
        "--micro-batch-size",
    )
    hybrid = "--hybrid-layer-pattern" in v or "--hybrid-override-pattern" in v
    absent = [
        f
        for f in required
        if f not in v
        and not (
            (f == "--num-layers" and ("--encoder-num-layers" in v or hybrid))
            or (f == "--seq-length" and "--encoder-seq-length" in v)
        )
    ]
    if absent:
        problems.append("Megatron-LM needs " + ", ".join(absent))
    if "--max-position-embeddings" not in v:
        notes.append("Megatron-LM needs --max-position-embeddings; metatrace takes --seq-length")
    # Grouped-query attention only with --group-query-attention (notes 6.1); its default is 1.
    if "--group-query-attention" in v:
        m["num_query_groups"] = v.get("--num-query-groups", 1)
    elif "--num-query-groups" in v:
        notes.append(
            f"--num-query-groups {v['--num-query-groups']} is ignored without "
            "--group-query-attention: Megatron-LM builds multi-head attention"
        )
    position = v.get("--position-embedding-type")
    if "--use-rotary-position-embeddings" in v:
        position = "rope"  # deprecated spelling
    if "--no-position-embedding" in v and position not in ("rope", "mrope"):
        problems.append(
            "--no-position-embedding is deprecated (Megatron-LM refuses it unless the "
            "position embedding is rope); use --position-embedding-type none"
        )
    if position is not None:
        # mrope rotates like rope (no parameters); relative is T5's. Both are listed as not
        # modelled. yarn (HEAD's) is GPTModel's YarnRotaryEmbedding.
        m["position_embedding_type"] = {"mrope": "rope", "relative": "none"}.get(position, position)
    if "--quick-geglu" in v and ("--swiglu" in v or "--squared-relu" in v):
        problems.append(
            "--quick-geglu with --swiglu or --squared-relu: give one activation (Megatron-LM "
            "asserts that --quick-geglu is not --swiglu)"
        )
    elif "--quick-geglu" in v:
        m["activation"] = "quick_geglu"  # GLU over fused_bias_geglu's quick_gelu (notes 1.2)
    if "--swiglu" in v and "--squared-relu" in v:
        problems.append("--swiglu and --squared-relu exclude each other (Megatron-LM asserts it)")
    elif "--swiglu" in v:
        m["activation"] = "swiglu"
    elif "--squared-relu" in v:
        m["activation"] = "squared_relu"
        if "--disable-bias-linear" not in v and "--no-bias-gelu-fusion" not in v:
            problems.append(
                "--squared-relu with linear biases needs --no-bias-gelu-fusion (or "
                "--disable-bias-linear): Megatron-LM's TransformerConfig refuses the fused "
                "bias-GeLU kernel for squared ReLU (notes 6.3)"
            )
    # validate_args turns the QKV bias on whenever linear biases are (notes 6.4).
    if "--add-qkv-bias" in v or "--disable-bias-linear" not in v:
        m["add_qkv_bias"] = True
    _experts(v, job, notes, problems)
    _latent_attention(v, job, notes, problems)
    _glu_options(v, job, notes, problems)
    _windows(v, job, notes, problems)
    _hybrid(v, job, notes, problems)
    _gated_delta_net(v, job, notes, problems)


_MAMBA_FLAGS = ("--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups", "--mamba-num-heads")
_GDN_FLAGS = (
    "--linear-conv-kernel-dim",
    "--linear-key-head-dim",
    "--linear-value-head-dim",
    "--linear-num-key-heads",
    "--linear-num-value-heads",
)


def _drop(job, flags) -> None:
    for flag in flags:
        job["model"].pop(FLAGS[flag].key.split(".")[-1], None)


def _hybrid(v, job, notes, problems) -> None:
    """Hybrid models: --hybrid-override-pattern (core_v0.16.1's pretrain_mamba.py; core_v0.19
    forwards it to --hybrid-layer-pattern and refuses both) is model.hybrid_layer_pattern;
    core_v0.19's legacy --mtp-hybrid-override-pattern with --mtp-num-layers becomes its `/`
    part. core_v0.19 derives --num-layers from the pattern; core_v0.16.1's MambaModel asserts
    that they agree (left to the job's resolution)."""
    from metatrace.config.release import since

    m = job["model"]
    old, new = v.get("--hybrid-override-pattern"), v.get("--hybrid-layer-pattern")
    if old is not None and new is not None:
        problems.append(
            "--hybrid-override-pattern and --hybrid-layer-pattern cannot both be given "
            "(Megatron-LM asserts it; the first is the deprecated name of the second)"
        )
    if "--disable-mamba-mem-eff-path" in v:
        problems.append(
            "--disable-mamba-mem-eff-path: the unfused Mamba-2 path (a separate convolution "
            "and chunked scan, other saved tensors) is not modelled; metatrace models the fused "
            "mamba_split_conv1d_scan_combined"
        )
    pattern = new if new is not None else old
    if pattern is None:
        given = [f for f in _MAMBA_FLAGS + ("--mtp-hybrid-override-pattern",) if f in v]
        if given:
            notes.append(
                f"{_ignored(given)} without --hybrid-layer-pattern (--hybrid-override-pattern)"
            )
            _drop(job, [f for f in given if f in _MAMBA_FLAGS])
        if "--is-hybrid-model" in v:
            notes.append(
                "--is-hybrid-model without a hybrid layer pattern changes only the output "
                "layers' initialisation; a GPT model is built"
            )
        return
    mtp = v.get("--mtp-hybrid-override-pattern")
    depth = v.get("--mtp-num-layers") or 0
    if mtp is not None and depth and "/" not in pattern:
        pattern += ("/" + mtp) * depth  # core_v0.19's validate_args conversion
    elif mtp is not None:
        notes.append("--mtp-hybrid-override-pattern is ignored without --mtp-num-layers")
    m["hybrid_layer_pattern"] = pattern
    layers = v.get("--num-layers")
    if layers is not None and since(0, 19):
        # the main pattern's layer symbols (not '|', not the '/' part)
        count = len(pattern.split("/")[0].replace("|", ""))
        if layers != count:
            notes.append(
                f"--num-layers {layers} is ignored: the hybrid layer pattern has {count} "
                "layers (Megatron-LM core_v0.19 takes the pattern's)"
            )
        m.pop("num_layers", None)


def _gated_delta_net(v, job, notes, problems) -> None:
    """Gated DeltaNet in a GPT model: --experimental-attention-variant gated_delta_net (gdn, its
    newer name) with --linear-attention-freq (la_freq_type: an integer, or a list expression,
    1 for a GDN layer); megatron-core's TransformerConfig refuses the variant without it."""
    m = job["model"]
    variant = v.get("--experimental-attention-variant")
    gdn = variant in ("gated_delta_net", "gdn")
    text = v.get("--linear-attention-freq")
    if gdn and text is None:
        problems.append(
            f"--experimental-attention-variant {variant} needs --linear-attention-freq "
            "(megatron-core asserts it)"
        )
    elif gdn:
        try:
            m["linear_attention_freq"] = _layer_freq(text)
        except ValueError:
            problems.append(
                f"--linear-attention-freq expects an integer or a list expression such as "
                f'"([1]*3+[0]*1)*12" (digits, commas, brackets, + and *), got {text!r}'
            )
    elif text is not None:
        notes.append(
            "--linear-attention-freq is ignored without --experimental-attention-variant "
            "gated_delta_net"
        )
    hybrid = "G" in (m.get("hybrid_layer_pattern") or "")
    given = [f for f in _GDN_FLAGS if f in v]
    if given and not gdn and not hybrid:
        notes.append(
            f"{_ignored(given)} without Gated DeltaNet layers "
            "(--experimental-attention-variant gated_delta_net, or G in the hybrid pattern)"
        )
        _drop(job, given)


def _glu_options(v, job, notes, problems) -> None:
    """--glu-linear-offset and --activation-func-clamp-value act on gated activations only;
    megatron-core's TransformerConfig refuses an offset with the fused bias-activation kernel
    of any activation but quick_gelu (transformer_config.py:1505)."""
    m = job["model"]
    gated = "--swiglu" in v or "--quick-geglu" in v
    fused = (
        "--no-bias-swiglu-fusion" not in v
        if "--swiglu" in v
        else "--no-bias-gelu-fusion" not in v and "--disable-bias-linear" not in v
    )
    offset = v.get("--glu-linear-offset", 0.0)
    if offset and "--quick-geglu" not in v and fused:
        off = "--no-bias-swiglu-fusion" if "--swiglu" in v else "--no-bias-gelu-fusion"
        problems.append(
            f"--glu-linear-offset {offset:g} needs --quick-geglu, or {off}: megatron-core "
            "refuses a GLU offset with the fused bias-activation kernel of other activations"
        )
    elif not gated:
        given = [f for f in ("--glu-linear-offset", "--activation-func-clamp-value") if f in v]
        if given:
            notes.append(f"{_ignored(given)} without --swiglu or --quick-geglu")
        for flag in given:
            m.pop(FLAGS[flag].key.split(".")[-1], None)


def _windows(v, job, notes, problems) -> None:
    """Sliding-window attention: --window-size is Megatron-LM's tuple_type ("128,0" or
    "(128,0)": integers split at commas), --window-attn-skip-freq its moe_freq_type (an integer,
    or with a '[' a list expression of digits, commas, brackets, + and *)."""
    m = job["model"]
    text = v.get("--window-size")
    if text is not None:
        try:
            window = [int(x) for x in text.strip("()").split(",")]
        except ValueError:
            window = []
        if len(window) != 2:
            problems.append(
                f"--window-size expects two integers left,right (e.g. 128,0; -1: unbounded), "
                f"got {text!r}"
            )
        m["window_size"] = window
    text = v.get("--window-attn-skip-freq")
    if text is None:
        return
    if "--window-size" not in v:
        notes.append("--window-attn-skip-freq is ignored without --window-size")
        return
    try:
        m["window_attn_skip_freq"] = _layer_freq(text)
    except ValueError:
        problems.append(
            f"--window-attn-skip-freq expects an integer or a list expression such as "
            f'"([0]+[1]*3)*3" (digits, commas, brackets, + and *), got {text!r}'
        )


def _layer_freq(text: str) -> int | list[int]:
    """Megatron-LM's moe_freq_type without eval: int(text), or a list expression of integer
    lists, + and * when the text has a '['. ValueError otherwise."""
    import re

    from metatrace.config.resolve import list_expression

    if "[" not in text:
        return int(text)
    if re.search(r"[^,\d\[\]\(\)\+\*]", text):  # what Megatron-LM's _eval_pattern allows
        raise ValueError(text)

    out = list_expression(text)
    if not isinstance(out, list) or not all(type(x) is int for x in out):
        raise ValueError(text)
    return out


# Flags only multi-latent attention reads (megatron-core's MLATransformerConfig fields).
_MLA_FLAGS = (
    "--q-lora-rank",
    "--kv-lora-rank",
    "--qk-head-dim",
    "--qk-pos-emb-head-dim",
    "--v-head-dim",
    "--rotary-scaling-factor",
    "--mscale",
    "--mscale-all-dim",
)


# HEAD's non-MLA yarn (--position-embedding-type yarn) reads these; --yarn-* only it.
_YARN_FLAGS = ("--rotary-scaling-factor", "--mscale", "--mscale-all-dim")
_NON_MLA_YARN_FLAGS = (
    "--yarn-original-max-position-embeddings",
    "--yarn-beta-fast",
    "--yarn-beta-slow",
)


def _latent_attention(v, job, notes, problems) -> None:
    """Multi-latent attention: its flags mean nothing without --multi-latent-attention, but
    for the yarn ones with --position-embedding-type yarn (HEAD's GPTModel YaRN). The --yarn-*
    flags feed only that yarn (MLA's boundaries have no flag: notes 4.8)."""
    yarn = v.get("--position-embedding-type") == "yarn"
    unused = [f for f in _NON_MLA_YARN_FLAGS if f in v]
    if unused and (not yarn or "--multi-latent-attention" in v):
        notes.append(f"{_ignored(unused)} without --position-embedding-type yarn")
        for flag in unused:
            job["model"].pop(FLAGS[flag].key.split(".")[-1], None)
    if "--multi-latent-attention" in v:
        if "--group-query-attention" in v:
            problems.append(
                "--multi-latent-attention and --group-query-attention exclude each "
                "other (Megatron-LM asserts it)"
            )
            job["model"].pop("num_query_groups", None)
        return
    given = [f for f in _MLA_FLAGS if f in v and not (yarn and f in _YARN_FLAGS)]
    if given:
        notes.append(f"{_ignored(given)} without --multi-latent-attention")
        for flag in given:
            job["model"].pop(FLAGS[flag].key.split(".")[-1], None)
    if v.get("--rope-type") == "yarn":
        problems.append(
            "--rope-type yarn needs --multi-latent-attention (Megatron-LM asserts "
            "rope for other attention)"
        )


def _experts(v, job, notes, problems) -> None:
    """Mixture of experts: the flags that need a reading (--num-experts 0 means none)."""
    if not _is_moe(v):
        # those megatron-core may refuse on a dense model go on to the job's checks
        given = [
            f
            for f in v
            if f.startswith("--moe-")
            and FLAGS[f].cls == "modelled"
            and FLAGS[f].key not in MOE_REFUSED_DENSE
        ]
        if given:
            notes.append(f"{_ignored(given)} without --num-experts")
            for flag in given:
                if FLAGS[flag].key is not None:
                    *path, leaf = FLAGS[flag].key.split(".")
                    job.get(path[0], {}).pop(leaf, None)
        return
    m, t = job["model"], job["training"]
    m["num_experts"] = v["--num-experts"]
    freq = v.get("--moe-layer-freq")
    if freq is not None:
        m["moe_layer_freq"] = int(freq) if freq.strip().isdigit() else freq
    kinds = v.get("--moe-router-load-balancing-type")
    if kinds:
        if len(set(kinds)) > 1:
            problems.append(
                f"{_show('--moe-router-load-balancing-type', kinds)}: combined "
                "load-balancing losses are not modelled; give one"
            )
        m["moe_router_load_balancing_type"] = kinds[0]
    coeffs = v.get("--moe-aux-loss-coeff")
    if coeffs:
        m["moe_aux_loss_coeff"] = coeffs[0]
    # A capacity factor pads every expert to capacity only with
    # --moe-pad-expert-input-to-capacity; alone it drops tokens beyond it.
    if "--moe-pad-expert-input-to-capacity" in v:
        if "--moe-expert-capacity-factor" not in v:
            problems.append(
                "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor "
                "(Megatron-LM asserts it)"
            )
        t["moe_routing"] = "capacity"
    # --moe-enable-deepep (deprecated in megatron-core 0.16.1) is the flex dispatcher's deepep
    # backend; megatron-core refuses it with another dispatcher or with the hybridep backend
    # (transformer_config.py:1063-1068).
    if v.get("--moe-enable-deepep"):
        backend = v.get("--moe-flex-dispatcher-backend", "deepep")
        if v.get("--moe-token-dispatcher-type") != "flex" or backend != "deepep":
            problems.append(
                "--moe-enable-deepep needs --moe-token-dispatcher-type flex and no other "
                "--moe-flex-dispatcher-backend (megatron-core asserts it)"
            )
        job["parallel"]["moe_flex_dispatcher_backend"] = "deepep"


def _vocabulary(v, job, notes, problems) -> None:
    """model.vocab_size from the tokenizer (notes 4.4, Megatron-LM core_v0.16.1)."""
    m = job["model"]
    size, tokenizer = v.get("--vocab-size"), v.get("--tokenizer-type")
    if "--padded-vocab-size" in v:
        # The final size, unpadded: with a multiple of 1, padding only rounds to tp, which the
        # vocabulary-parallel embedding needs anyway.
        m["vocab_size"], m["make_vocab_size_divisible_by"] = v["--padded-vocab-size"], 1
        return
    if tokenizer is None:
        if size is not None and "--vocab-file" not in v:
            notes.append(
                "no --tokenizer-type: pretrain_gpt.py defaults to GPT2BPETokenizer "
                "(which needs --vocab-file); metatrace takes the vocabulary from "
                "--vocab-size"
            )
            m["vocab_size"] = size
            return
        if "--vocab-file" not in v:
            notes.append(
                f"no --tokenizer-type or --vocab-file: assuming pretrain_gpt.py's "
                f"default GPT2BPETokenizer ({GPT2_VOCAB} tokens)"
            )
        tokenizer = "GPT2BPETokenizer"
    if tokenizer == "GPT2BPETokenizer":
        if size is not None:
            notes.append(f"--vocab-size is ignored by GPT2BPETokenizer ({GPT2_VOCAB} tokens)")
        m["vocab_size"] = GPT2_VOCAB
    elif size is None:
        problems.append(
            f"metatrace cannot know the vocabulary of --tokenizer-type {tokenizer} (Megatron-LM "
            "reads it from the tokenizer's files): give its size with --vocab-size"
        )
    elif tokenizer == "NullTokenizer":
        m["vocab_size"] = size + 1  # 0.16.1: the end-of-document id is V, so V + 1 tokens
    else:
        m["vocab_size"] = size
        if tokenizer not in ("TikTokenizer",):
            notes.append(
                f"--vocab-size {size} stands for {tokenizer}'s vocabulary "
                "(Megatron-LM reads it from the tokenizer's files)"
            )


def _parallel(v, job, notes, problems, world_size) -> None:
    p = job["parallel"]
    tp = v.get("--tensor-model-parallel-size", 1)
    pp = v.get("--pipeline-model-parallel-size", 1)
    cp = v.get("--context-parallel-size", 1)
    _virtual_pipeline(v, p, problems, pp)
    layout = v.get("--pipeline-model-parallel-layout")
    if layout is not None:
        p["layout"] = layout
    kinds = v.get("--cp-comm-type")
    if kinds:
        layers = v.get("--num-layers")
        if len(kinds) > 1 and layers is not None and len(kinds) != layers:
            problems.append(
                f"--cp-comm-type gives {len(kinds)} values; a value per layer needs "
                f"--num-layers = {layers} of them"
            )
        p["cp_comm_type"] = {"allgather": "all_gather"}.get(kinds[0], kinds[0])
    path = v.get("--tp-comm-overlap-cfg")
    if path is not None and not v.get("--tp-comm-overlap"):
        notes.append("--tp-comm-overlap-cfg changes nothing without --tp-comm-overlap")
    elif path is not None:
        cfg = _read_ub_cfg(path, problems)
        if cfg is not None:
            p["tp_comm_overlap_cfg"] = cfg
    # Expert parallelism (notes 2): EP needs experts; ETP alone lays out the expert grid of a
    # dense model.
    ep = v.get("--expert-model-parallel-size", 1)
    etp = v.get("--expert-tensor-parallel-size", tp)
    if ep > 1 and not _is_moe(v):
        problems.append(
            f"--expert-model-parallel-size {ep} needs --num-experts (Megatron-LM asserts it)"
        )
    if min(ep, etp, tp, pp, cp) < 1:
        return  # job_from_dict reports degrees below 1
    if world_size % (etp * ep * pp):
        problems.append(
            f"world size {world_size} is not divisible by expert tp x ep x pp = "
            f"{etp} x {ep} x {pp} = {etp * ep * pp} (megatron-core's expert grid)"
        )
    elif (
        "--use-tp-pp-dp-mapping" in v
        and pp > 1
        and world_size % (tp * pp * cp) == 0
        and world_size // (etp * ep * pp) != world_size // (tp * pp * cp)
    ):
        problems.append(
            f"with --use-tp-pp-dp-mapping the expert data-parallel size (world / (etp x ep x pp) "
            f"= {world_size // (etp * ep * pp)}) must equal the data-parallel size (world / "
            f"(tp x pp x cp) = {world_size // (tp * pp * cp)}) (megatron-core asserts it)"
        )
    if "--expert-tensor-parallel-size" in v:
        p["etp"] = etp


def _read_ub_cfg(path: str, problems: list[str]) -> dict | None:
    """--tp-comm-overlap-cfg: the YAML file Megatron-LM hands Transformer Engine as ub_cfgs
    ({gemm name: settings}); checked as parallel.tp_comm_overlap_cfg."""
    from metatrace.config.read import parse_yaml, read_text

    try:
        data = parse_yaml(read_text(path, "--tp-comm-overlap-cfg file"), path)
    except ConfigError as e:
        problems.append(e.problems[0])
        return None
    if not isinstance(data, dict):
        problems.append(
            f"--tp-comm-overlap-cfg {path}: expected a mapping of GEMM names (qkv_fprop, ...) "
            "to their settings"
        )
        return None
    return data


def _virtual_pipeline(v, p, problems, pp) -> None:
    """parallel.vpp as validate_args derives it (notes 4.6)."""
    per_chunk = v.get("--num-layers-per-virtual-pipeline-stage")
    stages = v.get("--num-virtual-stages-per-pipeline-rank")
    given = [
        f
        for f in (
            "--num-layers-per-virtual-pipeline-stage",
            "--num-virtual-stages-per-pipeline-rank",
            "--pipeline-model-parallel-layout",
        )
        if f in v
    ]
    if len(given) > 1:
        problems.append(f"give at most one of {', '.join(given)} (Megatron-LM asserts it)")
        return
    if per_chunk is None and stages is None:
        return
    overlap = "--no-overlap-p2p-communication" not in v
    if pp <= (1 if overlap else 2):
        problems.append(
            "an interleaved pipeline needs --pipeline-model-parallel-size > "
            + ("1" if overlap else "2 with --no-overlap-p2p-communication")
        )
        return
    if stages is None:
        if "--decoder-first-pipeline-num-layers" in v or "--decoder-last-pipeline-num-layers" in v:
            problems.append(
                "with --decoder-first/last-pipeline-num-layers give the virtual "
                "stages as --num-virtual-stages-per-pipeline-rank (Megatron-LM "
                "asserts it)"
            )
            return
        layers = v.get("--num-layers", v.get("--encoder-num-layers"))
        if layers is None or per_chunk < 1:
            return
        layers += ("--account-for-embedding-in-pipeline-split" in v) + (
            "--account-for-loss-in-pipeline-split" in v
        )
        if layers % pp or (layers // pp) % per_chunk:
            problems.append(
                f"{layers} layers over --pipeline-model-parallel-size {pp} do not "
                "split into chunks of --num-layers-per-virtual-pipeline-stage "
                f"{per_chunk}"
            )
            return
        stages = layers // pp // per_chunk
    if stages != 1:
        p["vpp"] = stages


def _training(v, job, notes, problems) -> None:
    t = job["training"]
    bf16, fp16 = "--bf16" in v, "--fp16" in v
    if bf16 and fp16:
        problems.append("--bf16 and --fp16 exclude each other (Megatron-LM asserts it)")
    t["precision"] = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    if "--fp8-format" in v and bf16:
        t["precision"], t["fp8_format"] = "fp8", v["--fp8-format"]
        if v.get("--fp8-recipe") not in (None, "custom"):  # custom is listed as not modelled
            t["fp8_recipe"] = v["--fp8-recipe"]
        if "--fp8-param-gather" in v:
            t["fp8_param_gather"] = True
    elif "--fp8-recipe" in v and "--fp8-format" not in v:
        notes.append(f"{_ignored(['--fp8-recipe'])} without --fp8-format")
    if "--fp8-param-gather" in v and "--fp8-format" not in v:
        problems.append(
            "--fp8-param-gather needs --fp8-format (megatron-core refuses FP8 "
            "parameters without FP8)"
        )
    if "--fp4-format" in v and "--fp8-format" in v:
        problems.append(
            "--fp8-format and --fp4-format exclude each other (megatron-core refuses fp8 and "
            "fp4 at once)"
        )
    elif "--fp4-format" in v and bf16:
        t["precision"] = "fp4"
        if v.get("--fp4-recipe") not in (None, "custom"):  # custom is listed as not modelled
            t["fp4_recipe"] = v["--fp4-recipe"]
    if "--fp4-param-gather" in v and "--fp4-format" not in v:
        problems.append(
            "--fp4-param-gather needs --fp4-format (megatron-core refuses FP4 parameters "
            "without FP4)"
        )
    bf16_layers = ("--first-last-layers-bf16", "--num-layers-at-start-in-bf16")
    bf16_layers += ("--num-layers-at-end-in-bf16",)
    given = [f for f in bf16_layers if f in v]
    if given and t["precision"] not in ("fp8", "fp4"):
        # megatron-core reads them only under FP8 or FP4 (fp8_utils.py:516, fp4_utils.py:122)
        for flag in given:
            t.pop(FLAGS[flag].key.split(".")[1], None)
        notes.append(f"{' '.join(given)} changes nothing without --fp8-format or --fp4-format")
    elif "--first-last-layers-bf16" not in v:
        for flag in given[:]:  # the counts act only with the switch (fp8_utils.py:515-520)
            t.pop(FLAGS[flag].key.split(".")[1], None)
        if given:
            notes.append(f"{' '.join(given)} changes nothing without --first-last-layers-bf16")
    if "--overlap-param-gather" in v and "--overlap-grad-reduce" not in v:
        problems.append(
            "--overlap-param-gather needs --overlap-grad-reduce (Megatron-LM asserts it)"
        )
    _recompute(v, t, notes)
    # bf16 accumulates and reduces gradients in fp32 unless asked otherwise (notes 6.10);
    # config.py derives that default, the flags override it.
    if "--accumulate-allreduce-grads-in-fp32" in v:
        t["grad_reduce_in_fp32"] = True
    elif "--grad-reduce-in-bf16" in v:
        t["grad_reduce_in_fp32"] = False
    if v.get("--optimizer") in ("adam", "sgd"):
        t["optimizer"] = v["--optimizer"]
    _offloading(v, t, notes, problems)
    _megatron_fsdp(v, t, notes)
    _cuda_graphs(v, t, notes)


_MOE_SCOPES = {"moe", "moe_router", "moe_preprocess"}


def _graph_flags(v) -> tuple[str, list[str]]:
    """(impl, scope) of --cuda-graph-impl (or the deprecated --enable-cuda-graph: local,
    --external-cuda-graph: transformer_engine; a newer Megatron-LM's impl full_iteration: local
    over the whole iteration) and --cuda-graph-scope (a newer one's --cuda-graph-modules)."""
    impl = v.get("--cuda-graph-impl", "none")
    if impl == "none" and "--enable-cuda-graph" in v:
        impl = "local"
    elif impl == "none" and "--external-cuda-graph" in v:
        impl = "transformer_engine"
    scope = v.get("--cuda-graph-scope", v.get("--cuda-graph-modules")) or []
    if isinstance(scope, str):
        scope = [scope]
    scope = [x for item in scope for x in item.strip("[]").replace(",", " ").split()]
    if impl == "full_iteration":
        impl, scope = "local", ["full_iteration"]
    return impl, [x for x in scope if x != "full"]  # megatron-core: "full" is the whole layer


def _graphs_not_modelled(v) -> bool:
    """CUDA graphs listed as not modelled: megatron-core's own (local) of an MoE model or with
    MoE or mamba scopes."""
    impl, scope = _graph_flags(v)
    moe = "--num-experts" in v or bool(_MOE_SCOPES & set(scope))
    return impl not in ("none", "transformer_engine") and (moe or "mamba" in scope)


def _cuda_graphs(v, t, notes) -> None:
    impl, scope = _graph_flags(v)
    if _graphs_not_modelled(v):
        return  # the run is described without them, and says so
    if impl == "none":
        given = [f for f in ("--cuda-graph-scope", "--cuda-graph-modules") if f in v]
        if given:
            notes.append(f"{_ignored(given)} without --cuda-graph-impl")
        return
    t["cuda_graph_impl"] = impl
    t["cuda_graph_scope"] = scope or None


_FSDP_OPTIONS = {
    "--data-parallel-sharding-strategy": "fsdp_sharding_strategy",
    "--outer-dp-sharding-strategy": "fsdp_outer_sharding_strategy",
    "--fsdp-double-buffer": "fsdp_double_buffer",
    "--suggested-communication-unit-size": "fsdp_communication_unit_size",
    "--megatron-fsdp-main-grads-dtype": "fsdp_main_grads_dtype",
    "--megatron-fsdp-main-params-dtype": "fsdp_main_params_dtype",
    "--megatron-fsdp-grad-comm-dtype": "fsdp_grad_comm_dtype",
}


def _megatron_fsdp(v, t, notes) -> None:
    """--use-megatron-fsdp and its options (which act only with it)."""
    given = [f for f in _FSDP_OPTIONS if f in v]
    if "--use-megatron-fsdp" not in v:
        if given:
            notes.append(f"{_ignored(given)} without --use-megatron-fsdp")
        return
    t["megatron_fsdp"] = True
    for flag, key in _FSDP_OPTIONS.items():
        if flag in v:
            t[key] = v[flag]
    if "--data-parallel-sharding-strategy" not in v:
        notes.append(
            "--data-parallel-sharding-strategy not given: optim_grads_params, the default of "
            "Megatron-LM after core_v0.16.1 (core_v0.16.1's no_shard fails at the first "
            "optimizer step with megatron-core 0.16.1)"
        )


def _offloading(v, t, notes, problems) -> None:
    """Fine-grained activation offloading: --offload-modules and --min-offloaded-tensor-size
    act only with --fine-grained-activation-offloading (megatron-core then needs modules)."""
    given = [f for f in ("--offload-modules", *_OFFLOAD_OPTIONS) if f in v]
    if "--fine-grained-activation-offloading" not in v:
        if given:
            notes.append(f"{_ignored(given)} without --fine-grained-activation-offloading")
        return
    if not v.get("--offload-modules"):
        problems.append(
            "--fine-grained-activation-offloading needs --offload-modules "
            "(megatron-core asserts it)"
        )
        return
    t["activation_offload_modules"] = list(v["--offload-modules"])
    for flag, key in _OFFLOAD_OPTIONS.items():
        if flag in v:
            t[key] = v[flag]


# Fine-grained offloading's options beside --offload-modules (all but the first megatron-core
# 0.19's: tracing.checks refuses them under 0.16.1).
_OFFLOAD_OPTIONS = {
    "--min-offloaded-tensor-size": "min_offloaded_tensor_size",
    "--activation-offload-fraction": "activation_offload_fraction",
    "--delta-offload-bytes-across-pp-ranks": "delta_offload_bytes_across_pp_ranks",
    "--fine-grained-offloading-max-inflight-offloads": (
        "fine_grained_offloading_max_inflight_offloads"
    ),
}


def _recompute(v, t, notes) -> None:
    granularity = v.get("--recompute-granularity")
    if "--recompute-activations" in v:
        granularity = "selective"  # validate_args, whatever --recompute-granularity says
    options = [
        f for f in ("--recompute-method", "--recompute-num-layers", "--recompute-modules") if f in v
    ]
    if granularity is None:
        if options:
            notes.append(f"{_ignored(options)} without --recompute-granularity")
        return
    rec = {"granularity": granularity}
    if "--recompute-method" in v:
        rec["method"] = v["--recompute-method"]
    if "--recompute-num-layers" in v:
        rec["num_layers"] = v["--recompute-num-layers"]
    modules = v.get("--recompute-modules")
    if modules is not None:
        rec["modules"] = list(modules)
    t["recompute"] = {**t.get("recompute", {}), **rec}


def _implementation(v, job, notes, problems, gpu, env) -> None:
    impl = job["implementation"]
    kind = v.get("--transformer-impl", "transformer_engine")
    if kind == "inference_optimized":
        problems.append(
            "--transformer-impl inference_optimized is an inference layer spec; "
            "metatrace models training (local or transformer_engine)"
        )
    elif "--transformer-impl" in v:
        impl["transformer_impl"] = kind
    backend = v.get("--attention-backend")
    if backend == "local" and "--spec" not in v:
        problems.append(
            "--attention-backend local needs --spec local in Megatron-LM (notes "
            "6.9); for GPT use --transformer-impl local"
        )
    elif backend is not None:
        impl["attention_backend"] = backend
    position = job["model"].get("position_embedding_type", "learned_absolute")
    if "--no-rope-fusion" in v or position != "rope":
        impl["rope_fusion"] = False  # validate_args turns it off without rope
    elif kind == "local":
        notes.append(
            "RoPE fusion stays on in Megatron-LM with --transformer-impl local and uses "
            "Transformer Engine's kernel where TE is installed; metatrace models the "
            "local spec's unfused RoPE (pass --no-rope-fusion to match)"
        )
    # megatron-core's bias_activation_fusion is --bias-swiglu-fusion with --swiglu, else
    # --bias-gelu-fusion (core_transformer_config_from_args).
    off = "--no-bias-swiglu-fusion" if "--swiglu" in v else "--no-bias-gelu-fusion"
    if off in v:
        impl["bias_activation_fusion"] = False
    allow = env.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    if "--deterministic-mode" in v:
        for flag in ("--cross-entropy-loss-fusion", "--use-flash-attn"):
            if flag in v:
                problems.append(
                    f"{flag} is refused with --deterministic-mode (Megatron-LM asserts it)"
                )
        if kind == "transformer_engine" and allow not in (None, "0"):
            # megatron-core 0.16.1 TEDotProductAttention.__init__ (Megatron-LM's HEAD sets the
            # variable itself when it is not set)
            problems.append(
                f"--deterministic-mode with NVTE_ALLOW_NONDETERMINISTIC_ALGO={allow}: "
                "megatron-core's Transformer Engine attention refuses to run (it "
                "needs 0)"
            )
    # Transformer Engine trains deterministically with --deterministic-mode (Megatron-LM turns
    # torch's deterministic algorithms on) or NVTE_ALLOW_NONDETERMINISTIC_ALGO=0.
    if kind == "transformer_engine" and ("--deterministic-mode" in v or allow == "0"):
        _deterministic_attention(backend, impl, notes, problems, gpu)
    if env.get("TORCHDYNAMO_DISABLE") == "1" or env.get("TORCH_COMPILE_DISABLE") == "1":
        impl["torch_compile"] = False  # megatron-core's @jit_fuser kernels run eagerly


def _deterministic_attention(backend, impl, notes, problems, gpu) -> None:
    """Transformer Engine's backend selection for deterministic training (TE 2.8-2.20,
    attention/dot_product_attention/utils.py, "Filter: Determinism") drops cuDNN's fused
    attention (its arbitrary-sequence-length backend) before sm90: the auto backend then runs
    flash-attn (>= 2.4.1 is deterministic), and an explicit fused backend has nothing left."""
    from metatrace.config.hardware import GPU_ARCH

    arch = GPU_ARCH.get(gpu or "h100", "")
    if not (arch.startswith("sm") and int(arch[2:]) < 90):
        return
    if backend in (None, "auto"):
        impl["attention_backend"] = "flash"
        notes.append(
            f"deterministic training on {gpu}: Transformer Engine has no deterministic "
            "fused attention before sm90 and runs flash-attn (metatrace assumes "
            "flash-attn >= 2.4.1 is installed, as in NVIDIA's PyTorch containers)"
        )
    elif backend == "fused":
        problems.append(
            f"deterministic training with --attention-backend fused on {gpu}: "
            "Transformer Engine has no deterministic fused attention before sm90 "
            "and finds no backend to run"
        )


def _cluster(v, job, notes, problems, world_size, gpu, gpus_per_node, env) -> list:
    """The cluster section, and the environment: variables metatrace models are read or
    checked, those that change nothing are accepted silently, those it knows change memory
    are returned as not modelled, any other is accepted and named in a note."""
    c = job["cluster"]
    c["num_gpus"] = world_size
    if gpu is not None:
        c["gpu"] = gpu
    if gpus_per_node is not None:
        c["gpus_per_node"] = gpus_per_node
    missing = [
        NotModelled(f"{n}={env[n]}", *ENV_NOT_MODELLED[n]) for n in env if n in ENV_NOT_MODELLED
    ]
    other = [
        n
        for n in env
        if n not in ENV_MODELLED
        and n not in ENV_NOT_MODELLED
        and n not in ENV_NO_EFFECT
        and not n.startswith(ENV_NO_EFFECT_PREFIXES)
    ]
    if other:
        notes.append(
            f"environment variables metatrace does not know, taken to change nothing "
            f"it predicts: {', '.join(sorted(other))}"
        )
    if "CUBLAS_WORKSPACE_CONFIG" in env:
        c["cublas_workspace_config"] = env["CUBLAS_WORKSPACE_CONFIG"]
    if env.get("WORLD_SIZE", str(world_size)) != str(world_size):
        problems.append(
            f"WORLD_SIZE={env['WORLD_SIZE']} in the environment, but the world size is {world_size}"
        )
    backend = v.get("--attention-backend", "auto")
    for name, expected in zip(NVTE_ATTN, NVTE_FOR_BACKEND.get(backend, (1, 1, 1))):
        if name in env and env[name] != str(expected):
            problems.append(
                f"{name}={env[name]} contradicts --attention-backend {backend}, which sets it to "
                f"{expected}; megatron-core asserts they agree (choose the attention with "
                "--attention-backend)"
            )
    if "NCCL_NVLS_ENABLE" in env:
        c["nccl_nvls"] = env["NCCL_NVLS_ENABLE"] != "0"
    if "NCCL_BUFFSIZE" in env:
        c["nccl_buffsize"] = int(env["NCCL_BUFFSIZE"])
    if "NCCL_MIN_NCHANNELS" in env or "NCCL_MAX_NCHANNELS" in env:
        from metatrace.config.hardware import NCCL_CHANNELS

        low = int(env.get("NCCL_MIN_NCHANNELS", 1))
        high = int(env.get("NCCL_MAX_NCHANNELS", 64))
        c["nccl_channels"] = max(low, min(high, NCCL_CHANNELS))
    # torch reads PYTORCH_ALLOC_CONF first, PYTORCH_CUDA_ALLOC_CONF (deprecated) only without it
    # (c10/core/AllocatorConfig.cpp).
    conf = env.get("PYTORCH_ALLOC_CONF", env.get("PYTORCH_CUDA_ALLOC_CONF"))
    if conf is not None:
        c["allocator_conf"] = conf
        if "PYTORCH_ALLOC_CONF" in env and env.get("PYTORCH_CUDA_ALLOC_CONF", conf) != conf:
            notes.append(
                f"PYTORCH_ALLOC_CONF={conf} and PYTORCH_CUDA_ALLOC_CONF="
                f"{env['PYTORCH_CUDA_ALLOC_CONF']}: PyTorch reads the first only"
            )
    from metatrace.config.hardware import GPU_ARCH

    tp, cp = v.get("--tensor-model-parallel-size", 1), v.get("--context-parallel-size", 1)
    fsdp = "--use-megatron-fsdp" in v or "--use-torch-fsdp2" in v
    arch = GPU_ARCH.get(gpu or "h100", "")
    before_blackwell = arch.startswith("sm") and int(arch[2:]) < 100
    connections = env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if connections not in (None, "1") and (tp > 1 or cp > 1) and not fsdp and before_blackwell:
        problems.append(
            f"CUDA_DEVICE_MAX_CONNECTIONS={connections}: Megatron-LM asserts it is 1 "
            "with tensor or context parallelism before Blackwell"
        )
    return missing
