"""Every Megatron-LM `pretrain_gpt.py` flag, and what metatrace does with it.

`flags.tsv` (next to this file) lists every option string of Megatron-LM's parser at
tag core_v0.16.1, at core_v0.19.2 and at a 2026 HEAD, as argparse holds it (dest, action, type,
default, choices, arity; ../shared/notes/megatron-lm-flags.tsv without its help column, plus
core_v0.19.2's column and rows from bench/megatron_parser.py). The tables below put each in
exactly one class:

1. modelled (`_MODELLED`): it sets a job key, or a derivation in metatrace.config.megatron.args reads it;
2. no effect (`_NO_EFFECT`, by reason): it cannot change the memory PyTorch's allocator hands out
   during training iterations, nor the traffic of their collectives;
3. not modelled yet (`_NOT_MODELLED`, by feature): it changes memory or traffic and metatrace
   does not model it; given with a value other than its default, it is named in the warning, in
   the JSON report and next to the verdict, with the way it could move the peak;
4. refused (`_REFUSED`): Megatron-LM itself refuses it (validate_args asserts).

A flag of any of these parsers is known (a command line for a newer Megatron-LM than the
megatron-core metatrace runs is read the same way; its flags newer than core_v0.16.1 are noted).
A flag in none is a misspelling when it is close to one (an error naming it), else an error too
unless the user names the newer Megatron-LM it comes from: then it is reported as not modelled
(metatrace.config.megatron.args).

The classes were decided from megatron-core 0.16.1's and Transformer Engine 2.20's sources
(where the dest is read), the flag's help, and, for flags only Megatron-LM's own training code
reads, that code's ports (Megatron-Bridge 0.3.1); the flags new in core_v0.19.2 from megatron-core
0.19.2's sources and the Megatron-LM training code its wheel ships (megatron/training: where the
dest is read); HEAD-only flags from their help text alone.
"""

from __future__ import annotations

import ast
import csv
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

Class = Literal["modelled", "no_effect", "not_modelled", "refused"]
Versions = Literal["all", "core_v0.16.1", "core_v0.19.2", "HEAD", "older"]
Parser = Literal["core_v0.16.1", "core_v0.19.2", "HEAD"]
PARSERS: tuple[Parser, ...] = ("core_v0.16.1", "core_v0.19.2", "HEAD")
"""The parsers of flags.tsv, oldest first (its columns in_core_v0.16.1, in_core_v0.19.2, in_head)."""
NEWER: tuple[Versions, ...] = ("core_v0.19.2", "HEAD")
"""The `versions` of flags that Megatron-LM core_v0.16.1 does not have."""


Direction = Literal["raises", "lowers", "either", "unknown", "traffic"]


@dataclass(frozen=True)
class Flag:
    """One Megatron-LM option string: how argparse reads it, and its class."""

    name: str
    dest: str
    nargs: int | str
    """0: a switch; 1: one value; 3: three values; "+": one or more; "*": any number; "?": an
    optional value (core_v0.16.1's --lazy-mpu-init)."""
    type: Callable[[str], Any]
    choices: tuple | None
    default: Any
    """The parser's default (what the run has when the flag is not given)."""
    const: Any
    """What a switch stores (True, False, or a job value, e.g. a rank order)."""
    versions: Versions
    """Which parsers have it: "all" (core_v0.16.1's and the later ones': HEAD's, and
    core_v0.19.2's where known), "core_v0.16.1" (its alone: removed or renamed since),
    "core_v0.19.2" (added after core_v0.16.1, in core_v0.19.2's parser; HEAD's too but for three),
    "HEAD" (added after core_v0.19.2), or "older" (a release before core_v0.16.1 only)."""
    cls: Class
    reason: str
    """modelled: the job key or "derived"; no_effect: why; not_modelled: the feature;
    refused: Megatron-LM's message."""
    key: str | None = None
    """Class 1: the job key the flag sets as it is ("model.num_layers"); None: a derivation."""
    direction: Direction | None = None
    """Class 3: how it could move the peak against a prediction without it."""
    parsers: tuple[Parser, ...] = ()
    """The parsers of flags.tsv that have it, oldest first; core_v0.19.2 is left out of a flag
    of the modelopt-generic group, which its wheel cannot build (flags.tsv: unknown)."""

    @property
    def switch(self) -> bool:
        return self.nargs == 0


# --------------------------------------------------------------------------- 1. modelled

# Flag -> the job key it sets as it is, or None where a derivation in megatron_args reads it
# (../shared/notes/megatron-args.md, sections 4 and 6). A switch sets its key to what argparse
# stores (store_true: true, store_false: false) unless `_CONST` says otherwise.
_MODELLED: dict[str, str | None] = {
    # model shape (notes 4.1-4.3)
    "--num-layers": "model.num_layers",
    "--encoder-num-layers": None,  # the same as --num-layers for GPT
    "--hidden-size": "model.hidden_size",
    "--ffn-hidden-size": "model.ffn_hidden_size",
    "--num-attention-heads": "model.num_attention_heads",
    "--group-query-attention": None,
    "--num-query-groups": None,
    "--kv-channels": "model.kv_channels",
    "--max-position-embeddings": "model.max_position_embeddings",
    "--hidden-dropout": "model.hidden_dropout",
    "--attention-dropout": "model.attention_dropout",
    "--position-embedding-type": None,
    "--use-rotary-position-embeddings": None,
    "--no-position-embedding": None,
    "--rotary-base": "model.rotary_base",
    "--rotary-percent": "model.rotary_percent",
    "--normalization": "model.normalization",
    "--norm-epsilon": "model.norm_epsilon",
    "--swiglu": None,
    "--squared-relu": None,
    "--disable-bias-linear": "model.add_bias_linear",
    "--add-qkv-bias": None,
    "--qk-layernorm": "model.qk_layernorm",
    "--untie-embeddings-and-output-weights": "model.untie_embeddings_and_output_weights",
    "--make-vocab-size-divisible-by": "model.make_vocab_size_divisible_by",
    "--tokenizer-type": None,
    "--vocab-size": None,
    "--padded-vocab-size": None,
    "--seq-length": "training.seq_length",
    "--encoder-seq-length": None,  # the same as --seq-length for GPT
    "--decoder-seq-length": None,  # must equal --seq-length (the pipeline's receive buffers)
    # parallelism (notes 4.6)
    "--tensor-model-parallel-size": "parallel.tp",
    "--pipeline-model-parallel-size": "parallel.pp",
    "--num-layers-per-virtual-pipeline-stage": None,
    "--num-virtual-stages-per-pipeline-rank": None,
    "--decoder-first-pipeline-num-layers": "parallel.first_stage_layers",
    "--decoder-last-pipeline-num-layers": "parallel.last_stage_layers",
    "--account-for-embedding-in-pipeline-split": "parallel.account_for_embedding",
    "--account-for-loss-in-pipeline-split": "parallel.account_for_loss",
    "--pipeline-model-parallel-layout": None,
    "--sequence-parallel": "parallel.sequence_parallel",
    "--context-parallel-size": "parallel.cp",
    "--cp-comm-type": None,
    "--hierarchical-context-parallel-sizes": "parallel.hierarchical_cp_sizes",
    "--expert-model-parallel-size": "parallel.ep",
    "--expert-tensor-parallel-size": None,
    "--use-tp-pp-dp-mapping": "parallel.rank_order",
    "--microbatch-group-size-per-virtual-pipeline-stage": "parallel.microbatch_group_size",
    "--no-overlap-p2p-communication": "parallel.overlap_p2p_comm",
    "--tp-comm-overlap": "parallel.tp_comm_overlap",
    "--tp-comm-overlap-cfg": None,  # a YAML file read into parallel.tp_comm_overlap_cfg
    "--tp-comm-overlap-rs-dgrad": "parallel.tp_comm_overlap_rs_dgrad",
    "--disable-tp-comm-overlap-ag": "parallel.tp_comm_overlap_ag",
    "--no-tp-comm-overlap-ag": "parallel.tp_comm_overlap_ag",
    "--disable-tp-comm-overlap-rs": "parallel.tp_comm_overlap_rs",
    "--no-tp-comm-overlap-rs": "parallel.tp_comm_overlap_rs",
    "--disable-tp-comm-bulk-dgrad": "parallel.tp_comm_bulk_dgrad",
    "--no-tp-comm-bulk-dgrad": "parallel.tp_comm_bulk_dgrad",
    "--disable-tp-comm-bulk-wgrad": "parallel.tp_comm_bulk_wgrad",
    "--no-tp-comm-bulk-wgrad": "parallel.tp_comm_bulk_wgrad",
    "--overlap-p2p-communication-warmup-flush": "parallel.overlap_p2p_comm_warmup_flush",
    # mixture of experts
    "--num-experts": None,
    "--moe-layer-freq": None,
    "--moe-ffn-hidden-size": "model.moe_ffn_hidden_size",
    "--moe-shared-expert-intermediate-size": "model.moe_shared_expert_intermediate_size",
    "--moe-shared-expert-gate": "model.moe_shared_expert_gate",
    "--moe-shared-expert-overlap": "parallel.moe_shared_expert_overlap",
    "--overlap-moe-expert-parallel-comm": "parallel.overlap_moe_expert_parallel_comm",
    "--delay-wgrad-compute": "parallel.delay_wgrad_compute",
    "--moe-grouped-gemm": "implementation.moe_grouped_gemm",
    "--moe-permute-fusion": "implementation.moe_permute_fusion",
    "--moe-router-fusion": "implementation.moe_router_fusion",
    "--moe-router-load-balancing-type": None,
    "--moe-router-dtype": "training.moe_router_dtype",
    "--moe-router-padding-for-quantization": "training.moe_router_padding_for_quantization",
    "--moe-router-padding-for-fp8": "training.moe_router_padding_for_quantization",
    "--moe-router-score-function": "model.moe_router_score_function",
    "--moe-router-topk": "model.moe_router_topk",
    "--moe-router-pre-softmax": "model.moe_router_pre_softmax",
    "--moe-router-num-groups": "model.moe_router_num_groups",
    "--moe-router-group-topk": "model.moe_router_group_topk",
    "--moe-router-topk-scaling-factor": "model.moe_router_topk_scaling_factor",
    "--moe-router-enable-expert-bias": "model.moe_router_enable_expert_bias",
    "--moe-aux-loss-coeff": None,
    "--moe-z-loss-coeff": "model.moe_z_loss_coeff",
    "--moe-token-dispatcher-type": "parallel.moe_token_dispatcher_type",
    "--moe-flex-dispatcher-backend": "parallel.moe_flex_dispatcher_backend",
    "--moe-deepep-num-sms": "parallel.moe_deepep_num_sms",
    "--moe-hybridep-num-sms": "parallel.moe_hybridep_num_sms",
    "--moe-enable-deepep": None,
    "--moe-expert-capacity-factor": "training.moe_expert_capacity_factor",
    "--moe-pad-expert-input-to-capacity": None,
    # multi-latent attention (its rotary scaling too) and multi-token prediction (notes 4.8)
    "--multi-latent-attention": "model.multi_latent_attention",
    "--q-lora-rank": "model.q_lora_rank",
    "--kv-lora-rank": "model.kv_lora_rank",
    "--qk-head-dim": "model.qk_head_dim",
    "--qk-pos-emb-head-dim": "model.qk_pos_emb_head_dim",
    "--v-head-dim": "model.v_head_dim",
    "--rope-type": "model.rope_type",
    "--rotary-scaling-factor": "model.rotary_scaling_factor",
    "--mscale": "model.mscale",
    "--mscale-all-dim": "model.mscale_all_dim",
    # GPT-OSS: YaRN without MLA (HEAD's --position-embedding-type yarn, which also reads
    # --rotary-scaling-factor and --mscale*), clamped GLUs, attention sinks, sliding windows
    "--yarn-original-max-position-embeddings": "model.original_max_position_embeddings",
    "--yarn-beta-fast": "model.beta_fast",
    "--yarn-beta-slow": "model.beta_slow",
    "--quick-geglu": None,
    "--glu-linear-offset": "model.glu_linear_offset",
    "--activation-func-clamp-value": "model.activation_func_clamp_value",
    "--softmax-type": "model.softmax_type",
    "--window-size": None,  # tuple_type, read in megatron_args
    "--window-attn-skip-freq": None,  # moe_freq_type, read in megatron_args
    "--mtp-num-layers": "model.mtp_num_layers",
    "--mtp-loss-scaling-factor": "model.mtp_loss_scaling_factor",
    "--mtp-use-repeated-layer": "model.mtp_use_repeated_layer",
    "--mla-down-proj-fusion": "model.mla_down_proj_fusion",
    # hybrid models (pretrain_mamba.py / pretrain_hybrid.py): the pattern, Mamba-2's sizes;
    # Gated DeltaNet in GPT models (Qwen3-Next), gated attention, LatentMoE
    "--hybrid-override-pattern": None,  # 0.16.1's name; 0.19 forwards it to the next
    "--hybrid-layer-pattern": None,
    "--mtp-hybrid-override-pattern": None,  # 0.19's legacy MTP pattern, with --mtp-num-layers
    "--is-hybrid-model": None,  # implied by a pattern (initialisation scale only)
    "--disable-mamba-mem-eff-path": None,  # refused: the unfused Mamba-2 path is not modelled
    "--mamba-state-dim": "model.mamba_state_dim",
    "--mamba-head-dim": "model.mamba_head_dim",
    "--mamba-num-groups": "model.mamba_num_groups",
    "--mamba-num-heads": "model.mamba_num_heads",
    "--experimental-attention-variant": None,
    "--linear-attention-freq": None,  # la_freq_type, read in megatron_args
    "--linear-conv-kernel-dim": "model.linear_conv_kernel_dim",
    "--linear-key-head-dim": "model.linear_key_head_dim",
    "--linear-value-head-dim": "model.linear_value_head_dim",
    "--linear-num-key-heads": "model.linear_num_key_heads",
    "--linear-num-value-heads": "model.linear_num_value_heads",
    "--attention-output-gate": "model.attention_output_gate",
    "--moe-latent-size": "model.moe_latent_size",
    # training (notes 4.5, 4.9, 4.10, 4.12)
    "--micro-batch-size": "training.micro_batch_size",
    "--global-batch-size": "training.global_batch_size",
    "--bf16": None,
    "--fp16": None,
    "--fp8-format": None,
    "--fp8-recipe": None,
    "--fp8-param-gather": None,
    "--fp8-amax-history-len": "training.fp8_amax_history_len",
    "--fp4-format": None,
    "--fp4-recipe": None,
    "--first-last-layers-bf16": "training.first_last_layers_bf16",
    "--num-layers-at-start-in-bf16": "training.num_layers_at_start_in_bf16",
    "--num-layers-at-end-in-bf16": "training.num_layers_at_end_in_bf16",
    "--recompute-activations": None,
    "--recompute-granularity": None,
    "--recompute-method": None,
    "--recompute-num-layers": None,
    "--recompute-modules": None,
    "--distribute-saved-activations": "training.recompute.distribute_saved_activations",
    "--use-distributed-optimizer": "training.distributed_optimizer",
    "--overlap-grad-reduce": "training.overlap_grad_reduce",
    "--overlap-param-gather": "training.overlap_param_gather",
    "--overlap-param-gather-with-optimizer-step": (
        "training.overlap_param_gather_with_optimizer_step"
    ),
    "--num-distributed-optimizer-instances": "training.num_distributed_optimizer_instances",
    "--accumulate-allreduce-grads-in-fp32": None,
    "--grad-reduce-in-bf16": None,
    "--ddp-bucket-size": "training.ddp_bucket_size",
    "--ddp-average-in-collective": "training.ddp_average_in_collective",
    "--ddp-pad-buckets-for-high-nccl-busbw": "training.ddp_pad_buckets_for_high_nccl_busbw",
    "--optimizer": None,
    "--sgd-momentum": "training.sgd_momentum",
    "--use-precision-aware-optimizer": "training.use_precision_aware_optimizer",
    "--cpu-offloading-num-layers": "training.cpu_offloading_num_layers",
    "--optimizer-cpu-offload": "training.optimizer_cpu_offload",
    "--cuda-graph-impl": None,
    "--cuda-graph-scope": None,
    "--cuda-graph-modules": None,
    "--enable-cuda-graph": None,
    "--external-cuda-graph": None,
    "--optimizer-offload-fraction": "training.optimizer_offload_fraction",
    "--overlap-cpu-optimizer-d2h-h2d": "training.overlap_cpu_optimizer_d2h_h2d",
    "--main-grads-dtype": "training.main_grads_dtype",
    "--main-params-dtype": "training.main_params_dtype",
    "--exp-avg-dtype": "training.exp_avg_dtype",
    "--exp-avg-sq-dtype": "training.exp_avg_sq_dtype",
    "--clip-grad": "training.clip_grad",
    "--log-num-zeros-in-grad": "training.log_num_zeros_in_grad",
    "--no-gradient-accumulation-fusion": "training.gradient_accumulation_fusion",
    "--calculate-per-token-loss": "training.calculate_per_token_loss",
    "--defer-embedding-wgrad-compute": "training.defer_embedding_wgrad_compute",
    "--wgrad-deferral-limit": "training.wgrad_deferral_limit",
    "--no-create-attention-mask-in-dataloader": "training.create_attention_mask_in_dataloader",
    "--fine-grained-activation-offloading": None,
    "--use-megatron-fsdp": None,
    "--data-parallel-sharding-strategy": None,
    "--outer-dp-sharding-strategy": None,
    "--fsdp-double-buffer": None,
    "--suggested-communication-unit-size": None,
    "--megatron-fsdp-main-grads-dtype": None,
    "--megatron-fsdp-main-params-dtype": None,
    "--megatron-fsdp-grad-comm-dtype": None,
    "--offload-modules": None,
    "--min-offloaded-tensor-size": None,
    "--activation-offload-fraction": None,
    "--delta-offload-bytes-across-pp-ranks": None,
    "--fine-grained-offloading-max-inflight-offloads": None,
    # implementation (notes 4.10, 4.11)
    "--transformer-impl": None,
    "--attention-backend": None,
    "--no-rope-fusion": None,
    "--cross-entropy-loss-fusion": "implementation.cross_entropy_loss_fusion",
    "--cross-entropy-fusion-impl": "implementation.cross_entropy_fusion_impl",
    "--no-bias-gelu-fusion": None,
    "--no-bias-swiglu-fusion": None,
    "--no-bias-dropout-fusion": "implementation.bias_dropout_fusion",
    "--no-masked-softmax-fusion": "implementation.masked_softmax_fusion",
    "--attention-softmax-in-fp32": "implementation.attention_softmax_in_fp32",
    "--apply-query-key-layer-scaling": "implementation.apply_query_key_layer_scaling",
    "--use-transformer-engine-op-fuser": "implementation.te_op_fuser",
    "--deterministic-mode": None,  # what Transformer Engine's attention selection then drops
}
_CONST = {"--use-tp-pp-dp-mapping": "tp-cp-ep-pp-dp"}

# Values of modelled flags that metatrace does not model (newer Megatron-LM choices): the job is
# built without them and they are reported like class-3 flags.
UNMODELLED_VALUES: dict[str, tuple[tuple[Any, ...], str, Direction]] = {
    "--optimizer": (
        ("muon", "dist_muon", "lion", "soap", "adaptive_muon"),
        # core_v0.19.2's validate_args: with --use-distributed-optimizer (and dist_muon) these
        # run under the layer-wise distributed optimizer instead of megatron-core's
        "optimizers other than adam and sgd (Muon, Lion, SOAP; with --use-distributed-optimizer "
        "the layer-wise distributed optimizer)",
        "either",
    ),
    "--position-embedding-type": (
        ("mrope", "relative"),
        "position embeddings other than learned_absolute, rope, yarn and none",
        "either",
    ),
    "--moe-router-score-function": (
        ("sqrtsoftplus",),
        "the sqrtsoftplus router score function (routed as softmax)",
        "unknown",
    ),
    "--moe-flex-dispatcher-backend": (
        ("ncclep",),
        "the NCCL EP flex dispatcher (dispatched as DeepEP)",
        "either",
    ),
    "--fp8-recipe": (("custom",), "custom FP8 quantizers", "unknown"),
    "--experimental-attention-variant": (
        ("dsa", "gdn2"),
        "DeepSeek sparse attention and Gated DeltaNet 2 (built without the variant)",
        "either",
    ),
    "--fp4-recipe": (("custom",), "custom FP4 quantizers", "unknown"),
    "--rerun-mode": (
        ("report_stats",),
        "the rerun state machine's report_stats mode (every step run twice)",
        "traffic",
    ),
}

# Megatron-LM refuses these (validate_args asserts, or its TransformerConfig raises).
_REFUSED = {
    "--help": "--help: Megatron-LM prints its help and exits; there is no run to predict",
    "-h": "-h: Megatron-LM prints its help and exits; there is no run to predict",
    "--batch-size": "--batch-size is no longer valid; use --micro-batch-size",
    "--warmup": "--warmup is no longer valid; use --lr-warmup-fraction",
    "--model-parallel-size": "--model-parallel-size is no longer valid; use "
    "--tensor-model-parallel-size",
    "--checkpoint-activations": "--checkpoint-activations is no longer valid; use "
    "--recompute-activations",
    "--init-method-xavier-uniform": "--init-method-xavier-uniform is broken in Megatron-LM (its "
    "TransformerConfig gets an unknown keyword, notes 4.1)",
    # megatron-core 0.16.1: finalize_model_grads calls finish_grad_sync(force_all_reduce=...),
    # which TorchFullyShardedDataParallel inherits from _BaseDataParallel without the argument.
    "--use-torch-fsdp2": "--use-torch-fsdp2 fails in megatron-core 0.16.1 at the end of the first "
    "backward (finalize_model_grads passes force_all_reduce to TorchFullyShardedDataParallel's "
    "finish_grad_sync, which takes no argument: TypeError); use --use-megatron-fsdp",
}

# --------------------------------------------------------------------------- 2. no effect

# Reason -> flags that cannot change allocated memory or traffic in training iterations.
_NO_EFFECT: dict[str, str] = {
    "inference only: pretrain_gpt.py trains and runs no inference": (
        "--bert-embedder-type --cache-mla-latents --decode-only-cuda-graphs "
        "--disable-chunked-prefill --enable-chunked-prefill --flash-decode "
        "--inference-batch-times-seqlen-threshold --inference-coordinator-port "
        "--inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens "
        "--inference-cuda-graph-scope --inference-disable-ep-consensus "
        "--inference-disable-triton-nvls-kernels --inference-dynamic-batching "
        "--inference-dynamic-batching-async-sched-mode "
        "--inference-dynamic-batching-block-size --inference-dynamic-batching-buffer-size-gb "
        "--inference-dynamic-batching-cuda-graph-max-tokens "
        "--inference-dynamic-batching-cuda-graph-mixed-prefill-count "
        "--inference-dynamic-batching-cuda-graph-sizing-distribution "
        "--inference-dynamic-batching-logprobs-mode "
        "--inference-dynamic-batching-mamba-memory-ratio "
        "--inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens "
        "--inference-dynamic-batching-num-cuda-graphs "
        "--inference-dynamic-batching-paused-buffer-size-gb "
        "--inference-dynamic-batching-prefix-caching "
        "--inference-dynamic-batching-prefix-caching-coordinator-policy "
        "--inference-dynamic-batching-prefix-caching-eviction-policy "
        "--inference-dynamic-batching-prefix-caching-mamba-gb "
        "--inference-dynamic-batching-prefix-caching-routing-alpha "
        "--inference-dynamic-batching-sampling-backend "
        "--inference-dynamic-batching-track-generated-token-events "
        "--inference-dynamic-batching-track-paused-request-events "
        "--inference-dynamic-batching-unified-memory-level --inference-fuse-tp-communication "
        "--inference-grouped-gemm-backend --inference-logging-step-interval "
        "--inference-max-batch-size --inference-max-requests --inference-max-seq-length "
        "--inference-moe-disable-fused-quant-kernels --inference-moe-token-dispatcher-type "
        "--inference-shards --inference-text-gen-server-logging "
        "--inference-use-synchronous-zmq-collectives --inference-wandb-logging "
        "--mamba-inference-conv-states-dtype "
        "--mamba-inference-ssm-states-dtype --max-tokens-to-oom --mlp-chunks-for-prefill "
        "--moe-pad-experts-for-cuda-graph-inference --nccl-all-reduce-for-prefill "
        "--no-inference-disable-ep-consensus --no-inference-dynamic-batching-prefix-caching "
        "--no-inference-text-gen-server-logging "
        "--no-inference-use-synchronous-zmq-collectives --no-inference-wandb-logging "
        "--num-speculative-tokens --output-bert-embeddings --use-legacy-static-engine "
        "--use-same-sampling-seed-across-dp-ranks "
    ),
    "reinforcement learning only (train_rl.py)": (
        "--grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-entropy-term-weight "
        "--grpo-filter-groups-with-same-reward --grpo-group-size --grpo-iterations "
        "--grpo-kl-beta --grpo-prompts-per-step --langrl-env-config --langrl-external-server "
        "--langrl-inference-server-conversation-template --langrl-inference-server-type "
        "--moe-enable-routing-replay --no-langrl-external-server "
        "--no-rl-inference-logprobs-is-correction "
        "--no-rl-offload-inference-model-weights-when-idle "
        "--no-rl-offload-kv-cache-during-training --no-rl-partial-rollouts "
        "--no-rl-persist-cuda-graphs --no-rl-remove-kv-cache-during-training "
        "--no-rl-reset-cuda-graphs --no-rl-skip-bos-token --no-rl-training-cuda-graphs "
        "--no-rl-use-sequence-packing --no-rl-verify-model-weights-swap --refit-method "
        "--rl-consumption-granularity --rl-default-temperature --rl-default-top-k "
        "--rl-default-top-p --rl-durable-rollout-bank --rl-generation-lag "
        "--rl-importance-sampling-truncation-coef --rl-inference-expert-model-parallel-size "
        "--rl-inference-expert-tensor-model-parallel-size "
        "--rl-inference-logprobs-is-correction --rl-inference-model-unified-memory-level "
        "--rl-inference-parsers --rl-inference-pipeline-model-parallel-size "
        "--rl-inference-tensor-model-parallel-size --rl-kv-cache-management-mode "
        "--rl-max-inflight-requests --rl-offload-inference-model-weights-when-idle "
        "--rl-offload-kv-cache-during-training --rl-offload-optimizer-during-inference "
        "--rl-parallel-generation-tasks --rl-partial-rollouts --rl-persist-cuda-graphs "
        "--rl-profile --rl-profile-dir --rl-prompts-per-eval "
        "--rl-remove-kv-cache-during-training --rl-reset-cuda-graphs --rl-rollout-bank-dir "
        "--rl-rollout-bank-max-bytes --rl-sequence-packing-algo "
        "--rl-sequence-packing-max-sequences-per-bin --rl-skip-bos-token "
        "--rl-submission-granularity --rl-training-cuda-graphs --rl-use-sequence-packing "
        "--rl-verify-model-weights-swap "
    ),
    "checkpoints: saved and loaded between iterations, not during them": (
        "--async-ckpt-cpu-priority --async-ckpt-io-priority --async-ckpt-use-cpu-shm "
        "--async-save --async-strategy --auto-detect-ckpt-format "
        "--ckpt-assume-constant-structure --ckpt-convert-format --ckpt-convert-save "
        "--ckpt-convert-update-legacy-dist-opt-format --ckpt-drop-redundant-extra-state "
        "--ckpt-format --ckpt-fully-parallel-load --ckpt-fully-parallel-load-exchange-algo "
        "--ckpt-fully-parallel-load-per-rank-objects --ckpt-fully-parallel-load-process-group "
        "--ckpt-fully-parallel-save --ckpt-fully-parallel-save-process-group "
        "--ckpt-pg-tensors-cache-create --ckpt-pg-tensors-cache-path --ckpt-step "
        "--disable-ckpt-fully-parallel-save --disable-ckpt-load-validate-sharding-integrity "
        "--disable-msc --disable-stream-ckpt-dequant --no-stream-ckpt-dequant --disable-save-tokenizer-assets --disable-strict-fsdp-dtensor-load "
        "--disable-use-tokenizer-model-from-checkpoint-args --dist-ckpt-format "
        "--dist-ckpt-optim-fully-reshardable --dist-ckpt-save-pre-mcore-014 "
        "--dist-ckpt-strictness --dist-ckpt-workers "
        "--distrib-optim-fully-reshardable-mem-efficient --dump-param-to-param-group-map "
        "--enable-msc --exit-on-missing-checkpoint --export-kd-teacher-ckpt-format --finetune "
        "--load --load-main-params-from-ckpt --no-ckpt-fully-parallel-save "
        "--no-ckpt-load-validate-sharding-integrity --no-load-optim --no-load-rng "
        "--no-save-optim --no-save-rng --no-save-tokenizer-assets "
        "--no-strict-fsdp-dtensor-load --no-use-tokenizer-model-from-checkpoint-args "
        "--non-persistent-ckpt-type --non-persistent-global-ckpt-dir "
        "--non-persistent-local-ckpt-algo --non-persistent-local-ckpt-dir "
        "--non-persistent-save-interval --override-ckpt-iteration --persistent-save-interval "
        "--pretrained-checkpoint --replication --replication-factor --replication-jump --save "
        "--save-interval --save-params-interval --save-retain-interval "
        "--save-tokens-per-expert-interval --save-wgrads-interval --use-dist-ckpt "
        "--use-persistent-ckpt-worker --verify-integrity "
    ),
    "other model families (vision, BERT, retrieval, T5): GPT training does not read them": (
        "--bert-load --bert-no-binary-head --biencoder-projection-dim "
        "--biencoder-shared-query-context-model --block-data-path --classes-fraction "
        "--data-per-class-fraction --decoder-num-layers --dino-bottleneck-size "
        "--dino-freeze-last-layer --dino-head-hidden-size --dino-local-crops-number "
        "--dino-local-img-size --dino-norm-last-layer --dino-teacher-temp "
        "--dino-warmup-teacher-temp --dino-warmup-teacher-temp-epochs "
        "--embedding-path --evidence-data-path "
        "--ict-head-size --ict-load --img-h "
        "--img-w --indexer-batch-size --indexer-log-interval --iter-per-epoch "
        "--mask-factor --mask-prob --mask-type "
        "--num-channels --num-classes --patch-dim --query-in-block-prob "
        "--retriever-report-topk-accuracies --retriever-score-scaling --sample-rate "
        "--short-seq-prob --swin-backbone-type --titles-data-path --use-one-sent-docs "
        "--vision-backbone-type --vision-pretraining --vision-pretraining-type "
    ),
    "learning rate, weight decay, loss scale and optimizer hyper-parameters: scalars": (
        "--adam-beta1 --adam-beta2 --adam-eps --apply-wd-to-qk-layernorm --decoupled-lr "
        "--decoupled-min-lr --end-weight-decay --head-lr-mult --hysteresis "
        "--initial-loss-scale --lion-beta1 --lion-beta2 --logits-load-kd-loss-alpha "
        "--loss-scale --loss-scale-window --lr --lr-decay-iters --lr-decay-samples "
        "--lr-decay-style --lr-warmup-fraction --lr-warmup-init --lr-warmup-iters "
        "--lr-warmup-samples --lr-wsd-decay-iters --lr-wsd-decay-samples --lr-wsd-decay-style "
        "--min-loss-scale --min-lr --muon-coefficient-type --muon-extra-scale-factor "
        "--muon-fp32-matmul-prec --muon-momentum --muon-num-ns-steps --muon-scale-mode "
        "--mup-attn-scale-power --mup-base-head-dim --mup-base-hidden-size --mup-width-mult "
        "--no-weight-decay-cond-type --override-opt-param-scheduler "
        "--override-opt_param-scheduler --start-weight-decay "
        "--use-checkpoint-opt-param-scheduler --use-checkpoint-opt_param-scheduler "
        "--weight-decay --weight-decay-incr-style "
    ),
    "data loading on the host: the same batch tensors reach the GPU": (
        "--allow-ambiguous-pad-tokens --data-args-path --data-cache-path --data-path "
        "--dataloader-defer-npy-index-mmap --dataloader-fast-cache-load --dataloader-type "
        "--eod-mask-loss --fim-data --fim-eod-token --fim-fragment-rate --fim-middle-token "
        "--fim-no-prefix --fim-pad-token --fim-prefix-token --fim-rate --fim-split-sample "
        "--fim-spm-rate --fim-suffix-token --finetune-data-files --finetune-data-split "
        "--finetune-hf-dataset --logits-load-decode-threads --logits-load-ignore-errors "
        "--logits-load-msc-prefetch-depth --logits-load-prefetch-factor "
        "--mid-level-dataset-surplus --mock-data --no-data-sharding --no-mmap-bin-files "
        "--num-dataset-builder-threads --num-workers --object-storage-cache-path "
        "--per-dataset-sequences-path --per-split-data-args-path "
        "--phase-transition-iterations --reset-attention-mask --reset-position-ids "
        "--sft-tokenizer-prompt-format --split --test-data-path --train-data-path "
        "--valid-data-path "
    ),
    "tokenizer files and behaviour (the vocabulary size is given separately)": (
        "--chat-template --disable-tokenizer-sentencepiece-ignore-extra-whitespaces "
        "--legacy-tokenizer --merge-file "
        "--no-tokenizer-sentencepiece-ignore-extra-whitespaces --null-tokenizer-eod-id "
        "--null-tokenizer-pad-id --tiktoken-num-special-tokens --tiktoken-pattern "
        "--tiktoken-special-tokens --tokenizer-hf-include-special-tokens "
        "--tokenizer-hf-no-include-special-tokens --tokenizer-hf-no-use-fast "
        "--tokenizer-hf-use-fast --tokenizer-metadata --tokenizer-model "
        "--tokenizer-sentencepiece-legacy --trust-remote-code --use-gigatoken --vocab-file "
    ),
    "logging, timers, profiling and telemetry: on the host, or a few scalars": (
        "--app-tag-run-name --app-tag-run-version --config-logger-dir "
        "--disable-flight-recorder-dump-on-timeout "
        "--disable-flight-recorder-extra-dump-on-exec "
        "--disable-flight-recorder-include-only-active "
        "--disable-log-loss-scale-to-tensorboard --disable-straggler-on-startup "
        "--flight-recorder-dump-path --flight-recorder-include-stack-trace "
        "--flight-recorder-trace-buffer-size --log-device-memory-used --log-energy "
        "--log-interval --log-memory-interval --log-memory-to-tensorboard --log-progress "
        "--log-straggler --log-throughput --log-timers-to-tensorboard "
        "--log-validation-ppl-to-tensorboard --log-world-size-to-tensorboard --logging-level "
        "--memory-snapshot-path --moe-per-layer-logging "
        "--moe-routing-trace-capture-hidden-states --moe-routing-trace-capture-logits "
        "--moe-routing-trace-dump-weights --moe-routing-trace-max-training-iters "
        "--moe-routing-trace-path --no-barrier-with-level-1-timing "
        "--no-flight-recorder-dump-on-timeout --no-flight-recorder-extra-dump-on-exec "
        "--no-flight-recorder-include-only-active --no-log-loss-scale-to-tensorboard "
        "--no-one-logger --nvtx-ranges --one-logger-async --one-logger-project "
        "--one-logger-run-name --otel-enabled --otel-service-name --otel-span-groups "
        "--profile --profile-ranks --profile-step-end --profile-step-start "
        "--pytorch-profiler-collect-callstack --pytorch-profiler-collect-chakra "
        "--pytorch-profiler-collect-shapes --record-memory-history --record-shapes "
        "--result-rejected-tracker-filename --run-workload-inspector-server "
        "--straggler-ctrlr-port --straggler-minmax-count --tensorboard-dir "
        "--tensorboard-log-interval --tensorboard-queue-size --timing-log-level "
        "--timing-log-option --use-pytorch-profiler --wandb-entity --wandb-exp-name "
        "--wandb-project --wandb-save-dir "
    ),
    "fault tolerance and restarts: on the host, acting only on failures": (
        "--adlr-autoresume --adlr-autoresume-interval --calc-ft-timeouts "
        "--check-for-spiky-loss --enable-ft-package --error-injection-rate "
        "--error-injection-type --fault-injector-delay-start-iteration "
        "--fault-injector-fault-delay --fault-injector-fault-probabilities "
        "--fault-injector-fault-types --fault-injector-mtti-seconds "
        "--fault-injector-num-ranks --fault-injector-offset-seconds --fault-injector-ranks "
        "--fault-injector-seed --ft-num-warmup-iters --inprocess-barrier-timeout "
        "--inprocess-completion-timeout --inprocess-empty-cuda-cache --inprocess-granularity "
        "--inprocess-hard-timeout --inprocess-heartbeat-interval "
        "--inprocess-heartbeat-timeout --inprocess-last-call-wait --inprocess-max-iterations "
        "--inprocess-monitor-process-interval --inprocess-monitor-thread-interval "
        "--inprocess-progress-watchdog-interval --inprocess-restart --inprocess-soft-timeout "
        "--inprocess-termination-grace-time "
    ),
    "process groups, streams and kernel resources (NCCL's and the MoE dispatchers' own buffers "
    "are outside PyTorch's allocator)": (
        "--create-all-gather-group --disable-bf16-reduced-precision-matmul "
        "--disable-gloo-process-groups --distributed-backend --distributed-timeout-minutes "
        "--distributed-timeout-seconds-after-init --enable-experimental --fake-process-group "
        "--high-priority-a2a-comm-stream --high-priority-stream-groups "
        "--inference-rng-tracker --lazy-mpu-init --local-rank "
        "--moe-flex-dispatcher-num-sms --moe-hybridep-num-blocks-permute "
        "--moe-hybridep-num-blocks-unpermute "
        "--moe-hybridep-num-sms-preprocessing --muon-use-syrk --nccl-communicator-config-path "
        "--no-persist-layer-norm --pipeline-model-parallel-comm-backend --sharp-enabled-group "
        "--symmetric-ar-type --te-rng-tracker --tp-comm-bootstrap-backend --use-sharp "
    ),
    "Transformer Engine before 1.6 only (megatron-core 0.16 passes tp_comm_overlap_ag and "
    "tp_comm_overlap_rs instead)": (
        "--disable-tp-comm-split-ag --disable-tp-comm-split-rs --no-tp-comm-split-ag "
        "--no-tp-comm-split-rs"
    ),
    "run length and exit conditions": (
        "--exit-duration-in-mins --exit-interval --exit-signal --exit-signal-handler "
        "--exit-signal-handler-for-dataloader --exit-signal-handler-for-training "
        "--iterations-to-skip --train-iters --train-samples "
    ),
    "evaluation: forward-only passes between training iterations": (
        "--eval-global-batch-size --eval-interval --eval-iters --eval-micro-batch-size "
        "--full-validation --multiple-validation-sets --skip-train --start-eval-at-iter "
        "--validation-set-names "
    ),
    "values only: the same tensors and shapes": (
        "--embedding-init-method-std --fp8-amax-compute-algo --fp8-interval --fp8-margin "
        "--init-method-std --logits-save-dtype --logits-save-top-p "
        "--logits-save-top-p-min-k --mhc-init-gating-factor "
        "--moe-router-bias-update-rate --moe-router-force-load-balancing "
        "--moe-router-quantile-balancing-ema "
        "--moe-token-drop-policy --mrope-section --no-yarn-correction-range-round-to-int "
        "--qk-clip-alpha --qk-clip-threshold --relative-attention-max-distance "
        "--relative-attention-num-buckets --rope-scaling-factor --rotary-interleaved "
        "--rotary-seq-len-interpolation-factor --seed --use-rope-scaling "
        "--yarn-correction-range-round-to-int "
    ),
    "CUDA graphs: eager iterations before the capture, whose peak the capture's covers": (
        "--cuda-graph-warmup-steps "
    ),
    "no effect in megatron-core 0.16.1: get_megatron_optimizer picks the Adam and SGD classes "
    "again after reading it": "--use-torch-optimizer-for-cpu-offload ",
    "no effect in megatron-core 0.16.1 (deprecated, read nowhere, or read only by features "
    "not in use)": (
        "--apply-residual-connection-post-layernorm "
        "--disable-async-tensor-model-parallel-allreduce --moe-extended-tp --mtp-standalone "
        "--no-async-tensor-model-parallel-allreduce --no-scatter-gather-tensors-in-pipeline "
        "--onnx-safe --use-flash-attn --use-mcore-models "
    ),
    "timing only: the same buffers and buckets, used or freed at other times": (
        "--disable-align-grad-reduce --disable-manual-gc-eval --empty-unused-memory-level "
        "--manual-gc --manual-gc-interval --no-align-grad-reduce --no-align-param-gather "
        "--no-manual-gc-eval --train-sync-interval "
    ),
    "host memory only": (
        "--cpu-offloading-retain-pinned-cpu-buffers --no-pin-cpu-grads --no-pin-cpu-params "
        "--use-cpu-initialization "
    ),
    "set-up before training": "--data-parallel-random-init --no-initialization ",
    "the rerun state machine's checks (its report_stats mode runs every step twice: a value "
    "not modelled)": "--rerun-mode ",
    "negligible: a few scalars per iteration, not scaling with the model": (
        "--apply-layernorm-1p --check-for-large-grads "
        "--check-weight-hash-across-dp-replicas-interval --log-params-norm "
        "--no-check-for-nan-in-loss-and-grad --test-mode "
    ),
}

# --------------------------------------------------------------------------- 3. not modelled yet

# (feature, how it could move the peak) -> flags. A flag given with its default value changes
# nothing and is not reported.
_NOT_MODELLED: dict[tuple[str, Direction], str] = {
    # dense recipes (the FSDP, offloading, userbuffers and CUDA-graph issue)
    ("CUDA graph of the optimizer step", "raises"): "--optimizer-cuda-graph",
    ("FSDP options", "either"): (
        "--torch-fsdp2-no-reshard-after-forward "
        "--enable-full-sharding-in-hsdp --fsdp-manual-registration --init-model-with-meta-device "
        "--keep-fp8-transpose-cache --megatron-fsdp-enable-fine-grained-param-gather "
        "--megatron-fsdp-max-pool-double-buffer "
        "--megatron-fsdp-version --no-gradient-reduce-div-fusion "
        "--fsdp-db-use-persist-buf-on-alloc-fail"
    ),
    ("NCCL user-buffer registration (buffers from NCCL's pool)", "unknown"): (
        "--use-nccl-ub --disable-symmetric-registration"
    ),
    ("fine-grained activation offloading delayed until a CUDA graph replays", "either"): (
        "--delay-offload-until-cuda-graph"
    ),
    ("gradient buckets by count or with fp32 accumulation", "either"): (
        "--ddp-num-buckets --ddp-param-name-patterns-for-fp32-local-accumulation "
        "--ddp-reduce-scatter-with-fp32-accumulation"
    ),
    ("layer-wise distributed-optimizer layout", "unknown"): "--no-use-layer-wise-param-layout",
    ("GTP weight rematerialisation (weights sharded beyond TP)", "either"): (
        "--tensor-parallel-num-weight-shards --expert-tensor-parallel-num-weight-shards "
        "--gtp-remat-opt-in-modules --gtp-remat-nccl-ub --gtp-expert-remat-nccl-ub "
        "--gtp-remat-reduce-scatter-with-fp32-accumulation"
    ),
    ("hybrid context parallelism (packed sequences)", "either"): (
        "--hybrid-context-parallel --max-seqlen-per-dp-cp-rank"
    ),
    ("packed sequences (THD attention)", "either"): "--dataloader-inter-document-masking --sft",
    ("pipeline transfers by ring exchange", "unknown"): "--use-ring-exchange-p2p",
    ("batch-size schedules (fewer micro-batches while ramping)", "lowers"): (
        "--rampup-batch-size --decrease-batch-size-if-needed --step-batch-size-schedule"
    ),
    # precision
    ("low-precision options: custom quantizers, per-module precision", "either"): (
        "--fp4-quantizer-factory --fp8-quantizer-factory --te-precision-config-file "
        "--fp8-output-proj --reuse-grad-buf-for-mxfp8-param-ag"
    ),
    # megatron-core 0.16.1's DistributedDataParallelConfig has no fp4_param_gather and its
    # distributed optimizer no NVFP4 parameter path: the run is described with bf16 parameters.
    ("FP4 (NVFP4) parameters gathered in FP4", "lowers"): "--fp4-param-gather",
    ("weight gradients without FP8 (high-precision inputs kept)", "raises"): (
        "--no-fp8-wgrad --disable-fp8-wgrad"
    ),
    ("kitchen quantization extension", "unknown"): (
        "--kitchen-config-file --kitchen-recipe-number --kitchen-attention-backend "
        "--use-kitchen-attention"
    ),
    ("fp16 cross entropy (logits not upcast)", "lowers"): "--fp16-lm-cross-entropy",
    ("output-logit dtype", "raises"): "--output-logit-dtype",
    # megatron-core's kernels are compiled at import, before Megatron-LM reads this flag: whether
    # they then run eagerly (the fused cross entropy's backward 4*s*b*V/t lower, the pointwise
    # fusions' temporaries higher) is not known here; TORCHDYNAMO_DISABLE=1 is modelled.
    ("JIT fusion switched off (if it reaches megatron-core's compiled kernels)", "either"): (
        "--disable-jit-fuser"
    ),
    ("batch-invariant kernels", "unknown"): "--batch-invariant-backend --batch-invariant-mode",
    # mixture of experts (the MoE issue)
    ("expert-parallel overlap variants (early attention release, dispatch by wgrad)", "either"): (
        "--ep-overlap-early-attn-memory-release --overlap-dispatch-backward-with-experts-wgrad"
    ),
    ("MoE flex dispatcher (DeepEP, HybridEP, NCCL EP)", "either"): (
        "--moe-hybridep-pad-uneven-dispatch-inputs "
        "--moe-ncclep-zero-copy --moe-ncclep-static-shape --moe-permute-fusion-into-hybridep "
        "--moe-dispatch-fwd-dtype --moe-combine-bwd-dtype --moe-expert-rank-capacity-factor"
    ),
    ("MoE paged activation stash", "either"): (
        "--moe-paged-stash --moe-paged-stash-buffer-size-factor-cpu "
        "--moe-paged-stash-buffer-size-factor-cuda --moe-paged-stash-page-size"
    ),
    ("MoE router and expert variants", "either"): (
        "--moe-router-force-biased --moe-input-jitter-eps --moe-apply-probs-on-input "
        "--use-fused-weighted-squared-relu"
    ),
    ("MoE expert weight layouts", "unknown"): (
        "--moe-single-grouped-bias --moe-single-grouped-weight --moe-use-grouped-tensor "
        "--moe-use-legacy-grouped-gemm --use-grouped-gemm-for-dense-mlp "
        "--use-grouped-gemm-for-shared-expert"
    ),
    ("MoE layer recompute", "lowers"): "--moe-layer-recompute",
    ("MoE upcycling from a dense model", "unknown"): (
        "--moe-use-upcycling --moe-upcycling-granularity"
    ),
    # model variants
    ("activation variants", "either"): "--openai-gelu --use-te-activation-func",
    ("attention variants", "raises"): "--qk-l2-norm --qk-clip",
    ("experimental attention variants (DSA, gated delta product)", "either"): (
        "--dsa-indexer-head-dim --dsa-indexer-k-norm-epsilon "
        "--dsa-indexer-k-norm-fp32 --dsa-indexer-loss-coeff --dsa-indexer-n-heads "
        "--dsa-indexer-rope-interleaved --dsa-indexer-skip-topk-offset --dsa-indexer-topk "
        "--dsa-indexer-topk-freq --dsa-indexer-use-sparse-loss --dsa-kernel-backend "
        "--disable-dsa-indexer-rotate-activation --disable-dsa-indexer-scoring-relu "
        "--no-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu --gdp-cutedsl-kernel "
        "--gdp-num-chunk-states-to-recompute --gdp-num-householder"
    ),
    ("attention kernel generation pinned (FA2/FA3/FA4)", "either"): "--flash-attention-version",
    ("fused residual + RMSNorm", "unknown"): "--fused-residual-rmsnorm",
    # megatron-core 0.19.2 TransformerLayer._forward_mlp: each chunk's activations are saved as
    # the whole MLP's were, its temporaries 1/n as large, and the chunks' outputs concatenated
    # (a second copy of the MLP's output while torch.cat runs).
    ("MLP computed in sequence chunks", "either"): "--mlp-chunks-for-training",
    # megatron-core 0.19.2 TEGroupedMLP.bias_act_func: off the fused TE-op path an interleaved fc1
    # output is reordered by a copy and the fused bias-activation kernel is not used.
    ("GLU activations in an interleaved weight layout", "raises"): (
        "--moe-mlp-glu-interleave-size --moe-shared-expert-glu-interleave-size"
    ),
    ("layers without RoPE", "lowers"): "--no-rope-freq",
    ("fp32 residual stream", "raises"): "--fp32-residual-connection",
    ("embedding output not cloned under sequence parallelism", "either"): (
        "--no-clone-scatter-output-in-embedding --disable-clone-scatter-output-in-embedding"
    ),
    ("multi-token-prediction variants", "either"): ("--mtp-detach-heads --mtp-hsm"),
    ("hyper-connection residual streams (mHC)", "either"): (
        "--enable-mhc-connections --mhc-num-residual-streams --mhc-recompute-layer-num "
        "--mhc-sinkhorn-iterations"
    ),
    # megatron-core 0.19.2: the embedding's output and the logits multiplied out of place
    # (LanguageModelEmbedding.forward, LanguageModule._scale_logits): a second logits tensor.
    ("MuP multipliers", "raises"): "--use-mup --mup-embedding-mult --mup-output-mult",
    ("heterogeneous layers", "either"): (
        "--heterogeneous-layers-config-path --heterogeneous-layers-config-encoded-json"
    ),
    # 0.16.1's MambaModel allocates layers by these ratios without a pattern
    ("hybrid layers allocated by ratios", "either"): "--hybrid-attention-ratio --hybrid-mlp-ratio",
    ("the Mamba-2 state's dtype in training", "either"): "--mamba-training-ssm-states-dtype",
    ("the Muon optimizer's options", "either"): (
        "--muon-tp-mode --muon-no-split-qkv --muon-scalar-optimizer --muon-nesterov "
        "--muon-use-nesterov"
    ),
    ("frozen parameters (no gradients or optimizer state)", "lowers"): (
        "--freeze-all-layers --freeze-base-for-mtp --qad-train-target"
    ),
    ("vocabulary padding off", "lowers"): "--no-pad-vocab-size --disable-pad-vocab-size",
    ("tokens added to the vocabulary", "raises"): "--tokenizer-special-tokens --vocab-extra-ids",
    ("the model or layer spec from elsewhere", "unknown"): (
        "--spec --yaml-cfg --use-checkpoint-args --use-mp-args-from-checkpoint-args "
        "--use-legacy-models"
    ),
    # beside the model
    ("knowledge distillation (a teacher model)", "raises"): (
        "--export-kd-teacher-load --export-kd-teacher-model-config --export-kd-cfg"
    ),
    ("logits distillation", "raises"): "--logits-load-dir --logits-save-dir --logits-save-top-k",
    ("ModelOpt's model builder and layer spec", "either"): (
        "--modelopt-enabled --export-te-mcore-model --export-default-te-spec "
        "--export-force-local-attention --export-legacy-megatron --export-model-type "
        "--export-real-quant-cfg --enable-gpt-oss --export-moe-apply-probs-on-input "
        "--export-qk-l2-norm"
    ),
    ("ModelOpt quantization-aware training", "raises"): (
        "--export-quant-cfg --export-kv-cache-quant"
    ),
    ("ModelOpt offline model (no decoder layers)", "lowers"): "--export-offline-model",
    ("the RL training loop", "raises"): "--perform-rl-step",
    ("max-attention-logit logging (turns flash attention off)", "raises"): (
        "--log-max-attention-logit"
    ),
    ("debug dumps of activations and input gradients", "raises"): (
        "--save-activations-interval --save-dgrads-interval"
    ),
    ("GPU sniff tests", "unknown"): "--gpu-sniff-test-interval",
    ("in-process restart with warm reserve ranks (a smaller data-parallel world)", "raises"): (
        "--inprocess-active-world-size"
    ),
}

# --------------------------------------------------------------------------- the table


def _names(text: str) -> list[str]:
    return text.split()


def _types(name: str) -> Callable[[str], Any]:
    """argparse's converter of a TSV `type` cell. Megatron-LM's own converters of layer
    frequencies (`moe_freq_type` ...) take an integer or a Python list expression; they are kept
    as text here (megatron_args reads them); enum converters take the member's name."""
    return {"int": int, "float": float, "bool": _bool}.get(name, str)


def _bool(text: str) -> bool:
    return bool(text)  # argparse's type=bool: any non-empty value is true


def _default(cell: str) -> Any:
    """The parser's default from its repr in the TSV (enum members by name)."""
    if cell.startswith(("AttnBackend.", "Signals.")):
        return cell.split(".", 1)[1]
    try:
        return ast.literal_eval(cell)
    except (ValueError, SyntaxError):
        return cell


def _rows() -> list[dict[str, str]]:
    text = resources.files("metatrace.config.megatron").joinpath("flags.tsv").read_text()
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    return list(csv.DictReader(lines, delimiter="\t"))


def _classes() -> dict[str, tuple]:
    """Flag -> (class, reason, key, direction), each flag once (a test checks that every flag
    of the TSV is here exactly once)."""
    out: dict[str, tuple] = {}

    def put(flag, value):
        if flag in out:
            raise ValueError(f"{flag} is in two classes of megatron_flags")  # a bug here
        out[flag] = value

    for flag, key in _MODELLED.items():
        put(flag, ("modelled", key or "derived", key, None))
    for flag, message in _REFUSED.items():
        put(flag, ("refused", message, None, None))
    for reason, names in _NO_EFFECT.items():
        for flag in _names(names):
            put(flag, ("no_effect", reason, None, None))
    for (feature, direction), names in _NOT_MODELLED.items():
        for flag in _names(names):
            put(flag, ("not_modelled", feature, None, direction))
    return out


# core_v0.16.1's --lazy-mpu-init took a value (type bool); HEAD's is a switch. Either reads.
_OPTIONAL_VALUE = {"--lazy-mpu-init"}


_COLUMN = {"core_v0.16.1": "in_core_v0.16.1", "core_v0.19.2": "in_core_v0.19.2", "HEAD": "in_head"}


def _versions(parsers: tuple[Parser, ...]) -> Versions:
    if parsers[0] == "core_v0.16.1":
        return "all" if len(parsers) > 1 else "core_v0.16.1"
    return parsers[0]


def _build() -> dict[str, Flag]:
    classes = _classes()
    flags = {}
    for row in _rows():
        name = row["flag"]
        if name not in classes:
            raise ValueError(f"{name} is in no class of megatron_flags")  # a bug here
        cls, reason, key, direction = classes[name]
        kind = row["kind"]
        if name in _OPTIONAL_VALUE:
            nargs: int | str = "?"
        elif kind in ("store_true", "store_false", "boolean_optional", "help"):
            nargs = 0
        else:
            nargs = {"": 1, "+": "+", "*": "*"}.get(row["nargs"], row["nargs"])
            nargs = int(nargs) if isinstance(nargs, str) and nargs.isdigit() else nargs
        # what a switch stores: store_false and the "--no-" half of a boolean pair store False
        const = kind != "store_false" and not (
            kind == "boolean_optional" and name.startswith("--no-")
        )
        choices = (
            tuple(
                c.split(".", 1)[1] if row["type"].startswith("enum_type_handler") else c
                for c in row["choices"].split(",")
            )
            if row["choices"]
            else None
        )
        if choices and row["type"] in ("int", "float"):
            choices = tuple(_types(row["type"])(c) for c in choices)
        parsers = tuple(p for p in PARSERS if row[_COLUMN[p]] == "yes")
        flags[name] = Flag(
            name=name,
            dest=row["dest"],
            nargs=nargs,
            type=_types(row["type"]),
            choices=choices,
            default=_default(row["default"]),
            const=_CONST.get(name, const),
            versions=_versions(parsers),
            cls=cls,
            reason=reason,
            key=key,
            direction=direction,
            parsers=parsers,
        )
    for name, (nargs, cls, reason, direction) in _OLDER.items():
        flags[name] = Flag(
            name=name,
            dest=name[2:].replace("-", "_"),
            nargs=nargs,
            type=str,
            choices=None,
            default=[] if nargs == "+" else None if nargs else False,
            const=True,
            versions="older",
            cls=cls,
            reason=reason,
            direction=direction,
        )
    return flags


# Flags of older Megatron-LM releases that neither parser of the table has (renamed or removed
# since), read as they were and classed like what replaced them: nargs, class, reason, direction.
_OLDER: dict[str, tuple[int | str, Class, str, Direction | None]] = {
    "--use-custom-fsdp": (
        0,
        "not_modelled",
        "FSDP (sharded parameters, gradients and optimizer state)",
        "lowers",
    ),  # renamed --use-megatron-fsdp
    "--fp8-dot-product-attention": (0, "not_modelled", "FP8 attention", "either"),
    "--fp8-multi-head-attention": (0, "not_modelled", "FP8 attention", "either"),
    "--muon-split-qkv": (0, "not_modelled", "the Muon optimizer's options", "either"),
    "--special-tokens": ("+", "not_modelled", "tokens added to the vocabulary", "raises"),
    "--check-for-nan-in-loss-and-grad": (
        0,
        "no_effect",
        "negligible: a few scalars per iteration, not scaling with the model",
        None,
    ),
    "--barrier-with-L1-time": (
        0,
        "no_effect",
        "logging, timers, profiling and telemetry: on the host, or a few scalars",
        None,
    ),
    "--load-model-opt-format": (
        0,
        "no_effect",
        "checkpoints: saved and loaded between iterations, not during them",
        None,
    ),
    "--retriever-seq-length": (
        1,
        "no_effect",
        "other model families (vision, BERT, retrieval, T5): GPT training does not read them",
        None,
    ),
    "--tokenizer-prompt-format": (
        1,
        "no_effect",
        "tokenizer files and behaviour (the vocabulary size is given separately)",
        None,
    ),
}

# Class-3 options (and values) that act only with another option: given without any of these
# (with a value other than its default), they change nothing and are noted as ignored.
_NEEDS_GROUPS: dict[str, str] = {
    "--use-megatron-fsdp --use-torch-fsdp2 --use-custom-fsdp": (
        "--torch-fsdp2-no-reshard-after-forward "
        "--enable-full-sharding-in-hsdp --fsdp-manual-registration --init-model-with-meta-device "
        "--keep-fp8-transpose-cache --megatron-fsdp-enable-fine-grained-param-gather "
        "--megatron-fsdp-max-pool-double-buffer "
        "--megatron-fsdp-version --no-gradient-reduce-div-fusion "
        "--fsdp-db-use-persist-buf-on-alloc-fail"
    ),
    "--fp8-format --fp4-format": (
        "--no-fp8-wgrad --disable-fp8-wgrad --fp8-output-proj --fp8-quantizer-factory "
        "--reuse-grad-buf-for-mxfp8-param-ag --fp8-recipe --te-precision-config-file"
    ),
    "--fp4-format": "--fp4-recipe --fp4-param-gather --fp4-quantizer-factory",
    "--use-mup": "--mup-embedding-mult --mup-output-mult",
    "--use-grouped-gemm-for-shared-expert": "--moe-shared-expert-glu-interleave-size",
    "--enable-mhc-connections": (
        "--mhc-num-residual-streams --mhc-recompute-layer-num --mhc-sinkhorn-iterations"
    ),
    "--experimental-attention-variant": (
        "--dsa-indexer-head-dim "
        "--dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32 --dsa-indexer-loss-coeff "
        "--dsa-indexer-n-heads --dsa-indexer-rope-interleaved --dsa-indexer-skip-topk-offset "
        "--dsa-indexer-topk --dsa-indexer-topk-freq --dsa-indexer-use-sparse-loss "
        "--dsa-kernel-backend --disable-dsa-indexer-rotate-activation "
        "--disable-dsa-indexer-scoring-relu --no-dsa-indexer-rotate-activation "
        "--no-dsa-indexer-scoring-relu --gdp-cutedsl-kernel --gdp-num-chunk-states-to-recompute "
        "--gdp-num-householder"
    ),
    "--hybrid-context-parallel": "--max-seqlen-per-dp-cp-rank",
    "--tensor-parallel-num-weight-shards --expert-tensor-parallel-num-weight-shards": (
        "--gtp-remat-opt-in-modules --gtp-remat-nccl-ub --gtp-expert-remat-nccl-ub "
        "--gtp-remat-reduce-scatter-with-fp32-accumulation"
    ),
    "--use-nccl-ub": "--disable-symmetric-registration",
    "--kitchen-config-file --kitchen-recipe-number --use-kitchen-attention": (
        "--kitchen-attention-backend"
    ),
    "--export-kd-teacher-load": "--export-kd-cfg --export-kd-teacher-model-config",
    "--logits-save-dir": "--logits-save-top-k",
    "--optimizer": (
        "--muon-tp-mode --muon-no-split-qkv --muon-scalar-optimizer --muon-nesterov "
        "--muon-use-nesterov --muon-split-qkv"
    ),
    "--num-experts": (
        "--overlap-moe-expert-parallel-comm --delay-wgrad-compute "
        "--ep-overlap-early-attn-memory-release --overlap-dispatch-backward-with-experts-wgrad "
        "--moe-enable-deepep --moe-flex-dispatcher-backend "
        "--moe-hybridep-pad-uneven-dispatch-inputs --moe-ncclep-zero-copy "
        "--moe-ncclep-static-shape --moe-permute-fusion-into-hybridep --moe-dispatch-fwd-dtype --moe-combine-bwd-dtype "
        "--moe-expert-rank-capacity-factor --moe-paged-stash "
        "--moe-paged-stash-buffer-size-factor-cpu --moe-paged-stash-buffer-size-factor-cuda "
        "--moe-paged-stash-page-size --moe-router-force-biased --moe-input-jitter-eps "
        "--moe-apply-probs-on-input --moe-shared-expert-gate "
        "--use-fused-weighted-squared-relu --moe-single-grouped-bias --moe-single-grouped-weight "
        "--moe-use-grouped-tensor --moe-use-legacy-grouped-gemm --moe-mlp-glu-interleave-size "
        "--use-grouped-gemm-for-shared-expert --moe-layer-recompute --moe-use-upcycling "
        "--moe-upcycling-granularity --moe-router-score-function "
        "--moe-router-load-balancing-type"
    ),
}
NEEDS: dict[str, tuple[str, ...]] = {
    flag: tuple(parents.split())
    for parents, flags in _NEEDS_GROUPS.items()
    for flag in flags.split()
}
"""A class-3 flag (or a flag with values not modelled) -> the options it acts only with."""

FLAGS: dict[str, Flag] = _build()
"""Every Megatron-LM flag (option string) -> Flag."""


# --------------------------------------------------------------------------- environment

# Variables that change what metatrace predicts, and how it reads them (megatron_args._cluster).
ENV_MODELLED = {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0: Transformer Engine trains deterministically (before "
    "sm90 its attention then runs flash-attn); checked with --deterministic-mode",
    "TORCHDYNAMO_DISABLE": "1: megatron-core's torch.compile'd kernels run eagerly",
    "TORCH_COMPILE_DISABLE": "1: megatron-core's torch.compile'd kernels run eagerly",
    "CUBLAS_WORKSPACE_CONFIG": "sizes PyTorch's cuBLAS workspaces "
    "(cluster.cublas_workspace_config)",
    "NVTE_FLASH_ATTN": "checked against --attention-backend (megatron-core asserts they agree)",
    "NVTE_FUSED_ATTN": "checked against --attention-backend (megatron-core asserts they agree)",
    "NVTE_UNFUSED_ATTN": "checked against --attention-backend (megatron-core asserts they agree)",
    "CUDA_DEVICE_MAX_CONNECTIONS": "checked: Megatron-LM asserts 1 with TP or CP before Blackwell",
    "WORLD_SIZE": "checked against the world size",
    "NCCL_NVLS_ENABLE": "0: no NVLS buffers (cluster.nccl_nvls)",
    "NCCL_BUFFSIZE": "NCCL's SIMPLE buffer per connection (cluster.nccl_buffsize)",
    "NCCL_MIN_NCHANNELS": "bounds NCCL's channels per communicator (cluster.nccl_channels)",
    "NCCL_MAX_NCHANNELS": "bounds NCCL's channels per communicator (cluster.nccl_channels)",
    "PYTORCH_CUDA_ALLOC_CONF": "the caching allocator's settings the device-memory verdict "
    "simulates (cluster.allocator_conf)",
    "PYTORCH_ALLOC_CONF": "the caching allocator's settings the device-memory verdict simulates "
    "(cluster.allocator_conf; read before PYTORCH_CUDA_ALLOC_CONF)",
}
# Variables that cannot change allocated memory or traffic: accepted silently.
ENV_NO_EFFECT = {
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "OMP_NUM_THREADS",
    "PYTHONPATH",
    "PYTHONWARNINGS",
    "PYTHONUNBUFFERED",
    "PYTHONHASHSEED",
    "TOKENIZERS_PARALLELISM",
    "NVTE_FWD_LAYERNORM_SM_MARGIN",
    "NVTE_BWD_LAYERNORM_SM_MARGIN",
    "NVTE_DEBUG",
    "NVTE_DEBUG_LEVEL",
    "NVTE_TORCH_COMPILE",
    "CUDNN_LOGLEVEL_DBG",
    "CUBLASLT_LOG_LEVEL",
    "TORCH_CPP_LOG_LEVEL",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_SHOW_CPP_STACKTRACES",
    "TORCH_LOGS",
    "SKIP_PYTEST",
    "N_REPEATS",
    "NON_DETERMINSTIC_RESULTS",
}
ENV_NO_EFFECT_PREFIXES = (
    "NCCL_",  # the same collectives run (those that size NCCL's buffers are listed above)
    "TORCH_NCCL_",
    "TORCHELASTIC_",
    "TORCHINDUCTOR_",
    "TRITON_",
    "UCX_",
    "NVSHMEM_",
    "OMPI_",
    "PMIX_",
    "SLURM_",
    "HF_",
    "WANDB_",
    "TRANSFORMERS_",
)
# Variables that change memory in ways metatrace does not model.
ENV_NOT_MODELLED: dict[str, tuple[str, Direction]] = {
    # NVFP4BlockScaling's switches (TE 2.8 common/recipe/__init__.py:412-416)
    "NVTE_NVFP4_DISABLE_RHT": ("NVFP4 without the random Hadamard transform", "either"),
    "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": (
        "NVFP4 gradients without stochastic rounding",
        "either",
    ),
    "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": ("NVFP4 weights in 1x16 blocks", "unknown"),
    "NVTE_FUSED_ATTN_BACKEND": ("a cuDNN attention sub-backend chosen by hand", "either"),
    "NVTE_CPU_OFFLOAD_V1": ("Transformer Engine's first CPU-offloading implementation", "either"),
    "PYTORCH_NO_CUDA_MEMORY_CACHING": ("PyTorch's caching allocator switched off", "unknown"),
    **{
        # NCCL's device buffers sized or placed otherwise than the verdict's estimate assumes
        name: ("NCCL's device buffers outside the allocator, sized otherwise", "either")
        for name in (
            "NCCL_LL_BUFFSIZE",
            "NCCL_LL128_BUFFSIZE",
            "NCCL_P2P_NET_CHUNKSIZE",
            "NCCL_P2P_NVL_CHUNKSIZE",
            "NCCL_NVLS_CHUNKSIZE",
            "NCCL_MAX_P2P_NCHANNELS",
            "NCCL_NCHANNELS_PER_NET_PEER",
            "NCCL_CUMEM_ENABLE",
            "NCCL_RUNTIME_CONNECT",
            "NCCL_P2P_READ_ENABLE",
            "NCCL_SHM_USE_CUDA_MEMCPY",
            "NCCL_COMM_SPLIT_SHARE_RESOURCES",
            "NCCL_WORK_FIFO_BYTES",
        )
    },
}
# Variables whose values the run parses, and how (a value it cannot parse is refused by name,
# whether or not it changes what metatrace predicts): "int" as Python's int() reads it (Transformer
# Engine's int(os.getenv(...)), torch.distributed's WORLD_SIZE, the CUDA driver's count), "0/1"
# for PyTorch's switches, which take "1" alone as set (torch/_dynamo/config.py) and so would take
# "true" silently for unset.
ENV_FORMATS: dict[str, Literal["int", "0/1"]] = {
    "NVTE_FLASH_ATTN": "int",
    "NVTE_FUSED_ATTN": "int",
    "NVTE_UNFUSED_ATTN": "int",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "int",
    "NVTE_FUSED_ATTN_BACKEND": "int",
    "CUDA_DEVICE_MAX_CONNECTIONS": "int",
    "WORLD_SIZE": "int",
    "NCCL_NVLS_ENABLE": "int",
    "NCCL_BUFFSIZE": "int",
    "NCCL_MIN_NCHANNELS": "int",
    "NCCL_MAX_NCHANNELS": "int",
    "TORCHDYNAMO_DISABLE": "0/1",
    "TORCH_COMPILE_DISABLE": "0/1",
}
# CUDA_DEVICE_MAX_CONNECTIONS aside, these are what the attention backends set (megatron-core
# 0.16.1 LanguageModule._set_attention_backend: each --attention-backend sets
# (NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN) and asserts that a value already in the
# environment is the same, so these variables can confirm the backend but never choose it).
NVTE_ATTN = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
NVTE_FOR_BACKEND = {
    "local": (0, 0, 0),
    "flash": (1, 0, 0),
    "fused": (0, 1, 0),
    "unfused": (0, 0, 1),
    "auto": (1, 1, 1),
}
GPT2_VOCAB = 50257  # GPT-2 BPE tokens (notes 4.4)
