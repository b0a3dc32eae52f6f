"""Job configuration: nested keyword-only dataclasses, a YAML loader and the checks that run
before any model is built.

A job file has five sections (model, parallel, training, implementation, cluster). Keys are
those of the dataclasses below; `model.preset` (or `model.hf_config`, a Hugging Face
config.json) fills the model section and explicit keys override it. `load_job(path)` returns a
`Job` whose every derived value (ffn size, kv channels, padded vocabulary, data-parallel size,
number of micro-batches, ...) is resolved the way Megatron-LM derives it (../shared/notes/megatron-args.md, section 2).

Bad input raises `ConfigError`; the command line prints it and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from metatrace.errors import ConfigError

Precision = Literal["bf16", "fp16", "fp32", "fp8"]
Activation = Literal["gelu", "swiglu", "geglu", "relu", "squared_relu", "silu"]
GATED_ACTIVATIONS = ("swiglu", "geglu")


@dataclass(frozen=True, kw_only=True)
class Model:
    preset: str | None = None
    """Name of a preset in `metatrace.models.presets` (e.g. llama2-7b); explicit keys override it."""
    hf_config: str | None = None
    """Path of a Hugging Face config.json (relative to the job file) read into this section by
    `metatrace.models.hf`; explicit keys override it. Not together with preset."""
    num_layers: int | None = None
    """Transformer layers in the decoder."""
    hidden_size: int | None = None
    """Model width h."""
    ffn_hidden_size: int | None = None
    """MLP width; default 4h, or Megatron-LM's SwiGLU rounding floor(8h/3/64)*64 when gated."""
    num_attention_heads: int | None = None
    """Attention heads a."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; omitted means multi-head attention."""
    kv_channels: int | None = None
    """Head dimension; default h / a."""
    vocab_size: int | None = None
    """Tokenizer vocabulary before padding."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this times tp, as Megatron-LM does."""
    max_position_embeddings: int | None = None
    """Position table size for learned absolute positions; default training.seq_length."""
    position_embedding_type: Literal["learned_absolute", "rope", "none"] | None = None
    """learned_absolute (Megatron-LM's default), rope or none."""
    rotary_base: int | None = None
    """RoPE base (10000 unless a preset says otherwise)."""
    rotary_percent: float = 1.0
    """Fraction of the head dimension that RoPE rotates."""
    normalization: Literal["LayerNorm", "RMSNorm"] | None = None
    """LayerNorm (default) or RMSNorm."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalisation layers."""
    activation: Activation | None = None
    """MLP activation: gelu (default), swiglu, geglu, relu, squared_relu, silu."""
    add_bias_linear: bool | None = None
    """Biases in all linear layers (Megatron-LM default: true)."""
    add_qkv_bias: bool | None = None
    """Bias in the QKV projection (always on with add_bias_linear, as in Megatron-LM; alone it
    gives Qwen-style QKV-only biases)."""
    qk_layernorm: bool | None = None
    """Normalise queries and keys per head."""
    untie_embeddings_and_output_weights: bool | None = None
    """Separate output-layer weight instead of sharing the word embedding."""
    hidden_dropout: float | None = None
    """Dropout after attention and MLP (Megatron-LM default 0.1)."""
    attention_dropout: float | None = None
    """Dropout on attention probabilities (Megatron-LM default 0.1)."""
    num_experts: int | None = None
    """Routed experts per mixture-of-experts layer; omitted means a dense model."""
    moe_ffn_hidden_size: int | None = None
    """Width of each routed expert's MLP (default ffn_hidden_size)."""
    moe_router_topk: int = 2
    """Experts each token is routed to (Megatron-LM default 2)."""
    moe_layer_freq: int | list[int] | str = 1
    """Which layers are MoE layers: every n-th (an integer), a 0/1 list per layer, or Megatron-LM's
    expression such as "([0]*3+[1]*58)"."""
    moe_shared_expert_intermediate_size: int | None = None
    """Total width of the shared experts (all shared experts together); omitted means none."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)."""
    moe_router_pre_softmax: bool = False
    """Softmax before the top-k choice instead of after it."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: expert groups (DeepSeek's node-limited routing)."""
    moe_router_group_topk: int | None = None
    """Group-limited routing: groups each token may use."""
    moe_router_topk_scaling_factor: float | None = None
    """Scale of the top-k routing weights (DeepSeek-V3: 2.5)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free load balancing with a per-expert bias (DeepSeek-V3)."""
    moe_router_load_balancing_type: Literal[
        "aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"
    ] = "aux_loss"
    """Load balancing of the router (Megatron-LM default aux_loss)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the auxiliary load-balancing loss (Megatron-LM default 0)."""
    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss; omitted means none."""
    multi_latent_attention: bool = False
    """DeepSeek's multi-latent attention (megatron-core's MLASelfAttention) instead of
    (grouped-query) self-attention; the head dimensions below replace kv_channels."""
    q_lora_rank: int | None = None
    """MLA: rank of the query down-projection; omitted means no query compression (one
    column-parallel query projection), as Megatron-LM's default."""
    kv_lora_rank: int = 32
    """MLA: rank of the key/value latent (Megatron-LM's default 32; DeepSeek-V3: 512)."""
    qk_head_dim: int = 128
    """MLA: query/key head dimension without the rotary part (DeepSeek's qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """MLA: rotary part of the query/key head (DeepSeek's qk_rope_head_dim); a query/key head
    is qk_head_dim + qk_pos_emb_head_dim wide."""
    v_head_dim: int = 128
    """MLA: value head dimension."""
    rope_type: Literal["rope", "yarn"] | None = None
    """MLA: rotary embedding kind; default yarn (megatron-core's MLATransformerConfig). Without
    MLA only rope."""
    rotary_scaling_factor: float = 1.0
    """MLA yarn: context-extension factor (Megatron-LM's default 1.0; DeepSeek-V3: 40)."""
    original_max_position_embeddings: int = 4096
    """MLA yarn: the pre-extension context length."""
    beta_fast: float = 32.0
    """MLA yarn: fast correction boundary."""
    beta_slow: float = 1.0
    """MLA yarn: slow correction boundary."""
    mscale: float = 1.0
    """MLA yarn: attention-scale factor."""
    mscale_all_dim: float = 0.0
    """MLA yarn: attention-scale factor for all dimensions (Megatron-LM's default 0)."""
    mtp_num_layers: int | None = None
    """Multi-token prediction depths (DeepSeek-V3: 1), built after the decoder on the last
    pipeline stage (or where parallel.layout puts 'm'); omitted means none."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the multi-token-prediction loss."""


@dataclass(frozen=True, kw_only=True)
class Parallel:
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: int | None = None
    """Virtual pipeline stages (model chunks) per pipeline rank; omitted means no interleaving."""
    cp: int = 1
    """Context-parallel size (splits the sequence)."""
    ep: int = 1
    """Expert-parallel size (mixture-of-experts only)."""
    etp: int | None = None
    """Expert tensor-parallel size; default tp."""
    dp: int | None = None
    """Data-parallel size; derived from cluster.num_gpus when omitted."""
    sequence_parallel: bool = False
    """Shard norm and dropout activations along the sequence over the TP group."""
    first_stage_layers: int | None = None
    """Layers on the first pipeline stage (uneven split)."""
    last_stage_layers: int | None = None
    """Layers on the last pipeline stage (uneven split)."""
    account_for_embedding: bool = False
    """Count the embedding as one layer in the pipeline split."""
    account_for_loss: bool = False
    """Count the loss/output layer as one layer in the pipeline split."""
    layout: str | None = None
    """Megatron pipeline layout string, e.g. "Et|(tt|)*3tL" (E embedding, t layer, L loss)."""
    rank_order: str = "tp-cp-ep-dp-pp"
    """Order in which ranks are laid out, fastest-varying first (Megatron's default)."""
    cp_comm_type: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] = "p2p"
    """How Transformer Engine's attention communicates under context parallelism."""
    hierarchical_cp_sizes: list[int] | None = None
    """With cp_comm_type a2a+p2p: the sizes of the all-to-all (inner) and ring (outer) levels,
    whose product is cp."""
    microbatch_group_size: int | None = None
    """Interleaved schedule: micro-batches run together per virtual stage (default pp)."""
    overlap_p2p_comm: bool | None = None
    """Interleaved schedule: overlap pipeline sends and receives with compute (Megatron-LM's
    default; off without virtual stages)."""
    overlap_p2p_comm_warmup_flush: bool = False
    """Interleaved schedule: overlap also in the warm-up and flush phases."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "allgather"
    """How MoE layers move tokens to their experts: all-gather / reduce-scatter over the TP x EP
    group (Megatron-LM's default) or all-to-all over the EP group."""
    moe_shared_expert_overlap: bool = False
    """Overlap the shared experts' computation with the token dispatch (alltoall)."""


@dataclass(frozen=True, kw_only=True)
class Recompute:
    granularity: Literal["full", "selective"] | None = None
    """Activation recompute: full layers or selective submodules; omitted means none."""
    method: Literal["uniform", "block"] | None = None
    """Full recompute only: uniform (every chunk of num_layers) or block (first num_layers)."""
    num_layers: int | None = None
    """Full recompute only: layers per checkpointed chunk (uniform) or per stage (block)."""
    modules: list[str] | None = None
    """Selective recompute only: submodules to recompute (default [core_attn])."""
    distribute_saved_activations: bool = False
    """Shard the checkpointed inputs over the TP group (full recompute, no sequence parallel)."""


@dataclass(frozen=True, kw_only=True)
class Training:
    seq_length: int | None = None
    """Tokens per sample."""
    micro_batch_size: int = 1
    """Samples per micro-batch per model replica."""
    global_batch_size: int | None = None
    """Samples per optimizer step; default micro_batch_size x dp."""
    precision: Precision = "bf16"
    """Parameter and compute precision; fp8 is bf16 parameters with Transformer Engine's FP8
    GEMMs (--fp8-format with --bf16)."""
    fp8_format: Literal["hybrid", "e4m3"] | None = None
    """With precision fp8: e4m3 everywhere, or hybrid (default: e4m3 forward, e5m2 gradients)."""
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] | None = None
    """With precision fp8: the scaling recipe (default delayed, as in Megatron-LM)."""
    fp8_param_gather: bool = False
    """With precision fp8: keep parameters in FP8 and gather them in FP8 (needs the
    distributed optimizer)."""
    fp8_amax_history_len: int = 1
    """With the delayed FP8 recipe: how many amax values each quantizer keeps (Megatron-LM's
    --fp8-amax-history-len, default 1; Transformer Engine's own default would be 1024)."""
    recompute: Recompute = field(default_factory=Recompute)
    """Activation recomputation."""
    activation_offload_modules: list[
        Literal["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1",
                "moe_act"]
    ] | None = None
    """megatron-core's fine-grained activation offloading (--fine-grained-activation-offloading
    --offload-modules): what these modules save for backward goes to pinned host memory after
    their forward and comes back in backward. attn_proj needs core_attn; attn_norm and mlp_norm
    move nothing in Transformer Engine's dense layers (their norm is fused into the next linear),
    expert_fc1 only with moe_grouped_gemm. Omitted or empty: off."""
    min_offloaded_tensor_size: int = 1024 * 1024
    """With activation_offload_modules: saved tensors with fewer elements stay on the GPU
    (--min-offloaded-tensor-size)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over the data-parallel group (ZeRO-1)."""
    overlap_grad_reduce: bool = False
    """Reduce gradients in buckets during backward."""
    overlap_param_gather: bool = False
    """Gather parameters during the next forward (needs the distributed optimizer)."""
    overlap_param_gather_with_optimizer_step: bool = False
    """Start the first parameter all-gather inside the optimizer step (needs
    overlap_param_gather and virtual pipeline stages); turns DDP's bucketing off."""
    num_distributed_optimizer_instances: int = 1
    """Distributed-optimizer replicas: the state is sharded over dp / this many ranks."""
    grad_reduce_in_fp32: bool | None = None
    """fp32 main-grad buffers, reduced in fp32 (Megatron-LM's default with bf16 and fp8:
    --accumulate-allreduce-grads-in-fp32; gradients stay in the parameter dtype otherwise)."""
    ddp_bucket_size: int | None = None
    """Gradient bucket size in elements with overlap_grad_reduce (default max(4e7, 1e6 x dp x cp))."""
    ddp_average_in_collective: bool = False
    """Average gradients inside the reduction collective instead of scaling beforehand."""
    ddp_pad_buckets_for_high_nccl_busbw: bool = False
    """Pad each gradient bucket to a multiple that keeps NCCL's bus bandwidth high
    (--ddp-pad-buckets-for-high-nccl-busbw): lcm(dp, 128, 2**16) elements with the
    distributed optimizer."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Adam (Megatron-LM's default) or SGD with momentum."""
    sgd_momentum: float = 0.9
    """SGD momentum (0 keeps no momentum buffer)."""
    use_precision_aware_optimizer: bool = False
    """Transformer Engine's FusedAdam keeps main params / moments in the dtypes below."""
    main_grads_dtype: Literal["fp32", "bf16"] = "fp32"
    """Main-gradient dtype (non-fp32 needs use_precision_aware_optimizer)."""
    main_params_dtype: Literal["fp32", "fp16"] = "fp32"
    """Master-parameter dtype (non-fp32 needs use_precision_aware_optimizer)."""
    exp_avg_dtype: Literal["fp32", "fp16", "bf16", "fp8"] = "fp32"
    """Adam first-moment dtype (non-fp32 needs use_precision_aware_optimizer)."""
    exp_avg_sq_dtype: Literal["fp32", "fp16", "bf16", "fp8"] = "fp32"
    """Adam second-moment dtype (non-fp32 needs use_precision_aware_optimizer)."""
    clip_grad: float = 1.0
    """Gradient clipping by global norm (0 turns it off)."""
    log_num_zeros_in_grad: bool = False
    """Count zero gradients at every step (Megatron-LM's --log-num-zeros-in-grad)."""
    gradient_accumulation_fusion: bool = True
    """Weight-gradient GEMMs accumulate straight into DDP's main-grad buffers (Megatron-LM's
    default; --no-gradient-accumulation-fusion turns it off)."""
    defer_embedding_wgrad_compute: bool = False
    """The last stage keeps each micro-batch's output-layer input and logits gradient and runs
    the output layer's weight-gradient GEMMs after the last backward (--defer-embedding-wgrad-compute;
    needs pipeline parallelism and gradient_accumulation_fusion)."""
    wgrad_deferral_limit: int = 0
    """With defer_embedding_wgrad_compute: how many micro-batches are deferred (0: all)."""
    calculate_per_token_loss: bool = False
    """Normalise the loss by the tokens of the whole global batch (--calculate-per-token-loss)."""
    moe_routing: Literal["balanced", "capacity"] = "balanced"
    """Token counts per expert, which depend on the data, as metatrace assumes them: balanced
    (every expert gets tokens x topk / experts; dropless routing) or capacity (each expert's
    input padded to its capacity, megatron-core's static path; needs moe_expert_capacity_factor)."""
    moe_expert_capacity_factor: float | None = None
    """Expert capacity as a multiple of the balanced share. With moe_routing capacity every
    expert's input is padded to it; with balanced routing tokens beyond it are dropped (which
    caps moe_hottest_expert_load)."""
    moe_hottest_expert_load: float = 1.0
    """With balanced routing: the most loaded expert on each rank gets this multiple of the
    balanced share (e.g. 1.5), to see the worst case; the other experts keep theirs."""
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """Router logits and probabilities in fp32 / fp64 instead of the model dtype."""
    create_attention_mask_in_dataloader: bool = True
    """The data loader builds a causal mask bool [b, 1, s, s] per micro-batch and copies it to
    the GPU (Megatron-LM's default; --no-create-attention-mask-in-dataloader turns it off)."""


@dataclass(frozen=True, kw_only=True)
class Implementation:
    transformer_impl: Literal["local", "transformer_engine"] = "transformer_engine"
    """Layer spec family: Transformer Engine (Megatron-LM's default) or megatron-core's local
    modules."""
    attention_backend: Literal["auto", "local", "unfused", "flash", "fused"] = "auto"
    """Attention kernel. auto: what Transformer Engine picks on cluster.gpu (fused cuDNN
    attention on the GPUs metatrace knows); flash: TE's flash-attn path (needs flash-attn
    2.1.1-2.8.1 next to TE 2.8); local: megatron-core's own attention (local spec only)."""
    rope_fusion: bool | None = None
    """Transformer Engine's fused RoPE kernel (Megatron-LM's default with TE; needs TE, so the
    local spec defaults to megatron-core's unfused RoPE)."""
    cross_entropy_loss_fusion: bool = False
    """Fused vocab-parallel cross entropy (--cross-entropy-loss-fusion)."""
    cross_entropy_fusion_impl: Literal["native", "te"] = "native"
    """With cross_entropy_loss_fusion: megatron-core's fused kernel, or Transformer Engine's
    (which overwrites the logits with their gradient)."""
    bias_activation_fusion: bool = True
    """Fused bias-GeLU / bias-SwiGLU kernels (Megatron-LM's default; --no-bias-gelu-fusion,
    --no-bias-swiglu-fusion turn them off). Only GeLU with biases and SwiGLU have one."""
    bias_dropout_fusion: bool = True
    """Fused bias-dropout-add (--no-bias-dropout-fusion turns it off)."""
    masked_softmax_fusion: bool = True
    """Apex's fused scaled masked softmax in megatron-core's own attention
    (--no-masked-softmax-fusion turns it off)."""
    attention_softmax_in_fp32: bool = False
    """Attention softmax in fp32 in unfused attention (--attention-softmax-in-fp32)."""
    apply_query_key_layer_scaling: bool = False
    """Scale attention scores by the layer number (--apply-query-key-layer-scaling); forces
    the softmax into fp32."""
    moe_grouped_gemm: bool = False
    """Experts of a MoE layer as one grouped GEMM (Transformer Engine's GroupedLinear) instead of
    one MLP per expert."""
    moe_permute_fusion: bool = False
    """Transformer Engine's fused token permutation kernels in the MoE dispatchers
    (--moe-permute-fusion): int32 row-id maps instead of megatron-core's index tensors."""
    moe_router_fusion: bool = False
    """Transformer Engine's fused top-k / aux-loss router kernels (--moe-router-fusion)."""
    torch_compile: bool = True
    """megatron-core's fused kernels (@jit_fuser: bias-GeLU, SwiGLU, bias-dropout-add, the fused
    cross entropy) run compiled by torch.compile, as they do on a GPU; false runs them eagerly
    (TORCHDYNAMO_DISABLE=1 or TORCH_COMPILE_DISABLE=1), which allocates other buffers."""
    te_op_fuser: bool = False
    """Dense MLPs run as megatron-core's TEFusedMLP, one Transformer Engine operation-fuser
    pipeline (te.pytorch.ops.Sequential: norm, fc1, activation, fc2, TP reduction) instead of
    LayerNormLinear, megatron-core's activation and Linear (--use-transformer-engine-op-fuser,
    Megatron-LM after core_v0.16.1). Only dense MLPs change: attention, MoE experts and shared
    experts keep their modules. Saves what the unfused modules save in bf16; under FP8 both MLP
    weights are quantized again in every forward and kept per micro-batch in flight, instead of
    one persistent FP8 weight per module."""


# Compute capability of each GPU model (what Transformer Engine's choices depend on).
GPU_ARCH = {
    "a100-40gb": "sm80",
    "a100": "sm80",
    "h100": "sm90",
    "h800": "sm90",
    "h200": "sm90",
    "b200": "sm100",
    "gb200": "sm100",
    "l40s": "sm89",
    "mi300x": "gfx942",
}

# Device memory as `torch.cuda.get_device_properties(0).total_memory` reports it, in GiB,
# rounded to 0.1 GiB (the advertised "80 GB" of an H100 is 79.1 GiB usable by PyTorch).
GPU_MEMORY_GIB = {
    "a100-40gb": 39.4,
    "a100": 79.3,
    "h100": 79.1,
    "h800": 79.1,
    "h200": 139.8,
    "b200": 178.4,
    "gb200": 184.0,
    "l40s": 44.4,
    "mi300x": 191.5,
}


# Link bandwidth per GPU and direction, in Gb/s: (inside a node: NVLink or PCIe, across nodes:
# one NIC per GPU). Class defaults of common systems (e.g. DGX H100: NVLink 4 at 450 GB/s, one
# 400 Gb/s NDR InfiniBand port per GPU); set cluster.intra_node_gbps / inter_node_gbps for yours.
GPU_LINKS_GBPS = {
    "a100-40gb": (2400, 200),  # NVLink 3, 300 GB/s; HDR InfiniBand
    "a100": (2400, 200),
    "h100": (3600, 400),  # NVLink 4, 450 GB/s; NDR InfiniBand
    "h800": (1600, 400),  # NVLink 4 at 200 GB/s
    "h200": (3600, 400),
    "b200": (7200, 400),  # NVLink 5, 900 GB/s
    "gb200": (7200, 400),
    "l40s": (256, 200),  # PCIe 4.0 x16, 32 GB/s
    "mi300x": (3584, 400),  # Infinity Fabric, 7 links of 64 GB/s
}


# Peak dense (no sparsity) bf16 tensor-core throughput per GPU, TFLOP/s, from the vendors' data
# sheets (SXM / OAM parts). The time model (metatrace.timing) runs every counted FLOP at this
# peak times cluster.compute_efficiency; FP8 GEMMs run at twice it on GPU_FP8_ARCHS.
GPU_PEAK_TFLOPS = {
    "a100-40gb": 312,
    "a100": 312,
    "h100": 989,
    "h800": 989,
    "h200": 989,
    "b200": 2250,
    "gb200": 2500,
    "l40s": 362,
    "mi300x": 1307,
}

# Architectures whose tensor cores run FP8 at twice the bf16 rate (Ada, Hopper, Blackwell).
GPU_FP8_ARCHS = ("sm89", "sm90", "sm100")

# Device memory bandwidth, TB/s (data sheets): the optimizer step's element-wise update is
# bound by it (metatrace.timing).
GPU_HBM_TBPS = {
    "a100-40gb": 1.555,
    "a100": 2.039,
    "h100": 3.35,
    "h800": 3.35,
    "h200": 4.8,
    "b200": 8.0,
    "gb200": 8.0,
    "l40s": 0.864,
    "mi300x": 5.3,
}


@dataclass(frozen=True, kw_only=True)
class Cluster:
    num_gpus: int | None = None
    """GPUs in the job; default tp x pp x cp x dp."""
    gpus_per_node: int = 8
    """GPUs per node; ranks are placed on nodes in order (GPU names n{node}_g{gpu})."""
    gpu: str = "h100"
    """GPU model: one of GPU_MEMORY_GIB's keys."""
    gpu_memory_gib: float | None = None
    """Memory per GPU; default from `gpu`."""
    reserved_overhead_gib: float = 4.0
    """Memory a GPU needs beside what PyTorch's caching allocator hands out: the CUDA context,
    NCCL's communicators and buffers, and allocator fragmentation. Added to the predicted peak
    for the verdict, never to the peak itself."""
    intra_node_gbps: float | None = None
    """Link bandwidth per GPU and direction inside a node, Gb/s (default for `gpu`)."""
    inter_node_gbps: float | None = None
    """Network bandwidth per GPU and direction across nodes, Gb/s (default for `gpu`)."""
    cublas_workspace_config: str | None = None
    """The run's CUBLAS_WORKSPACE_CONFIG (":SIZE_KIB:COUNT" pairs), which sizes PyTorch's cuBLAS
    workspaces; default PyTorch's for `gpu` (":4096:8" on sm90/sm100, ":4096:2:16:8" before)."""
    compute_efficiency: float = 0.5
    """An assumption of the time model, not a measurement: the fraction of the GPU's peak dense
    FLOP/s (GPU_PEAK_TFLOPS) that the counted FLOPs (matrix products and attention) run at,
    i.e. the model FLOPs utilisation of the steps' compute. 0.5 is typical of well-tuned
    Megatron-LM runs of large dense models on Hopper (published runs report 0.4 to 0.55);
    small models and short sequences reach less. Between 0 (exclusive) and 1."""


@dataclass(frozen=True)
class NotModelled:
    """An option of the run that metatrace does not model: the prediction is made without it."""

    option: str
    """As the run gives it, e.g. "--moe-router-fusion" or "--optimizer muon"."""
    feature: str
    """What is not modelled."""
    direction: Literal["raises", "lowers", "either", "unknown", "traffic"]
    """How it could move the predicted peak: raises, lowers, either way, unknown, or not at all
    (traffic: it changes only the communication)."""


@dataclass(frozen=True, kw_only=True)
class Job:
    model: Model = field(default_factory=Model)
    parallel: Parallel = field(default_factory=Parallel)
    training: Training = field(default_factory=Training)
    implementation: Implementation = field(default_factory=Implementation)
    cluster: Cluster = field(default_factory=Cluster)
    source: str = "<config>"
    """Where the job came from (a file name), for messages."""

    # Derived values; `resolve()` fills them. Read them, do not set them in a file.
    padded_vocab_size: int = 0
    num_microbatches: int = 0
    notes: tuple[str, ...] = ()
    """What was adjusted the way Megatron-LM adjusts it (e.g. sequence parallel off at tp 1)."""
    attention_kernel: str = ""
    """The attention that runs: fused, flash or unfused (Transformer Engine), local."""
    not_modelled: tuple[NotModelled, ...] = ()
    """Options of the run metatrace does not model (from Megatron-LM arguments): the prediction
    leaves them out, and the verdict says so."""


SECTIONS = ("model", "parallel", "training", "implementation", "cluster")
_DERIVED = (
    "source", "padded_vocab_size", "num_microbatches", "notes", "attention_kernel", "not_modelled"
)


# --------------------------------------------------------------------------- loading


def load_job(path: str | Path) -> Job:
    """Read a YAML job file, apply the preset, derive and check everything."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"{path}: not valid YAML{line}: {getattr(e, 'problem', e)}") from None
    data = data if data is not None else {}
    return job_from_dict(data, source=str(path), base_dir=path.parent)


def job_from_dict(
    data: Any, *, source: str = "<config>", base_dir: str | Path | None = None
) -> Job:
    """Build and resolve a Job from a plain mapping (the parsed YAML). A relative
    `model.hf_config` is read from `base_dir` (the job file's directory; default the current
    one)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections {SECTIONS}")
    data, hf_notes = _apply_hf_config(data, Path(base_dir) if base_dir is not None else None)
    job = _build(
        Job, _apply_preset(data), "", exclude=_DERIVED
    )
    job = resolve(dataclasses.replace(job, source=source))
    # resolve() writes its own notes; what the HF config said comes first.
    return dataclasses.replace(job, notes=hf_notes + job.notes) if hf_notes else job


def _all_keys() -> dict[str, str]:
    """Every valid key as {leaf: full path}, to point at the right section."""
    out = {}
    for sec in SECTIONS:
        cls = typing.get_type_hints(Job)[sec]
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, f"{sec}.{f.name}")
            if dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name]):
                for g in dataclasses.fields(typing.get_type_hints(cls)[f.name]):
                    out.setdefault(g.name, f"{sec}.{f.name}.{g.name}")
    return out


def _unknown_key(cls, key: str, path: str, valid: list[str]) -> ConfigError:
    full = f"{path}.{key}" if path else key
    norm = str(key).replace("-", "_")
    close = difflib.get_close_matches(norm, valid, n=1, cutoff=0.6)
    if norm in valid:
        hint = f"; did you mean '{_join(path, norm)}'?"
    elif close:
        hint = f"; did you mean '{_join(path, close[0])}'?"
    else:
        elsewhere = _all_keys().get(norm)
        hint = f"; did you mean '{elsewhere}'?" if elsewhere else f" (valid keys: {', '.join(valid)})"
    return ConfigError(f"unknown key '{full}'{hint}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _build(cls, data: Any, path: str, exclude: tuple[str, ...] = ()):
    if not isinstance(data, dict):
        raise ConfigError(f"'{path}' must be a mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls) if f.name not in exclude]
    kwargs = {}
    for key, value in data.items():
        if key not in valid:
            raise _unknown_key(cls, key, path, valid)
        kwargs[key] = _coerce(hints[key], value, _join(path, key))
    return cls(**kwargs)


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if value is not None else "nothing (null)"


def _coerce(tp, value: Any, path: str):
    """Check `value` against the annotation `tp`; return it (ints accepted for floats)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(option, value, path)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, path)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            choices = ", ".join(str(a) for a in args)
            raise ConfigError(f"'{path}' must be one of {choices}; got {value!r}{hint}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"'{path}' must be a list, got {_describe(value)}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"'{path}' must be true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"'{path}' must be a whole number, got {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"'{path}' must be a number, got {_describe(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"'{path}' must be a string, got {_describe(value)}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} at {path}")  # a bug in this file, not input


# --------------------------------------------------------------------------- resolving


def resolve(job: Job) -> Job:
    """Apply the preset, derive every default the way Megatron-LM does, and check the result."""
    model = _resolve_model(job.model)
    training = job.training
    if training.seq_length is None:
        raise ConfigError("'training.seq_length' is required")
    if model.max_position_embeddings is None:
        model = dataclasses.replace(model, max_position_embeddings=training.seq_length)

    par = job.parallel
    cl = job.cluster
    if par.etp is None:
        par = dataclasses.replace(par, etp=par.tp)
    if par.vpp == 1:
        par = dataclasses.replace(par, vpp=None)
    model_size = par.tp * par.pp * par.cp
    for name in ("tp", "pp", "cp", "ep", "etp"):
        if getattr(par, name) < 1:
            raise ConfigError(f"'parallel.{name}' must be at least 1, got {getattr(par, name)}")
    if par.vpp is not None and par.vpp < 1:
        raise ConfigError(f"'parallel.vpp' must be at least 1, got {par.vpp}")
    if par.dp is not None and par.dp < 1:
        raise ConfigError(f"'parallel.dp' must be at least 1, got {par.dp}")
    if cl.num_gpus is None:
        cl = dataclasses.replace(cl, num_gpus=model_size * (par.dp or 1))
    if cl.num_gpus < 1:
        raise ConfigError(f"'cluster.num_gpus' must be at least 1, got {cl.num_gpus}")
    if cl.gpus_per_node < 1:
        raise ConfigError(f"'cluster.gpus_per_node' must be at least 1, got {cl.gpus_per_node}")
    if par.dp is None:
        if cl.num_gpus % model_size:
            raise ConfigError(
                f"cluster.num_gpus = {cl.num_gpus} is not divisible by "
                f"tp x pp x cp = {par.tp} x {par.pp} x {par.cp} = {model_size}"
            )
        par = dataclasses.replace(par, dp=cl.num_gpus // model_size)
    elif model_size * par.dp != cl.num_gpus:
        raise ConfigError(
            f"tp x pp x cp x dp = {par.tp} x {par.pp} x {par.cp} x {par.dp} = "
            f"{model_size * par.dp}, but cluster.num_gpus = {cl.num_gpus}"
        )
    if cl.gpu_memory_gib is None:
        if cl.gpu not in GPU_MEMORY_GIB:
            close = difflib.get_close_matches(cl.gpu, list(GPU_MEMORY_GIB), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown 'cluster.gpu' {cl.gpu!r}{hint} (known: {', '.join(GPU_MEMORY_GIB)}); "
                "or give cluster.gpu_memory_gib"
            )
        cl = dataclasses.replace(cl, gpu_memory_gib=GPU_MEMORY_GIB[cl.gpu])
    intra, inter = GPU_LINKS_GBPS.get(cl.gpu, (None, None))
    if cl.intra_node_gbps is None or cl.inter_node_gbps is None:
        if intra is None:
            raise ConfigError(
                f"no link bandwidths are known for cluster.gpu {cl.gpu!r}; give "
                "cluster.intra_node_gbps and cluster.inter_node_gbps"
            )
        cl = dataclasses.replace(
            cl,
            intra_node_gbps=cl.intra_node_gbps if cl.intra_node_gbps is not None else intra,
            inter_node_gbps=cl.inter_node_gbps if cl.inter_node_gbps is not None else inter,
        )
    for name in ("intra_node_gbps", "inter_node_gbps"):
        if getattr(cl, name) <= 0:
            raise ConfigError(f"'cluster.{name}' must be positive, got {getattr(cl, name)}")

    if training.global_batch_size is None:
        training = dataclasses.replace(
            training, global_batch_size=training.micro_batch_size * par.dp
        )
    notes = []
    if par.etp != par.tp and model.num_experts is None:
        notes.append(
            f"parallel.etp = {par.etp} only lays out the expert process groups (megatron-core "
            "builds them for every model); this model has no experts"
        )
    if par.sequence_parallel and par.tp == 1:
        par = dataclasses.replace(par, sequence_parallel=False)
        notes.append("sequence_parallel has no effect at tp = 1; Megatron-LM turns it off too")
    if training.grad_reduce_in_fp32 is None:
        # Megatron-LM's validate_args: bf16 accumulates and reduces gradients in fp32 unless
        # the main grads are asked for in bf16 (--grad-reduce-in-bf16 / --main-grads-dtype).
        training = dataclasses.replace(
            training,
            grad_reduce_in_fp32=training.precision in ("bf16", "fp8")
            and training.main_grads_dtype == "fp32",
        )
    if par.overlap_p2p_comm is None:
        par = dataclasses.replace(par, overlap_p2p_comm=par.vpp is not None)
    if par.microbatch_group_size is None and par.vpp is not None:
        par = dataclasses.replace(par, microbatch_group_size=par.pp)
    if par.layout is not None:
        from metatrace.checks import layout_stages

        stages = layout_stages(par.layout, par.pp)
        vpp = len(stages) // par.pp
        if par.vpp is not None and par.vpp != vpp:
            raise ConfigError(
                f"parallel.vpp = {par.vpp}, but parallel.layout has {len(stages)} stages = "
                f"pp {par.pp} x {vpp} virtual stages"
            )
        par = dataclasses.replace(par, vpp=vpp if vpp > 1 else None)
        if par.vpp is not None:
            par = dataclasses.replace(
                par,
                overlap_p2p_comm=True if job.parallel.overlap_p2p_comm is None else par.overlap_p2p_comm,
                microbatch_group_size=par.microbatch_group_size or par.pp,
            )
    impl = job.implementation
    te = impl.transformer_impl == "transformer_engine"
    if impl.rope_fusion is None:
        # Megatron-LM's default with Transformer Engine, turned off without RoPE.
        # megatron-core fuses MLA's RoPE only for yarn (MLATransformerConfig refuses the rest).
        impl = dataclasses.replace(
            impl,
            rope_fusion=te and model.position_embedding_type == "rope"
            and (not model.multi_latent_attention or model.rope_type == "yarn"),
        )
    kernel = impl.attention_backend
    if kernel == "auto":
        # Transformer Engine 2.8 prefers cuDNN fused attention on sm90+ and, without a
        # flash-attn it accepts (2.1.1-2.8.1), on sm80 too; the local spec has one attention.
        kernel = "fused" if te else "local"
    if not te and kernel == "unfused":
        kernel = "local"  # megatron-core's own attention is the unfused one
    if training.precision == "fp8":
        training = dataclasses.replace(
            training,
            fp8_format=training.fp8_format or "hybrid",
            fp8_recipe=training.fp8_recipe or "delayed",
        )
    rec = training.recompute
    if rec.granularity == "selective" and rec.modules is None:
        rec = dataclasses.replace(rec, modules=["core_attn"])
        training = dataclasses.replace(training, recompute=rec)

    multiple = model.make_vocab_size_divisible_by * par.tp
    padded = math.ceil(model.vocab_size / multiple) * multiple
    job = dataclasses.replace(
        job,
        model=model,
        parallel=par,
        training=training,
        cluster=cl,
        implementation=impl,
        padded_vocab_size=padded,
        notes=tuple(notes),
        attention_kernel=kernel,
    )
    from metatrace.checks import check_job, check_with_megatron

    check_job(job)
    check_with_megatron(job)
    micro = training.micro_batch_size * par.dp
    return dataclasses.replace(job, num_microbatches=training.global_batch_size // micro)


# Megatron-LM's command-line defaults for the model section when neither a preset nor the
# file sets them (../shared/notes/megatron-args.md, sections 2 and 4).
_MODEL_DEFAULTS = {
    "position_embedding_type": "learned_absolute",
    "rotary_base": 10000,
    "normalization": "LayerNorm",
    "activation": "gelu",
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "untie_embeddings_and_output_weights": False,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
}
_REQUIRED_MODEL = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


def _apply_preset(data: dict) -> dict:
    """Merge `model.preset`'s dimensions under the keys the file gives explicitly."""
    from metatrace.models.presets import PRESETS

    model = data.get("model")
    if model is None:
        return data
    if not isinstance(model, dict):
        raise ConfigError(f"'model' must be a mapping, got {_describe(model)}")
    name = model.get("preset")
    if name is None:
        return data
    if not isinstance(name, str) or name not in PRESETS:
        close = difflib.get_close_matches(str(name), list(PRESETS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown 'model.preset' {name!r}{hint} (known: {', '.join(PRESETS)})")
    return {**data, "model": {**PRESETS[name].dims, **model}}


def _apply_hf_config(data: dict, base_dir: Path | None) -> tuple[dict, tuple[str, ...]]:
    """Merge the model section read from `model.hf_config` under the keys the file gives
    explicitly, as `_apply_preset` does; the notes of the reading (`metatrace.models.hf`)."""
    model = data.get("model")
    if not isinstance(model, dict) or model.get("hf_config") is None:
        return data, ()  # _apply_preset names a model section that is not a mapping
    if model.get("preset") is not None:
        raise ConfigError("'model.preset' and 'model.hf_config' both give the model; keep one "
                          "(explicit model keys override either)")
    name = model["hf_config"]
    if not isinstance(name, str):
        raise ConfigError(
            f"'model.hf_config' must be the path of a config.json, got {_describe(name)}"
        )
    from metatrace.models.hf import read_hf_config

    path = Path(name).expanduser()
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    training = data.get("training")
    seq = training.get("seq_length") if isinstance(training, dict) else None
    seq = seq if type(seq) is int else None  # a bad one is reported by resolve()
    dims, notes = read_hf_config(path, seq_length=seq)
    return {**data, "model": {**dims, **model}}, notes


def _resolve_model(model: Model) -> Model:
    values = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    for name, value in _MODEL_DEFAULTS.items():
        if values[name] is None:
            values[name] = value
    missing = [n for n in _REQUIRED_MODEL if values[n] is None]
    if missing:
        raise ConfigError(
            "model needs " + ", ".join(f"'model.{n}'" for n in missing)
            + " (or a model.preset or model.hf_config)"
        )
    for name in _REQUIRED_MODEL + ("ffn_hidden_size", "num_query_groups", "kv_channels"):
        if values[name] is not None and values[name] < 1:
            raise ConfigError(f"'model.{name}' must be at least 1, got {values[name]}")
    if values["add_bias_linear"]:
        values["add_qkv_bias"] = True  # Megatron-LM: linear biases include the QKV bias
    h = values["hidden_size"]
    if values["ffn_hidden_size"] is None:
        # Megatron-LM: 4h, or for SwiGLU floor(8h/3 / 64) * 64 (arguments.py, validate_args).
        gated = values["activation"] in GATED_ACTIVATIONS
        values["ffn_hidden_size"] = (4 * h * 2 // 3 // 64) * 64 if gated else 4 * h
    if values["kv_channels"] is None:
        if h % values["num_attention_heads"]:
            raise ConfigError(
                f"model.hidden_size = {h} is not divisible by model.num_attention_heads = "
                f"{values['num_attention_heads']}; give model.kv_channels"
            )
        values["kv_channels"] = h // values["num_attention_heads"]
    if values["num_query_groups"] is None:
        values["num_query_groups"] = values["num_attention_heads"]
    if values["rope_type"] is None:
        # megatron-core's MLATransformerConfig defaults to yarn; other attention rotates plainly.
        values["rope_type"] = "yarn" if values["multi_latent_attention"] else "rope"
    if values["num_experts"] is not None:
        if values["num_experts"] < 1:
            raise ConfigError(f"'model.num_experts' must be at least 1, got {values['num_experts']}")
        if values["moe_ffn_hidden_size"] is None:
            values["moe_ffn_hidden_size"] = values["ffn_hidden_size"]
        values["moe_layer_freq"] = moe_layer_pattern(values["moe_layer_freq"], values["num_layers"])
    return Model(**values)


def moe_layer_pattern(freq, num_layers: int) -> list[int]:
    """model.moe_layer_freq as a 0/1 list per layer (1: MoE), as Megatron-LM reads it: every
    n-th layer from the first, a list, or an expression of lists such as "([0]*3+[1]*58)"."""
    import ast

    where = "'model.moe_layer_freq'"
    if isinstance(freq, str):
        def value(node):
            if isinstance(node, ast.Constant) and type(node.value) is int:
                return node.value
            if isinstance(node, ast.List):
                return [value(e) for e in node.elts]
            if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
                left, right = value(node.left), value(node.right)
                return left + right if isinstance(node.op, ast.Add) else left * right
            raise ValueError
        try:
            freq = value(ast.parse(freq.strip(), mode="eval").body)
        except (SyntaxError, ValueError, TypeError):
            raise ConfigError(
                f"{where} {freq!r} is not an integer, a list or an expression such as "
                "\"([0]*3+[1]*58)\""
            ) from None
    if isinstance(freq, int):
        if freq < 1:
            raise ConfigError(f"{where} must be at least 1, got {freq}")
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    if len(freq) != num_layers or any(v not in (0, 1) for v in freq):
        raise ConfigError(
            f"{where} must give 0 (dense) or 1 (MoE) for each of the {num_layers} layers, got "
            f"{len(freq)} values"
        )
    return list(freq)


def job_to_dict(job: Job) -> dict:
    """The resolved job as plain data (for JSON output and the config summary)."""
    return dataclasses.asdict(job)
