"""The evaluation metrics against hand computations, brute-force enumeration, an independent
re-implementation of the authors' verl procedure (docs/authors.md §8), and scipy; the report from hand-made records; the `eval`
settings and their rejections."""
import dataclasses
import itertools
import json
import random
from collections import defaultdict
from functools import partial

import numpy as np
import pytest
import scipy.stats

from cleaner_jax import wiring
from cleaner_jax.config import ConfigError, base_config, validate
from cleaner_jax.eval import metrics
from cleaner_jax.eval.records import EpisodeCodec, read_records, vote_key
from cleaner_jax.eval.report import markdown, metric_dict, summarise
from cleaner_jax.eval.runner import problem_seed
from cleaner_jax.eval.settings import EvalSettings, parse_overrides
from cleaner_jax.trajectory import Episode, RawTrajectory, Segment, ToolStats

# ----------------------------------------------------------------------------- mean@n, std@n


def test_mean_and_std_at_n_by_hand():
    v = [[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]]
    assert metrics.mean_at_n(v) == pytest.approx((0.75 + 0.0 + 0.5) / 3)
    # population std per problem: sqrt(p (1 - p)) for 0/1 values
    assert metrics.std_at_n(v) == pytest.approx((np.sqrt(0.75 * 0.25) + 0.0 + 0.5) / 3)


def test_metrics_reject_empty_input():
    with pytest.raises(ValueError, match="at least one problem"):
        metrics.mean_at_n([])
    with pytest.raises(ValueError, match="at least one sample"):
        metrics.std_at_n([[1.0], []])


def test_bootstrap_ks_are_verls():
    assert metrics.bootstrap_ks(1) == []
    assert metrics.bootstrap_ks(2) == [2]
    assert metrics.bootstrap_ks(16) == [2, 4, 8, 16]
    assert metrics.bootstrap_ks(32) == [2, 4, 8, 16, 32]
    assert metrics.bootstrap_ks(10) == [2, 4, 8, 10]


# ----------------------------------------------------------------------------- maj@k tie rule


@pytest.mark.parametrize("values,answers,expected", [
    ([0, 1, 1], ["x", "y", "y"], 1.0),            # a clear majority
    ([1, 0, 0, 1], ["a", "b", "b", "a"], 1.0),    # tie 2-2: the answer seen first wins
    ([0, 1, 1, 0], ["b", "a", "a", "b"], 0.0),
    ([1, 0], ["a", "a"], 1.0),                    # the majority answer's first sample gives the value
    ([0, 0, 1], [None, None, "7"], 0.0),          # "no answer" votes like any other answer
    ([1], ["z"], 1.0),
])
def test_majority_value_by_hand(values, answers, expected):
    assert metrics.majority_value(values, answers) == expected


def test_code_votes_pass_or_fail():
    assert vote_key("code", "def f(): ...", True) == "pass" and vote_key("code", None, False) == "fail"
    assert vote_key("math", "42", False) == "42" and vote_key("choice", None, False) is None


# ----------------------------------------------------------------------------- the authors' bootstrap


def verl_bootstrap_metric(data, subset_size, reduce_fns, n_bootstrap=1000, seed=42):
    """The procedure of verl's `bootstrap_metric` (docs/authors.md §8), re-written here as an independent reference."""
    np.random.seed(seed)
    lists = [[] for _ in range(len(reduce_fns))]
    for _ in range(n_bootstrap):
        idxs = np.random.choice(len(data), size=subset_size, replace=True)
        sub = [data[i] for i in idxs]
        for i, fn in enumerate(reduce_fns):
            lists[i].append(fn(sub))
    return [(np.mean(x), np.std(x)) for x in lists]


def verl_calc_maj_val(data, vote_key, val_key):
    vote2vals = defaultdict(list)
    for d in data:
        vote2vals[d[vote_key]].append(d[val_key])
    vote2cnt = {k: len(v) for k, v in vote2vals.items()}
    maj_vote = max(vote2cnt, key=vote2cnt.get)
    return vote2vals[maj_vote][0]


@pytest.mark.parametrize("seed", [42, 7])
def test_bootstrap_equals_the_authors_code(seed):
    rng = random.Random(seed)
    values = [float(rng.random() < 0.4) for _ in range(9)]
    answers = [rng.choice(["1", "2", "3", None]) for _ in range(9)]
    for k in (2, 4, 8, 9):
        ours = metrics.problem_bootstrap(values, answers, k, resamples=1000, seed=seed)
        (best, worst) = verl_bootstrap_metric(values, k, [np.max, np.min], seed=seed)
        vote = [{"val": v, "pred": a} for v, a in zip(values, answers)]
        [maj] = verl_bootstrap_metric(vote, k, [partial(verl_calc_maj_val, vote_key="pred", val_key="val")], seed=seed)
        assert ours["best"] == pytest.approx(best, abs=1e-12)
        assert ours["worst"] == pytest.approx(worst, abs=1e-12)
        assert ours["maj"] == pytest.approx(maj, abs=1e-12)


def _exact_expectations(values, answers, k):
    """E[max], E[min], E[maj value] over all m^k equally likely draws with replacement."""
    best = worst = maj = 0.0
    draws = list(itertools.product(range(len(values)), repeat=k))
    for d in draws:
        sub = [values[i] for i in d]
        best += max(sub)
        worst += min(sub)
        counts, first, order = {}, {}, []
        for i in d:  # tie rule written independently: highest count, then earliest first appearance
            a = answers[i]
            if a not in counts:
                order.append(a)
                first[a] = values[i]
            counts[a] = counts.get(a, 0) + 1
        top = max(counts.values())
        maj += first[next(a for a in order if counts[a] == top)]
    return best / len(draws), worst / len(draws), maj / len(draws)


def test_bootstrap_converges_to_brute_force_enumeration():
    values = [1.0, 0.0, 0.0, 1.0, 0.0]
    answers = ["5", "3", "3", "5", "4"]  # 5 and 3 tie often: the first-appearance rule decides
    for k in (2, 3, 4):
        best, worst, maj = _exact_expectations(values, answers, k)
        got = metrics.problem_bootstrap(values, answers, k, resamples=20000, seed=0)
        for name, exact in (("best", best), ("worst", worst), ("maj", maj)):
            mean, std = got[name]
            assert abs(mean - exact) < 4 * std / np.sqrt(20000) + 1e-9, (k, name, mean, exact)
    # best@k of a problem with a fraction p correct is 1 - (1 - p)^k in expectation
    assert _exact_expectations(values, answers, 3)[0] == pytest.approx(1 - 0.6 ** 3)


def test_bootstrap_over_problems_averages_per_problem_results():
    vals = [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]]
    ans = [["a", "b", "b"], ["c", "c", "d", "d"]]
    out = metrics.bootstrap_over_problems(vals, ans, [2], resamples=500, seed=3)
    per = [metrics.problem_bootstrap(v, a, 2, 500, 3) for v, a in zip(vals, ans)]
    assert out["maj"][2]["mean"] == pytest.approx((per[0]["maj"][0] + per[1]["maj"][0]) / 2)
    assert out["best"][2]["std"] == pytest.approx((per[0]["best"][1] + per[1]["best"][1]) / 2)


# ----------------------------------------------------------------------------- the confidence interval


def numpy_percentile_bootstrap(x, level, resamples, seed):
    rng = np.random.default_rng(seed)
    x = np.asarray(x, float)
    means = np.empty(resamples)
    for b in range(resamples):  # one resample at a time
        means[b] = np.mean(x[rng.integers(0, len(x), size=len(x))])
    return np.percentile(means, [100 * (1 - level) / 2, 100 * (1 + level) / 2])


def test_ci_equals_an_independent_numpy_bootstrap_and_agrees_with_scipy():
    rng = np.random.default_rng(0)
    x = rng.binomial(16, 0.3, size=30) / 16  # 30 problems' mean@16
    lo, hi = metrics.percentile_ci(x, 0.95, resamples=4000, seed=11)
    ref = numpy_percentile_bootstrap(x, 0.95, 4000, 11)
    assert (lo, hi) == pytest.approx(tuple(ref), abs=1e-12)
    sp = scipy.stats.bootstrap((x,), np.mean, confidence_level=0.95, n_resamples=4000, method="percentile",
                               random_state=np.random.default_rng(5)).confidence_interval
    assert abs(lo - sp.low) < 0.015 and abs(hi - sp.high) < 0.015
    assert lo < x.mean() < hi
    # the normal approximation of the mean's interval has about the same width
    half = 1.96 * x.std(ddof=1) / np.sqrt(len(x))
    assert (hi - lo) == pytest.approx(2 * half, rel=0.15)


def test_ci_of_one_problem_is_a_point_and_bad_levels_fail():
    assert metrics.percentile_ci([0.25], 0.9, 100, 0) == (0.25, 0.25)
    with pytest.raises(ValueError, match="level"):
        metrics.percentile_ci([0.1, 0.2], 1.0, 100, 0)


# ----------------------------------------------------------------------------- the report from records


def _episode() -> Episode:
    raw = RawTrajectory((1, 2), (Segment("prompt", (1, 2)), Segment("turn", (3, 4), turn=1)))
    return Episode(raw, raw.flatten(), (), ToolStats(), "answer", True, 1)


CODEC = EpisodeCodec(encode=lambda e: {}, decode=lambda d: _episode())


def _record(index, uid, samples, wall=1.0):
    return {"index": index, "uid": uid, "wall_s": wall,
            "samples": [{"valid": ok, "acc": acc, "score": 1.0 if acc else -1.0, "vote": vote, "episode": {}}
                        for ok, acc, vote in samples]}


RECORDS = [
    _record(0, "p0", [(True, True, "4"), (True, False, "5"), (True, True, "4"), (True, True, "4")]),
    _record(1, "p1", [(True, False, "1"), (True, False, "2"), (False, False, None), (True, False, "1")]),
    _record(2, "p2", [(False, False, None)] * 4),  # every sample lost to infrastructure
    _record(3, "p3", [(True, True, "9"), (True, False, "8"), (True, False, "8"), (True, True, "9")], wall=3.0),
]


def _summary(records):
    return summarise("aime24", False, records, 4, {"temperature": 1.0, "top_p": 0.6, "top_k": -1}, eval_seed=0,
                     resamples=200, bootstrap_seed=42, ci_level=0.9, codec=CODEC)


def test_summary_by_hand():
    r = _summary(RECORDS)
    assert (r.problems, r.problems_without_valid_samples, r.invalid) == (3, 1, 5)
    assert r.mean_at_n == pytest.approx((0.75 + 0.0 + 0.5) / 3)
    assert r.std_at_n == pytest.approx((np.sqrt(0.75 * 0.25) + 0.0 + 0.5) / 3)
    # unbiased pass@k only up to the fewest valid samples (p1 has 3): 1, 2, 3
    assert sorted(r.pass_at_k) == [1, 2, 3]
    assert r.pass_at_k[1] == pytest.approx(r.mean_at_n)
    assert r.pass_at_k[2] == pytest.approx((1.0 + 0.0 + (1 - 1 / 6)) / 3)  # p3: 1 - C(2,2)/C(4,2)
    assert sorted(r.maj_at_k) == [2, 4]
    assert 0.0 <= r.ci["low"] <= r.mean_at_n <= r.ci["high"] <= 1.0 and r.ci["level"] == 0.9
    assert r.mean_score == pytest.approx(np.mean([1, -1, 1, 1, -1, -1, -1, 1, -1, -1, 1]))
    assert r.timing == {"wall_s_per_problem": pytest.approx(1.5), "wall_s_per_problem_median": pytest.approx(1.0),
                        "wall_s_total": pytest.approx(6.0)}
    assert r.seeds == {"eval_seed": 0, "bootstrap_seed": 42, "bootstrap_resamples": 200}


def test_summary_does_not_depend_on_record_order():
    a, b = _summary(RECORDS), _summary(list(reversed(RECORDS)))
    # compared as JSON, where NaN (an undefined share: no sample made a call) equals NaN
    assert json.dumps(dataclasses.asdict(a), sort_keys=True) == json.dumps(dataclasses.asdict(b), sort_keys=True)


def test_metric_names_and_markdown():
    off = _summary(RECORDS)
    on = dataclasses.replace(off, saar=True, timing={"wall_s_per_problem": 2.5, "wall_s_per_problem_median": 2.0,
                                                      "wall_s_total": 10.0})
    names = metric_dict([off])
    assert {"eval/aime24/mean@4", "eval/aime24/std@4", "eval/aime24/mean@4/ci_low", "eval/aime24/pass@1",
            "eval/aime24/best@2/mean", "eval/aime24/maj@4/std", "eval/aime24/mean_score"} <= set(names)
    both = metric_dict([off, on])
    assert "eval/aime24/saar_on/mean@4" in both and "eval/aime24/saar_off/mean@4" in both
    md = markdown([off, on], "evaluation of X")
    assert md.startswith("# evaluation of X\n")
    assert "SAAR adds +1.00 s per problem on aime24 (median; mean +1.00)." in md  # off: walls 1, 1, 1, 3
    assert f"| aime24 | off | 3 | 4 | 1 | 0.6 | {100 * off.mean_at_n:.1f} |" in md


def test_read_records_drops_a_torn_last_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"index": 0}\n{"index": 1}\n{"ind')
    assert read_records(p) == [{"index": 0}, {"index": 1}]
    assert p.read_text() == '{"index": 0}\n{"index": 1}\n'  # truncated, so new lines append cleanly
    p.write_text('{"index": 0}\nnot json\n{"index": 2}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:2: not a JSON record"):
        read_records(p)


def test_problem_seed_depends_only_on_its_arguments():
    assert problem_seed(0, "aime24", "a") == problem_seed(0, "aime24", "a")
    assert len({problem_seed(s, b, u) for s in (0, 1) for b in ("aime24", "aime25") for u in ("a", "b")}) == 8
    assert 0 <= problem_seed(3, "x", "y") < 2 ** 63


# ----------------------------------------------------------------------------- settings and config


def test_overrides_parse_typed():
    got = parse_overrides("aime24:n=32,temperature=0.6; livecodebench:n=10,saar=off", ["aime24", "livecodebench"])
    assert got == {"aime24": {"n": 32, "temperature": 0.6}, "livecodebench": {"n": 10, "saar": "off"}}
    assert isinstance(got["aime24"]["temperature"], float) and parse_overrides("", ["aime24"]) == {}


@pytest.mark.parametrize("text,pattern", [
    ("aime23:n=4", r"unknown benchmark 'aime23'"),
    ("aime24:m=4", r"aime24: unknown key 'm'; overridable: n, temperature, top_p, top_k, saar"),
    ("aime24:n=four", r"aime24: n='four' is not a int"),
    ("aime24:n", r"aime24: 'n' is not key=value"),
    ("aime24", r"'aime24' is not 'BENCHMARK:key=value,...'"),
    ("aime24:n=2;aime24:n=3", r"'aime24' appears twice"),
])
def test_malformed_overrides_are_rejected(text, pattern):
    with pytest.raises(ConfigError, match=r"^config\.eval\.overrides: .*" + pattern):
        parse_overrides(text, ["aime24"])


def _toy():
    c = base_config()
    c.model.tiny_init = True
    c.data.eval = "toy"
    c.data.eval_limit = 4
    c.reward.overlong_buffer = 0
    c.warmup_sft.steps = 0
    c.algo.group_size, c.algo.prompts_per_step, c.algo.mini_batches_per_step, c.algo.micro_batch_size = 2, 2, 1, 4
    return c


@pytest.mark.parametrize("key,value,pattern", [
    ("overrides", "toy:n=0", r"config\.eval\.overrides: toy: EvalSettings\.n: 0 is out of range: must be >= 1"),
    ("overrides", "toy:top_p=1.5", r"config\.eval\.overrides: toy: EvalSettings\.top_p: 1\.5 is out of range"),
    ("overrides", "toy:saar=maybe", r"config\.eval\.overrides: toy: EvalSettings\.saar: 'maybe' is not allowed"),
    ("overrides", "toy:top_k=0", r"config\.eval\.overrides: toy: EvalSettings\.top_k: 0 is not allowed"),
    ("overrides", "gsm9k:n=2", r"config\.eval\.overrides: unknown benchmark 'gsm9k'"),
    ("top_k", 0, r"config\.eval\.top_k: 0 is not allowed: use -1 \(off\) or k >= 1"),
    ("n", 0, r"config\.eval\.n: 0 is out of range: must be >= 1"),
    ("temperature", 0.0, r"config\.eval\.temperature: 0\.0 is out of range: must be > 0\.0"),
    ("saar", "sometimes", r"config\.eval\.saar: 'sometimes' is not allowed: use one of 'off', 'on', 'both'"),
    ("ci_level", 1.0, r"config\.eval\.ci_level: 1\.0 is out of range"),
])
def test_eval_keys_are_checked_naming_the_key(key, value, pattern):
    c = _toy()
    c.eval[key] = value
    with pytest.raises(ConfigError, match=pattern):
        validate(c)


def test_saar_at_evaluation_needs_tools():
    c = _toy()
    c.agent.use_tools, c.saar.enable = False, False
    validate(c)  # SAAR off at evaluation: fine
    c.eval.overrides = "toy:saar=both"
    with pytest.raises(ConfigError, match=r"config\.eval\.saar: SAAR needs tools, .* for toy"):
        validate(c)


def test_wiring_gives_each_benchmark_its_settings():
    c = _toy()
    c.data.eval = "toy,aime24"
    c.eval.n, c.eval.temperature, c.eval.top_p, c.eval.top_k = 8, 0.7, 0.5, 20
    c.rollout.temperature, c.rollout.top_p = 1.0, 1.0  # training's sampling stays apart
    c.eval.overrides = "aime24:n=32,temperature=0.6,saar=both"
    c.train.seed = 5
    specs = {s.name: s.settings for s in wiring.eval_specs(validate(c), {"toy": [], "aime24": []})}
    assert specs["toy"] == EvalSettings(n=8, temperature=0.7, top_p=0.5, top_k=20, saar="off")
    assert specs["aime24"] == EvalSettings(n=32, temperature=0.6, top_p=0.5, top_k=20, saar="both")
    assert specs["aime24"].saar_variants() == (False, True)
    assert wiring.eval_sampling(validate(c)) == {"temperature": 0.7, "top_p": 0.5, "top_k": 20}
    assert wiring.eval_plan(validate(c)).seed == 5  # eval.seed None: train.seed
    c.eval.seed = 9
    assert wiring.eval_plan(validate(c)).seed == 9


def test_paper_configs_evaluate_as_the_authors():
    """docs/authors.md §8, written out by hand."""
    from test_config import load_config

    c4, c7, d4 = load_config("qwen3_4b_cleaner"), load_config("qwen25_7b_cleaner"), load_config("qwen3_4b_dapo")
    assert (c4.eval.n, c7.eval.n) == (16, 32)
    assert (c4.eval.temperature, c4.eval.top_p, c7.eval.temperature, c7.eval.top_p) == (1.0, 0.6, 1.0, 0.6)
    assert (c4.eval.saar, c7.eval.saar, d4.eval.saar) == ("on", "off", "off")
    assert (c4.eval.saar_rollback_probability, c4.saar.max_retries) == (1.0, 3)
    assert parse_overrides(c4.eval.overrides, ["livecodebench"]) == {"livecodebench": {"n": 10, "saar": "off"}}


def test_resume_refuses_a_directory_written_with_other_settings(tmp_path):
    from cleaner_jax.eval.runner import BenchmarkSpec, EvalPlan, _check_manifest, _manifest, samples_path
    from cleaner_jax.toy.task import make_problems

    probs = make_problems(3, seed=1)
    specs = [BenchmarkSpec("toy", probs, EvalSettings(n=2))]
    _check_manifest(tmp_path, _manifest(specs, EvalPlan(), "m"), resume=True)  # a new directory
    line = samples_path(tmp_path, "toy", False)
    line.parent.mkdir(parents=True)
    line.write_text("{}\n")
    _check_manifest(tmp_path, _manifest(specs, EvalPlan(), "m"), resume=True)  # same settings: lines kept
    assert line.exists()
    other = [BenchmarkSpec("toy", probs, EvalSettings(n=4))]
    with pytest.raises(ValueError, match=r"manifest\.json: this directory holds an evaluation with another benchmarks"):
        _check_manifest(tmp_path, _manifest(other, EvalPlan(), "m"), resume=True)
    with pytest.raises(ValueError, match=r"another plan"):
        _check_manifest(tmp_path, _manifest(specs, EvalPlan(seed=1), "m"), resume=True)
    with pytest.raises(ValueError, match=r"another model"):
        _check_manifest(tmp_path, _manifest(specs, EvalPlan(), "other model"), resume=True)
    _check_manifest(tmp_path, _manifest(other, EvalPlan(), "m"), resume=False)  # afresh: old lines go
    assert not line.exists()


# ----------------------------------------------------------------------------- the runner, in process


class _Executor:
    """A tool without a sandbox: code that mentions `bad` fails with a NameError."""

    async def execute(self, code):
        from cleaner_jax.agent.tools import ToolResult

        if "bad" in code:
            return ToolResult("Tool call failure\nreason: \nstderr: NameError: name 'bad' is not defined", "NameError")
        return ToolResult("Tool call success\nstdout: 4\n", None)


class _Scorer:
    async def ascore(self, problem, text):
        from cleaner_jax.rewards.math import strict_box_score

        return strict_box_score(text, problem.ground_truth)


def _runner_env(tmp_path):
    import hashlib

    from cleaner_jax.agent.collect import Collector
    from cleaner_jax.agent.config import AgentConfig
    from cleaner_jax.agent.scripted import ScriptedPolicy, code_call
    from cleaner_jax.chat.template import ChatFormat
    from cleaner_jax.toy.checkpoint import build_tokenizer
    from cleaner_jax.toy.task import make_problems
    from cleaner_jax.viz.episode_io import episode_from_dict, episode_to_dict

    tok = build_tokenizer(str(tmp_path / "tok"), "qwen3")
    problems = make_problems(5, seed=3, max_operand=9, num_ops=1)
    calls = []

    def generate_for(route):
        """Per episode: a failing call, a working one, then an answer that depends on the
        episode's route (right or wrong), so that samples disagree."""
        calls.append(route)
        h = int(hashlib.sha256(route.encode()).hexdigest(), 16)
        answer = problems[h % len(problems)].ground_truth
        return ScriptedPolicy(tok, [code_call("print(bad)", "Try. "), code_call("print(4)", "Again. ")],
                              final=f"So \\boxed{{{answer}}}.")

    collector = Collector(generate_for, _Executor(), ChatFormat(tok), AgentConfig(), _Scorer())
    return collector, problems, calls, EpisodeCodec(episode_to_dict, episode_from_dict)


def _evaluate(collector, problems, out, codec, *, concurrent, resume=True):
    import asyncio

    from cleaner_jax.eval.runner import BenchmarkSpec, EvalPlan, run_evaluation

    specs = [BenchmarkSpec("toy", problems, EvalSettings(n=4, saar="both"))]
    plan = EvalPlan(seed=7, bootstrap_resamples=100, max_concurrent_problems=concurrent)
    return asyncio.run(run_evaluation(collector, specs, out, plan, codec, resume=resume, model="scripted",
                                      title="t", progress=False))


def _lines(path):
    import json

    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        r.pop("wall_s")
    return sorted(rows, key=lambda r: r["index"])


def _untimed(results):
    return [{k: v for k, v in dataclasses.asdict(r).items() if k != "timing"} for r in results]


def test_runner_results_do_not_depend_on_concurrency_and_resume_reruns_only_missing_problems(tmp_path):
    from cleaner_jax.eval.runner import samples_path

    collector, problems, calls, codec = _runner_env(tmp_path)
    one = _evaluate(collector, problems, tmp_path / "one", codec, concurrent=1)
    many = _evaluate(collector, problems, tmp_path / "many", codec, concurrent=5)
    assert _untimed(one) == _untimed(many)
    for saar in (False, True):
        assert _lines(samples_path(tmp_path / "one", "toy", saar)) == _lines(samples_path(tmp_path / "many", "toy", saar))
    off, on = one
    # SAAR on: every episode's failing call is rolled back and recovered; off: the error stays
    assert on.tool["rollback/global_triggered"] == 5 * 4 and on.tool["rollback/global_recovery_rate"] == 1.0
    assert off.tool["rollback/global_triggered"] == 0 and off.tool["errors/per_trajectory_raw"] == 1.0
    rows_on = _lines(samples_path(tmp_path / "one", "toy", True))
    assert all(len(s["saar_events"]) == 1 and s["saar_events"][0]["outcome"] == "recovered"
               for r in rows_on for s in r["samples"])
    # the answers are recorded as the verifier extracted them, and mean@n agrees with them
    accs = [[s["answer"] == p.ground_truth for s in r["samples"]] for r, p in zip(rows_on, problems)]
    assert on.mean_at_n == pytest.approx(np.mean([np.mean(a) for a in accs]))

    # a run that stopped after three problems: the two missing ones run, nothing else
    path = samples_path(tmp_path / "one", "toy", True)
    kept = path.read_text().splitlines()[:3]
    path.write_text("\n".join(kept) + "\n")
    calls.clear()
    again = _evaluate(collector, problems, tmp_path / "one", codec, concurrent=1)
    assert len(calls) == 2 * 4  # two problems x n episodes (SAAR off was complete)
    assert _untimed(again) == _untimed(one)


def test_infra_failures_count_the_invalid_samples_episodes():
    """tool_calls/infra_failures counts the failures of the samples left out as invalid (over the
    valid ones alone it would always be 0): here 5 invalid samples with one infra failure each."""
    def infra_episode() -> Episode:
        raw = RawTrajectory((1, 2), (Segment("prompt", (1, 2)),))
        return Episode(raw, raw.flatten(), (), ToolStats(infra_failures=1), "infra", False, 0)

    codec = EpisodeCodec(encode=lambda e: {}, decode=lambda d: infra_episode() if d else _episode())
    records = [{**r, "samples": [{**s, "episode": {} if s["valid"] else {"infra": 1}} for s in r["samples"]]}
               for r in RECORDS]
    r = summarise("aime24", False, records, 4, {"temperature": 1.0}, eval_seed=0, resamples=50, bootstrap_seed=0,
                  ci_level=0.9, codec=codec)
    assert r.invalid == 5 and r.tool["tool_calls/infra_failures"] == 5.0
    assert _summary(RECORDS).tool["tool_calls/infra_failures"] == 0.0  # the invalid samples' episodes had none


def _costed_episode(turn_tokens: tuple[int, ...], calls: int) -> Episode:
    """An episode whose assistant turns hold `turn_tokens` tokens each (observations between them
    hold 5, which are not generated) and that executed `calls` tool calls."""
    segs = [Segment("prompt", (1, 2))]
    for i, n in enumerate(turn_tokens):
        segs.append(Segment("turn", (7,) * n, turn=i + 1))
        segs.append(Segment("obs", (8,) * 5, turn=i + 1, role="result"))
    raw = RawTrajectory((1, 2), tuple(segs))
    return Episode(raw, raw.flatten(), (), ToolStats(tool_call_total=calls, first_attempt_total=calls), "answer",
                   False, len(turn_tokens))


def test_cost_per_solve_and_accuracy_within_a_tool_call_budget_by_hand():
    """tokens_per_solved / tool_calls_per_solved average the correct samples only (generated turn
    tokens, observations left out); acc_within_budget is mean@n with a correct sample that executed
    more calls than the budget counted wrong; invalid samples are in none of them."""
    episodes = {"a": ((10, 4), 1), "b": ((12, 9, 4), 2), "c": ((6,), 0), "d": ((30, 30, 30), 3)}
    codec = EpisodeCodec(encode=lambda e: {}, decode=lambda d: _costed_episode(*episodes[d["e"]]))
    sample = lambda e, acc, valid=True: {"valid": valid, "acc": acc, "score": 0.0, "vote": "x",  # noqa: E731
                                         "episode": {"e": e}}
    records = [{"index": 0, "uid": "p", "wall_s": 1.0, "samples": [sample("a", True), sample("b", True)]},
               {"index": 1, "uid": "q", "wall_s": 1.0,
                "samples": [sample("c", False), sample("d", True), sample("a", True, valid=False)]}]
    r = summarise("toy", False, records, 2, {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, eval_seed=0,
                  resamples=10, bootstrap_seed=0, ci_level=0.9, codec=codec, tool_call_budget=1)
    # solved: a (14 tokens, 1 call), b (25, 2), d (90, 3)
    assert r.tokens_per_solved == pytest.approx((14 + 25 + 90) / 3)
    assert r.tool_calls_per_solved == pytest.approx((1 + 2 + 3) / 3)
    assert r.mean_at_n == pytest.approx((1.0 + 0.5) / 2)
    # within one call: p keeps a only (1/2), q has none (d made 3 calls): (0.5 + 0) / 2
    assert r.acc_within_budget == pytest.approx(0.25)
    names = metric_dict([r])
    assert names["eval/toy/acc_within_budget"] == pytest.approx(0.25)
    assert names["eval/toy/tokens_per_solved"] == pytest.approx(43.0)
    assert "25.0 (≤1 calls)" in markdown([r], "x")
    wide = summarise("toy", False, records, 2, {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, eval_seed=0,
                     resamples=10, bootstrap_seed=0, ci_level=0.9, codec=codec, tool_call_budget=3)
    assert wide.acc_within_budget == pytest.approx(wide.mean_at_n)  # no solve made more than 3 calls
    plain = summarise("toy", False, records, 2, {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, eval_seed=0,
                      resamples=10, bootstrap_seed=0, ci_level=0.9, codec=codec)
    assert plain.acc_within_budget is None and "eval/toy/acc_within_budget" not in metric_dict([plain])


def _called_episode(outcomes: tuple[bool, ...]) -> Episode:
    """An episode whose tool calls failed (True) or worked (False) in this order."""
    segs = [Segment("prompt", (1,))]
    for i, failed in enumerate(outcomes):
        segs += [Segment("turn", (3,), turn=i + 1), Segment("obs", (4,), turn=i + 1, role="result", tool_failed=failed)]
    segs.append(Segment("turn", (5,), turn=len(outcomes) + 1))
    raw = RawTrajectory((1,), tuple(segs))
    return Episode(raw, raw.flatten(), (), ToolStats(tool_call_total=len(outcomes)), "answer", False, 1)


def test_recovery_shares_by_hand():
    """recovery_after_failed_first_call: of the samples whose first call failed, those with a
    working call later; solved_with_failed_call: of the correct samples, those holding a failure."""
    kinds = {"ok": (False,), "fixed": (True, False), "gave_up": (True,), "twice": (True, True, False),
             "late": (False, True), "none": ()}
    codec = EpisodeCodec(encode=lambda e: {}, decode=lambda d: _called_episode(kinds[d["k"]]))
    sample = lambda k, acc: {"valid": True, "acc": acc, "score": 0.0, "vote": "x", "episode": {"k": k}}  # noqa: E731
    records = [{"index": 0, "uid": "p", "wall_s": 1.0, "samples": [sample("ok", True), sample("fixed", True),
                                                                     sample("gave_up", False)]},
               {"index": 1, "uid": "q", "wall_s": 1.0, "samples": [sample("twice", True), sample("late", True),
                                                                     sample("none", False)]}]
    r = summarise("toy", False, records, 3, {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, eval_seed=0,
                  resamples=10, bootstrap_seed=0, ci_level=0.9, codec=codec)
    # first call failed: fixed, gave_up, twice -> 2 of 3 made a working call later
    assert r.recovery_after_failed_first_call == pytest.approx(2 / 3)
    # correct: ok, fixed, twice, late -> fixed, twice and late hold a failed call
    assert r.solved_with_failed_call == pytest.approx(3 / 4)
    names = metric_dict([r])
    assert names["eval/toy/recovery_after_failed_first_call"] == pytest.approx(2 / 3)
    assert names["eval/toy/solved_with_failed_call"] == pytest.approx(3 / 4)
