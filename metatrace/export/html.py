"""The report as one self-contained HTML page (`metatrace run --html PATH`).

`page(report, timelines)` is a pure function of the JSON report (`metatrace.export.report.job_report`,
with `max_micro_batch` when --max-mbs ran) and, for the pictures of memory over the iteration,
each role's `RoleMemory.timeline` (not part of the JSON report). Nothing is computed here that
the report does not hold: sizes are formatted with the terminal's helpers (metatrace.render),
the module trees are the report's rows put back in their tree and folded as the terminal folds
them, the charts are drawn in metatrace.export.svg. The page needs no network: inline CSS,
inline SVG, no script (the trees collapse with <details>). Every text from the report goes
through html.escape. It fits a 700-pixel window: the charts shrink, wide tables scroll inside
their own box.

Known limitations: the trees leave out the TP communication column the terminal has (the
collectives are listed per stage instead); timelines longer than 600 steps are drawn as 600
columns, each the highest level of its steps, as the terminal does.
"""

from __future__ import annotations

import html
from types import SimpleNamespace

from metatrace.analysis import aggregate as agg
from metatrace.analysis.timing import Breakdown, describe_rates
from metatrace.export import svg
from metatrace.export.svg import MIXED, PARTS, PHASE_COLOURS
from metatrace.records import Collective
from metatrace.render.format import (
    DIM_TITLES,
    DTYPE_SHORT,
    compact,
    layer_span,
    mib,
    peak_at,
    rank_span,
    seconds,
    size,
    volume,
    where_it_goes,
)
from metatrace.render.format import op as op_name
from metatrace.render.run import param_shapes

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
       max-width: 1100px; margin: 2em auto; padding: 0 1em; overflow-wrap: anywhere; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
h3 { font-size: 1em; margin-top: 1.5em; }
.scroll { overflow-x: auto; max-width: 100%; }
table { border-collapse: collapse; margin: .5em 0; }
th, td { padding: 2px 8px; border-bottom: 1px solid #e4e4e4; text-align: left;
         vertical-align: top; }
th { background: #f4f4f4; overflow-wrap: normal; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.zero td { color: #999; } tr.total td { font-weight: bold; }
dl.config { display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 2px 16px; }
dl.config dt { font-weight: bold; } dl.config dd { margin: 0; }
.verdict { padding: .6em 1em; border-radius: 4px; font-weight: bold; }
.fits { background: #e6f4e6; color: #1b5e20; } .oom { background: #fde8e8; color: #b71c1c; }
.caveat { background: #fff4e0; color: #7a4b00; font-weight: normal; }
.timing { padding: .6em 1em; border-radius: 4px; background: #eef3fa; color: #1a3d6d; }
.note { color: #666; font-size: .9em; } .key { display: inline-block; width: .9em;
  height: .9em; margin: 0 .3em 0 1em; vertical-align: -1px; }
svg { display: block; width: 100%; max-width: 960px; height: auto; margin: .3em 0; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
svg text.tick, svg text.axis { fill: #666; } svg text.capacity, svg text.peak { fill: #b71c1c; }
.tree { margin: .3em 0 1em; font-size: .95em; max-width: 900px; }
.tree .row, .tree summary { display: flex; flex-wrap: wrap; gap: 0 .6em; padding: 1px 0;
  border-bottom: 1px solid #f0f0f0; }
.tree summary { cursor: pointer; list-style: none; }
.tree summary::-webkit-details-marker { display: none; }
.tree summary::before, .tree .row::before { content: "▸"; width: .8em; color: #888; }
.tree details[open] > summary::before { content: "▾"; } .tree .row::before { content: ""; }
.tree .kids { margin-left: .5em; padding-left: .6em; border-left: 1px solid #ddd; }
.tree .name { font-weight: 600; } .tree .type { color: #777; }
.tree .figs { margin-left: auto; display: flex; gap: .8em; font-variant-numeric: tabular-nums; }
.tree .fig { min-width: 6.5em; text-align: right; white-space: nowrap; }
.tree .shapes { flex-basis: 100%; padding-left: 1.4em; color: #777; font-size: .9em; }
.tree .head { font-weight: bold; background: #f4f4f4; }
@media (max-width: 760px) {
  body { margin: 1em auto; padding: 0 .6em; font-size: 13px; }
  table { font-size: 12px; } th, td { padding: 2px 4px; } .tree .fig { min-width: 5.5em; }
  dl.config { grid-template-columns: minmax(0, 1fr); } dl.config dd { margin-bottom: .3em; }
}
"""


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def _table(head, rows, numeric=(), classes=None) -> str:
    """A table: `head` column titles, `rows` of cells (escaped here); columns whose index is in
    `numeric` are right-aligned; `classes[i]` is row i's class."""
    out = ['<div class="scroll"><table><thead><tr>']
    out += [f"<th{' class=n' if i in numeric else ''}>{esc(h)}</th>" for i, h in enumerate(head)]
    out.append("</tr></thead><tbody>")
    for i, row in enumerate(rows):
        cls = f' class="{esc(classes[i])}"' if classes and classes[i] else ""
        cells = "".join(
            f"<td{' class=n' if j in numeric else ''}>{esc(c)}</td>" for j, c in enumerate(row)
        )
        out.append(f"<tr{cls}>{cells}</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _key(colour: str, label: str) -> str:
    return f'<span class="key" style="background:{colour}"></span>{esc(label)}'


# ----------------------------------------------------------------------------- configuration


def _model_line(report) -> str:
    m = report["model"]
    name = f"{m['preset']}: " if m.get("preset") else ""
    heads = m["num_attention_heads"]
    if m.get("multi_latent_attention"):
        attention = f"multi-latent, kv rank {m['kv_lora_rank']}"
    elif m.get("num_query_groups") not in (None, heads):
        attention = f"{m['num_query_groups']} query groups, head dim {m['kv_channels']}"
    else:
        attention = f"multi-head, head dim {m['kv_channels']}"
    active = (
        f" ({m['active_params']:,} active per token)"
        if m["active_params"] != m["total_params"]
        else ""
    )
    return (
        f"{name}{m['num_layers']} layers, hidden {m['hidden_size']}, ffn {m['ffn_hidden_size']}, "
        f"{heads} heads ({attention}), vocab {m['vocab_size']} (padded "
        f"{m['padded_vocab_size']}), {m['normalization']}, {m['activation']}, "
        f"{m['position_embedding_type']} positions; {m['total_params']:,} parameters{active}"
    )


def _config_rows(report) -> list[tuple[str, str]]:
    w, par, tr, cl = report["world"], report["parallel"], report["training"], report["cluster"]
    impl = report["implementation"]
    rows = [("model", _model_line(report))]
    if report["model"].get("num_experts"):
        m = report["model"]
        rows.append(
            (
                "experts",
                f"{m['num_experts']} experts, top-{m['moe_router_topk']}, "
                f"expert ffn {m['moe_ffn_hidden_size']}; routing assumed "
                f"{report.get('moe_routing', '?')}",
            )
        )
    vpp = f" (vpp {w['vpp']})" if w.get("vpp") else ""
    experts = (
        f" · etp {w['etp']} · expert dp {w['expert_dp']}"
        if report["model"].get("num_experts")
        else ""
    )
    rows.append(
        (
            "parallel",
            f"tp {w['tp']} · pp {w['pp']}{vpp} · cp {w['cp']} · dp {w['dp']} "
            f"· ep {w['ep']}{experts} · sequence parallel "
            f"{'on' if par.get('sequence_parallel') else 'off'} · rank order "
            f"{w['rank_order']}",
        )
    )
    rec = (tr.get("recompute") or {}).get("granularity")
    rows.append(
        (
            "training",
            f"seq {tr['seq_length']} · micro-batch {tr['micro_batch_size']} · "
            f"global batch {tr['global_batch_size']} ({w['num_microbatches']} "
            f"micro-batches per iteration) · {tr['precision']} · "
            f"{f'{rec} recompute' if rec else 'no recompute'}"
            + (" · distributed optimizer" if tr.get("distributed_optimizer") else ""),
        )
    )
    nodes = -(-w["num_gpus"] // w["gpus_per_node"])
    rows.append(
        (
            "cluster",
            f"{w['num_gpus']} GPUs, {w['gpus_per_node']} per node ({nodes} "
            f"node{'s' * (nodes > 1)}), {cl['gpu']} {cl['gpu_memory_gib']:g} GiB, "
            f"{cl['reserved_overhead_gib']:g} GiB reserved overhead",
        )
    )
    rows.append(
        ("implementation", f"{impl['transformer_impl']} · attention {impl['attention_backend']}")
    )
    rows += [("note", note) for note in report.get("notes", ())]
    return rows


def _configuration(report) -> str:
    items = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in _config_rows(report))
    return f'<h2>Configuration</h2><dl class="config">{items}</dl>'


def _verdict(report) -> str:
    v = report.get("memory_verdict")
    if v is None:
        return '<p class="note">No iteration was traced: no memory verdict.</p>'
    cl = report["cluster"]
    from metatrace.render.format import verdict_text

    text = verdict_text(f"{cl['gpu']} ({cl['gpu_memory_gib']:g} GiB)", v)
    out = f'<p class="verdict {"fits" if v["fits"] else "oom"}">{esc(text)}</p>'
    if v.get("not_modelled"):
        from metatrace.analysis.memory import not_modelled_text

        out += f'<p class="verdict caveat">{esc(not_modelled_text(v["not_modelled"]))}</p>'
    return out + _advice(report)


def _advice(report) -> str:
    """The changes that make the job fit (the report's `advice`), as the terminal lists them
    under the verdict: each traced with its peak, headroom, step time and the step's change."""
    advice, v = report.get("advice"), report.get("memory_verdict")
    if not advice or v is None:
        return ""
    from metatrace.render.advice import signed_size, step_delta
    from metatrace.render.format import seconds, size

    now = advice["iteration_seconds"]
    goal = "fit" if not v["fits"] else "fit beyond the prediction's error band"
    step = f"; the step now {seconds(now)}" if now is not None else ""
    out = f"<h3>To make it {goal}, change one thing (each traced{step})</h3>"
    if not advice["changes"]:
        return out + '<p class="note">No single change found that fits.</p>'
    rows = [
        [
            c["change"],
            size(c["highest_peak_bytes"]),
            signed_size(c["headroom_bytes"]) + (" *" if c["within_error_band"] else ""),
            seconds(c["iteration_seconds"]) if c["iteration_seconds"] is not None else "-",
            step_delta(c, now),
        ]
        for c in advice["changes"]
    ]
    out += _table(["Change", "Peak", "Headroom", "Step", "Step Δ"], rows, numeric=(1, 2, 3, 4))
    if any(c["within_error_band"] for c in advice["changes"]):
        out += '<p class="note">*: within the prediction\'s error band; listed last.</p>'
    if advice["misses"]:
        missed = "; ".join(
            f"{c['change']} (short by {size(-c['headroom_bytes'])})" for c in advice["misses"]
        )
        out += f'<p class="note">Traced, still out of memory: {esc(missed)}.</p>'
    return out


# ----------------------------------------------------------------------------- time


def _schedule(world) -> str:
    if world["pp"] == 1:
        return "no pipeline"
    return f"interleaved 1F1B, vpp {world['vpp']}" if world.get("vpp") else "1F1B"


def timing(report) -> str:
    """The time model's iteration time and pipeline bubble, and each stage's share."""
    t = report.get("timing")
    if t is None:
        return ""
    line = (
        f"Estimated iteration time {seconds(t['iteration_seconds'])} "
        f"({describe_rates(t['compute_efficiency'], t['peak_tflops'])}, exposed "
        f"communication included, {_schedule(report['world'])}), pipeline bubble "
        f"{t['bubble_fraction']:.1%}"
    )
    rows = [
        [
            r["pp_stage"],
            seconds(r["timing"]["iteration_seconds"]),
            seconds(r["timing"]["busy_seconds"]),
            seconds(r["timing"]["optimizer_seconds"]),
            f"{r['timing']['bubble_fraction']:.1%}",
            f"{r['timing']['flops_per_microbatch'] / 1e12:,.1f}",
        ]
        for r in report["roles"]
        if "timing" in r
    ]
    head = ["Stage", "Iteration", "Busy", "Optimizer", "Bubble", "TFLOP/µb"]
    b = t.get("breakdown")  # absent from reports written before it
    where = ""
    if b:
        parts = where_it_goes(
            Breakdown.from_json(b), t["iteration_seconds"], report["world"]["pp"] > 1
        )
        where = f"<br>{esc(parts)}"
    return (
        f'<p class="timing" id="timing"><b>{esc(line)}</b>{where}</p>'
        + _table(head, rows, numeric=set(range(6)))
        + '<p class="note">Per stage: Busy, the forward and backward steps with their exposed '
        "communication; Bubble, the stage's idle share of the forward-backward part; "
        "TFLOP/µb, the compute of one micro-batch.</p>"
    )


# ----------------------------------------------------------------------------- memory


def memory_bars(report) -> str:
    """The stacked bars of every stage's peak on one axis, capacity lines labelled, and their
    key."""
    roles = [r for r in report["roles"] if "memory" in r]
    v = report["memory_verdict"]
    capacity = v["gpu_memory_bytes"]
    usable = capacity - v["reserved_overhead_bytes"] - v["outside_allocator_bytes"]
    chart, on_scale = svg.memory_bars(roles, capacity, usable)
    keys = "".join(_key(colour, label) for _, label, _, colour in PARTS)
    note = (
        ""
        if on_scale
        else (
            f" GPU capacity {size(capacity)} (less what lives outside the allocator: "
            f"{size(usable)}) lies beyond the scale."
        )
    )
    return chart + f'<p class="note">{keys}.{esc(note)}</p>'


def _memory_table(report) -> str:
    rows = []
    for r in report["roles"]:
        m = r["memory"]
        at = peak_at(SimpleNamespace(**m["peak_at"]), r["vpp_chunks"])
        rows.append(
            [r["pp_stage"], rank_span(r["ranks"])]
            + [size(m[key]) for key, *_ in PARTS[:5]]
            + [m["inflight_microbatches"], size(m["temporary_bytes"]), size(m["peak_bytes"]), at]
        )
    head = (
        ["Stage", "Ranks"]
        + [label for _, label, *_ in PARTS[:5]]
        + ["µb", "Temp", "Peak", "Peak at"]
    )
    legend = "; ".join(f"{label}: {text}" for _, label, text, _ in PARTS)
    return (
        _table(head, rows, numeric={0, 2, 3, 4, 5, 6, 7, 8, 9})
        + f'<p class="note">Per GPU. {esc(legend)}; µb: micro-batches in flight at the '
        "peak. Peak: the highest torch.cuda.max_memory_allocated() expected.</p>"
    )


def _timelines(report, timelines) -> str:
    roles = report["roles"]
    if timelines is None or len(timelines) != len(roles) or not all(timelines):
        return '<p class="note">The steps of the iteration are not in the JSON report.</p>'
    # One scale for every stage, so that the charts compare as the bars above do.
    top = max(
        max(r["memory"]["peak_bytes"], *(b for _, b in steps)) for r, steps in zip(roles, timelines)
    )
    out = []
    for r, steps in zip(roles, timelines):
        peak = r["memory"]["peak_bytes"]
        out.append(
            f"<h3>Stage {esc(r['pp_stage'])} · peak {esc(size(peak))} · {len(steps):,} steps</h3>"
        )
        out.append(svg.timeline_chart(r["pp_stage"], peak, steps, top))
    keys = "".join(_key(c, p) for p, c in PHASE_COLOURS.items()) + _key(MIXED, "mixed")
    return "".join(out) + (
        f'<p class="note">{keys}. Each step is the highest live memory of a chunk\'s forward '
        "or backward step of one micro-batch, in schedule order, then the optimizer step; "
        "workspaces included. Every chart has the same scale, from 0 to above the highest "
        "level of all stages.</p>"
    )


def _memory(report, timelines) -> str:
    if not all("memory" in r for r in report["roles"]):
        return ""
    w = report["world"]
    return (
        f"<h2>Memory per GPU over one training iteration ({w['num_microbatches']} "
        "micro-batches and the optimizer step)</h2>"
        + memory_bars(report)
        + _memory_table(report)
        + "<h2>Memory over the iteration</h2>"
        + _timelines(report, timelines)
    )


# ----------------------------------------------------------------------------- communication

_COMM_HEAD = [
    "Dimension",
    "Calls",
    "Sent",
    "Share",
    "Inside nodes",
    "Across nodes",
    "Time/GPU",
    "Exposed",
]


def _comm_row(title: str, t: dict, total_sent: int) -> list:
    share = f"{t['bytes_sent'] / total_sent:.1%}" if total_sent else ""
    return [
        title,
        f"{t['count']:,}",
        volume(t["bytes_sent"]),
        share,
        volume(t["intra_node_bytes"]),
        volume(t["inter_node_bytes"]),
        seconds(t["seconds"]),
        seconds(t["exposed_seconds"]),
    ]


def comm_table(report) -> str:
    """The cluster's communication per dimension for one iteration (every dimension, the
    ones without traffic greyed), and the total."""
    comm = report["cluster"].get("comm")
    if comm is None:
        return ""
    total = comm["total"]
    rows, classes = [], []
    for dim, t in comm.items():
        if dim == "total":
            continue
        rows.append(_comm_row(DIM_TITLES.get(dim, dim), t, total["bytes_sent"]))
        classes.append("" if t["count"] else "zero")
    rows.append(_comm_row("Total", total, total["bytes_sent"]))
    rows[-1][3] = "100%" if total["bytes_sent"] else ""
    classes.append("total")
    cl = report["cluster"]
    return (
        "<h2>Communication per iteration</h2>"
        + _table(_COMM_HEAD, rows, numeric=set(range(1, 8)), classes=classes)
        + '<p class="note">Calls and bytes sent, summed over all GPUs for one iteration. '
        "Time/GPU: the slowest GPU's estimated wire time per iteration; Exposed: of it, what "
        "Megatron does not overlap with compute. Assumed: NCCL's ring algorithm, one link per "
        f"GPU at {esc(format(cl['intra_node_gbps'], 'g'))} Gb/s inside a node and "
        f"{esc(format(cl['inter_node_gbps'], 'g'))} Gb/s across nodes; latency, congestion and "
        "in-network reduction ignored.</p>"
    )


# ----------------------------------------------------------------------------- module trees


def module_roots(role) -> list[agg.ModuleRow]:
    """A role's module trees rebuilt from its report's rows (listed parents first), each with
    the collectives it issued, so that identical layers fold as they do in the terminal."""
    issued: dict[str, list[Collective]] = {}
    for i, c in enumerate(role.get("collectives_per_microbatch", ())):
        issued.setdefault(c["module"], []).append(
            Collective(
                seq=i,
                op=c["op"],
                aten=c["aten"],
                group=c["group"],
                ranks=tuple(c["ranks"]),
                shape=tuple(c["shape"]),
                dtype=c["dtype"],
                bytes=c["bytes"],
                count=c["count"],
                phase=c["phase"],
                module=c["module"],
                peer=c.get("peer"),
            )
        )
    rows: dict[str, agg.ModuleRow] = {}
    roots = []
    for m in role.get("modules", ()):
        row = agg.ModuleRow(
            fqn=m["fqn"],
            type=m["type"],
            layer=m["layer"],
            params=m["params"],
            param_bytes=m["param_bytes"],
            param_shapes=tuple((name, tuple(d)) for name, d in m["param_shapes"].items()),
            activation_bytes=m["activation_bytes"],
            collectives=tuple(issued.get(m["fqn"], ())),
            peaks=dict(m["peak_bytes"]),
            params_total=m["params_total"],
            param_bytes_total=m.get("param_bytes_total", 0),
            activation_bytes_total=m["activation_bytes_total"],
        )
        rows[row.fqn] = row
        parent = agg.parent_of(row.fqn)
        if parent in rows:
            rows[parent].children.append(row)
        else:
            roots.append(row)
    return roots


def _idle(row: agg.ModuleRow) -> bool:
    """megatron-core's IdentityOp / IdentityFuncOp slots that hold and do nothing: left out,
    as the terminal leaves them out without --expand."""
    return (
        row.type.startswith("Identity")
        and not row.params_total
        and not row.activation_bytes_total
        and not any(r.collectives for r in agg.walk([row]))
    )


OPEN_LEVELS = 3
"""Tree levels shown open: the model, its blocks and the list of layers; the layers closed."""


def _node(fold: agg.Fold, label: str, level: int) -> str:
    row = fold.row
    line = (
        f'<span class="name">{esc(label)}</span><span class="type">{esc(row.type)}</span>'
        f'<span class="figs"><span class="fig">'
        f"{esc(size(row.param_bytes_total)) if row.params_total else ''}</span>"
        f'<span class="fig">'
        f"{esc(size(row.activation_bytes_total)) if row.activation_bytes_total else ''}"
        "</span></span>"
    )
    if row.params:
        line += f'<span class="shapes">{esc(param_shapes(row))}</span>'
    kids = [f for f in agg.fold_children(row) if not _idle(f.row)]
    if not kids:
        return f'<div class="row">{line}</div>'
    inner = "".join(
        _node(k, k.first if k.count == 1 else f"{k.first}-{k.last} (× {k.count})", level + 1)
        for k in kids
    )
    opened = " open" if level < OPEN_LEVELS else ""
    return f'<details{opened}><summary>{line}</summary><div class="kids">{inner}</div></details>'


def module_tree(role, note: bool = True) -> str:
    """The role's module trees, collapsible: parameters and activations of each subtree, and
    (with `note`) what the columns hold."""
    roots = module_roots(role)
    if not roots:
        return ""
    head = (
        '<div class="row head"><span class="name">Module</span><span class="type">Type</span>'
        '<span class="figs"><span class="fig">Params</span><span class="fig">Act/µb</span>'
        "</span></div>"
    )
    body = "".join(_node(agg.Fold(r, 1, r.name, r.name, None), r.fqn or "model", 0) for r in roots)
    return f'<div class="tree">{head}{body}</div>' + (TREE_NOTE if note else "")


TREE_NOTE = (
    '<p class="note">Params: bytes of the parameters of the module and its children; Act/µb: '
    "activations they save for backward per micro-batch; below a module, its own parameters' "
    "shapes. A run of identical layers is shown once, as first-last (× count), with the figures "
    "of one of them.</p>"
)


# ----------------------------------------------------------------------------- stages


def _stages_table(report) -> str:
    rows = [
        [
            r["pp_stage"],
            rank_span(r["ranks"]),
            _gpus(r.get("gpus", ())),
            layer_span(r["layers"]),
            f"{r['params']['count']:,}",
            mib(r["params"]["bytes"]),
            mib(r["activations_per_microbatch_bytes"]),
            len(r["collectives_per_microbatch"]),
        ]
        for r in report["roles"]
    ]
    head = [
        "Stage",
        "Ranks",
        "GPUs",
        "Layers",
        "Parameters",
        "Param MiB",
        "Act MiB/µb",
        "Collectives/µb",
    ]
    return _table(head, rows, numeric={0, 4, 5, 6, 7})


def _gpus(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else (f"{names[0]} … {names[-1]}" if names else "")


def _stage_comm(role) -> str:
    """A stage's traced rank: its communication per dimension and the collectives behind it."""
    if "comm" not in role:
        return ""
    rows, classes = [], []
    for dim, t in role["comm"].items():
        rows.append(
            [
                DIM_TITLES.get(dim, dim),
                f"{t['count']:,}",
                volume(t["bytes_sent"]),
                volume(t["bytes_received"]),
                volume(t["intra_node_bytes"]),
                volume(t["inter_node_bytes"]),
                seconds(t["seconds"]),
                seconds(t["exposed_seconds"]),
            ]
        )
        classes.append("" if t["count"] else "zero")
    head = [
        "Dimension",
        "Calls",
        "Sent",
        "Received",
        "Inside nodes",
        "Across nodes",
        "Time",
        "Exposed",
    ]
    items = sorted(
        role.get("comm_collectives", ()),
        key=lambda it: (it["dimension"], not it["per_microbatch"], it["module"]),
    )
    detail = [
        [
            DIM_TITLES.get(it["dimension"], it["dimension"]),
            op_name(it["op"]),
            f"{it['group']} ({len(it['ranks'])})",
            f"{compact(it['shape'])} {DTYPE_SHORT.get(it['dtype'], it['dtype'])} "
            f"{volume(it['message_bytes'])}",
            f"{it['count']:,}",
            volume(it["count"] * it["bytes_sent"]),
            it["phase"],
            it["module"],
            it["overlapped_with"] or "—",
        ]
        for it in items
    ]
    detail_head = [
        "Dimension",
        "Collective",
        "Group",
        "Message",
        "Calls",
        "Sent/iteration",
        "Phase",
        "Module",
        "Overlapped with",
    ]
    return (
        f"<p>Communication of one GPU (rank {esc(role['traced_rank'])}) per iteration:</p>"
        + _table(head, rows, numeric=set(range(1, 8)), classes=classes)
        + f"<details><summary>{len(detail):,} kinds of collective</summary>"
        + _table(detail_head, detail, numeric={4, 5})
        + "</details>"
    )


def _stages(report) -> str:
    out = ["<h2>Per pipeline stage</h2>", _stages_table(report)]
    for r in report["roles"]:
        out.append(
            f"<h3>Pipeline stage {esc(r['pp_stage'])} · ranks {esc(rank_span(r['ranks']))}"
            f" · layers {esc(layer_span(r['layers']))} · traced rank "
            f"{esc(r['traced_rank'])}</h3>"
        )
        if "memory" in r:
            m = r["memory"]
            parts = ", ".join(f"{label} {size(m[key])}" for key, label, *_ in PARTS)
            out.append(
                f"<p>Peak {esc(size(m['peak_bytes']))} ({esc(parts)}) at "
                f"{esc(peak_at(SimpleNamespace(**m['peak_at']), r['vpp_chunks']))}.</p>"
            )
        out.append(_stage_comm(r))
        tree = module_tree(r, note=r is report["roles"][-1])
        if tree:
            out.append(f"<p>Modules of one GPU (rank {esc(r['traced_rank'])}):</p>{tree}")
    return "".join(out)


def _full_model(report) -> str:
    full = report.get("full_model")
    if full is None:
        return ""
    return (
        f"<h2>Full model without parallelism</h2><p>{full['params']['count']:,} parameters "
        f"({esc(size(full['params']['bytes']))}) · activations "
        f"{esc(size(full['activations_per_microbatch_bytes']))} per micro-batch on one "
        "GPU.</p>" + module_tree(full)
    )


def _search(report) -> str:
    search = report.get("max_micro_batch")
    if search is None:
        return ""
    rows = [
        [
            p["micro_batch_size"],
            p["num_microbatches"],
            size(p["highest_peak_bytes"]),
            size(p["headroom_bytes"]) if p["fits"] else f"-{size(-p['headroom_bytes'])}",
            "fits" if p["fits"] else "out of memory",
        ]
        for p in sorted(search["probes"], key=lambda p: p["micro_batch_size"])
    ]
    best = search["best"]
    answer = (
        f"Micro-batch size {best} fits (the report above is for it)."
        if best is not None
        else f"None fits: micro-batch size {search['candidates'][0]} is already out of memory."
    )
    sizes = ", ".join(str(c) for c in search["candidates"])
    return (
        "<h2>Largest micro-batch size that fits</h2>"
        f'<p class="note">Valid sizes {esc(sizes)}; the global batch stays.</p>'
        + _table(
            ["Micro-batch", "Micro-batches", "Highest peak", "Headroom", ""],
            rows,
            numeric={0, 1, 2, 3},
        )
        + f"<p><b>{esc(answer)}</b></p>"
    )


# ----------------------------------------------------------------------------- the page


def _release(report: dict) -> str:
    """ "megatron-core 0.19.2 · ", the release the job was traced under ("" when none)."""
    release = report.get("megatron_core")
    return f"megatron-core {esc(release)} · " if release else ""


def page(report: dict, timelines=None) -> str:
    """The whole page. `timelines`: one sequence of (phase, bytes) per role, in the order of
    report["roles"] (RoleMemory.timeline); without them the pictures over time are left out."""
    model = report["model"].get("preset") or "model"
    title = f"metatrace: {model} on {report['world']['num_gpus']} GPUs"
    body = [
        f"<h1>{esc(title)}</h1>",
        f'<p class="note">metatrace {esc(report["metatrace_version"])} · '
        f"{_release(report)}report schema "
        f"{esc(report['schema_version'])} · job {esc(report['source'])}</p>",
        _configuration(report),
        _verdict(report),
        timing(report),
        _memory(report, timelines),
        comm_table(report),
        _stages(report),
        _full_model(report),
        _search(report),
    ]
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>\n"
        + "\n".join(part for part in body if part)
        + "\n</body></html>\n"
    )


def role_timelines(analysis) -> list | None:
    """Every role's RoleMemory.timeline from an Analysis (None when an iteration is missing):
    the one figure the page needs that the JSON report does not hold."""
    if not analysis.iterations:
        return None
    return [ra.memory.timeline for ra in analysis.roles]


def write_html(report: dict, path: str, timelines=None) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(page(report, timelines))
    except OSError as e:
        from metatrace.errors import ConfigError

        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None
