"""Each arm against the baseline arm, paired by seed: the tests and intervals a reviewer asks of a
study with a handful of seeds (docs/study.md, "Paired tests against the baseline").

Why paired: the runs of one seed share their warm start and their evaluation problems, so the
per-seed difference d = arm - baseline cancels what the seed alone decides; its spread is smaller
than either arm's. Every statistic here is a function of the d of the seeds both arms have (a
pair with a NaN side dropped: a run that never logged the metric):

- the mean and the median of d, the sd of d (ddof=1);
- the bootstrap CI of the mean of d: `aggregate.seed_stats` on d, BCa by default (`PairedSpec`);
- the sign-flip permutation test (two-sided, statistic |mean(d)|): under "no difference" each d is
  as likely to have had the other sign. Exact over all 2^n sign patterns up to `EXACT_MAX_N`
  pairs, a seeded Monte Carlo beyond, p = (1 + #{>=}) / (1 + R). It is the primary test: it
  assumes nothing about the distribution of d, and it tests the mean the CI is about;
- the Wilcoxon signed-rank test (`wilcoxon`), the check on ranks a reviewer expects beside it;
- the minimum detectable effect of a paired t-test at the observed sd of d and n (`mde`): with an
  insignificant result it says which differences these seeds could not have seen;
- Holm's correction of the primary metric's sign-flip p-values over the arms compared (`holm`);
- each arm's collapse count against the baseline's, Fisher's exact test (`collapse_fisher`).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy import optimize, stats

from cleaner_jax.study.aggregate import BootstrapSpec, seed_stats

EXACT_MAX_N = 20  # the sign-flip test enumerates all 2^n patterns up to here (2^20: under a second)
WILCOXON_PERMUTATION_MAX_N = 13  # Wilcoxon with ties or zeros: exact sign flips of the midranks up to here
ALPHA, POWER = 0.05, 0.80  # the MDE's test: two-sided alpha, and the power it must reach
TIE_RTOL = 100 * float(np.finfo(np.float64).eps)  # as scipy.stats.permutation_test: |stat| within this is a tie
_CHUNK = 1 << 16  # sign patterns per block of the exact enumeration (memory: _CHUNK x n floats)


@dataclasses.dataclass(frozen=True)
class PairedSpec:
    """How the paired statistics are formed (the study config's keys, docs/study.md)."""
    bootstrap: BootstrapSpec  # the CI of the mean difference (`paired_ci_method`, default BCa)
    permutation_resamples: int  # Monte Carlo sign patterns beyond EXACT_MAX_N pairs
    seed: int  # of the Monte Carlo sign flips
    alpha: float = ALPHA
    power: float = POWER


@dataclasses.dataclass(frozen=True)
class SignFlip:
    p: float
    exact: bool  # True: all 2^n patterns; False: `resamples` random ones, p = (1 + #{>=}) / (1 + R)
    resamples: int


@dataclasses.dataclass(frozen=True)
class Wilcoxon:
    w_plus: float  # the sum of the ranks of |d| over the positive d (zeros dropped, ties at midranks)
    w_minus: float
    p: float
    method: str  # which null distribution gave p
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Mde:
    effect: float  # the mean difference, in the metric's units, a paired t-test detects with `power`
    dz: float  # the same over the sd of d (Cohen's d_z)
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Paired:
    """One metric of one arm against the baseline."""
    metric: str
    seeds: tuple[int, ...]  # the pairs used (summary.json's `runs` holds both sides' values)
    mean_diff: float
    median_diff: float
    sd_diff: float
    ci_low: float
    ci_high: float
    sign_flip: SignFlip
    wilcoxon: Wilcoxon
    mde: Mde

    @property
    def n(self) -> int:
        return len(self.seeds)

    def to_json(self) -> dict:
        return json_safe({**dataclasses.asdict(self), "n": self.n})


@dataclasses.dataclass(frozen=True)
class Fisher:
    """Collapsed / not collapsed runs of an arm and of the baseline: Fisher's exact test (two-sided)."""
    arm_collapsed: int
    arm_runs: int
    baseline_collapsed: int
    baseline_runs: int
    odds_ratio: float
    p: float

    def to_json(self) -> dict:
        return json_safe(dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class Comparisons:
    """Every arm against the baseline: arm -> metric -> Paired; Holm over the arms for the primary metric."""
    baseline: str
    primary_metric: str
    spec: PairedSpec
    paired: Mapping[str, Mapping[str, Paired]]
    holm_p: Mapping[str, float]  # arm -> Holm-adjusted sign-flip p of the primary metric
    collapse: Mapping[str, Fisher]

    def to_json(self) -> dict:
        s = self.spec
        method = {"sign_flip": f"two-sided, statistic |mean(d)|; exact over 2^n sign patterns for n <= {EXACT_MAX_N}, "
                               f"else {s.permutation_resamples} seeded random ones (seed {s.seed})",
                  "wilcoxon": "scipy.stats.wilcoxon, zero_method='wilcox', exact null distribution without ties or "
                              f"zeros, exact sign flips of the midranks with them up to n = {WILCOXON_PERMUTATION_MAX_N}"
                              ", else the normal approximation",
                  "ci": f"{s.bootstrap.level:.0%} {s.bootstrap.method} bootstrap of mean(d), {s.bootstrap.resamples} "
                        f"resamples, seed {s.bootstrap.seed}",
                  "holm": "Holm over the arms compared with the baseline, of the primary metric's sign-flip p",
                  "mde": f"paired t-test, two-sided alpha {s.alpha}, power {s.power}, at the observed sd of d and n",
                  "collapse": "scipy.stats.fisher_exact on [[arm collapsed, not], [baseline collapsed, not]], "
                              "two-sided, over each arm's runs with a collapse verdict"}
        return {"primary_metric": self.primary_metric, "paired_method": method,
                "paired": {a: {m: p.to_json() for m, p in ms.items()} for a, ms in self.paired.items()},
                "holm_p": json_safe(dict(self.holm_p)),
                "collapse": {a: f.to_json() for a, f in self.collapse.items()}}


def json_safe(x: Any) -> Any:
    """JSON values: NaN as null, infinities as the strings metrics.jsonl uses ("inf", "-inf")."""
    if isinstance(x, Mapping):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return None if math.isnan(x) else ("inf" if x == math.inf else "-inf" if x == -math.inf else x)
    if isinstance(x, np.integer):
        return int(x)
    return x


def pairs(arm: Mapping[int, float], baseline: Mapping[int, float]) -> tuple[tuple[int, ...], np.ndarray]:
    """The seeds both sides have a number for, and d = arm - baseline on them."""
    seeds = tuple(s for s in sorted(set(arm) & set(baseline))
                  if not (math.isnan(arm[s]) or math.isnan(baseline[s])))
    return seeds, np.asarray([arm[s] - baseline[s] for s in seeds], dtype=np.float64)


def _abs_mean(d: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.abs(np.mean(d, axis=axis))


def sign_flip(d: Sequence[float], resamples: int, seed: int) -> SignFlip:
    """Two-sided sign-flip permutation p of mean(d) = 0, statistic |mean(d)|.

    n <= EXACT_MAX_N: all 2^n sign patterns, pattern k flipping d_i where bit i of k is set,
    counted in blocks with NumPy. scipy.stats.permutation_test(permutation_type="samples") is exact
    too when n_resamples >= 2^n, but it builds the patterns with itertools in Python: seconds per
    metric at n = 20, for every metric of every arm; tests/test_study_stats.py checks both agree.
    Beyond: scipy's Monte Carlo with `resamples` seeded random patterns, p = (1 + #{>=}) / (1 + R).
    Statistics within TIE_RTOL of the observed one count as ties (>=), as scipy does."""
    d = np.asarray(d, dtype=np.float64)
    n = len(d)
    if n == 0:
        return SignFlip(math.nan, True, 0)
    if n > EXACT_MAX_N:
        res = stats.permutation_test((d,), _abs_mean, permutation_type="samples", vectorized=True,
                                     n_resamples=resamples, alternative="greater", batch=10_000,
                                     rng=np.random.default_rng(seed))
        return SignFlip(float(res.pvalue), False, resamples)
    observed = abs(float(d.sum())) / n
    bits = np.arange(n, dtype=np.int64)
    count = 0
    for start in range(0, 1 << n, _CHUNK):
        k = np.arange(start, min(start + _CHUNK, 1 << n), dtype=np.int64)
        signs = 1.0 - 2.0 * ((k[:, None] >> bits) & 1)
        count += int(np.count_nonzero(np.abs(signs @ d) / n >= observed - TIE_RTOL * observed))
    return SignFlip(count / (1 << n), True, 1 << n)


def _snap(d: np.ndarray) -> np.ndarray:
    """d rounded to 12 digits of its largest magnitude: metric values are means of finitely many
    outcomes, and differences equal in exact arithmetic (0.3 - 0.2, 0.2 - 0.1) differ in the last
    bits after subtraction; ranks must see them as the ties (or zeros) they are."""
    scale = float(np.max(np.abs(d))) if len(d) else 0.0
    return d if scale == 0.0 else np.round(d / scale, 12) * scale


def wilcoxon(d: Sequence[float]) -> Wilcoxon:
    """The Wilcoxon signed-rank test of d, two-sided (scipy.stats.wilcoxon).

    zero_method="wilcox": a zero difference has no sign, so it is dropped, Wilcoxon's own rule (the
    sign-flip test above keeps zeros; they cannot change its statistic). The null distribution: with
    neither ties nor zeros, the exact one of W+ (`method="exact"`); with them, the exact distribution
    of W+ over all sign flips of the midranks (`PermutationMethod` with 2^n resamples) up to
    WILCOXON_PERMUTATION_MAX_N pairs, the normal approximation with tie and continuity corrections
    beyond (the rule of scipy's "auto", chosen here explicitly so that the summary can say which).
    Every d zero: p = 1 with a note (scipy would divide 0 by 0)."""
    d = _snap(np.asarray(d, dtype=np.float64))
    nonzero = d[d != 0]
    ranks = stats.rankdata(np.abs(nonzero))
    w_plus, w_minus = float(ranks[nonzero > 0].sum()), float(ranks[nonzero < 0].sum())
    if len(d) == 0:
        return Wilcoxon(math.nan, math.nan, math.nan, "none", "no pairs")
    if len(nonzero) == 0:
        return Wilcoxon(0.0, 0.0, 1.0, "none", "every difference is zero: no evidence of a difference, p = 1")
    ties, zeros = len(np.unique(np.abs(nonzero))) < len(nonzero), len(nonzero) < len(d)
    if not (ties or zeros):
        method, name = "exact", "exact"
    elif len(d) <= WILCOXON_PERMUTATION_MAX_N:
        method, name = stats.PermutationMethod(n_resamples=2 ** len(d)), "exact sign flips of the midranks"
    else:
        method, name = "asymptotic", "normal approximation (tie- and continuity-corrected)"
    res = stats.wilcoxon(d, zero_method="wilcox", method=method, alternative="two-sided")
    note = f"{len(d) - len(nonzero)} zero difference(s) dropped" if zeros else ""
    return Wilcoxon(w_plus, w_minus, float(res.pvalue), name, note)


def paired_t_power(dz: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test with n pairs at standardized effect dz: the chance the
    noncentral t (df n - 1, noncentrality dz sqrt(n)) falls beyond +-t_{1-alpha/2}. The lower tail
    is the upper tail at -dz (scipy's nct.cdf underflows to NaN far in it)."""
    df, nc = n - 1, dz * math.sqrt(n)
    crit = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(crit, df, nc) + stats.nct.sf(crit, df, -nc))


def mde(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> Mde:
    """The smallest mean difference a two-sided paired t-test with n pairs detects with `power` when
    the differences' sd is `sd` (the observed one): dz solving paired_t_power(dz) = power, times sd.
    A planning number: an effect below it may be real and unseen with these seeds."""
    if n < 2:
        return Mde(math.nan, math.nan, "needs 2 pairs")
    high = 1.0
    while paired_t_power(high, n, alpha) < power:
        high *= 2.0
    dz = float(optimize.brentq(lambda x: paired_t_power(x, n, alpha) - power, 0.0, high, xtol=1e-12))
    if not sd > 0:
        return Mde(math.nan, dz, "the differences do not vary (sd 0): no t-test")
    return Mde(dz * sd, dz, "")


def paired(metric: str, arm: Mapping[int, float], baseline: Mapping[int, float], spec: PairedSpec) -> Paired:
    """Every paired statistic of one metric (seed -> value on each side)."""
    seeds, d = pairs(arm, baseline)
    boot = seed_stats(d.tolist(), spec.bootstrap)
    return Paired(metric, seeds, boot["mean"], float(np.median(d)) if len(d) else math.nan, boot["std"],
                  boot["ci_low"], boot["ci_high"], sign_flip(d, spec.permutation_resamples, spec.seed),
                  wilcoxon(d), mde(boot["std"], len(d), spec.alpha, spec.power))


def holm(pvalues: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment (family-wise error at alpha over the m tests): the i-th smallest p
    (from 0) times m - i, made non-decreasing along that order, capped at 1. NaN p's (no pairs) are
    left out of m and stay NaN. scipy.stats.false_discovery_control is Benjamini-Hochberg, which
    controls the false discovery rate, a weaker promise than a reviewer's "any of these arms"."""
    order = sorted((k for k, p in pvalues.items() if not math.isnan(p)), key=lambda k: pvalues[k])
    out = {k: math.nan for k in pvalues}
    running = 0.0
    for i, k in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * pvalues[k]))
        out[k] = running
    return out


def collapse_fisher(arm: Sequence[float], baseline: Sequence[float]) -> Fisher:
    """Fisher's exact test (two-sided) of the 2x2 table [[arm collapsed, not], [baseline collapsed,
    not]] over each side's runs with a verdict (`aggregate.collapsed`: 1.0, 0.0, NaN). Collapse is
    a yes/no per run and rare, so counts, not means: the hypergeometric p given the margins."""
    a = [v for v in arm if not math.isnan(v)]
    b = [v for v in baseline if not math.isnan(v)]
    ca, cb = int(sum(a)), int(sum(b))
    if not a or not b:
        return Fisher(ca, len(a), cb, len(b), math.nan, math.nan)
    res = stats.fisher_exact([[ca, len(a) - ca], [cb, len(b) - cb]], alternative="two-sided")
    return Fisher(ca, len(a), cb, len(b), float(res.statistic), float(res.pvalue))


def compare(per_run: Mapping[str, Mapping[int, Mapping[str, float]]], baseline: str, primary_metric: str,
            spec: PairedSpec) -> Comparisons:
    """per_run: arm -> seed -> run_summary (as aggregate.summarize). Every metric any run has, for
    every arm but the baseline; nothing when the baseline has no finished run."""
    metrics = sorted({m for seeds in per_run.values() for s in seeds.values() for m in s})
    base = per_run.get(baseline, {})
    out: dict[str, dict[str, Paired]] = {}
    collapse: dict[str, Fisher] = {}
    for arm in sorted(per_run):
        if arm == baseline or not base:
            continue
        runs = per_run[arm]
        out[arm] = {m: paired(m, {s: v.get(m, math.nan) for s, v in runs.items()},
                              {s: v.get(m, math.nan) for s, v in base.items()}, spec) for m in metrics}
        collapse[arm] = collapse_fisher([v.get("collapsed", math.nan) for v in runs.values()],
                                        [v.get("collapsed", math.nan) for v in base.values()])
    primary = {a: ms[primary_metric].sign_flip.p if primary_metric in ms else math.nan for a, ms in out.items()}
    return Comparisons(baseline, primary_metric, spec, out, holm(primary), collapse)


def _num(x: float, fmt: str = ".3f") -> str:
    return "-" if math.isnan(x) else format(x, fmt)


def _p(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2g}" if x < 0.001 else f"{x:.3f}"


def markdown(c: Comparisons, description: str = "") -> str:
    """summary.md's section: the primary metric's paired table, then the collapse counts with Fisher's p."""
    s = c.spec
    what = f"`{c.primary_metric}`: {description}. " if description else ""
    lines = [f"## Primary metric `{c.primary_metric}`: arm − `{c.baseline}`, paired by seed\n",
             f"{what}d = arm − baseline per seed both have. CI: {s.bootstrap.level:.0%} {s.bootstrap.method} bootstrap "
             f"of mean(d). Sign-flip p: two-sided, exact for n ≤ {EXACT_MAX_N}, else {s.permutation_resamples} "
             f"random flips. Holm: the sign-flip p adjusted over the {len(c.paired)} arm(s). MDE: the mean "
             f"difference a paired t-test detects with {s.power:.0%} power at alpha {s.alpha} (two-sided), "
             "given these seeds' sd of d.\n",
             "| arm | n pairs | mean diff | median diff | CI | sign-flip p | Wilcoxon p | Holm p | MDE |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, ms in c.paired.items():
        r = ms.get(c.primary_metric)
        if r is None:
            lines.append(f"| {arm} | 0 | - | - | - | - | - | - | - |")
            continue
        ci = "-" if math.isnan(r.ci_low) else f"[{r.ci_low:.3f}, {r.ci_high:.3f}]"
        lines.append(f"| {arm} | {r.n} | {_num(r.mean_diff)} | {_num(r.median_diff)} | {ci} | {_p(r.sign_flip.p)} | "
                     f"{_p(r.wilcoxon.p)} | {_p(c.holm_p[arm])} | {_num(r.mde.effect)} |")
    if c.collapse:
        counts = "; ".join(f"{a} {f.arm_collapsed}/{f.arm_runs} (Fisher's exact p = {_p(f.p)})"
                           for a, f in c.collapse.items())
        base = next(iter(c.collapse.values()))
        lines += ["", f"Collapsed runs against `{c.baseline}` {base.baseline_collapsed}/{base.baseline_runs}: "
                      f"{counts}."]
    return "\n".join(lines) + "\n"
