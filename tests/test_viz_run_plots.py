"""End-of-run plots: drawn from the same scalars TensorBoard shows, the last row of a re-logged step
wins, and a plot whose scalars the run never wrote is skipped with a note, not an error."""
import logging
import math

import matplotlib.image as mpimg
import numpy as np
import pytest

from cleaner_jax.rl.metrics_writer import MetricsWriter
from cleaner_jax.viz.plots import load_scalars
from cleaner_jax.viz.run_plots import PLOTS, _error_rate, plot_run, read_metrics

ROWS = {
    1: {"reward/mean": -0.5, "reward/acc": 0.25, "tool_calls/success_rate": 0.5, "tool_calls/total_attempts": 4.0,
        "tool/raw_error_rate": 0.6,
        "adv/zero_adv_group_frac": 1.0, "learner/gap/abs_diff": 0.01,
        "credit/pos_adv_failed_call_frac": 0.3, "credit/pos_adv_spliced_frac": 0.0},
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
    assert names == {"reward.png", "accuracy.png", "tool_error_rate.png", "zero_adv_groups.png", "logprob_gap.png",
                     "credit.png"}
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


def _plotted(monkeypatch):
    """{png name: {legend label: (x data, y data)}} of what plot_run draws."""
    from cleaner_jax.viz import figure
    drawn = {}
    save = figure.save

    def keep(fig, ax, path, **kw):
        drawn[path.name] = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}
        return save(fig, ax, path, **kw)

    monkeypatch.setattr(figure, "save", keep)
    return drawn


def test_the_spliced_gap_is_left_out_where_no_token_was_spliced(tmp_path, monkeypatch):
    """Step 2 spliced nothing: its spliced gap is 0/0, which the learner writes as 0.0; the plot
    must leave a gap there (NaN), not draw a perfect match."""
    rows = {1: {"learner/gap/abs_diff": 0.01, "learner/gap/spliced/abs_diff": 0.05, "splice/token_frac": 0.2},
            2: {"learner/gap/abs_diff": 0.02, "learner/gap/spliced/abs_diff": 0.0, "splice/token_frac": 0.0},
            3: {"learner/gap/abs_diff": 0.03, "learner/gap/spliced/abs_diff": 0.08, "splice/token_frac": 0.1}}
    with MetricsWriter(tmp_path / "tb") as w:
        for step, row in rows.items():
            w.write(step, row)
    drawn = _plotted(monkeypatch)
    plot_run(tmp_path)
    lines = drawn["logprob_gap.png"]
    xs, ys = lines["spliced: learner/gap/spliced/abs_diff"]
    assert xs == [1, 2, 3] and ys[0] == 0.05 and math.isnan(ys[1]) and ys[2] == 0.08
    assert lines["not spliced: learner/gap/abs_diff"] == ([1, 2, 3], [0.01, 0.02, 0.03])  # every step has those


def test_a_run_that_never_spliced_draws_no_spliced_gap(tmp_path, monkeypatch):
    with MetricsWriter(tmp_path / "tb") as w:
        for step in (1, 2):
            w.write(step, {"learner/gap/abs_diff": 0.01, "learner/gap/spliced/abs_diff": 0.0, "splice/token_frac": 0.0})
    drawn = _plotted(monkeypatch)
    plot_run(tmp_path)
    assert list(drawn["logprob_gap.png"]) == ["not spliced: learner/gap/abs_diff"]


def test_a_studys_accuracy_band_stays_inside_0_1(tmp_path, monkeypatch):
    """Three seeds near the top and near the bottom of an accuracy: mean ± std runs past [0, 1]
    (1.0244 at step 1, −0.0244 at step 2); the drawn band stops at the bounds, the mean is untouched."""
    from cleaner_jax.study import plots as study_plots
    from cleaner_jax.viz import figure

    bands = {}
    save = figure.save

    def keep(fig, ax, path, **kw):
        (poly,) = ax.collections
        bands[path.name] = (poly.get_paths()[0].vertices, list(ax.get_lines()[0].get_ydata()))
        return save(fig, ax, path, **kw)

    monkeypatch.setattr(figure, "save", keep)
    seeds = [([1, 2], [0.9, 0.0]), ([1, 2], [1.0, 0.1]), ([1, 2], [1.0, 0.0])]
    std = math.sqrt((2 * (0.1 / 3) ** 2 + (0.2 / 3) ** 2) / 2)  # ddof=1 of {0.9, 1, 1} and of {0, 0.1, 0}
    assert 0.9667 + std > 1.0 and 0.0333 - std < 0.0  # the unclipped band would leave [0, 1]
    assert study_plots.plot_metric(tmp_path / "train_accuracy.png", "train_accuracy", "acc", {"a": seeds})
    vertices, mean = bands["train_accuracy.png"]
    assert vertices[:, 1].min() == 0.0 and vertices[:, 1].max() == 1.0
    np.testing.assert_allclose(mean, [2.9 / 3, 0.1 / 3])
    lo, hi = study_plots.band_limits(np.asarray(mean), np.full(2, std), study_plots.RANGES["train_accuracy"])
    np.testing.assert_allclose(lo, [2.9 / 3 - std, 0.0])
    np.testing.assert_allclose(hi, [1.0, 0.1 / 3 + std])
    # a metric with no range is drawn as mean ± std (a reward can be negative)
    assert study_plots.plot_metric(tmp_path / "reward.png", "reward", "r", {"a": seeds})
    assert bands["reward.png"][0][:, 1].max() == pytest.approx(2.9 / 3 + std)


def test_every_study_curve_has_a_range():
    from cleaner_jax.study import aggregate
    from cleaner_jax.study import plots as study_plots
    curves = set(aggregate.TRAIN_SERIES) | {"heldout_accuracy"} | {f"heldout_{m}" for m in aggregate.HELDOUT_OPTIONAL}
    assert curves == set(study_plots.RANGES)


def test_the_per_arm_figure_draws_each_arms_mean_and_ci(tmp_path, monkeypatch):
    """plots/arms_<value>.png: one point per arm in the given order (an ablation's grid), at the
    mean, with an error bar from ci_low to ci_high; an arm without a finite mean is left out, and a
    study where no arm has one draws nothing."""
    from cleaner_jax.study import plots as study_plots
    from cleaner_jax.viz import figure

    drawn = {}
    save = figure.save

    def keep(fig, ax, path, **kw):
        (line,) = ax.get_lines()[:1]
        bars = ax.collections[0].get_segments()  # the error bars, one vertical segment per arm
        drawn[path.name] = (list(line.get_ydata()), [(b[0][1], b[1][1]) for b in bars],
                            [t.get_text() for t in ax.get_xticklabels()])
        return save(fig, ax, path, **kw)

    monkeypatch.setattr(figure, "save", keep)
    nan = float("nan")
    stats = {"gamma_0": {"n": 5.0, "mean": 0.8, "ci_low": 0.7, "ci_high": 0.85},
             "gamma_0_5": {"n": 0.0, "mean": nan, "ci_low": nan, "ci_high": nan},
             "gamma_0_9": {"n": 5.0, "mean": 0.6, "ci_low": 0.4, "ci_high": 0.9}}
    assert study_plots.plot_arms(tmp_path / "arms_x.png", "x", "x", stats)
    means, bars, labels = drawn["arms_x.png"]
    assert means == [0.8, 0.6]
    np.testing.assert_allclose(bars, [(0.7, 0.85), (0.4, 0.9)])
    assert labels == ["gamma_0\n(n=5)", "gamma_0_9\n(n=5)"]
    assert (tmp_path / "arms_x.png").is_file()
    assert not study_plots.plot_arms(tmp_path / "none.png", "x", "x", {"a": stats["gamma_0_5"]})
    assert not (tmp_path / "none.png").exists()
