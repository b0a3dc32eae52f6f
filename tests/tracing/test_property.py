"""Random small configurations: every one either is refused with a ConfigError before any model
is built, or traces, renders and reports without an internal error."""

import io

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from metatrace.analysis.analyze import analyze
from metatrace.config import job_from_dict
from metatrace.errors import ConfigError
from metatrace.export.report import job_report
from metatrace.render.run import render_run
from metatrace.tracing.trace import trace_job

recompute = st.one_of(
    st.just({}),
    st.fixed_dictionaries(
        {
            "granularity": st.just("full"),
            "method": st.sampled_from(["uniform", "block"]),
            "num_layers": st.integers(1, 2),
        }
    ),
    st.fixed_dictionaries(
        {
            "granularity": st.just("selective"),
            "modules": st.lists(
                st.sampled_from(["core_attn", "mlp", "layernorm"]),
                min_size=1,
                max_size=2,
                unique=True,
            ),
        }
    ),
)


@st.composite
def configs(draw):
    """Mostly valid layouts (degrees drawn first, dimensions made to fit), sometimes not."""
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3]))
    vpp = draw(st.sampled_from([None, 2])) if pp > 1 else None
    groups = tp * draw(st.sampled_from([1, 2]))
    heads = groups * draw(st.sampled_from([1, 2]))
    layers = pp * (vpp or 1) * draw(st.integers(1, 2))
    if draw(st.integers(0, 5)) == 0:  # now and then, something Megatron refuses
        layers, heads = draw(st.integers(1, 5)), draw(st.sampled_from([2, 3, 4]))
    micro = draw(st.integers(1, 2))
    return {
        "model": {
            "num_layers": layers,
            "hidden_size": heads * draw(st.sampled_from([8, 16])),
            "num_attention_heads": heads,
            "num_query_groups": groups,
            "ffn_hidden_size": tp * draw(st.sampled_from([16, 24])),
            "vocab_size": draw(st.integers(50, 300)),
            "normalization": draw(st.sampled_from(["LayerNorm", "RMSNorm"])),
            "activation": draw(st.sampled_from(["gelu", "swiglu", "squared_relu", "geglu"])),
            "add_bias_linear": draw(st.booleans()),
            "position_embedding_type": draw(st.sampled_from(["rope", "learned_absolute", "none"])),
            "untie_embeddings_and_output_weights": draw(st.booleans()),
            "hidden_dropout": draw(st.sampled_from([0.0, 0.1])),
            "attention_dropout": draw(st.sampled_from([0.0, 0.1])),
            "qk_layernorm": draw(st.booleans()),
        },
        "parallel": {
            "tp": tp,
            "pp": pp,
            "vpp": vpp,
            "dp": draw(st.sampled_from([None, 1, 2])),
            "sequence_parallel": draw(st.booleans()),
        },
        "training": {
            "seq_length": draw(st.sampled_from([16, 24, 32])),
            "micro_batch_size": micro,
            "global_batch_size": draw(st.sampled_from([None, micro * pp * 2, 5])),
            "precision": draw(st.sampled_from(["bf16", "fp16", "fp32"])),
            "recompute": draw(recompute),
        },
    }


def _clean(data):
    """Drop None values: they stand for keys a user leaves out."""
    return {
        section: {k: v for k, v in values.items() if v is not None}
        for section, values in data.items()
    }


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(configs())
def test_random_configs_have_no_internal_error(data):
    try:
        job = job_from_dict(_clean(data))
    except ConfigError:
        return
    analysis = analyze(trace_job(job, full_model=False))
    console = Console(file=io.StringIO(), width=120, color_system=None)
    render_run(analysis, console)
    report = job_report(analysis)
    assert sum(len(r["ranks"]) for r in report["roles"]) == job.cluster.num_gpus
