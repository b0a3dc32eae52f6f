"""megatron-core 0.16.1's EP all-to-all overlap (overlap_moe_expert_parallel_comm) and delayed
weight gradients (delay_wgrad_compute), as metatrace runs them.

What megatron-core does (pipeline_parallel/combined_1f1b.py, models/common/
model_chunk_schedule_plan.py, models/gpt/fine_grained_callables.py):
- Every 1F1B step runs the forward of one micro-batch and the backward of another together,
  layer by layer: layer i forward beside layer L-1-i backward (model_chunk_schedule_plan.py:500),
  each layer split into attn (attention .. router, dispatch preprocess), dispatch, mlp (experts),
  combine. Per layer (model_chunk_schedule_plan.py:210-250):
      comm:    combine_bwd | dispatch_fwd -> dispatch_bwd     | combine_fwd
      compute: attn_fwd    | mlp_bwd -> mlp_bwd_dw -> mlp_fwd | attn_bwd -> attn_bwd_dw
  so each all-to-all of one micro-batch runs beside the attention or expert compute of the
  other: hidden, not on the step's path (metatrace.analysis.timing).
- Memory: with the layers overlapped, the two micro-batches' activations add up to one
  micro-batch's, but after mlp_fwd / combine_fwd and before attn_bwd the forward layer's
  attention-part activations are alive beside the backward layer's: one layer's attention part
  more (the reason for ep_overlap_early_attn_memory_release). The interleaved schedule runs one
  more micro-batch in its warm-up (schedules.py:775-779); without pipelining the combined
  schedule runs F0, (F1,B0), ..., B(n-1) (combined_1f1b.py:18-112).
- delay_wgrad_compute: TE's linears keep inputs and output gradients until backward_dw, which
  the schedule calls right after the layer part's backward (mlp_bwd_dw before dispatch_bwd,
  attn_bwd_dw after attn_bwd); the node also keeps its output gradients until then
  (fine_grained_callables.py:296-325).

How metatrace runs it:
- the traced micro-batch runs megatron-core's plain forward_step/backward_step; with
  delay_wgrad_compute `delayed_wgrad` calls backward_dw where the combined schedule does: the
  experts' when the gradient of their input is ready, the attention's (and shared experts')
  when the gradient of the layer's input is;
- the replayed iteration runs megatron-core's own schedule with the flag on (its warm-up count),
  its combined step (`combined_interleaved`, `combined_no_pipelining`) replaced by the backward
  step then the forward step of the replay, with the overlap's extra one-layer attention part
  (`StepProfile.overlap`) held across both, and with Megatron-FSDP sharding the parameters
  (megatron-core 0.19) one layer's gathered parameters (fsdp.combined_extra).

Known limitations: chunk granularity, not layer granularity (the extra is held beside the
whole backward and forward steps, so beside the output layer's logits gradient too, where the
real schedule has only the other micro-batch's embedding); the node's kept output gradients are
not modelled; the dispatcher's preprocess state (row_id_map, permuted probs) is counted with the
experts' part.
"""

from __future__ import annotations

import contextlib


def _backward_step(input_tensor, output_tensor, output_grad, model_chunk, config):
    """megatron-core's schedules.backward_step as each release takes it: with the chunk's model
    type before 0.19 (input, output, output gradient, model type, config), without it since."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_type

    from metatrace.hooks import guards

    model_type = () if guards.since(0, 19) else (get_model_type(model_chunk),)
    return schedules.backward_step(input_tensor, output_tensor, output_grad, *model_type, config)


@contextlib.contextmanager
def delayed_wgrad(model):
    """With delay_wgrad_compute, call each MoE layer's backward_dw where megatron-core's combined
    1F1B does, in a plain backward: the routed experts' when the gradient of the experts' input is
    computed (after mlp_bwd), the shared experts' and attention's when the gradient of the
    layer's input is (after attn_bwd)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.core.utils import get_attr_wrapped_model

    handles = []
    for chunk in model:
        gpt = get_attr_wrapped_model(chunk, "decoder", return_model_obj=True)
        if not gpt.config.delay_wgrad_compute:
            continue
        for layer in gpt.modules():
            if not isinstance(layer, TransformerLayer) or not layer.is_moe_layer:
                continue

            def attn_dw(layer=layer):  # fine_grained_callables.py _BackwardDWWrapper
                layer.mlp.backward_dw(routed_experts=False, shared_experts=True)
                layer.self_attention.backward_dw()

            experts = layer.mlp.experts
            handles.append(experts.register_forward_pre_hook(_on_input(layer.mlp.backward_dw)))
            handles.append(layer.register_forward_pre_hook(_on_input(attn_dw), with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _on_input(fn):
    """A forward pre-hook that runs fn() once the gradient of the module's first input is ready."""

    def hook(module, args, kwargs=None):
        x = args[0] if args else (kwargs or {}).get("hidden_states")
        if x is not None and x.requires_grad:
            x.register_hook(lambda grad: fn())
        return None

    return hook


def _forward(
    forward_step_func,
    data_iterator,
    model,
    num_microbatches,
    input_tensor,
    store,
    config,
    *,
    collect,
    first,
    microbatch,
    vp_stage=None,
):
    """megatron-core's forward_step as its schedules call it."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules

    return schedules.forward_step(
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        input_tensor,
        store,
        config,
        ps.get_context_parallel_world_size(),
        collect,
        is_first_microbatch=first,
        current_microbatch=microbatch,
        vp_stage=vp_stage,
        is_last_stage=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
    )


def combined_no_pipelining(hold):
    """combined_1f1b_schedule_for_no_pipelining (combined_1f1b.py:18) with each combined step run
    as the backward step of micro-batch i, then the forward step of i + 1, `hold(chunk)` (the
    overlap's extra bytes, a tensor or None) alive across both."""

    def schedule(
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        input_tensor,
        output_tensor_grad,
        forward_data_store,
        config,
        collect_non_loss_data,
        first_val_step,
        forward_only,
        no_sync_func,
        total_num_tokens,
        check_first_val_step,
    ):
        def forward(i):
            return _forward(
                forward_step_func,
                data_iterator,
                model,
                num_microbatches,
                input_tensor,
                forward_data_store,
                config,
                collect=collect_non_loss_data,
                first=check_first_val_step(i == 0),
                microbatch=i,
            )

        output_tensor, num_tokens = forward(0)  # alone: nothing to overlap with
        with no_sync_func():
            for i in range(num_microbatches - 1):
                total_num_tokens += num_tokens
                extra = hold(0)
                _backward_step(input_tensor, output_tensor, output_tensor_grad, model, config)
                output_tensor, num_tokens = forward(i + 1)
                del extra
        total_num_tokens += num_tokens
        # The last backward alone, outside no_sync (the gradients are synchronised).
        _backward_step(input_tensor, output_tensor, output_tensor_grad, model, config)
        return forward_data_store, total_num_tokens

    return schedule


def combined_interleaved(hold):
    """combined_1f1b_schedule_for_interleaved_pipelining (combined_1f1b.py:115): the schedule's
    pre/post-processing in megatron-core's order around the backward step, then the forward step
    of the replay, `hold(forward chunk)` alive across both."""

    def schedule(
        config,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        forward_data_store,
        forward_step_helper_preprocess,
        forward_step_helper_postprocess,
        backward_step_helper_preprocess,
        backward_step_helper_postprocess,
        get_microbatch_id_in_model_chunk,
        get_model_chunk_id,
        check_first_val_step,
        is_first_microbatch_for_model_chunk,
        collect_non_loss_data,
        f_virtual_microbatch_id=None,
        b_virtual_microbatch_id=None,
        pre_forward=None,
        pre_backward=None,
        post_forward=None,
        post_backward=None,
    ):

        f_chunk = b_chunk = input_tensor = None
        if f_virtual_microbatch_id is not None:
            f_mb = get_microbatch_id_in_model_chunk(f_virtual_microbatch_id, forward=True)
            f_chunk = get_model_chunk_id(f_virtual_microbatch_id, forward=True)
            input_tensor = forward_step_helper_preprocess(f_virtual_microbatch_id, f_chunk, f_mb)
        if b_virtual_microbatch_id is not None:
            b_chunk = get_model_chunk_id(b_virtual_microbatch_id, forward=False)
            b_input, b_output, b_grad = backward_step_helper_preprocess(
                b_virtual_microbatch_id, b_chunk
            )
        # TransformerModelChunkSchedulePlan.run: the receives' waits first.
        if f_chunk is not None and pre_forward is not None:
            pre_forward(f_chunk)
        if b_chunk is not None and pre_backward is not None:
            pre_backward(b_chunk)
        extra = hold(f_chunk) if f_chunk is not None and b_chunk is not None else None
        output_tensor = input_tensor_grad = None
        if b_chunk is not None:
            input_tensor_grad = _backward_step(b_input, b_output, b_grad, model[b_chunk], config)
        if f_chunk is not None:
            first = is_first_microbatch_for_model_chunk(f_virtual_microbatch_id)
            output_tensor, num_tokens = _forward(
                forward_step_func,
                data_iterator[f_chunk],
                model[f_chunk],
                num_microbatches,
                input_tensor,
                forward_data_store,
                config,
                collect=collect_non_loss_data,
                first=check_first_val_step(first),
                microbatch=f_mb,
                vp_stage=f_chunk,
            )
        del extra
        # The sends (their return values unused, as in run()).
        if f_chunk is not None and post_forward is not None:
            post_forward(output_tensor, f_chunk)
        if b_chunk is not None and post_backward is not None:
            post_backward(input_tensor_grad, b_chunk)
        if f_chunk is not None:
            forward_step_helper_postprocess(f_chunk, output_tensor, num_tokens)
        if b_chunk:  # sic (combined_1f1b.py:236): not for chunk 0
            backward_step_helper_postprocess(b_virtual_microbatch_id)
        return output_tensor, input_tensor_grad

    return schedule
