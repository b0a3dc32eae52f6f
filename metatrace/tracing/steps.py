"""What Megatron-LM's pretrain_gpt.py does around the model for one micro-batch.

Megatron-LM is not a dependency, so its per-micro-batch training code (tag core_v0.16.1:
pretrain_gpt.py `get_batch`, `forward_step`, `loss_func`; megatron/training/utils.py
`get_batch_on_this_tp_rank`) is restated here, with the allocations and collectives it makes:

- TP rank 0 of the first and last pipeline stages copies the batch to the GPU (tokens, labels
  int64 [b, s]; loss_mask fp32 [b, s]; a causal attention mask bool [b, 1, s, s] when the data
  loader creates one, Megatron-LM's default; position_ids int64 [b, s]) and broadcasts it over
  the TP group; the other TP ranks allocate the same buffers and receive. Middle stages load
  nothing.
- Under context parallelism the batch is split into 2 x cp load-balanced chunks
  (megatron-core's get_batch_on_this_cp_rank).
- The loss is the masked sum of megatron-core's per-token losses.

Left out, because they move no data and allocate nothing that lasts: the NaN / spiky-loss
checks of the rerun state machine (they need values).
"""

from __future__ import annotations

import functools
from functools import partial

import torch

from metatrace.hooks import guards


def synthetic_batches(*, micro_batch_size: int, seq_length: int, attention_mask: bool):
    """An endless iterator of the host-side dicts Megatron's GPTDataset yields (token ids are
    zeros). They are CPU tensors expanded from one element, so that even a [b, 1, s, s] mask
    costs no host memory; `.cuda()` makes the full device copies, as in a real run."""
    b, s = micro_batch_size, seq_length
    while True:
        batch = {
            "tokens": torch.zeros(1, dtype=torch.int64).expand(b, s),
            "labels": torch.zeros(1, dtype=torch.int64).expand(b, s),
            "loss_mask": torch.ones(1, dtype=torch.float32).expand(b, s),
            "position_ids": torch.arange(s, dtype=torch.int64).expand(b, s),
        }
        if attention_mask:
            batch["attention_mask"] = torch.zeros((1, 1, 1, 1), dtype=torch.bool).expand(b, 1, s, s)
        yield batch


def get_batch_on_this_tp_rank(
    data_iterator, *, micro_batch_size, seq_length, attention_mask, mtp=False
):
    """Megatron-LM training/utils.py: rank 0 of the TP group loads, then broadcasts. With
    multi-token prediction (`mtp`) the last stage takes tokens and positions too: the MTP layers
    embed them."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    src = ps.get_tensor_model_parallel_src_rank()

    def _broadcast(item):
        if item is not None:
            torch.distributed.broadcast(item, src, group=group)

    if ps.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        batch = {
            "tokens": data["tokens"].cuda(non_blocking=True),
            "labels": data["labels"].cuda(non_blocking=True),
            "loss_mask": data["loss_mask"].cuda(non_blocking=True),
            "attention_mask": (
                data["attention_mask"].cuda(non_blocking=True) if "attention_mask" in data else None
            ),
            "position_ids": data["position_ids"].cuda(non_blocking=True),
        }
    else:
        device = torch.cuda.current_device()
        shape = (micro_batch_size, seq_length)
        batch = {
            "tokens": torch.empty(shape, dtype=torch.int64, device=device),
            "labels": torch.empty(shape, dtype=torch.int64, device=device),
            "loss_mask": torch.empty(shape, dtype=torch.float32, device=device),
            "attention_mask": (
                torch.empty(
                    (*shape[:1], 1, seq_length, seq_length), dtype=torch.bool, device=device
                )
                if attention_mask
                else None
            ),
            "position_ids": torch.empty(shape, dtype=torch.int64, device=device),
        }
    if ps.get_pipeline_model_parallel_world_size() == 1:
        keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    elif ps.is_pipeline_first_stage():
        keys = ("tokens", "attention_mask", "position_ids")
        batch["labels"] = batch["loss_mask"] = None
    elif mtp:  # last stage, with the MTP layers
        keys = ("tokens", "position_ids", "labels", "loss_mask", "attention_mask")
    else:  # last stage
        keys = ("labels", "loss_mask", "attention_mask")
        batch["tokens"] = batch["position_ids"] = None
    for key in keys:
        _broadcast(batch[key])
    return batch


def get_batch(data_iterator, vp_stage, *, micro_batch_size, seq_length, attention_mask, mtp=False):
    """pretrain_gpt.get_batch: nothing on middle stages, TP broadcast, then the CP split."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    if not (first or last):
        return None, None, None, None, None
    batch = get_batch_on_this_tp_rank(
        data_iterator,
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
        attention_mask=attention_mask,
        mtp=mtp,
    )
    if guards.since(0, 19):  # the group and the hybrid-CP switch became arguments
        batch = get_batch_on_this_cp_rank(
            batch, is_hybrid_cp=False, cp_group=ps.get_context_parallel_group()
        )
    else:
        batch = get_batch_on_this_cp_rank(batch)
    return (
        batch["tokens"],
        batch["labels"],
        batch["loss_mask"],
        batch["attention_mask"],
        batch["position_ids"],
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt.loss_func: masked sum of per-token losses, token count, reporting pair."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    reporting_loss = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": reporting_loss}


def reduce_losses(losses_reduced, rows: int | None = None) -> None:
    """Megatron-LM's train_step after the optimizer step: on the last pipeline stage, the
    micro-batches' (loss, tokens) pairs are stacked, summed and all-reduced over the
    data-parallel group (with context parallelism) for reporting.

    `rows`: how many micro-batches the stack holds (default: the losses given). The stack is
    allocated first and filled (`vstack(..., out=)`), which allocates and frees what vstack
    does; the short replays of iteration.replayed_iteration stack their few losses into one of
    the whole iteration's size."""
    from megatron.core import parallel_state as ps

    if not ps.is_pipeline_last_stage(ignore_virtual=True) or not losses_reduced:
        return
    rows = max(rows or 0, len(losses_reduced))
    for key in losses_reduced[0]:
        vals = [x[key].view(-1) for x in losses_reduced]
        first = vals[0]
        stack = torch.empty((rows, first.numel()), dtype=first.dtype, device=first.device)
        val = torch.vstack(vals, out=stack[: len(vals)]).sum(dim=0)
        del stack
        torch.distributed.all_reduce(
            val, group=ps.get_data_parallel_group(with_context_parallel=True)
        )


def make_forward_step(*, micro_batch_size: int, seq_length: int, attention_mask: bool):
    """pretrain_gpt.forward_step, bound to the batch shape."""

    def forward_step(data_iterator, model):
        from megatron.core.utils import get_attr_wrapped_model

        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        config = get_attr_wrapped_model(model, "config")
        tokens, labels, loss_mask, mask, position_ids = get_batch(
            data_iterator,
            vp_stage,
            micro_batch_size=micro_batch_size,
            seq_length=seq_length,
            attention_mask=attention_mask,
            mtp=config.mtp_num_layers is not None,
        )
        # pretrain_mamba.py (megatron-core 0.16.1's MambaModel) passes no loss mask
        masked = {"loss_mask": loss_mask} if _takes_loss_mask(model) else {}
        output_tensor = model(tokens, position_ids, mask, labels=labels, **masked)
        return output_tensor, partial(loss_func, loss_mask)

    return forward_step


def _takes_loss_mask(model) -> bool:
    """Whether the language model inside Megatron's wrappers takes a loss_mask argument."""
    while hasattr(model, "module"):
        model = model.module
    return _forward_takes_loss_mask(type(model))


@functools.cache
def _forward_takes_loss_mask(cls) -> bool:
    import inspect

    return "loss_mask" in inspect.signature(cls.forward).parameters
