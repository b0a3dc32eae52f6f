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
import re

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from metatrace.analysis.timing import breakdown, describe_rates
from metatrace.render.fit import FirstThatFits, FitTable, Joined
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

IGNORED = re.compile(r"\bignored\b|\bnothing without\b")
"""A note about an option the job is described without: it acts only with another one that is
not given (resolve's and the Megatron-LM reader's wording). Shown with the summary, not only
with --detail: nothing the user gave is ignored silently."""


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
    if m.hybrid_layer_pattern is not None:
        return f"{m.num_layers}-layer hybrid"
    return f"{m.num_layers}-layer GPT"


def recompute_text(rec) -> str | None:
    """Activation recompute in words (None: none)."""
    if rec.granularity == "full":
        return f"full recompute ({rec.method}, {rec.num_layers} layers)"
    if rec.granularity == "selective":
        return f"selective recompute ({', '.join(rec.modules)})"
    return None


def fsdp_text(tr) -> str | None:
    """Megatron-FSDP and its sharding (None: DDP)."""
    if not tr.megatron_fsdp:
        return None
    hsdp = (
        f" (HSDP: {tr.num_distributed_optimizer_instances} instances, outer "
        f"{tr.fsdp_outer_sharding_strategy})"
        if tr.num_distributed_optimizer_instances > 1
        else ""
    )
    return f"Megatron-FSDP {tr.fsdp_sharding_strategy}{hsdp}"


def offload_texts(tr) -> list[str]:
    """Activation and optimizer offloading to the host."""
    out = []
    if tr.cpu_offloading_num_layers:
        out.append(f"first {tr.cpu_offloading_num_layers} layers' activations offloaded")
    if tr.activation_offload_modules:
        out.append(f"offloading {', '.join(tr.activation_offload_modules)}")
    if tr.optimizer_cpu_offload:
        fraction = tr.optimizer_offload_fraction
        out.append("optimizer CPU offload" + (f" ({fraction:.0%})" if fraction < 1 else ""))
    return out


def graphs_text(tr) -> str | None:
    """CUDA graphs and what they capture (None: none)."""
    if tr.local_layer_graphs:
        return "megatron-core's CUDA graphs of whole layers"
    if tr.cuda_graph_impl == "local":
        return "CUDA graph of the whole iteration"
    if tr.cuda_graph_impl == "transformer_engine":
        what = " and ".join(tr.cuda_graph_scope or []) or "whole layers"
        return f"TE's CUDA graphs of {what}"
    return None


def precision_text(tr) -> str | None:
    """The FP8 or FP4 recipe (None: neither)."""
    if tr.precision == "fp8":
        text = f"FP8 {tr.fp8_recipe or 'delayed'} scaling ({tr.fp8_format or 'hybrid'})"
        text += ", FP8 parameters" if tr.fp8_param_gather else ""
    elif tr.precision == "fp4":
        text = f"FP4 {tr.fp4_recipe or 'nvfp4'}"
    else:
        return None
    if tr.first_last_layers_bf16:
        text += (
            f", first {tr.num_layers_at_start_in_bf16} and last "
            f"{tr.num_layers_at_end_in_bf16} layers in bf16"
        )
    return text


def in_effect(job) -> list[str]:
    """What shapes memory or time beyond the layout and batch: sequence parallelism, the
    optimizer and its sharding, recompute, offloading, CUDA graphs, TP overlap, the FP8 or FP4
    recipe, the MoE dispatcher."""
    par, tr = job.parallel, job.training
    out = ["sequence parallel"] if par.sequence_parallel else []
    if tr.megatron_fsdp:
        out.append(fsdp_text(tr) or "")
    elif tr.distributed_optimizer:
        instances = tr.num_distributed_optimizer_instances
        out.append("distributed optimizer" + (f" ({instances} instances)" if instances > 1 else ""))
    if tr.use_precision_aware_optimizer:
        out.append("precision-aware optimizer")
    out += [t for t in (recompute_text(tr.recompute), precision_text(tr)) if t]
    out += offload_texts(tr)
    out += [t for t in (graphs_text(tr),) if t]
    if par.tp_comm_overlap:
        out.append("TP overlap (userbuffers)")
    if job.model.num_experts:
        dispatcher = par.moe_token_dispatcher_type
        if dispatcher == "flex":
            dispatcher += f" ({par.moe_flex_dispatcher_backend})"
        out.append(f"{dispatcher} dispatcher")
        if par.overlap_moe_expert_parallel_comm:
            out.append("EP overlap")
    return out


def build_job_line(analysis) -> Group:
    """The job: model, parameters, precision and GPUs on a line; the parallel layout and the
    batch on the next; what else is in effect (`in_effect`) on a third; each broken between
    its items where longer than the width."""
    job = analysis.job
    par, tr, cl = job.parallel, job.training, job.cluster
    params = f"{count(analysis.total_params)} parameters"
    if analysis.active_params != analysis.total_params:
        params += f" ({count(analysis.active_params)} active)"
    layout = [f"tp {par.tp}", f"pp {par.pp}"] + ([f"vpp {par.vpp}"] if par.vpp else [])
    layout += [f"cp {par.cp}", f"ep {par.ep}"]
    layout += [f"etp {par.etp}"] if job.model.num_experts and par.etp != par.tp else []
    layout += [
        f"dp {par.dp}",
        f"seq {tr.seq_length:,}",
        f"micro-batch {tr.micro_batch_size}",
        f"global batch {tr.global_batch_size:,}",
    ]
    head = [
        Text(model_name(job), style="bold"),
        params,
        tr.precision,
        f"on {cl.num_gpus:,} × {cl.gpu} ({cl.gpu_memory_gib:g} GiB)",
    ]
    if analysis.traced.megatron_core:
        head.append(f"megatron-core {analysis.traced.megatron_core}")
    parts = [Joined(head, ", "), Joined(layout)]
    features = in_effect(job)
    if features:
        parts.append(Joined(features))
    return Group(*parts)


def peak_step(at, chunks: int) -> str:
    """The step a stage peaks in, short: "bwd µb 0", "fwd µb 3 c1" (model chunk 1),
    "optimizer step"."""
    if at.phase == "optimizer":
        return "optimizer step"
    text = PHASE_SHORT.get(at.phase, at.phase)
    if at.microbatch is not None:
        text += f" µb {at.microbatch}"
    if at.chunk is not None and chunks > 1:
        text += f" c{at.chunk}"
    return text


def peak_module(at, chunks: int) -> str | None:
    """The module a stage peaks in, short: "layers.15.mlp" (the chunk, named by `peak_step`,
    and "decoder." left out), "model" outside every submodule; None in the optimizer step."""
    if at.phase == "optimizer":
        return None
    module = at.module or "model"
    if at.chunk is not None and chunks > 1:
        chunk = f"chunk{at.chunk}"
        module = "model" if module == chunk else module.removeprefix(chunk + ".")
    return module.removeprefix("decoder.")


def stage_layers(layers) -> str:
    """A stage's layers, at most 12 columns where it can: "1-16", "1, 32-33"; an interleaved
    stage's many runs as the first and the last ("1-4 … 65-68")."""
    span = layer_span(layers)
    runs = span.split(", ")
    return span if len(span) <= 12 or len(runs) < 3 else f"{runs[0]} … {runs[-1]}"


def signed(nbytes: int) -> str:
    return size(nbytes) if nbytes >= 0 else f"-{size(-nbytes)}"


def build_stage_table(analysis):
    """One row per pipeline stage: its ranks, layers, parameters per GPU, and (with the
    iteration traced) peak, headroom, micro-batches in flight at the peak and where it peaks:
    the step and the module ("bwd µb 0, layers.15.mlp") where that fits the width with every
    cell on one line, else the step in the table and the modules below it."""
    v = analysis.verdict
    rows, steps, modules = [], [], []
    for ra in analysis.roles:
        row = [
            str(ra.role.pp_stage),
            rank_span(ra.role.ranks),
            stage_layers(ra.summary.layers),
            count(ra.summary.params),
        ]
        m = ra.memory
        if v is not None and m is not None:
            room = ra.device.fit[1]
            chunks = len(ra.traced.chunks)
            row += [
                Text(size(m.peak), style="bold"),
                Text(signed(room), style="" if room >= 0 else "red"),
                str(m.inflight),
            ]
            steps.append(peak_step(m.peak_at, chunks))
            modules.append(peak_module(m.peak_at, chunks))
        elif v is not None:
            row += [None] * 3
            steps.append(None)
            modules.append(None)
        rows.append(row)
    if v is None:
        return _stage_table(rows, None)
    chunked = any(s is not None and " c" in s for s in steps)
    legend = (
        f"µb: micro-batches in flight at the peak, of {analysis.job.num_microbatches:,} per "
        "iteration" + ("; c: the model chunk (virtual stage)." if chunked else ".")
    )
    wide = _stage_table(rows, [s if m is None else f"{s}, {m}" for s, m in zip(steps, modules)])
    narrow = _stage_table(rows, steps)
    where: dict[str, list[int]] = {}
    for ra, module in zip(analysis.roles, modules):
        if module is not None:
            where.setdefault(module, []).append(ra.role.pp_stage)
    below = legend
    if where:
        named = [
            f"{module} ({'stage' if len(stages) == 1 else 'stages'} {rank_span(stages)})"
            for module, stages in where.items()
        ]
        below = f"Modules at the peaks: {', '.join(named)}. {legend}"
    return FirstThatFits(
        (wide, Group(wide, Text(legend, style="dim"))),
        (narrow, Group(narrow, Text(below, style="dim"))),
    )


def _stage_table(rows, peaks_in) -> FitTable:
    table = FitTable()
    for header, kind in (("Stage", "number"), ("Ranks", "name"), ("Layers", "name")):
        table.add_column(header, kind)
    table.add_column("Params")
    if peaks_in is not None:
        for header in ("Peak", "Headroom", "µb"):
            table.add_column(header)
        table.add_column("Peaks in", "name")
    for row, at in zip(rows, peaks_in or [None] * len(rows)):
        table.add_row(*row, *([at] if peaks_in is not None else []))
    return table


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
        elif IGNORED.search(note):  # what the user gave and the job is described without
            text.append(f"\n{note}.", style="dim")
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
