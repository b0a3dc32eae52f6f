"""PYTORCH_ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF): the settings of PyTorch's CUDA caching
allocator that change the memory it reserves, as torch 2.13 reads them
(c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.h). metatrace.analysis.allocator
simulates the allocator under them."""

from __future__ import annotations

from dataclasses import dataclass

from metatrace.errors import ConfigError

MiB = 1 << 20
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = MiB  # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: a small-pool segment (and expandable page)
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge
INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB to 64 GiB, one per power of two


@dataclass(frozen=True)
class AllocatorConfig:
    """The settings of PYTORCH_ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF) that change reserved
    memory, in bytes."""

    expandable_segments: bool = False
    max_split_size: int | None = None
    """None: unlimited (the default)."""
    max_non_split_rounding: int = 20 * MiB
    roundup_power2_divisions: tuple[int, ...] = (0,) * INTERVALS
    """Divisions per power-of-two interval from 1 MiB (index 0: below 2 MiB) to 64 GiB."""
    garbage_collection_threshold: float = 0.0
    large_segment_size: int = 20 * MiB
    """The large pool's segment for requests under 10 MiB (torch 2.13's large_segment_size_mb,
    kLargeBuffer before)."""
    unknown: tuple[str, ...] = ()
    """What the simulation leaves out, as given: keys of pinned memory and CUDA-graph capture,
    keys PyTorch does not know (it ignores them), backend:cudaMallocAsync (CUDA's own
    allocator, not simulated); the job's notes and not-modelled options name them."""


_IGNORED_KEYS = {
    # Settings of pinned host memory, CUDA-graph capture, IPC and the backend: no effect on the
    # device memory of the allocations simulated here.
    "pinned_use_background_threads",
    "pinned_num_register_threads",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "graph_capture_record_stream_reuse",
    "throw_on_cudamalloc_oom",
    "pinned_reserve_segment_size_mb",
    "expandable_segments_handle_type",
}


def _size_t(key: str, value: str) -> int:
    if not value.isdigit():
        raise ConfigError(f"PYTORCH_ALLOC_CONF: {key} takes a whole number, not {value!r}")
    return int(value)


def _power2(key: str, value: int) -> int:
    if value and value & (value - 1):
        raise ConfigError(f"PYTORCH_ALLOC_CONF: {key} must be a power of two or 0, not {value}")
    return value


def _divisions(value: str) -> tuple[int, ...]:
    """roundup_power2_divisions: a single number for every interval, or
    [MB:divisions,...,>:divisions] (AllocatorConfig.cpp parseRoundUpPower2Divisions)."""
    key = "roundup_power2_divisions"
    if not value.startswith("["):
        return (_power2(key, _size_t(key, value)),) * INTERVALS
    if not value.endswith("]"):
        raise ConfigError(f"PYTORCH_ALLOC_CONF: {key} {value!r} lacks its closing ']'")
    table = [0] * INTERVALS
    first, last = True, 0
    for item in filter(None, value[1:-1].split(",")):
        bound, sep, count = item.partition(":")
        if not sep:
            raise ConfigError(f"PYTORCH_ALLOC_CONF: {key} entry {item!r} is not SIZE_MB:COUNT")
        n = _power2(key, _size_t(key, count))
        if bound == ">":
            table[last + 1 :] = [n] * (INTERVALS - last - 1)
            continue
        mb = _size_t(key, bound)
        if mb <= 0 or mb & (mb - 1):
            raise ConfigError(f"PYTORCH_ALLOC_CONF: {key} bound {mb} is not a power of two")
        index = min(max(mb.bit_length() - 1, 0), INTERVALS - 1)
        if first:
            table[:index] = [n] * index
            first = False
        table[index] = n
        last = index
    return tuple(table)


def parse_alloc_conf(text: str) -> AllocatorConfig:
    """PYTORCH_ALLOC_CONF's `key:value,key:value` (torch 2.13's keys); a malformed value is a
    ConfigError naming it, as torch refuses it at the first CUDA allocation."""
    values: dict = {}
    unknown = []
    rest = text.strip()
    while rest:
        key, sep, rest = rest.partition(":")
        key = key.strip()
        if not sep:
            raise ConfigError(f"PYTORCH_ALLOC_CONF: {key!r} has no value (key:value)")
        if rest.startswith("["):
            end = rest.find("]")
            if end < 0:
                raise ConfigError(f"PYTORCH_ALLOC_CONF: {key}'s list lacks its closing ']'")
            value, rest = rest[: end + 1], rest[end + 1 :].lstrip(",")
        else:
            value, _, rest = rest.partition(",")
        value = value.strip()
        if key == "expandable_segments":
            if value not in ("True", "False"):
                raise ConfigError("PYTORCH_ALLOC_CONF: expandable_segments is True or False")
            values["expandable_segments"] = value == "True"
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb"):
            mb = _size_t(key, value)
            if key != "large_segment_size_mb" and mb < 20:
                raise ConfigError(f"PYTORCH_ALLOC_CONF: {key} must be at least 20 (MiB)")
            name = {
                "max_split_size_mb": "max_split_size",
                "max_non_split_rounding_mb": "max_non_split_rounding",
                "large_segment_size_mb": "large_segment_size",
            }[key]
            values[name] = mb * MiB
        elif key == "garbage_collection_threshold":
            try:
                threshold = float(value)
            except ValueError:
                threshold = -1.0
            if not 0 < threshold < 1:
                raise ConfigError(
                    f"PYTORCH_ALLOC_CONF: garbage_collection_threshold is in (0, 1), not {value}"
                )
            values["garbage_collection_threshold"] = threshold
        elif key == "roundup_power2_divisions":
            values["roundup_power2_divisions"] = _divisions(value)
        elif key == "backend":
            if value not in ("native", "cudaMallocAsync"):
                raise ConfigError("PYTORCH_ALLOC_CONF: backend is native or cudaMallocAsync")
            if value == "cudaMallocAsync":
                unknown.append("backend:cudaMallocAsync")
        elif key in _IGNORED_KEYS:
            unknown.append(f"{key}:{value}")
        else:  # PyTorch skips a key it does not know (ConfigTokenizer::skipKey)
            unknown.append(f"{key}:{value} (a key PyTorch does not know: it ignores it)")
    return AllocatorConfig(**values, unknown=tuple(unknown))
