"""Reading a job: a YAML file or a plain mapping into the dataclasses of metatrace.config.job,
unknown keys named by their full path with the closest valid one, values checked against the
annotations, the preset or Hugging Face config.json merged under the explicit keys; then
resolved (metatrace.config.resolve)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

from metatrace.config.job import DERIVED, SECTIONS, Job
from metatrace.config.read import excerpt, parse_yaml, read_text
from metatrace.config.resolve import resolve
from metatrace.errors import ConfigError

# Every whole number of a job (a dimension, a count, a batch) is at most 2**31 - 1: PyTorch's
# and megatron-core's CUDA kernels index many of them with 32-bit integers, no real job comes
# near it, and it keeps products of sizes (a weight's bytes) far from 64-bit overflow.
MAX_INT = 2**31 - 1


def load_job(path: str | Path) -> Job:
    """Read a YAML job file, apply the preset, derive and check everything."""
    path = Path(path)
    data = parse_yaml(read_text(path, "config file"), str(path))
    data = data if data is not None else {}
    return job_from_dict(data, source=str(path), base_dir=path.parent)


def job_from_dict(
    data: Any, *, source: str = "<config>", base_dir: str | Path | None = None
) -> Job:
    """Build and resolve a Job from a plain mapping (the parsed YAML). A relative
    `model.hf_config` is read from `base_dir` (the job file's directory; default the current
    one)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections {SECTIONS}")
    data, hf_notes = _apply_hf_config(data, Path(base_dir) if base_dir is not None else None)
    job = _build(Job, _apply_preset(data), "", exclude=DERIVED)
    job = resolve(dataclasses.replace(job, source=source))
    # resolve() writes its own notes; what the HF config said comes first.
    return dataclasses.replace(job, notes=hf_notes + job.notes) if hf_notes else job


def _all_keys() -> dict[str, str]:
    """Every valid key as {leaf: full path}, to point at the right section."""
    out = {}
    for sec in SECTIONS:
        cls = typing.get_type_hints(Job)[sec]
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, f"{sec}.{f.name}")
            if dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name]):
                for g in dataclasses.fields(typing.get_type_hints(cls)[f.name]):
                    out.setdefault(g.name, f"{sec}.{f.name}.{g.name}")
    return out


def _unknown_key(cls, key: str, path: str, valid: list[str]) -> ConfigError:
    full = f"{path}.{key}" if path else key
    norm = str(key).replace("-", "_")
    close = difflib.get_close_matches(norm, valid, n=1, cutoff=0.6)
    if norm in valid:
        hint = f"; did you mean '{_join(path, norm)}'?"
    elif close:
        hint = f"; did you mean '{_join(path, close[0])}'?"
    else:
        elsewhere = _all_keys().get(norm)
        hint = (
            f"; did you mean '{elsewhere}'?" if elsewhere else f" (valid keys: {', '.join(valid)})"
        )
    return ConfigError(f"unknown key '{full}'{hint}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _build(cls, data: Any, path: str, exclude: tuple[str, ...] = ()):
    if not isinstance(data, dict):
        raise ConfigError(f"'{path}' must be a mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls) if f.name not in exclude]
    kwargs = {}
    for key, value in data.items():
        if key not in valid:
            raise _unknown_key(cls, key, path, valid)
        kwargs[key] = _coerce(hints[key], value, _join(path, key))
    return cls(**kwargs)


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {excerpt(value)}" if value is not None else "nothing (null)"


def _coerce(tp, value: Any, path: str):
    """Check `value` against the annotation `tp`; return it (ints accepted for floats)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(option, value, path)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, path)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            choices = ", ".join(str(a) for a in args)
            raise ConfigError(f"'{path}' must be one of {choices}; got {excerpt(value)}{hint}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"'{path}' must be a list, got {_describe(value)}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"'{path}' must be true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"'{path}' must be a whole number, got {_describe(value)}")
        if abs(value) > MAX_INT:
            raise ConfigError(
                f"'{path}' = {excerpt(value)} is beyond {MAX_INT:,} (2**31 - 1), the largest "
                "size or count metatrace takes"
            )
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"'{path}' must be a number, got {_describe(value)}")
        if isinstance(value, int) and abs(value) > MAX_INT:
            raise ConfigError(f"'{path}' = {excerpt(value)} is beyond {MAX_INT:,}")
        if not math.isfinite(value):
            raise ConfigError(f"'{path}' must be a finite number, got {value}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"'{path}' must be a string, got {_describe(value)}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} at {path}")  # a bug in this file, not input


def _apply_preset(data: dict) -> dict:
    """Merge `model.preset`'s dimensions under the keys the file gives explicitly."""
    from metatrace.config.presets import PRESETS

    model = data.get("model")
    if model is None:
        return data
    if not isinstance(model, dict):
        raise ConfigError(f"'model' must be a mapping, got {_describe(model)}")
    name = model.get("preset")
    if name is None:
        return data
    if not isinstance(name, str) or name not in PRESETS:
        close = difflib.get_close_matches(str(name), list(PRESETS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown 'model.preset' {name!r}{hint} (known: {', '.join(PRESETS)})")
    return {**data, "model": {**PRESETS[name].dims, **model}}


def _apply_hf_config(data: dict, base_dir: Path | None) -> tuple[dict, tuple[str, ...]]:
    """Merge the model section read from `model.hf_config` under the keys the file gives
    explicitly, as `_apply_preset` does; the notes of the reading (`metatrace.config.hf`)."""
    model = data.get("model")
    if not isinstance(model, dict) or model.get("hf_config") is None:
        return data, ()  # _apply_preset names a model section that is not a mapping
    if model.get("preset") is not None:
        raise ConfigError(
            "'model.preset' and 'model.hf_config' both give the model; keep one "
            "(explicit model keys override either)"
        )
    name = model["hf_config"]
    if not isinstance(name, str):
        raise ConfigError(
            f"'model.hf_config' must be the path of a config.json, got {_describe(name)}"
        )
    from metatrace.config.hf import read_hf_config

    path = Path(name).expanduser()
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    training = data.get("training")
    seq = training.get("seq_length") if isinstance(training, dict) else None
    seq = seq if type(seq) is int else None  # a bad one is reported by resolve()
    dims, notes = read_hf_config(path, seq_length=seq)
    return {**data, "model": {**dims, **model}}, notes


def job_to_dict(job: Job) -> dict:
    """The resolved job as plain data (for JSON output and the config summary)."""
    return dataclasses.asdict(job)
