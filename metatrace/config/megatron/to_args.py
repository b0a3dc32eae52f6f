"""A job's layout -> Megatron-LM `pretrain_gpt.py` arguments (the reverse of
metatrace.config.megatron.args for the settings `metatrace plan` chooses).

`layout_args(job)` gives the flags of the parallel layout, the batch, the precision, the
activation recompute and the data-parallel optimizer, grouped by subject (one group a line when
printed). `job_from_args(model flags + layout_args(job))` gives back the job's values of
`LAYOUT_FIELDS`; `launcher(job)` is the torchrun command line that starts the job's GPUs.

Known limitations: the model's flags (its dimensions, vocabulary and tokenizer) and the
settings the planner keeps from its base job (offloading, Megatron FSDP, CUDA graphs, MoE
dispatch, TP communication overlap) are not written: the job file of `plan --write-config` has
them. A rank order other than Megatron-LM's two (`--use-tp-pp-dp-mapping`) has no flag.
"""

from __future__ import annotations

import math

# (section, field) that layout_args reproduces through job_from_args.
LAYOUT_FIELDS = (
    ("parallel", "tp"),
    ("parallel", "pp"),
    ("parallel", "vpp"),
    ("parallel", "cp"),
    ("parallel", "ep"),
    ("parallel", "etp"),
    ("parallel", "dp"),
    ("parallel", "sequence_parallel"),
    ("parallel", "rank_order"),
    ("training", "seq_length"),
    ("training", "micro_batch_size"),
    ("training", "global_batch_size"),
    ("training", "precision"),
    ("training", "fp8_format"),
    ("training", "fp8_recipe"),
    ("training", "fp8_param_gather"),
    ("training", "recompute"),
    ("training", "distributed_optimizer"),
    ("training", "overlap_grad_reduce"),
    ("training", "overlap_param_gather"),
    ("training", "num_distributed_optimizer_instances"),
)

# Megatron-LM's --use-tp-pp-dp-mapping (metatrace.config.megatron.flags._CONST).
_TP_PP_DP = "tp-cp-ep-pp-dp"


def layout_arg_groups(job) -> list[list[str]]:
    """The flags of `job`'s layout, batch, precision, recompute and optimizer, by subject."""
    p, t = job.parallel, job.training
    parallel = [
        "--tensor-model-parallel-size",
        str(p.tp),
        "--pipeline-model-parallel-size",
        str(p.pp),
    ]
    if p.vpp:
        parallel += ["--num-virtual-stages-per-pipeline-rank", str(p.vpp)]
    if p.cp > 1:
        parallel += ["--context-parallel-size", str(p.cp)]
    if p.ep > 1:
        parallel += ["--expert-model-parallel-size", str(p.ep)]
    if p.etp is not None and p.etp != p.tp:
        parallel += ["--expert-tensor-parallel-size", str(p.etp)]
    if p.sequence_parallel:
        parallel.append("--sequence-parallel")
    if p.rank_order == _TP_PP_DP:
        parallel.append("--use-tp-pp-dp-mapping")
    batch = [
        "--seq-length",
        str(t.seq_length),
        "--micro-batch-size",
        str(t.micro_batch_size),
        "--global-batch-size",
        str(t.global_batch_size),
    ]
    batch += _precision(t)
    groups = [parallel, batch]
    recompute = _recompute(t.recompute)
    if recompute:
        groups.append(recompute)
    optimizer = []
    if t.distributed_optimizer:
        optimizer.append("--use-distributed-optimizer")
    if t.overlap_grad_reduce:
        optimizer.append("--overlap-grad-reduce")
    if t.overlap_param_gather:
        optimizer.append("--overlap-param-gather")
    if t.num_distributed_optimizer_instances > 1:
        optimizer += [
            "--num-distributed-optimizer-instances",
            str(t.num_distributed_optimizer_instances),
        ]
    if optimizer:
        groups.append(optimizer)
    return groups


def layout_args(job) -> list[str]:
    """`layout_arg_groups` as one token list."""
    return [token for group in layout_arg_groups(job) for token in group]


def launcher(job) -> list[str]:
    """torchrun's arguments for the job's GPUs (ranks fill nodes in order)."""
    gpus, per_node = job.cluster.num_gpus, job.cluster.gpus_per_node
    return [
        "torchrun",
        "--nnodes",
        str(math.ceil(gpus / per_node)),
        "--nproc-per-node",
        str(min(gpus, per_node)),
        "pretrain_gpt.py",
    ]


def _precision(t) -> list[str]:
    if t.precision == "fp32":
        return []
    if t.precision == "fp16":
        return ["--fp16"]
    out = ["--bf16"]
    if t.precision == "fp8":
        out += ["--fp8-format", t.fp8_format or "hybrid"]
        if t.fp8_recipe is not None:
            out += ["--fp8-recipe", t.fp8_recipe]
        if t.fp8_param_gather:
            out.append("--fp8-param-gather")
    return out


def _recompute(r) -> list[str]:
    if r.granularity is None:
        return []
    out = ["--recompute-granularity", r.granularity]
    if r.method is not None:
        out += ["--recompute-method", r.method]
    if r.num_layers is not None:
        out += ["--recompute-num-layers", str(r.num_layers)]
    if r.modules is not None:
        out += ["--recompute-modules", *r.modules]
    if r.distribute_saved_activations:
        out.append("--distribute-saved-activations")
    return out
