"""Megatron-LM's pretrain_gpt.py parser, dumped one row per option string.

    PYTHONPATH=/tmp/mc19/src python bench/megatron_parser.py > parser.tsv
    PYTHONPATH=/tmp/mc19/src python bench/megatron_parser.py --into TABLE --column in_core_v0.19.2

Builds the parser the way pretrain_gpt.py does, without running training:
`argparse.ArgumentParser(description='Megatron-LM Arguments', allow_abbrev=False)`, then
`megatron.training.arguments.add_megatron_arguments(parser)` (every argument group, those
generated from config dataclasses by `ArgumentGroupFactory` included), with
`megatron.core.extensions.kitchen.HAVE_KITCHEN` forced so that the `kitchen` group is captured;
then walks `parser._actions` (../shared/notes/megatron-lm-flags.md, "How it was produced").
Prints the columns of ../shared/notes/megatron-lm-flags.tsv but the `in_*` ones: flag, dest,
kind, type, default, choices, nargs, group, help, sorted by group title (case-insensitive), then
flag. With `--into TABLE --column NAME`, adds the column NAME to a table of that form
(tests/data/megatron-lm-flags.tsv, or metatrace/config/megatron/flags.tsv without its help
column): "yes" for a flag this parser has, "no" for one it has not, "unknown" for a flag of a
group the parser could not be built with (`modelopt-generic` without megatron.post_training); and
adds this parser's flags that the table lacks as rows (their other `in_*` cells "no"), in the
table's order.

The Megatron-LM sources must come first on the path (the megatron-core of the same release:
megatron-core's wheels since 0.19 ship `megatron/training`). Modules that a CPU machine may lack
and that only kernels use at import (triton) are stubbed; pretrain_gpt.py's ModelOpt group
(`megatron.post_training.arguments.add_modelopt_args`) is added when that module imports (the
megatron-core wheel does not ship it).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import enum
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import typing


class _Anything(types.ModuleType):
    """A stub module: every attribute is a callable stub, decorators return what they wrap."""

    __path__: list[str] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub


def _stub(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]  # @triton.jit, @triton.autotune(...) applied
    return _stub


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stubs the named modules (and their submodules)."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Anything(spec.name)

    def exec_module(self, module):
        pass


# megatron-core's Triton kernels that import triton unguarded (0.19.2): stubbed whole where
# triton is not installed, rather than triton itself, which torch probes and would then take for
# a real one. Nothing of them runs while the parser is built.
TRITON_KERNELS = ("megatron.core.transformer.moe.ops.paged_stash", "megatron.core.ssm.ops")


def _cell(value) -> str:
    return " ".join(str(value).split())


def _type_name(action: argparse.Action) -> str:
    converter = action.type
    if converter is None:
        return ""
    name = getattr(converter, "__name__", type(converter).__name__)
    if name == "enum_type_handler" and action.choices:  # ArgumentGroupFactory's, by its enum
        return f"{name}[{type(next(iter(action.choices))).__name__}]"
    return name


def _kind(action: argparse.Action) -> str:
    return {
        argparse._StoreAction: "store",
        argparse._StoreTrueAction: "store_true",
        argparse._StoreFalseAction: "store_false",
        argparse._StoreConstAction: "store_const",
        argparse._AppendAction: "append",
        argparse._HelpAction: "help",
        argparse.BooleanOptionalAction: "boolean_optional",
    }.get(type(action), type(action).__name__)


def _choice(c) -> str:
    return f"{type(c).__name__}.{c.name}" if isinstance(c, enum.Enum) else str(c)


def _default(value) -> str:
    if value == argparse.SUPPRESS:
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def parser() -> tuple[argparse.ArgumentParser, set[str]]:
    """pretrain_gpt.py's parser, and the titles of the groups it could not be built with."""
    if importlib.util.find_spec("triton") is None:
        sys.meta_path.insert(0, _StubFinder(TRITON_KERNELS))
    if not hasattr(typing, "override"):  # Python 3.12's, which marks and returns the method
        typing.override = lambda method: method  # type: ignore[attr-defined]
    import megatron.core.extensions.kitchen as kitchen

    kitchen.HAVE_KITCHEN = True
    # (arguments.py imports HAVE_KITCHEN from the module when it adds the kitchen group)
    from megatron.training import arguments

    p = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    arguments.add_megatron_arguments(p)
    try:
        from megatron.post_training.arguments import add_modelopt_args  # type: ignore
    except ImportError:
        print("no megatron.post_training: the modelopt group is left out", file=sys.stderr)
        return p, {"modelopt-generic"}
    add_modelopt_args(p)
    return p, set()


def rows(p: argparse.ArgumentParser) -> list[dict[str, str]]:
    group_of = {}
    for group in p._action_groups:
        for action in group._group_actions:
            group_of[id(action)] = group.title
    out = []
    for action in p._actions:
        for flag in action.option_strings:
            nargs = action.nargs
            out.append(
                {
                    "flag": flag,
                    "dest": action.dest,
                    "kind": _kind(action),
                    "type": _type_name(action),
                    "default": _default(action.default),
                    "choices": ",".join(_choice(c) for c in action.choices)
                    if action.choices
                    else "",
                    "nargs": "" if nargs is None else str(nargs),
                    "group": group_of.get(id(action), ""),
                    "help": _cell(action.help or "")[:120],
                }
            )
    out.sort(key=lambda r: (r["group"].lower(), r["flag"]))
    return out


COLUMNS = ("flag", "dest", "kind", "type", "default", "choices", "nargs", "group", "help")


def merge(path: str, column: str, parsed: list[dict[str, str]], missing: set[str]) -> None:
    """Adds `column` (and rows for the flags it lacks) to the table at `path`, in place."""
    with open(path) as f:
        lines = f.read().splitlines()
    comments = [line for line in lines if line.startswith("#")]
    table = list(
        csv.DictReader([line for line in lines if not line.startswith("#")], delimiter="\t")
    )
    header = [c for c in lines[len(comments)].split("\t") if c != column]
    ins = [c for c in header if c.startswith("in_")]
    at = header.index(ins[-1]) + 1
    header.insert(at, column)
    by_flag = {r["flag"]: r for r in parsed}
    for row in table:
        row[column] = (
            "yes" if row["flag"] in by_flag else "unknown" if row["group"] in missing else "no"
        )
    known = {row["flag"] for row in table}
    key = lambda r: (r["group"].lower(), r["flag"])
    for new in parsed:
        if new["flag"] in known:
            continue
        row = {c: new.get(c, "no") for c in header}
        row[column] = "yes"
        table.insert(bisect.bisect(table, key(row), key=key), row)
    with open(path, "w") as f:
        for line in comments:
            f.write(line + "\n")
        f.write("\t".join(header) + "\n")
        for row in table:
            f.write("\t".join(row[c] for c in header) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--into", action="append", default=[], help="a table to add the column to")
    ap.add_argument("--column", help="the column's name (with --into)")
    args = ap.parse_args(argv)
    p, missing = parser()
    table = rows(p)
    if args.into:
        for path in args.into:
            merge(path, args.column, table, missing)
        return 0
    print("\t".join(COLUMNS))
    for r in table:
        print("\t".join(r[c] for c in COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
