"""Helpers shared by both tiers (tests/unit, tests/tracing): paths, model sections and jobs
(small, from Hugging Face configs), the command line in a subprocess, the report's schema, and
checkers of traces (meta against real tensors), what autograd saves, and memory snapshots.

Importing this module imports nothing of metatrace's: each helper imports what it needs when
called, so the fast tier can use it without megatron-core.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
DEBUG = os.path.join(EXAMPLES, "debug.yaml")
GOLDEN = os.path.join(ROOT, "tests", "golden")
DATA = os.path.join(ROOT, "tests", "data")
HF = os.path.join(DATA, "hf")


# Model sections on the debug preset (h 64, 4 heads, ffn 128). MLA: every dimension distinct, so
# that a swapped one changes a count. MOE: 4 experts, top-2 routing.
MLA = {
    "multi_latent_attention": True,
    "num_query_groups": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_head_dim": 16,
    "qk_pos_emb_head_dim": 8,
    "v_head_dim": 12,
    "qk_layernorm": True,
}
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 96}
# The training section's routing for tests of balanced routing's closed forms (the default is
# random top-k routing, whose hottest expert gets more than its share).
BALANCED = {"moe_routing": "balanced"}

# A Megatron-LM command line of a small GPT job (tp 2, pp 2, sequence parallel) on 8 GPUs.
GPT_ARGS = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 16 "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
    "--bf16 --use-distributed-optimizer --vocab-file vocab.json --merge-file merges.txt "
    "--lr 1e-4 --train-iters 10 --no-gradient-accumulation-fusion"
)


def small_job(**sections):
    """A resolved job on the debug preset with `sections` merged in (tests' building block)."""
    from metatrace.config import job_from_dict

    data = {
        "model": {"preset": "debug"},
        "training": {"seq_length": 64, "micro_batch_size": 2},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return job_from_dict(data)


def hf_path(repo: str) -> str:
    """tests/data/hf/<repo>/config.json: the published config.json of that Hugging Face repo."""
    return os.path.join(HF, repo, "config.json")


def hf_job(repo_or_path: str, model=None, training=None, **sections):
    """A resolved job whose model section is a Hugging Face config (a repo under tests/data/hf,
    or a path), with `model` overrides and the other sections merged in."""
    from metatrace.config import job_from_dict

    path = repo_or_path if os.sep in repo_or_path else hf_path(repo_or_path)
    return job_from_dict(
        {
            "model": {"hf_config": path, **(model or {})},
            "training": {"seq_length": 64, "micro_batch_size": 1, **(training or {})},
            **sections,
        }
    )


def metatrace(*args, cwd=None):
    """`python -m metatrace *args` as a user runs it: the completed process, output as text."""
    return subprocess.run(
        [sys.executable, "-m", "metatrace", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=300,
    )


def write_job(tmp_path, text):
    """Write `text` to tmp_path/job.yaml; returns its path."""
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def report_validator():
    """A JSON Schema validator of the report schema shipped in the package."""
    import json
    from importlib import resources

    import jsonschema

    schema = json.loads(
        resources.files("metatrace.export").joinpath("report.schema.json").read_text()
    )
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def saved_storages(fn):
    """(fn()'s result, {storage: bytes}) of the distinct storages autograd saves while fn()
    runs, each once (as metatrace.tracing.measure counts them); told apart by their StorageImpl
    (meta storages all have data_ptr 0)."""
    import torch

    saved = {}

    def pack(t):
        st = t.untyped_storage()
        saved[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def collective_rows(trace):
    return [
        [c.op, c.group, list(c.shape), c.dtype, c.bytes, c.phase, c.module]
        for c in trace.collectives
    ]


def assert_meta_matches_real(job, world, role):
    """`role` traced on meta and on real CPU tensors: the same tensors saved for backward, the
    same collectives, the same activation bytes."""
    from metatrace.analysis import aggregate as agg
    from metatrace.tracing.trace import trace_role

    meta = trace_role(job, world, role, device="meta", also_track=("cpu",)).trace
    real = trace_role(job, world, role, device="cpu").trace
    saved = lambda t: [(s.module, s.shape, s.dtype, s.bytes, s.phase, s.static) for s in t.saved]
    assert saved(meta) == saved(real)
    assert collective_rows(meta) == collective_rows(real)
    assert agg.activation_bytes(meta) == agg.activation_bytes(real) > 0


# ------------------------------------------------------------------------ memory snapshots


def allocated_over_time(snap) -> list[int]:
    """Bytes allocated after every entry of the device trace, recomputed from the entries."""
    live, out = 0, []
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_completed":
            live -= e["size"]
        out.append(live)
    return out


def replay(snap) -> dict[int, tuple[int, list]]:
    """Replay the trace as an allocator would, checking every step: every allocation inside a
    segment the trace reserved before it (segment_alloc, or segment_map of expandable
    segments), none overlapping another live one; the blocks left at the end."""
    entries = snap["device_traces"][0]
    ranges: list[tuple[int, int]] = []
    live: dict[int, tuple[int, list]] = {}
    requested = None
    for e in entries:
        addr, size = e["addr"], e["size"]
        if e["action"] in ("segment_alloc", "segment_map"):
            assert all(addr + size <= a or a + s <= addr for a, s in ranges), e
            ranges.append((addr, size))
            ranges.sort()
            merged: list[tuple[int, int]] = []  # pages mapped next to each other: one range
            for a, s in ranges:
                if merged and sum(merged[-1]) == a:
                    merged[-1] = (merged[-1][0], merged[-1][1] + s)
                else:
                    merged.append((a, s))
            ranges = merged
        elif e["action"] == "alloc":
            assert requested is None
            assert any(a <= addr and addr + size <= a + s for a, s in ranges), e
            assert size > 0 and addr % 512 == 0
            assert all(addr + size <= a or a + s <= addr for a, (s, _) in live.items()), e
            live[addr] = (size, e["frames"])
        elif e["action"] == "free_requested":
            assert requested is None and live[addr][0] == size, e
            requested = addr
        else:
            assert e["action"] == "free_completed" and requested == addr, e
            del live[addr]
            requested = None
    assert requested is None
    return live


def reserved_over_time(snap) -> list[int]:
    """Bytes the trace's segments hold after every entry."""
    held, out = 0, []
    for e in snap["device_traces"][0]:
        if e["action"] in ("segment_alloc", "segment_map"):
            held += e["size"]
        elif e["action"] in ("segment_free", "segment_unmap"):
            held -= e["size"]
        out.append(held)
    return out


def hybrid_params(model, padded_vocab: int) -> tuple[int, int]:
    """(parameters, parameters active per token) of a whole model with Mamba-2, Gated DeltaNet,
    attention, MLP and MoE layers, from megatron-core's module shapes (RMSNorm, no biases):

    - Mamba-2 (megatron/core/ssm/mamba_mixer.py), d_inner = heads x head_dim: in_proj
      h x (2 d_inner + 2 groups state + heads) with its fused norm (h), conv1d over
      d_inner + 2 groups state channels (kernel 4, a bias each), dt_bias, A_log and D (one a
      head), the gated norm (d_inner), out_proj d_inner x h.
    - Gated DeltaNet (gated_delta_net.py), qk = key heads x key_dim, v = value heads x
      value_dim: in_proj h x (2 qk + 2 v + 2 value heads) and its fused norm (h), conv1d over
      2 qk + v channels (no bias), dt_bias and A_log (one a value head), out_norm (value_dim),
      out_proj v x h.
    - attention: linear_qkv h x (heads + 2 groups) kv_channels, + heads x kv_channels with the
      output gate, and its fused norm; q/k norms (kv_channels each) in GPT layers with
      qk_layernorm (the hybrid stack's attention has none); linear_proj.
    - MLP: fc1 (two matrices gated) with its fused norm, fc2. MoE: pre-MLP norm, router
      (experts x h), routed experts over the latent width (or h) with the latent projections
      (2 h latent), shared experts over h and their sigmoid gate (h).
    - embedding, an untied output layer (padded vocabulary x h each), the final norm.
    """
    from metatrace.config.hybrid import parse
    from metatrace.config.release import since

    m = model
    h, gated = m.hidden_size, 2 if m.activation in ("swiglu", "geglu", "quick_geglu") else 1
    a, d = m.num_attention_heads, m.kv_channels
    heads = m.mamba_num_heads or 0  # resolved for hybrid models only
    inner = heads * m.mamba_head_dim
    conv = inner + 2 * m.mamba_num_groups * m.mamba_state_dim
    mamba = h + h * (conv + inner + heads) + 5 * conv + 3 * heads + inner + inner * h
    qk = m.linear_num_key_heads * m.linear_key_head_dim
    v = m.linear_num_value_heads * m.linear_value_head_dim
    nv = m.linear_num_value_heads
    gdn = h + h * (2 * qk + 2 * v + 2 * nv) + (2 * qk + v) * m.linear_conv_kernel_dim
    gdn += 2 * nv + m.linear_value_head_dim + v * h
    qkv = (a + 2 * m.num_query_groups) * d + (a * d if m.attention_output_gate else 0)
    attention = h + h * qkv + a * d * h
    mlp = h + gated * h * m.ffn_hidden_size + m.ffn_hidden_size * h
    experts, shared = 0, 0
    if m.num_experts:
        width = m.moe_latent_size or h
        experts = m.num_experts * (gated + 1) * width * m.moe_ffn_hidden_size
        shared = (gated + 1) * h * (m.moe_shared_expert_intermediate_size or 0)
        shared += 2 * h * m.moe_latent_size if m.moe_latent_size else 0
        shared += h if m.moe_shared_expert_gate else 0
    moe = h + (m.num_experts or 0) * h + shared  # without the routed experts
    if m.hybrid_layer_pattern is not None:
        layers = parse(m.hybrid_layer_pattern, since_0_19=since(0, 19)).layers
    else:  # a GPT model: a mixer ('*' or 'G') and an MLP ('-' or 'E') a layer
        freq = m.linear_attention_freq
        if isinstance(freq, int):
            freq = [0 if (i + 1) % freq == 0 else 1 for i in range(m.num_layers)]
        moe_freq = m.moe_layer_freq if m.num_experts else [0] * m.num_layers
        layers = "".join(
            ("G" if freq and freq[i] else "*") + ("E" if moe_freq[i] else "-")
            for i in range(m.num_layers)
        )
        attention += 2 * d if m.qk_layernorm else 0
    per = {"M": mamba, "G": gdn, "*": attention, "-": mlp, "E": moe}
    dense = sum(per[s] for s in layers)
    dense += padded_vocab * h * (2 if m.untie_embeddings_and_output_weights else 1) + h
    routed = layers.count("E") * experts
    active = layers.count("E") * experts * m.moe_router_topk // m.num_experts if experts else 0
    return dense + routed, dense + active


class _Launches:
    """Stands in for the recorder's host count: the kernels reported."""

    def __init__(self):
        self.launches = 0

    def kernel(self, ps, launches):
        self.launches += launches


def priced(fn):
    """(picoseconds, launches) the stand-ins report while fn() runs, at an H100's rates."""
    from metatrace.config.kernels import kernel_model
    from metatrace.hooks import flops

    host = _Launches()
    count = flops.FlopCount(kernel_model("h100"), host)
    flops.push(count)
    try:
        fn()
    finally:
        flops.pop(count)
    return count.ps, host.launches
