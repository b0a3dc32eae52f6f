"""The report as one self-contained HTML page (`metatrace run --html PATH`).

`page(report, timelines)` is a pure function of the JSON report (`metatrace.export.report.job_report`,
with `max_micro_batch` when --max-mbs ran) and, for the pictures of memory over the iteration,
each role's `RoleMemory.timeline` (not part of the JSON report). Nothing is computed here that
the report does not hold: sizes are formatted with the terminal's helpers (metatrace.render.run,
metatrace.render.comm). The page needs no network: inline CSS, inline SVG drawn below, no
script. Every text from the report goes through html.escape.

Known limitations: no module trees (the terminal and the JSON have them); timelines longer than
600 steps are drawn as 600 columns, each the highest level of its steps, as the terminal does.
"""

from __future__ import annotations

import html
from types import SimpleNamespace

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
)
from metatrace.render.format import op as op_name

PARTS = (
    ("params_bytes", "Params", "parameters and module buffers", "#4e79a7"),
    ("grads_bytes", "Grads", "DDP's main-gradient buffers", "#f28e2b"),
    ("optimizer_bytes", "Optim", "main parameters and optimizer state", "#e15759"),
    ("workspace_bytes", "Wkspc", "kernel workspaces and buffers kept for good", "#76b7b2"),
    ("activations_bytes", "Activ", "held for the micro-batches in flight", "#59a14f"),
    ("temporary_bytes", "Temp", "the running step's own", "#b07aa1"),
)
PHASE_COLOURS = {
    "forward": "#4e79a7",
    "backward": "#f28e2b",
    "grad sync": "#9c755f",
    "optimizer": "#e15759",
}
MIXED = "#bab0ac"
WIDTH = 760
MAX_COLUMNS = 600

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
       max-width: 1100px; margin: 2em auto; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
h3 { font-size: 1em; margin-top: 1.5em; }
table { border-collapse: collapse; margin: .5em 0; }
th, td { padding: 2px 8px; border-bottom: 1px solid #e4e4e4; text-align: left;
         vertical-align: top; }
th { background: #f4f4f4; } td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
tr.zero td { color: #999; } tr.total td { font-weight: bold; }
dl.config { display: grid; grid-template-columns: max-content auto; gap: 2px 16px; }
dl.config dt { font-weight: bold; } dl.config dd { margin: 0; }
.verdict { padding: .6em 1em; border-radius: 4px; font-weight: bold; }
.fits { background: #e6f4e6; color: #1b5e20; } .oom { background: #fde8e8; color: #b71c1c; }
.caveat { background: #fff4e0; color: #7a4b00; font-weight: normal; }
.note { color: #666; font-size: .9em; } .key { display: inline-block; width: .9em;
  height: .9em; margin: 0 .3em 0 1em; vertical-align: -1px; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
"""


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def _table(head, rows, numeric=(), classes=None) -> str:
    """A table: `head` column titles, `rows` of cells (escaped here); columns whose index is in
    `numeric` are right-aligned; `classes[i]` is row i's class."""
    out = ["<table><thead><tr>"]
    out += [f"<th{' class=n' if i in numeric else ''}>{esc(h)}</th>" for i, h in enumerate(head)]
    out.append("</tr></thead><tbody>")
    for i, row in enumerate(rows):
        cls = f' class="{esc(classes[i])}"' if classes and classes[i] else ""
        cells = "".join(
            f"<td{' class=n' if j in numeric else ''}>{esc(c)}</td>" for j, c in enumerate(row)
        )
        out.append(f"<tr{cls}>{cells}</tr>")
    out.append("</tbody></table>")
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

    text = verdict_text(
        f"{cl['gpu']} ({cl['gpu_memory_gib']:g} GiB)",
        fits=v["fits"],
        worst=v["highest_peak_bytes"],
        worst_ranks=v["highest_peak_ranks"],
        oom_ranks=v["out_of_memory_ranks"],
        headroom=v["headroom_bytes"],
        reserved_gib=cl["reserved_overhead_gib"],
        userbuffers=v.get("userbuffer_bytes", 0),
    )
    out = f'<p class="verdict {"fits" if v["fits"] else "oom"}">{esc(text)}</p>'
    if v.get("not_modelled"):
        from metatrace.analysis.memory import not_modelled_text

        out += f'<p class="verdict caveat">{esc(not_modelled_text(v["not_modelled"]))}</p>'
    return out


# ----------------------------------------------------------------------------- memory


def memory_bars(report) -> str:
    """One stacked horizontal bar per pipeline stage, its parts in order; GPU capacity and
    capacity minus the reserved overhead as vertical lines when they fall on the scale."""
    roles = [r for r in report["roles"] if "memory" in r]
    v = report["memory_verdict"]
    capacity, usable = v["gpu_memory_bytes"], v["gpu_memory_bytes"] - v["reserved_overhead_bytes"]
    top = max(r["memory"]["peak_bytes"] for r in roles)
    # Capacity far above every peak would squash the bars: then it is named, not drawn.
    on_scale = capacity <= 4 * top
    scale = max(top, capacity) if on_scale else top
    left, right, row = 70, 90, 26
    plot = WIDTH - left - right
    height = row * len(roles) + 24
    out = [
        f'<svg width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" '
        f'aria-label="memory per pipeline stage">'
    ]
    for i, r in enumerate(roles):
        y, x, mem = 4 + i * row, float(left), r["memory"]
        out.append(
            f'<text x="{left - 6}" y="{y + 15}" text-anchor="end">stage {esc(r["pp_stage"])}</text>'
        )
        for key, label, _, colour in PARTS:
            w = plot * mem[key] / scale
            out.append(
                f'<rect class="seg" data-stage="{esc(r["pp_stage"])}" x="{x:.2f}" '
                f'y="{y}" width="{w:.2f}" height="{row - 8}" fill="{colour}"><title>'
                f"stage {esc(r['pp_stage'])} · {esc(label)} {esc(size(mem[key]))}"
                f"</title></rect>"
            )
            x += w
        out.append(f'<text x="{x + 6:.2f}" y="{y + 15}">{esc(size(mem["peak_bytes"]))}</text>')
    if on_scale:
        # Labels on either side of their lines: the two lines are often a few pixels apart.
        for value, label, style, anchor in (
            (usable, "capacity − reserved", ' stroke-dasharray="4 3"', "end"),
            (capacity, "GPU capacity", "", "start"),
        ):
            x = left + plot * value / scale
            out.append(
                f'<line x1="{x:.2f}" y1="0" x2="{x:.2f}" y2="{height - 12}" '
                f'stroke="#b71c1c"{style}/><text x="{x:.2f}" y="{height - 2}" '
                f'text-anchor="{anchor}">{esc(label)}</text>'
            )
    out.append("</svg>")
    keys = "".join(_key(colour, label) for _, label, _, colour in PARTS)
    note = (
        ""
        if on_scale
        else (
            f" GPU capacity {size(capacity)} (capacity − reserved {size(usable)}) lies beyond "
            "the scale."
        )
    )
    return "".join(out) + f'<p class="note">{keys}.{esc(note)}</p>'


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


def _columns(steps):
    """At most MAX_COLUMNS (phase or None when mixed, highest level) columns."""
    n = max(1, -(-len(steps) // MAX_COLUMNS))
    out = []
    for i in range(0, len(steps), n):
        group = steps[i : i + n]
        phases = {p for p, _ in group}
        out.append((phases.pop() if len(phases) == 1 else None, max(b for _, b in group)))
    return out


def timeline_chart(stage, peak: int, steps, floor: int, top: int) -> str:
    """Memory over the iteration of one stage: a step line from `floor` to `top`, a strip
    below coloured by phase, the peak as a dashed line."""
    left, right, height, strip = 70, 10, 120, 8
    plot_w, plot_h = WIDTH - left - right, height - strip - 14
    cols = _columns(steps)
    span = max(1, top - floor)

    def y(level):
        return 4 + plot_h * (1 - (level - floor) / span)

    dx = plot_w / max(1, len(cols))
    points = []
    for i, (_, level) in enumerate(cols):
        points += [
            f"{left + i * dx:.2f},{y(level):.2f}",
            f"{left + (i + 1) * dx:.2f},{y(level):.2f}",
        ]
    out = [
        f'<svg width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" '
        f'aria-label="memory over the iteration, stage {esc(stage)}">',
        f'<text x="{left - 6}" y="{y(top) + 4:.2f}" text-anchor="end">{esc(size(top))}</text>',
        f'<text x="{left - 6}" y="{y(floor):.2f}" text-anchor="end">{esc(size(floor))}</text>',
        f'<line x1="{left}" y1="{y(peak):.2f}" x2="{WIDTH - right}" y2="{y(peak):.2f}" '
        f'stroke="#b71c1c" stroke-dasharray="4 3"><title>peak {esc(size(peak))}</title></line>',
        f'<polyline fill="none" stroke="#222" stroke-width="1.2" points="{" ".join(points)}"/>',
    ]
    base = 4 + plot_h + 4
    for i, (phase, _) in enumerate(cols):
        colour = PHASE_COLOURS.get(phase, MIXED)
        out.append(
            f'<rect x="{left + i * dx:.2f}" y="{base:.2f}" width="{dx:.2f}" '
            f'height="{strip}" fill="{colour}"/>'
        )
    out.append("</svg>")
    return "".join(out)


def _timelines(report, timelines) -> str:
    roles = report["roles"]
    if timelines is None or len(timelines) != len(roles) or not all(timelines):
        return '<p class="note">The steps of the iteration are not in the JSON report.</p>'
    out = []
    for r, steps in zip(roles, timelines):
        peak = r["memory"]["peak_bytes"]
        floor, top = min(b for _, b in steps), max(peak, max(b for _, b in steps))
        out.append(
            f"<h3>Stage {esc(r['pp_stage'])} · peak {esc(size(peak))} · {len(steps):,} steps</h3>"
        )
        out.append(timeline_chart(r["pp_stage"], peak, steps, floor, top))
    keys = "".join(_key(c, p) for p, c in PHASE_COLOURS.items()) + _key(MIXED, "mixed")
    return "".join(out) + (
        f'<p class="note">{keys}. Each step is the highest live memory of a chunk\'s forward '
        "or backward step of one micro-batch, in schedule order, then the optimizer step; "
        "workspaces included. Each chart spans its own stage's lowest to highest level (the bars "
        "above compare the stages).</p>"
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
    return "".join(out)


def _full_model(report) -> str:
    full = report.get("full_model")
    if full is None:
        return ""
    return (
        f"<h2>Full model without parallelism</h2><p>{full['params']['count']:,} parameters "
        f"({esc(size(full['params']['bytes']))}) · activations "
        f"{esc(size(full['activations_per_microbatch_bytes']))} per micro-batch on one "
        "GPU.</p>"
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


def page(report: dict, timelines=None) -> str:
    """The whole page. `timelines`: one sequence of (phase, bytes) per role, in the order of
    report["roles"] (RoleMemory.timeline); without them the pictures over time are left out."""
    model = report["model"].get("preset") or "model"
    title = f"metatrace: {model} on {report['world']['num_gpus']} GPUs"
    body = [
        f"<h1>{esc(title)}</h1>",
        f'<p class="note">metatrace {esc(report["metatrace_version"])} · report schema '
        f"{esc(report['schema_version'])} · job {esc(report['source'])}</p>",
        _configuration(report),
        _verdict(report),
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
