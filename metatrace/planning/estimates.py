"""Closed forms of a layout for the planner (metatrace.planning.plan): parameters per layer, a lower
bound and an estimate of a rank's memory, and an estimate of the iteration time. Pure
functions of a resolved job; the planner traces the layouts these do not rule out.
"""

from __future__ import annotations

from dataclasses import dataclass

from metatrace.config import GATED_ACTIVATIONS, GPU_PEAK_TFLOPS

# Extra compute of a training step per recompute kind, in forward passes (forward + backward
# = 3 forward passes): full recompute runs every layer's forward again; selective recomputes
# attention's core only.
_FULL_RECOMPUTE = 1.0


@dataclass(frozen=True)
class Shape:
    """Parameters of one layer and of the embedding, from the model's dimensions."""

    dense: int
    """A layer's attention, norms and dense MLP (or router and shared experts)."""
    experts: int
    """A MoE layer's routed experts, all of them."""
    moe_layers: int
    embedding: int
    """The word embedding (the output layer has as many when untied)."""


def _gated(model) -> int:
    """Matrices of the FFN's first projection: two with a gated linear unit."""
    return 2 if model.activation in GATED_ACTIVATIONS else 1


def shape_of(job) -> Shape:
    m = job.model
    h, d = m.hidden_size, m.kv_channels
    gated = _gated(m)
    if m.multi_latent_attention:
        q = (
            (
                h * m.q_lora_rank
                + m.q_lora_rank * m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim)
            )
            if m.q_lora_rank
            else (h * m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim))
        )
        kv = h * (
            m.kv_lora_rank + m.qk_pos_emb_head_dim
        ) + m.kv_lora_rank * m.num_attention_heads * (m.qk_head_dim + m.v_head_dim)
        attention = q + kv + m.num_attention_heads * m.v_head_dim * h
    else:
        attention = (
            h * (m.num_attention_heads + 2 * m.num_query_groups) * d + m.num_attention_heads * d * h
        )
    if m.attention_output_gate:  # linear_qkv also gives the gate
        attention += h * m.num_attention_heads * d
    mlp = (gated + 1) * h * m.ffn_hidden_size
    moe_layers, experts, dense = 0, 0, m.num_layers * (attention + mlp + 2 * h)
    if m.hybrid_layer_pattern is not None:
        dense, moe_layers = _hybrid_dense(m, attention, mlp)
    elif m.linear_attention_freq is not None:  # Gated DeltaNet instead of some attention
        dense -= _gdn_layers(m) * (attention - _gdn(m))
    width = m.moe_latent_size or h  # LatentMoE: experts run in the latent space
    if m.num_experts:
        if m.hybrid_layer_pattern is None:
            freq = m.moe_layer_freq if isinstance(m.moe_layer_freq, list) else [1] * m.num_layers
            moe_layers = sum(freq)
            shared = _shared(m, gated)
            dense -= moe_layers * (mlp - h * m.num_experts - shared)
        if m.moe_latent_size:
            dense += moe_layers * 2 * h * m.moe_latent_size
        expert = (gated + 1) * width * (m.moe_ffn_hidden_size or m.ffn_hidden_size)
        experts = m.num_experts * expert
    return Shape(
        dense=dense // m.num_layers,
        experts=experts,
        moe_layers=moe_layers,
        embedding=job.padded_vocab_size * h,
    )


def _shared(m, gated: int) -> int:
    """A MoE layer's shared experts: their MLP, and the sigmoid gate's hidden_size weights."""
    width = m.moe_shared_expert_intermediate_size or 0
    return (gated + 1) * m.hidden_size * width + (m.hidden_size if m.moe_shared_expert_gate else 0)


def _mamba(m) -> int:
    """A Mamba-2 mixer's projections: in_proj to z, x, B, C and dt, out_proj back."""
    inner = m.mamba_num_heads * m.mamba_head_dim
    groups = 2 * m.mamba_num_groups * m.mamba_state_dim
    return m.hidden_size * (2 * inner + groups + m.mamba_num_heads) + inner * m.hidden_size


def _gdn(m) -> int:
    """A Gated DeltaNet's projections: in_proj to q, k, v, the gate, beta and alpha; out_proj."""
    qk = m.linear_num_key_heads * m.linear_key_head_dim
    v = m.linear_num_value_heads * m.linear_value_head_dim
    return m.hidden_size * (2 * qk + 2 * v + 2 * m.linear_num_value_heads) + v * m.hidden_size


def _gdn_layers(m) -> int:
    """Layers of a GPT model that linear_attention_freq gives Gated DeltaNet (megatron-core's
    get_linear_attention_pattern: an integer n keeps attention in every n-th layer)."""
    freq = m.linear_attention_freq
    if isinstance(freq, list):
        return sum(freq)
    return m.num_layers - m.num_layers // freq


def _hybrid_dense(m, attention: int, mlp: int) -> tuple[int, int]:
    """(parameters of a hybrid model's layers but the routed experts, MoE layers) from its
    pattern: one norm a layer, the mixer or MLP, a MoE layer's router and shared experts."""
    from metatrace.config.hybrid import parse
    from metatrace.config.release import since

    layers = parse(m.hybrid_layer_pattern, since_0_19=since(0, 19)).layers
    h, gated = m.hidden_size, _gated(m)
    shared = _shared(m, gated)
    per = {
        "M": _mamba(m),
        "*": attention,
        "G": _gdn(m),
        "-": mlp,
        "E": h * (m.num_experts or 0) + shared,
    }
    return sum(per[s] + h for s in layers), layers.count("E")


def parameter_counts(job) -> tuple[int, int]:
    """(parameters, parameters active per token) of the whole model from its dimensions: the
    layers, the multi-token prediction layers (each a layer and its 2h x h projection; one
    shared by every depth with mtp_use_repeated_layer), the
    embedding and an untied output layer; of the routed experts top-k of every MoE layer's
    active. Norms and biases are left out (a few per mille at most; `metatrace run` counts
    every parameter)."""
    m, s = job.model, shape_of(job)
    mtp = m.mtp_num_layers or 0
    if m.mtp_use_repeated_layer:
        mtp = min(mtp, 1)
    embedding = s.embedding * (2 if m.untie_embeddings_and_output_weights else 1)
    dense = (m.num_layers + mtp) * s.dense + mtp * 2 * m.hidden_size**2 + embedding
    experts = s.experts * (s.moe_layers + (mtp if s.moe_layers else 0))
    active = experts * m.moe_router_topk // m.num_experts if m.num_experts else experts
    return dense + experts, dense + active


def _in_flight(job, last: bool = False) -> int:
    """Micro-batches whose activations the first stage (the `last` one) holds at once under
    the schedule."""
    par = job.parallel
    if par.pp == 1:
        return 1
    if par.vpp:  # interleaved: a warm-up of (pp - rank - 1) * 2 + (vpp - 1) * pp chunk steps
        warmup = 0 if last else (par.pp - 1) * 2
        steps = min(job.num_microbatches * par.vpp, warmup + (par.vpp - 1) * par.pp + 1)
        return -(-steps // par.vpp)
    return 1 if last else min(par.pp, job.num_microbatches)


def _tokens(job) -> int:
    """Tokens of one micro-batch on a rank before sequence parallelism: s / cp x b."""
    return job.training.seq_length // job.parallel.cp * job.training.micro_batch_size


def static_bytes(job) -> int:
    """Parameters, gradients and optimizer state of a first-stage rank (biases, position
    embeddings and LayerNorm's second vector left out: a lower bound)."""
    par, tr, s = job.parallel, job.training, shape_of(job)
    stage_layers = job.model.num_layers // par.pp
    dense = stage_layers * s.dense // par.tp + s.embedding // par.tp
    if par.pp == 1:  # the first stage is also the last: final norm, untied output layer
        dense += job.model.hidden_size
        if job.model.untie_embeddings_and_output_weights:
            dense += s.embedding // par.tp
    expert = s.experts * s.moe_layers // par.pp // (par.ep * par.etp)
    grad = 4 if tr.grad_reduce_in_fp32 else 2
    # The distributed optimizer shards over the dp x cp (expert dp) ranks of one of its
    # num_distributed_optimizer_instances instances.
    n = tr.num_distributed_optimizer_instances
    shard = par.dp * par.cp // n if tr.distributed_optimizer else 1
    edp = par.dp * par.cp * par.tp // (par.ep * par.etp) // n if tr.distributed_optimizer else 1
    # bf16 parameter, main gradient, fp32 main parameter and Adam's two moments.
    return (
        dense * (2 + grad) + 12 * dense // shard + expert * (2 + grad) + 12 * expert // max(1, edp)
    )


def _layer_input(job) -> int:
    par = job.parallel
    return _tokens(job) * job.model.hidden_size * 2 // (par.tp if par.sequence_parallel else 1)


def _fixed_bytes(job) -> int:
    """Static memory and PyTorch's cuBLAS workspace of the thread running the forward (always
    allocated), and Transformer Engine's userbuffers (outside the allocator, on the GPU all the
    same: the verdict adds them too)."""
    from metatrace.config.hardware import cublas_workspace_bytes
    from metatrace.config.userbuffers import userbuffer_bytes

    return static_bytes(job) + cublas_workspace_bytes(job) + userbuffer_bytes(job)


def memory_lower_bound(job) -> int:
    """What any rank of the first stage holds at least: its fixed memory and every layer's
    input for the micro-batches in flight."""
    tr = job.training
    layers = job.model.num_layers // job.parallel.pp
    if {"attn_norm", "qkv_linear"} & set(tr.activation_offload_modules or ()):
        # Activation offloading moves the layer inputs to the host, but with a fraction f
        # below 1 (megatron-core 0.19) the last int(n (1 - f)) of a micro-batch's n offload
        # groups stay: k groups a layer, at least floor(layers (1 - f)) - 1 whole layers.
        layers = max(0, int(layers * (1 - tr.activation_offload_fraction)) - 1)
    # Transformer Engine's layer-wise offloading (pp 1): when the forward ends, the inputs of
    # the first cpu_offloading_num_layers layers are on the host.
    layers -= tr.cpu_offloading_num_layers if layers else 0
    return _fixed_bytes(job) + layers * _layer_input(job) * _in_flight(job)


def _layer_activations(job) -> float:
    """Bytes a layer saves for backward per micro-batch without recompute, averaged over the
    model's layers: Korthikanti et al.'s 34·sbh/t with sequence parallel and fused attention
    (10 + 24/t without), whose MLP part (19·sbh/t; 3 + 16/t without sequence parallel) a MoE
    layer replaces by what its router, dispatcher and experts save (_moe_mlp_bytes)."""
    par, m = job.parallel, job.model
    tokens = _tokens(job)
    sp = par.sequence_parallel
    per_token = m.hidden_size * (34 / par.tp if sp else 10 + 24 / par.tp)
    dense = tokens * per_token
    if not m.num_experts:
        return dense
    moe_share = shape_of(job).moe_layers / m.num_layers
    mlp = tokens * m.hidden_size * (19 / par.tp if sp else 3 + 16 / par.tp)
    return dense + moe_share * (_moe_mlp_bytes(job, tokens) - mlp)


def _moe_mlp_bytes(job, tokens: int) -> float:
    """What a MoE layer's MLP saves for backward per micro-batch, `tokens` entering the layer
    (bf16; balanced routing: a rank's experts receive topk pairs a token): the router's fp32
    logits, probabilities and bool map and the permutation's int32 [T, 2E + 1] row map; per
    (token, expert) pair the experts' first GEMM input (h), its output (the activation's input,
    two halves when gated), the second GEMM's input and the fp32 routing weight; a shared
    expert's dense MLP, and with its sigmoid gate the gated output and score (models/te_moe.py,
    te_grouped.py, megatron-core's experts and shared_experts.py)."""
    par, m = job.parallel, job.model
    h, e, k = m.hidden_size, m.num_experts, m.moe_router_topk
    local = tokens / par.tp if par.sequence_parallel else tokens  # after the SP scatter
    pairs = local * par.etp * k  # the expert-TP group gathers its ranks' tokens
    f = (m.moe_ffn_hidden_size or m.ffn_hidden_size) / par.etp
    out = local * (2 * h + 9 * e + 4 * (2 * e + 1))
    out += pairs * (2 * h + 2 * _gated(m) * f + 2 * f + 4)
    shared = (m.moe_shared_expert_intermediate_size or 0) / par.tp
    if m.moe_shared_expert_gate:
        out += local * (2 * h + 2)
    return out + tokens * (2 * h + 2 * _gated(m) * shared + 2 * shared)


def _gathered(job) -> int:
    """Bytes of the [s, b, h] hidden states the allgather dispatcher gathers from the whole
    TP x EP group for one micro-batch."""
    par = job.parallel
    local = _tokens(job) // (par.tp if par.sequence_parallel else 1)
    return local * par.tp * par.ep * job.model.hidden_size * 2


def _dispatcher_transient(job) -> int:
    """What the allgather dispatcher holds while a MoE layer runs (megatron-core 0.16.1's
    MoEAllGatherTokenDispatcher): the group's gathered hidden states, in megatron-core's global
    memory buffer (kept from then on), the combine's fp32 copy of the unpermuted output before
    its reduce-scatter (twice as large; in backward the gathered fp32 gradient), and the
    gathered fp32 probabilities and bool routing map [T x tp x ep, E]."""
    par, m = job.parallel, job.model
    if not m.num_experts or par.moe_token_dispatcher_type != "allgather" or par.ep * par.tp == 1:
        return 0
    gathered = _gathered(job)
    return 3 * gathered + gathered // (2 * m.hidden_size) * 5 * m.num_experts


def _logits_bytes(job) -> int:
    """The last stage's logits of one micro-batch in bf16 [s, b, V/t] (what the output layer
    returns to the loss)."""
    return _tokens(job) * job.padded_vocab_size // job.parallel.tp * 2


def memory_estimate(job) -> int:
    """A closed-form estimate (not a bound) to order the layouts: the larger of the first
    stage's (its micro-batches in flight) and the last stage's (fewer in flight, the logits)
    fixed memory and activations (_layer_activations; with full recompute the layer inputs and
    the activations of the one layer recomputed in backward)."""
    par, tr = job.parallel, job.training
    layers = job.model.num_layers // par.pp - tr.cpu_offloading_num_layers  # those on the host
    fixed = _fixed_bytes(job) + _more_workspaces(job) + _dispatcher_transient(job)
    if tr.recompute.granularity == "full":
        # Each layer keeps its input; in backward one layer's forward runs again and holds
        # its activations until its backward has used them.
        per_layer = _layer_input(job)
        fixed += int(_layer_activations(job))
    else:
        per_layer = _layer_activations(job)
    first = layers * per_layer * _in_flight(job)
    last = layers * per_layer * _in_flight(job, last=True) + _logits_bytes(job)
    return fixed + int(max(first, last))


def _more_workspaces(job) -> int:
    """Workspaces every traced run holds beside the forward thread's cuBLAS one (not in the
    lower bound, which keeps to what is certain): the backward thread's cuBLAS workspace and
    Transformer Engine's (models/te_runtime.py te_workspace: once per userbuffers stream with
    TP communication overlap)."""
    from metatrace.config.hardware import GPU_ARCH, cublas_workspace_bytes, te_workspace_bytes
    from metatrace.config.userbuffers import UB_STREAMS

    out = cublas_workspace_bytes(job)
    if job.implementation.transformer_impl == "transformer_engine":
        te = te_workspace_bytes(GPU_ARCH.get(job.cluster.gpu, "sm90"))
        out += te * (UB_STREAMS if job.parallel.tp_comm_overlap else 1)
    return out


@dataclass(frozen=True)
class Estimate:
    compute: float
    """Seconds of compute per iteration (FLOPs at the assumed efficiency, recompute included)."""
    bubble: float
    """Idle fraction of the pipeline schedule: (pp - 1) / (vpp · m + pp - 1)."""
    comm: float
    """Exposed communication seconds per iteration (closed form, or traced when known)."""
    seconds: float
    """The iteration: max(compute, host) / (1 - bubble) + comm, or the traced time model's
    figure."""
    host: float = 0.0
    """Seconds of host work per iteration issuing the busiest stage's kernels (host_seconds;
    0 where the compute is not priced per kernel, as the traced time model does)."""


def _flops(job) -> float:
    """FLOPs of one iteration over all GPUs: 6 per parameter and token for the layers'
    matmuls (experts: top-k of them), the causal attention scores, recompute."""
    m, tr, s = job.model, job.training, shape_of(job)
    tokens = tr.global_batch_size * tr.seq_length
    active = m.num_layers * s.dense + s.embedding
    if m.num_experts:
        active += s.moe_layers * s.experts * m.moe_router_topk // m.num_experts
    attention = 2 * 2 * tr.seq_length * m.num_attention_heads * m.kv_channels * m.num_layers / 2
    forward = 2 * active + attention
    extra = {"full": _FULL_RECOMPUTE * forward, "selective": attention}.get(
        tr.recompute.granularity or "none", 0.0
    )
    return tokens * (3 * forward + extra)


def estimate(job, exposed_comm: float | None = None) -> Estimate:
    """Closed-form iteration time; `exposed_comm` replaces the communication term. Compute per
    kernel (kernel_seconds) unless the job sets cluster.compute_efficiency (or its GPU is not in
    the kernel tables: then at FALLBACK_EFFICIENCY), as the traced time model does."""
    par, cl = job.parallel, job.cluster
    compute = kernel_seconds(job) if cl.compute_efficiency is None else None
    if compute is None:
        eff = cl.compute_efficiency or FALLBACK_EFFICIENCY
        compute = _flops(job) / cl.num_gpus / (GPU_PEAK_TFLOPS[cl.gpu] * 1e12 * eff)
    m = job.num_microbatches
    bubble = (par.pp - 1) / ((par.vpp or 1) * m + par.pp - 1)
    if exposed_comm is None:
        exposed_comm = _comm_seconds(job)
    # A step lasts as long as the longer of its kernels and the host's work issuing them (the
    # traced time model's host, metatrace.config.host, per iteration rather than per kernel).
    host = host_seconds(job) if cl.compute_efficiency is None else 0.0
    seconds = max(compute, host) / (1 - bubble) + exposed_comm
    return Estimate(compute, bubble, exposed_comm, seconds, host)


# The host's work per micro-batch, in config.host's units (module forward calls, operators from
# Python, views, operators the autograd engine runs, kernel launches), as the tracer counts them
# on the debug model (tp 1; hooks/host.py): a layer's forward and backward per
# transformer_impl; a MoE layer's routing and dispatch beside its grouped experts (what it adds
# to a dense layer), and each local expert more where they run one after another (no
# moe_grouped_gemm; with it, one unit and each further expert's launches of the grouped GEMMs);
# the first stage's embedding and the last stage's output layer and loss; the
# optimizer step per layer and once. Collectives (a few per layer with tp > 1) and selective
# recompute (a few operators) are left out; full recompute runs the layers' forward again in
# backward.
HOST_UNITS = {
    ("transformer_engine", "forward"): {"module": 15, "operator": 14, "view": 17, "launch": 14},
    ("transformer_engine", "backward"): {"backward": 61, "launch": 22},
    ("local", "forward"): {"module": 17, "operator": 42, "view": 52, "launch": 40},
    ("local", "backward"): {"backward": 124, "launch": 42},
    ("moe", "forward"): {"module": 2, "operator": 24, "view": 18, "launch": 29},
    ("moe", "backward"): {"backward": 57, "launch": 15},
    ("expert", "forward"): {"module": 3, "operator": 2, "view": 7, "launch": 3},
    ("expert", "backward"): {"backward": 14, "launch": 5},
    ("first", "forward"): {"module": 6, "operator": 21, "view": 13, "launch": 10},
    ("first", "backward"): {"backward": 9, "launch": 9},
    ("last", "forward"): {"module": 5, "operator": 48, "view": 23, "launch": 35},
    ("last", "backward"): {"operator": 1, "backward": 43, "launch": 17},
    ("optimizer", "layer"): {"operator": 6, "view": 18, "launch": 6},
    ("optimizer", "once"): {"operator": 14, "view": 12, "launch": 12},
}


def _host_units(key: tuple) -> float:
    from metatrace.config.host import HOST_SECONDS

    return sum(n * HOST_SECONDS[unit] for unit, n in HOST_UNITS[key].items())


def host_seconds(job) -> float:
    """Closed-form host work per iteration of the busiest pipeline stage (HOST_UNITS at
    config.host.HOST_SECONDS): its layers' forward and backward per micro-batch, the embedding
    on the first stage and the output layer on the last, and the optimizer step. Layers that
    CUDA graphs replay cost the host nothing."""
    from metatrace.config import release
    from metatrace.config.host import HOST_SECONDS

    m, par, tr = job.model, job.parallel, job.training
    impl = job.implementation.transformer_impl
    forward, backward = _host_units((impl, "forward")), _host_units((impl, "backward"))
    newer = release.since(0, 19)
    if newer and not (m.qk_layernorm or m.multi_latent_attention):
        # HOST_UNITS counts megatron-core 0.16.1's modules: 0.19's attention builds no
        # IdentityOp for absent query and key norms (attention.py: q_layernorm None), two
        # module calls fewer a layer
        forward -= 2 * HOST_SECONDS["module"]
    moe_share = shape_of(job).moe_layers / m.num_layers if m.num_experts else 0.0
    if moe_share:
        experts = max(1, m.num_experts // par.ep)
        local = 1 if job.implementation.moe_grouped_gemm else experts
        forward += moe_share * (
            _host_units(("moe", "forward")) + local * _host_units(("expert", "forward"))
        )
        backward += moe_share * (
            _host_units(("moe", "backward")) + local * _host_units(("expert", "backward"))
        )
        if job.implementation.moe_grouped_gemm:
            # Transformer Engine's grouped GEMM launches one cuBLAS GEMM per expert
            # (hooks.flops.report_grouped): fc1 and fc2 forward, their data and weight
            # gradients backward, each expert's but the one ("expert") counts
            more = (experts - 1) * HOST_SECONDS["launch"]
            forward += moe_share * 2 * more
            backward += moe_share * 4 * more
    if tr.recompute.granularity == "full":
        backward += forward
    if tr.cuda_graph_impl != "none":
        forward = backward = 0.0
    layers = m.num_layers / par.pp
    ends = [("first",), ("last",)] if par.pp > 1 else [("first", "last")]
    per_microbatch = max(
        layers * (forward + backward)
        + sum(_host_units((end, phase)) for end in stage for phase in ("forward", "backward"))
        for stage in ends
    )
    optimizer = layers * _host_units(("optimizer", "layer")) + _host_units(("optimizer", "once"))
    return job.num_microbatches * per_microbatch + optimizer


# Memory-bound bytes a layer's element-wise kernels move per token (norms, residuals, rotary,
# activation, FP8 casts, in forward and backward): MEMORY_PER_HIDDEN per unit of hidden size
# plus MEMORY_PER_SHARDED per unit of its tensor-parallel widths (QKV, attention output, FFN in
# and out) over tp, by precision; the output layer's loss MEMORY_PER_LOGIT per logit of a rank's
# vocabulary shard. Fitted to the kernels the tracer counts for Llama-2 7B layers (tp 1, 2, 4
# with sequence parallelism: 119, 89 and 74 bytes per token and hidden unit in bf16; tp 1 and 4:
# 175 and 109 in FP8) and its output layer.
MEMORY_PER_HIDDEN = {"bf16": 60, "fp8": 87}
MEMORY_PER_SHARDED = {"bf16": 4.9, "fp8": 7.3}
MEMORY_PER_LOGIT = 85
FALLBACK_EFFICIENCY = 0.5
"""The FLOP rate (fraction of peak) of a GPU the kernel tables lack."""


def kernel_seconds(job) -> float | None:
    """Compute seconds per iteration of the busiest pipeline stage, kernel by kernel
    (metatrace.config.kernels, as the tracer prices what it dispatches): each layer's GEMMs at
    their shapes (forward, data and weight gradients; FP8 / FP4 with training.precision fp8 /
    fp4), its
    fused attention, its memory-bound work (the MEMORY_* constants), the experts' grouped GEMMs
    with balanced routing, and on the last stage the output layer; full recompute runs the
    layers' forward again, selective the attention's. None when the GPU is not in the tables."""
    from metatrace.config import kernels as K

    model = K.kernel_model(job.cluster.gpu)
    if model is None:
        return None
    m, par, tr = job.model, job.parallel, job.training
    tp, cp = par.tp, par.cp
    t = tr.seq_length // cp * tr.micro_batch_size
    h, d = m.hidden_size, m.kv_channels
    fp8, fp4 = tr.precision == "fp8", tr.precision == "fp4"
    # FP4's casts and element-wise work are taken as FP8's (the constants are fitted to bf16
    # and FP8 traces only; an NVFP4 layer moves somewhat more: a Hadamard pass per cast)
    precision = "fp8" if fp8 or fp4 else "bf16"
    gated = _gated(m)
    # gradient-accumulation fusion: the weight gradient is added into main_grad (fp32 or the
    # parameters' dtype), which the GEMM reads and writes
    acc = (4 if tr.grad_reduce_in_fp32 else 2) if tr.gradient_accumulation_fusion else 0

    def linear(n_in: int, n_out: int, rows: int = t) -> tuple[float, float]:
        """(forward, backward) seconds of a linear layer over `rows` tokens."""
        fwd = K.gemm_seconds(model, rows, n_out, n_in, fp8=fp8, fp4=fp4)
        bwd = K.gemm_seconds(model, rows, n_in, n_out, fp8=fp8, fp4=fp4) + K.gemm_seconds(
            model, n_out, n_in, rows, fp8=fp8, fp4=fp4, accumulate=acc
        )
        return fwd, bwd

    if m.multi_latent_attention:
        qkv_width = m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim) * 3 // tp
        attn_width = m.num_attention_heads * m.v_head_dim // tp
        head_dim = m.qk_head_dim + m.qk_pos_emb_head_dim
    else:
        qkv_width = (m.num_attention_heads + 2 * m.num_query_groups) * d // tp
        attn_width = m.num_attention_heads * d // tp
        head_dim = d
    parts = [linear(h, qkv_width), linear(attn_width, h)]
    heads = m.num_attention_heads // tp
    scores = 4 * tr.micro_batch_size * heads * t * tr.seq_length * head_dim // 2
    attn_fwd = K.attention_seconds(model, scores, t, head_dim, causal=True, backward=False)
    attn_bwd = K.attention_seconds(model, scores * 5 // 2, t, head_dim, causal=True, backward=True)
    ffn = m.ffn_hidden_size // tp
    dense_mlp = [linear(h, gated * ffn), linear(ffn, h)]
    widths = qkv_width + attn_width + (gated + 1) * ffn
    bytes_per_token = MEMORY_PER_HIDDEN[precision] * h + int(MEMORY_PER_SHARDED[precision] * widths)
    memory = K.memory_seconds(model, t * bytes_per_token)
    attention_fwd = sum(f for f, _ in parts) + attn_fwd + memory / 3
    attention_bwd = sum(b for _, b in parts) + attn_bwd + memory * 2 / 3
    mlp_fwd = sum(f for f, _ in dense_mlp)
    mlp_bwd = sum(b for _, b in dense_mlp)
    moe_fwd = moe_bwd = 0.0
    if m.num_experts:
        expert_ffn = (m.moe_ffn_hidden_size or m.ffn_hidden_size) // par.etp
        local = max(1, m.num_experts // par.ep)
        rows = max(1, t * m.moe_router_topk * par.ep // m.num_experts)
        up, down = (
            linear(h, gated * expert_ffn, rows * local),
            linear(expert_ffn, h, rows * local),
        )
        moe_fwd, moe_bwd = up[0] + down[0], up[1] + down[1]
        shared = m.moe_shared_expert_intermediate_size
        if shared:
            s_up, s_down = linear(h, gated * shared // tp), linear(shared // tp, h)
            moe_fwd += s_up[0] + s_down[0]
            moe_bwd += s_up[1] + s_down[1]
    s = shape_of(job)
    layers = m.num_layers / par.pp
    moe_share = s.moe_layers / m.num_layers if m.num_experts else 0.0
    fwd = attention_fwd + (1 - moe_share) * mlp_fwd + moe_share * moe_fwd
    bwd = attention_bwd + (1 - moe_share) * mlp_bwd + moe_share * moe_bwd
    extra = {"full": fwd, "selective": attn_fwd}.get(tr.recompute.granularity or "none", 0.0)
    vocab = job.padded_vocab_size // tp
    out_fwd, out_bwd = linear(h, vocab)
    loss = K.memory_seconds(model, t * vocab * MEMORY_PER_LOGIT)
    step = layers * (fwd + bwd + extra) + out_fwd + out_bwd + loss
    return step * job.num_microbatches


def _comm_seconds(job) -> float:
    """Closed-form communication of a rank per iteration, counted as exposed: tensor parallel
    (10 collectives of the layer's [s, b, h] per layer and micro-batch, 4 more with full
    recompute), the context-parallel ring (which Megatron overlaps with attention, but only as
    far as attention lasts), pipeline boundaries per virtual stage, expert all-to-alls (4 per
    MoE layer) or the allgather dispatcher's gathers and reduce-scatters over the TP x EP
    group; the data-parallel reduction only without overlap."""
    par, tr, m = job.parallel, job.training, job.model
    intra, inter = (x * 1e9 / 8 for x in (job.cluster.intra_node_gbps, job.cluster.inter_node_gbps))
    node = job.cluster.gpus_per_node
    layers = m.num_layers // par.pp
    full = _tokens(job) * m.hidden_size * 2
    mbs = job.num_microbatches
    out = 0.0
    if par.tp > 1:
        calls = 10 + (4 if tr.recompute.granularity == "full" else 0)
        bw = intra if par.tp <= node else inter
        out += layers * mbs * calls * full * (par.tp - 1) / par.tp / bw
    if par.cp > 1:  # the ring passes K and V forward, K, V and their gradients backward
        kv = full // m.hidden_size * 2 * m.num_query_groups * m.kv_channels
        bw = intra if par.tp * par.cp <= node else inter
        out += layers * mbs * 3 * kv * (par.cp - 1) / par.tp / bw
    if par.pp > 1:  # a send and a receive per boundary and micro-batch, each way
        bw = intra if par.tp * par.cp * par.dp * 2 <= node else inter
        out += 2 * (par.vpp or 1) * mbs * full / (par.tp if par.sequence_parallel else 1) / bw
    group = par.ep * par.tp
    if m.num_experts and group > 1:
        moe_layers = shape_of(job).moe_layers // par.pp
        if par.moe_token_dispatcher_type == "allgather":
            # Every rank gathers the TP x EP group's tokens (bf16) and reduce-scatters the
            # output in fp32 (token_dispatcher.py's combine), the backward the reverse; the
            # fp32 probabilities and bool routing map gathered forward, their gradient back.
            hidden = _gathered(job) * (1 - 1 / group)
            per_layer = hidden * (2 + 4 + 4 + 2) / 2 + hidden / (2 * m.hidden_size) * (
                m.num_experts * (4 + 1 + 4)
            )
            if group > node:  # a ring across nodes: the node's GPUs share its crossing
                per_layer /= node
        elif par.ep > 1:
            local = full / (par.tp if par.sequence_parallel else 1)
            per_layer = 4 * local * m.moe_router_topk * (par.ep - 1) / par.ep
        else:
            per_layer = 0
        out += moe_layers * mbs * per_layer / (intra if group <= node else inter)
    if par.dp * par.cp > 1 and not tr.overlap_grad_reduce:
        grads = static_bytes(job) / 18 * 4  # the gradients' share of the static bytes
        out += (
            2
            * grads
            * (par.dp - 1)
            / par.dp
            / (intra if par.tp * par.pp == 1 and par.dp <= node else inter)
        )
    return out
