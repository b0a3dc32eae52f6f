"""Transformer Engine 2.8's FP8 primary weights (fp8_param_gather) as Megatron-FSDP handles them.

megatron-core 0.16.1's Megatron-FSDP (megatron_fsdp/mixed_precision.py, param_and_grad_buffer.py,
megatron_fsdp.py) recognises FP8 parameters as TE's QuantizedTensor and then:
- groups them apart (dtype "float8"), with a uint8 model-weight buffer of their row-wise data
  (sharded under optim_grads_params), an fp32 main-weight buffer and a bf16 main-gradient buffer
  (fp32 with grad_reduce_in_fp32), never a buffer of their nominal dtype;
- swaps a parameter's data for its view of the gathered buffer through `_data`;
- creates each Float8 weight's transpose after the backward all-gather (`_create_transpose`;
  TE 2.8 has no post_all_gather_processing) and discards it (`_transpose = None`) when an FSDP
  unit is released (only transformer layers, only under optim_grads_params);
- after the optimizer step casts the fp32 main-weight shards into the FP8 shards with TE's
  `cast_master_weights_to_fp8` (tensor/utils.py): a copy of every shard in the nominal dtype,
  all alive until the casts are done, and one packed fp32 MAX all-reduce of the amaxes.

`FP8Param` is the linear stand-ins' FP8 weight under Megatron-FSDP: a float8_e4m3fn Parameter
(the row-wise data) with the attributes and methods FSDP uses; hooks.patches points FSDP's
`is_float8tensor` at it and its `fp8_quantize` at `fp8_quantize` below. Per-tensor recipes
(delayed, tensorwise) only: MXFP8 fails in cast_master_weights_to_fp8 on a GPU, and blockwise
takes another path; both are refused (metatrace.config.checks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

U8 = torch.uint8


class FP8Param(torch.nn.Parameter):
    """A TE Float8Tensor weight as Megatron-FSDP sees it: `_data` is the uint8 view of the
    parameter's own FP8 storage, `_transpose` its column-wise copy (Hopper) or None."""

    _transpose: torch.Tensor | None = None
    _transpose_invalid: bool = True
    _scale_inv: torch.Tensor | None = None

    @property
    def _data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self).view(U8)

    @_data.setter
    def _data(self, raw: torch.Tensor) -> None:
        torch.Tensor.data.__set__(self, raw.view(self.dtype))

    def _create_transpose(self) -> None:
        """Float8Tensor._create_transpose: a [K, M] copy, kept until discarded."""
        if self._transpose is None:
            self._transpose = self._data.t().contiguous()
        self._transpose_invalid = False

    def get_high_precision_init_val(self) -> torch.Tensor:
        """TE keeps a host copy of the initial values; the data stands for it (no memory on
        the device either way)."""
        return self._data

    def clear_high_precision_init_val(self) -> None:
        pass


def fp8_parameter(weight: torch.nn.Parameter) -> FP8Param:
    """`weight` (float8_e4m3fn) as an FP8Param with its attributes."""
    out = FP8Param(weight.data, requires_grad=weight.requires_grad)
    for name, value in vars(weight).items():
        setattr(out, name, value)
    return out


def is_float8tensor(tensor) -> bool:
    """Megatron-FSDP's is_float8tensor, for metatrace's FP8 weights."""
    return isinstance(tensor, FP8Param)


def ensure_transpose(weight, arch: str) -> None:
    """TE's update_usage(columnwise_usage=True) on an FP8 weight whose transpose FSDP discarded:
    Hopper's GEMMs need it; Blackwell's read the row-wise data."""
    if isinstance(weight, FP8Param) and arch != "sm100" and weight._transpose is None:
        weight._create_transpose()


def drop_blackwell_transpose(weight, arch: str) -> None:
    """On Blackwell TE drops the transpose FSDP made after the backward all-gather once the
    weight's backward no longer needs column-wise data."""
    if isinstance(weight, FP8Param) and arch == "sm100":
        weight._transpose, weight._transpose_invalid = None, True


def fp8_quantize(
    model_params, main_params, start_offsets, data_parallel_group, fsdp_shard_model_params
) -> None:
    """Megatron-FSDP's fp8_quantize over TE 2.8's cast_master_weights_to_fp8 (per-tensor
    scaling), on meta: the nominal-dtype copies of the main-weight shards, the packed amax
    all-reduce, the casts into the FP8 shards in place."""
    if not model_params:
        return
    shards = [x[0] if x[1] is None else x for x in fsdp_shard_model_params]
    device = model_params[0].device
    nominal = [
        None if m is None else m.to(torch.bfloat16)  # master_weight.to(model_weight.dtype)
        for m in main_params
    ]
    overflow = torch.zeros(1, dtype=torch.int, device=device)
    amaxes = torch.zeros(len(model_params), dtype=torch.float32, device=device)
    dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=data_parallel_group)
    for param, copy, shard in zip(model_params, nominal, shards):
        param._transpose_invalid = True
        if copy is not None:
            target = shard[0] if isinstance(shard, (list, tuple)) else shard
            target.copy_(copy.view(target.shape))
    del nominal, overflow, amaxes
