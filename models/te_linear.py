"""Stand-ins for megatron-core's Transformer Engine linear wrappers and TENorm.

Class names, constructor signatures, parameter names, shapes and attributes are those of
megatron-core 0.16.1's `TELinear`, `TEColumnParallelLinear`, `TERowParallelLinear`,
`TELayerNormColumnParallelLinear` and `TENorm` (extensions/transformer_engine.py) over
Transformer Engine 2.8 (`te.pytorch.Linear`, `LayerNormLinear`, `LayerNorm`, `RMSNorm`), with
the parameter attributes TE sets on a real device (tensor_model_parallel, partition_dim,
partition_stride, sequence_parallel) and the ones megatron-core sets (allreduce).

`_LinearFunction` keeps and sends what TE 2.8's `_Linear` / `_LayerNormLinear` do in bf16
(module/linear.py, module/layernorm_linear.py):
- saved: the input as given (the same storage; the local shard under sequence parallelism),
  and for LayerNormLinear also ln_out [Ns, in] (new) and fp32 mu (LayerNorm) and rsigma [Ns];
- column parallel + SP: the input (or ln_out) is all-gathered for the GEMM and the gathered
  buffer freed right after; in backward it is gathered again (before the dgrad GEMM) and dgrad
  is reduce-scattered; without SP, dgrad is all-reduced (tp > 1);
- row parallel: the output is reduce-scattered (SP) or all-reduced in place; with SP the output
  gradient is all-gathered in backward; a row bias is added after the reduction (a new tensor),
  or returned to the caller (megatron's skip_bias_add);
- a column bias is fused into the GEMM; a weight gradient [out, in] is allocated per backward,
  or with gradient-accumulation fusion written into DDP's main_grad (`te_runtime.te_wgrad`).

Under FP8 (an fp8_autocast region is active) the quantized path of
`metatrace.models.te_fp8_linear` runs instead.

Known limitations: userbuffer (tp_comm_overlap) and symmetric all-reduce variants are not
modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from metatrace.hooks import flops
from metatrace.hooks.remap import library_kernel
from metatrace.models.norm import NormBase, norm_backward, norm_forward
from metatrace.models.te_cpu_offload import mark_if_offloading
from metatrace.models.te_fp8_linear import fp8_backward, fp8_forward
from metatrace.models.te_runtime import (
    bulk_reduced,
    dgrad_and_input,
    fuses_wgrad,
    te_wgrad,
    te_workspace,
    ub_all_gather,
    ub_margin,
    ub_reduce_scatter,
)


@dataclass(frozen=True)
class _Mode:
    parallel: str | None  # "column", "row" or None (duplicated)
    sequence_parallel: bool  # effective: tp > 1 and config.sequence_parallel
    group: object
    tp: int
    norm: str | None = None  # "LayerNorm" / "RMSNorm" for LayerNormLinear
    eps: float = 1e-5
    fp8: str | None = None  # the FP8 recipe of the enclosing autocast region, if any
    arch: str = "sm90"
    # TE's userbuffers overlaps (tp_comm_overlap): some of ag_fprop, rs_fprop, ag_dgrad,
    # rs_dgrad, bulk_dgrad, bulk_wgrad; ub_name: megatron-core's buffer name (qkv, fc1, ...)
    ub: frozenset = frozenset()
    ub_name: str | None = None

    def ub_gather(self, x2, gemm: str):
        """All-gather into userbuffer {ub_name}_{gemm} (no allocation)."""
        return ub_all_gather(f"{self.ub_name}_{gemm}", x2, self.group, self.tp)


def _gather(x2, mode):
    out = torch.empty((x2.shape[0] * mode.tp, *x2.shape[1:]), dtype=x2.dtype, device=x2.device)
    dist.all_gather_into_tensor(out, x2, group=mode.group)
    return out


def _reduce_scatter(x2, mode):
    out = torch.empty((x2.shape[0] // mode.tp, *x2.shape[1:]), dtype=x2.dtype, device=x2.device)
    dist.reduce_scatter_tensor(out, x2, group=mode.group)
    return out


def _output_view(out, x):
    """The GEMM's [N, out] output in the input's leading shape. TE's GEMM writes that shape
    itself (general_gemm takes the N-d input), so the function's output is no view: an
    _unsafe_view, which autograd does not track as one (megatron-core 0.19 adds an expert's
    bias into its fc2 output in place, mlp.py:350)."""
    lead = x.shape[:-1]
    shape = (out.shape[0] // max(1, _prod(lead[1:])), *lead[1:], out.shape[-1])
    return torch.ops.aten._unsafe_view(out, shape)


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, ln_weight, ln_bias, mode: _Mode, module=None):
        te_workspace(module, x.device)
        with library_kernel():
            return _LinearFunction._forward(ctx, x, weight, bias, ln_weight, ln_bias, mode, module)

    @staticmethod
    def backward(ctx, grad):
        with library_kernel():
            return _LinearFunction._backward(ctx, grad)

    @staticmethod
    def _forward(ctx, x, weight, bias, ln_weight, ln_bias, mode: _Mode, module=None):
        in_features = x.shape[-1]
        x2 = x.contiguous().view(-1, in_features)  # [Ns, in], TE's prepare_forward
        ctx.mode, ctx.x_shape, ctx.module = mode, x.shape, module
        if mode.fp8 is not None:
            return _output_view(fp8_forward(ctx, x2, weight, bias, ln_weight, ln_bias), x)
        mu = rsigma = ln_out = None
        if mode.norm is not None:
            ln_out, mu, rsigma = norm_forward(
                x2, ln_weight, ln_bias, mode.eps, mode.norm == "RMSNorm"
            )
        inp = ln_out if ln_out is not None else x2
        column_sp = mode.parallel == "column" and mode.sequence_parallel
        total = inp  # [N, in]
        if column_sp:
            total = mode.ub_gather(inp, "fprop") if "ag_fprop" in mode.ub else _gather(inp, mode)
        rs_out = None
        if "rs_fprop" in mode.ub:  # TE allocates the reduce-scatter's output before the GEMM
            rs_out = torch.empty(
                (x2.shape[0] // mode.tp, weight.shape[0]), dtype=x2.dtype, device=x2.device
            )
        with flops.sm_margin(ub_margin(mode, "fprop")):
            if bias is not None:
                out = torch.addmm(bias, total, weight.t())  # bias in the GEMM epilogue (column)
            else:
                out = torch.mm(total, weight.t())  # [N, out]
        del total  # the gathered input is freed right after the GEMM
        if rs_out is not None:
            ub_reduce_scatter(rs_out, out, mode.group)
            out = rs_out
        elif mode.parallel == "row" and mode.tp > 1:
            if mode.sequence_parallel:
                out = _reduce_scatter(out, mode)
            else:
                dist.all_reduce(out, group=mode.group)
        # TE's cpu_offloading marks: Linear its input as given (saved_inputmat is inp, so the
        # mark stays on the caller's tensor), LayerNormLinear the input it saves and the norm's.
        mark_if_offloading(x if mode.norm is None else None, x2, mu, rsigma, ln_out)
        ctx.save_for_backward(x2, weight, bias, ln_weight, ln_bias, ln_out, mu, rsigma)
        return _output_view(out, x)

    @staticmethod
    def _backward(ctx, grad):
        mode = ctx.mode
        if mode.fp8 is not None:
            return (*fp8_backward(ctx, grad), None, None)
        x2, weight, bias, ln_weight, ln_bias, ln_out, mu, rsigma = ctx.saved_tensors
        dy = grad.contiguous().view(-1, grad.shape[-1])
        if mode.parallel == "row" and mode.sequence_parallel:  # [N, out]
            dy = mode.ub_gather(dy, "dgrad") if "ag_dgrad" in mode.ub else _gather(dy, mode)
        saved_input = ln_out if ln_out is not None else x2
        column_sp = mode.parallel == "column" and mode.sequence_parallel
        total = saved_input  # gathered before the dgrad GEMM
        if column_sp:
            bulk = "bulk_dgrad" in mode.ub
            total = mode.ub_gather(saved_input, "dgrad") if bulk else _gather(saved_input, mode)
        with flops.sm_margin(ub_margin(mode, "dgrad")):
            dgrad, dinput = dgrad_and_input(  # [N, in]
                mode,
                dy.shape[0],
                weight.shape[1],
                dy.dtype,
                dy.device,
                lambda out: (
                    torch.mm(dy, weight, out=out) if out is not None else torch.mm(dy, weight)
                ),
            )
        with flops.sm_margin(ub_margin(mode, "wgrad")):
            if fuses_wgrad(ctx.module, weight):  # the GEMM into main_grad dispatches nothing
                flops.report_gemm(dy.shape[1], dy.shape[0], total.shape[1], into=weight.main_grad)
            wgrad = te_wgrad(ctx.module, weight, torch.mm, dy.t(), total)  # [out, in]
        dinput = bulk_reduced(mode, dgrad, dinput)
        bgrad = dy.sum(0) if bias is not None else None
        del total
        dln_w = dln_b = None
        if mode.norm is not None:
            dinput, dln_w, dln_b = norm_backward(
                dinput, x2, ln_weight, ln_bias, mu, rsigma, mode.norm == "RMSNorm"
            )
        return dinput.view(ctx.x_shape), wgrad, bgrad, dln_w, dln_b, None, None


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def _tp_group(tp_group, is_expert=False):
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    return get_tensor_model_parallel_group_if_none(tp_group, is_expert)


class _TELinearBase(torch.nn.Module):
    """Parameters and forward shared by the linear stand-ins."""

    def _setup(
        self,
        config,
        in_features,
        out_features,
        *,
        parallel_mode,
        tp_group,
        bias,
        skip_bias_add,
        init_method,
        stride=1,
    ):
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        self.config = config
        self._tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.parallel_mode = parallel_mode
        self.sequence_parallel = self.tp_size > 1 and config.sequence_parallel
        self.te_return_bias = skip_bias_add and bias
        self.use_bias = bias
        self.is_first_microbatch = True
        self.fuse_wgrad_accumulation = config.gradient_accumulation_fusion
        self.disable_parameter_transpose_cache = getattr(
            config, "disable_parameter_transpose_cache", False
        )
        self.te_quant_params = None
        if parallel_mode == "column":
            out_features //= self.tp_size
        elif parallel_mode == "row":
            in_features //= self.tp_size
        self.in_features, self.out_features = in_features, out_features
        device = torch.cuda.current_device()  # remapped to the traced device
        dtype = config.params_dtype
        self.fp8_param = bool(config.fp8 and config.fp8_param)
        self.weight = torch.nn.Parameter(
            torch.empty(
                out_features,
                in_features,
                dtype=torch.float8_e4m3fn if self.fp8_param else dtype,
                device=device,
            )
        )
        if self.fp8_param:
            from metatrace.models.te_fp8 import register_fp8_param_buffers

            shape = (out_features, in_features)
            register_fp8_param_buffers(self, config, shape, device, "_fp8_param_buffer")
            if getattr(config, "metatrace_fsdp_strategy", None):
                self._fsdp_fp8_weight(config.metatrace_fsdp_strategy)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = torch.empty(0, dtype=dtype, device=device)  # TE: a zero-length tensor
        if config.perform_initialization:
            with get_cuda_rng_tracker().fork():
                init_method(self.weight)
        # Attributes TE's reset_parameters sets on a real device, and megatron-core's.
        w = self.weight
        if parallel_mode in ("column", "row"):
            w.tensor_model_parallel = True
            w.partition_dim = 0 if parallel_mode == "column" else 1
            w.partition_stride = stride
        if bias:
            if parallel_mode == "column":
                self.bias.tensor_model_parallel = True
                self.bias.partition_dim = 0
                self.bias.partition_stride = stride
            elif parallel_mode == "row":
                self.bias.sequence_parallel = self.sequence_parallel
        for p in self.parameters():
            p.allreduce = True
        self.ub, self.ub_name = frozenset(), None

    def _userbuffers(
        self, name, *, ag, rs=False, rs_dgrad=False, bulk_dgrad=False, bulk_wgrad=False
    ):
        """TE 2.8's userbuffers overlaps for this module (Linear / LayerNormLinear __init__),
        from the ub_* arguments megatron-core passes with config.tp_comm_overlap."""
        sp = self.sequence_parallel
        column, row = self.parallel_mode == "column", self.parallel_mode == "row"
        flags = {
            "ag_fprop": column and sp and ag,
            "rs_dgrad": column and sp and rs_dgrad,
            "bulk_dgrad": column and sp and bulk_dgrad and not rs_dgrad,
            "bulk_wgrad": column and sp and bulk_wgrad and not rs_dgrad,
            "rs_fprop": row and sp and rs,
            "ag_dgrad": row and sp and ag,
        }
        self.ub = frozenset(k for k, on in flags.items() if on)
        self.ub_name = name if self.ub else None

    def _linear_userbuffers(self, config, name, parallel_mode, is_expert):
        """megatron-core's TELinear: ub_overlap_ag / ub_overlap_rs from the config, off for
        experts and duplicated layers."""
        # (megatron-core turns the overlap off for other buffer names; MLA is refused for it)
        if name not in ("qkv", "proj", "fc1", "fc2"):
            return
        if config.tp_comm_overlap and parallel_mode != "duplicated" and not is_expert:
            self._userbuffers(name, ag=config.tp_comm_overlap_ag, rs=config.tp_comm_overlap_rs)

    def _setup_parallel(
        self, config, in_features, out_features, *, parallel_mode, tp_group, is_expert, **kwargs
    ):
        """megatron-core's wrappers around `_setup`: an expert linear under expert tensor or
        expert parallelism leaves communication to the MoE dispatcher, so TE gets its shard and
        no parallel mode; expert parameters reduce their gradients over the expert
        data-parallel group (allreduce False) when ep > 1."""
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        expert_parallel = config.expert_model_parallel_size > 1
        if is_expert and parallel_mode is not None and (tp > 1 or expert_parallel):
            if parallel_mode == "column":
                out_features //= tp
            elif parallel_mode == "row":
                in_features //= tp
            self._setup(
                config, in_features, out_features, parallel_mode=None, tp_group=None, **kwargs
            )
            self._tp_group = tp_group
            if tp > 1:
                # Sharded over expert TP all the same, though TE (given no parallel mode) marks
                # nothing: metatrace's own mark, for the count of the model's parameters.
                self.weight.metatrace_expert_tp_sharded = True
                if parallel_mode == "column" and self.bias.numel():
                    self.bias.metatrace_expert_tp_sharded = True
        else:
            self._setup(
                config,
                in_features,
                out_features,
                parallel_mode=parallel_mode,
                tp_group=tp_group,
                **kwargs,
            )
        if is_expert:
            for p in self.parameters():
                p.allreduce = not expert_parallel

    def _fsdp_fp8_weight(self, strategy: str) -> None:
        """Under Megatron-FSDP the FP8 weight is TE's Float8Tensor as FSDP handles it
        (models.te_fp8_param): its scale, and on Hopper its transpose, are the tensor's own.
        FSDP discards the transpose when it releases a transformer layer (optim_grads_params
        only, so the steady state starts without it) and TE makes it again when needed."""
        from metatrace.models.te_fp8_param import fp8_parameter

        weight = self._parameters["weight"] = fp8_parameter(self.weight)
        arch = getattr(self.config, "metatrace_gpu_arch", "sm90")
        if arch == "sm100":  # one buffer serves both usages: the scale is buffer 0
            weight._scale_inv = self._fp8_param_buffer0
            return
        weight._scale_inv = self._fp8_param_buffer1
        if strategy == "optim_grads_params":
            del self._fp8_param_buffer0
        else:
            weight._transpose, weight._transpose_invalid = self._fp8_param_buffer0, False

    def _apply(self, fn, recurse=True):
        """TE's quantized parameters stay FP8 under module.bfloat16() (Float16Module)."""
        if not self.fp8_param:
            return super()._apply(fn, recurse)
        weight = self._parameters.pop("weight")
        try:
            return super()._apply(fn, recurse)
        finally:
            self._parameters["weight"] = weight

    def _mode(self, norm=None, eps=1e-5) -> _Mode:
        from metatrace.models.te_fp8 import active_recipe

        return _Mode(
            parallel=self.parallel_mode,
            sequence_parallel=self.sequence_parallel,
            group=self._tp_group,
            tp=self.tp_size,
            norm=norm,
            eps=eps,
            fp8=active_recipe(),
            arch=getattr(self.config, "metatrace_gpu_arch", "sm90"),
            # LayerNormLinear gathers through NCCL when grad is off (a recomputed forward's
            # first pass under full recompute): layernorm_linear.py ub_overlap_ag_fprop.
            ub=self.ub - {"ag_fprop"} if norm and not torch.is_grad_enabled() else self.ub,
            ub_name=self.ub_name,
        )

    def _run(self, x, ln_weight=None, ln_bias=None, norm=None, eps=1e-5):
        bias = self.bias if self.use_bias and not self.te_return_bias else None
        row = self.parallel_mode == "row"
        out = _LinearFunction.apply(
            x, self.weight, None if row else bias, ln_weight, ln_bias, self._mode(norm, eps), self
        )
        if row and bias is not None:
            out = out + bias  # TE adds a row-parallel bias after the reduction, outside the GEMM
        self.is_first_microbatch = False
        return (out, self.bias) if self.te_return_bias else (out, None)

    def finish_init(self, quant_config) -> None:
        """megatron-core calls this on every module after building (quantisation recipes)."""

    def backward_dw(self) -> None:
        """Delayed weight-gradient computation (not modelled: weight gradients run in backward)."""

    def forward(self, x):
        return self._run(x)


def newer_arguments(config, gtp_remat_group=None) -> None:
    """megatron-core 0.19 passes its TE layers a `name` (the key of a per-module recipe in
    `config.quant_recipe`) and TELinear a `gtp_remat_group` (generalised tensor parallelism's
    weight shards, a group of one when `gtp_remat_size` is 1). The stand-ins model neither a
    per-module recipe nor weight re-materialisation: an error if either is in effect."""
    if getattr(config, "quant_recipe", None) is not None:
        raise ValueError("per-module quantization recipes (quant_recipe) are not modelled")
    if gtp_remat_group is not None and gtp_remat_group.size() > 1:
        raise ValueError(
            "generalised tensor parallelism (gtp_remat_size > 1) is not modelled: its weight "
            "shards are re-materialised per layer"
        )


class TELinear(_TELinearBase):
    """megatron-core's TELinear (TE's Linear); its column- and row-parallel wrappers subclass it,
    as megatron-core's do (attention and shared experts test `isinstance(.., TELinear)`)."""

    save_original_input = False
    """TE >= 2.6 Linear: save the bf16 input for backward instead of its quantized copy, and
    quantize it again for the wgrad GEMM (megatron-core's set_save_original_input: attention's
    linear_proj and shared experts' linear_fc1 under non-delayed FP8, layers whose norm is
    recomputed)."""

    def __init__(
        self,
        input_size,
        output_size,
        *,
        parallel_mode,
        config,
        init_method,
        bias,
        skip_bias_add,
        skip_weight_param_allocation,
        tp_comm_buffer_name=None,
        is_expert=False,
        symmetric_ar_type=None,
        tp_group=None,
        name=None,
        gtp_remat_group=None,
    ):
        super().__init__()
        newer_arguments(config, gtp_remat_group)
        if skip_weight_param_allocation:
            raise ValueError(
                "Transformer Engine linear layers do not support skip_weight_param_allocation"
            )
        if parallel_mode == "duplicated":
            group, te_mode = None, None
        else:
            group, te_mode = _tp_group(tp_group, is_expert), parallel_mode
        self._setup_parallel(
            config,
            input_size,
            output_size,
            parallel_mode=te_mode,
            tp_group=group,
            is_expert=is_expert,
            bias=bias,
            skip_bias_add=skip_bias_add,
            init_method=init_method,
        )
        self._linear_userbuffers(config, tp_comm_buffer_name, parallel_mode, is_expert)
        if parallel_mode == "duplicated":
            for p in self.parameters():
                p.sequence_parallel = config.sequence_parallel


class TEColumnParallelLinear(TELinear):
    def __init__(
        self,
        input_size,
        output_size,
        *,
        config,
        init_method,
        gather_output,
        bias,
        skip_bias_add,
        is_expert,
        skip_weight_param_allocation=False,
        tp_comm_buffer_name=None,
        tp_group=None,
        stride=1,
        name=None,
    ):
        _TELinearBase.__init__(self)
        newer_arguments(config)
        if gather_output:
            raise ValueError("Transformer Engine linear layers do not support gather_output = True")
        self._setup_parallel(
            config,
            input_size,
            output_size,
            parallel_mode="column",
            tp_group=_tp_group(tp_group, is_expert),
            is_expert=is_expert,
            bias=bias,
            skip_bias_add=skip_bias_add,
            init_method=init_method,
            stride=stride,
        )
        self._linear_userbuffers(config, tp_comm_buffer_name, "column", is_expert)


class TERowParallelLinear(TELinear):
    def __init__(
        self,
        input_size,
        output_size,
        *,
        config,
        init_method,
        bias,
        input_is_parallel,
        skip_bias_add,
        is_expert,
        tp_comm_buffer_name=None,
        tp_group=None,
        name=None,
    ):
        _TELinearBase.__init__(self)
        newer_arguments(config)
        if not input_is_parallel:
            raise ValueError(
                "Transformer Engine linear layers do not support input_is_parallel = False"
            )
        self._setup_parallel(
            config,
            input_size,
            output_size,
            parallel_mode="row",
            tp_group=_tp_group(tp_group, is_expert),
            is_expert=is_expert,
            bias=bias,
            skip_bias_add=skip_bias_add,
            init_method=init_method,
        )
        self._linear_userbuffers(config, tp_comm_buffer_name, "row", is_expert)


class TELayerNormColumnParallelLinear(_TELinearBase):
    """LayerNorm (or RMSNorm) fused into a column-parallel linear: parameters layer_norm_weight,
    layer_norm_bias (LayerNorm only), weight, bias."""

    def __init__(
        self,
        input_size,
        output_size,
        *,
        config,
        init_method,
        gather_output,
        bias,
        skip_bias_add,
        is_expert,
        skip_weight_param_allocation=False,
        tp_comm_buffer_name=None,
        tp_group=None,
        stride=1,
        name=None,
    ):
        super().__init__()
        newer_arguments(config)
        if gather_output or is_expert or skip_weight_param_allocation:
            raise ValueError(
                "TELayerNormColumnParallelLinear supports none of gather_output, "
                "is_expert, skip_weight_param_allocation"
            )
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        device = torch.cuda.current_device()
        dtype = config.params_dtype
        # Registered before weight and bias, as TE does.
        self.layer_norm_weight = torch.nn.Parameter(
            torch.ones(input_size, dtype=dtype, device=device)
        )
        if self.normalization == "RMSNorm":
            self.layer_norm_bias = None
        else:
            self.layer_norm_bias = torch.nn.Parameter(
                torch.zeros(input_size, dtype=dtype, device=device)
            )
        self._setup(
            config,
            input_size,
            output_size,
            parallel_mode="column",
            tp_group=_tp_group(tp_group),
            bias=bias,
            skip_bias_add=skip_bias_add,
            init_method=init_method,
            stride=stride,
        )
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is not None:
                p.sequence_parallel = self.sequence_parallel
        if config.tp_comm_overlap:  # megatron-core's ub_* arguments to LayerNormLinear
            disabled = (tp_comm_buffer_name == "qkv" and config.tp_comm_overlap_disable_qkv) or (
                tp_comm_buffer_name == "fc1" and config.tp_comm_overlap_disable_fc1
            )
            self._userbuffers(
                tp_comm_buffer_name,
                ag=config.tp_comm_overlap_ag and not disabled,
                rs_dgrad=config.tp_comm_overlap_rs_dgrad and not disabled,
                bulk_dgrad=config.tp_comm_bulk_dgrad,
                bulk_wgrad=config.tp_comm_bulk_wgrad,
            )

    def forward(self, x):
        return self._run(
            x, self.layer_norm_weight, self.layer_norm_bias, self.normalization, self.eps
        )


class LayerNorm(NormBase):
    """transformer_engine.pytorch.LayerNorm, as megatron-core's TENorm builds it."""

    te = True

    def __init__(self, config, hidden_size, eps):
        super().__init__(
            config, hidden_size, eps, rms=False, sequence_parallel=config.sequence_parallel
        )


class RMSNorm(NormBase):
    """transformer_engine.pytorch.RMSNorm, as megatron-core's TENorm builds it."""

    te = True

    def __init__(self, config, hidden_size, eps):
        super().__init__(
            config, hidden_size, eps, rms=True, sequence_parallel=config.sequence_parallel
        )


class TENorm:
    """megatron-core's TENorm: a factory returning TE's LayerNorm or RMSNorm module."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5):
        if config.normalization == "LayerNorm":
            return LayerNorm(config, hidden_size, eps)
        if config.normalization == "RMSNorm":
            return RMSNorm(config, hidden_size, eps)
        raise ValueError("Only LayerNorm and RMSNorm are currently supported")
