"""End to end: `python -m cleaner_jax.train --config configs/toy.py` on a shrunken toy run.

Checks what a run must leave behind (TensorBoard events, metrics, a checkpoint, trajectory
dumps, an evaluation report), and that killing a run after step k and starting it again gives
the same step k+1 metrics as a run that was never interrupted.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--config.warmup_sft.steps=4", "--config.warmup_sft.examples=16", "--config.warmup_sft.batch_size=8",
    # a few-step warm start, or a few RL steps, cannot pay back the query blocks' longer compile
    # (~3 s per program and width; bench/RESULTS.md, 2026-12-07): whole-sequence attention in the fit
    # and the learner. The blocks are tested in tests/test_warm_start_fit.py and test_attention_impls.py
    "--config.warmup_sft.attention_block=0", "--config.model.attention_block=0",
    "--config.algo.prompts_per_step=2", "--config.algo.group_size=2", "--config.algo.micro_batch_size=4",
    "--config.data.eval_limit=2", "--config.eval.n=2", "--config.train.eval_every=2",
    "--config.train.checkpoint_every=1", "--config.sandbox.workers=2",
]


def train_cmd(workdir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "cleaner_jax.train", "--config", str(ROOT / "configs/toy.py"),
            "--workdir", str(workdir), f"--config.train.steps={steps}", *SMALL]


def run(workdir: Path, steps: int) -> None:
    proc = subprocess.run(train_cmd(workdir, steps), cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def descendants(pid: int) -> list[int]:
    """Every living descendant of `pid` (children that left its process group too)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:  # already reaped: its children, if any, were re-parented
        return []


def kill_trainer(proc: subprocess.Popen) -> list[int]:
    """SIGKILL the trainer's process group, then any descendant that had left the group (the
    embedded rollout server runs in its own session): the test started them all. Returns those."""
    def group(pid: int) -> int | None:
        try:
            return os.getpgid(pid)
        except ProcessLookupError:  # exited since the listing
            return None

    escaped = [p for p in descendants(proc.pid) if group(p) not in (None, proc.pid)]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for p in escaped:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return escaped


def metrics_by_step(workdir: Path) -> dict[int, dict]:
    """Last row per step (a resumed run re-logs the steps after its checkpoint)."""
    rows = {}
    for line in (workdir / "tb" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    return rows


_REFERENCE: dict[int, Path] = {}


def reference_run(tmp_path_factory, steps: int = 3) -> Path:
    """The uninterrupted toy run of `steps` steps, made once per test session: tests/test_trainer_kill.py
    compares its killed-and-resumed runs against the same one (tests only read it)."""
    if steps not in _REFERENCE:
        wd = tmp_path_factory.mktemp(f"toy_uninterrupted_{steps}")
        run(wd, steps=steps)
        _REFERENCE[steps] = wd
    return _REFERENCE[steps]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory)


def test_toy_run_writes_events_checkpoint_dumps_and_eval(uninterrupted):
    wd = uninterrupted
    assert list((wd / "tb").glob("events.out.tfevents.*"))
    m = metrics_by_step(wd)
    assert sorted(k for k in m if "reward/mean" in m[k]) == [1, 2, 3]
    for key in ("reward/acc", "learner/loss", "adv/zero_adv_group_frac", "tool_calls/success_rate",
                "splice/token_frac", "weight_sync/probe_gap"):
        assert key in m[3], key
    assert m[3]["weight_sync/probe_gap"] < 1e-3  # the server serves exactly the learner's weights
    assert (wd / "checkpoints" / "3").is_dir()
    assert sorted(p.name for p in (wd / "trajectories").glob("*.jsonl.gz")) == [
        "step_000001.jsonl.gz", "step_000002.jsonl.gz", "step_000003.jsonl.gz"]
    report = json.loads((wd / "eval" / "step_000002" / "results.json").read_text())
    assert report[0]["name"] == "toy" and report[0]["samples_per_problem"] == 2
    assert (wd / "eval" / "step_000002" / "results.md").read_text().startswith("# evaluation at step 2")


# slow: tests/test_trainer_kill.py's seeded kills (default suite) check the same resume, killed in
# chosen phases, against every metric exactly
@pytest.mark.slow
def test_kill_and_resume_repeats_the_next_step_exactly(uninterrupted, tmp_path):
    wd = tmp_path / "toy_b"
    proc = subprocess.Popen(train_cmd(wd, steps=3), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.time() + 1500
    try:
        while not (wd / "checkpoints" / "1").is_dir():  # killed once step 1 is checkpointed
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            assert time.time() < deadline, "no checkpoint within the deadline"
            time.sleep(0.5)
    finally:
        kill_trainer(proc)
    run(wd, steps=3)  # resumes from the newest complete checkpoint
    a, b = metrics_by_step(uninterrupted), metrics_by_step(wd)
    for step in (2, 3):
        for key in ("reward/mean", "reward/acc", "learner/loss", "learner/grad_norm", "response/purified_tokens_mean"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-6), (step, key)


def test_evaluate_cli_writes_a_report_for_the_newest_export(uninterrupted, tmp_path):
    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, "-m", "cleaner_jax.evaluate", "--config", str(ROOT / "configs/toy.py"),
         "--workdir", str(uninterrupted), "--out", str(out), "--config.data.eval_limit=3",
         "--config.eval.n=2", "--config.sandbox.workers=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in report] == ["toy"] and report[0]["problems"] == 3
    assert set(report[0]["pass_at_k"]) == {"1", "2"}  # JSON keys of the pass@k dict
    assert "sync/step_000003" in (out / "results.md").read_text()  # evaluated the newest export


def test_an_overlapped_run_killed_and_resumed_keeps_the_bound_the_draws_and_its_first_step(uninterrupted, tmp_path):
    """train.max_staleness=1 (docs/async.md), killed once step 1 is checkpointed and run again:
    every step draws the synchronous run's problems, no trained token is older than one update,
    the collections really overlap the updates, and step 1 (nothing prefetched yet) is the
    synchronous run's step 1 in every metric but wall-clock and `async/*` ones."""
    from _run_compare import is_wall_clock, same_value

    from cleaner_jax.viz.dumps import read_step

    wd = tmp_path / "toy_async"
    # a learner 3 s slower than it is: step 3's rollouts, started when step 2's update starts, get
    # tokens from the weights before it
    overlap = ["--config.train.max_staleness=1", "--config.train.debug_update_delay_s=3",
               "--config.rollout.continue_aborted=True"]
    proc = subprocess.Popen(train_cmd(wd, steps=3) + overlap, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 1500
    try:
        while not (wd / "checkpoints" / "1").is_dir():  # killed with step 2's collection in flight
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            assert time.time() < deadline, "no checkpoint within the deadline"
            time.sleep(0.5)
    finally:
        kill_trainer(proc)
    proc = subprocess.run(train_cmd(wd, steps=3) + overlap, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-6000:]
    a, b = metrics_by_step(uninterrupted), metrics_by_step(wd)
    for step in (1, 2, 3):
        assert b[step]["async/dropped_groups"] == 0
        assert b[step]["data/position"] == a[step]["data/position"]  # the draws in step order
        sync_uids = [d.uid for d in read_step(uninterrupted, step)]
        assert [d.uid for d in read_step(wd, step)] == sync_uids
        versions = {int(v) for d in read_step(wd, step) if d.episode is not None
                    for v in d.episode.purified.policy_version[d.episode.purified.loss_mask == 1]}
        assert versions and versions <= {step - 2, step - 1}, (step, versions)  # the bound, k = 1
    # step 2 was collected again after the resume, on the restored weights; step 3's collection
    # ran beside step 2's update
    assert b[2]["async/staleness_max"] == 0 and b[3]["async/staleness_max"] == 1
    assert b[3]["async/launch_lag"] == 1
    differ = [k for k in a[1] if k in b[1] and not is_wall_clock(k) and not same_value(a[1][k], b[1][k])]
    assert not differ, {k: (a[1][k], b[1][k]) for k in differ}
    assert set(a[1]) - set(b[1]) == set()
