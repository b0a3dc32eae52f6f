"""The time model of an iteration as a Chrome / Perfetto trace (pure: an Analysis with its
timing in, a JSON-ready dict out; open it in https://ui.perfetto.dev or chrome://tracing).

One process per pipeline stage ("stage s (ranks ...)"), with threads:
- compute: a complete event per step ("F m3 c1": forward of micro-batch 3, model chunk 1;
  "B ..." backward) and the optimizer step, args micro-batch, chunk, FLOPs, the rank's peak
  allocated bytes in the step, compute and exposed-communication seconds;
- communication: the exposed collectives of each step, inside it where the traced micro-batch
  issued them, and those of the optimizer step;
- overlapped communication: collectives Megatron overlaps with compute (the context-parallel
  ring), at their place, one after another;
- pipeline sends and receives, as async events (they may overlap one another and the steps).
Timestamps are microseconds from the start of the iteration (metatrace.analysis.timing's simulation).
"""

from __future__ import annotations

from metatrace.render.format import rank_span

COMPUTE, COMM, OVERLAPPED = 1, 2, 3
_THREADS = {COMPUTE: "compute", COMM: "communication", OVERLAPPED: "overlapped communication"}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _complete(name, pid, tid, start, end, cat, args) -> dict:
    ts = _us(start)
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "dur": round(_us(end) - ts, 3),
        "args": args,
    }


def step_name(span) -> str:
    if span.chunk is None:
        return span.phase
    return f"{span.phase[0].upper()} m{span.microbatch} c{span.chunk}"


def chrome_trace(analysis) -> dict:
    """{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}} of an Analysis
    (metatrace.analysis.analyze) whose `timing` is known."""
    timing = analysis.timing
    ranks = {ra.role.pp_stage: ra.role.ranks for ra in analysis.roles}
    events: list[dict] = []
    for st in timing.stages:
        pid = st.stage
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": pid,
                "args": {"name": f"stage {st.stage} (ranks {rank_span(ranks[st.stage])})"},
            }
        )
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": st.stage}}
        )
        for tid, name in _THREADS.items():
            events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            )
        overlapped_until = 0.0
        for span in st.spans:
            args = {
                "microbatch": span.microbatch,
                "chunk": span.chunk,
                "flops": span.flops,
                "peak_bytes": span.peak_bytes,
                "compute_seconds": span.compute_seconds,
                "exposed_comm_seconds": span.comm_seconds,
            }
            events.append(
                _complete(step_name(span), pid, COMPUTE, span.start, span.end, span.phase, args)
            )
            for call in span.calls:
                args = {
                    "bytes": call.bytes,
                    "dimension": call.dimension,
                    "module": call.module,
                    "step": step_name(span),
                }
                start = span.start + call.offset
                tid = COMM
                if call.overlapped is not None:
                    # Overlapped calls do not delay the step; shown one after another.
                    tid, args["overlapped_with"] = OVERLAPPED, call.overlapped
                    start = max(start, overlapped_until)
                    overlapped_until = start + call.seconds
                end = start + call.seconds
                events.append(
                    _complete(f"{call.op} {call.group}", pid, tid, start, end, "comm", args)
                )
    for i, t in enumerate(timing.transfers):
        (src, src_chunk), (dst, dst_chunk) = t.source, t.target
        step = f"{t.phase[0].upper()} m{t.microbatch}"
        args = {"bytes": t.bytes, "microbatch": t.microbatch, "seconds": t.end - t.start}
        for side, pid, name in (
            (0, src, f"send {step} c{src_chunk} to stage {dst}"),
            (1, dst, f"recv {step} c{dst_chunk} from stage {src}"),
        ):
            common = {"name": name, "cat": "p2p", "pid": pid, "tid": COMM, "id": 2 * i + side}
            events.append({**common, "ph": "b", "ts": _us(t.start), "args": args})
            events.append({**common, "ph": "e", "ts": _us(t.end)})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": analysis.job.source,
            "iteration_seconds": timing.iteration_seconds,
            "bubble_fraction": timing.bubble_fraction,
            "peak_tflops": timing.peak_tflops,
            "compute_efficiency": timing.efficiency,
        },
    }
