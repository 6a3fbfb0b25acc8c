"""The recoverable world's regime (docs/toy_world.md, "The recoverable world"), measured on a seed
no study uses (100): `python -m cleaner_jax.train --config configs/toy_recoverable.py` with its
warm start, the held-out evaluation before RL (128 problems x 4 samples, SAAR off: the policy's
own sampling) and 3 RL steps with SAAR. From the run's own metrics.jsonl:

- at least 70% of failed first calls are followed by a working call in the same trajectory;
- at least 25% of the correct trajectories hold a failed call;
- held-out accuracy is at most 60%, and accuracy within one tool call is below it;
- both splice kinds (shallow: the call only; deep: the whole turn) occur in the RL steps.

Marked slow (about 4 minutes on the 2-core box): `.venv/bin/python -m pytest -m slow tests/test_toy_recoverable.py`.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _study_common import metrics_by_step

ROOT = Path(__file__).resolve().parents[1]
UNSEEN_SEED = 100  # the studies use seeds 0-7


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_recoverable_world_is_in_the_papers_regime_on_an_unseen_seed(tmp_path):
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "cleaner_jax.train", "--config", "configs/toy_recoverable.py",
           "--workdir", str(workdir), f"--config.train.seed={UNSEEN_SEED}", "--config.train.steps=3",
           "--config.train.eval_every=3"]
    with open(tmp_path / "console.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=1700).returncode
    assert rc == 0, (tmp_path / "console.log").read_text()[-5000:]
    rows = metrics_by_step(workdir / "tb" / "metrics.jsonl")
    before = rows[0]
    assert before["eval/toy/recovery_after_failed_first_call"] >= 0.7, before
    assert before["eval/toy/solved_with_failed_call"] >= 0.25, before
    assert before["eval/toy/mean@4"] <= 0.6, before
    assert before["eval/toy/acc_within_budget"] < before["eval/toy/mean@4"], before
    rl = [rows[s] for s in (1, 2, 3)]
    assert sum(r["splice/shallow/token_frac"] for r in rl) > 0 and sum(r["splice/deep/token_frac"] for r in rl) > 0
