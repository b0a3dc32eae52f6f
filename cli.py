"""The metatrace command line: one `cmd_x(args, console) -> exit code` per command.

Exit codes: 0 success, 2 bad input (a config, a flag, a file; one message, no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from metatrace import __version__
from metatrace.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="metatrace",
        description="Per-GPU memory and communication of a Megatron-Core training job, "
        "traced on the meta device.",
    )
    parser.add_argument("--version", action="version", version=f"metatrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def common(p):
        source = p.add_argument_group(
            "the job (one of --config, --megatron-args, --megatron-args-file)"
        )
        source.add_argument("--config", metavar="FILE", help="job file (YAML)")
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
        source.add_argument(
            "--world-size", type=int, metavar="N", help="GPUs of the run (with Megatron-LM arguments)"
        )
        source.add_argument(
            "--gpu", metavar="NAME", help="GPU model, e.g. h100, a100 (default h100)"
        )
        source.add_argument("--gpus-per-node", type=int, metavar="N", help="default 8")
        source.add_argument(
            "--env",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="an environment variable of the run (e.g. CUBLAS_WORKSPACE_CONFIG=:4096:8)",
        )
        p.add_argument("--depth", type=int, metavar="D", help="deepest module level shown")
        p.add_argument(
            "--expand", action="store_true", help="show identical layers and stages one by one"
        )
        p.add_argument("--width", type=int, metavar="COLUMNS", help="output width")
        p.add_argument(
            "--quiet", "-q", action="store_true", help="no progress messages on stderr"
        )

    run = sub.add_parser("run", help="trace every rank role and print the report")
    common(run)
    run.add_argument("--json", metavar="PATH", help="also write the report as JSON")
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
        "--jobs", type=int, metavar="N", help="processes tracing roles in parallel (default: CPUs, at most 4)"
    )
    run.add_argument(
        "--fail-on-oom",
        action="store_true",
        help="exit with status 1 when some rank does not fit in GPU memory",
    )
    run.set_defaults(func=cmd_run)

    comm = sub.add_parser("comm", help="print only the communication tables")
    common(comm)
    comm.add_argument(
        "--dim", choices=("tp", "cp", "ep", "dp", "pp"), help="only this dimension's section"
    )
    comm.add_argument("--jobs", type=int, metavar="N", help="as for run")
    comm.set_defaults(func=cmd_comm)

    groups = sub.add_parser(
        "groups", help="print the rank groups megatron-core forms (no tracing)"
    )
    common(groups)
    which = groups.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="R", help="only the groups of global rank R")
    which.add_argument("--all", action="store_true", help="list every group (default: 16 per kind)")
    groups.set_defaults(func=cmd_groups)

    tree = sub.add_parser("tree", help="print the module tree of one rank")
    common(tree)
    tree.add_argument("--rank", type=int, required=True, metavar="R", help="global rank")
    tree.set_defaults(func=cmd_tree)
    return parser


def _console(args, console):
    if console is not None:
        return console
    from rich.console import Console

    return Console(width=args.width) if args.width else Console()


def _progress(console, args=None):
    """Progress on stderr while tracing, only when stderr is a terminal (and not --quiet)."""
    if not sys.stderr.isatty() or getattr(args, "quiet", False):
        return None
    from rich.console import Console

    err = Console(stderr=True)
    return lambda message: err.print(f"[dim]{message}…[/dim]")


def _check_output_path(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"--json {path}: directory {parent} does not exist")
    if os.path.isdir(path):
        raise ConfigError(f"--json {path} is a directory")


def _check_depth(args) -> None:
    if args.depth is not None and args.depth < 0:
        raise ConfigError(f"--depth must be 0 or more, got {args.depth}")
    if args.width is not None and args.width < 40:
        raise ConfigError(f"--width must be at least 40 columns, got {args.width}")


def _load_job(args):
    """The job from --config or from Megatron-LM arguments; warnings go to stderr."""
    import dataclasses

    sources = [o for o in ("config", "megatron_args", "megatron_args_file") if getattr(args, o)]
    if len(sources) != 1:
        raise ConfigError(
            "give the job as one of --config FILE, --megatron-args ARGS, --megatron-args-file FILE"
        )
    megatron = ("world_size", "gpu", "gpus_per_node", "env")
    if args.config:
        given = [o for o in megatron if getattr(args, o)]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag} applies to Megatron-LM arguments; set it in {args.config}")
        from metatrace.config import load_job

        return load_job(args.config)
    from metatrace.megatron_args import job_from_args, read_args_file, split_args

    if args.world_size is None:
        raise ConfigError("Megatron-LM arguments need --world-size N (the GPUs of the run)")
    env = {}
    for item in args.env:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise ConfigError(f"--env {item!r} must be NAME=VALUE")
        env[name] = value
    if args.megatron_args is not None:
        tokens, source = split_args(args.megatron_args), "--megatron-args"
    else:
        tokens, source = read_args_file(args.megatron_args_file), args.megatron_args_file
    job, notes = job_from_args(
        tokens,
        world_size=args.world_size,
        gpu=args.gpu,
        gpus_per_node=args.gpus_per_node,
        env=env,
        source=source,
    )
    for note in notes:
        if note.startswith("warning"):
            print(f"metatrace: {note}", file=sys.stderr)
    return dataclasses.replace(job, notes=job.notes + tuple(notes))


def cmd_run(args, console=None) -> int:
    from metatrace.render import render_run, render_search
    from metatrace.report import job_report, search_report, write_json
    from metatrace.search import max_micro_batch
    from metatrace.trace import trace_job

    _check_depth(args)
    if args.json:
        _check_output_path(args.json)
    _check_jobs(args)
    job = _load_job(args)
    console = _console(args, console)
    progress = _progress(console, args)
    search = None
    if args.max_mbs:
        search = max_micro_batch(
            job,
            lambda j: trace_job(j, full_model=False, progress=progress, workers=args.jobs),
            progress,
        )
        job_trace = search.trace
    else:
        job_trace = trace_job(
            job, full_model=not args.no_full_model, progress=progress, workers=args.jobs
        )
    render_run(job_trace, console, depth=args.depth, expand=args.expand)
    if search is not None:
        render_search(job, search, console)
    if args.json:
        report = job_report(job_trace)
        if search is not None:
            report["max_micro_batch"] = search_report(search)
        write_json(report, args.json)
        console.print(f"\nJSON report written to {args.json}")
    if args.fail_on_oom and not _fits(job_trace):
        return 1
    return 0


def _fits(job_trace) -> bool:
    from metatrace.memory import role_memory, verdict

    ranked = [(rt.role.ranks, role_memory(rt.trace, rt.iteration)) for rt in job_trace.roles]
    return verdict(job_trace.job, ranked).fits


def _check_jobs(args) -> None:
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {args.jobs}")


def cmd_comm(args, console=None) -> int:
    from metatrace.render import build_summary, section
    from metatrace.render_comm import render_comm
    from metatrace.trace import trace_job

    _check_depth(args)
    _check_jobs(args)
    job = _load_job(args)
    console = _console(args, console)
    job_trace = trace_job(
        job, full_model=False, progress=_progress(console, args), workers=args.jobs
    )
    console.print(section("Configuration"))
    console.print(build_summary(job, job_trace.world))
    render_comm(job_trace, console, dim=args.dim)
    return 0


def cmd_groups(args, console=None) -> int:
    from metatrace.render import build_summary, section
    from metatrace.render_comm import build_groups
    from metatrace.world import World

    _check_depth(args)
    job = _load_job(args)
    world = World.from_job(job)
    if args.rank is not None and not 0 <= args.rank < world.size:
        raise ConfigError(f"--rank {args.rank} is not a rank of this job (0 to {world.size - 1})")
    console = _console(args, console)
    console.print(section("Configuration"))
    console.print(build_summary(job, world))
    whose = f" of rank {args.rank} ({world.gpu(args.rank)})" if args.rank is not None else ""
    console.print(section(
        f"Rank groups{whose}, as megatron-core forms them (rank order {job.parallel.rank_order}; "
        f"GPU n{{node}}_g{{gpu}}, {world.gpus_per_node} GPUs per node)"))
    console.print(build_groups(world, rank=args.rank, limit=None if args.all else 16))
    return 0


def cmd_tree(args, console=None) -> int:
    from metatrace.render import build_role_tree, build_totals_line, role_title, section
    from metatrace.trace import JobTrace, trace_role
    from metatrace.world import World

    _check_depth(args)
    job = _load_job(args)
    world = World.from_job(job)
    if not 0 <= args.rank < world.size:
        raise ConfigError(f"--rank {args.rank} is not a rank of this job (0 to {world.size - 1})")
    role = next(r for r in world.roles() if args.rank in r.ranks)
    console = _console(args, console)
    rt = trace_role(job, world, role, rank=args.rank, iteration=False)
    job_trace = JobTrace(job=job, world=world, roles=(rt,), full=None)
    console.print(section(role_title(job_trace, [rt])))
    console.print(build_role_tree(job_trace, [rt], depth=args.depth, expand=args.expand))
    console.print(build_totals_line(rt.trace))
    return 0


def main(argv=None, console=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    warnings.filterwarnings("ignore")  # megatron-core warns about missing Apex/TE at import
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # fake process groups warn in C++
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


if __name__ == "__main__":
    sys.exit(main())
