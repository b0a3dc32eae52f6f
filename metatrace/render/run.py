"""The terminal report of `metatrace run`: tables and trees built from an Analysis
(metatrace.analysis.analyze); the caller prints them.

`build_*()` functions return rich renderables; nothing here computes a figure (formatting only).
"""

from __future__ import annotations

import re

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from metatrace.analysis import aggregate as agg
from metatrace.records import STEP
from metatrace.render.comm import render_comm
from metatrace.render.fit import FitTable
from metatrace.render.format import (
    PARAM_SHORT,
    TP_GROUPS,
    GiB,
    MiB,
    compact,
    gpu_span,
    layer_span,
    mib,
    peak_at,
    rank_span,
    seconds,
    section,
    shape,
    size,
)
from metatrace.render.summary import (
    build_run_summary,
    build_verdict,
    fsdp_text,
    graphs_text,
    offload_texts,
    recompute_text,
)
from metatrace.render.timeline import build_timeline


def param_shapes(row: agg.ModuleRow) -> str:
    """Parameter names and shapes; numbered ones of one shape (the per-expert weight0,
    weight1, ... of grouped GEMMs) as one entry: "weight0-7 8× [96, 64]"."""
    entries: list[list] = []  # [base, first, last, shape]
    for name, dims in row.param_shapes:
        m = re.fullmatch(r"(\D+)(\d+)", name)
        prev = entries[-1] if entries else None
        if m and prev and prev[0] == m[1] and prev[2] == int(m[2]) - 1 and prev[3] == dims:
            prev[2] = int(m[2])
        elif m:
            entries.append([m[1], int(m[2]), int(m[2]), dims])
        else:
            entries.append([name, None, None, dims])
    out = []
    for base, first, last, dims in entries:
        if first is None:
            out.append(f"{PARAM_SHORT.get(base, base)} {shape(dims)}")
        elif first == last:
            out.append(f"{base}{first} {shape(dims)}")
        else:
            out.append(f"{base}{first}-{last} {last - first + 1}× {shape(dims)}")
    return "  ".join(out)


# ----------------------------------------------------------------------------- summary


def build_summary(job, world) -> Table:
    m, par, tr, cl, impl = job.model, job.parallel, job.training, job.cluster, job.implementation
    nodes = -(-cl.num_gpus // cl.gpus_per_node)
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    name = f"{m.preset}: " if m.preset else (f"{m.hf_config}: " if m.hf_config else "")
    if m.multi_latent_attention:
        q = f"q rank {m.q_lora_rank}, " if m.q_lora_rank else ""
        attention = (
            f"multi-latent: {q}kv rank {m.kv_lora_rank}, qk head dim "
            f"{m.qk_head_dim}+{m.qk_pos_emb_head_dim}, v head dim {m.v_head_dim}"
        )
    elif m.num_query_groups != m.num_attention_heads:
        attention = f"{m.num_query_groups} query groups, head dim {m.kv_channels}"
    else:
        attention = f"multi-head, head dim {m.kv_channels}"
    position = m.position_embedding_type
    if position == "rope" and m.multi_latent_attention and m.rope_type == "yarn":
        position = f"yarn rope (x{m.rotary_scaling_factor:g})"
    elif position == "yarn":
        position = f"yarn rope (x{m.rotary_scaling_factor:g})"
    if m.window_size is not None:
        position += f", window {m.window_size[0]}"
    if m.softmax_type != "vanilla":
        position += f", {m.softmax_type} softmax"
    mtp = (
        f", {m.mtp_num_layers} MTP layer{'s' * (m.mtp_num_layers > 1)}" if m.mtp_num_layers else ""
    )
    table.add_row(
        "model",
        f"{name}{m.num_layers} layers{mtp}, hidden {m.hidden_size}, ffn {m.ffn_hidden_size}, "
        f"{m.num_attention_heads} heads ({attention}), vocab {m.vocab_size} "
        f"(padded {job.padded_vocab_size}), {m.normalization}, {m.activation}, {position}, "
        f"{'untied' if m.untie_embeddings_and_output_weights else 'tied'} embeddings, "
        f"{'biases' if m.add_bias_linear else 'no biases'}, dropout "
        f"{m.hidden_dropout:g}/{m.attention_dropout:g}",
    )
    if m.num_experts:
        table.add_row("experts", moe_summary(job))
    vpp = f" (vpp {par.vpp})" if par.vpp else ""
    table.add_row(
        "parallel",
        f"tp {par.tp} · pp {par.pp}{vpp} · cp {par.cp} · dp {par.dp} · ep {par.ep}"
        + (f" · etp {par.etp} · expert dp {world.expert_dp}" if m.num_experts else "")
        + f" · sequence parallel {'on' if par.sequence_parallel else 'off'}"
        f" · rank order {par.rank_order}",
    )
    table.add_row(
        "training",
        " · ".join(
            [
                f"seq {tr.seq_length} · micro-batch {tr.micro_batch_size} · global batch "
                f"{tr.global_batch_size} ({job.num_microbatches} micro-batches per iteration)",
                tr.precision,
                recompute_text(tr.recompute) or "no recompute",
            ]
            + (["distributed optimizer"] if tr.distributed_optimizer else [])
            + [t for t in (fsdp_text(tr),) if t]
            + offload_texts(tr)
            + [t + " (static buffers in Wkspc)" for t in (graphs_text(tr),) if t]
        ),
    )
    table.add_row(
        "cluster",
        f"{cl.num_gpus} GPUs, {cl.gpus_per_node} per node ({nodes} node{'s' * (nodes > 1)}), "
        f"{cl.gpu} {cl.gpu_memory_gib:g} GiB",
    )
    table.add_row("implementation", f"{impl.transformer_impl} · attention {impl.attention_backend}")
    for note in job.notes:
        table.add_row("note", note)
    return table


def moe_summary(job) -> str:
    """The MoE layers of a job in a line, with the routing assumption its numbers rest on."""
    from metatrace.config.routing import Routing

    m = job.model
    moe_layers = sum(m.moe_layer_freq)
    shared = (
        f", shared experts {m.moe_shared_expert_intermediate_size}"
        if m.moe_shared_expert_intermediate_size
        else ""
    )
    routing = Routing.of_job(job)
    return (
        f"{m.num_experts} experts, top-{m.moe_router_topk}, expert ffn {m.moe_ffn_hidden_size}"
        f"{shared}, {moe_layers} of {m.num_layers} layers MoE, "
        f"{job.parallel.moe_token_dispatcher_type} dispatcher, "
        f"{'grouped GEMM' if job.implementation.moe_grouped_gemm else 'one GEMM per expert'} · "
        f"routing assumed {routing.describe()}"
    )


# ----------------------------------------------------------------------------- module trees


def build_module_table(
    roots: list[agg.ModuleRow],
    *,
    tp_columns: bool,
    depth: int | None = None,
    expand: bool = False,
    step: tuple = (),
) -> FitTable:
    """Module tree as a table: parameters and activations of each subtree, and (per rank) the
    TP collectives each module issues. `depth` counts the model itself as 0."""
    table = FitTable()
    table.add_column("Module", "module")
    table.add_column("Type", "type")
    table.add_column("Parameters", "prose")
    table.add_column("Param MiB")
    table.add_column("Act MiB")
    if tp_columns:
        table.add_column("TP communication (MiB)", "prose")
    for root in roots:
        label = root.fqn or "model"
        _add_rows(
            table,
            agg.Fold(root, 1, root.name, root.name, None),
            "",
            "",
            0,
            label,
            tp_columns,
            depth,
            expand,
        )
    if tp_columns and step:
        cell = _tp_cell(step)
        if cell:
            table.add_row("(training step)", "", "", "", "", cell)
    return table


def _add_rows(table, fold, guide, child_guide, level, label, tp, depth, expand):
    row = fold.row
    cut = depth is not None and level >= depth and row.children
    cells = [
        f"{guide}{label}",
        row.type,
        param_shapes(row),
        mib(row.param_bytes_total) if row.params_total else "",
        mib(row.activation_bytes_total) if row.activation_bytes_total else "",
    ]
    if tp:
        cells.append(_tp_cell(row.collectives))
    table.add_row(*cells)
    if cut:
        return
    if expand:
        folds = [agg.Fold(c, 1, c.name, c.name, None) for c in row.children]
    else:
        folds = [f for f in agg.fold_children(row) if not _placeholder(f.row)]
    for i, child in enumerate(folds):
        last = i == len(folds) - 1
        name = child.row.name
        if child.count > 1:
            name = f"{child.first}-{child.last} (× {child.count})"
        _add_rows(
            table,
            child,
            child_guide + ("└─ " if last else "├─ "),
            child_guide + ("   " if last else "│  "),
            level + 1,
            name,
            tp,
            depth,
            expand,
        )


def _placeholder(row: agg.ModuleRow) -> bool:
    """megatron-core's IdentityOp / IdentityFuncOp slots that hold and do nothing: shown only
    with --expand."""
    return (
        row.type.startswith("Identity")
        and not row.params_total
        and not row.activation_bytes_total
        and not any(True for r in agg.walk([row]) if r.collectives)
    )


_PHASE_MARK = {"forward": "fwd", "backward": "bwd", "recompute": "rec"}


def _tp_cell(collectives) -> str:
    """The TP-group collectives of one module, one per line: phase, op, message shape, MiB."""
    counts: dict[tuple, int] = {}
    for c in collectives:
        if c.group in TP_GROUPS:
            key = (_PHASE_MARK[c.phase], c.op, compact(c.shape), mib(c.bytes))
            counts[key] = counts.get(key, 0) + 1
    return "\n".join(
        f"{phase} {f'{n}× ' if n > 1 else ''}{op} {dims} {size_}"
        for (phase, op, dims, size_), n in counts.items()
    )


# ----------------------------------------------------------------------------- roles


def role_title(analysis, group) -> str:
    """`group`: RoleAnalysis of roles shown as one."""
    world = analysis.world
    first = group[0]
    ranks = sorted(r for ra in group for r in ra.role.ranks)
    stages = [ra.role.pp_stage for ra in group]
    summary = first.summary
    which = (
        f"Pipeline stage {stages[0]}"
        if len(stages) == 1
        else f"Pipeline stages {layer_span(stages)} (identical)"
    )
    gpus = gpu_span(world, ranks)
    layers = "" if len(group) > 1 else f" · layers {layer_span(summary.layers)}"
    return f"{which} · ranks {rank_span(ranks)} ({gpus}){layers} · traced rank {first.trace.rank}"


def group_roles(analysis, expand: bool = False):
    """Consecutive roles with the same signature, grouped (each alone with `expand`)."""
    groups = []
    prev_sig = None
    for ra in analysis.roles:
        sig = None if expand else ra.signature
        if groups and sig is not None and sig == prev_sig:
            groups[-1].append(ra)
        else:
            groups.append([ra])
        prev_sig = sig
    return groups


def build_role_tree(ra, *, depth=None, expand=False):
    """The module tree of a role (a RoleAnalysis) with its TP communication."""
    step = [c for c in ra.trace.collectives if c.module == STEP]
    return build_module_table(list(ra.tree), tp_columns=True, depth=depth, expand=expand, step=step)


def build_totals_line(s: agg.RoleSummary) -> Text:
    return Text(
        f"{s.params:,} parameters ({size(s.param_bytes)}) · activations "
        f"{size(s.activation_bytes)} saved per micro-batch",
        style="dim",
    )


def build_roles_table(analysis) -> FitTable:
    table = FitTable()
    for col, kind in (
        ("Stage", "number"),
        ("Ranks", "name"),
        ("Layers", "name"),
        ("Parameters", "number"),
        ("Param MiB", "number"),
        ("Act MiB/µb", "number"),
        ("Collectives/µb", "number"),
    ):
        table.add_column(col, kind)
    for ra in analysis.roles:
        s = ra.summary
        table.add_row(
            str(ra.role.pp_stage),
            rank_span(ra.role.ranks),
            layer_span(s.layers),
            f"{s.params:,}",
            mib(s.param_bytes),
            mib(s.activation_bytes),
            str(s.collectives),
        )
    return table


# ----------------------------------------------------------------------------- memory


def _unit(nbytes: int) -> tuple[str, int]:
    return ("GiB", GiB) if nbytes >= 10 * GiB else ("MiB", MiB)


def _amount(nbytes: int, unit: int) -> str:
    value = nbytes / unit
    return f"{value:,.2f}" if unit == GiB else f"{value:,.1f}"


def build_memory_table(roles) -> Group:
    """Every role's memory over one iteration, in parts that add up to its peak, and where each
    role peaks. `roles`: RoleAnalysis with their memory."""
    name, unit = _unit(max(ra.memory.peak for ra in roles))
    table = FitTable()
    for col in ("Stage", "Ranks", "Params", "Grads", "Optim", "Wkspc", "Activ", "µb", "Temp"):
        table.add_column(col, "name" if col == "Ranks" else "number")
    table.add_column(f"Peak {name}")
    where = []
    for ra in roles:
        m = ra.memory
        table.add_row(
            str(ra.role.pp_stage),
            rank_span(ra.role.ranks),
            _amount(m.params, unit),
            _amount(m.grads, unit),
            _amount(m.optimizer, unit),
            _amount(m.workspaces, unit),
            _amount(m.activations, unit),
            str(m.inflight),
            _amount(m.temporary, unit),
            Text(_amount(m.peak, unit), style="bold"),
        )
        where.append(
            Text(
                f"stage {ra.role.pp_stage} peaks in {peak_at(m.peak_at, len(ra.traced.chunks))}",
                style="dim",
            )
        )
    legend = Text(
        f"{name} per GPU. Params: parameters and module buffers; Grads: DDP's main-grad buffers; "
        "Optim: main parameters and optimizer state; Wkspc: kernel workspaces and buffers kept "
        "for good; Activ: held for the µb micro-batches in flight; Temp: the running step's own. "
        "Peak: the highest torch.cuda.max_memory_allocated() expected.",
        style="dim",
    )
    return Group(table, *where, legend)


def build_offload_lines(analysis) -> list[Text]:
    """One line on activation offloading's PCIe traffic and pinned host memory per stage (none
    when the job does not offload)."""
    job = analysis.job
    parts = []
    for ra in analysis.roles:
        o = ra.offload
        if o is not None:
            parts.append(
                f"stage {ra.role.pp_stage} {size(o.d2h_per_microbatch)} per micro-batch, "
                f"{size(o.d2h_per_iteration)} per iteration, {size(o.pinned_host)} pinned"
            )
    if not parts:
        return []
    layers = job.training.cpu_offloading_num_layers
    if layers:
        what = f"first {layers} layers, Transformer Engine"
    else:
        what = ", ".join(job.training.activation_offload_modules)
    return [
        Text(
            f"Activation offloading ({what}), each way over the host link per GPU and host memory pinned "
            f"for good: {'; '.join(parts)}.",
            style="dim",
        )
    ]


def build_host_optimizer_lines(analysis) -> list[Text]:
    """One line on the optimizer CPU offload: the share of the update on the host, host memory
    and the copies per step (none without it)."""
    from metatrace.analysis.timing import host_optimizer_seconds

    job = analysis.job
    parts = []
    for ra in analysis.roles:
        h = ra.traced.host_optimizer
        if h is None:
            continue
        share = h.offloaded_numel / h.total_numel if h.total_numel else 0.0
        secs = host_optimizer_seconds(job, h)
        link = f", {seconds(secs)} over the host link" if secs is not None else ""
        parts.append(
            f"stage {ra.role.pp_stage} {share:.0%} of {h.total_numel / 1e6:,.1f}M shard elements, "
            f"{size(h.host_bytes)} host memory, {size(h.d2h_bytes)} to the host and "
            f"{size(h.h2d_bytes)} back per step{link}"
        )
    if not parts:
        return []
    return [
        Text(
            "Optimizer CPU offload (optimizer_offload_fraction "
            f"{job.training.optimizer_offload_fraction:g}; master weights and Adam moments of "
            f"that share on the host, not in Optim), per GPU: {'; '.join(parts)}. The host "
            "update's own time is not modelled.",
            style="dim",
        )
    ]


def build_full_model(full, *, depth=None, expand=False):
    """The whole model on one GPU (the Analysis' `full`)."""
    s = full.summary
    return Group(
        build_module_table(list(full.tree), tp_columns=False, depth=depth, expand=expand),
        Text(
            f"{s.params:,} parameters ({size(s.param_bytes)}) · activations "
            f"{size(s.activation_bytes)} per micro-batch on one GPU",
            style="dim",
        ),
    )


def render_run(
    analysis, console, *, depth=None, expand=False, detail=False, advice: dict | None = None
) -> None:
    """The summary (metatrace.render.summary; with `advice`, the report's advice under the
    verdict), then the memory of every stage over the iteration; with `detail`, also the
    configuration, the module trees and the communication sections before the memory, and the
    verdict again at the end."""
    job = analysis.job
    console.print(build_run_summary(analysis, advice))
    if detail:
        console.print(section("Configuration"))
        console.print(build_summary(job, analysis.world))
        if analysis.full is not None:
            console.print(section("Full model without parallelism (one GPU, one micro-batch)"))
            console.print(build_full_model(analysis.full, depth=depth, expand=expand))
        for group in group_roles(analysis, expand):
            console.print(section(role_title(analysis, group)))
            console.print(build_role_tree(group[0], depth=depth, expand=expand))
            console.print(build_totals_line(group[0].summary))
        console.print(section("Per pipeline stage (one micro-batch)"))
        console.print(build_roles_table(analysis))
        if analysis.iterations:
            render_comm(analysis, console)
    if analysis.iterations:
        console.print(
            section(
                f"Memory per GPU over one training iteration ({job.num_microbatches} "
                "micro-batches and the optimizer step)"
            )
        )
        console.print(build_memory_table(analysis.roles))
        for line in build_offload_lines(analysis) + build_host_optimizer_lines(analysis):
            console.print(line)
        console.print(section("Memory over the iteration"))
        console.print(build_timeline(analysis.roles))
        if detail:
            console.print()
            console.print(build_verdict(analysis))


def render_search(job, search, console) -> None:
    """The micro-batch sizes tried by --max-mbs and the answer."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("Micro-batch", "Micro-batches", "Highest peak", "Headroom", ""):
        table.add_column(col, justify="right" if col else "left")
    for p in sorted(search.probes, key=lambda p: p.micro_batch_size):
        table.add_row(
            str(p.micro_batch_size),
            str(p.num_microbatches),
            size(p.peak),
            size(p.headroom) if p.fits else f"-{size(-p.headroom)}",
            Text("fits", style="green") if p.fits else Text("out of memory", style="red"),
        )
    console.print(
        section(
            f"Largest micro-batch size that fits (global batch {job.training.global_batch_size}; "
            f"valid sizes {', '.join(str(c) for c in search.candidates)})"
        )
    )
    console.print(table)
    if search.best is None:
        console.print(
            Text(
                f"None fits: micro-batch size {search.candidates[0]} is already out of memory "
                "(its report is shown above).",
                style="bold red",
            )
        )
    else:
        console.print(
            Text(
                f"Micro-batch size {search.best} fits (its report is shown above).",
                style="bold green",
            )
        )
