"""`metatrace run --memory-snapshot`: the predicted iteration as a PyTorch memory snapshot.

Checked against the numbers metatrace reports (the peak, the static parts, the workspaces),
against the snapshot's own consistency (allocations and frees pair up, blocks never overlap,
the final segment holds what is still allocated), and through torch's own readers of the
format (torch.cuda._memory_viz, pure Python, no CUDA needed). The allocator itself, on
synthetic traces, is in tests/unit/test_snapshot.py."""

import base64
import io
import json
import pickle
import re

import pytest
from rich.console import Console
from torch.cuda import _memory_viz

from metatrace.analysis.memory import persistent_bytes, role_memory
from metatrace.cli import main
from metatrace.export.snapshot import chosen_roles, role_snapshot
from metatrace.tracing.trace import trace_job
from tests.helpers import DEBUG, allocated_over_time, replay, small_job

MiB = 2**20


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
        active = {
            b["address"]: (b["size"], b["frames"])
            for b in segment["blocks"]
            if b["state"] == "active_allocated"
        }
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


def test_choice_of_roles(roles):
    peaks = [role_memory(rt.trace, rt.iteration).peak for rt in roles]
    ((path, rt, peak),) = chosen_roles(roles, "snap.pickle")
    assert peak == max(peaks) and rt is roles[peaks.index(max(peaks))]
    per_stage = chosen_roles(roles, "out/stage{stage}.pickle")
    assert [(p, r.role.pp_stage) for p, r, _ in per_stage] == [
        ("out/stage0.pickle", 0),
        ("out/stage1.pickle", 1),
    ]


def run(*argv):
    out = io.StringIO()
    code = main(list(argv), Console(file=out, width=120, color_system=None))
    return code, out.getvalue()


def test_cli_writes_the_rank_with_the_highest_peak_and_one_file_per_stage(tmp_path):
    one = tmp_path / "snap.pickle"
    code, text = run(
        "run",
        "--config",
        DEBUG,
        "--no-full-model",
        "--jobs",
        "1",
        "-q",
        "--json",
        str(tmp_path / "r.json"),
        "--memory-snapshot",
        str(one),
    )
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    peaks = {r["traced_rank"]: r["memory"]["peak_bytes"] for r in report["roles"]}
    assert peaks[2] > peaks[0]  # the last stage holds the output layer's cuBLAS workspaces too
    assert (
        f"Memory snapshot of rank 2 (pipeline stage 1, the highest peak: "
        f"{peaks[2] / MiB:,.1f} MiB) written to {one}"
    ) in text
    assert max(allocated_over_time(pickle.loads(one.read_bytes()))) == peaks[2]

    code, text = run(
        "run",
        "--config",
        DEBUG,
        "--no-full-model",
        "--jobs",
        "1",
        "-q",
        "--memory-snapshot",
        str(tmp_path / "stage{stage}.pickle"),
    )
    assert code == 0
    for stage, rank in ((0, 0), (1, 2)):
        path = tmp_path / f"stage{stage}.pickle"
        assert f"rank {rank} (pipeline stage {stage}: " in text and str(path) in text
        assert max(allocated_over_time(pickle.loads(path.read_bytes()))) == peaks[rank]
