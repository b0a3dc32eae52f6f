"""megatron-core's own checks of a job: building its TransformerConfig and OptimizerConfig
raises what it refuses (as a ConfigError), before any model is built. The job's own rules (metatrace.config.checks)
ran when it was resolved; these need megatron-core, so they run where tracing starts."""

from __future__ import annotations


def check_with_megatron(job) -> None:
    """Raise ConfigError with megatron-core's message when it refuses `job`, or naming the
    option the installed megatron-core release does not have."""
    from metatrace.models.build import optimizer_config, transformer_config

    _check_release(job)
    transformer_config(job, cuda_graphs=True, check_only=True)
    optimizer_config(job, check_only=True)


def _check_release(job) -> None:
    """Job keys only megatron-core 0.19 has (the Megatron-FSDP dtypes, the repeated MTP layer),
    given another value than their default under an older release."""
    from metatrace.config.job import FSDP_DTYPES, changed_from_default
    from metatrace.errors import ConfigError
    from metatrace.hooks import guards

    if job.model.mtp_use_repeated_layer and not guards.since(0, 19):
        raise ConfigError(
            "model.mtp_use_repeated_layer needs megatron-core 0.19 or newer (megatron-core "
            f"{guards.release_text()} is installed, which builds a multi-token-prediction layer "
            'per depth; README.md, "megatron-core 0.19", says how to get it)'
        )
    given = changed_from_default(job.training, FSDP_DTYPES)
    if given and not guards.since(0, 19):
        key = given[0]
        raise ConfigError(
            f"training.{key}: {getattr(job.training, key)} needs megatron-core 0.19 or newer "
            f"(megatron-core {guards.release_text()} is installed, whose Megatron-FSDP has no "
            'such option; README.md, "megatron-core 0.19", says how to get it)'
        )
