"""The difference between two traced jobs, from their JSON reports (pure functions, no torch).

`diff_reports(a, b)` compares two `metatrace.export.report.job_report` dicts (freshly traced or read
from `--json` files) and returns plain data:

- `config`: the configuration keys whose resolved values differ (model, parallel, training,
  implementation, cluster, the derived world), first;
- `cluster`: the cluster's figures side by side (verdict, highest peak, headroom, parameters,
  communication per dimension over all GPUs);
- `roles`: pairs of pipeline-stage roles with their memory and communication figures, and the
  modules whose parameter shapes, saved activations or collectives differ;
- `changes`: one entry per changed key or figure (empty when nothing differs).

Every figure row holds both values, `delta` (b - a) and `percent` (of a) for numbers, and which
direction is better, so the renderer can colour it and a script can read it.

Roles are paired by the layers they hold: when both jobs have the same pipeline stages and
layers, stage by stage; otherwise every role of the job with more stages is paired with the role
of the other that holds most of its layers (the first and last stages, which hold the embedding
and the loss, with each other when no layer decides), so a role of the job with fewer stages
may appear in several pairs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import TypeGuard

from metatrace.analysis.comm import module_pattern

DIFF_SCHEMA_VERSION = 1

CONFIG_SECTIONS = ("model", "parallel", "training", "implementation", "cluster", "world")
# Not configuration: the cluster's traffic (under `cluster` in the report) and the parameter
# counts (compared as figures).
_NOT_CONFIG = {("cluster", "comm"), ("model", "total_params"), ("model", "active_params")}

# (path in a role's report, label, better): "lower" or "higher" is better, None: neither.
ROLE_FIGURES = (
    ("params.count", "parameters", None),
    ("activations_per_microbatch_bytes", "activations per micro-batch", "lower"),
    ("memory.params_bytes", "memory: parameters", "lower"),
    ("memory.grads_bytes", "memory: gradients", "lower"),
    ("memory.optimizer_bytes", "memory: optimizer", "lower"),
    ("memory.workspace_bytes", "memory: workspaces", "lower"),
    ("memory.activations_bytes", "memory: activations", "lower"),
    ("memory.inflight_microbatches", "micro-batches in flight", "lower"),
    ("memory.temporary_bytes", "memory: temporary", "lower"),
    ("memory.peak_bytes", "peak", "lower"),
    ("memory.peak_at", "peaks in", None),
    ("timing.iteration_seconds", "estimated iteration time", "lower"),
    ("timing.bubble_fraction", "pipeline bubble", "lower"),
)
COMM_FIGURES = (
    ("count", "calls", "lower"),
    ("bytes_sent", "sent", "lower"),
    ("intra_node_bytes", "inside nodes", "lower"),
    ("inter_node_bytes", "across nodes", "lower"),
    ("seconds", "time", "lower"),
    ("exposed_seconds", "exposed", "lower"),
)
CLUSTER_FIGURES = (
    ("memory_verdict.fits", "fits", "higher"),
    ("memory_verdict.highest_peak_bytes", "highest peak", "lower"),
    ("memory_verdict.device_bytes", "device memory (tightest rank)", "lower"),
    ("memory_verdict.allocator_reserve_bytes", "its allocator reserve", "lower"),
    ("memory_verdict.outside_allocator_bytes", "its memory outside the allocator", "lower"),
    ("memory_verdict.headroom_bytes", "headroom", "higher"),
    ("memory_verdict.out_of_memory_ranks", "ranks out of memory", "lower"),
    ("model.total_params", "parameters", None),
    ("model.active_params", "active parameters", None),
    ("world.num_microbatches", "micro-batches per iteration", None),
    ("timing.iteration_seconds", "estimated iteration time", "lower"),
    ("timing.bubble_fraction", "pipeline bubble", "lower"),
)
_MISSING = object()


def diff_reports(a: dict, b: dict, labels: tuple[str, str] | None = None) -> dict:
    """The difference b - a of two JSON reports (see the module docstring); `labels`: how the
    user gave each side (default: the job each report came from)."""
    config = config_changes(a, b)
    cluster = cluster_rows(a, b)
    roles = [role_diff(a["roles"][i], b["roles"][j]) for i, j in pair_roles(a["roles"], b["roles"])]
    changes = [{"path": f"config.{c['key']}", "a": c["a"], "b": c["b"]} for c in config]
    changes += [_change("cluster", row) for row in cluster if row["changed"]]
    for pair in roles:
        where = f"roles[{pair['label']}]"
        changes += [_change(where, row) for row in pair["figures"] if row["changed"]]
        for mod in pair["modules"]:
            changes.append(
                {"path": f"{where}.modules.{mod['module']}", "a": mod["a"], "b": mod["b"]}
            )
    return {
        "diff_schema_version": DIFF_SCHEMA_VERSION,
        "a": _side(a, labels[0] if labels else None),
        "b": _side(b, labels[1] if labels else None),
        "config": config,
        "cluster": cluster,
        "roles": roles,
        "changes": changes,
    }


def _side(report: dict, label: str | None) -> dict:
    return {
        "label": label if label is not None else str(report.get("source")),
        "source": report.get("source"),
        "metatrace_version": report.get("metatrace_version"),
        "schema_version": report.get("schema_version"),
    }


def _change(where: str, row: dict) -> dict:
    out = {"path": f"{where}.{row['figure']}", "a": row["a"], "b": row["b"]}
    if "delta" in row:
        out["delta"] = row["delta"]
    return out


# ----------------------------------------------------------------------------- configuration


def _flatten(value, prefix: str, out: dict) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else k, out)
    else:
        out[prefix] = value


def config_changes(a: dict, b: dict) -> list[dict]:
    """Resolved configuration keys whose values differ, in section order."""
    out = []
    for section in CONFIG_SECTIONS:
        flat_a: dict = {}
        flat_b: dict = {}
        for report, flat in ((a, flat_a), (b, flat_b)):
            values = {
                k: v
                for k, v in report.get(section, {}).items()
                if (section, k) not in _NOT_CONFIG
                # world repeats parallel's and cluster's sizes; only its derived ones count
                and not (section == "world" and (k in report["parallel"] or k in report["cluster"]))
            }
            _flatten(values, section, flat)
        for key in list(flat_a) + [k for k in flat_b if k not in flat_a]:
            va, vb = flat_a.get(key), flat_b.get(key)
            if va != vb:
                out.append({"key": key, "a": va, "b": vb})
    for key in ("moe_routing", "megatron_core"):
        if a.get(key) != b.get(key):
            out.append({"key": key, "a": a.get(key), "b": b.get(key)})
    return out


# ----------------------------------------------------------------------------- figures


def _get(data: dict, path: str):
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return _MISSING
        data = data[part]
    return data


def _value(path: str, value):
    """A figure as compared and shown: where a rank peaks as one phrase, rank lists as counts."""
    if path.endswith("peak_at") and isinstance(value, dict):
        where = value["phase"]
        if value.get("microbatch") is not None:
            where += f" µb {value['microbatch']}"
        return f"{where}, {value.get('module') or 'model'}"
    if path.endswith("out_of_memory_ranks") and isinstance(value, list):
        return len(value)
    return value


def _number(value) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def figure_row(a: dict, b: dict, path: str, label: str, better, figure: str | None = None):
    """A row comparing `path` in two reports; None when neither report has the figure."""
    va, vb = _get(a, path), _get(b, path)
    if va is _MISSING and vb is _MISSING:
        return None
    va = None if va is _MISSING else _value(path, va)
    vb = None if vb is _MISSING else _value(path, vb)
    row = {
        "figure": figure or path,
        "label": label,
        "a": va,
        "b": vb,
        "better": better,
        "changed": va != vb,
    }
    if _number(va) and _number(vb):
        row["delta"] = vb - va
        row["percent"] = (vb - va) / va * 100 if va else None
    return row


def _rows(a: dict, b: dict, figures, prefix: str = "") -> list[dict]:
    rows = []
    for path, label, better in figures:
        row = figure_row(a, b, prefix + path, label, better)
        if row is not None:
            rows.append(row)
    return rows


def comm_rows(a: dict, b: dict, prefix: str) -> list[dict]:
    """Per dimension with traffic on either side: calls, bytes, time (prefix `comm.` or
    `cluster.comm.`)."""
    dims: list[str] = []
    for report in (a, b):
        got = _get(report, prefix.rstrip("."))
        if got is not _MISSING:
            dims += [d for d in got if d not in dims]
    rows = []
    for dim in dims:
        counts = [_get(r, f"{prefix}{dim}.count") for r in (a, b)]
        if not any(c not in (_MISSING, 0) for c in counts):
            continue
        for key, label, better in COMM_FIGURES:
            row = figure_row(a, b, f"{prefix}{dim}.{key}", f"{dim}: {label}", better)
            if row is not None:
                rows.append(row)
    return rows


def cluster_rows(a: dict, b: dict) -> list[dict]:
    return _rows(a, b, CLUSTER_FIGURES) + comm_rows(a, b, "cluster.comm.")


# ----------------------------------------------------------------------------- roles


def pair_roles(roles_a: list[dict], roles_b: list[dict]) -> list[tuple[int, int]]:
    """(index in a, index in b) pairs; see the module docstring."""
    if [r["layers"] for r in roles_a] == [r["layers"] for r in roles_b]:
        return [(i, i) for i in range(len(roles_a))]
    flip = len(roles_a) < len(roles_b)
    many, few = (roles_b, roles_a) if flip else (roles_a, roles_b)
    pairs = []
    for i, role in enumerate(many):
        layers = set(role["layers"])
        position = i / max(1, len(many) - 1)

        def score(j, i=i, layers=layers, position=position):
            other = few[j]
            ends = (i == 0) == (j == 0) and (i == len(many) - 1) == (j == len(few) - 1)
            near = -abs(position - j / max(1, len(few) - 1))
            return (len(layers & set(other["layers"])), ends, near)

        j = max(range(len(few)), key=score)
        pairs.append((j, i) if flip else (i, j))
    return pairs


def role_label(a: dict, b: dict) -> str:
    sa, sb = a["pp_stage"], b["pp_stage"]
    return f"stage {sa}" if sa == sb else f"stage {sa}/{sb}"


def role_diff(a: dict, b: dict) -> dict:
    figures = (
        [figure_row(a, b, "layers", "layers", None)]
        + _rows(a, b, ROLE_FIGURES)
        + comm_rows(a, b, "comm.")
    )
    return {
        "label": role_label(a, b),
        "a": {k: a[k] for k in ("index", "pp_stage", "ranks", "layers")},
        "b": {k: b[k] for k in ("index", "pp_stage", "ranks", "layers")},
        "figures": figures,
        "modules": module_changes(a, b),
    }


def module_summary(role: dict) -> dict[str, dict]:
    """Per module pattern (`decoder.layers.*.mlp`: one entry for all layers): type, parameter
    shapes, distinct saved-activation sizes, and collectives per occurrence per micro-batch."""
    seen: dict[str, dict] = {}
    occurrences: Counter = Counter()
    for mod in role["modules"]:
        pattern, _ = module_pattern(mod["fqn"])
        occurrences[pattern] += 1
        entry = seen.setdefault(
            pattern,
            {"type": mod["type"], "param_shapes": mod["param_shapes"], "activation_bytes": set()},
        )
        entry["activation_bytes"].add(mod["activation_bytes"])
    calls: dict[str, Counter] = defaultdict(Counter)
    for c in role["collectives_per_microbatch"]:
        pattern, _ = module_pattern(c["module"])
        dims = ",".join(str(d) for d in c["shape"])
        calls[pattern][f"{c['phase']} {c['op']} {c['group']} [{dims}] {c['dtype']}"] += 1
    for pattern, counter in calls.items():
        entry = seen.setdefault(pattern, {"type": "", "param_shapes": {}, "activation_bytes": {0}})
        n = max(1, occurrences[pattern])
        entry["collectives"] = {k: v / n if v % n else v // n for k, v in sorted(counter.items())}
    for entry in seen.values():
        entry["activation_bytes"] = sorted(entry["activation_bytes"])
        entry.setdefault("collectives", {})
    return seen


def module_changes(a: dict, b: dict) -> list[dict]:
    """Modules (by pattern) present on one side only, or with different parameter shapes,
    saved activations or collectives, in the order of a's tree then b's."""
    sa, sb = module_summary(a), module_summary(b)
    out = []
    for pattern in list(sa) + [p for p in sb if p not in sa]:
        ma, mb = sa.get(pattern), sb.get(pattern)
        if ma != mb:
            out.append({"module": pattern, "a": ma, "b": mb})
    return out
