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


# Job keys (with their default) that only megatron-core 0.19 has: the release that adds them.
_SINCE = {
    ("training", "fsdp_main_grads_dtype", "auto"): (0, 19),
    ("training", "fsdp_main_params_dtype", "fp32"): (0, 19),
    ("training", "fsdp_grad_comm_dtype", "auto"): (0, 19),
}


def _check_release(job) -> None:
    from metatrace.errors import ConfigError
    from metatrace.hooks import guards

    for (section, key, default), release in _SINCE.items():
        value = getattr(getattr(job, section), key)
        if value != default and not guards.since(*release):
            raise ConfigError(
                f"{section}.{key}: {value} needs megatron-core {'.'.join(map(str, release))} or "
                f"newer (megatron-core {guards.release_text()} is installed, whose Megatron-FSDP "
                f'has no such option; README.md, "megatron-core 0.19", says how to get it)'
            )
