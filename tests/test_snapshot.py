"""`metatrace run --memory-snapshot`: the predicted iteration as a PyTorch memory snapshot.

Checked against the numbers metatrace reports (the peak, the static parts, the workspaces),
against the snapshot's own consistency (allocations and frees pair up, blocks never overlap,
the final segment holds what is still allocated), and through torch's own readers of the
format (torch.cuda._memory_viz, pure Python, no CUDA needed)."""

import base64
import io
import json
import os
import pickle
import re

import pytest
from rich.console import Console
from torch.cuda import _memory_viz

from metatrace.cli import main
from metatrace.records import MemEvent, Trace, Window
from metatrace.analysis.memory import persistent_bytes, role_memory
from metatrace.export.snapshot import BASE, chosen_roles, role_snapshot
from metatrace.tracing.trace import trace_job

from conftest import EXAMPLES, small_job

DEBUG = os.path.join(EXAMPLES, "debug.yaml")


@pytest.fixture(scope="module")
def roles():
    """pp 2 with 2 virtual stages (4 micro-batches): windows of every kind, two roles."""
    job = small_job(
        model={"num_layers": 4},
        parallel={"pp": 2, "vpp": 2},
        training={"global_batch_size": 8},
        cluster={"num_gpus": 2},
    )
    return trace_job(job, full_model=False, workers=1).roles


def snapshot_of(rt):
    return role_snapshot(rt.trace, rt.iteration, rank=rt.role.rank, stage=rt.role.pp_stage)


def allocated_over_time(snap) -> list[int]:
    """Bytes allocated after every entry of the device trace, recomputed from the entries."""
    live, out = 0, []
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_completed":
            live -= e["size"]
        out.append(live)
    return out


def replay(snap) -> dict[int, tuple[int, list]]:
    """Replay the trace as an allocator would, checking every step; the blocks left at the end."""
    entries = snap["device_traces"][0]
    first = entries[0]
    assert first["action"] == "segment_alloc" and first["addr"] == BASE
    end = BASE + first["size"]
    live: dict[int, tuple[int, list]] = {}
    requested = None
    for e in entries[1:]:
        addr, size = e["addr"], e["size"]
        if e["action"] == "alloc":
            assert requested is None
            assert BASE <= addr and addr + size <= end and size > 0 and addr % 512 == 0
            assert all(addr + size <= a or a + s <= addr for a, (s, _) in live.items()), e
            live[addr] = (size, e["frames"])
        elif e["action"] == "free_requested":
            assert requested is None and live[addr][0] == size, e
            requested = addr
        else:
            assert e["action"] == "free_completed" and requested == addr, e
            del live[addr]
            requested = None
    assert requested is None
    return live


def test_the_highest_allocated_bytes_of_the_trace_is_the_reported_peak(roles):
    for rt in roles:
        m = role_memory(rt.trace, rt.iteration)
        snap = snapshot_of(rt)
        over_time = allocated_over_time(snap)
        assert max(over_time) == m.peak
        # Before the first event of the iteration: static memory and workspaces, one block each
        # per part and per kept storage.
        entries = snap["device_traces"][0]
        setup = [e for e in entries if e["time_us"] == 0 and e["action"] == "alloc"]
        kind = [(e["frames"][0]["filename"], e["frames"][0]["name"], e["size"]) for e in setup]
        static = {name: size for what, name, size in kind if what == "static"}
        assert static == {"params": m.params, "grads": m.grads, "optimizer": m.optimizer}
        workspaces = [size for what, _, size in kind if what == "workspace"]
        assert sum(workspaces) == m.workspaces == persistent_bytes(rt.trace) > 0
        assert over_time[len(setup)] == rt.iteration.static_bytes + m.workspaces
        # At the end: what the iteration's last event left, plus the workspaces.
        assert over_time[-1] == rt.iteration.memory[-1].live + m.workspaces
    peaks = [role_memory(rt.trace, rt.iteration).peak for rt in roles]
    assert peaks[0] != peaks[1]  # the default choice below is not a tie


def test_allocations_and_frees_pair_up_and_the_segment_holds_what_is_left(roles):
    for rt in roles:
        snap = snapshot_of(rt)
        live = replay(snap)
        entries = snap["device_traces"][0]
        allocs = sum(e["action"] == "alloc" for e in entries)
        frees = sum(e["action"] == "free_completed" for e in entries)
        assert allocs - frees == len(live)
        (segment,) = snap["segments"]
        active = {b["address"]: (b["size"], b["frames"])
                  for b in segment["blocks"] if b["state"] == "active_allocated"}
        assert active == live
        assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
        assert segment["allocated_size"] == sum(size for size, _ in live.values())
        assert segment["total_size"] % (2 << 20) == 0


def test_frames_name_the_part_the_module_and_the_window(roles):
    for rt in roles:
        snap = snapshot_of(rt)
        allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
        root = f"rank {rt.role.rank}, pipeline stage {rt.role.pp_stage}: one training iteration"
        root_frame = {"filename": "metatrace", "line": 0, "name": root}
        assert all(e["frames"][-1] == root_frame for e in allocs)
        # Each replayed forward step keeps one tensor standing for its activations: 4
        # micro-batches x 2 chunks, each allocated inside its own forward window.
        held = [e for e in allocs if e["frames"][0]["name"] == "activations kept for backward"]
        steps = sorted(e["frames"][2]["name"] for e in held)
        expected = [f"forward of micro-batch {m}, chunk {c}" for m in range(4) for c in range(2)]
        assert steps == sorted(expected)
        kinds = {f["filename"] for e in allocs for f in e["frames"]}
        assert kinds <= {"static", "workspace", "tensor", "module", "step", "metatrace"}
        windows = {e["frames"][-2]["name"] for e in allocs}
        assert "optimizer" in windows and "before the iteration" in windows


def test_torch_memory_viz_reads_it(roles, tmp_path):
    rt = roles[1]
    snap = snapshot_of(rt)
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snap))
    snap = pickle.loads(path.read_bytes())
    left = replay(snap)
    left_bytes = sum(size for size, _ in left.values())

    summary = _memory_viz.segsum(snap)  # raises on inconsistent segments
    assert f"total_allocated: {_memory_viz.Bytes(left_bytes)}" in summary
    text = _memory_viz.trace(snap)
    assert f"{len(snap['device_traces'][0])} entries" in text
    assert text.count("cudaMalloc(") == 1 and text.count("# free completed for") > 10
    # The flamegraph inputs: one line per block, "frames bytes"; the allocated ones add up.
    for reader in (_memory_viz.memory, _memory_viz.segments):
        lines = reader(snap, format_flamegraph=lambda lines: lines).splitlines()
        active = [line for line in lines if ";active_allocated;" in line]
        assert sum(int(line.rsplit(" ", 1)[1]) for line in active) == left_bytes
        assert all(f"metatrace:0:rank {rt.role.rank}, pipeline stage 1" in line for line in active)
    # The HTML pages embed the pickle for the visualizer (base64 after padding to 3 bytes).
    for html in (_memory_viz.trace_plot(snap), _memory_viz.segment_plot(snap)):
        files = json.loads(re.search(r"const local_files = (\[.*\])", html).group(1))
        assert pickle.loads(base64.b64decode(files[0]["base64"])) == snap


def _trace(memory, *, static_bytes=0, parts=None, windows=()):
    return Trace(rank=0, modules=(), collectives=(), saved=(), memory=tuple(memory),
                 static_bytes=static_bytes, windows=tuple(windows), static_parts=parts or {})


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
    changes = [(1, MiB), (2, MiB), (3, MiB), (2, -MiB), (4, MiB // 2), (1, 512), (1, -512),
               (1, -MiB), (3, -MiB)]
    window = Window("forward", 0, 1, first=10, last=13, held=3)
    iteration = _trace(_events(static, changes), static_bytes=static, parts={"params": MiB},
                       windows=[window])
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


def test_choice_of_roles(roles):
    peaks = [role_memory(rt.trace, rt.iteration).peak for rt in roles]
    ((path, rt, peak),) = chosen_roles(roles, "snap.pickle")
    assert peak == max(peaks) and rt is roles[peaks.index(max(peaks))]
    per_stage = chosen_roles(roles, "out/stage{stage}.pickle")
    assert [(p, r.role.pp_stage) for p, r, _ in per_stage] == [
        ("out/stage0.pickle", 0), ("out/stage1.pickle", 1)]


def run(*argv):
    out = io.StringIO()
    code = main(list(argv), Console(file=out, width=120, color_system=None))
    return code, out.getvalue()


def test_cli_writes_the_rank_with_the_highest_peak_and_one_file_per_stage(tmp_path):
    one = tmp_path / "snap.pickle"
    code, text = run("run", "--config", DEBUG, "--no-full-model", "--jobs", "1", "-q",
                     "--json", str(tmp_path / "r.json"), "--memory-snapshot", str(one))
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    peaks = {r["traced_rank"]: r["memory"]["peak_bytes"] for r in report["roles"]}
    assert peaks[2] > peaks[0]  # the last stage holds the output layer's cuBLAS workspaces too
    assert (f"Memory snapshot of rank 2 (pipeline stage 1, the highest peak: "
            f"{peaks[2] / MiB:,.1f} MiB) written to {one}") in text
    assert max(allocated_over_time(pickle.loads(one.read_bytes()))) == peaks[2]

    code, text = run("run", "--config", DEBUG, "--no-full-model", "--jobs", "1", "-q",
                     "--memory-snapshot", str(tmp_path / "stage{stage}.pickle"))
    assert code == 0
    for stage, rank in ((0, 0), (1, 2)):
        path = tmp_path / f"stage{stage}.pickle"
        assert f"rank {rank} (pipeline stage {stage}: " in text and str(path) in text
        assert max(allocated_over_time(pickle.loads(path.read_bytes()))) == peaks[rank]


@pytest.mark.parametrize(
    "path, message",
    [
        ("{tmp}/missing/snap.pickle", "--memory-snapshot {tmp}/missing/snap.pickle: directory"),
        ("{tmp}", "--memory-snapshot {tmp} is a directory"),
        ("{tmp}/stage{{stage}}/snap.pickle",
         "--memory-snapshot {tmp}/stage0/snap.pickle: directory"),
    ],
)
def test_bad_snapshot_paths_exit_2_before_tracing(tmp_path, capsys, monkeypatch, path, message):
    import metatrace.tracing.trace

    def no_tracing(*args, **kwargs):
        raise AssertionError("traced before checking the path")

    monkeypatch.setattr(metatrace.tracing.trace, "trace_job", no_tracing)
    path = path.format(tmp=tmp_path)
    code, _ = run("run", "--config", DEBUG, "--memory-snapshot", path)
    assert code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
