"""The simulated world: groups as megatron-core forms them, roles, GPU names."""

import pytest

from metatrace.hooks.fake_world import fake_world, named_groups
from metatrace.world import Layout
from metatrace.hooks.patches import megatron_patches
from metatrace.hooks.remap import remap_cuda
from metatrace.world import World

from conftest import small_job


def test_groups_of_the_megatron_walkthrough():
    # 16 GPUs, tp 2, pp 4 (../shared/notes/megatron-args.md section 3 and seeds/003).
    world = World.from_job(small_job(parallel={"tp": 2, "pp": 4}, model={"num_layers": 4},
                            cluster={"num_gpus": 16}))
    assert world.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert world.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert world.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    other = World.from_job(small_job(parallel={"tp": 2, "pp": 4, "rank_order": "tp-cp-ep-pp-dp"},
                            model={"num_layers": 4}, cluster={"num_gpus": 16}))
    assert other.groups("pp")[0] == [0, 2, 4, 6]
    assert other.groups("dp")[:2] == [[0, 8], [1, 9]]
    # TP2 PP2 DP2 CP2 (groups need no model: the local spec's refusal of CP does not apply).
    cp = World(Layout(world_size=16, tp=2, pp=2, cp=2))
    assert cp.groups("cp")[0] == [0, 2]
    assert cp.groups("dp")[0] == [0, 4]
    assert cp.groups("dp_cp")[0] == [0, 2, 4, 6]


@pytest.mark.parametrize(
    "parallel, num_gpus",
    [({"tp": 2, "pp": 2}, 8), ({"tp": 2, "pp": 2, "rank_order": "tp-cp-ep-pp-dp"}, 8),
     ({"tp": 1, "pp": 4}, 8)],
)
def test_groups_equal_megatron_process_groups(parallel, num_gpus):
    world = World.from_job(small_job(parallel=parallel, model={"num_layers": 4},
                            cluster={"num_gpus": num_gpus}))
    with megatron_patches(), remap_cuda("meta"):
        for rank in range(num_gpus):
            with fake_world(world.layout, rank):
                seen = {name: list(ranks) for name, ranks in named_groups().values()}
            for name in ("tp", "pp", "dp", "mp"):
                if name in seen:
                    assert seen[name] == world.group_of(name, rank), (name, rank)
            assert seen.get("tp", [rank]) == world.group_of("tp", rank)


@pytest.mark.parametrize(
    "layout",
    [
        Layout(world_size=16, tp=2, pp=4),
        Layout(world_size=16, tp=2, pp=4, order="tp-cp-ep-pp-dp"),
        Layout(world_size=16, tp=2, pp=2, cp=2),
        Layout(world_size=16, tp=2, pp=2, cp=2, etp=4, order="tp-cp-ep-pp-dp"),
        Layout(world_size=16, tp=2, pp=2, ep=4, etp=1),
        Layout(world_size=24, tp=2, pp=3, ep=2),
        Layout(world_size=16, tp=2, pp=2, dist_opt_instances=2),
        Layout(world_size=16, tp=2, cp=2, dist_opt_instances=4),
        Layout(world_size=16, tp=2, pp=2, ep=2, etp=1, dist_opt_instances=2, order="tp-cp-ep-pp-dp"),
        Layout(world_size=32, tp=1, cp=2, ep=8, dist_opt_instances=2),
    ],
    ids=["tp2-pp4", "tp2-pp4-pp-dp", "tp2-pp2-cp2", "tp2-pp2-cp2-pp-dp", "ep4-etp1", "24-gpus-ep2",
         "2-instances", "cp2-4-instances", "ep2-2-instances-pp-dp", "edp4-dp16-2-instances"],
)
def test_every_group_kind_equals_megatron(layout):
    # Every group kind metatrace lists, against megatron-core's getters on every rank.
    from metatrace.hooks.fake_world import _group_getters

    world = World(layout)
    names = [name for name, _ in _group_getters() if world.knows(name)]
    assert {"tp", "cp", "dp", "pp", "ep", "etp", "edp", "mp", "dp_cp", "tp_cp", "embedding"} <= set(names)
    if layout.dist_opt_instances > 1:
        assert {"intra_dp_cp", "intra_edp", "inter_dist_opt", "dist_opt"} <= set(names)
    with megatron_patches(), remap_cuda("meta"):
        for rank in range(layout.world_size):
            with fake_world(layout, rank):
                import torch.distributed as dist

                for name, getter in _group_getters():
                    if not world.knows(name):
                        continue
                    try:
                        group = getter()
                    except AssertionError:  # not a member (embedding, position embedding)
                        assert not any(rank in g for g in world.groups(name)), (name, rank)
                        continue
                    ranks = dist.get_process_group_ranks(group)
                    assert sorted(ranks) == sorted(world.group_of(name, rank)), (name, rank)


@pytest.mark.parametrize("sizes", [(2, 1, 1, 4, 2), (8, 2, 1, 4, 16), (3, 2, 5, 1, 2)])
def test_vectorised_groups_equal_megatron_generator(sizes):
    import itertools

    from megatron.core.parallel_state import generate_masked_orthogonal_rank_groups

    from metatrace.world import orthogonal_groups

    world = 1
    for s in sizes:
        world *= s
    for mask in itertools.product([False, True], repeat=len(sizes)):
        expected = generate_masked_orthogonal_rank_groups(world, list(sizes), list(mask))
        assert [list(g) for g in orthogonal_groups(sizes, mask)] == expected, mask


def test_roles_cover_every_rank_once_and_name_gpus():
    world = World.from_job(small_job(parallel={"tp": 2, "pp": 2, "dp": 3}, model={"num_layers": 4},
                            cluster={"gpus_per_node": 4}))
    roles = world.roles()
    assert [r.pp_stage for r in roles] == [0, 1]
    ranks = sorted(r for role in roles for r in role.ranks)
    assert ranks == list(range(12))
    assert roles[1].rank == 6 and roles[1].ranks == (6, 7, 8, 9, 10, 11)
    assert world.gpu(0) == "n0_g0" and world.gpu(5) == "n1_g1" and world.gpu(11) == "n2_g3"


def test_distributed_optimizer_instance_groups():
    # 16 GPUs, tp 2, dp 8, num_distributed_optimizer_instances 2: each dp group splits into two
    # halves (the instances); a shard's all-reduce pairs the ranks at the same place in each.
    world = World.from_job(small_job(parallel={"tp": 2}, cluster={"num_gpus": 16},
                                     training={"distributed_optimizer": True,
                                               "num_distributed_optimizer_instances": 2}))
    assert world.groups("dp_cp") == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]
    assert world.groups("intra_dp_cp") == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert world.groups("intra_edp") == world.groups("intra_dp_cp")
    assert world.groups("inter_dist_opt") == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11],
                                              [5, 13], [7, 15]]
    assert world.groups("dist_opt") == [list(range(8)), list(range(8, 16))]
    assert world.kinds()[-4:] == ("intra_dp_cp", "intra_edp", "inter_dist_opt", "dist_opt")
    one = World.from_job(small_job(parallel={"tp": 2}, cluster={"num_gpus": 16}))
    assert "intra_dp_cp" not in one.kinds() and not one.knows("inter_dist_opt")
