"""CUDA graphs (training.cuda_graph_impl): the static buffers a captured run keeps beside what the
eager run holds.

A graph replays the kernels and addresses of its capture: the activations the captured region
saves live in the graphs' private memory pool, which the capture (in the schedule's order, so
that one micro-batch's memory is reused by the next as in eager mode) fills as far as the eager
run does; `max_memory_allocated` counts them during the capture, and the GPU holds the pool for
good. What a captured run holds beyond the eager run's peak are the static buffers:

- Transformer Engine's per-layer graphs (megatron-core 0.16.1's TECudaGraphHelper, TE 2.8's
  make_graphed_callables with `_reuse_graph_input_output_buffers`): a static input per
  (layer, micro-batch) capture, the hidden states [s/cp/(tp with SP), b, h] in bf16 and, when the
  graph holds the attention, a bool causal mask [b, 1, s/cp, s] and the rotary table; captures
  whose backward has run hand theirs on, so there are as many as layer-forwards in flight along
  the schedule. megatron-core's own `_get_sample_arguments` lays them out here, over the traced
  chunks. Beside them one gradient buffer per output signature (the layer's output). Where
  eager mode keeps one tensor per layer in flight (a layer's output, saved as the next one's
  input), the capture keeps two: the output in the pool and the next layer's static input, a
  copy of it; the static inputs are that difference. A MoE layer's graph of its router part
  (cuda_graph_scope moe_router, moe_preprocess) ends before the dispatch and returns the
  router's or the preprocessing's tensors, the residual and the shared experts' output: one
  gradient buffer for each of those that requires grad, per signature (`_MoEGraphs`), made
  where the traced micro-batch's first MoE layer ends its captured part. Its outputs are
  taken to live as long as the eager run keeps them (as the layers' activations are).
- megatron-core's whole-iteration graph (local, cuda_graph_scope [full_iteration]:
  full_cuda_graph.py): its StaticBufferLoader copies every micro-batch's batch (tokens, labels,
  loss mask, positions, and the data loader's attention mask) to the GPU at the start of the
  iteration and keeps them; the ranks that read data (tensor-parallel rank 0 of the first and
  last pipeline stages) hold num_microbatches of them instead of one at a time.
- megatron-core's per-layer local graphs (CudaGraphManager): every runner's captured output,
  which eager mode frees once its backward has run, and TensorReusePool's buffers
  (_local_layer_buffers).

All are allocated where the traced micro-batch starts and kept, like the kernel workspaces.
Not modelled: the graphs' own memory outside PyTorch's allocator (executables, NCCL's
registrations), fragmentation between the two pools, the zero mask a TE-graphed layer
allocates per call when the data loader gives none; with moe_preprocess, the alltoall
dispatcher's device-to-host copy moving out of the graph (megatron-core's cuda_dtoh_point
before_ep_alltoall): the trace keeps it where eager mode has it, before the permutation.

Known limitation: with graphs of parts of layers the allocated peak is an upper bound.
Megatron-LM runs its first cuda_graph_warmup_steps iterations (3) eagerly and captures after
them, and once captured, the activations the graphs save live in their pool without counting
as allocated (TE weak-references what the capture allocated). `max_memory_allocated` is then the
largest of the eager peak, the capture's (static buffers and the captured parts' activations)
and the replay's (static buffers and the eager parts' activations); metatrace gives the eager
peak plus the static buffers, which holds for whole-layer graphs (their capture is the eager
run) and exceeds it for partial ones: the one calibration case, a MoE model with graphs of its
attention and router parts (bench/calibration.py), +5.94 % where its eager peak is +2.50 %.
The device's memory (the pool reserved beside the eager parts) is what the sum approximates.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from metatrace.models.moe_graphs import PREPROCESS, capturing


class StaticBuffers:
    """The buffers of the capture, alive while this object is."""

    def __init__(self, tensors: list[torch.Tensor], batches: list[dict] | None = None):
        self.tensors = tensors
        self.batches = batches

    def data(self):
        """The data iterator over the static batches (None: the normal one)."""
        return itertools.cycle(self.batches) if self.batches else None


def capture_plan(job, config, model) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each static buffer of per-layer graphs on this rank (TE's or
    megatron-core's local ones; the whole-iteration graph's batches are static_buffers'), worked
    out before anything is recorded: megatron-core builds TE's sample inputs with temporaries of
    its own (the mask from a host [s/cp, s] float matrix)."""
    tr = job.training
    if tr.cuda_graph_impl == "transformer_engine":
        return [(tuple(t.shape), t.dtype) for t in _te_static_inputs(job, config, model)]
    if tr.local_layer_graphs:
        return _local_layer_buffers(job, config, model)
    return []


@contextlib.contextmanager
def static_buffers(job, plan, device):
    """Allocate the capture's static buffers of this rank (module doc; `plan` from capture_plan)
    inside the recorder, one allocation each; yield a StaticBuffers."""
    tr = job.training
    tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in plan]
    whole = tr.cuda_graph_scope == ["full_iteration"]
    batches = _static_batches(job) if whole else None
    router = tr.cuda_graph_impl == "transformer_engine" and "moe_router" in (
        tr.cuda_graph_scope or []
    )
    with capturing(tr.cuda_graph_scope, tensors) if router else contextlib.nullcontext():
        yield StaticBuffers(tensors, batches)


def _static_batches(job) -> list[dict] | None:
    """StaticBufferLoader's copies: num_microbatches batches on the ranks that read data."""
    from megatron.core import parallel_state as ps

    from metatrace.tracing.steps import synthetic_batches

    tr = job.training
    first = ps.is_pipeline_first_stage(ignore_virtual=True)
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    if ps.get_tensor_model_parallel_rank() != 0 or not (first or last):
        return None
    source = synthetic_batches(
        micro_batch_size=tr.micro_batch_size,
        seq_length=tr.seq_length,
        attention_mask=tr.create_attention_mask_in_dataloader,
    )
    # copy_tensors_in_struct: src.clone().detach().cuda(); one device copy each.
    return [
        {k: t.cuda() for k, t in batch.items()}
        for batch in itertools.islice(source, job.num_microbatches)
    ]


def _te_static_inputs(job, config, model) -> list[torch.Tensor]:
    """megatron-core's TECudaGraphHelper sample inputs over the chunks, and TE's gradient buffer
    per output signature."""
    from megatron.core.transformer import cuda_graphs, enums

    from metatrace.hooks import guards
    from metatrace.hooks.patches import TE_RELEASE

    tr = job.training
    # megatron-core 0.19 renamed the scope cuda_graph_modules (CudaGraphModule); the config
    # migrates a scope given at construction, not one set on it afterwards as here
    attr, kind = (
        ("cuda_graph_modules", enums.CudaGraphModule)
        if guards.since(0, 19)
        else ("cuda_graph_scope", enums.CudaGraphScope)
    )
    scope = [kind[s] for s in (tr.cuda_graph_scope or [])]
    saved = (config.cuda_graph_impl, getattr(config, attr))
    orig = (cuda_graphs.HAVE_TE_GRAPHS, cuda_graphs.is_te_min_version)

    def is_te_min_version(version, check_equality=True):
        wanted = tuple(int(n) for n in str(version).split(".")[:2])
        return TE_RELEASE >= wanted if check_equality else TE_RELEASE > wanted

    try:
        # The layers read the scope from their (shared) config: whether the mask is an input.
        config.cuda_graph_impl = "transformer_engine"
        setattr(config, attr, scope)
        cuda_graphs.HAVE_TE_GRAPHS, cuda_graphs.is_te_min_version = True, is_te_min_version
        helper = cuda_graphs.TECudaGraphHelper(model, config, tr.seq_length, tr.micro_batch_size)
        if not helper.flattened_callables:
            return []
        # A MoE layer's router graph has outputs of its own (_MoEGraphs): the layer output's
        # gradient buffer is for the other captured layers.
        router = "moe_router" in (tr.cuda_graph_scope or [])
        plain = any(
            not (router and getattr(c, "is_moe_layer", False)) for c in helper.flattened_callables
        )
        # _get_cuda_graph_input_data's order: one micro-batch without pipelining, else all.
        helper.num_microbatches = job.num_microbatches if job.parallel.pp > 1 else 1
        order = _schedule_order(config, helper.num_microbatches, helper.num_model_chunks)
        # torch.tril(torch.ones((s/cp, s))) builds the mask on the host first: not here.
        with torch.device("meta"):
            args, kwargs = helper._get_sample_arguments(order)
    finally:
        config.cuda_graph_impl = saved[0]
        setattr(config, attr, saved[1])
        cuda_graphs.HAVE_TE_GRAPHS, cuda_graphs.is_te_min_version = orig
    unique: dict[int, torch.Tensor] = {}
    for sample in [*args, *(tuple(k.values()) for k in kwargs)]:
        for t in sample:
            if torch.is_tensor(t):
                unique.setdefault(id(t), t)
    tensors = list(unique.values())
    # The static gradient of the layer's output (TE 2.8 graph.py: one per output signature).
    if plain:
        hidden = args[0][0]
        tensors.append(torch.empty_like(hidden, dtype=config.params_dtype, requires_grad=False))
    return tensors


def _schedule_order(config, microbatches: int, chunks: int) -> list[int]:
    """megatron-core's capture order over the pipeline schedule (TECudaGraphHelper's): c the
    forward of chunk c (1-based), -c its backward."""
    from megatron.core.pipeline_parallel.schedules import (
        get_pp_rank_microbatches,
        get_schedule_table,
    )
    from megatron.core.transformer import cuda_graphs

    group = config.microbatch_group_size_per_vp_stage
    _, _, warmup, _ = get_pp_rank_microbatches(microbatches, chunks, group, False)
    table = get_schedule_table(microbatches, chunks, group)
    return cuda_graphs.convert_schedule_table_to_order(warmup, chunks, table)


def _local_layer_buffers(job, config, model) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """megatron-core 0.16.1's per-layer local graphs (CudaGraphManager, _CudaGraphRunner): the
    buffers they hold for good beyond the eager run's, by its capture rules.

    Every transformer layer has a manager (any scope but full_iteration graphs the whole layer);
    it has a runner per micro-batch of the first iteration with pipelining, one without. Each
    runner holds its captured output (`fwd_graph_outputs`, never weakly referenced), so all of
    them stay allocated where eager mode holds only the layer outputs of the micro-batches in
    flight (saved by the next layer; a chunk's output sent down the pipeline is freed). Inputs
    that are not another graph's output come from TensorReusePool, which keeps every buffer it
    creates: the hidden states entering a chunk and the output gradient entering its backward
    (handed back after each capture, so one serves them all), and for a tensor that several
    layers take (the micro-batch's attention mask, the chunk's cached rotary table) a buffer of
    its own, created at its first capture and never handed back."""
    from megatron.core import parallel_state as ps

    from metatrace.models.build import unwrap

    tr, par = job.training, job.parallel
    sp = par.tp if par.sequence_parallel else 1
    s_local = tr.seq_length // par.cp
    hidden = (
        (s_local // sp, tr.micro_batch_size, job.model.hidden_size),
        torch.float32 if config.fp32_residual_connection else config.params_dtype,
    )
    mask = ((tr.micro_batch_size, 1, s_local, tr.seq_length), torch.bool)
    chunks = [unwrap(c) for c in model]
    layers = [len(c.decoder.layers) if getattr(c, "decoder", None) else 0 for c in chunks]
    rope = [getattr(c, "rotary_pos_emb", None) for c in chunks]
    n = len(chunks)
    pipelined = par.pp > 1
    runs = job.num_microbatches if pipelined else 1
    order = _schedule_order(config, runs, n) if pipelined else [1, -1]

    def has_mask(c):
        vp = c if n > 1 else None
        first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        return tr.create_attention_mask_in_dataloader and (first or last)

    def held(c):  # layer outputs eager mode holds per chunk-forward in flight
        vp = c if n > 1 else None
        sent = not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        return layers[c] - (1 if sent and layers[c] else 0)

    free: dict = {}  # TensorReusePool: buffers handed back, by (shape, dtype)
    created: list = []  # its strong references

    def get(key):
        if free.get(key):
            free[key] -= 1
        else:
            created.append(key)

    def put(key):
        free[key] = free.get(key, 0) + 1

    def shared(key, uses):  # an input several captures take: a buffer of its own
        get(key)
        if uses == 1:
            put(key)

    in_flight, most, rotary_done = 0, 0, set()
    for entry in order:
        c = abs(entry) - 1
        if not layers[c]:
            continue
        if entry > 0:
            if has_mask(c):
                shared(mask, layers[c])
            if rope[c] is not None and c not in rotary_done:
                rotary_done.add(c)
                dim = 2 * rope[c].inv_freq.numel()
                shared(((s_local, 1, 1, dim), torch.float32), runs * layers[c])
            get(hidden)  # the chunk's input, copied in at each replay
            put(hidden)
            in_flight += held(c)
            most = max(most, in_flight)
        else:
            get(hidden)  # the output gradient of the chunk's last layer
            put(hidden)
            in_flight -= held(c)
    outputs = runs * sum(layers) - most
    return [hidden] * outputs + created


_STEP_PHASES = ("forward", "backward", "recompute")
_SCOPE_MODULES = {
    # What each part of a layer's graph holds, as paths below the layer (megatron-core 0.16.1's
    # TransformerLayer._get_submodules_under_cudagraphs and _te_cuda_graph_capture; 0.19 alike):
    # the norm before the part, the part, its bias-dropout-add; of a MoE layer with moe_router
    # the pre-MLP norm, the router and the shared experts when not overlapped (moe_layer.py's
    # maybe_skip_or_early_return_by_cudagraph), with moe_preprocess also MoELayer.preprocess:
    # the latent projection and the dispatcher's preprocessing (recorded as "mlp.preprocess").
    "attn": ("input_layernorm", "self_attention", "self_attn_bda"),
    "mlp": ("pre_mlp_layernorm", "mlp", "mlp_bda"),  # dense layers
    "moe": ("pre_mlp_layernorm", "mlp", "mlp_bda"),  # MoE layers
    "moe_router": ("pre_mlp_layernorm", "mlp.router", "mlp.shared_experts"),
    "moe_preprocess": (f"mlp.{PREPROCESS}", "mlp.fc1_latent_proj"),
}
_LAYERS = "decoder.layers."


def _layer_of(module: str) -> tuple[str, str] | None:
    """(the decoder layer's name, the path below it) of a module inside a decoder layer."""
    at = module.find(_LAYERS)
    if at < 0 or (at and module[at - 1] != "."):
        return None
    number, _, rest = module[at + len(_LAYERS) :].partition(".")
    if not number.isdigit():
        return None
    return module[: at + len(_LAYERS) + len(number)], rest


def _below(path: str, parts) -> bool:
    return any(path == p or path.startswith(p + ".") for p in parts)


def captured_by_graphs(job, modules=()):
    """The time model's view of CUDA graphs (metatrace.config.host): a predicate
    `captured(module, phase)`, whether the module's work in that phase replays from a graph (its
    kernels launch with the graph, its Python does not run), or None without graphs. The
    whole-iteration graph holds every step's work (the optimizer step runs outside it); per-layer
    graphs (Transformer Engine's, megatron-core's local ones) the decoder layers, or with
    cuda_graph_scope the parts of them `_SCOPE_MODULES` names: mlp those of dense layers, moe,
    moe_router and moe_preprocess those of MoE layers, mamba a hybrid model's Mamba layers
    whole, told by their router or their mixer among `modules` (the traced modules' names)."""
    tr = job.training
    if tr.cuda_graph_impl == "none":
        return None
    scope = tr.cuda_graph_scope or []
    if scope == ["full_iteration"]:
        return lambda module, phase: phase in _STEP_PHASES
    named = [layer for m in modules if (layer := _layer_of(m)) is not None]
    moe_layers = {layer for layer, path in named if path == "mlp.router"}
    mamba_layers = (
        {layer for layer, path in named if path == "mixer"} if "mamba" in scope else set()
    )

    def parts_of(scopes) -> tuple[str, ...]:
        out = tuple(m for s in scopes for m in _SCOPE_MODULES[s])
        if "moe_router" in scopes and job.parallel.moe_shared_expert_overlap:
            out = tuple(m for m in out if m != "mlp.shared_experts")  # run by the dispatcher
        return out

    dense = parts_of([s for s in scope if s in ("attn", "mlp")])
    moe = parts_of([s for s in scope if s not in ("mlp", "mamba")])

    def captured(module: str, phase: str) -> bool:
        if phase not in _STEP_PHASES:
            return False
        layer = _layer_of(module)
        if layer is None:
            return False
        if not scope or layer[0] in mamba_layers:
            return True
        return _below(layer[1], moe if layer[0] in moe_layers else dense)

    return captured
