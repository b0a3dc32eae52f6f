"""The job: nested keyword-only dataclasses, one per section of a job file (model, parallel,
training, implementation, cluster), a docstring on every key. metatrace.config.load reads them
from YAML, metatrace.config.resolve derives what Megatron-LM derives."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, TypeVar

_T = TypeVar("_T")


def replace(obj: _T, **changes) -> _T:
    """dataclasses.replace for the job's dataclasses (frozen, every field set by __init__, no
    __post_init__, no slots): a copy with `changes`, without a call to __init__ (2-3 us against
    12-23 us, measured: the planner resolves thousands of layouts, each a dozen replacements)."""
    unknown = set(changes) - obj.__dataclass_fields__.keys()  # type: ignore[attr-defined]
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field {sorted(unknown)[0]!r}")
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


Precision = Literal["bf16", "fp16", "fp32", "fp8", "fp4"]
Activation = Literal["gelu", "swiglu", "geglu", "quick_geglu", "relu", "squared_relu", "silu"]
GATED_ACTIVATIONS = ("swiglu", "geglu", "quick_geglu")


@dataclass(frozen=True, kw_only=True)
class Model:
    preset: str | None = None
    """Name of a preset in `metatrace.config.presets` (e.g. llama2-7b); explicit keys override it."""
    hf_config: str | None = None
    """Path of a Hugging Face config.json (relative to the job file) read into this section by
    `metatrace.config.hf`; explicit keys override it. Not together with preset."""
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
    position_embedding_type: Literal["learned_absolute", "rope", "yarn", "none"] | None = None
    """learned_absolute (Megatron-LM's default), rope, yarn (GPTModel's YarnRotaryEmbedding,
    GPT-OSS; set by the yarn keys below, without multi-latent attention) or none."""
    rotary_base: int | None = None
    """RoPE base (10000 unless a preset says otherwise)."""
    rotary_percent: float = 1.0
    """Fraction of the head dimension that RoPE rotates."""
    normalization: Literal["LayerNorm", "RMSNorm"] | None = None
    """LayerNorm (default) or RMSNorm."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalisation layers."""
    activation: Activation | None = None
    """MLP activation: gelu (default), swiglu, geglu, quick_geglu (megatron-core's quick_gelu
    gated, Megatron-LM's --quick-geglu; GPT-OSS), relu, squared_relu, silu."""
    glu_linear_offset: float = 0.0
    """Gated activations: act(x_glu) * (x_linear + offset) (GPT-OSS: 1.0). Values only."""
    activation_func_clamp_value: float | None = None
    """Gated activations: clamp x_glu from above and x_linear to [-v, v] before the activation
    (GPT-OSS's swiglu_limit 7.0); omitted means no clamp."""
    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = "vanilla"
    """Attention softmax with a sink (Transformer Engine 2.8's softmax_type): off-by-one adds 1
    to the denominator, learnable a trained logit per head (GPT-OSS's attention sinks: one
    parameter [heads / tp] per layer). Not with flash attention (TE turns it off)."""
    window_size: list[int] | None = None
    """Sliding-window attention [left, right] (-1: unbounded; causal windows are [w, 0]);
    omitted means full attention. GPT-OSS: [128, 0]."""
    window_attn_skip_freq: int | list[int] | None = None
    """Which layers keep full attention among the windowed ones: every n-th layer (an integer;
    GPT-OSS 2: layers 2, 4, ... full, 1, 3, ... windowed) or a 0/1 list per layer (1: window);
    omitted means every layer is windowed."""
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
    moe_shared_expert_gate: bool = False
    """A sigmoid gate on the shared experts' output (Qwen2-MoE, Qwen3-Next; megatron-core's
    moe_shared_expert_gate): hidden_size weights a layer, one logit a token."""
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
        "aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"
    ] = "aux_loss"
    """Load balancing of the router (Megatron-LM default aux_loss; quantile_balancing, a
    per-expert bias updated once per global batch, needs megatron-core 0.19)."""
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
    mla_down_proj_fusion: bool = False
    """MLA (megatron-core 0.19, Transformer Engine, q_lora_rank set): one down-projection for
    the query and the key-value latents with the input norm fused in (FusedMLASelfAttention,
    --mla-down-proj-fusion)."""
    rope_type: Literal["rope", "yarn"] | None = None
    """MLA: rotary embedding kind; default yarn (megatron-core's MLATransformerConfig). Without
    MLA only rope (YaRN there is position_embedding_type: yarn)."""
    rotary_scaling_factor: float = 1.0
    """yarn (MLA, or position_embedding_type yarn): context-extension factor (Megatron-LM's
    default 1.0; DeepSeek-V3: 40; GPT-OSS: 32)."""
    original_max_position_embeddings: int = 4096
    """yarn: the pre-extension context length."""
    beta_fast: float = 32.0
    """yarn: fast correction boundary."""
    beta_slow: float = 1.0
    """yarn: slow correction boundary."""
    mscale: float = 1.0
    """yarn: attention-scale factor."""
    mscale_all_dim: float = 0.0
    """yarn: attention-scale factor for all dimensions (Megatron-LM's default 0)."""
    mtp_num_layers: int | None = None
    """Multi-token prediction depths (DeepSeek-V3: 1), built after the decoder on the last
    pipeline stage (or where parallel.layout puts 'm'); omitted means none."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the multi-token-prediction loss."""
    mtp_use_repeated_layer: bool = False
    """One multi-token-prediction layer applied at every depth (its weights shared: Nemotron 3
    Super); megatron-core 0.19's mtp_use_repeated_layer."""
    hybrid_layer_pattern: str | None = None
    """Hybrid models (Nemotron-H, Nemotron 3): one symbol a layer, as megatron-core's hybrid
    model reads it: M Mamba-2, * attention, - MLP, E mixture of experts; megatron-core 0.19 also
    takes G (Gated DeltaNet), `|` between pipeline stages and `/` before the multi-token
    prediction pattern (once per depth). model.num_layers is then the number of layer symbols
    of the main pattern. Megatron-LM: --hybrid-override-pattern (0.16.1), --hybrid-layer-pattern
    (0.19)."""
    mamba_state_dim: int = 128
    """Mamba-2: state size per head (N; Megatron-LM's --mamba-state-dim)."""
    mamba_head_dim: int = 64
    """Mamba-2: head dimension (P)."""
    mamba_num_groups: int = 8
    """Mamba-2: groups sharing B and C (G)."""
    mamba_num_heads: int | None = None
    """Mamba-2: heads; omitted means 2 x hidden_size / mamba_head_dim (megatron-core's
    expand 2)."""
    linear_attention_freq: int | list[int] | None = None
    """Gated DeltaNet layers in place of attention (Qwen3-Next; megatron-core's
    experimental_attention_variant gated_delta_net): every n-th layer keeps attention (an
    integer; Qwen3-Next: 4) or a 1/0 list per layer (1: Gated DeltaNet); omitted means none."""
    linear_conv_kernel_dim: int = 4
    """Gated DeltaNet: the short convolution's kernel size."""
    linear_key_head_dim: int = 128
    """Gated DeltaNet: query and key head dimension."""
    linear_value_head_dim: int = 128
    """Gated DeltaNet: value head dimension."""
    linear_num_key_heads: int = 16
    """Gated DeltaNet: query and key heads."""
    linear_num_value_heads: int = 32
    """Gated DeltaNet: value heads (a multiple of the key heads)."""
    attention_output_gate: bool = False
    """Gated attention (Qwen3-Next): the query projection also gives a gate per head and
    channel, sigmoid(gate) scales the attention output before linear_proj (megatron-core's
    attention_output_gate; linear_qkv grows by num_attention_heads x kv_channels columns)."""
    moe_latent_size: int | None = None
    """LatentMoE (Nemotron 3 Super): the routed experts run in a space of this width, between
    a down-projection of the hidden state before dispatch (fc1_latent_proj, h x latent) and an
    up-projection after combine (fc2_latent_proj); the shared experts and the router keep the
    hidden size (megatron-core's moe_latent_size). Omitted means none."""


UbMethod = Literal["ring_exchange", "pipeline", "bulk", "external"]


@dataclass(frozen=True, kw_only=True)
class UbGemm:
    """One GEMM's entry of Transformer Engine's userbuffers configuration (initialize_ub's
    ub_cfgs; Megatron-LM's --tp-comm-overlap-cfg YAML). `method` and `fp8_buf` decide the
    buffer's size; num_sm with set_sm_margin the multiprocessors the GEMM leaves to the
    collective (the time model's); the others tune speed only and change no memory or traffic."""

    method: UbMethod | None = None
    """ring_exchange (peer-to-peer), pipeline (split GEMM and collective), bulk, external;
    default: TE's for the GEMM."""
    fp8_buf: bool | None = None
    """Under FP8, an FP8 (1-byte) buffer; TE honours it for all-gather GEMMs (always FP8) and
    for pipeline reduce-scatters."""
    is_reduce_scatter: bool | None = None
    num_sm: int | None = None
    cga_size: int | None = None
    set_sm_margin: bool | None = None
    num_splits: int | None = None
    aggregate: bool | None = None
    atomic_gemm: bool | None = None
    use_ce: bool | None = None
    comm_priority: int | None = None
    gemm_priority: int | None = None
    pipeline_rs_overlap_first_gemm: bool | None = None


@dataclass(frozen=True, kw_only=True)
class UbConfig:
    """Transformer Engine's userbuffers configuration per GEMM of a transformer layer."""

    qkv_fprop: UbGemm | None = None
    qkv_dgrad: UbGemm | None = None
    qkv_wgrad: UbGemm | None = None
    proj_fprop: UbGemm | None = None
    proj_dgrad: UbGemm | None = None
    proj_wgrad: UbGemm | None = None
    fc1_fprop: UbGemm | None = None
    fc1_dgrad: UbGemm | None = None
    fc1_wgrad: UbGemm | None = None
    fc2_fprop: UbGemm | None = None
    fc2_dgrad: UbGemm | None = None
    fc2_wgrad: UbGemm | None = None


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
    group (Megatron-LM's default), all-to-all over the EP group, or flex: DeepEP / HybridEP
    kernels over the TP x EP group, a token sent once per destination rank."""
    moe_flex_dispatcher_backend: Literal["deepep", "hybridep"] = "deepep"
    """The flex dispatcher's kernels: DeepEP (dispatch, then megatron-core's permutation) or
    HybridEP (the permutation fused into dispatch)."""
    moe_deepep_num_sms: int = 20
    """SMs DeepEP's kernels use (its channels are half of them; sizes its handle tensors; the
    time model's compute beside an overlapped dispatch runs on the others)."""
    moe_hybridep_num_sms: int = 16
    """SMs HybridEP's dispatch and combine kernels use (megatron-core 0.16.1's default 16,
    --moe-hybridep-num-sms): the time model's compute beside an overlapped dispatch runs on the
    others."""
    moe_shared_expert_overlap: bool = False
    """Overlap the shared experts' computation with the token dispatch (alltoall)."""
    overlap_moe_expert_parallel_comm: bool = False
    """Hide the MoE all-to-alls behind the other micro-batch's compute (megatron-core's combined
    1F1B, --overlap-moe-expert-parallel-comm): forward of one micro-batch and backward of another
    run layer by layer together; one more micro-batch in the interleaved warm-up. Needs ep > 1,
    the alltoall dispatcher, no layer recompute, and vpp when pp > 1."""
    delay_wgrad_compute: bool = False
    """With overlap_moe_expert_parallel_comm: the experts' weight gradients run after their layer
    part's backward (TE's delay_wgrad_compute, --delay-wgrad-compute), their inputs and output
    gradients kept until then."""
    tp_comm_overlap: bool = False
    """Transformer Engine's TP communication overlap (--tp-comm-overlap): its linear layers
    all-gather and reduce-scatter through userbuffers, overlapped with their GEMMs; the buffers
    live outside PyTorch's allocator. Needs sequence_parallel and tp > 1."""
    tp_comm_overlap_ag: bool = True
    """With tp_comm_overlap: all-gathers before column-parallel GEMMs (and the output
    gradient's before row-parallel dgrad) through userbuffers."""
    tp_comm_overlap_rs: bool = True
    """With tp_comm_overlap: reduce-scatters after row-parallel GEMMs through userbuffers."""
    tp_comm_overlap_rs_dgrad: bool = False
    """With tp_comm_overlap: the column-parallel dgrad's reduce-scatter pipelined with the dgrad
    GEMM (replaces the bulk overlaps)."""
    tp_comm_bulk_dgrad: bool = True
    """With tp_comm_overlap: the input's all-gather in backward beside the dgrad GEMM."""
    tp_comm_bulk_wgrad: bool = True
    """With tp_comm_overlap: dgrad's reduce-scatter beside the wgrad GEMM."""
    tp_comm_overlap_cfg: UbConfig | None = None
    """With tp_comm_overlap: the userbuffers configuration per GEMM (Megatron-LM's
    --tp-comm-overlap-cfg file; Megatron-Bridge's TransformerLayerTPOverlapCfg)."""


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
    GEMMs (--fp8-format with --bf16), fp4 bf16 parameters with its FP4 GEMMs (--fp4-format
    e2m1 with --bf16; Blackwell only)."""
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
    fp4_recipe: Literal["nvfp4"] | None = None
    """With precision fp4: the scaling recipe (--fp4-recipe; nvfp4, the default and the only
    one Megatron-LM ships: E2M1 data in blocks of 16 with E4M3 scales and a per-tensor amax)."""
    first_last_layers_bf16: bool = False
    """With precision fp8 (not the delayed recipe) or fp4: run the first
    num_layers_at_start_in_bf16 and the last num_layers_at_end_in_bf16 transformer layers in
    bf16 (--first-last-layers-bf16)."""
    num_layers_at_start_in_bf16: int = 1
    """With first_last_layers_bf16: how many of the first layers (--num-layers-at-start-in-bf16)."""
    num_layers_at_end_in_bf16: int = 1
    """With first_last_layers_bf16: how many of the last layers (--num-layers-at-end-in-bf16)."""
    recompute: Recompute = field(default_factory=Recompute)
    """Activation recomputation."""
    activation_offload_modules: (
        list[
            Literal[
                "attn_norm",
                "qkv_linear",
                "core_attn",
                "attn_proj",
                "mlp_norm",
                "expert_fc1",
                "moe_act",
            ]
        ]
        | None
    ) = None
    """megatron-core's fine-grained activation offloading (--fine-grained-activation-offloading
    --offload-modules): what these modules save for backward goes to pinned host memory after
    their forward and comes back in backward. attn_proj needs core_attn; attn_norm and mlp_norm
    move nothing in Transformer Engine's dense layers (their norm is fused into the next linear),
    expert_fc1 only with moe_grouped_gemm. Omitted or empty: off."""
    min_offloaded_tensor_size: int = 1024 * 1024
    """With activation_offload_modules: saved tensors with fewer elements stay on the GPU
    (--min-offloaded-tensor-size)."""
    activation_offload_fraction: float = 1.0
    """With activation_offload_modules (megatron-core 0.19): the share of each micro-batch's
    offload groups that are offloaded; the later groups of its forward stay on the GPU
    (--activation-offload-fraction, 0 to 1)."""
    delta_offload_bytes_across_pp_ranks: int = 0
    """With activation_offload_modules (megatron-core 0.19): pipeline rank r keeps r times
    this many bytes of offload groups on the GPU, those of the micro-batches whose backward
    runs first (--delta-offload-bytes-across-pp-ranks)."""
    fine_grained_offloading_max_inflight_offloads: int | None = None
    """With activation_offload_modules (megatron-core 0.19): per offload module, how many of
    its copies to the host may be pending before the compute stream waits for the oldest
    (--fine-grained-offloading-max-inflight-offloads; None: no such waits)."""
    cpu_offloading_num_layers: int = 0
    """Transformer Engine's layer-wise activation offloading (--cpu-offloading-num-layers): what
    the first N transformer layers save for backward (the tensors TE's modules mark: linear and
    norm inputs, attention's q, k, v and output) goes to pinned host memory during the forward
    and comes back during the backward, a few layers at a time (with the local spec: the linear
    layers' inputs). Needs pipeline parallel size 1, no recompute and fewer than num_layers;
    0: off."""
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
    megatron_fsdp: bool = False
    """Megatron-FSDP (--use-megatron-fsdp): megatron-core's FullyShardedDataParallel in place of
    DDP, with the distributed optimizer. Parameters, gradients and optimizer state are sharded
    over the data-parallel group as fsdp_sharding_strategy says; with optim_grads_params each
    transformer layer's parameters are all-gathered before its forward and its backward and
    freed after them, and its gradients reduce-scattered after its backward."""
    fsdp_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = (
        "optim_grads_params"
    )
    """With megatron_fsdp: what is sharded (ZeRO-0 to ZeRO-3): nothing, the optimizer state, also
    the gradients, also the parameters (--data-parallel-sharding-strategy; Megatron-LM
    core_v0.16.1's default is no_shard, later ones' optim_grads_params)."""
    fsdp_outer_sharding_strategy: Literal["no_shard", "optim"] = "no_shard"
    """With megatron_fsdp and hybrid sharding (num_distributed_optimizer_instances > 1): what is
    sharded across the instances (--outer-dp-sharding-strategy). no_shard: each instance keeps
    its own shards and the gradients are all-reduced across the instances; optim (needs
    fsdp_sharding_strategy optim_grads_params): the main weights and optimizer state are sharded
    over the whole data-parallel group, the gradients reduce-scattered across the instances and
    the parameters all-gathered across them again in the iteration's first micro-batch."""
    fsdp_double_buffer: bool = False
    """With megatron_fsdp: persistent double buffers for the parameter all-gathers and gradient
    reduce-scatters instead of buckets allocated per layer (--fsdp-double-buffer)."""
    fsdp_communication_unit_size: int | None = None
    """With megatron_fsdp: elements to all-gather at once, which sets how far ahead parameters
    are prefetched (--suggested-communication-unit-size; default: megatron-core's)."""
    fsdp_main_grads_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """With megatron_fsdp under megatron-core 0.19 (--megatron-fsdp-main-grads-dtype): the
    dtype of the main-gradient buffer, which is also what the reduce-scatters send unless
    fsdp_grad_comm_dtype says otherwise; auto: the parameters' (bf16 under bf16, where
    megatron-core 0.16.1 keeps them in fp32 with grad_reduce_in_fp32). 0.16.1 has no such
    option: another value than auto is an error there."""
    fsdp_main_params_dtype: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"
    """With megatron_fsdp under megatron-core 0.19 (--megatron-fsdp-main-params-dtype): the
    dtype of the sharded main weights the optimizer steps; auto: the parameters' own, no
    separate copy. 0.16.1 keeps them in fp32: another value is an error there."""
    fsdp_grad_comm_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """With megatron_fsdp under megatron-core 0.19 (--megatron-fsdp-grad-comm-dtype): the dtype
    the gradient reduce-scatters send (a cast copy where it differs from the main gradients');
    auto: the main gradients'. Not in 0.16.1: another value is an error there."""
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
    optimizer_cpu_offload: bool = False
    """megatron-core's HybridDeviceOptimizer (--optimizer-cpu-offload; needs
    use_precision_aware_optimizer): for the first optimizer_offload_fraction of each rank's
    parameter shards, the fp32 master copy and Adam's moments live in host memory and the update
    runs on the host; the gradient shards go to the host (D2H) and the updated parameters come
    back (H2D) in every optimizer step. The rest stays on the GPU with fp32 moments."""
    optimizer_offload_fraction: float = 1.0
    """With optimizer_cpu_offload: the fraction of the shard's elements whose update moves to
    the host, taken in parameter order (--optimizer-offload-fraction; Megatron-LM's default 1.0)."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """With optimizer_cpu_offload: one host optimizer per parameter, so each one's update starts
    when its gradient has arrived and its copy back overlaps the next (--overlap-cpu-optimizer-
    d2h-h2d). Time only."""
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
    optimizer_impl: Literal["te", "apex", "torch"] = "te"
    """Where the run's optimizer comes from, as megatron-core picks it by what is installed:
    Transformer Engine's FusedAdam / FusedSGD and multi-tensor kernels (te, NVIDIA's
    containers), Apex's (apex: the same states and allocations), or neither (torch:
    torch.optim's AdamW / Adam with its foreach step, whose sqrt of the second moments is one
    temporary the size of the optimizer's parameters, and megatron-core's Python loops for
    gradient norms and scaling)."""
    moe_routing: Literal["random", "balanced", "capacity"] | None = None
    """Token counts per expert, which depend on the data, as metatrace assumes them: random
    (the default; routing at the start of training: each token's top-k a uniform draw of
    distinct experts, the hottest expert's expected load on every rank, dropless), balanced
    (every expert gets tokens x topk / experts; the default when moe_hottest_expert_load is
    given) or capacity (each expert's input padded to its capacity, megatron-core's static path;
    needs moe_expert_capacity_factor)."""
    moe_expert_capacity_factor: float | None = None
    """Expert capacity as a multiple of the balanced share. With moe_routing capacity every
    expert's input is padded to it; with random or balanced routing tokens beyond it are
    dropped (which caps the hottest expert's load)."""
    moe_hottest_expert_load: float | None = None
    """Balanced routing with the most loaded expert on each rank at this multiple of the
    balanced share (e.g. 1.5), to see a worst case; the other experts keep theirs. Not with
    moe_routing random, which derives that load from the routing."""
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """Router logits and probabilities in fp32 / fp64 instead of the model dtype."""
    moe_router_padding_for_quantization: bool = False
    """Pad each expert's tokens from every source rank to a multiple of the FP8 or FP4 GEMM
    alignment (16 rows, 32 with mxfp8, 128 with fp4) in the routing map
    (--moe-router-padding-for-quantization, alias --moe-router-padding-for-fp8): the alltoall
    dispatcher sends the padding rows through its all-to-alls, the flex dispatcher pads what it
    received; TE's Fp8Padding then has nothing left to pad. Needs precision fp8 or fp4 and the
    alltoall or flex dispatcher."""
    cuda_graph_impl: Literal["none", "local", "transformer_engine"] = "none"
    """CUDA graphs (--cuda-graph-impl): transformer_engine captures each transformer layer (or
    the parts cuda_graph_scope names) with TE's make_graphed_callables; local with megatron-core's
    own graphs: each whole transformer layer (any scope but full_iteration; with Transformer
    Engine) or the whole iteration (cuda_graph_scope: [full_iteration])."""
    cuda_graph_scope: (
        list[
            Literal["attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full_iteration"]
        ]
        | None
    ) = None
    """What is captured (--cuda-graph-scope): attn (a layer's attention part), mlp (its MLP
    part: dense layers), moe (a MoE layer's MLP part: drop-and-pad routing only), moe_router
    (a MoE layer's pre-MLP norm, router and shared experts), moe_preprocess (with moe_router:
    also the dispatcher's preprocessing before the all-to-all), mamba (a hybrid model's Mamba
    layers), several of them, or omitted: the whole layer; full_iteration (local): the whole
    forward-backward of an iteration, every micro-batch."""
    create_attention_mask_in_dataloader: bool = True
    """The data loader builds a causal mask bool [b, 1, s, s] per micro-batch and copies it to
    the GPU (Megatron-LM's default; --no-create-attention-mask-in-dataloader turns it off)."""

    @property
    def local_layer_graphs(self) -> bool:
        """megatron-core's per-layer local CUDA graphs (local with any scope but full_iteration)."""
        return self.cuda_graph_impl == "local" and self.cuda_graph_scope != ["full_iteration"]


FSDP_DTYPES = ("fsdp_main_grads_dtype", "fsdp_main_params_dtype", "fsdp_grad_comm_dtype")
"""Training's keys for Megatron-FSDP's dtypes: megatron-core 0.19's megatron_<key> fields,
which 0.16.1 does not have."""

OFFLOAD_KNOBS = (
    "activation_offload_fraction",
    "delta_offload_bytes_across_pp_ranks",
    "fine_grained_offloading_max_inflight_offloads",
)
"""Training's keys for fine-grained offloading's steady state: megatron-core 0.19's
TransformerConfig fields of the same names, which 0.16.1 does not have."""


def changed_from_default(section, names) -> list[str]:
    """Those of `names` whose value in the dataclass instance `section` is not its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(section)}
    return [name for name in names if getattr(section, name) != defaults[name]]


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
    """Fused bias-GeLU / bias-SwiGLU / quick-GEGLU kernels (Megatron-LM's default;
    --no-bias-gelu-fusion, --no-bias-swiglu-fusion turn them off). Only GeLU with biases,
    SwiGLU and quick-GEGLU have one (Job.bias_activation_fusion)."""
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


@dataclass(frozen=True, kw_only=True)
class Cluster:
    num_gpus: int | None = None
    """GPUs in the job; default tp x pp x cp x dp."""
    gpus_per_node: int = 8
    """GPUs per node; ranks are placed on nodes in order (GPU names n{node}_g{gpu})."""
    nvlink_domain: int | None = None
    """GPUs joined by NVLink (ranks in order, a multiple of gpus_per_node): traffic inside a
    domain runs at intra_node_gbps, across domains over the network. Default: 72 on GB200 and
    GB300 (an NVL72 rack), else the node."""
    gpu: str = "h100"
    """GPU model: one of GPU_MEMORY_GIB's keys."""
    gpu_memory_gib: float | None = None
    """Memory per GPU; default from `gpu`."""
    reserved_overhead_gib: float = 0.0
    """A margin the user keeps free on every GPU beyond what metatrace predicts the device
    holds (the caching allocator's reserve, the CUDA context, NCCL's buffers, userbuffers): the
    verdict asks the prediction plus this margin to fit."""
    allocator_conf: str | None = None
    """The run's PYTORCH_ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF), e.g. "expandable_segments:True":
    the caching allocator's settings the device-memory verdict simulates; default PyTorch's."""
    nccl_gib: float | None = None
    """NCCL's device memory per GPU (its communicators' buffers); default derived per
    communicator from NCCL's own rules (metatrace.analysis.device.communicator). A measured
    figure (ncclCommMemStats, or the device's use less the rest) replaces the estimate."""
    nccl_nvls: bool = True
    """NCCL's NVLS (NVSwitch multicast) buffers where the GPUs have them (NCCL_NVLS_ENABLE=0:
    off)."""
    nccl_buffsize: int | None = None
    """NCCL's SIMPLE-protocol buffer per connection, bytes (NCCL_BUFFSIZE; default 4 MiB)."""
    nccl_channels: int | None = None
    """Collective channels per NCCL communicator (default 32, an 8-GPU NVSwitch node's;
    NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS bound it)."""
    context_gib: float | None = None
    """What a training process holds on its GPU beside the allocator's reserve and NCCL's
    buffers (the CUDA context, loaded kernels, libraries' own memory); default measured, 2.6 GB
    (metatrace.analysis.device.CONTEXT_BYTES)."""
    intra_node_gbps: float | None = None
    """Link bandwidth per GPU and direction inside a node, Gb/s (default for `gpu`)."""
    inter_node_gbps: float | None = None
    """Network bandwidth per GPU and direction across nodes, Gb/s (default for `gpu`)."""
    host_link_gbps: float | None = None
    """Bandwidth between a GPU and host memory per direction, Gb/s (PCIe, or NVLink-C2C on
    GB200; default for `gpu`): the time model's activation-offloading copies."""
    cublas_workspace_config: str | None = None
    """The run's CUBLAS_WORKSPACE_CONFIG (":SIZE_KIB:COUNT" pairs), which sizes PyTorch's cuBLAS
    workspaces; default PyTorch's for `gpu` (":4096:8" on sm90/sm100, ":4096:2:16:8" before)."""
    compute_efficiency: float | None = None
    """The time model's compute rates. None (default): each kernel at the rate its shape gets on
    the GPU (metatrace.config.kernels: GEMMs with tile and wave quantisation, fused attention by
    sequence length, memory-bound operators by the bytes they move; constants measured on an
    H100). A number between 0 (exclusive) and 1: instead, every counted FLOP (matrix products
    and attention) at this fraction of the GPU's peak dense FLOP/s and element-wise work free,
    i.e. an assumed model FLOPs utilisation of the steps' compute."""


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

    @property
    def bias_activation_fusion(self) -> bool:
        """megatron-core's bias_activation_fusion as Megatron-LM sets it: the fused kernels
        are on by default (bias_gelu_fusion, bias_swiglu_fusion) and off for GeLU without
        biases; other activations have no kernel but quick_geglu's (Megatron-LM's --quick-geglu
        sets it with bias_swiglu_fusion; megatron-core's weighted_bias_quick_geglu_impl)."""
        act = self.model.activation
        return self.implementation.bias_activation_fusion and (
            act in ("swiglu", "quick_geglu") or (act == "gelu" and self.model.add_bias_linear)
        )


SECTIONS = ("model", "parallel", "training", "implementation", "cluster")
DERIVED = (
    "source",
    "padded_vocab_size",
    "num_microbatches",
    "notes",
    "attention_kernel",
    "not_modelled",
)
