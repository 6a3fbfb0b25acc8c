"""Benchmark evaluation: n samples per problem through the same agent loop and verifiers as
training, summarised as pass@k / avg@n plus tool and SAAR statistics, written as JSON and a
Markdown table."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cleaner_jax.data.problems import Problem
from cleaner_jax.eval.pass_at_k import mean_pass_at_k
from cleaner_jax.experience import Collector, Scored
from cleaner_jax.saar.metrics import step_metrics


@dataclasses.dataclass(frozen=True)
class BenchmarkResult:
    name: str
    problems: int
    samples_per_problem: int
    pass_at_k: dict[int, float]
    mean_score: float
    invalid: int  # episodes lost to infrastructure failures (excluded)
    tool: dict[str, float]


def ks_for(n: int) -> list[int]:
    """1, 2, 4, ... up to n (and n itself)."""
    ks = [k for k in (2 ** i for i in range(12)) if k <= n]
    return ks if ks[-1] == n else ks + [n]


def summarise(name: str, scored: Sequence[Scored], n: int) -> BenchmarkResult:
    groups: dict[int, list[Scored]] = {}
    for s in scored:
        groups.setdefault(s.group, []).append(s)
    correct = [[x.reward.acc for x in g if x.valid] for g in groups.values()]
    correct = [c for c in correct if c]
    m = min((len(c) for c in correct), default=0)
    valid = [s for s in scored if s.valid]
    episodes = [s.episode for s in valid if s.episode is not None]
    return BenchmarkResult(
        name=name,
        problems=len(groups),
        samples_per_problem=n,
        pass_at_k={k: mean_pass_at_k(correct, k) for k in ks_for(m)} if m else {},
        mean_score=float(np.mean([s.reward.score for s in valid])) if valid else float("nan"),
        invalid=len(scored) - len(valid),
        tool=step_metrics(episodes) if episodes else {},
    )


async def evaluate(collector: Collector, benchmarks: dict[str, Sequence[Problem]], n: int,
                   sampling: dict[str, Any], seed: int) -> list[BenchmarkResult]:
    out = []
    for i, (name, problems) in enumerate(benchmarks.items()):
        scored = await collector.collect(problems, n, sampling, seed=seed * 1000 + i)
        out.append(summarise(name, scored, n))
    return out


def write_report(results: Sequence[BenchmarkResult], out_dir: str | Path, title: str) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "results.json"
    js.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    ks = sorted({k for r in results for k in r.pass_at_k})
    head = "| benchmark | problems | n | " + " | ".join(f"pass@{k}" for k in ks) + \
           " | mean score | tool success | SAAR recovery | invalid |"
    rows = [head, "|" + "---|" * (len(ks) + 7)]
    for r in results:
        cells = [f"{100 * r.pass_at_k[k]:.1f}" if k in r.pass_at_k else "-" for k in ks]
        rows.append(f"| {r.name} | {r.problems} | {r.samples_per_problem} | " + " | ".join(cells)
                    + f" | {r.mean_score:+.3f} | {r.tool.get('tool_calls/success_rate', float('nan')):.3f}"
                    f" | {r.tool.get('rollback/global_recovery_rate', float('nan')):.3f} | {r.invalid} |")
    md = out / "results.md"
    md.write_text(f"# {title}\n\npass@k in %, unbiased estimator over n samples per problem.\n\n" + "\n".join(rows) + "\n")
    return js, md
