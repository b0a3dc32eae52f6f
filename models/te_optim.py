"""Stand-ins for Transformer Engine's optimizers and multi-tensor kernels, which megatron-core's
optimizers use on a GPU (`megatron.core.optimizer` imports TE's FusedAdam, FusedSGD,
multi_tensor_applier, multi_tensor_l2norm and multi_tensor_scale; without TE or Apex it falls
back to torch.optim and to Python loops that allocate what the CUDA kernels do not).

What they allocate is what TE 2.8 allocates (transformer_engine/pytorch/optimizers/):
- FusedAdam keeps `exp_avg` and `exp_avg_sq` per parameter in `exp_avg_dtype` /
  `exp_avg_sq_dtype` (fp32 by default), a scale per non-fp32 state, and with `master_weights`
  a master copy in `master_weight_dtype` (int16 remainders with `store_param_remainders`).
  Its step updates everything in place with one kernel; states stored below fp32 are first
  unscaled into fp32 temporaries, all of a parameter group at once, and written back at the end.
- FusedSGD keeps a `momentum_buffer` per parameter when momentum is used.
- multi_tensor_l2norm returns a one-element fp32 norm (and per-tensor norms when asked);
  multi_tensor_scale writes dst = src * scale in place. Neither allocates per-tensor
  temporaries.
The arithmetic itself is not reproduced: on meta there are no values, and the updates are in
place, so they neither allocate nor free.
"""

from __future__ import annotations

import torch

from metatrace.config.host import MULTI_TENSOR_CHUNK, multi_tensor_launches
from metatrace.hooks import flops

_CHUNK = MULTI_TENSOR_CHUNK  # TE's multi_tensor_applier chunk size


def multi_tensor_applier(op, noop_flag_buffer, tensor_lists, *args):
    """TE's multi_tensor_applier: hands the lists to the kernel `op`."""
    return op(_CHUNK, noop_flag_buffer, tensor_lists, *args)


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """The L2 norm kernel: a one-element fp32 total, and one norm per tensor when `per_tensor`.
    It reads every tensor in the multi-tensor launches of one list and a cleanup kernel sums
    the blocks' partial norms (config.host.multi_tensor_launches)."""
    tensors = tensor_lists[0]
    device = tensors[0].device if tensors else noop_flag.device
    total = torch.zeros(1, dtype=torch.float32, device=device)
    per = torch.zeros(len(tensors) if per_tensor else 0, dtype=torch.float32, device=device)
    launches = multi_tensor_launches((t.numel() for t in tensors), 1, chunk_size)
    flops.report_moved(*tensors, launches=launches + 1)
    return total, per


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """dst = src * scale for every pair of tensors, in place: the multi-tensor launches of two
    lists (config.host.multi_tensor_launches), not a copy and a product per tensor."""
    with flops.uncounted():
        for src, dst in zip(tensor_lists[0], tensor_lists[1]):
            if dst is not src:
                dst.copy_(src)
            dst.mul_(scale)
    launches = multi_tensor_launches((t.numel() for t in tensor_lists[0]), 2, chunk_size)
    flops.report_moved(*tensor_lists[0], *tensor_lists[1], launches=launches)


def local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron.core.utils.local_multi_tensor_l2_norm (megatron-core's fallback without TE and
    Apex), its allocations without its read to the host: a 0-d norm per tensor, kept until the
    total is taken, then the one-element result made on the device from the host's value."""
    norms = [torch.norm(t) for tensors in tensor_lists for t in tensors]
    device = norms[0].device if norms else noop_flag.device
    torch.stack(norms).norm() if norms else None  # torch.norm(torch.tensor(l2)): on the host
    return torch.zeros(1, dtype=torch.float32, device=device), None


class FusedAdam(torch.optim.Optimizer):
    """transformer_engine.pytorch.optimizers.FusedAdam (TE 2.8): states and step allocations."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        *,
        bias_correction=True,
        adam_w_mode=True,
        capturable=False,
        master_weights=False,
        master_weight_dtype=torch.float32,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        use_decoupled_grad=False,
        store_param_remainders=False,
        set_grad_none=None,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.capturable = capturable
        self.master_weights = master_weights
        self.use_decoupled_grad = use_decoupled_grad
        self.name_to_dtype_map = {
            "exp_avg": exp_avg_dtype,
            "exp_avg_sq": exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }
        self.store_param_remainders = (
            store_param_remainders and master_weights and master_weight_dtype == torch.float32
        )
        self._scales: dict = {}
        self._dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device="cuda")

    def zero_grad(self, set_to_none=None):
        for group in self.param_groups:
            for p in group["params"]:
                if self.use_decoupled_grad:
                    p.decoupled_grad = None
                else:
                    p.grad = None

    def _initialize_state(self, param, name, zero_buffer, store_param_remainders=False):
        dtype = self.name_to_dtype_map[name]
        if store_param_remainders:
            data = torch.zeros_like(param, dtype=torch.int16)
        else:
            # FP8 (uint8) moments are Float8Tensors over one byte per element.
            data = torch.empty_like(param, dtype=dtype)
        if zero_buffer:
            data.zero_()
        self.state[param][name] = data
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[name] = torch.ones(
                [1], dtype=torch.float32, device=param.device
            )

    def initialize_state(self, param, store_param_remainders):
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(
                param,
                "master_param",
                zero_buffer=False,
                store_param_remainders=store_param_remainders,
            )
            if not store_param_remainders:
                self.state[param]["master_param"].copy_(param.detach())

    def _unscaled(self, param, name):
        """(the state's local tensor, its fp32 view): the state itself when fp32, else an fp32
        temporary. Megatron-FSDP's states are DTensors: their shard is what the kernel reads."""
        state = self.state[param][name]
        local = state.to_local() if hasattr(state, "to_local") else state
        if local.dtype in (torch.float32, torch.int16):
            return local, local
        return local, local.float()

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            temporaries = []  # fp32 copies of low-precision states, freed after the group
            for p in group["params"]:
                state = self.state[p]
                remainders = self.store_param_remainders and p.dtype == torch.bfloat16
                if len(state) == 0:
                    self.initialize_state(p, remainders)
                grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if grad is None:
                    continue
                for name in ("exp_avg", "exp_avg_sq", "master_param"):
                    if name in state:
                        local, unscaled = self._unscaled(p, name)
                        if unscaled is not local:
                            temporaries.append((local, unscaled))
            # multi_tensor_adam: every update in place, one multi-tensor call per parameter
            # dtype over [grads, params, exp_avgs, exp_avg_sqs] (and the master copies or their
            # remainders with master_weights: five lists).
            self._report_launches(group["params"])
            for scaled, unscaled in temporaries:  # _apply_scale writes the states back
                scaled.copy_(unscaled)
            del temporaries
        return loss

    def _report_launches(self, params) -> None:
        """The multi_tensor_adam launches of a group's step (config.host): TE's FusedAdam.step
        lists the parameters with a gradient by dtype and calls the kernel once per list."""
        by_dtype: dict = {}
        for p in params:
            grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
            if grad is not None:
                by_dtype.setdefault(p.dtype, []).append((p, grad))
        for dtype, pairs in by_dtype.items():
            depth = 5 if self.master_weights and dtype != torch.float32 else 4
            launches = multi_tensor_launches((p.numel() for p, _ in pairs), depth)
            tensors = [t for p, g in pairs for t in (p, g, *self.state[p].values())]
            flops.report_moved(*tensors, launches=launches)


class FusedSGD(torch.optim.Optimizer):
    """transformer_engine.pytorch.optimizers.FusedSGD: a momentum buffer per parameter."""

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0.0,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        wd_after_momentum=False,
        materialize_master_grads=True,
        set_grad_none=False,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(params, defaults)

    def initialize_state(self, param):
        """The momentum buffer the first step creates (a clone of the gradient)."""
        group = next(g for g in self.param_groups if any(p is param for p in g["params"]))
        if group["momentum"] and "momentum_buffer" not in self.state[param]:
            self.state[param]["momentum_buffer"] = torch.zeros_like(param)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or not group["momentum"]:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.clone(p.grad).detach()
        return loss
