"""A replayed iteration of many micro-batches, built exactly from a few short replays (pure: Trace
records in, a Trace out; no torch).

megatron-core's schedules repeat a steady state: 1F1B runs its warm-up forwards, then one
forward and one backward step per micro-batch, then the cool-down backwards; the interleaved
schedule does the same with the chunks of a group of `microbatch_group_size_per_vp_stage`
micro-batches. The number of micro-batches M changes only how often the loop body runs: the
warm-up count, the first and the last micro-batch depend on the rank and on M's remainder by the
group size, not on M. So the replayed iteration of M0 + n*P micro-batches (P the group size,
M0 past the warm-up) is

    head + block_0 + block_1 + ... + block_(n-1) + tail_n

for each kind of record (collectives, saved tensors, memory events, windows): the records
before the steady state (`head`, the same for every n), n repetitions of the loop body, and the
records after it. Every repetition does what the one before did, with its records renumbered:
the recorder numbers events (`seq`) and storages in order, and a repetition adds the same number
of each; the live bytes grow by what a repetition keeps for the rest of the iteration (on the
last stage, the loss megatron-core's forward_data_store keeps for every micro-batch, as the real
run does); windows name the next micro-batches. Each integer field of a record in the block is
therefore base + j*step in repetition j, and each in the tail base + n*step; every other field
(shapes, modules, phases, operators) is the same in every repetition. Operator counts are
affine in n the same way.

`fit` reads the head, the block and the tail from replays of M0, M0+P, M0+2P and M0+3P
micro-batches, and checks that its model rebuilds each of the four record for record (every
field equal, the three repetitions of the block included); `Steady.trace(n)` is then the replay
of M0 + n*P micro-batches, not an estimate: the same records, so the same peak, timeline,
communication and time model. When the check fails, `fit` returns None and the caller replays
the whole iteration.

Known limitations: the extension assumes that nothing in the replay counts micro-batches past
M0 + 3P (iteration.steady_counts sets M0 past the counters it knows: the warm-up, the deferred
embedding-gradient limit); a counter that turned later would pass the check and still differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from metatrace.records import Trace, column

KINDS = ("collectives", "saved", "memory", "windows")
"""The Trace fields that hold one record per event, in seq order."""


@dataclass(frozen=True)
class _Affine:
    """A record whose integer fields are base + n * per_n + j * per_j (n the repetitions of the
    iteration, j the repetition a record of a run belongs to)."""

    cls: type
    base: tuple
    per_n: tuple
    per_j: tuple
    moving: tuple[int, ...]
    """Indices of the fields that change."""

    def values(self, n: int, j: int = 0) -> tuple:
        if not self.moving:
            return self.base
        out = list(self.base)
        for i in self.moving:
            out[i] += n * self.per_n[i] + j * self.per_j[i]
        return tuple(out)


@dataclass(frozen=True)
class _Series:
    """One kind of record: fixed parts (one record each for every n) and runs (n repetitions of
    a block of records), in order (module docstring)."""

    parts: tuple[tuple[bool, tuple[_Affine, ...]], ...]
    """(is a run, its records)."""

    def values(self, n: int) -> list[tuple]:
        out: list[tuple] = []
        for run, records in self.parts:
            for j in range(n) if run else (0,):
                out.extend(r.values(n, j) for r in records)
        return out

    def columns(self, n: int, fields: tuple[str, ...], cls: type) -> dict:
        """Trace.columns of the records of `n` repetitions, built part by part with numpy (a
        run's integer fields as base + j*step over its repetitions j, the others repeated)."""
        import numpy as np

        index = {name: i for i, name in enumerate(_names(cls))}
        pieces: dict[str, list] = {name: [] for name in fields}
        for run, records in self.parts:
            if not records:
                continue
            if not run:
                values = [r.values(n, 0) for r in records]
                for name in fields:
                    pieces[name].append(column([v[index[name]] for v in values]))
                continue
            if n == 0:
                continue
            first = [r.values(n, 0) for r in records]
            for name in fields:
                i = index[name]
                block = column([v[i] for v in first])
                steps = [r.per_j[i] for r in records]
                if not any(steps):
                    pieces[name].append(np.tile(block, n))
                    continue
                if block.dtype == object:  # ints that move beside values that are not ints
                    values = [v[i] for v in first]
                    pieces[name].append(
                        column(
                            [
                                v + j * step if step else v
                                for j in range(n)
                                for v, step in zip(values, steps)
                            ]
                        )
                    )
                    continue
                j = np.arange(n, dtype=np.int64)[:, None]
                pieces[name].append((block[None, :] + j * np.array(steps)[None, :]).ravel())
        out = {}
        for name, parts in pieces.items():
            if not parts:
                out[name] = column([])
            elif all(p.dtype != object for p in parts):
                out[name] = np.concatenate(parts)
            else:
                out[name] = np.concatenate([p.astype(object) for p in parts])
        return out

    def records(self, n: int) -> list:
        out: list = []
        for run, records in self.parts:
            for j in range(n) if run else (0,):
                out.extend(r.cls(*r.values(n, j)) for r in records)
        return out


@dataclass(frozen=True)
class Steady:
    """A replayed iteration as a function of the repetitions n of its steady state."""

    base: Trace
    """The replay of M0 micro-batches (n = 0)."""
    series: dict
    """{Trace field: _Series} for KINDS and for collective_flops (as (seq, flops) pairs)."""
    counts: dict
    """{"op_counts" | "unclassified": {operator: (base, step)}}."""

    def trace(self, n: int) -> Trace:
        """The iteration of M0 + n*P micro-batches (its records built when first read)."""
        return ExtendedTrace(self, n)

    def field(self, n: int, name: str):
        """A Trace field of the iteration of M0 + n*P micro-batches that depends on n (_LAZY)."""
        if name in KINDS:
            return tuple(self.series[name].records(n))
        if name == "collective_flops":
            return dict(self.series["collective_flops"].values(n))
        return {op: b + n * step for op, (b, step) in self.counts[name].items() if b + n * step}


_LAZY = (*KINDS, "op_counts", "unclassified", "collective_flops")


class ExtendedTrace(Trace):
    """What Steady.trace returns: a Trace like any other (every record of the iteration), whose
    records are built when first read, and which pickles as its recipe (a Steady and n), so that
    a traced role crosses from a worker process in kilobytes, not millions of records."""

    recipe: tuple

    def __init__(self, steady: Steady, n: int):  # not the dataclass's: the records wait
        for f in dataclasses.fields(Trace):
            if f.name not in _LAZY:
                object.__setattr__(self, f.name, getattr(steady.base, f.name))
        object.__setattr__(self, "recipe", (steady, n))

    def __reduce__(self):
        return (ExtendedTrace, self.recipe)

    def columns(self, kind: str, names: tuple[str, ...]) -> dict:
        if kind in self.__dict__.get("_built", {}) or kind not in KINDS:
            return super().columns(kind, names)
        steady, n = self.recipe
        series = steady.series[kind]
        cls = next((r.cls for _, rs in series.parts for r in rs), None)
        if cls is None:  # no records of this kind
            return {name: column([]) for name in names}
        return series.columns(n, names, cls)

    def tally(self, kind: str, ignore: frozenset[str] = frozenset({"seq"})) -> list:
        if kind in self.__dict__.get("_built", {}) or kind not in KINDS:
            return super().tally(kind, ignore)
        steady, n = self.recipe
        out = []
        for run, records in steady.series[kind].parts:
            for r in records:
                names = _names(r.cls)
                if not run:
                    out.append((r.cls(*r.values(n)), 1))
                elif n and all(names[i] in ignore for i in r.moving if r.per_j[i]):
                    out.append((r.cls(*r.values(n)), n))
                else:
                    out.extend((r.cls(*r.values(n, j)), 1) for j in range(n))
        return out

    def pick(self, kind: str, indices) -> list:
        if kind in self.__dict__.get("_built", {}) or kind not in KINDS:
            return super().pick(kind, indices)
        indices = list(indices)
        if not indices:
            return []
        series = self.recipe[0].series[kind]
        cls = next(r.cls for _, rs in series.parts for r in rs)
        names = _names(cls)
        cols = series.columns(self.recipe[1], names, cls)
        lists = {name: cols[name][indices].tolist() for name in names}
        return [cls(*(lists[name][k] for name in names)) for k in range(len(indices))]

    def _field(self, name: str):
        built = self.__dict__.get("_built")
        if built is None:
            built = {}
            object.__setattr__(self, "_built", built)
        if name not in built:
            built[name] = self.recipe[0].field(self.recipe[1], name)
        return built[name]


def _lazy(name: str) -> property:
    return property(lambda self: self._field(name))


for _name in _LAZY:
    setattr(ExtendedTrace, _name, _lazy(_name))


def fit(samples: list[Trace]) -> Steady | None:
    """The Steady of four replays of M0, M0+P, M0+2P and M0+3P micro-batches (in that order), or
    None when they are not head + n blocks + tail with affine integer fields."""
    if len(samples) != 4:
        raise ValueError("fit needs the replays of M0 + n*P micro-batches for n = 0, 1, 2, 3")
    first = samples[0]
    for t in samples[1:]:
        same = (t.rank, t.modules, t.static_bytes, t.static_parts)
        if same != (first.rank, first.modules, first.static_bytes, first.static_parts):
            return None
    series = {}
    for kind in (*KINDS, "collective_flops"):
        if kind == "collective_flops":
            records = [sorted(t.collective_flops.items()) for t in samples]
        else:
            records = [list(getattr(t, kind)) for t in samples]
        s = _fit_series([[_values(r) for r in rs] for rs in records], records)
        if s is None:
            return None
        series[kind] = s
    counts = {}
    for name in ("op_counts", "unclassified"):
        dicts = [getattr(t, name) for t in samples]
        ops: dict = {}
        for op in set().union(*dicts):
            v = [d.get(op, 0) for d in dicts]
            step = v[1] - v[0]
            if any(v[n] != v[0] + n * step for n in range(4)):
                return None
            ops[op] = (v[0], step)
        counts[name] = ops
    return Steady(base=first, series=series, counts=counts)


_NAMES: dict[type, tuple[str, ...]] = {}


def _names(cls: type) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _values(record) -> tuple:
    if type(record) is tuple:
        return record
    return tuple(getattr(record, name) for name in _names(type(record)))


COUNTERS = frozenset(
    {
        "seq",
        "live",
        "storage",
        "microbatch",
        "first",
        "last",
        "output",
        "held",
        "kernels",
        "host_ps",
        "syncs",
    }
)
"""Integer fields that number things (events, storages, micro-batches) or add them up (live
bytes; a window's kernels, host work and synchronisations: the optimizer step's reduction of
the losses views each micro-batch's): they may change from one repetition to the next. The
others locate a repetition's records in the next replay (`_fit_series`)."""


def _key(cls, row: tuple) -> tuple:
    if cls is tuple:  # collective_flops: (seq, flops)
        return row[1:]
    names = _NAMES[cls]
    return (cls, *(v for name, v in zip(names, row) if name not in COUNTERS))


def _fit_series(rows: list[list[tuple]], records: list) -> _Series | None:
    """The parts of one kind of record from the four samples' records (as value tuples),
    checked against all four, or None.

    The replay of M0+P holds the records of M0's and more: past their common beginning, difflib
    aligns the two by what does not count (COUNTERS left out), and each stretch the larger one
    inserts is a run."""
    import difflib

    a, b = rows[:2]
    types = [type(r) for r in records[0]], [type(r) for r in records[1]]
    # What the two replays record alike up to where they part is the same for every n; the
    # rest aligns by what does not count.
    cut = 0
    while cut < min(len(a), len(b)) and a[cut] == b[cut]:
        cut += 1
    keys = [[_key(t, row) for t, row in zip(ts[cut:], rs[cut:])] for ts, rs in zip(types, (a, b))]
    ops = [
        (tag, i1 + cut, i2 + cut, j1 + cut, j2 + cut)
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(
            None, keys[0], keys[1], autojunk=False
        ).get_opcodes()
    ]
    if cut:
        ops.insert(0, ("equal", 0, cut, 0, cut))
    series = _build(ops, rows, types)
    if series is not None:
        return series
    # Where the records an insert repeats are like the ones before it (a chain of frees at the
    # end of the iteration, one per micro-batch, the oldest last), difflib may take the wrong
    # ones for the new: try the insert earlier.
    full = [[_key(t, row) for t, row in zip(ts, rs)] for ts, rs in zip(types, (a, b))]
    for k, (tag, _, _, j1, j2) in enumerate(ops):
        if tag != "insert" or k == 0 or ops[k - 1][0] != "equal":
            continue
        _, e1, e2, f1, f2 = ops[k - 1]
        for shift in range(1, e2 - e1 + 1):
            if full[0][e2 - shift : e2] != full[1][j2 - shift : j2]:
                break
            moved = [
                *ops[: k - 1],
                *([("equal", e1, e2 - shift, f1, f2 - shift)] if shift < e2 - e1 else []),
                ("insert", e2 - shift, e2 - shift, j1 - shift, j2 - shift),
                ("equal", e2 - shift, e2, j2 - shift, j2),
                *ops[k + 1 :],
            ]
            series = _build(moved, rows, types)
            if series is not None:
                return series
    return None


def _build(ops: list[tuple], rows: list[list[tuple]], types) -> _Series | None:
    """The series of an alignment of the first two samples (difflib opcodes), checked against
    all four samples, or None."""
    a, b, c, _ = rows
    parts = []
    at = [0, 0, 0, 0]  # where the part starts in each sample
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            fixed = []
            for k in range(i2 - i1):
                r = _affine(types[0][i1 + k], a[i1 + k], b[j1 + k], b[j1 + k])
                if r is None:
                    return None
                fixed.append(r)
            parts.append((False, tuple(fixed)))
            at = [x + i2 - i1 for x in at]
        elif tag == "insert":
            size = j2 - j1
            if at[2] + 2 * size > len(c):
                return None
            run = []
            for q in range(size):
                # Repetition 0 in the replays of n = 1 and 2, repetition 1 in that of n = 2.
                x, y, z = b[at[1] + q], c[at[2] + q], c[at[2] + size + q]
                r = _affine(types[1][j1 + q], x, y, z, at_n=1)
                if r is None:
                    return None
                run.append(r)
            parts.append((True, tuple(run)))
            at = [x + n * size for n, x in enumerate(at)]
        else:
            return None
    series = _Series(tuple(parts))
    for n, row in enumerate(rows):
        if series.values(n) != row:
            return None
    return series


def _affine(cls, x: tuple, y: tuple, z: tuple, *, at_n: int = 0) -> _Affine | None:
    """x at (n, j) = (at_n, 0), y at (at_n + 1, 0), z at (at_n + 1, 1) (z = y for a fixed
    record): integer fields may change, nothing else."""
    if not len(x) == len(y) == len(z):
        return None
    per_n, per_j = [], []
    for u, v, w in zip(x, y, z):
        if type(u) is int and type(v) is int and type(w) is int:
            per_n.append(v - u)
            per_j.append(w - v)
        elif u == v == w and type(u) is type(v) is type(w):
            per_n.append(0)
            per_j.append(0)
        else:
            return None
    moving = tuple(i for i in range(len(x)) if per_n[i] or per_j[i])
    base = tuple(u - at_n * per_n[i] if per_n[i] else u for i, u in enumerate(x))
    return _Affine(cls, base, tuple(per_n), tuple(per_j), moving)
