"""An evaluation's report, computed from the per-problem records alone (`eval.records`), so
that a resumed evaluation reports exactly what an uninterrupted one does.

`results.json`: one entry per benchmark and SAAR setting, with the authors' metrics
(docs/authors.md §8: mean@n, std@n, bootstrap best@k / worst@k / maj@k), the unbiased pass@k,
a bootstrap confidence interval of mean@n over problems, tool and SAAR metrics
(`saar.tool_metrics.step_metrics`, as in training), the settings and seeds, and wall times.
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
from cleaner_jax.saar.tool_metrics import generated_tokens, step_metrics  # one definition of a sample's cost
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
    # what a solve costs (docs/metrics.md, "Evaluation"): generated tokens (every assistant turn of
    # the raw record, SAAR retries included) and executed tool calls, averaged over the correct
    # samples; NaN without a correct one. A recovered error is paid for here, not in mean@n.
    tokens_per_solved: float
    tool_calls_per_solved: float
    # mean@n when a sample may execute at most `tool_call_budget` tool calls (both None: no budget)
    tool_call_budget: int | None
    acc_within_budget: float | None
    # the regime CLEANER's argument is about (docs/toy_world.md, "The recoverable world"): of the
    # samples whose first call failed, the share that made a working call later in the same
    # trajectory; of the correct samples, the share holding a failed call. NaN when undefined.
    recovery_after_failed_first_call: float
    solved_with_failed_call: float
    settings: dict[str, Any]  # n, temperature, top_p, top_k
    seeds: dict[str, Any]  # the evaluation seed and the bootstrap seed and resamples
    timing: dict[str, float]  # wall_s_per_problem (mean), wall_s_per_problem_median, wall_s_total

    @property
    def label(self) -> str:
        return f"{self.name} (SAAR {'on' if self.saar else 'off'})"


def summarise(name: str, saar: bool, records: Sequence[dict[str, Any]], n: int, settings: dict[str, Any], *,
              eval_seed: int, resamples: int, bootstrap_seed: int, ci_level: float,
              codec: EpisodeCodec, tool_call_budget: int | None = None) -> BenchmarkResult:
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
    solved = [e for e, ok in zip(episodes, (c for cs in correct for c in cs)) if ok]
    return BenchmarkResult(
        name=name, saar=saar, problems=len(values), samples_per_problem=n, **head,
        mean_score=float(np.mean(scores)) if scores else float("nan"), invalid=invalid,
        problems_without_valid_samples=empty, tool=step_metrics(episodes, excluded=excluded) if episodes else {},
        first_attempt_error_rate=failed / tried if tried else (0.0 if episodes else float("nan")),
        first_attempt_errors_per_trajectory=failed / len(episodes) if episodes else float("nan"),
        tokens_per_solved=float(np.mean([generated_tokens(e) for e in solved])) if solved else float("nan"),
        tool_calls_per_solved=float(np.mean([e.stats.tool_call_total for e in solved])) if solved else float("nan"),
        tool_call_budget=tool_call_budget,
        acc_within_budget=within_budget(correct, episodes, tool_call_budget),
        **recovery_shares(episodes, [c for cs in correct for c in cs]),
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


def call_outcomes(e: Episode) -> list[bool]:
    """Whether each tool call of `e` failed, in execution order (its observations in the raw
    record; an infrastructure fault is no call outcome)."""
    return [seg.tool_failed for seg in e.raw.segments if seg.kind == "obs" and not seg.infra]


def recovery_shares(episodes: Sequence[Episode], correct: Sequence[bool]) -> dict[str, float]:
    """recovery_after_failed_first_call and solved_with_failed_call over `episodes` (flat, with
    `correct` in the same order)."""
    outcomes = [call_outcomes(e) for e in episodes]
    failed_first = [o for o in outcomes if o and o[0]]
    solved = [o for o, ok in zip(outcomes, correct, strict=True) if ok]
    nan = float("nan")
    return {"recovery_after_failed_first_call":
                float(np.mean([not all(o) for o in failed_first])) if failed_first else nan,
            "solved_with_failed_call": float(np.mean([any(o) for o in solved])) if solved else nan}


def within_budget(correct: Sequence[Sequence[bool]], episodes: Sequence[Episode], budget: int | None) -> float | None:
    """mean@n had each sample been allowed at most `budget` executed tool calls: a sample that
    executed more would have been stopped at its (budget+1)-th call without an answer, so it
    counts as wrong. Computed from the same samples, which is exact: everything a stopped sample
    did before the cut is the same tokens. `correct` is per problem, `episodes` flat in the same
    order. None without a budget, NaN without samples."""
    if budget is None:
        return None
    if not correct:
        return float("nan")
    calls = [e.stats.tool_call_total for e in episodes]
    per_problem, i = [], 0
    for cs in correct:
        per_problem.append(float(np.mean([ok and c <= budget for ok, c in zip(cs, calls[i:i + len(cs)])])))
        i += len(cs)
    if i != len(calls):
        raise ValueError(f"within_budget: {len(calls)} episodes for {i} samples")
    return float(np.mean(per_problem))


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
        out[f"{p}/tokens_per_solved"] = r.tokens_per_solved
        out[f"{p}/tool_calls_per_solved"] = r.tool_calls_per_solved
        out[f"{p}/recovery_after_failed_first_call"] = r.recovery_after_failed_first_call
        out[f"{p}/solved_with_failed_call"] = r.solved_with_failed_call
        if r.acc_within_budget is not None:
            out[f"{p}/acc_within_budget"] = r.acc_within_budget
        out[f"{p}/wall_s_per_problem"] = r.timing["wall_s_per_problem"]
    return out


def _pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.1f}"


def markdown(results: Sequence[BenchmarkResult], title: str) -> str:
    ks = sorted({k for r in results for k in r.pass_at_k})
    bks = sorted({k for r in results for k in r.maj_at_k})
    head = (["benchmark", "SAAR", "problems", "n", "T", "top-p", "mean@n", "CI", "std@n"]
            + [f"pass@{k}" for k in ks] + [f"best@{k}" for k in bks] + [f"maj@{k}" for k in bks]
            + ["mean score", "tool success", "first-attempt errors / traj", "SAAR recovery", "tokens / solved",
               "tool calls / solved"] + (["within budget"] if any(r.tool_call_budget is not None for r in results) else [])
            + ["invalid"])
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
                  f"{r.tool.get('rollback/global_recovery_rate', float('nan')):.3f}", f"{r.tokens_per_solved:.1f}",
                  f"{r.tool_calls_per_solved:.2f}"]
        if any(o.tool_call_budget is not None for o in results):
            cells.append("-" if r.acc_within_budget is None else f"{_pct(r.acc_within_budget)} (≤{r.tool_call_budget} calls)")
        cells.append(str(r.invalid))
        lines.append("| " + " | ".join(cells) + " |")
    level = results[0].ci["level"] if results else 0.95
    seeds = results[0].seeds if results else {}
    intro = (f"In %. mean@n: accuracy over the n samples of a problem, averaged over problems (the authors' headline); "
             f"CI: its {100 * level:g}% percentile-bootstrap interval over problems; std@n: per-problem std, averaged; "
             f"pass@k: unbiased estimator; best@k / maj@k: the authors' bootstrap "
             f"({seeds.get('bootstrap_resamples')} resamples, seed {seeds.get('bootstrap_seed')}); "
             f"first-attempt errors / traj: failed first tries of tool calls per valid sample (SAAR retries excluded); "
             f"tokens / solved and tool calls / solved: generated tokens and executed calls per correct sample; "
             f"within budget: mean@n counting a sample that executed more calls than the budget as wrong; "
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
