"""The default routing assumption (random top-k at initialisation, metatrace.config.routing):
the hottest expert's expected load against an exact enumeration and a Monte-Carlo draw of the
same routing, and how the job's keys select the policy."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

from metatrace.config.routing import Routing, expected_hottest, expected_max_binomial
from metatrace.errors import ConfigError
from tests.helpers import MOE, small_job


def test_expected_max_binomial_is_the_enumerated_maximum():
    # Three independent Binomial(10, 0.3): every outcome (11^3) weighted by its probability.
    n, p = 10, 0.3
    pmf = [math.comb(n, x) * p**x * (1 - p) ** (n - x) for x in range(n + 1)]
    exact = sum(
        pmf[a] * pmf[b] * pmf[c] * max(a, b, c)
        for a, b, c in itertools.product(range(n + 1), repeat=3)
    )
    assert expected_max_binomial(n, p, 3) == pytest.approx(exact, rel=1e-12)
    assert expected_max_binomial(n, p, 1) == pytest.approx(n * p)


def routed_max(tokens: int, experts: int, topk: int) -> float:
    """E[max count] over every way `tokens` tokens can each choose `topk` distinct experts."""
    subsets = list(itertools.combinations(range(experts), topk))
    total = 0
    for choice in itertools.product(subsets, repeat=tokens):
        counts = [0] * experts
        for subset in choice:
            for e in subset:
                counts[e] += 1
        total += max(counts)
    return total / len(subsets) ** tokens


@pytest.mark.parametrize("tokens, experts, topk", [(6, 4, 1), (4, 4, 2), (3, 6, 2)])
def test_few_tokens_against_every_routing(tokens, experts, topk):
    """Exact for a handful of tokens (every routing enumerated): the hottest expert's excess
    over its share within 6 % (1,296 to 4,096 routings; the normal correction is at its
    weakest with so few tokens)."""
    mean = tokens * topk / experts
    exact = routed_max(tokens, experts, topk) - mean
    assert (expected_hottest(tokens, experts, topk) - 1) * mean == pytest.approx(exact, rel=0.06)


# (tokens of all sources, experts, topk, Monte-Carlo E[max] - mean): the calibration cases'
# layouts (8,192 tokens over 4 or 8 experts, top-1 and top-2) and a wide one (256 tokens, 64
# experts, top-8). 8,000 draws each, seed 0.
MONTE_CARLO = [(8192, 4, 1), (8192, 8, 2), (256, 64, 8)]


def monte_carlo(tokens, experts, topk, draws=8000, seed=0):
    """Mean and standard error of the hottest expert's count when each token picks `topk`
    distinct experts uniformly (the k smallest of E uniform keys)."""
    rng = np.random.default_rng(seed)
    hottest = np.empty(draws)
    for i in range(draws):
        if topk == 1:
            counts = np.bincount(rng.integers(0, experts, tokens), minlength=experts)
        else:
            keys = rng.random((tokens, experts))
            chosen = np.argpartition(keys, topk, axis=1)[:, :topk]
            counts = np.bincount(chosen.ravel(), minlength=experts)
        hottest[i] = counts.max()
    return hottest.mean(), hottest.std() / math.sqrt(draws)


@pytest.mark.parametrize("tokens, experts, topk", MONTE_CARLO)
def test_hottest_expert_against_a_monte_carlo_draw_of_the_routing(tokens, experts, topk):
    """The expected hottest count within 3 % of its excess over the share in a Monte-Carlo
    draw of the routing itself (measured: 0.1-0.4 % short; the draw's standard error is
    0.2-0.5 % of the excess); independent binomials alone fall short by more than three
    standard errors (by 14 % of the excess with 4 experts)."""
    mean = tokens * topk / experts
    drawn, stderr = monte_carlo(tokens, experts, topk)
    excess = drawn - mean
    assert stderr < 0.01 * excess
    predicted = expected_hottest(tokens, experts, topk) * mean - mean
    assert predicted == pytest.approx(excess, rel=0.03)
    independent = expected_max_binomial(tokens, topk / experts, experts) - mean
    assert independent < excess - 3 * stderr


def test_the_calibration_layouts_load():
    # 8 experts, top-1, 2 sources of 4,096 tokens: 1,024 each on average, the hottest 1,069.7
    # (Monte Carlo: 1,069.7 +- 0.3); 4 experts, 8,192 tokens: 2,048, the hottest 2,094.6.
    assert expected_hottest(8192, 8, 1) * 1024 == pytest.approx(1069.7, abs=0.1)
    assert expected_hottest(8192, 4, 1) * 2048 == pytest.approx(2094.6, abs=0.1)
    assert expected_hottest(8192, 8, 8) == 1.0  # every token to every expert
    assert expected_hottest(8192, 1, 1) == 1.0


def moe(**training):
    return small_job(model=MOE, parallel={"ep": 2}, training=training, cluster={"num_gpus": 2})


def test_the_default_is_random_routing_and_says_its_load():
    routing = Routing.of_job(moe())
    assert routing.policy == "random"
    # tp 1: each of the ep 2 sources routes s*b = 64*2 tokens to 2 of 4 experts.
    assert routing.load(128, 2, 4, 2) == pytest.approx(1.0742, abs=1e-4)
    assert routing.describe() == (
        "random top-k at initialisation: the hottest of 4 experts 1.074x its share "
        "(2 x 128 tokens, top-2), on every rank"
    )
    capped = Routing.of_job(moe(moe_expert_capacity_factor=1.05))
    assert capped.load(128, 2, 4, 2) == 1.05
    assert "(capacity factor 1.05 drops the rest)" in capped.describe()


def test_the_load_is_computed_once_per_dispatch_and_stays_exact():
    # Routing keeps each dispatch's value (every MoE layer of a trace asks for the same one):
    # asked again, and asked in turn with other dispatches, each gets its own exact value.
    routing = Routing.of_job(moe())
    dispatches = [(128, 2, 4, 2), (64, 2, 4, 2), (128, 2, 4, 1), (128, 2, 4, 2), (64, 2, 4, 2)]
    for tokens, sources, experts, topk in dispatches:
        exact = expected_hottest(tokens * sources, experts, topk)
        assert routing.load(tokens, sources, experts, topk) == exact
    assert len(routing._hottest) == 3
    # A replaced copy (another policy) starts its own memo; equality ignores the memo.
    assert dataclasses.replace(routing, capacity_factor=1.01).load(128, 2, 4, 2) == 1.01
    assert routing == Routing.of_job(moe())


def test_a_stated_hottest_load_is_balanced_routing():
    routing = Routing.of_job(moe(moe_hottest_expert_load=1.3))
    assert (routing.policy, routing.load(128, 2, 4, 2)) == ("balanced", 1.3)
    assert routing.describe().startswith("balanced (every expert gets tokens x topk / experts)")
    assert Routing.of_job(moe(moe_routing="balanced")).load(128, 2, 4, 2) == 1.0


def test_random_routing_with_a_stated_hottest_load_is_refused():
    with pytest.raises(ConfigError, match="moe_routing: random derives the hottest expert's"):
        moe(moe_routing="random", moe_hottest_expert_load=1.3)
