"""cleaner_jax.study.collapse on synthetic studies with known answers: the collapse verdict, the
early-window precursors, the ROC AUC against scipy's Mann-Whitney U, and the flagging threshold."""
import json
import math

import numpy as np
import pytest
from scipy import stats

from cleaner_jax.study import collapse


def _rows(acc_before, acc_after, k3, splice_frac, grad, steps=8):
    """A run's metrics.jsonl rows: held-out accuracy at steps 0 and `steps`, per RL step the
    training accuracy and the given learner/splice values (lists indexed by step - 1)."""
    rows = [{"step": 0, "eval/toy/mean@4": acc_before}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "reward/acc": 0.5, "learner/gap/spliced/k3_kl": k3[s - 1],
                     "splice/token_frac": splice_frac[s - 1], "learner/grad_norm": grad[s - 1],
                     "learner/ratio_max": 1.0, "learner/entropy": 0.3})
    rows.append({"step": steps, "eval/toy/mean@4": acc_after})
    return rows


def _write_run(study, arm, seed, rows):
    run = study / "runs" / arm / f"seed_{seed}"
    (run / "tb").mkdir(parents=True)
    (run / "tb" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "DONE").write_text("{}")


def test_the_early_window_skips_steps_without_spliced_tokens():
    rows = {s["step"]: {k: v for k, v in s.items() if k != "step"}
            for s in _rows(0.4, 0.4, k3=[0.0, 0.6, 0.9, 0.0, 0.3, 5.0, 5.0, 5.0],
                           splice_frac=[0.0, 0.1, 0.2, 0.0, 0.1, 0.1, 0.1, 0.1], grad=[1, 2, 3, 4, 5, 6, 7, 8])}
    # spliced k3 over steps 2, 3, 5 (steps 1 and 4 had no spliced token: their 0.0 is 0/0)
    assert collapse.early_value(rows, "spliced_k3_kl", 5) == pytest.approx((0.6 + 0.9 + 0.3) / 3)
    assert collapse.early_value(rows, "grad_norm", 5) == pytest.approx(3.0)  # every step counts
    assert collapse.early_value(rows, "spliced_token_frac", 5) == pytest.approx(0.4 / 5)
    assert math.isnan(collapse.early_value(rows, "pos_adv_spliced_frac", 5))  # never logged


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_roc_auc_is_mann_whitney_u_over_the_pairs(seed):
    rng = np.random.default_rng(seed)
    pos = rng.integers(0, 6, size=4).astype(float)  # small integers: ties happen
    neg = rng.integers(0, 6, size=9).astype(float)
    u = stats.mannwhitneyu(pos, neg, alternative="two-sided").statistic  # U of the first sample, ties half
    assert collapse.roc_auc(pos, neg) == pytest.approx(u / (len(pos) * len(neg)))
    assert math.isnan(collapse.roc_auc([], neg))


def test_the_threshold_flags_every_collapse_and_counts_false_alarms(tmp_path):
    """Two collapsed runs with early spliced k3 0.9 and 1.2, three healthy with 0.1, 0.95 and 0.2:
    the threshold is 0.9, one healthy run (0.95) is flagged too, AUC = (2 + 2 + 1) / 6."""
    study = tmp_path / "toy_study"
    study.mkdir()
    (study / "study_config.json").write_text(json.dumps({"benchmark": "toy"}))
    flat = [0.05] * 8
    spec = {("cleaner", 0): (0.4, 0.01, 0.9), ("cleaner", 1): (0.3, 0.10, 1.2), ("cleaner", 2): (0.4, 0.8, 0.1),
            ("cleaner_splice_corr", 0): (0.4, 0.85, 0.95), ("cleaner_splice_corr", 1): (0.3, 0.7, 0.2)}
    for (arm, seed), (before, after, k3) in spec.items():
        _write_run(study, arm, seed, _rows(before, after, [k3] * 8, [0.1] * 8, flat))
    _write_run(study, "grpo_raw", 0, _rows(0.4, 0.8, [0.0] * 8, [0.0] * 8, flat))  # no splices: no k3 value
    records = collapse.read_study(study, None, early_steps=5)
    assert {(r.arm, r.seed): r.collapsed for r in records} == {
        ("cleaner", 0): 1.0, ("cleaner", 1): 1.0, ("cleaner", 2): 0.0, ("cleaner_splice_corr", 0): 0.0,
        ("cleaner_splice_corr", 1): 0.0, ("grpo_raw", 0): 0.0}
    sep = collapse.separation(records, "spliced_k3_kl")
    assert sep == {"collapsed": 2.0, "healthy": 3.0, "auc": pytest.approx(5 / 6), "threshold": 0.9, "false_alarms": 1.0}
    only = collapse.read_study(study, ["grpo_raw"], early_steps=5)
    assert [(r.arm, r.seed) for r in only] == [("grpo_raw", 0)]

    out = tmp_path / "report.md"
    assert collapse.main([str(study), "--arms", "cleaner,cleaner_splice_corr", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| toy_study | cleaner | 3 | 2 |" in text and "| toy_study | cleaner_splice_corr | 2 | 0 |" in text
    assert "grpo_raw" not in text
    assert "## Before the collapse: toy_study cleaner seed 0" in text
    assert "| spliced_k3_kl (`learner/gap/spliced/k3_kl`) | 2 | 3 | 0.83 | 0.900 | 1 |" in text


def test_a_directory_that_is_no_study_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a study directory"):
        collapse.read_study(tmp_path, None, 5)
