import itertools
import math

import pytest

from cleaner_jax.eval.pass_at_k import mean_pass_at_k, pass_at_k


def brute_force(n, c, k):
    """Fraction of k-subsets of n samples (c correct) that contain a correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 1, 1), (5, 2, 3), (8, 3, 4), (10, 9, 2), (6, 6, 6), (7, 1, 7)])
def test_matches_enumeration(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12)


def test_pass_at_1_is_accuracy_and_large_n_is_stable():
    assert pass_at_k(16, 4, 1) == pytest.approx(0.25)
    assert pass_at_k(1000, 10, 100) == pytest.approx(1 - math.comb(990, 100) / math.comb(1000, 100))
    assert mean_pass_at_k([[True, False], [False, False]], 1) == pytest.approx(0.25)


def test_bad_arguments():
    with pytest.raises(ValueError, match="k=3"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="c=4"):
        pass_at_k(3, 4, 1)


def test_mean_over_problems_with_different_sample_counts_matches_enumeration():
    """Problems keep different numbers of valid samples (infra failures are dropped)."""
    problems = [[True, False, False, True, False], [False, False, False], [True, True, False, False]]
    for k in (1, 2, 3):
        by_hand = sum(brute_force(len(p), sum(p), k) for p in problems) / len(problems)
        assert mean_pass_at_k(problems, k) == pytest.approx(by_hand, abs=1e-12)
