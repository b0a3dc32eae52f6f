"""The fields of megatron-core's config dataclasses that one release adds to another's.

    python bench/megatron_fields.py OLD_ROOT NEW_ROOT

OLD_ROOT and NEW_ROOT hold a `megatron/core` each (site-packages for the installed 0.16.1,
/tmp/mc19/src for 0.19.2's unpacked wheel). The sources are parsed, not imported (0.19.2 needs
Python 3.12): a class's fields are its annotated class-body names that are not ClassVar, with
those of its bases in the same file set (ModelParallelConfig for TransformerConfig), as
dataclasses.fields would list them. Prints config, field, annotation and default of every field
NEW_ROOT has and OLD_ROOT has not, one a line (tab-separated); metatrace/config/megatron/fields.py
classifies those of 0.19.2.
"""

from __future__ import annotations

import ast
import os
import sys

CONFIGS = {
    "TransformerConfig": "megatron/core/transformer/transformer_config.py",
    "ModelParallelConfig": "megatron/core/model_parallel_config.py",
    "OptimizerConfig": "megatron/core/optimizer/optimizer_config.py",
    "DistributedDataParallelConfig": "megatron/core/distributed/distributed_data_parallel_config.py",
}


def _classes(root: str) -> dict[str, ast.ClassDef]:
    out = {}
    for path in set(CONFIGS.values()):
        tree = ast.parse(open(os.path.join(root, path)).read())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, node)
    return out


def fields(root: str, name: str) -> dict[str, tuple[str, str]]:
    """Field -> (annotation, default) of class `name`, its bases' first (the dataclass order)."""
    classes = _classes(root)
    node = classes[name]
    out: dict[str, tuple[str, str]] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out.update(fields(root, base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            annotation = ast.unparse(stmt.annotation)
            if annotation.startswith(("ClassVar", "typing.ClassVar")):
                continue
            default = ast.unparse(stmt.value) if stmt.value is not None else ""
            out[stmt.target.id] = (annotation, " ".join(default.split())[:80])
    return out


def new_fields(old_root: str, new_root: str) -> list[tuple[str, str, str, str]]:
    rows = []
    for name in ("TransformerConfig", "OptimizerConfig", "DistributedDataParallelConfig"):
        old = fields(old_root, name)
        for field, (annotation, default) in fields(new_root, name).items():
            if field not in old:
                rows.append((name, field, annotation, default))
    return rows


def main(argv: list[str]) -> int:
    old_root, new_root = argv
    for row in new_fields(old_root, new_root):
        print("\t".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
