"""The toy warm start's NLL fit: one `Learner.update` per step over the whole-sequence
attention with the RL learner's LM-head chunks (`algo.logprob_chunk`: the loop before issue 28 item 2)
against `toy.warm_start.fit` (STEPS_PER_CALL steps per compiled call, the config's
`warmup_sft.attention_block` query blocks and `warmup_sft.logprob_chunk` chunks), measured in the same run
on the run's own demonstrations, init and batch rows (configs/toy.py).

Printed per path: the seconds of the first call (compile included), the steady seconds per
step after it, and the total; then the old / new ratio of both and the largest per-step loss
difference and the largest final weight difference (the two paths make the same updates, so this
is float rounding, which Adam amplifies over hundreds of steps: printed per 100-step window with
each path's mean NLL); and
the process CPU time of each path, a measure a busy box's load moves less than the wall clock.
Findings go to bench/RESULTS.md.

Run: `.venv/bin/python bench/warm_start_speed.py [--steps 200] [--seed 0]`, or `--tiny` for a smoke
run of a few seconds (8 steps on 32 demonstrations; numbers meaningless).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="NLL steps of each path")
    ap.add_argument("--seed", type=int, default=0, help="train.seed (tiny init, demonstrations, batch rows)")
    ap.add_argument("--tiny", action="store_true", help="smoke run: 8 steps, 32 demonstrations, 4 steps per call")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from cleaner_jax.config import validate
    from cleaner_jax.models import params
    from cleaner_jax.rl.batch import from_trajectories
    from cleaner_jax.rl.learner import Learner
    from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
    from cleaner_jax.rl.losses import LossConfig
    from cleaner_jax.session import Session, make_mesh, prepare_model_dir
    from cleaner_jax.study.config import load_run_config
    from cleaner_jax.toy import task as toy_task
    from cleaner_jax.toy import warm_cache
    from cleaner_jax.toy.warm_start import STEPS_PER_CALL, batch_rows, fit, teacher_demonstrations

    c = load_run_config(ROOT / "configs" / "toy.py")
    c.train.seed = args.seed
    per_call = STEPS_PER_CALL
    if args.tiny:
        args.steps, c.warmup_sft.examples, per_call = 8, 32, 4
    c = validate(c)
    cfg = c.warmup_sft
    with tempfile.TemporaryDirectory(prefix="warm_start_speed_") as tmp:
        model_dir = prepare_model_dir(c, Path(tmp))
        mesh = make_mesh(c)
        with Session(c, model_dir) as s:  # the demonstrations exactly as toy.warm_start.warm_start makes them
            problems = toy_task.make_problems(cfg.examples, seed=10_000 + c.train.seed,
                                              max_operand=c.data.toy_max_operand, num_ops=c.data.toy_num_ops,
                                              split="train")
            habits = toy_task.TeacherHabits(error_rate=cfg.error_rate, deep_share=cfg.deep_error_share,
                                            guess_rate=cfg.guess_rate, give_up_rate=cfg.give_up_rate)
            demos = asyncio.run(teacher_demonstrations(s.chat, s.executor, warm_cache.teacher_agent(s.agent),
                                                       problems, habits, c.train.seed))
            pad = s.chat.tokenizer.pad_token_id or 0
        batch = dataclasses.replace(from_trajectories(demos, np.ones(len(demos), np.float32), pad_id=pad),
                                    rollout_logprobs=None)
        rows = batch_rows(len(demos), args.steps, cfg.batch_size, c.train.seed)

        def learner(attention_block: int, logprob_chunk: int) -> Learner:
            return Learner(params.from_pretrained(model_dir, mesh=mesh, attention_block=attention_block), LearnerConfig(
                loss=LossConfig(kind="nll"),
                optimizer=OptimizerConfig(learning_rate=cfg.lr, warmup_steps=0, weight_decay=0.0),
                micro_batch_size=cfg.batch_size, logprob_chunk_size=logprob_chunk), mesh)

        print(f"{len(demos)} demonstrations, width {batch.input_ids.shape[1]}, batch {cfg.batch_size}, "
              f"{args.steps} steps; {per_call} steps per call (new)", flush=True)
        timing, losses = {}, {}
        old = learner(0, c.algo.logprob_chunk)  # the 12-02 fit read the RL learner's chunking
        c0, t0 = time.process_time(), time.perf_counter()
        out = [old.update(batch.rows(rows[0])).metrics["loss"]]
        t1 = time.perf_counter()
        out += [old.update(batch.rows(r)).metrics["loss"] for r in rows[1:]]
        t2 = time.perf_counter()
        cpu = {"old": time.process_time() - c0}
        timing["old"], losses["old"] = (t1 - t0, (t2 - t1) / max(args.steps - 1, 1), t2 - t0), np.asarray(out)
        old_weights = [np.asarray(x) for x in jax.tree.leaves(old.params)]
        old.close()
        new = learner(cfg.attention_block, cfg.logprob_chunk)
        c0, marks = time.process_time(), [time.perf_counter()]
        losses["new"] = fit(new, batch, rows, steps_per_call=per_call, on_steps=lambda _: marks.append(time.perf_counter()))
        cpu["new"] = time.process_time() - c0
        weight_diff = max(float(np.abs(np.asarray(x) - o).max()) for x, o in zip(jax.tree.leaves(new.params), old_weights))
        new.close()
        # the first call's metrics are fetched after the second call was dispatched: its mark is late
        # by at most that dispatch; steady = the calls after the first
        first, total = marks[1] - marks[0], marks[-1] - marks[0]
        timing["new"] = (first, (total - first) / max(args.steps - per_call, 1), total)
    for name, (first, steady, total) in timing.items():
        print(f"{name}: first call {first:.1f} s (compile included), {steady * 1e3:.0f} ms/step after it, "
              f"{total:.1f} s for {args.steps} steps ({args.steps / total:.2f} steps/s; process CPU {cpu[name]:.1f} s), final NLL {losses[name][-1]:.4f}")
    print(f"old / new: {timing['old'][1] / timing['new'][1]:.2f}x per steady step, "
          f"{timing['old'][2] / timing['new'][2]:.2f}x in total, {cpu['old'] / cpu['new']:.2f}x in process CPU "
          "time (what a busy box's load does not change); "
          f"max |loss difference| {np.abs(losses['old'] - losses['new']).max():.2e}, "
          f"max |final weight difference| {weight_diff:.2e}")
    window = 100  # where the curves part: float rounding that Adam's update (g / sqrt(v)) amplifies over many steps
    for i in range(0, args.steps, window):
        o, n = losses["old"][i:i + window], losses["new"][i:i + window]
        print(f"steps {i}-{i + len(o) - 1}: mean NLL old {o.mean():.4f} new {n.mean():.4f}, "
              f"max |difference| {np.abs(o - n).max():.2e}")


if __name__ == "__main__":
    main()
