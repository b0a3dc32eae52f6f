"""What lives outside PyTorch's allocator (metatrace.analysis.device): NCCL 2.29's buffers per
communicator against the closed forms worked by hand from its sources
(../shared/notes/device-memory.md), and the device-memory sum."""

from types import SimpleNamespace

from metatrace.analysis.device import communicator, communicators
from metatrace.records import Collective

MiB = 1 << 20


def cluster(gpu="h100", gpus_per_node=8, **nccl):
    return SimpleNamespace(
        gpu=gpu,
        gpus_per_node=gpus_per_node,
        nccl_nvls=nccl.get("nvls", True),
        nccl_buffsize=nccl.get("buffsize"),
        nccl_channels=nccl.get("channels"),
        nvlink_domain=nccl.get("domain"),
    )


def test_a_tensor_parallel_group_of_a_whole_h100_node():
    c = communicator("tp", tuple(range(8)), {"all_reduce"}, set(), 3, cluster())
    # (2 + 3 x 32 channels + 16 NVLS channels) granules of 2 MiB (init.cc, channel.cc)
    assert c.setup == (2 + 96 + 16) * 2 * MiB
    # per channel a P2P receiver (4 KiB + LL 512 KiB + LL128 4.69 MiB + SIMPLE 4 MiB -> 10 MiB)
    # and a sender in write mode (4 KiB -> 2 MiB)
    assert c.ring == 32 * (10 + 2) * MiB
    # NVLS: 16 channels x 2 x (128 KiB x 8 steps) x 8 heads
    assert c.nvls == 256 * MiB
    assert c.p2p == 0 and c.total == (228 + 384 + 256) * MiB


def test_read_mode_on_a100_moves_the_simple_buffer_to_the_sender_and_has_no_nvls():
    c = communicator("dp", tuple(range(8)), {"reduce_scatter"}, set(), 0, cluster("a100"))
    assert c.ring == 32 * (6 + 6) * MiB  # 4 KiB + LL + LL128 -> 6 MiB; 4 KiB + SIMPLE -> 6 MiB
    assert c.nvls == 0 and c.setup == (2 + 96) * 2 * MiB


def test_a_ring_across_nodes_with_one_member_a_node_uses_the_network_both_ways():
    ranks = tuple(range(0, 64, 8))  # one rank on each of 8 nodes
    c = communicator("dp", ranks, {"all_reduce"}, set(), 8, cluster())
    # GPUDirect RDMA: send LL128 + SIMPLE -> 10 MiB, receive all three -> 10 MiB; no NVLS
    assert c.ring == 32 * (10 + 10) * MiB and c.nvls == 0


def test_send_and_receive_peers_inside_and_across_nodes():
    near = communicator("pp", (0, 1), {"send", "recv"}, {1}, 0, cluster())
    assert near.ring == 0 and near.p2p == 32 * (10 + 2) * MiB
    far = communicator("pp", (0, 8), {"send", "recv"}, {8}, 0, cluster())
    # shared buffers: 32 p2p channels x 16 x 128 KiB chunks, a direction (net.cc:636-673)
    assert far.p2p == 2 * 32 * 16 * 128 * 1024
    # An NVL72 rack: the peer on the next tray of 4 is reached over NVLink (P2P buffers)
    rack = cluster("gb200", gpus_per_node=4, domain=72)
    assert communicator("pp", (0, 8), {"send", "recv"}, {8}, 0, rack).p2p == near.p2p


def test_the_nccl_settings_a_run_gives():
    off = communicator("tp", tuple(range(8)), {"all_reduce"}, set(), 0, cluster(nvls=False))
    assert off.nvls == 0 and off.setup == (2 + 96) * 2 * MiB
    big = communicator("tp", (0, 1), {"all_reduce"}, set(), 0, cluster(buffsize=8 * MiB))
    assert big.ring == 32 * (14 + 2) * MiB  # the receiver's SIMPLE 8 MiB: 4 KiB + ... -> 14 MiB
    few = communicator("tp", (0, 1), {"all_reduce"}, set(), 0, cluster(channels=8))
    assert few.ring == 8 * 12 * MiB and few.setup == (2 + 24 + 16) * 2 * MiB


def _all_to_all(library=None):
    return Collective(
        seq=0,
        op="all_to_all",
        aten="c10d.alltoall_base_.default",
        group="tp_ep",
        ranks=tuple(range(8)),
        shape=(4096, 1024),
        dtype="bfloat16",
        bytes=8 * MiB,
        count=1,
        phase="forward",
        module="decoder.layers.0.mlp.token_dispatcher",
        library=library,
    )


def test_a_library_s_dispatch_takes_no_nccl_send_and_receive_buffers():
    job = SimpleNamespace(cluster=cluster())
    (nccl,) = communicators(job, [_all_to_all()], 0)
    # the alltoall dispatcher: NCCL connects to its 7 peers, every p2p channel
    assert nccl.p2p == 7 * 32 * (10 + 2) * MiB and nccl.ring == 0
    # DeepEP / HybridEP: their own buffers; NCCL gathers the buffers' IPC handles (a ring)
    (deepep,) = communicators(job, [_all_to_all("deepep")], 0)
    assert deepep.p2p == deepep.nvls == 0 and deepep.ring == 32 * (10 + 2) * MiB
