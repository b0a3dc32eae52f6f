"""A fake `torch.distributed` world in which megatron-core's own `parallel_state` forms every group.

`fake_world(...)` initialises the default process group with torch's fake backend (collectives
complete at once and move nothing) as one chosen global rank of a world of any size, then calls
`parallel_state.initialize_model_parallel`, so that every group is built by megatron-core itself.
On exit it destroys both, so the next rank can be simulated in the same process.
"""

from __future__ import annotations

import contextlib
import sys

import torch.distributed as dist

from metatrace.hooks import collectives
from metatrace.world import Layout

# Every device type needs a backend: plain "fake" breaks batch_isend_irecv on meta tensors.
FAKE_BACKEND = "cpu:fake,cuda:fake,meta:fake"


def _group_getters():
    """megatron-core's process groups by the name metatrace reports them under.

    When two names return the same group object (e.g. dp and dp_cp with cp = 1), the first
    name in this list is used.
    """
    from megatron.core import parallel_state as ps

    return [
        ("tp", ps.get_tensor_model_parallel_group),
        ("pp", ps.get_pipeline_model_parallel_group),
        ("dp", lambda: ps.get_data_parallel_group(with_context_parallel=False)),
        ("cp", ps.get_context_parallel_group),
        ("dp_cp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
        ("tp_cp", ps.get_tensor_and_context_parallel_group),
        ("mp", ps.get_model_parallel_group),
        ("embedding", ps.get_embedding_group),
        ("position_embedding", ps.get_position_embedding_group),
        ("ep", ps.get_expert_model_parallel_group),
        ("etp", ps.get_expert_tensor_parallel_group),
        ("edp", ps.get_expert_data_parallel_group),
        ("tp_ep", ps.get_expert_tensor_and_model_parallel_group),
        ("tp_ep_pp", ps.get_expert_tensor_model_pipeline_parallel_group),
        ("tp_dp", lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=False)),
        ("tp_dp_cp", lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True)),
        ("cp_a2a", _hierarchical_cp(0)),  # cp_comm_type a2a+p2p: the all-to-all level
        ("cp_p2p", _hierarchical_cp(1)),  # and the ring level
        # num_distributed_optimizer_instances > 1 (with one instance the first three are
        # dp_cp, edp and none, the last the whole world):
        # DDP's reduce-scatter and parameter all-gather of dense and expert buckets,
        (
            "intra_dp_cp",
            lambda: ps.get_data_parallel_group(
                with_context_parallel=True, partial_data_parallel=True
            ),
        ),
        ("intra_edp", lambda: ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)),
        # the all-reduce of each shard across the instances (dense and expert buckets alike),
        (
            "inter_dist_opt",
            lambda: ps.get_inter_distributed_optimizer_instance_group(check_initialized=False),
        ),
        # and every GPU of an instance: the optimizer's gradient-norm statistics.
        ("dist_opt", lambda: ps.get_intra_distributed_optimizer_instance_group()),
        ("world", lambda: dist.group.WORLD),
    ]


def _hierarchical_cp(level: int):
    from megatron.core import parallel_state as ps

    def get():
        groups = ps.get_hierarchical_context_parallel_groups(check_initialized=False)
        return groups[level] if groups else None

    return get


def named_groups() -> dict[str, tuple[str, tuple[int, ...]]]:
    """{torch group_name: (megatron-core name, global ranks)} for the simulated rank."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, getter in _group_getters():
        try:
            group = getter()
        except (AssertionError, RuntimeError, AttributeError):
            continue  # not created for this layout (e.g. no position-embedding group)
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        key = group.group_name
        if key not in out:
            out[key] = (name, tuple(dist.get_process_group_ranks(group)))
    return out


@contextlib.contextmanager
def _symmetric_object_gathers():
    """`all_gather_object` in the simulated world: every rank contributes what the simulated
    one does (the world's ranks are symmetric), without serialising the object once per rank of
    the world (megatron-core's optimizer gathers its parameter-group keys over the world)."""
    orig = dist.all_gather_object

    def all_gather_object(object_list, obj, group=None):
        for i in range(len(object_list)):
            object_list[i] = obj

    dist.all_gather_object = all_gather_object
    try:
        yield
    finally:
        dist.all_gather_object = orig


@contextlib.contextmanager
def fake_world(layout: Layout, rank: int, *, seed: int = 1234, nvlink_domain: int | None = None):
    """Simulate global `rank` of `layout`; megatron-core's parallel_state is live inside;
    `nvlink_domain`: the cluster's GPUs per NVLink domain (collectives.nvlink_domain() inside)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a torch.distributed world is already initialised in this process")
    # init_process_group wraps sys.excepthook to prefix "[rank<r>]: " to every line of an
    # uncaught exception's report, and never unwraps it: each simulated rank would add a prefix
    # to whatever the process reports afterwards (torch 2.13 distributed_c10d.py:1921-1937).
    excepthook = sys.excepthook
    try:
        dist.init_process_group(
            backend=FAKE_BACKEND, rank=rank, world_size=layout.world_size, store=FakeStore()
        )
    finally:
        sys.excepthook = excepthook
    collectives.set_nvlink_domain(nvlink_domain)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            context_parallel_size=layout.cp,
            hierarchical_context_parallel_sizes=(
                list(layout.hierarchical_cp_sizes) if layout.hierarchical_cp_sizes else None
            ),
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            num_distributed_optimizer_instances=layout.dist_opt_instances,
            order=layout.order,
            create_gloo_process_groups=False,
        )
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        with _symmetric_object_gathers():
            yield
    finally:
        from metatrace.hooks.patches import clear_parallel_state_leftovers

        collectives.set_nvlink_domain(None)
        ps.destroy_model_parallel()
        clear_parallel_state_leftovers()
        if dist.is_initialized():
            dist.destroy_process_group()
