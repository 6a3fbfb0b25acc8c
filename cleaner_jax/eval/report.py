"""An evaluation's report, computed from the per-problem records alone (`eval.records`), so
that a resumed evaluation reports exactly what an uninterrupted one does.

`results.json`: one entry per benchmark and SAAR setting, with the authors' metrics
(docs/authors.md §8: mean@n, std@n, bootstrap best@k / worst@k / maj@k), the unbiased pass@k,
a bootstrap confidence interval of mean@n over problems, tool and SAAR metrics
(`saar.metrics.step_metrics`, as in training), the settings and seeds, and wall times.
`results.md`: the same as a table, then the latency table (wall time per problem with and
without SAAR). Wall times are the only numbers that differ between two runs of the same
evaluation; they are kept under `timing`.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cleaner_jax.eval import metrics
from cleaner_jax.eval.pass_at_k import mean_pass_at_k
from cleaner_jax.eval.records import EpisodeCodec
from cleaner_jax.saar.metrics import step_metrics
from cleaner_jax.trajectory import Episode


@dataclasses.dataclass(frozen=True)
class BenchmarkResult:
    """One benchmark under one SAAR setting. Fractions in [0, 1]; `best_at_k[k]` etc. are
    {'mean', 'std'} over bootstrap resamples, averaged over problems."""

    name: str
    saar: bool
    problems: int  # problems with at least one valid sample (the metrics' denominator)
    samples_per_problem: int  # n asked for
    mean_at_n: float  # headline: the authors' acc/mean@n
    std_at_n: float
    ci: dict[str, float]  # {'level', 'low', 'high'}: bootstrap interval of mean_at_n over problems
    pass_at_k: dict[int, float]  # unbiased, k <= the fewest valid samples of a problem
    best_at_k: dict[int, dict[str, float]]
    worst_at_k: dict[int, dict[str, float]]
    maj_at_k: dict[int, dict[str, float]]
    mean_score: float  # the reward, over all valid samples
    invalid: int  # samples lost to infrastructure failures (excluded)
    problems_without_valid_samples: int
    tool: dict[str, float]
    # the policy's own first try of each tool call (SAAR's retries excluded): failed / tried, and
    # failed per valid trajectory (the unit of docs/metrics.md's "Evaluation"); NaN without samples
    first_attempt_error_rate: float
    first_attempt_errors_per_trajectory: float
    settings: dict[str, Any]  # n, temperature, top_p, top_k
    seeds: dict[str, Any]  # the evaluation seed and the bootstrap seed and resamples
    timing: dict[str, float]  # wall_s_per_problem (mean), wall_s_per_problem_median, wall_s_total

    @property
    def label(self) -> str:
        return f"{self.name} (SAAR {'on' if self.saar else 'off'})"


def summarise(name: str, saar: bool, records: Sequence[dict[str, Any]], n: int, settings: dict[str, Any], *,
              eval_seed: int, resamples: int, bootstrap_seed: int, ci_level: float,
              codec: EpisodeCodec) -> BenchmarkResult:
    rows = sorted(records, key=lambda r: r["index"])
    values, votes, correct, scores, episodes, excluded = [], [], [], [], [], []
    invalid = empty = 0
    for r in rows:
        valid = [s for s in r["samples"] if s["valid"]]
        invalid += len(r["samples"]) - len(valid)
        # the invalid samples' episodes count in tool_calls/infra_failures only, as in training
        excluded += [codec.decode(s["episode"]) for s in r["samples"] if not s["valid"] and s["episode"] is not None]
        if not valid:
            empty += 1
            continue
        values.append([float(s["acc"]) for s in valid])
        votes.append([s["vote"] for s in valid])
        correct.append([bool(s["acc"]) for s in valid])
        scores += [float(s["score"]) for s in valid]
        episodes += [codec.decode(s["episode"]) for s in valid]
    if values:
        m = min(len(c) for c in correct)
        boot = metrics.bootstrap_over_problems(values, votes, metrics.bootstrap_ks(n), resamples, bootstrap_seed)
        per_problem = [float(np.mean(v)) for v in values]
        lo, hi = metrics.percentile_ci(per_problem, ci_level, resamples, bootstrap_seed)
        head = {"mean_at_n": metrics.mean_at_n(values), "std_at_n": metrics.std_at_n(values),
                "ci": {"level": ci_level, "low": lo, "high": hi},
                "pass_at_k": {k: mean_pass_at_k(correct, k) for k in _pass_ks(m)},
                "best_at_k": boot["best"], "worst_at_k": boot["worst"], "maj_at_k": boot["maj"]}
    else:
        nan = float("nan")
        head = {"mean_at_n": nan, "std_at_n": nan, "ci": {"level": ci_level, "low": nan, "high": nan},
                "pass_at_k": {}, "best_at_k": {}, "worst_at_k": {}, "maj_at_k": {}}
    walls = [float(r["wall_s"]) for r in rows]
    tried, failed = first_attempts(episodes)
    return BenchmarkResult(
        name=name, saar=saar, problems=len(values), samples_per_problem=n, **head,
        mean_score=float(np.mean(scores)) if scores else float("nan"), invalid=invalid,
        problems_without_valid_samples=empty, tool=step_metrics(episodes, excluded=excluded) if episodes else {},
        first_attempt_error_rate=failed / tried if tried else (0.0 if episodes else float("nan")),
        first_attempt_errors_per_trajectory=failed / len(episodes) if episodes else float("nan"),
        settings=dict(settings), seeds={"eval_seed": eval_seed, "bootstrap_seed": bootstrap_seed,
                                        "bootstrap_resamples": resamples},
        timing={"wall_s_per_problem": float(np.mean(walls)) if walls else float("nan"),
                "wall_s_per_problem_median": float(np.median(walls)) if walls else float("nan"),
                "wall_s_total": float(np.sum(walls))})


def first_attempts(episodes: Sequence[Episode]) -> tuple[int, int]:
    """(tool calls tried, first tries that failed) over `episodes`: the policy's own first try of
    each call, before any SAAR retry: the policy's own calls, whether SAAR is on or off."""
    tried = sum(e.stats.first_attempt_total for e in episodes)
    return tried, tried - sum(e.stats.first_attempt_success for e in episodes)


def _pass_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n (and n itself)."""
    ks = [k for k in (2 ** i for i in range(12)) if k <= n]
    return ks if ks[-1] == n else ks + [n]


def metric_dict(results: Sequence[BenchmarkResult]) -> dict[str, float]:
    """Flat `eval/<benchmark>[/saar_on|saar_off]/<metric>` scalars for the training log; the
    SAAR level appears only when a benchmark was evaluated both ways."""
    both = {r.name for r in results if any(o.name == r.name and o.saar != r.saar for o in results)}
    out: dict[str, float] = {}
    for r in results:
        p = f"eval/{r.name}" + (f"/saar_{'on' if r.saar else 'off'}" if r.name in both else "")
        n = r.samples_per_problem
        out[f"{p}/mean@{n}"] = r.mean_at_n
        out[f"{p}/std@{n}"] = r.std_at_n
        out[f"{p}/mean@{n}/ci_low"] = r.ci["low"]
        out[f"{p}/mean@{n}/ci_high"] = r.ci["high"]
        for k, v in r.pass_at_k.items():
            out[f"{p}/pass@{k}"] = v
        for name, table in (("best", r.best_at_k), ("maj", r.maj_at_k)):
            for k, ms in table.items():
                out[f"{p}/{name}@{k}/mean"] = ms["mean"]
                out[f"{p}/{name}@{k}/std"] = ms["std"]
        out[f"{p}/mean_score"] = r.mean_score
        out[f"{p}/first_attempt_error_rate"] = r.first_attempt_error_rate
        out[f"{p}/first_attempt_errors_per_trajectory"] = r.first_attempt_errors_per_trajectory
        out[f"{p}/wall_s_per_problem"] = r.timing["wall_s_per_problem"]
    return out


def _pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.1f}"


def markdown(results: Sequence[BenchmarkResult], title: str) -> str:
    ks = sorted({k for r in results for k in r.pass_at_k})
    bks = sorted({k for r in results for k in r.maj_at_k})
    head = (["benchmark", "SAAR", "problems", "n", "T", "top-p", "mean@n", "CI", "std@n"]
            + [f"pass@{k}" for k in ks] + [f"best@{k}" for k in bks] + [f"maj@{k}" for k in bks]
            + ["mean score", "tool success", "first-attempt errors / traj", "SAAR recovery", "invalid"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        s = r.settings
        cells = [r.name, "on" if r.saar else "off", str(r.problems), str(r.samples_per_problem), f"{s['temperature']:g}",
                 f"{s['top_p']:g}", _pct(r.mean_at_n), f"[{_pct(r.ci['low'])}, {_pct(r.ci['high'])}]", _pct(r.std_at_n)]
        cells += [_pct(r.pass_at_k[k]) if k in r.pass_at_k else "-" for k in ks]
        cells += [_pct(r.best_at_k[k]["mean"]) if k in r.best_at_k else "-" for k in bks]
        cells += [_pct(r.maj_at_k[k]["mean"]) if k in r.maj_at_k else "-" for k in bks]
        cells += [f"{r.mean_score:+.3f}", f"{r.tool.get('tool_calls/success_rate', float('nan')):.3f}",
                  f"{r.first_attempt_errors_per_trajectory:.3f}",
                  f"{r.tool.get('rollback/global_recovery_rate', float('nan')):.3f}", str(r.invalid)]
        lines.append("| " + " | ".join(cells) + " |")
    level = results[0].ci["level"] if results else 0.95
    seeds = results[0].seeds if results else {}
    intro = (f"In %. mean@n: accuracy over the n samples of a problem, averaged over problems (the authors' headline); "
             f"CI: its {100 * level:g}% percentile-bootstrap interval over problems; std@n: per-problem std, averaged; "
             f"pass@k: unbiased estimator; best@k / maj@k: the authors' bootstrap "
             f"({seeds.get('bootstrap_resamples')} resamples, seed {seeds.get('bootstrap_seed')}); "
             f"first-attempt errors / traj: failed first tries of tool calls per valid sample (SAAR retries excluded); "
             f"evaluation seed {seeds.get('eval_seed')}.")
    lat = ["| benchmark | SAAR | problems run | wall s / problem (median) | wall s / problem (mean) | wall s total |",
           "|---|---|---|---|---|---|"]
    for r in results:
        t = r.timing
        lat.append(f"| {r.name} | {'on' if r.saar else 'off'} | {r.problems + r.problems_without_valid_samples} | "
                   f"{t['wall_s_per_problem_median']:.2f} | {t['wall_s_per_problem']:.2f} | {t['wall_s_total']:.1f} |")
    added = []
    for r in results:
        off = next((o for o in results if o.name == r.name and not o.saar), None)
        if r.saar and off is not None:
            med = r.timing["wall_s_per_problem_median"] - off.timing["wall_s_per_problem_median"]
            mean = r.timing["wall_s_per_problem"] - off.timing["wall_s_per_problem"]
            added.append(f"SAAR adds {med:+.2f} s per problem on {r.name} (median; mean {mean:+.2f}).")
    return (f"# {title}\n\n{intro}\n\n" + "\n".join(lines) + "\n\n## Latency\n\n"
            "Wall time per problem: all n samples, concurrent with other problems up to eval.max_concurrent_problems; "
            "the first problems of a run also pay for compilation, which the median discounts.\n\n"
            + "\n".join(lat) + "\n" + ("\n" + " ".join(added) + "\n" if added else ""))


def write_report(results: Sequence[BenchmarkResult], out_dir: str | Path, title: str) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "results.json"
    js.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    md = out / "results.md"
    md.write_text(markdown(results, title))
    return js, md
