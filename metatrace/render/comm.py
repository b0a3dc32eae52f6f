"""Rendering of communication: the cluster summary, one section per parallel dimension, and the
rank-group tables (`metatrace groups`). Figures come from the Analysis
(metatrace.analysis.analyze); formatting only.
"""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from metatrace.analysis.timing import describe_rates
from metatrace.render.fit import FitTable, Kind
from metatrace.render.format import (
    DIM_NAMES,
    DIM_TITLES,
    DTYPE_SHORT,
    HOST_BOUND,
    PHASE_SHORT,
    compact,
    gpu_span,
    layer_span,
    op,
    rank_span,
    seconds,
    section,
    volume,
)


def message(it) -> str:
    return f"{compact(it.shape)} {DTYPE_SHORT.get(it.dtype, it.dtype)} {volume(it.message)}"


def gpu_list(world, ranks, limit: int = 8) -> str:
    names = [world.gpu(r) for r in ranks]
    if len(names) > limit:
        names = names[: limit - 1] + ["…", names[-1]]
    return "[" + " ".join(names) + "]"


def groups_line(world, groups, limit: int = 4) -> str:
    """The first `limit` groups as GPU names, and how many there are and cross nodes."""
    shown = " ".join(gpu_list(world, g) for g in groups[:limit])
    more = " …" if len(groups) > limit else ""
    crossing = sum(world.crosses_nodes(g) for g in groups)
    where = (
        "all inside nodes"
        if not crossing
        else ("all cross nodes" if crossing == len(groups) else f"{crossing} cross nodes")
    )
    return f"{shown}{more} ({len(groups)} groups of {len(groups[0])} GPUs; {where})"


_KIND: dict[str, Kind] = {
    "Dimension": "name",
    "GPUs": "name",
    "Layers": "name",
    "Phase": "name",
    "Collective": "name",
    "Group": "prose",
    "When": "prose",
    "Module": "module",
    "Message": "prose",
    "Boundary tensor": "prose",
    "Overlapped with": "prose",
    "Kind": "name",
    "Groups (GPUs)": "prose",
}


def _table(*columns) -> FitTable:
    """Figures right-aligned and whole; module paths shortened from the left; messages, group
    lists and kinds wrap between their items."""
    table = FitTable()
    for col in columns:
        table.add_column(col, _KIND.get(col, "number"))
    return table


# ----------------------------------------------------------------------------- summary


def build_comm_summary(job, jc) -> Group:
    """Per dimension, over all GPUs for one iteration: calls, bytes sent, share, inside and
    across nodes; the slowest GPU's estimated time; then the assumptions."""
    table = _table(
        "Dimension", "Calls", "Sent", "Share", "Inside nodes", "Across nodes", "Time/GPU", "Exposed"
    )
    total = jc.total
    for dim, t in jc.cluster.items():
        if not t.count:
            continue
        share = t.bytes_sent / total.bytes_sent if total.bytes_sent else 0.0
        table.add_row(
            DIM_TITLES[dim],
            f"{t.count:,}",
            volume(t.bytes_sent),
            f"{share:.1%}",
            volume(t.intra),
            volume(t.inter),
            seconds(t.seconds),
            seconds(t.exposed_seconds),
        )
    table.add_row(
        Text("Total", style="bold"),
        f"{total.count:,}",
        volume(total.bytes_sent),
        "100%" if total.bytes_sent else "",
        volume(total.intra),
        volume(total.inter),
        seconds(total.seconds),
        seconds(total.exposed_seconds),
    )
    cl = job.cluster
    assumptions = Text(
        "Calls and bytes sent, summed over all GPUs for one iteration. Time/GPU: the slowest "
        "GPU's estimated wire time per iteration; Exposed: of it, what Megatron does not overlap "
        "with compute (overlapped collectives hide only if the compute beside them lasts "
        "longer). Assumed: NCCL's ring algorithm (a rank sends 2(n-1)/n of an all-reduce's "
        "message, (n-1)/n of an all-gather's, reduce-scatter's or all-to-all's), one link per GPU "
        f"at {cl.intra_node_gbps:g} Gb/s inside a node and {cl.inter_node_gbps:g} Gb/s across "
        "nodes (cluster.intra_node_gbps, cluster.inter_node_gbps); a ring collective crossing "
        "nodes runs over the NICs of its members on a node together (k members: k times the "
        "rate, at most the node's link); latency, congestion and in-network reduction ignored.",
        style="dim",
    )
    return Group(table, assumptions)


def build_timing_line(analysis) -> Text | None:
    """One line of the time model (metatrace.analysis.timing): the iteration and the pipeline bubble."""
    t = analysis.timing
    if t is None:
        return None
    par = analysis.job.parallel
    schedule = f"interleaved 1F1B, vpp {par.vpp}" if par.vpp else "1F1B"
    if par.pp == 1:
        schedule = "no pipeline"
    text = Text(
        f"Estimated iteration time {seconds(t.iteration_seconds)} "
        f"({describe_rates(t.efficiency, t.peak_tflops)}, exposed communication as "
        f"above, {schedule}), pipeline bubble {t.bubble_fraction:.1%}",
        style="bold",
    )
    from metatrace.analysis.timing import STEP_PHASES, offload_exposed_seconds

    spans = [sp for st in t.stages for sp in st.spans]
    step = max((sp.offload_seconds for sp in spans if sp.phase in STEP_PHASES), default=0.0)
    host = max((sp.offload_seconds for sp in spans if sp.phase == "optimizer"), default=0.0)
    if step:
        gbps = analysis.job.cluster.host_link_gbps
        exposed = offload_exposed_seconds(t)
        effect = (
            f"adding {seconds(exposed)} per iteration" if exposed else "hidden behind the steps"
        )
        text.append(
            f"\nActivation offloading's host copies: {seconds(step)} per step each way at "
            f"{gbps / 8:g} GB/s, {effect}",
            style="",
        )
    if t.host is not None:
        text.append(f"\n{host_line(t)}", style="")
    if t.dp_exposed_seconds > 0:
        text.append(
            f"\nData-parallel parameter gathering and gradient reduction (overlapped) outlast "
            f"the steps beside them by {seconds(t.dp_exposed_seconds)} per iteration",
            style="",
        )
    if host:
        gbps = analysis.job.cluster.host_link_gbps
        text.append(
            f"\nOptimizer CPU offload: {seconds(host)} of copies to the host and back in the "
            f"optimizer step at {gbps / 8:g} GB/s each way (the host's update itself not timed)",
            style="",
        )
    return text


def host_line(t) -> str:
    """The host's side of the iteration of the stage that finishes last (Timing.host)."""
    host = t.host
    where = f" (stage {host.stage})" if len(t.stages) > 1 else ""
    syncs = f"{host.syncs:,} synchronisation{'s' if host.syncs != 1 else ''}"
    bound = host.wait_seconds >= HOST_BOUND * t.iteration_seconds
    return (
        f"The host{where} launches {host.kernels:,} kernels per iteration with "
        f"{seconds(host.seconds)} of work and {syncs}; the GPU waits "
        f"{seconds(host.wait_seconds)} of {seconds(t.iteration_seconds)} for it"
        + (" (host-bound)" if bound else "")
    )


# ----------------------------------------------------------------------------- pipeline


def build_pp_section(analysis) -> Group | None:
    world, jc = analysis.world, analysis.comm
    if world.layout.pp == 1:
        return None
    table = _table(
        "Stage",
        "GPUs",
        "Layers",
        "Boundary tensor",
        "Sends",
        "Receives",
        "Sent/GPU",
        "Across nodes",
    )
    embedding = []
    for ra in analysis.roles:
        comm = ra.comm
        p2p = [it for it in comm.items if it.dimension == "pp" and it.peer is not None]
        embedding += [it for it in comm.items if it.dimension == "pp" and it.peer is None]
        shapes = sorted({message(it) for it in p2p})
        crossing = sum(it.count for it in p2p if it.crosses_nodes)
        total = sum(it.count for it in p2p)
        table.add_row(
            str(ra.role.pp_stage),
            gpu_span(world, ra.role.ranks),
            layer_span(ra.summary.layers),
            Text("\n".join(shapes)),
            f"{sum(it.count for it in p2p if it.op == 'send'):,}",
            f"{sum(it.count for it in p2p if it.op == 'recv'):,}",
            volume(sum(it.count * it.sent for it in p2p)),
            "all" if crossing == total and total else (f"{crossing:,}" if crossing else "none"),
        )
    t = jc.cluster["pp"]
    lines = [
        table,
        Text(f"Groups: {groups_line(world, world.groups('pp'))}"),
    ]
    if embedding:
        it = embedding[0]
        lines.append(
            Text(
                f"Tied embedding: first and last stage all-reduce the word-embedding gradient "
                f"({message(it)}) once per iteration; groups {groups_line(world, world.groups('embedding'), 2)}"
            )
        )
    schedule = "interleaved 1F1B" if analysis.job.parallel.vpp else "1F1B"
    lines.append(
        Text(
            f"Per iteration, all GPUs: {t.count:,} "
            f"{'sends, receives and embedding all-reduces' if embedding else 'sends and receives'}, "
            f"{volume(t.bytes_sent)} sent. "
            f"Counted as megatron-core's {schedule} schedule issues them; "
            + (
                "overlapped with compute (overlap_p2p_comm)."
                if analysis.job.parallel.overlap_p2p_comm
                else "not overlapped with compute."
            ),
            style="dim",
        )
    )
    return Group(*lines)


# ----------------------------------------------------------------------------- data parallel


_WHEN = {
    "forward": "first forward",
    "backward": "backward",
    "grad sync": "gradient sync",
    "optimizer": "optimizer step",
}


def build_dp_section(analysis) -> Group | None:
    """The once-per-iteration collectives (data parallel and the small statistics), per stage;
    consecutive stages with the same rows are shown once."""
    world, jc = analysis.world, analysis.comm
    blocks = []
    for ra in analysis.roles:
        comm = ra.comm
        merged: dict[tuple, list] = {}
        for it in comm.items:
            if it.dimension in ("dp", "other"):
                key = (it.op, it.group, len(it.ranks), it.dtype, it.phase, it.overlapped)
                merged.setdefault(key, []).append(it)
        rows = tuple(
            (
                op(name),
                f"{group} ({n})",
                f"{sum(it.count for it in items):,}",
                f"{volume(sum(it.count * it.message for it in items))} {DTYPE_SHORT.get(dtype, dtype)}",
                volume(sum(it.count * it.sent for it in items)),
                _WHEN.get(phase, phase),
                overlapped or "—",
            )
            for (name, group, n, dtype, phase, overlapped), items in merged.items()
        )
        if blocks and blocks[-1][1] == rows:
            blocks[-1][0].append(ra.role.pp_stage)
        elif rows:
            blocks.append(([ra.role.pp_stage], rows))
    if not blocks:
        return None
    table = _table(
        "Stages", "Collective", "Group", "Calls", "Message", "Sent/GPU", "When", "Overlapped with"
    )
    for stages, rows in blocks:
        for i, row in enumerate(rows):
            table.add_row(layer_span(stages) if i == 0 else "", *row)
    t = jc.cluster["dp"]
    if world.dp * world.layout.cp == 1:
        return Group(
            table,
            Text(
                "No data parallelism: no gradient reduction; the gradient norm's all-reduce remains.",
                style="dim",
            ),
        )
    lines = [Text(f"Data-parallel groups: {groups_line(world, world.groups('dp_cp'))}")]
    tr = analysis.job.training
    if world.instances > 1 and tr.megatron_fsdp and tr.fsdp_outer_sharding_strategy == "optim":
        lines.append(
            Text(
                f"Megatron-FSDP's hybrid sharding in {world.instances} instances: parameters and "
                f"gradients sharded over the {world.dp * world.layout.cp // world.instances} ranks "
                f"of an instance and gathered and reduced within intra_dp_cp groups "
                f"{groups_line(world, world.groups('intra_dp_cp'))}; the optimizer state sharded "
                f"over all {world.dp * world.layout.cp} ranks (outer optim): gradient shards "
                "reduce-scattered in the last micro-batch and parameter shards all-gathered in the "
                "first across the instances in inter_dist_opt groups "
                f"{groups_line(world, world.groups('inter_dist_opt'))}"
            )
        )
    elif world.instances > 1:
        lines.append(
            Text(
                f"Distributed optimizer in {world.instances} instances, each sharding the optimizer "
                f"state over {world.dp * world.layout.cp // world.instances} ranks: gradients "
                f"reduce-scattered and parameters all-gathered in intra_dp_cp groups "
                f"{groups_line(world, world.groups('intra_dp_cp'))} (expert buckets in intra_edp), "
                f"each shard all-reduced across the instances in inter_dist_opt groups "
                f"{groups_line(world, world.groups('inter_dist_opt'))}"
            )
        )
    return Group(
        table,
        *lines,
        Text(
            f"Per iteration, all GPUs: {t.count:,} data-parallel collectives, "
            f"{volume(t.bytes_sent)} sent. Calls: DDP's gradient buckets (reduce-scatter with "
            "the distributed optimizer, all-reduce without), its parameter all-gathers, and "
            "the small all-reduces of the gradient norm (other groups) and of the loss; "
            "Message: summed over the calls.",
            style="dim",
        ),
    )


# ----------------------------------------------------------------------------- TP / CP / EP


def _layer_rows(items):
    return tuple(
        (it.module, it.phase, it.op, message(it), it.count, it.layers, it.per_microbatch)
        for it in sorted(
            items,
            key=lambda i: (not i.per_microbatch, i.phase != "forward", i.phase, i.module, i.op),
        )
    )


def build_model_dim_section(analysis, dim: str) -> Group | None:
    """Collectives issued inside the model steps (TP/SP, CP or EP), per module, per layer and
    per micro-batch; roles with the same rows are shown once."""
    job, world, jc = analysis.job, analysis.world, analysis.comm
    mb = job.num_microbatches
    blocks, prev = [], None
    for ra in analysis.roles:
        items = [it for it in ra.comm.items if it.dimension == dim and it.per_microbatch]
        if not items:
            continue
        rows = _layer_rows(items)
        if prev is not None and prev[0] == rows:
            prev[1].append(ra.role.pp_stage)
            continue
        prev = (rows, [ra.role.pp_stage], items)
        blocks.append(prev)
    if not blocks:
        return None
    parts = []
    for _rows, stages, items in blocks:
        title = (
            f"stage {stages[0]}" if len(stages) == 1 else f"stages {layer_span(stages)} (identical)"
        )
        table = _table("Module", "Phase", "Collective", "Message", "Per layer", "Per µb", "Sent/µb")
        order = {"forward": 0, "recompute": 1, "backward": 2}
        for it in sorted(items, key=lambda i: order.get(i.phase, 3)):
            per_mb = it.count // mb
            table.add_row(
                Text(it.module.removeprefix("decoder.")),
                PHASE_SHORT.get(it.phase, it.phase),
                op(it.op),
                Text(message(it)),
                f"{per_mb // it.layers}" if it.layers else "",
                f"{per_mb:,}",
                volume(per_mb * it.sent),
            )
        calls = sum(it.count for it in items) // mb
        sent = sum(it.count * it.sent for it in items) // mb
        layers = max((it.layers for it in items), default=0)
        in_layers = [it for it in items if it.layers]
        per_layer = ""
        if in_layers and layers:
            per_layer = (
                f"; per layer {sum(it.count for it in in_layers) // mb // layers} calls, "
                f"{volume(sum(it.count * it.sent for it in in_layers) / mb / layers)}"
            )
        parts += [
            Text(
                f"{title.capitalize()}: per micro-batch {calls:,} calls, {volume(sent)} sent per "
                f"GPU{per_layer}; per iteration ({mb} micro-batches) {calls * mb:,} calls, "
                f"{volume(sent * mb)}.",
                style="bold",
            ),
            table,
        ]
    once = {}
    for ra in analysis.roles:
        for it in ra.comm.items:
            if it.dimension == dim and not it.per_microbatch:
                once.setdefault(
                    (it.op, it.group, len(it.ranks), PHASE_SHORT.get(it.phase, it.phase)), []
                ).append((ra.role.pp_stage, it))
    for (name, group, n, phase), found in once.items():
        stages = sorted({s for s, _ in found})
        calls = sorted({it.count for _, it in found})
        times = "Once" if calls == [1] else "/".join(str(c) for c in calls) + " times"
        parts.append(
            Text(
                f"{times} per iteration ({phase}), stage{'s' if len(stages) > 1 else ''} "
                f"{layer_span(stages)}: {op(name)} over {group} ({n}) of "
                + ", ".join(sorted({message(it) for _, it in found}))
                + (
                    " (gradients of the layer norms, replicated under sequence parallel)"
                    if dim == "tp" and phase == "grad sync"
                    else ""
                )
            )
        )
    group_kind = {"tp": "tp", "cp": "cp", "ep": "ep"}[dim]
    t = jc.cluster[dim]
    parts += [
        Text(f"Groups: {groups_line(world, world.groups(group_kind))}"),
        Text(
            f"Per iteration, all GPUs: {t.count:,} calls, {volume(t.bytes_sent)} sent.", style="dim"
        ),
    ]
    if dim == "tp":
        parts.append(
            Text(
                "Module (model): the vocabulary-parallel cross entropy's all-reduces; (step): "
                "Megatron-LM's batch broadcast from the first tensor-parallel rank.",
                style="dim",
            )
        )
    return Group(*parts)


def dimension_title(job, dim: str) -> str:
    par = job.parallel
    if dim == "tp":
        sp = " with sequence parallel" if par.sequence_parallel else ""
        return f"Tensor parallel{sp} (tp {par.tp}), per GPU"
    if dim == "cp":
        return f"Context parallel (cp {par.cp}, {par.cp_comm_type}), per GPU"
    if dim == "ep":
        return f"Expert parallel (ep {par.ep}), per GPU"
    if dim == "dp" and par.dp * par.cp == 1:
        return "Once per iteration (no data parallelism)"
    if dim == "dp":
        return (
            f"Data parallel (dp {par.dp}{f' × cp {par.cp}' if par.cp > 1 else ''}), per iteration"
        )
    return f"Pipeline parallel (pp {par.pp}{f', vpp {par.vpp}' if par.vpp else ''}), per iteration"


def render_comm(analysis, console, *, dim: str | None = None) -> None:
    """The communication sections of an Analysis whose iterations were traced."""
    job = analysis.job
    console.print(
        section(
            f"Communication per iteration ({job.num_microbatches} micro-batches, "
            f"{analysis.world.size:,} GPUs)"
        )
    )
    console.print(build_comm_summary(job, analysis.comm))
    timing_line = build_timing_line(analysis)
    if timing_line is not None:
        console.print(timing_line)
    builders = {
        "tp": lambda: build_model_dim_section(analysis, "tp"),
        "cp": lambda: build_model_dim_section(analysis, "cp"),
        "ep": lambda: build_model_dim_section(analysis, "ep"),
        "pp": lambda: build_pp_section(analysis),
        "dp": lambda: build_dp_section(analysis),
    }
    for name in [dim] if dim else ["tp", "cp", "ep", "pp", "dp"]:
        body = builders[name]()
        if body is None:
            if dim:
                console.print(section(dimension_title(job, name)))
                console.print(
                    Text(f"No {DIM_NAMES[name]} communication in this layout.", style="dim")
                )
            continue
        console.print(section(dimension_title(job, name)))
        console.print(body)


# ----------------------------------------------------------------------------- groups


GROUP_TITLES = {
    "tp": "tensor",
    "cp": "context",
    "dp": "data",
    "pp": "pipeline",
    "ep": "expert",
    "etp": "expert tensor",
    "edp": "expert data",
    "mp": "model: tp × pp",
    "dp_cp": "data × context: DDP",
    "tp_cp": "tensor × context",
    "embedding": "first + last stage",
    "intra_dp_cp": "dp × cp of one optimizer instance",
    "intra_edp": "expert dp of one optimizer instance",
    "inter_dist_opt": "same shard across instances",
    "dist_opt": "every GPU of one optimizer instance",
}


def build_groups(world, *, rank: int | None = None, limit: int | None = 16) -> FitTable:
    """Every kind of group as megatron-core forms it; with `rank`, only that rank's groups."""
    table = _table("Kind", "Groups", "Size", "Cross nodes", "Groups (GPUs)")
    for kind in world.kinds():
        groups = world.groups(kind)
        if rank is not None:
            shown = [g for g in groups if rank in g]
            if not shown:
                continue
        elif max(len(g) for g in groups) == 1:
            shown = []  # a group of one per rank: nothing to list
        else:
            shown = groups if limit is None else groups[:limit]
        lines = [
            f"{compact(g)} {gpu_list(world, g, limit=16)}"
            if len(g) <= 16
            else f"{rank_span(g)}: {gpu_list(world, g)}"
            for g in shown
        ] or ["every rank alone"]
        if shown and len(shown) < len(groups) and rank is None:
            lines.append(f"… {len(groups) - len(shown):,} more (--all lists every group)")
        table.add_row(
            f"{kind} ({GROUP_TITLES[kind]})",
            f"{len(groups):,}",
            "/".join(str(n) for n in sorted({len(g) for g in groups})),
            f"{sum(world.crosses_nodes(g) for g in groups):,}",
            Text("\n".join(lines)),
        )
    return table
