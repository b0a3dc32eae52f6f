"""The replayed iteration built from its steady state (metatrace.tracing.steady, through
iteration.replayed_iteration) against the whole replay: the same records, and the same report
(every number of the JSON report), for micro-batch counts below, at and past the threshold, in
every schedule: no pipelining, 1F1B, interleaved, data parallel with
overlapped gradient reduction and the distributed optimizer, MoE."""

import dataclasses

import pytest

from metatrace.analysis.analyze import analyze
from metatrace.export.report import job_report
from metatrace.records import Collective, JobTrace, MemEvent, Saved, Trace, Window
from metatrace.tracing import steady
from metatrace.tracing.trace import trace_role
from metatrace.world import World
from tests.helpers import MOE, small_job

LAYOUTS = {
    "pp1": ({"model": {"num_layers": 2}}, 1, [1, 37, 100]),
    "pp2-1f1b": ({"parallel": {"pp": 2}}, 1, [2, 37, 100]),
    # megatron-core wants whole groups of 2 here (a last group of 1 would leave less than pp).
    "pp2-vpp2": ({"parallel": {"pp": 2, "vpp": 2}, "model": {"num_layers": 4}}, 1, [4, 38, 100]),
    "dp2-overlap-distopt": (
        {
            "parallel": {"dp": 2},
            "training": {"overlap_grad_reduce": True, "distributed_optimizer": True},
        },
        2,
        [37, 100],
    ),
    "moe-ep2": ({"model": {**MOE, "num_layers": 2}, "parallel": {"ep": 2, "dp": 2}}, 2, [37, 100]),
}


RECORDS = {"collectives": Collective, "saved": Saved, "memory": MemEvent, "windows": Window}
assert set(RECORDS) == set(steady.KINDS)


def traced(sections, dp, microbatches, extend):
    data = {k: dict(v) for k, v in sections.items()}
    data.setdefault("training", {})["global_batch_size"] = 2 * dp * microbatches
    job = small_job(**data)
    world = World.from_job(job)
    roles = tuple(trace_role(job, world, role, extend=extend) for role in world.roles())
    return JobTrace(job=job, world=world, roles=roles, full=None)


def numbers(report):
    """The report without wall-clock times (tracing seconds)."""
    if isinstance(report, dict):
        return {k: numbers(v) for k, v in report.items() if k not in ("seconds", "trace_seconds")}
    if isinstance(report, list):
        return [numbers(v) for v in report]
    return report


CASES = [(name, m) for name, (_, _, counts) in LAYOUTS.items() for m in counts]


@pytest.mark.parametrize("layout, microbatches", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_steady_state_extension_equals_the_whole_replay(layout, microbatches):
    sections, dp, _ = LAYOUTS[layout]
    fast = traced(sections, dp, microbatches, extend=True)
    full = traced(sections, dp, microbatches, extend=False)
    extended = [isinstance(rt.iteration, steady.ExtendedTrace) for rt in fast.roles]
    # From 37 micro-batches on every layout here is past the steady state's threshold (MoE's
    # too: its losses are freed at the end newest first, and its first micro-batch allocates one
    # storage more, so the run of frees is the newest, not the last ones).
    assert all(extended) == (microbatches >= 37), extended
    for a, b in zip(fast.roles, full.roles):
        if isinstance(a.iteration, steady.ExtendedTrace):
            # Columns built from the steady state, before any record is: those of the records.
            fresh = steady.ExtendedTrace(*a.iteration.recipe)
            for kind, cls in RECORDS.items():
                names = tuple(f.name for f in dataclasses.fields(cls))
                got, want = fresh.columns(kind, names), b.iteration.columns(kind, names)
                for name in names:
                    assert got[name].dtype == want[name].dtype, (kind, name)
                    assert got[name].tolist() == want[name].tolist(), (kind, name)
            assert "_built" not in fresh.__dict__
        for f in dataclasses.fields(Trace):
            assert getattr(a.iteration, f.name) == getattr(b.iteration, f.name), f.name
    assert numbers(job_report(analyze(fast))) == numbers(job_report(analyze(full)))


def _trace(memory, op_counts):
    return Trace(
        rank=0,
        modules=(),
        collectives=(),
        saved=(),
        memory=tuple(memory),
        static_bytes=0,
        op_counts=op_counts,
    )


def _events(n, size):
    """A head, n repetitions of a step that keeps `size(j)` bytes, their frees in reverse."""
    out, live, seq = [], 0, 0
    sizes = [size(j) for j in range(3 + n)]
    for j, nbytes in enumerate(sizes):
        seq, live = seq + 1, live + nbytes
        out.append(MemEvent(seq, nbytes, live, "m", "forward", j))
    for j in reversed(range(len(sizes))):
        seq, live = seq + 1, live - sizes[j]
        out.append(MemEvent(seq, -sizes[j], live, "(step)", "optimizer", j))
    return out


def test_fit_builds_runs_in_either_order_and_refuses_what_is_not_affine():
    samples = [_trace(_events(n, lambda j: 512), {"op": 3 + 2 * n}) for n in range(4)]
    fitted = steady.fit(samples)
    assert fitted is not None
    big = fitted.trace(50)
    assert big.memory == tuple(_events(50, lambda j: 512))
    assert big.op_counts == {"op": 103}
    # Kept bytes that grow with the micro-batch: not the same step repeated.
    growing = [_trace(_events(n, lambda j: 512 * (1 + j)), {}) for n in range(4)]
    assert steady.fit(growing) is None
    # An operator count that is not affine in the repetitions.
    counts = [_trace(_events(n, lambda j: 512), {"op": n * n}) for n in range(4)]
    assert steady.fit(counts) is None
