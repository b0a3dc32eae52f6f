"""The host in the step time (metatrace.config.host, hooks/host.py): the max-plus model against
hand-worked sequences, the kernels and host work the recorder counts for what a layer
dispatches, and CUDA graphs' launches."""

import pytest
import torch

from metatrace.config.host import (
    HOST_SECONDS,
    IDENTITY,
    Piece,
    apply,
    kernels_of,
    power,
    product,
    then,
)
from metatrace.config.kernels import kernel_model

US = 10**6  # picoseconds in a microsecond
LAUNCH = round(HOST_SECONDS["launch"] * 1e12)
H100 = kernel_model("h100")


def _stream(events) -> Piece:
    """A piece from ("host", us) / ("kernel", us) / ("sync",) events."""
    p = Piece()
    for kind, *arg in events:
        getattr(p, kind)(*(round(a * US) for a in arg))
    return p


def _run(events, host=0.0, gpu=0.0):
    """(host, GPU) clocks in us after `events`, simulated one by one."""
    h, g = host, gpu
    for kind, *arg in events:
        if kind == "host":
            h += arg[0]
        elif kind == "kernel":
            g = max(g, h) + arg[0]
        else:
            h = max(h, g)
    return h, g


def test_a_gpu_bound_window_ends_with_its_kernels():
    # The host issues three 100 us kernels 10 us apart: the GPU never waits after the first.
    events = [("host", 10), ("kernel", 100)] * 3
    h, g = apply(_stream(events).matrix(), 0, 0)
    assert (h / US, g / US) == (30, 310)  # 10 us before the first kernel, then 300 us of work


def test_a_host_bound_window_ends_with_its_host():
    # 50 us of host work per 5 us kernel: each kernel waits for its issue.
    events = [("host", 50), ("kernel", 5)] * 4
    h, g = apply(_stream(events).matrix(), 0, 0)
    assert (h / US, g / US) == (200, 205)
    # Started behind a GPU still busy for 1 ms, the same window is GPU-bound again.
    h, g = apply(_stream(events).matrix(), 0, 1000 * US)
    assert (h / US, g / US) == (200, 1020)


def test_a_synchronisation_in_the_middle_empties_the_gpus_queue():
    # The host issues a 1 ms kernel, reads a value back (waits for it), then issues 20 small
    # kernels at 30 us each: after the wait the GPU waits for every one of them.
    events = [("host", 10), ("kernel", 1000), ("sync",)] + [("host", 30), ("kernel", 5)] * 20
    h, g = apply(_stream(events).matrix(), 0, 0)
    assert h / US == 10 + 1000 + 20 * 30 == _run(events)[0]
    assert g / US == 1010 + 20 * 30 + 5 == _run(events)[1]
    # Without the read, the 20 kernels run while the first is still on the GPU.
    no_sync = [e for e in events if e[0] != "sync"]
    assert apply(_stream(no_sync).matrix(), 0, 0)[1] / US == 10 + 1000 + 20 * 5


@pytest.mark.parametrize("split", [0, 3, 7, 12])
def test_pieces_compose_exactly(split):
    events = [("host", 7), ("kernel", 40), ("host", 60), ("kernel", 3), ("sync",)] * 3
    events = events[:13] + [("host", 25), ("kernel", 90)]
    whole = _stream(events).matrix()
    assert then(_stream(events[:split]).matrix(), _stream(events[split:]).matrix()) == whole
    for start in ((0, 0), (500, 0), (0, 500)):
        h, g = apply(whole, *(x * US for x in start))
        assert (h / US, g / US) == pytest.approx(_run(events, *start))


def test_a_layer_repeated():
    layer = _stream([("host", 20), ("kernel", 15), ("sync",), ("host", 5), ("kernel", 30)])
    m = layer.matrix()
    assert power(m, 5) == product([m] * 5)
    assert power(m, 0) == IDENTITY
    # The first layer: 20 us to issue its first kernel, 15 us on the GPU, the host waits, then
    # 5 us and a 30 us kernel: the GPU done at 70 us, the host at 40. Each next layer's 20 us
    # of host work runs beside that kernel: 50 us more each.
    h, g = apply(power(m, 5), 0, 0)
    assert (h / US, g / US) == (70 + 4 * 50 - 30, 70 + 4 * 50)


def test_kernels_per_operator():
    assert kernels_of("mm", view=False) == 1
    assert kernels_of("view", view=True) == 0
    assert kernels_of("empty", view=False) == 0  # an allocation launches nothing
    assert kernels_of("nonzero", view=False) == 3  # count, copy the count, write the indices


def _recorded(fn, captured=None, module=None, device="meta"):
    from metatrace.hooks.recorder import Recorder

    module = module or torch.nn.Linear(4, 4, device=device)
    rec = Recorder(
        chunks={"": module}, devices=(device,), groups={}, rank=0, kernels=H100, captured=captured
    )
    with rec, rec.window("forward", 0):
        fn()
    (w,) = rec.trace().windows
    return w


def test_the_recorder_counts_a_layers_launches_and_host_work():
    """A linear layer with a bias and a GeLU on meta: the operators it dispatches are a GEMM with
    the bias (addmm), the GeLU and the weight's transpose (a view): two kernels."""
    layer = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).to("meta")
    x = torch.empty(8, 64, device="meta")
    w = _recorded(lambda: layer(x), module=layer)
    assert w.kernels == 2
    ps = {key: round(v * 1e12) for key, v in HOST_SECONDS.items()}
    # Three module calls (the Sequential, the Linear, the GELU), two operators, one view, two
    # launches.
    assert w.host_ps == 3 * ps["module"] + 2 * ps["operator"] + ps["view"] + 2 * ps["launch"]
    assert w.syncs == 0
    # Host-bound: the kernels of an 8 x 64 layer take a few microseconds.
    (m,) = w.host
    h, g = apply(m, 0, 0)
    assert h == w.host_ps  # no synchronisation: the host never waits
    assert 0 < g - h < w.kernel_ps  # the last kernel (the GeLU) alone runs after the host is done


def test_a_value_read_back_synchronises():
    """On real (CPU) tensors: masked_select's output size depends on the mask, .item() reads a
    value back; a stand-in that replaced such a read says so (hooks.host.sync)."""
    from metatrace.hooks import host

    x = torch.randn(1000)

    def reads():
        x.masked_select(x > 0)
        x.sum().item()
        host.sync()

    w = _recorded(reads, device="cpu")
    assert w.syncs == 3
    # the comparison, masked_select's four, the sum; a copy of the value per synchronisation
    assert w.kernels == 1 + 4 + 1 + 3


def test_a_cuda_graph_launches_its_captured_modules_once():
    layer = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).to("meta")
    x = torch.empty(8, 64, device="meta")
    eager = _recorded(lambda: layer(x), module=layer)
    graphed = _recorded(lambda: layer(x), captured=lambda m, phase: True, module=layer)
    assert graphed.kernels == eager.kernels == 2
    assert graphed.kernel_ps == eager.kernel_ps
    assert graphed.host_ps == LAUNCH  # the graph's own launch, nothing else


@pytest.mark.parametrize(
    "training, captured, eager",
    [
        # Transformer Engine's per-layer graphs: the whole layer, in forward and backward.
        (
            {"cuda_graph_impl": "transformer_engine"},
            ["decoder.layers.0", "chunk1.decoder.layers.3.mlp.linear_fc1"],
            ["embedding", "decoder.final_layernorm", "output_layer", "(step)"],
        ),
        # Only the attention part.
        (
            {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["attn"]},
            ["decoder.layers.2.self_attention.linear_qkv", "decoder.layers.2.input_layernorm"],
            ["decoder.layers.2.mlp", "decoder.layers.2"],
        ),
        # The whole iteration: every step's work, the optimizer step's none.
        (
            {"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]},
            ["embedding", "output_layer", "(step)"],
            [],
        ),
    ],
)
def test_what_cuda_graphs_capture(training, captured, eager):
    from metatrace.config import job_from_dict
    from metatrace.tracing.graphs import captured_by_graphs

    job = job_from_dict(
        {
            "model": {"preset": "debug"},
            "implementation": {"transformer_impl": "transformer_engine"},
            "training": {"seq_length": 64, "micro_batch_size": 1, **training},
        }
    )
    inside = captured_by_graphs(job)
    for module in captured:
        assert inside(module, "forward") and inside(module, "backward")
        assert not inside(module, "optimizer")
    for module in eager:
        assert not inside(module, "forward")
    plain = {"model": {"preset": "debug"}, "training": {"seq_length": 64}}
    assert captured_by_graphs(job_from_dict(plain)) is None


@pytest.mark.parametrize("overlap", [False, True])
def test_what_moe_graphs_capture(overlap):
    """Transformer Engine's graphs of MoE layers: a dense layer (0) has its attention and MLP
    captured with scopes attn and mlp, a MoE layer (1) its attention, pre-MLP norm, router,
    preprocessing and shared experts with attn, moe_router and moe_preprocess: the shared
    experts not when the dispatcher overlaps them."""
    from metatrace.config import job_from_dict
    from metatrace.tracing.graphs import captured_by_graphs

    job = job_from_dict(
        {
            "model": {
                "preset": "debug",
                "num_experts": 4,
                "moe_shared_expert_intermediate_size": 64,
            },
            "parallel": {
                "moe_token_dispatcher_type": "alltoall",
                "moe_shared_expert_overlap": overlap,
            },
            "implementation": {"transformer_impl": "transformer_engine"},
            "training": {
                "seq_length": 64,
                "cuda_graph_impl": "transformer_engine",
                "cuda_graph_scope": ["attn", "mlp", "moe_router", "moe_preprocess"],
            },
        }
    )
    dense, moe = "decoder.layers.0", "decoder.layers.1"
    modules = [dense, f"{dense}.mlp", f"{moe}.mlp", f"{moe}.mlp.router", f"{moe}.mlp.experts"]
    inside = captured_by_graphs(job, modules)
    captured = [
        f"{dense}.self_attention.linear_qkv",
        f"{dense}.pre_mlp_layernorm",
        f"{dense}.mlp.linear_fc1",
        f"{moe}.input_layernorm",
        f"{moe}.pre_mlp_layernorm",
        f"{moe}.mlp.router",
        f"{moe}.mlp.preprocess",
    ]
    eager = [f"{moe}.mlp", f"{moe}.mlp.experts.linear_fc1", f"{moe}.mlp_bda", "output_layer"]
    shared = f"{moe}.mlp.shared_experts.linear_fc1"
    (eager if overlap else captured).append(shared)
    for module in captured:
        assert inside(module, "forward") and inside(module, "backward")
    for module in eager:
        assert not inside(module, "forward") and not inside(module, "backward")


def test_what_mamba_graphs_capture():
    """Scope mamba: a hybrid stack's Mamba layers whole (told by their mixer), nothing else."""
    from metatrace.config import job_from_dict
    from metatrace.tracing.graphs import captured_by_graphs

    job = job_from_dict(
        {
            "model": {"preset": "debug"},
            "implementation": {"transformer_impl": "transformer_engine"},
            "training": {
                "seq_length": 64,
                "cuda_graph_impl": "transformer_engine",
                "cuda_graph_scope": ["mamba"],
            },
        }
    )
    inside = captured_by_graphs(job, ["decoder.layers.0.mixer", "decoder.layers.1.self_attention"])
    for module in ("decoder.layers.0.mixer.in_proj", "decoder.layers.0.norm"):
        assert inside(module, "forward") and inside(module, "backward")
    for module in ("decoder.layers.1.self_attention.linear_qkv", "decoder.layers.1", "embedding"):
        assert not inside(module, "forward")


def test_batched_pipeline_communication_synchronises_the_host():
    """Two stages of 1F1B, two micro-batches, host-bound steps (100 us of host work issuing a
    10 us kernel, as one max-plus matrix): megatron-core's batched sends and receives end in
    torch.cuda.synchronize(), so the host cannot issue a step before the GPU has received its
    input; without them (overlap_p2p_comm) it runs ahead."""
    from metatrace.analysis.timing import simulate
    from metatrace.config.host import scaled

    us = 1e-6
    step = scaled(_stream([("host", 100), ("kernel", 10)]).matrix(), 1e-12)
    orders = [
        [("forward", 0, 0), ("forward", 0, 1), ("backward", 0, 0), ("backward", 0, 1)],
        [("forward", 0, 0), ("backward", 0, 0), ("forward", 0, 1), ("backward", 0, 1)],
    ]

    def run(sync):
        clocks, synced = [], []
        out = simulate(
            orders,
            lambda s, phase, chunk: 10 * us,
            pp=2,
            host=lambda s, phase, chunk: (step, 10 * us, 10 * us),
            clocks=clocks,
            p2p_sync=sync,
            synced=synced,
        )
        return [round(end / us) for _, end, *_ in out[1]], round(clocks[1] / us), synced

    # Without synchronisations stage 1's host issues its first forward from 0 while stage 0
    # runs its own (its input arrives at 110 us): the kernel ends at 120; each next step is
    # 100 us of host work on.
    assert run(False) == ([120, 210, 310, 410], 400, [0, 0])
    # With them stage 1's host starts issuing each forward when its input has arrived (110 us,
    # then 320 where its backward ends). Its backwards follow no communication (the last
    # stage's send_forward_recv_backward does nothing) and run ahead; the host waits for its
    # last backward's send (530). Synchronisations: stage 0 after its first forward's send
    # and before each backward's receive, stage 1 before each forward's receive and after the
    # last send (megatron-core's 1F1B).
    assert run(True) == ([220, 320, 430, 530], 530, [3, 3])


# ----------------------------------------------------------------------------- launches a
# dispatched operator does not show: what the H200 profiles of bench/step_time.py counted


CHUNK = 2048 * 32


@pytest.mark.parametrize(
    "numels, depth, launches",
    [
        ([100, 100, 100], 1, 1),  # everything in one launch
        ([1] * 111, 1, 2),  # 110 tensors fill a launch of one list
        ([1] * 37, 4, 2),  # 36 of four lists (Adam's)
        ([320 * CHUNK + 1], 4, 2),  # 320 chunks fill a launch; the last one goes alone
        ([200 * CHUNK, 200 * CHUNK], 1, 2),  # the second tensor goes on in the next launch
        ([0, 5, 0], 2, 1),  # empty tensors skipped
        ([], 2, 0),
    ],
)
def test_multi_tensor_launches(numels, depth, launches):
    from metatrace.config.host import multi_tensor_launches

    assert multi_tensor_launches(numels, depth) == launches


def test_the_optimizers_multi_tensor_kernels_launch_by_chunks():
    """Transformer Engine's multi-tensor kernels as megatron-core calls them in the optimizer
    step: the gradient norm (one list, then the cleanup kernel that adds the blocks' norms),
    the copy of the main parameters to the model's (two lists; not a copy and a product per
    tensor) and FusedAdam's update (four lists: gradients, parameters, both moments)."""
    from metatrace.config.host import multi_tensor_launches
    from metatrace.hooks.remap import remap_cuda
    from metatrace.models import te_optim

    # 150 parameters, the largest of 400 chunks: more tensors and chunks than one launch holds.
    numels = [400 * CHUNK] + [1000] * 149
    params = [torch.empty(n, device="meta") for n in numels]
    copies = [torch.empty(n, dtype=torch.bfloat16, device="meta") for n in numels]
    for p in params:
        p.grad = torch.empty_like(p)
    flag = torch.zeros(1, dtype=torch.int, device="meta")
    with remap_cuda("meta"):
        adam = te_optim.FusedAdam(params)
    grads = [p.grad for p in params]
    norm = _recorded(lambda: te_optim.multi_tensor_l2norm(CHUNK, flag, [grads], False))
    fills = 2  # its outputs, zeroed: the total, and no per-tensor norms (an empty fill: none)
    assert norm.kernels == fills - 1 + multi_tensor_launches(numels, 1) + 1
    assert multi_tensor_launches(numels, 1) == 3  # 320 chunks, then 80 + 110 tensors, then 39
    scale = _recorded(lambda: te_optim.multi_tensor_scale(CHUNK, flag, [params, copies], 1.0))
    assert scale.kernels == multi_tensor_launches(numels, 2) == 4
    adam.step()  # the first step makes (and zeroes) the moments
    step = _recorded(adam.step)
    assert step.kernels == multi_tensor_launches(numels, 4) == 6


def test_the_batch_copied_to_the_device_launches_its_copies():
    """get_batch's .cuda() of the data loader's host tensors: a copy each on the device (the
    H200 profiles' Memcpy HtoD, five per micro-batch); work on host tensors alone launches
    nothing."""
    batch = [torch.zeros(2, 64, dtype=torch.int64) for _ in range(5)]
    w = _recorded(lambda: [t.to("meta", non_blocking=True) for t in batch])
    assert w.kernels == 5
    host = _recorded(lambda: [t.add(1) for t in batch])
    assert host.kernels == 0


def test_empty_outputs_launch_nothing():
    w = _recorded(lambda: (torch.zeros(0, device="meta"), torch.zeros(3, device="meta")))
    assert w.kernels == 1


@pytest.mark.parametrize("tokens, kernels", [(2048, 2), (3072, 2), (3073, 8)])
def test_the_embeddings_backward_takes_its_direct_path_for_few_tokens(tokens, kernels):
    """PyTorch's embedding_dense_backward_cuda: up to 3072 indices, the gradient zeroed and one
    embedding_backward_feature_kernel (the H200 profile of GPT 1.3B at micro-batch 1, 2048
    tokens: 2 a micro-batch, for the word and position embeddings); more, it sorts them."""
    grad = torch.empty(tokens, 64, dtype=torch.bfloat16, device="meta")
    ids = torch.empty(tokens, dtype=torch.int64, device="meta")
    w = _recorded(lambda: torch.ops.aten.embedding_dense_backward(grad, ids, 1000, -1, False))
    assert w.kernels == kernels


def test_foreach_operators_launch_by_chunks():
    """torch.optim's foreach step (optimizer_impl: torch): each foreach operator is one
    multi-tensor call over its lists, and the list it writes when not in place."""
    from metatrace.config.host import multi_tensor_launches

    numels = [CHUNK] * 120
    xs = [torch.empty(n, device="meta") for n in numels]
    ys = [torch.empty(n, device="meta") for n in numels]
    assert _recorded(lambda: torch._foreach_mul_(xs, 0.5)).kernels == 2  # 110 tensors, then 10
    add = _recorded(lambda: torch._foreach_add_(xs, ys))
    assert add.kernels == multi_tensor_launches(numels, 2) == 2
    sqrt = _recorded(lambda: torch._foreach_sqrt(xs))  # reads one list, writes another
    assert sqrt.kernels == multi_tensor_launches(numels, 2)
    lerp = _recorded(lambda: torch._foreach_addcmul_(xs, ys, ys))
    assert lerp.kernels == multi_tensor_launches(numels, 3) == 3  # 48 tensors a launch


@pytest.mark.parametrize("host, flagged", [(0.0, False), (0.009, False), (0.01, True), (0.6, True)])
def test_the_where_it_goes_line_says_host_bound_from_one_percent(host, flagged):
    from metatrace.analysis.timing import Breakdown
    from metatrace.render.format import where_it_goes

    b = Breakdown(
        stage=1,
        compute=1.0 - host,
        communication=0.0,
        idle=0.0,
        optimizer=0.0,
        offload=0.0,
        host=host,
    )
    line = where_it_goes(b, 1.0, True)
    assert line.startswith(
        "Where it goes (stage 1, the last to finish; host-bound): "
        if flagged
        else "Where it goes (stage 1, the last to finish): "
    )
    assert ("waiting for the host" in line) == (host >= 1e-3)  # terms under 0.1 % left out


def test_the_constants_are_the_stored_measurement():
    """HOST_SECONDS are bench/host_overhead.py's figures on the development machine, stored in
    bench/data/cpu_host_overhead.json, to two significant digits; the launch (not measurable on
    a CPU) is the cited 3.8 us."""
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "data")
    with open(os.path.join(path, "cpu_host_overhead.json")) as f:
        stored = json.load(f)["constants"]
    for unit in ("operator", "view", "backward", "module"):
        assert HOST_SECONDS[unit] == pytest.approx(float(f"{stored[unit]:.2g}")), unit
    assert stored["launch"] is None and HOST_SECONDS["launch"] == 3.8e-6


def test_a_grouped_gemm_launches_one_cublas_gemm_per_group_with_rows():
    """Transformer Engine 2.8's grouped GEMM is one cuBLAS GEMM per non-empty group
    (te_general_grouped_gemm -> nvte_multi_tensor_gemm): a call over 4 experts of which one
    received nothing launches 3 kernels, the backward's two calls 6; the GPU time is the same
    as one kernel over the groups' tiles."""
    from metatrace.config import kernels
    from metatrace.hooks import flops
    from metatrace.hooks.host import HostCount

    host = HostCount()
    count = flops.FlopCount(H100, host)
    rows = (256, 0, 512, 128)
    flops.push(count)
    try:
        flops.report_grouped(rows, 1024, 2048)
        assert host.kernels == 3
        flops.report_grouped(rows, 2048, 1024, times=2)
        assert host.kernels == 3 + 6
    finally:
        flops.pop(count)
    once = kernels.grouped_gemm_seconds(H100, rows, 2048, 1024)
    twice = 2 * kernels.grouped_gemm_seconds(H100, rows, 1024, 2048)
    assert count.ps == round(once * 1e12) + round(twice * 1e12)
    assert host.host_ps == 9 * LAUNCH
