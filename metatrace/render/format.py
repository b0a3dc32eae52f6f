"""Formatting shared by every output: sizes, spans of ranks and layers, shapes, times, names of
operators, dtypes and phases."""

from __future__ import annotations

from rich.text import Text

from metatrace.analysis.margins import ErrorBand

MiB = 2**20
GiB = 2**30
TP_GROUPS = ("tp",)
PARAM_SHORT = {"weight": "w", "bias": "b", "layer_norm_weight": "ln.w", "layer_norm_bias": "ln.b"}


def mib(nbytes: int) -> str:
    value = nbytes / MiB
    if value >= 1 or value == 0:
        return f"{value:,.1f}"
    return f"{value:.3f}" if value >= 0.001 else "<0.001"


def size(nbytes: int) -> str:
    """A size for prose: MiB below 1 GiB, GiB above."""
    if nbytes >= GiB:
        return f"{nbytes / GiB:,.2f} GiB"
    return f"{mib(nbytes)} MiB"


def shape(dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def compact(dims) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def rank_span(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) <= 6:
        return ", ".join(str(r) for r in ranks)
    return f"{', '.join(str(r) for r in ranks[:4])}, … {ranks[-1]} ({len(ranks)} ranks)"


def layer_span(layers) -> str:
    if not layers:
        return "none"
    layers = list(layers)
    runs, start, prev = [], layers[0], layers[0]
    for n in layers[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        runs.append(f"{start}-{prev}" if prev != start else f"{start}")
        if n is not None:
            start = prev = n
    return ", ".join(runs)


def gpu_span(world, ranks) -> str:
    """The first and last GPU of sorted `ranks`."""
    return (
        f"{world.gpu(ranks[0])} … {world.gpu(ranks[-1])}" if len(ranks) > 1 else world.gpu(ranks[0])
    )


def peak_at(at, chunks: int = 1) -> str:
    if at.phase == "optimizer":
        return "optimizer step"
    where = at.phase
    if at.microbatch is not None:
        where += f" µb {at.microbatch}"
    if at.chunk is not None and chunks > 1:
        where += f" chunk {at.chunk}"
    where += f", {at.module or 'model'}"  # STEP: the training step outside the modules
    return where


def section(title: str) -> Text:
    return Text(f"\n{title}", style="bold")


DIM_TITLES = {
    "tp": "TP (+SP)",
    "cp": "CP",
    "ep": "EP",
    "dp": "DP",
    "pp": "PP",
    "other": "Other",
}
DIM_NAMES = {
    "tp": "tensor-parallel",
    "cp": "context-parallel",
    "ep": "expert-parallel",
    "dp": "data-parallel",
    "pp": "pipeline-parallel",
}
_OP = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "broadcast": "broadcast",
    "send": "send",
    "recv": "receive",
}
DTYPE_SHORT = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8e5",
    "int64": "int64",
    "bool": "bool",
}
PHASE_SHORT = {
    "forward": "fwd",
    "backward": "bwd",
    "recompute": "rec",
    "grad sync": "grad sync",
    "optimizer": "optimizer step",
}


def volume(nbytes: float) -> str:
    """Bytes for communication tables: B, KiB, MiB, GiB, TiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:,.1f} {unit}" if value >= 10 else f"{value:.2f} {unit}"
    return f"{nbytes:,.0f} B"


def seconds(value: float) -> str:
    if value >= 1:
        return f"{value:,.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:,.1f} ms"
    if value >= 1e-7:
        return f"{value * 1e6:,.1f} µs"
    return "<0.1 µs" if value else "0"


def time_terms(terms, total: float) -> str:
    """'compute 5.70 s (93%), pipeline idle 0.42 s (7%), ...': (name, seconds) terms of `total`,
    as given (largest first), those under 0.1 % of it left out."""
    shown = [(name, sec) for name, sec in terms if total > 0 and sec >= 1e-3 * total]
    return ", ".join(
        f"{name} {seconds(sec)} ({sec / total:.{0 if sec >= 0.01 * total else 1}%})"
        for name, sec in shown
    )


HOST_BOUND = 0.01
"""The share of an iteration the GPU waits for the host from which the iteration is called
host-bound."""


def where_it_goes(b, total: float, pipelined: bool) -> str:
    """The line of metatrace.analysis.timing.Breakdown `b` of an iteration of `total` seconds;
    "host-bound" where the GPU waits for the host HOST_BOUND of it or more (the term says how
    long)."""
    where = f"stage {b.stage}, the last to finish" if pipelined else "the iteration"
    if total > 0 and b.host >= HOST_BOUND * total:
        where += "; host-bound"
    return f"Where it goes ({where}): {time_terms(b.terms(), total)}"


def op(name: str) -> str:
    return _OP.get(name, name)


def band_sentence(v: dict) -> str:
    """Where the headroom (or the shortfall) of the report's memory_verdict `v` lies within the
    prediction's error band for the job's kind (metatrace.analysis.margins), a sentence that
    says so; else nothing."""
    b = v.get("error_band")
    if not b or not b["within"]:
        return ""
    phrase = ErrorBand(b["kind"], b["fraction"], b["source"]).phrase()
    if v["fits"]:
        return f" That headroom is within {phrase} ({size(b['bytes'])}): it may not fit."
    return f" That shortfall is within {phrase} ({size(b['bytes'])}): it may fit."


def verdict_text(gpu: str, v: dict) -> str:
    """The verdict's sentence (terminal and HTML) from the JSON report's memory_verdict `v`:
    the GPU ("h100 (79.1 GiB)"), the rank that takes the most of its GPU and its parts (the
    allocated peak, the caching allocator's reserve, what lives outside the allocator and its
    largest term), the margin the user keeps, and the headroom or what is missing; where
    expandable segments would change the verdict, by how much."""
    terms = v["outside_terms"]
    largest = f" ({terms[0]['term']} {size(terms[0]['bytes'])})" if terms else ""
    parts = (
        f"allocator reserve {size(v['allocator_reserve_bytes'])} (peak "
        f"{size(v['allocated_peak_bytes'])} allocated) + {size(v['outside_allocator_bytes'])} "
        f"outside it{largest}"
    )
    margin = v["reserved_overhead_bytes"]
    kept = f" + the {size(margin)} margin kept free" if margin else ""
    who = f"ranks {rank_span(v['device_ranks'])} take {size(v['device_bytes'])}"
    if v["fits"]:
        text = f"Fits on {gpu}: {who}: {parts}{kept}; headroom {size(v['headroom_bytes'])}."
        if v.get("allocator_retries"):
            text += " The allocator frees its cache to make room (slower steps)."
    else:
        text = (
            f"Out of memory on {gpu} by {size(-v['headroom_bytes'])} on ranks "
            f"{rank_span(v['out_of_memory_ranks'])}: {who}: {parts}{kept}."
        )
    text += band_sentence(v)
    e = v.get("expandable_segments")
    if e is not None and e["fits"] != v["fits"]:
        if e["fits"]:
            text += (
                " With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it fits (headroom "
                f"{size(e['headroom_bytes'])})."
            )
        else:
            text += (
                " With expandable_segments:True it would not fit (short by "
                f"{size(-e['headroom_bytes'])})."
            )
    return text
