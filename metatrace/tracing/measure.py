"""`metatrace measure`: check a prediction against real execution of one rank.

The rank's model and optimizer are built exactly as `trace_role` builds them (megatron-core's
GPTModel with the job's layer spec, DDP, megatron-core's optimizer) inside the same fake world,
where only rank R exists and collectives complete without moving data (their buffers are still
allocated), but on real tensors. Then real training iterations run under megatron-core's own
schedule (metatrace.tracing.iteration with `real_steps`) on random token ids; the tensors a rank would
receive from its pipeline neighbours are the buffers P2PCommunicator allocates, left as they are.
On the CPU the batch broadcast is made local and dropout allocates as CUDA's kernels do
(hooks/training.py).

Two instruments, both independent of metatrace's recorder:
- the peak: on the CPU, the PyTorch profiler's allocation events (profile_memory=True), every
  CPU allocation and free with its exact size, from before the model is built to the end; the
  running sum's maximum in the steady-state iterations (the second and later) is the peak. On a
  GPU, torch.cuda.max_memory_allocated() after a reset at the start of the second iteration,
  less what the process held before the model was built (earlier work's leftovers);
- the saved activations: `torch.autograd.graph.saved_tensors_hooks` around one micro-batch's
  forward, counting each storage once (untyped storage data_ptr, nbytes), storages that existed
  before the micro-batch (parameters) left out.

Known limitations: the GPU path is not exercised by the tests (they run without a GPU); received
pipeline tensors hold whatever the allocator returned (memory does not depend on values).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass

from metatrace.errors import ConfigError

BLOCK = 512  # the CUDA caching allocator's block; the prediction counts in these


@dataclass(frozen=True)
class Measured:
    """What a real run of one rank allocated (bytes)."""

    peak: int
    """Highest bytes allocated at once in the steady-state iterations (exact sizes)."""
    peak_blocks: int
    """The same with every allocation rounded up to 512 bytes, as the CUDA caching allocator
    rounds it (equal to `peak` on a GPU, where the allocator already did)."""
    saved: int
    """Bytes of the storages one micro-batch's forward saves for backward."""
    saved_blocks: int
    """The same, each storage rounded up to 512 bytes (as the prediction counts them)."""
    device: str
    model: int
    """Live once the model and DDP exist (parameters, DDP's buffers), in blocks on the CPU."""
    steady: int
    """Live when the measured iteration starts: the model, the optimizer's state, what earlier
    steps kept (workspaces, buffers megatron-core reuses)."""
    seconds: float | None = None
    """On a GPU: wall seconds of an iteration after the first (the median), from one
    synchronisation to the next; the fake world's collectives move nothing. None on the CPU."""
    reserved: int | None = None
    """On a GPU: torch.cuda.max_memory_reserved(), the caching allocator's segments at their
    most (it never gives them back unless emptied, so this covers the whole run). None on the
    CPU."""
    device_used: int | None = None
    """On a GPU: what the device held at the end (torch.cuda.mem_get_info: total - free), the
    process's CUDA context, libraries and the allocator's reserve together. None on the CPU."""
    device_before: int | None = None
    """On a GPU: the same before the model was built (the context with nothing allocated yet,
    plus whatever else the device held)."""
    allocations: tuple = ()
    """On the CPU: every allocation and free of the run as (ns, bytes, address), a free
    negative, in time order (what an allocator simulation replays)."""


@dataclass(frozen=True)
class Predicted:
    peak: int
    saved: int
    cuda_only: int
    """Part of `peak` that only a GPU allocates: PyTorch's cuBLAS workspaces."""
    model: int
    """Parameters and gradient buffers (role_memory's params + grads)."""
    steady: int
    """Static memory and workspaces (cuBLAS included), what exists before the iteration."""
    reserved: int = 0
    """The simulated caching allocator's reserve (max_memory_reserved) under the job's
    settings (analysis.device)."""
    reserved_cpu: int = 0
    """The same without the cuBLAS workspaces, which a CPU run does not allocate."""
    device: int = 0
    """The reserve and the CUDA context and userbuffers: the device's use of a run in the
    fake world, where no NCCL communicator exists."""
    allocator: object = None
    """The job's metatrace.config.allocator.AllocatorConfig."""


def allocation_running(events, block: int = 1) -> list[tuple[int, int]]:
    """(ns, bytes live after it) for `events` ((ns, bytes, ptr), a free negative) in time
    order, the sum started at the first event. With `block`, each allocation counts rounded
    up to a multiple of it (its free the same amount). A free of memory allocated before the
    log started is not the run's: the garbage collector freeing an earlier model in the same
    process would otherwise lower the sum by that model's size."""
    live, out, sizes = 0, [], {}
    for ns, nbytes, ptr in sorted(events, key=lambda e: e[0]):
        if nbytes > 0:
            nbytes = -(-nbytes // block) * block
            sizes[ptr] = nbytes
        elif ptr in sizes:
            nbytes = -sizes.pop(ptr)
        else:
            continue
        live += nbytes
        out.append((ns, live))
    return out


def allocation_peak(events, since_ns: int, block: int = 1) -> int:
    """Highest running sum of `events` (see allocation_running) at or after `since_ns`."""
    return max(
        (live for ns, live in allocation_running(events, block) if ns >= since_ns), default=0
    )


def live_at(running: list[tuple[int, int]], ns: int) -> int:
    """Bytes live just before time `ns`."""
    import bisect

    i = bisect.bisect_left(running, (ns, -1))
    return running[i - 1][1] if i else 0


def _profiler_log(prof, prefix: str) -> tuple[list, dict[str, list[int]]]:
    """The profiler's CPU allocation events as (ns, bytes, ptr) and the start times of the
    record_function ranges whose names start with `prefix`, by name. Three kinds of allocation
    are not the device's and left out with the frees that end them: what a stand-in allocates
    while it computes a kernel's values by the PyTorch reference (inside REFERENCE_RANGE,
    models/ssm_reference.py), host tensors (inside HOST_RANGE, `host_allocations`), and what a
    GEMM allocates and frees inside its own call (`_scratch`, GEMMS)."""
    from metatrace.models.ssm_reference import REFERENCE_RANGE

    events, marks, reference = [], {}, set()
    stack = [(node, False) for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, inside = stack.pop()
        inside = inside or node.name in (REFERENCE_RANGE, HOST_RANGE)
        stack.extend((child, inside) for child in node.children)
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
                if inside and fields.alloc_size > 0:
                    reference.add((node.start_time_ns, fields.ptr))
        elif node.name in GEMMS:
            reference |= _scratch(node)
        elif node.name.startswith(prefix):
            marks.setdefault(node.name, []).append(node.start_time_ns)
    return _without(events, reference), {name: sorted(times) for name, times in marks.items()}


GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
"""CPU GEMM operators whose own scratch (oneDNN's packed operands, a bf16 GEMM's fp32
accumulator) stands for what cuBLAS does in its workspace, which the prediction counts apart
(a CUDA-only buffer, left out of a CPU comparison)."""


def _scratch(node) -> set:
    """(ns, ptr) of the allocations made and freed inside `node` (a GEMM operator's call): its
    scratch. Its output, allocated inside and freed after, is not."""
    made, found = {}, set()
    stack = list(node.children)
    log = []
    while stack:
        child = stack.pop()
        stack.extend(child.children)
        fields = child.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            log.append((child.start_time_ns, fields.alloc_size, fields.ptr))
    for ns, size, ptr in sorted(log):
        if size > 0:
            made[ptr] = ns
        elif ptr in made:
            found.add((made.pop(ptr), ptr))
    return found


def _without(events: list, allocations: set) -> list:
    """`events` without the allocations `allocations` ((ns, ptr)) and the frees that end them."""
    if not allocations:
        return events
    out, pending = [], set()
    for ns, size, ptr in sorted(events, key=lambda e: e[0]):
        if size > 0 and (ns, ptr) in allocations:
            pending.add(ptr)
        elif size < 0 and ptr in pending:
            pending.discard(ptr)
        else:
            out.append((ns, size, ptr))
    return out


def random_batches(job, count: int) -> list[dict]:
    """`count` host-side batches as Megatron's GPTDataset yields them, with random token ids."""
    import torch

    from metatrace.tracing.steps import synthetic_batches

    tr = job.training
    template = synthetic_batches(
        micro_batch_size=tr.micro_batch_size,
        seq_length=tr.seq_length,
        attention_mask=tr.create_attention_mask_in_dataloader,
    )
    out = []
    for _ in range(count):
        batch = dict(next(template))
        shape = batch["tokens"].shape
        batch["tokens"] = torch.randint(job.model.vocab_size, shape)
        batch["labels"] = torch.randint(job.model.vocab_size, shape)
        out.append(batch)
    return out


class _Probe:
    """What run_microbatch / run_iteration tell a recorder, kept to the step phase only;
    `on_backward` runs when the first backward step starts."""

    def __init__(self, on_backward=None):
        self.phase = "forward"
        self.on_backward = on_backward

    def set_step_phase(self, phase: str) -> None:
        if phase == "backward" and self.phase != "backward" and self.on_backward:
            self.on_backward()
        self.phase = phase

    @contextlib.contextmanager
    def window(self, *args):
        yield {}

    label = window


# Factory functions that make a host tensor when called without a device, on a GPU too.
_FACTORIES = ("tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "rand", "randn")


HOST_RANGE = "metatrace.host"
"""The profiler range around a call that makes a host tensor (`_host_tensors`)."""


def _host_tensors():
    """A mode (enter it inside remap_cuda, so it sees calls before they are remapped) for the
    tensors made by factory functions called without a device: host tensors on a GPU as well
    (megatron-core's fused softmax saves `torch.tensor([scale])`, 4 bytes a layer), which a CPU
    run cannot otherwise tell from device tensors. It keeps weak references to them (an address
    freed and reused by a device tensor must not pass for a host one) and makes them inside
    HOST_RANGE, which `_profiler_log` leaves out of the peak."""
    import weakref

    import torch
    from torch.overrides import TorchFunctionMode
    from torch.profiler import record_function

    factories = {getattr(torch, name) for name in _FACTORIES}

    class HostTensors(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.made: list = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func not in factories or (kwargs or {}).get("device") is not None:
                return func(*args, **(kwargs or {}))
            with record_function(HOST_RANGE):
                out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.made.append(weakref.ref(out))
            return out

        def ptrs(self) -> set[int]:
            alive = (ref() for ref in self.made)
            return {t.untyped_storage().data_ptr() for t in alive if t is not None}

    return HostTensors()


@contextlib.contextmanager
def host_allocations():
    """While active (the training iterations of a CPU run; enter it inside remap_cuda), calls
    that make host tensors on a GPU run inside HOST_RANGE, which `_profiler_log` leaves out of
    the peak: factory functions called without a device (`_host_tensors`) and
    `torch.get_rng_state()`, the CPU generator's 5,056-byte state each checkpointed layer keeps
    until its backward (megatron-core's CheckpointFunction). On a GPU they are host memory, not
    the device's."""
    import torch
    from torch.profiler import record_function

    get_rng_state = torch.get_rng_state

    def host_rng_state():
        with record_function(HOST_RANGE):
            return get_rng_state()

    torch.get_rng_state = host_rng_state
    try:
        with _host_tensors():
            yield
    finally:
        torch.get_rng_state = get_rng_state


class _Held:
    """What the pack hook returns: autograd keeps it as long as it keeps the saved tensor."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor):
        self.tensor = tensor


@contextlib.contextmanager
def counting_saved(probe: _Probe, existing: _Existing):
    """{data_ptr: nbytes} of the device storages the micro-batch's forward saved for backward
    and that autograd still holds when the first backward step starts (a save whose graph is
    dropped before, e.g. bias-dropout-add's inside a checkpointed layer, is not held; counted
    while alive, no two storages share an address). Recomputation in backward saves again: not
    activations a micro-batch holds."""
    import weakref

    import torch

    from metatrace.hooks.recorder import SavedIdentity

    saved: dict[int, int] = {}
    held: list = []
    host = _host_tensors()
    identity = SavedIdentity()  # megatron-core's attributes on saved weights kept in backward

    def count():
        skip = existing.ptrs() | host.ptrs()
        for ref in held:
            h = ref()
            if h is None or h.tensor.device.type == "meta":
                continue
            storage = h.tensor.untyped_storage()
            if storage.data_ptr() not in skip:
                saved[storage.data_ptr()] = storage.nbytes()

    def pack(t):
        identity.note(t)
        if probe.phase != "forward":
            return t
        h = _Held(t)
        held.append(weakref.ref(h))
        return h

    def unpack(h):
        return h.tensor if isinstance(h, _Held) else h

    probe.on_backward = count
    with host, identity, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield saved


@contextlib.contextmanager
def saved_identity():
    """Saved tensors keep their Python identity in backward, as in a trace (the recorder's
    SavedIdentity) and the counted micro-batch: where a stand-in installs saved-tensor hooks of
    its own (Transformer Engine's layer-wise offloading, metatrace.models.te_cpu_offload, which
    calls the pair beneath it as TE does), autograd would hand megatron-core's linear layers a
    new tensor object for each saved weight, without the `grad_added_to_main_grad` and
    `main_grad` they read (and DDP then finds no gradient)."""
    import torch

    from metatrace.hooks.recorder import SavedIdentity

    identity = SavedIdentity()

    def pack(t):
        identity.note(t)
        return t

    with identity, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _storage_ptr(tensor) -> int:
    # A DTensor (Megatron-FSDP's parameters) has no storage of its own: its local tensor's.
    return getattr(tensor, "_local_tensor", tensor).untyped_storage().data_ptr()


class _Existing:
    """The device storages alive before the counted micro-batch, by the tensors that hold them.

    An address counts as existing only while the tensor that had it is alive and still there:
    an address freed since (a temporary the garbage collector still listed) may be reused by
    an activation the micro-batch saves, which must be counted (the allocator's choice of
    address decided it otherwise, and differed between machines)."""

    def __init__(self, model):
        import weakref

        import torch

        params = [p for chunk in model for p in chunk.parameters()]
        self._held = [(weakref.ref(p), _storage_ptr(p)) for p in params]
        for o in gc.get_objects():
            # see trace._live_tensors; a tensor without a storage to read holds none
            if issubclass(type(o), torch.Tensor) and o.device.type != "meta":
                with contextlib.suppress(RuntimeError):
                    self._held.append((weakref.ref(o), _storage_ptr(o)))

    def ptrs(self) -> set[int]:
        ptrs = set()
        for ref, ptr in self._held:
            t = ref()
            with contextlib.suppress(RuntimeError):
                if t is not None and _storage_ptr(t) == ptr:
                    ptrs.add(ptr)
        return ptrs


def measure_rank(job, rank: int, *, iterations: int = 3, device: str = "cpu") -> Measured:
    """Build global `rank`'s model and optimizer for real on `device` and run one micro-batch
    (saved activations counted) and `iterations` training iterations (peak measured).

    The order: the profiler starts before the model is built, so every byte the run holds is
    an allocation it saw (nothing is assumed about what lives before); the counted micro-batch
    runs under DDP's no_sync, as the traced one does; iterations after the first are the steady
    state the prediction describes."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from metatrace.hooks.fake_world import fake_world
    from metatrace.hooks.offload import reset_manager as reset_offload_manager
    from metatrace.hooks.patches import megatron_patches
    from metatrace.hooks.remap import remap_cuda
    from metatrace.hooks.training import (
        cuda_like_dropout,
        cuda_like_mixed_adds,
        local_broadcasts,
    )
    from metatrace.models.build import (
        build_model_chunks,
        build_optimizer,
        transformer_config,
        wrap_ddp,
    )
    from metatrace.models.te_runtime import te_process
    from metatrace.tracing.fsdp import gathered_once
    from metatrace.tracing.iteration import run_iteration
    from metatrace.tracing.trace import run_microbatch
    from metatrace.world import World

    world = World.from_job(job)
    te = job.implementation.transformer_impl == "transformer_engine"
    cuda = device == "cuda"
    pool = random_batches(job, job.num_microbatches)  # host memory, made before anything counts
    marker = "metatrace.tracing.measure."
    allocated = {}  # on a GPU: torch.cuda.memory_allocated() at the marks
    remap = contextlib.nullcontext() if cuda else remap_cuda(device)
    profiler = (
        contextlib.nullcontext()
        if cuda
        else profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    )
    dropout = contextlib.nullcontext() if cuda else cuda_like_dropout()
    adds = contextlib.nullcontext() if cuda else cuda_like_mixed_adds()
    patches = megatron_patches(
        compiled=job.implementation.torch_compile, optimizer=job.training.optimizer_impl
    )
    base = 0  # on a GPU: what earlier work in this process still holds, not the rank's
    if cuda:
        gc.collect()
        torch.cuda.synchronize()
        # cuBLAS workspaces are the process's, made at its first GEMM: free them so that the
        # rank makes its own, as a training process does.
        torch._C._cuda_clearCublasWorkspaces()
        base = torch.cuda.memory_allocated()
        free, total = torch.cuda.mem_get_info()
        device_before = total - free
    with (
        profiler as prof,
        patches,
        remap,
        fake_world(world.layout, rank, nvlink_domain=world.nvlink_domain),
        te_process(te),
        local_broadcasts(),
        dropout,
        adds,
    ):
        config = transformer_config(job)
        model = wrap_ddp(job, config, build_model_chunks(job=job, config=config, device=device))
        with record_function(marker + "model"):  # parameters and DDP's buffers exist
            if cuda:
                allocated["model"] = torch.cuda.memory_allocated()
        optimizer = build_optimizer(job, model)
        gathered_once(model)
        probe = _Probe()
        with contextlib.ExitStack() as stack:
            saved = stack.enter_context(counting_saved(probe, _Existing(model)))
            for chunk in model:
                stack.enter_context(chunk.no_sync())
            run_microbatch(job, config, model, rec=probe)
        saved_bytes = sum(saved.values())
        saved_blocks = sum(-(-n // BLOCK) * BLOCK for n in saved.values())
        # With activation offloading the counted micro-batch was the offload manager's first:
        # training starts with a fresh one (its first iteration learns the group order).
        reset_offload_manager()
        took = []
        for i in range(iterations):
            if cuda:
                torch.cuda.synchronize()
                if i == min(1, iterations - 1):
                    torch.cuda.reset_peak_memory_stats()
                    allocated["steady"] = torch.cuda.memory_allocated()
                took.append(-time.perf_counter())
            with (
                record_function(marker + "iteration"),
                saved_identity(),
                contextlib.nullcontext() if cuda else host_allocations(),
            ):
                run_iteration(
                    job,
                    config,
                    model,
                    optimizer,
                    rec=_Probe(),
                    device=torch.device(device),
                    real_steps=True,
                    batches=lambda: _cycle(pool),
                )
            if cuda:
                torch.cuda.synchronize()
                took[-1] += time.perf_counter()
        del model, optimizer
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return Measured(
            peak=peak,
            peak_blocks=peak,
            saved=saved_bytes,
            saved_blocks=saved_blocks,
            device=device,
            model=allocated["model"] - base,
            steady=allocated["steady"] - base,
            seconds=statistics.median(took[1:] or took),
            reserved=torch.cuda.max_memory_reserved(),
            device_used=total - free,
            device_before=device_before,
        )
    events, marks = _profiler_log(prof, marker)
    iterations_at = marks[marker + "iteration"]
    since = iterations_at[min(1, len(iterations_at) - 1)]
    running = allocation_running(events, BLOCK)
    return Measured(
        peak=allocation_peak(events, since),
        peak_blocks=max(live for ns, live in running if ns >= since),
        saved=saved_bytes,
        saved_blocks=saved_blocks,
        device=device,
        model=live_at(running, marks[marker + "model"][0]),
        steady=live_at(running, since),
        allocations=tuple(sorted(events)),
    )


def _cycle(pool):
    while True:
        yield from pool


def predict(job, rank: int) -> Predicted:
    """metatrace's prediction for global `rank` (traced on meta, as `metatrace run` does)."""
    from metatrace.tracing.trace import trace_role
    from metatrace.world import World

    world = World.from_job(job)
    role = next(r for r in world.roles() if rank in r.ranks)
    return predicted(job, trace_role(job, world, role, rank=rank))


def predicted(job, rt) -> Predicted:
    """The prediction from a traced role (a RoleTrace with its iteration)."""
    from metatrace.analysis import aggregate as agg
    from metatrace.analysis.device import context_bytes, role_device_memory
    from metatrace.analysis.memory import lifetimes, role_memory
    from metatrace.config.allocator import parse_alloc_conf

    # The cuBLAS workspaces (one per thread that ran a GEMM: forward, and the autograd
    # engine's in backward), by their storages: a global memory buffer can have their size.
    life = lifetimes(rt.trace.memory)
    cublas = sum(life.bytes[sid] for sid in rt.trace.workspaces)
    memory = role_memory(rt.trace, rt.iteration)
    config = parse_alloc_conf(job.cluster.allocator_conf or "")
    device = role_device_memory(job, rt, memory.peak)
    return Predicted(
        peak=memory.peak,
        saved=agg.role_summary(rt.trace).activation_bytes,
        cuda_only=cublas,
        model=memory.params + memory.grads,
        steady=memory.static,
        reserved=device.reserve.reserved,
        reserved_cpu=_reserve_cpu(job, rt, config).reserved,
        device=device.reserve.reserved + context_bytes(job) + device.userbuffers,
        allocator=config,
    )


def check_request(job, rank: int, device: str) -> None:
    """Refuse what cannot be measured, before anything is built (ConfigError: exit 2)."""
    import importlib.util

    import torch

    from metatrace.world import World

    size = World.from_job(job).size
    if not 0 <= rank < size:
        raise ConfigError(f"--rank {rank} is outside the world of {size} GPUs (0 to {size - 1})")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda needs a GPU and none is visible here; use --device cpu")
    te = job.implementation.transformer_impl == "transformer_engine"
    if te and (device == "cpu" or importlib.util.find_spec("transformer_engine") is None):
        raise ConfigError(
            "the Transformer Engine layer spec cannot run for real "
            + ("on the CPU" if device == "cpu" else "without transformer_engine installed")
            + "; measure the local spec instead (implementation.transformer_impl: local)"
        )
    if job.model.num_experts and job.parallel.moe_token_dispatcher_type == "flex":
        raise ConfigError(
            "the flex dispatcher (DeepEP, HybridEP) cannot run for real in a world of one rank: "
            "its kernels exchange tokens through buffers shared with the other ranks; measure "
            "parallel.moe_token_dispatcher_type alltoall or allgather instead"
        )


def check_fits(predicted: Predicted, device: str) -> None:
    """Refuse a run the machine cannot hold: the prediction (CUDA-only workspaces aside on the
    CPU) against the memory available now."""
    import torch

    need = predicted.peak - (predicted.cuda_only if device == "cpu" else 0)
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0]
    else:
        free = _available_host_memory()
    if free is not None and need > free:
        raise ConfigError(
            f"the rank is predicted to need {need / 2**30:.2f} GiB and this machine has "
            f"{free / 2**30:.2f} GiB available; measure a smaller model"
        )


def _available_host_memory() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return None


def build_comparison(predicted: Predicted, measured: Measured, rank: int):
    """rich Table: predicted against measured, the difference in bytes and percent."""
    from rich import box
    from rich.table import Table

    cpu = measured.device == "cpu"
    peak = predicted.peak - (predicted.cuda_only if cpu else 0)
    table = Table(
        title=f"rank {rank}: predicted against measured on {measured.device}", box=box.SIMPLE_HEAD
    )
    for name in ("", "predicted", "measured", "difference", "%"):
        table.add_column(name, justify="left" if not name else "right")
    steady = predicted.steady - (predicted.cuda_only if cpu else 0)
    rows = [
        ("peak" + (" (cuBLAS workspaces aside)" if cpu else ""), peak, measured.peak_blocks),
        ("  parameters, gradient buffers", predicted.model, measured.model),
        (
            "  optimizer state, workspaces",
            steady - predicted.model,
            measured.steady - measured.model,
        ),
        (
            "  the iteration's own at the peak",
            peak - steady,
            measured.peak_blocks - measured.steady,
        ),
        ("saved activations / micro-batch", predicted.saved, measured.saved_blocks),
    ]
    if measured.reserved is not None:  # a GPU: the allocator's own reserve and the device's use
        rows += [
            ("allocator reserve (max_memory_reserved)", predicted.reserved, measured.reserved),
            ("device use (mem_get_info; no NCCL here)", predicted.device, measured.device_used),
        ]
    elif measured.allocations and predicted.allocator is not None:
        rows.append(
            (
                "allocator reserve, simulated over each side's allocations",
                predicted.reserved_cpu,
                measured_reserve(measured, predicted.allocator).reserved,
            )
        )
    for label, p, m in rows:
        diff = p - m
        pct = f"{100 * diff / m:+.2f}" if m else "-"
        table.add_row(label, f"{p:,}", f"{m:,}", f"{diff:+,}", pct)
    if cpu:
        table.caption = (
            f"bytes; measured in 512-byte blocks as the CUDA allocator counts (exact peak "
            f"{measured.peak:,}); the GPU prediction {predicted.peak:,} includes "
            f"{predicted.cuda_only:,} of cuBLAS workspaces a CPU run does not allocate"
        )
    return table


def reserves(job, rt, measured: Measured, config) -> tuple:
    """The simulated allocator's reserve (analysis.device.Reserve) over metatrace's allocations
    of the traced role `rt` and over the allocations a CPU `measured` run made, under the
    allocator settings `config`: the check of the allocations metatrace feeds the simulation
    against megatron-core's own, without a GPU. The cuBLAS workspaces, which a CPU run does
    not allocate, are left out of the prediction's."""
    return _reserve_cpu(job, rt, config), measured_reserve(measured, config)


def measured_reserve(measured: Measured, config):
    """The simulated allocator's Reserve over a CPU run's own allocations."""
    from metatrace.analysis.device import FREE, simulate

    return simulate([(n if n > 0 else FREE, ptr) for _, n, ptr in measured.allocations], config)


def _reserve_cpu(job, rt, config):
    """The simulated allocator's Reserve over the role's allocations without the cuBLAS
    workspaces (what a CPU run allocates)."""
    from metatrace.analysis.device import role_allocations, simulate

    workspaces = {("micro", sid) for sid in rt.trace.workspaces}
    return simulate([e for e in role_allocations(job, rt) if e[1] not in workspaces], config)
