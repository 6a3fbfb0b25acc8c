"""A disk that fills during a checkpoint is one clear line, and the last good checkpoint stays
(issue #27, item 8).

No disk is filled: Orbax's JSON writer is made to raise OSError(ENOSPC) inside a real save (the
error then travels through Orbax's threads and futures as it would). The sizes in the message are
computed here by hand from the arrays saved.
"""
from __future__ import annotations

import errno
import logging
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from cleaner_jax.rl.checkpointing import CheckpointDiskFullError, Checkpointer, QuietDiskFull

ROOT = Path(__file__).resolve().parents[1]
# params (4, 4) float32 + opt_state (4, 4) float32 + (2,) int32: 64 + 64 + 8 bytes
NEED_BYTES = 16 * 4 + 16 * 4 + 2 * 4


async def _full(self, x, directory):
    raise OSError(errno.ENOSPC, "No space left on device", str(directory / "metadata"))


def _state(v: float):
    return {"w": jnp.full((4, 4), v, jnp.float32)}, {"m": jnp.full((4, 4), -v, jnp.float32),
                                                      "count": jnp.array([1, 2], jnp.int32)}


def test_a_full_disk_is_one_error_naming_path_and_bytes_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path / "checkpoints")
    ck.save(1, *_state(1.0), {"data_position": 7})
    ck.wait()
    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", _full)
    with pytest.raises(CheckpointDiskFullError) as info:
        ck.save(2, *_state(2.0), {"data_position": 9})
        ck.wait()
    msg = str(info.value)
    assert "\n" not in msg
    m = re.fullmatch(r"no space left on device while writing checkpoint 2 \((?P<path>\S+)\): its state needs about "
                     r"0\.0 MiB \((?P<need>[\d,]+) bytes\), [\d,.]+ MiB \((?P<free>[\d,]+) bytes\) are free on the file "
                     r"system of (?P<dir>\S+)\. The last complete checkpoint, step 1, is kept .*", msg)
    assert m, msg
    assert m["path"] == str(tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp" / "extra.orbax-checkpoint-tmp"
                            / "metadata")
    assert int(m["need"].replace(",", "")) == NEED_BYTES
    assert m["dir"] == str(tmp_path / "checkpoints")
    free = shutil.disk_usage(tmp_path).free
    assert abs(int(m["free"].replace(",", "")) - free) < 2**30  # the same file system's free space
    ck.close()
    monkeypatch.undo()
    again = Checkpointer(tmp_path / "checkpoints")
    assert again.all_steps() == [1]
    step, params, opt, extra = again.restore(None, *_state(0.0))
    assert step == 1 and extra == {"data_position": 7}
    np.testing.assert_array_equal(np.asarray(params["w"]), np.full((4, 4), 1.0, np.float32))
    np.testing.assert_array_equal(np.asarray(opt["m"]), np.full((4, 4), -1.0, np.float32))
    again.close()


def test_the_console_filter_drops_only_full_disk_records():
    def record(exc: BaseException | None) -> logging.LogRecord:
        return logging.LogRecord("absl", logging.ERROR, __file__, 1, "failed", None,
                                 (type(exc), exc, None) if exc is not None else None)
    wrapped = RuntimeError("Failed to run 5 Handler Commit operations")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    tensorstore_like = ValueError("Error writing local file \"/x/d/0.0\": No space left on device [OS error]")
    quiet = QuietDiskFull()
    assert not quiet.filter(record(wrapped)) and not quiet.filter(record(tensorstore_like))
    assert quiet.filter(record(None)) and quiet.filter(record(RuntimeError("something else")))
    assert quiet.filter(record(OSError(errno.EACCES, "Permission denied")))


SCRIPT = textwrap.dedent("""
    import errno, runpy, sys
    import jax.numpy as jnp
    from orbax.checkpoint._src.handlers import json_checkpoint_handler
    from cleaner_jax import session
    from cleaner_jax.rl.checkpointing import Checkpointer

    async def full(self, x, directory):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "metadata"))

    def checkpoints_then_full(config, workdir):  # the trainer's first call: two saves, the second fills the disk
        ck = Checkpointer(workdir / "checkpoints")
        try:  # closed as the trainer closes its learner's (on error too)
            state = ({"w": jnp.ones((4, 4))}, {"m": jnp.zeros((4, 4))})
            ck.save(1, *state, {"data_position": 3})
            ck.wait()
            json_checkpoint_handler.JsonCheckpointHandler._save_fn = full
            ck.save(2, *state, {"data_position": 5})
            ck.wait()
        finally:
            ck.close()

    session.prepare_model_dir = checkpoints_then_full
    sys.argv = ["cleaner_jax.train", "--config", sys.argv[1], "--workdir", sys.argv[2]]
    runpy.run_module("cleaner_jax.train", run_name="__main__")
""")


def test_the_trainer_says_it_in_one_error_line_and_exits_1(tmp_path):
    wd = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "configs/toy.py"), str(wd)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-4000:]
    err = proc.stderr
    # none of the full disk's tracebacks (Orbax's threads log one each) reaches the console, nor ours.
    # (Orbax leaves the failed save's other threads running; one that is still running when the
    # interpreter exits may log "cannot schedule new futures after shutdown", unrelated to the disk.)
    assert "No space left on device" not in err and "CheckpointDiskFullError" not in err, err[-4000:]
    lines = [line for line in err.splitlines() if "space" in line]
    assert len(lines) == 1 and lines[0].startswith("error: no space left on device while writing checkpoint 2 ("), err
    assert "The last complete checkpoint, step 1, is kept" in lines[0]
    assert "Traceback" in (wd / "train.log").read_text()  # Orbax's tracebacks are kept in the log file
    ck = Checkpointer(wd / "checkpoints")
    assert ck.all_steps() == [1]
    ck.close()
