"""Transformer Engine's userbuffers (parallel.tp_comm_overlap): the buffers TE 2.8's
initialize_ub allocates (metatrace.config.userbuffers), the checks Megatron-LM and TE make, and
the Megatron-LM flags. Buffer shape [seq * mbs / cp, hidden]; 12 GEMMs: 8 all-gather (qkv_fprop,
qkv_dgrad, proj_dgrad, proj_wgrad, fc1_fprop, fc1_dgrad, fc2_dgrad, fc2_wgrad), 4 reduce-scatter
(proj_fprop, fc2_fprop, qkv_wgrad, fc1_wgrad)."""

import pytest

from metatrace.config import job_from_dict
from metatrace.config.megatron.args import job_from_args
from metatrace.config.userbuffers import userbuffer_bytes, userbuffers
from metatrace.errors import ConfigError

SEQ, MBS, H = 4096, 2, 4096


def ub_job(tp=4, cp=1, precision="bf16", cfg=None, **parallel):
    training = {"seq_length": SEQ, "micro_batch_size": MBS, "precision": precision}
    if precision == "fp8":
        training["fp8_recipe"] = "tensorwise"
    par = {"tp": tp, "cp": cp, "sequence_parallel": True, "tp_comm_overlap": True, **parallel}
    if cfg is not None:
        par["tp_comm_overlap_cfg"] = cfg
    return job_from_dict(
        {
            "model": {"preset": "llama3-8b", "num_layers": 2},
            "parallel": par,
            "training": training,
            "implementation": {"transformer_impl": "transformer_engine"},
            "cluster": {"num_gpus": tp * cp, "gpu": "h100"},
        }
    )


def test_default_buffers_are_twelve_full_bf16_buffers():
    rows = SEQ * MBS // 2  # cp 2 splits the sequence
    bufs = userbuffers(ub_job(cp=2))
    assert len(bufs) == 12
    assert {b.shape for b in bufs} == {(rows, H)}
    assert userbuffer_bytes(ub_job(cp=2)) == 12 * rows * H * 2


def test_fp8_makes_the_all_gather_buffers_one_byte():
    rows = SEQ * MBS
    assert userbuffer_bytes(ub_job(precision="fp8")) == 8 * rows * H + 4 * rows * H * 2


def test_ring_exchange_reduce_scatter_keeps_2tp_minus_1_chunks():
    # Megatron-Bridge's userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192 style: proj_fprop and
    # fc2_fprop by ring exchange.
    cfg = {
        "proj_fprop": {"method": "ring_exchange", "num_sm": 1, "set_sm_margin": True},
        "fc2_fprop": {"method": "ring_exchange", "num_sm": 1, "set_sm_margin": True},
    }
    tp, full = 4, SEQ * MBS * H * 2
    extra = 2 * (full // tp * (2 * tp - 1) - full)
    assert userbuffer_bytes(ub_job(tp=tp, cfg=cfg)) == 12 * full + extra


def test_a_pipelined_dgrad_becomes_a_reduce_scatter_and_its_wgrad_an_all_gather():
    cfg = {"fc1_dgrad": {"method": "pipeline", "fp8_buf": True}}
    bufs = {b.name: b for b in userbuffers(ub_job(precision="fp8", cfg=cfg))}
    assert bufs["fc1_dgrad"].reduce_scatter and bufs["fc1_dgrad"].method == "pipeline"
    assert bufs["fc1_dgrad"].fp8  # fp8_buf honoured for a pipeline reduce-scatter
    assert not bufs["fc1_wgrad"].reduce_scatter and not bufs["fc1_wgrad"].fp8
    assert bufs["fc1_wgrad"].method == "bulk"


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"qkv_fprop": {"method": "pipeline"}}, "cannot all-gather"),
        ({"proj_wgrad": {"method": "bulk"}}, "method external"),
        (
            {"qkv_dgrad": {"method": "ring_exchange"}, "qkv_wgrad": {"method": "bulk"}},
            "takes no qkv_wgrad entry",
        ),
    ],
)
def test_configurations_te_refuses_are_refused(cfg, message):
    with pytest.raises(ConfigError, match=message):
        ub_job(cfg=cfg)


def test_unknown_setting_names_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'parallel.tp_comm_overlap_cfg.qkv_fprop"):
        ub_job(cfg={"qkv_fprop": {"methd": "bulk"}})


def test_what_te_or_megatron_core_refuses_or_is_not_modelled_with_fp8_is_refused():
    with pytest.raises(ConfigError, match="tp_comm_overlap_rs_dgrad under FP8"):
        ub_job(precision="fp8", tp_comm_overlap_rs_dgrad=True)
    with pytest.raises(ConfigError, match="fc2_fprop.fp8_buf under FP8"):
        ub_job(precision="fp8", cfg={"fc2_fprop": {"method": "pipeline", "fp8_buf": True}})
    with pytest.raises(ConfigError, match="atomic GEMM overlap for FP8 only"):
        ub_job(cfg={"qkv_fprop": {"atomic_gemm": True}})
    assert ub_job(precision="fp8", cfg={"qkv_fprop": {"atomic_gemm": True}})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"parallel": {"sequence_parallel": False}}, "needs parallel.sequence_parallel"),
        ({"implementation": {"transformer_impl": "local"}}, "needs implementation"),
        ({"training": {"precision": "fp8", "fp8_recipe": "mxfp8"}}, "not modelled yet"),
        ({"model": {"mtp_num_layers": 1}}, "multi-token prediction fails in megatron-core"),
    ],
)
def test_what_megatron_lm_refuses_or_is_not_modelled_is_refused(changes, message):
    data = {
        "model": {"preset": "llama3-8b", "num_layers": 2},
        "parallel": {"tp": 4, "sequence_parallel": True, "tp_comm_overlap": True},
        "training": {"seq_length": SEQ},
        "cluster": {"num_gpus": 4, "gpu": "b200"},
    }
    for section, values in changes.items():
        data.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=message):
        job_from_dict(data)


def test_options_without_the_overlap_are_noted_not_refused():
    job = job_from_dict(
        {
            "model": {"preset": "llama3-8b", "num_layers": 2},
            "parallel": {"tp": 4, "sequence_parallel": True, "tp_comm_overlap_ag": False},
            "training": {"seq_length": SEQ},
            "cluster": {"num_gpus": 4},
        }
    )
    assert (
        "parallel.tp_comm_overlap_ag changes nothing without parallel.tp_comm_overlap: ignored"
        in job.notes
    )
    assert userbuffers(job) == []


ARGS = (
    "--num-layers 2 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 "
    "--max-position-embeddings 4096 --vocab-size 32000 --micro-batch-size 1 --bf16 "
    "--tensor-model-parallel-size 4 --sequence-parallel --transformer-impl transformer_engine "
)


def test_megatron_lm_flags_and_the_cfg_file(tmp_path):
    cfg = tmp_path / "ub.yaml"
    cfg.write_text("fc2_fprop: {method: ring_exchange, num_sm: 1}\n")
    flags = f"--tp-comm-overlap --disable-tp-comm-bulk-wgrad --tp-comm-overlap-cfg {cfg}"
    job, _ = job_from_args((ARGS + flags).split(), world_size=8)
    par = job.parallel
    assert par.tp_comm_overlap and not par.tp_comm_bulk_wgrad and par.tp_comm_overlap_ag
    assert par.tp_comm_overlap_cfg.fc2_fprop.method == "ring_exchange"
    assert not job.not_modelled


def test_an_unreadable_cfg_file_is_one_message(tmp_path):
    with pytest.raises(ConfigError, match="cannot read --tp-comm-overlap-cfg file"):
        job_from_args(
            (ARGS + f"--tp-comm-overlap --tp-comm-overlap-cfg {tmp_path}/no.yaml").split(),
            world_size=4,
        )
    bad = tmp_path / "bad.yaml"
    bad.write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        job_from_args(
            (ARGS + f"--tp-comm-overlap --tp-comm-overlap-cfg {bad}").split(), world_size=4
        )


def test_sm_margins_are_te_defaults_unless_configured():
    """TE 2.8's get_default_config: num_sm 16 with set_sm_margin for pipeline, bulk and external
    (their GEMMs run on the other multiprocessors), none for ring_exchange (copy engines)."""
    margins = {b.name: b.margin for b in userbuffers(ub_job())}
    assert margins["proj_fprop"] == margins["qkv_dgrad"] == margins["fc1_wgrad"] == 16
    assert margins["qkv_fprop"] == margins["fc2_dgrad"] == 0
    cfg = {"proj_fprop": {"num_sm": 24}, "qkv_dgrad": {"set_sm_margin": False}}
    margins = {b.name: b.margin for b in userbuffers(ub_job(cfg=cfg))}
    assert (margins["proj_fprop"], margins["qkv_dgrad"], margins["fc2_fprop"]) == (24, 0, 16)
