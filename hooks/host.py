"""The host's side of a recording: the kernels each dispatched operator launches, the host work
that issues them, and the synchronisations that make the host wait for the GPU, folded into
max-plus pieces (metatrace.config.host) as the recorder sees them.

The recorder (hooks/recorder.py) owns one `HostCount` and tells it of every operator and
module call; stand-ins for library kernels report their kernels through hooks/flops.py (each a
launch); code that metatrace replaced where megatron-core reads a value back on the host (the
MoE dispatchers' token counts, the optimizer's gradient norm) says so with `sync()`.
"""

from __future__ import annotations

from collections.abc import Callable

from metatrace.config.host import D2H_COPY_SECONDS, HOST_SECONDS, Piece

_PS = {key: round(value * 1e12) for key, value in HOST_SECONDS.items()}
_D2H_PS = round(D2H_COPY_SECONDS * 1e12)


class HostCount:
    """Kernels, host work and synchronisations so far, and the max-plus pieces they fold into:
    a piece ends where the recorder cuts (a window's start and end, a layer's mark).

    `captured(module, phase)`: whether a module's work in that phase replays from a CUDA graph
    (its operators and module calls cost the host nothing and launch nothing; entering a
    captured stretch costs one launch, the graph's)."""

    __slots__ = ("captured", "host_ps", "in_graph", "kernels", "piece", "pieces", "syncs")

    def __init__(self, captured: Callable[[str, str], bool] | None = None):
        self.captured = captured
        self.kernels = 0
        self.host_ps = 0
        self.syncs = 0
        self.piece = Piece()
        self.pieces: list[tuple] = []
        self.in_graph = False

    def cut(self) -> int:
        """Close the running piece; the number of pieces closed."""
        self.pieces.append(self.piece.matrix())
        self.piece = Piece()
        return len(self.pieces)

    def _graph(self, module: str, phase: str) -> bool:
        inside = self.captured is not None and self.captured(module, phase)
        if inside and not self.in_graph:
            self.work(_PS["launch"])  # the graph's launch
        self.in_graph = inside
        return inside

    def work(self, ps: int) -> None:
        self.host_ps += ps
        self.piece.host(ps)

    def kernel(self, ps: int, launches: int = 1) -> None:
        """`launches` kernels taking `ps` in all on the GPU, each launched by the host."""
        if not self.in_graph:
            self.work(launches * _PS["launch"])
        self.kernels += launches
        self.piece.kernel(ps)

    def operator(
        self, module: str, phase: str, kind: str, launches: int, ps: int, sync: bool
    ) -> None:
        """A dispatched operator of `kind` ("operator", "view", "backward") issued for
        `module` in `phase`, launching `launches` kernels that take `ps` on the GPU."""
        if not self._graph(module, phase):
            self.work(_PS[kind])
        if launches:
            self.kernel(ps, launches)
        if sync:
            self.sync()

    def module(self, module: str, phase: str) -> None:
        """A module's forward is called (in forward, or recomputed in backward)."""
        if not self._graph(module, phase):
            self.work(_PS["module"])

    def sync(self) -> None:
        """The host waits for the GPU (after the small copy that reads the value back)."""
        self.syncs += 1
        self.kernel(_D2H_PS)
        self.piece.sync()


_ACTIVE: list[HostCount] = []


def push(count: HostCount) -> None:
    _ACTIVE.append(count)


def pop(count: HostCount) -> None:
    if count in _ACTIVE:
        _ACTIVE.remove(count)


def sync() -> None:
    """Code standing in for megatron-core's where it reads a device value back on the host
    (.item(), .tolist(), .cpu()): the host waits for the GPU here. Nothing outside a recorder."""
    if _ACTIVE:
        _ACTIVE[-1].sync()
