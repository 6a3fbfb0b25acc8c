"""Scalars written by tensorboardX are read back exactly and plotted per sweep run."""
import json

import numpy as np
import pytest
from tensorboardX import SummaryWriter

from cleaner_jax.viz.plots import load_scalars, plot_sweep


def write_run(run_dir, gamma, values):
    run_dir.mkdir(parents=True)
    (run_dir / "sweep_point.json").write_text(json.dumps({"saar.gamma": gamma}))
    with SummaryWriter(str(run_dir / "tb")) as w:
        for step, v in enumerate(values):
            w.add_scalar("reward/mean", v, step)


def test_load_scalars_round_trip(tmp_path):
    write_run(tmp_path / "a", "0.5", [0.25, -0.5, 1.0])
    steps, values = load_scalars(tmp_path / "a")["reward/mean"]
    assert steps.tolist() == [0, 1, 2]
    np.testing.assert_allclose(values, [0.25, -0.5, 1.0], rtol=1e-6)


def test_plot_sweep_writes_a_png(tmp_path):
    write_run(tmp_path / "g03", "0.3", [0.0, 0.1])
    write_run(tmp_path / "g07", "0.7", [0.2, 0.3])
    out = plot_sweep(tmp_path, "reward/mean", tmp_path / "plot.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KeyError, match="nope"):
        plot_sweep(tmp_path, "nope", tmp_path / "x.png")


def test_no_events_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no TensorBoard event files"):
        load_scalars(tmp_path)
