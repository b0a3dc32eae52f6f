"""Megatron-LM `pretrain_gpt.py` arguments -> a metatrace job.

Users may describe a run by the arguments they give Megatron-LM instead of a YAML job. This
module reads them (a token list, a line or training script, or a `{"--flag": value}` mapping),
checks every flag against one declarative table (`FLAGS`) and derives the job mapping that
`metatrace.config.job_from_dict` takes, the way Megatron-LM at tag core_v0.16.1 derives its
settings (../shared/notes/megatron-args.md, sections 1, 2, 4 and 6).

Every flag is in one of three classes:
1. modelled: it sets job keys (directly through `Flag.key`, or in the derivations below);
2. accepted silently: it changes nothing metatrace models (logging, data, checkpoints, the
   learning-rate schedule, ...);
3. known but not modelled yet (`Flag.reason`): accepted, and listed in one warning; the job
   describes the run without it (a mixture-of-experts model becomes its dense counterpart).
A flag that Megatron-LM does not have is an error that suggests the closest known flag.

Known limitations: the table was written from the notes and Megatron-LM's argument groups, not
from a dump of its parser, so a rarely used flag may be missing (an error names it) or may take
a value where this table says not; flags that Megatron-LM itself refuses or that crash it are
errors here too.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from metatrace.errors import ConfigError


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
    "--expert-model-parallel-size": _value(None, int),
    "--expert-tensor-parallel-size": _value(None, int),
    "--use-tp-pp-dp-mapping": _switch("parallel.rank_order", "tp-cp-ep-pp-dp"),
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
    "--rope-scaling-factor= --rotary-seq-len-interpolation-factor= --rope-type= "
    "--rotary-scaling-factor= --mscale= --mscale-all-dim= --data-parallel-sharding-strategy= "
    "--fp8-margin= --fp8-interval= --fp8-amax-compute-algo= "
    # inference-only
    "--inference-batch-times-seqlen-threshold= --max-tokens-to-oom= --inference-max-requests= "
    "--inference-max-seq-length= --flash-decode --output-bert-embeddings --bert-embedder-type= "
    "--symmetric-ar-type= --nccl-all-reduce-for-prefill --mlp-chunks-for-prefill=",
    ignored=True,
)

_MOE = "mixture of experts"
# Class 3: known, not modelled yet. Reason -> flags.
_NOT_MODELLED_GROUPS = {
    _MOE: "--num-experts= --moe-layer-freq= --moe-ffn-hidden-size= "
    "--moe-shared-expert-intermediate-size= --moe-shared-expert-overlap --moe-grouped-gemm "
    "--moe-use-legacy-grouped-gemm --moe-layer-recompute --moe-extended-tp --moe-use-upcycling "
    "--moe-upcycling-granularity= --moe-router-load-balancing-type=+ --moe-router-dtype= "
    "--moe-router-fusion --moe-router-score-function= --moe-router-topk= "
    "--moe-router-pre-softmax --moe-router-num-groups= --moe-router-group-topk= "
    "--moe-router-topk-scaling-factor= --moe-router-enable-expert-bias "
    "--moe-router-bias-update-rate= --moe-router-force-load-balancing "
    "--moe-router-padding-for-fp8 --moe-router-padding-for-quantization --moe-aux-loss-coeff=+ "
    "--moe-z-loss-coeff= --moe-input-jitter-eps= --moe-per-layer-logging "
    "--moe-token-dispatcher-type= --moe-enable-deepep --moe-flex-dispatcher-backend= "
    "--moe-deepep-num-sms= --moe-hybridep-num-sms= --moe-permute-fusion "
    "--moe-expert-capacity-factor= --moe-pad-expert-input-to-capacity --moe-token-drop-policy= "
    "--moe-apply-probs-on-input --moe-shared-expert-gate --moe-latent-size= "
    "--overlap-moe-expert-parallel-comm --delay-wgrad-compute",
    "multi-latent attention": "--multi-latent-attention --q-lora-rank= --kv-lora-rank= "
    "--qk-head-dim= --qk-pos-emb-head-dim= --v-head-dim= --cache-mla-latents",
    "multi-token prediction": "--mtp-num-layers= --mtp-loss-scaling-factor=",
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
    "pipeline schedule options": "--overlap-p2p-communication-warmup-flush "
    "--microbatch-group-size-per-virtual-pipeline-stage= --no-overlap-p2p-communication "
    "--use-ring-exchange-p2p --no-scatter-gather-tensors-in-pipeline",
    "gradient and parameter communication options": "--overlap-param-gather-with-optimizer-step "
    "--no-align-grad-reduce --no-align-param-gather --ddp-pad-buckets-for-high-nccl-busbw "
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
_MOE_RECOMPUTE = ("moe_act", "moe", "shared_experts")


# --------------------------------------------------------------------------- reading


def split_args(text: str) -> list[str]:
    """The arguments in `text`: one line of flags, or a training script.

    Accepted, as a POSIX shell reads it: quotes, backslash escapes, backslash-newline
    continuations and `#` comments. The text is cut into commands at newlines and `;`, `&`,
    `|`; a redirection (`> log`, `2>&1`) ends its command. The arguments are those of the
    first command holding a word that starts with `--`, past its launcher: if a word ending in
    `.py` (the training script) is there, everything up to it is dropped (`torchrun
    --nproc_per_node 8 pretrain_gpt.py ...`), otherwise everything before the first `--` word.
    The commands right after it that start with `--` continue the arguments (a file with a
    flag per line, or comment lines amid continuations). Other commands before it (`cd`,
    `export FOO=1`, `FOO=bar`) and after it are ignored, but arguments that use a shell
    variable (`$FOO`, `${FOO}`) are an error: metatrace does not expand them.
    """
    assigned: dict[str, int] = {}
    args: list[_Word] | None = None
    for words in _commands(text):
        if args is not None:
            if not words[0].text.startswith("--"):
                break
            args += words
            continue
        k = 1 if words[0].text in ("export", "declare") else 0
        while k < len(words) and _ASSIGNMENT.match(words[k].text):
            assigned.setdefault(words[k].text.split("=", 1)[0], words[k].line)
            k += 1
        if any(w.text.startswith("--") for w in words[k:]):
            args = _past_launcher(words[k:])
    used = sorted({name for w in args or () for name in w.variables})
    if used:
        where = [f"${n} (set on line {assigned[n]})" if n in assigned else f"${n}" for n in used]
        raise ConfigError(
            f"the arguments use shell variables {', '.join(where)}; metatrace does not "
            "expand shell variables: write their values into the arguments"
        )
    return [w.text for w in args or ()]


def read_args_file(path) -> list[str]:
    """The arguments in a file: a line or training script (`split_args`), or a YAML/JSON mapping
    `{"--flag": value}` (`args_from_mapping`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise ConfigError(f"cannot read arguments file {path}: {why}") from None
    lines = [ln.strip() for ln in text.splitlines()]
    first = next((ln for ln in lines if ln and not ln.startswith("#")), "")
    try:
        if first.startswith("{") or re.match(r"""^["']?--[\w.-]+["']?\s*:""", first):
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ConfigError(f"not a valid YAML mapping: {getattr(e, 'problem', e)}") from None
            return args_from_mapping(data)
        return split_args(text)
    except ConfigError as e:
        raise ConfigError([f"{path}: {e.problems[0]}", *e.problems[1:]]) from None


def args_from_mapping(data: Any) -> list[str]:
    """Tokens of a `{"--flag": value}` mapping, as Megatron-LM's CI writes its test cases: true
    is a bare flag, false or null leaves it out, a list gives several values; a string given to
    a flag that takes several values is split at whitespace (brackets around it dropped)."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"the arguments must be a mapping of flags to values, got {type(data).__name__}"
        )
    tokens = []
    for flag, value in data.items():
        if not isinstance(flag, str) or not flag.startswith("--"):
            raise ConfigError(f"{flag!r} is not a flag: the keys must be flags like '--num-layers'")
        if value is True:
            tokens.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            tokens += [flag, *(_scalar(v) for v in value)]
        elif isinstance(value, str) and FLAGS.get(flag, Flag()).nargs in ("+", "*"):
            tokens += [flag, *value.strip().removeprefix("[").removesuffix("]").split()]
        else:
            tokens += [flag, _scalar(value)]
    return tokens


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass
class _Word:
    text: str
    line: int
    variables: set


_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_NAME = re.compile(r"\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*)|([0-9@*#?$!-])|(\()")


def _variable(text: str, i: int) -> str | None:
    """The name of the shell expansion that starts with the `$` at text[i], if any."""
    m = _NAME.match(text, i + 1)
    if m is None:
        return None
    name = m.group(1) or m.group(2) or m.group(3) or "(...)"
    return name.split("[")[0]  # ${ARGS[@]} is ARGS


def _commands(text: str) -> list[list[_Word]]:
    """The words of each command of a shell text (see `split_args` for what is understood)."""
    commands, words, buf = [], [], []
    state = {"in_word": False, "vars": set(), "skip": False, "line": 1, "start": 1}

    def end_word():
        if state["in_word"] and not state["skip"]:
            words.append(_Word("".join(buf), state["start"], state["vars"]))
        buf.clear()
        state.update(in_word=False, vars=set())

    def end_command():
        end_word()
        if words:
            commands.append(list(words))
        words.clear()
        state["skip"] = False

    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            if text.startswith("\\\n", i):
                state["line"] += 1
            else:
                _begin(state)
                buf.append(text[i + 1 : i + 2])
            i += 2
        elif c == "'":
            j = text.find("'", i + 1)
            if j < 0:
                raise ConfigError(f"line {state['line']}: a single quote is not closed")
            _begin(state)
            buf.append(text[i + 1 : j])
            state["line"] += text.count("\n", i, j)
            i = j + 1
        elif c == '"':
            i = _double_quoted(text, i + 1, buf, state)
        elif c == "(" and _ASSIGNMENT.fullmatch("".join(buf)):
            # a bash array, NAME=( ... ): one word, even over several lines
            j = text.find(")", i)
            if j < 0:
                raise ConfigError(f"line {state['line']}: a parenthesis is not closed")
            for k in range(i, j):
                if text[k] == "$" and (name := _variable(text, k)):
                    state["vars"].add(name)
            buf.append(text[i : j + 1])
            state["line"] += text.count("\n", i, j)
            i = j + 1
        elif c == "#" and not state["in_word"]:
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c in " \t\r":
            end_word()
            i += 1
        elif c == "\n":
            end_command()
            state["line"] += 1
            i += 1
        elif c in ";|&":
            end_command()
            i += 2 if text[i : i + 2] in ("&&", "||", ";;") else 1
        elif c in "<>":
            if state["in_word"] and "".join(buf).isdigit():  # a file descriptor: 2>&1
                buf.clear()
                state["in_word"] = False
            end_word()
            state["skip"] = True  # the redirection target and the rest of the command
            i += 1
            while i < n and text[i] in "<>&":
                i += 1
        else:
            _begin(state)
            if c == "$" and (name := _variable(text, i)):
                state["vars"].add(name)
            buf.append(c)
            i += 1
    end_command()
    return commands


def _begin(state: dict) -> None:
    """A word starts (or goes on) here; remember the line it started on."""
    if not state["in_word"]:
        state.update(in_word=True, start=state["line"])


def _double_quoted(text: str, i: int, buf: list, state: dict) -> int:
    start = state["line"]
    _begin(state)
    while i < len(text):
        c = text[i]
        if c == '"':
            return i + 1
        if c == "\\" and text[i + 1 : i + 2] in ('$', '`', '"', "\\", "\n"):
            if text[i + 1] == "\n":
                state["line"] += 1
            else:
                buf.append(text[i + 1])
            i += 2
            continue
        if c == "$" and (name := _variable(text, i)):
            state["vars"].add(name)
        state["line"] += c == "\n"
        buf.append(c)
        i += 1
    raise ConfigError(f"line {start}: a double quote is not closed")


def _past_launcher(words: list[_Word]) -> list[_Word]:
    for j, w in enumerate(words):
        previous = FLAGS.get(words[j - 1].text) if j else None
        value_of_flag = previous is not None and previous.nargs != 0
        if w.text.endswith(".py") and not w.text.startswith("-") and not value_of_flag:
            return words[j + 1 :]
    first = next(j for j, w in enumerate(words) if w.text.startswith("--"))
    return words[first:]


# --------------------------------------------------------------------------- parsing


def _parse(tokens: list[str]) -> dict[str, Any]:
    """Flag -> value as argparse would store it (switches True, lists for several values); the
    last of a repeated flag wins. Every problem is reported in one ConfigError."""
    values: dict[str, Any] = {}
    unknown, problems = [], []
    i, previous = 0, None
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):
            after = f" after {previous}, which takes no value" if previous else ""
            problems.append(f"unexpected value {token!r}{after}")
            continue
        name, eq, inline = token.partition("=")
        spec = FLAGS.get(name)
        previous = name
        if spec is None:
            unknown.append(name)
            while i < len(tokens) and not tokens[i].startswith("--"):
                i += 1  # its values
            continue
        given = [inline] if eq else []
        if not eq and spec.nargs != 0:
            limit = 1 if spec.nargs == 1 else len(tokens)
            while i < len(tokens) and not tokens[i].startswith("--") and len(given) < limit:
                given.append(tokens[i])
                i += 1
        if spec.removed:
            problems.append(spec.removed)
            continue
        if spec.nargs == 0:
            if eq:
                problems.append(f"{name} takes no value, got {inline!r}")
            values[name] = True
            continue
        previous = None
        if not given and spec.nargs != "*":
            problems.append(f"{name} needs a value")
            continue
        try:
            converted = [_convert(name, spec, text) for text in given]
        except ConfigError as e:
            problems.append(str(e))
            continue
        values[name] = converted[0] if spec.nargs == 1 else converted
    if unknown:
        problems.insert(0, "unknown Megatron-LM flags: " + ", ".join(_suggest(f) for f in unknown))
    if problems:
        raise ConfigError(problems)
    return values


def _convert(name: str, spec: Flag, text: str):
    try:
        value = spec.type(text)
    except ValueError:
        kind = {int: "an integer", float: "a number"}.get(spec.type, "a value")
        raise ConfigError(f"{name} expects {kind}, got {text!r}") from None
    if spec.choices is not None and value not in spec.choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in spec.choices], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{name} must be one of {', '.join(spec.choices)}; got {text!r}{hint}")
    return value


def _suggest(flag: str) -> str:
    close = difflib.get_close_matches(flag.replace("_", "-"), list(FLAGS), n=1, cutoff=0.75)
    return f"{flag} (did you mean {close[0]}?)" if close else flag


# --------------------------------------------------------------------------- deriving


def job_dict_from_args(
    tokens: list[str] | dict,
    *,
    world_size: int,
    gpu: str | None = None,
    gpus_per_node: int | None = None,
    env: dict[str, str] | None = None,
) -> tuple[dict, list[str]]:
    """The job mapping for `job_from_dict` and notes for the user; the first note is the one
    warning that lists every given flag metatrace does not model yet."""
    v = _parse(args_from_mapping(tokens) if isinstance(tokens, dict) else list(tokens))
    env = {k: str(val) for k, val in (env or {}).items()}
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"the world size must be a whole number >= 1, got {world_size!r}")
    job: dict = {s: {} for s in ("model", "parallel", "training", "implementation", "cluster")}
    notes: list[str] = []
    problems: list[str] = []
    for flag, value in v.items():
        spec = FLAGS[flag]
        if spec.key is not None:
            _put(job, spec.key, spec.const if spec.nargs == 0 else value)
    _model(v, job, notes, problems)
    _vocabulary(v, job, notes, problems)
    _parallel(v, job, notes, problems, world_size)
    _training(v, job, notes, problems)
    _implementation(v, job, notes, problems)
    _cluster(v, job, notes, problems, world_size, gpu, gpus_per_node, env)
    if problems:
        raise ConfigError(problems)
    missing = _unmodelled(v)
    if missing:
        notes.insert(0, _warning(missing))
    return {k: s for k, s in job.items() if s}, notes


def job_from_args(
    tokens: list[str] | dict,
    *,
    world_size: int,
    gpu: str | None = None,
    gpus_per_node: int | None = None,
    env: dict[str, str] | None = None,
    source: str = "<megatron-args>",
):
    """`job_dict_from_args`, resolved and checked by `job_from_dict`: (Job, notes)."""
    from metatrace.config import job_from_dict

    data, notes = job_dict_from_args(
        tokens, world_size=world_size, gpu=gpu, gpus_per_node=gpus_per_node, env=env
    )
    return job_from_dict(data, source=source), notes


def not_modelled(tokens: list[str] | dict) -> list[str]:
    """'flag: what is not modelled' for every given flag (or value) metatrace does not model
    yet; empty when the run is fully modelled."""
    v = _parse(args_from_mapping(tokens) if isinstance(tokens, dict) else list(tokens))
    return [f"{flag}: {reason}" for flag, reason in _unmodelled(v)]


def _put(job: dict, key: str, value) -> None:
    *path, leaf = key.split(".")
    node = job
    for part in path:
        node = node.setdefault(part, {})
    node[leaf] = value


def _is_moe(v) -> bool:
    return bool(v.get("--num-experts"))  # --num-experts 0 means no experts


def _unmodelled(v) -> list[tuple[str, str]]:
    out = []
    for flag, value in v.items():
        reason = FLAGS[flag].reason
        if flag == "--num-experts" and not value:
            continue
        if reason is None and _is_moe(v) and flag in (
            "--expert-model-parallel-size", "--expert-tensor-parallel-size"
        ):
            reason = _MOE
        if reason is not None:
            out.append((_show(flag, value), reason))
    optimizer = v.get("--optimizer", "adam")
    if optimizer not in ("adam", "sgd"):
        out.append((f"--optimizer {optimizer}", "optimizers other than adam and sgd"))
    position = v.get("--position-embedding-type")
    if position in ("yarn", "mrope", "relative"):
        out.append((f"--position-embedding-type {position}", "position embeddings other than "
                    "learned_absolute, rope and none"))
    if "--fp8-format" in v and "--bf16" not in v:
        out.append(("--fp8-format without --bf16", "FP8 over fp16 or fp32 parameters"))
    if v.get("--fp8-recipe") == "custom" and "--fp8-format" in v:
        out.append(("--fp8-recipe custom", "custom FP8 quantizers"))
    if len(set(v.get("--cp-comm-type", ()))) > 1:
        out.append((_show("--cp-comm-type", v["--cp-comm-type"]), "a context-parallel "
                    "communication type per layer"))
    return out


def _show(flag: str, value) -> str:
    if value is True:
        return flag
    if isinstance(value, list):
        return " ".join([flag, *map(str, value)])
    return f"{flag} {value}"


def _warning(missing: list[tuple[str, str]]) -> str:
    by_reason: dict[str, list[str]] = {}
    for flag, reason in missing:
        by_reason.setdefault(reason, []).append(flag)
    parts = [f"{reason} ({', '.join(flags)})" for reason, flags in by_reason.items()]
    return (
        "warning: metatrace does not model these yet, and predicts the run without them: "
        + "; ".join(parts)
    )


def _model(v, job, notes, problems) -> None:
    m = job["model"]
    for flag, alias, key in (
        ("--num-layers", "--encoder-num-layers", "model.num_layers"),
        ("--seq-length", "--encoder-seq-length", "training.seq_length"),
    ):
        if flag in v and alias in v:
            problems.append(f"give {flag} or {alias}, not both (Megatron-LM asserts it)")
        elif alias in v:
            _put(job, key, v[alias])
    required = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                "--micro-batch-size")
    absent = [f for f in required if f not in v and not (
        f == "--num-layers" and "--encoder-num-layers" in v
        or f == "--seq-length" and "--encoder-seq-length" in v)]
    if absent:
        problems.append("Megatron-LM needs " + ", ".join(absent))
    if "--max-position-embeddings" not in v:
        notes.append("Megatron-LM needs --max-position-embeddings; metatrace takes --seq-length")
    # Grouped-query attention only with --group-query-attention (notes 6.1); its default is 1.
    if "--group-query-attention" in v:
        m["num_query_groups"] = v.get("--num-query-groups", 1)
    elif "--num-query-groups" in v:
        notes.append(
            f"--num-query-groups {v['--num-query-groups']} is ignored without "
            "--group-query-attention: Megatron-LM builds multi-head attention"
        )
    position = v.get("--position-embedding-type")
    if "--use-rotary-position-embeddings" in v:
        position = "rope"  # deprecated spelling
    if "--no-position-embedding" in v and position not in ("rope", "mrope"):
        problems.append("--no-position-embedding is deprecated (Megatron-LM refuses it unless the "
                        "position embedding is rope); use --position-embedding-type none")
    if position is not None:
        # yarn and mrope rotate like rope (no parameters); relative is T5's. All three are
        # listed as not modelled.
        m["position_embedding_type"] = {"yarn": "rope", "mrope": "rope", "relative": "none"}.get(
            position, position
        )
    if "--swiglu" in v and "--squared-relu" in v:
        problems.append("--swiglu and --squared-relu exclude each other (Megatron-LM asserts it)")
    elif "--swiglu" in v:
        m["activation"] = "swiglu"
    elif "--squared-relu" in v:
        m["activation"] = "squared_relu"
        if "--disable-bias-linear" not in v and "--no-bias-gelu-fusion" not in v:
            problems.append(
                "--squared-relu with linear biases needs --no-bias-gelu-fusion (or "
                "--disable-bias-linear): Megatron-LM's TransformerConfig refuses the fused "
                "bias-GeLU kernel for squared ReLU (notes 6.3)"
            )
    # validate_args turns the QKV bias on whenever linear biases are (notes 6.4).
    if "--add-qkv-bias" in v or "--disable-bias-linear" not in v:
        m["add_qkv_bias"] = True


def _vocabulary(v, job, notes, problems) -> None:
    """model.vocab_size from the tokenizer (notes 4.4, Megatron-LM core_v0.16.1)."""
    m = job["model"]
    size, tokenizer = v.get("--vocab-size"), v.get("--tokenizer-type")
    if "--padded-vocab-size" in v:
        # The final size, unpadded: with a multiple of 1, padding only rounds to tp, which the
        # vocabulary-parallel embedding needs anyway.
        m["vocab_size"], m["make_vocab_size_divisible_by"] = v["--padded-vocab-size"], 1
        return
    if tokenizer is None:
        if size is not None and "--vocab-file" not in v:
            notes.append("no --tokenizer-type: pretrain_gpt.py defaults to GPT2BPETokenizer "
                         "(which needs --vocab-file); metatrace takes the vocabulary from "
                         "--vocab-size")
            m["vocab_size"] = size
            return
        if "--vocab-file" not in v:
            notes.append(f"no --tokenizer-type or --vocab-file: assuming pretrain_gpt.py's "
                         f"default GPT2BPETokenizer ({_GPT2_VOCAB} tokens)")
        tokenizer = "GPT2BPETokenizer"
    if tokenizer == "GPT2BPETokenizer":
        if size is not None:
            notes.append(f"--vocab-size is ignored by GPT2BPETokenizer ({_GPT2_VOCAB} tokens)")
        m["vocab_size"] = _GPT2_VOCAB
    elif size is None:
        problems.append(
            f"metatrace cannot know the vocabulary of --tokenizer-type {tokenizer} (Megatron-LM "
            "reads it from the tokenizer's files): give its size with --vocab-size"
        )
    elif tokenizer == "NullTokenizer":
        m["vocab_size"] = size + 1  # 0.16.1: the end-of-document id is V, so V + 1 tokens
    else:
        m["vocab_size"] = size
        if tokenizer not in ("TikTokenizer",):
            notes.append(f"--vocab-size {size} stands for {tokenizer}'s vocabulary "
                         "(Megatron-LM reads it from the tokenizer's files)")


def _parallel(v, job, notes, problems, world_size) -> None:
    p = job["parallel"]
    tp = v.get("--tensor-model-parallel-size", 1)
    pp = v.get("--pipeline-model-parallel-size", 1)
    cp = v.get("--context-parallel-size", 1)
    _virtual_pipeline(v, p, problems, pp)
    layout = v.get("--pipeline-model-parallel-layout")
    if layout is not None:
        # MTP layers (m) are listed as not modelled; the layout without them places the rest.
        p["layout"] = layout.replace("m", "") if "--mtp-num-layers" in v else layout
    kinds = v.get("--cp-comm-type")
    if kinds:
        layers = v.get("--num-layers")
        if len(kinds) > 1 and layers is not None and len(kinds) != layers:
            problems.append(f"--cp-comm-type gives {len(kinds)} values; a value per layer needs "
                            f"--num-layers = {layers} of them")
        p["cp_comm_type"] = {"allgather": "all_gather"}.get(kinds[0], kinds[0])
    # Expert parallelism (notes 2): EP needs experts; ETP only lays out the expert grid of a
    # dense model. With experts both are listed as not modelled and the model is dense.
    ep = v.get("--expert-model-parallel-size", 1)
    etp = v.get("--expert-tensor-parallel-size", tp)
    if ep > 1 and not _is_moe(v):
        problems.append(f"--expert-model-parallel-size {ep} needs --num-experts (Megatron-LM "
                        "asserts it)")
    if min(ep, etp, tp, pp, cp) < 1:
        return  # job_from_dict reports degrees below 1
    if world_size % (etp * ep * pp):
        problems.append(f"world size {world_size} is not divisible by expert tp x ep x pp = "
                        f"{etp} x {ep} x {pp} = {etp * ep * pp} (megatron-core's expert grid)")
    elif ("--use-tp-pp-dp-mapping" in v and pp > 1 and world_size % (tp * pp * cp) == 0
          and world_size // (etp * ep * pp) != world_size // (tp * pp * cp)):
        problems.append(
            f"with --use-tp-pp-dp-mapping the expert data-parallel size (world / (etp x ep x pp) "
            f"= {world_size // (etp * ep * pp)}) must equal the data-parallel size (world / "
            f"(tp x pp x cp) = {world_size // (tp * pp * cp)}) (megatron-core asserts it)"
        )
    if "--expert-tensor-parallel-size" in v:
        p["etp"] = etp


def _virtual_pipeline(v, p, problems, pp) -> None:
    """parallel.vpp as validate_args derives it (notes 4.6)."""
    per_chunk = v.get("--num-layers-per-virtual-pipeline-stage")
    stages = v.get("--num-virtual-stages-per-pipeline-rank")
    given = [f for f in ("--num-layers-per-virtual-pipeline-stage",
                         "--num-virtual-stages-per-pipeline-rank",
                         "--pipeline-model-parallel-layout") if f in v]
    if len(given) > 1:
        problems.append(f"give at most one of {', '.join(given)} (Megatron-LM asserts it)")
        return
    if per_chunk is None and stages is None:
        return
    overlap = "--no-overlap-p2p-communication" not in v
    if pp <= (1 if overlap else 2):
        problems.append(
            "an interleaved pipeline needs --pipeline-model-parallel-size > "
            + ("1" if overlap else "2 with --no-overlap-p2p-communication")
        )
        return
    if stages is None:
        if "--decoder-first-pipeline-num-layers" in v or "--decoder-last-pipeline-num-layers" in v:
            problems.append("with --decoder-first/last-pipeline-num-layers give the virtual "
                            "stages as --num-virtual-stages-per-pipeline-rank (Megatron-LM "
                            "asserts it)")
            return
        layers = v.get("--num-layers", v.get("--encoder-num-layers"))
        if layers is None or per_chunk < 1:
            return
        layers += ("--account-for-embedding-in-pipeline-split" in v) + (
            "--account-for-loss-in-pipeline-split" in v)
        if layers % pp or (layers // pp) % per_chunk:
            problems.append(f"{layers} layers over --pipeline-model-parallel-size {pp} do not "
                            "split into chunks of --num-layers-per-virtual-pipeline-stage "
                            f"{per_chunk}")
            return
        stages = layers // pp // per_chunk
    if stages != 1:
        p["vpp"] = stages


def _training(v, job, notes, problems) -> None:
    t = job["training"]
    bf16, fp16 = "--bf16" in v, "--fp16" in v
    if bf16 and fp16:
        problems.append("--bf16 and --fp16 exclude each other (Megatron-LM asserts it)")
    t["precision"] = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    if "--fp8-format" in v and bf16:
        t["precision"], t["fp8_format"] = "fp8", v["--fp8-format"]
        if v.get("--fp8-recipe") not in (None, "custom"):  # custom is listed as not modelled
            t["fp8_recipe"] = v["--fp8-recipe"]
        if "--fp8-param-gather" in v:
            t["fp8_param_gather"] = True
    elif "--fp8-param-gather" in v and "--fp8-format" not in v:
        problems.append("--fp8-param-gather needs --fp8-format (megatron-core refuses FP8 "
                        "parameters without FP8)")
    _recompute(v, t, notes)
    # bf16 accumulates and reduces gradients in fp32 unless asked otherwise (notes 6.10);
    # config.py derives that default, the flags override it.
    if "--accumulate-allreduce-grads-in-fp32" in v:
        t["grad_reduce_in_fp32"] = True
    elif "--grad-reduce-in-bf16" in v:
        t["grad_reduce_in_fp32"] = False
    if v.get("--optimizer") in ("adam", "sgd"):
        t["optimizer"] = v["--optimizer"]


def _recompute(v, t, notes) -> None:
    granularity = v.get("--recompute-granularity")
    if "--recompute-activations" in v:
        granularity = "selective"  # validate_args, whatever --recompute-granularity says
    options = [f for f in ("--recompute-method", "--recompute-num-layers", "--recompute-modules")
               if f in v]
    if granularity is None:
        if options:
            notes.append(f"{', '.join(options)} are ignored without --recompute-granularity")
        return
    rec = {"granularity": granularity}
    if "--recompute-method" in v:
        rec["method"] = v["--recompute-method"]
    if "--recompute-num-layers" in v:
        rec["num_layers"] = v["--recompute-num-layers"]
    modules = v.get("--recompute-modules")
    if modules is not None:
        # Modules of unmodelled layers go with them (listed in the warning).
        skip = (_MOE_RECOMPUTE if _is_moe(v) else ()) + (
            ("mla_up_proj",) if "--multi-latent-attention" in v else ())
        rec["modules"] = [m for m in modules if m not in skip]
    t["recompute"] = {**t.get("recompute", {}), **rec}


def _implementation(v, job, notes, problems) -> None:
    impl = job["implementation"]
    kind = v.get("--transformer-impl", "transformer_engine")
    if kind == "inference_optimized":
        problems.append("--transformer-impl inference_optimized is an inference layer spec; "
                        "metatrace models training (local or transformer_engine)")
    elif "--transformer-impl" in v:
        impl["transformer_impl"] = kind
    backend = v.get("--attention-backend")
    if backend == "local" and "--spec" not in v:
        problems.append("--attention-backend local needs --spec local in Megatron-LM (notes "
                        "6.9); for GPT use --transformer-impl local")
    elif backend is not None:
        impl["attention_backend"] = backend
    position = job["model"].get("position_embedding_type", "learned_absolute")
    if "--no-rope-fusion" in v or position != "rope":
        impl["rope_fusion"] = False  # validate_args turns it off without rope
    elif kind == "local":
        notes.append("RoPE fusion stays on in Megatron-LM with --transformer-impl local and uses "
                     "Transformer Engine's kernel where TE is installed; metatrace models the "
                     "local spec's unfused RoPE (pass --no-rope-fusion to match)")
    # megatron-core's bias_activation_fusion is --bias-swiglu-fusion with --swiglu, else
    # --bias-gelu-fusion (core_transformer_config_from_args).
    off = "--no-bias-swiglu-fusion" if "--swiglu" in v else "--no-bias-gelu-fusion"
    if off in v:
        impl["bias_activation_fusion"] = False
    if "--deterministic-mode" in v:
        for flag in ("--cross-entropy-loss-fusion", "--use-flash-attn"):
            if flag in v:
                problems.append(
                    f"{flag} is refused with --deterministic-mode (Megatron-LM asserts it)"
                )


def _cluster(v, job, notes, problems, world_size, gpu, gpus_per_node, env) -> None:
    c = job["cluster"]
    c["num_gpus"] = world_size
    if gpu is not None:
        c["gpu"] = gpu
    if gpus_per_node is not None:
        c["gpus_per_node"] = gpus_per_node
    unknown = [n for n in env if n not in _ENV_NAMES and not n.startswith(_ENV_PREFIXES)]
    if unknown:
        problems.append(
            f"unknown environment variables: {', '.join(unknown)} (known: "
            f"{', '.join(sorted(_ENV_NAMES))}, and NCCL_*, TORCH_NCCL_*, CUBLAS_*)"
        )
    if "CUBLAS_WORKSPACE_CONFIG" in env:
        c["cublas_workspace_config"] = env["CUBLAS_WORKSPACE_CONFIG"]
    if env.get("WORLD_SIZE", str(world_size)) != str(world_size):
        problems.append(f"WORLD_SIZE={env['WORLD_SIZE']} in the environment, but the world size "
                        f"is {world_size}")
    backend = v.get("--attention-backend", "auto")
    for name, expected in zip(_NVTE_ATTN, _NVTE_FOR_BACKEND.get(backend, (1, 1, 1))):
        if name in env and env[name] != str(expected):
            problems.append(
                f"{name}={env[name]} contradicts --attention-backend {backend}, which sets it to "
                f"{expected}; megatron-core asserts they agree (choose the attention with "
                "--attention-backend)"
            )
    if "PYTORCH_CUDA_ALLOC_CONF" in env:
        notes.append(f"PYTORCH_CUDA_ALLOC_CONF={env['PYTORCH_CUDA_ALLOC_CONF']} changes reserved "
                     "memory and fragmentation, not the allocated bytes metatrace predicts "
                     "(cluster.reserved_overhead_gib stands for them)")
    from metatrace.config import GPU_ARCH

    tp, cp = v.get("--tensor-model-parallel-size", 1), v.get("--context-parallel-size", 1)
    fsdp = "--use-megatron-fsdp" in v or "--use-torch-fsdp2" in v
    arch = GPU_ARCH.get(gpu or "h100", "")
    before_blackwell = arch.startswith("sm") and int(arch[2:]) < 100
    connections = env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if connections not in (None, "1") and (tp > 1 or cp > 1) and not fsdp and before_blackwell:
        problems.append(f"CUDA_DEVICE_MAX_CONNECTIONS={connections}: Megatron-LM asserts it is 1 "
                        "with tensor or context parallelism before Blackwell")
