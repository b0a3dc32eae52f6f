"""Ctrl-C for the command line: exit status 130 and one line, at any moment, no process left.

Left to itself, Python raises KeyboardInterrupt wherever the main thread happens to be: inside
an import, inside the final flush of the output (a traceback, then death by the signal), in a
process pool's shutdown waiting on the pipe of a worker that the same Ctrl-C has killed (a
hang), and in every forked worker, each printing its own traceback. A terminal's Ctrl-C reaches
the whole process group, so all of these happen at once.

The command therefore installs `quiet_interrupts()` before it imports anything else. On SIGINT
the process that installed it kills its child processes (the workers multiprocessing forked,
the only children metatrace starts), waits for them, writes `metatrace: interrupted` on stderr and
leaves with os._exit(130): nothing it was doing is finished or torn down. A forked child
inherits the handler and ignores the signal (tracing.trace's workers also ignore it from their
first instruction on): its parent ends it.

Known limitations: a SIGINT during the interpreter's own start, before the console script runs
(the `site` import: tens of milliseconds), is Python's to handle. A Python handler runs between
bytecodes of the main thread, so one long call into C (a single torch kernel) delays the exit
by its length. A JSON or HTML file being written at that moment is left as it stands.
"""

from __future__ import annotations

import os
import signal
import sys

MESSAGE = "metatrace: interrupted"

_OWNER: list[int] = []  # the process that installed the handler


def quiet_interrupts() -> None:
    """SIGINT ends this process with status 130 and MESSAGE (see the module's docstring); where
    it was ignored when the process started (a shell's background job), it stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return
    _OWNER[:] = [os.getpid()]
    signal.signal(signal.SIGINT, _interrupted)


def _interrupted(signum, frame) -> None:
    if os.getpid() not in _OWNER:
        return  # a forked worker: its parent ends it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not start this again
    try:
        _end_children()
    except Exception:  # whatever the process was doing, the exit below must happen
        pass
    # A progress bar (rich, on a terminal) hides the cursor and redraws its line: clear the
    # line and show the cursor again before the one line.
    prefix = "\r\x1b[2K\x1b[?25h" if os.isatty(2) else ""
    try:
        os.write(2, f"{prefix}{MESSAGE}\n".encode())
    except OSError:
        pass  # stderr closed: the status says it
    os._exit(130)


def _end_children() -> None:
    """Kill this process's children (the workers multiprocessing forked) and wait until they
    are gone."""
    children = _children()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in children:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # already reaped (by the pool's own thread)


def _children() -> set[int]:
    """The processes whose parent this one is. From /proc, not only from multiprocessing's
    list: a worker that was forked but not yet listed when the signal came (Process.start adds
    it after the fork) would be left running, holding the pipes of the terminal or the caller
    open and reading its task queue for good (each worker keeps the queue's writing end too)."""
    me, pids = os.getpid(), set()
    # A signal during the import of multiprocessing finds it partly initialised (seen in a
    # fresh environment, where imports compile first): its list only once it has one.
    active = getattr(sys.modules.get("multiprocessing"), "active_children", None)
    if active is not None:
        try:
            pids.update(child.pid for child in active())
        except Exception:  # its state half made: /proc below still finds the children
            pass
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids  # no /proc: multiprocessing's list is all there is
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    # pid (comm) state ppid ...: comm may hold spaces and parentheses
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == me:
                        pids.add(int(entry))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    return pids
