"""The simulated world against megatron-core: the groups it forms in the fake world, and its own
rank-group generator (groups, roles and GPU names on their own are in tests/unit/test_world.py)."""

import pytest

from metatrace.hooks.fake_world import fake_world, named_groups
from metatrace.hooks.patches import megatron_patches
from metatrace.hooks.remap import remap_cuda
from metatrace.world import Layout, World
from tests.helpers import small_job


@pytest.mark.parametrize(
    "parallel, num_gpus",
    [
        ({"tp": 2, "pp": 2}, 8),
        ({"tp": 2, "pp": 2, "rank_order": "tp-cp-ep-pp-dp"}, 8),
        ({"tp": 1, "pp": 4}, 8),
    ],
)
def test_groups_equal_megatron_process_groups(parallel, num_gpus):
    world = World.from_job(
        small_job(parallel=parallel, model={"num_layers": 4}, cluster={"num_gpus": num_gpus})
    )
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
        Layout(
            world_size=16, tp=2, pp=2, ep=2, etp=1, dist_opt_instances=2, order="tp-cp-ep-pp-dp"
        ),
        Layout(world_size=32, tp=1, cp=2, ep=8, dist_opt_instances=2),
    ],
    ids=[
        "tp2-pp4",
        "tp2-pp4-pp-dp",
        "tp2-pp2-cp2",
        "tp2-pp2-cp2-pp-dp",
        "ep4-etp1",
        "24-gpus-ep2",
        "2-instances",
        "cp2-4-instances",
        "ep2-2-instances-pp-dp",
        "edp4-dp16-2-instances",
    ],
)
def test_every_group_kind_equals_megatron(layout):
    # Every group kind metatrace lists, against megatron-core's getters on every rank.
    from metatrace.hooks.fake_world import _group_getters

    world = World(layout)
    names = [name for name, _ in _group_getters() if world.knows(name)]
    assert {"tp", "cp", "dp", "pp", "ep", "etp", "edp", "mp", "dp_cp", "tp_cp", "embedding"} <= set(
        names
    )
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


def test_the_simulated_world_leaves_the_process_excepthook_as_it_was():
    # torch's init_process_group wraps sys.excepthook with a "[rank<r>]: " prefix and never
    # unwraps it: two ranks traced in one process would report a later exception as
    # "[rank0]: [rank1]: Traceback ...".
    import io
    import sys

    before = sys.excepthook
    layout = Layout(world_size=2, tp=2)
    with megatron_patches(), remap_cuda("meta"):
        for rank in range(layout.world_size):
            with fake_world(layout, rank):
                pass
    assert sys.excepthook is before
    report = io.StringIO()
    stderr, sys.stderr = sys.stderr, report
    try:
        sys.excepthook(ValueError, ValueError("late"), None)
    finally:
        sys.stderr = stderr
    assert report.getvalue().startswith("ValueError: late"), report.getvalue()


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


@pytest.mark.parametrize(
    "layout",
    [
        Layout(world_size=32, tp=2, pp=2, cp=2, dist_opt_instances=2),
        Layout(world_size=48, tp=2, pp=3, ep=4, etp=1),
        Layout(world_size=16, tp=2, pp=2, order="tp-cp-ep-pp-dp"),
    ],
    ids=["cp2-2-instances", "ep4-etp1", "pp-dp"],
)
def test_rank_generators_list_the_ranks_groups_as_megatron_does(layout):
    # The patched RankGenerator.get_ranks lists the groups that hold the simulated rank (every
    # group for the kinds whose loops use them all), as megatron-core's own lists them.
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from metatrace.hooks.patches import _EVERY_GROUP

    tp, pp, cp, ep = layout.tp, layout.pp, layout.cp, layout.ep
    etp = layout.etp or tp
    generators = {  # as initialize_model_parallel makes them
        "decoder": (
            dict(tp=tp, ep=1, dp=layout.world_size // (tp * cp * pp), pp=pp, cp=cp),
            ["tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp", "tp-cp", "tp-dp-cp"],
        ),
        "expert": (
            dict(tp=etp, ep=ep, dp=layout.world_size // (etp * ep * pp), pp=pp, cp=1),
            ["tp", "ep", "dp", "pp", "tp-ep", "tp-ep-pp"],
        ),
    }
    every = {
        (kind, token): ps.RankGenerator(**sizes, order=layout.order).get_ranks(token)
        for kind, (sizes, tokens) in generators.items()
        for token in tokens
    }
    assert any(token not in _EVERY_GROUP for _, token in every)
    with megatron_patches(), remap_cuda("meta"):
        for rank in (0, 5, layout.world_size - 1):
            with fake_world(layout, rank):
                assert dist.get_rank() == rank
                for (kind, token), groups in every.items():
                    sizes, _ = generators[kind]
                    listed = ps.RankGenerator(**sizes, order=layout.order).get_ranks(token)
                    if token not in _EVERY_GROUP:
                        groups = [g for g in groups if rank in g]
                        assert len(groups) == 1
                    assert listed == groups, (kind, token, rank)
