"""The compute-matched arm (docs/study.md, "Compute-matched arms"): the step's generation budget
counted by hand, the prompts-per-step arithmetic on a synthetic study (metrics written by hand,
no training), the runner's order and resume, the config's rejections and the summary's budget
table. Nothing here trains: a stand-in replaces each train process."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest
from ml_collections import ConfigDict

from cleaner_jax.agent.collect import rollout_metrics
from cleaner_jax.config import ConfigError
from cleaner_jax.eval import report
from cleaner_jax.saar import tool_metrics
from cleaner_jax.study import aggregate, runner
from cleaner_jax.study.__main__ import summarize
from cleaner_jax.study.config import study_config, validate_study
from cleaner_jax.study.matching import MatchError, matched_prompts, prompts_quantum
from cleaner_jax.trajectory import Episode, RawTrajectory, ScoredEpisode, Segment, ToolStats

# ---------------------------------------------------------------------------- the budget metric


def _episode(segments: list[Segment]) -> Episode:
    raw = RawTrajectory((1, 2, 3), (Segment("prompt", (1, 2, 3)), *segments))
    return Episode(raw, raw.flatten(), (), ToolStats(), "answer", True, 3)


def test_generated_tokens_count_every_turn_of_the_raw_record_and_nothing_else():
    """A failed call (6 tokens), its error feedback (4), SAAR's regeneration (5), its result (3),
    the answer turn (7): 6 + 5 + 7 = 18 generated; the prompt's and observations' tokens are not.
    A second valid episode generates 4, an invalid one (a sandbox fault) 3 before it was cut; a
    lost rollout has no record. The step: 18 + 4 + 3 = 25 tokens over 3 episodes with a record."""
    saar = _episode([
        Segment("turn", (7,) * 6, turn=1, call_start=2),
        Segment("obs", (8,) * 4, turn=1, role="feedback", tool_failed=True, error_label="SyntaxError"),
        Segment("turn", (9,) * 5, turn=1, attempt=1, call_start=1, splice="shallow"),
        Segment("obs", (8,) * 3, turn=1, role="result"),
        Segment("turn", (6,) * 7, turn=2),
    ])
    plain = _episode([Segment("turn", (5,) * 4, turn=1)])
    cut = _episode([Segment("turn", (5,) * 3, turn=1, call_start=0),
                    Segment("obs", (8,) * 2, turn=1, role="result", tool_failed=True, infra=True)])
    assert tool_metrics.generated_tokens(saar) == 18
    assert report.generated_tokens is tool_metrics.generated_tokens  # one definition, the evaluation's too
    scored = [ScoredEpisode("p", 0, saar, 1.0, True), ScoredEpisode("p", 0, plain, 0.0),
              ScoredEpisode("q", 1, cut, math.nan, error="sandbox infra"),
              ScoredEpisode("q", 1, None, math.nan, error="rollout lost")]
    m = rollout_metrics(scored)
    assert m["rollout/generated_tokens"] == 25.0
    assert m["rollout/generated_tokens_per_trajectory"] == pytest.approx(25 / 3)
    assert tool_metrics.generation_metrics([]) == {"rollout/generated_tokens": 0.0,
                                                  "rollout/generated_tokens_per_trajectory": 0.0}

# ---------------------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize("group, minis, micro, quantum", [(8, 1, 16, 2), (16, 4, 8, 2), (3, 2, 4, 8), (8, 1, 4, 1),
                                                          (5, 1, 1, 1)])
def test_prompts_quantum_is_the_step_of_valid_prompts_per_step(group, minis, micro, quantum):
    assert prompts_quantum(group, minis, micro) == quantum
    valid = [p for p in range(1, 4 * quantum + 1) if (group * p) % minis == 0 and (group * p // minis) % micro == 0]
    assert valid == [quantum * k for k in range(1, 5)]  # the config checks' rule, by brute force


@pytest.mark.parametrize("prompts, ratio, quantum, expected", [
    (4, 1.5, 2, 6),    # 6.0 exactly
    (4, 1.25, 2, 6),   # 5.0 = 2.5 quanta: a tie goes up (round-half-even would give 4)
    (4, 1.2, 2, 4),    # 4.8 = 2.4 quanta: down
    (4, 1.9, 2, 8),    # 7.6 = 3.8 quanta: up
    (4, 0.1, 2, 2),    # never below one quantum
    (7, 1.3, 1, 9),    # 9.1
])
def test_matched_prompts_rounding_rule(prompts, ratio, quantum, expected):
    assert matched_prompts(prompts, ratio, quantum) == expected


def test_matched_prompts_rejects_an_undefined_ratio():
    for ratio in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            matched_prompts(4, ratio, 2)

# ---------------------------------------------------------------------------- a synthetic study


def _study(arms: dict[str, dict] | None = None) -> ConfigDict:
    """grpo_raw (the baseline), cleaner and grpo_matched (cleaner's budget) on seeds 0 and 1, plus `arms`."""
    c = study_config()
    c.seeds = "0,1"
    c.bootstrap_resamples = 1000
    c.permutation_resamples = 1000
    c.arms.grpo_raw = ConfigDict({"saar": {"enable": False}})
    c.arms.cleaner = ConfigDict()
    c.arms.grpo_matched = ConfigDict({"match_generation": "cleaner"})
    for name, value in (arms or {}).items():
        c.arms[name] = ConfigDict(value)
    return c


# generated tokens per RL step, by hand: (arm, seed) -> steps 1, 2. configs/toy.py: prompts_per_step 4,
# group_size 8, one mini-batch of micro-batches of 16, so prompts_per_step moves in steps of 2.
BUDGETS = {("grpo_raw", 0): (800, 1200), ("cleaner", 0): (1900, 1900),   # 1000 vs 1900: ratio 1.9, 4 x 1.9 = 7.6 -> 8
           ("grpo_raw", 1): (1000, 1000), ("cleaner", 1): (1250, 1250)}  # ratio 1.25, 4 x 1.25 = 5.0 (tie) -> 6
EXPECTED_PROMPTS = {0: 8, 1: 6}


def metrics_text(budget: tuple[float, ...], resumed_junk: bool = False) -> str:
    """A run's tb/metrics.jsonl: the step-0 evaluation, then per RL step the rollout metrics (and
    an evaluation at the last). `resumed_junk`: step 2 logged once before a resume with another value."""
    rows = [{"step": 0, "eval/toy/mean@2": 0.25}]
    for step, tokens in enumerate(budget, 1):
        if resumed_junk and step == len(budget):
            rows.append({"step": step, "reward/acc": 0.5, "rollout/generated_tokens": 99999.0})
        rows.append({"step": step, "reward/acc": 0.5, "rollout/generated_tokens": float(tokens)})
    rows.append({"step": len(budget), "eval/toy/mean@2": 0.5})
    return "".join(json.dumps(r) + "\n" for r in rows)


def finish(run: Path, budget: tuple[float, ...], **match) -> None:
    """A finished run as the runner leaves it: metrics and DONE."""
    (run / "tb").mkdir(parents=True, exist_ok=True)
    (run / "tb" / "metrics.jsonl").write_text(metrics_text(budget, resumed_junk=True))
    (run / runner.DONE).write_text(json.dumps({"command": [], "seconds": 1.0, **match}))


def prompts_flag(command: tuple[str, ...]) -> list[str]:
    return [a for a in command if a.startswith("--config.algo.prompts_per_step=")]


def test_the_matched_run_gets_the_hand_computed_prompts_per_step_per_seed(tmp_path):
    study = validate_study(_study())
    runs = {(r.arm, r.seed): r for r in runner.plan(study, tmp_path)}
    for (arm, seed), budget in BUDGETS.items():
        finish(runs[(arm, seed)].workdir, budget)
    for seed, prompts in EXPECTED_PROMPTS.items():
        resolved = runner.resolve(study, runs[("grpo_matched", seed)], tmp_path)
        assert prompts_flag(resolved.command) == [f"--config.algo.prompts_per_step={prompts}"]
        # otherwise the baseline's command: same keys and values, its own workdir
        base = runs[("grpo_raw", seed)].command
        assert [a for a in resolved.command if a not in prompts_flag(resolved.command)][:-1] == list(base[:-1])
        assert resolved.command[-1] == str(tmp_path / "runs" / "grpo_matched" / f"seed_{seed}")
        assert resolved.match["prompts_per_step"] == prompts and resolved.match["quantum"] == 2
        assert resolved.key and resolved.key != runs[("grpo_raw", seed)].key  # the value is in the run-cache key
    m0 = runner.resolve(study, runs[("grpo_matched", 0)], tmp_path).match
    assert (m0["reference_tokens_per_step"], m0["baseline_tokens_per_step"]) == (1900.0, 1000.0)
    assert (m0["ratio"], m0["target"]) == (pytest.approx(1.9), pytest.approx(7.6))


def test_a_matched_run_is_not_resolved_before_its_references(tmp_path):
    study = validate_study(_study())
    runs = {(r.arm, r.seed): r for r in runner.plan(study, tmp_path)}
    assert runs[("grpo_matched", 0)].command == () and runs[("grpo_matched", 0)].key == ""
    with pytest.raises(ValueError, match="no command until"):
        runner.execute(runs[("grpo_matched", 0)], runner._Children())
    finish(runs[("grpo_raw", 0)].workdir, BUDGETS[("grpo_raw", 0)])
    with pytest.raises(MatchError, match="'cleaner' seed 0 is not done"):
        runner.resolve(study, runs[("grpo_matched", 0)], tmp_path)
    (runs[("cleaner", 0)].workdir / "tb").mkdir(parents=True)
    (runs[("cleaner", 0)].workdir / "tb" / "metrics.jsonl").write_text('{"step": 1, "reward/acc": 0.5}\n')
    (runs[("cleaner", 0)].workdir / runner.DONE).write_text("{}")
    with pytest.raises(MatchError, match="no positive rollout/generated_tokens"):  # a run from older code
        runner.resolve(study, runs[("grpo_matched", 0)], tmp_path)


def test_the_plan_puts_each_matched_arm_after_its_reference_and_the_baseline_in_its_seed(tmp_path):
    study = validate_study(_study({"aaa_matched": {"match_generation": "cleaner"}}))  # sorts before its references
    order = [(r.arm, r.seed) for r in runner.plan(study, tmp_path)]
    assert order == [(a, s) for s in (0, 1) for a in ("cleaner", "grpo_raw", "aaa_matched", "grpo_matched")]
    for r in runner.plan(study, tmp_path):
        if r.arm.endswith("matched"):
            assert r.needs == ("cleaner", "grpo_raw")
            assert all(order.index((a, r.seed)) < order.index((r.arm, r.seed)) for a in r.needs)


def test_run_study_starts_a_matched_run_after_its_references_end_and_records_the_value(tmp_path, monkeypatch):
    """Two at once: a matched run waits for its reference and baseline of its seed (the reference
    is slow here), runs with the computed value, and its match.json and DONE record it."""
    study = validate_study(_study())
    study = dataclasses.replace(study, settings=dataclasses.replace(study.settings, parallel=2))
    spans: dict[tuple[str, int], tuple[float, float]] = {}
    lock = threading.Lock()

    def fake_execute(run: runner.RunSpec, children) -> runner.Outcome:
        t0 = time.monotonic()
        assert run.command  # resolved
        if run.arm == "cleaner":
            time.sleep(0.3)
        if run.needs:
            budget = BUDGETS[("cleaner", run.seed)]  # it achieved about its reference's budget
        else:
            budget = BUDGETS[(run.arm, run.seed)]
        run.workdir.mkdir(parents=True, exist_ok=True)
        finish(run.workdir, budget, **({"match": run.match} if run.match else {}))
        with lock:
            spans[(run.arm, run.seed)] = (t0, time.monotonic())
        return runner.Outcome(0, 0.0)

    monkeypatch.setattr(runner, "execute", fake_execute)
    assert runner.run_study(study, tmp_path) == []
    for seed, prompts in EXPECTED_PROMPTS.items():
        start = spans[("grpo_matched", seed)][0]
        assert start >= spans[("cleaner", seed)][1] and start >= spans[("grpo_raw", seed)][1]
        done = json.loads((runner.run_dir(tmp_path, "grpo_matched", seed) / runner.DONE).read_text())
        assert done["match"]["prompts_per_step"] == prompts


def test_a_failed_reference_leaves_the_matched_run_not_started(tmp_path, monkeypatch):
    study = validate_study(_study())
    started: list[str] = []

    def fake_execute(run, children):
        started.append(run.arm)
        if run.arm == "cleaner":
            return runner.Outcome(2, 0.0)
        finish(run.workdir, BUDGETS[(run.arm, run.seed)])
        return runner.Outcome(0, 0.0)

    monkeypatch.setattr(runner, "execute", fake_execute)
    failed = runner.run_study(study, tmp_path)
    assert sorted((r.arm, r.seed) for r in failed) == [("cleaner", 0), ("cleaner", 1), ("grpo_matched", 0),
                                                        ("grpo_matched", 1)]
    assert "grpo_matched" not in started


def test_a_started_matched_run_resumes_with_its_recorded_value_and_done_records_it(tmp_path):
    """The real `execute` with a stand-in train command: match.json is written before train
    starts; a second start (the references' metrics changed meanwhile) keeps that value; DONE
    carries the record, also when the run is copied from the run cache."""
    study = validate_study(_study())
    runs = {(r.arm, r.seed): r for r in runner.plan(study, tmp_path)}
    for (arm, seed), budget in BUDGETS.items():
        finish(runs[(arm, seed)].workdir, budget)
    first = runner.resolve(study, runs[("grpo_matched", 0)], tmp_path)
    crash = (sys.executable, "-c", "import sys; sys.exit(3)")
    assert runner.execute(dataclasses.replace(first, command=crash), runner._Children()).rc == 3
    assert json.loads((first.workdir / runner.MATCH).read_text()) == first.match
    finish(runs[("cleaner", 0)].workdir, (4000, 4000))  # would give 16 prompts now
    again = runner.resolve(study, runs[("grpo_matched", 0)], tmp_path)
    assert prompts_flag(again.command) == ["--config.algo.prompts_per_step=8"] and again.key == first.key
    ok = (sys.executable, "-c", "pass")
    assert runner.execute(dataclasses.replace(again, command=ok), runner._Children()).rc == 0
    assert json.loads((first.workdir / runner.DONE).read_text())["match"] == first.match
    # the same run met again (same run config: same key) is copied from the run cache, its DONE with the record
    copy = dataclasses.replace(again, workdir=tmp_path / "elsewhere" / "seed_0")
    out = runner.execute(copy, runner._Children())
    assert out.reused_from == tmp_path / "run_cache" / again.key
    assert json.loads((copy.workdir / runner.DONE).read_text())["match"] == first.match

# ---------------------------------------------------------------------------- the config


@pytest.mark.parametrize("arms, key, message", [
    ({"grpo_matched": {"match_generation": "dapo"}}, "config.arms.grpo_matched.match_generation", "'dapo' is not an arm"),
    ({"grpo_matched": {"match_generation": "twice"}, "twice": {"match_generation": "cleaner"}},
     "config.arms.grpo_matched.match_generation", "'twice' is itself a matched arm"),
    ({"grpo_matched": {"match_generation": "grpo_matched"}}, "config.arms.grpo_matched.match_generation",
     "itself a matched arm"),
    ({"grpo_matched": {"match_generation": "grpo_raw"}}, "config.arms.grpo_matched.match_generation",
     "is the baseline arm"),
    ({"grpo_raw": {"match_generation": "cleaner"}}, "config.arms.grpo_raw.match_generation", "on the baseline arm"),
    ({"grpo_matched": {"match_generation": 3}}, "config.arms.grpo_matched.match_generation", "wrong type"),
    ({"grpo_matched": {"match_generation": "cleaner", "saar": {"gamma": 0.5}}}, "config.arms.grpo_matched.saar.gamma",
     "no run keys of its own"),
])
def test_the_config_rejects_a_match_that_cannot_work_naming_the_key(arms, key, message):
    with pytest.raises(ConfigError, match=f"{key.replace('.', '[.]')}: .*{message}"):
        validate_study(_study(arms))


def test_a_matched_arm_is_the_baseline_s_run_config_and_a_summary_value_can_lead():
    c = _study()
    c.run.train = ConfigDict({"steps": 3})
    c.primary_metric = "generated_tokens_per_step_mean"
    study = validate_study(c)
    arms = {a.name: a for a in study.arms}
    assert arms["grpo_matched"].overrides == arms["grpo_raw"].overrides == {"train.steps": 3, "saar.enable": False}
    assert study.matched() == {"grpo_matched": "cleaner"}

# ---------------------------------------------------------------------------- the summary


def test_the_summary_shows_both_budgets_per_seed(tmp_path):
    study = validate_study(_study())
    runs = {(r.arm, r.seed): r for r in runner.plan(study, tmp_path)}
    for (arm, seed), budget in BUDGETS.items():
        finish(runs[(arm, seed)].workdir, budget)
    achieved = {0: (1850, 1950), 1: (1300, 1200)}  # the matched runs' own budgets: near their references'
    for seed in (0, 1):
        resolved = runner.resolve(study, runs[("grpo_matched", seed)], tmp_path)
        finish(resolved.workdir, achieved[seed], match=resolved.match)
    text = summarize(study, tmp_path)
    rows = aggregate.read_metrics(runs[("cleaner", 0)].workdir / "tb" / "metrics.jsonl")
    assert aggregate.generated_tokens_per_step(rows) == 1900.0  # step 2's resumed row: the last value wins
    table = text[text.index("## Generation budget per seed"):]
    assert "| seed | cleaner | grpo_matched (matches cleaner) | grpo_raw |" in table
    assert "| 0 | 1900.0 | 1900.0 (prompts_per_step=8) | 1000.0 |" in table
    assert "| 1 | 1250.0 | 1250.0 (prompts_per_step=6) | 1000.0 |" in table
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["runs"]["grpo_matched"]["0"]["generated_tokens_per_step_mean"] == 1900.0
    assert summary["arms"]["cleaner"]["generated_tokens_per_step_mean"]["mean"] == pytest.approx(1575.0)
    assert summary["matching"]["grpo_matched"]["1"]["ratio"] == pytest.approx(1.25)
    assert "generated tokens per RL step" in text  # the main table's row too
