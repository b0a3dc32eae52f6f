"""The package's import graph: no cycles, no upward imports, and pure layers free of torch,
megatron-core and the instruments.

Reads every module's source with `ast` and imports none of them (this file is in the fast tier):
module-level and function-local `import` / `from ... import` statements (`from x import y`
counts x.y when y is a module of the package), `importlib.import_module("literal")`, and any
string constant that is exactly the name of one of the package's modules (hooks/patches.py names
its stand-ins that way and imports them later). File paths map to module names the way
pyproject.toml's [tool.setuptools] packages and package-dir do (and setup.py, which ships the
root cli.py as metatrace.cli).
"""

from __future__ import annotations

import ast
import os

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The layers, lowest first: a module may import its own layer and those below it. A module
# takes the row of its most specific pattern: an exact name beats "pkg.*", a longer "pkg.*"
# beats a shorter one; "pkg.*" covers pkg itself and everything below it.
LAYERS = (
    (
        "base",
        ("metatrace", "metatrace.errors", "metatrace.interrupt", "metatrace.records"),
        "the error types and frozen event records every other layer speaks",
    ),
    (
        "config",
        ("metatrace.config", "metatrace.config.*"),
        "job dataclasses, loading and checks: plain data from YAML or flags",
    ),
    (
        "world",
        ("metatrace.world",),
        "ranks and process groups computed from a job's parallel sizes, before any model exists",
    ),
    (
        "analysis",
        ("metatrace.analysis.*",),
        "pure aggregation: records in, tables out, testable without megatron-core",
    ),
    (
        "formatting",
        ("metatrace.render.format",),
        "sizes, numbers and titles that every output formats the same way",
    ),
    (
        "outputs",
        ("metatrace.render", "metatrace.render.*", "metatrace.export.*"),
        "terminal, JSON, HTML, snapshot and Chrome renderings of one computed result",
    ),
    (
        "instruments",
        (
            "metatrace.hooks",
            "metatrace.hooks.collectives",
            "metatrace.hooks.flops",
            "metatrace.hooks.host",
            "metatrace.hooks.remap",
            "metatrace.hooks.fastmeta",
            "metatrace.hooks.recorder",
            "metatrace.hooks.offload",
            "metatrace.hooks.meta_kernels",
        ),
        "context managers that turn a running model into records; models report through them",
    ),
    (
        "models",
        ("metatrace.models.*",),
        "stand-ins for Transformer Engine, flash-attn and fused kernels, built on the instruments",
    ),
    (
        "assembly",
        (
            "metatrace.hooks.*",
            "metatrace.hooks.patches",
            "metatrace.hooks.fake_world",
            "metatrace.models.build",
        ),
        "wires stand-ins into megatron-core (patches, fake world, a rank's model); new hooks land here",
    ),
    (
        "tracing",
        ("metatrace.tracing.*",),
        "runs a job's ranks on the meta device through the assembly and collects traces",
    ),
    (
        "planning",
        ("metatrace.planning.*",),
        "searches configurations, checking candidates with the tracing layer",
    ),
    (
        "entry",
        ("metatrace.cli", "metatrace.__main__"),
        "the command line, which wires every layer together",
    ),
)
PURE = ("base", "config", "world", "analysis", "formatting", "outputs")
# What a module of a pure layer must not import (the name or anything below it).
IMPURE = (
    "torch",
    "megatron",
    "transformer_engine",
    "flash_attn",
    "metatrace.hooks",
    "metatrace.models",
    "metatrace.tracing",
    "metatrace.planning",
)


# --- the checker ---------------------------------------------------------------------------


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the most specific pattern matching `module` (None: no layer)."""
    best, best_rank = None, None
    for index, (_, patterns, _) in enumerate(LAYERS):
        for pattern in patterns:
            if pattern.endswith(".*"):
                prefix = pattern[:-2]
                if module != prefix and not module.startswith(prefix + "."):
                    continue
                rank = (0, len(prefix))
            elif pattern == module:
                rank = (1, len(pattern))
            else:
                continue
            if best_rank is None or rank > best_rank:
                best, best_rank = index, rank
    return best


def _below(name: str, roots) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path whose last module imports the first) per strongly connected set of
    modules (Tarjan's algorithm on the edges between `graph`'s own modules)."""
    index, low, stack, on_stack, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.add(w)
                if w == v:
                    break
            if len(scc) > 1 or v in graph[v]:
                sccs.append(scc)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, scc) for scc in sccs]


def _cycle_in(graph, scc) -> list[str]:
    """A path through `scc` from its first module back to it (breadth-first, so the shortest)."""
    start = min(scc)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & scc):
                if w == start:
                    return paths[v]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(scc)


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Everything wrong with an import graph {module: names it imports} of the package."""
    problems = []
    for cycle in find_cycles(graph):
        problems.append("import cycle: " + " -> ".join(cycle + cycle[:1]))
    for module in sorted(graph):
        mine = layer_of(module)
        if mine is None:
            problems.append(f"{module} is in no layer: add it to LAYERS in {__name__}")
            continue
        for name in sorted(graph[module]):
            if LAYERS[mine][0] in PURE and _below(name, IMPURE):
                problems.append(f"{module} (pure layer {LAYERS[mine][0]}) imports {name}")
                continue
            theirs = layer_of(name) if name in graph else None
            if theirs is not None and theirs > mine:
                problems.append(
                    f"{module} (layer {mine} {LAYERS[mine][0]}) imports {name} "
                    f"(higher layer {theirs} {LAYERS[theirs][0]})"
                )
    return problems


# --- reading the package -------------------------------------------------------------------


def package_modules(root: str = ROOT) -> dict[str, str]:
    """{module name: source path} of every module the wheel ships, from pyproject.toml."""
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    package_dir = setuptools.get("package-dir", {})
    modules = {}
    for package in setuptools["packages"]:
        directory = _package_directory(package, package_dir, root)
        if not os.path.isdir(directory) and os.path.isfile(directory + ".py"):
            modules[package] = directory + ".py"  # setup.py ships cli.py as metatrace.cli
            continue
        for entry in sorted(os.listdir(directory)):
            if not entry.endswith(".py"):
                continue
            name = package if entry == "__init__.py" else f"{package}.{entry[:-3]}"
            modules[name] = os.path.join(directory, entry)
    return modules


def _package_directory(package: str, package_dir: dict, root: str) -> str:
    """setuptools' rule: the nearest enclosing package named in package-dir, plus the rest."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in package_dir:
            return os.path.join(root, package_dir[head], *parts[i:])
    return os.path.join(root, package_dir.get("", ""), *parts)


def imported_names(source: str, module: str, is_package: bool, known) -> set[str]:
    """The module names `source` (the module `module`) imports, anywhere in its code."""
    names = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base:
                names.add(base)
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                if sub in known:
                    names.add(sub)
        elif isinstance(node, ast.Call) and _is_import_call(node.func):
            if (
                node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names.add(node.args[0].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
            names.add(node.value)
    names.discard(module)
    return names


def _is_import_call(func) -> bool:
    """importlib.import_module(...), import_module(...) or __import__(...)."""
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def package_graph(root: str = ROOT) -> dict[str, set[str]]:
    modules = package_modules(root)
    graph = {}
    for name, path in modules.items():
        with open(path) as f:
            source = f.read()
        graph[name] = imported_names(source, name, path.endswith("__init__.py"), modules)
    return graph


# --- the tests -----------------------------------------------------------------------------


def test_the_package_has_no_cycles_and_no_upward_or_impure_imports():
    problems = violations(package_graph())
    assert not problems, "\n".join(problems)


def test_the_walk_sees_the_whole_package():
    graph = package_graph()
    # Every layer's flagship is found, cli.py under its installed name included.
    for module in (
        "metatrace",
        "metatrace.config.megatron.args",
        "metatrace.render.format",
        "metatrace.hooks.patches",
        "metatrace.models.te_linear",
        "metatrace.cli",
        "metatrace.__main__",
    ):
        assert module in graph
    assert "metatrace.models.te_linear" in graph["metatrace.models.specs"]
    assert "metatrace.models.te_optim" in graph["metatrace.hooks.patches"]  # by string


def test_the_layer_table_is_consistent():
    patterns = [p for _, ps, _ in LAYERS for p in ps]
    assert len(patterns) == len(set(patterns)), "a pattern in two layers"
    assert set(PURE) <= {name for name, _, _ in LAYERS}
    assert layer_of("metatrace.hooks.guards") == layer_of("metatrace.hooks.patches")
    assert layer_of("metatrace.hooks.flops") < layer_of("metatrace.models.norm")
    assert layer_of("metatrace.models.build") > layer_of("metatrace.models.specs")
    assert layer_of("metatrace.render.format") < layer_of("metatrace.render.run")
    assert layer_of("metatrace.render") == layer_of("metatrace.export.html")
    assert layer_of("metatrace.somewhere") is None


def test_the_checker_finds_cycles_upward_and_impure_imports():
    graph = {
        "metatrace.models.a": {"metatrace.models.b", "torch"},
        "metatrace.models.b": {"metatrace.models.c"},
        "metatrace.models.c": {"metatrace.models.a"},
        "metatrace.world": {"metatrace.analysis.memory"},
        "metatrace.analysis.memory": {"metatrace.records", "torch.nn"},
        "metatrace.records": set(),
        "metatrace.render.run": {"metatrace.tracing.trace", "megatron.core"},
        "metatrace.tracing.trace": {"metatrace.models.a", "megatron.core"},
        "metatrace.extra": set(),
    }
    assert violations(graph) == [
        "import cycle: metatrace.models.a -> metatrace.models.b -> metatrace.models.c"
        " -> metatrace.models.a",
        "metatrace.analysis.memory (pure layer analysis) imports torch.nn",
        f"metatrace.extra is in no layer: add it to LAYERS in {__name__}",
        "metatrace.render.run (pure layer outputs) imports megatron.core",
        "metatrace.render.run (pure layer outputs) imports metatrace.tracing.trace",
        "metatrace.world (layer 2 world) imports metatrace.analysis.memory"
        " (higher layer 3 analysis)",
    ]


def test_the_reader_sees_hidden_imports():
    known = {
        "metatrace.models.te_cp",
        "metatrace.config",
        "metatrace.config.job",
        "metatrace.models.te_optim",
        "metatrace.hooks.patches",
    }
    source = """
import importlib

def forward():
    from metatrace.models.te_cp import context_parallel_attention  # function-local
    from metatrace import config  # a submodule through `from`
    from .job import Job  # relative, inside metatrace.config
    importlib.import_module("transformer_engine.pytorch")
    return _standin("metatrace.models.te_optim", "FusedAdam")  # named by string
"""
    names = imported_names(source, "metatrace.config.load", False, known)
    assert names == {
        "importlib",
        "metatrace",
        "metatrace.config",
        "metatrace.config.job",
        "metatrace.models.te_cp",
        "metatrace.models.te_optim",
        "transformer_engine.pytorch",
    }


@pytest.mark.parametrize(
    "module, expected",
    [
        ("metatrace.models.te_attention", "metatrace.models.te_cp"),
        ("metatrace.models.te_linear", "metatrace.models.te_fp8_linear"),
    ],
)
def test_the_dispatching_module_owns_the_edge(module, expected):
    """The two former cycles: the dispatcher imports its specialisation, never the reverse."""
    graph = package_graph()
    assert expected in graph[module]
    assert module not in graph[expected]
