"""The installed megatron-core, checked: its release, and metatrace's copies of its source.

- Releases: MEGATRON_CORE is what metatrace was measured with; `check_megatron_core()` (on entry
  to hooks/patches.py's `megatron_patches`) refuses any other installed release, and each patch
  names the releases that need it (`Versions`).
- Copies: where metatrace restates megatron-core code (a parser, a rank generator, a layer spec,
  the math of a compiled kernel), a mark in the copy's docstring or comment names the original
  and the hash of its source when the copy was made, one mark per original:

      Restates megatron.core.<module>.<name> (source sha256: <first 12 hex digits>).

  A copy that holds for more than one supported release lists each release's hash, oldest
  first ("(source sha256: 6ee0db2a2177, fa3ad8693ffa)"), and branches on `since()` where the
  releases differ; a copy of what only newer releases have says from which series
  ("(source sha256: 2211880f4e3e; since 0.19)").

  ("Copied from" in place of "Restates" for a copy; a mark may wrap between its words.) A mark
  is plain text, so modules that import neither megatron-core nor hooks carry one too
  (metatrace.config, metatrace.world). `copies()` finds the marks in metatrace's source,
  `stale()` names each copy whose original changed since: a megatron-core upgrade that changes
  copied code fails tests/tracing/test_patch_guard.py until the copy is reviewed and its mark
  given the new hash (`source_hash`).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib
import importlib.util
import inspect
import logging
import re
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path

from metatrace.config import release as _release
from metatrace.errors import ConfigError

# --- releases -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Versions:
    """megatron-core releases, `since` to `until` inclusive. A bound of two numbers is a series:
    (0, 16) is every 0.16.x. `until` None: `since` alone."""

    since: tuple[int, ...]
    until: tuple[int, ...] | None = None

    def __contains__(self, release: tuple[int, ...]) -> bool:
        until = self.since if self.until is None else self.until
        return self.since <= release[: len(self.since)] and release[: len(until)] <= until

    def __str__(self) -> str:
        if self.until is None:
            return _dotted(self.since)
        return f"{_dotted(self.since)} to {_dotted(self.until)}"


def _dotted(release: tuple[int, ...]) -> str:
    """(0, 16, 1) -> "0.16.1", a series (0, 16) -> "0.16.x"."""
    return ".".join(map(str, release)) + (".x" if len(release) < 3 else "")


EVERY_RELEASE = Versions((0, 16), (0, 19))
"""What a patch needs under every supported release."""
RELEASE_0_16 = Versions((0, 16))
"""What only megatron-core 0.16 needs (0.19 changed or dropped the target)."""
RELEASE_0_19 = Versions((0, 19))
"""What only megatron-core 0.19 needs (its new code, or a target 0.16 does not have)."""

MEGATRON_CORE = (Versions((0, 16, 1)), Versions((0, 19)))
"""The megatron-core releases metatrace was measured with and its patches checked against:
0.16.1 and the 0.19 series. 0.17 and 0.18 are refused (their sources differ from both in what
the patches replace)."""


def supported(release: tuple[int, ...]) -> bool:
    """Whether `release` is one of MEGATRON_CORE."""
    return any(release in versions for versions in MEGATRON_CORE)


def supported_text() -> str:
    """MEGATRON_CORE in words: "0.16.1 and 0.19.x"."""
    return " and ".join(map(str, MEGATRON_CORE))


def parse_release(version: str) -> tuple[int, ...]:
    """(0, 16, 1) from "0.16.1", also from "0.16.1rc0" or "0.16.1.dev0+g0abc" (a pre-release
    counts as its release); at least three numbers ("0.16" is 0.16.0)."""
    numbers = _release.parse(version)
    if not numbers:
        raise ValueError(f"not a release number: {version!r}")
    return numbers + (0,) * (3 - len(numbers))


# megatron.core.jit binds jit_fuser to torch.compile when megatron-core is imported, and importing
# torch.compile's machinery (dynamo, inductor, sympy's users) is about half of megatron-core's
# import (3 of 6 s, measured with python -X importtime). Traces run those functions eagerly, so
# import_megatron_core() imports megatron-core with torch.compile deferred: a decorated function
# runs eagerly inside megatron_patches() and is compiled by the real torch.compile on its first
# call outside (a real run's, e.g. `metatrace measure` on a GPU), as torch.compile compiles on the
# first call too. megatron-core 0.16.1 (megatron/core/jit.py) binds it so with torch >= 2.2.
EAGER = [0]
"""How many megatron_patches() contexts are open: deferred functions run eagerly inside."""


def _deferred_compile(model=None, **options):
    """torch.compile(model, **options), compiled on the first call made outside a trace."""
    import functools

    import torch

    if model is None:  # @torch.compile(options...)
        return functools.partial(_deferred_compile, **options)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kwargs):
        nonlocal compiled
        if EAGER[0]:
            return model(*args, **kwargs)
        if compiled is None:  # torch.compile is torch's again once megatron-core is imported
            compiled = torch.compile(model, **options)
        return compiled(*args, **kwargs)

    return call


# torch wraps its Python reference kernels (torch._refs, which meta tensors run) and other
# functions in torch._compile._disable_dynamo, whose first call imports torch._dynamo to wrap
# the function in torch._dynamo.disable: 0.44 s of each worker's first trace (python -X
# importtime, torch 2.13), for a wrapper that only matters while dynamo compiles, which no trace
# does. Until something else asks for it, torch._dynamo is a stand-in whose `disable` runs the
# function as it is while dynamo is not imported, and through the real disable once it is (then
# compiling treats it as before). Any other attribute imports the real module.
class _LazyDynamo(types.ModuleType):
    def __init__(self, file: str):
        super().__init__("torch._dynamo")
        self.__file__ = file  # for what walks sys.modules asking (inspect.getmodule)
        # torch.distributed.init_process_group clears trace_rules' caches when torch._dynamo
        # is in sys.modules: not filled before it is imported.
        self.trace_rules = types.SimpleNamespace(clear_lru_cache=self._clear_trace_rules)

    def _clear_trace_rules(self) -> None:
        real = imported_dynamo()
        if real is not None:
            real.trace_rules.clear_lru_cache()

    def disable(self, fn=None, recursive=True, **options):
        if fn is None:
            return functools.partial(self.disable, recursive=recursive, **options)
        real = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal real
            if sys.modules.get("torch._dynamo") is self:
                return fn(*args, **kwargs)
            if real is None:
                real = sys.modules["torch._dynamo"].disable(fn, recursive, **options)
            return real(*args, **kwargs)

        return call

    def __getattr__(self, name: str):
        if name.startswith("__") and name != "__path__":  # (a submodule's import asks __path__)
            raise AttributeError(name)
        return getattr(self._load(), name)

    def _load(self):
        import torch

        if sys.modules.get("torch._dynamo") is self:
            del sys.modules["torch._dynamo"]
            if torch.__dict__.get("_dynamo") is self:
                del torch._dynamo
        return importlib.import_module("torch._dynamo")


def imported_dynamo():
    """torch._dynamo where it is imported (not the _LazyDynamo stand-in), else None."""
    module = sys.modules.get("torch._dynamo")
    return None if isinstance(module, _LazyDynamo) else module


def _defer_dynamo() -> None:
    """Put the _LazyDynamo stand-in in place unless torch._dynamo is imported already."""
    import torch

    if "torch._dynamo" not in sys.modules and "_dynamo" not in torch.__dict__:
        lazy = _LazyDynamo(str(Path(torch.__file__).parent / "_dynamo" / "__init__.py"))
        sys.modules["torch._dynamo"] = lazy
        torch._dynamo = lazy


_CALLERS_WARNINGS = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    (
        "megatron.core.distributed.distributed_data_parallel",
        "full_param_layout not provided with use_distributed_optimizer",
    ),
)


_INFERENCE_TRITON_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


@functools.cache
def inference_triton_ops() -> None:
    """megatron-core's MambaMixer imports three Triton kernels of dynamic-batching inference at
    module level, and Triton is not installed with megatron-core 0.16.1 (nor installable on
    every machine): where it is missing, that module is one whose kernels raise if called
    (training never calls them), for the life of the process."""
    import types

    if _INFERENCE_TRITON_OPS in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    module = types.ModuleType(_INFERENCE_TRITON_OPS)

    def unavailable(*args, **kwargs):
        raise NotImplementedError("megatron-core's inference Triton kernels (not traced)")

    for name in ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge"):
        setattr(module, name, unavailable)
    sys.modules[_INFERENCE_TRITON_OPS] = module


def import_megatron_core():
    """megatron.core, imported (the first time) with torch.compile deferred (above), and
    everything alive then frozen (gc.freeze)."""
    import gc

    if "megatron.core" not in sys.modules:
        import torch

        _defer_dynamo()
        compile_now = torch.compile
        torch.compile = _deferred_compile
        try:
            import megatron.core  # noqa: F401
        finally:
            torch.compile = compile_now
        # torch's and megatron-core's modules (hundreds of thousands of objects) live as long
        # as the process: out of the collector's full passes, which otherwise took a third to
        # a half of a role's trace (forked workers inherit it). Unfrozen at exit, so that the
        # interpreter's last collection frees them: triton's bindings (megatron-core 0.19
        # imports triton) print every object still alive then as a leak.
        gc.freeze()
        atexit.register(gc.unfreeze)
        # Warnings megatron-core 0.19 addresses to the code that calls it, where metatrace
        # calls it as Megatron-LM does: GPTModel's deprecation (pretrain_gpt.py builds one), and
        # DDP computing the distributed optimizer's parameter layout itself, which Megatron-LM's
        # wrap_model_chunks_with_ddp computes beforehand from the same parameters, bucket size
        # and intra-instance group sizes (the same layout).
        for name, text in _CALLERS_WARNINGS:
            logging.getLogger(name).addFilter(lambda r, text=text: text not in r.getMessage())
    inference_triton_ops()
    return sys.modules["megatron.core"]


def installed_release() -> tuple[str, tuple[int, ...]]:
    """The installed megatron-core's version string and release numbers."""
    package_info = import_megatron_core().package_info
    return package_info.__version__, parse_release(package_info.__version__)


def release_text() -> str:
    """The installed megatron-core's release as reports name it: "0.19.2" (without the
    "+<git hash>" 0.19's package_info appends when its directory lies in a git checkout)."""
    import_megatron_core()
    return _release.version().split("+")[0]


def check_megatron_core() -> tuple[int, ...]:
    """The installed megatron-core release; ConfigError when it is not one of MEGATRON_CORE."""
    version, release = installed_release()
    if not supported(release):
        raise ConfigError(
            f"megatron-core {version} is installed; metatrace supports megatron-core "
            f"{supported_text()}, the releases its patches of megatron-core were checked against"
        )
    return release


def release() -> tuple[int, ...]:
    """The installed megatron-core's release numbers, (0, 16, 1) or (0, 19, 2), megatron-core
    imported (metatrace.config.release reads them without importing it)."""
    import_megatron_core()
    return _release.release()


def since(*numbers: int) -> bool:
    """Whether the installed megatron-core is `numbers` (a release or series) or newer: where a
    call into megatron-core differs between the supported releases, the caller asks."""
    import_megatron_core()
    return _release.since(*numbers)


class PatchError(RuntimeError):
    """A patch's target is not in the installed megatron-core (renamed or removed): metatrace
    needs updating for that release."""


# --- copies ---------------------------------------------------------------------------------

_GAP = r"\s+(?:#\s*)?"  # a mark may wrap, in a docstring or from comment line to comment line
MARK = re.compile(
    rf"(?:Restates|Copied{_GAP}from){_GAP}(megatron\.core(?:\.\w+)+){_GAP}"
    rf"\(source{_GAP}sha256:{_GAP}([0-9a-f]{{12}}(?:,{_GAP}[0-9a-f]{{12}})*)"
    rf"(?:;{_GAP}since{_GAP}(\d+\.\d+))?\)"
)
# The packages whose source may hold copies (models/ and hooks/ are installed under metatrace).
PACKAGES = ("metatrace", "metatrace.models", "metatrace.hooks")


@dataclass(frozen=True)
class Copy:
    """One mark: where it is and what it says."""

    where: str
    """file:line, the file relative to the directory metatrace/ is in (metatrace/world.py:81;
    models/specs.py:56 in a checkout)."""
    original: str
    """Dotted name of the megatron-core object, e.g. megatron.core.parallel_state.RankGenerator."""
    sha: str
    """The hashes the mark records, as written: one per release the copy was reviewed against."""
    since: tuple[int, ...] = ()
    """The series the original first appears in ("; since 0.19" in the mark): under an older
    release there is nothing to compare."""


def source_hash(obj) -> str:
    """First 12 hex digits of the sha256 of `obj`'s source (inspect.getsource, decorators
    included), dedented and each line's trailing whitespace stripped: an indentation change of
    the whole block does not count, any other change (comments and docstrings too) does."""
    text = textwrap.dedent(inspect.getsource(obj))
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def resolve(dotted: str):
    """The object a dotted name denotes: its longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"no module of {dotted} imports")


def _locations(package: str) -> list[Path]:
    return [Path(p).resolve() for p in importlib.util.find_spec(package).submodule_search_locations]


def _files() -> list[Path]:
    """The .py files of PACKAGES, each once (installed, models/ and hooks/ lie in metatrace/)."""
    seen: dict[Path, None] = {}
    for package in PACKAGES:
        for location in _locations(package):
            for path in sorted(location.rglob("*.py")):
                seen.setdefault(path.resolve())
    return list(seen)


def copies() -> list[Copy]:
    """Every mark in the source of metatrace, metatrace.models and metatrace.hooks."""
    base = _locations("metatrace")[0].parent
    found = []
    for path in _files():
        where = path.relative_to(base) if path.is_relative_to(base) else path
        text = path.read_text()
        for m in MARK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            since = _release.parse(m.group(3) or "")
            found.append(Copy(f"{where}:{line}", m.group(1), m.group(2), since))
    return found


def stale(marks: list[Copy] | None = None) -> list[str]:
    """One line per copy whose original's source hash is not the one its mark records (or whose
    original no longer exists), naming the copy, the original and both hashes."""
    problems = []
    for mark in copies() if marks is None else marks:
        if mark.since and not since(*mark.since):
            continue
        try:
            now = source_hash(resolve(mark.original))
        except (ImportError, AttributeError, OSError, TypeError) as e:
            problems.append(f"{mark.where}: {mark.original} cannot be read ({e})")
            continue
        if now not in re.findall(r"[0-9a-f]{12}", mark.sha):
            problems.append(
                f"{mark.where}: {mark.original} changed (source sha256 {mark.sha} in the mark, "
                f"{now} installed): review the copy, then record the new hash"
            )
    return problems
