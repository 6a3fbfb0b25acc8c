"""Does the toy warm start learn to copy the tool's output, or to recall each training answer?

The toy's final turn ("The tool printed 84. The answer is \\boxed{84}.") can be produced two ways:
by copying the number from the observation (which works on any problem) or by recalling the
answer of an expression seen in the demonstrations (which fails on the held-out ones). Which one
the NLL fit learns depends on how often it sees each demonstration. This bench runs the run's
own warm start (`toy.warm_start.warm_start`, configs/toy.py) twice at the same number of steps,
with few distinct demonstrations (each seen many times) and with many, and measures on clean
held-out demonstrations (a right call, no habits; problems from the held-out side of
`toy.task.split_of`, never seen in any form):

- P(result): the teacher-forced probability of the whole number after "The tool printed";
- P(operands): the same for "12 * 7" in the call (copied from the question).

Printed: both per variant and the many / few ratio of P(result), measured in the same run.
Findings go to bench/RESULTS.md.

Run: `.venv/bin/python bench/toy_warm_start.py [--steps 800] [--few 256] [--many 2048] [--seed 0]`,
or `--tiny` for a smoke run of a few seconds (numbers meaningless).
"""
from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def spans(tokenizer, ids: list[int]) -> tuple[list[int], list[int]]:
    """Token positions of the result digits after "The tool printed " and of the call's operands."""
    pieces = [tokenizer.decode([t]) for t in ids]
    starts = np.cumsum([0] + [len(p) for p in pieces])
    text = "".join(pieces)

    def positions(m: re.Match | None) -> list[int]:
        return [] if m is None else [i for i in range(len(ids)) if m.start(1) <= starts[i] < m.end(1)]
    return (positions(re.search(r"The tool printed (-?\d+)", text)),
            positions(re.search(r"result = (\d+ [-+*] \d+)", text)))


def sequence_probability(logprobs: np.ndarray, positions: list[list[int]]) -> float:
    """Mean over rows of exp(sum of the row's log-probs at its positions); rows without any skipped."""
    return float(np.mean([np.exp(logprobs[r, p].sum()) for r, p in enumerate(positions) if p]))


def measure(config, workdir: Path, held_problems) -> dict[str, float]:
    """`config`: the validated RunConfig (what train.py passes down)."""
    from cleaner_jax.models import params
    from cleaner_jax.rl.batch import from_trajectories
    from cleaner_jax.rl.learner import Learner
    from cleaner_jax.rl.learner_config import LearnerConfig
    from cleaner_jax.session import Session, make_mesh, prepare_model_dir
    from cleaner_jax.toy import task as toy_task
    from cleaner_jax.toy import warm_cache
    from cleaner_jax.toy.warm_start import teacher_demonstrations, warm_start

    clean = toy_task.TeacherHabits(error_rate=0.0, deep_share=0.0, guess_rate=0.0, give_up_rate=0.0)
    model_dir = prepare_model_dir(config, workdir)
    mesh = make_mesh(config)
    t0 = time.perf_counter()
    with Session(config, model_dir) as s:
        agent = warm_cache.teacher_agent(s.agent)
        out = warm_start(model_dir, workdir / "warm_start_model", config, s.chat, s.executor, agent, mesh)
        seconds = time.perf_counter() - t0
        held = asyncio.run(teacher_demonstrations(s.chat, s.executor, agent, held_problems, clean, seed=1))
    tok = s.chat.tokenizer
    batch = from_trajectories(held, np.ones(len(held), np.float32), pad_id=tok.pad_token_id or 0)
    learner = Learner(params.from_pretrained(out, mesh=mesh), LearnerConfig(logprob_micro_batch_size=8), mesh)
    logprobs = learner.logprobs(batch.input_ids, batch.attention_mask, temperature=1.0)  # [B, T], aligned
    learner.close()
    ids = np.asarray(batch.input_ids)
    result, operands = zip(*(spans(tok, [int(t) for t in row]) for row in ids))
    return {"p_result": sequence_probability(logprobs, list(result)),
            "p_operands": sequence_probability(logprobs, list(operands)), "warm_start_s": seconds}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=800, help="warm-start steps of both variants")
    ap.add_argument("--few", type=int, default=256, help="distinct demonstrations, variant 1")
    ap.add_argument("--many", type=int, default=2048, help="distinct demonstrations, variant 2")
    ap.add_argument("--held", type=int, default=128, help="held-out clean demonstrations measured")
    ap.add_argument("--seed", type=int, default=0, help="train.seed (tiny init, demonstrations, batch order)")
    ap.add_argument("--tiny", action="store_true", help="smoke run: 4 steps, 16/32 demonstrations, 8 held out")
    args = ap.parse_args(argv)
    if args.tiny:
        args.steps, args.few, args.many, args.held = 4, 16, 32, 8
    sys.path.insert(0, str(ROOT))
    from cleaner_jax.config import validate
    from cleaner_jax.study.config import load_run_config
    from cleaner_jax.toy import task as toy_task

    base = load_run_config(ROOT / "configs" / "toy.py")
    held = toy_task.make_problems(args.held, seed=987_654, max_operand=base.data.toy_max_operand,
                                  num_ops=base.data.toy_num_ops, split="heldout", distinct=True)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="toy_warm_start_") as tmp:
        for name, examples in (("few", args.few), ("many", args.many)):
            c = load_run_config(ROOT / "configs" / "toy.py")
            c.train.seed, c.warmup_sft.steps, c.warmup_sft.examples = args.seed, args.steps, examples
            if args.tiny:
                c.warmup_sft.batch_size = 4
            rows[name] = measure(validate(c), Path(tmp) / name, held)
            r = rows[name]
            print(f"{name:>4}: {examples} demonstrations x {args.steps} steps (batch {c.warmup_sft.batch_size}) "
                  f"in {r['warm_start_s']:.0f} s: P(result) {r['p_result']:.3g}  P(operands) {r['p_operands']:.3g}",
                  flush=True)
    print(f"many / few, P(result): {rows['many']['p_result'] / rows['few']['p_result']:.2f}")


if __name__ == "__main__":
    main()
