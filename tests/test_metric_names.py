"""Metric names are a public contract (docs/metrics.md): TensorBoard shows exactly the names
`metrics.jsonl` holds, and every one of them is documented.

The documented names are read from docs/metrics.md at test time: the first column of every table
whose header starts with `name`, with the placeholders of its placeholder table turned into the
regular expressions given there. The names written are those of a tiny real toy training run
(tests/test_console.py's, with the step-0 evaluation), read back with TensorBoard's own event
reader and with json.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jax.numpy as jnp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_console import console_run

from cleaner_jax.eval.records import EpisodeCodec
from cleaner_jax.eval.report import markdown, metric_dict, summarise
from cleaner_jax.rl.losses import LossConfig, LossInputs, compute_loss, reduce_metrics
from cleaner_jax.rl.staleness import staleness_metrics
from cleaner_jax.saar.tool_metrics import step_metrics
from cleaner_jax.trajectory import Episode, RawTrajectory, Segment, ToolStats, Trajectory

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "metrics.md"


def table_rows(text: str) -> list[list[list[str]]]:
    """Every markdown table of `text` as rows of cells (the header first; the |---| line left out;
    `\\|` inside a cell is a literal pipe)."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip().replace("\x00", "|") for c in line.replace("\\|", "\x00").strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def documented_patterns(text: str) -> dict[str, re.Pattern]:
    """documented name -> the regex it stands for."""
    tables = table_rows(text)
    holders = [t for t in tables if [c.lower() for c in t[0][:3]] == ["placeholder", "stands for", "regex"]]
    assert len(holders) == 1, "docs/metrics.md needs exactly one placeholder table (placeholder | stands for | regex)"
    placeholders = {}
    for row in holders[0][1:]:
        name, regex = row[0].strip("`"), row[2].strip("`")
        assert re.fullmatch(r"<[a-z_]+>", name), f"placeholder {name!r} is not <lower_case>"
        re.compile(regex)
        placeholders[name] = regex
    out = {}
    for table in tables:
        if table[0][0].lower() != "name":
            continue
        for row in table[1:]:
            m = re.fullmatch(r"`([^`]+)`", row[0])
            assert m, f"docs/metrics.md: a name cell that is not one `name`: {row[0]!r}"
            name = m.group(1)
            assert name not in out, f"docs/metrics.md documents {name!r} twice"
            parts = re.split(r"(<[a-z_]+>)", name)
            for p in parts[1::2]:
                assert p in placeholders, f"docs/metrics.md: {name!r} uses {p}, which the placeholder table lacks"
            out[name] = re.compile("".join(placeholders[p] if i % 2 else re.escape(p) for i, p in enumerate(parts)))
    return out


def test_placeholders_match_what_they_stand_for():
    pats = documented_patterns(DOC.read_text(encoding="utf-8"))
    cases = {  # written name -> the documented name it must match (by hand, from eval.report.metric_dict etc.)
        "eval/toy/pass@1": "eval/<bench>/pass@<k>",
        "eval/aime24/saar_on/mean@16/ci_low": "eval/<bench>/mean@<n>/ci_low",
        "eval/gpqa_diamond/maj@4/mean": "eval/<bench>/maj@<k>/mean",
        "tool_calls/failure_reason/NameError": "tool_calls/failure_reason/<label>",
        "tool_calls/failure_reason/": "tool_calls/failure_reason/<label>",
        "splice/deep/log_ratio_p95": "splice/<kind>/log_ratio_p95",
        "async/token_share/lag_0": "async/token_share/lag_<lag>",
        "async/token_share/lag_12": "async/token_share/lag_<lag>",
    }
    for written, doc in cases.items():
        assert pats[doc].fullmatch(written), (written, doc)
    for written in ["eval/toy/pass_1", "eval/toy/pass@", "splice/other/token_frac", "eval/toy/saar_maybe/mean@2",
                    "reward/mean/extra", "tool_calls/failure_reason/a/b", "async/token_share/lag_",
                    "async/token_share/lag_-1"]:
        assert not any(p.fullmatch(written) for p in pats.values()), written


def test_tensorboard_tags_equal_jsonl_keys_and_all_are_documented(tmp_path_factory):
    wd, _, _ = console_run(tmp_path_factory)
    keys: set[str] = set()
    for line in (wd / "tb" / "metrics.jsonl").read_text().splitlines():
        keys |= set(json.loads(line)) - {"step"}
    acc = EventAccumulator(str(wd / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == keys, (sorted(tags - keys), sorted(keys - tags))
    assert {"eval/toy/pass@1", "eval/toy/mean@2", "reward/acc"} <= tags  # written verbatim, `@` included
    # the step-0 evaluation and the step-1 one are both there, under the same names
    assert [e.step for e in acc.Scalars("eval/toy/pass@1")] == [0, 1]
    pats = documented_patterns(DOC.read_text(encoding="utf-8"))
    undocumented = sorted(k for k in keys if not any(p.fullmatch(k) for p in pats.values()))
    assert not undocumented, f"add these to docs/metrics.md (name, meaning, unit): {undocumented}"


def _episode(tried: int, ok: int, retries: int):
    raw = RawTrajectory((1, 2), (Segment("prompt", (1, 2)), Segment("turn", (3, 4), turn=1)))
    stats = ToolStats(tool_call_total=tried + retries, tool_call_success=ok + retries,
                      first_attempt_total=tried, first_attempt_success=ok)
    return Episode(raw, raw.flatten(), (), stats, "answer", True, 1)


def test_eval_first_attempt_metrics_by_hand():
    """eval/<bench>/first_attempt_*: failed first tries over first tries and per valid sample; SAAR's
    retries (tool_call_total beyond the first attempts) do not count, invalid samples neither."""
    codec = EpisodeCodec(encode=lambda e: {}, decode=lambda d: _episode(*d["calls"]))
    sample = lambda calls, valid=True: {"valid": valid, "acc": 0.0, "score": 0.0, "vote": "x",  # noqa: E731
                                        "episode": {"calls": calls}}
    records = [
        {"index": 0, "uid": "a", "wall_s": 1.0, "samples": [sample((2, 1, 3)), sample((0, 0, 0))]},
        {"index": 1, "uid": "b", "wall_s": 1.0, "samples": [sample((3, 0, 0)), sample((5, 0, 0), valid=False)]},
    ]
    r = summarise("toy", True, records, 2, {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, eval_seed=0,
                  resamples=10, bootstrap_seed=0, ci_level=0.9, codec=codec)
    # valid samples: (2 tried, 1 ok), (0, 0), (3 tried, 0 ok): 5 tried, 4 failed, 3 trajectories
    assert r.first_attempt_error_rate == 4 / 5
    assert r.first_attempt_errors_per_trajectory == 4 / 3
    names = metric_dict([r])
    row = markdown([r], "x").split("\n| toy | on |", 1)[1].split("\n")[0]
    # tool success, errors / traj, recovery, tokens / solved and calls / solved (nothing solved), invalid
    assert row.rstrip(" |").split(" | ")[-6:] == ["0.200", "1.333", "0.000", "nan", "nan", "1"]
    assert names["eval/toy/first_attempt_error_rate"] == 4 / 5
    assert names["eval/toy/first_attempt_errors_per_trajectory"] == 4 / 3
    none = summarise("toy", True, [{"index": 0, "uid": "a", "wall_s": 1.0, "samples": [sample((0, 0, 0))]}], 1,
                     {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, eval_seed=0, resamples=10, bootstrap_seed=0,
                     ci_level=0.9, codec=codec)
    assert (none.first_attempt_error_rate, none.first_attempt_errors_per_trajectory) == (0.0, 0.0)


def test_names_a_toy_run_does_not_write_are_documented_too():
    """The names only other settings write: rollout IS and the splice correction (learner/*), a
    failure reason, a benchmark evaluated with SAAR on and off, the asynchronous staleness. Each
    is produced by the code that writes it, then looked up in docs/metrics.md."""
    names: set[str] = set()
    ones = jnp.ones((2, 4))
    for cfg in [LossConfig(tis="token", splice_correction="tis"), LossConfig(tis="sequence", tis_mode="mask",
                                                                          splice_correction="mask")]:
        inputs = LossInputs(-ones, ones, jnp.array([1.0, -1.0]), old_logp=-ones, entropy=ones, rollout_logp=-ones,
                            behaviour_logp=-ones, splice_kind=jnp.array([[0, 1, 2, 0]] * 2))
        out = compute_loss(cfg, inputs)
        names |= {f"learner/{k}" for k in reduce_metrics(out)}
    assert {"learner/tis_weight_mean", "learner/splice_is_ratio_max", "learner/pg_clipfrac_dual"} <= names
    episode = _episode(2, 1, 0)
    episode.stats.failure_reasons["NameError"] = 1
    names |= set(step_metrics([episode]))
    assert "tool_calls/failure_reason/NameError" in names
    records = [{"index": 0, "uid": "a", "wall_s": 1.0,
                "samples": [{"valid": True, "acc": 1.0, "score": 1.0, "vote": "4", "episode": {}}] * 2}]
    codec = EpisodeCodec(encode=lambda e: {}, decode=lambda d: _episode(1, 1, 0))
    results = [summarise("aime24", saar, records, 2, {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, eval_seed=0,
                         resamples=10, bootstrap_seed=0, ci_level=0.9, codec=codec) for saar in (False, True)]
    both = metric_dict(results)
    assert "eval/aime24/saar_on/pass@1" in both
    names |= set(both)
    stale = Trajectory.build([1], [5, 6, 7], [1, 1, 1], [0.0] * 3, [0.0] * 3, [False] * 3, (),
                             policy_version=[3, 1, -1])
    staleness = staleness_metrics([stale], 3)
    assert {"async/staleness_mean", "async/unknown_version_share", "async/token_share/lag_2"} <= set(staleness)
    names |= set(staleness)
    pats = documented_patterns(DOC.read_text(encoding="utf-8"))
    undocumented = sorted(k for k in names if not any(p.fullmatch(k) for p in pats.values()))
    assert not undocumented, f"add these to docs/metrics.md (name, meaning, unit): {undocumented}"
