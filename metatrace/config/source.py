"""The job a command is given: a job file (YAML), a file of Megatron-LM arguments (a training
script, one line, or a `{--flag: value}` mapping) or such arguments as one string. A file is
told apart by its name and content (`file_kind`), so that `--config FILE` and a positional
FILE take either. The world size of Megatron-LM arguments comes from `--world-size` or from
the script's launcher line (metatrace.config.megatron.launch), which must agree.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Literal

from metatrace.errors import ConfigError

FileKind = Literal["job", "megatron", "hf_config", "report", "json"]


@dataclass(frozen=True, kw_only=True)
class MegatronOptions:
    """The options that apply to Megatron-LM arguments (`--world-size`, `--gpu`, ...);
    `fallback_world_size` is used only where neither `world_size` nor a launcher line gives
    one (`metatrace plan --num-gpus`), `world_flag` names the flag that gives it."""

    world_size: int | None = None
    gpu: str | None = None
    gpus_per_node: int | None = None
    env: tuple[str, ...] = ()
    newer_megatron: str | None = None
    fallback_world_size: int | None = None
    world_flag: str = "--world-size"

    def given(self) -> list[str]:
        """The flags given, as the user wrote them."""
        names = ("world_size", "gpu", "gpus_per_node", "env", "newer_megatron")
        return ["--" + n.replace("_", "-") for n in names if getattr(self, n)]


def file_kind(path: str) -> FileKind:
    """What a file holds: a job file, Megatron-LM arguments (a script, a line, a mapping of
    `--flag`s), a Hugging Face config.json, a JSON report of `metatrace run --json`, or other
    JSON ("json": not valid JSON, or none of these). Unreadable or malformed files are told by
    their name; their readers name the problem."""
    from metatrace.config.job import SECTIONS
    from metatrace.config.read import MAX_TEXT_BYTES, parse_yaml, read_text

    if path.endswith(".json"):
        try:
            with open(path, "rb") as f:
                text = f.read(MAX_TEXT_BYTES + 1)
            if len(text) > MAX_TEXT_BYTES:
                return "report"  # larger than any job, config or arguments file is read
            data = json.loads(text)
        except (OSError, ValueError, RecursionError):
            return "json"
        if not isinstance(data, dict):
            return "json"
        if "memory_verdict" in data:
            return "report"
        if "model_type" in data or "architectures" in data:
            return "hf_config"
        if _flags(data):
            return "megatron"
        return "job" if set(data) & set(SECTIONS) else "json"
    if not path.endswith((".yaml", ".yml")):
        # a script, a line; not a device or a pipe, which the job loader refuses by name
        return "megatron" if os.path.isfile(path) else "job"
    try:
        data = parse_yaml(read_text(path, "job file"), path)
    except ConfigError:
        return "job"  # the job loader names the problem
    return "megatron" if _flags(data) else "job"


def _flags(data) -> bool:
    return isinstance(data, dict) and any(str(k).startswith("--") for k in data)


def read_job(
    *,
    config: str | None = None,
    megatron_args: str | None = None,
    megatron_args_file: str | None = None,
    options: MegatronOptions = MegatronOptions(),
):
    """(the Job, the notes to warn about) from one of a file (`config`: a job file or Megatron-LM
    arguments, told apart by `file_kind`), Megatron-LM arguments as a string, or a file of
    them."""
    sources = [s for s in (config, megatron_args, megatron_args_file) if s]
    if len(sources) != 1:
        raise ConfigError(
            "give the job as one of FILE (a job file or a training script), --config FILE, "
            "--megatron-args ARGS, --megatron-args-file FILE"
        )
    if config:
        kind = file_kind(config)
        if kind == "hf_config":
            raise ConfigError(
                f"{config} is a Hugging Face config.json, a model without a layout: name it in "
                "a job file's model.hf_config (see examples/qwen3-8b-hf.yaml), or plan its "
                f"layouts with metatrace plan --model {config}"
            )
        if kind == "report":
            raise ConfigError(
                f"{config} is a JSON report of metatrace run, not a job (metatrace diff reads it)"
            )
        if kind == "megatron":
            megatron_args_file, config = config, None
        # "json": load_job names what is wrong with it
    if config:
        if options.given():
            raise ConfigError(
                f"{options.given()[0]} applies to Megatron-LM arguments; set it in {config}"
            )
        from metatrace.config import load_job

        job = load_job(config)
        return job, job.notes  # e.g. fields of a Hugging Face config.json that nothing reads
    return _megatron_job(megatron_args, megatron_args_file, options)


def _megatron_job(text: str | None, path: str | None, options: MegatronOptions):
    from metatrace.config.megatron.args import job_from_args
    from metatrace.config.megatron.launch import read_launch, world_of
    from metatrace.config.megatron.script import environment, read_args, split_args

    if options.newer_megatron is not None and not options.newer_megatron.strip():
        raise ConfigError("--newer-megatron needs the release's name, e.g. core_v0.17.0")
    given = {}
    for item in options.env:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise ConfigError(f"--env {item!r} must be NAME=VALUE")
        given[name] = value
    if text is not None:
        tokens, script, source = split_args(text), text, "--megatron-args"
    else:
        assert path is not None
        (tokens, script), source = read_args(path), path
    # The script's exported variables are the run's environment; --env overrides them.
    env, unexpanded = environment(script) if script is not None else ({}, [])
    env.update(given)
    unread = [n for n in unexpanded if n not in given]
    if unread:
        raise ConfigError(
            f"{source} exports {', '.join(unread)} from shell variables, which metatrace does "
            f"not expand: give the value with --env {unread[0]}=VALUE"
        )
    launch = read_launch(script) if script is not None else None
    world_size, gpus_per_node = options.world_size, options.gpus_per_node
    if world_size is None and (launch is None or launch.problem) and options.fallback_world_size:
        world_size = options.fallback_world_size
    world_size, gpus_per_node = world_of(
        launch, world_size, gpus_per_node, source, flag=options.world_flag
    )
    if world_size is None:
        raise ConfigError(
            f"Megatron-LM arguments need {options.world_flag} N (the GPUs of the run) where "
            "no launcher line (torchrun, srun) says it"
        )
    job, notes = job_from_args(
        tokens,
        world_size=world_size,
        gpu=options.gpu,
        gpus_per_node=gpus_per_node,
        env=env,
        source=source,
        release=options.newer_megatron,
    )
    return dataclasses.replace(job, notes=job.notes + tuple(notes)), tuple(notes)
