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


def test_a_run_and_a_study_draw_their_curves_alike(tmp_path, monkeypatch):
    """The end-of-run plots and a study's plots share one look (viz/figure.py): a dot at each step
    of the same size, integer step ticks, a grid and a legend; only the study adds its band."""
    from cleaner_jax.study import plots as study_plots
    from cleaner_jax.viz import figure

    axes = {}
    save = figure.save

    def keep(fig, ax, path, **kw):  # the axes as written (styled by save; closed figures keep them)
        written = save(fig, ax, path, **kw)
        axes[path.name] = (ax.get_lines(), len(ax.collections), ax.get_legend() is not None,
                           ax.xaxis.get_major_locator(), any(g.get_visible() for g in ax.get_xgridlines()))
        return written

    monkeypatch.setattr(figure, "save", keep)
    with MetricsWriter(tmp_path / "run" / "tb") as w:
        for step, row in ROWS.items():
            w.write(step, row)
    plot_run(tmp_path / "run")
    seeds = [([1, 2], [0.1, 0.3]), ([1, 2], [0.2, 0.2])]
    assert study_plots.plot_metric(tmp_path / "study.png", "acc", "acc", {"a": seeds})
    (run_line,), run_bands, *run_rest = axes["reward.png"]
    (study_line,), study_bands, *study_rest = axes["study.png"]
    assert (run_line.get_marker(), run_line.get_markersize()) == (study_line.get_marker(), study_line.get_markersize())
    assert run_line.get_marker() not in (None, "None", "")
    assert (run_bands, study_bands) == (0, 1)  # the study's ± one std band
    for has_legend, locator, grid in (run_rest, study_rest):
        assert has_legend and grid and locator.tick_values(0.0, 3.0).tolist() == [0.0, 1.0, 2.0, 3.0]
