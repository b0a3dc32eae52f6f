"""The routing assumption of a mixture-of-experts job: how many tokens each expert gets, which
depends on the data in a real run (metatrace.models.moe substitutes it for megatron-core's
data-dependent routing; reports describe it next to the figures)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Routing:
    """The routing assumption of a job (`training.moe_routing` and its options)."""

    policy: str = "balanced"
    hottest_expert_load: float = 1.0
    capacity_factor: float | None = None
    """With balanced routing: megatron-core's token dropping caps what one source rank sends
    to an expert at this multiple of its share (so it caps the hottest expert's load)."""

    @classmethod
    def of(cls, config) -> Routing:
        """The assumption models.build.transformer_config attached to megatron-core's config."""
        return getattr(config, "metatrace_routing", cls())

    @classmethod
    def of_job(cls, job) -> Routing:
        tr = job.training
        return cls(tr.moe_routing, tr.moe_hottest_expert_load, tr.moe_expert_capacity_factor)

    @property
    def hottest(self) -> float:
        """The hottest local expert's load after token dropping."""
        if self.capacity_factor is None:
            return self.hottest_expert_load
        return min(self.hottest_expert_load, self.capacity_factor)

    def describe(self) -> str:
        if self.policy == "capacity":
            return (
                f"each expert's input padded to its capacity ({self.capacity_factor:g}x the "
                "balanced share; megatron-core's static path)"
            )
        text = "balanced (every expert gets tokens x topk / experts)"
        if self.hottest_expert_load != 1.0:
            text += f", the hottest expert of every rank {self.hottest:g}x its share"
            if self.hottest != self.hottest_expert_load:
                text += f" (capacity factor {self.capacity_factor:g} drops the rest)"
        return text
