"""The metatrace command line: one `cmd_x(args, console) -> exit code` per command.

Exit codes: 0 success, 2 bad input (a config, a flag, a file; one message, no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings

from metatrace import __version__
from metatrace.errors import ConfigError
from metatrace.interrupt import quiet_interrupts


def _positive_gib(text: str) -> float:
    """A GiB figure: a finite number above 0 (argparse names the flag when this raises)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and 0 < value < 2**31):
        raise argparse.ArgumentTypeError(f"{text!r} must be a number of GiB above 0")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with long words of its messages (a value the user gave, quoted back) cut to
    an excerpt."""

    def error(self, message: str):  # type: ignore[override]
        import re

        from metatrace.config.read import EXCERPT

        short = re.sub(rf"\S{{{EXCERPT},}}", lambda m: m.group(0)[: EXCERPT - 1] + "…", message)
        super().error(short)


WIDTH_HELP = "output width (default: the terminal's; piped, COLUMNS or 80; at least 40)"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="metatrace",
        description="Per-GPU memory and communication of a Megatron-Core training job, "
        "traced on the meta device.",
    )
    parser.add_argument("--version", action="version", version=f"metatrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def megatron_options(group, cluster: bool = True):
        """The options of Megatron-LM arguments; `cluster`: with --world-size, --gpu and
        --gpus-per-node (plan has its own)."""
        if cluster:
            group.add_argument(
                "--world-size",
                type=int,
                metavar="N",
                help="GPUs of the run (with Megatron-LM arguments); read from a training "
                "script's launcher line (torchrun, python -m torch.distributed.run, srun and "
                "#SBATCH, mpirun) where it has one, and then it must agree with that line",
            )
            group.add_argument(
                "--gpu", metavar="NAME", help="GPU model, e.g. h100, a100 (default h100)"
            )
            group.add_argument(
                "--gpus-per-node",
                type=int,
                metavar="N",
                help="default 8, or the launcher line's processes per node",
            )
        group.add_argument(
            "--env",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="an environment variable of the run (e.g. CUBLAS_WORKSPACE_CONFIG=:4096:8)",
        )
        group.add_argument(
            "--newer-megatron",
            metavar="RELEASE",
            help="the arguments are for Megatron-LM RELEASE, newer than the flags metatrace knows "
            "(core_v0.16.1, HEAD of 2026-08-22): its flags that no known release has are "
            "reported as not modelled instead of refused",
        )

    def job_sources(p, *, model: bool = False):
        """The job: a positional FILE, or one of --config, --megatron-args, --megatron-args-file
        (and for plan --model)."""
        p.add_argument(
            "job",
            nargs="?",
            metavar="FILE",
            help="the job: a job file (YAML) or a file of Megatron-LM arguments (a training "
            "script, one line, or a YAML {--flag: value} map); the same as --config FILE",
        )
        title = "--model, " if model else ""
        source = p.add_argument_group(
            f"the job (FILE or one of {title}--config, --megatron-args, --megatron-args-file)"
        )
        source.add_argument(
            "--config", metavar="FILE", help="job file (YAML), or a file of Megatron-LM arguments"
        )
        source.add_argument(
            "--megatron-args",
            metavar="ARGS",
            help="Megatron-LM pretrain_gpt.py arguments, quoted as one string",
        )
        source.add_argument(
            "--megatron-args-file",
            metavar="FILE",
            help="a file with them: one line, a training script, or a YAML {--flag: value} map",
        )
        return source

    def common(p, tree: bool = True, quiet: str = "no progress messages on stderr"):
        """The job's options; with `tree`, the module tree's (--depth, --expand)."""
        megatron_options(job_sources(p))
        if tree:
            p.add_argument("--depth", type=int, metavar="D", help="deepest module level shown")
            p.add_argument(
                "--expand", action="store_true", help="show identical layers and stages one by one"
            )
        else:
            p.set_defaults(depth=None)
        p.add_argument("--width", type=int, metavar="COLUMNS", help=WIDTH_HELP)
        p.add_argument("--quiet", "-q", action="store_true", help=quiet)

    run = sub.add_parser("run", help="trace every rank role and print the report")
    common(run, quiet="no progress on stderr; print only the verdict and its advice")
    shown = run.add_mutually_exclusive_group()
    shown.add_argument(
        "--summary",
        action="store_true",
        help="print only the summary (verdict, stages, iteration time, communication)",
    )
    shown.add_argument(
        "--detail",
        action="store_true",
        help="also print the configuration, the module trees and the communication sections "
        "(implied by --depth and --expand)",
    )
    run.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    run.add_argument(
        "--html", metavar="PATH", help="also write the report as a self-contained HTML page"
    )
    run.add_argument(
        "--memory-snapshot",
        metavar="PATH",
        help="also write the memory timeline of the rank with the highest peak as a PyTorch "
        "memory snapshot (pytorch.org/memory_viz); {stage} in PATH: one file per pipeline stage",
    )
    run.add_argument(
        "--chrome-trace",
        metavar="PATH",
        help="also write the estimated timeline of an iteration as a Chrome/Perfetto trace",
    )
    run.add_argument(
        "--no-full-model",
        action="store_true",
        help="skip tracing the unparallelised model (its tree is not shown)",
    )
    run.add_argument(
        "--max-mbs",
        action="store_true",
        help="find the largest micro-batch size that fits (the global batch stays)",
    )
    run.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="processes tracing roles in parallel (default: CPUs, at most 4)",
    )
    run.add_argument(
        "--no-advice",
        action="store_true",
        help="when a job does not fit (or fits within the prediction's error), do not trace "
        "the changes that would make it fit",
    )
    run.add_argument(
        "--fail-on-oom",
        action="store_true",
        help="exit with status 1 when some rank does not fit in GPU memory",
    )
    run.set_defaults(func=cmd_run)

    comm = sub.add_parser("comm", help="print only the communication tables")
    common(comm, tree=False)
    comm.add_argument(
        "--dim", choices=("tp", "cp", "ep", "dp", "pp"), help="only this dimension's section"
    )
    comm.add_argument("--jobs", type=int, metavar="N", help="as for run")
    comm.add_argument(
        "--summary",
        action="store_true",
        help="only the job, the iteration time and a table per dimension (no sections)",
    )
    comm.set_defaults(func=cmd_comm)

    groups = sub.add_parser(
        "groups",
        help="print the rank groups megatron-core forms (no tracing; megatron-core's own checks "
        "of the model settings run with the commands that trace)",
    )
    common(groups, tree=False)
    which = groups.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="R", help="only the groups of global rank R")
    which.add_argument("--all", action="store_true", help="list every group (default: 16 per kind)")
    groups.set_defaults(func=cmd_groups)

    tree = sub.add_parser("tree", help="print the module tree of one rank")
    common(tree)
    tree.add_argument("--rank", type=int, required=True, metavar="R", help="global rank")
    tree.set_defaults(func=cmd_tree)

    measure = sub.add_parser(
        "measure", help="run one rank for real and compare its memory with the prediction"
    )
    common(measure, tree=False)
    measure.add_argument("--rank", type=int, required=True, metavar="R", help="global rank")
    measure.add_argument(
        "--iterations", type=int, default=3, metavar="N", help="training iterations (default 3)"
    )
    measure.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)"
    )
    measure.set_defaults(func=cmd_measure)

    diff = sub.add_parser(
        "diff",
        help="compare two jobs: configuration, memory, communication, modules",
        description="Compare two jobs. Each side is a job file (YAML), a JSON report written by "
        "`metatrace run --json`, a file of Megatron-LM arguments, or Megatron-LM arguments "
        "quoted as one string.",
    )
    diff.add_argument("a", metavar="A", help="the first job")
    diff.add_argument("b", metavar="B", help="the job compared with it")
    megatron_options(diff.add_argument_group("sides given as Megatron-LM arguments"))
    diff.add_argument("--json", metavar="PATH", help="also write the diff as JSON")
    diff.add_argument(
        "--all", action="store_true", help="show unchanged figures of every stage too"
    )
    diff.add_argument("--jobs", type=int, metavar="N", help="as for run")
    diff.add_argument("--width", type=int, metavar="COLUMNS", help=WIDTH_HELP)
    diff.add_argument("--quiet", "-q", action="store_true", help="no progress messages on stderr")
    diff.set_defaults(func=cmd_diff, depth=None)

    presets = sub.add_parser("presets", help="list the model presets with their sizes (no tracing)")
    presets.add_argument(
        "name", nargs="?", metavar="NAME", help="one preset: its every dimension and its source"
    )
    presets.add_argument("--width", type=int, metavar="COLUMNS", help=WIDTH_HELP)
    presets.set_defaults(func=cmd_presets, depth=None)

    plan = sub.add_parser(
        "plan",
        help="find the parallel layouts that fit and rank them",
        description="Enumerate parallel layouts of a model on a cluster, prune with closed-form "
        "bounds, trace the promising ones and rank those that fit.",
    )
    what = job_sources(plan, model=True)
    what.add_argument(
        "--model", metavar="NAME", help="a preset (e.g. llama2-70b) or a Hugging Face config.json"
    )
    megatron_options(what, cluster=False)
    plan.add_argument(
        "--num-gpus",
        type=int,
        metavar="N",
        help="GPUs of the cluster (default: the job's, or its launcher line's)",
    )
    plan.add_argument("--gpu", metavar="NAME", help="GPU model (default h100)")
    plan.add_argument("--gpu-memory-gib", type=_positive_gib, metavar="GIB", help="memory per GPU")
    plan.add_argument("--gpus-per-node", type=int, metavar="N", help="default 8")
    plan.add_argument(
        "--reserved-overhead-gib",
        type=float,
        metavar="GIB",
        help="a margin kept free on every GPU beyond the predicted device memory (default 0)",
    )
    plan.add_argument("--seq", type=int, metavar="S", help="sequence length")
    plan.add_argument("--global-batch", type=int, metavar="B", help="samples per iteration")
    plan.add_argument("--top", type=int, default=3, metavar="K", help="layouts shown (default 3)")
    plan.add_argument(
        "--max-traces", type=int, default=16, metavar="N", help="most layouts traced (default 16)"
    )
    plan.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    plan.add_argument(
        "--write-config",
        metavar="PATH",
        help="write the recommended layout as a job file (YAML) for `metatrace run --config`",
    )
    plan.add_argument("--jobs", type=int, metavar="N", help="as for run")
    plan.add_argument("--width", type=int, metavar="COLUMNS", help=WIDTH_HELP)
    plan.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    plan.set_defaults(func=cmd_plan, depth=None)
    return parser


def _console(args, console):
    """The console of the output (see metatrace.render.fit.output_console): piped, --width,
    else COLUMNS, else the width the content needs, and no trailing blanks."""
    if console is not None:
        return console
    from metatrace.render.fit import output_console

    return output_console(getattr(args, "width", None))


def _progress(console, args=None):
    """Progress on stderr while tracing, only when stderr is a terminal (and not --quiet)."""
    if not sys.stderr.isatty() or getattr(args, "quiet", False):
        return None
    from rich.console import Console

    err = Console(stderr=True)
    return lambda message: err.print(f"[dim]{message}…[/dim]")


def _check_output_path(path: str, flag: str = "--json") -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path}: directory {parent} does not exist")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory")


def _check_depth(args) -> None:
    if args.depth is not None and args.depth < 0:
        raise ConfigError(f"--depth must be 0 or more, got {args.depth}")
    if args.width is not None and args.width < 40:
        raise ConfigError(f"--width must be at least 40 columns, got {args.width}")


def _load_job(args):
    """The job from --config or from Megatron-LM arguments, checked by megatron-core too;
    warnings go to stderr."""
    job = _read_job(args)
    _check_with_megatron(job)
    return job


def _check_with_megatron(job) -> None:
    """megatron-core's own checks (imports it: seconds), once the command line is checked."""
    from metatrace.tracing.checks import check_with_megatron

    check_with_megatron(job)


def _read_job(args, fallback_world_size: int | None = None, world_flag: str = "--world-size"):
    """The job from FILE, --config or Megatron-LM arguments; warnings go to stderr."""
    from metatrace.config.source import MegatronOptions, read_job

    if getattr(args, "job", None) and args.config:
        raise ConfigError(f"give the job once: {args.job} or --config {args.config}")
    options = MegatronOptions(
        world_size=getattr(args, "world_size", None),
        gpu=args.gpu,
        gpus_per_node=args.gpus_per_node,
        env=tuple(args.env),
        newer_megatron=args.newer_megatron,
        fallback_world_size=fallback_world_size,
        world_flag=world_flag,
    )
    job, notes = read_job(
        config=getattr(args, "job", None) or args.config,
        megatron_args=args.megatron_args,
        megatron_args_file=args.megatron_args_file,
        options=options,
    )
    _warn(notes)
    return job


def _warn(notes) -> None:
    for note in notes:
        if note.startswith("warning"):
            print(f"metatrace: {note}", file=sys.stderr)


def cmd_run(args, console=None) -> int:
    from metatrace.analysis.analyze import analyze
    from metatrace.export.report import job_report, search_report, write_json
    from metatrace.planning.search import max_micro_batch
    from metatrace.render.run import render_run, render_search
    from metatrace.render.summary import build_run_summary, build_verdict, build_verdict_advice
    from metatrace.tracing.trace import shared_workers, trace_job

    _check_depth(args)
    if args.quiet and (args.summary or args.detail):
        flag = "--summary" if args.summary else "--detail"
        raise ConfigError(f"--quiet prints only the verdict; it cannot be combined with {flag}")
    if args.json:
        _check_output_path(args.json)
    if args.html:
        _check_output_path(args.html, "--html")
    if args.chrome_trace:
        _check_output_path(args.chrome_trace, "--chrome-trace")
    _check_jobs(args)
    job = _read_job(args)
    if args.chrome_trace:
        from metatrace.analysis.timing import peak_flops

        if peak_flops(job) is None:
            raise ConfigError(
                f"--chrome-trace needs the peak FLOP/s of cluster.gpu {job.cluster.gpu!r}, "
                "which metatrace does not know"
            )
    if args.memory_snapshot:
        from metatrace.export.snapshot import stage_paths

        for path in stage_paths(args.memory_snapshot, job.parallel.pp):
            _check_output_path(path, "--memory-snapshot")
    _check_with_megatron(job)  # after every check of the command line
    console = _console(args, console)
    progress = _progress(console, args)
    search = advice = None
    with shared_workers():  # the advice's traces reuse the job's worker processes
        if args.max_mbs:
            search = max_micro_batch(
                job,
                lambda j: trace_job(j, full_model=False, progress=progress, workers=args.jobs),
                progress,
            )
            analysis = search.analysis
        else:
            analysis = analyze(
                trace_job(
                    job, full_model=not args.no_full_model, progress=progress, workers=args.jobs
                )
            )
        if not args.no_advice:
            advice = _advice(analysis, args, progress)
    # --quiet: the verdict alone (and its advice, the search's answer and where the files
    # went); --summary: the summary alone.
    if args.quiet:
        console.print(build_verdict(analysis))
        if advice is not None:
            console.print()
            console.print(build_verdict_advice(analysis, advice))
    elif args.summary:
        console.print(build_run_summary(analysis, advice))
    else:
        detail = args.detail or args.depth is not None or args.expand
        render_run(
            analysis, console, depth=args.depth, expand=args.expand, detail=detail, advice=advice
        )
    if search is not None:
        render_search(job, search, console)
    if args.json or args.html:
        report = job_report(analysis)
        if search is not None:
            report["max_micro_batch"] = search_report(search)
        if not args.no_advice:
            report["advice"] = advice
    if args.json:
        write_json(report, args.json)
        console.print(f"\nJSON report written to {args.json}", soft_wrap=True)
    if args.html:
        from metatrace.export.html import role_timelines, write_html

        write_html(report, args.html, role_timelines(analysis))
        console.print(f"\nHTML report written to {args.html}", soft_wrap=True)
    if args.chrome_trace:
        from metatrace.export.chrome import chrome_trace

        write_json(chrome_trace(analysis), args.chrome_trace)
        console.print(f"\nChrome trace written to {args.chrome_trace}", soft_wrap=True)
    if args.memory_snapshot:
        from metatrace.config.allocator import parse_alloc_conf
        from metatrace.export.snapshot import write_snapshots

        config = parse_alloc_conf(analysis.job.cluster.allocator_conf or "")
        lines = write_snapshots(analysis.job, analysis.traced.roles, args.memory_snapshot, config)
        console.print("\n" + "\n".join(lines), markup=False, soft_wrap=True)
    if args.fail_on_oom and not analysis.verdict.fits:
        return 1
    return 0


def _advice(analysis, args, progress) -> dict | None:
    """The changes that would make the job fit (metatrace.planning.advice), as the report's
    `advice`; None when it fits beyond the prediction's error band."""
    from metatrace.analysis.analyze import analyze
    from metatrace.export.advice import advice_report
    from metatrace.planning.advice import advise, needs_advice
    from metatrace.tracing.trace import trace_jobs

    if not needs_advice(analysis):
        return None
    advice = advise(
        analysis,
        lambda jobs: [analyze(t) for t in trace_jobs(jobs, full_model=False, workers=args.jobs)],
        progress=progress,
    )
    return advice_report(advice, as_flags=_given_as_flags(args))


def _given_as_flags(args) -> bool:
    """Whether the job came as Megatron-LM arguments (a string, or a file of them however it
    was given), so that the advice writes its changes as flags."""
    from metatrace.config.source import file_kind

    path = getattr(args, "job", None) or args.config
    return bool(args.megatron_args or args.megatron_args_file) or (
        bool(path) and file_kind(path) == "megatron"
    )


def _check_jobs(args) -> None:
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {args.jobs}")


def cmd_comm(args, console=None) -> int:
    from metatrace.analysis.analyze import analyze
    from metatrace.render.comm import render_comm
    from metatrace.render.format import section
    from metatrace.render.run import build_summary
    from metatrace.tracing.trace import trace_job

    _check_depth(args)
    _check_jobs(args)
    if args.summary and args.dim:
        raise ConfigError("--summary shows every dimension; it cannot be combined with --dim")
    job = _load_job(args)
    console = _console(args, console)
    job_trace = trace_job(
        job, full_model=False, progress=_progress(console, args), workers=args.jobs
    )
    analysis = analyze(job_trace)
    if args.summary:
        from metatrace.render.summary import build_comm_overview

        console.print(build_comm_overview(analysis))
        return 0
    console.print(section("Configuration"))
    console.print(build_summary(job, job_trace.world))
    render_comm(analysis, console, dim=args.dim)
    return 0


def cmd_groups(args, console=None) -> int:
    from metatrace.render.comm import build_groups
    from metatrace.render.format import section
    from metatrace.render.run import build_summary
    from metatrace.world import World

    _check_depth(args)
    job = _read_job(args)
    world = World.from_job(job)
    if args.rank is not None and not 0 <= args.rank < world.size:
        raise ConfigError(f"--rank {args.rank} is not a rank of this job (0 to {world.size - 1})")
    # The layout's checks are metatrace's own (config.checks, World): megatron-core's checks of
    # the model and optimizer settings, seconds of import, wait for the commands that trace.
    console = _console(args, console)
    console.print(section("Configuration"))
    console.print(build_summary(job, world))
    whose = f" of rank {args.rank} ({world.gpu(args.rank)})" if args.rank is not None else ""
    console.print(
        section(
            f"Rank groups{whose}, as megatron-core forms them (rank order {job.parallel.rank_order}; "
            f"GPU n{{node}}_g{{gpu}}, {world.gpus_per_node} GPUs per node)"
        )
    )
    console.print(build_groups(world, rank=args.rank, limit=None if args.all else 16))
    return 0


def cmd_tree(args, console=None) -> int:
    from metatrace.analysis.analyze import analyze
    from metatrace.render.format import section
    from metatrace.render.run import build_role_tree, build_totals_line, role_title
    from metatrace.tracing.trace import JobTrace, trace_role
    from metatrace.world import World

    _check_depth(args)
    job = _read_job(args)
    world = World.from_job(job)
    if not 0 <= args.rank < world.size:
        raise ConfigError(f"--rank {args.rank} is not a rank of this job (0 to {world.size - 1})")
    _check_with_megatron(job)
    role = next(r for r in world.roles() if args.rank in r.ranks)
    console = _console(args, console)
    rt = trace_role(job, world, role, rank=args.rank, iteration=False)
    analysis = analyze(JobTrace(job=job, world=world, roles=(rt,), full=None))
    ra = analysis.roles[0]
    console.print(section(role_title(analysis, [ra])))
    console.print(build_role_tree(ra, depth=args.depth, expand=args.expand))
    console.print(build_totals_line(ra.summary))
    return 0


def cmd_measure(args, console=None) -> int:
    from metatrace.tracing.measure import (
        build_comparison,
        check_fits,
        check_request,
        measure_rank,
        predict,
    )

    job = _load_job(args)
    if args.iterations < 1:
        raise ConfigError(f"--iterations must be at least 1, not {args.iterations}")
    check_request(job, args.rank, args.device)
    console = _console(args, console)
    progress = _progress(console, args) or (lambda message: None)
    progress(f"tracing rank {args.rank} on meta")
    predicted = predict(job, args.rank)
    check_fits(predicted, args.device)
    progress(f"running rank {args.rank} on {args.device} for {args.iterations} iterations")
    measured = measure_rank(job, args.rank, iterations=args.iterations, device=args.device)
    console.print(build_comparison(predicted, measured, args.rank))
    return 0


def cmd_presets(args, console=None) -> int:
    from metatrace.config import job_from_dict
    from metatrace.config.presets import PRESETS
    from metatrace.planning.estimates import parameter_counts
    from metatrace.render.presets import build_preset, build_presets

    _check_depth(args)
    console = _console(args, console)
    if args.name is not None:
        if args.name not in PRESETS:
            raise ConfigError(f"no preset {args.name!r}; the presets: {', '.join(PRESETS)}")
        console.print(build_preset(args.name, PRESETS[args.name]))
        return 0
    rows = []
    for name in PRESETS:
        job = job_from_dict(
            {"model": {"preset": name}, "training": {"seq_length": 1024}},
            source=name,
        )
        rows.append((name, job, *parameter_counts(job)))
    console.print(build_presets(rows))
    return 0


def _side(side: str, args):
    """One side of `metatrace diff`: a JSON report (read), or a job (read, not traced yet)."""
    from metatrace.config.source import file_kind

    if os.path.isfile(side) and file_kind(side) in ("report", "json"):
        from metatrace.config.read import MAX_REPORT_BYTES, parse_json, read_text
        from metatrace.export.report import check_report

        report = parse_json(read_text(side, "JSON report", MAX_REPORT_BYTES), side)
        check_report(report, side)
        return report
    given = dict(job=None, config=None, megatron_args=None, megatron_args_file=None)
    if os.path.isfile(side):
        given["config"] = side
    elif side.lstrip().startswith("--"):
        given["megatron_args"] = side
    else:
        raise ConfigError(
            f"{side}: no such file (a side is a job file, a JSON report, or Megatron-LM arguments)"
        )
    side_args = argparse.Namespace(**vars(args))
    vars(side_args).update(given)
    if given["config"] and file_kind(side) == "job":
        vars(side_args).update(
            world_size=None, gpu=None, gpus_per_node=None, env=[], newer_megatron=None
        )
    return _read_job(side_args)


def _side_label(side: str, given) -> str:
    """A side of `metatrace diff` as the user gave it: a file by its name (a JSON report with
    the job it came from), Megatron-LM arguments by their start."""
    if isinstance(given, dict):
        return f"{side} (from {given['source']})" if given.get("source") else side
    if os.path.isfile(side):
        return side
    text = " ".join(side.split())
    return text if len(text) <= 60 else text[:59] + "…"


def _side_report(side: str, given, args, progress) -> dict:
    """The JSON report of one side of `metatrace diff` (`given`: what _side returned)."""
    from metatrace.analysis.analyze import analyze
    from metatrace.export.report import job_report
    from metatrace.tracing.trace import trace_job

    if isinstance(given, dict):
        return given
    if progress:
        progress(f"tracing {side}")
    return job_report(
        analyze(trace_job(given, full_model=False, progress=progress, workers=args.jobs))
    )


def cmd_diff(args, console=None) -> int:
    from metatrace.analysis.diff import diff_reports
    from metatrace.export.report import write_json
    from metatrace.render.diff import render_diff

    _check_depth(args)
    _check_jobs(args)
    if args.json:
        _check_output_path(args.json)
    console = _console(args, console)
    progress = _progress(console, args)
    # Both sides read and checked before either is traced.
    sides = [_side(side, args) for side in (args.a, args.b)]
    for given in sides:
        if not isinstance(given, dict):
            _check_with_megatron(given)
    from metatrace.tracing.trace import shared_workers

    with shared_workers():
        a, b = (
            _side_report(side, given, args, progress)
            for side, given in zip((args.a, args.b), sides)
        )
    labels = (_side_label(args.a, sides[0]), _side_label(args.b, sides[1]))
    diff = diff_reports(a, b, labels)
    render_diff(diff, console, all_rows=args.all)
    if args.json:
        write_json(diff, args.json)
        console.print(f"\nJSON diff written to {args.json}")
    return 0


def _plan_base(args):
    """The job whose model, batch and cluster the planner keeps, the GPUs to plan for, and the
    file it came from (None for --model and --megatron-args)."""
    from metatrace.config.source import file_kind
    from metatrace.planning.plan import base_job

    if args.job and args.config:
        raise ConfigError(f"give the job once: {args.job} or --config {args.config}")
    path, model = args.job or args.config, args.model
    if path and not model and os.path.isfile(path) and file_kind(path) == "hf_config":
        path, model = None, path
    if sum(bool(g) for g in (path, model, args.megatron_args, args.megatron_args_file)) != 1:
        raise ConfigError(
            "give the job as one of FILE, --model NAME, --config FILE, --megatron-args ARGS, "
            "--megatron-args-file FILE"
        )
    base = None
    if model:
        given = [
            f for f, v in (("--env", args.env), ("--newer-megatron", args.newer_megatron)) if v
        ]
        if given:
            raise ConfigError(f"{given[0]} applies to Megatron-LM arguments, not to --model")
        missing = [
            f
            for f, v in (
                ("--num-gpus", args.num_gpus),
                ("--seq", args.seq),
                ("--global-batch", args.global_batch),
            )
            if v is None
        ]
        if missing:
            raise ConfigError(f"plan --model needs {', '.join(missing)}")
    else:
        megatron = bool(args.megatron_args or args.megatron_args_file) or (
            os.path.isfile(path) and file_kind(path) == "megatron"
        )
        job_args = argparse.Namespace(**vars(args))
        vars(job_args).update(
            job=None,
            config=path,
            gpu=args.gpu if megatron else None,
            gpus_per_node=args.gpus_per_node if megatron else None,
        )
        base = _read_job(job_args, fallback_world_size=args.num_gpus, world_flag="--num-gpus")
    cluster = {
        key: getattr(args, key)
        for key in ("gpu", "gpus_per_node", "gpu_memory_gib", "reserved_overhead_gib")
    }
    job, num_gpus = base_job(
        model=model,
        base=base,
        seq=args.seq,
        global_batch=args.global_batch,
        num_gpus=args.num_gpus,
        cluster=cluster,
    )
    return job, num_gpus, path


def cmd_plan(args, console=None) -> int:
    from metatrace.analysis.analyze import analyze
    from metatrace.export.report import job_report, write_json
    from metatrace.planning.plan import plan, plan_report
    from metatrace.render.plan import render_plan
    from metatrace.tracing.trace import shared_workers, trace_job

    _check_depth(args)
    _check_jobs(args)
    for flag in ("num_gpus", "top", "max_traces"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.json:
        _check_output_path(args.json)
    if args.write_config:
        _check_output_path(args.write_config, "--write-config")
    job, num_gpus, path = _plan_base(args)
    console = _console(args, console)
    with _plan_progress(args, f"{job.source} on {num_gpus:,} GPUs") as progress:
        with shared_workers():
            result = plan(
                job,
                num_gpus,
                top=args.top,
                budget=args.max_traces,
                progress=progress,
                trace=lambda j: job_report(
                    analyze(trace_job(j, full_model=False, workers=args.jobs))
                ),
            )
        progress(len(result.traced), args.max_traces, None)
    ranked = result.ranked()
    if args.write_config and ranked:
        from metatrace.planning.job_file import write_job_file
        from metatrace.render.format import size

        best = ranked[0]
        write_job_file(
            best.candidate.job,
            args.write_config,
            header=[
                f"metatrace plan: #1 of {job.source} on {num_gpus:,} GPUs: "
                f"{best.candidate.layout.describe()}",
                f"planned peak {size(best.peak)} ({best.peak:,} bytes), headroom "
                f"{size(best.headroom)}",
            ],
            base_dir=os.path.dirname(path) if path else ".",
        )
    render_plan(
        job,
        num_gpus,
        result,
        console,
        top=args.top,
        config_path=args.write_config if ranked else None,
    )
    if args.json:
        write_json(plan_report(result, args.top), args.json)
        console.print(f"\nJSON plan written to {args.json}")
    if args.write_config and not ranked:
        console.print(f"\nNo layout fits: {args.write_config} not written")
    return 0 if ranked else 1


@contextlib.contextmanager
def _plan_progress(args, what: str):
    """`progress(done, budget, layout)` of plan on stderr (layout None: the search is over): a
    bar on a terminal, a line per trace otherwise (a log, CI); nothing with --quiet."""
    import time

    if args.quiet:
        yield lambda done, total, text: None
        return
    start = time.monotonic()
    if not sys.stderr.isatty():

        def line(done, total, text):
            took = f"{time.monotonic() - start:.0f} s"
            if text is None:
                print(f"metatrace plan: {done} traced in {took}", file=sys.stderr, flush=True)
            else:
                print(
                    f"metatrace plan: tracing {done + 1} of at most {total} ({took}): {text}",
                    file=sys.stderr,
                    flush=True,
                )

        print(f"metatrace plan: enumerating the layouts of {what}", file=sys.stderr, flush=True)
        yield line
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with bar:
        task = bar.add_task("enumerating layouts", total=args.max_traces)
        yield lambda done, total, text: bar.update(
            task, completed=done if text else total, description=text or "done"
        )


def main(argv=None, console=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    warnings.filterwarnings("ignore")  # megatron-core warns about missing Apex/TE at import
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # fake process groups warn in C++
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler (measure) logs each start
    try:
        return args.func(args, console)
    except ConfigError as e:
        problems = e.problems
        head = "metatrace: error: "
        if len(problems) == 1:
            print(head + problems[0], file=sys.stderr)
        else:
            print(head + f"{len(problems)} problems in the configuration:", file=sys.stderr)
            for p in problems:
                print(f"  - {p}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    """The console command: main(), its output flushed, and out without finalising the
    interpreter (megatron-core and a trace leave hundreds of thousands of objects: tearing them
    down took 0.2 s of the 405B example's run, for nothing the command still has to write).
    Ctrl-C at any moment, the flush included: status 130 and one line (metatrace.interrupt;
    metatrace.__main__ installs it before this module is even imported)."""
    quiet_interrupts()
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, OSError):  # e.g. `metatrace run ... | head`
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
