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
    """Job keys only megatron-core 0.19 has (the Megatron-FSDP dtypes, the repeated MTP layer,
    fine-grained offloading's steady-state knobs, quantile-balancing routing), given another
    value than their default under an older release, and Megatron-FSDP in the combined 1F1B
    schedule."""
    from metatrace.config.job import FSDP_DTYPES, OFFLOAD_KNOBS, changed_from_default
    from metatrace.errors import ConfigError
    from metatrace.hooks import guards

    if guards.since(0, 19):
        return
    tr, par = job.training, job.parallel
    given = [
        (f"training.{key}: {getattr(tr, key)}", why)
        for keys, why in (
            (OFFLOAD_KNOBS, "whose fine-grained activation offloading offloads every group"),
            (FSDP_DTYPES, "whose Megatron-FSDP has no such option"),
        )
        for key in changed_from_default(tr, keys)
    ]
    if job.model.mtp_use_repeated_layer:
        why = "which builds a multi-token-prediction layer per depth"
        given.insert(0, ("model.mtp_use_repeated_layer", why))
    if job.model.mla_down_proj_fusion:
        why = "whose multi-latent attention has no fused down-projection"
        given.insert(0, ("model.mla_down_proj_fusion", why))
    if job.model.moe_router_load_balancing_type == "quantile_balancing":
        why = "whose router has no quantile balancing"
        given.insert(0, ("model.moe_router_load_balancing_type: quantile_balancing", why))
    if tr.megatron_fsdp and par.overlap_moe_expert_parallel_comm and job.model.num_experts:
        why = (
            "whose combined 1F1B schedule calls the layers' parts directly, past the hooks with "
            "which Megatron-FSDP gathers and releases their parameters; 0.19 gathers per part "
            "and releases per layer"
        )
        given.insert(
            0, ("training.megatron_fsdp with parallel.overlap_moe_expert_parallel_comm", why)
        )
    if given:
        what, why = given[0]
        raise ConfigError(
            f"{what} needs megatron-core 0.19 or newer (megatron-core {guards.release_text()} "
            f'is installed, {why}; README.md, "megatron-core 0.19", says how to get it)'
        )
