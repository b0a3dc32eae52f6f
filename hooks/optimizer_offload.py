"""megatron-core's optimizer CPU offload (--optimizer-cpu-offload: HybridDeviceOptimizer) on meta.

What megatron-core 0.16.1 does (optimizer/cpu_offloading/hybrid_optimizer.py, with the
arguments get_megatron_optimizer passes: param_update_in_fp32, pinned host grads and params):
- the distributed optimizer hands it each rank's parameter shards (with the precision-aware
  optimizer, which Megatron-LM requires, the bf16 model shards themselves). Walking them in
  order, while fewer than `offload_fraction` x (elements on the GPU) have been offloaded, a shard
  gets a host copy; every non-fp32 shard then gets an fp32 copy (on the host for offloaded
  ones, on the GPU for the others). Offloaded shards are updated by torch's AdamW on the host
  (one optimizer per shard with overlap_cpu_optimizer_d2h_h2d), the rest by TE's FusedAdam on
  the GPU over the fp32 copies (fp32 moments: the precision-aware dtypes are not passed);
- its step gives each GPU fp32 copy `grad.to(fp32)` as gradient (the gradient itself when the
  main gradients are fp32, else a new fp32 tensor that stays until the next step), copies the
  offloaded shards' gradients into pinned host buffers (a non-blocking copy converts on the GPU
  first when the dtypes differ), steps the host optimizers, and copies each updated host fp32
  copy back into its GPU shard (converted on the host: the GPU dtype's bytes cross the link).

On meta `param.is_cuda` is False, so megatron-core would take every shard for a host one and
fail in its step. The split and the step are restated here with "on the traced device" for
is_cuda:
- a host copy is a meta tensor marked `metatrace_host`: created while the optimizer is built,
  never handed to a recorded operator, left out of the GPU's static tensors (models.build) and
  counted as host memory instead (`host_bytes`);
- the host optimizers' update is not run (host memory and host time, no GPU memory); the
  copies are not run either, their bytes are logged on the optimizer (`moved`);
- on CUDA tensors (`metatrace measure --device cuda`) megatron-core's own code runs. On the CPU
  (`metatrace measure --device cpu`) host and device cannot be told apart: refused there.

Not modelled: the host update's time (the time model counts the copies over the host link).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

_MOVED = "_metatrace_moved"


@dataclass(frozen=True)
class HostOptimizer:
    """What the hybrid optimizer keeps and moves on one rank (bytes)."""

    offloaded_numel: int
    """Elements of the parameter shards the host updates."""
    total_numel: int
    """Elements of all the rank's parameter shards."""
    host_bytes: int
    """Host memory: fp32 copies, Adam's moments and the pinned gradient buffers."""
    d2h_bytes: int
    """Gradients copied to the host in each optimizer step."""
    h2d_bytes: int
    """Updated parameters copied back in each optimizer step."""


def is_host(t) -> bool:
    return bool(getattr(t, "metatrace_host", False))


def host_tensor(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor without host memory: a `device` (meta) tensor marked as the host's."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.metatrace_host = True
    return t


def _traced(params) -> bool:
    """Whether the parameters are on the tracer's device (meta), not a real GPU or the CPU."""
    return any(p.device.type == "meta" for p in params)


def _params(hdo):
    return [p for group in hdo.param_groups for p in group["params"]]


def split(orig):
    """HybridDeviceOptimizer._get_sub_optimizer_param_groups, restated for meta (module doc)."""

    def _get_sub_optimizer_param_groups(self, offload_fraction: float):
        params = _params(self)
        if not _traced(params):
            return orig(self, offload_fraction)
        threshold = sum(p.numel() for p in params) * offload_fraction  # all on the GPU
        offloaded = 0
        cpu_groups, gpu_groups = [], []
        gpu_to_cpu, cpu_to_gpu, to_fp32 = {}, {}, {}
        for group in self.param_groups:
            gpu_group, cpu_group = {**group, "params": []}, {**group, "params": []}
            for orig_param in group["params"]:
                param, host = orig_param, offloaded < threshold
                if host:
                    param = host_tensor(param.shape, param.dtype, param.device)
                    offloaded += param.numel()
                if self.param_update_in_fp32 and param.dtype != torch.float32:
                    if host:
                        param = host_tensor(param.shape, torch.float32, param.device)
                    else:
                        param = param.detach().clone().float()
                    to_fp32[orig_param] = param
                if host:
                    gpu_to_cpu[orig_param] = param
                    cpu_to_gpu[param] = orig_param
                (cpu_group if host else gpu_group)["params"].append(param)
            if gpu_group["params"]:
                gpu_groups.append(gpu_group)
            if cpu_group["params"]:
                cpu_groups.append(cpu_group)
        return cpu_groups, gpu_groups, gpu_to_cpu, cpu_to_gpu, to_fp32

    return _get_sub_optimizer_param_groups


def step(orig):
    """HybridDeviceOptimizer.step, restated for meta (module doc)."""

    def _step(self, closure=None):
        if not _traced(_params(self)):
            return orig(self, closure)
        self._sync_hdo_param_groups_to_sub_optimizers()
        if self.param_update_in_fp32:
            for param, fp32_param in self.param_to_fp32_param.items():
                if param in self.gpu_params_map_cpu_copy:
                    continue
                grad = getattr(param, "decoupled_grad", param.grad)
                fp32_param.requires_grad = grad is not None
                if grad is not None:
                    fp32_param.grad = grad.to(fp32_param.dtype)
        d2h = h2d = 0
        for optimizer in self.cpu_optimizers:
            for group in optimizer.param_groups:
                for host in group["params"]:
                    gpu_param = self.cpu_copys_map_gpu_param[host]
                    grad = getattr(gpu_param, "decoupled_grad", gpu_param.grad)
                    if grad is None:
                        continue
                    if grad.dtype != host.dtype:
                        grad.to(host.dtype)  # the non-blocking copy converts on the GPU first
                    d2h += host.numel() * host.element_size()
                    h2d += gpu_param.numel() * gpu_param.element_size()
        if self.gpu_optimizer:
            self.gpu_optimizer.step(closure)
        # The host optimizers' update, and the copies back into the GPU shards (in place).
        setattr(self, _MOVED, (d2h, h2d))
        self._sync_sub_optimizers_state_to_hdo()

    return _step


def initialize_state(hdo, main_grads_dtype: torch.dtype) -> None:
    """The state every step after the first finds: the GPU optimizer's moments (TE's FusedAdam
    creates them in its first step), the host optimizers' (torch's AdamW: step, exp_avg,
    exp_avg_sq) and pinned gradient buffers, and the GPU fp32 copies' gradients the last step
    left when the main gradients are not fp32."""
    if hdo.gpu_optimizer is not None:
        for group in hdo.gpu_optimizer.param_groups:
            for p in group["params"]:
                hdo.gpu_optimizer.initialize_state(p, False)
                if main_grads_dtype != p.dtype:
                    p.grad = torch.empty_like(p)
    for optimizer in hdo.cpu_optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p] = {
                    "step": host_tensor((), torch.float32, p.device),
                    "exp_avg": host_tensor(p.shape, p.dtype, p.device),
                    "exp_avg_sq": host_tensor(p.shape, p.dtype, p.device),
                }
                hdo.cpu_copy_map_grad[p] = p.grad = host_tensor(p.shape, p.dtype, p.device)
    hdo._sync_sub_optimizers_state_to_hdo()


def host_optimizer(hdo) -> HostOptimizer:
    """What `hdo` (after a step) keeps on the host and moved."""
    params = _params(hdo)
    host = 0
    for optimizer in hdo.cpu_optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                # (the state holds `p` itself as master_param once synced to the hybrid's)
                tensors = [p, *optimizer.state[p].values(), hdo.cpu_copy_map_grad.get(p)]
                unique = {id(t): t for t in tensors if torch.is_tensor(t)}.values()
                host += sum(t.numel() * t.element_size() for t in unique)
    d2h, h2d = getattr(hdo, _MOVED, (0, 0))
    return HostOptimizer(
        offloaded_numel=sum(p.numel() for p in hdo.gpu_params_map_cpu_copy),
        total_numel=sum(p.numel() for p in params),
        host_bytes=host,
        d2h_bytes=d2h,
        h2d_bytes=h2d,
    )


def offload_record(optimizer) -> HostOptimizer | None:
    """host_optimizer summed over the HybridDeviceOptimizers inside megatron-core's (chained)
    optimizer (the dense and the expert parameters'); None without any."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    inner = [getattr(o, "optimizer", None) for o in chained]
    parts = [host_optimizer(o) for o in inner if isinstance(o, HybridDeviceOptimizer)]
    if not parts:
        return None
    return HostOptimizer(
        *(sum(getattr(p, f.name) for p in parts) for f in dataclasses.fields(HostOptimizer))
    )
