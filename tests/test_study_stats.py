"""The paired statistics of a study (cleaner_jax/study/paired.py) against references computed here
by hand or by an independent route: sign patterns counted in comments, closed-form binomial
sums, hypergeometric probabilities, the enumerated Wilcoxon distribution, a NumPy Monte Carlo of
the paired t-test's power, G*Power's published sample size; then summary.json / summary.md of a
tiny synthetic study, and the study config's primary_metric."""
import itertools
import json
import math

import numpy as np
import pytest
from ml_collections import ConfigDict
from scipy import stats

from cleaner_jax.config import ConfigError
from cleaner_jax.study import paired
from cleaner_jax.study.aggregate import BootstrapSpec, read_metrics, run_summary, seed_stats
from cleaner_jax.study.config import BUDGET_PRIMARY, study_config, summary_values, validate_study

SPEC = paired.PairedSpec(BootstrapSpec(2000, 0, 0.95, "BCa"), permutation_resamples=100_000, seed=3)


def test_sign_flip_exact_by_hand():
    # d = [1, 2, 3], sum 6. The 8 sign patterns give sums
    #   +1+2+3 = 6, -1+2+3 = 4, +1-2+3 = 2, +1+2-3 = 0, -1-2+3 = 0, -1+2-3 = -2, +1-2-3 = -4, -1-2-3 = -6:
    # |sum| >= 6 twice, p = 2/8.
    r = paired.sign_flip([1.0, 2.0, 3.0], 1000, 0)
    assert (r.p, r.exact, r.resamples) == (0.25, True, 8)
    # the test is scale-free: the same data in other units, the same p
    assert paired.sign_flip([0.37, 0.74, 1.11], 1000, 0).p == 0.25
    # d = [0, 1, 2]: the zero's sign changes nothing, so each of the sums +-1 +-2 in {3, 1, -1, -3}
    # comes twice; |sum| >= 3: 4 of 8
    assert paired.sign_flip([0.0, 1.0, 2.0], 1000, 0).p == 0.5
    # every difference zero: every pattern ties the observed 0, p = 1
    assert paired.sign_flip([0.0, 0.0, 0.0], 1000, 0).p == 1.0
    assert math.isnan(paired.sign_flip([], 1000, 0).p)


def _binomial_p(plus: int, minus: int) -> float:
    """The exact sign-flip p of `plus` values +1 and `minus` values -1: a flipped sample is n
    independent fair +-1, its sum n - 2K with K ~ Binomial(n, 1/2) the number of -1s; the observed
    sum is plus - minus = n - 2 minus, so |n - 2K| >= |n - 2 minus| iff K <= minus or K >= n - minus."""
    n = plus + minus
    assert minus < n / 2
    return 2 * sum(math.comb(n, k) for k in range(minus + 1)) / 2 ** n


def test_sign_flip_exact_at_20_pairs_equals_the_binomial_sum():
    d = np.array([1.0] * 14 + [-1.0] * 6)
    r = paired.sign_flip(d, 1000, 0)
    assert r.exact and r.resamples == 2 ** 20
    assert r.p == pytest.approx(_binomial_p(14, 6), abs=1e-15)  # 2 (C(20,0) + ... + C(20,6)) / 2^20 = 0.1153...


def test_sign_flip_monte_carlo_at_21_pairs_is_close_to_the_exact_answer():
    d = np.array([1.0] * 15 + [-1.0] * 6)
    exact = _binomial_p(15, 6)  # 2 (1+21+210+1330+5985+20349+54264) / 2^21 = 164320 / 2097152
    assert exact == 164320 / 2097152
    r = paired.sign_flip(d, 100_000, 3)
    assert not r.exact and r.resamples == 100_000
    count = r.p * (1 + r.resamples) - 1  # p = (1 + #{>=}) / (1 + R): a whole number of hits
    assert count == pytest.approx(round(count), abs=1e-6)
    se = math.sqrt(exact * (1 - exact) / r.resamples)
    assert abs(r.p - exact) < 4 * se
    # the same data scaled: the same random patterns, the same hits
    assert paired.sign_flip(0.37 * d, 100_000, 3).p == r.p
    assert paired.sign_flip(d, 100_000, 4).p != r.p  # the seed is used


def test_exact_enumeration_equals_scipy_permutation_test():
    """scipy.stats.permutation_test is exact once n_resamples >= 2^n: the same p, ties included."""
    for d in (np.random.default_rng(1).normal(0.2, 1.0, 10), np.array([0.1, -0.1, 0.2, 0.2, 0.0, -0.3, 0.1])):
        ref = stats.permutation_test((d,), lambda x, axis: np.abs(np.mean(x, axis=axis)), permutation_type="samples",
                                     vectorized=True, n_resamples=2 ** len(d), alternative="greater")
        assert paired.sign_flip(d, 1000, 0).p == pytest.approx(ref.pvalue, abs=1e-15)


def test_wilcoxon_by_hand():
    # |d| = 0.5 0.8 1.2 2.0 3.1 have ranks 1 2 3 4 5; the negative one (-1.2) has rank 3:
    # W+ = 1 + 2 + 4 + 5 = 12, W- = 3.
    d = [0.5, -1.2, 2.0, 3.1, 0.8]
    r = paired.wilcoxon(d)
    assert (r.w_plus, r.w_minus, r.method) == (12.0, 3.0, "exact")
    # the null: each rank positive with probability 1/2, all 32 sign patterns equally likely
    w = [sum(k for k, s in zip(range(1, 6), signs) if s) for signs in itertools.product((0, 1), repeat=5)]
    upper = sum(x >= 12 for x in w)  # rank sets summing to >= 12: complements of {}, {1}, {2}, {3}, {1,2}
    assert upper == 5
    assert r.p == pytest.approx(2 * upper / 32, abs=1e-15)  # two-sided: 10/32


def test_wilcoxon_with_ties_zeros_and_nothing():
    # zero_method "wilcox": the 0 is dropped; |1| |-1| |2| have midranks 1.5 1.5 3; W+ = 1.5 + 3 = 4.5.
    # Over the 8 sign patterns W+ is 0, 1.5, 1.5, 3, 3, 4.5, 4.5, 6: P(W+ >= 4.5) = 3/8, P(W+ <= 4.5) = 7/8;
    # two-sided 2 min(3/8, 7/8) = 0.75
    r = paired.wilcoxon([1.0, -1.0, 2.0, 0.0])
    assert (r.w_plus, r.w_minus, r.p) == (4.5, 1.5, pytest.approx(0.75, abs=1e-15))
    assert "midranks" in r.method and "1 zero" in r.note
    # differences equal in exact arithmetic but not in floats (0.3-0.2 vs 0.2-0.1) are ties: midranks
    # 1.5 1.5 3, all positive, W+ = 6, reached by 1 of 8 patterns: p = 2/8
    t = paired.wilcoxon([0.3 - 0.2, 0.2 - 0.1, 0.5 - 0.3])
    assert (t.w_plus, t.p) == (6.0, pytest.approx(0.25, abs=1e-15))
    zero = paired.wilcoxon([0.0, 0.0, 0.0])
    assert zero.p == 1.0 and "zero" in zero.note


def test_fisher_on_collapse_counts_by_hand():
    # arm 4 of 5 collapsed, baseline 0 of 5 (a NaN verdict is no run). Given the margins (4 collapsed of
    # 10), the arm's count is hypergeometric: P(k) = C(5,k) C(5,4-k) / C(10,4) = 5, 50, 100, 50, 5 / 210
    # for k = 0..4. Two-sided: the tables no likelier than the observed (k = 4): k = 0 and 4, 10/210.
    f = paired.collapse_fisher([1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, math.nan])
    assert (f.arm_collapsed, f.arm_runs, f.baseline_collapsed, f.baseline_runs) == (4, 5, 0, 5)
    assert f.p == pytest.approx(10 / 210, abs=1e-15)
    assert f.to_json()["odds_ratio"] == "inf"  # 4*5 / (1*0): JSON has no infinity
    assert paired.collapse_fisher([0.0, 0.0], [0.0, 0.0]).p == 1.0


def test_holm_by_hand():
    # sorted 0.01 (a), 0.03 (c), 0.04 (b) times 3, 2, 1: 0.03, 0.06, 0.04 -> kept non-decreasing: 0.06
    got = paired.holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert got == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06}, abs=1e-15)
    # capped at 1; a NaN (no pairs) is no test: m = 2, and it stays NaN
    capped = paired.holm({"a": 0.5, "b": 0.6, "c": math.nan})
    assert capped["a"] == 1.0 and capped["b"] == 1.0 and math.isnan(capped["c"])


def test_mde_has_80_percent_power_by_monte_carlo():
    """Simulate the paired t-test at the returned effect: d ~ N(mde, sd), n pairs, reject when
    |mean| / (s / sqrt(n)) > t_{0.975, n-1}; the share rejected is the power."""
    sd, n, reps = 0.2, 6, 200_000
    m = paired.mde(sd, n)
    assert m.effect == pytest.approx(m.dz * sd)
    d = np.random.default_rng(11).normal(m.effect, sd, (reps, n))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
    power = np.mean(np.abs(t) > stats.t.ppf(0.975, n - 1))
    assert power == pytest.approx(0.80, abs=4 * math.sqrt(0.16 / reps))


def test_mde_against_g_power():
    # G*Power, paired t-test (matched pairs), dz = 0.5, alpha 0.05 two-sided, power 0.8: total sample
    # size 34, actual power 0.8078 (33 pairs fall short). So the MDE at 34 pairs is below 0.5 sd, at 33 above.
    assert paired.paired_t_power(0.5, 34) == pytest.approx(0.8078, abs=1e-4)
    assert paired.mde(1.0, 34).dz < 0.5 < paired.mde(1.0, 33).dz
    assert math.isnan(paired.mde(0.3, 1).effect)  # one pair: no sd
    assert math.isnan(paired.mde(0.0, 5).effect)  # identical differences: no t-test


def test_paired_drops_nan_pairs_and_reuses_seed_stats():
    arm = {0: 0.5, 1: 0.6, 2: math.nan, 3: 0.4, 4: 0.9, 7: 0.2}
    base = {0: 0.4, 1: 0.5, 2: 0.3, 3: 0.3, 4: 0.6, 5: 0.1}
    r = paired.paired("m", arm, base, SPEC)
    assert r.seeds == (0, 1, 3, 4) and r.n == 4  # seed 2's arm value is NaN; 5 and 7 are one-sided
    d = [0.5 - 0.4, 0.6 - 0.5, 0.4 - 0.3, 0.9 - 0.6]
    assert r.mean_diff == pytest.approx(sum(d) / 4, abs=1e-15)
    assert r.median_diff == pytest.approx((0.1 + 0.1) / 2, abs=1e-12)
    ci = seed_stats(d, SPEC.bootstrap)
    assert (r.ci_low, r.ci_high) == (ci["ci_low"], ci["ci_high"])
    # all 4 differences positive, three tied: only the all-plus and all-minus patterns reach |sum|, 2/16
    assert r.sign_flip.p == pytest.approx(2 / 16, abs=1e-15)
    json.dumps(r.to_json(), allow_nan=False)


# -- the summary of a tiny synthetic study -------------------------------------------------------

ARMS_AFTER = {  # held-out accuracy after RL per seed 0..4 (every run starts at 0.4)
    "grpo_raw": [0.40, 0.50, 0.30, 0.45, 0.35],
    "cleaner": [0.50, 0.70, 0.60, 0.85, 0.85],    # d = 0.1 0.2 0.3 0.4 0.5
    "collapsy": [0.10, 0.10, 0.10, 0.45, 0.35],   # d = -0.3 -0.4 -0.2 0 0; seeds 0-2 collapse (0.1 < 0.2)
}


def _write_run(run, before, after):
    rows = [{"step": 0, "eval/toy/mean@4": before},
            {"step": 1, "reward/acc": 0.5, "adv/zero_adv_group_frac": 0.25},
            {"step": 2, "reward/acc": 0.6, "adv/zero_adv_group_frac": 0.5, "eval/toy/mean@4": after}]
    (run / "tb").mkdir(parents=True)
    (run / "tb" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "DONE").write_text("{}")


def _tiny_study():
    c = study_config()
    c.seeds, c.baseline, c.share_runs = "0,1,2,3,4", "grpo_raw", False
    c.bootstrap_resamples = 500
    for arm in ARMS_AFTER:
        c.arms[arm] = ConfigDict()
    return c


def test_summary_json_holds_the_per_seed_values_and_the_paired_tests(tmp_path):
    from cleaner_jax.study.__main__ import summarize
    study = validate_study(_tiny_study())
    assert study.primary_metric == "heldout_acc_after"  # configs/toy.py sets no eval.tool_call_budget
    for arm, after in ARMS_AFTER.items():
        for seed, value in enumerate(after):
            _write_run(tmp_path / "runs" / arm / f"seed_{seed}", 0.4, value)
    text = summarize(study, tmp_path)
    out = json.loads((tmp_path / "summary.json").read_text())
    for arm, after in ARMS_AFTER.items():  # every run's value, to recompute from
        assert [out["runs"][arm][str(s)]["heldout_acc_after"] for s in range(5)] == after
    assert out["primary_metric"] == "heldout_acc_after" and set(out["paired"]) == {"cleaner", "collapsy"}
    cleaner = out["paired"]["cleaner"]["heldout_acc_after"]
    assert cleaner["n"] == 5 and cleaner["seeds"] == [0, 1, 2, 3, 4]
    assert cleaner["mean_diff"] == pytest.approx(0.3, abs=1e-12) and cleaner["median_diff"] == pytest.approx(0.3)
    # five positive differences, all distinct: |sum| is reached by the all-plus and the all-minus
    # patterns only, 2/32; W+ = 1+2+3+4+5 = 15, the largest of the 32 equally likely values: 2/32
    assert cleaner["sign_flip"]["p"] == pytest.approx(2 / 32) and cleaner["sign_flip"]["exact"]
    assert cleaner["wilcoxon"]["w_plus"] == 15 and cleaner["wilcoxon"]["p"] == pytest.approx(2 / 32)
    # the MDE at these 5 pairs' sd (its power is checked above by Monte Carlo): the summary carries it
    assert cleaner["mde"]["effect"] == pytest.approx(paired.mde(np.std([0.1, 0.2, 0.3, 0.4, 0.5], ddof=1), 5).effect)
    collapsy = out["paired"]["collapsy"]["heldout_acc_after"]
    # the zeros leave the sum alone: of the 8 patterns of -0.3 -0.4 -0.2 two reach |sum| = 0.9: 2/8
    assert collapsy["sign_flip"]["p"] == pytest.approx(0.25)
    # Holm over the two arms: 0.0625 x 2 = 0.125, then max(0.125, 0.25 x 1) = 0.25
    assert out["holm_p"] == pytest.approx({"cleaner": 0.125, "collapsy": 0.25})
    # 3 of 5 collapsed against 0 of 5: P(k) = C(5,k) C(5,3-k) / C(10,3) = 10, 50, 50, 10 / 120; p = 20/120
    fisher = out["collapse"]["collapsy"]
    assert (fisher["arm_collapsed"], fisher["baseline_collapsed"], fisher["p"]) == (3, 0, pytest.approx(1 / 6))
    assert out["collapse"]["cleaner"]["p"] == 1.0
    assert set(out["paired"]["cleaner"]) == set(out["runs"]["cleaner"]["0"])  # every summarised metric
    assert "vs_baseline" in out and "arms" in out
    assert "| arm | n pairs | mean diff | median diff | CI | sign-flip p | Wilcoxon p | Holm p | MDE |" in text
    assert "| cleaner | 5 | 0.300 | 0.300 |" in text and "collapsy 3/5 (Fisher's exact p = 0.167)" in text
    assert (tmp_path / "summary.md").read_text() == text


# -- the config's primary metric -----------------------------------------------------------------

def test_an_unknown_primary_metric_is_rejected_naming_the_key():
    c = _tiny_study()
    c.primary_metric = "heldout_accuracy_after"
    with pytest.raises(ConfigError, match=r"config\.primary_metric: 'heldout_accuracy_after' is not a summary value"
                                          r".*heldout_acc_after"):
        validate_study(c)


def test_the_primary_metric_default_follows_the_tool_call_budget():
    c = _tiny_study()
    c.run.eval = ConfigDict({"tool_call_budget": 1})  # every arm's runs log acc_within_budget
    assert validate_study(c).primary_metric == BUDGET_PRIMARY == "heldout_acc_within_budget_after"
    c = _tiny_study()
    c.arms.cleaner = ConfigDict({"eval": {"tool_call_budget": 1}})  # one arm only: the others' runs lack it
    assert validate_study(c).primary_metric == "heldout_acc_after"
    c = _tiny_study()
    c.primary_metric = BUDGET_PRIMARY
    with pytest.raises(ConfigError, match=r"config\.primary_metric: .*eval\.tool_call_budget.*grpo_raw"):
        validate_study(c)
    c.primary_metric = "train_accuracy_last"
    assert validate_study(c).primary_metric == "train_accuracy_last"


def test_summary_values_cover_what_run_summary_gives(tmp_path):
    """Every value a run logging every metric gets is a name the config accepts."""
    from cleaner_jax.study.aggregate import HELDOUT_OPTIONAL
    row0 = {"step": 0, "eval/toy/mean@4": 0.3, **{f"eval/toy/{m}": 0.1 for m in HELDOUT_OPTIONAL}}
    row1 = {"step": 1, "reward/acc": 0.5, "tool_calls/success_rate": 0.5, "tool_calls/total_attempts": 2.0,
            "rollback/global_recovery_rate": 0.5, "rollback/global_triggered": 1.0}
    row2 = {**row0, "step": 2}
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (row0, row1, row2)) + "\n")
    names = set(run_summary(read_metrics(path), "toy", 1))
    assert names == set(summary_values())
