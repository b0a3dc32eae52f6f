"""The largest micro-batch size that fits (`metatrace run --max-mbs`).

The global batch stays as configured; a micro-batch size is a candidate when it divides the
samples per data-parallel replica (global batch / dp) and the job stays valid (the interleaved
schedule needs the number of micro-batches to be a multiple of pp). Peak memory grows with the
micro-batch size, so a binary search over the candidates traces O(log n) of them, each one a
whole job (every role, one iteration).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from metatrace.analysis.analyze import Analysis, analyze
from metatrace.config import resolve
from metatrace.errors import ConfigError
from metatrace.tracing.checks import check_with_megatron


@dataclass(frozen=True)
class Probe:
    micro_batch_size: int
    num_microbatches: int
    peak: int
    """Highest peak over the roles (bytes)."""
    headroom: int
    """GPU memory left on the tightest rank after the reserved overhead (negative: missing)."""
    ranks: tuple[int, ...]
    """Ranks with the highest peak."""

    @property
    def fits(self) -> bool:
        return self.headroom >= 0


@dataclass(frozen=True)
class Search:
    candidates: tuple[int, ...]
    probes: tuple[Probe, ...]
    """In the order they were traced."""
    best: int | None
    """The largest micro-batch size that fits; None when even the smallest does not."""
    analysis: Analysis
    """The analysed trace of `best` (of the smallest candidate when nothing fits)."""


def candidates(job) -> list[tuple[int, object]]:
    """(micro-batch size, resolved job) for every valid size, smallest first."""
    tr = job.training
    per_replica = tr.global_batch_size // job.parallel.dp
    out = []
    for mbs in range(1, per_replica + 1):
        if per_replica % mbs:
            continue
        try:
            candidate = resolve(
                dataclasses.replace(job, training=dataclasses.replace(tr, micro_batch_size=mbs))
            )
            check_with_megatron(candidate)
        except ConfigError:
            continue
        out.append(
            (mbs, dataclasses.replace(candidate, notes=job.notes, not_modelled=job.not_modelled))
        )
    if not out:
        raise ConfigError(
            f"no micro-batch size divides global_batch_size / dp = {tr.global_batch_size} / "
            f"{job.parallel.dp} into a valid job"
        )
    return out


def max_micro_batch(job, trace: Callable, progress=None) -> Search:
    """Binary search for the largest fitting micro-batch size; `trace(job)` -> JobTrace."""
    progress = progress or (lambda message: None)
    options = candidates(job)
    probes, analyses = [], {}

    def probe(i: int) -> Probe:
        mbs, candidate = options[i]
        progress(f"micro-batch size {mbs}")
        analysis = analyze(trace(candidate))
        v = analysis.verdict
        p = Probe(mbs, candidate.num_microbatches, v.worst, v.headroom, v.worst_ranks)
        probes.append(p)
        analyses[i] = analysis
        return p

    lo, hi = 0, len(options) - 1  # the answer is the last fitting index in [lo - 1, hi]
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if probe(mid).fits:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if best is None and 0 not in analyses:
        probe(0)
    shown = best if best is not None else 0
    return Search(
        candidates=tuple(m for m, _ in options),
        probes=tuple(probes),
        best=options[best][0] if best is not None else None,
        analysis=analyses[shown],
    )
