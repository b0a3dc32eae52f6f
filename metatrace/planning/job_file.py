"""A resolved job as a YAML job file (`metatrace plan --write-config`): the keys a user would
write, in the format of examples/*.yaml, that `metatrace run --config` resolves back to the
same job.

The file holds the model's preset (or Hugging Face config.json), the layout's keys (tp, pp,
sequence parallel, micro-batch size, recompute, ...), the cluster's size, and every other key
whose value the job has and the defaults would not give: every key that differs from its
default is written, then each one is left out in turn where the mapping still resolves to the
same job without it (a preset's dimension, a size derived from the others).
"""

from __future__ import annotations

import copy
import dataclasses
import os

from metatrace.config import job_from_dict
from metatrace.config.job import SECTIONS, Job
from metatrace.errors import ConfigError

# Written even where they equal the defaults: what the layout is.
_ALWAYS = {
    "parallel": ("tp", "pp", "vpp", "cp", "ep", "sequence_parallel"),
    "training": (
        "seq_length",
        "micro_batch_size",
        "global_batch_size",
        "precision",
        "recompute",
        "distributed_optimizer",
    ),
    "cluster": ("num_gpus", "gpus_per_node", "gpu"),
}
# Written only where they are set (None or 1 is "not used").
_WHEN_SET = {("parallel", "vpp"), ("parallel", "cp"), ("parallel", "ep"), ("training", "recompute")}


def job_file_data(job, *, base_dir: str = ".", out_dir: str = ".") -> dict:
    """The mapping of the job file of `job` (see the module docstring). A relative
    `model.hf_config` of `job` is read from `base_dir` and written relative to `out_dir`."""
    model: dict = {}
    if job.model.preset is not None:
        model["preset"] = job.model.preset
    elif job.model.hf_config is not None:
        path = os.path.join(base_dir, os.path.expanduser(job.model.hf_config))
        model["hf_config"] = os.path.relpath(path, out_dir)
    data: dict = {"model": model}
    for section in SECTIONS:
        values, default = getattr(job, section), getattr(Job(), section)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if (section, f.name) in (("model", "preset"), ("model", "hf_config")):
                continue
            if value != getattr(default, f.name) or f.name in _ALWAYS.get(section, ()):
                if (section, f.name) in _WHEN_SET and value == getattr(default, f.name):
                    continue
                data.setdefault(section, {})[f.name] = _plain(value)
    off = _differences(_load(data, job, out_dir), job)
    if off:
        raise ConfigError(
            f"cannot write {job.source} as a job file: {off[0][0]}.{off[0][1]} differs"
        )
    # Leave out each key the others give anyway (a preset's dimension, a derived size).
    for section in list(data):
        for name in list(data[section]):
            if name in _ALWAYS.get(section, ()) or name in ("preset", "hf_config"):
                continue
            value = data[section].pop(name)
            try:
                same = not _differences(_load(data, job, out_dir), job)
            except ConfigError:
                same = False
            if not same:
                data[section][name] = value
    return {s: data[s] for s in SECTIONS if data.get(s)}


def _load(data: dict, job, out_dir: str):
    return job_from_dict(copy.deepcopy(data), source=job.source, base_dir=out_dir)


def _differences(got, want) -> list[tuple[str, str, object]]:
    out = []
    for section in SECTIONS:
        a, b = getattr(got, section), getattr(want, section)
        for f in dataclasses.fields(b):
            if (section, f.name) == ("model", "hf_config"):
                continue  # rewritten relative to the file
            if getattr(a, f.name) != getattr(b, f.name):
                out.append((section, f.name, getattr(b, f.name)))
    return out


def _plain(value):
    """A value as YAML writes it: a nested dataclass as its keys that differ from the defaults."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        default = type(value)()
        return {
            f.name: _plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if getattr(value, f.name) != getattr(default, f.name)
        }
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_job_file(job, path: str, *, header: list[str], base_dir: str = ".") -> None:
    """Write `job` to `path` as a YAML job file, `header` as its opening comment lines, then
    the job's Megatron-LM launch (metatrace.config.megatron.to_args), commented out."""
    import yaml

    from metatrace.config.megatron.to_args import command_lines, megatron_command

    data = job_file_data(job, base_dir=base_dir, out_dir=os.path.dirname(os.path.abspath(path)))
    text = "".join(f"# {line}\n" for line in header)
    text += "#\n"
    for line in command_lines(megatron_command(job)):
        text += f"# {line.removeprefix('# ')}\n" if line.startswith("# ") else f"#   {line}\n"
    text += yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None
