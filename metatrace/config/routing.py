"""The routing assumption of a mixture-of-experts job: how many tokens each expert gets, which
depends on the data in a real run (metatrace.models.moe substitutes it for megatron-core's
data-dependent routing; reports describe it next to the figures).

random (the default): routing as it is at the start of training. Router weights drawn at random
make each token's top-k an exchangeable draw: k distinct experts, every k-subset equally likely.
Per layer and micro-batch every source rank (the tp x ep ranks whose tokens an expert receives)
routes its N tokens so; expert e's count from all S sources is then exactly Binomial(S*N, k/E),
and the counts of the E experts sum to S*N*k. The hottest expert's expected count is computed
(`expected_hottest`) and the rank holding it is the binding one: its first local expert
receives that multiple of its share (metatrace.models.moe).

Known limitations: tokens are taken as independent; in a real run they share the router's
weights, and a common component of the hidden states gives some experts more tokens in every
micro-batch, which grows with training's imbalance and shrinks with load balancing
(sinkhorn, which balances each source rank's choices, or an auxiliary loss). The hottest expert
is taken for every layer and micro-batch on the rank shown, not as a draw per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def expected_max_binomial(draws: int, p: float, count: int) -> float:
    """E[max of `count` independent Binomial(draws, p)], exactly: the sum over x >= 0 of
    P(max > x) = 1 - F(x)^count, F the binomial's distribution function. The terms below
    mean - 12 sd are 1 (F there is below 1e-32) and are counted without being summed; the sum
    stops where the tail's term falls below 1e-15."""
    if count == 1 or p <= 0 or p >= 1 or draws == 0:
        return draws * p
    mean, sd = draws * p, math.sqrt(draws * p * (1 - p))
    lo = max(0, math.floor(mean - 12 * sd))
    log_pmf = (
        math.lgamma(draws + 1)
        - math.lgamma(lo + 1)
        - math.lgamma(draws - lo + 1)
        + lo * math.log(p)
        + (draws - lo) * math.log1p(-p)
    )
    pmf, cdf, total = math.exp(log_pmf), 0.0, float(lo)
    ratio = p / (1 - p)
    for x in range(lo, draws + 1):
        cdf += pmf
        term = 1 - min(cdf, 1.0) ** count
        if x > mean and term < 1e-15:
            break
        total += term
        pmf *= (draws - x) / (x + 1) * ratio
    return total


def expected_hottest(draws: int, experts: int, topk: int) -> float:
    """The hottest expert's expected count as a multiple of the mean, when `draws` tokens each
    choose `topk` distinct experts of `experts` uniformly (random router weights at
    initialisation). Each count is exactly Binomial(draws, k/E); they are not independent: they
    sum to draws*k, with correlation -1/(E-1) between any two. The maximum is computed exactly
    for independent counts (`expected_max_binomial`) and its excess over the mean scaled by
    sqrt(E/(E-1)), which is exact for normal counts with that correlation (X_e - mean is then
    sd*sqrt(E/(E-1))*(Z_e - mean of Z), whose maximum is max Z - mean of Z). Against a
    Monte-Carlo draw of the routing itself: within 1 % of the excess (tests/unit/test_routing.py);
    independence alone falls 14 % short of it with 4 experts."""
    if experts <= 1 or topk >= experts or draws == 0:
        return 1.0
    p = topk / experts
    mean = draws * p
    excess = expected_max_binomial(draws, p, experts) - mean
    return 1 + excess * math.sqrt(experts / (experts - 1)) / mean


@dataclass(frozen=True)
class Dispatch:
    """What one MoE layer routes per micro-batch, as the job lays it out: `tokens` on each of
    `sources` ranks (the dispatcher's tp x ep group), each to `topk` of `experts`."""

    tokens: int
    sources: int
    experts: int
    topk: int


@dataclass(frozen=True)
class Routing:
    """The routing assumption of a job (`training.moe_routing` and its options)."""

    policy: str = "random"
    hottest_expert_load: float = 1.0
    """With balanced routing: the stated load of the hottest expert on every rank."""
    capacity_factor: float | None = None
    """megatron-core's token dropping caps what one source rank sends to an expert at this
    multiple of its share (so it caps the hottest expert's load)."""
    dispatch: Dispatch | None = None
    """The job's layout of one dispatch (to describe the random policy's load)."""
    _hottest: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    """expected_hottest's values by its arguments: every MoE layer of a trace asks for the
    same dispatch, forward and recompute alike (DeepSeek-V3's 58 twice), and one value takes
    up to 0.1 s (its sum runs to `draws` where the distribution function rounds short of 1).
    The instance lives on one job's transformer config (models.build), so the memo is one
    trace's."""

    @classmethod
    def of(cls, config) -> Routing:
        """The assumption models.build.transformer_config attached to megatron-core's config."""
        return getattr(config, "metatrace_routing", cls())

    @classmethod
    def of_job(cls, job) -> Routing:
        tr, m, par = job.training, job.model, job.parallel
        policy = tr.moe_routing
        if policy is None:  # a stated hottest-expert load is a balanced assumption
            policy = "random" if tr.moe_hottest_expert_load is None else "balanced"
        dispatch = None
        if m.num_experts:
            # With experts and tp > 1 sequence parallelism is on (checks.py), so each rank of
            # the tp x cp grid routes its own s*b/(tp*cp) tokens; the dispatcher's group is the
            # expert tensor- and expert-parallel ranks.
            tokens = tr.seq_length * tr.micro_batch_size // (par.tp * par.cp)
            dispatch = Dispatch(
                tokens, (par.etp or par.tp) * par.ep, m.num_experts, m.moe_router_topk
            )
        load = tr.moe_hottest_expert_load
        return cls(policy, 1.0 if load is None else load, tr.moe_expert_capacity_factor, dispatch)

    def load(self, tokens: int, sources: int, experts: int, topk: int) -> float:
        """The hottest expert's multiple of its share in a dispatch of `tokens` on each of
        `sources` ranks, after token dropping."""
        if self.policy != "random":
            return self.balanced_load
        return self._capped(self.hottest(tokens * sources, experts, topk))

    def hottest(self, draws: int, experts: int, topk: int) -> float:
        """expected_hottest(draws, experts, topk), computed once per instance."""
        args = (draws, experts, topk)
        value = self._hottest.get(args)
        if value is None:
            value = self._hottest[args] = expected_hottest(draws, experts, topk)
        return value

    @property
    def balanced_load(self) -> float:
        """Balanced routing's hottest expert: the stated load after token dropping."""
        return self._capped(self.hottest_expert_load)

    def _capped(self, load: float) -> float:
        return load if self.capacity_factor is None else min(load, self.capacity_factor)

    def describe(self) -> str:
        if self.policy == "capacity":
            return (
                f"each expert's input padded to its capacity ({self.capacity_factor:g}x the "
                "balanced share; megatron-core's static path)"
            )
        if self.policy == "random":
            text = "random top-k at initialisation"
            d = self.dispatch
            if d is None:
                return text
            load = self.load(d.tokens, d.sources, d.experts, d.topk)
            text += (
                f": the hottest of {d.experts} experts {load:.3f}x its share "
                f"({d.sources} x {d.tokens} tokens, top-{d.topk}), on every rank"
            )
            uncapped = self.hottest(d.tokens * d.sources, d.experts, d.topk)
            if load != uncapped:
                text += f" (capacity factor {self.capacity_factor:g} drops the rest)"
            return text
        text = "balanced (every expert gets tokens x topk / experts)"
        hottest = self.balanced_load
        if self.hottest_expert_load != 1.0:
            text += f", the hottest expert of every rank {hottest:g}x its share"
            if hottest != self.hottest_expert_load:
                text += f" (capacity factor {self.capacity_factor:g} drops the rest)"
        return text
