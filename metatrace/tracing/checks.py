"""megatron-core's own checks of a job: building its TransformerConfig and OptimizerConfig
raises what it refuses (as a ConfigError), before any model is built. The job's own rules (metatrace.config.checks)
ran when it was resolved; these need megatron-core, so they run where tracing starts."""

from __future__ import annotations


def check_with_megatron(job) -> None:
    """Raise ConfigError with megatron-core's message when it refuses `job`."""
    from metatrace.models.build import optimizer_config, transformer_config

    transformer_config(job, cuda_graphs=True, check_only=True)
    optimizer_config(job, check_only=True)
