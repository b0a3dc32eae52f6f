"""Ctrl-C at any moment of `metatrace run`, `plan` and `diff` with worker processes (issue 41).

SIGINT goes to the command's process group, as a terminal's Ctrl-C does, at moments spread from
the first import to the report's last lines: timed ones from the interpreter's start to the
first byte of the report (as an uninterrupted run of the same command timed them), and for the
reports longer than stdout's pipe (run, diff), after the test has read the report's first byte,
its middle, and as late as the command cannot have written it all (the pipe holds 4 KiB and
the test reads it only then, so the command is still writing). Each interrupted moment must end
with status 130 within 30 s, stderr exactly `metatrace: interrupted` (one line), stdout the
first bytes of the uninterrupted report (nothing past what was written before the signal), and
no process of the group left (the workers included).

Python's own start (its `site` import, tens of milliseconds, before any code of metatrace runs)
is left out: a SIGINT there is the interpreter's to report. The first moment is three times the
time this interpreter takes to start and exit, measured two at a time as the moments run (a CI
machine under load starts it several times slower than an idle one).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import EXAMPLES, ROOT

LOCAL = os.path.join(EXAMPLES, "debug-local.yaml")
COMMANDS = {
    # --detail: a report of 20 KiB, so that its writes wait for the test to read them
    "run": ("run", "--config", LOCAL, "--jobs", "2", "--detail"),
    # --quiet: plan reports each trace on stderr when it is not a terminal
    "plan": ("plan", "--config", LOCAL, "--jobs", "2", "--max-traces", "4", "--quiet"),
    "diff": ("diff", LOCAL, os.path.join(EXAMPLES, "debug.yaml"), "--jobs", "2"),  # 8 KiB
}
TIMED = 10  # moments before the report, per command
PIPE = 4096  # stdout's pipe capacity (the smallest Linux allows)
INTERRUPTED = b"metatrace: interrupted\n"

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc") or not hasattr(fcntl, "F_SETPIPE_SZ"), reason="needs Linux"
)


def _argv() -> list[str]:
    """The console script a user runs, else `python -m metatrace` (the same entry)."""
    script = os.path.join(os.path.dirname(sys.executable), "metatrace")
    return [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "metatrace"]


def _start(args) -> subprocess.Popen:
    process = subprocess.Popen(
        [*_argv(), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        start_new_session=True,  # its own process group, as a terminal's job
    )
    fcntl.fcntl(process.stdout.fileno(), fcntl.F_SETPIPE_SZ, PIPE)
    return process


def _group(pgid: int) -> list[str]:
    """The processes of group `pgid` still there (zombies are gone already)."""
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    head, tail = f.read().rsplit(")", 1)
            except OSError:
                continue
            state, _, pgrp = tail.split()[:3]
            if int(pgrp) == pgid and state != "Z":
                left.append(f"{entry} {head.split('(', 1)[1]} {state}")
    return left


def _uninterrupted(args) -> tuple[bytes, bytes, float]:
    """stdout, stderr and the seconds to the report's first byte of an uninterrupted run."""
    process = _start(args)
    start = time.perf_counter()
    first = os.read(process.stdout.fileno(), 1)
    seconds = time.perf_counter() - start
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0 and first, err.decode()[-2000:]
    return first + out, err, seconds


def _interrupt(args, at: float | None = None, after: int = 0) -> dict:
    """The command interrupted `at` seconds after its start, or once `after` bytes of its
    stdout have been read."""
    process = _start(args)
    out = b""
    if at is not None:
        time.sleep(at)
    while len(out) < after:
        chunk = os.read(process.stdout.fileno(), after - len(out))
        assert chunk, f"the report ended after {len(out)} bytes"
        out += chunk
    running = process.poll() is None
    sent = time.perf_counter()
    try:
        os.killpg(process.pid, signal.SIGINT)
    except ProcessLookupError:
        pass  # it had ended, and nothing of its group was left
    try:
        rest, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        left = _group(process.pid)
        os.killpg(process.pid, signal.SIGKILL)
        rest, err = process.communicate()
        return dict(status="hang", out=out + rest, err=err, running=running, left=left)
    return dict(
        status=process.returncode,
        out=out + rest,
        err=err,
        running=running,
        left=_group(process.pid),
        seconds=time.perf_counter() - sent,
    )


def _start_seconds() -> float:
    """Seconds this interpreter takes to start (site included), import what the console script
    imports before metatrace's code (`re`) and exit: the slowest of 6, run two at a time as the
    moments are (and beside whatever else loads the machine then, as they are)."""

    def once(_) -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import re"], check=True)
        return time.perf_counter() - start

    with ThreadPoolExecutor(2) as pool:
        return max(pool.map(once, range(6)))


@pytest.mark.parametrize("command", COMMANDS)
def test_ctrl_c_at_any_moment_exits_130_with_one_line_and_no_process_left(command):
    args = COMMANDS[command]
    report, err, to_report = _uninterrupted(args)
    assert err == b"", err.decode()
    first = 3 * _start_seconds()
    assert first < to_report / 2, "the command starts too slowly to be interrupted before it"
    moments: list[dict] = [
        dict(at=first + (to_report - first) * i / (TIMED - 1)) for i in range(TIMED)
    ]
    if len(report) > 2 * PIPE:  # the report's writes wait for the test: no race with the end
        moments += [dict(after=1), dict(after=len(report) // 2), dict(after=len(report) - PIPE - 1)]
    with ThreadPoolExecutor(2) as pool:  # two commands at a time, as on a 2-core machine
        results = list(pool.map(lambda m: {**m, **_interrupt(args, **m)}, moments))
    problems, interrupted = [], 0
    for r in results:
        moment = f"at {r['at']:.2f} s" if "at" in r else f"after {r['after']} bytes"
        where = f"{command} {moment}"
        if not r["running"]:  # it had ended before the signal: the whole report, status 0
            if (r["status"], r["out"], r["err"]) != (0, report, b""):
                problems.append(f"{where}: ended before the signal, but status {r['status']}")
            continue
        interrupted += 1
        if r["status"] != 130:
            problems.append(f"{where}: status {r['status']}: {r['err'].decode()[-1500:]}")
        elif r["err"] != INTERRUPTED:
            problems.append(f"{where}: stderr {r['err'].decode()[-1500:]!r}")
        elif not report.startswith(r["out"]):
            problems.append(f"{where}: stdout is not the report's start: {r['out'][-300:]!r}")
        elif r["seconds"] > 5:
            problems.append(f"{where}: {r['seconds']:.1f} s to end")
        if r["left"]:
            problems.append(f"{where}: processes left: {r['left']}")
    assert not problems, "\n".join(problems)
    # At most the last timed moment may come after a fast run's end (plan's report fits the
    # pipe); the moments after bytes of the report cannot.
    assert interrupted >= len(moments) - 1, [r["running"] for r in results]
    assert sum(bool(r["out"]) for r in results) >= (3 if len(report) > 2 * PIPE else 0)
