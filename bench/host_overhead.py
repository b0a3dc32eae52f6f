"""The host's cost per operator and per module, on this machine's CPU or on a GPU.

    python bench/host_overhead.py [--device cpu|cuda] [--only SUBSTRING] [--layers N]
                                  [--repeat N] [--json FILE]

What the time model's host constants (metatrace/config/host.py) come from. A GPU runs a
step no faster than the host issues its kernels; the host's work per kernel is PyTorch's
(Python binding, dispatcher, autograd recording, TensorIterator, the allocator) and
megatron-core's Python around the operators. Run on tiny tensors, whose kernels take next to
nothing, the wall time is the host's work.

1. Operators: a loop of small ATen operators on 8 x 8 tensors that require gradients (what a
   forward records), and views, timed per call (one thread, the median of several rounds).
2. Modules: the local-spec layers of bench/step_time.py's cases (GPT, Llama-like, 8 local
   experts) built by megatron-core with tiny sizes (hidden 64, sequence 64, the cases'
   structure and layer count cut to --layers), one micro-batch's forward and backward through
   megatron-core's schedule, timed per step (the median of --repeat). A counting pass counts
   the operators each step dispatches, the kernels they launch (config.host.kernels_of), the
   modules its forward calls and the torch functions the CUDA-to-CPU remapping intercepts
   (metatrace.hooks.remap, on the CPU; its own cost per call is measured and taken out). Per
   module: the forward's time less its operators' and launches' (1.), over its module calls;
   per backward operator: the backward's time less its launches, over its operators (the
   autograd engine's work per node and megatron-core's Python in custom autograd functions
   included).

On the CPU (`--device cpu`, the default) the operators run CPU kernels on tiny tensors: the
CUDA runtime's own cost of a launch (cudaLaunchKernel) and PyTorch's CUDA path (the device
guard, the caching allocator, the CUDA TensorIterator) are not there, and config/host.py takes
the launch from a published measurement. On a GPU (`--device cuda`) the same operators run on
CUDA tensors, and again on CPU tensors in the same process: the CPU's time is the operator's
host work on that machine's CPU, the difference the CUDA path's and the launch's, per kernel
(`launch`). Each operator's GPU time is measured too (the calls queued behind a sleeping kernel,
then run back to back, between two events): the host's time per call is a host cost only
where it is well above it (`host_bound`). The layers run on CUDA tensors (a synchronisation
before each step, none inside it). `--json` (default with --device cuda:
bench/data/GPU_host_overhead.json) stores the measurements and `constants`, the values of
config.host.HOST_SECONDS they give; bench/device_memory.py --device cuda runs the same
measurement.
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


def _ops(x, y) -> tuple[dict, dict]:
    import torch

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
    return ops, views


def _gpu_per_call(fn, calls: int, host_s: float) -> float:
    """The GPU's seconds per call of fn(): `calls` calls queued behind a sleeping kernel that
    outlasts their issue (fewer than the launch queue holds), then run back to back."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(max(1e7, 4 * calls * host_s * 2e9)))  # cycles, at most ~2 GHz
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def operators(device: str = "cpu") -> dict:
    """Seconds per call of small ATen operators (with autograd recording), of views, of the
    remapping mode's interception, and of Python's empty call. On a GPU: each operator's time
    on CUDA and on CPU tensors, their difference per launch, the GPU's own time per call, and
    the host's cost of a synchronisation (a value read back)."""
    import torch

    from metatrace.hooks.remap import remap_cuda

    empty = _per_call(lambda: None, 20000)

    def timed(on: str) -> tuple[dict, dict, dict]:
        x = torch.randn(8, 8, requires_grad=True, device=on)
        y = torch.randn(8, 8, requires_grad=True, device=on)
        ops, views = _ops(x, y)
        for fn in (*ops.values(), *views.values()):  # the first calls' caches, CUDA's set-up
            for _ in range(50):
                fn()
        if on == "cuda":
            torch.cuda.synchronize()
        per_op = {name: _per_call(fn, 5000) - empty for name, fn in ops.items()}
        per_view = {name: _per_call(fn, 5000) - empty for name, fn in views.items()}
        if on == "cuda":
            torch.cuda.synchronize()
        return per_op, per_view, ops

    per_op, per_view, ops = timed(device)
    out = {
        "op_s": statistics.median(per_op.values()),
        "view_s": statistics.median(per_view.values()),
        "ops": per_op,
        "views": per_view,
    }
    if device == "cpu":
        x = torch.randn(8, 8)
        plain = _per_call(lambda: x.dim(), 20000)
        with remap_cuda("cpu"):
            remapped = _per_call(lambda: x.dim(), 20000)
        out["remap_s"] = remapped - plain
        out["launch_s"] = 0.0
        out["cpu_op_s"] = out["op_s"]
        return out
    cpu_op, _, _ = timed("cpu")
    gpu = {name: _gpu_per_call(fn, 500, per_op[name]) for name, fn in ops.items()}
    x = torch.ones(8, device="cuda")
    read = _per_call(lambda: x.sum().item(), 2000) - empty
    out.update(
        remap_s=0.0,
        cpu_ops=cpu_op,
        cpu_op_s=statistics.median(cpu_op.values()),
        launch_s=statistics.median(per_op[k] - cpu_op[k] for k in per_op),
        gpu_ops=gpu,
        host_bound={k: per_op[k] > 1.5 * gpu[k] for k in per_op},
        sync_s=read - per_op["sum"],
    )
    return out


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

    from metatrace.config.host import kernels_of

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts.count("views" if func.is_view else "ops")
            if func.namespace == "aten":
                counts.count(
                    "kernels", kernels_of(func._overloadpacket.__name__, view=func.is_view)
                )
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

    def __init__(self, counts: _Counts | None = None, cuda: bool = False):
        self.times: dict[str, list[float]] = {}
        self.counts = counts
        self.phase = "forward"
        self.cuda = cuda

    def set_step_phase(self, phase):
        self.phase = phase

    @contextlib.contextmanager
    def window(self, phase, *args):
        if self.counts is not None:
            self.counts.step = phase
        if self.cuda:  # the GPU's queue empty: the step's time is its issue
            import torch

            torch.cuda.synchronize()
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


def steps(job, repeat: int, device: str = "cpu") -> dict:
    """Per step kind (forward, backward, grad sync, optimizer): the median seconds, and the
    counts of one iteration (one micro-batch), on `device`'s tensors."""
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
    cuda = device == "cuda"
    with (
        megatron_patches(compiled=False, optimizer=job.training.optimizer_impl),
        contextlib.nullcontext() if cuda else remap_cuda("cpu"),
        fake_world(world.layout, 0),
        local_broadcasts(),
        contextlib.nullcontext() if cuda else cuda_like_dropout(),
    ):
        config = transformer_config(job)
        model = wrap_ddp(job, config, build_model_chunks(job=job, config=config, device=device))
        optimizer = build_optimizer(job, model)

        def iteration(rec):
            run_iteration(
                job,
                config,
                model,
                optimizer,
                rec=rec,
                device=torch.device(device),
                real_steps=True,
                batches=lambda: _cycle(pool),
            )

        iteration(_Probe(cuda=cuda))  # warm-up: the optimizer's state, the first calls' caches
        timed = _Probe(cuda=cuda)
        for _ in range(repeat):
            iteration(timed)
        counts = _Counts()
        Dispatch, Functions, pre = _modes(counts)
        handle = torch.nn.modules.module.register_module_forward_pre_hook(pre)
        try:
            # Functions inside remap_cuda's mode, as run_iteration's calls reach it first.
            with Functions(), Dispatch():
                iteration(_Probe(counts, cuda=cuda))
        finally:
            handle.remove()
    return {
        phase: {
            "seconds": statistics.median(ts[-repeat:]) if len(ts) >= repeat else ts[-1],
            **counts.by_step.get(phase, {}),
        }
        for phase, ts in timed.times.items()
    }


CASES = ("gpt 1.3b, mbs 1", "llama-like h4096, s4096", "moe 8x top2, local experts")


def measure(device: str = "cpu", *, only: str = "", layers: int = 4, repeat: int = 9) -> dict:
    """The operators' and the cases' measurements, and the constants they give
    (config.host.HOST_SECONDS's keys), printed as they come."""
    ops = operators(device)
    line = (
        f"operator {ops['op_s'] * 1e6:.2f} us (median of {len(ops['ops'])}: "
        + ", ".join(f"{k} {v * 1e6:.2f}" for k, v in ops["ops"].items())
        + f"); view {ops['view_s'] * 1e6:.2f} us"
    )
    if device == "cuda":
        line += (
            f"; on CPU tensors {ops['cpu_op_s'] * 1e6:.2f} us, so a launch "
            f"{ops['launch_s'] * 1e6:.2f} us; the GPU's time per call "
            + ", ".join(f"{k} {v * 1e6:.2f}" for k, v in ops["gpu_ops"].items())
            + f" (host-bound: {sum(ops['host_bound'].values())} of {len(ops['host_bound'])}); "
            f"a value read back {ops['sync_s'] * 1e6:.1f} us"
        )
    else:
        line += f"; remapping {ops['remap_s'] * 1e6:.2f} us a call"
    print(line, flush=True)
    rows = []
    for name in CASES:
        if only not in name:
            continue
        job = tiny_job(name, layers)
        got = steps(job, repeat, device)
        fwd, bwd = got["forward"], got["backward"]
        own = fwd["seconds"] - fwd.get("functions", 0) * ops["remap_s"]
        ops_s = (
            fwd.get("ops", 0) * ops["cpu_op_s"]
            + fwd.get("views", 0) * ops["view_s"]
            + fwd.get("kernels", 0) * ops["launch_s"]
        )
        module = (own - ops_s) / max(1, fwd.get("modules", 0))
        bwd_own = bwd["seconds"] - bwd.get("functions", 0) * ops["remap_s"]
        bwd_own -= bwd.get("kernels", 0) * ops["launch_s"]
        per_bwd = bwd_own / max(1, bwd.get("ops", 0) + bwd.get("views", 0))
        row = {"case": name, "layers": job.model.num_layers, "steps": got}
        row.update(module_s=module, backward_op_s=per_bwd)
        rows.append(row)
        print(
            f"{name:30} forward {fwd['seconds'] * 1e3:7.2f} ms: {fwd.get('ops', 0)} operators, "
            f"{fwd.get('views', 0)} views, {fwd.get('kernels', 0)} kernels, "
            f"{fwd.get('modules', 0)} modules, {fwd.get('functions', 0)} remapped calls -> "
            f"{module * 1e6:.1f} us a module; backward {bwd['seconds'] * 1e3:7.2f} ms: "
            f"{bwd.get('ops', 0)} operators, {bwd.get('views', 0)} views, "
            f"{bwd.get('kernels', 0)} kernels -> {per_bwd * 1e6:.2f} us each",
            flush=True,
        )
    out = {"device": device, "operators": ops, "cases": rows}
    if rows:
        out["constants"] = {
            "operator": ops["cpu_op_s"],
            "view": ops["view_s"],
            "backward": statistics.median(r["backward_op_s"] for r in rows),
            "module": statistics.median(r["module_s"] for r in rows),
            "launch": ops["launch_s"] if device == "cuda" else None,
        }
        print(
            "constants (config.host.HOST_SECONDS): "
            + ", ".join(
                f"{k} {v * 1e6:.1f} us" if v is not None else f"{k} not measured on the CPU"
                for k, v in out["constants"].items()
            ),
            flush=True,
        )
    return out


def described(device: str) -> dict:
    """The machine measured: its CPU, GPU and software."""
    import platform

    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of each case")
    parser.add_argument("--repeat", type=int, default=9, help="timed iterations per case")
    parser.add_argument(
        "--json",
        help="write the measurements here (default with --device cuda: "
        "bench/data/GPU_host_overhead.json)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch

    torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU")
    result = {
        **described(args.device),
        **measure(args.device, only=args.only, layers=args.layers, repeat=args.repeat),
    }
    path = args.json
    if path is None and args.device == "cuda":
        from step_time import detected_gpu

        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(here, "data", f"{detected_gpu()}_host_overhead.json")
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
