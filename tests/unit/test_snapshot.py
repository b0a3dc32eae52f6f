"""The memory snapshot's allocator on synthetic traces: first fit, coalescing, resizes, the
synthetic segment (snapshots of traced jobs, and refused paths, are in
tests/tracing/test_snapshot.py)."""

import pytest

from metatrace.analysis.memory import role_memory
from metatrace.export.snapshot import role_snapshot
from metatrace.records import MemEvent, Trace, Window
from tests.helpers import allocated_over_time, replay


def _trace(memory, *, static_bytes=0, parts=None, windows=()):
    return Trace(
        rank=0,
        modules=(),
        collectives=(),
        saved=(),
        memory=tuple(memory),
        static_bytes=static_bytes,
        windows=tuple(windows),
        static_parts=parts or {},
    )


def _events(static_bytes, changes):
    """MemEvents from (storage, delta) pairs, `live` running from `static_bytes`."""
    live, out = static_bytes, []
    for seq, (sid, delta) in enumerate(changes, start=10):
        live += delta
        out.append(MemEvent(seq, delta, live, "decoder.layers.0.mlp", "forward", sid))
    return out


MiB = 2**20


def test_resizes_first_fit_and_the_synthetic_segment():
    # The micro-batch keeps storage 7 (a workspace that grew to 3 KiB before shrinking; it
    # counts at its largest, as role_memory counts it) and frees storage 8.
    micro = _trace(_events(0, [(7, 1024), (8, 512), (7, 2048), (8, -512), (7, -1024)]))
    static = 2 * MiB
    # Storage 2 leaves a hole that storage 4 fills; storage 1 grows (resize_) and shrinks back.
    changes = [
        (1, MiB),
        (2, MiB),
        (3, MiB),
        (2, -MiB),
        (4, MiB // 2),
        (1, 512),
        (1, -512),
        (1, -MiB),
        (3, -MiB),
    ]
    window = Window("forward", 0, 1, first=10, last=13, held=3)
    iteration = _trace(
        _events(static, changes), static_bytes=static, parts={"params": MiB}, windows=[window]
    )
    snap = role_snapshot(micro, iteration, rank=3, stage=1)
    m = role_memory(micro, iteration)
    over_time = allocated_over_time(snap)
    # 2 MiB static + 3 KiB workspace + storages 1, 2, 3 (3 MiB) at the highest.
    assert max(over_time) == m.peak == 5 * MiB + 3072
    assert over_time[-1] == 2 * MiB + 3072 + MiB // 2
    live = replay(snap)
    assert sorted(frames[0]["name"] for _, frames in live.values()) == [
        "decoder.layers.0.mlp (forward)",  # storage 4
        "decoder.layers.0.mlp (forward), kept from earlier iterations",  # the workspace
        "params",
        "static",  # the static bytes not split into parts
    ]
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    # params, the rest of the static bytes, the workspace; storages 1, 2, 3, 4, then storage 1
    # re-allocated at each resize.
    assert [e["size"] for e in allocs] == [MiB, MiB, 3072, MiB, MiB, MiB, MiB // 2, MiB + 512, MiB]
    assert allocs[6]["addr"] == allocs[4]["addr"]  # storage 4 in storage 2's hole (first fit)
    assert allocs[7]["addr"] == allocs[5]["addr"] + MiB  # grown storage 1 fits no hole: on top
    assert allocs[8]["addr"] == allocs[3]["addr"]  # shrunk back, it fits its old place again
    # The furthest address used is 6 MiB + 3.5 KiB: the segment rounds it up to 8 MiB.
    assert snap["segments"][0]["total_size"] == 8 * MiB
    steps = {e["frames"][0]["name"]: e["frames"][-2]["name"] for e in allocs[3:]}
    assert steps["activations kept for backward"] == "forward of micro-batch 1, chunk 0"
    assert steps["decoder.layers.0.mlp (forward)"] == "between steps (the schedule's own work)"

    bad = _trace(_events(0, [(1, 512), (1, -1024)]))
    with pytest.raises(ValueError, match="frees 1024 bytes of storage 1, which holds 512"):
        role_snapshot(micro, bad, rank=0, stage=0)


def test_the_arena_coalesces_free_neighbours():
    from metatrace.export.snapshot import _Arena

    arena = _Arena()
    a, b, c, d = (arena.alloc(100) for _ in range(4))
    assert (a, b, c, d) == (0, 100, 200, 300)
    arena.release(b, 100)
    arena.release(a, 100)  # merges with the hole above it
    assert arena.free == [(0, 200)] and arena.alloc(200) == 0
    arena.release(0, 200)
    arena.release(d, 100)  # the top: the bump pointer comes down
    assert arena.end == 300 and arena.free == [(0, 200)]
    arena.release(c, 100)  # merges with the hole below it, then reaches the top
    assert arena.end == 0 and arena.free == [] and arena.high == 400
    assert arena.alloc(350) == 0 and arena.high == 400


def test_random_allocations_never_overlap_and_keep_the_peak():
    """First fit with coalescing under churn: a seeded random sequence of allocations, frees
    and resizes of up to 40 storages."""
    import random

    rng = random.Random(7)
    sizes: dict[int, int] = {}
    changes = []
    for _ in range(600):
        sid = rng.randrange(40)
        old = sizes.get(sid, 0)
        new = rng.choice([0, 0, rng.randrange(1, 5000) * 512])
        if new != old:
            changes.append((sid, new - old))
            sizes[sid] = new
    iteration = _trace(_events(MiB, changes), static_bytes=MiB, parts={"params": MiB})
    snap = role_snapshot(_trace([]), iteration, rank=0, stage=0)
    live = replay(snap)  # asserts that no two live blocks overlap
    assert sum(size for size, _ in live.values()) == MiB + sum(sizes.values())
    assert max(allocated_over_time(snap)) == role_memory(_trace([]), iteration).peak
    assert snap["segments"][0]["total_size"] < 2 * role_memory(_trace([]), iteration).peak
