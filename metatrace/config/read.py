"""Reading what the user hands over (job files, Hugging Face config.json, Megatron-LM argument
files, JSON reports): bounded in size and nesting, UTF-8 only, no duplicate keys, every problem
one `ConfigError` that quotes at most a short excerpt.

The bounds are far above any real input and far below what exhausts this process:
- `MAX_TEXT_BYTES` (16 MiB) for job files, configs and argument files, which are kilobytes;
  `MAX_REPORT_BYTES` (1 GiB) for a JSON report of `metatrace run --json` (tens of MB at 16k GPUs);
- `MAX_DEPTH` (64) levels of nesting: a job file has three;
- `MAX_NODES` (1,000,000) values once YAML aliases are expanded, so that nine lines of aliases
  that expand to a billion values (a "billion laughs" file) are refused in milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from metatrace.errors import ConfigError

MAX_TEXT_BYTES = 16 << 20
MAX_REPORT_BYTES = 1 << 30
MAX_DEPTH = 64
MAX_NODES = 1_000_000
EXCERPT = 60


def excerpt(value: Any) -> str:
    """`repr(value)`, cut to a short excerpt for a message."""
    text = repr(value)
    return text if len(text) <= EXCERPT else text[: EXCERPT - 1] + "…"


def read_text(path: str | Path, what: str, limit: int = MAX_TEXT_BYTES) -> str:
    """The text of `path` (`what` names it in messages): at most `limit` bytes (a device or pipe
    that never ends is not read to its end), UTF-8 with or without a byte-order mark."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise ConfigError(f"{path}: larger than {limit >> 20} MiB; not a {what}")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{path}: UTF-16 text; save the {what} as UTF-8")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); "
            f"save the {what} as UTF-8"
        ) from None
    if "\x00" in text:
        raise ConfigError(f"{path}: binary data (a NUL byte); not a {what}")
    return text


def parse_yaml(text: str, source: str) -> Any:
    """YAML (safe subset) with duplicate keys refused and bounded nesting and size."""
    import yaml

    try:
        data = yaml.load(text, Loader=_loader())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"{source}: not valid YAML{line}: {getattr(e, 'problem', e)}") from None
    check_shape(data, source)  # nesting is bounded while composing (_loader)
    return data


def parse_json(text: str, source: str) -> Any:
    """JSON with duplicate keys and NaN/Infinity refused, and bounded nesting."""

    def pairs(items):
        out = {}
        for key, value in items:
            if key in out:
                raise ConfigError(f"{source}: key {excerpt(key)} given twice")
            out[key] = value
        return out

    def constant(name):
        raise ConfigError(f"{source}: {name} is not a JSON number")

    try:
        data = json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON (line {e.lineno}): {e.msg}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested more than {MAX_DEPTH} levels deep") from None
    check_shape(data, source)
    return data


def check_shape(data: Any, source: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH and more than MAX_NODES values (aliases counted as
    often as they are used), without walking more than that."""
    count = 0
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise ConfigError(f"{source}: more than {MAX_NODES:,} values (YAML aliases expanded)")
        if depth > MAX_DEPTH:
            raise ConfigError(f"{source}: nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _loader():
    """A SafeLoader that refuses a key given twice in one mapping and nesting beyond MAX_DEPTH
    while composing (before Python's recursion limit)."""
    import yaml

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(
                    f"nested more than {MAX_DEPTH} levels deep (line {mark.line + 1})"
                )
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *anchor` merges; flatten_mapping handles it
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                except TypeError:  # an unhashable key; construct_mapping names it
                    break
                if dup:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {excerpt(key)} given twice",
                        key_node.start_mark,
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return Loader
