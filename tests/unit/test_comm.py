"""Bytes a ring algorithm sends and receives per collective (the traced communication is in
tests/tracing/test_comm.py)."""

from metatrace.analysis.comm import ring_bytes


def test_ring_algorithm_bytes():
    # all-reduce: reduce-scatter then all-gather, 2(n-1)/n of the message each way.
    assert ring_bytes("all_reduce", 1000, 4) == (1500, 1500)
    assert ring_bytes("all_gather", 1000, 4) == (750, 750)
    assert ring_bytes("reduce_scatter", 800, 8) == (700, 700)
    assert ring_bytes("send", 1000, 2) == (1000, 0) and ring_bytes("recv", 1000, 2) == (0, 1000)
    assert ring_bytes("all_reduce", 1000, 1) == (0, 0)


def test_ring_collectives_across_nodes_use_the_nics_of_the_members_on_a_node():
    """NCCL lays a ring per NIC: a group with k members on each node sends across nodes at k times
    one NIC's rate (at most the node's link); all-to-all leaves through each GPU's own NIC."""
    from metatrace.analysis.comm import link_gbps
    from metatrace.world import World
    from tests.helpers import small_job

    job = small_job(cluster={"gpu": "h100"})
    world = World.from_job(job)  # 8 GPUs a node; only the ranks' nodes matter here
    intra, inter = job.cluster.intra_node_gbps, job.cluster.inter_node_gbps
    assert link_gbps(job, world, "all_reduce", (0, 1, 2, 3)) == intra  # inside a node
    assert link_gbps(job, world, "reduce_scatter", (0, 8, 16, 24)) == inter  # one per node
    assert link_gbps(job, world, "reduce_scatter", (0, 2, 4, 6, 8, 10, 12, 14)) == 4 * inter
    assert link_gbps(job, world, "all_reduce", tuple(range(16))) == min(intra, 8 * inter)
    assert link_gbps(job, world, "all_to_all", tuple(range(16))) == inter
