"""Rendering of `metatrace plan`: the search in numbers, the best layouts, why each wins and
what it costs (formatting only; figures from metatrace.planning.plan)."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from metatrace.analysis.margins import ErrorBand
from metatrace.analysis.timing import Breakdown
from metatrace.config.megatron.to_args import command_lines, megatron_command
from metatrace.render.fit import FitTable
from metatrace.render.format import DIM_TITLES, seconds, section, size, time_terms


def build_search(result) -> Text:
    fit = sum(t.fits for t in result.traced)
    return Text(
        f"{result.layouts:,} layouts enumerated: {result.invalid:,} refused by Megatron's rules, "
        f"{result.pruned_memory:,} cannot fit (memory lower bound above the GPU), "
        f"{len(result.traced)} traced ({fit} fit), {len(result.dominated):,} dominated by a "
        f"traced layout that fits, {result.outgrown:,} holding more than a traced layout that "
        f"does not fit (or only within the error band), {result.represented:,} variants of degrees already shown, "
        f"{result.untraced:,} not traced (estimated slower, or beyond the trace budget).",
        style="dim",
    )


def layout_cell(lay) -> str:
    """A layout in the table's column: its degrees and micro-batch size, then what departs
    from the planner's usual (recompute; no distributed optimizer where data parallelism
    could shard it; no sequence parallelism with tp > 1): "tp2 pp8 vpp10 dp16 mbs1 sel"."""
    parts = [f"tp{lay.tp}", f"pp{lay.pp}"] + ([f"vpp{lay.vpp}"] if lay.vpp else [])
    parts += [f"cp{lay.cp}"] if lay.cp > 1 else []
    parts += [f"ep{lay.ep}"] if lay.ep > 1 else []
    parts += [f"dp{lay.dp}", f"mbs{lay.mbs}"]
    parts += {"selective": ["sel"], "full": ["full"]}.get(lay.recompute, [])
    parts += ["no-DO"] if lay.dp * lay.cp > 1 and not lay.distributed_optimizer else []
    parts += ["no-SP"] if lay.tp > 1 and not lay.sp else []
    return " ".join(parts)


def build_best(result, top: int) -> Group:
    """The layouts that fit, best first, one line each at 80 columns; what the layout column
    abbreviates below it."""
    table = FitTable()
    table.add_column("#")
    table.add_column("Layout", "name")
    for header in ("Iteration", "Bubble", "Exposed comm", "Peak", "Headroom"):
        table.add_column(header)
    ranked = result.ranked()[:top]
    for i, t in enumerate(ranked, 1):
        table.add_row(
            str(i),
            layout_cell(t.candidate.layout),
            seconds(t.estimate.seconds),
            f"{t.estimate.bubble:.1%}",
            seconds(t.estimate.comm),
            size(t.peak),
            Text(size(t.headroom), style="yellow" if t.within_error else ""),
        )
    lays = [t.candidate.layout for t in ranked]
    notes = ["Layout: parallel degrees, micro-batch size (mbs)"]
    if any(lay.recompute != "none" for lay in lays):
        notes.append("sel / full: selective or full recompute")
    marked = [m for m in ("no-DO", "no-SP") if any(m in layout_cell(lay) for lay in lays)]
    notes.append(
        "each runs sequence parallel where tp > 1 and the distributed optimizer where "
        "dp × cp > 1" + (f", but those marked {' or '.join(marked)}" if marked else "")
    )
    return Group(table, Text("; ".join(notes) + ".", style="dim"))


def _exposed(report: dict) -> str:
    """The slowest rank's exposed seconds per dimension."""
    worst = max(
        report["roles"], key=lambda r: sum(d["exposed_seconds"] for d in r["comm"].values())
    )
    parts = [
        f"{DIM_TITLES[d]} {seconds(v['exposed_seconds'])}"
        for d, v in worst["comm"].items()
        if v["exposed_seconds"] >= 1e-4
    ]
    return ", ".join(parts) or "none"


def build_reasons(result, top: int) -> Group:
    """Why each layout ranks where it does and what it costs."""
    ranked = result.ranked()[:top]
    lines = []
    for i, t in enumerate(ranked, 1):
        lay, est = t.candidate.layout, t.estimate
        if i == 1:
            why = "fastest estimated iteration of the layouts that fit"
        else:
            first = ranked[0].estimate
            why = (
                f"{est.seconds / first.seconds - 1:+.1%} time against #1 ("
                + ", ".join(
                    p
                    for p in (
                        f"bubble {est.bubble:.1%} vs {first.bubble:.1%}"
                        if abs(est.bubble - first.bubble) > 1e-3
                        else "",
                        f"exposed comm {seconds(est.comm)} vs {seconds(first.comm)}"
                        if abs(est.comm - first.comm) > 1e-3
                        else "",
                        f"compute {seconds(est.compute)} vs {seconds(first.compute)}"
                        if abs(est.compute - first.compute) > 1e-3
                        else "",
                    )
                    if p
                )
                + ")"
            )
        cost = (
            f"peak {size(t.peak)}, headroom {size(t.headroom)}; exposed communication: "
            f"{_exposed(t.report)}"
        )
        band = t.report["memory_verdict"]["error_band"]
        if t.within_error:
            phrase = ErrorBand(band["kind"], band["fraction"], band["source"]).phrase()
            cost += f" (within {phrase}, {size(band['bytes'])}: it may not fit)"
        if lay.recompute != "none":
            cost += f"; {lay.recompute} recompute adds compute"
        lines.append(Text.assemble((f"#{i} ", "bold"), (lay.describe(), "bold"), f": {why}."))
        timing = t.report.get("timing")
        if timing:
            terms = Breakdown.from_json(timing["breakdown"]).terms()
            lines.append(Text(f"   time: {time_terms(terms, timing['iteration_seconds'])}."))
        lines.append(Text(f"   costs {cost}.", style="dim"))
    edge = [t for t in result.ranked()[top:] if t.within_error]
    if edge:
        band = edge[0].report["memory_verdict"]["error_band"]
        phrase = ErrorBand(band["kind"], band["fraction"], band["source"]).phrase()
        lines.append(
            Text(
                f"Traced and fitting only within {phrase} (ranked after): "
                + "; ".join(
                    f"{t.candidate.layout.describe()} ({seconds(t.estimate.seconds)}, headroom "
                    f"{size(t.headroom)})"
                    for t in edge[:4]
                )
                + ("; …" if len(edge) > 4 else ""),
                style="dim",
            )
        )
    misses = [t for t in result.traced if not t.fits]
    if misses:
        lines.append(
            Text(
                "Traced and out of memory: "
                + "; ".join(f"{t.candidate.layout.describe()} ({size(t.peak)})" for t in misses[:6])
                + ("; …" if len(misses) > 6 else ""),
                style="dim",
            )
        )
    return Group(*lines)


def build_commands(best, config_path: str | None, width: int | None = None) -> Group:
    """How to run the recommended layout: `metatrace run` on the written job file, and torchrun
    with every Megatron-LM flag of the job (one subject a line, continued with backslashes,
    broken between words at `width`), after comment lines on its data and on what no flag
    gives."""
    lines = []
    if config_path:
        lines.append(Text(f"metatrace run --config {config_path}"))
    for line in command_lines(megatron_command(best.candidate.job), width):
        lines.append(Text(line, style="dim" if line.startswith("#") else ""))
    return Group(*lines)


def render_plan(
    job, num_gpus: int, result, console, *, top: int, config_path: str | None = None
) -> None:
    """The plan; `config_path`: where the job file of #1 was written (--write-config)."""
    cl, tr = job.cluster, job.training
    console.print(
        section(
            f"Layouts of {job.source} on {num_gpus:,} × {cl.gpu} ({cl.gpu_memory_gib:g} GiB"
            + (f", {cl.reserved_overhead_gib:g} GiB kept free" if cl.reserved_overhead_gib else "")
            + f"), sequence {tr.seq_length:,}, "
            f"global batch {tr.global_batch_size:,}"
        )
    )
    console.print(build_search(result))
    if not result.ranked():
        console.print(Text("No layout fits.", style="bold red"))
        return
    console.print(build_best(result, top))
    console.print(build_reasons(result, top))
    best = result.ranked()[0]
    efficiency = best.candidate.job.cluster.compute_efficiency
    rates = (
        "each kernel at its modelled rate for its shape (smaller GEMMs and attention over "
        "shorter sequences, as micro-batch 1 or context parallelism make them, run at a lower "
        "fraction of peak)"
        if efficiency is None
        else f"its FLOPs at {efficiency:.0%} of the GPU's peak FLOP/s whatever their shape"
    )
    console.print(
        Text(
            f"Iteration: the time model of each traced layout ({rates}; the pipeline schedule "
            "simulated; exposed communication at link bandwidth; what Megatron overlaps inside "
            "a step hidden as far as the kernels beside it last: the context-parallel ring the "
            "attention's, TP userbuffers the step's other kernels).",
            style="dim",
        )
    )
    console.print(section(f"Run #1: {best.candidate.layout.describe()}"))
    console.print(build_commands(best, config_path, console.width), soft_wrap=True)
