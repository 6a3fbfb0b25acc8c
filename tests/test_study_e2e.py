"""End to end: `python -m cleaner_jax.study` on a small real study (tests/_study_common.py: 2 arms x
2 seeds, 2 RL steps), killed in its second run and started again.

Checks: every run finished once and the finished one was not redone; the killed run resumed from
its checkpoint; the warm start and the step-0 evaluation were computed once per seed and reused by
the other arm; the summary's numbers equal a NumPy computation from the runs' own metrics; a PNG
per metric; the runs share one compilation cache; and one arm x seed rerun from scratch (fresh
workdir, fresh warm cache, the study's compilation cache) reproduces the
killed-and-continued run's metrics.jsonl: every key exactly, but for the wall-clock ones (left out),
as tests/test_trainer_kill.py."""
import json
import subprocess
import sys

import numpy as np
import pytest
from _study_common import ARMS, SEEDS, STUDY_TIMEOUT_S, metrics_by_step, run_to_end
# what "the same metrics" means for two runs of one config, as for a killed-and-resumed run
# (docs/reliability.md, "Equal to an uninterrupted run"): wall-clock metrics left out, the rest exactly
from _run_compare import is_wall_clock, same_value

pytestmark = pytest.mark.timeout(STUDY_TIMEOUT_S)


def test_every_run_finished_once_and_the_killed_one_resumed(small_study):
    s = small_study
    for arm in ARMS:
        for seed in SEEDS:
            run = s.run(arm, seed)
            assert (run / "DONE").exists(), run
            assert (run / "console.log").exists()
    first = s.run(ARMS[0], SEEDS[0])
    assert (first / "DONE").read_text() == s.first_run_done_before_kill  # skipped, not redone
    assert (first / "console.log").read_text().count("\n=== ") == 1
    assert (s.killed_run / "console.log").read_text().count("\n=== ") == 2  # started again after the kill
    log = (s.killed_run / "train.log").read_text()
    if s.killed_at_steps < 2:  # killed between its checkpoints: train's own resume continued it
        assert "resumed from checkpoint" in log
    second_console = (s.workdir.parent / "study_console_2.log").read_text()
    assert "summary" in second_console.lower()


def test_the_runs_share_one_compilation_cache(small_study):
    """share_compilation_cache (on by default): every run's train.compilation_cache_dir is the study's
    xla_cache/, which holds the compiled programs (the rerun test below loads from it too)."""
    s = small_study
    cache = s.workdir / "xla_cache"
    assert cache.is_dir() and any(cache.iterdir())
    for arm in ARMS:
        for seed in SEEDS:
            config = json.loads((s.run(arm, seed) / "config.json").read_text())
            assert config["train"]["compilation_cache_dir"] == str(cache)


def test_warm_start_and_step0_evaluation_shared_per_seed(small_study):
    s = small_study
    entries = sorted(p for p in (s.workdir / "warm_cache").iterdir() if p.is_dir())
    assert len(entries) == len(SEEDS), entries  # one warm start per seed, whatever the arm
    seeds = sorted(json.loads((e / "key.json").read_text())["config"]["train"]["seed"] for e in entries)
    assert seeds == list(SEEDS)
    for e in entries:
        assert (e / "warm_start_model" / "config.json").exists()
        assert len([p for p in (e / "eval0").iterdir() if p.is_dir()]) == 1
    for seed in SEEDS:
        a, b = (metrics_by_step(s.run(arm, seed) / "tb" / "metrics.jsonl")[0] for arm in ARMS)
        assert a == b  # the step-0 row, the wall-clock one included: the evaluation was run once
        logs = [(s.run(arm, seed) / "train.log").read_text() for arm in ARMS]
        assert sum("warm start reused from the cache" in t for t in logs) == 1
        assert sum("step-0 evaluation reused from the cache" in t for t in logs) == 1
        weights = [(s.run(arm, seed) / "warm_start_model" / "model.safetensors").read_bytes() for arm in ARMS]
        assert weights[0] == weights[1]


def test_summary_equals_numpy_over_the_runs_metrics(small_study):
    s = small_study
    summary = json.loads((s.workdir / "summary.json").read_text())
    for arm in ARMS:
        after, before, zero = [], [], []
        for seed in SEEDS:
            rows = metrics_by_step(s.run(arm, seed) / "tb" / "metrics.jsonl")
            key = next(k for k in rows[0] if k.startswith("eval/toy/mean@") and k.count("/") == 2)
            before.append(rows[0][key])
            after.append(rows[max(rows)][key])
            zero.append(rows[max(rows)]["adv/zero_adv_group_frac"])
        got = summary["arms"][arm]
        assert got["heldout_acc_before"]["mean"] == pytest.approx(np.mean(before), abs=1e-12)
        assert got["heldout_acc_after"]["mean"] == pytest.approx(np.mean(after), abs=1e-12)
        assert got["heldout_acc_after"]["std"] == pytest.approx(np.std(after, ddof=1), abs=1e-12)
        assert got["zero_adv_group_frac_last"]["mean"] == pytest.approx(np.mean(zero), abs=1e-12)
        assert got["heldout_acc_after"]["ci_low"] == pytest.approx(min(after), abs=1e-12)  # 2 seeds: [min, max]
        assert got["heldout_acc_after"]["ci_high"] == pytest.approx(max(after), abs=1e-12)
    assert set(summary["vs_baseline"]) == {"cleaner"}
    text = (s.workdir / "summary.md").read_text()
    assert "held-out accuracy after RL" in text and "Difference from `grpo_raw`" in text
    written = {p.stem for p in (s.workdir / "plots").glob("*.png")}
    assert {"heldout_accuracy", "zero_adv_group_frac", "response_tokens", "train_accuracy"} <= written
    assert {"arms_heldout_acc_after", "arms_heldout_acc_gain", "arms_collapsed"} <= written  # per-arm figures
    for p in (s.workdir / "plots").glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p
    # the error-rate curve is drawn iff some training step made a tool call (0 calls: undefined, no curve)
    calls = any(row.get("tool_calls/total_attempts", 0) > 0 for arm in ARMS for seed in SEEDS
                for row in metrics_by_step(s.run(arm, seed) / "tb" / "metrics.jsonl").values())
    assert ("first_attempt_error_rate" in written) == calls
    again = subprocess.run([sys.executable, "-m", "cleaner_jax.study", "--config", str(s.config), "--workdir",
                            str(s.workdir), "--summarize-only"], cwd=s.source, env=s.env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((s.workdir / "summary.json").read_text())["arms"] == summary["arms"]


def test_one_run_from_scratch_reproduces_its_metrics(small_study, tmp_path):
    """The killed-and-continued run, rerun with its own command in a fresh workdir and a fresh warm
    cache (so its warm start and step-0 evaluation are computed, not copied), its programs loaded
    from the study's compilation cache: the same metrics.jsonl."""
    s = small_study
    cmd = json.loads((s.killed_run / "DONE").read_text())["command"]
    fresh = tmp_path / "fresh"
    cmd = [a.replace(str(s.killed_run), str(fresh)).replace(str(s.workdir / "warm_cache"), str(tmp_path / "cache"))
           for a in cmd]
    assert str(fresh) in cmd and any(str(tmp_path / "cache") in a for a in cmd)
    log = tmp_path / "console.log"
    assert run_to_end(cmd, s.source, s.env, log, 1800) == 0, log.read_text()[-5000:]
    a = metrics_by_step(s.killed_run / "tb" / "metrics.jsonl")
    b = metrics_by_step(fresh / "tb" / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [0, 1, 2]
    for step in a:
        ka = {k: v for k, v in a[step].items() if not is_wall_clock(k)}
        kb = {k: v for k, v in b[step].items() if not is_wall_clock(k)}
        assert sorted(ka) == sorted(kb), step
        differ = {k: (ka[k], kb[k]) for k in ka if not same_value(ka[k], kb[k])}
        assert not differ, (step, differ)
