"""Weights & Biases beside TensorBoard (`train.loggers`): the same names and values, offline.

The W&B run is read back from the `.wandb` file its offline mode writes (no network, no
`wandb.Api`): wandb 0.31 has no Python reader of it any more (its core is a Go binary), so
`wandb_history` reads the file's framing (a LevelDB log: the `:W&B` header, 32 KiB blocks of
records with a CRC-32, length and type each) here and parses every record with wandb's own
protobuf `Record`.
"""
import dataclasses
import glob
import json
import math
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from _configs import load_config
from cleaner_jax.config import ConfigError, check_environment, validate
from cleaner_jax.config.sections import TrainConfig
from cleaner_jax.rl import metrics_writer
from cleaner_jax.rl.metrics_writer import MetricsWriter, parse_loggers

ROWS = [  # (step, metrics): names as a run writes them, values TensorBoard's float32 cannot hold exactly
    (0, {"eval/toy/pass@1": 0.1, "eval/toy/mean@16/ci_low": 1 / 3}),
    (1, {"reward/mean": 0.7, "learner/grad_norm": float("nan"), "time/step_s": 12.25}),
    (1, {"eval/toy/pass@1": 0.3}),  # the evaluation after step 1: a second write of the step
    (2, {"reward/mean": -2.5, "learner/loss_scale": float("inf"), "weight_sync/probe_gap": 1e-7}),
]


def wandb_history(wandb_file: str) -> dict[tuple[str, int], float]:
    """{(name, step): value} of the history records of an offline run's `.wandb` file (W&B's own
    keys, `_step`, `_runtime`, `_timestamp`, left out)."""
    from wandb.proto import wandb_internal_pb2

    data = open(wandb_file, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    out, pos, pending, block = {}, 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a header: the block's zero padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue  # padding
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF, f"bad CRC at {pos}"
        pending += chunk
        if kind not in (1, 4):  # 1: a whole record, 2/3/4: its first, middle and last pieces
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = int(items.pop("_step"))
            out.update({(name, step): float(v) for name, v in items.items() if not name.startswith("_")})
    return out


def offline_run_file(root) -> str:
    """The `.wandb` file of the one offline run under `root`, once W&B has written all of it.

    `run.finish()` returns before wandb-core's writer has flushed the run's last records (measured:
    about 1 read in 60 under load found no history record, and the same file read a moment later
    had it), so the test waits for the service with `wandb.teardown()`, as a process's exit does."""
    import wandb

    wandb.teardown()
    [wandb_file] = glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb"))
    return wandb_file


def toy():
    return load_config("toy")


def offline_env(root) -> dict[str, str]:
    """W&B offline with everything it writes under `root`: its run (WANDB_DIR) and the core's
    debug logs and settings (WANDB_CACHE_DIR, WANDB_CONFIG_DIR, WANDB_DATA_DIR; ~/.cache/wandb
    and ~/.config/wandb otherwise); quiet, and pytest's stdout left alone."""
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_CACHE_DIR": str(root / "cache"),
            "WANDB_CONFIG_DIR": str(root / "config"), "WANDB_DATA_DIR": str(root / "data"),
            "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.timeout(120)
def test_an_offline_wandb_run_gets_tensorboards_names_and_values(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    for name, value in offline_env(wandb_dir).items():  # no network: the run stays on disk
        monkeypatch.setenv(name, value)
    config = dataclasses.asdict(validate(toy()))  # what train gives the run (make_metrics_writer)
    with MetricsWriter(tmp_path / "tb", loggers=parse_loggers("tensorboard,wandb"),
                       wandb_init={"project": "cleaner_jax", "name": "t", "dir": str(wandb_dir), "config": config}) as w:
        for step, metrics in ROWS:
            w.write(step, metrics)
    logged = wandb_history(offline_run_file(wandb_dir))

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    board = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    jsonl = {(name, row["step"]): float(v) for row in map(json.loads, (tmp_path / "tb" / "metrics.jsonl").open())
             for name, v in row.items() if name != "step"}
    assert sorted(logged) == sorted(board) == sorted(jsonl)  # the same (name, step) pairs, names unchanged
    assert len(logged) == sum(len(m) for _, m in ROWS)
    for key, value in logged.items():  # W&B keeps float64 (as metrics.jsonl), TensorBoard float32
        assert same(value, jsonl[key]) and same(float(np.float32(value)), board[key]), (key, value, board[key])


def test_wandb_is_not_imported_when_the_key_is_off(tmp_path):
    """The default train.loggers: a run of the writer (and of train's import) never imports wandb,
    whether it is installed or not."""
    code = f"""
import sys
from pathlib import Path
import cleaner_jax.train
from cleaner_jax.config.sections import TrainConfig
from cleaner_jax.rl.metrics_writer import MetricsWriter, parse_loggers
loggers = parse_loggers(TrainConfig().loggers)
assert loggers == ("tensorboard",), loggers
with MetricsWriter(Path({str(tmp_path)!r}), loggers=loggers) as w:
    w.write(1, {{"reward/mean": 0.5}})
    w.flush()
assert (Path({str(tmp_path)!r}) / "metrics.jsonl").exists()
print("wandb" in sys.modules, sorted(m for m in sys.modules if m.startswith("wandb")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False []", out.stdout


def test_loggers_key_default_is_tensorboard_as_before():
    assert TrainConfig().loggers == "tensorboard" and parse_loggers("tensorboard") == ("tensorboard",)
    assert parse_loggers(" tensorboard , wandb ") == ("tensorboard", "wandb") and parse_loggers("wandb") == ("wandb",)


@pytest.mark.parametrize("key,value,pattern", [
    ("loggers", "tensorboard,mlflow", r"config\.train\.loggers: 'tensorboard,mlflow': unknown logger 'mlflow'"),
    ("loggers", "wandb,wandb", r"config\.train\.loggers: 'wandb,wandb': 'wandb,wandb' names a logger twice"),
    ("loggers", " , ", r"config\.train\.loggers: ' , ': names no logger"),
    ("wandb_project", "p", r"config\.train\.wandb_project: 'p' names a W&B run, but train\.loggers='tensorboard' "
                           r"has no wandb"),
    ("wandb_name", "n", r"config\.train\.wandb_name: 'n' names a W&B run"),
])
def test_bad_loggers_are_rejected_naming_the_key(key, value, pattern):
    c = toy()
    c.train[key] = value
    with pytest.raises(ConfigError, match=pattern):
        validate(c)


def test_wandb_missing_fails_at_start_up_saying_what_to_install(monkeypatch):
    c = toy()
    c.train.loggers = "tensorboard,wandb"
    monkeypatch.setattr(metrics_writer, "wandb_installed", lambda: False)
    r = validate(c)  # the config is right; this machine lacks the package
    with pytest.raises(ConfigError, match=r"config\.train\.loggers: 'tensorboard,wandb' asks for wandb, but the "
                                          r"wandb package is not installed: pip install cleaner_jax\[wandb\]"):
        check_environment(r)
    monkeypatch.setattr(metrics_writer, "wandb_installed", lambda: True)
    check_environment(r)
    assert r.train.loggers == "tensorboard,wandb"


def test_the_writer_alone_says_what_to_install_when_wandb_is_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ImportError, match=r"pip install cleaner_jax\[wandb\]"):
        MetricsWriter(tmp_path, loggers=("wandb",))
    assert not any(tmp_path.iterdir())  # it failed before writing anything


def test_trainers_wandb_run_is_named_and_configured_from_the_run_config(tmp_path, monkeypatch):
    from cleaner_jax import train

    seen = {}
    monkeypatch.setattr(train, "MetricsWriter", lambda logdir, **kw: seen.update(kw, logdir=logdir))
    c = toy()
    c.train.loggers, c.train.wandb_name = "wandb", "run-1"
    monkeypatch.setattr(metrics_writer, "wandb_installed", lambda: True)
    r = validate(c)
    train.make_metrics_writer(r, tmp_path / "w", keep_through=3)
    assert seen["logdir"] == tmp_path / "w" / "tb" and seen["keep_through"] == 3 and seen["loggers"] == ("wandb",)
    assert seen["wandb_init"] == {"project": "cleaner_jax", "name": "run-1", "dir": str(tmp_path / "w"),
                                  "config": dataclasses.asdict(r)}


@pytest.mark.timeout(120)
def test_wandb_alone_writes_no_event_file_but_still_metrics_jsonl(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name, value in offline_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    with MetricsWriter(tmp_path / "tb", loggers=("wandb",), wandb_init={"dir": str(tmp_path)}) as w:
        w.write(1, {"reward/mean": 0.5})
    assert not list((tmp_path / "tb").glob(metrics_writer.EVENT_GLOB))
    assert json.loads((tmp_path / "tb" / "metrics.jsonl").read_text()) == {"step": 1, "reward/mean": 0.5}
    assert wandb_history(offline_run_file(tmp_path)) == {("reward/mean", 1): 0.5}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_toy_training_run_logs_to_wandb_what_it_logs_to_tensorboard(tmp_path):
    """End to end (train, its config keys, the evaluations before and after the step): every
    TensorBoard (tag, step) of a tiny toy run is in its offline W&B run with the same value."""
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(__file__).resolve().parents[1]
    wd = tmp_path / "run"
    tiny = ["--config.train.steps=1", "--config.train.eval_every=1", "--config.train.eval_before_train=True",
            "--config.train.checkpoint_every=1", "--config.warmup_sft.steps=2", "--config.warmup_sft.examples=8",
            "--config.warmup_sft.batch_size=4", "--config.warmup_sft.attention_block=0",
            "--config.algo.prompts_per_step=2", "--config.algo.group_size=2",
            "--config.algo.micro_batch_size=4", "--config.data.eval_limit=2", "--config.eval.n=2",
            "--config.sandbox.workers=2"]
    cmd = [sys.executable, "-m", "cleaner_jax.train", "--config", str(root / "configs/toy.py"), "--workdir", str(wd),
           *tiny, "--config.train.loggers=tensorboard,wandb", "--config.train.wandb_name=toy"]
    env = {**os.environ, **offline_env(tmp_path)}
    del env["WANDB_CONSOLE"]  # the run's own console (progress bars) as a user would have it
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    [wandb_file] = glob.glob(str(wd / "wandb" / "offline-run-*" / "run-*.wandb"))
    logged = wandb_history(wandb_file)
    acc = EventAccumulator(str(wd / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    board = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert ("eval/toy/pass@1", 0) in board and ("eval/toy/pass@1", 1) in board and ("reward/acc", 1) in board
    assert sorted(logged) == sorted(board)
    assert all(same(float(np.float32(v)), board[k]) for k, v in logged.items())
