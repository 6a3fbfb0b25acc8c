"""Evaluate a checkpoint on benchmarks with the training-time agent loop (SAAR per config).

    python -m cleaner_jax.evaluate --config configs/toy.py --workdir runs/toy \
        [--model_dir DIR] [--config.data.eval=aime24,aime25] [--config.rollout.eval_n=16]

The model is `--model_dir` (an HF directory), else the newest weights the trainer exported
under `<workdir>/sync/`, else `config.model.path`. Writes `<out>/results.json` and
`<out>/results.md` (pass@k, mean score, tool and SAAR statistics); `--out` defaults to
`<workdir>/eval/final`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags
from transformers import AutoTokenizer

from cleaner_jax.agent.tools import SandboxExecutor
from cleaner_jax.chat.template import CODE_INTERPRETER_TOOL, ChatFormat
from cleaner_jax.config import ConfigError, validate
from cleaner_jax.eval.runner import evaluate, write_report
from cleaner_jax.experience import Collector
from cleaner_jax.rewards.scorer import Scorer
from cleaner_jax.runtime import rollout_backend
from cleaner_jax.tools.sandbox import Sandbox
from cleaner_jax.wiring import agent_config, eval_benchmarks, eval_sampling



def pick_model_dir(workdir: Path, model_dir: str | None, config_path: str | None) -> Path:
    if model_dir:
        return Path(model_dir).resolve()
    exports = sorted((workdir / "sync").glob("step_*"))
    if exports:
        return exports[-1]
    if config_path:
        return Path(config_path).resolve()
    raise app.UsageError(f"nothing to evaluate: no --model_dir, no export under {workdir}/sync, no config.model.path")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.basicConfig(level=logging.INFO)
    f = flags.FLAGS
    c = f.config
    workdir = Path(f.workdir).resolve()
    model_dir = pick_model_dir(workdir, f.model_dir, c.model.path)
    if c.model.tiny_init:  # a toy run's model is whatever the trainer exported
        c.model.tiny_init = False
        c.model.path = str(model_dir)
    try:
        validate(c)
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    benchmarks = eval_benchmarks(c)
    if not benchmarks:
        raise app.UsageError("config.data.eval names no benchmark")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools = (CODE_INTERPRETER_TOOL,) if c.agent.use_tools else ()
    chat = ChatFormat(tokenizer, tools=tools, chunk_template=c.agent.chunk_template)
    loop = asyncio.new_event_loop()
    with contextlib.ExitStack() as stack:
        stack.callback(loop.close)
        sandbox = stack.enter_context(Sandbox(workers=c.sandbox.workers, timeout_s=c.sandbox.timeout_s,
                                              memory_mb=c.sandbox.memory_mb))
        scorer = stack.enter_context(Scorer(sandbox, c.reward.math_mode))
        executor = SandboxExecutor(sandbox, observation_mode=c.agent.observation_mode,
                                   max_chars=c.agent.observation_max_chars)
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]  # the model's, not the tokenizer's
        client = stack.enter_context(rollout_backend(c, model_dir, vocab_size))
        stack.callback(lambda: loop.run_until_complete(client.close()))
        collector = Collector(client.session, executor, chat, agent_config(c), scorer)
        results = loop.run_until_complete(evaluate(collector, benchmarks, c.rollout.eval_n, eval_sampling(c), seed=c.train.seed))
    out = Path(f.out).resolve() if f.out else workdir / "eval" / "final"
    js, md = write_report(results, out, f"evaluation of {model_dir}")
    print(md.read_text())
    print(f"written: {js} and {md}")


if __name__ == "__main__":  # flags are defined here so that importing this module defines none
    config_flags.DEFINE_config_file("config", None, "ml-collections config file", lock_config=True)
    flags.DEFINE_string("workdir", None, "the training run's directory")
    flags.DEFINE_string("model_dir", None, "HF directory to evaluate (default: newest export in workdir)")
    flags.DEFINE_string("out", None, "where to write results (default: <workdir>/eval/final)")
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
