"""metatrace.interrupt's handler when the signal comes in the middle of an import (the whole
SIGINT sweep is tests/tracing/test_interrupt.py)."""

import sys
import types

from metatrace import interrupt


def test_children_are_found_while_multiprocessing_is_half_imported(monkeypatch):
    # A fresh environment compiles each module on first import, so a Ctrl-C then can find
    # multiprocessing in sys.modules without its functions yet (seen: an AttributeError
    # traceback and status 1 instead of 130).
    monkeypatch.setitem(sys.modules, "multiprocessing", types.ModuleType("multiprocessing"))
    assert isinstance(interrupt._children(), set)


def test_the_handler_exits_130_with_one_line_whatever_ending_the_children_raises(monkeypatch):
    exits, written = [], []
    monkeypatch.setattr(interrupt, "_OWNER", [interrupt.os.getpid()])
    monkeypatch.setattr(interrupt, "_end_children", lambda: 1 / 0)
    monkeypatch.setattr(interrupt.os, "_exit", exits.append)
    monkeypatch.setattr(interrupt.os, "write", lambda fd, data: written.append((fd, data)))
    monkeypatch.setattr(interrupt.signal, "signal", lambda *args: None)
    interrupt._interrupted(2, None)
    assert exits == [130]
    assert written == [(2, b"metatrace: interrupted\n")] or written[0][1].endswith(
        b"metatrace: interrupted\n"
    )
