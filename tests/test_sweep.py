"""launch/sweep.py: a real tiny sweep point (one RL step) is an ordinary train workdir whose config
has the point's values and the fixed --set values; --print lists every point's command without
running anything; a key the run config lacks stops the sweep before any run starts.

One real point, not a grid of them: the grid's expansion is what --print shows, and every run
beyond the first would only repeat the same ~40 s train start-up in the default suite."""
import itertools
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from _configs import load_module
from cleaner_jax.viz.plots import study_runs

ROOT = Path(__file__).resolve().parents[1]
SWEEP = [sys.executable, str(ROOT / "launch" / "sweep.py"), "--config", str(ROOT / "configs" / "toy.py")]
# one RL step of the smallest toy run: no warm start, no evaluation, one group of two short episodes
TINY = {"train.steps": "1", "warmup_sft.steps": "0", "algo.prompts_per_step": "1", "algo.group_size": "2",
        "algo.micro_batch_size": "2", "train.eval_every": "0", "train.checkpoint_every": "1",
        "sandbox.workers": "1", "agent.max_response_tokens": "64", "reward.overlong_buffer": "16",
        "agent.max_assistant_turns": "1"}
GRID = {"saar.gamma": ["0.3"], "saar.max_retries": ["2"]}  # one point, two swept keys


def sweep(workdir: Path, grid: dict[str, list[str]], fixed: dict[str, str], *extra: str,
          timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [*SWEEP, "--workdir", str(workdir), *extra]
    for key, values in grid.items():
        cmd += ["--grid", f"{key}={','.join(values)}"]
    for key, value in fixed.items():
        cmd += ["--set", f"{key}={value}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def sweep_main(workdir: Path, grid: dict[str, list[str]], fixed: dict[str, str], *extra: str) -> int:
    """launch/sweep.py's main() in this process (argument checks and --print: no subprocess start-up)."""
    argv = ["--config", SWEEP[3], "--workdir", str(workdir), *extra]
    for key, values in grid.items():
        argv += ["--grid", f"{key}={','.join(values)}"]
    for key, value in fixed.items():
        argv += ["--set", f"{key}={value}"]
    return load_module(ROOT / "launch" / "sweep.py").main(argv)


def typed(text: str, like):
    """A command-line value as the run config holds it (the type of the config's value)."""
    if isinstance(like, bool):
        return {"True": True, "False": False}[text]
    return type(like)(text)


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("sweep")
    proc = sweep(workdir, GRID, TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return workdir


@pytest.mark.slow  # a real training run (~70 s); --print and the key checks below run by default
def test_a_point_is_a_run_with_its_values(tiny_sweep):
    run = tiny_sweep / "gamma=0.3_max_retries=2"  # run_name: the last part of each key = value, joined by _
    assert [p.name for p in tiny_sweep.iterdir()] == [run.name]
    assert json.loads((run / "sweep_point.json").read_text()) == {"saar.gamma": "0.3", "saar.max_retries": "2"}
    config = json.loads((run / "config.json").read_text())  # what train ran with
    assert config["saar"]["gamma"] == 0.3 and config["saar"]["max_retries"] == 2
    for key, value in TINY.items():
        section, name = key.split(".")
        assert config[section][name] == typed(value, config[section][name]), key
    rows = [json.loads(line) for line in (run / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows if "reward/mean" in r}) == [1]  # one RL step, trained
    assert (run / "checkpoints" / "1").is_dir()
    # a sweep is a study to the notebooks: its arm is the point without train.seed, its seed the run's
    assert study_runs(tiny_sweep) == {"saar.gamma=0.3, saar.max_retries=2": {0: run}}


def test_print_lists_every_point_and_runs_nothing(tmp_path, capsys):
    grid = {"saar.gamma": ["0.3", "0.5"], "saar.max_retries": ["1", "3"]}
    assert sweep_main(tmp_path / "printed", grid, {"train.steps": "2"}, "--print") == 0
    assert not (tmp_path / "printed").exists()
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
    expected = list(itertools.product(grid["saar.gamma"], grid["saar.max_retries"]))  # the full grid, in order
    assert len(commands) == len(expected)
    for cmd, (gamma, retries) in zip(commands, expected):
        assert cmd[:5] == [sys.executable, "-m", "cleaner_jax.train", "--config", SWEEP[3]]
        assert cmd[cmd.index("--workdir") + 1] == str(tmp_path / "printed" / f"gamma={gamma}_max_retries={retries}")
        assert f"--config.saar.gamma={gamma}" in cmd and f"--config.saar.max_retries={retries}" in cmd
        assert "--config.train.steps=2" in cmd


@pytest.mark.parametrize("spec, message, listed", [
    ("saar.gama=0.3,0.5", "config.saar.gama: unknown key; the keys of config.saar are: ", ["gamma", "max_retries"]),
    ("sar.gamma=0.3", "config.sar.gamma: unknown key; the sections are: ", ["saar", "train", "algo"]),
    ("saar.gamma.x=1", "config.saar.gamma.x: unknown key; the keys of config.saar are: ", ["gamma"]),
    ("saar.gamma", "--grid 'saar.gamma': expected KEY=V1,V2,...", []),
])
def test_a_bad_grid_key_stops_before_any_run(tmp_path, spec, message, listed):
    with pytest.raises(SystemExit) as stop:
        sweep_main(tmp_path / "w", {"saar.gamma": ["0.3"]}, {}, "--grid", spec)
    text = str(stop.value)
    assert text.startswith(message), text
    assert set(listed) <= set(text[len(message):].split(", ")), text  # the message names the keys that exist
    assert not (tmp_path / "w").exists()  # no run directory, no sweep_point.json: nothing started


def test_a_bad_set_key_stops_before_any_run(tmp_path):
    with pytest.raises(SystemExit, match=r"^config\.train\.stepz: unknown key; the keys of config\.train are: "):
        sweep_main(tmp_path / "w", GRID, {"train.stepz": "1"})
    assert not (tmp_path / "w").exists()


def test_the_script_exits_with_the_message(tmp_path):
    """As a command (what a user runs): the message on stderr, a non-zero status, nothing started."""
    proc = subprocess.run([*SWEEP, "--workdir", str(tmp_path / "w"), "--grid", "saar.gama=0.3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("config.saar.gama: unknown key;"), proc.stderr
    assert not (tmp_path / "w").exists()


def write_point(sweep_dir: Path, name: str, point: dict[str, str], seed: int | None) -> Path:
    run = sweep_dir / name
    run.mkdir(parents=True)
    (run / "sweep_point.json").write_text(json.dumps(point))
    if seed is not None:
        (run / "config.json").write_text(json.dumps({"train": {"seed": seed}}))
    return run


def test_a_seeded_sweep_is_a_study_of_its_other_keys(tmp_path):
    runs = {(g, s): write_point(tmp_path, f"gamma={g}_seed={s}", {"saar.gamma": g, "train.seed": str(s)}, s)
            for g in ("0.3", "0.7") for s in (1, 0)}
    assert study_runs(tmp_path) == {f"saar.gamma={g}": {0: runs[g, 0], 1: runs[g, 1]} for g in ("0.3", "0.7")}
    assert list(study_runs(tmp_path)["saar.gamma=0.3"]) == [0, 1]  # seeds ascending


def test_a_sweep_study_names_what_is_wrong(tmp_path):
    write_point(tmp_path / "a", "x", {"saar.gamma": "0.3"}, None)  # never started: no config.json
    with pytest.raises(FileNotFoundError, match=r"config\.json missing: the run of .*x/sweep_point\.json never started"):
        study_runs(tmp_path / "a")
    write_point(tmp_path / "b", "x", {"saar.gamma": "0.3", "train.seed": "0"}, 0)
    write_point(tmp_path / "b", "y", {"saar.gamma": "0.3"}, 0)  # the same arm and seed again
    with pytest.raises(ValueError, match=r"two runs of arm 'saar.gamma=0.3' with train.seed=0"):
        study_runs(tmp_path / "b")
