"""Multi-latent attention and multi-token prediction: the config checks (the traced counts are in
tests/tracing/test_mla.py)."""

import pytest

from metatrace.errors import ConfigError
from tests.helpers import MLA, small_job


@pytest.mark.parametrize(
    "sections, message",
    [
        (
            {"model": MLA, "parallel": {"cp": 2}, "training": {"seq_length": 64}},
            "parallel.cp > 1 with multi-latent attention is not modelled",
        ),
        (
            {"model": MLA, "implementation": {"attention_backend": "flash"}},
            "flash with multi-latent attention",
        ),
        ({"model": {**MLA, "num_query_groups": 2}}, "MLA has no grouped-query attention"),
        (
            {"model": {"rope_type": "yarn"}},
            "rope_type yarn is multi-latent attention.s; for YaRN with other attention",
        ),
        (
            {"training": {"recompute": {"granularity": "selective", "modules": ["mla_up_proj"]}}},
            "'mla_up_proj' needs model.multi_latent_attention",
        ),
        (
            {"model": {"mtp_num_layers": 1, "position_embedding_type": "learned_absolute"}},
            "multi-token prediction needs model.position_embedding_type rope or none",
        ),
        ({"model": {"mtp_num_layers": 0}}, "model.mtp_num_layers = 0 must be at least 1"),
        (
            {"model": {**MLA, "mla_down_proj_fusion": True, "q_lora_rank": None}},
            "mla_down_proj_fusion needs model.q_lora_rank",
        ),
        (
            {
                "model": {"num_layers": 3, "mtp_num_layers": 1},
                "parallel": {"pp": 3, "layout": "Et|ttm|L"},
            },
            "MTP layers \\(m\\) in the stage of the loss",
        ),
        (
            {"model": {"num_layers": 3}, "parallel": {"pp": 2, "layout": "Et|ttmL"}},
            "places 1 MTP layers \\(m\\), but model.mtp_num_layers = None",
        ),
    ],
)
def test_mla_mtp_config_errors(sections, message):
    with pytest.raises(ConfigError, match=message):
        small_job(**sections)
