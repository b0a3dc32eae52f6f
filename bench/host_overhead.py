"""The host's cost per operator and per module, measured on this machine's CPU.

    python bench/host_overhead.py [--only SUBSTRING] [--layers N] [--repeat N] [--json FILE]

What the time model's host constants (metatrace/config/host.py) come from. A GPU runs a
step no faster than the host issues its kernels; the host's work per kernel is PyTorch's
(Python binding, dispatcher, autograd recording, TensorIterator, the allocator) and
megatron-core's Python around the operators. That code is the same on the CPU: run on tiny
tensors, whose kernels take next to nothing, the wall time is the host's work.

1. Operators: a loop of small ATen operators on 8 x 8 tensors that require gradients (what a
   forward records), and views, timed per call (one thread, the median of several rounds).
2. Modules: the local-spec layers of bench/step_time.py's cases (GPT, Llama-like, 8 local
   experts) built by megatron-core on the CPU with tiny sizes (hidden 64, sequence 64, the
   cases' structure and layer count cut to --layers), one micro-batch's forward and backward
   through megatron-core's schedule, timed per step (the median of --repeat). A counting pass
   counts the operators each step dispatches, the modules its forward calls and the torch
   functions the CUDA-to-CPU remapping intercepts (metatrace.hooks.remap; its own cost per call
   is measured and taken out). Per module: the forward's time less its operators' (1.), over its
   module calls; per backward operator: the backward's time over its operators (the autograd
   engine's work per node and megatron-core's Python in custom autograd functions included).

Not measurable here: the CUDA runtime's own cost of a launch (cudaLaunchKernel) and of the
caching allocator's bookkeeping, which a CPU run replaces with its own kernel on a tiny tensor
and the CPU allocator; config/host.py takes the launch cost from a published measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _per_call(fn, calls: int, rounds: int = 7) -> float:
    """Median over `rounds` of the seconds per call of fn() run `calls` times."""
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) / calls)
    return statistics.median(out)


def operators() -> dict:
    """Seconds per call of small ATen operators (with autograd recording), of views, of the
    remapping mode's interception, and of Python's empty call."""
    import torch

    from metatrace.hooks.remap import remap_cuda

    x = torch.randn(8, 8, requires_grad=True)
    y = torch.randn(8, 8, requires_grad=True)
    ops = {
        "add": lambda: x + y,
        "mul": lambda: x * 0.5,
        "mm": lambda: torch.mm(x, y),
        "gelu": lambda: torch.nn.functional.gelu(x),
        "softmax": lambda: torch.softmax(x, -1),
        "sum": lambda: x.sum(-1),
        "to bf16": lambda: x.to(torch.bfloat16),
        "layer_norm": lambda: torch.nn.functional.layer_norm(x, (8,)),
    }
    views = {
        "view": lambda: x.view(64),
        "transpose": lambda: x.transpose(0, 1),
        "unsqueeze": lambda: x.unsqueeze(0),
    }
    empty = _per_call(lambda: None, 20000)
    per_op = {name: _per_call(fn, 5000) - empty for name, fn in ops.items()}
    per_view = {name: _per_call(fn, 5000) - empty for name, fn in views.items()}
    plain = _per_call(lambda: x.dim(), 20000)
    with remap_cuda("cpu"):
        remapped = _per_call(lambda: x.dim(), 20000)
    return {
        "op_s": statistics.median(per_op.values()),
        "view_s": statistics.median(per_view.values()),
        "ops": per_op,
        "views": per_view,
        "remap_s": remapped - plain,
    }


class _Counts(contextlib.ContextDecorator):
    """Per step: dispatched operators (views apart), module calls, intercepted torch functions."""

    def __init__(self):
        self.by_step: dict[str, dict] = {}
        self.step = None

    def count(self, key: str, n: int = 1) -> None:
        if self.step is not None:
            d = self.by_step.setdefault(self.step, {})
            d[key] = d.get(key, 0) + n


def _modes(counts: _Counts):
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts.count("views" if func.is_view else "ops")
            return func(*args, **(kwargs or {}))

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            counts.count("functions")
            return func(*args, **(kwargs or {}))

    def pre(module, args):
        if torch._C._current_graph_task_id() == -1:
            counts.count("modules")

    return Dispatch, Functions, pre


class _Probe:
    """The recorder's interface to run_iteration: times (or counts) each step."""

    def __init__(self, counts: _Counts | None = None):
        self.times: dict[str, list[float]] = {}
        self.counts = counts
        self.phase = "forward"

    def set_step_phase(self, phase):
        self.phase = phase

    @contextlib.contextmanager
    def window(self, phase, *args):
        if self.counts is not None:
            self.counts.step = phase
        start = time.perf_counter()
        try:
            yield {}
        finally:
            self.times.setdefault(phase, []).append(time.perf_counter() - start)
            if self.counts is not None:
                self.counts.step = None

    label = window


def tiny_job(name: str, layers: int):
    import step_time

    from metatrace.config import job_from_dict, resolve

    data = step_time.job_dict(name, "h200")
    model = data["model"]
    model.update(hidden_size=64, num_attention_heads=4, vocab_size=512)
    model["num_layers"] = min(model["num_layers"], layers)
    model["max_position_embeddings"] = 64
    if "ffn_hidden_size" in model:
        model["ffn_hidden_size"] = 256
    if "moe_ffn_hidden_size" in model:
        model["moe_ffn_hidden_size"] = 128
    data["training"].update(seq_length=64, global_batch_size=data["training"]["micro_batch_size"])
    return resolve(job_from_dict(data))


def steps(job, repeat: int) -> dict:
    """Per step kind (forward, backward, grad sync, optimizer): the median seconds, and the
    counts of one iteration (one micro-batch)."""
    import torch

    from metatrace.hooks.fake_world import fake_world
    from metatrace.hooks.patches import megatron_patches
    from metatrace.hooks.remap import remap_cuda
    from metatrace.hooks.training import cuda_like_dropout, local_broadcasts
    from metatrace.models.build import (
        build_model_chunks,
        build_optimizer,
        transformer_config,
        wrap_ddp,
    )
    from metatrace.tracing.iteration import run_iteration
    from metatrace.tracing.measure import _cycle, random_batches
    from metatrace.world import World

    world = World.from_job(job)
    pool = random_batches(job, job.num_microbatches)
    with (
        megatron_patches(compiled=False, optimizer=job.training.optimizer_impl),
        remap_cuda("cpu"),
        fake_world(world.layout, 0),
        local_broadcasts(),
        cuda_like_dropout(),
    ):
        config = transformer_config(job)
        model = wrap_ddp(job, config, build_model_chunks(job=job, config=config, device="cpu"))
        optimizer = build_optimizer(job, model)

        def iteration(rec):
            run_iteration(
                job,
                config,
                model,
                optimizer,
                rec=rec,
                device=torch.device("cpu"),
                real_steps=True,
                batches=lambda: _cycle(pool),
            )

        iteration(_Probe())  # warm-up: the optimizer's state, the first calls' caches
        timed = _Probe()
        for _ in range(repeat):
            iteration(timed)
        counts = _Counts()
        Dispatch, Functions, pre = _modes(counts)
        handle = torch.nn.modules.module.register_module_forward_pre_hook(pre)
        try:
            # Functions inside remap_cuda's mode, as run_iteration's calls reach it first.
            with Functions(), Dispatch():
                iteration(_Probe(counts))
        finally:
            handle.remove()
    return {
        phase: {
            "seconds": statistics.median(ts[-repeat:]) if len(ts) >= repeat else ts[-1],
            **counts.by_step.get(phase, {}),
        }
        for phase, ts in timed.times.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of each case")
    parser.add_argument("--repeat", type=int, default=9, help="timed iterations per case")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch

    torch.set_num_threads(1)
    import step_time

    ops = operators()
    print(
        f"operator {ops['op_s'] * 1e6:.2f} us (median of {len(ops['ops'])}: "
        + ", ".join(f"{k} {v * 1e6:.2f}" for k, v in ops["ops"].items())
        + f"); view {ops['view_s'] * 1e6:.2f} us; remapping {ops['remap_s'] * 1e6:.2f} us a call"
    )
    rows = []
    for name in ("gpt 1.3b, mbs 1", "llama-like h4096, s4096", "moe 8x top2, local experts"):
        if args.only not in name:
            continue
        job = tiny_job(name, args.layers)
        got = steps(job, args.repeat)
        fwd, bwd = got["forward"], got["backward"]
        own = fwd["seconds"] - fwd.get("functions", 0) * ops["remap_s"]
        ops_s = fwd.get("ops", 0) * ops["op_s"] + fwd.get("views", 0) * ops["view_s"]
        module = (own - ops_s) / max(1, fwd.get("modules", 0))
        bwd_own = bwd["seconds"] - bwd.get("functions", 0) * ops["remap_s"]
        per_bwd = bwd_own / max(1, bwd.get("ops", 0) + bwd.get("views", 0))
        row = {"case": name, "layers": job.model.num_layers, "steps": got}
        row.update(module_s=module, backward_op_s=per_bwd)
        rows.append(row)
        print(
            f"{name:30} forward {fwd['seconds'] * 1e3:7.2f} ms: {fwd.get('ops', 0)} operators, "
            f"{fwd.get('views', 0)} views, {fwd.get('modules', 0)} modules, "
            f"{fwd.get('functions', 0)} remapped calls -> {module * 1e6:.1f} us a module; "
            f"backward {bwd['seconds'] * 1e3:7.2f} ms: {bwd.get('ops', 0)} operators, "
            f"{bwd.get('views', 0)} views -> {per_bwd * 1e6:.2f} us each"
        )
    if rows:
        print(
            f"module {statistics.median(r['module_s'] for r in rows) * 1e6:.1f} us, "
            f"backward operator {statistics.median(r['backward_op_s'] for r in rows) * 1e6:.2f} "
            "us (medians over the cases)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"operators": ops, "cases": rows}, f, indent=1)
    del step_time
    return 0


if __name__ == "__main__":
    sys.exit(main())
