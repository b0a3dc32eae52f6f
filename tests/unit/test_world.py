"""The simulated world on its own: groups of known layouts, roles, GPU names, distributed
optimizer instances (against megatron-core's groups: tests/tracing/test_world.py)."""

from metatrace.world import Layout, World
from tests.helpers import small_job


def test_groups_of_the_megatron_walkthrough():
    # 16 GPUs, tp 2, pp 4 (../shared/notes/megatron-args.md section 3 and seeds/003).
    world = World.from_job(
        small_job(parallel={"tp": 2, "pp": 4}, model={"num_layers": 4}, cluster={"num_gpus": 16})
    )
    assert world.groups("tp") == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [8, 9],
        [10, 11],
        [12, 13],
        [14, 15],
    ]
    assert world.groups("dp") == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
        [8, 10],
        [9, 11],
        [12, 14],
        [13, 15],
    ]
    assert world.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    other = World.from_job(
        small_job(
            parallel={"tp": 2, "pp": 4, "rank_order": "tp-cp-ep-pp-dp"},
            model={"num_layers": 4},
            cluster={"num_gpus": 16},
        )
    )
    assert other.groups("pp")[0] == [0, 2, 4, 6]
    assert other.groups("dp")[:2] == [[0, 8], [1, 9]]
    # TP2 PP2 DP2 CP2 (groups need no model: the local spec's refusal of CP does not apply).
    cp = World(Layout(world_size=16, tp=2, pp=2, cp=2))
    assert cp.groups("cp")[0] == [0, 2]
    assert cp.groups("dp")[0] == [0, 4]
    assert cp.groups("dp_cp")[0] == [0, 2, 4, 6]


def test_roles_cover_every_rank_once_and_name_gpus():
    world = World.from_job(
        small_job(
            parallel={"tp": 2, "pp": 2, "dp": 3},
            model={"num_layers": 4},
            cluster={"gpus_per_node": 4},
        )
    )
    roles = world.roles()
    assert [r.pp_stage for r in roles] == [0, 1]
    ranks = sorted(r for role in roles for r in role.ranks)
    assert ranks == list(range(12))
    assert roles[1].rank == 6 and roles[1].ranks == (6, 7, 8, 9, 10, 11)
    assert world.gpu(0) == "n0_g0" and world.gpu(5) == "n1_g1" and world.gpu(11) == "n2_g3"


def test_distributed_optimizer_instance_groups():
    # 16 GPUs, tp 2, dp 8, num_distributed_optimizer_instances 2: each dp group splits into two
    # halves (the instances); a shard's all-reduce pairs the ranks at the same place in each.
    world = World.from_job(
        small_job(
            parallel={"tp": 2},
            cluster={"num_gpus": 16},
            training={"distributed_optimizer": True, "num_distributed_optimizer_instances": 2},
        )
    )
    assert world.groups("dp_cp") == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]
    assert world.groups("intra_dp_cp") == [
        [0, 2, 4, 6],
        [8, 10, 12, 14],
        [1, 3, 5, 7],
        [9, 11, 13, 15],
    ]
    assert world.groups("intra_edp") == world.groups("intra_dp_cp")
    assert world.groups("inter_dist_opt") == [
        [0, 8],
        [2, 10],
        [4, 12],
        [6, 14],
        [1, 9],
        [3, 11],
        [5, 13],
        [7, 15],
    ]
    assert world.groups("dist_opt") == [list(range(8)), list(range(8, 16))]
    assert world.kinds()[-4:] == ("intra_dp_cp", "intra_edp", "inter_dist_opt", "dist_opt")
    one = World.from_job(small_job(parallel={"tp": 2}, cluster={"num_gpus": 16}))
    assert "intra_dp_cp" not in one.kinds() and not one.knows("inter_dist_opt")
