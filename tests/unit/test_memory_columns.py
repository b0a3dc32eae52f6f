"""The iteration's memory read as columns (metatrace.analysis.memory: _lifetime_columns,
window_highs, _most_held) against the record-by-record readings they replace, on random event
streams: storages allocated and freed, never freed, freed without being allocated in the trace
(static storages), resized to nothing and grown again (Megatron-FSDP's buckets), windows with
and without events."""

from hypothesis import given, settings
from hypothesis import strategies as st

from metatrace.analysis import memory as mem
from metatrace.records import MemEvent, Window, column


@st.composite
def streams(draw):
    """Memory events in seq order (live the running sum) and windows over them."""
    storages = draw(st.integers(1, 12))
    events, live, seq = [], 0, 0
    size = {}
    for _ in range(draw(st.integers(0, 60))):
        sid = draw(st.integers(0, storages - 1))
        now = size.get(sid, 0)
        if now > 0 and draw(st.booleans()):
            delta = -now if draw(st.booleans()) else -draw(st.integers(1, now))
        else:
            delta = draw(st.sampled_from([512, 1024, 4096, -512]))
        size[sid] = now + delta
        live += delta
        events.append(MemEvent(seq, delta, live, "m", "forward", sid))
        seq += draw(st.integers(1, 3))
    windows, at = [], 0
    while at < seq + 2 and len(windows) < 12:
        first = at + draw(st.integers(0, 3))
        last = first + draw(st.integers(-1, 8))
        held = draw(st.one_of(st.none(), st.integers(0, storages - 1)))
        windows.append(Window("forward", 0, len(windows), first, last, held=held))
        at = max(first, last + 1) if draw(st.booleans()) else first  # some overlap
    return tuple(events), tuple(windows)


def _columns(events, windows):
    ev = {n: column([getattr(e, n) for e in events]) for n in ("seq", "delta", "live", "storage")}
    names = ("phase", "chunk", "microbatch", "first", "last", "held")
    win = {n: column([getattr(w, n) for w in windows]) for n in names}
    return ev, win


@settings(max_examples=400, deadline=None)
@given(streams())
def test_lifetime_columns_are_the_lifetimes(stream):
    events, _ = stream
    ev, _ = _columns(events, ())
    life = mem.lifetimes(events)
    cols = mem._lifetime_columns(ev)
    got = {
        (s if n == 0 else (s, n)): (a, f, b)
        for s, n, a, f, b in zip(
            *(cols[k].tolist() for k in ("storage", "life", "allocated", "freed", "bytes"))
        )
    }
    want = {k: (a, life.freed.get(k, mem._ALIVE), life.bytes[k]) for k, a in life.allocated.items()}
    assert got == want


@settings(max_examples=400, deadline=None)
@given(streams(), st.integers(0, 4096))
def test_window_highs_are_the_walks_they_replace(stream, static):
    events, windows = stream
    ev, win = _columns(events, windows)
    # Each window alone: the level before it and its events.
    alone = []
    for w in windows:
        before = [e.live for e in events if e.seq < w.first]
        inside = [e.live for e in events if w.first <= e.seq <= w.last]
        alone.append(max([before[-1] if before else static, *inside]))
    assert mem.window_highs(static, ev, win, carry=False).tolist() == alone
    # In order, no event read twice (the walk _timeline did).
    walked, i, live = [], 0, static
    for w in windows:
        while i < len(events) and events[i].seq < w.first:
            live = events[i].live
            i += 1
        top = live
        while i < len(events) and events[i].seq <= w.last:
            live = events[i].live
            top = max(top, live)
            i += 1
        walked.append(top)
    assert mem.window_highs(static, ev, win, carry=True).tolist() == walked


@settings(max_examples=400, deadline=None)
@given(streams())
def test_most_held_counts_windows_whose_held_storage_is_alive(stream):
    events, windows = stream
    ev, win = _columns(events, windows)
    life = mem.lifetimes(events)
    changes = []
    for w in windows:
        if w.held is not None and w.held in life.allocated:
            changes += [(life.allocated[w.held], 1), (life.freed.get(w.held, 1 << 62), -1)]
    most = now = 0
    for _, delta in sorted(changes):
        now += delta
        most = max(most, now)
    assert mem._most_held(win, mem._lifetime_columns(ev)) == most
