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
        p.add_argument("--config", required=True, metavar="FILE", help="job file (YAML)")
        p.add_argument("--depth", type=int, metavar="D", help="deepest module level shown")
        p.add_argument(
            "--expand", action="store_true", help="show identical layers and stages one by one"
        )
        p.add_argument("--width", type=int, metavar="COLUMNS", help="output width")

    run = sub.add_parser("run", help="trace every rank role and print the report")
    common(run)
    run.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    run.add_argument(
        "--no-full-model",
        action="store_true",
        help="skip tracing the unparallelised model (its tree is not shown)",
    )
    run.set_defaults(func=cmd_run)

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


def _progress(console):
    """Progress on stderr while tracing, only when stderr is a terminal."""
    if not sys.stderr.isatty():
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


def cmd_run(args, console=None) -> int:
    from metatrace.config import load_job
    from metatrace.render import render_run
    from metatrace.report import job_report, write_json
    from metatrace.trace import trace_job

    _check_depth(args)
    if args.json:
        _check_output_path(args.json)
    job = load_job(args.config)
    console = _console(args, console)
    job_trace = trace_job(job, full_model=not args.no_full_model, progress=_progress(console))
    render_run(job_trace, console, depth=args.depth, expand=args.expand)
    if args.json:
        write_json(job_report(job_trace), args.json)
        console.print(f"\nJSON report written to {args.json}")
    return 0


def cmd_tree(args, console=None) -> int:
    from metatrace.config import load_job
    from metatrace.render import build_role_tree, build_totals_line, role_title, section
    from metatrace.trace import JobTrace, trace_role
    from metatrace.world import World

    _check_depth(args)
    job = load_job(args.config)
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
