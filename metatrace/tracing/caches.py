"""A least-recently-used cache that the layers share, in a micro-batch traced in part
(metatrace.tracing.layers): megatron-core's rotary embeddings cache their forward's output
(lru_cache(maxsize=32) on the class), and multi-latent attention has an instance per layer.

Tracing every layer, each instance's forward misses (once per micro-batch: full recompute runs
no rotary embedding again) and from the (maxsize + 1)-th call on the cache evicts the least
recently used entry, the first call's then the second's: a free of that entry's storage right
after the call that evicts it, attributed where that call ran. The truncated run calls fewer
instances than the cache holds and evicts nothing. So its calls are recorded (`watch`), the
skipped layers' calls placed where their forwards' copies are (`copied`), and once every run
is expanded `evict` runs the cache over all the calls in order and inserts each eviction's
free: the records of tracing every layer (tests/tracing/test_layers.py compares them).

Known limitations: only a cache whose every call misses, in the forward, with the cache empty
when the micro-batch starts and the truncated run not filling it; otherwise the micro-batch is
traced whole (`evict` returns None).
"""

from __future__ import annotations

import contextlib
import dataclasses
from bisect import bisect_left
from collections import Counter
from typing import Any

CALL = "lru-cache call"
"""The marks' block name of the recorded calls (no decoder block is named so)."""


@dataclasses.dataclass
class Calls:
    """The calls the truncated run made to shared caches: by mark key (CALL, n, "call") in
    Marks.at (the mark's sid is the entry's storage), what each evicts with."""

    info: dict = dataclasses.field(default_factory=dict)
    """{key: (the cache, its maxsize, bytes of the entry, module, phase)}: module and phase
    where the call ran (an eviction's free is attributed there)."""
    failed: str | None = None
    """Why the calls are not the pattern modelled (the micro-batch is then traced whole)."""
    made: Counter = dataclasses.field(default_factory=Counter)
    """Calls the truncated run made, by cache."""


def shared(models: dict[str, Any]) -> dict:
    """{a class's lru-cached forward: (maxsize, [(fqn, module)])} of the modules of `models`
    that share such a cache."""
    out: dict = {}
    for prefix, model in models.items():
        for name, module in model.named_modules():
            forward = type(module).forward
            if hasattr(forward, "cache_parameters"):
                fqn = f"{prefix}.{name}" if prefix else name
                size = forward.cache_parameters()["maxsize"]
                out.setdefault(forward, (size, []))[1].append((fqn, module))
    return out


def fills(models: dict[str, Any]) -> bool:
    """Whether a cache is shared by more instances than it holds (conservatively, as if
    each instance took two entries: forward and recomputation)."""
    return any(
        size is not None and 2 * len(users) > size for size, users in shared(models).values()
    )


@contextlib.contextmanager
def watch(models: dict[str, Any], rec, at: dict, calls: Calls):
    """While inside, each call of a cache that fills (`fills`) is recorded in `at` and `calls`
    (the class's forward wrapped: multi-latent attention calls it through
    get_cached_cos_sin as often as through the module)."""
    restore = []
    try:
        for cache, (size, users) in shared(models).items():
            if size is None or 2 * len(users) <= size:
                continue
            if cache.cache_info().currsize:
                calls.failed = "the cache holds entries when the micro-batch starts"
            owner = next(c for c in type(users[0][1]).__mro__ if c.__dict__.get("forward") is cache)
            restore.append((owner, cache))
            owner.forward = _recording(cache, size, rec, at, calls)
        yield calls
    finally:
        for owner, cache in restore:
            owner.forward = cache


def _recording(cache, size: int, rec, at: dict, calls: Calls):
    """`cache` (an lru_cache on a class's forward) recording each call that returns."""
    import torch

    from metatrace.hooks.recorder import Mark

    def forward(self, *args, **kwargs):
        misses = cache.cache_info().misses
        output = cache(self, *args, **kwargs)
        emb = output[0] if isinstance(output, tuple) else output
        sid = rec.known_storage(emb)
        if torch._C._current_graph_task_id() != -1:  # in the backward
            calls.failed = "a call in the backward"
        elif cache.cache_info().misses != misses + 1:
            calls.failed = "a call that hits"
        elif sid is None:
            calls.failed = "an entry the recorder did not see"
        seq, live, where, phase = rec.position()
        key = (CALL, len(calls.info), "call")
        at[key] = Mark(seq, sid or 0, live, 0, 0, 0, 0, Counter(), Counter())
        calls.info[key] = (cache, size, emb.untyped_storage().nbytes(), where, phase)
        calls.made[cache] += 1
        if calls.made[cache] > size:
            calls.failed = "the truncated run fills the cache"
        return output

    return forward


def copied(at: dict, calls: Calls, run, period_key, m: int, seq: int, sid: int, live: int):
    """Add the calls of a run's m skipped layers to `at` and `calls`: the period layer's call
    (its mark `at[period_key]`, after the run's expansion) moved on by each copy of its
    forward (`seq`, `sid`, `live`: one forward's records, storage ids and live bytes)."""
    from metatrace.hooks.recorder import Mark

    mark = at[period_key]
    cache, size, nbytes, where, phase = calls.info[period_key]
    old = run.fqn(run.period)
    for i in range(1, m + 1):
        key = (CALL, len(calls.info), "call")
        at[key] = Mark(
            mark.seq + i * seq,
            mark.sid + i * sid,
            mark.live + i * live,
            0,
            0,
            0,
            0,
            Counter(),
            Counter(),
        )
        module = run.fqn(run.period + i) + where[len(old) :] if where.startswith(old) else where
        calls.info[key] = (cache, size, nbytes, module, phase)


def evict(trace, at: dict, calls: Calls):
    """`trace` (every run expanded) with the frees of the entries each cache evicts inserted
    (see the module docstring); None where the calls are not the pattern modelled."""
    from metatrace.records import MemEvent

    if calls.failed is not None:
        return None
    order = sorted(calls.info, key=lambda key: at[key].seq)
    inserted: list[tuple[int, MemEvent]] = []  # (seq it follows, the free), in order
    by_cache: dict = {}
    for key in order:
        cache, size, nbytes, where, phase = calls.info[key]
        held = by_cache.setdefault(cache, [])
        held.append(key)
        if len(held) > size:
            gone = held.pop(0)  # every call misses: the least recently used is the oldest
            mark = at[key]
            freed = calls.info[gone][2]
            free = MemEvent(0, -freed, mark.live, where, phase, at[gone].sid)
            inserted.append((mark.seq, free))
    if not inserted:
        return trace
    return _insert(trace, inserted)


def _insert(trace, inserted: list):
    """`trace` with the frees `inserted` ((seq of the record each follows, the free with the
    live bytes there before any insertion), in order of seq): every later record's seq moved
    on by the frees before it, every later memory event's live bytes less what they freed."""
    points = [p for p, _ in inserted]
    freed = [0]  # bytes the first j frees free
    for _, event in inserted:
        freed.append(freed[-1] - event.delta)

    def seq_new(s: int) -> int:
        return s + bisect_left(points, s)

    memory: list = []
    j = 0
    for r in trace.memory:
        while j < len(inserted) and points[j] < r.seq:
            event = inserted[j][1]
            memory.append(
                dataclasses.replace(
                    event, seq=seq_new(points[j]) + 1, live=event.live - freed[j + 1]
                )
            )
            j += 1
        memory.append(dataclasses.replace(r, seq=seq_new(r.seq), live=r.live - freed[j]))
    for k in range(j, len(inserted)):
        event = inserted[k][1]
        memory.append(
            dataclasses.replace(event, seq=seq_new(points[k]) + 1, live=event.live - freed[k + 1])
        )
    return dataclasses.replace(
        trace,
        memory=tuple(memory),
        saved=tuple(dataclasses.replace(r, seq=seq_new(r.seq)) for r in trace.saved),
        collectives=tuple(dataclasses.replace(r, seq=seq_new(r.seq)) for r in trace.collectives),
        windows=tuple(
            dataclasses.replace(w, first=seq_new(w.first - 1) + 1, last=seq_new(w.last))
            for w in trace.windows
        ),
        collective_flops={seq_new(s): v for s, v in trace.collective_flops.items()},
    )
