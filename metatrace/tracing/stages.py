"""Pipeline stages that do the same work: traced once, the others' records derived (pure but
for `stage_keys`, which asks megatron-core where each stage's layers are).

Two middle stages (neither the first, which holds the embedding, nor the last, which holds the
output layer, the loss and any MTP layers) whose model chunks hold as many decoder layers each,
of the same kinds, build the same modules with the same local names (`decoder.layers.0`, ...)
and run the same operators on the same shapes: their micro-batch's records differ only in

- the global layer numbers of their modules (ModuleInfo.layer), shifted by the chunks' layer
  offsets;
- the traced rank, and with it the members of the groups of their collectives and the peers of
  their pipeline sends and receives.

A layer's kind is everything megatron-core decides from its global layer number: dense or MoE
(`moe_layer_freq`), windowed attention (`window_attn_skip_freq`), and any per-layer list of
the TransformerConfig (`no_rope_freq`, ...). FP8 jobs are not derived (`derivable`), so
which FP8 layers stay in BF16 does not enter it.
`derive` checks that every group the traced stage used is the world's group of that kind for
its rank (and returns None otherwise: the stage is traced). Each stage's iteration is replayed
from its own model (the schedule's warm-up depends on the stage), from the derived micro-batch."""

from __future__ import annotations

import dataclasses

from metatrace.records import Collective, ModuleInfo, Trace


def derivable(job) -> bool:
    """Whether the job's traced micro-batch leaves no state that its iteration's replay reads,
    so that a stage's replay from a derived micro-batch is the replay of its own. Measured: the
    MoE aux-loss tracker holds tensors from the micro-batch that the iteration frees, so MoE
    jobs are traced stage by stage; so are those with the other features that keep state from
    the forward (FP8 scaling, activation offloading, CUDA graphs, Megatron-FSDP, userbuffers,
    MTP), which no test has checked."""
    return not (job.model.num_experts or job.model.mtp_num_layers or keeps_state(job))


def keeps_state(job) -> bool:
    """Whether the job uses a feature that keeps state from one layer or step for another (FP8
    scaling, activation or CPU offloading, CUDA graphs, Megatron-FSDP, userbuffers): neither a
    stage's records nor a layer's are derived from another's where it does."""
    t = job.training
    return bool(
        t.precision in ("fp8", "fp4")
        or t.activation_offload_modules
        or t.cpu_offloading_num_layers
        or t.cuda_graph_impl != "none"
        or t.megatron_fsdp
        or job.parallel.tp_comm_overlap
    )


def stage_keys(job, world, config) -> dict[int, tuple | None]:
    """{pipeline stage: what its records depend on}, None for stages that are traced on their
    own (the first and the last, or every stage under a custom pipeline layout). `config`: the
    job's TransformerConfig."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp = world.layout.pp
    chunks = job.parallel.vpp or 1
    out: dict[int, tuple | None] = {s: None for s in range(pp)}
    if pp < 3 or config.pipeline_model_parallel_layout is not None or not derivable(job):
        return out
    for s in range(1, pp - 1):
        key = []
        for v in range(chunks):
            vp = v if job.parallel.vpp else None
            offset = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=s)
            count = get_num_layers_to_build(config, vp_stage=vp, pp_rank=s)
            key.append((offset, tuple(_kind(config, i) for i in range(offset, offset + count))))
        out[s] = tuple(key)
    return out


def same_work(a: tuple | None, b: tuple | None) -> bool:
    """Whether stages of keys a and b do the same work (their layers' kinds, chunk by chunk)."""
    if a is None or b is None:
        return False
    return [kinds for _, kinds in a] == [kinds for _, kinds in b]


def _kind(config, index: int) -> tuple:
    """What megatron-core decides from layer `index` (0-based) alone."""
    from megatron.core.transformer.utils import is_layer_window_attention

    n = config.num_layers
    lists = tuple(
        (name, value[index])
        for name, value in sorted(vars(config).items())
        if isinstance(value, (list, tuple)) and len(value) == n and n > 1
    )
    window = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, index + 1)
    return (lists, window)


def derive(trace: Trace, rank: int, world, shifts: list[int], chunks) -> Trace | None:
    """The micro-batch records of the stage of `rank` from `trace`, those of a stage that does
    the same work; `shifts[v]`: how much further on chunk v's layers are. None when a
    collective's group is not the world's group of its kind for the traced rank (the stage is
    then traced). The iteration is not derived: the schedule's warm-up depends on the stage."""
    move = _mover(trace.rank, rank, world)
    collectives = [move(c) for c in trace.collectives]
    if any(c is None for c in collectives):
        return None
    modules = tuple(_shifted(m, shifts, chunks) for m in trace.modules)
    return dataclasses.replace(trace, rank=rank, modules=modules, collectives=tuple(collectives))


def _mover(mine: int, rank: int, world):
    """Collective of rank `mine` -> the same collective of rank `rank` (the same coordinates but
    the pipeline stage), or None where the recorded group is not the world's."""
    pipe = world.group_of("pp", mine)
    if rank not in pipe:
        return lambda c: None
    step = pipe.index(rank) - pipe.index(mine)

    def shift(r: int) -> int:
        """The rank at r's coordinates, `step` pipeline stages on."""
        own = world.group_of("pp", r)
        return own[(own.index(r) + step) % len(own)]

    def move(c: Collective) -> Collective | None:
        if c.group == "unnamed":
            # The default group (every rank): pipeline transfers where pp is the world size.
            if tuple(c.ranks) != tuple(range(world.size)):
                return None
            ranks = tuple(c.ranks)
        else:
            try:
                if tuple(c.ranks) != tuple(world.group_of(c.group, mine)):
                    return None
                ranks = tuple(world.group_of(c.group, rank))
            except KeyError:
                return None
        if {shift(r) for r in c.ranks} != set(ranks):
            return None
        peer = shift(c.peer) if c.peer is not None else None
        return dataclasses.replace(c, ranks=ranks, peer=peer)

    return move


def _shifted(m: ModuleInfo, shifts: list[int], chunks) -> ModuleInfo:
    if m.layer is None:
        return m
    v = next(
        (i for i, p in enumerate(chunks) if p and (m.fqn == p or m.fqn.startswith(p + "."))), 0
    )
    return dataclasses.replace(m, layer=m.layer + shifts[v])
