"""The full toy study, `python -m cleaner_jax.study --config configs/toy_study.py` (4 arms x 5
seeds; about 50 minutes on the 2-core box), against the claims docs/toy_world.md makes and
docs/toy_results.md reports, read here from the runs' own metrics.jsonl (json, NumPy):

- after the warm start the policy fails 0.3-0.6 first calls per trajectory on average over the
  seeds (its own sampling: nothing is injected), and its held-out accuracy is at most 50% on
  every seed;
- RL with CLEANER raises held-out accuracy by at least 20 points on average over the seeds;
- both splice kinds (shallow: the call only; deep: the whole turn) occur in CLEANER's RL steps;
- summary.json holds these same numbers.

Marked slow (the default suite runs the small study of tests/_study_common.py instead):
`.venv/bin/python -m pytest -m slow tests/test_toy_study_full.py`.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _study_common import metrics_by_step

ROOT = Path(__file__).resolve().parents[1]
ACC, FAILED_FIRST = "eval/toy/mean@4", "eval/toy/first_attempt_errors_per_trajectory"


def check_claims(study: Path) -> dict[str, float]:
    """Assert the claims on a finished study's workdir; returns the numbers they rest on."""
    summary = json.loads((study / "summary.json").read_text())
    seeds = summary["seeds"]["cleaner"]
    assert len(seeds) >= 5, seeds  # the minimum
    before, after, failed = [], [], []
    shallow = deep = 0.0
    for seed in seeds:
        rows = metrics_by_step(study / "runs" / "cleaner" / f"seed_{seed}" / "tb" / "metrics.jsonl")
        evals = sorted(step for step, row in rows.items() if ACC in row)
        assert evals[0] == 0 and evals[-1] > 0, (seed, evals)
        before.append(rows[0][ACC])
        after.append(rows[evals[-1]][ACC])
        failed.append(rows[0][FAILED_FIRST])
        shallow += sum(row.get("splice/shallow/token_frac", 0.0) for step, row in rows.items() if step > 0)
        deep += sum(row.get("splice/deep/token_frac", 0.0) for step, row in rows.items() if step > 0)
    gain = float(np.mean(np.subtract(after, before)))
    assert 0.3 <= np.mean(failed) <= 0.6, failed
    assert max(before) <= 0.5, before
    assert gain >= 0.20, (before, after)
    assert shallow > 0 and deep > 0, (shallow, deep)
    assert summary["arms"]["cleaner"]["heldout_acc_gain"]["mean"] == pytest.approx(gain, abs=1e-9)
    return {"gain": gain, "failed_first_calls": float(np.mean(failed)), "max_before": max(before)}


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)
def test_the_full_toy_study_meets_the_claims(tmp_path):
    workdir = tmp_path / "toy_study"
    cmd = [sys.executable, "-m", "cleaner_jax.study", "--config", "configs/toy_study.py", "--workdir", str(workdir)]
    with open(tmp_path / "console.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=3 * 3600 - 60).returncode
    assert rc == 0, (tmp_path / "console.log").read_text()[-5000:]
    check_claims(workdir)
