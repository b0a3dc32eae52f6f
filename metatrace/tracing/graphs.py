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
  copy of it; the static inputs are that difference.
- megatron-core's whole-iteration graph (local, cuda_graph_scope [full_iteration]:
  full_cuda_graph.py): its StaticBufferLoader copies every micro-batch's batch (tokens, labels,
  loss mask, positions, and the data loader's attention mask) to the GPU at the start of the
  iteration and keeps them; the ranks that read data (tensor-parallel rank 0 of the first and
  last pipeline stages) hold num_microbatches of them instead of one at a time.

Both are allocated where the traced micro-batch starts and kept, like the kernel workspaces.
Not modelled: the graphs' own memory outside PyTorch's allocator (executables, NCCL's
registrations), fragmentation between the two pools, the zero mask a TE-graphed layer
allocates per call when the data loader gives none.
"""

from __future__ import annotations

import contextlib
import itertools

import torch


class StaticBuffers:
    """The buffers of the capture, alive while this object is."""

    def __init__(self, tensors: list[torch.Tensor], batches: list[dict] | None = None):
        self.tensors = tensors
        self.batches = batches

    def data(self):
        """The data iterator over the static batches (None: the normal one)."""
        return itertools.cycle(self.batches) if self.batches else None


def capture_plan(job, config, model) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each static buffer of TE's per-layer graphs on this rank (none for
    other set-ups), worked out before anything is recorded: megatron-core builds the sample
    inputs with temporaries of its own (the mask from a host [s/cp, s] float matrix)."""
    if job.training.cuda_graph_impl != "transformer_engine":
        return []
    return [(tuple(t.shape), t.dtype) for t in _te_static_inputs(job, config, model)]


@contextlib.contextmanager
def static_buffers(job, plan, device):
    """Allocate the capture's static buffers of this rank (module doc; `plan` from capture_plan)
    inside the recorder, one allocation each; yield a StaticBuffers."""
    tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in plan]
    # local graphs are the whole-iteration one (metatrace.config.checks)
    batches = _static_batches(job) if job.training.cuda_graph_impl == "local" else None
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
    from megatron.core.pipeline_parallel.schedules import (
        get_pp_rank_microbatches,
        get_schedule_table,
    )
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.enums import CudaGraphScope

    from metatrace.hooks.patches import TE_RELEASE

    tr = job.training
    scope = [CudaGraphScope[s] for s in (tr.cuda_graph_scope or [])]
    saved = (config.cuda_graph_impl, config.cuda_graph_scope)
    orig = (cuda_graphs.HAVE_TE_GRAPHS, cuda_graphs.is_te_min_version)

    def is_te_min_version(version, check_equality=True):
        wanted = tuple(int(n) for n in str(version).split(".")[:2])
        return TE_RELEASE >= wanted if check_equality else TE_RELEASE > wanted

    try:
        # The layers read the scope from their (shared) config: whether the mask is an input.
        config.cuda_graph_impl, config.cuda_graph_scope = "transformer_engine", scope
        cuda_graphs.HAVE_TE_GRAPHS, cuda_graphs.is_te_min_version = True, is_te_min_version
        helper = cuda_graphs.TECudaGraphHelper(model, config, tr.seq_length, tr.micro_batch_size)
        if not helper.flattened_callables:
            return []
        # _get_cuda_graph_input_data's order: one micro-batch without pipelining, else all.
        pipelined = job.parallel.pp > 1
        helper.num_microbatches = job.num_microbatches if pipelined else 1
        _, _, warmup, _ = get_pp_rank_microbatches(
            helper.num_microbatches,
            helper.num_model_chunks,
            config.microbatch_group_size_per_vp_stage,
            False,
        )
        table = get_schedule_table(
            helper.num_microbatches,
            helper.num_model_chunks,
            config.microbatch_group_size_per_vp_stage,
        )
        order = cuda_graphs.convert_schedule_table_to_order(warmup, helper.num_model_chunks, table)
        # torch.tril(torch.ones((s/cp, s))) builds the mask on the host first: not here.
        with torch.device("meta"):
            args, kwargs = helper._get_sample_arguments(order)
    finally:
        config.cuda_graph_impl, config.cuda_graph_scope = saved
        cuda_graphs.HAVE_TE_GRAPHS, cuda_graphs.is_te_min_version = orig
    unique: dict[int, torch.Tensor] = {}
    for sample in [*args, *(tuple(k.values()) for k in kwargs)]:
        for t in sample:
            if torch.is_tensor(t):
                unique.setdefault(id(t), t)
    tensors = list(unique.values())
    # The static gradient of the layer's output (TE 2.8 graph.py: one per output signature).
    hidden = args[0][0]
    tensors.append(torch.empty_like(hidden, dtype=config.params_dtype, requires_grad=False))
    return tensors
