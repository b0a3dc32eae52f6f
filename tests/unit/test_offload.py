"""Fine-grained activation offloading: module names are checked when the job is loaded (what
offloading moves is traced in tests/tracing/test_offload.py)."""

import pytest

from metatrace.errors import ConfigError
from tests.helpers import small_job


def test_unknown_module_names_are_refused_at_load():
    with pytest.raises(ConfigError, match="did you mean 'core_attn'"):
        small_job(training={"activation_offload_modules": ["core_atn"]})


@pytest.mark.parametrize(
    "training, sections, message",
    [
        ({"activation_offload_fraction": 0.0}, {}, r"must be above 0 and at most 1 \(at 0"),
        ({"activation_offload_fraction": 1.5}, {}, "must be above 0 and at most 1"),
        (
            {"delta_offload_bytes_across_pp_ranks": 1},
            {"parallel": {"pp": 2}, "cluster": {"num_gpus": 2}, "model": {"num_layers": 4}},
            "with pipeline parallelism: megatron-core 0.19.2 keeps the first offload group",
        ),
        ({"delta_offload_bytes_across_pp_ranks": -1}, {}, "must not be negative"),
        ({"fine_grained_offloading_max_inflight_offloads": -1}, {}, "must not be negative"),
    ],
    ids=["fraction-0", "fraction-above-1", "delta-with-pp", "delta-negative", "cap"],
)
def test_steady_state_knobs_megatron_core_cannot_run_are_refused(training, sections, message):
    training = {"activation_offload_modules": ["core_attn"], **training}
    with pytest.raises(ConfigError, match=message):
        small_job(training=training, **sections)


def test_delta_without_pipeline_parallelism_is_taken():
    """Pipeline rank 0 keeps 0 x delta bytes on the GPU: nothing changes, nothing refused."""
    training = {"activation_offload_modules": ["core_attn"]}
    job = small_job(training={**training, "delta_offload_bytes_across_pp_ranks": 1 << 20})
    assert job.training.delta_offload_bytes_across_pp_ranks == 1 << 20


def test_steady_state_flags_map_to_their_keys_and_back():
    from metatrace.config.megatron.args import job_from_args, split_args
    from metatrace.config.megatron.to_args import megatron_args

    args = (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
        "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 8 --bf16 "
        "--vocab-size 1000 --fine-grained-activation-offloading --offload-modules core_attn "
        "--activation-offload-fraction 0.5 --fine-grained-offloading-max-inflight-offloads 2 "
        "--delta-offload-bytes-across-pp-ranks 4096"
    )
    resolved, _ = job_from_args(split_args(args), world_size=8)
    tr = resolved.training
    assert tr.activation_offload_fraction == 0.5
    assert tr.fine_grained_offloading_max_inflight_offloads == 2
    assert tr.delta_offload_bytes_across_pp_ranks == 4096
    assert resolved.not_modelled == ()
    back = " ".join(megatron_args(resolved))
    assert "--activation-offload-fraction 0.5" in back
    assert "--fine-grained-offloading-max-inflight-offloads 2" in back
    assert "--delta-offload-bytes-across-pp-ranks 4096" in back


# ----------------------------------------------------------------- layer-wise (Transformer Engine)


def test_te_layer_windows_are_tes():
    """TE 2.8's layer_window_map: after which layer's forward group i's GPU copies go (and
    before which layer's backward it comes back); the last window is always the last layer."""
    from metatrace.models.te_cpu_offload import _window_map

    assert _window_map(40, 80) == {i: 2 * i + 1 for i in range(40)}
    assert _window_map(20, 80) == {i: 4 * i + 3 for i in range(20)}
    # 80 = 2 * 30 + 20: the first 20 windows take one more layer each.
    windows = _window_map(30, 80)
    assert [windows[i] for i in (0, 1, 19, 20, 29)] == [2, 5, 59, 61, 79]
    for n, layers in ((1, 2), (3, 7), (7, 8), (13, 32)):
        assert max(_window_map(n, layers).values()) == layers - 1


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"training": {"cpu_offloading_num_layers": 2}}, r"between 1 and num_layers - 1 \(1\)"),
        (
            {"parallel": {"pp": 2}, "cluster": {"num_gpus": 2}},
            "needs parallel.pp 1",
        ),
        (
            {"training": {"recompute": {"granularity": "selective"}}},
            "does not work with training.recompute",
        ),
        (
            {"training": {"activation_offload_modules": ["core_attn"]}},
            "exclude each other",
        ),
    ],
    ids=["all-layers", "pipeline", "recompute", "fine-grained"],
)
def test_layer_offloading_refuses_what_megatron_core_refuses(sections, message):
    training = {"cpu_offloading_num_layers": 1, **sections.pop("training", {})}
    with pytest.raises(ConfigError, match=message):
        small_job(training=training, **sections)


def test_megatron_lm_flag_maps_to_the_layer_count():
    from metatrace.config.megatron.args import job_from_args, split_args

    args = (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
        "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 8 --bf16 "
        "--vocab-size 1000 --cpu-offloading-num-layers 3"
    )
    resolved, _ = job_from_args(split_args(args), world_size=8)
    assert resolved.training.cpu_offloading_num_layers == 3
    assert resolved.not_modelled == ()


def test_the_planners_bound_keeps_the_layer_inputs_a_fraction_leaves():
    """memory_lower_bound: offloading qkv_linear moves every layer input to the host; with
    activation_offload_fraction 0.5 over 8 layers (one or more groups a layer) the last
    int(8 x 0.5) - 1 = 3 whole layers keep theirs ([s, b, h] bf16, one micro-batch in flight
    without pipelining)."""
    from metatrace.planning.estimates import memory_lower_bound

    def bound(fraction):
        training = {
            "activation_offload_modules": ["qkv_linear", "core_attn"],
            "activation_offload_fraction": fraction,
        }
        job = small_job(model={"num_layers": 8}, training=training)
        return memory_lower_bound(job), job

    full, job = bound(1.0)
    half, _ = bound(0.5)
    tokens = job.training.seq_length * job.training.micro_batch_size
    assert half - full == 3 * tokens * job.model.hidden_size * 2
