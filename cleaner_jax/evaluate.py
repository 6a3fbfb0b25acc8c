"""Evaluate a model on benchmarks with the training-time agent loop and verifiers.

    python -m cleaner_jax.evaluate --config configs/toy.py --workdir runs/toy \
        [--model_dir DIR | --checkpoint runs/toy/checkpoints/8] [--out DIR] \
        [--config.data.eval=aime24,aime25] [--config.eval.n=16] [--config.eval.saar=both]

What is evaluated: `--model_dir` (an HF directory); or `--checkpoint DIR/STEP`, an Orbax
training checkpoint whose parameters are restored into the run's model and exported to a
temporary HF directory for the rollout server; else the newest weights the trainer exported
under `<workdir>/sync/`; else `config.model.path`.
Sampling (n, temperature, top-p, top-k) and SAAR come from the `eval` section, per benchmark
with `eval.overrides`. Writes under `--out` (default `<workdir>/eval/final`): one JSON line per
problem in `samples/<benchmark>.saar_{on,off}.jsonl`, `manifest.json` (the settings),
`results.json` and `results.md`, and for LiveCodeBench the generations keyed by `question_id`
for LiveCodeBench's own evaluator (`livecodebench.saar_*.lcb_custom_outputs.json`). Running the
same command again after a kill resumes: problems already written are not run again
(`eval.resume=False` starts afresh).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import tempfile
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from cleaner_jax import distributed
from cleaner_jax.config import ConfigError, RunConfig, check_environment, check_override_keys, validate
from cleaner_jax.data.problems import DataError
from cleaner_jax.eval.records import EpisodeCodec
from cleaner_jax.eval.runner import run_evaluation
from cleaner_jax.models import params
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rollout.weight_sync import ContextBudgetError
from cleaner_jax.session import Session, log_to_file, make_mesh, prepare_model_dir, use_compilation_cache
from cleaner_jax.viz.episode_io import episode_from_dict, episode_to_dict
from cleaner_jax.wiring import eval_benchmarks, eval_plan, eval_specs, learner_config

log = logging.getLogger("cleaner_jax.evaluate")


def pick_model_dir(workdir: Path, model_dir: str | None, config_path: str | None) -> Path:
    if model_dir:
        return Path(model_dir).resolve()
    exports = sorted((workdir / "sync").glob("step_*"))
    if exports:
        return exports[-1]
    if config_path:
        return Path(config_path).resolve()
    raise app.UsageError(f"nothing to evaluate: no --model_dir, no export under {workdir}/sync, no config.model.path")


def parse_checkpoint(path: str) -> tuple[Path, int | None]:
    """`DIR/STEP` -> (DIR, STEP); a directory of steps -> (it, None: the newest)."""
    p = Path(path).resolve()
    if p.name.isdigit():
        return p.parent, int(p.name)
    if not p.is_dir():
        raise app.UsageError(f"--checkpoint {path}: not a directory (give <workdir>/checkpoints/<step>)")
    return p, None


def export_checkpoint(c: RunConfig, workdir: Path, checkpoint: str, out_dir: Path) -> tuple[Path, int]:
    """The parameters of an Orbax training checkpoint as an HF directory; returns it and the step.

    The run's model directory supplies the architecture and tokenizer; a learner of the run's
    config restores into it (the path a resumed training takes), and `params.save_pretrained`
    writes what the rollout server loads. The learner is closed before serving starts."""
    root, step = parse_checkpoint(checkpoint)
    template = prepare_model_dir(c, workdir)
    mesh = make_mesh(c)
    # The export runs no attention (so any attention_impl builds on any device); the parameter tree
    # of the checkpoint depends on scan_layers.
    model = params.from_pretrained(template, mesh=mesh, param_dtype=c.model.param_dtype,
                                 compute_dtype=c.model.compute_dtype, scan_layers=c.model.scan_layers)
    learner = Learner(model, learner_config(c), mesh, checkpoint_dir=root)
    try:
        restored, _ = learner.restore(step)
        out = params.save_pretrained(learner.model(), out_dir, tokenizer_from=template)
    finally:
        learner.close()
    log.info("restored %s step %d and exported it to %s", root, restored, out)
    return out, restored


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if f.model_dir and f.checkpoint:
        raise app.UsageError("give --model_dir or --checkpoint, not both")
    workdir = Path(f.workdir).resolve()
    try:
        c = validate(f.config)  # the one validation: everything below takes the typed RunConfig
        check_environment(c)  # the files, directories and packages it names, before anything is built
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    print(f"evaluating (log: {log_to_file(workdir / 'evaluate.log')})", flush=True)
    try:  # the learner processes join before any device is touched
        distributed.initialize(c.distributed)
        distributed.one_process_only("evaluate")
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    use_compilation_cache(c)  # before anything compiles
    try:
        benchmarks = eval_benchmarks(c)  # a bad benchmark file: one line naming file, row and field
    except DataError as err:
        raise SystemExit(f"error: {err}") from None
    if not benchmarks:
        raise app.UsageError("config.data.eval names no benchmark")
    out = Path(f.out).resolve() if f.out else workdir / "eval" / "final"
    with contextlib.ExitStack() as stack:
        if f.checkpoint:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cleaner_eval_checkpoint_")))
            model_dir, step = export_checkpoint(c, workdir, f.checkpoint, tmp / "model")
            label = f"checkpoint {parse_checkpoint(f.checkpoint)[0]} step {step}"
        else:
            model_dir = pick_model_dir(workdir, f.model_dir, c.model.path)
            label = str(model_dir)
        if c.model.tiny_init:  # a toy run's model is whatever was exported, not a new random one
            c = dataclasses.replace(c, model=dataclasses.replace(c.model, tiny_init=False, path=str(model_dir)))
        session = stack.enter_context(Session(c, model_dir))
        try:
            collector = session.start_rollout(model_dir)
        except ContextBudgetError as err:
            raise SystemExit(f"error: {err}") from None
        results = session.run(run_evaluation(
            collector, eval_specs(c, benchmarks), out, eval_plan(c), EpisodeCodec(episode_to_dict, episode_from_dict),
            resume=c.eval.resume, model=label, title=f"evaluation of {label}"))
    md = out / "results.md"
    print(md.read_text())
    print(f"written: {out / 'results.json'}, {md} and {len(results)} sample file(s) under {out / 'samples'}")


if __name__ == "__main__":  # flags are defined here so that importing this module defines none
    config_flags.DEFINE_config_file("config", None, "ml-collections config file", lock_config=True)
    flags.DEFINE_string("workdir", None, "the training run's directory")
    flags.DEFINE_string("model_dir", None, "HF directory to evaluate (default: newest export in workdir)")
    flags.DEFINE_string("checkpoint", None, "Orbax training checkpoint to evaluate: <workdir>/checkpoints/<step>")
    flags.DEFINE_string("out", None, "where to write results (default: <workdir>/eval/final)")
    flags.mark_flags_as_required(["config", "workdir"])
    try:
        check_override_keys(sys.argv[1:])
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    app.run(main)
