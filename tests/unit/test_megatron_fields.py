"""The megatron-core config fields new in 0.19.2 (metatrace.config.megatron.fields)."""

import importlib.util
import os
import sys
from collections import Counter

import pytest

from metatrace.config.megatron.fields import FIELDS_0_19_2
from metatrace.config.megatron.flags import FLAGS

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import megatron_fields

# megatron-core 0.19.2's wheel unpacked (its sources are parsed, never imported)
MC19 = "/tmp/mc19/src"


def _installed_root() -> str:
    """The folder holding the installed megatron-core's `megatron/core` (not imported)."""
    spec = importlib.util.find_spec("megatron")
    assert spec is not None and spec.submodule_search_locations
    for folder in spec.submodule_search_locations:
        if os.path.isdir(os.path.join(folder, "core")):
            return os.path.dirname(folder)
    raise AssertionError("no megatron/core installed")


def test_each_field_once_with_a_class():
    keys = [(f.config, f.name) for f in FIELDS_0_19_2]
    assert len(keys) == len(set(keys)) == 93
    assert Counter(f.config for f in FIELDS_0_19_2) == {
        "TransformerConfig": 67,
        "OptimizerConfig": 14,
        "DistributedDataParallelConfig": 12,
    }
    for f in FIELDS_0_19_2:
        assert (f.direction is not None) == (f.cls == "not_modelled"), f.name
        if f.flag is not None:  # a field set by a flag is classed as the flag
            assert (f.cls, f.reason) == (FLAGS[f.flag].cls, FLAGS[f.flag].reason), f.name


def test_specific_fields():
    by_name = {f.name: f for f in FIELDS_0_19_2}
    # a flag under another name (DDP's field, Megatron-LM's --ddp- flag)
    assert by_name["num_buckets"].flag == "--ddp-num-buckets"
    assert by_name["num_buckets"].cls == "not_modelled"
    # set by validate_args for Muon & co. with --use-distributed-optimizer
    layer_wise = by_name["use_layer_wise_distributed_optimizer"]
    assert (layer_wise.config, layer_wise.cls, layer_wise.flag) == (
        "OptimizerConfig",
        "not_modelled",
        None,
    )
    assert by_name["megatron_fsdp_main_grads_dtype"].cls == "modelled"  # its flag's job key
    assert by_name["megatron_fsdp_enable_fine_grained_param_gather"].reason == "FSDP options"
    assert by_name["use_transformer_engine_op_fuser"].cls == "modelled"
    assert by_name["moe_grad_scale_func"].cls == "no_effect"
    assert by_name["gtp_weight_remat_size"].reason.startswith("GTP")


def test_fields_are_not_in_the_installed_0_16_1():
    """None of the table's fields is a field of the installed megatron-core 0.16.1's configs
    (parsed from its sources), and some of 0.16.1's were removed by 0.19.2."""
    root = _installed_root()
    for config in ("TransformerConfig", "OptimizerConfig", "DistributedDataParallelConfig"):
        old = megatron_fields.fields(root, config)
        assert len(old) > 10
        assert not [f.name for f in FIELDS_0_19_2 if f.config == config and f.name in old]
    assert "moe_extended_tp" in megatron_fields.fields(root, "TransformerConfig")
    assert "tensor_model_parallel_size" in megatron_fields.fields(root, "TransformerConfig")


@pytest.mark.skipif(not os.path.isdir(MC19), reason="megatron-core 0.19.2's sources not here")
def test_table_is_what_0_19_2_adds():
    new = megatron_fields.new_fields(_installed_root(), MC19)
    assert sorted((c, f) for c, f, _, _ in new) == sorted((f.config, f.name) for f in FIELDS_0_19_2)
