"""Log-prob gap metrics against hand-computed values; MetricsWriter output read back with
TensorBoard's own event reader and as JSON lines."""
import json
import logging
import math

import numpy as np
import pytest

from cleaner_jax.rl.logprob_gap import logprob_gap_metrics
from cleaner_jax.rl.metrics_writer import MetricsWriter


def test_gap_hand_computed():
    learner = np.array([[0.0, -1.0, -2.0, -3.0, 99.0]])
    rollout = np.array([[0.0, -1.0, -2.2, -2.5, -1.0]])
    mask = np.array([[0, 1, 1, 1, 0]])  # the last token is padding with a garbage value
    m = logprob_gap_metrics(learner, rollout, mask)
    d = np.array([0.0, 0.2, -0.5])  # learner - rollout on policy tokens
    assert m["gap/abs_diff"] == pytest.approx(np.abs(d).mean())
    assert m["gap/abs_diff_max"] == pytest.approx(0.5)
    assert m["gap/k3_kl"] == pytest.approx(np.mean(np.exp(d) - 1 - d), rel=1e-5)
    assert m["gap/frac_outside_band"] == pytest.approx(2 / 3)  # exp(0.2)=1.22, exp(-0.5)=0.61


def test_gap_identical_is_zero():
    x = np.random.default_rng(0).normal(size=(3, 7))
    m = logprob_gap_metrics(x, x, np.ones((3, 7)))
    assert all(v == 0.0 for v in m.values())


def test_metrics_writer_tensorboard_and_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path) as w:
        w.write(1, {"loss": 0.5, "gap/abs_diff": 0.01})
        w.write(2, {"loss": 0.25, "grad_norm": float("nan")})
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert math.isnan(acc.Scalars("grad_norm")[0].value)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 1, "loss": 0.5, "gap/abs_diff": 0.01}
    assert rows[1]["grad_norm"] == "nan"


def test_metrics_writer_keeps_every_name(tmp_path, caplog):
    """TensorBoard and metrics.jsonl carry the same names: none is rewritten (tensorboardX's
    add_scalar would turn `pass@1` into `pass_1`)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    names = ["eval/toy/pass@1", "eval/toy/mean@16/ci_low", "eval/gpqa_diamond/maj@4/mean", "learner/loss"]
    with caplog.at_level(logging.INFO), MetricsWriter(tmp_path) as w:
        w.write(3, {n: float(i) for i, n in enumerate(names)})
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(names)
    assert [(e.step, e.value) for e in acc.Scalars("eval/toy/pass@1")] == [(3, 0.0)]
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert sorted(k for k in row if k != "step") == sorted(names)
    assert "illegal" not in caplog.text
