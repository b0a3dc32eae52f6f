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


def test_an_all_to_all_across_nodes_sends_to_its_node_over_nvlink_and_to_the_rest_by_nic():
    """Each peer gets its share at once: 7 of 15 peers in the node at NVLink's rate, 8 over the
    NIC; the call lasts as long as the NIC's part. In an NVL72 rack all 15 are NVLink peers."""
    from metatrace.analysis.comm import wire_seconds
    from metatrace.world import World
    from tests.helpers import small_job

    job = small_job(cluster={"gpu": "h100"})
    world = World.from_job(job)
    intra, inter = job.cluster.intra_node_gbps * 1e9, job.cluster.inter_node_gbps * 1e9
    nbytes = 15 * 2**20  # 1 MiB to each peer
    got = wire_seconds(job, world, "all_to_all", tuple(range(16)), 3, nbytes)
    assert got == max(7 * 2**20 * 8 / intra, 8 * 2**20 * 8 / inter) == 8 * 2**20 * 8 / inter
    # a reduce-scatter over the same ranks is not split: the ring's rate (link_gbps)
    assert wire_seconds(job, world, "reduce_scatter", tuple(range(16)), 3, nbytes) == (
        nbytes * 8 / min(intra, 8 * inter)
    )
    rack = small_job(cluster={"gpu": "gb200", "gpus_per_node": 4})
    assert rack.cluster.nvlink_domain == 72
    got = wire_seconds(rack, World.from_job(rack), "all_to_all", tuple(range(16)), 3, nbytes)
    assert got == nbytes * 8 / (rack.cluster.intra_node_gbps * 1e9)
