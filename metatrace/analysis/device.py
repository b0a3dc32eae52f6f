"""A rank's device memory: the caching allocator's reserve, simulated over the rank's recorded
allocations (analysis.allocator), and what lives outside the allocator (pure, no torch).

The allocations a rank makes, in order (`allocations`):
1. its static storages (parameters and buffers module by module, DDP's buffers, the
   optimizer's main parameters and state), as the recorder first saw them (Trace.static_sizes);
2. the traced micro-batch as it ran: every storage at its own size and moment;
3. the iteration, twice: its schedule's own work (pipeline transfers, the loss, the gradient
   synchronisation, the optimizer step) as recorded, and each chunk's forward and backward step
   of each micro-batch as the traced micro-batch's step ran it (the iteration replays a step as
   a few lumps of the same bytes; the allocator sees the step's every tensor); what one
   iteration makes and keeps for the next is freed as the next starts. A long iteration's
   steady state repeats: the simulation runs its first micro-batches and two periods of its
   steady state (metatrace.tracing.steady).

A storage that grows in place (resize_) is a new allocation and the old one's free, as
PyTorch's resize_ does; one that shrinks keeps its block.

Outside the allocator (`role_device_memory`): the CUDA context and libraries, NCCL's buffers
per communicator the rank's collectives use (`communicator`, NCCL 2.29's rules), Transformer
Engine's userbuffers. `DeviceMemory.fit` says whether the rank fits its GPU, where only by the
allocator freeing its cache, and by how much.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import cast

from metatrace.analysis.allocator import (
    CachingAllocator,
    OutOfMemory,
    Peak,
)
from metatrace.config.allocator import AllocatorConfig
from metatrace.config.hardware import NCCL_CHANNELS
from metatrace.records import Trace

FREE = -(1 << 62)
"""The delta of a free whatever the storage's size."""
STEADY_PERIODS = 2
"""Periods of a long iteration's steady state the simulation runs (their allocations repeat:
the reserve the first period leaves serves the next)."""


def _window_of(windows: dict, seq: int):
    """Index of the chunk step window holding `seq` (windows sorted by first), or None."""
    import bisect

    i = bisect.bisect_right(windows["first"], seq) - 1
    if i >= 0 and seq <= windows["last"][i]:
        return i
    return None


def _columns(trace: Trace):
    ev = trace.columns("memory", ("seq", "delta", "storage"))
    win = trace.columns("windows", ("phase", "chunk", "microbatch", "first", "last", "output"))
    steps = [
        i
        for i in range(len(win["first"]))
        if win["chunk"][i] is not None and win["phase"][i] in ("forward", "backward")
    ]
    windows = {name: [win[name][i] for i in steps] for name in win}
    order = sorted(range(len(steps)), key=lambda j: windows["first"][j])
    windows = {name: [values[j] for j in order] for name, values in windows.items()}
    return (
        ev["seq"].tolist(),
        ev["delta"].tolist(),
        ev["storage"].tolist(),
        windows,
    )


@dataclass
class _Step:
    """A traced micro-batch's chunk step, as the iteration's replay of it must run it."""

    events: list
    """[(delta, storage)] of the storages the micro-batch's chunk steps allocated."""
    after: list
    """Storages the step allocated that the micro-batch freed outside any chunk step (but its
    output, which the schedule frees): freed right after the step."""
    output: int | None


def _micro_steps(micro: Trace) -> tuple[dict, set]:
    """{(phase, chunk): _Step} of the traced micro-batch, and its persistent storages."""
    seqs, deltas, sids, win = _columns(micro)
    owner: dict = {}  # storage -> window index that allocated it
    freed_in: dict = {}  # storage -> window index where freed (None: outside windows)
    size: dict = {}
    for seq, delta, sid in zip(seqs, deltas, sids):
        now = size.get(sid, 0) + delta
        size[sid] = now
        if delta > 0 and sid not in owner and now == delta:
            owner[sid] = _window_of(win, seq)
        elif now <= 0 and sid in owner:
            freed_in[sid] = _window_of(win, seq)
    persistent = {sid for sid in owner if sid not in freed_in}
    steps: dict = {}
    for i in range(len(win["first"])):
        key = (win["phase"][i], win["chunk"][i])
        steps[key] = _Step([], [], win["output"][i])
    for seq, delta, sid in zip(seqs, deltas, sids):
        i = _window_of(win, seq)
        if i is None or sid in persistent or owner.get(sid) is None:
            continue
        steps[(win["phase"][i], win["chunk"][i])].events.append((delta, sid))
    for sid, i in owner.items():
        if i is not None and sid in freed_in and freed_in[sid] is None:
            step = steps[(win["phase"][i], win["chunk"][i])]
            if sid != step.output:
                step.after.append(sid)
    return steps, persistent


def simulated_iteration(iteration: Trace | None) -> Trace | None:
    """The iteration the simulation runs: a long one's first micro-batches and STEADY_PERIODS
    periods of its steady state (metatrace.tracing.steady's recipe), else itself."""
    recipe = getattr(iteration, "recipe", None)
    if recipe is None:
        return iteration
    steady, n = recipe
    return steady.trace(min(n, STEADY_PERIODS))


def role_allocations(job, rt):
    """allocations() of a traced role: with fine-grained activation offloading that keeps
    groups on the GPU, the iteration's steps as its steady micro-batches run them."""
    from metatrace.analysis.memory import steady_microbatches

    return allocations(rt.trace, rt.iteration, steady=steady_microbatches(job, rt))


def allocations(micro: Trace, iteration: Trace | None, *, steady=None):
    """The rank's allocations in order: (delta bytes, key) with keys unique per tensor life
    (see the module docstring); a positive delta is an allocation. `steady`: (the micro-batch
    the iteration's steps run, {(chunk, micro-batch): another one for those steps}), where they
    differ from the traced one (memory.steady_microbatches)."""
    yield from ((n, ("static", i)) for i, n in enumerate(micro.static_sizes))
    seqs, deltas, sids, _ = _columns(micro)
    for delta, sid in zip(deltas, sids):
        yield delta, ("micro", sid)
    iteration = simulated_iteration(iteration)
    if iteration is None:
        return
    typical, others = steady if steady is not None else (micro, {})
    steps, _ = _micro_steps(typical)
    other_steps = {key: _micro_steps(trace)[0] for key, trace in others.items()}
    seqs, deltas, sids, win = _columns(iteration)
    coarse = set()  # the replay's lumps: storages allocated inside a chunk step
    size: dict = {}
    for seq, delta, sid in zip(seqs, deltas, sids):
        now = size.get(sid, 0) + delta
        size[sid] = now
        if delta > 0 and now == delta and _window_of(win, seq) is not None:
            coarse.add(sid)
    # What the iteration allocates and keeps (the optimizer step's new FP8 weight caches, ...)
    # stands for what the next iteration finds: role_memory counts it only after it is made.
    # The second iteration frees the first's as it starts, and makes its own again.
    left = [sid for sid, now in size.items() if now > 0 and sid not in coarse]
    count = len(win["first"])
    for rep in range(2):
        if rep:
            yield from ((FREE, ("iteration", rep - 1, sid)) for sid in left)
        outputs: dict = {}  # the replay's output lump -> the traced step's output
        j = 0

        def step_events(i, rep=rep, outputs=outputs):
            mb, chunk = win["microbatch"][i], win["chunk"][i]
            step = other_steps.get((chunk, mb), steps).get((win["phase"][i], chunk))
            if step is None:
                return
            for d, s in step.events:
                yield d, ("step", rep, mb, s)
            for s in step.after:
                yield FREE, ("step", rep, mb, s)
            if win["output"][i] is not None and step.output is not None:
                outputs[win["output"][i]] = ("step", rep, mb, step.output)

        for seq, delta, sid in zip(seqs, deltas, sids):
            while j < count and win["first"][j] <= seq:
                yield from step_events(j)
                j += 1
            if sid in outputs:
                if delta < 0:
                    yield FREE, outputs[sid]
                continue
            if sid in coarse:
                continue
            yield delta, ("iteration", rep, sid)
        while j < count:
            yield from step_events(j)
            j += 1


@dataclass(frozen=True)
class Reserve:
    """What the simulated allocator reserved for a rank (bytes)."""

    reserved: int
    """Peak of the segments (torch.cuda.max_memory_reserved())."""
    allocated: int
    """Peak of the blocks allocated (torch.cuda.max_memory_allocated(), at block sizes)."""
    holes: tuple[tuple[int, object], ...]
    """The largest cached free blocks at the peak of the reserve: (bytes, key of the tensor
    whose free left them)."""
    segments: int
    peak_key: object = None
    """The tensor whose allocation reserved the last segment (analysis.allocator.Peak.key)."""
    oom: OutOfMemory | None = None
    """Where the allocator ran out of `capacity`, if it did."""
    retries: int = 0
    """Times it freed its cache to find room (num_alloc_retries)."""


@dataclass(frozen=True)
class Requests:
    """A rank's allocations as the allocator is asked for them (`requests`): the storages'
    sizes followed once, so that several simulations of them (other settings, a capacity)
    each only run the allocator."""

    ops: list
    """[(n, key)]: n > 0 allocates n bytes for key, 0 frees it, n < 0 grows it in place to -n
    bytes (a new block, then the old one freed)."""
    keys: list | None
    """The allocations' keys by the int each op names them by; None where ops hold them."""

    def key(self, k: object) -> object:
        """The allocations' key of what the allocator saw as `k` (None: no tensor's)."""
        if self.keys is None or k is None:
            return k
        if isinstance(k, tuple):  # ("grown", k)
            return (k[0], self.keys[k[1]])
        return self.keys[cast(int, k)]


def requests(events, *, intern: bool = True) -> Requests:
    """The allocator's requests of `events` ((delta, key) as allocations() gives): a positive
    delta allocates, or grows a live storage; a free (or a delta that takes it to 0 or below)
    frees a live one, a smaller negative one shrinks it in place (no request), one of a storage
    not live is nothing. `intern`: name keys by ints (cheaper to hash than allocations()'s
    tuples)."""
    size: dict = {}
    ops: list = []
    append = ops.append
    ids: dict = {}
    for delta, key in events:
        if intern:
            k = ids.get(key)
            if k is None:
                k = ids[key] = len(ids)
        else:
            k = key
        now = size.get(k, 0)
        if delta > 0:
            size[k] = now + delta
            append((-(now + delta), k) if now else (delta, k))
        elif now:
            if now + delta <= 0:
                append((0, k))
                del size[k]
            else:
                size[k] = now + delta
    return Requests(ops, list(ids) if intern else None)


def simulate(
    events, config: AllocatorConfig, capacity: int | None = None, *, alloc=None
) -> Reserve:
    """Run `events` ((delta, key) as allocations() gives, or their Requests) through the
    allocator (`alloc`, a CachingAllocator to watch, made here by default)."""
    if not isinstance(events, Requests):
        events = requests(events, intern=alloc is None)
    alloc = alloc or CachingAllocator(config, capacity)
    malloc, free = alloc.malloc, alloc.free
    oom = None
    try:
        for n, k in events.ops:
            if n > 0:
                malloc(k, n)
            elif n == 0:
                free(k)
            else:  # grown in place: a new block, then the old one freed
                grown = ("grown", k)
                malloc(grown, -n)
                free(k)
                alloc.rename(grown, k)
    except OutOfMemory as e:
        oom = e
    peak: Peak = alloc.peak
    return Reserve(
        reserved=peak.reserved,
        allocated=alloc.peak_allocated,
        holes=tuple((nbytes, events.key(k)) for nbytes, k in peak.holes),
        segments=alloc.segments,
        peak_key=events.key(peak.key),
        oom=oom,
        retries=alloc.retries,
    )


# ----------------------------------------------------------------------------- outside the allocator

MiB = 1 << 20
GRANULE = 2 * MiB
"""cuMem's allocation granularity: NCCL takes every buffer as its own cuMemCreate rounded up to
it (nccl src/include/alloc.h:255-287; 2 MiB on current data-centre GPUs, [uncertain] as the
driver reports it), and IPC buffers to CUDA_IPC_MIN, 2 MiB (src/include/comm.h:42)."""
NCCL_LL, NCCL_LL128, NCCL_SIMPLE = 512 * 1024, 4_915_200, 4 * MiB
"""NCCL's buffer per protocol and connection (src/init.cc:753-790): NCCL_LL_BUFFSIZE,
NCCL_LL128_BUFFSIZE, NCCL_BUFFSIZE."""
NCCL_CONN_MEM = 4096
"""ncclSendMem / ncclRecvMem beside each connection's buffers."""
NVLS_CHANNELS = {"sm90": 16, "sm100": 24}
"""NVLS channels (src/transport/nvls.cc:148-151: NVLS_NCHANNELS_SM90, _SM100_NVL inside one
NVLink domain)."""
NVLS_CHUNK = 128 * 1024 * 8
"""NCCL_NVLS_CHUNKSIZE (128 KiB) x NCCL_STEPS (8): one NVLS buffer per channel and head."""
NVLS_GPUS = frozenset({"h100", "h800", "h200", "b200", "gb200", "b300", "gb300"})
"""GPUs whose NVSwitch systems support multicast (NVLS: sm90 and later with NVSwitch)."""
NET_SHARED_CHUNKS = 16 * 128 * 1024
"""Send/receive across nodes: shared buffers of p2pnChannels x 16 x NCCL_P2P_NET_CHUNKSIZE
(128 KiB) per local rank and direction (src/transport/net.cc:636-673)."""
CONTEXT_BYTES = 2_600_000_000
"""The CUDA context, the kernel images PyTorch, cuBLAS and the rest load, and the libraries'
own device memory: what a process holds beside the caching allocator's reserve. Measured
(issue 42): 2.6 GB on one H200 training megatron-core on one GPU (torch 2.11, CUDA 13), NCCL
aside; [assumption] the same on other GPUs until measured there (bench/device_memory.py)."""
EXPANDABLE_SLACK = 256 * MiB
"""Headroom below which the verdict also simulates expandable segments: more than they can
reserve beyond the default (a 20 MiB page per pool and stream)."""
RING_OPS = frozenset(
    {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_gather_object"}
)
"""Collectives NCCL runs on its rings; all_gather_object (a few bytes a rank: a library's
set-up exchanging its buffers' handles) only there, with no NVLS."""
NVLS_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter"})
P2P_OPS = frozenset({"send", "recv", "all_to_all", "gather", "scatter"})


def _align(nbytes: int, to: int = GRANULE) -> int:
    return -(-nbytes // to) * to


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a rank creates (a process group its collectives use) and the
    device memory NCCL 2.29 takes for it on this rank (bytes)."""

    group: str
    size: int
    setup: int
    """At ncclCommInitRank: the device structures of every channel (src/init.cc:546-621,
    src/channel.cc:13-64): (2 + 3 x channels + NVLS channels) granules."""
    ring: int
    """The ring's connections, made at the first ring collective (NCCL connects lazily with
    cuMem, src/enqueue.cc:490-497): per channel a receive and a send connector."""
    nvls: int
    """NVLS (NVSwitch multicast) buffers, at the first collective NCCL runs with it."""
    p2p: int
    """Send/receive (pipeline transfers, all-to-all): per peer, its channels' connectors."""

    @property
    def total(self) -> int:
        return self.setup + self.ring + self.nvls + self.p2p


def communicator(
    group: str, ranks: tuple[int, ...], ops: set, peers: set, rank: int, cluster
) -> Communicator:
    """The device memory of rank `rank`'s communicator over `ranks` that ran collectives `ops`
    and sent to or received from `peers` (see Communicator; ../shared/notes/device-memory.md),
    under the job's `cluster` (its GPU, GPUs per node and NCCL settings)."""
    from metatrace.config.hardware import GPU_ARCH

    gpu, domain = cluster.gpu, cluster.nvlink_domain or cluster.gpus_per_node
    simple = cluster.nccl_buffsize or NCCL_SIMPLE
    channels = cluster.nccl_channels or NCCL_CHANNELS
    arch = GPU_ARCH.get(gpu, "")
    node = rank // domain  # NVLink reaches every GPU of the domain (an NVL72 rack's trays too)
    local = sum(1 for r in ranks if r // domain == node)
    # P2P transport inside a node (src/transport/p2p.cc:397-400, 466-469): the receiver holds
    # all three protocols' buffers, the sender ncclSendMem; in read mode (the default for sm80
    # pairs over NVLink, src/graph/paths.cc:375) the SIMPLE buffer moves to the sender.
    if arch == "sm80":
        p2p_recv = _align(NCCL_CONN_MEM + NCCL_LL + NCCL_LL128)
        p2p_send = _align(NCCL_CONN_MEM + simple)
    else:
        p2p_recv = _align(NCCL_CONN_MEM + NCCL_LL + NCCL_LL128 + simple)
        p2p_send = _align(NCCL_CONN_MEM)
    # NET transport with GPUDirect RDMA (src/transport/net.cc:887-920, 1054-1090): the send
    # side keeps LL128 and SIMPLE on the GPU, the receive side all three.
    net_send = _align(NCCL_LL128 + simple)
    net_recv = _align(NCCL_LL + NCCL_LL128 + simple)
    nvls_channels = 0
    nvls_ok = cluster.nccl_nvls and gpu in NVLS_GPUS and local == len(ranks) and local >= 2
    if nvls_ok:
        nvls_channels = NVLS_CHANNELS.get(arch, 16)
    setup = (2 + 3 * channels + nvls_channels) * GRANULE
    ring = 0
    if ops & RING_OPS:
        # A ring enters and leaves each node once per channel: of the `local` members on this
        # node, one in `local` receives from and one sends to another node.
        outside = 1 / local if local < len(ranks) else 0.0
        recv = outside * net_recv + (1 - outside) * p2p_recv
        send = outside * net_send + (1 - outside) * p2p_send
        ring = round(channels * (recv + send))
    nvls = 0
    if nvls_ok and ops & NVLS_OPS:
        nvls = _align(nvls_channels * 2 * NVLS_CHUNK * local)
    p2p = 0
    far = {p for p in peers if p // domain != node}
    near = peers - far
    if near:
        # Channels per NVLink peer: twice the peer's bandwidth in links, a power of two, at
        # most the communicator's p2p channels (src/graph/paths.cc:833-912): all of them on an
        # NVSwitch system.
        p2p += len(near) * channels * (p2p_recv + p2p_send)
    if far:
        p2p += 2 * channels * NET_SHARED_CHUNKS
    return Communicator(group, len(ranks), setup, ring, nvls, p2p)


def communicators(job, collectives, rank: int) -> tuple[Communicator, ...]:
    """The communicators rank `rank` creates: one per process group its `collectives`
    (records.Collective) use, groups of one rank aside (PyTorch creates a communicator when a
    group first runs a collective). What a library moves with buffers of its own
    (Collective.library) takes none of NCCL's send/receive buffers."""
    groups: dict = {}
    for c in collectives:
        if len(c.ranks) < 2:
            continue
        ops, peers, name = groups.setdefault(c.ranks, (set(), set(), c.group))
        if c.library is not None:
            # DeepEP's and HybridEP's kernels move the tokens through their own buffers; NCCL
            # runs only their set-up's all_gather_object of the buffers' IPC handles over the
            # group (deep_ep buffer.py)
            ops.add("all_gather_object")
            continue
        ops.add(c.op)
        if c.peer is not None:
            peers.add(c.peer)
        elif c.op in P2P_OPS:
            peers.update(r for r in c.ranks if r != rank)
    return tuple(
        communicator(name, ranks, ops, peers, rank, job.cluster)
        for ranks, (ops, peers, name) in sorted(groups.items())
    )


@dataclass(frozen=True)
class DeviceMemory:
    """What one rank takes on its GPU (bytes)."""

    allocated: int
    """The allocated peak (torch.cuda.max_memory_allocated())."""
    reserve: Reserve
    """The caching allocator under the job's settings, on a device with room for it
    (torch.cuda.max_memory_reserved() on a GPU large enough)."""
    context: int
    """The CUDA context and libraries (CONTEXT_BYTES, or cluster.context_gib)."""
    nccl: tuple[Communicator, ...]
    userbuffers: int
    """Transformer Engine's userbuffers (tp_comm_overlap)."""
    room: int | None = None
    """The GPU's memory less the margin kept free (None: not asked)."""
    retried: Reserve | None = None
    """Where the reserve does not fit beside the rest: the allocator run again with the room
    left, freeing its cache and retrying before it gives up (its oom says whether it does)."""
    expandable: Reserve | None = None
    """The reserve with expandable_segments:True, where the job does not set it and its
    default does not fit with EXPANDABLE_SLACK to spare."""
    expandable_retried: Reserve | None = None
    """The same run with the room left, where it does not fit either."""
    nccl_given: int | None = None
    """cluster.nccl_gib, which replaces the communicators' estimate, in bytes."""
    holes: tuple[tuple[int, str], ...] = ()
    """The largest cached free blocks at the reserve's peak: (bytes, the module whose tensor's
    free left the block)."""
    reserve_peak_at: str = ""
    """What the allocator reserved its last segment for: the module and the step."""

    @property
    def nccl_bytes(self) -> int:
        if self.nccl_given is not None:
            return self.nccl_given
        return sum(c.total for c in self.nccl)

    @property
    def outside(self) -> int:
        return self.context + self.nccl_bytes + self.userbuffers

    @property
    def total(self) -> int:
        return self.reserve.reserved + self.outside

    def _fit(self, reserve: Reserve, retried: Reserve | None) -> tuple[bool, int]:
        room = self.room if self.room is not None else 1 << 62
        left = room - (reserve.reserved + self.outside)
        if left >= 0:
            return True, left
        if retried is not None and retried.oom is None:  # fits by freeing the cache
            return True, room - (retried.reserved + self.outside)
        return False, left  # short by what the allocator would reserve beyond the room

    @property
    def fit(self) -> tuple[bool, int]:
        """(whether the rank fits its GPU, its headroom: negative, what the allocator would
        reserve beyond the room)."""
        return self._fit(self.reserve, self.retried)

    @property
    def used(self) -> Reserve:
        """The run the verdict reads: the one that fits by freeing the cache where only that
        one does, else the reserve on a device with room for it."""
        fits, _ = self.fit
        if fits and self.retried is not None and self.retried.oom is None:
            return self.retried
        return self.reserve

    @property
    def taken(self) -> int:
        """What the rank takes of its GPU in the run the verdict reads (`used`)."""
        return self.used.reserved + self.outside

    @property
    def retries(self) -> int:
        """Times the allocator frees its cache in the run that fits (0: it fits without)."""
        return self.used.retries if self.used is self.retried else 0

    @property
    def expandable_fit(self) -> tuple[bool, int]:
        """fit with expandable_segments:True; where not simulated, the default's (it fits with
        room to spare)."""
        if self.expandable is None:
            return self.fit
        return self._fit(self.expandable, self.expandable_retried)

    def terms(self) -> list[tuple[str, int]]:
        """What lives outside the allocator, largest first."""
        terms = [("CUDA context and libraries", self.context)]
        if self.nccl_given is not None:
            terms.append(("NCCL (cluster.nccl_gib)", self.nccl_given))
        elif self.nccl:
            terms.append(("NCCL", self.nccl_bytes))
        if self.userbuffers:
            terms.append(("userbuffers", self.userbuffers))
        return sorted(terms, key=lambda t: -t[1])


def context_bytes(job) -> int:
    """What a process holds beside the allocator and NCCL (cluster.context_gib, or measured)."""
    gib = job.cluster.context_gib
    return round(gib * 2**30) if gib is not None else CONTEXT_BYTES


def role_device_memory(job, rt, allocated: int, *, capacity: int | None = None) -> DeviceMemory:
    """A traced role's device memory: its allocations through the allocator of the job's
    PYTORCH_ALLOC_CONF (cluster.allocator_conf), then what lives outside it. `capacity`: the
    device's memory less the margin the user keeps; where the reserve would not fit beside the
    rest, the allocator is run again with what is left, as the real one frees its cache and
    retries before it gives up (DeviceMemory.retried)."""
    from metatrace.config.allocator import parse_alloc_conf
    from metatrace.config.userbuffers import userbuffer_bytes

    config = parse_alloc_conf(job.cluster.allocator_conf or "")
    events = requests(role_allocations(job, rt))
    reserve = simulate(events, config)
    collectives = list(rt.trace.collectives)
    if rt.iteration is not None:
        collectives += [c for c, _ in rt.iteration.tally("collectives")]
    cl = job.cluster
    context = context_bytes(job)
    memory = DeviceMemory(
        allocated=allocated,
        reserve=reserve,
        room=capacity,
        context=context,
        nccl=communicators(job, collectives, rt.trace.rank),
        userbuffers=userbuffer_bytes(job),
        nccl_given=None if cl.nccl_gib is None else round(cl.nccl_gib * 2**30),
    )
    holes, at = _holes(rt, reserve)
    memory = dataclasses.replace(memory, holes=holes, reserve_peak_at=at)
    if capacity is None:
        return memory
    left = capacity - memory.outside
    if memory.total > capacity:
        memory = dataclasses.replace(memory, retried=simulate(events, config, left))
    # Expandable segments can change the verdict only where the default's does not fit with
    # room to spare (they reserve whole 20 MiB pages, so a little more at times).
    if not config.expandable_segments and memory.total + EXPANDABLE_SLACK > capacity:
        expandable = dataclasses.replace(config, expandable_segments=True)
        grown = simulate(events, expandable)
        retried = simulate(events, expandable, left) if grown.reserved > left else None
        memory = dataclasses.replace(memory, expandable=grown, expandable_retried=retried)
    return memory


def _holes(rt, reserve: Reserve) -> tuple[tuple[tuple[int, str], ...], str]:
    """Reserve.holes with each key told by the module whose tensor's free left the block, and
    what the last segment was reserved for (module and step)."""
    modules: dict = {}
    for origin, trace in (("micro", rt.trace), ("iteration", simulated_iteration(rt.iteration))):
        if trace is None:
            continue
        cols = trace.columns("memory", ("storage", "module", "delta"))
        for sid, module, delta in zip(
            cols["storage"].tolist(), cols["module"].tolist(), cols["delta"].tolist()
        ):
            if delta > 0:
                modules.setdefault((origin, sid), module)

    def who(key) -> str:
        if isinstance(key, tuple) and key and key[0] == "grown":
            key = key[1]
        if not isinstance(key, tuple):
            return "(a segment's unused rest)"
        if key[0] == "static":
            return "(static)"
        origin = "iteration" if key[0] == "iteration" else "micro"
        return modules.get((origin, key[-1])) or "(step)"

    def when(key) -> str:
        if isinstance(key, tuple) and key and key[0] == "grown":
            key = key[1]
        if not isinstance(key, tuple) or key[0] == "static":
            return "set-up"
        if key[0] == "micro":
            return "the first micro-batch"
        if key[0] == "step":
            return f"iteration {key[1] + 1}, micro-batch {key[2]}"
        return f"iteration {key[1] + 1}"

    holes = tuple((nbytes, who(key)) for nbytes, key in reserve.holes)
    key = reserve.peak_key
    return holes, f"{who(key)} ({when(key)})" if key is not None else ""
