"""Megatron-LM pretrain_gpt.py arguments -> jobs: derivations, classes of flags, errors, files."""

import json
import os

import pytest

from metatrace.config.megatron.args import (
    FLAGS,
    NOT_MODELLED_REASONS,
    args_from_mapping,
    job_dict_from_args,
    job_from_args,
    not_modelled,
    read_args_file,
    split_args,
)
from metatrace.errors import ConfigError
from tests.helpers import DATA

# The arguments, GPU and environment of every case of ../shared/calibration's
# megatron_ci_calibration.jsonl (Megatron-LM's functional tests), copied so that the tests do
# not need the shared folder.
CASES = os.path.join(DATA, "megatron_ci_args.jsonl")

# A small dense GPT as Megatron-LM's CI runs it (without the flags that change nothing).
BASE = (
    "--num-layers 12 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 32 --bf16 "
    "--vocab-file vocab.json --merge-file merges.txt"
)


def job(text, world_size=8, **kw):
    return job_from_args(split_args(text), world_size=world_size, **kw)


def error(text, world_size=8, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        job_dict_from_args(split_args(text), world_size=world_size, **kw)
    return str(info.value)


def calibration_cases():
    with open(CASES) as f:
        return [json.loads(line) for line in f if line.strip()]


def case(name):
    return next(c for c in calibration_cases() if c.get("case") == name)


# --------------------------------------------------------------------------- calibration


def test_every_calibration_flag_is_classified_and_every_case_builds_or_says_why():
    checked = 0
    for c in calibration_cases():
        args = c.get("args")
        if not isinstance(args, dict):
            continue
        checked += 1
        kw = dict(world_size=c["world_size"], gpu=c["hardware"], env=c.get("env_vars"))
        # The userbuffers file of a TP-overlap case is in Megatron-LM's repository.
        args = {k: v for k, v in args.items() if k != "--tp-comm-overlap-cfg"}
        job_dict_from_args(args, **kw)  # no unknown flag, no bad value
        try:
            job_from_args(args, **kw)
        except ConfigError as e:
            assert not_modelled(args), f"{c['case']}: {e}"  # only unmodelled runs may fail
    assert checked >= 43


def test_interleaved_pipeline_case_derives_as_megatron_does():
    c = case("gpt/gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce")
    data, notes = job_dict_from_args(c["args"], world_size=8, gpu="a100", env=c["env_vars"])
    assert data == {
        "model": {
            "num_layers": 12,
            "hidden_size": 512,
            "num_attention_heads": 8,
            "max_position_embeddings": 1024,
            "add_qkv_bias": True,
            "vocab_size": 50257,
        },
        "parallel": {"tp": 1, "pp": 4, "vpp": 3},  # 12 layers / pp 4 / 1 layer per chunk
        "training": {
            "micro_batch_size": 4,
            "global_batch_size": 32,
            "seq_length": 1024,
            "clip_grad": 1.0,
            "log_num_zeros_in_grad": True,
            "precision": "bf16",
            "distributed_optimizer": True,
            "overlap_grad_reduce": True,
            "gradient_accumulation_fusion": False,
        },
        "implementation": {
            "transformer_impl": "transformer_engine",
            "attention_backend": "unfused",
            "attention_softmax_in_fp32": True,
            "rope_fusion": False,
        },
        "cluster": {"num_gpus": 8, "gpu": "a100", "cublas_workspace_config": ":4096:8"},
    }
    assert notes == [] and not_modelled(c["args"]) == []
    resolved, _ = job_from_args(c["args"], world_size=8, gpu="a100", env=c["env_vars"])
    assert (resolved.parallel.pp, resolved.parallel.vpp, resolved.parallel.dp) == (4, 3, 2)
    assert resolved.padded_vocab_size == 50304  # ceil(50257 / 128) * 128
    assert resolved.num_microbatches == 4  # 32 / (4 x dp 2)
    assert resolved.training.grad_reduce_in_fp32 is True  # bf16 default
    assert resolved.attention_kernel == "unfused"


def test_tp4_local_case_pads_the_vocabulary_over_tp():
    c = case("gpt/gpt3_mcore_tp4_pp1")
    resolved, _ = job_from_args(c["args"], world_size=8, gpu="a100", env=c["env_vars"])
    assert resolved.padded_vocab_size == 50688  # ceil(50257 / 512) * 512
    assert resolved.implementation.transformer_impl == "local"
    assert resolved.implementation.apply_query_key_layer_scaling is True
    assert resolved.parallel.dp == 2


def test_cp_case_maps_hierarchical_sizes_and_comm_type():
    c = case("gpt/gpt3_mcore_te_tp1_pp2_cp4_a2a_p2p_nondeterministic")
    resolved, _ = job_from_args(c["args"], world_size=8, gpu="a100", env=c["env_vars"])
    par = resolved.parallel
    assert (par.cp, par.cp_comm_type, par.hierarchical_cp_sizes) == (4, "a2a+p2p", [2, 2])
    assert par.dp == 1
    assert resolved.model.hidden_dropout == 0.0
    assert resolved.num_microbatches == 8  # cp does not change dp: 32 / (4 x 1)


def test_moe_case_maps_experts_and_expert_parallelism():
    c = case("moe/gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel")
    resolved, notes = job_from_args(c["args"], world_size=8, gpu="h100", env=c["env_vars"])
    assert not [n for n in notes if n.startswith("warning")]
    m, par = resolved.model, resolved.parallel
    assert (m.num_experts, m.moe_router_topk, m.moe_router_load_balancing_type) == (
        4,
        1,
        "sinkhorn",
    )
    assert m.moe_ffn_hidden_size == m.ffn_hidden_size and m.moe_layer_freq == [1] * 12
    assert (par.ep, par.etp, par.moe_token_dispatcher_type) == (2, 2, "allgather")
    assert not_modelled(c["args"]) == []


def test_mla_case_maps_the_latent_dimensions():
    c = case("gpt/gpt3_mcore_te_tp2_pp2_mla")
    resolved, notes = job_from_args(c["args"], world_size=8, gpu="h100", env=c["env_vars"])
    assert not [n for n in notes if n.startswith("warning")]
    m = resolved.model
    assert m.multi_latent_attention and (m.q_lora_rank, m.kv_lora_rank) == (192, 64)
    assert (m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (16, 8, 16)
    # Megatron-LM's defaults: yarn (MLATransformerConfig's), factor 1.0 (the CLI's, not 40)
    assert (m.rope_type, m.rotary_scaling_factor, m.mscale_all_dim) == ("yarn", 1.0, 0.0)
    assert not_modelled(c["args"]) == []


def test_mtp_keeps_its_layout_and_mla_flags_need_mla():
    resolved, _ = job(
        BASE.replace("--num-layers 12", "--num-layers 3")
        + " --position-embedding-type rope --pipeline-model-parallel-size 2"
        " --mtp-num-layers 1 --pipeline-model-parallel-layout 'Et|ttmL'"
    )
    assert resolved.model.mtp_num_layers == 1 and resolved.parallel.layout == "Et|ttmL"
    resolved, notes = job(BASE + " --kv-lora-rank 64 --mscale 2.0")
    assert resolved.model.kv_lora_rank == 32 and resolved.model.mscale == 1.0
    assert any(
        "--kv-lora-rank, --mscale are ignored without --multi-latent-attention" in n for n in notes
    )
    assert "--rope-type yarn needs --multi-latent-attention" in error(BASE + " --rope-type yarn")
    assert "exclude each other" in error(BASE + " --multi-latent-attention --group-query-attention")


def test_moe_options_not_modelled_are_listed():
    resolved, notes = job(
        BASE
        + " --num-experts 8 --no-bias-gelu-fusion --moe-apply-probs-on-input --moe-layer-freq 2"
        " --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity"
    )
    assert resolved.model.moe_layer_freq == [1, 0] * 6  # 12 layers
    assert resolved.training.moe_routing == "capacity"
    assert resolved.training.moe_expert_capacity_factor == 1.5
    (warning,) = [n for n in notes if n.startswith("warning")]
    assert "MoE router and expert variants (--moe-apply-probs-on-input)" in warning
    assert [(n.option, n.direction) for n in resolved.not_modelled] == [
        ("--moe-apply-probs-on-input", "either")
    ]


def test_moe_fusion_flags_map_to_the_implementation():
    resolved, notes = job(
        BASE
        + " --swiglu --disable-bias-linear --num-experts 8 --moe-permute-fusion --moe-router-fusion"
    )
    assert resolved.implementation.moe_permute_fusion
    assert resolved.implementation.moe_router_fusion
    assert not [n for n in notes if n.startswith("warning")]


# --------------------------------------------------------------------------- derivations


def test_group_query_attention_gates_num_query_groups():
    gqa, _ = job(BASE + " --group-query-attention --num-query-groups 2")
    assert gqa.model.num_query_groups == 2
    mha, notes = job(BASE + " --num-query-groups 2")
    assert mha.model.num_query_groups == 8  # ignored: multi-head attention
    assert any("--num-query-groups 2 is ignored" in n for n in notes)
    mqa, _ = job(BASE + " --group-query-attention")
    assert mqa.model.num_query_groups == 1  # Megatron-LM's default for --num-query-groups


def test_null_tokenizer_adds_one_token_in_0_16_1():
    resolved, _ = job(BASE + " --tokenizer-type NullTokenizer --vocab-size 32000")
    assert resolved.model.vocab_size == 32001
    assert resolved.padded_vocab_size == 32128  # ceil(32001 / 128) * 128, not 32000


def test_tokenizers_of_unknown_size_need_vocab_size():
    msg = error(BASE + " --tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/x")
    assert "HuggingFaceTokenizer" in msg and "--vocab-size" in msg
    assert "--vocab-size" in error(BASE + " --tokenizer-type TikTokenizer")
    resolved, notes = job(BASE + " --tokenizer-type HuggingFaceTokenizer --vocab-size 128256")
    assert resolved.model.vocab_size == 128256
    assert any("stands for HuggingFaceTokenizer" in n for n in notes)
    gpt2, notes = job(BASE + " --vocab-size 1000")  # GPT2BPETokenizer ignores --vocab-size
    assert gpt2.model.vocab_size == 50257 and any("ignored by GPT2BPE" in n for n in notes)


def test_padded_vocab_size_is_taken_as_is():
    resolved, _ = job(BASE + " --tensor-model-parallel-size 2 --padded-vocab-size 50000")
    assert resolved.padded_vocab_size == 50000


def test_precision_from_bf16_fp16_fp8():
    assert job(BASE.replace("--bf16", ""))[0].training.precision == "fp32"
    assert job(BASE.replace("--bf16", "--fp16"))[0].training.grad_reduce_in_fp32 is False
    fp8, _ = job(BASE + " --fp8-format e4m3 --fp8-recipe tensorwise", gpu="h100")
    assert (fp8.training.precision, fp8.training.fp8_format, fp8.training.fp8_recipe) == (
        "fp8",
        "e4m3",
        "tensorwise",
    )
    assert "exclude each other" in error(BASE + " --fp16")
    assert not job(BASE + " --grad-reduce-in-bf16")[0].training.grad_reduce_in_fp32
    fp16_fp8 = not_modelled(split_args(BASE.replace("--bf16", "--fp16") + " --fp8-format hybrid"))
    assert fp16_fp8 == ["--fp8-format without --bf16: FP8 over fp16 or fp32 parameters"]


def test_fp4_flags_map_to_precision_fp4():
    """--fp4-format e2m1 --fp4-recipe nvfp4 (with --bf16) is training.precision fp4; the
    first/last-layers flags are modelled; --fp4-param-gather and the custom recipe are not."""
    fp4, notes = job(
        BASE + " --fp4-format e2m1 --fp4-recipe nvfp4 --first-last-layers-bf16 "
        "--num-layers-at-end-in-bf16 2",
        gpu="b200",
    )
    tr = fp4.training
    assert (tr.precision, tr.fp4_recipe, tr.fp8_recipe, tr.grad_reduce_in_fp32) == (
        "fp4",
        "nvfp4",
        None,
        True,
    )
    assert (tr.first_last_layers_bf16, tr.num_layers_at_start_in_bf16) == (True, 1)
    assert tr.num_layers_at_end_in_bf16 == 2
    assert fp4.not_modelled == ()
    assert job(BASE + " --fp4-format e2m1", gpu="b200")[0].training.fp4_recipe == "nvfp4"
    assert not_modelled(split_args(BASE + " --fp4-format e2m1 --fp4-param-gather")) == [
        "--fp4-param-gather: FP4 (NVFP4) parameters gathered in FP4"
    ]
    assert not_modelled(split_args(BASE + " --fp4-format e2m1 --fp4-recipe custom")) == [
        "--fp4-recipe custom: custom FP4 quantizers"
    ]
    assert not_modelled(split_args(BASE.replace("--bf16", "--fp16") + " --fp4-format e2m1")) == [
        "--fp4-format without --bf16: FP4 over fp16 or fp32 parameters"
    ]
    both = BASE + " --fp8-format hybrid --fp4-format e2m1"
    assert "--fp8-format and --fp4-format exclude each other" in error(both, gpu="b200")
    assert "--fp4-param-gather needs --fp4-format" in error(BASE + " --fp4-param-gather")
    with pytest.raises(ConfigError, match="fp4 \\(NVFP4\\) needs a Blackwell GPU"):
        job(BASE + " --fp4-format e2m1", gpu="h100")
    # without FP8 or FP4 the bf16-layer flags change nothing (megatron-core reads them there)
    plain, notes = job(BASE + " --first-last-layers-bf16")
    assert plain.training.first_last_layers_bf16 is False
    assert any("changes nothing without --fp8-format or --fp4-format" in n for n in notes)
    # delayed scaling cannot keep layers in bf16 (megatron-core refuses it)
    with pytest.raises(ConfigError, match="fp8_recipe delayed: megatron-core refuses it"):
        job(BASE + " --fp8-format hybrid --first-last-layers-bf16", gpu="h100")


def test_recompute_activations_means_selective():
    rec = job(BASE + " --recompute-activations")[0].training.recompute
    assert (rec.granularity, rec.modules) == ("selective", ["core_attn"])
    full = job(
        BASE + " --recompute-granularity full --recompute-method block --recompute-num-layers 2"
    )[0].training.recompute
    assert (full.granularity, full.method, full.num_layers) == ("full", "block", 2)


def test_virtual_pipeline_from_either_flag_and_its_checks():
    pp = " --pipeline-model-parallel-size 2"
    assert job(BASE + pp + " --num-layers-per-virtual-pipeline-stage 2")[0].parallel.vpp == 3
    assert job(BASE + pp + " --num-virtual-stages-per-pipeline-rank 2")[0].parallel.vpp == 2
    # 12 + embedding + loss = 14 layers: 7 per stage, no chunks of 2
    msg = error(
        BASE + pp + " --num-layers-per-virtual-pipeline-stage 2 "
        "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"
    )
    assert "14 layers" in msg
    msg = error(BASE + " --num-layers-per-virtual-pipeline-stage 1")
    assert "pipeline-model-parallel-size > 1" in msg
    assert "at most one" in error(
        BASE + pp + " --num-virtual-stages-per-pipeline-rank 2 "
        "--num-layers-per-virtual-pipeline-stage 1"
    )


def test_rank_order_cp_comm_type_and_expert_degrees():
    resolved, _ = job(
        BASE + " --use-tp-pp-dp-mapping --context-parallel-size 2 --cp-comm-type allgather"
    )
    assert resolved.parallel.rank_order == "tp-cp-ep-pp-dp"
    assert resolved.parallel.cp_comm_type == "all_gather"
    assert "needs --num-experts" in error(BASE + " --expert-model-parallel-size 2")
    assert "expert tp x ep x pp = 3 x 1 x 1" in error(BASE + " --expert-tensor-parallel-size 3")


def test_rope_fusion_only_with_rope_and_bias_fusion_per_activation():
    learned, _ = job(BASE)
    assert learned.implementation.rope_fusion is False
    rope, _ = job(BASE + " --position-embedding-type rope")
    assert rope.implementation.rope_fusion is True  # TE spec default
    deprecated, _ = job(BASE + " --use-rotary-position-embeddings")
    assert deprecated.model.position_embedding_type == "rope"
    # --no-bias-gelu-fusion does nothing to SwiGLU, whose kernel --no-bias-swiglu-fusion turns off
    assert job(BASE + " --swiglu --no-bias-gelu-fusion")[0].implementation.bias_activation_fusion
    swiglu_off, _ = job(BASE + " --swiglu --no-bias-swiglu-fusion")
    assert not swiglu_off.implementation.bias_activation_fusion
    assert "--no-bias-gelu-fusion" in error(BASE + " --squared-relu")
    assert job(BASE + " --squared-relu --disable-bias-linear")[0].model.activation == "squared_relu"


def test_last_of_a_repeated_flag_wins():
    assert job(BASE + " --num-layers 4")[0].model.num_layers == 4
    assert job(BASE + " --hidden-size=256")[0].model.hidden_size == 256


# --------------------------------------------------------------------------- errors


def test_unknown_flags_are_one_error_with_suggestions():
    msg = error(BASE + " --num-layer 2 --hiden-size 3 --tensor_model_parallel_size 2")
    assert msg.count("\n") == 0  # one line naming them all
    assert "--num-layer (did you mean --num-layers?)" in msg
    assert "--hiden-size (did you mean --hidden-size?)" in msg
    assert "--tensor_model_parallel_size (did you mean --tensor-model-parallel-size?)" in msg


def test_bad_values_name_the_flag_and_value():
    assert "--num-layers expects an integer, got 'twelve'" in error(BASE + " --num-layers twelve")
    assert "--hidden-dropout expects a number, got 'x'" in error(BASE + " --hidden-dropout x")
    msg = error(BASE + " --transformer-impl transformer-engine")
    assert "--transformer-impl must be one of" in msg and "'transformer_engine'" in msg
    assert "--bf16 takes no value" in error(BASE + " --bf16=yes")


def test_missing_values_and_stray_words():
    assert "--num-layers needs a value" in error("--num-layers --bf16 " + BASE)
    assert "--seq-length needs a value" in error(BASE + " --seq-length")
    assert "unexpected value 'yes' after --bf16" in error(BASE + " --bf16 yes")
    assert "Megatron-LM needs --hidden-size" in error(
        "--num-layers 2 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1"
    )
    assert "use --micro-batch-size" in error(BASE + " --batch-size 4")


def test_environment():
    env = {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8",
        "NCCL_ALGO": "Ring",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }
    assert job(BASE, env=env)[0].cluster.cublas_workspace_config == ":4096:2:16:8"
    # The allocator's settings: PYTORCH_ALLOC_CONF before its deprecated alias, as torch reads
    alloc = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert job(BASE, env=alloc)[0].cluster.allocator_conf == "expandable_segments:True"
    both = {**alloc, "PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}
    resolved, notes = job(BASE, env=both)
    assert resolved.cluster.allocator_conf == "max_split_size_mb:512"
    assert any("PyTorch reads the first only" in n for n in notes)
    # Variables that change nothing are accepted silently, unknown ones are named in a note,
    # and those that change memory in ways metatrace does not model are reported as such.
    quiet = {
        "PYTHONWARNINGS": "ignore",
        "NVTE_FWD_LAYERNORM_SM_MARGIN": "8",
        "NVTE_BWD_LAYERNORM_SM_MARGIN": "8",
        "NCCL_IB_SL": "1",
        "NCCL_NVLS_ENABLE": "0",
    }
    resolved, notes = job(BASE, env={**quiet, "FOO": "1"})
    assert resolved.cluster.nccl_nvls is False  # NCCL_NVLS_ENABLE=0: no NVLS buffers
    sized = job(BASE, env={"NCCL_BUFFSIZE": "8388608", "NCCL_MAX_NCHANNELS": "16"})[0].cluster
    assert (sized.nccl_buffsize, sized.nccl_channels) == (8 << 20, 16)
    assert [n for n in notes if "environment" in n] == [
        "environment variables metatrace does not know, taken to change nothing it predicts: FOO"
    ]
    assert resolved.not_modelled == ()
    resolved, notes = job(BASE, env={"NVTE_FUSED_ATTN_BACKEND": "0"})
    assert [(n.option, n.direction) for n in resolved.not_modelled] == [
        ("NVTE_FUSED_ATTN_BACKEND=0", "either")
    ]
    assert notes[0].startswith("warning") and "NVTE_FUSED_ATTN_BACKEND=0" in notes[0]
    # megatron-core asserts NVTE_*_ATTN agree with --attention-backend: they cannot choose it
    assert "NVTE_FUSED_ATTN=0 contradicts --attention-backend auto" in error(
        BASE, env={"NVTE_FUSED_ATTN": "0"}
    )
    flash = {"NVTE_FLASH_ATTN": 1, "NVTE_FUSED_ATTN": 0, "NVTE_UNFUSED_ATTN": 0}
    assert job(BASE + " --attention-backend flash", env=flash)[0].attention_kernel == "flash"
    assert "CUDA_DEVICE_MAX_CONNECTIONS=8" in error(
        BASE + " --tensor-model-parallel-size 2", env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    )


# --------------------------------------------------------------------------- file forms

SCRIPT = r"""#!/bin/bash
# pretrain a small GPT
set -e
export CUDA_DEVICE_MAX_CONNECTIONS=1
CHECKPOINT_PATH=/ckpt   # assigned, but not used in the flags
torchrun --nproc_per_node 8 --nnodes 1 pretrain_gpt.py \
    --num-layers 12 --hidden-size 512 \
    --num-attention-heads 8 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 4 --global-batch-size 32 \
    # precision and tokenizer (a comment amid the continuations)
    --bf16 --vocab-file 'vocab.json' --merge-file "merges.txt" 2>&1 | tee train.log
echo done
"""


def test_script_yaml_and_token_forms_give_the_same_job(tmp_path):
    extra = (
        " --pipeline-model-parallel-size 2 --context-parallel-size 2 "
        "--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 1"
    )
    tokens = split_args(BASE + extra)
    script = tmp_path / "train.sh"
    script.write_text(SCRIPT.replace("--bf16", "--bf16" + extra + " \\\n   "))
    mapping = tmp_path / "args.yaml"
    mapping.write_text(
        "--num-layers: 12\n--hidden-size: 512\n--num-attention-heads: 8\n--seq-length: 1024\n"
        "--max-position-embeddings: 1024\n--micro-batch-size: 4\n--global-batch-size: 32\n"
        "--bf16: true\n--fp16: false\n--vocab-file: vocab.json\n--merge-file: merges.txt\n"
        "--pipeline-model-parallel-size: 2\n--context-parallel-size: 2\n"
        '--cp-comm-type: a2a+p2p\n--hierarchical-context-parallel-sizes: "2 1"\n'
    )
    as_json = tmp_path / "args.json"
    as_json.write_text(
        json.dumps({"--bf16": True, **dict(zip(tokens[:14:2], map(int, tokens[1:14:2])))})
    )
    expected = job_dict_from_args(tokens, world_size=8)[0]
    for path in (script, mapping):
        assert job_dict_from_args(read_args_file(path), world_size=8)[0] == expected, path
    assert expected["parallel"]["hierarchical_cp_sizes"] == [2, 1]
    assert read_args_file(as_json)[:3] == ["--bf16", "--num-layers", "12"]


def test_script_forms():
    per_line = "# one flag per line\n--num-layers 2\n\n# precision\n--bf16\necho done --fp16\n"
    assert split_args(per_line) == ["--num-layers", "2", "--bf16"]
    assert split_args("python pretrain_gpt.py --num-layers 2 --bf16") == [
        "--num-layers",
        "2",
        "--bf16",
    ]
    assert split_args("--spec my_spec.py --bf16") == ["--spec", "my_spec.py", "--bf16"]
    assert split_args("--num-layers 2 > log.txt --bf16") == ["--num-layers", "2"]
    assert split_args("--pipeline-model-parallel-layout 'Et|tL' # layout") == [
        "--pipeline-model-parallel-layout",
        "Et|tL",
    ]
    with pytest.raises(ConfigError, match=r"\$GPT_ARGS \(set on line 1\)"):
        split_args('GPT_ARGS="--num-layers 2"\ntorchrun pretrain_gpt.py $GPT_ARGS --bf16')
    arrays = "ARGS=(\n  --num-layers 2\n)\ntorchrun pretrain_gpt.py ${ARGS[@]} --bf16\n"
    with pytest.raises(ConfigError, match=r"\$ARGS \(set on line 1\)"):  # a bash array
        split_args(arrays)
    with pytest.raises(ConfigError, match=r"\$TP;"):
        split_args("--tensor-model-parallel-size ${TP}")
    assert split_args("--save '$HOME'") == ["--save", "$HOME"]  # single quotes do not expand


def test_mapping_values():
    assert args_from_mapping(
        {
            "--recompute-modules": "[core_attn mlp]",
            "--bf16": True,
            "--fp16": None,
            "--data-path": ["a", "b"],
        }
    ) == ["--recompute-modules", "core_attn", "mlp", "--bf16", "--data-path", "a", "b"]
    with pytest.raises(ConfigError, match="not a flag"):
        args_from_mapping({"num-layers": 2})
    with pytest.raises(ConfigError, match="--num-layers needs a value"):
        job_dict_from_args({"--num-layers": True}, world_size=1)


def test_unreadable_file_names_it(tmp_path):
    missing = tmp_path / "nope.sh"
    with pytest.raises(ConfigError, match="cannot read arguments file .*nope.sh"):
        read_args_file(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("--num-layers: [1\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        read_args_file(bad)


def test_table_invariants():
    for flag, spec in FLAGS.items():
        assert flag.startswith("-") and spec.nargs in (0, 1, 3, "+", "*", "?"), flag
        assert (spec.key is not None) <= (spec.cls == "modelled"), flag
        assert (spec.direction is not None) == (spec.cls == "not_modelled"), flag
    assert NOT_MODELLED_REASONS["--optimizer-cuda-graph"].startswith("CUDA graph")
    assert "--use-flash-attn" not in NOT_MODELLED_REASONS  # a no-op in 0.16.1
    assert FLAGS["--no-overlap-p2p-communication"].const is False  # store_false
    assert FLAGS["--no-rl-skip-bos-token"].const is False  # the "no" half of a boolean pair
    assert FLAGS["--attention-backend"].choices == ("flash", "fused", "unfused", "local", "auto")


def _flag_rows() -> list[dict[str, str]]:
    import csv

    with open(os.path.join(DATA, "megatron-lm-flags.tsv")) as f:
        return list(csv.DictReader(f, delimiter="\t"))


def test_every_flag_of_megatron_lm_is_in_exactly_one_class():
    """tests/data/megatron-lm-flags.tsv is ../shared/notes/megatron-lm-flags.tsv (every option
    string of pretrain_gpt.py's parser at core_v0.16.1 and at a 2026 HEAD) with core_v0.19.2's
    column and rows (bench/megatron_parser.py). megatron_flags raises on a flag in two classes;
    here no flag may be missing or unclassified."""
    from collections import Counter

    from metatrace.config.megatron.flags import _classes

    rows = _flag_rows()
    assert len(rows) == 933
    classes = _classes()
    # no flag missing, none extra (but flags of older releases, classed separately)
    assert sorted(classes) == sorted(r["flag"] for r in rows)
    for row in rows:  # the package's copy of the parser's attributes is the same
        spec = FLAGS[row["flag"]]
        newer = spec.versions in ("core_v0.19.2", "HEAD")
        assert (spec.dest, newer) == (row["dest"], row["in_core_v0.16.1"] == "no")
        assert (spec.nargs in (0, "?")) == (row["nargs"] == "0"), row["flag"]
        assert ("core_v0.19.2" in spec.parsers) == (row["in_core_v0.19.2"] == "yes"), row["flag"]
    counts = Counter(spec.cls for spec in FLAGS.values() if spec.versions != "older")
    assert sum(counts.values()) == 933 and counts["refused"] == 8  # 6 + -h/--help
    assert min(counts["modelled"], counts["no_effect"], counts["not_modelled"]) > 100


def test_core_v0_19_2_parser_column():
    """megatron-core 0.19.2's wheel ships Megatron-LM's training code, whose parser
    (bench/megatron_parser.py) has 849 option strings: 656 of core_v0.16.1's, 190 of HEAD's
    that core_v0.16.1 lacks, and 3 that neither has. Its modelopt group is unknown (the wheel
    has no megatron/post_training); every flag of it is classified."""
    from collections import Counter

    rows = _flag_rows()
    column = Counter(r["in_core_v0.19.2"] for r in rows)
    assert column == {"yes": 849, "no": 62, "unknown": 22}
    assert {r["group"] for r in rows if r["in_core_v0.19.2"] == "unknown"} == {"modelopt-generic"}
    in19 = [FLAGS[r["flag"]] for r in rows if r["in_core_v0.19.2"] == "yes"]
    assert Counter(f.versions for f in in19) == {"all": 656, "core_v0.19.2": 193}
    assert all(f.cls in ("modelled", "no_effect", "not_modelled", "refused") for f in in19)
    only19 = sorted(f.name for f in in19 if f.parsers == ("core_v0.19.2",))
    assert only19 == [
        "--disable-stream-ckpt-dequant",
        "--moe-ncclep-static-shape",
        "--no-stream-ckpt-dequant",
    ]
    # removed between core_v0.16.1 and core_v0.19.2 (HEAD lacks them too)
    gone = FLAGS["--use-legacy-models"]
    assert gone.versions == "core_v0.16.1" and gone.parsers == ("core_v0.16.1",)
    # a flag of core_v0.16.1's modelopt group keeps "all": core_v0.19.2's is unknown
    assert FLAGS["--export-te-mcore-model"].parsers == ("core_v0.16.1", "HEAD")
    assert FLAGS["--use-gigatoken"].versions == "HEAD"  # added after core_v0.19.2


def test_classes_of_flags_new_in_core_v0_19_2():
    """Each checked where megatron-core 0.19.2 or its training code reads the dest."""
    cases = {
        # checkpointing.py passes it to the checkpoint load strategy alone
        "--no-stream-ckpt-dequant": ("no_effect", None),
        # token_dispatcher.py _NCCLEPManager: the full receive buffer goes to the experts
        "--moe-ncclep-static-shape": ("not_modelled", "either"),
        # experts.py bias_act_func: a reordering copy, no fused bias-activation
        "--moe-mlp-glu-interleave-size": ("not_modelled", "raises"),
        # transformer_layer.py: the chunks' outputs concatenated
        "--mlp-chunks-for-training": ("not_modelled", "either"),
        # language_module.py _scale_logits: logits * mult out of place
        "--use-mup": ("not_modelled", "raises"),
        # arguments.py validate_args: weight shards beyond TP change the data-parallel size
        "--tensor-parallel-num-weight-shards": ("not_modelled", "either"),
        # the paged stash of routed experts' activations (moe/paged_stash.py)
        "--moe-paged-stash": ("not_modelled", "either"),
        # megatron_fsdp's main gradient and parameter buffers, its reductions' dtype: job keys
        # (training.fsdp_main_grads_dtype ...) under megatron-core 0.19
        "--megatron-fsdp-main-grads-dtype": ("modelled", None),
        "--megatron-fsdp-main-params-dtype": ("modelled", None),
        "--megatron-fsdp-grad-comm-dtype": ("modelled", None),
        # fine_grained_activation_offload.py: (1 - fraction) of the groups stay on the device
        # fine-grained offloading's steady state (post_warmup_callback): job keys
        # (training.activation_offload_fraction ...) under megatron-core 0.19
        "--activation-offload-fraction": ("modelled", None),
        "--delta-offload-bytes-across-pp-ranks": ("modelled", None),
        "--fine-grained-offloading-max-inflight-offloads": ("modelled", None),
        "--no-use-layer-wise-param-layout": ("not_modelled", "unknown"),
        # combined_1f1b.py: a stream's priority
        "--high-priority-a2a-comm-stream": ("no_effect", None),
        # finalize_model_grads.py: the quantile-balancing bias update's coefficient
        "--moe-router-quantile-balancing-ema": ("no_effect", None),
    }
    got = {f: (FLAGS[f].cls, FLAGS[f].direction) for f in cases}
    assert got == cases
    assert all(FLAGS[f].versions == "core_v0.19.2" for f in cases)
    assert FLAGS["--moe-mlp-glu-interleave-size"].reason.startswith("GLU activations")


def test_flags_of_other_megatron_lm_versions_are_read_and_misspellings_refused():
    resolved, notes = job(BASE + " --use-transformer-engine-op-fuser --log-max-attention-logit")
    from metatrace.config import release

    installed = release.version()
    assert installed[0].isdigit()  # the distribution's metadata, megatron-core not imported
    assert (
        f"from a Megatron-LM newer than core_v0.16.1 (metatrace runs megatron-core {installed}): "
        "in core_v0.19.2: --use-transformer-engine-op-fuser"
    ) in notes
    _, notes = job(BASE + " --use-gigatoken --moe-paged-stash")
    assert any(
        n.endswith(
            "in core_v0.19.2: --moe-paged-stash; after it (HEAD of 2026-08-22): --use-gigatoken"
        )
        for n in notes
    )
    assert [n.option for n in resolved.not_modelled] == ["--log-max-attention-logit"]
    assert "unknown Megatron-LM flags: --fim-rat (did you mean --fim-rate?)" in error(
        BASE + " --fim-rat 0.5"
    )
    # No parser in the table has it and it is no misspelling: refused, unless the user names
    # the newer Megatron-LM it comes from; then reported (its effect unknown), its values with it.
    assert error(BASE + " --frobnicate-widgets 3 --micro-batch-size 2") == (
        "unknown Megatron-LM flag --frobnicate-widgets: in no release metatrace knows "
        "(core_v0.16.1, core_v0.19.2, HEAD of 2026-08-22), and no misspelling of theirs; if it "
        "comes from a newer Megatron-LM, name the release (--newer-megatron RELEASE) to have it "
        "reported as not modelled"
    )
    resolved, notes = job(
        BASE + " --frobnicate-widgets 3 --micro-batch-size 2", release="core_v0.17.0"
    )
    assert [(n.option, n.feature, n.direction) for n in resolved.not_modelled] == [
        (
            "--frobnicate-widgets",
            "a flag of Megatron-LM core_v0.17.0, in none of core_v0.16.1's, core_v0.19.2's and "
            "HEAD's parsers",
            "unknown",
        )
    ]
    assert resolved.training.micro_batch_size == 2 and "--frobnicate-widgets" in notes[0]
    # Flags of older releases are known by their successors' class; a negation is never
    # offered for a misspelling.
    resolved, notes = job(BASE + " --check-for-nan-in-loss-and-grad --use-custom-fsdp")
    assert [n.option for n in resolved.not_modelled] == ["--use-custom-fsdp"]
    assert any(n.startswith("from a Megatron-LM older than core_v0.16.1") for n in notes)
    message = error(BASE + " --overlap-p2p-communication")
    assert "--no-overlap-p2p-communication" not in message
    assert "'--'" in error(BASE + " --")


def test_flags_that_change_nothing_are_accepted_and_defaults_are_not_reported():
    quiet = (
        " --fim-data --fim-rate 0.5 --fim-spm-rate 0.5 --async-strategy nvrx "
        "--async-ckpt-use-cpu-shm --log-params-norm --rerun-mode validate_results "
        "--cuda-graph-impl none"
    )  # the last two: class 3, but their defaults
    resolved, notes = job(BASE + quiet)
    assert resolved.not_modelled == () and not [n for n in notes if n.startswith("warning")]
    resolved, _ = job(BASE + " --rerun-mode report_stats --moe-router-score-function sigmoid")
    assert [(n.option, n.direction) for n in resolved.not_modelled] == [
        ("--rerun-mode report_stats", "traffic")
    ]


def test_values_of_a_newer_megatron_lm_are_reported_not_refused():
    resolved, notes = job(
        BASE
        + " --swiglu --disable-bias-linear --num-experts 4 --moe-router-score-function sqrtsoftplus "
        "--moe-router-load-balancing-type quantile_balancing"
    )
    assert resolved.model.moe_router_score_function == "softmax"
    # quantile balancing is a job key (megatron-core 0.19 runs it; 0.16.1 refuses it)
    assert resolved.model.moe_router_load_balancing_type == "quantile_balancing"
    assert [n.option for n in resolved.not_modelled] == [
        "--moe-router-score-function sqrtsoftplus",
    ]


def test_ncclep_dispatcher_is_reported_not_refused():
    """--moe-flex-dispatcher-backend ncclep (core_v0.19.2 on): dispatched as DeepEP, reported."""
    resolved, _ = job(
        BASE + " --swiglu --disable-bias-linear --num-experts 8 --expert-model-parallel-size 2 "
        "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend ncclep"
    )
    assert resolved.parallel.moe_flex_dispatcher_backend == "deepep"
    assert [(n.option, n.direction) for n in resolved.not_modelled] == [
        ("--moe-flex-dispatcher-backend ncclep", "either")
    ]


def test_deterministic_mode_before_sm90_runs_flash_attention():
    a100, notes = job(BASE + " --deterministic-mode", gpu="a100")
    assert a100.attention_kernel == "flash" and any("training on a100" in n for n in notes)
    # Transformer Engine is deterministic with NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 alone too,
    # and megatron-core's attention refuses --deterministic-mode without it.
    env0 = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    assert job(BASE, gpu="a100", env=env0)[0].attention_kernel == "flash"
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO=1" in error(
        BASE + " --deterministic-mode", env={"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}
    )
    assert not job(BASE, env={"TORCHDYNAMO_DISABLE": "1"})[0].implementation.torch_compile
    assert job(BASE + " --deterministic-mode", gpu="h100")[0].attention_kernel == "fused"
    assert (
        job(BASE + " --deterministic-mode --attention-backend unfused", gpu="a100")[
            0
        ].attention_kernel
        == "unfused"
    )
    assert "no deterministic fused attention" in error(
        BASE + " --deterministic-mode --attention-backend fused", gpu="a100"
    )
    assert "--decoder-seq-length 512 differs" in error(
        BASE + " --pipeline-model-parallel-size 2 --decoder-seq-length 512"
    )


def test_options_of_recent_runs_map_to_their_keys():
    tr = job(
        BASE + " --pipeline-model-parallel-size 2 --defer-embedding-wgrad-compute "
        "--wgrad-deferral-limit 2 --bf16 --fp8-format hybrid --fp8-amax-history-len 16 "
        "--use-distributed-optimizer "
        "--ddp-pad-buckets-for-high-nccl-busbw --fine-grained-activation-offloading "
        "--offload-modules core_attn attn_proj --min-offloaded-tensor-size 4096"
    )[0].training
    assert (tr.defer_embedding_wgrad_compute, tr.wgrad_deferral_limit) == (True, 2)
    assert (tr.fp8_amax_history_len, tr.ddp_pad_buckets_for_high_nccl_busbw) == (16, True)
    assert (tr.activation_offload_modules, tr.min_offloaded_tensor_size) == (
        ["core_attn", "attn_proj"],
        4096,
    )
    resolved, notes = job(BASE + " --offload-modules core_attn --min-offloaded-tensor-size 8")
    assert resolved.training.activation_offload_modules is None
    assert any("are ignored without --fine-grained-activation-offloading" in n for n in notes)
    assert "needs --offload-modules" in error(BASE + " --fine-grained-activation-offloading")
    impl = job(
        BASE + " --cross-entropy-loss-fusion --cross-entropy-fusion-impl te "
        "--use-transformer-engine-op-fuser"
    )[0].implementation
    assert (impl.cross_entropy_loss_fusion, impl.cross_entropy_fusion_impl, impl.te_op_fuser) == (
        True,
        "te",
        True,
    )


def test_options_that_act_only_with_another_are_noted_not_reported():
    quiet, notes = job(
        BASE + " --no-fp8-wgrad --tp-comm-overlap-cfg ub.yaml "
        "--optimizer-offload-fraction 0.5 --disable-symmetric-registration "
        "--moe-router-score-function sqrtsoftplus --fp8-recipe custom"
    )
    assert quiet.not_modelled == ()
    assert any(
        n == "--tp-comm-overlap-cfg changes nothing without --tp-comm-overlap" for n in notes
    )
    loud, _ = job(BASE + " --use-nccl-ub --disable-symmetric-registration")
    assert [n.option for n in loud.not_modelled] == [
        "--use-nccl-ub",
        "--disable-symmetric-registration",
    ]


def test_overlap_param_gather_needs_what_megatron_lm_asserts_and_a_job_file_what_core_does():
    from tests.helpers import small_job

    # Megatron-LM's arguments.py asserts --overlap-grad-reduce with --overlap-param-gather.
    opt = f"{BASE} --use-distributed-optimizer --overlap-param-gather"
    assert "--overlap-param-gather needs --overlap-grad-reduce" in error(opt)
    assert job(opt + " --overlap-grad-reduce")[0].training.overlap_param_gather
    # megatron-core (as Megatron-Bridge drives it) overlaps the distributed optimizer's
    # parameter all-gathers without overlapping the gradient reduction.
    tr = small_job(training={"distributed_optimizer": True, "overlap_param_gather": True}).training
    assert tr.overlap_param_gather and not tr.overlap_grad_reduce
    with pytest.raises(ConfigError, match="overlap_param_gather needs training.distributed_opt"):
        small_job(training={"overlap_param_gather": True})


def test_megatron_fsdp_flags_map_to_their_keys_and_act_only_with_it():
    tr = job(
        BASE + " --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads "
        "--fsdp-double-buffer --suggested-communication-unit-size 500000000"
    )[0].training
    assert (tr.megatron_fsdp, tr.fsdp_sharding_strategy, tr.fsdp_double_buffer) == (
        True,
        "optim_grads",
        True,
    )
    assert tr.fsdp_communication_unit_size == 500_000_000
    # What megatron-core's MegatronFSDP and Megatron-LM set around it.
    assert tr.distributed_optimizer and tr.overlap_grad_reduce and not tr.overlap_param_gather
    assert not tr.gradient_accumulation_fusion
    resolved, notes = job(BASE + " --use-megatron-fsdp")
    assert resolved.training.fsdp_sharding_strategy == "optim_grads_params"
    assert resolved.training.overlap_param_gather
    assert any("--data-parallel-sharding-strategy not given" in n for n in notes)
    assert resolved.not_modelled == ()
    resolved, notes = job(BASE + " --fsdp-double-buffer --data-parallel-sharding-strategy optim")
    assert not resolved.training.megatron_fsdp and not resolved.training.fsdp_double_buffer
    assert any("are ignored without --use-megatron-fsdp" in n for n in notes)
    with pytest.raises(ConfigError, match="no_shard: megatron-core 0.16.1's Megatron-FSDP fails"):
        job(BASE + " --use-megatron-fsdp --data-parallel-sharding-strategy no_shard")
    # megatron-core 0.16.1's finalize_model_grads breaks torch FSDP2 (TypeError).
    message = error(BASE + " --use-torch-fsdp2 --untie-embeddings-and-output-weights")
    assert "fails in megatron-core 0.16.1" in message and "force_all_reduce" in message


def test_outer_dp_sharding_strategy_maps_to_its_key_with_megatron_fsdp():
    hsdp = BASE + " --use-megatron-fsdp --num-distributed-optimizer-instances 2"
    resolved, _ = job(hsdp + " --outer-dp-sharding-strategy optim")
    tr = resolved.training
    assert (tr.fsdp_outer_sharding_strategy, tr.num_distributed_optimizer_instances) == ("optim", 2)
    assert resolved.not_modelled == ()
    assert job(hsdp)[0].training.fsdp_outer_sharding_strategy == "no_shard"
    # megatron-core reads it with Megatron-FSDP only.
    resolved, notes = job(BASE + " --outer-dp-sharding-strategy optim")
    assert resolved.training.fsdp_outer_sharding_strategy == "no_shard"
    assert "--outer-dp-sharding-strategy is ignored without --use-megatron-fsdp" in notes
    # Where megatron-core 0.16.1 fails with it: said before anything is built.
    with pytest.raises(ConfigError, match="needs hybrid sharding"):
        job(BASE + " --use-megatron-fsdp --outer-dp-sharding-strategy optim")
    with pytest.raises(
        ConfigError, match="needs training.fsdp_sharding_strategy optim_grads_params"
    ):
        job(hsdp + " --data-parallel-sharding-strategy optim --outer-dp-sharding-strategy optim")
    message = error(hsdp + " --outer-dp-sharding-strategy optim_grads")
    assert "--outer-dp-sharding-strategy must be one of no_shard, optim" in message


def test_optimizer_cpu_offload_flags():
    base = BASE + " --use-distributed-optimizer --use-precision-aware-optimizer"
    tr = job(base + " --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d")[0].training
    assert (tr.optimizer_cpu_offload, tr.optimizer_offload_fraction) == (True, 1.0)
    assert tr.overlap_cpu_optimizer_d2h_h2d
    args = base + " --optimizer-cpu-offload --optimizer-offload-fraction 0.25"
    assert job(args)[0].training.optimizer_offload_fraction == 0.25
    # get_megatron_optimizer picks the classes again after reading it: no effect, not noted.
    assert not_modelled(split_args(args + " --use-torch-optimizer-for-cpu-offload")) == []
    # Megatron-LM accepts the fraction alone (and ignores it); metatrace says so.
    quiet, notes = job(base + " --optimizer-offload-fraction 0.5")
    assert not quiet.training.optimizer_cpu_offload
    assert any(
        "nothing without training.optimizer_cpu_offload" in n for n in [*quiet.notes, *notes]
    )
    assert quiet.training.optimizer_offload_fraction == 1.0
    with pytest.raises(ConfigError, match="needs training.use_precision_aware_optimizer"):
        job(BASE + " --use-distributed-optimizer --optimizer-cpu-offload")


def test_cuda_graph_flags():
    tr = job(BASE + " --cuda-graph-impl transformer_engine --cuda-graph-scope attn mlp")[0].training
    assert (tr.cuda_graph_impl, tr.cuda_graph_scope) == ("transformer_engine", ["attn", "mlp"])
    assert job(BASE + " --external-cuda-graph")[0].training.cuda_graph_impl == "transformer_engine"
    full = BASE + " --cuda-graph-impl local --cuda-graph-scope full_iteration"
    tr = job(full + " --cuda-graph-warmup-steps 2")[0].training
    assert (tr.cuda_graph_impl, tr.cuda_graph_scope) == ("local", ["full_iteration"])
    assert not_modelled(split_args(full + " --cuda-graph-warmup-steps 2")) == []
    # A newer Megatron-LM's impl full_iteration is the same graph.
    assert job(BASE + " --cuda-graph-impl full_iteration")[0].training.cuda_graph_scope == [
        "full_iteration"
    ]
    quiet, notes = job(BASE + " --cuda-graph-scope attn")
    assert quiet.training.cuda_graph_impl == "none"
    assert any("ignored without --cuda-graph-impl" in n for n in notes)


def test_local_layer_graph_flags():
    # --enable-cuda-graph (deprecated) and --cuda-graph-impl local are megatron-core's
    # per-layer graphs; "full" is the whole layer.
    for flags in (" --enable-cuda-graph", " --cuda-graph-impl local --cuda-graph-scope full"):
        tr = job(BASE + flags)[0].training
        assert (tr.cuda_graph_impl, tr.cuda_graph_scope) == ("local", None)


# --------------------------------------------------------------------------- GPT-OSS

# openai/gpt-oss-120b as a Megatron-LM command line (HEAD's --position-embedding-type yarn).
GPT_OSS = (
    "--num-layers 36 --hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64 "
    "--group-query-attention --num-query-groups 8 --kv-channels 64 --seq-length 4096 "
    "--max-position-embeddings 131072 --micro-batch-size 1 --global-batch-size 64 --bf16 "
    "--tokenizer-type HuggingFaceTokenizer --vocab-size 201088 --normalization RMSNorm "
    "--norm-epsilon 1e-5 --untie-embeddings-and-output-weights --hidden-dropout 0 "
    "--attention-dropout 0 --num-experts 128 --moe-router-topk 4 --moe-ffn-hidden-size 2880 "
    "--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 "
    "--softmax-type learnable --window-size 128,0 --window-attn-skip-freq 2 "
    "--position-embedding-type yarn --rotary-base 150000 --rotary-scaling-factor 32 "
    "--yarn-original-max-position-embeddings 4096 --yarn-beta-fast 32 --yarn-beta-slow 1"
)


def test_gpt_oss_command_line_gives_the_presets_model():
    from metatrace.config.presets import PRESETS

    resolved, notes = job(GPT_OSS)
    assert resolved.not_modelled == ()
    dims = PRESETS["gpt-oss-120b"].dims
    assert {k: getattr(resolved.model, k) for k in dims} == dims
    # Each flag is read, not left at a default that equals the preset's.
    m = resolved.model
    assert (m.activation, m.glu_linear_offset, m.activation_func_clamp_value) == (
        "quick_geglu",
        1.0,
        7.0,
    )
    assert (m.softmax_type, m.window_size, m.window_attn_skip_freq) == ("learnable", [128, 0], 2)
    assert (m.position_embedding_type, m.rotary_scaling_factor) == ("yarn", 32.0)


def problems(text, world_size=8) -> list[str]:
    """The problems of the one ConfigError that deriving (and checking) the job raises."""
    with pytest.raises(ConfigError) as info:
        job(text, world_size=world_size)
    return info.value.problems


@pytest.mark.parametrize(
    "flags, expected",
    [
        ("--window-size 128", "--window-size expects two integers left,right"),
        ("--window-size 128,0,0", "--window-size expects two integers left,right"),
        ("--window-size left,0", "--window-size expects two integers left,right"),
        ("--window-attn-skip-freq two", "--window-attn-skip-freq expects an integer or a list"),
        # Megatron-LM's _eval_pattern allows no spaces nor names (metatrace never evals)
        ("--window-attn-skip-freq '[1, 0]*18'", "--window-attn-skip-freq expects an integer"),
        ("--window-attn-skip-freq '[len]*36'", "--window-attn-skip-freq expects an integer"),
        ("--window-attn-skip-freq '([1]*3'", "--window-attn-skip-freq expects an integer"),
        ("--window-attn-skip-freq '[1]*35'", "one 0 or 1 per layer (36)"),
        ("--window-attn-skip-freq 0", "model.window_attn_skip_freq = 0 must be at least 1"),
        ("--softmax-type sink", "--softmax-type must be one of vanilla, off-by-one, learnable"),
        ("--activation-func-clamp-value high", "--activation-func-clamp-value expects a number"),
        ("--activation-func-clamp-value -1", "activation_func_clamp_value = -1 must be positive"),
        ("--swiglu", "--quick-geglu with --swiglu or --squared-relu: give one activation"),
        ("--position-embedding-type spiral", "--position-embedding-type must be one of"),
        ("--attention-backend flash", "flash: Transformer Engine 2.8 turns flash-attn off"),
    ],
)
def test_bad_gpt_oss_values_give_one_clear_error(flags, expected):
    found = problems(GPT_OSS + " " + flags)
    assert len(found) == 1 and expected in found[0], found


def test_gpt_oss_flags_read_as_megatron_lm_reads_them():
    m = job(GPT_OSS + " --window-size '(512,-1)' --window-attn-skip-freq '([0]+[1]*3)*9'")[0].model
    assert m.window_size == [512, -1]
    assert m.window_attn_skip_freq == ([0] + [1] * 3) * 9
    # A GLU offset needs quick_geglu while the bias-activation kernel is fused (megatron-core).
    swiglu = BASE + " --swiglu --glu-linear-offset 1"
    assert "needs --quick-geglu, or --no-bias-swiglu-fusion" in error(swiglu)
    assert job(swiglu + " --no-bias-swiglu-fusion")[0].model.glu_linear_offset == 1.0
    # Without a gated activation, without a window, without yarn: Megatron-LM ignores them.
    plain, notes = job(
        BASE + " --disable-bias-linear --glu-linear-offset 1 --window-attn-skip-freq 2 "
        "--yarn-beta-fast 16 --rotary-scaling-factor 4"
    )
    m = plain.model
    assert (m.glu_linear_offset, m.window_attn_skip_freq, m.beta_fast) == (0.0, None, 32.0)
    assert m.rotary_scaling_factor == 1.0 and plain.not_modelled == ()
    assert "--glu-linear-offset is ignored without --swiglu or --quick-geglu" in notes
    assert "--window-attn-skip-freq is ignored without --window-size" in notes
    assert "--yarn-beta-fast is ignored without --position-embedding-type yarn" in notes
    # mrope and relative are still reported as not modelled; yarn no longer.
    assert [n.option for n in job(BASE + " --position-embedding-type mrope")[0].not_modelled] == [
        "--position-embedding-type mrope"
    ]
    assert not_modelled(split_args(GPT_OSS)) == []
    # Multi-latent attention rotates by --rope-type; its yarn is not GPTModel's.
    mla = problems(BASE + " --multi-latent-attention --position-embedding-type yarn")
    assert len(mla) == 1 and "yarn with multi-latent attention" in mla[0], mla


def test_the_flex_dispatchers_sms_are_read():
    """--moe-deepep-num-sms (handle sizes, compute beside the dispatch) and
    --moe-hybridep-num-sms (compute beside the dispatch) reach the job."""
    args = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 1 --num-experts 4 "
        "--expert-model-parallel-size 2 --moe-token-dispatcher-type flex --bf16 --swiglu "
        "--disable-bias-linear "
    )
    job, _ = job_from_args((args + "--moe-deepep-num-sms 32").split(), world_size=2, gpu="h100")
    assert job.parallel.moe_deepep_num_sms == 32
    args += "--moe-flex-dispatcher-backend hybridep --moe-hybridep-num-sms 24"
    job, _ = job_from_args(args.split(), world_size=2, gpu="h100")
    assert (job.parallel.moe_flex_dispatcher_backend, job.parallel.moe_hybridep_num_sms) == (
        "hybridep",
        24,
    )


def test_moe_flags_on_a_dense_model_are_ignored_unless_megatron_core_refuses_them():
    resolved, notes = job(BASE + " --moe-aux-loss-coeff 0.01 --moe-router-topk 4")
    assert "--moe-aux-loss-coeff, --moe-router-topk are ignored without --num-experts" in notes
    assert resolved.model.moe_router_topk == 2  # the default: described without it
    # TransformerConfig asserts moe_ffn_hidden_size is None without experts
    with pytest.raises(ConfigError, match="moe_ffn_hidden_size needs mixture-of-experts"):
        job(BASE + " --moe-ffn-hidden-size 1024")
