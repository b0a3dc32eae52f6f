"""`metatrace measure`: the prediction against real execution of one rank on CPU tensors.

The peak is measured by the PyTorch profiler's allocation events and the saved activations by
saved_tensors_hooks, neither of them metatrace's recorder."""

import pytest
import torch
from rich.console import Console

from metatrace.cli import main
from metatrace.config.hardware import cublas_workspace_bytes
from metatrace.tracing.measure import (
    _Existing,
    _storage_ptr,
    allocation_peak,
    measure_rank,
    predict,
)
from tests.helpers import small_job

LOCAL = {"implementation": {"transformer_impl": "local"}}
CASES = {
    "tp1": ({}, 0),
    "tp2, rank 1": ({"parallel": {"tp": 2}}, 1),
    "pp2, first stage": ({"parallel": {"pp": 2}, "training": {"global_batch_size": 8}}, 0),
    "pp2, last stage": ({"parallel": {"pp": 2}, "training": {"global_batch_size": 8}}, 1),
    "full recompute": (
        {"training": {"recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}}},
        0,
    ),
    # With dropout: bias-dropout-add saves masks inside the checkpointed layers, which are not
    # held until backward (neither side may count them).
    "full recompute, dropout": (
        {
            "model": {"hidden_dropout": 0.1, "attention_dropout": 0.1},
            "training": {
                "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}
            },
        },
        0,
    ),
    # megatron-core's DDP asserts every weight's gradient under overlap_grad_reduce: the
    # counted micro-batch's saved-tensor hooks must keep the attributes its linear layers read
    # from the saved weight (grad_added_to_main_grad).
    "overlapped gradient reduce": (
        {
            "training": {
                "global_batch_size": 8,
                "distributed_optimizer": True,
                "overlap_grad_reduce": True,
            },
            "cluster": {"num_gpus": 2},
        },
        0,
    ),
    # Transformer Engine's layer-wise offloading (its stand-in's saved-tensor hooks) with
    # overlapped gradient reduce: the real iterations must keep the saved weights' attributes
    # (grad_added_to_main_grad), or DDP asserts a missing gradient.
    "layer-wise offloading, overlapped gradient reduce": (
        {
            "training": {
                "cpu_offloading_num_layers": 1,
                "global_batch_size": 8,
                "distributed_optimizer": True,
                "overlap_grad_reduce": True,
            },
        },
        0,
    ),
    # The unfused attention's global memory buffer ([b x heads, s, s] bf16: 64 KiB) the size of
    # a cuBLAS workspace: it is not one.
    "a buffer of a workspace's size": ({"cluster": {"cublas_workspace_config": ":64:1"}}, 0),
    "selective recompute, dropout": (
        {
            "model": {"hidden_dropout": 0.1, "attention_dropout": 0.1},
            "training": {"recompute": {"granularity": "selective"}},
        },
        0,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prediction_matches_a_real_cpu_run(name):
    """Saved activations equal exactly; the peak is within 1 %.

    Both sides count in 512-byte blocks: the prediction models the CUDA caching allocator, so
    the measured allocations are rounded the same way (Measured.peak_blocks), not fudged. The
    prediction's cuBLAS workspaces (two of CUBLAS_WORKSPACE_CONFIG's size, 32 MiB by default: the
    forward thread's and the autograd thread's) exist only on a GPU and are subtracted
    explicitly, known by their storages, not by their size.
    CPU dropout kernels allocate an activation-sized cast of the mask that the CUDA kernels
    do not; measure runs CUDA-like CPU dropout kernels (hooks.training.cuda_like_dropout) and
    adds of another dtype (hooks.training.cuda_like_mixed_adds), and leaves out what CPU GEMMs
    allocate and free inside their call (their scratch: cuBLAS works in its workspace) and the
    host tensors of the iterations (megatron-core's `torch.tensor([scale])` of the fused
    softmax, `torch.get_rng_state()` of each checkpoint: measure.host_allocations). What is
    left (the measured peak a few KiB higher, under 0.3 %) is memory only a CPU run allocates
    from the same allocator: Python scalars wrapped as 0-dim tensors, and other CPU kernels'
    own scratch (the contiguous copies CPU bmm's callers make), which CUDA kernels do not take
    from the caching allocator."""
    torch.set_num_threads(1)
    sections, rank = CASES[name]
    job = small_job(**LOCAL, **sections)
    predicted = predict(job, rank)
    measured = measure_rank(job, rank, iterations=2)
    assert predicted.cuda_only == 2 * cublas_workspace_bytes(job)
    assert measured.saved_blocks == predicted.saved > 0
    assert measured.saved <= measured.saved_blocks < measured.saved + 512 * 40
    peak = predicted.peak - predicted.cuda_only
    assert abs(peak - measured.peak_blocks) <= 0.01 * measured.peak_blocks
    assert measured.peak <= measured.peak_blocks
    # Parameters and DDP's gradient buffers, measured once they exist, are the predicted ones
    # (within the host tensors megatron-core makes on the way); the steady state lies between.
    assert abs(predicted.model - measured.model) <= 0.01 * measured.model
    assert measured.model < measured.steady < measured.peak_blocks


def test_allocation_peak_is_the_running_sums_maximum_after_the_mark():
    events = [(1, 1000, 10), (2, 3000, 11), (3, -1000, 10), (5, 100, 12), (6, -3000, 11)]
    assert allocation_peak(events, since_ns=0) == 4000
    assert allocation_peak(events, since_ns=4) == 3100  # only the steady state counts
    assert allocation_peak(events, since_ns=4, block=512) == 3072 + 512
    # A free of something allocated before the log started is not the run's memory.
    assert allocation_peak([(1, 600, 1), (2, -100, 99), (3, 100, 2)], since_ns=0, block=512) == 1536


def test_a_cpu_gemms_own_scratch_is_left_out_and_its_output_kept():
    # A bf16 GEMM on the CPU takes a scratch buffer (oneDNN's packed operand) inside aten::mm
    # and frees it there; cuBLAS works in its workspace, which the prediction counts apart.
    from torch.profiler import ProfilerActivity, profile

    from metatrace.tracing.measure import _profiler_log

    torch.set_num_threads(1)
    a = torch.randn(64, 256, dtype=torch.bfloat16)
    b = torch.randn(256, 200, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = torch.mm(a, b)
    stack, made = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            made += [node.extra_fields.alloc_size] if node.extra_fields.alloc_size > 0 else []
    assert len(made) > 1  # the output and at least one scratch buffer
    events, _ = _profiler_log(prof, "metatrace.")
    assert [size for _, size, _ in events] == [out.nbytes]


def test_host_tensors_of_the_iterations_are_left_out_of_the_peak():
    # On a GPU, torch.get_rng_state() (the CPU generator's state, 5,056 bytes, kept by each
    # checkpointed layer until its backward) and factories called without a device make host
    # tensors; a CPU run allocates them beside the device's. Inside host_allocations they are
    # left out; a tensor made for the device (device given) is not.
    from torch.profiler import ProfilerActivity, profile

    from metatrace.tracing.measure import _profiler_log, host_allocations

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with host_allocations():
            state = torch.get_rng_state()
            scale = torch.tensor([0.5])
            device = torch.empty(1000, device="cpu")
    events, _ = _profiler_log(prof, "metatrace.")
    assert state.nbytes == 5056 and scale.nbytes == 4
    assert [size for _, size, _ in events] == [device.nbytes]
    assert torch.get_rng_state is not None and torch.get_rng_state().nbytes == 5056


def test_allocations_of_a_references_values_are_left_out_until_freed():
    from metatrace.tracing.measure import _without

    events = [
        (1, 1000, 10),  # a kernel's buffer
        (2, 4000, 11),  # the reference's intermediate (inside REFERENCE_RANGE) ...
        (3, 500, 12),
        (4, -4000, 11),  # ... freed, inside or after the range
        (5, 2000, 11),  # the address again, for something else: counted
        (6, -2000, 11),
    ]
    kept = _without(events, {(2, 11)})
    assert kept == [(1, 1000, 10), (3, 500, 12), (5, 2000, 11), (6, -2000, 11)]
    assert allocation_peak(kept, since_ns=0) == 3500
    assert _without(events, set()) is events


def _cli(argv):
    console = Console(width=120, no_color=True, record=True)
    code = main(argv, console=console)
    return code, console.export_text()


def test_an_address_freed_before_the_micro_batch_is_not_an_existing_one():
    """A saved activation may take the address of a tensor that was alive when the existing
    storages were listed and freed since: it is counted (CI once lost a 2 KiB one so)."""
    param = torch.nn.Parameter(torch.zeros(512))
    temporary = torch.zeros(512)
    chunk = torch.nn.Module()
    chunk.weight = param
    existing = _Existing([chunk])
    assert {_storage_ptr(param), _storage_ptr(temporary)} <= existing.ptrs()
    freed = _storage_ptr(temporary)
    del temporary
    assert freed not in existing.ptrs()
    assert _storage_ptr(param) in existing.ptrs()


def test_measure_command_prints_the_comparison(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(
        "model: {preset: debug}\n"
        "training: {seq_length: 64, micro_batch_size: 2, global_batch_size: 4}\n"
        "parallel: {pp: 2}\ncluster: {num_gpus: 2}\n"
        "implementation: {transformer_impl: local}\n"
    )
    code, text = _cli(["measure", "--config", str(config), "--rank", "1", "--iterations", "2"])
    assert code == 0
    assert "rank 1: predicted against measured on cpu" in text
    assert "saved activations / micro-batch" in text and "+0.00" in text
    assert "67,108,864 of cuBLAS" in text


@pytest.mark.parametrize(
    "extra, args, message",
    [
        ("implementation: {transformer_impl: local}\n", ["--rank", "2"], "outside the world of 2"),
        ("", ["--rank", "0"], "implementation.transformer_impl: local"),
        (
            "implementation: {transformer_impl: local}\n",
            ["--rank", "0", "--iterations", "0"],
            "--iterations must be at least 1",
        ),
    ],
)
def test_measure_refuses_bad_input(tmp_path, capsys, extra, args, message):
    config = tmp_path / "job.yaml"
    config.write_text(
        "model: {preset: debug}\ntraining: {seq_length: 64}\nparallel: {tp: 2}\n" + extra
    )
    assert _cli(["measure", "--config", str(config), *args])[0] == 2
    assert message in capsys.readouterr().err


def test_measure_refuses_the_flex_dispatcher(tmp_path, capsys):
    # DeepEP's and HybridEP's kernels need the group's other ranks (the stand-ins run on meta).
    config = tmp_path / "job.yaml"
    config.write_text(
        "model: {preset: debug, num_experts: 4, moe_router_topk: 2, moe_ffn_hidden_size: 96}\n"
        "training: {seq_length: 64}\nparallel: {ep: 2, moe_token_dispatcher_type: flex}\n"
        "implementation: {transformer_impl: local}\ncluster: {num_gpus: 2}\n"
    )
    assert _cli(["measure", "--config", str(config), "--rank", "0"])[0] == 2
    assert "the flex dispatcher (DeepEP, HybridEP) cannot run for real" in capsys.readouterr().err


def test_measure_refuses_a_model_too_large_for_the_machine(monkeypatch):
    from metatrace.errors import ConfigError
    from metatrace.tracing import measure

    monkeypatch.setattr(measure, "_available_host_memory", lambda: 10 * 2**30)
    big = measure.Predicted(peak=200 * 2**30, saved=0, cuda_only=64 * 2**20, model=0, steady=0)
    with pytest.raises(ConfigError, match="predicted to need 199.94 GiB"):
        measure.check_fits(big, "cpu")
    measure.check_fits(
        measure.Predicted(peak=2**30, saved=0, cuda_only=0, model=0, steady=0), "cpu"
    )


def test_cuda_path(tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text(
        "model: {preset: debug}\ntraining: {seq_length: 64}\n"
        "implementation: {transformer_impl: local}\n"
    )
    if not torch.cuda.is_available():
        assert _cli(["measure", "--config", str(config), "--rank", "0", "--device", "cuda"])[0] == 2
        assert "needs a GPU" in capsys.readouterr().err
        pytest.skip("no GPU here: the --device cuda measurement is not exercised")
    code, text = _cli(["measure", "--config", str(config), "--rank", "0", "--device", "cuda"])
    assert code == 0 and "measured on cuda" in text


def test_streams_megatron_core_keeps_on_a_class_do_not_outlive_the_remapping():
    """The all-to-all dispatcher makes its device-to-host stream once, on the class: one made
    on meta (a stand-in) broke `metatrace measure --device cuda`, which traces on meta first
    and then runs megatron-core on the GPU in the same process (seen on an H100)."""
    import torch
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from metatrace.hooks.remap import remap_cuda

    with remap_cuda("meta"):
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()
        assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is not None
    assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None


def test_cpu_adds_of_another_dtype_allocate_what_cuda_does():
    # megatron-core's DDP adds each bf16 gradient into its fp32 main_grad. On the CPU,
    # TensorIterator first copies the whole gradient to fp32 (an embedding's [vocab, hidden]:
    # it set the measured peak of a first pipeline stage 8.6 % above the prediction at one
    # micro-batch); CUDA casts inside the kernel. Under cuda_like_mixed_adds the cast copies
    # are MIXED_ADD_CHUNK elements at most, and the sums are the same.
    from torch.profiler import ProfilerActivity, profile

    from metatrace.hooks.training import MIXED_ADD_CHUNK, cuda_like_mixed_adds

    main_grad = torch.randn(1008, 64)
    grad = torch.randn(1008, 64, dtype=torch.bfloat16)
    expected = main_grad + grad.float()

    def largest_allocation(add):
        target = main_grad.clone()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            add(target)
        sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
        return target, max(sizes, default=0)

    plain, plain_largest = largest_allocation(lambda t: t.add_(grad))
    assert plain_largest == grad.numel() * 4  # the CPU's fp32 copy of the whole gradient
    with cuda_like_mixed_adds():
        chunked, largest = largest_allocation(lambda t: t.add_(grad))
        same = torch.ones(4096)
        same.add_(torch.ones(4096), alpha=2)  # one dtype: one add, as before
        broadcast = torch.zeros(3, 4096).add_(torch.ones(4096, dtype=torch.bfloat16))
    assert largest <= MIXED_ADD_CHUNK * 4
    assert torch.equal(chunked, expected) and torch.equal(plain, expected)
    assert torch.equal(same, torch.full((4096,), 3.0))
    assert torch.equal(broadcast, torch.ones(3, 4096))
