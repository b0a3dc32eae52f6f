"""Communication per training iteration, from the records (pure functions, no torch).

Two traces per role feed it (metatrace.tracing.trace): the collectives of one micro-batch's model steps
(tensor, sequence, context parallelism, the batch broadcast; they repeat for every micro-batch)
and the collectives of the whole iteration around the steps (the pipeline's sends and receives
under megatron-core's schedule, DDP's gradient reductions and parameter all-gathers, the
embedding-gradient all-reduce, the optimizer's and the loss's small all-reduces).

Accounting: the message is the tensor a collective works on (the full tensor of an all-gather
or reduce-scatter). The bytes a rank sends and receives are NCCL's ring algorithm's over a
group of n ranks: all-reduce 2(n-1)/n of the message each way, all-gather, reduce-scatter and
all-to-all (n-1)/n, broadcast (n-1)/n (the average over the ring: the root sends, the last
receives), a send or a receive the message one way. A coalesced call counts once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from metatrace.records import Collective, Trace

DIMENSIONS = ("tp", "cp", "ep", "dp", "pp", "other")
"""Parallel dimensions traffic is reported under ("other": the optimizer's and the loss's
small statistics over model-parallel or whole-instance groups)."""

# megatron-core group name -> dimension.
GROUP_DIMENSION = {
    "tp": "tp",
    "tp_cp": "tp",
    "cp": "cp",
    "cp_a2a": "cp",
    "cp_p2p": "cp",
    "ep": "ep",
    "etp": "ep",
    "tp_ep": "ep",
    "dp": "dp",
    "dp_cp": "dp",
    "edp": "dp",
    "tp_dp": "dp",
    "tp_dp_cp": "dp",
    "intra_dp_cp": "dp",  # num_distributed_optimizer_instances > 1: within an instance
    "intra_edp": "dp",
    "inter_dist_opt": "dp",  # and across the instances
    "pp": "pp",
    "embedding": "pp",
    "position_embedding": "pp",
}

# Ring algorithm: bytes one rank sends and receives per message byte, for a group of n.
_RING = {
    "all_reduce": lambda n: (2 * (n - 1) / n, 2 * (n - 1) / n),
    "all_gather": lambda n: ((n - 1) / n, (n - 1) / n),
    "reduce_scatter": lambda n: ((n - 1) / n, (n - 1) / n),
    "all_to_all": lambda n: ((n - 1) / n, (n - 1) / n),
    "broadcast": lambda n: ((n - 1) / n, (n - 1) / n),
    "reduce": lambda n: ((n - 1) / n, (n - 1) / n),
    "gather": lambda n: ((n - 1) / n, (n - 1) / n),
    "scatter": lambda n: ((n - 1) / n, (n - 1) / n),
    "send": lambda n: (1.0, 0.0),
    "recv": lambda n: (0.0, 1.0),
}


def ring_bytes(op: str, message: int, n: int) -> tuple[int, int]:
    """(sent, received) bytes of one rank for one collective."""
    if n <= 1 and op not in ("send", "recv"):
        return 0, 0
    out, back = _RING.get(op, lambda n: (0.0, 0.0))(max(n, 1))
    return round(out * message), round(back * message)


_LAYER = re.compile(r"^(?:chunk(\d+)\.)?(.*?\blayers\.)(\d+)(\..*|$)")
_CHUNK = re.compile(r"^chunk\d+(\.|$)")


def module_pattern(module: str) -> tuple[str, tuple[int, int] | None]:
    """("decoder.layers.*.mlp.linear_fc1", (chunk, layer)) for a module inside a transformer
    layer; (module without its chunk prefix, None) otherwise."""
    m = _LAYER.match(module)
    if m:
        return f"{m.group(2)}*{m.group(4)}", (int(m.group(1) or 0), int(m.group(3)))
    return _CHUNK.sub("", module) or "(model)", None


@dataclass(frozen=True)
class Item:
    """One kind of collective a rank takes part in, with how often per iteration."""

    dimension: str
    op: str
    group: str
    ranks: tuple[int, ...]
    """The traced rank's group (for a send or receive: the rank and its peer)."""
    peer: int | None
    shape: tuple[int, ...]
    dtype: str
    message: int
    """Bytes of one message."""
    sent: int
    received: int
    """Bytes one call sends / receives on this rank."""
    count: int
    """Calls per iteration."""
    per_microbatch: bool
    """Issued by every micro-batch's model steps (else by the iteration around them)."""
    phase: str
    module: str
    """Module (transformer layers as `layers.*`), "(step)" outside the model."""
    layers: int
    """Transformer layers whose calls the item sums (0 outside the layers)."""
    crosses_nodes: bool
    overlapped: str | None
    """What Megatron overlaps it with (None: exposed)."""


@dataclass
class Totals:
    count: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    message_bytes: int = 0
    intra: int = 0
    inter: int = 0
    """Bytes sent inside a node / across nodes."""
    seconds: float = 0.0
    """Estimated wire time (ring model, link_gbps); for the cluster, the slowest GPU's."""
    exposed_seconds: float = 0.0
    """Of which not overlapped with compute."""


@dataclass
class RoleComm:
    items: list[Item]
    dims: dict[str, Totals] = field(default_factory=dict)


@dataclass
class JobComm:
    roles: list
    """(RoleTrace, RoleComm) per role."""
    cluster: dict[str, Totals]
    """Per dimension, summed over every GPU (time: the slowest GPU's)."""
    total: Totals
    """All dimensions, summed over every GPU (time: the slowest GPU's)."""


def _in_windows(trace: Trace):
    spans = sorted((w.first, w.last) for w in trace.windows if w.chunk is not None)

    def inside(seq: int) -> bool:
        return any(first <= seq <= last for first, last in spans)

    return inside


def _overlap(job, c: Collective, dimension: str) -> str | None:
    if c.overlap is not None:  # marked where it was issued (TE's userbuffers)
        return c.overlap
    tr, par = job.training, job.parallel
    if dimension == "dp" and c.op in ("reduce_scatter", "all_reduce") and tr.overlap_grad_reduce:
        if c.phase == "backward":
            return "backward"
    if dimension == "dp" and c.op == "all_gather" and tr.overlap_param_gather:
        # Megatron-FSDP gathers ahead of the forward and the backward; the optimizer step
        # starts the next iteration's first gathers.
        return c.phase if c.phase in ("forward", "backward") else "optimizer step"
    if dimension == "cp" and c.op in ("send", "recv"):
        return "attention"  # Transformer Engine's ring exchange runs beside the attention steps
    if dimension == "pp" and c.op in ("send", "recv") and par.overlap_p2p_comm:
        return "forward and backward"
    if dimension == "ep" and c.op == "all_to_all" and par.overlap_moe_expert_parallel_comm:
        # megatron-core's combined 1F1B runs each dispatch / combine beside the other
        # micro-batch's attention or experts (model_chunk_schedule_plan.py:210-250). Counted as
        # hidden in every step, also the first forward and last backward, which run alone.
        return "the other micro-batch's compute (combined 1F1B)"
    return None


def _add_calls(t: Totals, it: Item, ranks: int) -> None:
    """Add an item's calls per iteration on `ranks` ranks to `t`."""
    t.count += ranks * it.count
    t.bytes_sent += ranks * it.count * it.sent
    t.bytes_received += ranks * it.count * it.received
    t.message_bytes += ranks * it.count * it.message


_RING_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"})


def link_gbps(job, world, op: str, ranks) -> float:
    """The bandwidth one rank's share of a call over `ranks` moves at. Inside a node: the GPU's
    link (cluster.intra_node_gbps), also across the nodes of one NVLink domain (an NVL72 rack).
    Across domains, a ring collective's data leaves each domain once per ring, and NCCL lays one
    ring per NIC: the group's members in a domain send through their
    k NICs together (k x inter_node_gbps, at most the intra-node link; an assumption, not
    measured here); point-to-point and all-to-all traffic leaves through the GPU's own NIC."""
    cl = job.cluster
    if not world.crosses_nodes(ranks):
        return cl.intra_node_gbps
    if op not in _RING_OPS:
        return cl.inter_node_gbps
    members: dict[int, int] = {}
    for r in ranks:
        members[world.domain(r)] = members.get(world.domain(r), 0) + 1
    return min(cl.intra_node_gbps, min(members.values()) * cl.inter_node_gbps)


def wire_seconds(job, world, op: str, ranks, rank: int, nbytes: int) -> float:
    """Seconds one call moving `nbytes` (the larger of what `rank` sends and receives) over
    `ranks` takes on the wire. An all-to-all spanning NVLink domains sends each peer its share
    at once: the peers in `rank`'s own domain over NVLink, the others through the GPU's NIC,
    so it lasts as long as the slower of the two (NCCL's all-to-all runs one send and receive
    per peer concurrently). Other calls at link_gbps."""
    if op == "all_to_all" and len(ranks) > 1 and world.crosses_nodes(ranks):
        cl, home = job.cluster, world.domain(rank)
        near = sum(1 for r in ranks if r != rank and world.domain(r) == home)
        far = len(ranks) - 1 - near
        share = nbytes / (len(ranks) - 1)
        return max(
            near * share * 8 / (cl.intra_node_gbps * 1e9),
            far * share * 8 / (cl.inter_node_gbps * 1e9),
        )
    return nbytes * 8 / (link_gbps(job, world, op, ranks) * 1e9)


def _seconds(job, world, item: Item, rank: int) -> float:
    nbytes = max(item.sent, item.received)
    return item.count * wire_seconds(job, world, item.op, item.ranks, rank, nbytes)


def role_comm(job, world, micro: Trace, iteration: Trace, *, rank: int) -> RoleComm:
    """A role's collectives per iteration (the traced `rank` stands for the role).

    Collectives over a group of one rank move nothing and are left out."""
    inside = _in_windows(micro)
    grouped: dict[tuple, list] = {}
    sources = [(c, 1, True) for c in micro.collectives if inside(c.seq)]
    sources += [(c, k, False) for c, k in iteration.tally("collectives")]
    for c, times, per_microbatch in sources:
        if c.peer is None and len(c.ranks) <= 1:
            continue
        # A send or receive whose group the recorder could not name is the pipeline's (with
        # pp equal to the world size, torch issues the receives on the default group).
        dimension = GROUP_DIMENSION.get(c.group) or ("pp" if c.peer is not None else "other")
        ranks = tuple(sorted({rank, c.peer})) if c.peer is not None else c.ranks
        module, layer = module_pattern(c.module)
        key = (
            dimension,
            c.op,
            c.group,
            ranks,
            c.peer,
            c.shape,
            c.dtype,
            c.bytes,
            c.output_bytes,
            per_microbatch,
            c.phase,
            module,
        )
        grouped.setdefault(key, []).append((c, layer, times))
    items = []
    for key, calls in grouped.items():
        dimension, op, group, ranks, peer, shape, dtype, message, arrived, per_mb, phase, module = (
            key
        )
        n = len(calls[0][0].ranks) if peer is None else 2
        sent, received = ring_bytes(op, message, n)
        if arrived is not None:  # all-to-all: what arrives from the other ranks
            received = ring_bytes(op, arrived, n)[1]
        count = sum(k for *_, k in calls) * (job.num_microbatches if per_mb else 1)
        layers = len({layer for _, layer, _ in calls if layer is not None})
        items.append(
            Item(
                dimension,
                op,
                group,
                ranks,
                peer,
                shape,
                dtype,
                message,
                sent,
                received,
                count,
                per_mb,
                phase,
                module,
                layers,
                world.crosses_nodes(ranks),
                _overlap(job, calls[0][0], dimension),
            )
        )
    out = RoleComm(items=items, dims={d: Totals() for d in DIMENSIONS})
    for it in items:
        t = out.dims[it.dimension]
        seconds = _seconds(job, world, it, rank)
        _add_calls(t, it, 1)
        t.seconds += seconds
        t.exposed_seconds += 0.0 if it.overlapped else seconds
        if it.crosses_nodes:
            t.inter += it.count * it.sent
        else:
            t.intra += it.count * it.sent
    return out


def call_seconds(job, world, c: Collective, rank: int) -> tuple[str, float, str | None]:
    """One call of `c` on `rank`, as role_comm counts it: (dimension, estimated seconds, what
    Megatron overlaps it with or None). For placing calls in time (metatrace.analysis.timing)."""
    if c.peer is None and len(c.ranks) <= 1:
        return GROUP_DIMENSION.get(c.group, "other"), 0.0, None
    dimension = GROUP_DIMENSION.get(c.group) or ("pp" if c.peer is not None else "other")
    ranks = tuple(sorted({rank, c.peer})) if c.peer is not None else c.ranks
    sent, received = ring_bytes(c.op, c.bytes, len(c.ranks) if c.peer is None else 2)
    if c.output_bytes is not None:
        received = ring_bytes(c.op, c.output_bytes, len(c.ranks))[1]
    seconds = wire_seconds(job, world, c.op, ranks, rank, max(sent, received))
    return dimension, seconds, _overlap(job, c, dimension)


def _crossing(world, role, item: Item, traced: int, cache: dict) -> int:
    """How many of the role's ranks send this item's traffic across nodes: each rank's own
    group (or pipeline peer) of the kind the traced rank used."""
    if item.peer is not None:
        # The peer as far along each rank's own group (pipeline, or context-parallel ring).
        kind = item.group if world.knows(item.group) else "pp"
        traced_group = world.group_of(kind, traced)
        if item.peer not in traced_group:
            return len(role.ranks) if item.crosses_nodes else 0
        step = traced_group.index(item.peer) - traced_group.index(traced)
        key: tuple = ("peer", kind, step)
        if key not in cache:
            crossing = 0
            for r in role.ranks:
                group = world.group_of(kind, r)
                peer = group[(group.index(r) + step) % len(group)]
                crossing += world.domain(r) != world.domain(peer)
            cache[key] = crossing
        return cache[key]
    if not world.knows(item.group):
        return len(role.ranks) if item.crosses_nodes else 0
    key = ("group", item.group)
    if key not in cache:
        cache[key] = len(world.crossing_ranks(item.group).intersection(role.ranks))
    return cache[key]


def job_comm(job_trace) -> JobComm:
    """Every role's communication per iteration and the cluster's (needs iteration traces)."""
    job, world = job_trace.job, job_trace.world
    roles, cluster = [], {d: Totals() for d in DIMENSIONS}
    for rt in job_trace.roles:
        comm = role_comm(job, world, rt.trace, rt.iteration, rank=rt.trace.rank)
        roles.append((rt, comm))
        n = len(rt.role.ranks)
        cache: dict[tuple, int] = {}
        for it in comm.items:
            t = cluster[it.dimension]
            _add_calls(t, it, n)
            crossing = _crossing(world, rt.role, it, rt.trace.rank, cache)
            t.inter += crossing * it.count * it.sent
            t.intra += (n - crossing) * it.count * it.sent
        for d, rt_totals in comm.dims.items():
            cluster[d].seconds = max(cluster[d].seconds, rt_totals.seconds)
            cluster[d].exposed_seconds = max(cluster[d].exposed_seconds, rt_totals.exposed_seconds)
    total = Totals()
    for t in cluster.values():
        for name in ("count", "bytes_sent", "bytes_received", "message_bytes", "intra", "inter"):
            setattr(total, name, getattr(total, name) + getattr(t, name))
    total.seconds = max(sum(t.seconds for t in c.dims.values()) for _, c in roles)
    total.exposed_seconds = max(sum(t.exposed_seconds for t in c.dims.values()) for _, c in roles)
    return JobComm(roles=roles, cluster=cluster, total=total)
