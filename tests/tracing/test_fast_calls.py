"""The recorder's fast calls (hooks/recorder.py _DataSwaps: torch.empty, torch.distributed.isend
and irecv recorded without passing through the dispatch mode) against the usual path: every
record of every role, micro-batch and iteration, the same; and megatron-core imported with
torch._dynamo deferred (hooks/guards.py _LazyDynamo): a trace does not import it, and what
asks for it gets the real module."""

import dataclasses
import subprocess
import sys
import textwrap

import pytest

from metatrace.hooks import recorder
from metatrace.records import Trace
from metatrace.tracing.trace import trace_job
from tests.helpers import MOE, small_job

LAYOUTS = {
    "vpp2-dp2-cp2-overlap": {
        "model": {"num_layers": 8},
        "parallel": {"pp": 4, "vpp": 2, "cp": 2, "sequence_parallel": True, "tp": 2},
        "training": {
            "global_batch_size": 16,
            "distributed_optimizer": True,
            "overlap_grad_reduce": True,
            "overlap_param_gather": True,
        },
        "cluster": {"num_gpus": 32},
    },
    "moe-pp2-ep2": {
        "model": {**MOE, "num_layers": 4},
        "parallel": {"pp": 2, "ep": 2},
        "training": {"global_batch_size": 16},
        "cluster": {"num_gpus": 4},
    },
}


def _records(job_trace) -> list[dict]:
    out = []
    for rt in job_trace.roles:
        for trace in (rt.trace, rt.iteration):
            out.append({f.name: getattr(trace, f.name) for f in dataclasses.fields(Trace)})
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fast_calls_record_what_the_dispatch_mode_records(layout, monkeypatch):
    job = small_job(**LAYOUTS[layout])
    calls = {"empty": 0, "p2p": 0}
    empty, p2p = recorder._DataSwaps._empty, recorder._DataSwaps._p2p

    def count_empty(self, *args):
        out = empty(self, *args)
        calls["empty"] += out is not recorder._SLOW
        return out

    def count_p2p(self, *args):
        out = p2p(self, *args)
        calls["p2p"] += out is not recorder._SLOW
        return out

    monkeypatch.setattr(recorder._DataSwaps, "_empty", count_empty)
    monkeypatch.setattr(recorder._DataSwaps, "_p2p", count_p2p)
    fast = trace_job(job, full_model=False, workers=1, derive=False)
    # The fast calls ran (1F1B without virtual stages batches its transfers: no isend there).
    assert calls["empty"] and (calls["p2p"] or not job.parallel.vpp)
    monkeypatch.setattr(recorder, "FAST_CALLS", False)
    usual = trace_job(job, full_model=False, workers=1, derive=False)
    assert _records(fast) == _records(usual)


_LAZY = """
import sys, torch
from metatrace.hooks import guards
guards.import_megatron_core()
assert isinstance(sys.modules["torch._dynamo"], guards._LazyDynamo)
from tests.helpers import small_job
from metatrace.tracing.trace import trace_job
job = small_job(parallel={"pp": 2}, cluster={"num_gpus": 2})
trace_job(job, full_model=False, workers=1)
assert guards.imported_dynamo() is None, "a trace imported torch._dynamo"
ref = torch._refs.arange  # wrapped by torch._compile._disable_dynamo: our disable, so far
before = ref(0, 4, device="meta").shape
torch._dynamo.config  # anything else: the real module
assert guards.imported_dynamo() is sys.modules["torch._dynamo"] is torch._dynamo
assert not isinstance(torch._dynamo, guards._LazyDynamo)
assert ref(0, 4, device="meta").shape == before == (4,)  # now through the real disable
print("ok")
"""


def test_megatron_core_imported_with_dynamo_deferred():
    # A fresh interpreter: this session may have imported torch._dynamo already.
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LAZY)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
