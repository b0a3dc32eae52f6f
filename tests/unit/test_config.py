"""Loading, presets, derived values and the checks that run before any model is built."""

import pytest

from metatrace.config import job_from_dict, load_job
from metatrace.config.presets import PRESETS
from metatrace.errors import ConfigError
from tests.helpers import MOE, small_job


def problems(data) -> str:
    with pytest.raises(ConfigError) as info:
        job_from_dict(data)
    return str(info.value)


def test_every_preset_resolves_with_its_own_keys():
    for name in PRESETS:
        job = job_from_dict({"model": {"preset": name}, "training": {"seq_length": 128}})
        assert job.model.preset == name


def test_every_example_job_file_resolves():
    import glob
    import os

    from tests.helpers import EXAMPLES

    paths = sorted(glob.glob(os.path.join(EXAMPLES, "*.yaml")))
    # Job files; the userbuffers configuration is a --tp-comm-overlap-cfg file.
    paths = [p for p in paths if not os.path.basename(p).startswith("userbuffers_")]
    names = {os.path.basename(p) for p in paths}
    expected = {"debug.yaml", "llama3-8b-h100-fp8.yaml", "llama3-8b-h100-fsdp.yaml"}
    expected |= {"llama3-70b-gb200-fsdp-offload.yaml", "llama3-70b-h100-tp-overlap.yaml"}
    assert expected <= names
    for path in paths:
        job = load_job(path)
        assert (
            job.cluster.num_gpus
            == job.parallel.tp * job.parallel.pp * job.parallel.cp * job.parallel.dp
        ), path
    fp8 = load_job(os.path.join(EXAMPLES, "llama3-8b-h100-fp8.yaml"))
    assert fp8.training.use_precision_aware_optimizer and fp8.training.fp8_param_gather
    assert (fp8.training.main_grads_dtype, fp8.training.exp_avg_dtype) == ("bf16", "bf16")
    fsdp = load_job(os.path.join(EXAMPLES, "llama3-8b-h100-fsdp.yaml")).training
    assert fsdp.megatron_fsdp and fsdp.fsdp_sharding_strategy == "optim_grads_params"
    assert (fsdp.fp8_recipe, fsdp.global_batch_size, fsdp.seq_length) == ("tensorwise", 128, 8192)
    offload = load_job(os.path.join(EXAMPLES, "llama3-70b-gb200-fsdp-offload.yaml"))
    assert offload.training.megatron_fsdp and offload.training.cpu_offloading_num_layers == 20
    assert (offload.parallel.dp, offload.cluster.gpu) == (64, "gb200")
    overlap = load_job(os.path.join(EXAMPLES, "llama3-70b-h100-tp-overlap.yaml")).parallel
    assert overlap.tp_comm_overlap and overlap.tp_comm_overlap_cfg.proj_fprop.method == "pipeline"
    assert (overlap.tp, overlap.pp, overlap.vpp, overlap.cp, overlap.dp) == (4, 4, 5, 2, 2)


def test_explicit_keys_override_the_preset():
    job = small_job(model={"num_layers": 5, "hidden_size": 128})
    assert (job.model.num_layers, job.model.hidden_size) == (5, 128)
    assert job.model.ffn_hidden_size == PRESETS["debug"].dims["ffn_hidden_size"]


def test_megatron_lm_derivations():
    # SwiGLU ffn: floor(8h/3 / 64) * 64 -> 10880 for h = 4096 (Megatron-LM, not Llama's 11008).
    job = job_from_dict(
        {
            "model": {
                "num_layers": 2,
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "vocab_size": 50257,
                "activation": "swiglu",
            },
            "parallel": {"tp": 4, "pp": 2},
            "training": {"seq_length": 2048, "micro_batch_size": 2, "global_batch_size": 64},
            "cluster": {"num_gpus": 32},
        }
    )
    assert job.model.ffn_hidden_size == 10880
    assert job.model.kv_channels == 128
    assert job.model.num_query_groups == 32  # multi-head unless given
    assert job.padded_vocab_size == 50688  # ceil(50257 / (128 * 4)) * 512
    assert job.parallel.dp == 4  # 32 / (4 * 2 * 1)
    assert job.num_microbatches == 8  # 64 / (2 * 4)
    assert job.model.max_position_embeddings == 2048
    assert job.model.position_embedding_type == "learned_absolute"


def test_num_gpus_defaults_to_the_product_of_degrees():
    job = small_job(parallel={"tp": 2, "pp": 2, "dp": 3}, cluster={"gpus_per_node": 4})
    assert job.cluster.num_gpus == 12
    assert job.training.global_batch_size == 2 * 3


def test_sequence_parallel_at_tp1_is_turned_off_with_a_note():
    job = small_job(parallel={"sequence_parallel": True})
    assert job.parallel.sequence_parallel is False
    assert any("sequence_parallel" in n for n in job.notes)


def test_unknown_key_names_full_path_and_suggests():
    msg = problems({"model": {"preset": "debug", "hiden_size": 3}, "training": {"seq_length": 8}})
    assert "unknown key 'model.hiden_size'" in msg and "model.hidden_size" in msg
    msg = problems({"model": {"preset": "debug", "tp": 2}, "training": {"seq_length": 8}})
    assert "unknown key 'model.tp'" in msg and "'parallel.tp'" in msg
    msg = problems({"training": {"seq_length": 8, "recompute": {"granularty": "full"}}})
    assert "unknown key 'training.recompute.granularty'" in msg and "granularity" in msg
    assert "unknown key 'paralel'" in problems({"paralel": {}})


def test_types_are_checked():
    assert "'parallel.tp' must be a whole number" in problems(
        {"model": {"preset": "debug"}, "parallel": {"tp": "2"}, "training": {"seq_length": 8}}
    )
    assert "'parallel.sequence_parallel' must be true or false" in problems(
        {
            "model": {"preset": "debug"},
            "parallel": {"sequence_parallel": 1},
            "training": {"seq_length": 8},
        }
    )
    assert "one of bf16, fp16, fp32, fp8" in problems(
        {"model": {"preset": "debug"}, "training": {"seq_length": 8, "precision": "bf61"}}
    )


def test_degrees_that_do_not_multiply_out_print_every_factor():
    msg = problems(
        {
            "model": {"preset": "debug"},
            "parallel": {"tp": 2, "pp": 2, "dp": 3},
            "training": {"seq_length": 64},
            "cluster": {"num_gpus": 16},
        }
    )
    assert "tp x pp x cp x dp = 2 x 2 x 1 x 3 = 12, but cluster.num_gpus = 16" in msg
    msg = problems(
        {
            "model": {"preset": "debug"},
            "parallel": {"tp": 2, "cp": 3},
            "training": {"seq_length": 64},
            "cluster": {"num_gpus": 16},
        }
    )
    assert "cluster.num_gpus = 16 is not divisible by tp x pp x cp = 2 x 1 x 3 = 6" in msg


@pytest.mark.parametrize(
    "sections, expected",
    [
        ({"parallel": {"tp": 8}}, "num_attention_heads = 4 is not divisible by parallel.tp = 8"),
        ({"parallel": {"tp": 4}}, "num_query_groups = 2 is not divisible by parallel.tp = 4"),
        (
            {"model": {"num_query_groups": 3}},
            "num_attention_heads = 4 is not divisible by model.num_query_groups = 3",
        ),
        (
            {"model": {"num_layers": 3}, "parallel": {"pp": 2}},
            "model.num_layers = 3 is not divisible by parallel.pp = 2",
        ),
        (
            {
                "model": {"num_layers": 4},
                "parallel": {"pp": 2, "vpp": 3},
                "training": {"global_batch_size": 12},
            },
            "layers per pipeline rank are not divisible by parallel.vpp = 3",
        ),
        (
            {
                "model": {"num_layers": 8},
                "parallel": {"pp": 2, "vpp": 2},
                "training": {"global_batch_size": 3},
            },
            "to be a multiple of parallel.microbatch_group_size = 2, or to leave at least parallel.pp = 2 over",
        ),
        (
            {
                "model": {"num_layers": 8},
                "parallel": {"pp": 2, "vpp": 2, "microbatch_group_size": 4},
                "training": {"global_batch_size": 3},
            },
            "parallel.microbatch_group_size = 4, which must be at least parallel.pp = 2 and at most the number of micro-batches, 3",
        ),
        (
            {"parallel": {"cp": 2}, "training": {"seq_length": 66}},
            "not divisible by 2 x parallel.cp = 4",
        ),
        (
            {"parallel": {"dp": 2}, "training": {"global_batch_size": 5}},
            "global_batch_size = 5 is not a multiple of micro_batch_size x dp = 1 x 2 = 2",
        ),
        (
            {"parallel": {"tp": 2, "sequence_parallel": True}, "training": {"seq_length": 63}},
            "which does not divide it",
        ),
        (
            {
                "model": {
                    "position_embedding_type": "learned_absolute",
                    "max_position_embeddings": 32,
                }
            },
            "max_position_embeddings = 32 is smaller than training.seq_length = 64",
        ),
        ({"parallel": {"ep": 2}}, "needs a mixture-of-experts model (model.num_experts)"),
        (
            {"implementation": {"attention_backend": "local"}},
            "Transformer Engine then refuses to run",
        ),
        (
            {"parallel": {"cp": 2}, "implementation": {"transformer_impl": "local"}},
            "megatron-core's local attention refuses context parallelism",
        ),
        (
            {"parallel": {"cp": 2}, "implementation": {"attention_backend": "unfused"}},
            "unfused has no context-parallel path",
        ),
        (
            {"parallel": {"cp": 4, "cp_comm_type": "a2a"}},
            "key/value heads per TP rank (2) must both be divisible by it",
        ),
        (
            {"parallel": {"cp": 4, "cp_comm_type": "a2a+p2p", "hierarchical_cp_sizes": [2, 3]}},
            "whose product is parallel.cp = 4",
        ),
        (
            {"parallel": {"cp": 2, "hierarchical_cp_sizes": [2, 2]}},
            "hierarchical_cp_sizes [2, 2]: Megatron-LM asserts that their product is parallel.cp = 2",
        ),
        ({"parallel": {"hierarchical_cp_sizes": [2, 1]}}, "their product is parallel.cp = 1"),
        ({"training": {"precision": "fp8"}, "cluster": {"gpu": "a100"}}, "a100 has none"),
        ({"training": {"precision": "fp8", "fp8_recipe": "mxfp8"}}, "mxfp8 needs a Blackwell GPU"),
        (
            {"training": {"precision": "fp8", "fp8_param_gather": True}},
            "fp8_param_gather needs training.distributed_optimizer",
        ),
        (
            {"training": {"precision": "fp8"}, "implementation": {"transformer_impl": "local"}},
            "fp8 needs implementation.transformer_impl: transformer_engine",
        ),
        ({"training": {"recompute": {"granularity": "full"}}}, "full recompute needs"),
        (
            {"training": {"recompute": {"granularity": "selective", "modules": ["attn"]}}},
            "unknown module 'attn'",
        ),
        ({"training": {"overlap_param_gather": True}}, "needs training.distributed_optimizer"),
        (
            {"training": {"num_distributed_optimizer_instances": 2}, "cluster": {"num_gpus": 2}},
            "num_distributed_optimizer_instances > 1 needs training.distributed_optimizer",
        ),
        (
            {
                "training": {
                    "distributed_optimizer": True,
                    "num_distributed_optimizer_instances": 2,
                },
                "cluster": {"num_gpus": 3},
            },
            "dp x cp = 3 x 1 = 3 is not divisible by",
        ),
        (
            {
                "model": {"num_experts": 4},
                "parallel": {"ep": 2},
                "training": {
                    "distributed_optimizer": True,
                    "num_distributed_optimizer_instances": 4,
                },
                "cluster": {"num_gpus": 4},
            },
            "expert dp = num_gpus / (etp x ep x pp) = 2 is not divisible by",
        ),
        (
            {
                "parallel": {"pp": 4, "first_stage_layers": 1, "last_stage_layers": 2},
                "model": {"num_layers": 6},
            },
            "3 middle layers do not split evenly over 2 middle",
        ),
        (
            {"parallel": {"pp": 2, "layout": "Et|tL"}, "model": {"num_layers": 3}},
            "parallel.layout places 2 decoder layers, but model.num_layers = 3",
        ),
        (
            # Refused before it is spelled out (a hundred billion characters).
            {"parallel": {"pp": 2, "layout": "E|(t*99999|)*999999L"}},
            "is not a valid layout: it spells more than 1,000,000 layers",
        ),
        ({"parallel": {"rank_order": "tp-pp-dp"}}, "must order each of tp, cp, ep, dp, pp"),
        ({"cluster": {"gpu": "h1000"}}, "did you mean 'h100'?"),
        (
            # torch.optim is megatron-core's fallback where TE cannot be imported
            {"training": {"optimizer_impl": "torch"}},
            "training.optimizer_impl: torch means neither Transformer Engine nor Apex",
        ),
        (
            {
                "training": {"optimizer_impl": "apex", "use_precision_aware_optimizer": True},
            },
            "needs Transformer Engine's FusedAdam (training.optimizer_impl: te, not apex)",
        ),
        (
            {"cluster": {"allocator_conf": "expandable_segments:yes"}},
            "cluster.allocator_conf: PYTORCH_ALLOC_CONF: expandable_segments is True or False",
        ),
        ({"cluster": {"nccl_gib": -1}}, "cluster.nccl_gib = -1 must be at least 0"),
        ({"model": {"preset": "llama2-7"}}, "did you mean 'llama2-7b'?"),
    ],
)
def test_rules_megatron_enforces(sections, expected):
    data = {"model": {"preset": "debug"}, "training": {"seq_length": 64, "micro_batch_size": 1}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    assert expected in problems(data)


def test_allocator_settings_the_simulation_leaves_out_are_said():
    from metatrace.config import resolve

    job = resolve(small_job(cluster={"allocator_conf": "expandable_segment:True"}))
    assert any("expandable_segment:True (a key PyTorch does not know" in n for n in job.notes)
    job = resolve(small_job(cluster={"allocator_conf": "backend:cudaMallocAsync"}))
    assert [n.option for n in job.not_modelled] == ["PYTORCH_ALLOC_CONF backend:cudaMallocAsync"]
    assert resolve(job).not_modelled == job.not_modelled  # resolving again adds nothing


def test_several_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        small_job(parallel={"tp": 8, "pp": 3})
    assert len(info.value.problems) >= 2


def test_load_job_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_job(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_job(scalar)


def test_uniform_recompute_groups_must_divide_every_chunk():
    # 6 layers on pp 2 with the embedding and loss counted: chunks of 3 and 3... here 2 and 3.
    msg = problems(
        {
            "model": {"preset": "debug", "num_layers": 5},
            "parallel": {"pp": 2, "account_for_embedding": True},
            "training": {
                "seq_length": 64,
                "recompute": {"granularity": "full", "method": "uniform", "num_layers": 3},
            },
        }
    )
    assert "groups of training.recompute.num_layers = 3 layers" in msg and "(2 on some)" in msg


def test_chunk_layer_counts_follow_megatron_core():
    from metatrace.config.checks import chunk_layer_counts

    assert chunk_layer_counts(
        small_job(
            model={"num_layers": 8}, parallel={"pp": 2, "vpp": 2}, training={"global_batch_size": 4}
        )
    ) == [2, 2, 2, 2]
    assert chunk_layer_counts(
        small_job(
            model={"num_layers": 6},
            parallel={"pp": 4, "account_for_embedding": True, "account_for_loss": True},
        )
    ) == [1, 2, 2, 1]
    assert chunk_layer_counts(
        small_job(
            model={"num_layers": 7},
            parallel={"pp": 3, "first_stage_layers": 1, "last_stage_layers": 2},
        )
    ) == [1, 4, 2]
    assert chunk_layer_counts(
        small_job(
            model={"num_layers": 3},
            parallel={"pp": 2, "layout": "Et|t|t|L"},
            training={"global_batch_size": 4},
        )
    ) == [1, 1, 1, 0]


def test_megatron_fsdp_sets_what_megatron_core_sets_and_says_so():
    job = small_job(training={"megatron_fsdp": True})
    tr = job.training
    assert tr.fsdp_sharding_strategy == "optim_grads_params"
    assert tr.distributed_optimizer and tr.overlap_grad_reduce and tr.overlap_param_gather
    assert not tr.gradient_accumulation_fusion
    assert any(n.startswith("Megatron-FSDP (optim_grads_params) sets") for n in job.notes)
    tr = small_job(training={"megatron_fsdp": True, "fsdp_sharding_strategy": "optim"}).training
    assert tr.distributed_optimizer and not tr.overlap_grad_reduce and not tr.overlap_param_gather
    # Set already: nothing to say.
    quiet = small_job(
        training={
            "megatron_fsdp": True,
            "fsdp_sharding_strategy": "optim",
            "distributed_optimizer": True,
            "gradient_accumulation_fusion": False,
        }
    )
    assert not [n for n in quiet.notes if "Megatron-FSDP" in n]


@pytest.mark.parametrize(
    "training, message",
    [
        (
            {"megatron_fsdp": True, "fsdp_communication_unit_size": 0},
            "fsdp_communication_unit_size = 0 must be at least 1",
        ),
        (
            {"megatron_fsdp": True, "fsdp_sharding_strategy": "no_shard"},
            "fails at the first optimizer step",
        ),
        (
            {"megatron_fsdp": True, "parallel": {"pp": 2}},
            "parallel.pp = 2: megatron-core's (0.16.1 and 0.19) Megatron-FSDP fails while "
            "building its device mesh",
        ),
        (
            {"megatron_fsdp": True, "fsdp_outer_sharding_strategy": "optim"},
            "fsdp_outer_sharding_strategy optim needs hybrid sharding "
            "(training.num_distributed_optimizer_instances > 1)",
        ),
        (
            {
                "megatron_fsdp": True,
                "num_distributed_optimizer_instances": 2,
                "fsdp_sharding_strategy": "optim_grads",
                "fsdp_outer_sharding_strategy": "optim",
            },
            "needs training.fsdp_sharding_strategy optim_grads_params: with optim_grads "
            "megatron-core 0.16.1 fails while building Megatron-FSDP's buffers",
        ),
        (
            {
                "megatron_fsdp": True,
                "num_distributed_optimizer_instances": 2,
                "fsdp_outer_sharding_strategy": "optim",
                "model": MOE,
            },
            "with a mixture-of-experts model: megatron-core 0.16.1 fails while building",
        ),
    ],
)
def test_megatron_fsdp_refusals(training, message):
    parallel = training.pop("parallel", {})
    model = training.pop("model", {})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        small_job(cluster={"num_gpus": 4}, model=model, parallel=parallel, training=training)


@pytest.mark.parametrize("release_0_19", [False, True])
@pytest.mark.parametrize(
    "model",
    [
        {"linear_attention_freq": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
        {
            "hybrid_layer_pattern": "M*M-",
            "num_layers": 4,
            "normalization": "RMSNorm",
            "position_embedding_type": "none",
            "mamba_head_dim": 16,
        },
    ],
    ids=["gated-deltanet", "mamba"],
)
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_fsdp_with_recurrent_layers_at_tp_is_refused_under_0_16(
    monkeypatch, release_0_19, model, tp
):
    # megatron-core 0.16.1's make_fsdp_dtensor reads partition_dim, which its Mamba and GDN
    # layers do not set on their tensor-parallel conv1d / dt_bias / A_log (a traceback in the
    # real run, at tp > 1 only); 0.19 sets it.
    from metatrace.config import checks

    monkeypatch.setattr(checks, "release_since", lambda *v: release_0_19)
    training = {"megatron_fsdp": True, "distributed_optimizer": True}
    parallel = {"tp": tp, "sequence_parallel": tp > 1}
    refused = tp > 1 and not release_0_19
    try:
        small_job(cluster={"num_gpus": 4}, model=model, parallel=parallel, training=training)
    except ConfigError as e:
        assert refused and "Mamba-2 or Gated DeltaNet layers at parallel.tp = 2" in str(e), e
    else:
        assert not refused


def test_outer_sharding_is_accepted_where_megatron_core_runs_it():
    # Over dp 4 as 2 instances of 2, and as 2 instances of 1 rank (dp 2).
    for gpus in (4, 2):
        tr = small_job(
            cluster={"num_gpus": gpus},
            training={
                "megatron_fsdp": True,
                "num_distributed_optimizer_instances": 2,
                "fsdp_outer_sharding_strategy": "optim",
            },
        ).training
        assert tr.fsdp_outer_sharding_strategy == "optim"
    # The default changes nothing, with or without Megatron-FSDP.
    assert small_job().training.fsdp_outer_sharding_strategy == "no_shard"


@pytest.mark.parametrize(
    "script, job_file, gpu, per_node, world",
    [
        ("pretrain_llama3_70b_gb200_fsdp.sh", "llama3-70b-gb200-fsdp-offload.yaml", "gb200", 4, 64),
        (
            "pretrain_llama3_70b_h100_tp_overlap.sh",
            "llama3-70b-h100-tp-overlap.yaml",
            "h100",
            8,
            64,
        ),
        (
            "pretrain_llama3_8b_gb200_cuda_graphs.sh",
            "llama3-8b-gb200-cuda-graphs.yaml",
            "gb200",
            4,
            8,
        ),
    ],
)
def test_the_launch_script_examples_are_the_yaml_examples_jobs(
    monkeypatch, script, job_file, gpu, per_node, world
):
    """Each Megatron-LM launch script of examples/ (its flags; a userbuffers configuration
    file by its path from the repository's root) and its job file describe the same training."""
    import dataclasses
    import os

    from metatrace.config.megatron.args import job_from_args
    from metatrace.config.megatron.script import read_args_file
    from tests.helpers import EXAMPLES

    monkeypatch.chdir(os.path.dirname(EXAMPLES))
    args = read_args_file(os.path.join(EXAMPLES, script))
    job, _ = job_from_args(args, world_size=world, gpu=gpu, gpus_per_node=per_node)
    yaml = load_job(os.path.join(EXAMPLES, job_file))
    assert job.not_modelled == ()
    for section in ("parallel", "cluster"):
        assert getattr(job, section) == getattr(yaml, section), section
    fields = [f.name for f in dataclasses.fields(job.training)]
    differ = [f for f in fields if getattr(job.training, f) != getattr(yaml.training, f)]
    assert differ == []
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_query_groups"):
        assert getattr(job.model, name) == getattr(yaml.model, name), name


def test_averaging_in_the_collective_with_per_token_loss_is_refused():
    # megatron-core's DistributedDataParallel asserts it when it wraps the model (0.16.1 and
    # 0.19): a traceback in the middle of a trace before this check.
    training = {"ddp_average_in_collective": True, "calculate_per_token_loss": True}
    with pytest.raises(ConfigError, match="Cannot average in collective"):
        small_job(training=training)
    for alone in training:
        small_job(training={alone: True})
