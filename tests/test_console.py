"""What a user sees running `python -m cleaner_jax.train`: progress bars, our warnings and the
before/after summary on the console; Orbax/absl/JAX INFO lines only in <workdir>/train.log.

`console_run` is one tiny toy run with the evaluation before RL, made once per test session;
tests/test_metric_names.py checks its metric names, tests/test_viz_browser.py views a copy of its
dumps.
"""
from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys
from pathlib import Path

from cleaner_jax.session import log_to_file
from cleaner_jax.viz.run_plots import before_after_rows, read_metrics, run_summary

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--config.train.steps=1", "--config.train.eval_every=1", "--config.train.eval_before_train=True",
    "--config.train.checkpoint_every=1",
    "--config.warmup_sft.steps=2", "--config.warmup_sft.examples=8", "--config.warmup_sft.batch_size=4",
    "--config.warmup_sft.attention_block=0", "--config.model.attention_block=0",  # as tests/test_train_toy.py's SMALL
    "--config.algo.prompts_per_step=2", "--config.algo.group_size=2", "--config.algo.micro_batch_size=4",
    "--config.data.eval_limit=2", "--config.eval.n=2", "--config.sandbox.workers=2",
]
_RUN: dict[str, tuple[Path, str, str]] = {}
# a library INFO line: Python logging's level name as our formatters and absl's write it, or absl's
# own prefix ("I1201 13:55:08.508 ...")
INFO_LINE = re.compile(r"(^|\s)INFO(\s|:)|^I\d{4} \d\d:\d\d:\d\d")


def console_run(tmp_path_factory) -> tuple[Path, str, str]:
    """(workdir, stdout, stderr) of one tiny toy training run with the step-0 evaluation."""
    if "run" not in _RUN:
        wd = tmp_path_factory.mktemp("toy_console") / "run"
        cmd = [sys.executable, "-m", "cleaner_jax.train", "--config", str(ROOT / "configs/toy.py"),
               "--workdir", str(wd), *TINY]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        _RUN["run"] = (wd, proc.stdout, proc.stderr)
    return _RUN["run"]


def last_by_step(workdir: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for line in (workdir / "tb" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    return rows


def console_lines(text: str) -> list[str]:
    return [line for line in re.split(r"[\r\n]+", text) if line.strip()]


def test_console_shows_progress_and_summary_and_the_log_file_has_library_info(tmp_path_factory):
    wd, out, err = console_run(tmp_path_factory)
    lines = console_lines(out) + console_lines(err)
    info = [line for line in lines if INFO_LINE.search(line)]
    assert not info, info[:5]
    assert not [line for line in lines if "absl" in line or "orbax" in line.lower()], lines
    assert any(line.startswith("train: 100%") for line in console_lines(err)), err[-2000:]  # tqdm writes to stderr
    log = (wd / "train.log").read_text()
    assert re.search(r" INFO absl: .*[Cc]heckpoint", log), log[:2000]  # Orbax logs through absl
    assert f"(log: {wd / 'train.log'})" in out

    # the summary: before RL = the step-0 evaluation, after RL = the step-1 one, as metrics.jsonl has them
    m = last_by_step(wd)
    assert "held-out evaluation before and after RL:" in out
    table = out.split("held-out evaluation before and after RL:", 1)[1]
    for name, label, percent in [("mean@2", "toy accuracy (mean@2)", True),
                                 ("first_attempt_error_rate", "toy first-attempt tool error rate", True),
                                 ("first_attempt_errors_per_trajectory", "toy first-attempt tool errors / trajectory",
                                  False)]:
        before, after = m[0][f"eval/toy/{name}"], m[1][f"eval/toy/{name}"]
        row = next(line for line in table.splitlines() if line.strip().startswith(label))
        cells = re.split(r"\s{2,}", row.strip())
        if percent:
            assert cells[1:] == [f"{100 * before:.1f} %", f"{100 * after:.1f} %", f"{100 * (after - before):+.1f} pts"]
        else:
            assert cells[1:] == [f"{before:.3f}", f"{after:.3f}", f"{after - before:+.3f}"]
    assert "after RL (step 1)" in table


def test_log_to_file_keeps_our_warnings_on_the_console(tmp_path, capfd):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        path = log_to_file(tmp_path / "train.log")
        logging.getLogger("absl").info("orbax: CheckpointManager init")
        logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'tpu'")
        logging.getLogger("cleaner_jax.session").warning("more than 32 concurrent episodes per sandbox worker")
        for h in root.handlers:
            h.flush()
        err = capfd.readouterr().err
        assert "WARNING cleaner_jax.session: more than 32 concurrent episodes per sandbox worker" in err
        assert "CheckpointManager" not in err and "libtpu" not in err and "tpu" not in err
        text = path.read_text()
        assert "INFO absl: orbax: CheckpointManager init" in text
        assert "INFO jax._src.xla_bridge: Unable to initialize backend 'tpu'" in text
        assert "WARNING cleaner_jax.session: more than 32" in text
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])


def write_rows(workdir: Path, rows: list[dict]) -> None:
    (workdir / "tb").mkdir(parents=True)
    (workdir / "tb" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_rows_take_step_0_and_the_last_evaluation(tmp_path):
    write_rows(tmp_path, [
        {"step": 0, "eval/toy/mean@4": 0.25, "eval/toy/first_attempt_error_rate": 0.5,
         "eval/toy/first_attempt_errors_per_trajectory": 0.75},
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "reward/mean": 0.2, "eval/toy/mean@4": 0.375},
        {"step": 4, "eval/toy/mean@4": 0.5, "eval/toy/first_attempt_error_rate": 0.125,
         "eval/toy/first_attempt_errors_per_trajectory": 0.25},
        {"step": 4, "eval/toy/mean@4": 0.625},  # a resumed run re-logged step 4: the last row wins
    ])
    rows = before_after_rows(read_metrics(tmp_path))
    assert rows == [("toy accuracy (mean@4)", 0.25, 0.625, True),
                    ("toy first-attempt tool error rate", 0.5, 0.125, True),
                    ("toy first-attempt tool errors / trajectory", 0.75, 0.25, False)]
    text = run_summary(tmp_path)
    assert "after RL (step 4)" in text
    acc = next(line for line in text.splitlines() if "accuracy" in line)
    assert re.split(r"\s{2,}", acc.strip())[1:] == ["25.0 %", "62.5 %", "+37.5 pts"]
    per_traj = next(line for line in text.splitlines() if "/ trajectory" in line)
    assert re.split(r"\s{2,}", per_traj.strip())[1:] == ["0.750", "0.250", "-0.500"]


def test_summary_without_the_step_0_evaluation_says_how_to_get_it(tmp_path):
    write_rows(tmp_path, [{"step": 2, "eval/toy/mean@2": 0.5}])
    (label, before, after, percent), = before_after_rows(read_metrics(tmp_path))
    assert (label, after, percent) == ("toy accuracy (mean@2)", 0.5, True) and math.isnan(before)
    text = run_summary(tmp_path)
    assert re.split(r"\s{2,}", text.splitlines()[1].strip())[1:] == ["-", "50.0 %", "-"]
    assert "--config.train.eval_before_train=True" in text


def test_summary_without_any_evaluation(tmp_path):
    write_rows(tmp_path, [{"step": 1, "reward/mean": 0.0}])
    assert run_summary(tmp_path).startswith("no held-out evaluation")
