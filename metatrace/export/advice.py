"""The advice of `metatrace run` (metatrace.planning.advice) as JSON data: what the report's
`advice` holds and what the terminal and HTML outputs render."""

from __future__ import annotations


def describe_keys(keys) -> str:
    """Job-file keys as a job file writes them, on one line: `training.micro_batch_size: 1`."""

    def show(value) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if value is None:
            return "null"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
        if isinstance(value, list):
            return "[" + ", ".join(show(v) for v in value) + "]"
        return str(value)

    return "; ".join(f"{key}: {show(value)}" for key, value in keys)


def _change(a, as_flags: bool, seconds: float | None) -> dict:
    delta = a.seconds - seconds if a.seconds is not None and seconds is not None else None
    return {
        "kind": a.kind,
        "change": " ".join(a.flags) if as_flags else describe_keys(a.keys),
        "keys": {path: value for path, value in a.keys},
        "megatron_args": list(a.flags),
        "highest_peak_bytes": a.peak,
        "headroom_bytes": a.headroom,
        "fits": a.fits,
        "within_error_band": a.within_error,
        "iteration_seconds": a.seconds,
        "delta_seconds": delta,
        "estimated_peak_bytes": a.estimated_peak,
        "traced": a.traced,
    }


def advice_report(advice, *, as_flags: bool) -> dict:
    """`advice` (metatrace.planning.advice.Advice) as data; `as_flags`: each change written as
    Megatron-LM arguments (the job came as such) rather than job-file keys."""
    return {
        "given_as": "megatron_args" if as_flags else "job_file",
        "iteration_seconds": advice.seconds,
        "changes": [_change(a, as_flags, advice.seconds) for a in advice.changes],
        "misses": [_change(a, as_flags, advice.seconds) for a in advice.misses],
        "failed": [
            {"change": " ".join(flags) if as_flags else describe_keys(keys), "error": error}
            for keys, flags, error in advice.failed
        ],
        "considered": advice.considered,
        "pruned": advice.pruned,
    }
