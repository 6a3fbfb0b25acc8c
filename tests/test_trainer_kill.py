"""Row 3 of docs/reliability.md: the trainer SIGKILLed at any point resumes from its last complete
step, and its metrics equal an uninterrupted run's.

"Equal" (`assert_same_metrics`): the same rows in the same order in `metrics.jsonl`, the same
(step, value) series per tag in the TensorBoard events (read with TensorBoard's own
EventAccumulator, an independent reader), the same keys; values exactly equal, except wall-clock metrics (`time/*`, names ending in `_s`,
`*/wall_s_per_problem`), which are excluded. The restarted rollout server batches the resumed
step's requests as their timing falls, differently from the uninterrupted run's; its log-probs are
the same only because it is batch-invariant (`rollout.batch_invariant`), and these tests check it.

Kills land in chosen phases without any hook in the package: the trainer runs under this file's
driver (`python tests/test_trainer_kill.py --events F [--block KIND:ARG] -- <train args>`), which
wraps a few functions to log "enter/exit" lines to F and, for `--block`, to stop inside the chosen
write (after tearing the file being written) or phase; the test polls F (and the file system)
and SIGKILLs the process group. Orbax's own commit is interrupted by blocking its final rename.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# the driver: runs `python -m cleaner_jax.train`'s own __main__ block with a few functions wrapped

def _drive(argv: list[str]) -> None:
    sep = argv.index("--")
    opts, train_args = argv[:sep], argv[sep + 1:]
    events = opts[opts.index("--events") + 1]
    block = opts[opts.index("--block") + 1] if "--block" in opts else ""
    fd = os.open(events, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def note(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    def stop(what: str) -> None:
        note(f"blocked {what}")
        time.sleep(3600)  # the test kills us here
        raise SystemExit(f"the test did not kill the trainer blocked in {what}")

    import cleaner_jax.models.params as params
    import cleaner_jax.toy.checkpoint as tiny
    import cleaner_jax.train as T
    import cleaner_jax.train_steps as S
    import cleaner_jax.train_steps.step_loop as L
    from orbax.checkpoint._src.path import async_path

    def tearing(save_file):  # safetensors' save_file, as params / toy.checkpoint call it
        def wrapped(tensors, filename, metadata=None):
            target = Path(filename).parent.name.removeprefix(".").removesuffix(".partial")
            note(f"export {target}")
            save_file(tensors, filename, metadata=metadata)
            if block == f"export:{target}":
                size = os.path.getsize(filename)
                os.truncate(filename, size // 2)  # a torn file inside the half-written directory
                stop(f"export {target}")
        return wrapped

    params.save_file = tearing(params.save_file)
    tiny.save_file = tearing(tiny.save_file)

    collect = S.StepLoop.collect
    current = {"step": 0}

    def collect_wrapped(self, step, sampler):
        current["step"] = step + 1
        note(f"enter rollout {step + 1}")
        out = collect(self, step, sampler)
        if block == f"rollout:{step + 1}":
            stop(f"rollout {step + 1}")  # episodes collected, not yet returned to the step
        note(f"exit rollout {step + 1}")
        return out

    S.StepLoop.collect = collect_wrapped
    rl_step = L.rl_step_outputs

    def rl_step_wrapped(learner, scored, cfg):
        step = current["step"]
        note(f"enter update {step}")
        out = rl_step(learner, scored, cfg)
        if block == f"update:{step}":
            stop(f"update {step}")  # the learner's weights are updated in memory only
        note(f"exit update {step}")
        return out

    L.rl_step_outputs = rl_step_wrapped
    warm = T.warm_start

    def warm_wrapped(*args, **kwargs):
        note("enter warm_start")
        out = warm(*args, **kwargs)
        note("exit warm_start")
        return out

    T.warm_start = warm_wrapped
    rename = async_path.rename

    async def rename_wrapped(src, dst):
        if Path(dst).parent.name == "checkpoints" and block == f"checkpoint:{Path(dst).name}":
            stop(f"checkpoint {Path(dst).name}")  # every item and commit_success.txt written, not renamed
        return await rename(src, dst)

    async_path.rename = rename_wrapped
    src = Path(T.__file__).read_text()
    main_block = src[src.index('\nif __name__ == "__main__":'):]
    sys.argv = [T.__file__, *train_args]
    namespace = dict(vars(T), __name__="__main__")  # T's functions keep T's globals: the wrapped ones
    exec(compile(main_block, T.__file__, "exec"), namespace)  # noqa: S102 - the package's own source


if __name__ == "__main__":
    _drive(sys.argv[1:])
    sys.exit(0)


# ---------------------------------------------------------------------------------------------
# tests

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from safetensors.numpy import load_file  # noqa: E402
from _run_compare import is_wall_clock, same_value  # noqa: E402
from test_train_toy import kill_trainer, reference_run, train_cmd  # noqa: E402

def jsonl_rows(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "tb" / "metrics.jsonl").read_text().splitlines()]


def tb_scalars(workdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(workdir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_same_metrics(reference: Path, resumed: Path) -> None:
    a, b = jsonl_rows(reference), jsonl_rows(resumed)
    assert [(r["step"], sorted(r)) for r in a] == [(r["step"], sorted(r)) for r in b]
    for ra, rb in zip(a, b):
        for k in ra:
            if not is_wall_clock(k):
                assert same_value(ra[k], rb[k]), (ra["step"], k, ra[k], rb[k])
    ta, tb = tb_scalars(reference), tb_scalars(resumed)
    assert sorted(ta) == sorted(tb)
    for tag in ta:
        assert [s for s, _ in ta[tag]] == [s for s, _ in tb[tag]], tag  # no step twice, none missing
        if not is_wall_clock(tag):
            for (step, va), (_, vb) in zip(ta[tag], tb[tag]):
                assert same_value(va, vb), (step, tag, va, vb)


def committed_steps(workdir: Path) -> list[int]:
    d = workdir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / "commit_success.txt").is_file()) \
        if d.is_dir() else []


def leftovers(workdir: Path) -> list[str]:
    """Half-written things a finished run must not leave behind."""
    return sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*")
                  if p.name.endswith((".orbax-checkpoint-tmp", ".partial", ".replaced", ".tmp", ".rewrite")))


class Killer:
    """Starts the trainer under the driver, waits for a condition on its event lines (or the file
    system), and SIGKILLs its whole process group."""

    def __init__(self, workdir: Path, steps: int, tmp: Path):
        self.wd, self.steps, self.tmp, self.n = workdir, steps, tmp, 0
        self.expected_resumes: list[int] = []  # checkpoint each restart must resume from
        self.kills: list[str] = []
        self.escaped: list[int] = []  # descendants outside the trainer's process group, killed after it

    def kill_when(self, ready, block: str = "", delay: float = 0.0, what: str = "",
                  may_finish: bool = False) -> list[str] | None:
        """The event lines at the kill; None if the run ended first (allowed with `may_finish`)."""
        self.n += 1
        events = self.tmp / f"events_{self.n}.txt"
        events.touch()
        cmd = [sys.executable, __file__, "--events", str(events), *(["--block", block] if block else []), "--",
               *train_cmd(self.wd, self.steps)[3:]]
        err = self.tmp / f"stderr_{self.n}.txt"
        with open(err, "w") as stderr:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        deadline, finished = time.time() + 900, False
        try:
            while not ready(events.read_text().splitlines()):
                if may_finish and proc.poll() == 0:
                    finished = True
                    break
                assert proc.poll() is None, f"trainer exited ({proc.returncode}) before {what}: " + err.read_text()[-3000:]
                assert time.time() < deadline, f"{what} not reached in 900 s"
                time.sleep(0.005)
            time.sleep(delay)
        finally:
            self.escaped += kill_trainer(proc)
        self.kills.append(what if not finished else f"({what}: the run ended first)")
        steps = committed_steps(self.wd)
        self.expected_resumes.append(steps[-1] if steps else 0)
        return None if finished else events.read_text().splitlines()

    def finish(self) -> None:
        proc = subprocess.run(train_cmd(self.wd, self.steps), cwd=ROOT, capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, proc.stderr[-6000:]
        log = (self.wd / "train.log").read_text()
        resumed = [int(m) for m in re.findall(r"resumed from checkpoint (\d+)", log)]
        # every restart resumes from the newest committed checkpoint at the moment of the kill
        # (a start without one logs nothing and starts over)
        assert resumed == [s for s in self.expected_resumes if s > 0], (resumed, self.expected_resumes, self.kills)
        assert leftovers(self.wd) == []


def do_kill(k: Killer, kind: str, step: int = 0, rng: random.Random | None = None) -> None:
    """One kill of the given kind, with what must hold right after it."""
    wd = k.wd
    if kind in ("init", "warm_export"):
        name = "init_model" if kind == "init" else "warm_start_model"
        k.kill_when(lambda ev: f"blocked export {name}" in ev, block=f"export:{name}", what=f"{name} write")
        assert not (wd / name).exists()  # the torn directory exists only under its partial name
        torn = next((wd / f".{name}.partial").glob("*.safetensors"))
        with pytest.raises(Exception):
            load_file(torn)
    elif kind == "warm_start":
        ev = k.kill_when(lambda ev: "enter warm_start" in ev, delay=rng.uniform(0.2, 1.5), what="warm start")
        assert "exit warm_start" not in ev and not (wd / "warm_start_model").exists()
    elif kind in ("rollout", "update"):
        k.kill_when(lambda ev: f"blocked {kind} {step}" in ev, block=f"{kind}:{step}", what=f"{kind} of step {step}")
    elif kind == "sync_export":
        name = f"step_{step:06d}"
        k.kill_when(lambda ev: f"blocked export {name}" in ev, block=f"export:{name}", what=f"export of {name}")
        assert (wd / "sync" / f".{name}.partial").is_dir()
    elif kind == "checkpoint":
        k.kill_when(lambda ev: f"blocked checkpoint {step}" in ev, block=f"checkpoint:{step}",
                    what=f"checkpoint {step} commit")
        tmp = wd / "checkpoints" / f"{step}.orbax-checkpoint-tmp"
        assert tmp.is_dir() and (tmp / "commit_success.txt").is_file() and not (wd / "checkpoints" / str(step)).exists()
    elif kind == "checkpoint_poll":  # no block: polled from the file system, killed the moment it appears
        tmp = wd / "checkpoints" / f"{step}.orbax-checkpoint-tmp"
        k.kill_when(lambda ev: tmp.exists(), what=f"checkpoint {step} write (polled)")
    elif kind == "anytime":  # a random moment of the run (which may end first)
        start = time.time()
        delay = rng.uniform(1.0, 30.0)
        ev = k.kill_when(lambda ev: time.time() - start > delay, what=f"at {delay:.1f} s", may_finish=True)
        if ev is not None:
            k.kills[-1] += f" (last event: {ev[-1] if ev else 'none'})"
    else:
        raise ValueError(kind)


def random_plan(seed: int, steps: int, step_kinds: list[str]) -> list[tuple[str, int]]:
    """A start-up kill (the warm start's fit or its weight export), then one kill of each of
    `step_kinds` at a seeded random step, in an order the run can reach (a kill at step n resumes
    at or before n, so the steps do not decrease)."""
    rng = random.Random(seed)
    order = {"rollout": 0, "update": 1, "sync_export": 2, "checkpoint": 3}
    later = sorted(((kind, rng.randint(1, steps)) for kind in step_kinds), key=lambda ks: (ks[1], order[ks[0]]))
    return [(rng.choice(["warm_start", "warm_export"]), 0), *later]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory)


@pytest.mark.timeout(1800)  # five trainer starts: ~80 s on an idle 2-core machine, far more on a shared one
def test_seeded_random_kills_resume_to_the_uninterrupted_metrics(uninterrupted, tmp_path):
    # seed 9: the warm start's export, step 2's rollout, the commit of checkpoint 2 (an evaluated
    # step), step 3's update (checkpoint 2 committed, its evaluation rows must be on disk)
    plan = random_plan(seed=9, steps=3, step_kinds=["rollout", "update", "checkpoint"])
    assert plan == [("warm_export", 0), ("rollout", 2), ("checkpoint", 2), ("update", 3)]
    k = Killer(tmp_path / "run", 3, tmp_path)
    rng = random.Random(9)
    for kind, step in plan:
        do_kill(k, kind, step, rng)
    k.finish()
    assert_same_metrics(uninterrupted, k.wd)
    assert sorted(p.name for p in (k.wd / "trajectories").iterdir()) == [
        "step_000001.jsonl.gz", "step_000002.jsonl.gz", "step_000003.jsonl.gz"]
    assert [p.name for p in (k.wd / "sync").iterdir()] == ["step_000003"]


@pytest.mark.slow
@pytest.mark.timeout(5400)
def test_every_phase_killed_in_turn(uninterrupted, tmp_path):
    """Every kind of kill point, one after the other in one run (14 kills), then the metrics."""
    k = Killer(tmp_path / "run", 3, tmp_path)
    plan = ["init", "warm_start", "warm_export", "rollout:1", "update:1", "sync_export:1", "checkpoint_poll:1",
            "checkpoint:2", "rollout:2", "sync_export:2", "update:3", "rollout:3", "sync_export:3", "checkpoint:3"]
    rng = random.Random(5)
    for spec in plan:
        kind, _, step = spec.partition(":")
        do_kill(k, kind, int(step or 0), rng)
    k.finish()
    assert_same_metrics(uninterrupted, k.wd)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [11, 12])
def test_kills_at_random_moments(uninterrupted, tmp_path, seed):
    """Six SIGKILLs at seeded random moments (wherever they land: start-up, warm start, rollout,
    update, export, checkpoint, evaluation), then the metrics."""
    k = Killer(tmp_path / "run", 3, tmp_path)
    rng = random.Random(seed)
    for _ in range(6):
        do_kill(k, "anytime", 0, rng)
        if k.kills[-1].startswith("("):  # the run ended before the moment came
            break
    k.finish()
    assert_same_metrics(uninterrupted, k.wd)
    print("kills:", k.kills)


# ---------------------------------------------------------------------------------------------
# the pieces, without a trainer

def _scalar_rows(steps, scale):
    return {s: {"m/a": s * scale, "m/b": -s * scale / 3.0} for s in steps}


def test_metrics_writer_resume_drops_later_steps_torn_tails_and_purges_a_live_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cleaner_jax.rl.metrics_writer import MetricsWriter

    logdir = tmp_path / "tb"
    with MetricsWriter(logdir) as w:  # the killed run: steps 1..5, an eval row at 4
        for s, row in _scalar_rows(range(1, 6), 1.5).items():
            w.write(s, row)
            if s == 4:
                w.write(4, {"eval/x": 0.25})
        w.flush()
    (event_file,) = logdir.glob("events.out.tfevents.*")
    with open(event_file, "ab") as f:
        f.write(b"\x20\x00\x00\x00\x00\x00\x00\x00\x01\x02")  # a record torn by the kill
    with open(logdir / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "m/a": 1')  # a row torn by the kill
    live = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # a TensorBoard that had loaded it all
    live.Reload()
    assert [e.step for e in live.Scalars("m/a")] == [1, 2, 3, 4, 5]

    with MetricsWriter(logdir, keep_through=3) as w:  # the resumed run, from checkpoint 3
        for s, row in _scalar_rows(range(4, 7), 2.0).items():
            w.write(s, row)
        w.flush()

    want = {**_scalar_rows(range(1, 4), 1.5), **_scalar_rows(range(4, 7), 2.0)}
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": s, **want[s]} for s in range(1, 7)]  # exact: floats round-trip through JSON
    for acc in (live, EventAccumulator(str(logdir), size_guidance={"scalars": 0})):
        acc.Reload()
        # eval/x was at step 4 only: gone (a live reader keeps the tag name, with no events)
        assert sorted(t for t in acc.Tags()["scalars"] if acc.Scalars(t)) == ["m/a", "m/b"]
        for tag in ("m/a", "m/b"):
            got = [(e.step, e.value) for e in acc.Scalars(tag)]
            assert got == [(s, float(np.float32(want[s][tag]))) for s in range(1, 7)], tag
    for f in logdir.glob("events.out.tfevents.*"):  # also read file by file (viz.plots.load_scalars)
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        steps = [e.step for e in acc.Scalars("m/a")]
        assert steps in ([1, 2, 3], [4, 5, 6]), (f.name, steps)

    with MetricsWriter(logdir, keep_through=-1):  # a run that starts over (no checkpoint)
        pass
    assert (logdir / "metrics.jsonl").read_text() == ""
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    assert acc.Tags()["scalars"] == []


def test_a_damaged_metrics_line_before_the_end_is_an_error_naming_it(tmp_path):
    from cleaner_jax.rl.metrics_writer import MetricsWriter

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"\n{"step": 3, "a": 3.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON row"):
        MetricsWriter(tmp_path, keep_through=1)


def kill_when_marked(script: str, args: list[str], marker: Path, timeout_s: float) -> None:
    """Run `script` (python -c) with `args`, wait until it creates `marker` (the moment it has
    reached the point to kill at), then SIGKILL its whole process group."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + timeout_s
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


_KILL_INSIDE_EXPORT = """
import os, sys, time
from pathlib import Path
import cleaner_jax.models.params as params
src, out, marker = map(Path, sys.argv[1:4])
save = params.save_file
def torn(tensors, filename, metadata=None):
    save(tensors, filename, metadata=metadata)
    os.truncate(filename, os.path.getsize(filename) // 2)
    marker.touch()
    time.sleep(600)
params.save_file = torn
params.save_pretrained(params.from_pretrained(src), out, tokenizer_from=src)
"""


def test_an_export_killed_inside_its_write_leaves_the_old_directory_whole(tmp_path):
    from cleaner_jax.models import params
    from cleaner_jax.toy.checkpoint import make_tiny_checkpoint

    old, new = make_tiny_checkpoint(tmp_path / "old", seed=1), make_tiny_checkpoint(tmp_path / "new", seed=2)
    out = tmp_path / "exports" / "step_000002"
    params.save_pretrained(params.from_pretrained(old), out, tokenizer_from=old)
    marker = tmp_path / "torn"
    kill_when_marked(_KILL_INSIDE_EXPORT, [str(new), str(out), str(marker)], marker, 300)
    partial = out.parent / ".step_000002.partial"
    with pytest.raises(Exception):
        load_file(partial / "model.safetensors")  # torn, and only under the partial name
    want_old = load_file(old / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(want_old)
    for name in want_old:
        np.testing.assert_array_equal(got[name], want_old[name], err_msg=name)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in old.iterdir())

    params.save_pretrained(params.from_pretrained(new), out, tokenizer_from=new)  # the next export replaces both
    want_new = load_file(new / "model.safetensors")
    got = load_file(out / "model.safetensors")
    for name in want_new:
        np.testing.assert_array_equal(got[name], want_new[name], err_msg=name)
    assert sorted(p.name for p in out.parent.iterdir()) == ["step_000002"]


_KILL_INSIDE_ORBAX_COMMIT = """
import sys, time
from pathlib import Path
import numpy as np, jax.numpy as jnp
from orbax.checkpoint._src.path import async_path
from cleaner_jax.rl.checkpointing import Checkpointer
directory, marker = Path(sys.argv[1]), Path(sys.argv[2])
ck = Checkpointer(directory)
ck.save(1, {"w": jnp.arange(6.0)}, {"m": jnp.ones(3)}, {"data_position": 10})
ck.wait()
rename = async_path.rename
async def blocked(src, dst):
    if Path(dst).name == "2":
        marker.touch()
        time.sleep(600)
    return await rename(src, dst)
async_path.rename = blocked
ck.save(2, {"w": jnp.arange(6.0) * 7}, {"m": jnp.zeros(3)}, {"data_position": 20})
ck.wait()
"""


def test_a_checkpoint_killed_inside_its_commit_is_never_restored(tmp_path):
    import jax.numpy as jnp

    from cleaner_jax.rl.checkpointing import Checkpointer, remove_unfinished_saves

    directory, marker = tmp_path / "checkpoints", tmp_path / "blocked"
    kill_when_marked(_KILL_INSIDE_ORBAX_COMMIT, [str(directory), str(marker)], marker, 300)
    tmp = directory / "2.orbax-checkpoint-tmp"
    assert (tmp / "commit_success.txt").is_file() and not (directory / "2").exists()  # fully written, uncommitted

    ck = Checkpointer(directory)
    assert ck.all_steps() == [1] and ck.latest_step() == 1 and tmp.is_dir()  # a reader deletes nothing
    step, params, opt_state, extra = ck.restore(None, {"w": jnp.zeros(6)}, {"m": jnp.zeros(3)})
    assert step == 1 and extra == {"data_position": 10}
    np.testing.assert_array_equal(np.asarray(params["w"]), np.arange(6.0))
    np.testing.assert_array_equal(np.asarray(opt_state["m"]), np.ones(3))
    ck.save(2, {"w": jnp.arange(6.0) * 3}, {"m": jnp.zeros(3)}, {"data_position": 20})  # the step is redone
    ck.wait()
    assert not tmp.exists() and ck.all_steps() == [1, 2]
    (directory / "3.orbax-checkpoint-tmp").mkdir()  # what the trainer removes at start-up
    assert remove_unfinished_saves(directory) == [directory / "3.orbax-checkpoint-tmp"]
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]
    # a step directory without its commit marker (a deletion killed half-way) is never a checkpoint
    (directory / "2" / "commit_success.txt").unlink()
    ck.close()
    assert Checkpointer(directory).latest_step() == 1


def test_discarded_dumps_are_exactly_the_later_steps_and_unfinished_writes(tmp_path):
    from cleaner_jax.viz.dumps import discard_after

    d = tmp_path / "trajectories"
    d.mkdir()
    names = ["step_000001.jsonl.gz", "step_000002.jsonl.gz", "step_000003.jsonl.gz", "step_000003.jsonl.gz.tmp",
             "step_000004.jsonl", "notes.txt"]
    for n in names:
        (d / n).write_text("x")
    removed = discard_after(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["step_000003.jsonl.gz", "step_000003.jsonl.gz.tmp", "step_000004.jsonl"]
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt", "step_000001.jsonl.gz", "step_000002.jsonl.gz"]


_KILL_AFTER_FLUSH = """
import sys, time
from pathlib import Path
from cleaner_jax.rl.metrics_writer import MetricsWriter
logdir, marker = Path(sys.argv[1]), Path(sys.argv[2])
w = MetricsWriter(logdir)
for step in (1, 2, 3):
    w.write(step, {"m/a": step / 4})
    w.flush()
marker.touch()
time.sleep(600)
"""


def test_what_was_flushed_is_in_both_files_when_the_writer_is_killed(tmp_path):
    """`flush()` is a barrier: a kill right after it loses no step from TensorBoard either
    (tensorboardX's FileWriter loses the events still queued for its writer thread)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    marker = tmp_path / "flushed"
    kill_when_marked(_KILL_AFTER_FLUSH, [str(tmp_path / "tb"), str(marker)], marker, 120)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("m/a")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    rows = [json.loads(line) for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": s, "m/a": s / 4} for s in (1, 2, 3)]
