"""How many processes a training script's launcher line starts: the world size (and processes
per node) read from `torchrun` / `python -m torch.distributed.run` (or `.launch`), `srun`
(with the script's `#SBATCH` directives) and `mpirun` / `mpiexec`, so that a script that says
`--nproc_per_node 8 --nnodes 2` needs no `--world-size 16`.

Understood: the launcher's options with their values as separate words or after `=`
(`--nproc_per_node=8`, `-N2`); shell variables the script sets to plain values before the
launcher line (`GPUS_PER_NODE=8`, `export NNODES=2`, one set from another), and the Slurm
variables its `#SBATCH` directives give (`$SLURM_NNODES` from `#SBATCH --nodes=2`). What the
script leaves to the machine or the environment (a variable it does not set, `${N:-2}`,
`$((...))`, `--nproc_per_node gpu`, an elastic `--nnodes 1:4`, `srun` without a node count) is
a `problem`: the world size is then the user's to give.

Known limitations: one launcher line, the one that runs the training script (the command
metatrace.config.megatron.script reads the arguments from); `srun bash -c "..."` and other
launchers (deepspeed, accelerate) are not read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from metatrace.errors import ConfigError


@dataclass(frozen=True)
class Launch:
    """What the launcher line says: `world_size` and `per_node` processes (None where it does
    not say), `line` where it is, `text` its words as written, `problem` why the world size
    cannot be read from it."""

    world_size: int | None
    per_node: int | None
    line: int
    text: str
    problem: str | None = None

    def describe(self) -> str:
        return f"line {self.line}: {self.text}"


# Options of each launcher that size the world, by canonical name; the values are the names
# a script may use (long options also as --name=value, short ones also glued: -N2).
_TORCHRUN = {"nproc": ("--nproc_per_node", "--nproc-per-node"), "nnodes": ("--nnodes",)}
_TORCHRUN_SWITCHES = ("--standalone",)
_SRUN = {
    "nodes": ("-N", "--nodes"),
    "ntasks": ("-n", "--ntasks"),
    "per_node": ("--ntasks-per-node",),
    "gpus_per_node": ("--gpus-per-node",),
}
_MPIRUN = {"ntasks": ("-np", "-n", "--np", "--n")}
# The variables Slurm sets from an allocation, by the #SBATCH option that sizes it.
_SLURM_VARS = {
    "nodes": ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
    "ntasks": ("SLURM_NTASKS", "SLURM_NPROCS"),
    "per_node": ("SLURM_NTASKS_PER_NODE",),
    "gpus_per_node": ("SLURM_GPUS_PER_NODE",),
}
_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def read_launch(text: str) -> Launch | None:
    """The launcher line of a training script (None where the arguments have no launcher: a
    line of flags, `python pretrain_gpt.py ...` alone)."""
    from metatrace.config.megatron.script import arguments_command, commands

    cmds = commands(text)
    found = arguments_command(cmds)
    if found is None:
        return None
    index, start = found
    words = cmds[index][start:]
    script = _script_position(words)
    if script is None:
        return None
    launcher = words[:script]
    values = _assignments(cmds[:index] + [cmds[index][:start]], _sbatch(text))
    shown = " ".join(w.text for w in launcher)
    line = launcher[0].line if launcher else words[0].line
    try:
        world, per_node = _size(launcher, values)
    except _Unclear as e:
        return Launch(None, None, line, shown, str(e))
    if world is None:
        return None
    return Launch(world, per_node, line, shown)


def world_of(
    launch: Launch | None,
    world_size: int | None,
    gpus_per_node: int | None,
    source: str,
    flag: str = "--world-size",
) -> tuple[int | None, int | None]:
    """(world size, GPUs per node) of Megatron-LM arguments from `source`: the flags' where
    given, the launcher line's otherwise. A flag that disagrees with the launcher line is an
    error: the arguments were written for the launcher's world (their batch sizes, their
    layout), and a silent override would predict a run that script does not start. `flag`
    names the option that gives the world size where the launcher line cannot."""
    if launch is None:
        return world_size, gpus_per_node
    if launch.problem is not None:
        if world_size is None:
            raise ConfigError(
                f"{source} {launch.describe()}: {launch.problem}; give the world size with {flag} N"
            )
        return world_size, gpus_per_node
    if world_size is not None and world_size != launch.world_size:
        raise ConfigError(
            f"--world-size {world_size} disagrees with {source} {launch.describe()}, which "
            f"starts {launch.world_size} processes: drop --world-size, or change the script"
        )
    if gpus_per_node is not None and launch.per_node not in (None, gpus_per_node):
        raise ConfigError(
            f"--gpus-per-node {gpus_per_node} disagrees with {source} {launch.describe()}, "
            f"which starts {launch.per_node} processes a node (metatrace places ranks on nodes "
            "in order, that many a node): drop --gpus-per-node, or change the script"
        )
    return launch.world_size, gpus_per_node or launch.per_node


class _Unclear(Exception):
    """The launcher line does not say how many processes it starts."""


def _script_position(words) -> int | None:
    """Where the training script (a word ending in `.py`) is among the words, if anywhere."""
    for j, w in enumerate(words):
        if w.text.endswith(".py") and not w.text.startswith("-"):
            return j
    return None


def _assignments(cmds, slurm: dict[str, str]) -> dict[str, str | None]:
    """Shell variables set before the launcher line, to their values (None: not a plain value,
    e.g. `$((...))` or a variable the script does not set); the Slurm variables of the
    #SBATCH directives first."""
    from metatrace.config.megatron.script import leading_assignments

    values: dict[str, str | None] = dict(slurm)
    for words in cmds:
        for w in leading_assignments(words):
            name, value = w.text.split("=", 1)
            values[name] = _expand(value, values)
    return values


def _expand(text: str, values: dict[str, str | None]) -> str | None:
    """`text` with its `$NAME` / `${NAME}` replaced by their values; None where one is not known
    or something else is expanded (`${N:-2}`, `$((...))`, `$(...)`, backquotes)."""
    out = _VARIABLE.sub(lambda m: values.get(m.group(1) or m.group(2)) or "\0", text)
    return None if "\0" in out or "$" in out or "`" in out else out


def _sbatch(text: str) -> dict[str, str]:
    """The Slurm variables the script's #SBATCH directives size (SLURM_NNODES, ...)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("#SBATCH"):
            continue
        words = line[len("#SBATCH") :].split("#", 1)[0].split()
        for name, value in _options(words, _SRUN).items():
            for var in _SLURM_VARS[name]:
                found[var] = value
    return found


def _options(words: list[str], table: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """The options of `table` found in `words`, canonical name -> value as written."""
    spellings = {s: name for name, names in table.items() for s in names}
    out: dict[str, str] = {}
    for j, word in enumerate(words):
        flag, eq, value = word.partition("=")
        if flag in spellings and eq:
            out[spellings[flag]] = value
        elif word in spellings and j + 1 < len(words):
            out[spellings[word]] = words[j + 1]
        elif re.fullmatch(r"-[A-Za-z]\S+", word) and word[:2] in spellings:
            out[spellings[word[:2]]] = word[2:]  # -N2
    return out


def _size(launcher, values) -> tuple[int | None, int | None]:
    """(world size, processes per node) of the launcher's words; (None, None) where none of
    them is a launcher metatrace reads."""
    texts = [w.text for w in launcher]
    names = [os.path.basename(t) for t in texts]
    if "torchrun" in names:
        return _torchrun(texts[names.index("torchrun") + 1 :], values)
    for j in range(len(texts) - 1):
        if texts[j] == "-m" and texts[j + 1] in (
            "torch.distributed.run",
            "torch.distributed.launch",
        ):
            return _torchrun(texts[j + 2 :], values)
    for name in ("mpirun", "mpiexec"):
        if name in names:
            opts = _options(texts[names.index(name) + 1 :], _MPIRUN)
            if "ntasks" not in opts:
                raise _Unclear(f"{name} without -np: the allocation decides how many processes")
            return _number(name, "-np", opts["ntasks"], values), None
    if "srun" in names:
        return _srun(texts[names.index("srun") + 1 :], values)
    return None, None


def _torchrun(words: list[str], values) -> tuple[int, int]:
    opts = _options(words, _TORCHRUN)
    nproc = _number("torchrun", "--nproc_per_node", opts.get("nproc", "1"), values)
    nodes = opts.get("nnodes", "1")
    if any(w in _TORCHRUN_SWITCHES for w in words):
        nodes = "1"
    low, _, high = _resolved("torchrun", "--nnodes", nodes, values).partition(":")
    if high and high != low:
        raise _Unclear(
            f"torchrun --nnodes {nodes} is elastic: the nodes that join decide the world size"
        )
    return nproc * _number("torchrun", "--nnodes", low, values), nproc


def _srun(words: list[str], values) -> tuple[int, int | None]:
    opts = _options(words, _SRUN)
    for name, (var, *_) in _SLURM_VARS.items():
        if name not in opts and values.get(var):
            opts[name] = values[var]  # from the #SBATCH directives
    per_node = None
    for name in ("per_node", "gpus_per_node"):
        if name in opts:
            per_node = _number("srun", f"--{name.replace('_', '-')}", opts[name], values)
            break
    if "ntasks" in opts:
        return _number("srun", "--ntasks", opts["ntasks"], values), per_node
    if "nodes" not in opts or per_node is None:
        missing = "--nodes" if "nodes" not in opts else "--ntasks-per-node"
        raise _Unclear(
            f"srun without {missing} (nor #SBATCH {missing}): the allocation decides how many "
            "processes"
        )
    return _number("srun", "--nodes", opts["nodes"], values) * per_node, per_node


def _resolved(launcher: str, option: str, text: str, values) -> str:
    value = _expand(text, values)
    if value is None:
        names = [m.group(1) or m.group(2) for m in _VARIABLE.finditer(text)]
        unset = [n for n in names if values.get(n) is None]
        what = (
            f"${unset[0]}, which the script does not set to a plain value"
            if unset
            else f"{text}, which the shell expands as the script runs"
        )
        raise _Unclear(f"{launcher} {option} is {what}")
    return value


def _number(launcher: str, option: str, text: str, values) -> int:
    value = _resolved(launcher, option, text, values)
    value = value.split("(")[0]  # Slurm's "8(x2)" of SLURM_TASKS_PER_NODE
    value = value.rsplit(":", 1)[-1]  # --gpus-per-node h100:8
    if not value.isdigit() or int(value) < 1:
        raise _Unclear(f"{launcher} {option} {text} is not a number of processes")
    return int(value)
