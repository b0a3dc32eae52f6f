"""The time model against published training throughput (issue 21).

    python bench/throughput.py [--only TEXT] [--calibration FILE] [--json OUT]

Every row of ../shared/calibration/throughput.jsonl is laid out as a job (its model, GPUs and
parallel degrees as printed; what the source leaves out filled by one rule per source family,
listed in ASSUMED below, never per row), traced without the full model, and its iteration time
predicted (metatrace.analysis.timing). The published step time is the row's own (printed or
derived from tokens/s), else the row's TFLOP/s per GPU turned into seconds with the FLOP formula
its source uses (FORMULAS). Prints predicted / published per row with the shares of the predicted
iteration (metatrace.analysis.timing.breakdown: compute, communication in the steps, pipeline
idle, optimizer step), then the median |error| and the worst row, dense and MoE apart.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared", "calibration")
CALIBRATION = [
    os.path.join(SHARED, "throughput.jsonl"),
    os.path.join(SHARED, "throughput-2026.jsonl"),
]

# What each source family leaves out, filled the same way for every row of the family.
ASSUMED = {
    "megatron-lm-h100": "GPT (LayerNorm, GeLU, learned positions, biases, tied embeddings), "
    "FFN 4h, bf16, micro-batch 1, sequence parallel, TP communication overlap, the "
    "distributed optimizer with overlapped gradient reduce and parameter gather (as printed)",
    "megatron-lm-a100": "GPT as above, attention heads as the paper's Table 1 prints them "
    "(PAPER_HEADS; head dim 128 where neither prints them), vocab 51,200 where not printed, "
    "fp16, full recompute (the paper counts its FLOPs), micro-batch 1, the distributed "
    "optimizer off (2021), no sequence parallel (2021), megatron-core's local layers with "
    "Megatron's own attention and fused softmax (2021: no Transformer Engine, no flash "
    "attention)",
    "llama3": "Llama 3 405B, micro-batch 1, the paper's interleaved schedule at its least "
    "degree (2 virtual stages per rank: the paper does not print it) with one layer fewer on "
    "the first and last stages (the paper), the distributed optimizer with overlap, context "
    "parallel by all-gathering K and V (the paper, Sec. 3.3.2: its latency exposed)",
    "deepseek-v3": "examples/deepseek-v3-2048gpu.yaml's interleaved layout (the MTP layer with "
    "the loss: metatrace does not trace megatron-core's 'Et*3|(tt|)*29,m|L'), "
    "FP8 blockwise, micro-batch 1; DualPipe's overlap of the expert all-to-alls with the other "
    "micro-batch's compute (the report, Sec. 3.2.1) as megatron-core's counterpart, "
    "overlap_moe_expert_parallel_comm; the report's dispatch kernels (Sec. 3.2.2: a token "
    "crosses IB once per target node, then NVLink) as megatron-core's, the flex dispatcher "
    "with DeepEP",
    "mixtral": "the Megatron-Core MoE README's mapping, all-to-all dispatcher, grouped GEMM, "
    "balanced routing, the distributed optimizer with overlap",
    "nemo": "the NeMo model configs (Llama presets, GPT-3 as above, Nemotron: squared ReLU, "
    "LayerNorm, RoPE, no biases, vocab 256,000), FP8 delayed scaling, sequence parallel and TP "
    "communication overlap where tp > 1, the distributed optimizer with overlap",
    "mbridge": "the recipe's settings as the row gives them (MBRIDGE_PRESETS for the models); "
    "DGX B200/B300/H100 nodes of 8, GB200/GB300 trays of 4 in NVL72 racks, 64 GPUs of a "
    "rack to a job (16 of its 18 trays: the rack is the NVLink domain); force-balanced "
    "routing (the tables' footnote); Transformer Engine's per-module graphs of the recipe's "
    "scope (attn, mamba, moe_router, moe_preprocess); what metatrace does not model said per "
    "row (MBRIDGE_LEFT_OUT)",
}

# GPU families the summary reports apart.
GENERATION = {
    "a100": "Ampere",
    "h100": "Hopper",
    "h800": "Hopper",
    "h200": "Hopper",
    "b200": "Blackwell",
    "gb200": "Blackwell",
    "b300": "Blackwell",
    "gb300": "Blackwell",
}

# Megatron-Bridge recipe models -> metatrace presets (the rows' dimensions are the presets').
MBRIDGE_PRESETS = {
    "Llama 3.1 405B": "llama3.1-405b",
    "Llama 3 70B": "llama3-70b",
    "DeepSeek-V3": "deepseek-v3",
    "GPT-OSS-120B": "gpt-oss-120b",
    "Qwen3-30B-A3B": "qwen3-30b-a3b",
    "Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Nemotron 3 Nano": "nemotron-3-nano-30b-a3b",
    "Nemotron 3 Super": "nemotron-3-super-120b-a12b",
}

# What a Megatron-Bridge row cannot be built with yet, by a word of its settings.
MBRIDGE_UNBUILDABLE = {
    "Muon": "the Muon optimizer (not modelled: docs/megatron-core-releases.md says why)",
}

# Recipe settings metatrace does not model (megatron-core 0.18-0.19 features, kernels without a
# stand-in): named in the output, left out of the job.
MBRIDGE_LEFT_OUT = (
    ("fp8_dot_product_attention=True", "FP8 attention"),
    ("moe_paged_stash", "paged stash and the experts padded for the graph"),
    ("cutedsl_fused_grouped_mlp", "cuteDSL fused grouped MLP"),
)


# Narayanan et al. 2021, Table 1: attention heads by hidden size (the README's table omits them).
PAPER_HEADS = {
    2304: 24,
    3072: 32,
    4096: 32,
    6144: 48,
    8192: 64,
    10240: 80,
    12288: 96,
    16384: 128,
    20480: 128,
    25600: 160,
}


def family(name: str) -> str:
    for key in ("megatron-lm-h100", "megatron-lm-a100", "llama3", "deepseek-v3", "nemo", "mbridge"):
        if name.startswith(key):
            return key
    return "mixtral" if "mixtral" in name else "other"


def _gpu(text: str) -> str:
    text = text.lower()
    for name in ("h100", "h800", "a100", "h200", "gb200", "gb300", "b200", "b300"):
        if name in text:
            return name
    raise ValueError(text)


def _gpt(m: dict, *, vocab: int) -> dict:
    """GPT-3's architecture (the gpt3-175b preset's) with the row's dimensions."""
    from metatrace.config.presets import PRESETS

    h = m["hidden_size"]
    base = dict(PRESETS["gpt3-175b"].dims)
    del base["max_position_embeddings"]  # the sequence length
    return {
        **base,
        "num_layers": m["num_layers"],
        "hidden_size": h,
        "ffn_hidden_size": m.get("ffn_hidden_size") or 4 * h,
        "num_attention_heads": m.get("num_attention_heads") or h // 128,
        "vocab_size": m.get("vocab_size") or vocab,
    }


def unbuildable(row: dict) -> str | None:
    """Why a row cannot be laid out as a job yet, or None."""
    text = json.dumps(row["model"]) + json.dumps(row["training"])
    return next((why for word, why in MBRIDGE_UNBUILDABLE.items() if word in text), None)


def left_out(row: dict) -> list[str]:
    """The row's settings metatrace does not model (a Megatron-Bridge row's)."""
    text = json.dumps(row["training"])
    return [what for word, what in MBRIDGE_LEFT_OUT if word in text]


def _mbridge_layout(row: dict) -> dict:
    """The pipeline split of a Megatron-Bridge recipe as parallel keys."""
    tr, layers = row["training"], row["model"]["num_layers"]
    layout = tr.get("pipeline_layout", "")
    if layout.startswith("E"):
        return {"layout": layout.split()[0]}
    if "= E" in layout:
        return {"layout": layout.split("= ")[1].rstrip(")")}
    if "recipe map" in layout:  # [emb+a], n x [b], [c+MTP+loss]
        first, middle, times, last = re.search(
            r"\[emb\+(\d+)\], (\d+)x\[(\d+)\], \[(\d+)\+", layout
        ).group(1, 3, 2, 4)
        mtp = "m" if "MTP" in layout else ""
        t = lambda n: f"t*{n}" if int(n) > 1 else "t"
        return {"layout": f"E{t(first)}|({t(middle)}|)*{times}{t(last)}{mtp}L"}
    split = tr.get("pipeline_split", "")
    if "no embedding" in split:
        return {}
    if "embedding" in split:
        return {"account_for_embedding": True, "account_for_loss": True}
    if split and str(layers) not in split.split("/")[0]:
        raise ValueError(f"pipeline split not understood: {split}")
    return {}


def _preset_dims(name: str) -> dict:
    from metatrace.config.presets import PRESETS

    return PRESETS[name].dims


def _since_0_19() -> bool:
    from metatrace.config import release

    return release.since(0, 19)


def _hybrid_mtp(preset: str, mtp: str, notes: list) -> dict:
    """A hybrid recipe's multi-token prediction ("1 MTP block (pattern '*E') applied
    mtp_num_layers=2 times (mtp_use_repeated_layer=True)") as model keys: under megatron-core
    0.19 the pattern's depths after '/' and the repeated layer; 0.16.1 builds none (noted)."""
    block = re.search(r"pattern '([^']+)'", mtp).group(1)
    depths = int(re.search(r"mtp_num_layers=(\d+)", mtp).group(1))
    if not _since_0_19():
        notes.append("multi-token prediction (megatron-core 0.16.1: none in hybrid models)")
        return {}
    if "BF16" in mtp:
        notes.append("the MTP block in BF16")
    pattern = _preset_dims(preset)["hybrid_layer_pattern"] + f"/{block}" * depths
    return {
        "hybrid_layer_pattern": pattern,
        "mtp_use_repeated_layer": "mtp_use_repeated_layer=True" in mtp,
    }


def _mbridge(
    row: dict, parallel: dict, training: dict, cluster: dict, notes: list
) -> tuple[dict, dict]:
    """(model, implementation) of a Megatron-Bridge recipe row; fills the other sections and
    appends to `notes` what of the recipe metatrace leaves out."""
    m, par, tr = row["model"], row["parallel"], row["training"]
    name = next(k for k in MBRIDGE_PRESETS if m["name"].startswith(k))
    model = {"preset": MBRIDGE_PRESETS[name]}
    if m.get("vocab_size"):
        model["vocab_size"] = m["vocab_size"]
    hybrid = "hybrid_layer_pattern" in _preset_dims(model["preset"])
    if hybrid and "mtp" in m:
        model.update(_hybrid_mtp(model["preset"], m["mtp"], notes))
    if "GB" in row["system"]:  # trays of 4; a job takes 16 of an NVL72 rack's 18 trays: 64
        cluster.update(gpus_per_node=4, nvlink_domain=64)
    parallel["sequence_parallel"] = bool(par.get("sequence_parallel"))
    if par.get("etp"):
        parallel["etp"] = par["etp"]
    if (par.get("pp") or 1) > 1:
        parallel.update(_mbridge_layout(row))
    overlap = tr.get("comm_overlap") or {}
    precision = tr["precision"].lower()
    parallel["tp_comm_overlap"] = str(overlap.get("tp_comm_overlap", "")).startswith("on")
    if parallel["tp_comm_overlap"] and precision == "mxfp8":
        parallel["tp_comm_overlap"] = False
        notes.append("TP communication overlap (metatrace: not with MXFP8 yet)")
    detail = tr.get("precision_detail", "")
    if precision.startswith("fp8"):
        training.update(precision="fp8", fp8_recipe="tensorwise")
    elif precision == "mxfp8":
        training.update(precision="fp8", fp8_recipe="mxfp8")
    elif precision.startswith("nvfp4"):
        training.update(precision="fp4", fp4_recipe="nvfp4")
        if hybrid and not _since_0_19():
            notes.append("NVFP4 in the hybrid layers (megatron-core 0.16.1 runs them in bf16)")
        if "fp4_param_gather=True" in detail:
            notes.append("FP4 parameter gathering (megatron-core 0.16.1 has none)")
    else:
        raise ValueError(f"precision {tr['precision']!r} is not modelled yet")
    if training["precision"] == "fp8":
        training["fp8_param_gather"] = "fp8_param_gather=True" in detail or (
            "fp8_param_gather" in detail and "OFF" not in detail
        )
    training["distributed_optimizer"] = bool(tr.get("distributed_optimizer"))
    training["overlap_grad_reduce"] = bool(overlap.get("dp_overlap_grad_reduce"))
    training["overlap_param_gather"] = bool(overlap.get("dp_overlap_param_gather"))
    training["overlap_param_gather_with_optimizer_step"] = bool(
        overlap.get("overlap_param_gather_with_optimizer_step")
    )
    training["grad_reduce_in_fp32"] = bool(tr.get("grad_reduce_in_fp32"))
    if "BF16 main grads" in tr.get("optimizer", ""):
        training.update(
            use_precision_aware_optimizer=True,
            main_grads_dtype="bf16",
            exp_avg_dtype="bf16",
            exp_avg_sq_dtype="bf16",
        )
    recompute = tr.get("recompute", "none")
    if recompute.startswith("selective:"):
        modules = [x.strip() for x in recompute.split(":")[1].split(",")]
        training["recompute"] = {"granularity": "selective", "modules": modules}
    if tr.get("megatron_fsdp") or (overlap.get("fsdp") or "").startswith("Megatron-FSDP"):
        training.update(
            megatron_fsdp=True,
            fsdp_sharding_strategy="optim_grads_params",
            fsdp_double_buffer=True,
            distributed_optimizer=True,
        )
    offload = tr.get("offloading", "none")
    if "cpu_offloading_num_layers=" in offload:
        training["cpu_offloading_num_layers"] = int(
            offload.split("cpu_offloading_num_layers=")[1].split(")")[0]
        )
    graphs, moe = tr.get("cuda_graphs", "none"), tr.get("moe")
    if "full_iteration" in graphs and moe:
        notes.append("the whole-iteration CUDA graph (metatrace: not with MoE models yet)")
    elif "full_iteration" in graphs:
        training.update(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"])
    elif graphs.startswith("Transformer Engine") and moe and moe.get("ep_a2a_overlap"):
        notes.append("CUDA graphs with the EP all-to-all overlap (metatrace: not modelled)")
    elif graphs.startswith("Transformer Engine"):
        listed = re.search(r"scope \[([^\]]*)\]", graphs)
        scope = [x.strip() for x in listed.group(1).split(",")] if listed else ["attn"]
        training.update(cuda_graph_impl="transformer_engine", cuda_graph_scope=scope)
    impl = {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te"}
    if moe:
        training["moe_routing"] = "balanced"  # force-balanced (the tables' footnote)
        dispatcher = moe["token_dispatcher"]
        if dispatcher.startswith("flex"):
            backend = "hybridep" if "HybridEP" in dispatcher else "deepep"
            parallel.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend)
            if "moe_hybridep_num_sms=" in dispatcher:
                sms = int(re.match(r"\d+", dispatcher.split("moe_hybridep_num_sms=")[1]).group())
                parallel["moe_hybridep_num_sms"] = sms
            training["moe_router_dtype"] = "fp32"  # what DeepEP and HybridEP take
        else:
            parallel["moe_token_dispatcher_type"] = "alltoall"
        if moe.get("ep_a2a_overlap"):
            parallel.update(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
        parallel["moe_shared_expert_overlap"] = bool(moe.get("shared_expert_overlap"))
        if model["preset"].startswith("gpt-oss"):  # expert biases: TEGroupedMLP refuses it
            impl["bias_dropout_fusion"] = False
        impl.update(
            moe_grouped_gemm=bool(moe.get("grouped_gemm")),
            moe_permute_fusion=bool(moe.get("permute_fusion")),
            moe_router_fusion=bool(moe.get("router_fusion")),
        )
    return model, impl


def job_for(row: dict, notes: list | None = None) -> dict:
    """The job dict of a calibration row (see ASSUMED); `notes` gets what of the row's settings
    the job leaves out."""
    notes = [] if notes is None else notes
    fam, m, par, tr = family(row["name"]), row["model"], row["parallel"], row["training"]
    derived = row.get("derived") or {}
    tp = par.get("tp") or derived.get("tp") or 1
    pp = par.get("pp") or derived.get("pp") or 1
    vpp = par.get("vpp") if (par.get("vpp") or 1) > 1 else None
    cp = par.get("cp") or 1
    ep = par.get("ep") or 1
    gbs = tr.get("global_batch_size") or derived.get("global_batch_size")
    parallel = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "sequence_parallel": tp > 1}
    if vpp:
        parallel["vpp"] = vpp
    training = {
        "seq_length": tr["seq_length"],
        "micro_batch_size": tr.get("micro_batch_size") or 1,
        "global_batch_size": gbs,
        "distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    }
    cluster = {"num_gpus": row["num_gpus"], "gpus_per_node": 8, "gpu": _gpu(row["gpu"])}
    impl: dict = {}
    if fam == "megatron-lm-h100":
        model = _gpt(m, vocab=131072)
        parallel["tp_comm_overlap"] = tp > 1
    elif fam == "megatron-lm-a100":
        h = m["hidden_size"]
        model = _gpt(
            {**m, "num_attention_heads": m["num_attention_heads"] or PAPER_HEADS.get(h)},
            vocab=51200,
        )
        parallel["sequence_parallel"] = False
        impl = {"transformer_impl": "local", "attention_backend": "local"}
        training.update(
            precision="fp16",
            recompute={"granularity": "full", "method": "uniform", "num_layers": 1},
            distributed_optimizer=False,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
        )
    elif fam == "llama3":
        model = {"preset": "llama3.1-405b", "vocab_size": m["vocab_size"]}
        if cp > 1:
            parallel["cp_comm_type"] = "all_gather"
        if pp > 1:  # 2 virtual stages per rank; the first and the last one layer short
            per = -(-m["num_layers"] // pp) // 2
            if (2 * pp * per - m["num_layers"]) != 2:
                raise ValueError(f"{m['num_layers']} layers are not {2 * pp} x {per} - 2")
            short = "t" * (per - 1)
            parallel["layout"] = f"E{short}|({'t' * per}|)*{2 * pp - 2}{short}L"
    elif fam == "deepseek-v3":
        model = {"preset": "deepseek-v3"}
        # 120 micro-batches: interleaved groups of 24 (a multiple of none of pp's 16)
        parallel.update(
            layout="Et|(tt|)*30mL",
            moe_token_dispatcher_type="flex",
            moe_flex_dispatcher_backend="deepep",
            microbatch_group_size=24,
            overlap_moe_expert_parallel_comm=True,
        )
        training.update(
            precision="fp8",
            fp8_recipe="blockwise",
            moe_router_dtype="fp32",
            recompute={"granularity": "selective", "modules": ["layernorm", "mla_up_proj"]},
        )
        impl = {"moe_grouped_gemm": True, "moe_permute_fusion": True}
    elif fam == "mbridge":
        model, impl = _mbridge(row, parallel, training, cluster, notes)
    elif fam == "mixtral":
        model = {"preset": "mixtral-8x7b"}
        parallel["moe_token_dispatcher_type"] = "alltoall"
        impl = {"moe_grouped_gemm": True}
    else:  # nemo
        name = m["name"].lower()
        if name.startswith("llama"):
            preset = {
                "llama2-7b": "llama2-7b",
                "llama2-13b": "llama2-13b",
                "llama2-70b": "llama2-70b",
                "llama3-8b": "llama3-8b",
                "llama3-70b": "llama3-70b",
            }[name]
            model = {"preset": preset}
        elif name.startswith("gpt3"):
            model = _gpt(m, vocab=51200)
        else:  # Nemotron
            model = {
                "num_layers": m["num_layers"],
                "hidden_size": m["hidden_size"],
                "ffn_hidden_size": m["ffn_hidden_size"],
                "num_attention_heads": m["num_attention_heads"],
                "num_query_groups": m.get("num_query_groups"),
                "vocab_size": m.get("vocab_size") or 256000,
                "position_embedding_type": "rope",
                "normalization": "LayerNorm",
                "activation": "squared_relu",
                "add_bias_linear": False,
                "untie_embeddings_and_output_weights": True,
                "hidden_dropout": 0.0,
                "attention_dropout": 0.0,
            }
        parallel["tp_comm_overlap"] = tp > 1
        training.update(precision="fp8", fp8_recipe="delayed")
    model = {k: v for k, v in model.items() if v is not None}
    job = {"model": model, "parallel": parallel, "training": training, "cluster": cluster}
    if impl:
        job["implementation"] = impl
    return job


def megatron_flops(job) -> float:
    """Megatron-LM's num_floating_point_operations (training.py, core_r0.8): forward and
    backward, per iteration, causal attention not halved, SwiGLU's three matrices counted as
    3/2 of a plain MLP's two (gated_linear_multiplier; megatron-bridge's flop_utils.py keeps
    the same)."""
    m, tr = job.model, job.training
    h, L, s = m.hidden_size, m.num_layers, tr.seq_length
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    gated = 3 / 2 if m.activation == "swiglu" else 1
    routed = m.moe_router_topk if m.num_experts else 1
    ffn = (m.moe_ffn_hidden_size or m.ffn_hidden_size) if m.num_experts else m.ffn_hidden_size
    q_ratio = m.kv_channels * heads / h
    return (
        12
        * tr.global_batch_size
        * s
        * L
        * h
        * h
        * (
            (1 + groups / heads + s / h) * q_ratio
            + ffn / h * routed * gated
            + job.padded_vocab_size / (2 * L * h)
        )
    )


def narayanan_flops(job) -> float:
    """Narayanan et al. 2021, Sec. 5.1: 96 B s l h^2 (1 + s/6h + V/16lh), with the recompute
    forward."""
    m, tr = job.model, job.training
    h, L, s, V = m.hidden_size, m.num_layers, tr.seq_length, m.vocab_size
    return 96 * tr.global_batch_size * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


FORMULAS = {"megatron-lm-a100": narayanan_flops}


def published_seconds(row: dict, job) -> tuple[float, str]:
    pub, derived = row["published"], row.get("derived") or {}
    if pub.get("time_per_step_s"):
        return pub["time_per_step_s"], "printed"
    if derived.get("time_per_step_s"):
        return derived["time_per_step_s"], "derived"
    fam = family(row["name"])
    flops = FORMULAS.get(fam, megatron_flops)(job)
    return flops / (pub["tflops_per_gpu"] * 1e12 * row["num_gpus"]), "TFLOP/s"


def predict(job_dict: dict):
    from metatrace.analysis.timing import job_timing
    from metatrace.config import job_from_dict, resolve
    from metatrace.tracing.trace import trace_job

    job = resolve(job_from_dict(job_dict))
    traced = trace_job(job, full_model=False)
    return job, job_timing(traced)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="rows whose name contains this")
    parser.add_argument(
        "--calibration",
        action="append",
        help="a throughput file (repeatable; default both of ../shared/calibration's)",
    )
    parser.add_argument("--json", help="write the rows' figures here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # megatron-core's advice for real runs
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # fake process groups warn in C++
    from metatrace.analysis.timing import breakdown
    from metatrace.tracing.trace import shared_workers

    rows = [
        json.loads(line)
        for path in args.calibration or CALIBRATION
        for line in open(path)
        if line.strip()
    ]
    rows = [r for r in rows if args.only in r["name"]]
    out = []
    print(
        f"{'row':44} {'GPUs':>6} {'published':>10} {'predicted':>10} {'ratio':>6}  "
        "comp comm idle  opt  trace"
    )
    with shared_workers():
        for row in rows:
            start = time.perf_counter()
            why = unbuildable(row)
            if why:
                print(f"{row['name']:44} {row['num_gpus']:>6} not built: {why}")
                out.append({"name": row["name"], "not_built": why})
                continue
            missing = left_out(row)
            try:
                job_dict = job_for(row, missing)
                job, timing = predict(job_dict)
            except Exception as exc:  # a row metatrace cannot lay out: say so, go on
                print(f"{row['name']:44} {row['num_gpus']:>6} failed: {exc}")
                out.append({"name": row["name"], "error": str(exc)})
                continue
            pub, how = published_seconds(row, job)
            pred = timing.iteration_seconds
            ratio = pred / pub
            took = time.perf_counter() - start
            b = breakdown(timing)
            shares = [b.compute, b.communication, b.idle, b.optimizer + b.offload]
            parts = " ".join(f"{x / pred:>4.0%}" for x in shares)  # of the predicted time
            print(
                f"{row['name']:44} {row['num_gpus']:>6} {pub:>9.3f}s {pred:>9.3f}s "
                f"{ratio:>6.2f}  {parts}  {took:.0f} s ({how})",
                flush=True,
            )
            moe = bool(job.model.num_experts)
            if missing:
                print(f"{'':44} not modelled: {', '.join(missing)}")
            out.append(
                {
                    "name": row["name"],
                    "moe": moe,
                    "gpu": job.cluster.gpu,
                    "generation": GENERATION.get(job.cluster.gpu, job.cluster.gpu),
                    "not_modelled": missing,
                    "published_s": pub,
                    "predicted_s": pred,
                    "ratio": ratio,
                    "published_from": how,
                    "bubble": timing.bubble_fraction,
                    "breakdown": b.to_json(),
                }
            )
    good = [r for r in out if "ratio" in r]
    for label, pick in (("all", good), ("dense", [r for r in good if not r["moe"]])):
        _summary(label, pick)
    _summary("MoE", [r for r in good if r["moe"]])
    for gen in dict.fromkeys(r["generation"] for r in good):
        _summary(gen, [r for r in good if r["generation"] == gen])
    failed = [r["name"] for r in out if "error" in r]
    if failed:
        print(f"failed: {', '.join(failed)}")
    skipped = [r for r in out if "not_built" in r]
    if skipped:
        print(
            f"not built ({len(skipped)}): "
            + "; ".join(dict.fromkeys(r["not_built"] for r in skipped))
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _summary(label: str, rows: list) -> None:
    if not rows:
        return
    errors = [abs(r["ratio"] - 1) for r in rows]
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    print(
        f"{label}: {len(rows)} rows, median |error| {statistics.median(errors):.1%} "
        f"worst {worst['name']} at {worst['ratio']:.2f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
