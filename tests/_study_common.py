"""The small real study (cleaner_jax/testing/small_study.py: 2 arms x 2 seeds, 2 RL steps, a tiny
evaluation), run once per test session and shared: by tests/test_study_e2e.py and by the notebook
tests, which run on its output.

The fixture runs `python -m cleaner_jax.study` as a user would, on a snapshot of the package and
the configs taken when it starts (`SmallStudy.source`, first on PYTHONPATH: the study's runs and
a rerun of one of them then run one version of the code, even while the working tree is being
edited), kills it (SIGKILL to the study's
process group and the rollout server that left it) once the second run has committed its step-1
checkpoint, and runs the same command again to the end, so the output it hands over is that of a
killed-and-continued study. `SmallStudy` says what happened (which run was killed, when).

The `small_study` fixture itself is in tests/conftest.py (one study per session, whichever file
asks first); a test file using it sets

    from _study_common import STUDY_TIMEOUT_S
    pytestmark = pytest.mark.timeout(STUDY_TIMEOUT_S)

(the first test to use it pays for the study in its setup, which pytest-timeout counts: pytest.ini's
600 s are not enough on a loaded 2-core box, where one toy run takes 1.5-3.5 minutes).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from test_train_toy import kill_trainer  # the trainer tests' helper: group, then escaped descendants

from cleaner_jax.testing.small_study import ARMS, SEEDS, config_text

ROOT = Path(__file__).resolve().parents[1]
STUDY_TIMEOUT_S = 3600  # the study (4 runs, one of them killed and continued) and the test that waits for it


def metrics_by_step(path: Path) -> dict[int, dict]:
    """Last row per step of a metrics.jsonl (a resumed run re-logs the steps after its checkpoint)."""
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row.pop("step"), {}).update(row)
    return rows


@dataclasses.dataclass(frozen=True)
class SmallStudy:
    workdir: Path
    config: Path
    command: tuple[str, ...]
    source: Path               # the snapshot the study ran: cwd and PYTHONPATH of every command
    killed_run: Path           # the run the study was killed in
    killed_at_steps: int       # checkpoints the killed run had committed when killed
    first_run_done_before_kill: str  # the first run's DONE marker text at the kill (it must not be redone)
    seconds: float             # both invocations together

    def run(self, arm: str, seed: int) -> Path:
        return self.workdir / "runs" / arm / f"seed_{seed}"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.source)}


def snapshot(root: Path) -> Path:
    """A copy of the package and the configs under `root/src`."""
    src = root / "src"
    for name in ("cleaner_jax", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def run_to_end(cmd, cwd: Path, env: dict[str, str], log: Path, timeout_s: float) -> int:
    """Run `cmd` in its own session, console to `log`; on a timeout (or any error, the test's own
    timeout included) kill it and every process it started."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            kill_trainer(proc)  # the study and its runs; their rollout servers left the group


def run_small_study(root: Path) -> SmallStudy:
    root.mkdir(parents=True, exist_ok=True)
    src = snapshot(root)
    env = {**os.environ, "PYTHONPATH": str(src)}
    config = root / "small_study.py"
    config.write_text(config_text())
    workdir = root / "study"
    cmd = (sys.executable, "-m", "cleaner_jax.study", "--config", str(config), "--workdir", str(workdir))
    first = workdir / "runs" / ARMS[0] / f"seed_{SEEDS[0]}"
    second = workdir / "runs" / ARMS[1] / f"seed_{SEEDS[0]}"
    t0 = time.monotonic()
    with open(root / "study_console_1.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while not (second / "checkpoints" / "1").is_dir():
            if proc.poll() is not None:
                raise AssertionError(f"the study ended (exit {proc.returncode}) before it could be killed: "
                                     + (root / "study_console_1.log").read_text()[-3000:])
            if time.monotonic() > deadline:
                raise AssertionError("the study's second run wrote no step-1 checkpoint within 900 s")
            time.sleep(0.2)
        done_text = (first / "DONE").read_text()
        killed_at = len([p for p in (second / "checkpoints").iterdir() if p.name.isdigit()])
    finally:
        kill_trainer(proc)  # the study and its runs; their rollout servers left the group
    console = root / "study_console_2.log"
    rc = run_to_end(cmd, src, env, console, 1800)
    assert rc == 0, console.read_text()[-5000:]
    return SmallStudy(workdir, config, cmd, src, second, killed_at, done_text, time.monotonic() - t0)

