"""The multi-host learner (issue 16, deliverables 1 and 2) on a laptop: 2 local processes x 2 CPU
devices each, joined by `jax.distributed` on a loopback coordinator with gloo collectives, train
the same tiny model on the same scored episodes as 1 process x 4 devices, and must log the same
per-step losses, gradient norms and step metrics, recompute the same old log-probs, export the
same weights (sharded HF directory) and resume from a checkpoint both processes saved.

Each process of the 2-process run drives its share of every step's groups (`distributed.share`,
whole groups), builds its rows of the batch, and the learner assembles the global batch from the
process-local rows (`rl.batch.place_batch`). The reference is the one-process run of the same
code on the concatenated episodes (the order the share concatenates back to), i.e. the
trainer's single-host path that the rest of the suite checks against hand computations.

This file is also the worker: `python tests/test_multihost.py --process-id ...` runs one process.
Config rejections of the `distributed` section are checked here too.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
GROUPS, GROUP_SIZE, STEPS = 4, 4, 2  # per step; the checkpoint is written after STEPS, then one more step
VOCAB = 512


# ----------------------------------------------------------------------------- the episodes


def step_episodes(step: int) -> list:
    """Step `step`'s scored episodes, the same in every process and run: GROUPS groups of
    GROUP_SIZE, random lengths, observation tokens, SAAR-spliced tokens of both kinds, and
    infrastructure failures concentrated in the first groups (so the processes' shares hold
    different numbers of valid rows, none at all in step 1, and the padding differs from the
    one-process batch)."""
    from cleaner_jax.trajectory import Episode, RawTrajectory, ScoredEpisode, ToolStats, Trajectory

    rng = np.random.default_rng(1000 + step)
    out = []
    for g in range(GROUPS):
        prompt = rng.integers(3, VOCAB, rng.integers(3, 7)).tolist()
        for k in range(GROUP_SIZE):
            n = int(rng.integers(4, 30))
            response = rng.integers(3, VOCAB, n).tolist()
            loss = (rng.random(n) > 0.2).astype(int)  # 0: observation tokens
            kind = np.where((loss > 0) & (rng.random(n) < 0.25), rng.integers(1, 3, n), 0)
            rollout = np.where(loss > 0, -rng.random(n) * 3, 0.0)
            behaviour = np.where(kind > 0, rollout - rng.random(n), rollout)
            traj = Trajectory.build(prompt, response, loss.tolist(), rollout.tolist(), behaviour.tolist(),
                                    (kind > 0).tolist(), (), splice_kind=kind.tolist())
            ep = Episode(RawTrajectory(tuple(prompt), ()), traj, (), ToolStats(), "answer", False, 2)
            # step 1: every episode of process 0's share (groups 0 and 1) failed, its rows are all filler
            invalid = (g == 0 and k < 2) or (g == 1 and k == 0 and step % 2 == 0) or (step == 1 and g < 2)
            score = float(rng.integers(0, 2))
            out.append(ScoredEpisode(f"p{step}-{g}", g, ep, float("nan") if invalid else score, acc=score > 0,
                                     error="1 sandbox infrastructure failure(s)" if invalid else None))
    return out


# ----------------------------------------------------------------------------- the worker


def worker(args: argparse.Namespace) -> None:
    """One process of the 2-process run: CPU devices, join the run, train, write the record."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.local_devices)
    sys.path.insert(0, str(ROOT / "tests"))
    record = train_and_record(args.model, args.out, args.bucket_widths, args.process_id, args.num_processes,
                              args.port)
    (args.out / f"record_{args.process_id}.json").write_text(json.dumps(record))
    jax.distributed.shutdown()


def train_and_record(model_dir: Path, out: Path, widths: str, process_id: int = 0, num_processes: int = 1,
                     port: int = 0) -> dict:
    """STEPS RL steps, a checkpoint, the HF export, one more step; then a fresh learner restores
    the checkpoint and runs that step again. Returns the metrics and old log-probs of this
    process's episodes. With num_processes > 1 it joins the run first (train.main's path)."""
    import time

    import jax

    from _configs import load_config
    from cleaner_jax import distributed
    from cleaner_jax.config import validate

    t0 = time.perf_counter()
    say = lambda what: print(f"[{time.perf_counter() - t0:6.1f} s, cpu {time.process_time():6.1f} s] {what}",  # noqa: E731
                             flush=True)
    c = load_config("toy")
    if num_processes > 1:
        c.distributed.mode = "explicit"
        c.distributed.coordinator_address = f"127.0.0.1:{port}"
        c.distributed.num_processes = num_processes
        c.distributed.process_id = process_id
        c.distributed.initialization_timeout_s = 120
    c.algo.micro_batch_size = 4
    c.mesh.fsdp = -1  # every device of every process
    run = validate(c)  # once, as train.main does
    distributed.initialize(run.distributed)  # before anything touches a device, as train.main does
    say("joined")
    record: dict = {"steps": [], "old_logprobs": []}
    # the small exchanges: process 0's URL to everyone, ragged pieces in process order, the refusal
    record["url"] = distributed.broadcast_text("http://10.0.0.1:30000" if distributed.is_main() else None)
    record["ragged"] = distributed.gather_ragged(np.arange(process_id + 1, dtype=np.float64) / 3 + process_id).tolist()
    record["big"] = distributed.all_sum(np.asarray([2.0**40 + 1 + process_id])).tolist()  # exact: float64 bits
    try:
        distributed.one_process_only("train")
        record["refused"] = None
    except Exception as err:  # noqa: BLE001 - recorded, the test checks which
        record["refused"] = f"{type(err).__name__}: {err}"
    distributed.barrier("after the exchanges")

    from cleaner_jax.models import params
    from cleaner_jax.rl.learner import Learner
    from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
    from cleaner_jax.rl.step import StepConfig, rl_step_outputs
    from cleaner_jax.session import make_mesh

    assert jax.process_count() == num_processes and jax.device_count() == 4
    mesh = make_mesh(run)  # one (fsdp=4, tp=1) mesh over every process's devices
    cfg = LearnerConfig(micro_batch_size=4, logprob_micro_batch_size=4, bucket_widths=widths,
                        optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=0, eps=ADAM_EPS))
    step_cfg = StepConfig(max_response_tokens=32, width_bucket=8)

    def new_learner():
        model = params.from_pretrained(model_dir, mesh=mesh)
        return Learner(model, cfg, mesh, checkpoint_dir=out / "checkpoints")

    def run_step(learner, step):
        mine = distributed.share(GROUPS)
        episodes = step_episodes(step)[mine.start * GROUP_SIZE:mine.stop * GROUP_SIZE]
        out = rl_step_outputs(learner, episodes, step_cfg)
        return out.metrics, [None if o is None else o.tolist() for o in out.old_logprobs]

    learner = new_learner()
    for step in range(STEPS):
        metrics, old = run_step(learner, step)
        record["steps"].append(metrics)
        record["old_logprobs"].append(old)
        say(f"step {step}")
    learner.save(STEPS, {"data_position": 7})
    learner.wait_until_saved()
    params.save_pretrained(learner.model(), out / "export")  # collective: every process calls it
    say("checkpoint saved, weights exported")
    record["after"], _ = run_step(learner, STEPS)
    learner.close()

    resumed = new_learner()  # from the initial weights, then the checkpoint every process restores
    step, extra = resumed.restore()
    record["restored"] = {"step": step, "extra": extra, "update": resumed.step}
    record["resumed_after"], _ = run_step(resumed, STEPS)
    resumed.close()
    say("restored and resumed")
    return record


# ----------------------------------------------------------------------------- the test


def _launch(n: int, local_devices: int, model: Path, out: Path, port: int, widths: str) -> list[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = str(ROOT)
    out.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen(
        [sys.executable, __file__, "--process-id", str(p), "--num-processes", str(n), "--port", str(port),
         "--local-devices", str(local_devices), "--model", str(model), "--out", str(out), "--bucket-widths", widths],
        env=env, stdout=open(out / f"log_{p}.txt", "w"), stderr=subprocess.STDOUT) for p in range(n)]


def _wait(procs: list[subprocess.Popen], out: Path, timeout: float) -> None:
    for p in procs:
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            logs = "\n".join(f"{f}:\n{f.read_text()[-3000:]}" for f in sorted(out.glob("*/log_*.txt")))
            raise AssertionError(f"worker {p.args[3]} ended with {rc}:\n{logs}")


def _weights(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(directory.glob("*.safetensors"))
    assert files, f"no safetensors in {directory}"
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update(load_file(f))
    return out


# Tolerances. Both runs are float32 on CPU over the same (fsdp=4) mesh; what differs is which
# rows share a micro-batch (the global batch is the processes' rows in process order, with
# filler rows after each process's share instead of at the end, and bucketing sorts each
# process's rows on its own), so the loss and gradient sums are added in another order. That
# moves float32 results by a few ulps per reduction (~1e-7 relative); a token-sum over ~300
# tokens and a global-norm over ~100k gradient entries stay within 1e-5 relative. Weights after
# STEPS Adam updates at lr 1e-3: each update is lr * m / (sqrt(v) + eps), which a relative
# gradient change of 1e-5 moves by ~1e-5 * lr; 1e-6 absolute bounds STEPS + 1 of them with room.
# That needs an update that is smooth in the gradient: with Adam's default eps (1e-8) an entry
# whose gradient is near zero (the embedding row of a token seen once) takes a full lr-sized step
# in whatever direction its rounding noise points (seen: 3e-6 apart after 2 steps), so the runs
# use eps=1e-3, where the update is Lipschitz in the gradient with constant lr / eps = 1 and an
# entry's difference stays at its gradient's rounding level.
# Counts (tokens, denominators, groups, invalid episodes) are exact.
RTOL = 1e-5
WEIGHT_ATOL = 1e-6
ADAM_EPS = 1e-3
EXACT = ("learner/num_policy_tokens", "learner/loss_denominator", "adv/num_groups", "adv/num_invalid",
         "learner/skipped", "learner/lr")
# depends on how each process's own rows were bucketed into micro-batches, not on the model
LAYOUT_ONLY = ("learner/padded_token_frac",)


def _compare_metrics(two: dict, one: dict, where: str) -> None:
    assert set(two) == set(one), f"{where}: metric names differ: {set(two) ^ set(one)}"
    for k in sorted(one):
        if k in LAYOUT_ONLY:
            continue
        a, b = two[k], one[k]
        if k in EXACT:
            assert a == b, f"{where} {k}: 2x2 {a} vs 1x4 {b}"
        elif np.isnan(b):
            assert np.isnan(a), f"{where} {k}: 2x2 {a} vs 1x4 NaN"
        else:
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7, err_msg=f"{where} {k}")


# length bucketing (the run config's default, algo.bucket_widths=pow2) in the default suite; the
# padded path (bucketing off: one jitted scan over the whole mini-batch) as a slow variant
# slow: tests/test_multihost_train.py checks the same equality through the whole trainer in the default suite
@pytest.mark.slow
@pytest.mark.parametrize("widths", ["32,64", ""])
def test_two_processes_equal_one_process(tmp_path, widths):
    from cleaner_jax.rollout.fleet import free_loopback_port
    from cleaner_jax.toy.checkpoint import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "model", "qwen3", seed=3, vocab_size=VOCAB, hidden_size=32,
                                 intermediate_size=64, num_hidden_layers=2, max_window_layers=2)
    one_out, two_out = tmp_path / "one", tmp_path / "two"
    procs = []
    try:
        procs = _launch(2, 2, model, two_out, free_loopback_port(), widths)
        # meanwhile the reference here: this process has 4 CPU devices (conftest), one process
        one = json.loads(json.dumps(train_and_record(model, one_out, widths)))
        _wait(procs, tmp_path, timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    two = [json.loads((two_out / f"record_{p}.json").read_text()) for p in range(2)]

    for step in range(STEPS):
        # every process logs the same global numbers, those of the one-process run
        assert two[0]["steps"][step] == two[1]["steps"][step]
        _compare_metrics(two[0]["steps"][step], one["steps"][step], f"step {step}")
        # each process recomputed the old log-probs of its own episodes; in process order they are the run's
        mine = two[0]["old_logprobs"][step] + two[1]["old_logprobs"][step]
        assert len(mine) == len(one["old_logprobs"][step]) == GROUPS * GROUP_SIZE
        for a, b in zip(mine, one["old_logprobs"][step]):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6)
    assert one["steps"][0]["learner/grad_norm"] > 0 and one["steps"][0]["splice/token_frac"] > 0
    assert one["steps"][0]["adv/num_invalid"] == 3.0  # the infra failures above: 2 + 1 in step 0
    assert one["steps"][1]["adv/num_invalid"] == 8.0  # groups 0 and 1 whole
    assert two[0]["old_logprobs"][1] == [None] * (GROUPS // 2 * GROUP_SIZE)

    # the sharded export of the 2-process run holds the 1-process run's weights
    w1, w2 = _weights(one_out / "export"), _weights(two_out / "export")
    assert set(w1) == set(w2)
    start = _weights(model)
    moved = max(float(np.abs(w1[k].astype(np.float64) - start[k]).max()) for k in w1)
    assert moved > 100 * WEIGHT_ATOL, "the steps did not move the weights: the comparison would be empty"
    for k in w1:
        np.testing.assert_allclose(w2[k], w1[k], rtol=0, atol=WEIGHT_ATOL, err_msg=k)

    # both processes restored the checkpoint both saved, and the resumed step is the uninterrupted one
    for rec in (*two, one):
        assert rec["restored"] == {"step": STEPS, "extra": {"data_position": 7}, "update": STEPS}
        _compare_metrics(rec["resumed_after"], rec["after"], "resumed step")
    _compare_metrics(two[0]["after"], one["after"], "step after the checkpoint")

    # the exchanges, against hand values
    for p, rec in enumerate(two):
        assert rec["url"] == "http://10.0.0.1:30000"
        assert rec["ragged"] == [0.0, 1.0, 1.0 + 1 / 3]  # process 0: [0]; process 1: [1, 1 + 1/3]
        assert rec["big"] == [2 * (2.0**40 + 1) + 1]  # 2^41 + 3 needs float64 all the way
        assert rec["refused"].startswith("ConfigError: config.distributed.mode: 2 processes joined, but train's loop")
    assert one["refused"] is None and one["url"] == "http://10.0.0.1:30000" and one["ragged"] == [0.0]


def test_distributed_config_rejections():
    from _configs import load_config

    from cleaner_jax.config import ConfigError, validate

    def check(match, **keys):
        c = load_config("toy")
        for k, v in keys.items():
            setattr(c.distributed, k, v)
        with pytest.raises(ConfigError, match=match):
            validate(c)

    explicit = dict(mode="explicit", coordinator_address="127.0.0.1:8476", num_processes=2)
    check(r"config\.distributed\.process_id: 2 is not below distributed\.num_processes=2", process_id=2, **explicit)
    check(r"config\.distributed\.process_id: explicit mode needs it", **explicit)
    check(r"config\.distributed\.coordinator_address: explicit mode needs it", mode="explicit", num_processes=2,
          process_id=0)
    check(r"config\.distributed\.coordinator_address: '127\.0\.0\.1' is not HOST:PORT",
          **{**explicit, "coordinator_address": "127.0.0.1"}, process_id=0)
    check(r"config\.distributed\.num_processes: 2 is set but distributed\.mode='auto'", mode="auto", num_processes=2)
    check(r"config\.distributed\.process_id: 0 is set but distributed\.mode='off'", process_id=0)
    check(r"config\.distributed\.local_device_ids: '0,x' is not a comma-separated list", mode="auto",
          local_device_ids="0,x")
    check(r"config\.distributed\.local_device_ids: '0,0' must be distinct", mode="auto", local_device_ids="0,0")
    check(r"config\.distributed\.local_device_ids: '0' applies to a multi-process run", local_device_ids="0")
    check(r"config\.distributed\.mode: 'mpi' ", mode="mpi")
    check(r"config\.distributed\.num_processes: 0 ", mode="explicit", num_processes=0)


def test_auto_mode_without_a_cluster_names_the_key():
    """distributed.mode=auto where jax's cluster detection finds nothing: a ConfigError naming the
    key, not jax's bare ValueError (in a fresh process: jax must not have started yet)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_", "XLA_", "SLURM_", "OMPI_", "PMI_", "KUBERNETES_", "TPU_"))}
    env["PYTHONPATH"] = str(ROOT)
    code = ("import jax; jax.config.update('jax_platforms', 'cpu')\n"
            "from cleaner_jax.distributed import DistributedConfig, initialize\n"
            "try:\n    initialize(DistributedConfig(mode='auto', initialization_timeout_s=5))\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "ConfigError config.distributed.mode: 'auto' found no cluster to join" in out.stdout, out.stdout + out.stderr


def test_share_splits_in_order():
    """The shares of processes 0..P-1 concatenate to 0..n-1 and differ in size by at most one."""
    from cleaner_jax.distributed import share

    for n in range(0, 12):
        for count in range(1, 5):
            parts = [list(range(n))[share(n, p, count)] for p in range(count)]
            assert sum(parts, []) == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError, match="process 2 is not in 0..1"):
        share(4, 2, 2)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--local-devices", type=int, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bucket-widths", default="")
    worker(ap.parse_args())
