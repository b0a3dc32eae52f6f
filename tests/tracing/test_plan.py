"""`metatrace plan` on a small case where every layout is traced: the layouts it recommends fit,
and none it left out (by the memory bound, by dominance, or as slower) would have ranked
first; megatron's bubble in the estimate and layouts that keep the model and the batch (each
candidate job is checked by megatron-core)."""

import dataclasses
import io
import json
import re

import pytest
from rich.console import Console

from metatrace.analysis.analyze import analyze
from metatrace.cli import main
from metatrace.config import job_from_dict, load_job
from metatrace.config.megatron.args import job_from_args, split_args
from metatrace.config.megatron.to_args import LAYOUT_FIELDS, megatron_args
from metatrace.errors import ConfigError
from metatrace.export.report import job_report
from metatrace.planning import estimates as E
from metatrace.planning import plan as P
from metatrace.tracing.trace import trace_job

GPUS = 4
# 143 MiB, nothing outside the allocator: the traced peaks are 98.3 to 114.5 MiB (two cuBLAS
# workspaces of 32 MiB and TE's of 32 MiB + 1 KiB in every one), the allocator's reserve of the
# two layouts traced 126 MiB (at 102 MiB neither fits: the allocator runs out after freeing its
# cache).
MEMORY_GIB = 0.14


def _base():
    return job_from_dict(
        {
            "model": {"preset": "debug", "num_layers": 4},
            "training": {"seq_length": 256, "global_batch_size": 8},
            "cluster": {
                "num_gpus": 1,
                "gpu_memory_gib": MEMORY_GIB,
                "context_gib": 0,
                "nccl_gib": 0,
            },
        },
        source="debug",
    )


def _trace(job):
    return job_report(analyze(trace_job(job, full_model=False, workers=1)))


@pytest.fixture(scope="module")
def searched():
    base = _base()
    result = P.plan(base, GPUS, trace=_trace, top=2, budget=8)
    return base, result


def test_recommended_layouts_fit_and_rank_by_estimate(searched):
    base, result = searched
    ranked = result.ranked()
    assert ranked and len(ranked) <= 2
    assert all(t.fits and t.headroom >= 0 for t in ranked)
    seconds = [t.estimate.seconds for t in ranked]
    assert seconds == sorted(seconds)
    # One layout per set of degrees.
    assert len({P._family(t.candidate.layout) for t in ranked}) == len(ranked)
    assert (
        result.layouts
        == result.invalid
        + result.pruned_memory
        + len(result.traced)
        + len(result.dominated)
        + result.outgrown
        + result.represented
        + result.untraced
    )


def test_a_layout_within_the_error_band_ranks_after_and_the_search_goes_on(searched):
    """The first layout traced (the fastest estimate) made to fit only within the prediction's
    error band: it ranks after the others, does not stand for its degrees, rules out what holds
    no less, and the search traces on until `top` layouts fit beyond the band."""
    _, plain = searched
    first = []

    def trace(job):
        report = _trace(job)
        if not first:
            first.append(job)
            report["memory_verdict"]["error_band"]["within"] = True
        return report

    result = P.plan(_base(), GPUS, trace=trace, top=2, budget=8)
    edge = result.traced[0]
    assert edge.fits and edge.within_error and edge.candidate.job is first[0]
    ranked = result.ranked()
    assert ranked[-1] is edge
    assert sum(not t.within_error for t in ranked) == len(plain.ranked()) == 2
    assert len(result.traced) > len(plain.traced)
    # Nothing that holds no less than it (whose headroom could only be smaller) was traced.
    for t in result.traced[1:]:
        fused = t.candidate.job.attention_kernel in ("fused", "flash")
        assert not P._holds_no_more(edge.candidate.layout, t.candidate.layout, fused)


def test_nothing_left_out_would_have_ranked_first(searched):
    base, result = searched
    best = result.ranked()[0]
    capacity = round(MEMORY_GIB * 2**30)
    traced = {t.candidate.layout for t in result.traced}
    checked = fit_elsewhere = 0
    for layout in P.layouts(base, GPUS):
        try:
            job = P.job_of(base, layout)
        except ConfigError:
            continue
        if layout in traced:
            continue
        report = _trace(job)
        peak = report["memory_verdict"]["highest_peak_bytes"]
        checked += 1
        # The memory bound is a bound.
        assert E.memory_lower_bound(job) <= peak, layout
        if peak > capacity:
            continue
        fit_elsewhere += 1
        cand = P.Candidate(layout, job, 0, 0, E.estimate(job))
        assert P._traced(cand, report).estimate.seconds >= best.estimate.seconds, layout
    assert checked > 10 and fit_elsewhere > 0


@pytest.mark.parametrize(
    "sections",
    [
        {},
        {"implementation": {"transformer_impl": "local"}},
        {"parallel": {"pp": 2}, "cluster": {"num_gpus": 2}},
        {"training": {"recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}}},
        {
            "model": {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 96},
            "implementation": {"transformer_impl": "local"},
        },
        # Transformer Engine's grouped GEMMs: a launch per local expert
        {
            "model": {"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 96},
            "implementation": {"moe_grouped_gemm": True},
        },
    ],
    ids=["te", "local", "pp2", "full-recompute", "moe-local", "moe-grouped"],
)
def test_the_estimates_host_is_the_traced_hosts(sections):
    """The planner's closed-form host work (estimates.host_seconds, from per-layer counts of
    config.host's units) against the traced time model's (Timing.host: every operator, module
    and launch the tracer counted) of the stage that finishes last, within 15 %; and a
    host-bound estimate lasts at least its host work."""
    from metatrace.analysis.timing import job_timing
    from tests.helpers import small_job

    job = small_job(model={"num_layers": 4, **sections.pop("model", {})}, **sections)
    timing = job_timing(trace_job(job, full_model=False, workers=1))
    est = E.estimate(job)
    assert est.host == pytest.approx(timing.host.seconds, rel=0.15)
    assert est.host > est.compute  # the debug model's kernels take less than issuing them
    assert est.seconds >= est.host / (1 - est.bubble)


def test_bound_below_every_traced_peak(searched):
    _, result = searched
    for t in result.traced:
        assert t.candidate.lower_bound <= t.peak


def test_closed_form_static_memory_is_exact_for_a_plain_layout():
    """Without padding effects (one stage, tp 1), parameters + fp32 gradients + fp32 main
    parameters and two Adam moments: 18 bytes per parameter."""
    base = _base()
    job = P.job_of(base, P.Layout(1, 1, None, 1, 1, 1, False, 1, "none", False))
    params = json.loads(json.dumps(_trace(job)))["model"]["total_params"]
    assert E.static_bytes(job) == 18 * params


def test_cli_plan_prints_and_writes_json_config_and_flags(tmp_path):
    """The plan's JSON; --write-config's job file, which traces to the planned peak; and the
    printed torchrun flags, which Megatron-LM's parser (metatrace's reading of it) gives back
    as the planned layout."""
    out = io.StringIO()
    path = tmp_path / "plan.json"
    config = tmp_path / "best.yaml"
    code = main(
        [
            "plan",
            "--model",
            "debug",
            "--num-gpus",
            "2",
            "--seq",
            "128",
            "--global-batch",
            "4",
            "--max-traces",
            "2",
            "--top",
            "1",
            "--quiet",
            "--json",
            str(path),
            "--write-config",
            str(config),
        ],
        Console(file=out, width=120, color_system=None),
    )
    assert code == 0
    data = json.loads(path.read_text())
    best = data["best"][0]
    assert len(data["best"]) == 1 and best["fits"]
    text = out.getvalue()
    assert best["description"] in text
    # What its time is made of: the traced compute, then the other terms, adding up to it.
    line = re.search(r"time: (.*?)\.\n", text, re.S).group(1).replace("\n", " ")
    terms = dict(re.findall(r"([a-z ]+) ([\d.,]+ [µm]?s) \(", ", " + line))
    assert "compute" in {k.strip(", ") for k in terms}
    scale = {"s": 1, "ms": 1e-3, "µs": 1e-6}
    digit = {"s": 1e-2, "ms": 1e-4, "µs": 1e-7}  # the printed last digit: 1.23 s, 4.5 ms
    total = sum(float(v.split()[0]) * scale[v.split()[1]] for v in terms.values())
    rounding = sum(digit[v.split()[1]] / 2 for v in terms.values())
    # Terms under 0.1 % of the iteration are left out (render.format.time_terms): six in all.
    iteration = best["estimate"]["iteration_seconds"]
    left_out = (6 - len(terms)) * 1e-3 * iteration
    assert iteration - left_out - rounding <= total <= iteration + rounding
    # The job file: the planned layout, traced again to the planned peak.
    job = load_job(config)
    layout = best["layout"]
    assert (job.parallel.tp, job.parallel.pp, job.parallel.dp, job.training.micro_batch_size) == (
        layout["tp"],
        layout["pp"],
        layout["dp"],
        layout["mbs"],
    )
    assert job.training.distributed_optimizer == layout["distributed_optimizer"]
    assert _trace(job)["memory_verdict"]["highest_peak_bytes"] == best["peak_bytes"]
    assert f"metatrace run --config {config}" in text
    # The torchrun line and its continuation lines, as a shell would join them.
    lines = text[text.index("torchrun ") :].splitlines()
    end = next(i for i, line in enumerate(lines) if not line.endswith("\\"))
    command = " ".join(line.rstrip("\\") for line in lines[: end + 1])
    assert command.startswith("torchrun --nnodes 1 --nproc-per-node 2 pretrain_gpt.py ")
    tokens = split_args(command)  # the flags of pretrain_gpt.py, as from a training script
    assert tokens == megatron_args(job) and "--micro-batch-size" in tokens
    assert best["megatron_args"] == tokens  # the JSON has the same flags
    # Complete: the model comes back from the line alone, and the layout.
    back, _ = job_from_args(tokens, world_size=2)
    assert back.model == dataclasses.replace(job.model, preset=None)
    for section, name in LAYOUT_FIELDS:
        assert getattr(getattr(back, section), name) == getattr(getattr(job, section), name), name


def test_bubble_is_megatrons_closed_form():
    base = _base()
    job = P.job_of(base, P.Layout(1, 2, None, 1, 1, 2, False, 1, "none", False))
    m = job.num_microbatches
    assert E.estimate(job).bubble == pytest.approx(1 / (m + 1))
    job = P.job_of(base, P.Layout(1, 2, 2, 1, 1, 2, False, 1, "none", False))
    assert E.estimate(job).bubble == pytest.approx(1 / (2 * m + 1))


def test_layout_keeps_model_and_batch():
    base = _base()
    job = P.job_of(base, P.Layout(2, 2, None, 1, 1, 1, True, 2, "full", False))
    assert job.model == base.model
    assert (job.parallel.tp, job.parallel.pp, job.training.micro_batch_size) == (2, 2, 2)
    assert job.training.recompute.granularity == "full"
    assert (
        dataclasses.replace(
            job.training,
            micro_batch_size=1,
            recompute=base.training.recompute,
            distributed_optimizer=False,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
        )
        == base.training
    )


@pytest.mark.parametrize(
    "parallel",
    [{"tp": 1}, {"tp": 2, "cp": 2, "sequence_parallel": True}],
    ids=["tp1", "tp2-cp2"],
)
def test_closed_form_compute_follows_the_traced_kernels(parallel):
    """The search's per-kernel closed form (estimates.kernel_seconds) against the compute the
    time model sums from the traced kernels, for Llama-2 7B (within 15 %: it orders the layouts,
    the traced figure ranks them)."""
    from metatrace.analysis.timing import job_timing

    job = job_from_dict(
        {
            "model": {"preset": "llama2-7b", "max_position_embeddings": 4096},
            "parallel": parallel,
            "training": {"seq_length": 4096, "global_batch_size": 8},
            "cluster": {"num_gpus": 2 * parallel["tp"] * parallel.get("cp", 1), "gpu": "h100"},
        }
    )
    timing = job_timing(trace_job(job, full_model=False, workers=1))
    (stage,) = timing.stages
    traced = sum(sp.compute_seconds for sp in stage.spans if sp.phase in ("forward", "backward"))
    assert E.kernel_seconds(job) == pytest.approx(traced, rel=0.15)


@pytest.mark.parametrize("tp, ep", [(1, 4), (2, 2)])
def test_closed_form_moe_layer_activations_follow_the_trace(tp, ep):
    """What a MoE layer saves per micro-batch (router, permutation map, the experts' GEMM
    inputs and activation, the attention's Korthikanti terms) against what the trace of
    megatron-core's layer saved (activation_owners: each storage once), within 12 %: the
    planner orders layouts by it (it was 25 % short on Qwen3-30B-A3B before the MoE terms)."""
    from metatrace.analysis.aggregate import activation_owners
    from metatrace.config import resolve
    from tests.helpers import BALANCED, MOE, small_job

    job = resolve(
        small_job(
            model={**MOE, "num_experts": 8},
            parallel={"ep": ep, "tp": tp, "sequence_parallel": tp > 1},
            training={"global_batch_size": 8, **BALANCED},
            implementation={
                "moe_grouped_gemm": True,
                "moe_permute_fusion": True,
                "moe_router_fusion": True,
            },
            cluster={"num_gpus": 4},
        )
    )
    owners = activation_owners(trace_job(job, full_model=False).roles[0].trace)
    layer = sum(b for mod, b in owners.values() if ".layers.0." in f".{mod}")
    assert layer > 0
    assert E._layer_activations(job) == pytest.approx(layer, rel=0.12)


def test_a_layout_that_does_not_fit_rules_out_those_holding_as_much():
    """Context parallelism with the same tokens per rank (mbs / cp) and dp x cp holds no less
    (the same static memory, its ring's buffers on top); with a fused attention kernel the
    planner's selective recompute (core attention) holds no less than none."""
    small = P.Layout(1, 2, None, 1, 8, 8, False, 2, "none", True)
    cp = dataclasses.replace(small, cp=2, dp=4, mbs=4)
    assert P._holds_no_more(small, cp, False)
    assert not P._holds_no_more(small, dataclasses.replace(cp, mbs=2), False)
    assert not P._holds_no_more(cp, small, False)
    selective = dataclasses.replace(small, recompute="selective")
    assert P._holds_no_more(small, selective, True)
    assert not P._holds_no_more(small, selective, False)
    assert not P._holds_no_more(selective, small, True)


@pytest.mark.parametrize("dispatcher, tp, ep", [("allgather", 2, 2), ("alltoall", 1, 4)])
def test_closed_form_memory_estimate_of_a_moe_layout(dispatcher, tp, ep):
    """The planner's estimate of a MoE layout's peak against its trace, within 5 %: the
    layers' activations, the workspaces, and the allgather dispatcher's gathered tokens (held
    in megatron-core's global buffer, and their fp32 combine)."""
    from metatrace.config import resolve
    from tests.helpers import BALANCED, MOE, small_job

    job = resolve(
        small_job(
            model={**MOE, "num_experts": 8, "hidden_size": 256, "moe_ffn_hidden_size": 128},
            parallel={
                "ep": ep,
                "tp": tp,
                "sequence_parallel": tp > 1,
                "moe_token_dispatcher_type": dispatcher,
            },
            training={"global_batch_size": 8, "seq_length": 512, **BALANCED},
            cluster={"num_gpus": 4},
        )
    )
    peak = job_report(analyze(trace_job(job, full_model=False)))["roles"][0]["memory"]
    assert E.memory_estimate(job) == pytest.approx(peak["peak_bytes"], rel=0.05)
    assert (E._dispatcher_transient(job) > 0) == (dispatcher == "allgather")


SCRIPT = """#!/bin/bash
GPUS_PER_NODE=2
torchrun --nproc_per_node $GPUS_PER_NODE --nnodes 1 pretrain_gpt.py \\
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 \\
    --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm \\
    --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights \\
    --seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 4 \\
    --bf16 --tokenizer-type NullTokenizer --vocab-size 999
"""


def test_plan_of_a_megatron_script_reports_each_trace(tmp_path, capsys):
    """A training script planned as a job file is: its model and batch kept, its launcher's 2
    GPUs planned for; with stderr not a terminal, a line per trace there (none with --quiet)."""
    script = tmp_path / "train.sh"
    script.write_text(SCRIPT)
    out = io.StringIO()
    argv = ["plan", str(script), "--max-traces", "2", "--top", "1"]
    assert main(argv, Console(file=out, width=80, color_system=None)) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"metatrace plan: enumerating the layouts of {script} on 2 GPUs"
    traces = [line for line in err[1:-1] if line.startswith("metatrace plan: tracing ")]
    assert len(traces) == len(err) - 2 >= 1
    assert re.fullmatch(
        r"metatrace plan: tracing 1 of at most 2 \(\d+ s\): tp \d, pp .*", traces[0]
    )
    assert re.fullmatch(rf"metatrace plan: {len(traces)} traced in \d+ s", err[-1])
    text = " ".join(out.getvalue().split())
    assert f"Layouts of {script} on 2 × h100" in text and "global batch 4" in text
    assert "--seq-length 128" in text and "--num-query-groups 2" in text  # the script's model
    out = io.StringIO()
    assert main([*argv, "--quiet"], Console(file=out, width=80, color_system=None)) == 0
    assert capsys.readouterr().err == ""
    # Another size than the launcher's: --num-gpus plans for it.
    assert main([*argv, "--num-gpus", "4", "-q"], Console(file=out, width=80)) == 0
    assert f"Layouts of {script} on 4 × h100" in " ".join(out.getvalue().split())


def test_what_traces_took_beyond_their_estimates_reorders_the_rest(searched):
    """After a trace, the layouts left are ordered as their estimates plus what the traced ones
    took beyond theirs (the reserve, NCCL, what the closed forms leave out) fit or not: that of
    the same degrees where one of them was traced, else the least of all. A residual that
    leaves only the smallest estimates fitting puts them first; given for the first layout's
    degrees alone, it puts that layout behind the others."""
    base, result = searched
    found, *_ = P.candidates(base, GPUS)
    capacity = P._room(base)
    plain = P.ordered(found, capacity)
    assert all(c.estimated_memory <= capacity for c in plain[:1])
    smallest = min(c.estimated_memory for c in found)
    everywhere = P.ordered(found, capacity, {("elsewhere",): capacity - smallest})
    assert everywhere[0].estimated_memory == smallest
    assert plain[0].estimated_memory > smallest  # the residual changed the first choice
    first = P._family(plain[0].layout)
    assert any(P._family(c.layout) != first for c in found)
    only = P.ordered(found, capacity, {first: capacity, ("elsewhere",): 0})
    assert P._family(only[0].layout) != first
    traced = result.traced[0]
    residual = capacity - traced.headroom - traced.candidate.estimated_memory
    assert residual > 0  # the reserve and the workspaces beyond the estimate
