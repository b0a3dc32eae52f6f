"""Stand-ins for megatron-core's Transformer Engine grouped linears (the experts of TEGroupedMLP).

megatron-core 0.16.1's `TEColumnParallelGroupedLinear` / `TERowParallelGroupedLinear`
(extensions/transformer_engine.py) over TE 2.8's `GroupedLinear` (module/grouped_linear.py):
one GEMM per local expert on its slice of the permuted tokens (`m_splits`), parameters
`weight0..weight{n-1}` [out, in] (and `bias{i}` [out]), the expert tensor-parallel shard taken
by megatron-core, which does every communication itself (TE gets no parallel mode and tp 1).
With biases (GPT-OSS), megatron-core's TEGroupedMLP has TE add fc1's in the GEMM (skip_bias_add
False) and takes fc2's back (skip_bias_add True) to add them scaled by the routing probabilities.

What the bf16 path keeps and allocates:
- forward: the input split into per-expert views (the same storage) and the weights are saved,
  nothing new; one output buffer [sum(m_splits), out];
- backward: one dgrad buffer [sum(m_splits), in]; per expert a weight gradient [out, in], or with
  gradient-accumulation fusion the GEMM accumulates into main_grad and TE returns a new
  (uninitialised) tensor of main_grad's shape per expert, which megatron-core's DDP drops;
- a process-wide multi-stream cuBLAS workspace: 4 buffers of 32 MiB + 1 KiB on sm90 and later
  (4 MiB before), separate from the single-stream one of Linear.
No communication happens inside TE in either direction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from metatrace.config.hardware import te_workspace_bytes
from metatrace.hooks import flops
from metatrace.hooks.remap import library_kernel
from metatrace.models import te_runtime, te_wgrad
from metatrace.models.te_fp8 import active_recipe, register_fp8_param_buffers
from metatrace.models.te_fp8_grouped import fp8_backward, fp8_forward
from metatrace.models.te_linear import newer_arguments

_STREAMS = 4  # TE 2.8's get_num_compute_streams()


def _multi_stream_workspaces(module, device) -> None:
    process = te_runtime._PROCESS
    if getattr(process, "multi_stream_workspaces", None) is not None:
        return
    nbytes = te_workspace_bytes(
        getattr(getattr(module, "config", None), "metatrace_gpu_arch", "sm90")
    )
    process.multi_stream_workspaces = [
        torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(_STREAMS)
    ]


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits, module, *params):
        _multi_stream_workspaces(module, x.device)
        recipe = active_recipe()
        if recipe is not None:  # FP8 (metatrace.models.te_fp8_grouped)
            n, arch = module.num_gemms, getattr(module.config, "metatrace_gpu_arch", "sm90")
            ctx.module, ctx.x_shape, ctx.m_splits = module, x.shape, m_splits
            with library_kernel():
                out = fp8_forward(
                    ctx,
                    x.contiguous().view(-1, x.shape[-1]),
                    m_splits,
                    module,
                    params[:n],
                    params[n:],
                    recipe,
                    arch,
                    module.grad_enabled,
                )
            return out.view(*x.shape[:-1], module.out_features)
        with library_kernel():
            n = module.num_gemms
            weights, biases = params[:n], params[n:]
            x2 = x.contiguous().view(-1, x.shape[-1])
            inputs = torch.split(x2, m_splits)
            out = torch.empty((x2.shape[0], module.out_features), dtype=x.dtype, device=x.device)
            # One GEMM per expert on its m_splits[i] rows: together over all the rows.
            flops.report_grouped(m_splits, module.in_features, module.out_features)
            ctx.m_splits = tuple(m_splits)
            # TE >= 2.6 with save_original_input keeps the whole input once (grouped_linear.py
            # of TE 2.20: `inputmats[0] = inp`) instead of one view per expert: the same storage,
            # but one tensor to offload (megatron-core's expert_fc1 offloading sets it).
            original = module.save_original_input and weights[0].requires_grad
            # TE saves the biases whether it adds them (fc1: bias in the GEMM's epilogue, no new
            # tensor) or returns them (fc2, skip_bias_add: megatron-core adds them, weighted by
            # the routing probabilities, in TEGroupedMLP._apply_bias).
            ctx.save_for_backward(*((x2,) if original else inputs), *weights, *biases)
            ctx.module, ctx.x_shape, ctx.original = module, x.shape, original
            return out.view(*x.shape[:-1], module.out_features)

    @staticmethod
    def backward(ctx, grad):
        if getattr(ctx, "fp8", None) is not None:
            with library_kernel():
                dgrad, wgrads, bgrads = fp8_backward(ctx, grad, _wgrad)
            dgrad = dgrad.view(ctx.x_shape) if dgrad is not None else None
            return (dgrad, None, None, *wgrads, *bgrads)
        module = ctx.module
        n = module.num_gemms
        saved = ctx.saved_tensors  # the per-expert inputs (or the whole one), weights, biases
        k = 1 if ctx.original else n
        weights, biases = saved[k : k + n], saved[k + n :]
        with library_kernel():
            dy = grad.contiguous().view(-1, grad.shape[-1])
            dgrad = torch.empty((dy.shape[0], module.in_features), dtype=dy.dtype, device=dy.device)
            wgrads = [_wgrad(module, w, dy) for w in weights]
            gemm = flops.gemm(dy.shape[0], module.out_features, module.in_features)
            wgrad = any(w.requires_grad for w in weights)
            if wgrad and te_wgrad.delays(module):
                # delay_wgrad_compute: TE puts the per-expert inputs and dy in its WeightGradStore
                # until backward_dw runs the wgrad GEMMs (metatrace.models.te_wgrad).
                te_wgrad.put(module, (*saved[:k], dy), gemm)
                wgrad = False
            flops.report_grouped(  # dgrad, wgrad
                ctx.m_splits, module.out_features, module.in_features, times=2 if wgrad else 1
            )
            # TE 2.8 (grouped_linear.py backward): with the bias applied, the wgrad grouped GEMM
            # also returns each expert's bias gradient [out] (general_grouped_gemm's grad_bias);
            # a returned bias (use_bias = apply_bias False) gets none from TE.
            bgrads = [
                torch.empty(b.shape, dtype=b.dtype, device=b.device) if module.apply_bias else None
                for b in biases
            ]
        return (dgrad.view(ctx.x_shape), None, None, *wgrads, *bgrads)


def _wgrad(module, weight, dy):
    """A fresh [out, in] gradient per expert; with gradient-accumulation fusion the GEMM writes
    main_grad and TE still returns a new uninitialised tensor of its shape (not the cached
    dummy of Linear)."""
    if te_runtime.fuses_wgrad(module, weight):
        weight.grad_added_to_main_grad = True
        return torch.empty(weight.main_grad.shape, dtype=weight.dtype, device=dy.device)
    return torch.empty(weight.shape, dtype=weight.dtype, device=dy.device)


class TEGroupedLinear(torch.nn.Module):
    """megatron-core's TEGroupedLinear with TE's GroupedLinear inside, on meta."""

    def __init__(
        self,
        num_gemms,
        input_size,
        output_size,
        *,
        parallel_mode,
        config,
        init_method,
        bias,
        skip_bias_add,
        is_expert=False,
        tp_comm_buffer_name=None,
        pg_collection=None,
        name=None,
    ):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        super().__init__()
        newer_arguments(config)
        if not is_expert:
            raise AssertionError("TEGroupedLinear only supports expert parallelism")
        # FP8 primary weights (fp8_model_init): each weight{i} is TE's quantized tensor
        self.fp8_param = bool(config.fp8 and config.fp8_param)
        self.config = config
        self.num_gemms = num_gemms
        self.te_return_bias = skip_bias_add and bias
        self.use_bias = bias
        self.apply_bias = bias and not skip_bias_add  # TE's GroupedLinear.apply_bias
        self.is_first_microbatch = True
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self._pg_collection = pg_collection
        self._tp_group = pg_collection.expt_tp
        tp = dist.get_world_size(self._tp_group)
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.explicit_expert_comm = tp > 1 or self.expert_parallel
        if parallel_mode == "column":  # megatron-core's shard, or TE's own at tp 1
            output_size //= tp
        elif parallel_mode == "row":
            input_size //= tp
        self.in_features, self.out_features = input_size, output_size
        device = torch.cuda.current_device()
        dtype = config.params_dtype
        for i in range(num_gemms):
            w = torch.nn.Parameter(
                torch.empty(
                    output_size,
                    input_size,
                    dtype=torch.float8_e4m3fn if self.fp8_param else dtype,
                    device=device,
                )
            )
            if self.fp8_param:
                shape = (output_size, input_size)
                register_fp8_param_buffers(self, config, shape, device, f"_fp8_param_buffer{i}_")
            if config.perform_initialization and w.device.type != "meta":
                # (on meta an initialiser writes nothing, and hundreds of experts' normal_
                # calls cost seconds)
                with get_cuda_rng_tracker().fork():
                    init_method(w)
            # TE's reset_parameters on a device; with megatron-core's explicit communication TE
            # sees no parallel mode, so a row weight keeps partition_dim 0.
            w.tensor_model_parallel = True
            w.partition_dim = 1 if parallel_mode == "row" and not self.explicit_expert_comm else 0
            w.partition_stride = 1
            self.register_parameter(f"weight{i}", w)
            if bias:
                b = torch.nn.Parameter(torch.zeros(output_size, dtype=dtype, device=device))
                self.register_parameter(f"bias{i}", b)
        for p in self.parameters():
            p.allreduce = not self.expert_parallel
        if te_wgrad.delays(self):
            te_wgrad.mark(self, self.parameters())

    save_original_input = False
    """TE >= 2.6: save the bf16 input itself for backward, once, instead of the per-expert
    (quantized) inputs. megatron-core sets it (set_save_original_input) when offloading
    expert_fc1, and for moe_act recompute under FP8; TE 2.20 refuses it with the FP8
    delayed-scaling recipe."""

    def _params(self):
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []
        return weights, biases

    def _apply(self, fn, recurse=True):
        """TE's quantized parameters stay FP8 under module.bfloat16() (Float16Module)."""
        if not self.fp8_param:
            return super()._apply(fn, recurse)
        order = list(self._parameters)
        weights = {f"weight{i}": self._parameters.pop(f"weight{i}") for i in range(self.num_gemms)}
        try:
            return super()._apply(fn, recurse)
        finally:
            params = {**self._parameters, **weights}
            self._parameters.clear()
            self._parameters.update((name, params[name]) for name in order)

    def forward(self, x, m_splits):
        self.grad_enabled = torch.is_grad_enabled()  # (autograd's forward runs without grad)
        weights, biases = self._params()
        m_splits = [int(m) for m in m_splits]
        out = _GroupedLinearFunction.apply(x, m_splits, self, *weights, *biases)
        self.is_first_microbatch = False
        if self.te_return_bias:
            # TE 2.8 GroupedLinear.forward: [cast_if_needed(b, activation_dtype)], the
            # parameters themselves in bf16.
            return out, biases
        return out, None

    def finish_init(self, quant_config) -> None:
        """megatron-core calls this on every module after building (quantisation recipes)."""

    def backward_dw(self) -> None:
        """delay_wgrad_compute: the stored weight-gradient GEMMs run, their tensors are released
        (TE's GroupedLinear.backward_dw; metatrace.models.te_wgrad)."""
        te_wgrad.pop(self)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        """megatron-core's DDP hooks the module for parameters TE marked
        skip_backward_post_hook; backward_dw runs them."""
        te_wgrad.register_hook(self, hook)


class _ParallelGroupedLinear(TEGroupedLinear):
    """megatron-core's column / row wrappers: the parallel mode is the class's."""

    parallel_mode = "column"

    def __init__(
        self,
        num_gemms,
        input_size,
        output_size,
        *,
        config,
        init_method,
        bias,
        skip_bias_add,
        is_expert,
        tp_comm_buffer_name=None,
        pg_collection=None,
        name=None,
    ):
        super().__init__(
            num_gemms,
            input_size,
            output_size,
            parallel_mode=self.parallel_mode,
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            tp_comm_buffer_name=tp_comm_buffer_name,
            pg_collection=pg_collection,
        )


class TEColumnParallelGroupedLinear(_ParallelGroupedLinear):
    parallel_mode = "column"


class TERowParallelGroupedLinear(_ParallelGroupedLinear):
    parallel_mode = "row"
