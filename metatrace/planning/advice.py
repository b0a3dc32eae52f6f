"""What to change when a job does not fit (`metatrace run`; `--no-advice` turns it off).

When the verdict is out of memory, or fits by less than the prediction's error band for the
job's kind (metatrace.analysis.margins), the smallest single changes that make it fit beyond
that band, each one traced:

1. `PYTORCH_ALLOC_CONF=expandable_segments:True`, where the verdict's own allocator simulation
   over the job's traced allocations says it fits so (nothing more to trace: the same
   allocations, laid out otherwise, the step time unchanged);
2. every other kind of change is a ladder of steps, smallest first (metatrace.planning.variants:
   micro-batch size, recompute, activation offloading, the distributed optimizer and
   Megatron-FSDP, a larger tensor- or pipeline-parallel size); each ladder's first step whose
   closed-form estimate, anchored on the traced job, fits beyond the band and what the
   estimate may miss by (Anchor.margin: the allocator's fragmentation) is its candidate, else
   its first step estimated to fit beyond the band alone (ladders with none are pruned);
3. candidates are traced by estimated step time, `want` at once (their roles share the worker
   processes: metatrace.tracing.trace.trace_jobs), until `want` fit beyond the band or
   `budget` traces are done; a step that does not fit (or only within the band) queues its
   ladder's next step, estimated from its own trace (for a ladder of one number, with the
   closed form's change scaled by what the traced step really changed);
4. the changes that fit are listed by step time, each with its traced highest peak, headroom
   and step time (the time model's, as `metatrace run` prints it).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from metatrace.analysis.margins import ErrorBand, error_band
from metatrace.config.allocator import parse_alloc_conf
from metatrace.config.megatron.to_args import megatron_args
from metatrace.export.advice import describe_keys
from metatrace.planning.variants import (
    Anchor,
    Step,
    estimated_peak,
    estimated_seconds,
    ladders,
)

WANT = 2
"""Traced changes that fit beyond the band before the search stops."""
BUDGET = 4
"""Most variants traced."""


@dataclass(frozen=True)
class Advised:
    kind: str
    keys: tuple[tuple[str, Any], ...]
    """The job-file keys the change sets (dotted paths)."""
    flags: tuple[str, ...]
    """The same as Megatron-LM arguments (flags and their values, `no --flag` for one dropped,
    NAME=VALUE for an environment variable)."""
    peak: int
    """The traced highest allocated peak of any rank."""
    headroom: int
    fits: bool
    within_error: bool
    """It fits (or misses) by less than the prediction's error band."""
    seconds: float | None
    """The traced step time (None when the GPU's peak FLOP/s is unknown)."""
    estimated_peak: int
    """The closed-form estimate of the binding rank's peak that chose it."""
    traced: bool = True
    """False for expandable segments: the job's own trace, its allocator run again."""


@dataclass(frozen=True)
class Advice:
    band: ErrorBand
    peak: int
    """The job's highest allocated peak, as traced."""
    headroom: int
    seconds: float | None
    changes: tuple[Advised, ...]
    """The changes that fit, by step time (within the band last)."""
    misses: tuple[Advised, ...]
    """Traced changes that do not fit."""
    failed: tuple[tuple[tuple, tuple[str, ...], str], ...]
    """Changes metatrace could not trace: their keys, flags and the error's first line."""
    considered: int
    """Steps resolved and checked, of every ladder."""
    pruned: int
    """Ladders with no step estimated to fit beyond the band."""


def needs_advice(analysis) -> bool:
    """Out of memory, or fitting within the prediction's error band."""
    v = analysis.verdict
    if v is None:
        return False
    return not v.fits or error_band(analysis.job).within(v.headroom, v.binding.allocated)


def flag_changes(base, job) -> tuple[str, ...]:
    """The Megatron-LM arguments of `job` that differ from `base`'s."""

    def parsed(args: list[str]) -> dict[str, tuple[str, ...]]:
        out: dict[str, tuple[str, ...]] = {}
        flag = None
        for token in args:
            if token.startswith("--"):
                flag = token
                out[flag] = ()
            elif flag is not None:
                out[flag] += (token,)
        return out

    a, b = parsed(megatron_args(base)), parsed(megatron_args(job))
    out = [" ".join((flag, *values)) for flag, values in b.items() if a.get(flag) != values]
    out += [f"no {flag}" for flag in a if flag not in b]
    return tuple(out)


def _expandable(analysis, band: ErrorBand, seconds) -> Advised | None:
    """Expandable segments, where the verdict's simulation says the job fits with them and
    has more headroom so."""
    v, job = analysis.verdict, analysis.job
    if v.expandable_ranks_oom is None or v.expandable_ranks_oom:
        return None
    if v.expandable_headroom <= v.headroom:
        return None
    given = job.cluster.allocator_conf
    conf = f"{given},expandable_segments:True" if given else "expandable_segments:True"
    if not parse_alloc_conf(conf).expandable_segments:
        return None
    return Advised(
        kind="allocator",
        keys=(("cluster.allocator_conf", conf),),
        flags=(f"PYTORCH_ALLOC_CONF={conf}",),
        peak=v.worst,
        headroom=v.expandable_headroom,
        fits=True,
        within_error=band.within(v.expandable_headroom, v.binding.allocated),
        seconds=seconds,
        estimated_peak=v.binding.allocated,
        traced=False,
    )


def anchor_of(analysis, step: Step | None = None, scale: float | None = None) -> Anchor:
    """The estimates' anchor on a traced analysis (of `step`'s job, or of the job itself)."""
    v = analysis.verdict
    binding = next(r for r in analysis.roles if r.device is v.binding)
    return Anchor(
        job=analysis.job,
        memory=binding.memory,
        tree=binding.tree,
        peak=v.binding.allocated,
        room=v.headroom,
        reserve_ratio=v.binding.used.reserved / max(1, v.binding.allocated),
        seconds=analysis.timing.iteration_seconds if analysis.timing else None,
        shares=step.shares if step is not None else (),
        scale=scale,
    )


def _next_anchor(anchor: Anchor, step: Step, estimate: int, result) -> Anchor | None:
    """The anchor on a traced step that did not fit beyond the band. For a step of one number,
    the scale of the closed form's change carries on (None when the step did not help: the
    ladder ends)."""
    if not step.numeric:
        return anchor_of(result, step)
    guessed = anchor.headroom(estimate, step) - anchor.room
    got = result.verdict.headroom - anchor.room
    if got <= 0 or guessed <= 0:
        return None
    return anchor_of(result, step, scale=(anchor.scale or 1.0) * got / guessed)


class _Queue:
    """The candidates to trace, by estimated step time: at most one step of each ladder."""

    def __init__(self, ladders_: list[list[Step]], band: ErrorBand):
        self.ladders, self.band = ladders_, band
        self.heap: list[tuple[float, int, int, int, Anchor]] = []  # seconds, peak, ladder, step

    def push(self, ladder: int, start: int, anchor: Anchor) -> None:
        """The ladder's first step from `start` on estimated to fit beyond the band and what
        the estimate may miss by (else the first estimated to fit beyond the band alone)."""
        steps = self.ladders[ladder]
        peaks = {i: estimated_peak(anchor, steps[i]) for i in range(start, len(steps))}
        room = {i: anchor.headroom(p, steps[i]) - self.band.bytes_of(p) for i, p in peaks.items()}
        i = next((i for i in peaks if room[i] >= anchor.margin(steps[i])), None)
        if i is None:
            i = next((i for i in peaks if room[i] >= 0), None)
        if i is not None:
            est = estimated_seconds(anchor, steps[i])
            heapq.heappush(
                self.heap, (est if est is not None else 0.0, peaks[i], ladder, i, anchor)
            )

    def pop(self, count: int) -> list[tuple[Step, int, int, int, Anchor]]:
        """(step, its estimated peak, ladder, step index, anchor) of the `count` fastest."""
        out = []
        for _ in range(min(count, len(self.heap))):
            _, peak, ladder, i, anchor = heapq.heappop(self.heap)
            out.append((self.ladders[ladder][i], peak, ladder, i, anchor))
        return out


def advise(
    analysis,
    trace: Callable[[list], list],
    *,
    want: int = WANT,
    budget: int = BUDGET,
    progress: Callable[[str], None] | None = None,
) -> Advice:
    """The advice for a traced and analysed job (see the module docstring); `trace(jobs) ->
    [Analysis]` traces variants, at once where it can."""
    job, v = analysis.job, analysis.verdict
    band = error_band(job)
    base = anchor_of(analysis)
    found = ladders(job)
    queue = _Queue(found, band)
    for ladder in range(len(found)):
        queue.push(ladder, 0, base)
    pruned = len(found) - len(queue.heap)
    extra = _expandable(analysis, band, base.seconds)
    changes: list[Advised] = [extra] if extra is not None else []
    misses: list[Advised] = []
    failed: list[tuple[Step, Exception]] = []
    traced = clear = 0
    while queue.heap and traced < budget and clear < want:
        batch = queue.pop(min(want - clear, budget - traced))
        for step, *_ in batch:
            if progress:
                progress("advice: tracing " + describe_keys(step.keys))
        results = _trace_each(trace, [step for step, *_ in batch])
        traced += len(batch)
        for (step, est, ladder, i, anchor), result in zip(batch, results):
            if isinstance(result, Exception):
                failed.append((step, result))
                continue
            got = _advised(job, step, result, band, est)
            (changes if got.fits else misses).append(got)
            if got.fits and not got.within_error:
                clear += 1
            else:  # the ladder's next step, estimated from this one's trace
                following = _next_anchor(anchor, step, est, result)
                if following is not None:
                    queue.push(ladder, i + 1, following)
    changes.sort(key=lambda a: (a.within_error, a.seconds or 0.0, a.peak))
    return Advice(
        band=band,
        peak=v.worst,
        headroom=v.headroom,
        seconds=base.seconds,
        changes=tuple(changes),
        misses=tuple(misses),
        failed=tuple((step.keys, flag_changes(job, step.job), _reason(e)) for step, e in failed),
        considered=sum(len(steps) for steps in found),
        pruned=pruned,
    )


def _advised(job, step: Step, result, band: ErrorBand, estimate: int) -> Advised:
    """A traced change's figures."""
    v = result.verdict
    return Advised(
        kind=step.kind,
        keys=step.keys,
        flags=flag_changes(job, step.job),
        peak=v.worst,
        headroom=v.headroom,
        fits=v.fits,
        within_error=band.within(v.headroom, v.binding.allocated),
        seconds=result.timing.iteration_seconds if result.timing else None,
        estimated_peak=estimate,
    )


def _trace_each(trace, steps: list[Step]) -> list:
    """trace() of every step's job, at once; where that fails, one at a time, each failure as
    its exception (a change metatrace cannot trace is reported, not advised)."""
    try:
        return trace([s.job for s in steps])
    except Exception:  # which of them failed is found below
        pass
    out: list = []
    for step in steps:
        try:
            out += trace([step.job])
        except Exception as e:  # reported with the advice
            out.append(e)
    return out


def _reason(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:60]}" if text else type(error).__name__
