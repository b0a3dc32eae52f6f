"""The answer first: what `metatrace run` prints before anything else, on one screen of 80
columns: the job in a line, the verdict, each pipeline stage's peak and headroom, the estimated
iteration time, the communication per parallel dimension, and what the figures assume or leave
out. Everything comes from the Analysis (metatrace.analysis.analyze); formatting only.

Every table here fits 80 columns with its numbers whole: few columns, short headers, numbers
never wrapped (only the "Peaks in" column and prose wrap).
"""

from __future__ import annotations

import dataclasses
import os

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from metatrace.analysis.timing import breakdown, describe_rates
from metatrace.render.format import (
    DIM_TITLES,
    PHASE_SHORT,
    layer_span,
    rank_span,
    seconds,
    size,
    volume,
    where_it_goes,
)


def count(n: int) -> str:
    """A parameter count, short: 6.74 B, 437.1 M, 205,120."""
    if n >= 1e9:
        return f"{n / 1e9:,.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:,.1f} M"
    return f"{n:,}"


def model_name(job) -> str:
    m = job.model
    if m.preset:
        return m.preset
    if m.hf_config:  # a repo's config.json: the repo's name
        path = os.path.normpath(m.hf_config)
        head, tail = os.path.split(path)
        return os.path.basename(head) if tail == "config.json" and head else tail
    return f"{m.num_layers}-layer GPT"


def build_job_line(analysis) -> Text:
    """The job: model, parameters, precision and GPUs on a line; the parallel layout and the
    batch on the next (wrapped as prose where longer, the layout first so that it stays whole)."""
    job = analysis.job
    par, tr, cl = job.parallel, job.training, job.cluster
    params = f"{count(analysis.total_params)} parameters"
    if analysis.active_params != analysis.total_params:
        params += f" ({count(analysis.active_params)} active)"
    vpp = f" · vpp {par.vpp}" if par.vpp else ""
    etp = f" · etp {par.etp}" if job.model.num_experts and par.etp != par.tp else ""
    text = Text(model_name(job), style="bold")
    text.append(
        f", {params}, {tr.precision}, on {cl.num_gpus:,} × {cl.gpu} ({cl.gpu_memory_gib:g} GiB)\n"
        f"tp {par.tp} · pp {par.pp}{vpp} · cp {par.cp} · ep {par.ep}{etp} · dp {par.dp} · "
        f"seq {tr.seq_length:,} · micro-batch {tr.micro_batch_size} · global batch "
        f"{tr.global_batch_size:,}"
    )
    return text


def where(at, chunks: int) -> str:
    """Where a stage peaks, short: "bwd µb 0, layers.15.mlp", "fwd µb 3 chunk 1, layers.2.mlp"
    (the chunk named once, not again as the module path's "chunk1."), "optimizer step"."""
    if at.phase == "optimizer":
        return "optimizer step"
    text = PHASE_SHORT.get(at.phase, at.phase)
    if at.microbatch is not None:
        text += f" µb {at.microbatch}"
    module = at.module or "model"
    if at.chunk is not None and chunks > 1:
        text += f" chunk {at.chunk}"
        chunk = f"chunk{at.chunk}"
        module = "model" if module == chunk else module.removeprefix(chunk + ".")
    return f"{text}, {module.removeprefix('decoder.')}"


def signed(nbytes: int) -> str:
    return size(nbytes) if nbytes >= 0 else f"-{size(-nbytes)}"


def build_stage_table(analysis) -> Group:
    """One row per pipeline stage: its ranks, layers, parameters per GPU, and (with the
    iteration traced) peak, headroom, micro-batches in flight at the peak and where it peaks."""
    v = analysis.verdict
    # Collapsed padding (two spaces between columns, not three) leaves "Peaks in" room at 80.
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    columns = [("Stage", "right"), ("Ranks", "left"), ("Layers", "left"), ("Params", "right")]
    if v is not None:
        columns += [("Peak", "right"), ("Headroom", "right"), ("µb", "right")]
    for col, just in columns:
        table.add_column(col, justify=just, no_wrap=True)
    if v is not None:
        table.add_column("Peaks in", overflow="fold")
    for ra in analysis.roles:
        row = [
            str(ra.role.pp_stage),
            rank_span(ra.role.ranks),
            layer_span(ra.summary.layers),
            count(ra.summary.params),
        ]
        m = ra.memory
        if v is not None and m is not None:
            room = ra.device.fit[1]
            row += [
                Text(size(m.peak), style="bold"),
                Text(signed(room), style="" if room >= 0 else "red"),
                str(m.inflight),
                where(m.peak_at, len(ra.traced.chunks)),
            ]
        table.add_row(*row)
    if v is None:
        return Group(table)
    return Group(
        table,
        Text(
            f"µb: micro-batches in flight at the peak, of {analysis.job.num_microbatches:,} per "
            "iteration.",
            style="dim",
        ),
    )


def build_timing(analysis) -> Text:
    """The estimated iteration time and pipeline bubble, or why there is none."""
    t, job = analysis.timing, analysis.job
    if t is None:
        return Text(
            f"Iteration time not estimated: metatrace does not know the peak FLOP/s of "
            f"cluster.gpu {job.cluster.gpu!r}.",
            style="dim",
        )
    par = job.parallel
    schedule = (
        "no pipeline"
        if par.pp == 1
        else (f"interleaved 1F1B, vpp {par.vpp}" if par.vpp else "1F1B")
    )
    text = Text(
        f"Estimated iteration time {seconds(t.iteration_seconds)}, pipeline bubble "
        f"{t.bubble_fraction:.1%}",
        style="bold",
    )
    text.append(
        f" ({schedule}; {describe_rates(t.efficiency, t.peak_tflops)}, "
        "plus the exposed communication below"
    )
    if t.dp_exposed_seconds > 0:
        text.append(
            f", and {seconds(t.dp_exposed_seconds)} of overlapped data-parallel parameter "
            "gathering and gradient reduction outlasting the steps beside them"
        )
    text.append(")")
    # Host-bound iterations say so here, the GPU's wait as a term (docs/figures.md, "Time
    # model"); --detail adds the host's kernels, synchronisations and work.
    line = where_it_goes(breakdown(t), t.iteration_seconds, len(t.stages) > 1)
    text.append(f"\n{line}", style="")
    return text


def build_comm_table(analysis) -> Table:
    """Per parallel dimension, one iteration: bytes sent by all GPUs, of them across nodes,
    and the slowest GPU's wire time and the part of it not overlapped with compute."""
    jc = analysis.comm
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for col, just in (
        ("Communication", "left"),
        ("Sent", "right"),
        ("Across nodes", "right"),
        ("Time/GPU", "right"),
        ("Exposed", "right"),
    ):
        table.add_column(col, justify=just, no_wrap=True)
    for dim, t in jc.cluster.items():
        if t.count:
            table.add_row(
                DIM_TITLES[dim],
                volume(t.bytes_sent),
                volume(t.inter),
                seconds(t.seconds),
                seconds(t.exposed_seconds),
            )
    total = jc.total
    table.add_row(
        Text("Total", style="bold"),
        volume(total.bytes_sent),
        volume(total.inter),
        seconds(total.seconds),
        Text(seconds(total.exposed_seconds), style="bold"),
    )
    return table


def build_assumptions(analysis) -> Text:
    """What the figures assume, in a sentence, and the configuration's warnings."""
    job = analysis.job
    cl = job.cluster
    parts = [
        f"Sent: all GPUs per iteration; Time/GPU: the slowest GPU's. Assumed: NCCL rings, "
        f"{cl.intra_node_gbps:g} Gb/s per GPU inside a node, {cl.inter_node_gbps:g} Gb/s across nodes"
    ]
    if job.model.num_experts:
        from metatrace.config.routing import Routing

        parts.append(f"routing {Routing.of_job(job).describe()}")
    text = Text("; ".join(parts) + ".", style="dim")
    # Megatron-LM arguments metatrace does not model are in job.not_modelled (the verdict names
    # them); their warning note says the same and is not repeated.
    for note in job.notes:
        if note.startswith("warning") and not (job.not_modelled and "does not model" in note):
            text.append(f"\n{note[0].upper()}{note[1:]}", style="yellow")
    return text


def build_verdict(analysis) -> Text:
    from metatrace.analysis.memory import not_modelled_text
    from metatrace.export.report import verdict_report
    from metatrace.render.format import verdict_text

    job, v = analysis.job, analysis.verdict
    sentence = verdict_text(
        f"{job.cluster.gpu} ({job.cluster.gpu_memory_gib:g} GiB)", verdict_report(job, v)
    )
    text = Text(sentence, style="bold green" if v.fits else "bold red")
    if job.not_modelled:
        items = [dataclasses.asdict(n) for n in job.not_modelled]
        text.append("\n" + not_modelled_text(items), style="bold yellow")
    return text


def build_verdict_advice(analysis, advice: dict) -> Group:
    """The advice under the verdict (metatrace.render.advice)."""
    from metatrace.export.report import verdict_report
    from metatrace.render.advice import build_advice

    return build_advice(advice, verdict_report(analysis.job, analysis.verdict))


def build_run_summary(analysis, advice: dict | None = None) -> Group:
    """The summary `metatrace run` prints first (see the module docstring); `advice`: the
    report's advice (metatrace.export.advice), printed after the verdict."""
    parts: list = [build_job_line(analysis)]
    if analysis.verdict is not None:
        parts.append(build_verdict(analysis))
    if advice is not None:
        parts += [Text(), build_verdict_advice(analysis, advice)]
    parts += [Text(), build_stage_table(analysis)]
    if analysis.iterations:
        parts += [Text(), build_timing(analysis), Text(), build_comm_table(analysis)]
        parts.append(build_assumptions(analysis))
    return Group(*parts)


def build_comm_overview(analysis) -> Group:
    """`metatrace comm --summary`: the job, the iteration time and the table per dimension."""
    return Group(
        build_job_line(analysis),
        Text(),
        build_timing(analysis),
        Text(),
        build_comm_table(analysis),
        build_assumptions(analysis),
    )
