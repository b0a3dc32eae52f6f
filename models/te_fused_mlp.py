"""Stand-in for megatron-core's TEFusedMLP: a dense MLP run by Transformer Engine's operation
fuser (--use-transformer-engine-op-fuser; implementation.te_op_fuser).

megatron-core 0.16.1's TEFusedMLP (extensions/transformer_engine.py:1907-2185) keeps the MLP's
linear_fc1 (TE LayerNormLinear) and linear_fc2 (TE Linear) as the owners of the parameters but
never calls them. On its first forward it builds te.pytorch.ops.Sequential(RMSNorm | LayerNorm,
BasicLinear(fc1, column, SP), [Bias], GELU | GEGLU | SiLU | SwiGLU | ReLU | ReGLU,
BasicLinear(fc2, no TP mode), ReduceScatter | AllReduce, [Bias]) over those parameters. Without
biases Transformer Engine 2.8 fuses none of these ops (ops/fused: every fusion needs a Bias, an
extra-input add or userbuffers); with a fc1 bias it runs fc1 and the bias as one GEMM. The ops
run one after another inside ONE autograd function (ops/fuser.py,
_OperationFuserAutogradFunction), which `_FusedMLPFunction` mirrors:

- saved (bf16): the norm's input x [Ns, h] (the same storage) and fp32 rstd [Ns] (+ mean for
  LayerNorm); fc1's input, the local norm output [Ns, h]; the activation's input, the fc1 output
  [N, 2f/t] (gated) or [N, f/t]; fc2's input, the activation output [N, f/t]; the weights are
  the parameters. For SwiGLU this is byte for byte what LayerNormLinear + megatron-core's fused
  bias-SwiGLU + Linear save;
- collectives: as the unfused modules; fc1 all-gathers the norm output under SP (freed after
  the GEMM, gathered again before the dgrad GEMM), dgrad is reduce-scattered or all-reduced; the
  ReduceScatter / AllReduce op reduces fc2's output, its backward all-gathers the gradient;
- backward: each op clears its saved input right after its own backward (utils.
  clear_tensor_data), as separate autograd nodes would free them, but every parameter gradient
  is handed back when the whole MLP backward ends (fuser.py backward): without
  gradient-accumulation fusion fc2's weight gradient [h, f/t] lives through fc1's backward. The
  MLP's output gradient [Ns, h], the function's argument, also lives until the end (the
  unfused fc2 node drops it after its own backward).

FP8 (`_fp8_forward`, `_fp8_backward`; layouts from metatrace.models.te_fp8): BasicLinear has no
weight workspace; it quantizes its bf16 weight in every forward (basic_linear.py
_functional_forward: `w = weight_quantizer(w)`) and saves the column-wise usage for backward, so
each micro-batch in flight keeps a quantized copy of both MLP weights until its MLP backward
ends. The norm and the activation write their output straight into the next linear's input
quantizer (no bf16 copy with delayed scaling and MXFP8; through a transient bf16 buffer with
current and block scaling, as TE's C++ kernels choose); the fuser sets that quantizer's usages
before any op runs, so under SP with Float8 the norm output keeps its transpose as well as the
row-wise data it gathers (LayerNormLinear drops the transpose there). fc2 has no TP mode of its
own: the ReduceScatter op's backward all-gathers the output gradient in bf16, and fc2 then
quantizes it whole (the unfused row-parallel Linear gathers it in FP8).

Transformer Engine 2.8 sources (ops/, distributed.py, csrc/extensions/activation.cpp and
normalization.cpp) were read for this, and agree with 2.20 on all of the above; nothing was run
on a GPU.

Known limitations: userbuffers (tp_comm_overlap) and cache_quantized_input
(activation_func_fp8_input_store, which metatrace does not set) are not modelled; activation
values are not computed. Block scaling under sequence parallelism fails in TE 2.8 (the fuser's
FP8 all-gather needs the compact block layout its norm op does not write); metatrace.config.checks
refuses it.
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from metatrace.hooks import flops
from metatrace.hooks.remap import library_kernel
from metatrace.models.norm import norm_backward, norm_forward
from metatrace.models.te_cpu_offload import mark_if_offloading
from metatrace.models.te_fp8 import F32, quantize, reduce_amax, register
from metatrace.models.te_fp8_linear import _amax_all_reduce, _gather_rowwise, _gathered_input
from metatrace.models.te_linear import (
    TELayerNormColumnParallelLinear,
    TERowParallelLinear,
    _gather,
    _reduce_scatter,
)
from metatrace.models.te_runtime import (
    fuses_wgrad,
    gemm_output,
    te_wgrad,
    te_workspace,
    wgrad_into,
)

# (activation_func, gated_linear_unit) -> the Transformer Engine op TEFusedMLP builds
# (_make_activation_op; anything else raises NotImplementedError). All of them save their input
# and allocate only their output, in forward and in backward.
ACTIVATION_OPS = {
    (F.gelu, False): "GELU",
    (F.gelu, True): "GEGLU",
    (F.silu, False): "SiLU",
    (F.silu, True): "SwiGLU",
    (F.relu, False): "ReLU",
    (F.relu, True): "ReGLU",
}


def _clear(*tensors) -> None:
    """TE's clear_tensor_data: an op drops its saved tensors' storage after its backward."""
    for t in tensors:
        if t is not None:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def _tp_reduce(t, mode):
    """[N, h] -> [Ns, h] over the TP group: reduce-scattered under SP, else all-reduced (the
    ReduceScatter / AllReduce op after fc2, and fc1's column-parallel dgrad)."""
    if mode.tp == 1:
        return t
    if mode.sequence_parallel:
        return _reduce_scatter(t, mode)
    dist.all_reduce(t, group=mode.group)
    return t


def _wgrad(module, weight, dy, x):
    """BasicLinear's wgrad GEMM [out, in] = dy^T x, or accumulated into main_grad (reported:
    that GEMM dispatches nothing)."""
    if fuses_wgrad(module, weight):
        flops.report_gemm(dy.shape[1], dy.shape[0], x.shape[1], into=weight.main_grad)
    return te_wgrad(module, weight, torch.mm, dy.t(), x)


class _FusedMLPFunction(torch.autograd.Function):
    """_OperationFuserAutogradFunction over the MLP's ops (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w1, b1, w2, mlp, grad_enabled):
        fc1 = mlp.linear_fc1
        te_workspace(fc1, x.device)
        mode = fc1._mode(fc1.normalization, fc1.eps)  # fc1's TP mode, SP and FP8 recipe
        ctx.mlp, ctx.mode, ctx.x_shape = mlp, mode, x.shape
        # Function.forward runs with grad off; TE's fuser reads grad mode before its ops run.
        ctx.grad_enabled = grad_enabled
        ctx.has_b1 = b1 is not None
        x2 = x.contiguous().view(-1, x.shape[-1])  # [Ns, h]: the norm op's input_.contiguous()
        with library_kernel():
            if mode.fp8 is not None:
                out = _fp8_forward(ctx, x2, ln_w, ln_b, w1, b1, w2)
            else:
                out = _forward(ctx, x2, ln_w, ln_b, w1, b1, w2)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        with library_kernel():
            if ctx.mode.fp8 is not None:
                dx, dlw, dlb, g1, db1, g2 = _fp8_backward(ctx, grad)
            else:
                dx, dlw, dlb, g1, db1, g2 = _backward(ctx, grad)
        # Every parameter gradient is handed back only now, when the whole MLP backward ends.
        return dx.view(ctx.x_shape), dlw, dlb, g1, db1, g2, None, None


def _gated(mlp) -> bool:
    return mlp.config.gated_linear_unit


def _forward(ctx, x2, ln_w, ln_b, w1, b1, w2):
    mode, gated = ctx.mode, _gated(ctx.mlp)
    # Norm op: keeps its input and the fp32 statistics.
    y, mean, rstd = norm_forward(x2, ln_w, ln_b, mode.eps, mode.norm == "RMSNorm")  # [Ns, h]
    # fc1 BasicLinear (column): keeps the local norm output; the gathered copy lives for the GEMM.
    total = _gather(y, mode) if mode.sequence_parallel else y  # [N, h]
    h1 = torch.addmm(b1, total, w1.t()) if b1 is not None else torch.mm(total, w1.t())  # [N, 2f/t]
    del total
    # Activation op (tex.swiglu, ...): allocates its output only, keeps its input.
    f = h1.shape[1] // 2 if gated else h1.shape[1]
    act = torch.empty((h1.shape[0], f), dtype=h1.dtype, device=h1.device)  # [N, f/t]
    # fc2 BasicLinear (no TP mode: the next op reduces), keeps its input.
    out = _tp_reduce(torch.mm(act, w2.t()), mode)  # [N, h] -> [Ns, h]
    mark_if_offloading(x2, rstd, mean, y, h1, act)  # the ops' marks under cpu_offloading
    ctx.save_for_backward(x2, rstd, mean, y, h1, act)
    return out


def _backward(ctx, grad):
    x2, rstd, mean, y, h1, act = ctx.saved_tensors
    mode, mlp = ctx.mode, ctx.mlp
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    w1, w2 = fc1.weight, fc2.weight
    dy = grad.contiguous().view(-1, grad.shape[-1])
    if mode.sequence_parallel:
        dy = _gather(dy, mode)  # ReduceScatter op backward: [Ns, h] -> [N, h]
    # fc2 backward: dgrad, wgrad, then its saved input is cleared.
    dact = torch.mm(dy, w2)  # [N, f/t]
    g2 = _wgrad(fc2, w2, dy, act)  # [h, f/t]
    del dy
    _clear(act)
    # Activation backward (tex.dswiglu, ...): allocates its output only.
    dh1 = torch.empty_like(h1)  # [N, 2f/t]
    del dact
    _clear(h1)
    db1 = dh1.sum(0) if ctx.has_b1 else None  # Bias op backward
    # fc1 backward: the saved local norm output is gathered again before the dgrad GEMM.
    total = _gather(y, mode) if mode.sequence_parallel else y  # [N, h]
    dtotal = _tp_reduce(torch.mm(dh1, w1), mode)  # [N, h] -> [Ns, h]
    g1 = _wgrad(fc1, w1, dh1, total)  # [2f/t, h]
    del total, dh1
    _clear(y)
    # Norm op backward, then its statistics are cleared.
    dx, dlw, dlb = norm_backward(
        dtotal, x2, fc1.layer_norm_weight, fc1.layer_norm_bias, mean, rstd, mode.norm == "RMSNorm"
    )
    _clear(rstd, mean)
    return dx, dlw, dlb, g1, db1, g2


class TEFusedMLP(MLP):
    """megatron-core's TEFusedMLP over metatrace's Transformer Engine stand-ins.

    Known limitations: see the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Built on the first forward and kept in a tuple, as megatron-core does (not a submodule).
        self._fused_impl: tuple | None = None

    def _make_fused_impl(self) -> tuple:
        """What megatron-core's _make_fused_impl checks and keeps: the module types, the
        activation op, the submodule hooks it emulates, and (for FP8) the scaling state of the
        two BasicLinear ops."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if not isinstance(fc1, TELayerNormColumnParallelLinear):
            raise ValueError(
                f"{type(self).__name__} expects FC1 to be Transformer Engine "
                f"LayerNormLinear, but found {type(fc1).__name__}."
            )
        if not isinstance(fc2, TERowParallelLinear):
            raise ValueError(
                f"{type(self).__name__} expects FC2 to be Transformer Engine "
                f"Linear, but found {type(fc2).__name__}."
            )
        if fc1.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"Unsupported normalization ({fc1.normalization})")
        key = (self.activation_func, self.config.gated_linear_unit)
        if key not in ACTIVATION_OPS:
            raise NotImplementedError(
                "Transformer Engine operation-based API does not support "
                f"activation_func={key[0]}, gated_linear_unit={key[1]}"
            )
        return (_submodule_hooks(self), (BasicLinearState(fc1), BasicLinearState(fc2)))

    def forward(self, hidden_states, **kwargs):
        if self._fused_impl is None:
            self._fused_impl = self._make_fused_impl()
        pre, post = self._fused_impl[0]
        for submodule, hook in pre:  # megatron-core calls them without the input
            if hook(submodule, None) is not None:
                raise RuntimeError(
                    "TEFusedMLP module does not expose intermediate tensors, but "
                    "submodule has pre-forward hook that modifies input tensor."
                )
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        b1 = fc1.bias if fc1.use_bias and fc1.bias.numel() else None
        out = _FusedMLPFunction.apply(
            hidden_states,
            fc1.layer_norm_weight,
            fc1.layer_norm_bias,
            fc1.weight,
            b1,
            fc2.weight,
            self,
            torch.is_grad_enabled(),
        )
        for submodule, hook in post:
            if hook(submodule, None, None) is not None:
                raise RuntimeError(
                    "TEFusedMLP module does not expose intermediate tensors, but "
                    "submodule has post-forward hook that modifies output tensor."
                )
        # megatron-core builds fc2 with skip_bias_add: its bias goes to the bias-dropout-add
        # (otherwise TEFusedMLP appends a Bias op after the reduction).
        if fc2.te_return_bias:
            return out, (fc2.bias if fc2.bias.numel() else None)
        if fc2.use_bias:
            out = out + fc2.bias
        return out, None


def _submodule_hooks(mlp) -> tuple[list, list]:
    """megatron-core's _register_hooks_on_fused_impl: the forward hooks of the MLP and its
    submodules (linear_fc1 / fc2 never run, so e.g. DDP's parameter-gather pre-hooks are called
    on their behalf); backward hooks cannot be emulated and raise."""
    pre, post = [], []
    for submodule in mlp.modules():
        pre += [(submodule, hook) for hook in submodule._forward_pre_hooks.values()]
        post += [(submodule, hook) for hook in submodule._forward_hooks.values()]
        for kind, hooks in (
            ("pre", submodule._backward_pre_hooks),
            ("post", submodule._backward_hooks),
        ):
            if hooks:
                raise RuntimeError(
                    f"TEFusedMLP module does not support submodules with {kind}-backward hooks"
                )
    from megatron.core.distributed import distributed_data_parallel

    if any(inspect.getmodule(hook) is not distributed_data_parallel for _, hook in pre):
        warnings.warn(
            "TEFusedMLP module has a submodule with a pre-forward hook. TEFusedMLP "
            "module does not expose intermediate tensors, so the hook may have "
            "incorrect behavior if it attempts to access the input tensor.",
            stacklevel=2,
        )
    if post:
        warnings.warn(
            "TEFusedMLP module has a submodule with a post-forward hook. TEFusedMLP "
            "module does not expose intermediate tensors, so the hook may have "
            "incorrect behavior if it attempts to access the input or output tensors.",
            stacklevel=2,
        )
    return pre, post


# ----------------------------------------------------------------------------- FP8


class BasicLinearState:
    """What Transformer Engine's BasicLinear op keeps for FP8 for the whole run (op.py
    reset_recipe_state, on its first FP8 forward): with delayed scaling a scale and an amax
    history per direction for its two forward quantizers (input, weight) and its one backward
    quantizer (grad output); with current scaling a scale and an amax per quantizer; nothing with
    MXFP8 or block scaling. Having no output or grad-input quantizer of its own, it adds one
    amax fewer per direction than a TE module to the delayed-scaling reduction."""

    fp8_amax_fewer = 1  # read by te_fp8.reduce_amax

    def __init__(self, linear):
        self.weight = linear.weight  # the parameter the op computes with (te_fp8 reads .device)
        self.recipe: str | None = None
        self.tensors: list = []

    def setup(self, recipe: str, history: int, device) -> None:
        if recipe == self.recipe:
            return
        shapes = {
            "delayed": [(2,), (history, 2), (1,), (history, 1)],
            "tensorwise": [(1,)] * 6,
        }.get(recipe, [])
        self.recipe = recipe
        self.tensors = [torch.zeros(s, dtype=F32, device=device) for s in shapes]


def _quantized_weight(weight, recipe, arch, columnwise):
    """BasicLinear quantizes a bf16 weight in every forward (no workspace, no
    is_first_microbatch cache); an FP8 parameter is used as it is (None)."""
    if weight.element_size() == 1:
        return None
    return quantize(
        tuple(weight.shape),
        recipe,
        arch,
        rowwise=True,
        columnwise=columnwise,
        device=weight.device,
        weight=True,
    )


def _quantized_norm(x2, ln_w, ln_b, mode, columnwise):
    """The norm op writing into fc1's input quantizer: directly with delayed scaling (the fused
    kernel), else computed in bf16 and then quantized (TE's C++ normalization)."""
    rms, shape, device = mode.norm == "RMSNorm", tuple(x2.shape), x2.device
    if mode.fp8 == "delayed":
        q = quantize(
            shape, mode.fp8, mode.arch, rowwise=True, columnwise=columnwise, device=device, cast=x2
        )
        rstd = torch.empty(shape[0], dtype=F32, device=device)
        mean = None if rms else torch.empty(shape[0], dtype=F32, device=device)
        return q, mean, rstd
    y, mean, rstd = norm_forward(x2, ln_w, ln_b, mode.eps, rms)
    q = quantize(
        shape, mode.fp8, mode.arch, rowwise=True, columnwise=columnwise, device=device, cast=y
    )
    del y
    return q, mean, rstd


def _quantized_activation(shape, mode, dtype, device, columnwise, reads):
    """An activation kernel (forward or backward) writing into the next quantizer: directly
    with delayed scaling and MXFP8, through a bf16 buffer with current and block scaling (TE's
    C++ activation_helper: the quantized output is allocated first). The kernel reads `reads`."""
    q = quantize(shape, mode.fp8, mode.arch, rowwise=True, columnwise=columnwise, device=device)
    flops.report_moved(*reads, *q.tensors())
    if mode.fp8 in ("tensorwise", "blockwise"):
        tmp = torch.empty(shape, dtype=dtype, device=device)
        del tmp
    return q


def _parts(q) -> list:
    return q.tensors() if q is not None else []


def _fp8_forward(ctx, x2, ln_w, ln_b, w1, b1, w2):
    mode, mlp = ctx.mode, ctx.mlp
    recipe, arch, device = mode.fp8, mode.arch, x2.device
    sp, float8 = mode.sequence_parallel, recipe in ("delayed", "tensorwise")
    history = getattr(mlp.config, "fp8_amax_history_len", 1)
    ops = mlp._fused_impl[1]
    for op in ops:
        op.setup(recipe, history, device)
        ctx.region = register(op)
    ctx.first_in_region = ctx.region is not None and ctx.region.modules[:1] == [ops[0]]
    wgrad = ctx.grad_enabled and w1.requires_grad
    # Norm op: fc1's input quantizer has both usages (the fuser sets them before any op runs).
    shape = tuple(x2.shape)  # [Ns, h]
    q1, mean, rstd = _quantized_norm(x2, ln_w, ln_b, mode, columnwise=wgrad)
    gathered = []
    if sp:
        if recipe == "tensorwise":
            _amax_all_reduce(mode, device)  # the current-scaling amax over TP, then the gather
        gathered = _gather_rowwise(q1, shape, mode, recipe, arch, device)
    rows = shape[0] * (mode.tp if sp else 1)  # N
    wq1 = _quantized_weight(w1, recipe, arch, columnwise=ctx.grad_enabled)
    h1 = gemm_output((rows, w1.shape[0]), dtype=x2.dtype, device=device)  # [N, 2f/t] bf16
    flops.report_gemm(rows, w1.shape[1], w1.shape[0], fp8=True)
    if b1 is not None and wq1 is None:
        h1 = h1 + b1  # no GEMM-bias fusion for FP8 weights: the Bias op on its own
    del gathered
    if wq1 is not None:
        wq1.drop_rowwise()  # the copy kept for backward: column-wise usage
    if not (float8 and sp):
        q1.drop_rowwise()
    # Activation op, straight into fc2's input quantizer (no TP mode: both usages).
    f = h1.shape[1] // 2 if _gated(mlp) else h1.shape[1]
    q2 = _quantized_activation((rows, f), mode, x2.dtype, device, columnwise=wgrad, reads=(h1,))
    wq2 = _quantized_weight(w2, recipe, arch, columnwise=ctx.grad_enabled)
    out = gemm_output((rows, w2.shape[0]), dtype=x2.dtype, device=device)  # [N, h]
    flops.report_gemm(rows, w2.shape[1], w2.shape[0], fp8=True)
    if wq2 is not None:
        wq2.drop_rowwise()
    q2.drop_rowwise()
    out = _tp_reduce(out, mode)  # [Ns, h]
    kept = [_parts(q1), _parts(wq1), _parts(q2), _parts(wq2)]
    ctx.parts, ctx.local_rows = [len(k) for k in kept], shape[0]
    mark_if_offloading(x2, rstd, mean, h1, *q1.data(), *q2.data())  # not weights, not scales
    ctx.save_for_backward(x2, rstd, mean, h1, *(t for k in kept for t in k))
    return out


def _split(tensors, sizes) -> list:
    out, start = [], 0
    for n in sizes:
        out.append(list(tensors[start : start + n]))
        start += n
    return out


def _fp8_backward(ctx, grad):
    x2, rstd, mean, h1, *rest = ctx.saved_tensors
    q1, _, q2, _ = _split(rest, ctx.parts)  # the weight copies live until this backward ends
    mode, mlp = ctx.mode, ctx.mlp
    recipe, arch, device, dtype = mode.fp8, mode.arch, grad.device, grad.dtype
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    w1, w2 = fc1.weight, fc2.weight
    sp = mode.sequence_parallel
    rows = ctx.local_rows * (mode.tp if sp else 1)  # N
    dy = grad.contiguous().view(-1, grad.shape[-1])
    if sp:
        dy = _gather(dy, mode)  # the ReduceScatter op's backward gathers in bf16: [N, h]
    # fc2 backward (no TP mode): the whole output gradient is quantized here.
    dyq = quantize(
        tuple(dy.shape),
        recipe,
        arch,
        rowwise=True,
        columnwise=w2.requires_grad,
        device=device,
        cast=dy,
    )
    del dy
    dact = gemm_output((rows, w2.shape[1]), dtype=dtype, device=device)  # [N, f/t] bf16
    flops.report_gemm(rows, w2.shape[0], w2.shape[1], fp8=True)  # dgrad
    flops.report_gemm(w2.shape[0], rows, w2.shape[1], fp8=True, into=wgrad_into(fc2, w2))
    g2 = te_wgrad(fc2, w2, gemm_output, w2.shape, dtype=dtype, device=device)
    del dyq
    _clear(*q2)
    # Activation backward, straight into fc1's grad-output quantizer (both usages).
    dh1 = _quantized_activation(
        tuple(h1.shape), mode, dtype, device, columnwise=True, reads=(dact, h1)
    )
    # with a fc1 bias, TE's fused dact + dbias kernel (BackwardActivationBias)
    db1 = torch.zeros(h1.shape[1], dtype=dtype, device=device) if ctx.has_b1 else None
    del dact
    _clear(h1)
    # fc1 backward (column): the saved norm output is gathered again in FP8 under SP.
    inputs = []
    if sp:
        inputs = _gathered_input(q1, ctx.local_rows, w1.shape[1], mode, recipe, arch, device)
    dgrad = gemm_output((rows, w1.shape[1]), dtype=dtype, device=device)  # [N, h]
    flops.report_gemm(rows, w1.shape[0], w1.shape[1], fp8=True)  # dgrad
    flops.report_gemm(w1.shape[0], rows, w1.shape[1], fp8=True, into=wgrad_into(fc1, w1))
    dinput = _tp_reduce(dgrad, mode)  # [Ns, h]
    g1 = te_wgrad(fc1, w1, gemm_output, w1.shape, dtype=dtype, device=device)
    del dh1, inputs, dgrad
    _clear(*q1)
    dx, dlw, dlb = norm_backward(
        dinput, x2, fc1.layer_norm_weight, fc1.layer_norm_bias, mean, rstd, mode.norm == "RMSNorm"
    )
    _clear(rstd, mean)
    if recipe == "delayed" and ctx.first_in_region:
        reduce_amax(ctx.region, 2, device)  # the fuser's backward of a region's first module
    return dx, dlw, dlb, g1, db1, g2
