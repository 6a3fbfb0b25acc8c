"""The study's statistics over seeds against hand computations and an independent NumPy bootstrap
drawing the same resamples as scipy (rng.integers(0, n, (B, n)) from the same seeded Generator)."""
import json
import math

import numpy as np
import pytest

from cleaner_jax.study import aggregate
from cleaner_jax.study.aggregate import BootstrapSpec, read_metrics, run_summary, seed_stats, summarize

SPEC = BootstrapSpec(resamples=4000, seed=7, level=0.95, method="percentile")


def numpy_bootstrap_ci(x, resamples, seed, level):
    """The percentile interval of the mean by hand: draw index rows, average, take the quantiles."""
    x = np.asarray(x, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(x), (resamples, len(x)))
    means = x[idx].mean(axis=1)
    alpha = (1 - level) / 2
    return np.quantile(means, [alpha, 1 - alpha])


def test_mean_std_and_ci_of_two_seeds_by_hand():
    # mean 0.4; std (ddof=1) = sqrt(((0.2-0.4)^2 + (0.6-0.4)^2) / 1) = 0.2 * sqrt(2).
    # A resample of two values is {a,a}, {a,b}, {b,a} or {b,b}: its mean is a with probability 1/4,
    # so the 2.5% and 97.5% quantiles of the bootstrap distribution are a and b exactly.
    s = seed_stats([0.2, 0.6], SPEC)
    assert s["n"] == 2
    assert s["mean"] == pytest.approx(0.4, abs=1e-15)
    assert s["std"] == pytest.approx(0.2 * math.sqrt(2), abs=1e-15)
    assert s["ci_low"] == pytest.approx(0.2, abs=1e-15)
    assert s["ci_high"] == pytest.approx(0.6, abs=1e-15)


def test_ci_equals_an_independent_numpy_bootstrap_with_the_same_resamples():
    x = [0.31, 0.12, 0.55, 0.47, 0.20]
    s = seed_stats(x, SPEC)
    low, high = numpy_bootstrap_ci(x, SPEC.resamples, SPEC.seed, SPEC.level)
    assert s["ci_low"] == pytest.approx(low, abs=1e-12)
    assert s["ci_high"] == pytest.approx(high, abs=1e-12)
    assert s["mean"] == pytest.approx(sum(x) / 5, abs=1e-15)
    assert s["std"] == pytest.approx(float(np.sqrt(np.sum((np.array(x) - np.mean(x)) ** 2) / 4)), abs=1e-15)
    # another bootstrap seed draws other resamples: a different interval (so the seed is used)
    # (100 resamples: interpolated quantiles, not the few values a mean of 5 of 5 points can take)
    few = [seed_stats(x, BootstrapSpec(100, seed, SPEC.level, SPEC.method)) for seed in (1, 2)]
    assert (few[0]["ci_low"], few[0]["ci_high"]) != (few[1]["ci_low"], few[1]["ci_high"])
    for seed, f in zip((1, 2), few):
        assert (f["ci_low"], f["ci_high"]) == pytest.approx(tuple(numpy_bootstrap_ci(x, 100, seed, SPEC.level)), abs=1e-12)


def test_bca_interval_is_scipy_bca_and_differs_from_percentile():
    from scipy import stats
    x = np.array([0.05, 0.10, 0.12, 0.60, 0.71, 0.02, 0.90])
    spec = BootstrapSpec(2000, 3, 0.9, "BCa")
    s = seed_stats(x, spec)
    ref = stats.bootstrap((x,), np.mean, n_resamples=2000, confidence_level=0.9, method="BCa",
                          rng=np.random.default_rng(3)).confidence_interval
    assert (s["ci_low"], s["ci_high"]) == pytest.approx((ref.low, ref.high), abs=1e-12)
    perc = numpy_bootstrap_ci(x, 2000, 3, 0.9)
    assert abs(s["ci_low"] - perc[0]) > 1e-6


def test_degenerate_and_missing_values():
    one = seed_stats([0.5], SPEC)
    assert one["mean"] == 0.5 and math.isnan(one["std"]) and math.isnan(one["ci_low"])
    same = seed_stats([0.25, 0.25, 0.25], BootstrapSpec(500, 0, 0.95, "BCa"))
    assert (same["ci_low"], same["ci_high"], same["std"]) == (0.25, 0.25, 0.0)
    nan = seed_stats([math.nan, 0.2, 0.6], SPEC)  # a run that never logged the metric is left out
    assert nan["n"] == 2 and nan["mean"] == pytest.approx(0.4)


def test_paired_difference_from_the_baseline():
    base = {0: {"m": 0.10}, 1: {"m": 0.30}, 2: {"m": 0.20}, 3: {"m": 0.50}}
    arm = {0: {"m": 0.40}, 1: {"m": 0.35}, 2: {"m": 0.60}, 4: {"m": 0.99}}  # seed 3 missing, seed 4 extra
    out = summarize({"base": base, "arm": arm}, "base", SPEC)
    d = [0.40 - 0.10, 0.35 - 0.30, 0.60 - 0.20]  # seeds 0, 1, 2: the ones both arms have
    got = out["vs_baseline"]["arm"]["m"]
    assert got["n"] == 3
    assert got["mean"] == pytest.approx(np.mean(d), abs=1e-15)
    assert got["std"] == pytest.approx(np.std(d, ddof=1), abs=1e-15)
    low, high = numpy_bootstrap_ci(d, SPEC.resamples, SPEC.seed, SPEC.level)
    assert (got["ci_low"], got["ci_high"]) == pytest.approx((low, high), abs=1e-12)
    assert "base" not in out["vs_baseline"]
    assert out["arms"]["arm"]["m"]["mean"] == pytest.approx(np.mean([0.40, 0.35, 0.60, 0.99]))


def _rows(tmp_path):
    lines = [
        {"step": 0, "eval/toy/mean@4": 0.25, "eval/toy/pass@1": 0.25, "eval/toy/first_attempt_error_rate": 0.5},
        {"step": 1, "reward/acc": 0.1, "tool_calls/success_rate": 0.6, "tool_calls/total_attempts": 10.0,
         "rollback/global_recovery_rate": 0.5, "rollback/global_triggered": 4.0, "adv/zero_adv_group_frac": 0.75,
         "response/purified_tokens_mean": 100.0, "response/raw_tokens_mean": 120.0},
        {"step": 2, "reward/acc": 0.9, "tool_calls/success_rate": 0.0, "tool_calls/total_attempts": 0.0,
         "rollback/global_recovery_rate": 0.0, "rollback/global_triggered": 0.0, "adv/zero_adv_group_frac": 0.25,
         "response/purified_tokens_mean": 80.0, "response/raw_tokens_mean": 80.0},
        {"step": 2, "reward/acc": 0.5},  # a resumed run re-logged step 2: this value wins
        {"step": 3, "reward/acc": 0.7, "tool_calls/success_rate": 0.8, "tool_calls/total_attempts": 5.0,
         "rollback/global_recovery_rate": 1.0, "rollback/global_triggered": 1.0, "adv/zero_adv_group_frac": 0.5,
         "response/purified_tokens_mean": 60.0, "response/raw_tokens_mean": 70.0},
        {"step": 3, "credit/pos_adv_spliced_frac": "nan"},  # metrics.jsonl's spelling of a non-finite value
        {"step": 3, "eval/toy/mean@4": 0.625, "eval/toy/pass@1": 0.625, "eval/toy/first_attempt_error_rate": 0.2},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return read_metrics(path)


def test_run_summary_by_hand(tmp_path):
    rows = _rows(tmp_path)
    assert rows[2]["reward/acc"] == 0.5 and rows[2]["adv/zero_adv_group_frac"] == 0.25
    s = run_summary(rows, "toy", tail_steps=2)
    assert s["heldout_acc_before"] == 0.25 and s["heldout_acc_after"] == 0.625
    assert s["heldout_acc_gain"] == pytest.approx(0.375)
    assert s["collapsed"] == 0.0  # 0.625 is not below half of 0.25
    assert math.isnan(rows[3]["credit/pos_adv_spliced_frac"]) and math.isnan(s["pos_adv_spliced_frac_last"])
    assert s["first_attempt_error_rate_first"] == pytest.approx(0.4)
    # step 2 had no tool call (0/0, logged as success rate 0): left out, not a 100% error rate
    assert s["first_attempt_error_rate_last"] == pytest.approx(1 - 0.8)
    assert s["saar_recovery_rate_last"] == pytest.approx(1.0)  # step 2 never triggered SAAR
    assert s["zero_adv_group_frac_last"] == pytest.approx((0.25 + 0.5) / 2)
    assert s["response_tokens_last"] == pytest.approx(70.0)
    assert s["train_accuracy_last"] == pytest.approx(0.6) and s["train_accuracy_first"] == pytest.approx(0.1)
    assert s["heldout_first_attempt_error_rate_before"] == 0.5
    assert s["heldout_first_attempt_error_rate_after"] == 0.2
    assert "heldout_first_attempt_errors_per_trajectory_before" not in s  # never logged by this run


def test_accuracy_key_must_be_unique(tmp_path):
    rows = _rows(tmp_path)
    assert aggregate.accuracy_key(rows, "toy") == "eval/toy/mean@4"
    with pytest.raises(ValueError, match="eval/aime24/mean@n"):
        aggregate.accuracy_key(rows, "aime24")


def test_plot_band_by_hand(tmp_path):
    from cleaner_jax.study import plots
    curves = [([1, 2, 3], [0.0, 1.0, math.nan]), ([1, 2], [1.0, 3.0]), ([2, 4], [2.0, 5.0])]
    steps, mean, std = plots.band(curves)
    assert steps.tolist() == [1, 2, 3, 4]
    # step 1: {0, 1}; step 2: {1, 3, 2}; step 3: only a NaN (no value); step 4: {5} alone (std 0)
    assert mean[0] == 0.5 and mean[1] == 2.0 and math.isnan(mean[2]) and mean[3] == 5.0
    assert std[0] == pytest.approx(math.sqrt(0.5)) and std[1] == pytest.approx(1.0) and std[3] == 0.0
    assert plots.plot_metric(tmp_path / "m.png", "m", "m", {"a": curves})
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    assert not plots.plot_metric(tmp_path / "none.png", "m", "m", {"a": [([1], [math.nan])]})
    assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("before, after, expected", [(0.4, 0.19, 1.0), (0.4, 0.2, 0.0), (0.4, 0.9, 0.0),
                                                     (0.0, 0.0, 0.0), (float("nan"), 0.1, None)])
def test_the_collapse_criterion_by_hand(before, after, expected):
    """Held-out accuracy after RL below half of before (docs/study.md): 0.19 < 0.2 collapses, 0.2
    does not; undefined without both evaluations."""
    got = aggregate.collapsed(before, after)
    assert (expected is None and got != got) or got == expected
