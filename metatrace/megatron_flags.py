"""The Megatron-LM flags metatrace knows: one declarative table (`FLAGS`).

Every flag is in one of three classes (see metatrace.megatron_args): modelled (it sets a job key
or a derivation reads it), accepted silently (it changes nothing metatrace models), or known but
not modelled yet (`Flag.reason`). Flags Megatron-LM refuses carry its message (`Flag.removed`).
Written from ../shared/notes/megatron-args.md and Megatron-LM's argument groups (tag
core_v0.16.1, plus the flags its HEAD added, since Megatron-LM's CI runs HEAD).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

@dataclass(frozen=True)
class Flag:
    """One Megatron-LM flag."""

    nargs: int | str = 1
    """0: a bare switch; 1: one value; "+": one or more values; "*": zero or more."""
    type: Callable = str
    choices: tuple | None = None
    key: str | None = None
    """Job key the flag sets as it is ("model.num_layers"); None: a derivation below reads it."""
    const: Any = True
    """What a bare switch sets `key` to."""
    ignored: bool = False
    """Class 2: accepted, changes nothing metatrace models."""
    reason: str | None = None
    """Class 3: what metatrace does not model yet."""
    removed: str | None = None
    """Megatron-LM refuses the flag with this message."""


def _value(key=None, type=str, choices=None, nargs=1):
    return Flag(nargs=nargs, type=type, choices=choices, key=key)


def _switch(key=None, const=True):
    return Flag(nargs=0, key=key, const=const)


def _group(names: str, **spec) -> dict[str, Flag]:
    """Flags written compactly: `--flag` a switch, `--flag=` one value, `--flag=+` one or more
    values, `--flag=*` any number (also where Megatron-LM's arity is not pinned down here)."""
    out = {}
    for item in names.split():
        name, eq, arity = item.partition("=")
        out[name] = Flag(nargs=(arity or 1) if eq else 0, **spec)
    return out


_TOKENIZERS = (
    "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
    "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer",
)
_GPT2_VOCAB = 50257  # GPT-2 BPE tokens (notes 4.4)
_DTYPES = ("fp32", "fp16", "bf16", "fp8")

# Class 1: flags that set job keys. `key=None` ones are read by the derivations below.
_MODELLED: dict[str, Flag] = {
    # model shape (notes 4.1-4.3)
    "--num-layers": _value("model.num_layers", int),
    "--encoder-num-layers": _value(None, int),  # the same as --num-layers for GPT
    "--hidden-size": _value("model.hidden_size", int),
    "--ffn-hidden-size": _value("model.ffn_hidden_size", int),
    "--num-attention-heads": _value("model.num_attention_heads", int),
    "--group-query-attention": _switch(),
    "--num-query-groups": _value(None, int),
    "--kv-channels": _value("model.kv_channels", int),
    "--max-position-embeddings": _value("model.max_position_embeddings", int),
    "--hidden-dropout": _value("model.hidden_dropout", float),
    "--attention-dropout": _value("model.attention_dropout", float),
    # yarn is HEAD-only; accepted so that newer command lines read (and then warned about).
    "--position-embedding-type": _value(
        None, choices=("learned_absolute", "rope", "yarn", "mrope", "relative", "none")
    ),
    "--use-rotary-position-embeddings": _switch(),
    "--no-position-embedding": _switch(),
    "--rotary-base": _value("model.rotary_base", int),
    "--rotary-percent": _value("model.rotary_percent", float),
    "--normalization": _value("model.normalization", choices=("LayerNorm", "RMSNorm")),
    "--norm-epsilon": _value("model.norm_epsilon", float),
    "--swiglu": _switch(),
    "--squared-relu": _switch(),
    "--disable-bias-linear": _switch("model.add_bias_linear", False),
    "--add-qkv-bias": _switch(),
    "--qk-layernorm": _switch("model.qk_layernorm"),
    "--untie-embeddings-and-output-weights": _switch("model.untie_embeddings_and_output_weights"),
    "--make-vocab-size-divisible-by": _value("model.make_vocab_size_divisible_by", int),
    "--tokenizer-type": _value(None, choices=_TOKENIZERS),
    "--vocab-size": _value(None, int),
    "--padded-vocab-size": _value(None, int),
    "--seq-length": _value("training.seq_length", int),
    "--encoder-seq-length": _value(None, int),  # the same as --seq-length for GPT
    # parallelism (notes 4.6)
    "--tensor-model-parallel-size": _value("parallel.tp", int),
    "--pipeline-model-parallel-size": _value("parallel.pp", int),
    "--num-layers-per-virtual-pipeline-stage": _value(None, int),
    "--num-virtual-stages-per-pipeline-rank": _value(None, int),
    "--decoder-first-pipeline-num-layers": _value("parallel.first_stage_layers", int),
    "--decoder-last-pipeline-num-layers": _value("parallel.last_stage_layers", int),
    "--account-for-embedding-in-pipeline-split": _switch("parallel.account_for_embedding"),
    "--account-for-loss-in-pipeline-split": _switch("parallel.account_for_loss"),
    "--pipeline-model-parallel-layout": _value(None),
    "--sequence-parallel": _switch("parallel.sequence_parallel"),
    "--context-parallel-size": _value("parallel.cp", int),
    "--cp-comm-type": _value(None, choices=("p2p", "a2a", "allgather", "a2a+p2p"), nargs="+"),
    "--hierarchical-context-parallel-sizes": _value(
        "parallel.hierarchical_cp_sizes", int, nargs="+"
    ),
    "--expert-model-parallel-size": _value("parallel.ep", int),
    "--expert-tensor-parallel-size": _value(None, int),
    # mixture of experts
    "--num-experts": _value(None, int),
    "--moe-layer-freq": _value(None),
    "--moe-ffn-hidden-size": _value("model.moe_ffn_hidden_size", int),
    "--moe-shared-expert-intermediate-size": _value(
        "model.moe_shared_expert_intermediate_size", int
    ),
    "--moe-shared-expert-overlap": _switch("parallel.moe_shared_expert_overlap"),
    "--moe-grouped-gemm": _switch("implementation.moe_grouped_gemm"),
    "--moe-router-load-balancing-type": _value(
        None, choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"),
        nargs="+",
    ),
    "--moe-router-dtype": _value("training.moe_router_dtype", choices=("fp32", "fp64")),
    "--moe-router-score-function": _value(
        "model.moe_router_score_function", choices=("softmax", "sigmoid")
    ),
    "--moe-router-topk": _value("model.moe_router_topk", int),
    "--moe-router-pre-softmax": _switch("model.moe_router_pre_softmax"),
    "--moe-router-num-groups": _value("model.moe_router_num_groups", int),
    "--moe-router-group-topk": _value("model.moe_router_group_topk", int),
    "--moe-router-topk-scaling-factor": _value("model.moe_router_topk_scaling_factor", float),
    "--moe-router-enable-expert-bias": _switch("model.moe_router_enable_expert_bias"),
    "--moe-aux-loss-coeff": _value(None, float, nargs="+"),
    "--moe-z-loss-coeff": _value("model.moe_z_loss_coeff", float),
    "--moe-token-dispatcher-type": _value(
        "parallel.moe_token_dispatcher_type", choices=("allgather", "alltoall", "flex")
    ),
    "--moe-expert-capacity-factor": _value("training.moe_expert_capacity_factor", float),
    "--moe-pad-expert-input-to-capacity": _switch(),
    # multi-latent attention (its rotary scaling too) and multi-token prediction (notes 4.8)
    "--multi-latent-attention": _switch("model.multi_latent_attention"),
    "--q-lora-rank": _value("model.q_lora_rank", int),
    "--kv-lora-rank": _value("model.kv_lora_rank", int),
    "--qk-head-dim": _value("model.qk_head_dim", int),
    "--qk-pos-emb-head-dim": _value("model.qk_pos_emb_head_dim", int),
    "--v-head-dim": _value("model.v_head_dim", int),
    "--rope-type": _value("model.rope_type", choices=("rope", "yarn")),
    "--rotary-scaling-factor": _value("model.rotary_scaling_factor", float),
    "--mscale": _value("model.mscale", float),
    "--mscale-all-dim": _value("model.mscale_all_dim", float),
    "--mtp-num-layers": _value("model.mtp_num_layers", int),
    "--mtp-loss-scaling-factor": _value("model.mtp_loss_scaling_factor", float),
    "--use-tp-pp-dp-mapping": _switch("parallel.rank_order", "tp-cp-ep-pp-dp"),
    "--microbatch-group-size-per-virtual-pipeline-stage": _value("parallel.microbatch_group_size", int),
    "--no-overlap-p2p-communication": _switch("parallel.overlap_p2p_comm", False),
    "--overlap-p2p-communication-warmup-flush": _switch("parallel.overlap_p2p_comm_warmup_flush"),
    # training (notes 4.5, 4.9, 4.10, 4.12)
    "--micro-batch-size": _value("training.micro_batch_size", int),
    "--global-batch-size": _value("training.global_batch_size", int),
    "--bf16": _switch(),
    "--fp16": _switch(),
    "--fp8-format": _value(None, choices=("e4m3", "hybrid")),
    "--fp8-recipe": _value(None, choices=("tensorwise", "delayed", "mxfp8", "blockwise", "custom")),
    "--fp8-param-gather": _switch(),
    "--recompute-activations": _switch(),
    "--recompute-granularity": _value(None, choices=("full", "selective")),
    "--recompute-method": _value(None, choices=("uniform", "block")),
    "--recompute-num-layers": _value(None, int),
    "--recompute-modules": _value(None, nargs="*"),
    "--distribute-saved-activations": _switch("training.recompute.distribute_saved_activations"),
    "--use-distributed-optimizer": _switch("training.distributed_optimizer"),
    "--overlap-grad-reduce": _switch("training.overlap_grad_reduce"),
    "--overlap-param-gather": _switch("training.overlap_param_gather"),
    "--overlap-param-gather-with-optimizer-step": _switch(
        "training.overlap_param_gather_with_optimizer_step"
    ),
    "--num-distributed-optimizer-instances": _value(
        "training.num_distributed_optimizer_instances", int
    ),
    "--accumulate-allreduce-grads-in-fp32": _switch(),
    "--grad-reduce-in-bf16": _switch(),
    "--ddp-bucket-size": _value("training.ddp_bucket_size", int),
    "--ddp-average-in-collective": _switch("training.ddp_average_in_collective"),
    # lion, soap, adaptive_muon are HEAD-only (notes 5).
    "--optimizer": _value(
        None, choices=("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon")
    ),
    "--sgd-momentum": _value("training.sgd_momentum", float),
    "--use-precision-aware-optimizer": _switch("training.use_precision_aware_optimizer"),
    "--main-grads-dtype": _value("training.main_grads_dtype", choices=("fp32", "bf16")),
    "--main-params-dtype": _value("training.main_params_dtype", choices=("fp32", "fp16")),
    "--exp-avg-dtype": _value("training.exp_avg_dtype", choices=_DTYPES),
    "--exp-avg-sq-dtype": _value("training.exp_avg_sq_dtype", choices=_DTYPES),
    "--clip-grad": _value("training.clip_grad", float),
    "--log-num-zeros-in-grad": _switch("training.log_num_zeros_in_grad"),
    "--no-gradient-accumulation-fusion": _switch("training.gradient_accumulation_fusion", False),
    "--calculate-per-token-loss": _switch("training.calculate_per_token_loss"),
    "--no-create-attention-mask-in-dataloader": _switch(
        "training.create_attention_mask_in_dataloader", False
    ),
    # implementation (notes 4.10, 4.11)
    "--transformer-impl": _value(
        None, choices=("local", "transformer_engine", "inference_optimized")
    ),
    "--attention-backend": _value(None, choices=("flash", "fused", "unfused", "local", "auto")),
    "--no-rope-fusion": _switch(),
    "--cross-entropy-loss-fusion": _switch("implementation.cross_entropy_loss_fusion"),
    "--cross-entropy-fusion-impl": _value(
        "implementation.cross_entropy_fusion_impl", choices=("native", "te")
    ),
    "--no-bias-gelu-fusion": _switch(),
    "--no-bias-swiglu-fusion": _switch(),
    "--no-bias-dropout-fusion": _switch("implementation.bias_dropout_fusion", False),
    "--no-masked-softmax-fusion": _switch("implementation.masked_softmax_fusion", False),
    "--attention-softmax-in-fp32": _switch("implementation.attention_softmax_in_fp32"),
    "--apply-query-key-layer-scaling": _switch("implementation.apply_query_key_layer_scaling"),
}

# Megatron-LM refuses these (validate_args asserts, or its TransformerConfig raises).
_REMOVED = {
    "--batch-size": Flag(removed="--batch-size is no longer valid; use --micro-batch-size"),
    "--warmup": Flag(removed="--warmup is no longer valid; use --lr-warmup-fraction"),
    "--model-parallel-size": Flag(
        removed="--model-parallel-size is no longer valid; use --tensor-model-parallel-size"
    ),
    "--checkpoint-activations": Flag(
        nargs=0, removed="--checkpoint-activations is no longer valid; use --recompute-activations"
    ),
    "--init-method-xavier-uniform": Flag(
        nargs=0,
        removed="--init-method-xavier-uniform is broken in Megatron-LM (its TransformerConfig "
        "gets an unknown keyword, notes 4.1)",
    ),
}

# Class 2: accepted silently, they change nothing metatrace models.
_IGNORED = _group(
    # logging, profiling, fault tolerance
    "--log-interval= --log-params-norm --log-throughput --log-progress --log-energy "
    "--timing-log-level= --timing-log-option= --barrier-with-L1-time --tensorboard-dir= "
    "--tensorboard-log-interval= --tensorboard-queue-size= --log-timers-to-tensorboard "
    "--no-log-loss-scale-to-tensorboard --log-validation-ppl-to-tensorboard "
    "--log-memory-to-tensorboard --log-world-size-to-tensorboard --log-device-memory-used "
    "--wandb-project= --wandb-exp-name= --wandb-save-dir= --wandb-entity= --logging-level= "
    "--log-straggler --disable-straggler-on-startup --straggler-ctrlr-port= "
    "--straggler-minmax-count= --run-workload-inspector-server --profile --use-pytorch-profiler "
    "--profile-step-start= --profile-step-end= --profile-ranks=+ --record-memory-history "
    "--memory-snapshot-path= --no-one-logger --one-logger-project= --one-logger-run-name= "
    "--one-logger-async --app-tag-run-name= --app-tag-run-version= --enable-ft-package "
    "--calc-ft-timeouts --config-logger-dir= --disable-msc --adlr-autoresume "
    "--adlr-autoresume-interval= --rerun-mode= --error-injection-rate= --error-injection-type= "
    "--result-rejected-tracker-filename= --iterations-to-skip=+ --check-for-nan-in-loss-and-grad "
    "--no-check-for-nan-in-loss-and-grad --check-for-spiky-loss --check-for-large-grads "
    "--check-weight-hash-across-dp-replicas-interval= --verify-integrity "
    # checkpoints
    "--save= --load= --save-interval= --save-retain-interval= --no-save-optim --no-save-rng "
    "--no-load-optim --no-load-rng --load-main-params-from-ckpt --non-persistent-save-interval= "
    "--non-persistent-ckpt-type= --non-persistent-global-ckpt-dir= "
    "--non-persistent-local-ckpt-dir= --non-persistent-local-ckpt-algo= --finetune "
    "--pretrained-checkpoint= --ckpt-step= --no-initialization --exit-on-missing-checkpoint "
    "--no-use-tokenizer-model-from-checkpoint-args --use-dist-ckpt --auto-detect-ckpt-format "
    "--dist-ckpt-format= --ckpt-format= --ckpt-convert-format= --ckpt-convert-save= "
    "--ckpt-convert-update-legacy-dist-opt-format --ckpt-fully-parallel-save "
    "--no-ckpt-fully-parallel-save --ckpt-fully-parallel-load --ckpt-assume-constant-structure "
    "--dist-ckpt-strictness= --dist-ckpt-save-pre-mcore-014 --dist-ckpt-optim-fully-reshardable "
    "--distrib-optim-fully-reshardable-mem-efficient --load-model-opt-format= --async-save "
    "--use-persistent-ckpt-worker "
    # learning rate, weight decay, Adam, loss scale, initialisation, seed
    "--lr= --lr-decay-style= --lr-wsd-decay-style= --lr-decay-iters= --lr-decay-samples= "
    "--lr-wsd-decay-samples= --lr-wsd-decay-iters= --lr-warmup-fraction= --lr-warmup-iters= "
    "--lr-warmup-samples= --lr-warmup-init= --min-lr= --decoupled-lr= --decoupled-min-lr= "
    "--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler --weight-decay= "
    "--start-weight-decay= --end-weight-decay= --weight-decay-incr-style= --adam-beta1= "
    "--adam-beta2= --adam-eps= --loss-scale= --initial-loss-scale= --min-loss-scale= "
    "--loss-scale-window= --hysteresis= --init-method-std= --embedding-init-method-std= "
    "--seed= --data-parallel-random-init --use-cpu-initialization "
    # iterations, evaluation, exit
    "--train-iters= --train-samples= --eval-iters= --eval-interval= --test-mode --skip-train "
    "--full-validation --multiple-validation-sets --exit-interval= --exit-duration-in-mins= "
    "--exit-signal-handler --exit-signal= --exit-signal-handler-for-dataloader "
    "--train-sync-interval= "
    # data and tokenizer files (the tokenizer type decides the vocabulary)
    "--data-path=* --train-data-path=* --valid-data-path=* --test-data-path=* --split= "
    "--data-args-path= --per-split-data-args-path= --data-cache-path= --no-mmap-bin-files "
    "--mock-data --num-workers= --dataloader-type= --num-dataset-builder-threads= "
    "--object-storage-cache-path= --mid-level-dataset-surplus= --reset-position-ids "
    "--reset-attention-mask --eod-mask-loss --retriever-seq-length= --sample-rate= --mask-prob= "
    "--short-seq-prob= --vocab-file= --merge-file= --tokenizer-model= --tiktoken-pattern= "
    "--tiktoken-num-special-tokens= --tiktoken-special-tokens=+ --special-tokens=+ "
    "--tokenizer-prompt-format= --sft-tokenizer-prompt-format= --vocab-extra-ids= "
    "--legacy-tokenizer --trust-remote-code --no-pad-vocab-size "
    # runtime: process groups, determinism, memory housekeeping
    "--distributed-backend= --distributed-timeout-minutes= --local-rank= --lazy-mpu-init "
    "--fake-process-group --disable-gloo-process-groups --nccl-communicator-config-path= "
    "--high-priority-stream-groups=* --pipeline-model-parallel-comm-backend= "
    "--deterministic-mode --manual-gc --manual-gc-interval= --no-manual-gc-eval "
    "--empty-unused-memory-level= --use-mcore-models --enable-experimental "
    "--no-async-tensor-model-parallel-allreduce --disable-bf16-reduced-precision-matmul "
    "--te-rng-tracker --inference-rng-tracker "
    # no-ops in 0.16.1 or values that only apply when an unmodelled feature is on (notes 4.2,
    # 4.11, 4.12): the data-parallel sharding strategy is copied even without FSDP.
    "--use-flash-attn --no-persist-layer-norm --rotary-interleaved --use-rope-scaling "
    "--rope-scaling-factor= --rotary-seq-len-interpolation-factor= "
    "--data-parallel-sharding-strategy= "
    "--fp8-margin= --fp8-interval= --fp8-amax-compute-algo= "
    # inference-only
    "--inference-batch-times-seqlen-threshold= --max-tokens-to-oom= --inference-max-requests= "
    "--inference-max-seq-length= --flash-decode --output-bert-embeddings --bert-embedder-type= "
    "--symmetric-ar-type= --nccl-all-reduce-for-prefill --mlp-chunks-for-prefill= "
    "--cache-mla-latents "
    # MoE values that allocate nothing: the expert-bias update rate, which tokens a full expert
    # drops, logging; forced load balancing is what metatrace's balanced routing assumes.
    "--moe-router-bias-update-rate= --moe-token-drop-policy= --moe-per-layer-logging "
    "--moe-router-force-load-balancing",
    ignored=True,
)

_MOE = "mixture-of-experts options"
# Class 3: known, not modelled yet. Reason -> flags.
_NOT_MODELLED_GROUPS = {
    _MOE: "--moe-use-legacy-grouped-gemm --moe-layer-recompute --moe-extended-tp "
    "--moe-use-upcycling --moe-upcycling-granularity= --moe-router-fusion "
    "--moe-router-padding-for-fp8 --moe-router-padding-for-quantization "
    "--moe-input-jitter-eps= --moe-enable-deepep --moe-flex-dispatcher-backend= "
    "--moe-deepep-num-sms= --moe-hybridep-num-sms= --moe-permute-fusion "
    "--moe-apply-probs-on-input --moe-shared-expert-gate --moe-latent-size= "
    "--overlap-moe-expert-parallel-comm --delay-wgrad-compute",
    "CUDA graphs": "--cuda-graph-impl= --cuda-graph-scope=+ --cuda-graph-modules=+ "
    "--cuda-graph-warmup-steps= --enable-cuda-graph --external-cuda-graph",
    "TP communication overlap (userbuffers)": "--tp-comm-overlap --tp-comm-overlap-cfg= "
    "--disable-tp-comm-overlap-ag --disable-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad "
    "--disable-tp-comm-bulk-dgrad --disable-tp-comm-bulk-wgrad --tp-comm-bootstrap-backend= "
    "--disable-tp-comm-split-ag --disable-tp-comm-split-rs",
    "FSDP": "--use-torch-fsdp2 --torch-fsdp2-no-reshard-after-forward --use-megatron-fsdp "
    "--use-custom-fsdp --fsdp-double-buffer --suggested-communication-unit-size= "
    "--keep-fp8-transpose-cache --enable-full-sharding-in-hsdp --outer-dp-sharding-strategy= "
    "--no-gradient-reduce-div-fusion --init-model-with-meta-device --use-nccl-ub "
    "--disable-symmetric-registration",
    "optimizer CPU offload": "--optimizer-cpu-offload --optimizer-offload-fraction= "
    "--use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-grads "
    "--no-pin-cpu-params",
    "the Muon optimizer": "--muon-momentum= --muon-split-qkv=* --muon-no-split-qkv=* "
    "--muon-use-nesterov --muon-scale-mode= --muon-fp32-matmul-prec= --muon-num-ns-steps= "
    "--muon-tp-mode= --muon-extra-scale-factor=",
    "pipeline schedule options": "--use-ring-exchange-p2p --no-scatter-gather-tensors-in-pipeline",
    "gradient and parameter communication options": "--no-align-grad-reduce --no-align-param-gather --ddp-pad-buckets-for-high-nccl-busbw "
    "--ddp-num-buckets= --ddp-reduce-scatter-with-fp32-accumulation=* "
    "--defer-embedding-wgrad-compute --wgrad-deferral-limit= --use-sharp --sharp-enabled-group=",
    "low-precision options": "--first-last-layers-bf16 --num-layers-at-start-in-bf16= "
    "--num-layers-at-end-in-bf16= --fp8-amax-history-len= --no-fp8-wgrad "
    "--fp8-dot-product-attention --fp8-multi-head-attention --fp4-format= --fp4-recipe= "
    "--fp4-param-gather --fp8-quantizer-factory= --fp4-quantizer-factory= "
    "--te-precision-config-file= --reuse-grad-buf-for-mxfp8-param-ag --kitchen-config-file= "
    "--kitchen-recipe-number=",
    "batch-size schedules": "--rampup-batch-size=* --decrease-batch-size-if-needed "
    "--step-batch-size-schedule=",
    "model variants": "--apply-layernorm-1p --apply-residual-connection-post-layernorm "
    "--openai-gelu --onnx-safe=* --quick-geglu --qk-l2-norm --window-size=* "
    "--window-attn-skip-freq=* --fp32-residual-connection --fp16-lm-cross-entropy "
    "--no-clone-scatter-output-in-embedding --disable-jit-fuser --softmax-type= "
    "--glu-linear-offset= --activation-func-clamp-value= --use-te-activation-func "
    "--mrope-section=+ --relative-attention-num-buckets= --relative-attention-max-distance= "
    "--heterogeneous-layers-config-path= --heterogeneous-layers-config-encoded-json= "
    "--hybrid-attention-ratio= --hybrid-mlp-ratio= --hybrid-override-pattern= "
    "--decoder-num-layers= --decoder-seq-length= --sft",
    "arguments or layer specs from elsewhere": "--spec=* --yaml-cfg= --use-checkpoint-args "
    "--use-mp-args-from-checkpoint-args --use-legacy-models",
    "in-memory checkpoint replication": "--replication --replication-jump= --replication-factor=",
}

FLAGS: dict[str, Flag] = {**_MODELLED, **_REMOVED, **_IGNORED}
for _reason, _names in _NOT_MODELLED_GROUPS.items():
    FLAGS.update(_group(_names, reason=_reason))

NOT_MODELLED_REASONS: dict[str, str] = {f: s.reason for f, s in FLAGS.items() if s.reason}
"""Class-3 flag -> what metatrace does not model yet (for a calibration harness)."""

# Environment variables of a run. Megatron-LM's CI passes its own harness variables too.
_ENV_NAMES = {
    "CUBLAS_WORKSPACE_CONFIG", "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_ALGO",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN",
    "PYTORCH_CUDA_ALLOC_CONF", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
    "PYTHONPATH", "SKIP_PYTEST", "N_REPEATS", "NON_DETERMINSTIC_RESULTS",
}
_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "CUBLAS_")
# megatron-core 0.16.1 LanguageModule._set_attention_backend: each --attention-backend sets
# (NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN) and asserts that a value already in
# the environment is the same, so these variables can confirm the backend but never choose it.
_NVTE_ATTN = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
_NVTE_FOR_BACKEND = {
    "local": (0, 0, 0), "flash": (1, 0, 0), "fused": (0, 1, 0), "unfused": (0, 0, 1),
    "auto": (1, 1, 1),
}

