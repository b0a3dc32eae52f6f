"""The installed megatron-core's release, read without importing megatron-core (this layer stays
pure): its package_info where megatron-core is imported already (what runs), else its
distribution's metadata. Where a call into megatron-core differs between the supported releases
(hooks/guards.py: 0.16.1 and 0.19.x), the caller asks `since(0, 19)`."""

from __future__ import annotations

import functools
import re
import sys


@functools.cache
def parse(version: str) -> tuple[int, ...]:
    """(0, 19, 2) from "0.19.2", "0.19.2rc0" or "0.19.2+b995700"; () when no number leads."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(n) for n in match.group().split(".")) if match else ()


def version() -> str:
    """The installed megatron-core's version string ("0.19.2", "0.19.2+b995700" where 0.19's
    package_info adds the git hash of a checkout it lies in); "not installed" without one."""
    info = sys.modules.get("megatron.core.package_info")
    if info is not None:
        return info.__version__
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return "not installed"


def release() -> tuple[int, ...]:
    """The installed megatron-core's release numbers; () without one."""
    return parse(version())


def since(*numbers: int) -> bool:
    """Whether the installed megatron-core is `numbers` (a release or a series) or newer."""
    return release()[: len(numbers)] >= numbers


def series() -> str:
    """The installed release's series, "0.16" or "0.19" (the golden files' directory)."""
    return ".".join(map(str, release()[:2]))
