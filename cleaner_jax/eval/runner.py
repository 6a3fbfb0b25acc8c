"""Benchmark evaluation: n samples per problem through the same agent loop and verifiers as
training, one JSON line per problem (`eval.records`), then the report (`eval.report`).

    results = await run_evaluation(collector, specs, out_dir, plan, codec, resume=True, model=..., title=...)

Trust comes from three properties:
- each problem's episodes are seeded from (evaluation seed, benchmark, problem uid) only, so a
  problem gives the same samples whether it runs first or after a resume, alone or beside
  others (the collector's per-request seeds, `agent.collect.SeededGenerate`); SAAR on and off
  share the seed, so the two are compared on the same draws up to the first tool failure;
- a problem's line is written the moment it finishes; a resumed run skips the problems whose
  line is there, and refuses an output directory written with other settings (`manifest.json`);
- the report is computed from the lines alone.
SAAR at evaluation is the run's `saar` section with `enable` per benchmark setting, the
evaluation's rollback probability, and log-probs left to the learner (nothing trains on
evaluation episodes, so spliced spans are never re-scored).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cleaner_jax.agent.collect import Collector
from cleaner_jax.data import livecodebench
from cleaner_jax.data.problems import Problem
from cleaner_jax.eval.records import EpisodeCodec, append_record, problem_record, read_records
from cleaner_jax.eval.report import BenchmarkResult, summarise, write_report
from cleaner_jax.eval.settings import EvalSettings
from cleaner_jax.rewards.livecodebench import write_lcb_custom_outputs
from cleaner_jax.rewards.result import RewardResult


@dataclasses.dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    problems: Sequence[Problem]
    settings: EvalSettings


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    """Run-wide evaluation settings (the `eval` section less the per-benchmark ones)."""

    seed: int = 0
    bootstrap_resamples: int = 1000
    bootstrap_seed: int = 42
    ci_level: float = 0.95
    max_concurrent_problems: int = 16
    saar_rollback_probability: float = 1.0
    tool_call_budget: int | None = None  # eval.tool_call_budget: acc_within_budget's budget
    think_split: str = "faithful"  # reward.think_split: how the LiveCodeBench export finds the code


def problem_seed(seed: int, benchmark: str, uid: str) -> int:
    """A 63-bit seed that depends on nothing but its arguments (not on order or batching)."""
    digest = hashlib.sha256(f"{seed}|{benchmark}|{uid}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class _AnswerRecorder:
    """The collector's scorer, remembering each response's extracted answer (the verifier's
    `pred`) so that maj@k votes on exactly what was scored."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.answers: dict[tuple[str, str], str | None] = {}

    async def ascore(self, problem: Problem, response: str) -> RewardResult:
        result = await self.inner.ascore(problem, response)
        self.answers[(problem.uid, response)] = result.pred
        return result


def samples_path(out_dir: Path, name: str, saar: bool) -> Path:
    return out_dir / "samples" / f"{name}.saar_{'on' if saar else 'off'}.jsonl"


def lcb_export_path(out_dir: Path, name: str, saar: bool) -> Path:
    return out_dir / f"{name}.saar_{'on' if saar else 'off'}.lcb_custom_outputs.json"


def export_livecodebench(records: Sequence[dict[str, Any]], path: Path, think_split: str) -> Path:
    """The valid samples' responses keyed by `question_id` (the problem uid) in the format
    LiveCodeBench's custom evaluator reads, for the official number (docs/authors.md §8);
    samples lost to infrastructure failures are left out, as in the report."""
    responses = {r["uid"]: [s["response"] for s in r["samples"] if s["valid"]]
                 for r in sorted(records, key=lambda r: r["index"])}
    return write_lcb_custom_outputs(path, responses, think_split=think_split)


def _manifest(specs: Sequence[BenchmarkSpec], plan: EvalPlan, model: str) -> dict[str, Any]:
    return {"model": model, "plan": dataclasses.asdict(plan),
            "benchmarks": {s.name: {"settings": dataclasses.asdict(s.settings),
                                    "uids": [p.uid for p in s.problems]} for s in specs}}


def _check_manifest(out_dir: Path, manifest: dict[str, Any], resume: bool) -> None:
    """Write the manifest; on resume, refuse a directory made with other settings."""
    path = out_dir / "manifest.json"
    if resume and path.exists():
        old = json.loads(path.read_text())
        for key in ("model", "plan", "benchmarks"):
            if old.get(key) != manifest[key]:
                raise ValueError(
                    f"{path}: this directory holds an evaluation with another {key} ({json.dumps(old.get(key))[:300]} "
                    f"vs now {json.dumps(manifest[key])[:300]}); resume it with the same settings, or choose another "
                    "--out (or delete it)")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    for spec in manifest["benchmarks"]:  # a fresh evaluation never mixes in old lines
        for saar in (False, True):
            samples_path(out_dir, spec, saar).unlink(missing_ok=True)
    path.write_text(json.dumps(manifest, indent=2))


def _variant(collector: Collector, saar: bool, plan: EvalPlan, scorer: _AnswerRecorder) -> Collector:
    sc = dataclasses.replace(collector.agent.saar, enable=saar, rollback_probability=plan.saar_rollback_probability,
                             logprob_mode="recompute")
    agent = dataclasses.replace(collector.agent, saar=sc)
    # a server fault during evaluation regenerates the episode like in training (row 1 of docs/reliability.md)
    return Collector(collector.generate_for, collector.executor, collector.chat, agent, scorer,  # type: ignore[arg-type]
                     recover=collector.recover, max_restarts=collector.max_restarts,
                     continue_aborted=collector.continue_aborted)


async def _run_variant(collector: Collector, spec: BenchmarkSpec, saar: bool, out_dir: Path, plan: EvalPlan,
                       codec: EpisodeCodec, progress: bool) -> list[dict[str, Any]]:
    path = samples_path(out_dir, spec.name, saar)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = read_records(path)
    known = {p.uid for p in spec.problems}
    stray = sorted({r["uid"] for r in done} - known)
    if stray:
        raise ValueError(f"{path}: holds problems {stray[:3]} that {spec.name} does not have; delete the file")
    seen = {r["uid"] for r in done}
    todo = [(i, p) for i, p in enumerate(spec.problems) if p.uid not in seen]
    recorder = _AnswerRecorder(collector.scorer)
    variant = _variant(collector, saar, plan, recorder)
    sampling, n = spec.settings.sampling(), spec.settings.n
    gate = asyncio.Semaphore(plan.max_concurrent_problems)
    bar = tqdm(total=len(spec.problems), initial=len(done), desc=f"{spec.name} SAAR {'on' if saar else 'off'}",
               unit="problem", disable=not progress)

    async def one(index: int, problem: Problem) -> None:
        async with gate:
            seed = problem_seed(plan.seed, spec.name, problem.uid)
            t0 = time.perf_counter()
            scored = await variant.collect([problem], n, sampling, seed=seed)
            wall = time.perf_counter() - t0
            answers = [recorder.answers.get((problem.uid, s.response_text)) if s.episode is not None else None
                       for s in scored]
            record = problem_record(spec.name, saar, index, problem, seed, n, sampling, wall, scored, answers, codec)
            append_record(path, record)
            done.append(record)
            bar.update(1)

    try:
        await asyncio.gather(*(one(i, p) for i, p in todo))
    finally:
        bar.close()
    return done


async def run_evaluation(collector: Collector, specs: Sequence[BenchmarkSpec], out_dir: str | Path, plan: EvalPlan,
                         codec: EpisodeCodec, *, resume: bool, model: str, title: str,
                         progress: bool = True) -> list[BenchmarkResult]:
    """Evaluate every benchmark under each of its SAAR settings; writes `samples/*.jsonl`,
    `manifest.json`, `results.json` and `results.md` under `out_dir` (and for LiveCodeBench
    `livecodebench.saar_*.lcb_custom_outputs.json`). `resume=False` starts
    afresh (old lines are deleted); `model` names what is evaluated (checked on resume)."""
    out = Path(out_dir)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"run_evaluation: benchmark names repeat: {names}")
    for s in specs:
        uids = [p.uid for p in s.problems]
        if len(set(uids)) != len(uids):
            raise ValueError(f"run_evaluation: {s.name} has repeated problem uids; a resumable run needs unique ones")
    _check_manifest(out, _manifest(specs, plan, model), resume)
    results = []
    for spec in specs:
        for saar in spec.settings.saar_variants():
            records = await _run_variant(collector, spec, saar, out, plan, codec, progress)
            if spec.name == livecodebench.NAME:
                export_livecodebench(records, lcb_export_path(out, spec.name, saar), plan.think_split)
            results.append(summarise(spec.name, saar, records, spec.settings.n, spec.settings.sampling(),
                                     eval_seed=plan.seed, resamples=plan.bootstrap_resamples,
                                     bootstrap_seed=plan.bootstrap_seed, ci_level=plan.ci_level, codec=codec,
                                     tool_call_budget=plan.tool_call_budget))
    write_report(results, out, title)
    return results
