"""The memory snapshot on synthetic traces: the simulated allocator's segments and addresses,
frames per kind of allocation, resizes, churn (snapshots of traced jobs, and refused paths, are
in tests/tracing/test_snapshot.py)."""

from metatrace.analysis.device import allocations, simulate
from metatrace.config.allocator import AllocatorConfig
from metatrace.export.snapshot import role_snapshot
from metatrace.records import MemEvent, Trace, Window
from tests.helpers import allocated_over_time, replay, reserved_over_time

MiB = 2**20


def _trace(memory, *, static_sizes=(), parts=None, windows=()):
    return Trace(
        rank=0,
        modules=(),
        collectives=(),
        saved=(),
        memory=tuple(memory),
        static_bytes=sum(static_sizes),
        windows=tuple(windows),
        static_parts=parts or {},
        static_sizes=tuple(static_sizes),
    )


def _events(changes, start=10, phase="forward"):
    """MemEvents from (storage, delta) pairs (`live` is not read here)."""
    return [
        MemEvent(seq, delta, 0, "decoder.layers.0.mlp", phase, sid)
        for seq, (sid, delta) in enumerate(changes, start=start)
    ]


def test_segments_addresses_and_frames_are_the_simulated_allocators():
    # Static: a 12 MiB parameter (a segment of its own) and two 512-byte ones (the small pool).
    sizes = (12 * MiB, 512, 512)
    # The micro-batch keeps storage 7 (a 3 MiB workspace: a 20 MiB segment) and frees storage
    # 8, a forward step's temporary.
    fwd = Window("forward", 0, 0, first=10, last=11)
    micro = _trace(
        _events([(7, 3 * MiB), (8, 5 * MiB), (8, -5 * MiB)]),
        static_sizes=sizes,
        parts={"params": 12 * MiB + 1024},
        windows=[fwd],
    )
    # The iteration's own work: storage 1 grows in place (a new block, then the old one freed)
    # and is freed in its optimizer step.
    opt = Window("optimizer", None, None, first=20, last=22)
    iteration = _trace(
        _events([(1, 2 * MiB), (1, 2 * MiB), (1, -4 * MiB)], start=20),
        static_sizes=sizes,
        parts={"params": 12 * MiB + 1024},
        windows=[opt],
    )
    snap = role_snapshot(micro, iteration, rank=3, stage=1)
    entries = snap["device_traces"][0]
    segments = [(e["action"], e["size"]) for e in entries if e["action"].startswith("segment")]
    # 12 MiB exactly; the small pool's 2 MiB; 20 MiB for the workspace and the temporary (3 + 5
    # MiB), the iteration's 2 MiB in its rest (12 MiB free), and its 4 MiB there again.
    assert segments == [("segment_alloc", 12 * MiB), ("segment_alloc", 2 * MiB)] + [
        ("segment_alloc", 20 * MiB)
    ]
    live = replay(snap)
    assert max(reserved_over_time(snap)) == 34 * MiB
    reserve = simulate(allocations(micro, iteration), AllocatorConfig())
    assert max(reserved_over_time(snap)) == reserve.reserved
    assert max(allocated_over_time(snap)) == reserve.allocated
    kinds = {(e["frames"][0]["filename"], e["frames"][0]["name"]) for e in entries if e["frames"]}
    assert ("static", "params") in kinds
    assert ("workspace", "decoder.layers.0.mlp (forward), kept") in kinds
    steps = {e["frames"][-2]["name"] for e in entries if e["frames"]}
    assert "iteration 1: optimizer" in steps and "iteration 2: optimizer" in steps
    assert "the first micro-batch: forward of micro-batch 0, chunk 0" in steps
    # Left at the end: the static storages and the workspace, in the final segments.
    assert sorted(size for size, _ in live.values()) == [512, 512, 3 * MiB, 12 * MiB]
    blocks = [b for seg in snap["segments"] for b in seg["blocks"]]
    assert sorted(b["size"] for b in blocks if b["state"] == "active_allocated") == sorted(
        size for size, _ in live.values()
    )
    for seg in snap["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]


def test_churn_never_overlaps_and_matches_the_simulation():
    """A seeded random sequence of allocations, frees and resizes of up to 40 storages, under
    the default allocator and with expandable segments."""
    import random

    rng = random.Random(7)
    sizes: dict[int, int] = {}
    changes = []
    for _ in range(600):
        sid = rng.randrange(40)
        old = sizes.get(sid, 0)
        new = rng.choice([0, 0, rng.randrange(1, 50000) * 512])
        if new != old:
            changes.append((sid, new - old))
            sizes[sid] = new
    micro = _trace(_events(changes), static_sizes=(MiB,), parts={"params": MiB})
    for config in (AllocatorConfig(), AllocatorConfig(expandable_segments=True)):
        snap = role_snapshot(micro, None, rank=0, stage=0, config=config)
        live = replay(snap)  # asserts that no two live blocks overlap
        assert sum(size for size, _ in live.values()) >= MiB + sum(sizes.values())
        reserve = simulate(allocations(micro, None), config)
        assert max(reserved_over_time(snap)) == reserve.reserved
        assert max(allocated_over_time(snap)) == reserve.allocated
