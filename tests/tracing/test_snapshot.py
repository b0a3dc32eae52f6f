"""`metatrace run --memory-snapshot`: the predicted iteration as a PyTorch memory snapshot.

Checked against the numbers metatrace reports (the peak, the allocator's reserve, the static
parts, the workspaces), against the snapshot's own consistency (allocations and frees pair up
inside the segments reserved, blocks never overlap, the final segments hold what is still
allocated), and through torch's own readers of the format (torch.cuda._memory_viz, pure
Python, no CUDA needed). Synthetic traces are in tests/unit/test_snapshot.py."""

import base64
import io
import json
import pickle
import re

import pytest
from rich.console import Console
from torch.cuda import _memory_viz

from metatrace.analysis.memory import role_memory
from metatrace.cli import main
from metatrace.export.snapshot import chosen_roles, role_snapshot
from metatrace.tracing.trace import trace_job
from tests.helpers import DEBUG, allocated_over_time, replay, reserved_over_time, small_job

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


def test_the_trace_reaches_the_simulated_reserve_and_the_reported_peak(roles):
    from metatrace.analysis.device import allocations, simulate
    from metatrace.config.allocator import AllocatorConfig

    for rt in roles:
        m = role_memory(rt.trace, rt.iteration)
        snap = snapshot_of(rt)
        reserve = simulate(allocations(rt.trace, rt.iteration), AllocatorConfig())
        # The allocated bytes at their most: the simulation's (blocks as the allocator hands
        # them out), the analysis's peak within the blocks' rounding.
        assert max(allocated_over_time(snap)) == reserve.allocated
        assert reserve.allocated == pytest.approx(m.peak, rel=0.002)
        # The segments at their most: the predicted max_memory_reserved(), more than allocated.
        assert max(reserved_over_time(snap)) == reserve.reserved > reserve.allocated
        # Set-up first: one block per static storage, the parts' bytes.
        entries = snap["device_traces"][0]
        static: dict[str, int] = {}
        for e in entries:
            if e["action"] == "alloc" and e["frames"][0]["filename"] == "static":
                part = e["frames"][0]["name"]
                static[part] = static.get(part, 0) + e["size"]
        assert static == {"params": m.params, "grads": m.grads, "optimizer": m.optimizer}
        kept = [e for e in entries if e["frames"] and e["frames"][0]["filename"] == "workspace"]
        assert sum(e["size"] for e in kept if e["action"] == "alloc") >= m.workspaces > 0
    peaks = [role_memory(rt.trace, rt.iteration).peak for rt in roles]
    assert peaks[0] != peaks[1]  # the default choice below is not a tie


def test_allocations_and_frees_pair_up_and_the_segments_hold_what_is_left(roles):
    for rt in roles:
        snap = snapshot_of(rt)
        live = replay(snap)
        entries = snap["device_traces"][0]
        allocs = sum(e["action"] == "alloc" for e in entries)
        frees = sum(e["action"] == "free_completed" for e in entries)
        assert allocs - frees == len(live)
        segments = snap["segments"]
        assert len(segments) == sum(e["action"] == "segment_alloc" for e in entries) > 1
        active = {
            b["address"]: (b["size"], b["frames"])
            for segment in segments
            for b in segment["blocks"]
            if b["state"] == "active_allocated"
        }
        assert active == live
        for segment in segments:
            assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
            allocated = sum(b["size"] for b in segment["blocks"] if b["state"] != "inactive")
            assert segment["allocated_size"] == allocated
            assert segment["total_size"] % (2 << 20) == 0


def test_frames_name_the_part_the_module_and_the_step(roles):
    for rt in roles:
        snap = snapshot_of(rt)
        allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
        root = (
            f"rank {rt.role.rank}, pipeline stage {rt.role.pp_stage}: set-up, the first "
            "micro-batch, two iterations"
        )
        root_frame = {"filename": "metatrace", "line": 0, "name": root}
        assert all(e["frames"][-1] == root_frame for e in allocs)
        # Every forward step of the iteration runs the traced step's tensors: 4 micro-batches
        # x 2 chunks, in each of the two iterations.
        steps = {e["frames"][-2]["name"] for e in allocs}
        for i in (1, 2):
            for mb in range(4):
                for chunk in range(2):
                    assert f"iteration {i}: forward of micro-batch {mb}, chunk {chunk}" in steps
            assert f"iteration {i}: optimizer" in steps
        kinds = {f["filename"] for e in allocs for f in e["frames"]}
        assert kinds <= {"static", "workspace", "module", "step", "metatrace"}
        assert any(step.startswith("set-up") for step in steps)


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
    assert f"segments: {len(snap['segments'])}" in summary
    text = _memory_viz.trace(snap)
    assert f"{len(snap['device_traces'][0])} entries" in text
    assert text.count("cudaMalloc(") == len(snap["segments"])
    assert text.count("# free completed for") > 10
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
    # the allocated bytes at their most: the peak, the allocator's blocks' rounding aside
    assert max(allocated_over_time(pickle.loads(one.read_bytes()))) == pytest.approx(
        peaks[2], rel=0.002
    )

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
        highest = max(allocated_over_time(pickle.loads(path.read_bytes())))
        assert highest == pytest.approx(peaks[rank], rel=0.002)
