"""End-of-run plots: drawn from the same scalars TensorBoard shows, the last row of a re-logged step
wins, and a plot whose scalars the run never wrote is skipped with a note, not an error."""
import logging
import math

import matplotlib.image as mpimg
import numpy as np

from cleaner_jax.rl.metrics_writer import MetricsWriter
from cleaner_jax.viz.plots import load_scalars
from cleaner_jax.viz.run_plots import PLOTS, _error_rate, plot_run, read_metrics

ROWS = {
    1: {"reward/mean": -0.5, "reward/acc": 0.25, "tool_calls/success_rate": 0.5, "tool_calls/total_attempts": 4.0,
        "tool/raw_error_rate": 0.6,
        "adv/zero_adv_group_frac": 1.0, "learner/gap/abs_diff": 0.01},
    2: {"reward/mean": 0.0, "reward/acc": 0.5, "tool_calls/success_rate": 0.0, "tool_calls/total_attempts": 0.0,
        "tool/raw_error_rate": 0.3,
        "adv/zero_adv_group_frac": 0.5, "learner/gap/abs_diff": float("nan")},
}


def test_plots_from_the_runs_scalars(tmp_path, caplog):
    with MetricsWriter(tmp_path / "tb") as w:
        for step, row in ROWS.items():
            w.write(step, row)
        w.write(2, {"reward/mean": 0.25})  # a resumed run re-logs step 2: this value wins
    scalars = read_metrics(tmp_path)
    assert scalars["reward/mean"] == ([1, 2], [-0.5, 0.25])
    assert scalars["reward/acc"] == ([1, 2], [0.25, 0.5])
    assert scalars["learner/gap/abs_diff"][0] == [1, 2] and math.isnan(scalars["learner/gap/abs_diff"][1][1])
    tb = load_scalars(tmp_path / "tb")  # TensorBoard's own reader sees the same numbers
    for tag in ("reward/acc", "tool/raw_error_rate", "adv/zero_adv_group_frac"):
        np.testing.assert_allclose(tb[tag][1], scalars[tag][1], rtol=1e-6)
    # first-attempt error rate: 1 - 0.5 at step 1; step 2 had no tool call (0/0), so no point
    rate = _error_rate(scalars, *scalars["tool_calls/success_rate"])
    assert rate[0] == 0.5 and math.isnan(rate[1])
    with caplog.at_level(logging.INFO, logger="cleaner_jax.viz.run_plots"):
        written = plot_run(tmp_path)
    names = {p.name for p in written}
    assert names == {"reward.png", "accuracy.png", "tool_error_rate.png", "zero_adv_groups.png", "logprob_gap.png"}
    assert {p.name for p in (tmp_path / "plots").iterdir()} == names
    for skipped in set(PLOTS) - names:  # SAAR recovery and splice share: never written by this run
        assert any(f"plot {skipped} skipped" in r.getMessage() for r in caplog.records), skipped
    img = mpimg.imread(tmp_path / "plots" / "reward.png")
    assert img.shape[:2] == (385, 660) and img.std() > 0.01  # 6 x 3.5 in at 110 dpi, not blank


def test_a_run_without_any_known_scalar_writes_no_plot(tmp_path):
    with MetricsWriter(tmp_path / "tb") as w:
        w.write(1, {"time/rollout_s": 1.0})
    assert plot_run(tmp_path) == []
