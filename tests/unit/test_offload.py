"""Fine-grained activation offloading: module names are checked when the job is loaded (what
offloading moves is traced in tests/tracing/test_offload.py)."""

import pytest

from metatrace.errors import ConfigError
from tests.helpers import small_job


def test_unknown_module_names_are_refused_at_load():
    with pytest.raises(ConfigError, match="did you mean 'core_attn'"):
        small_job(training={"activation_offload_modules": ["core_atn"]})


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
