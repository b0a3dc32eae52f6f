"""Checks a resolved job against the rules Megatron-LM and megatron-core enforce, before any
model is built. Every violated rule is reported (one line each) in a single `ConfigError`.

megatron-core's own `TransformerConfig` checks run afterwards, before any trace
(metatrace.tracing.checks), and are reported the same way.
"""

from __future__ import annotations

import functools
import math
import re

from metatrace.config.hardware import GPU_ARCH, GPU_FP4_TFLOPS
from metatrace.config.hybrid import GDN, MAMBA
from metatrace.config.job import FSDP_DTYPES, GATED_ACTIVATIONS, OFFLOAD_KNOBS
from metatrace.config.release import since as release_since
from metatrace.errors import ConfigError

RANK_ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")
# Selective-recompute modules megatron-core 0.16.1 accepts for a dense GPT layer.
DENSE_RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
MOE_RECOMPUTE_MODULES = ("moe_act", "moe", "shared_experts")
MLA_RECOMPUTE_MODULES = ("mla_up_proj",)


# megatron-core 0.16.1 PipelineParallelLayerLayout.parse_str_to_list, restated without its
# LayerType enum (hooks/guards.py checks the hash against the installed megatron-core). Restates
# megatron.core.transformer.pipeline_parallel_layer_layout.PipelineParallelLayerLayout.parse_str_to_list
# (source sha256: 03460d910c79).
_LAYER_TYPES = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


_LAYOUT_LIMIT = 1_000_000
"""Characters a layout may expand to (no model has a million layers); beyond, it is refused
before it is spelled out."""


def _repeat(grown: list[int], m: re.Match) -> str:
    """The repetition `m` spelled out; `grown` counts the characters of the whole expansion."""
    grown[0] += len(m.group(1)) * int(m.group(2)) - len(m.group(0))
    if grown[0] > _LAYOUT_LIMIT:
        raise ValueError(f"it spells more than {_LAYOUT_LIMIT:,} layers")
    return m.group(1) * int(m.group(2))


def parse_layout(layout: str) -> list[list[str]]:
    """A pipeline layout string as megatron-core reads it: "Ettt|(tt|)*29,m|L" -> one list of
    layer types per virtual stage (embedding, decoder, mtp, loss)."""
    text = layout.replace(",", "")  # purely cosmetic commas
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):  # (ab|)*n, then x*n
        text = re.sub(pattern, functools.partial(_repeat, [len(text)]), text)
    stages = []
    for stage in text.split("|"):
        unknown = [c for c in stage if c not in _LAYER_TYPES]
        if unknown:
            raise ValueError(f"invalid layer character {unknown[0]!r} (known: E, L, t, m)")
        stages.append([_LAYER_TYPES[c] for c in stage])
    return stages


def layout_stages(layout: str, pp: int) -> list[list[str]]:
    """Parse a pipeline layout string as megatron-core does."""
    try:
        stages = parse_layout(layout)
    except (ValueError, re.error) as e:
        raise ConfigError(f"parallel.layout {layout!r} is not a valid layout: {e}") from None
    if len(stages) % pp:
        raise ConfigError(
            f"parallel.layout has {len(stages)} stages, not a multiple of parallel.pp = {pp}"
        )
    return stages


def check_job(job) -> None:
    problems = []
    for check in (
        _check_model,
        _check_parallel,
        _check_impl,
        _check_moe,
        _check_ep_overlap,
        _check_mla,
        _check_attention_variants,
        _check_bias_activation_fusion,
        _check_mtp,
        _check_hybrid_layers,
        _check_gate_and_latent,
        _check_cluster,
    ):
        problems.extend(check(job))
    split = list(_check_pipeline(job))
    problems += split
    problems.extend(_check_training(job, split_ok=not split))
    if problems:
        raise ConfigError(problems)


def _check_model(job):
    m = job.model
    tp = job.parallel.tp
    if m.num_attention_heads % tp:
        yield f"model.num_attention_heads = {m.num_attention_heads} is not divisible by parallel.tp = {tp}"
    if m.num_attention_heads % m.num_query_groups:
        yield (
            f"model.num_attention_heads = {m.num_attention_heads} is not divisible by "
            f"model.num_query_groups = {m.num_query_groups}"
        )
    if m.num_query_groups % tp:
        yield (
            f"model.num_query_groups = {m.num_query_groups} is not divisible by parallel.tp = {tp} "
            "(megatron-core splits key/value heads over the TP group)"
        )
    if m.ffn_hidden_size % tp:
        yield f"model.ffn_hidden_size = {m.ffn_hidden_size} is not divisible by parallel.tp = {tp}"
    for name in ("hidden_dropout", "attention_dropout"):
        p = getattr(m, name)
        if not 0.0 <= p < 1.0:
            yield f"model.{name} = {p} must be in [0, 1)"
    seq = job.training.seq_length
    if m.position_embedding_type == "learned_absolute" and m.max_position_embeddings < seq:
        yield (
            f"model.max_position_embeddings = {m.max_position_embeddings} is smaller than "
            f"training.seq_length = {seq}"
        )
    if m.make_vocab_size_divisible_by < 1:
        yield "model.make_vocab_size_divisible_by must be at least 1"
    if not 0.0 < m.rotary_percent <= 1.0:
        yield f"model.rotary_percent = {m.rotary_percent} must be in (0, 1]"
    if not m.norm_epsilon > 0:
        yield f"model.norm_epsilon = {m.norm_epsilon:g} must be more than 0"
    if m.position_embedding_type in ("rope", "yarn"):
        if m.rotary_base is not None and m.rotary_base < 1:
            yield f"model.rotary_base = {m.rotary_base} must be at least 1"
        if m.max_position_embeddings is not None and m.max_position_embeddings < 1:
            yield f"model.max_position_embeddings = {m.max_position_embeddings} must be at least 1"


def _check_parallel(job):
    par = job.parallel
    world = job.cluster.num_gpus
    tokens = par.rank_order.split("-")
    if sorted(tokens) != sorted(RANK_ORDER_TOKENS):
        yield (
            f"parallel.rank_order {par.rank_order!r} must order each of "
            f"{', '.join(RANK_ORDER_TOKENS)} exactly once, e.g. 'tp-cp-ep-dp-pp'"
        )
    if par.ep > 1 and job.model.num_experts is None:
        yield f"parallel.ep = {par.ep} needs a mixture-of-experts model (model.num_experts)"
    expert_grid = par.etp * par.ep * par.pp
    if world % expert_grid:
        yield (
            f"cluster.num_gpus = {world} is not divisible by etp x ep x pp = "
            f"{par.etp} x {par.ep} x {par.pp} = {expert_grid}"
        )
    elif not par.rank_order.endswith("pp") and par.pp > 1:
        expert_dp = world // expert_grid
        if expert_dp != par.dp:
            # megatron-core's initialize_model_parallel asserts this.
            yield (
                f"parallel.rank_order {par.rank_order!r} does not end in pp: megatron-core then "
                f"needs the same data-parallel size for dense and expert layers, got dp {par.dp} "
                f"and expert dp {expert_dp} = num_gpus / (etp x ep x pp)"
            )
    if par.cp > 1:
        seq = job.training.seq_length
        if seq % (2 * par.cp):
            yield (
                f"training.seq_length = {seq} is not divisible by 2 x parallel.cp = {2 * par.cp} "
                "(Megatron splits the sequence into 2 x cp load-balanced chunks)"
            )
        if job.implementation.transformer_impl == "local":
            yield (
                "parallel.cp > 1 needs implementation.transformer_impl: transformer_engine "
                "(megatron-core's local attention refuses context parallelism)"
            )
        elif job.attention_kernel == "unfused":
            yield (
                "implementation.attention_backend: unfused has no context-parallel path in "
                "Transformer Engine; use fused or flash with parallel.cp > 1"
            )
        yield from _check_cp_comm(job)
    elif par.hierarchical_cp_sizes is not None:  # what idle_keys left
        yield _cp_sizes_product(par)
    if par.sequence_parallel:
        local_seq = job.training.seq_length // par.cp
        if local_seq % par.tp:
            yield (
                f"sequence parallel splits training.seq_length / cp = {local_seq} over "
                f"parallel.tp = {par.tp}, which does not divide it"
            )
    yield from _check_tp_overlap(job)


def _check_tp_overlap(job):
    """Transformer Engine's userbuffers, as Megatron-LM and TE 2.8's initialize_ub check them."""
    from metatrace.config.userbuffers import UbError, userbuffers

    par = job.parallel
    if not par.tp_comm_overlap:
        return  # its options alone change nothing (resolve notes them)
    if not (par.sequence_parallel and par.tp > 1):
        yield (
            "parallel.tp_comm_overlap needs parallel.sequence_parallel with parallel.tp > 1 "
            "(Megatron-LM asserts it: the overlapped collectives are sequence parallelism's)"
        )
    if job.implementation.transformer_impl != "transformer_engine":
        yield "parallel.tp_comm_overlap needs implementation.transformer_impl: transformer_engine"
    elif job.implementation.te_op_fuser:
        yield (
            "parallel.tp_comm_overlap with implementation.te_op_fuser is not modelled yet "
            "(the op fuser's userbuffers linear ops)"
        )
    if job.model.mtp_num_layers:
        # megatron-core asserts a buffer name for every TE linear under tp_comm_overlap; MTP's
        # eh_proj has none (multi_token_prediction.py).
        yield (
            "parallel.tp_comm_overlap with multi-token prediction fails in megatron-core 0.16.1 "
            "(its eh_proj linear has no userbuffer name: 'Buffer name should be set')"
        )
    if job.model.multi_latent_attention:
        yield (
            "parallel.tp_comm_overlap with model.multi_latent_attention is not modelled yet "
            "(megatron-core turns the overlap off for MLA's projections, and with it for the "
            "layers built after them)"
        )
    tr = job.training
    if tr.precision == "fp8" and tr.fp8_recipe in ("mxfp8", "blockwise"):
        yield (
            f"parallel.tp_comm_overlap with training.fp8_recipe {tr.fp8_recipe} is not modelled "
            "yet (userbuffers gather the data and NCCL the scales); per-tensor recipes "
            "(delayed, tensorwise) are"
        )
    if tr.precision == "fp8" and par.tp_comm_overlap_rs_dgrad:
        yield (
            "parallel.tp_comm_overlap_rs_dgrad under FP8 is not modelled yet (Transformer "
            "Engine then writes dgrad in FP8 into an FP8 userbuffer)"
        )
    cfg = par.tp_comm_overlap_cfg
    for name, gemm in vars(cfg).items() if cfg is not None else ():
        if gemm is None:
            continue
        if gemm.atomic_gemm and tr.precision != "fp8":
            yield (
                f"parallel.tp_comm_overlap_cfg.{name}.atomic_gemm: Transformer Engine supports "
                "atomic GEMM overlap for FP8 only"
            )
        if tr.precision == "fp8" and gemm.fp8_buf and name in ("proj_fprop", "fc2_fprop"):
            yield (
                f"parallel.tp_comm_overlap_cfg.{name}.fp8_buf under FP8 is not modelled yet "
                "(Transformer Engine then writes the GEMM output in FP8 and reduce-scatters it "
                "in FP8)"
            )
    try:
        userbuffers(job)
    except UbError as e:
        yield str(e)


def _check_cp_comm(job):
    par, m = job.parallel, job.model
    sizes = par.hierarchical_cp_sizes
    if par.cp_comm_type == "a2a+p2p":
        if sizes is None or len(sizes) != 2 or sizes[0] * sizes[1] != par.cp or min(sizes) < 1:
            yield (
                "parallel.cp_comm_type a2a+p2p needs parallel.hierarchical_cp_sizes: [a2a size, "
                f"p2p size] whose product is parallel.cp = {par.cp}, got {sizes}"
            )
    elif sizes is not None:  # what idle_keys left
        yield _cp_sizes_product(par)
    a2a = {"a2a": par.cp, "a2a+p2p": (sizes or [1])[0]}.get(par.cp_comm_type)
    if a2a and a2a > 1:
        heads, groups = m.num_attention_heads // par.tp, m.num_query_groups // par.tp
        if heads % a2a or groups % a2a:
            yield (
                f"cp_comm_type {par.cp_comm_type} spreads attention heads over {a2a} ranks: "
                f"query heads per TP rank ({heads}) and key/value heads per TP rank ({groups}) "
                "must both be divisible by it"
            )


def _cp_sizes_product(par) -> str:
    return (
        f"parallel.hierarchical_cp_sizes {par.hierarchical_cp_sizes}: Megatron-LM asserts that "
        f"their product is parallel.cp = {par.cp}"
    )


def _check_pipeline(job):
    par = job.parallel
    layers = job.model.num_layers
    pp, vpp = par.pp, par.vpp
    uneven = par.first_stage_layers is not None or par.last_stage_layers is not None
    account = par.account_for_embedding or par.account_for_loss
    if vpp is not None and pp == 1:
        yield "parallel.vpp needs parallel.pp > 1"
        return
    if job.model.hybrid_layer_pattern is not None:
        stages = _hybrid_stages(job)
        yield from _check_hybrid_pipeline(job, stages)
        if stages is not None or vpp is not None:
            return
    if par.layout is not None:
        if uneven or account:
            yield (
                "parallel.layout cannot be combined with first_stage_layers, last_stage_layers, "
                "account_for_embedding or account_for_loss"
            )
            return
        stages = layout_stages(par.layout, pp)
        # Stages are listed in layer order (virtual-stage major), so the flat list is too.
        flat = [t for stage in stages for t in stage]
        count = flat.count("decoder")
        if count != layers:
            yield f"parallel.layout places {count} decoder layers, but model.num_layers = {layers}"
        if flat.count("embedding") != 1 or flat[:1] != ["embedding"]:
            yield "parallel.layout must start with the embedding (E), exactly once"
        if flat.count("loss") != 1 or flat[-1:] != ["loss"]:
            yield "parallel.layout must end with the loss (L), exactly once"
        yield from _check_mtp_layout(job, stages)
        return
    if uneven and account:
        yield (
            "parallel.first_stage_layers / last_stage_layers cannot be combined with "
            "account_for_embedding / account_for_loss"
        )
        return
    if uneven:
        middle_layers, middle_stages = layers, pp
        for name in ("first_stage_layers", "last_stage_layers"):
            n = getattr(par, name)
            if n is None:
                continue
            if n < 1:
                yield f"parallel.{name} = {n} must be at least 1"
                return
            if vpp is not None and n % vpp:
                yield f"parallel.{name} = {n} is not divisible by parallel.vpp = {vpp}"
            middle_layers -= n
            middle_stages -= 1
        if middle_stages < 0 or middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
            yield (
                f"the uneven split leaves {middle_layers} layers for {max(middle_stages, 0)} "
                f"middle stages (model.num_layers = {layers}, parallel.pp = {pp})"
            )
        elif middle_stages and middle_layers % middle_stages:
            yield (
                f"{middle_layers} middle layers do not split evenly over {middle_stages} middle "
                f"pipeline stages"
            )
        elif middle_stages and vpp is not None and (middle_layers // middle_stages) % vpp:
            yield (
                f"{middle_layers // middle_stages} layers per middle stage are not divisible by "
                f"parallel.vpp = {vpp}"
            )
        return
    total = layers + int(par.account_for_embedding) + int(par.account_for_loss)
    what = "model.num_layers" + (
        " + embedding" * par.account_for_embedding + " + loss" * par.account_for_loss
    )
    if total % pp:
        yield f"{what} = {total} is not divisible by parallel.pp = {pp}"
    elif vpp is not None and (total // pp) % vpp:
        yield (
            f"{what} / parallel.pp = {total // pp} layers per pipeline rank are not divisible "
            f"by parallel.vpp = {vpp}"
        )


def _hybrid_stages(job):
    """The pipeline segments of a hybrid layer pattern with `|` (None without)."""
    from metatrace.config.hybrid import parse
    from metatrace.config.release import since

    return parse(job.model.hybrid_layer_pattern, since_0_19=since(0, 19)).stages


def _check_hybrid_pipeline(job, stages):
    """megatron-core's hybrid stacks split the pattern by `|` (0.19, one segment a pipeline
    rank and virtual stage: `stages`) or evenly / by first and last stage layers (MambaStack,
    which takes no virtual pipeline)."""
    par = job.parallel
    chunks = par.pp * (par.vpp or 1)
    if par.layout is not None:
        yield "parallel.layout with model.hybrid_layer_pattern: give the stages as '|' in it"
    if stages is None:
        if par.vpp is not None:
            yield (
                "parallel.vpp with a hybrid model needs '|' in model.hybrid_layer_pattern "
                "between its pipeline chunks (megatron-core 0.19; 0.16.1's MambaStack takes no "
                "virtual pipeline)"
            )
        return
    if par.first_stage_layers is not None or par.last_stage_layers is not None:
        yield (
            "parallel.first_stage_layers / last_stage_layers with '|' in "
            "model.hybrid_layer_pattern: the pattern's segments are the stages"
        )
    if len(stages) != chunks:
        yield (
            f"model.hybrid_layer_pattern has {len(stages)} pipeline segments ('|'), but "
            f"parallel.pp x vpp = {chunks} model chunks"
        )


def chunk_layer_counts(job) -> list[int]:
    """Decoder layers of every model chunk, in layer order (virtual stage major: chunk v of
    pipeline rank p is entry v * pp + p), as megatron-core's get_num_layers_to_build splits
    them; call after the pipeline checks passed."""
    par, layers = job.parallel, job.model.num_layers
    pp, vpp = par.pp, par.vpp or 1
    stages = _hybrid_stages(job) if job.model.hybrid_layer_pattern is not None else None
    if stages is not None:
        return [len(stage) for stage in stages]
    if par.layout is not None:
        return [stage.count("decoder") for stage in layout_stages(par.layout, pp)]
    if par.first_stage_layers is not None or par.last_stage_layers is not None:
        first, last = par.first_stage_layers, par.last_stage_layers
        middle_stages = pp - (first is not None) - (last is not None)
        middle = layers - (first or 0) - (last or 0)
        per_stage = [middle // middle_stages if middle_stages else 0] * pp
        if first is not None:
            per_stage[0] = first
        if last is not None:
            per_stage[-1] = last
        return [n // vpp for _ in range(vpp) for n in per_stage]
    total = layers + int(par.account_for_embedding) + int(par.account_for_loss)
    counts = [total // pp // vpp] * (pp * vpp)
    if par.account_for_embedding:
        counts[0] -= 1
    if par.account_for_loss:
        counts[-1] -= 1
    return counts


def _check_training(job, split_ok: bool):
    tr = job.training
    par = job.parallel
    if tr.seq_length < 1:
        yield f"training.seq_length = {tr.seq_length} must be at least 1"
    if not tr.clip_grad >= 0:
        yield f"training.clip_grad = {tr.clip_grad:g} must be at least 0 (0: no clipping)"
    if not 0 <= tr.sgd_momentum < 1:
        yield f"training.sgd_momentum = {tr.sgd_momentum:g} must be in [0, 1)"
    if tr.micro_batch_size < 1:
        yield f"training.micro_batch_size = {tr.micro_batch_size} must be at least 1"
        return
    per_step = tr.micro_batch_size * par.dp
    yield from _check_deferred_wgrad(job, per_step)
    if tr.global_batch_size < 1 or tr.global_batch_size % per_step:
        yield (
            f"training.global_batch_size = {tr.global_batch_size} is not a multiple of "
            f"micro_batch_size x dp = {tr.micro_batch_size} x {par.dp} = {per_step}"
        )
    elif tr.global_batch_size // per_step > MAX_MICROBATCHES:
        yield (
            f"training.global_batch_size = {tr.global_batch_size:,} is "
            f"{tr.global_batch_size // per_step:,} micro-batches per iteration; metatrace "
            f"replays at most {MAX_MICROBATCHES:,}"
        )
    elif par.vpp is not None:
        # megatron-core's interleaved schedule: pp <= group <= M, and the last group of
        # micro-batches is whole or at least pp long.
        m = tr.global_batch_size // per_step
        group = par.microbatch_group_size or par.pp
        if not par.pp <= group <= m:
            yield (
                f"the interleaved schedule runs micro-batches in groups of "
                f"parallel.microbatch_group_size = {group}, which must be at least parallel.pp "
                f"= {par.pp} and at most the number of micro-batches, {m} = global_batch_size / "
                "(micro_batch_size x dp)"
            )
        elif 0 < m % group < par.pp:
            yield (
                f"the interleaved schedule needs the number of micro-batches ({m} = "
                f"global_batch_size / (micro_batch_size x dp)) to be a multiple of "
                f"parallel.microbatch_group_size = {group}, or to leave at least parallel.pp = "
                f"{par.pp} over"
            )
    if par.vpp is None and (par.microbatch_group_size is not None or par.overlap_p2p_comm):
        yield "parallel.microbatch_group_size and parallel.overlap_p2p_comm need parallel.vpp"
    if par.overlap_p2p_comm_warmup_flush and not par.overlap_p2p_comm:
        yield "parallel.overlap_p2p_comm_warmup_flush needs parallel.overlap_p2p_comm"
    if par.vpp is not None and not par.overlap_p2p_comm and par.pp <= 2:
        yield "an interleaved schedule without overlap_p2p_comm needs parallel.pp > 2"
    if tr.overlap_param_gather_with_optimizer_step and not (
        tr.overlap_param_gather and par.vpp is not None
    ):
        yield (
            "training.overlap_param_gather_with_optimizer_step needs "
            "training.overlap_param_gather and parallel.vpp"
        )
    yield from _check_fp8(job)
    yield from _check_fp4(job)
    yield from _check_first_last_bf16(job)
    # megatron-core overlaps the parameter all-gathers of the distributed optimizer only
    # (DistributedDataParallel.__init__); it does not need overlap_grad_reduce, which
    # Megatron-LM's arguments.py asks for and Megatron-Bridge does not.
    if tr.overlap_param_gather and not tr.distributed_optimizer:
        yield "training.overlap_param_gather needs training.distributed_optimizer"
    if tr.ddp_average_in_collective and tr.calculate_per_token_loss:
        # DistributedDataParallel.__init__ asserts it (0.16.1 and 0.19 alike)
        yield (
            "training.ddp_average_in_collective with training.calculate_per_token_loss: "
            "megatron-core's DDP refuses it (\"Cannot average in collective when calculating "
            'per-token loss!")'
        )
    yield from _check_optimizer(job)
    yield from _check_fsdp(job)
    yield from _check_recompute(job, split_ok)
    yield from _check_offload(job)
    yield from _check_cuda_graphs(job)


def _check_optimizer(job):
    """Megatron-LM's validate_args and megatron-core's optimizer/DDP assertions."""
    tr = job.training
    dp_cp = job.parallel.dp * job.parallel.cp
    n = tr.num_distributed_optimizer_instances
    if n < 1:
        yield f"training.num_distributed_optimizer_instances = {n} must be at least 1"
    elif n > 1:
        if not tr.distributed_optimizer:
            yield "training.num_distributed_optimizer_instances > 1 needs training.distributed_optimizer"
        if dp_cp % n:
            yield (
                f"dp x cp = {job.parallel.dp} x {job.parallel.cp} = {dp_cp} is not divisible by "
                f"training.num_distributed_optimizer_instances = {n}"
            )
        par = job.parallel
        grid = par.etp * par.ep * par.pp
        edp = job.cluster.num_gpus // grid
        if not job.cluster.num_gpus % grid and edp % n:
            # initialize_model_parallel asserts it (its expert groups build the instances).
            yield (
                f"expert dp = num_gpus / (etp x ep x pp) = {edp} is not divisible by "
                f"training.num_distributed_optimizer_instances = {n}"
            )
    if tr.ddp_bucket_size is not None and tr.ddp_bucket_size < 1:
        yield f"training.ddp_bucket_size = {tr.ddp_bucket_size} must be at least 1"
    low = [
        name
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
        if getattr(tr, name) != "fp32"
    ]
    if low and not tr.use_precision_aware_optimizer:
        yield (
            f"training.{low[0]} = {getattr(tr, low[0])} needs "
            "training.use_precision_aware_optimizer (Megatron-LM asserts it)"
        )
    if tr.use_precision_aware_optimizer:
        if tr.optimizer != "adam":
            yield "training.use_precision_aware_optimizer works with training.optimizer: adam only"
        if job.implementation.transformer_impl != "transformer_engine":
            yield (
                "training.use_precision_aware_optimizer needs Transformer Engine's FusedAdam "
                "(implementation.transformer_impl: transformer_engine)"
            )
        if tr.optimizer_impl != "te":
            yield (
                "training.use_precision_aware_optimizer needs Transformer Engine's FusedAdam "
                f"(training.optimizer_impl: te, not {tr.optimizer_impl})"
            )
    if tr.optimizer_impl == "torch" and job.implementation.transformer_impl == "transformer_engine":
        # megatron-core falls back to torch.optim only where TE cannot be imported
        yield (
            "training.optimizer_impl: torch means neither Transformer Engine nor Apex is "
            "installed, and implementation.transformer_impl: transformer_engine needs TE; use "
            "transformer_impl: local"
        )
    if tr.optimizer_cpu_offload:
        yield from _check_optimizer_offload(job)
    if tr.grad_reduce_in_fp32 and tr.main_grads_dtype != "fp32":
        yield "training.grad_reduce_in_fp32 contradicts training.main_grads_dtype = bf16"
    if tr.clip_grad < 0:
        yield f"training.clip_grad = {tr.clip_grad} must not be negative"


def _check_optimizer_offload(job):
    tr = job.training
    if not tr.use_precision_aware_optimizer:
        yield (
            "training.optimizer_cpu_offload needs training.use_precision_aware_optimizer "
            "(Megatron-LM asserts it)"
        )
    if not 0.0 <= tr.optimizer_offload_fraction <= 1.0:
        yield (
            f"training.optimizer_offload_fraction = {tr.optimizer_offload_fraction} must be "
            "between 0 and 1"
        )
    if tr.megatron_fsdp:
        yield (
            "training.optimizer_cpu_offload with training.megatron_fsdp is not modelled "
            "(Megatron-FSDP hands the hybrid optimizer DTensor shards, which its split sizes "
            "by their global shapes)"
        )
    if tr.fp8_param_gather:
        # distrib_optimizer._build_model_and_main_param_groups: with the offload the shards the
        # optimizer updates are the model's own, and an FP8 parameter's is None (current
        # scaling) or its 8-bit data (delayed): HybridDeviceOptimizer then fails, or updates
        # the FP8 bytes as numbers.
        yield (
            "training.optimizer_cpu_offload with training.fp8_param_gather: megatron-core 0.16.1 "
            "hands the hybrid optimizer the FP8 parameters' shards (None with current scaling) "
            "instead of high-precision ones"
        )


def _check_cuda_graphs(job):
    """What metatrace models of CUDA graphs (megatron-core's own refusals run with its
    TransformerConfig: metatrace.tracing.checks)."""
    tr = job.training
    impl, scope = tr.cuda_graph_impl, tr.cuda_graph_scope or []
    if impl == "none":
        if tr.cuda_graph_scope is not None:  # one idle_keys left: megatron-core reads it
            yield "training.cuda_graph_scope needs training.cuda_graph_impl"
        return
    what = f"training.cuda_graph_impl {impl}"
    if impl == "transformer_engine" and job.implementation.transformer_impl != "transformer_engine":
        yield f"{what} needs implementation.transformer_impl: transformer_engine"
    if tr.local_layer_graphs:
        # Without TE megatron-core keeps every capture's gradient buffers strongly referenced.
        if job.implementation.transformer_impl != "transformer_engine":
            yield (
                f"{what} per layer without implementation.transformer_impl: "
                "transformer_engine is not modelled"
            )
        if job.model.multi_latent_attention:
            yield f"{what} per layer with multi-latent attention is not modelled"
    if "full_iteration" in scope and len(scope) > 1:
        yield "training.cuda_graph_scope full_iteration goes alone"
    if "mamba" in scope and impl != "transformer_engine":
        yield f"{what} with training.cuda_graph_scope mamba is not modelled yet"
    if job.model.num_experts and impl != "transformer_engine":
        yield f"{what} with a mixture-of-experts model is not modelled yet"
    elif job.model.num_experts and not scope and tr.moe_routing != "capacity":
        # megatron-core asserts it for the moe scope only; a whole layer captures the same.
        yield (
            f"{what} over whole MoE layers needs training.moe_routing: capacity (drop-and-pad): "
            "a dropless dispatch reads its token counts on the host, which a graph cannot "
            "capture; training.cuda_graph_scope [attn, moe_router, moe_preprocess] captures "
            "the parts that can be"
        )
    if tr.activation_offload_modules:
        yield f"{what} with training.activation_offload_modules is not modelled"


def _check_fsdp(job):
    tr = job.training
    if not tr.megatron_fsdp:
        return
    if tr.fsdp_outer_sharding_strategy != "no_shard":
        yield from _check_hsdp_outer(job)
    if tr.fsdp_sharding_strategy == "no_shard":
        # MegatronFSDP keeps no model-weight buffer without sharding, and the distributed
        # optimizer's step_with_ready_grads calls start_param_sync, which gathers into it.
        yield (
            "training.fsdp_sharding_strategy no_shard: megatron-core 0.16.1's Megatron-FSDP fails "
            "at the first optimizer step (start_param_sync finds no model-weight buffer); use "
            "optim, optim_grads or optim_grads_params, or DDP (megatron_fsdp: false)"
        )
    unit = tr.fsdp_communication_unit_size
    if unit is not None and unit < 1:
        yield f"training.fsdp_communication_unit_size = {unit} must be at least 1"
    par = job.parallel
    if any(_recurrent_layers(job.model)) and par.tp > 1 and not release_since(0, 19):
        # MambaMixer and GatedDeltaNet mark conv1d, dt_bias, A_log (and more) tensor-parallel
        # with no partition_dim; megatron_fsdp's make_fsdp_dtensor reads param.partition_dim of
        # every tensor-parallel parameter (utils.py get_mcore_tensor_parallel_partition_dim).
        # 0.19 sets the attribute and reads it with a default.
        yield (
            f"training.megatron_fsdp with Mamba-2 or Gated DeltaNet layers at parallel.tp = "
            f"{par.tp}: megatron-core 0.16.1's Megatron-FSDP fails while making its DTensors "
            "(those layers mark conv1d, dt_bias and A_log tensor-parallel without the "
            "partition_dim it reads: AttributeError); use tp 1, or megatron-core 0.19"
        )
    if par.pp > 1:
        # mcore_fsdp_adapter._get_dp_tp_mesh rearranges torch.arange(world_size) as
        # "(dp_cp ep tp)": the world must be dp x cp x ep x tp, with no pipeline stages.
        yield (
            f"training.megatron_fsdp with parallel.pp = {par.pp}: megatron-core's (0.16.1 and "
            "0.19) Megatron-FSDP fails while building its device mesh (it lays the whole world out "
            "as dp x cp x ep x tp, without pipeline stages); use pp 1"
        )
    if tr.precision == "fp8" and tr.fp8_param_gather and tr.fp8_recipe == "mxfp8":
        # TE 2.8's cast_master_weights_to_fp8 raises NotImplementedError for MXFP8.
        yield (
            "training.fp8_param_gather with training.megatron_fsdp and fp8_recipe mxfp8 fails "
            "at the first optimizer step (Transformer Engine 2.8 cannot cast main weights to "
            "MXFP8 shards); use delayed or tensorwise, or fp8_param_gather: false"
        )
    elif tr.precision == "fp8" and tr.fp8_param_gather and tr.fp8_recipe == "blockwise":
        yield (
            "training.fp8_param_gather with training.megatron_fsdp and fp8_recipe blockwise is "
            "not modelled yet (Megatron-FSDP's blockwise buffers); delayed and tensorwise are"
        )


def _check_hsdp_outer(job):
    """--outer-dp-sharding-strategy optim: where megatron-core 0.16.1 itself fails with it."""
    tr = job.training
    what = f"training.fsdp_outer_sharding_strategy {tr.fsdp_outer_sharding_strategy}"
    if tr.num_distributed_optimizer_instances < 2:
        # FullyShardedDataParallel._init_dist_index builds no outer group and ParamAndGradBuffer
        # no hybrid buffers, yet the all-gather and reduce pipelines' get_fsdp_buffer return
        # hsdp_wbuf / hsdp_gbuf whenever the strategy is not no_shard.
        yield (
            f"{what} needs hybrid sharding (training.num_distributed_optimizer_instances > 1): "
            "without it megatron-core 0.16.1's Megatron-FSDP keeps no buffers sharded across "
            "instances and fails at its first all-gather (it looks for them all the same)"
        )
    if tr.fsdp_sharding_strategy in ("optim", "optim_grads"):
        # _init_each_parameter_group_buffers: the unsharded model-weight buffer's data is a
        # slice of the hybrid weight buffer, which is sharded over the instance.
        yield (
            f"{what} needs training.fsdp_sharding_strategy optim_grads_params: with "
            f"{tr.fsdp_sharding_strategy} megatron-core 0.16.1 fails while building Megatron-FSDP's "
            "buffers (its whole model-weight buffer does not fit in its slice of the buffer "
            "sharded within the instance: Data size mismatch)"
        )
    if job.model.num_experts:
        # The expert parameters' buffers are sharded over the expert data-parallel group alone
        # (FSDPDistributedIndex.get_dp_group(is_expert_parallel=True)), yet placed at the
        # hybrid rank's offset in the hybrid buffer: out of range on outer ranks >= 1.
        yield (
            f"{what} with a mixture-of-experts model: megatron-core 0.16.1 fails while building "
            "Megatron-FSDP's buffers on the ranks of every instance but the first (the experts' "
            "buffers are sharded within the instance only and their slice of the hybrid buffer "
            "is out of range: Data size mismatch); use no_shard"
        )


def _check_fp8(job):
    tr = job.training
    if tr.fp8_amax_history_len < 1:
        yield f"training.fp8_amax_history_len must be at least 1, got {tr.fp8_amax_history_len}"
    if tr.precision != "fp8":
        if tr.fp8_param_gather:
            yield "training.fp8_param_gather applies with training.precision: fp8 only"
        return
    if job.implementation.transformer_impl != "transformer_engine":
        yield "training.precision fp8 needs implementation.transformer_impl: transformer_engine"
    arch = GPU_ARCH.get(job.cluster.gpu)
    if arch == "sm80":
        yield f"training.precision fp8 needs an FP8 GPU (Ada, Hopper, Blackwell); {job.cluster.gpu} has none"
    elif arch is None or not arch.startswith("sm"):
        yield f"training.precision fp8 is not modelled on cluster.gpu {job.cluster.gpu!r}"
    elif tr.fp8_recipe == "mxfp8" and arch != "sm100":
        yield f"training.fp8_recipe mxfp8 needs a Blackwell GPU (b200, gb200, b300, gb300), not {job.cluster.gpu}"
    if tr.fp8_param_gather and not tr.distributed_optimizer:
        yield "training.fp8_param_gather needs training.distributed_optimizer"


def _check_fp4(job):
    """NVFP4 (Transformer Engine's NVFP4BlockScaling through megatron-core's fp4 options)."""
    tr = job.training
    if tr.precision != "fp4":
        return
    if job.implementation.transformer_impl != "transformer_engine":
        yield "training.precision fp4 needs implementation.transformer_impl: transformer_engine"
    if job.cluster.gpu not in GPU_FP4_TFLOPS:
        # TE 2.8 fp8.py:57-61 check_nvfp4_support: compute capability 10.0 or higher
        yield (
            "training.precision fp4 (NVFP4) needs a Blackwell GPU (compute capability 10.0: "
            f"{', '.join(GPU_FP4_TFLOPS)}), not {job.cluster.gpu}"
        )
    if job.parallel.tp_comm_overlap:
        yield (
            "parallel.tp_comm_overlap with training.precision fp4 is not modelled yet "
            "(Transformer Engine's userbuffers with NVFP4 data and scales)"
        )
    if job.implementation.te_op_fuser:
        yield (
            "implementation.te_op_fuser with training.precision fp4 is not modelled yet "
            "(the op fuser's NVFP4 path); leave te_op_fuser off"
        )
    if job.cluster.compute_efficiency is not None:
        yield (
            "cluster.compute_efficiency with training.precision fp4 is not modelled yet (the "
            "flat-rate time model has bf16 and FP8 rates only); leave it unset to time each "
            "kernel at its modelled rate, FP4 GEMMs at the GPU's FP4 peak"
        )
    yield from _check_fp4_dims(job)


def _check_fp4_dims(job):
    """Transformer Engine 2.8 quantizes to NVFP4 only tensors whose rows and columns are both
    multiples of 16 (NVFP4Quantizer::create_tensor, csrc/quantizer.cpp:1186-1191, and
    NVFP4Quantizer.is_quantizable): there is no bf16 fallback, the layer fails. The rows are a
    rank's tokens (its sequence share times the micro-batch, over tp too with sequence
    parallelism, where the local rows are quantized before the all-gather); the columns the
    linear layers' widths on a tensor-parallel rank."""
    m, par, tr = job.model, job.parallel, job.training
    if tr.seq_length is None or m.hidden_size is None:
        return
    rows = tr.seq_length // par.cp * tr.micro_batch_size
    if par.sequence_parallel:
        rows //= par.tp
    how = "seq_length / cp x micro_batch_size" + (" / tp" if par.sequence_parallel else "")
    if rows % 16:
        yield (
            f"training.precision fp4: {how} = {rows} tokens per rank; Transformer Engine "
            "quantizes to NVFP4 only row counts that are multiples of 16"
        )
    widths = {"model.hidden_size": m.hidden_size}
    if m.ffn_hidden_size is not None and not m.num_experts:
        widths["model.ffn_hidden_size / tp"] = m.ffn_hidden_size // par.tp
    if m.num_experts and m.moe_ffn_hidden_size is not None:
        widths["model.moe_ffn_hidden_size / etp"] = m.moe_ffn_hidden_size // par.etp
    if not m.multi_latent_attention and m.num_attention_heads:
        kv = m.kv_channels or m.hidden_size // m.num_attention_heads
        groups = m.num_query_groups or m.num_attention_heads
        widths["model.num_attention_heads x kv_channels / tp"] = (
            m.num_attention_heads * kv // par.tp
        )
        widths["model.num_query_groups x kv_channels / tp"] = groups * kv // par.tp
    for name, width in widths.items():
        if width % 16:
            yield (
                f"training.precision fp4: {name} = {width}; Transformer Engine quantizes to "
                "NVFP4 only widths that are multiples of 16"
            )


def _check_first_last_bf16(job):
    """--first-last-layers-bf16 (megatron-core transformer_config.py:988-1016)."""
    tr = job.training
    names = ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
    if not tr.first_last_layers_bf16:
        return
    if tr.precision == "fp8" and tr.fp8_recipe == "delayed":
        yield (
            "training.first_last_layers_bf16 with fp8_recipe delayed: megatron-core refuses it "
            "(delayed scaling does not support first / last layers in bf16)"
        )
    if tr.precision == "fp8" and tr.fp8_param_gather:
        yield (
            "training.first_last_layers_bf16 with training.fp8_param_gather is not modelled yet "
            "(the bf16 layers' weights are built outside fp8_model_init)"
        )
    most = (job.model.num_layers or 0) // job.parallel.pp
    for name in names:
        n = getattr(tr, name)
        if n < 0 or n > most:
            yield (
                f"training.{name} = {n} must be between 0 and the layers per pipeline stage "
                f"(model.num_layers // parallel.pp = {most}; megatron-core refuses it otherwise)"
            )


def _check_recompute(job, split_ok: bool):
    rec = job.training.recompute
    if rec.granularity is None:
        # what idle_keys left: Megatron-LM asserts distribute_saved_activations' granularity,
        # and TransformerConfig a method and layer count under the EP overlap whatever it is
        keys = (*_RECOMPUTE_LAYERS, "training.recompute.distribute_saved_activations")
        given = _given(job, keys)
        if given:
            yield f"{_need(given)} training.recompute.granularity"
        return
    if rec.granularity == "full":
        if rec.method is None or rec.num_layers is None:
            yield "full recompute needs training.recompute.method and training.recompute.num_layers"
        elif rec.num_layers < 1:
            yield f"training.recompute.num_layers = {rec.num_layers} must be at least 1"
        if split_ok and rec.method == "uniform" and rec.num_layers and rec.num_layers >= 1:
            counts = sorted({n for n in chunk_layer_counts(job) if n % rec.num_layers})
            if counts:
                yield (
                    f"full uniform recompute checkpoints groups of training.recompute.num_layers "
                    f"= {rec.num_layers} layers, which must divide the layers of every model "
                    f"chunk ({', '.join(map(str, counts))} on some); megatron-core would index "
                    "past the chunk's last layer"
                )
    else:
        if rec.method is not None or rec.num_layers is not None:
            yield "selective recompute takes no training.recompute.method or num_layers"
        for name in rec.modules or ():
            if name in MOE_RECOMPUTE_MODULES:
                if job.model.num_experts is None:
                    yield f"training.recompute.modules: {name!r} needs mixture-of-experts layers"
            elif name in MLA_RECOMPUTE_MODULES:
                if not job.model.multi_latent_attention:
                    yield f"training.recompute.modules: {name!r} needs model.multi_latent_attention"
            elif name not in DENSE_RECOMPUTE_MODULES:
                known = DENSE_RECOMPUTE_MODULES + MOE_RECOMPUTE_MODULES + MLA_RECOMPUTE_MODULES
                yield (
                    f"training.recompute.modules: unknown module {name!r} "
                    f"(known: {', '.join(known)})"
                )
        if "mlp" in (rec.modules or ()) and job.model.add_bias_linear:
            # megatron-core 0.16.1 checkpoints the MLP, which returns its fc2 bias parameter
            # alongside the output; autograd then makes the checkpoint's backward that
            # parameter's grad_fn, and backward re-enters it without end (reproduced with real
            # CPU tensors, tests/tracing/test_trace.py).
            yield (
                "selective recompute of 'mlp' with model.add_bias_linear: megatron-core 0.16.1's "
                "backward recurses without end in this combination; drop 'mlp' from "
                "training.recompute.modules or set model.add_bias_linear: false"
            )
    if rec.distribute_saved_activations:
        if job.parallel.tp == 1 or rec.granularity != "full":
            yield "distribute_saved_activations needs parallel.tp > 1 and full recompute"
        if job.parallel.sequence_parallel:
            yield "distribute_saved_activations cannot be combined with sequence parallel"


# Micro-batches per iteration: the replayed iteration keeps some 40 memory events per
# micro-batch and stage (tracing/steady.py), so a million is about a minute; real jobs run
# hundreds to a few thousand.
MAX_MICROBATCHES = 1_000_000
_MAX_GPU_GIB = 1 << 20  # far beyond any GPU (192-288 GiB in 2026); keeps bytes in range


def _check_cluster(job):
    cl = job.cluster
    if not 0 < cl.gpu_memory_gib <= _MAX_GPU_GIB:
        yield (
            f"cluster.gpu_memory_gib = {cl.gpu_memory_gib:g} must be more than 0 and at most "
            f"{_MAX_GPU_GIB:,} (1 PiB)"
        )
    if not 0 <= cl.reserved_overhead_gib <= _MAX_GPU_GIB:
        yield (
            f"cluster.reserved_overhead_gib = {cl.reserved_overhead_gib:g} must be at least 0 "
            f"and at most {_MAX_GPU_GIB:,}"
        )
    if cl.nccl_buffsize is not None and not 0 < cl.nccl_buffsize <= 1 << 40:
        yield f"cluster.nccl_buffsize = {cl.nccl_buffsize} must be more than 0 bytes"
    if cl.nccl_channels is not None and not 1 <= cl.nccl_channels <= 64:
        yield (
            f"cluster.nccl_channels = {cl.nccl_channels} must be between 1 and 64 (NCCL's "
            "MAXCHANNELS)"
        )
    for key in ("context_gib", "nccl_gib"):
        value = getattr(cl, key)
        if value is not None and not 0 <= value <= _MAX_GPU_GIB:
            yield f"cluster.{key} = {value:g} must be at least 0 and at most {_MAX_GPU_GIB:,}"
    if cl.allocator_conf is not None:
        from metatrace.config.allocator import parse_alloc_conf
        from metatrace.errors import ConfigError

        try:
            parse_alloc_conf(cl.allocator_conf)
        except ConfigError as e:
            yield f"cluster.allocator_conf: {e.problems[0]}"
    if cl.num_gpus > cl.gpus_per_node and cl.num_gpus % cl.gpus_per_node:
        yield (
            f"cluster.num_gpus = {cl.num_gpus} is not a whole number of nodes of "
            f"cluster.gpus_per_node = {cl.gpus_per_node}: torchrun starts as many on every "
            "node; give the GPUs per node the job uses (the groups' placement on nodes decides "
            "which links they use)"
        )
    efficiency = cl.compute_efficiency
    if efficiency is not None and not 0 < efficiency <= 1:
        yield (
            f"cluster.compute_efficiency = {efficiency} must be more than 0 and at most 1 (the "
            "fraction of the GPU's peak FLOP/s the time model assumes)"
        )


def _check_impl(job):
    impl = job.implementation
    if impl.transformer_impl != "local" and impl.attention_backend == "local":
        yield (
            "implementation.attention_backend: local turns every Transformer Engine attention "
            "backend off, and Transformer Engine then refuses to run; use auto, fused, flash or "
            "unfused with transformer_impl: transformer_engine, or transformer_impl: local"
        )
    yield from _check_te_op_fuser(job)


# Activations megatron-core 0.16.1's TEFusedMLP has a Transformer Engine op for (GELU, GEGLU,
# SiLU (TE >= 2.8), SwiGLU, ReLU; ReGLU has no metatrace name).
TE_OP_FUSER_ACTIVATIONS = ("gelu", "geglu", "silu", "swiglu", "relu")


def _check_te_op_fuser(job):
    """implementation.te_op_fuser: what megatron-core 0.16.1's TEFusedMLP and Transformer
    Engine 2.8's operation fuser refuse (both would fail in the first forward)."""
    impl, tr, par = job.implementation, job.training, job.parallel
    if not impl.te_op_fuser:
        return
    if impl.transformer_impl != "transformer_engine":
        yield (
            "implementation.te_op_fuser needs implementation.transformer_impl: "
            "transformer_engine (TEFusedMLP runs Transformer Engine's operation fuser over TE's "
            "LayerNormLinear and Linear, and raises ValueError on the local spec's linears)"
        )
    if job.model.activation not in TE_OP_FUSER_ACTIVATIONS:
        yield (
            f"implementation.te_op_fuser does not support model.activation "
            f"{job.model.activation}: TEFusedMLP has Transformer Engine ops for "
            f"{', '.join(TE_OP_FUSER_ACTIVATIONS)} only (NotImplementedError)"
        )
    blockwise = tr.precision == "fp8" and tr.fp8_recipe == "blockwise"
    if blockwise and par.tp > 1 and par.sequence_parallel:
        # TE 2.8: the norm op quantizes with fc1's input quantizer, whose all_gather_usage
        # BasicLinear never sets (GEMM-ready layout); _all_gather_fp8_blockwise then raises.
        yield (
            "implementation.te_op_fuser with training.fp8_recipe blockwise and "
            "parallel.sequence_parallel fails in Transformer Engine 2.8: the fuser's FP8 "
            "all-gather of fc1's input needs block scales in the compact layout, which its "
            "norm op does not write (RuntimeError); use another recipe or no sequence parallel"
        )


# Keys that only mixture-of-experts layers read.
_MOE_KEYS = (
    "model.moe_router_topk",
    "model.moe_layer_freq",
    "model.moe_router_score_function",
    "model.moe_router_pre_softmax",
    "model.moe_router_load_balancing_type",
    "model.moe_aux_loss_coeff",
    "model.moe_z_loss_coeff",
    "training.moe_router_dtype",
    "model.moe_shared_expert_intermediate_size",
    "model.moe_shared_expert_gate",
    "model.moe_ffn_hidden_size",
    "model.moe_router_num_groups",
    "model.moe_router_group_topk",
    "model.moe_router_topk_scaling_factor",
    "model.moe_router_enable_expert_bias",
    "model.moe_latent_size",
    "implementation.moe_grouped_gemm",
    "implementation.moe_permute_fusion",
    "implementation.moe_router_fusion",
    "training.moe_routing",
    "training.moe_expert_capacity_factor",
    "training.moe_hottest_expert_load",
    "training.moe_router_padding_for_quantization",
    "parallel.moe_token_dispatcher_type",
    "parallel.moe_shared_expert_overlap",
    "parallel.moe_flex_dispatcher_backend",
    "parallel.moe_deepep_num_sms",
    "parallel.moe_hybridep_num_sms",
    "parallel.overlap_moe_expert_parallel_comm",
    "parallel.delay_wgrad_compute",
)


def _given(job, paths) -> list[str]:
    """The `section.key` (or `section.sub.key`) paths of `paths` whose value is not the key's
    default."""
    out = []
    for path in paths:
        *sections, key = path.split(".")
        values = functools.reduce(getattr, sections, job)
        if getattr(values, key) != key_default(type(values), key):
            out.append(path)
    return out


_FP8_KEYS = ("training.fp8_format", "training.fp8_recipe")
_CAPACITY_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
"""Load balancing megatron-core's TransformerConfig takes a capacity factor with."""
_RECOMPUTE_LAYERS = ("training.recompute.method", "training.recompute.num_layers")
# Keys of mixture-of-experts layers that megatron-core's TransformerConfig (or 0.19's
# Megatron-LM) refuses on a dense model: not idle there (checks refuse them).
MOE_REFUSED_DENSE = (
    "model.moe_ffn_hidden_size",  # asserted None without experts
    "model.moe_router_group_topk",  # needs moe_router_num_groups, then num_experts
    "model.moe_router_enable_expert_bias",  # needs the sigmoid score function
    "model.moe_latent_size",  # 0.19's validate_args: MoE models only
    "training.moe_router_padding_for_quantization",  # needs FP8/FP4 and alltoall/flex
    "parallel.overlap_moe_expert_parallel_comm",  # asserts ep > 1
    "parallel.delay_wgrad_compute",  # needs the EP overlap
)
UB_OPTIONS = (
    "tp_comm_overlap_ag",
    "tp_comm_overlap_rs",
    "tp_comm_overlap_rs_dgrad",
    "tp_comm_bulk_dgrad",
    "tp_comm_bulk_wgrad",
    "tp_comm_overlap_cfg",
)
"""Parallel's keys for Transformer Engine's userbuffers: they act with tp_comm_overlap only."""


def idle_keys(job) -> list[tuple[list[str], str]]:
    """(keys, the setting they act with) for the keys `job` sets that act only with a setting it
    does not have: MoE keys on a dense model, FP8 keys without FP8, MLA keys without MLA, ...
    Such a key cannot change memory, traffic or time, and Megatron-LM ignores the flag it
    stands for (megatron-core reads it only behind that setting), so resolve() describes the
    job without it and says so. Where megatron-core or Megatron-LM refuse the combination the
    key is not idle: check_job reports what is left of these keys as a refusal."""
    m, par, tr = job.model, job.parallel, job.training
    rec = tr.recompute
    mamba, gdn = _recurrent_layers(m)
    out = []

    def idle(keys, absent: bool, parent: str) -> None:
        given = _given(job, keys) if absent else []
        if given:
            out.append((given, parent))

    refused = set(MOE_REFUSED_DENSE)
    if tr.moe_routing == "capacity" and tr.moe_expert_capacity_factor is None:
        refused.add("training.moe_routing")  # TransformerConfig: padding needs a capacity factor
    if m.moe_router_score_function == "sigmoid":
        refused.discard("model.moe_router_enable_expert_bias")
    softmax_after = m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax
    if m.moe_router_topk == 1 and softmax_after and m.moe_router_load_balancing_type != "sinkhorn":
        refused.add("model.moe_router_topk")  # TransformerConfig: top-1 needs pre-softmax
    if m.moe_router_load_balancing_type not in _CAPACITY_BALANCING:
        refused.add("training.moe_expert_capacity_factor")  # TransformerConfig refuses it
    moe = [k for k in _MOE_KEYS if k not in refused]
    idle(moe, m.num_experts is None, "mixture-of-experts layers (model.num_experts)")
    # Read behind use_shared_expert only; TransformerConfig refuses the overlap with the EP
    # overlap and MoELayer with a latent projection, shared experts or not.
    unshared = m.num_experts is not None and m.moe_shared_expert_intermediate_size is None
    overlap = ("parallel.moe_shared_expert_overlap",)
    if par.overlap_moe_expert_parallel_comm or m.moe_latent_size is not None:
        overlap = ()
    idle(
        (*overlap, "model.moe_shared_expert_gate"),
        unshared,
        "shared experts (model.moe_shared_expert_intermediate_size)",
    )
    # every expert's input is padded to its capacity: no hottest expert
    padded = m.num_experts is not None and tr.moe_routing == "capacity"
    idle(("training.moe_hottest_expert_load",), padded, "balanced routing")
    idle(
        _FLEX_KEYS,
        par.moe_token_dispatcher_type != "flex",
        "parallel.moe_token_dispatcher_type flex",
    )
    # MLATransformerConfig's own fields: Megatron-LM drops them without MLA. 0.19's Megatron-LM
    # asserts --mla-down-proj-fusion's.
    mla = [k for k in _MLA_KEYS if k != "model.mla_down_proj_fusion"]
    if m.position_embedding_type == "yarn":  # GPTModel's YarnRotaryEmbedding reads these
        mla = [k for k in mla if k.removeprefix("model.") not in YARN_KEYS]
    idle(mla, not m.multi_latent_attention, "model.multi_latent_attention")
    local = job.implementation.transformer_impl == "local"
    idle(
        ("model.mla_down_proj_fusion",),
        m.multi_latent_attention and local,
        "implementation.transformer_impl transformer_engine",
    )
    heads = ("model.mamba_num_heads",) if not m.hybrid_layer_pattern else ()
    idle(_MAMBA_KEYS + heads, not mamba, "Mamba-2 layers (M in model.hybrid_layer_pattern)")
    idle(
        _GDN_KEYS,
        not gdn,
        "Gated DeltaNet layers (model.linear_attention_freq, or G in model.hybrid_layer_pattern)",
    )
    # Transformer Engine gets the hierarchical groups for a2a+p2p only; Megatron-LM asserts
    # their product is cp whatever the communication.
    sizes = par.hierarchical_cp_sizes
    flat_cp = par.cp_comm_type != "a2a+p2p" and sizes is not None and math.prod(sizes) == par.cp
    idle(("parallel.hierarchical_cp_sizes",), flat_cp, "parallel.cp_comm_type a2a+p2p")
    # megatron-core's local spec has only its own unfused attention (flash-attn for inference
    # only); the backend sets Transformer Engine's environment, which nothing then reads.
    kernel = job.implementation.attention_backend in ("flash", "fused")
    idle(
        ("implementation.attention_backend",),
        local and kernel,
        "implementation.transformer_impl transformer_engine",
    )
    # The hybrid stack's attention spec has no query/key norms (IdentityOp).
    hybrid_norms = bool(m.hybrid_layer_pattern) and m.qk_layernorm is True
    idle(("model.qk_layernorm",), hybrid_norms, "a GPT model's attention")
    idle(_FP8_KEYS, tr.precision != "fp8", "training.precision fp8")
    delayed = tr.precision == "fp8" and tr.fp8_recipe in (None, "delayed")
    idle(
        ("training.fp8_amax_history_len",),
        not delayed,
        "training.precision fp8 with fp8_recipe delayed",
    )
    idle(("training.fp4_recipe",), tr.precision != "fp4", "training.precision fp4")
    low = tr.precision not in ("fp8", "fp4")
    idle(("training.first_last_layers_bf16",), low, "training.precision fp8 or fp4")
    idle(
        ("training.num_layers_at_start_in_bf16", "training.num_layers_at_end_in_bf16"),
        low or not tr.first_last_layers_bf16,
        "training.first_last_layers_bf16",
    )
    idle(("model.mtp_use_repeated_layer",), m.mtp_num_layers is None, "model.mtp_num_layers")
    idle(("model.window_attn_skip_freq",), m.window_size is None, "model.window_size")
    # TransformerConfig refuses an offset under the fused bias-activation kernels whatever the
    # activation; without them only a gated activation reads it.
    idle(
        ("model.activation_func_clamp_value",)
        + (("model.glu_linear_offset",) if not job.bias_activation_fusion else ()),
        m.activation not in GATED_ACTIVATIONS,
        "a gated activation (model.activation swiglu, geglu, quick_geglu)",
    )
    # A scope acts without an implementation where megatron-core reads it unguarded: 0.19
    # migrates full_iteration to cuda_graph_impl, and the MoE layer's own scopes change its
    # recompute and its EP overlap; the rest are read only with graphs.
    scope = set(tr.cuda_graph_scope or ()) <= {"attn", "mlp", "mamba"}
    idle(
        ("training.cuda_graph_scope",),
        tr.cuda_graph_impl == "none" and (scope or m.num_experts is None),
        "training.cuda_graph_impl",
    )
    idle(
        tuple(
            f"training.{k}"
            for k in (
                "fsdp_outer_sharding_strategy",
                "fsdp_double_buffer",
                "fsdp_communication_unit_size",
                *FSDP_DTYPES,
            )
        ),
        not tr.megatron_fsdp,
        "training.megatron_fsdp",
    )
    idle(
        tuple(f"training.{k}" for k in ("min_offloaded_tensor_size", *OFFLOAD_KNOBS)),
        not tr.activation_offload_modules,
        "training.activation_offload_modules",
    )
    idle(
        tuple(f"parallel.{k}" for k in UB_OPTIONS),
        not par.tp_comm_overlap,
        "parallel.tp_comm_overlap",
    )
    idle(
        ("training.optimizer_offload_fraction", "training.overlap_cpu_optimizer_d2h_h2d"),
        not tr.optimizer_cpu_offload,
        "training.optimizer_cpu_offload",
    )
    # Megatron-LM turns overlap_p2p_comm off without virtual stages (with a warning); only the
    # interleaved schedule reads the group size.
    flat = par.vpp in (None, 1) and par.layout is None
    overlap = ("parallel.overlap_p2p_comm",) if par.overlap_p2p_comm else ()
    idle(("parallel.microbatch_group_size", *overlap), flat, "parallel.vpp")
    # TransformerConfig reads the recompute keys behind the granularity, but asserts no method
    # and layer count under the EP overlap whatever it is.
    idle(
        ("training.recompute.modules",)
        + (() if par.overlap_moe_expert_parallel_comm else _RECOMPUTE_LAYERS),
        rec.granularity is None,
        "training.recompute.granularity",
    )
    idle(("training.recompute.modules",), rec.granularity == "full", "selective recompute")
    return out


def idle_modules(job) -> tuple[list[str], str] | None:
    """(entries, the setting they act with) of training.recompute.modules that act only with
    layers the model does not have: megatron-core reads 'moe' and 'shared_experts' in its MoE
    layer only (moe_layer.py, shared_experts.py), and its TransformerConfig checks neither
    ('moe_act' only without grouped GEMMs, 'mla_up_proj' without MLA: those stay refused)."""
    modules = job.training.recompute.modules or []
    # TransformerConfig accepts 'moe_act' with grouped GEMMs, experts or not
    grouped = ("moe_act",) if job.implementation.moe_grouped_gemm else ()
    idle = [name for name in modules if name in ("moe", "shared_experts", *grouped)]
    if job.model.num_experts is None and idle:
        return idle, "mixture-of-experts layers (model.num_experts)"
    return None


def _need(paths: list[str]) -> str:
    """The subject and verb of a message about the keys `paths`: "a needs", "a, b need"."""
    return f"{', '.join(paths)} {'needs' if len(paths) == 1 else 'need'}"


def _recurrent_layers(m) -> tuple[bool, bool]:
    """Whether model `m` has Mamba-2 layers, and Gated DeltaNet layers."""
    pattern = m.hybrid_layer_pattern or ""
    return MAMBA in pattern, GDN in pattern or m.linear_attention_freq is not None


@functools.cache
def key_default(cls, key: str):
    """The default of field `key` of the dataclass `cls` (a job section)."""
    import dataclasses

    return next(f.default for f in dataclasses.fields(cls) if f.name == key)


_FLEX_KEYS = (
    "parallel.moe_flex_dispatcher_backend",
    "parallel.moe_deepep_num_sms",
    "parallel.moe_hybridep_num_sms",
)
# DeepEP's recommended configs by group size (deep_ep 1.0.0 buffer.py:166-178): up to 8 ranks
# (one NVLink domain), else only these, asserted by Buffer.get_dispatch_config.
_DEEPEP_RANKS = (16, 24, 32, 64, 128, 144, 160)


def _check_flex(job):
    """What megatron-core 0.16.1 and DeepEP assert about the flex token dispatcher."""
    par, tr = job.parallel, job.training
    group = par.ep * par.etp  # the dispatcher's TP x EP group (expert tensor parallelism)
    if group == 1:  # token_dispatcher.py:1346
        yield "parallel.moe_token_dispatcher_type: flex needs parallel.ep x etp > 1"
    if par.moe_shared_expert_overlap:  # transformer_config.py:1090, token_dispatcher.py:1371
        yield "parallel.moe_shared_expert_overlap works only with moe_token_dispatcher_type: alltoall"
    if par.moe_flex_dispatcher_backend != "deepep":
        if par.moe_hybridep_num_sms < 1:
            yield f"parallel.moe_hybridep_num_sms = {par.moe_hybridep_num_sms} must be at least 1"
        return
    if tr.moe_routing == "capacity":  # transformer_config.py:1074-1081
        yield (
            "training.moe_routing: capacity (moe_pad_expert_input_to_capacity) is refused by "
            "megatron-core with the flex dispatcher's deepep backend"
        )
    if tr.precision not in ("bf16", "fp8", "fp4"):  # deep_ep buffer.py:255: x must be bfloat16
        yield f"DeepEP dispatches bf16 tokens only; training.precision is {tr.precision}"
    if group > 8 and group not in _DEEPEP_RANKS:
        yield (
            f"DeepEP has no configuration for {group} ranks (ep x etp); it supports up to 8 or "
            f"{', '.join(map(str, _DEEPEP_RANKS))}"
        )
    if par.moe_deepep_num_sms < 2 or par.moe_deepep_num_sms % 2:
        yield (
            f"parallel.moe_deepep_num_sms = {par.moe_deepep_num_sms} must be a positive even "
            "number (DeepEP runs one channel per two SMs)"
        )


def _check_moe(job):
    m, par, tr, impl = job.model, job.parallel, job.training, job.implementation
    if m.num_experts is None:
        given = _given(job, _MOE_KEYS)  # what idle_keys left: megatron-core refuses these
        if given:
            yield f"{_need(given)} mixture-of-experts layers (model.num_experts)"
        return
    if par.tp > 1 and not par.sequence_parallel:
        # megatron-core's MoELayer.forward raises this in training.
        yield (
            "mixture-of-experts layers with parallel.tp > 1 need parallel.sequence_parallel "
            "(megatron-core refuses to train without it)"
        )
    if m.num_experts % par.ep:
        yield f"model.num_experts = {m.num_experts} is not divisible by parallel.ep = {par.ep}"
    if not 1 <= m.moe_router_topk <= m.num_experts:
        yield (
            f"model.moe_router_topk = {m.moe_router_topk} must be between 1 and "
            f"model.num_experts = {m.num_experts}"
        )
    if par.moe_token_dispatcher_type == "flex":
        yield from _check_flex(job)
    if impl.moe_grouped_gemm and impl.transformer_impl == "local":
        yield (
            "implementation.moe_grouped_gemm with transformer_impl: local is megatron-core's "
            "legacy GroupedMLP (the grouped_gemm package), which is not modelled; use "
            "transformer_impl: transformer_engine"
        )
    factor = tr.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        yield f"training.moe_expert_capacity_factor = {factor:g} must be positive"
    if tr.moe_routing == "capacity" and factor is None:
        yield "training.moe_routing: capacity needs training.moe_expert_capacity_factor"
    load = tr.moe_hottest_expert_load
    if load is not None and load < 1:
        yield (
            f"training.moe_hottest_expert_load = {load:g} must be at least 1 (the hottest "
            "expert's multiple of the balanced share)"
        )
    elif load is not None and tr.moe_routing == "random":
        yield (
            "training.moe_hottest_expert_load applies to balanced routing; moe_routing: random "
            "derives the hottest expert's load from the routing (give one of them)"
        )
    if par.moe_shared_expert_overlap and not m.moe_shared_expert_intermediate_size:
        yield "parallel.moe_shared_expert_overlap needs model.moe_shared_expert_intermediate_size"
    if tr.moe_router_padding_for_quantization:
        yield from _check_router_padding(job)
    if impl.moe_router_fusion and tr.moe_router_dtype == "fp64":
        # transformer_engine/pytorch/router.py, fused_topk_with_score_function
        yield (
            "implementation.moe_router_fusion with training.moe_router_dtype: fp64 is refused "
            "by Transformer Engine's fused router (no float64 kernel)"
        )


def _check_router_padding(job):
    """What megatron-core 0.16.1 refuses with moe_router_padding_for_quantization
    (transformer_config.py:1621-1631): no FP8 or FP4, the allgather dispatcher."""
    name = "training.moe_router_padding_for_quantization"
    if job.training.precision not in ("fp8", "fp4"):
        yield (
            f"{name} pads for FP8 or FP4 GEMMs and needs training.precision: fp8 or fp4 "
            f"(megatron-core refuses it with {job.training.precision})"
        )
    if job.parallel.moe_token_dispatcher_type == "allgather":
        yield (
            f"{name} needs parallel.moe_token_dispatcher_type alltoall or flex (megatron-core "
            "refuses it with the allgather dispatcher)"
        )


# YaRN keys: MLA's rotary embedding, or position_embedding_type yarn.
YARN_KEYS = (
    "rotary_scaling_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)


def _check_ep_overlap(job):
    """megatron-core 0.16.1's asserts for the combined 1F1B schedule and delayed weight gradients
    (transformer_config.py:1852-1921), then what metatrace does not model beside them."""
    m, par, tr = job.model, job.parallel, job.training
    rc = tr.recompute
    name = "parallel.overlap_moe_expert_parallel_comm"
    if par.delay_wgrad_compute and not par.overlap_moe_expert_parallel_comm:
        yield f"parallel.delay_wgrad_compute needs {name} (megatron-core's assert)"
    if not par.overlap_moe_expert_parallel_comm or m.num_experts is None:
        return
    if par.pp > 1 and par.vpp is None:
        yield f"{name} with parallel.pp > 1 needs virtual pipeline stages (parallel.vpp)"
    if par.ep < 2:
        yield f"{name} needs expert parallelism (parallel.ep > 1)"
    if par.moe_token_dispatcher_type not in ("alltoall", "flex"):
        yield f"{name} needs parallel.moe_token_dispatcher_type alltoall (or flex)"
    if rc.granularity == "full" or rc.method is not None or rc.num_layers is not None:
        yield f"{name} needs no full recompute (recompute.granularity/method/num_layers unset)"
    if tr.precision == "fp32":
        yield f"{name} needs bf16 or fp16 (training.precision)"
    if par.moe_shared_expert_overlap:
        yield f"{name} and parallel.moe_shared_expert_overlap exclude each other"
    if m.mtp_num_layers not in (None, 1):
        yield f"{name} supports model.mtp_num_layers 1 only"
    elif m.mtp_num_layers == 1 and par.pp == 1:
        yield f"{name} with model.mtp_num_layers needs parallel.pp > 1"
    # Not modelled beside it: the combined schedule's replay (tracing/iteration.py) has no
    # CUDA-graph captures nor offload slots in its combined steps.
    if tr.cuda_graph_impl != "none":
        yield f"{name} with training.cuda_graph_impl is not modelled"
    if tr.activation_offload_modules or tr.cpu_offloading_num_layers:
        yield f"{name} with activation offloading is not modelled"


_MLA_KEYS = tuple(
    f"model.{k}"
    for k in (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
        "v_head_dim",
        "mla_down_proj_fusion",
        *YARN_KEYS,
    )
)


def _check_mla(job):
    m, par = job.model, job.parallel
    if m.position_embedding_type == "yarn" and m.multi_latent_attention:
        yield (
            "model.position_embedding_type yarn with multi-latent attention: MLA rotates by "
            "model.rope_type (yarn by default); use position_embedding_type rope"
        )
    if not m.multi_latent_attention:
        if m.mla_down_proj_fusion:  # 0.19's Megatron-LM asserts it (not idle_keys')
            yield "model.mla_down_proj_fusion needs model.multi_latent_attention"
        if m.rope_type == "yarn":
            yield (
                "model.rope_type yarn is multi-latent attention's; for YaRN with other attention "
                "set model.position_embedding_type: yarn (megatron-core's GPTModel)"
            )
        return
    if m.num_query_groups != m.num_attention_heads:
        yield (
            f"model.num_query_groups = {m.num_query_groups} with multi-latent attention: MLA "
            "has no grouped-query attention (Megatron-LM refuses the combination)"
        )
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        if getattr(m, name) < 1:
            yield f"model.{name} = {getattr(m, name)} must be at least 1"
    if m.q_lora_rank is not None and m.q_lora_rank < 1:
        yield f"model.q_lora_rank = {m.q_lora_rank} must be at least 1 (or omitted)"
    if m.mla_down_proj_fusion:
        # megatron-core 0.19 builds the fused attention in its Transformer Engine spec only (the
        # local spec takes no such argument: idle_keys) and asserts a query compression
        # (FusedMLASelfAttention)
        if m.q_lora_rank is None:
            yield "model.mla_down_proj_fusion needs model.q_lora_rank (a query compression)"
    if par.cp > 1:
        # Transformer Engine's context-parallel attention exchanges K and V of different head
        # dimensions separately for MLA; models/te_cp.py models equal head dimensions only.
        yield (
            "parallel.cp > 1 with multi-latent attention is not modelled (Transformer "
            "Engine's context-parallel MLA exchanges K and V of different head sizes)"
        )
    if job.attention_kernel == "flash":
        yield (
            "implementation.attention_backend: flash with multi-latent attention: Transformer "
            "Engine 2.8 turns flash-attn 2 off when the query and value head sizes differ; "
            "use fused or unfused"
        )


def _check_attention_variants(job):
    """Sliding windows, attention sinks and GPT-OSS's clamped GLU: what Transformer Engine 2.8
    and megatron-core 0.16.1 accept, and what metatrace models of them."""
    m, par = job.model, job.parallel
    kernel = job.attention_kernel
    window = m.window_size
    if window is not None:
        if len(window) != 2 or any(w < -1 for w in window):
            yield (
                f"model.window_size = {window} must be two sizes [left, right], each at least -1 "
                "(-1: unbounded), e.g. [128, 0]"
            )
        elif kernel == "fused" and (window[1] not in (-1, 0) or m.attention_dropout > 0):
            # TE 2.8 attention/dot_product_attention/utils.py, "Filter: Sliding window attention"
            yield (
                f"implementation.attention_backend: fused with model.window_size {window} and "
                f"attention_dropout {m.attention_dropout:g}: cuDNN's fused attention takes "
                "windows [left, 0] without dropout only (Transformer Engine 2.8 turns it off); "
                "use flash or unfused"
            )
        if par.cp > 1:
            yield "model.window_size with parallel.cp > 1 is not modelled"
    freq = m.window_attn_skip_freq
    if freq is not None:
        if isinstance(freq, int) and freq < 1:
            yield f"model.window_attn_skip_freq = {freq} must be at least 1"
        elif isinstance(freq, list) and (
            len(freq) != m.num_layers or any(x not in (0, 1) for x in freq)
        ):
            yield (
                f"model.window_attn_skip_freq as a list needs one 0 or 1 per layer "
                f"({m.num_layers}), got {freq}"
            )
    if m.softmax_type != "vanilla":
        if kernel == "flash":
            # TE 2.8 utils.py, "Filter: Softmax type": only fused and unfused take sinks.
            yield (
                f"model.softmax_type {m.softmax_type} with implementation.attention_backend: "
                "flash: Transformer Engine 2.8 turns flash-attn off for softmax sinks; use fused "
                "or unfused"
            )
        if par.cp > 1:
            yield f"model.softmax_type {m.softmax_type} with parallel.cp > 1 is not modelled"
    if m.activation not in GATED_ACTIVATIONS and m.glu_linear_offset:
        # what idle_keys left: TransformerConfig's check under the fused bias-activation kernels
        yield "model.glu_linear_offset needs a gated activation (swiglu, geglu, quick_geglu)"
    clamp = m.activation_func_clamp_value
    if clamp is not None and clamp <= 0:
        yield f"model.activation_func_clamp_value = {clamp:g} must be positive"
    impl = job.implementation
    if (
        m.num_experts
        and m.add_bias_linear
        and impl.moe_grouped_gemm
        and impl.transformer_impl == "transformer_engine"
        and impl.bias_dropout_fusion
    ):
        # megatron-core 0.16.1 moe/experts.py, TEGroupedMLP.__init__ asserts it.
        yield (
            "model.add_bias_linear with grouped expert GEMMs needs "
            "implementation.bias_dropout_fusion: false (megatron-core's TEGroupedMLP refuses "
            "bias-dropout fusion with expert biases)"
        )


def _check_bias_activation_fusion(job):
    """megatron-core 0.16.1 has a fused bias-activation kernel per activation and raises at the
    first forward where a layer has none: experts (routing probabilities applied in the
    kernel) only for swiglu and quick_geglu (mlp.py, moe/experts.py TEGroupedMLP), SwiGLU
    experts without a bias to add in the kernel, dense MLPs and shared experts only for gelu
    and swiglu (mlp.py)."""
    m = job.model
    if not job.bias_activation_fusion:
        return
    off = (
        "set implementation.bias_activation_fusion: false (Megatron-LM: "
        f"{'--no-bias-gelu-fusion' if m.activation == 'gelu' else '--no-bias-swiglu-fusion'})"
    )
    if m.num_experts and m.activation not in ("swiglu", "quick_geglu"):
        yield (
            f"model.activation {m.activation} in mixture-of-experts layers with fused "
            "bias-activation kernels: megatron-core fuses the routing probabilities only into "
            f"swiglu and quick_geglu and raises for the others; {off}"
        )
    impl = job.implementation
    grouped = impl.moe_grouped_gemm and impl.transformer_impl == "transformer_engine"
    if m.num_experts and m.activation == "swiglu" and m.add_bias_linear and not grouped:
        # SequentialMLP's experts are MLPs whose fc1 returns its bias for the kernel to add;
        # fused_bias_swiglu.weighted_bias_swiglu_impl raises NotImplementedError for a bias.
        yield (
            "model.add_bias_linear with SwiGLU experts run as one MLP each (no grouped GEMM) "
            "and fused bias-activation kernels: megatron-core's weighted SwiGLU kernel takes no "
            "bias and "
            f"raises; {off}, or use grouped expert GEMMs, or model.add_bias_linear: false"
        )
    dense = (
        not m.num_experts
        or m.moe_shared_expert_intermediate_size
        or (isinstance(m.moe_layer_freq, list) and 0 in m.moe_layer_freq)
    )
    if dense and m.activation == "quick_geglu":
        where = "dense MLPs" if not m.moe_shared_expert_intermediate_size else "shared experts"
        yield (
            f"model.activation quick_geglu in {where} with fused bias-activation kernels: "
            f"megatron-core's MLP fuses only gelu and swiglu there and raises; {off}"
        )


def _check_mtp(job):
    m = job.model
    n = m.mtp_num_layers
    if n is None:
        return
    if n < 1:
        yield f"model.mtp_num_layers = {n} must be at least 1 (or omitted)"
    if m.position_embedding_type not in ("rope", "none"):
        yield (
            "multi-token prediction needs model.position_embedding_type rope or none "
            "(Megatron-LM asserts it)"
        )


_MAMBA_KEYS = ("model.mamba_state_dim", "model.mamba_head_dim", "model.mamba_num_groups")
_GDN_KEYS = (
    "model.linear_conv_kernel_dim",
    "model.linear_key_head_dim",
    "model.linear_value_head_dim",
    "model.linear_num_key_heads",
    "model.linear_num_value_heads",
)


def _check_hybrid_layers(job):
    """Mamba-2 and Gated DeltaNet layers: what megatron-core's MambaMixer and GatedDeltaNet
    assert (megatron/core/ssm/mamba_mixer.py, gated_delta_net.py). megatron-core's specs of
    them are Transformer Engine's only; metatrace's models.hybrid also builds them from the
    local modules (`metatrace measure`), so transformer_impl local is accepted."""
    m, tp = job.model, job.parallel.tp
    pattern = m.hybrid_layer_pattern or ""
    mamba, gdn = _recurrent_layers(m)
    if gdn and m.activation not in ("swiglu", "silu"):
        # GatedDeltaNet runs its convolution with config.activation_func and asserts SiLU
        yield (
            f"Gated DeltaNet layers need model.activation swiglu or silu, not {m.activation} "
            "(megatron-core's GatedDeltaNet uses the activation in its short convolution and "
            "asserts silu)"
        )
    if mamba:
        yield from _head_split(
            m, tp, "MambaMixer", heads="mamba_num_heads", groups="mamba_num_groups"
        )
    freq = m.linear_attention_freq
    if isinstance(freq, int) and freq < 1:
        yield f"model.linear_attention_freq = {freq} must be at least 1"
    elif isinstance(freq, list) and (len(freq) != m.num_layers or set(freq) - {0, 1}):
        yield (
            f"model.linear_attention_freq as a list needs one 0 or 1 per layer "
            f"({m.num_layers}), got {freq}"
        )
    if freq is not None and pattern:
        yield (
            "model.linear_attention_freq is for GPT models; a hybrid model's Gated DeltaNet "
            "layers are G in model.hybrid_layer_pattern"
        )
    if gdn:  # each query/key head serves value_heads / key_heads value heads
        yield from _head_split(
            m, tp, "GatedDeltaNet", heads="linear_num_value_heads", groups="linear_num_key_heads"
        )


def _head_split(m, tp: int, module: str, *, heads: str, groups: str):
    """megatron-core's asserts of a mixer's head split: model.`heads` and model.`groups` each
    divisible by tp, and the heads by the groups."""
    for name in (heads, groups):
        if getattr(m, name) % tp:
            yield f"model.{name} = {getattr(m, name)} is not divisible by parallel.tp = {tp} ({module})"
    if getattr(m, heads) % getattr(m, groups):
        yield (
            f"model.{heads} = {getattr(m, heads)} is not divisible by model.{groups} = "
            f"{getattr(m, groups)} ({module})"
        )


def _check_gate_and_latent(job):
    """Gated attention (attention_output_gate) and LatentMoE (moe_latent_size): what
    megatron-core refuses with them."""
    m, par = job.model, job.parallel
    if m.attention_output_gate and m.multi_latent_attention:
        # MLATransformerConfig.__post_init__ raises NotImplementedError
        yield (
            "model.attention_output_gate with multi-latent attention: megatron-core has no "
            "output gate for MLA"
        )
    latent = m.moe_latent_size
    if latent is None or not m.num_experts:
        return  # without experts _check_moe names the key
    if latent < 1:
        yield f"model.moe_latent_size = {latent} must be at least 1 (or omitted)"
    if par.moe_shared_expert_overlap:
        # MoELayer.preprocess asserts it (0.16.1) / raises in training (0.19)
        yield (
            "model.moe_latent_size with parallel.moe_shared_expert_overlap: megatron-core "
            "refuses to overlap the shared experts with latent projections in training"
        )


def _check_mtp_layout(job, stages):
    """MTP layers (m) in a pipeline layout: as many as model.mtp_num_layers, in the stage of
    the loss. megatron-core allows them one stage earlier too; metatrace passes one
    hidden-state shape between stages, and MTP doubles it after its layers."""
    n = job.model.mtp_num_layers or 0
    placed = sum(stage.count("mtp") for stage in stages)
    if placed != n:
        yield (
            f"parallel.layout places {placed} MTP layers (m), but model.mtp_num_layers = "
            f"{job.model.mtp_num_layers}"
        )
    elif n and not any("mtp" in stage and "loss" in stage for stage in stages):
        yield (
            "parallel.layout must put the MTP layers (m) in the stage of the loss (L), e.g. ...|tmL"
        )


def _check_deferred_wgrad(job, per_step):
    """--defer-embedding-wgrad-compute: what megatron-core 0.16.1 refuses (TransformerConfig:
    pp 1, no gradient-accumulation fusion, a negative limit) is left to its own checks; these
    are the set-ups on which it fails while running."""
    tr = job.training
    if not tr.defer_embedding_wgrad_compute or job.parallel.pp == 1:
        return  # without pipelining megatron-core's TransformerConfig refuses it itself
    if job.implementation.transformer_impl == "local":
        # tensor_parallel/layers.py:1003: every ColumnParallelLinear (the local spec's
        # linear_qkv and linear_fc1 too) appends to its embedding_activation_buffer, which only
        # the output layer has (None elsewhere): AttributeError in the first forward.
        yield (
            "training.defer_embedding_wgrad_compute needs implementation.transformer_impl: "
            "transformer_engine (with the local spec megatron-core 0.16.1 fails in the first "
            "forward: its linear layers have no embedding_activation_buffer)"
        )
    if tr.global_batch_size >= per_step > 0:
        calls = (tr.global_batch_size // per_step) * (1 + (job.model.mtp_num_layers or 0))
        deferred = calls if tr.wgrad_deferral_limit == 0 else min(tr.wgrad_deferral_limit, calls)
        if deferred == 1:
            # utils.drain_embedding_wgrad_compute: drain_idx is only set inside its loop over
            # the second and later entries (UnboundLocalError at the first pipeline flush).
            yield (
                "training.defer_embedding_wgrad_compute with one deferred output-layer call per "
                "iteration (wgrad_deferral_limit 1, or one micro-batch) fails in megatron-core "
                "0.16.1's drain_embedding_wgrad_compute"
            )


def _check_layer_offload(job):
    tr = job.training
    n = tr.cpu_offloading_num_layers
    if not n:
        return
    layers = job.model.num_layers
    what = f"training.cpu_offloading_num_layers = {n}"
    if not 0 < n < layers:
        yield f"{what} must be between 1 and num_layers - 1 ({layers - 1})"
    if job.parallel.pp > 1:
        yield f"{what} needs parallel.pp 1 (megatron-core: no pipeline parallelism with it)"
    if tr.recompute.granularity is not None:
        yield f"{what} does not work with training.recompute (megatron-core refuses it)"
    if tr.activation_offload_modules:
        yield f"{what} and training.activation_offload_modules exclude each other"


def _check_offload(job):
    """Fine-grained activation offloading: what megatron-core 0.16.1 refuses (TransformerConfig:
    unknown modules, attn_proj without core_attn) is left to its own checks; these are the set-ups
    that fail while running. Layer-wise offloading: what TransformerConfig and TransformerBlock
    refuse."""
    yield from _check_layer_offload(job)
    tr = job.training
    modules = tr.activation_offload_modules or []
    if not modules:
        return
    # A micro-batch whose first offload group stays on the GPU is taken for finished after
    # that group (ChunkOffloadHandler.finish_all_groups: nothing pending), so megatron-core
    # 0.19.2 gives its later groups to the next micro-batch and fails in backward
    # (on_group_commit_backward: 'Chunk mismatch'); measured running its manager on meta.
    fraction = tr.activation_offload_fraction
    if not 0.0 < fraction <= 1.0:
        yield (
            f"training.activation_offload_fraction = {fraction} must be above 0 and at most 1 "
            "(at 0 every group stays on the GPU, which megatron-core 0.19.2's offload manager "
            "fails in backward: 'Chunk mismatch'; leave activation_offload_modules out instead)"
        )
    delta = tr.delta_offload_bytes_across_pp_ranks
    if delta < 0:
        yield f"training.delta_offload_bytes_across_pp_ranks = {delta} must not be negative"
    elif delta and job.parallel.pp > 1:
        yield (
            f"training.delta_offload_bytes_across_pp_ranks = {delta} with pipeline "
            "parallelism: megatron-core 0.19.2 keeps the first offload group of the first "
            "micro-batch on the GPU on every pipeline rank but the first, and its offload "
            "manager then fails in backward ('Chunk mismatch'); leave it at 0"
        )
    cap = tr.fine_grained_offloading_max_inflight_offloads
    if cap is not None and cap < 0:
        yield f"training.fine_grained_offloading_max_inflight_offloads = {cap} must not be negative"
    if tr.min_offloaded_tensor_size < 0:
        size = tr.min_offloaded_tensor_size
        yield f"training.min_offloaded_tensor_size = {size} must not be negative"
    if tr.recompute.granularity == "full":
        # Checkpointed layers save nothing in forward; their offload groups run again in the
        # recompute inside backward, where the manager's bookkeeping of which chunk runs
        # backward breaks with pipelining (on_group_commit_backward asserts), and without it the
        # groups are offloaded and reloaded at once, saving nothing.
        yield (
            "training.activation_offload_modules with full recompute: megatron-core 0.16.1 "
            "offloads inside backward's recompute, which saves nothing and with pipeline "
            "parallelism fails ('Chunk mismatch'); use selective recompute or no offloading"
        )
    # (expert_fc1 under FP8 delayed scaling, which TE's GroupedLinear refuses with
    # save_original_input, is covered by the refusal of FP8 with experts in _check_moe.)
