"""pass@k: the unbiased estimator against brute-force enumeration of k-subsets."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from marl_llm.training.rollout_metrics import mean_pass_at_k, pass_at_k


def brute_force(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (the first c correct) that contain a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_matches_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_edge_cases():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 3, 8) == 1.0  # n - c < k: every subset has a correct sample
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)


def test_large_n_is_stable_and_exact():
    for n, c, k in [(1000, 1, 1), (200, 100, 100), (500, 7, 50), (2000, 1500, 10)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        got = pass_at_k(n, c, k)
        assert 0.0 <= got <= 1.0
        assert got == pytest.approx(float(exact), rel=1e-9, abs=1e-12)


def test_invalid_arguments():
    for args in [(4, 1, 5), (4, 5, 1), (4, -1, 1), (4, 1, 0), (0, 0, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*args)


def test_mean_pass_at_k():
    assert mean_pass_at_k([(10, 3), (5, 0), (4, 4)], 1) == pytest.approx((0.3 + 0.0 + 1.0) / 3)
    assert mean_pass_at_k([(4, 1), (4, 2)], 2) == pytest.approx((0.5 + 5 / 6) / 2)
    with pytest.raises(ValueError):
        mean_pass_at_k([], 1)
    with pytest.raises(ValueError):
        mean_pass_at_k([(2, 1)], 3)
