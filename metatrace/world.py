"""The simulated cluster: where every global rank sits, which groups it belongs to, and which
ranks play the same role.

Group membership comes from megatron-core's own `RankGenerator` (the code
`initialize_model_parallel` uses), built the way `initialize_model_parallel` builds it: a dense
grid (tp, cp, dp, pp) and an expert grid (etp, ep, expert dp, pp) with the same order string.
GPUs are named `n{node}_g{gpu}`, ranks filling nodes in order.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from functools import cached_property

# Group name -> (grid, token for RankGenerator.get_ranks).
GROUP_TOKENS = {
    "tp": ("dense", "tp"),
    "cp": ("dense", "cp"),
    "dp": ("dense", "dp"),
    "pp": ("dense", "pp"),
    "dp_cp": ("dense", "dp-cp"),
    "tp_cp": ("dense", "tp-cp"),
    "mp": ("dense", "tp-pp"),
    "tp_dp": ("dense", "tp-dp"),
    "tp_dp_cp": ("dense", "tp-dp-cp"),
    "ep": ("expert", "ep"),
    "etp": ("expert", "tp"),
    "edp": ("expert", "dp"),
    "tp_ep": ("expert", "tp-ep"),
    "tp_ep_pp": ("expert", "tp-ep-pp"),
}

GROUP_KINDS = ("tp", "cp", "dp", "pp", "ep", "etp", "edp", "mp", "dp_cp", "tp_cp", "embedding")
"""The group kinds `metatrace groups` and the JSON report list, in that order."""

INSTANCE_KINDS = ("intra_dp_cp", "intra_edp", "inter_dist_opt", "dist_opt")
"""The distributed optimizer's instance groups (num_distributed_optimizer_instances), listed
after GROUP_KINDS when there is more than one instance: the dp x cp ranks of an instance (DDP's
dense reduce-scatter and all-gather), the expert dp ranks of an instance (the same for expert
buckets), the ranks holding the same shard in every instance (the all-reduce across instances,
of dense and expert shards alike) and every GPU of an instance (the gradient norm)."""


def orthogonal_groups(sizes, mask) -> tuple[tuple[int, ...], ...]:
    """megatron-core's generate_masked_orthogonal_rank_groups, vectorised (its loops take
    seconds on 16k GPUs; a test checks the two agree): orthogonal_array's rows."""
    return tuple(map(tuple, orthogonal_array(tuple(sizes), tuple(mask)).tolist()))


@functools.cache
def orthogonal_array(sizes: tuple[int, ...], mask: tuple[bool, ...]):
    """The rank groups as a read-only numpy array, one row per group, computed once per shape.
    Rank = sum of index_k x stride_k over the dimensions in `sizes` (the first varies fastest);
    a group varies the masked dimensions, and groups and their members are numbered first
    dimension fastest. Restates
    megatron.core.parallel_state.generate_masked_orthogonal_rank_groups
    (source sha256: 46ca2a9b4dff)."""
    import numpy as np

    n = len(sizes)
    grid = np.arange(int(np.prod(sizes))).reshape(tuple(reversed(sizes)))  # axis n-1-k: dim k
    fixed = [n - 1 - k for k in reversed(range(n)) if not mask[k]]
    varied = [n - 1 - k for k in reversed(range(n)) if mask[k]]
    size = int(np.prod([sizes[k] for k in range(n) if mask[k]]))
    groups = grid.transpose(fixed + varied).reshape(-1, size)
    groups.flags.writeable = False
    return groups


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The parallel sizes megatron-core's initialize_model_parallel takes."""

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    order: str = "tp-cp-ep-dp-pp"
    hierarchical_cp_sizes: tuple[int, ...] | None = None
    dist_opt_instances: int = 1
    """num_distributed_optimizer_instances: the distributed optimizer's replicas over dp x cp."""


class _Grid:
    """megatron-core 0.16.1's RankGenerator (parallel_state.py), restated: the sizes in the
    order's order (a dimension the order leaves out, of size 1, goes last) and, for a token
    such as "tp-dp", the groups that vary those dimensions (a test compares the groups with
    megatron-core's). 0.19 adds a gtp_remat dimension (generalised tensor parallelism), of
    size 1 unless gtp_remat_size is set, which leaves every group as it was. Restates
    megatron.core.parallel_state.RankGenerator (source sha256: c67b689c9866, 1d65ff342641)."""

    def __init__(self, sizes: dict[str, int], order: str):
        names = order.lower().split("-")
        for name, size in sizes.items():
            if name not in names:
                if size != 1:
                    raise ValueError(f"{name} = {size} is not in the rank order {order!r}")
                names.append(name)
        self.names = names
        self.sizes = [sizes[n] for n in names]

    def groups(self, token: str) -> tuple[tuple[int, ...], ...]:
        mask = [n in token.split("-") for n in self.names]
        return orthogonal_groups(self.sizes, mask)


@dataclass(frozen=True)
class Role:
    """Ranks that hold the same model chunks and do the same work (one pipeline stage)."""

    index: int
    pp_stage: int
    rank: int
    """The global rank that is traced for the role."""
    ranks: tuple[int, ...]
    """Every global rank the role stands for."""


def _per_world(method):
    """Memoise a World method per instance (functools.lru_cache on a method would keep every
    World it saw alive in one module-level cache)."""

    @functools.wraps(method)
    def memoised(self, *args):
        key = (method.__name__, *args)
        if key not in self._memo:
            self._memo[key] = method(self, *args)
        return self._memo[key]

    return memoised


class World:
    """Ranks, groups and roles of a parallel layout (`World.from_job(job)` for a job)."""

    def __init__(self, layout: Layout, gpus_per_node: int = 8, nvlink_domain: int | None = None):
        self._memo: dict[tuple, object] = {}
        self.layout = layout
        self.size = layout.world_size
        self.gpus_per_node = gpus_per_node
        self.nvlink_domain = nvlink_domain or gpus_per_node
        """GPUs joined by NVLink: what crosses a domain goes over the network."""
        self.dp = self.size // (layout.tp * layout.pp * layout.cp)
        self.expert_dp = self.size // ((layout.etp or layout.tp) * layout.ep * layout.pp)

    @classmethod
    def from_job(cls, job) -> World:
        par = job.parallel
        layout = Layout(
            world_size=job.cluster.num_gpus,
            tp=par.tp,
            pp=par.pp,
            vpp=par.vpp,
            cp=par.cp,
            ep=par.ep,
            etp=par.etp,
            order=par.rank_order,
            hierarchical_cp_sizes=(
                tuple(par.hierarchical_cp_sizes) if par.hierarchical_cp_sizes else None
            ),
            dist_opt_instances=job.training.num_distributed_optimizer_instances,
        )
        return cls(layout, job.cluster.gpus_per_node, job.cluster.nvlink_domain)

    @cached_property
    def _grids(self) -> dict[str, _Grid]:
        lay = self.layout
        return {
            "dense": _Grid(dict(tp=lay.tp, ep=1, dp=self.dp, pp=lay.pp, cp=lay.cp), lay.order),
            "expert": _Grid(
                dict(tp=lay.etp or lay.tp, ep=lay.ep, dp=self.expert_dp, pp=lay.pp, cp=1), lay.order
            ),
        }

    def groups(self, name: str) -> list[list[int]]:
        """Every group of kind `name` (a GROUP_TOKENS name, embedding or position_embedding)
        as lists of global ranks, in megatron-core's order."""
        return [list(g) for g in self._groups(name)]

    @property
    def instances(self) -> int:
        return self.layout.dist_opt_instances

    def kinds(self) -> tuple[str, ...]:
        """The group kinds to list: GROUP_KINDS, and INSTANCE_KINDS with several instances."""
        return GROUP_KINDS + (INSTANCE_KINDS if self.instances > 1 else ())

    def knows(self, name: str) -> bool:
        return (
            name in GROUP_TOKENS
            or name in ("embedding", "position_embedding")
            or (name in INSTANCE_KINDS and self.instances > 1)
        )

    @_per_world
    def _groups(self, name: str) -> tuple[tuple[int, ...], ...]:
        if name == "embedding":
            # megatron-core's default_embedding_ranks: first and last stage of each pp group.
            return tuple(tuple(sorted({g[0], g[-1]})) for g in self._groups("pp"))
        if name == "position_embedding":
            return tuple((g[0],) for g in self._groups("pp"))
        if name in INSTANCE_KINDS:
            return self._instance_groups(name)
        grid, token = GROUP_TOKENS[name]
        return self._grids[grid].groups(token)

    def _instance_groups(self, name: str) -> tuple[tuple[int, ...], ...]:
        """initialize_model_parallel's groups for num_distributed_optimizer_instances = n: each
        dp x cp group cut into n consecutive parts; each expert dp group likewise (level 0 of
        create_hierarchical_groups with sizes [edp / n, n]) and across the parts, the ranks at
        the same place in each (level 1: `inter`, the only inter-instance group megatron-core
        builds, dense shards use it too); an instance's GPUs: runs of edp / n consecutive
        tp-ep-pp groups of the expert grid."""
        n = self.instances
        if name == "intra_dp_cp":
            return tuple(
                g[i * (len(g) // n) : (i + 1) * (len(g) // n)]
                for g in self._groups("dp_cp")
                for i in range(n)
            )
        k = self.expert_dp // n
        if name == "intra_edp":
            return tuple(g[i * k : (i + 1) * k] for g in self._groups("edp") for i in range(n))
        if name == "inter_dist_opt":
            return tuple(g[j::k] for g in self._groups("edp") for j in range(k))
        mp = self._groups("tp_ep_pp")  # (torch's new_group sorts a group's ranks)
        return tuple(
            tuple(sorted(itertools.chain.from_iterable(mp[i : i + k])))
            for i in range(0, len(mp), k)
        )

    @_per_world
    def _index(self, name: str) -> dict[int, tuple[int, ...]]:
        return {r: g for g in self._groups(name) for r in g}

    def crosses_nodes(self, ranks) -> bool:
        """Whether `ranks` span more than one NVLink domain (the node, or an NVL72 rack)."""
        first = self.domain(ranks[0])
        return any(self.domain(r) != first for r in ranks)

    @_per_world
    def crossing_ranks(self, name: str) -> frozenset[int]:
        """The ranks whose group of kind `name` spans more than one node."""
        return frozenset(r for g in self._groups(name) if self.crosses_nodes(g) for r in g)

    @cached_property
    def pp_stage_of(self) -> dict[int, int]:
        return {r: i for group in self.groups("pp") for i, r in enumerate(group)}

    def group_of(self, name: str, rank: int) -> list[int]:
        try:
            return list(self._index(name)[rank])
        except KeyError:
            raise KeyError(f"rank {rank} is in no {name} group") from None

    def roles(self) -> list[Role]:
        """One role per pipeline stage: TP, CP and DP peers hold the same chunks."""
        by_stage: dict[int, list[int]] = {}
        for rank, stage in self.pp_stage_of.items():
            by_stage.setdefault(stage, []).append(rank)
        return [
            Role(index=s, pp_stage=s, rank=min(ranks), ranks=tuple(sorted(ranks)))
            for s, ranks in sorted(by_stage.items())
        ]

    def gpu(self, rank: int) -> str:
        return f"n{rank // self.gpus_per_node}_g{rank % self.gpus_per_node}"

    def domain(self, rank: int) -> int:
        """The NVLink domain of `rank`."""
        return rank // self.nvlink_domain
