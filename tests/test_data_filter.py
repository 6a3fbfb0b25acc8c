"""The authors' 7B difficulty filter: bucket counts against a hand computation on a small
synthetic statistics file, the sampled rows against an independent re-implementation of their
script with the global numpy generator they seed, the written file and its provenance, the
command line, the shipped statistics against the authors' published counts, and the 7B configs."""
from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cleaner_jax.config import ConfigError, check_environment, validate
from cleaner_jax.data.filter import (AUTHORS_RATIOS, SHIPPED_STATS, data_category, filter_file, load_stats,
                                     provenance_path, select_rows)
from cleaner_jax.data.problems import load_agentrl
from _configs import load_config

ROOT = Path(__file__).resolve().parents[1]
N = 72  # dataset rows; row i: pass rate (i % 9)/8, code when i is even
NO_STATS = (5, 17)  # rows the statistics file does not cover
ODD_RATE = 7  # 1 success in 6 attempts: a pass rate in no k/8 bucket


def source(i: int) -> str:
    return "train-code-taco-easy" if i % 2 == 0 else ("math_dapo" if i % 4 == 1 else "mega-science")


def stats_rows() -> list[dict]:
    rows = []
    for i in range(N):
        if i in NO_STATS:
            continue
        s, a = (1, 6) if i == ODD_RATE else (i % 9, 8)
        rows.append({"uid": str(i), "data_source": source(i), "successes": s, "attempts": a,
                     "success_rate": s / a, "avg_score": s / a, "keep": 0 < s < a})
    rows.append({"uid": "99", "data_source": "math_dapo", "successes": 4, "attempts": 8, "success_rate": 0.5,
                 "avg_score": 0.5, "keep": True})  # not in the dataset
    return rows


@pytest.fixture()
def files(tmp_path):
    stats = tmp_path / "train.success.jsonl.gz"
    with gzip.open(stats, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in stats_rows())
    data = tmp_path / "Open-AgentRL-30K.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"data_source": source(i), "prompt": json.dumps([{"role": "user", "content": f"problem {i}"}]),
         "reward_model": json.dumps({"ground_truth": str(i)})} for i in range(N)]), data)
    return data, stats


def reference_filter(ratios, retain_code=False) -> list[int]:
    """filter_dataset_by_statistics.filter_dataset re-written from its description, with the
    global np.random.seed / np.random.choice it uses; code rows are the even ones by construction."""
    stats = {int(r["uid"]): r for r in stats_rows()}
    kept = []
    for k in range(9):
        sr = k / 8.0
        members = [i for i in range(N) if i in stats and abs(stats[i]["success_rate"] - sr) <= 0.001]
        code = [i for i in members if i % 2 == 0]
        other = [i for i in members if i % 2 == 1]
        for group, seed, ratio in ((code, 42, 1.0 if retain_code and k > 0 else ratios[k]), (other, 43, ratios[k])):
            n = int(len(group) * ratio)
            if n >= len(group):
                kept += group
            elif n > 0:
                np.random.seed(seed + int(sr * 1000))
                kept += np.random.choice(group, size=n, replace=False).tolist()
    return sorted(kept)


def test_bucket_counts_match_a_hand_computation(files):
    sel = select_rows([str(i) for i in range(N)], load_stats(files[1]))
    # by hand: bucket k holds rows k, k+9, ..., k+63 (4 even = code, 4 odd); rows 5 and 17 have no
    # statistics (buckets 5 and 8 lose an odd row) and row 7 is in no bucket (bucket 7 loses one)
    assert [(b["code"], b["other"]) for b in sel.buckets] == [(4, 4)] * 5 + [(4, 3), (4, 4), (4, 3), (4, 3)]
    # ratios 0, .8, .9, 1 x5, 0: int(4 * .8) = int(4 * .9) = 3
    assert [(b["kept_code"], b["kept_other"]) for b in sel.buckets] == [
        (0, 0), (3, 3), (3, 3), (4, 4), (4, 4), (4, 3), (4, 4), (4, 3), (0, 0)]
    assert len(sel.kept) == 50 and len(sel.matched) == N - 2
    assert [b["seed_code"] for b in sel.buckets] == [42, 167, 292, 417, 542, 667, 792, 917, 1042]
    assert [b["seed_other"] for b in sel.buckets] == [43, 168, 293, 418, 543, 668, 793, 918, 1043]


@pytest.mark.parametrize("ratios, retain_code", [
    (AUTHORS_RATIOS, False),
    ((0.5,) * 9, False),
    ((0.3, 0.6, 0.75, 0.25, 0.5, 0.9, 0.1, 0.7, 0.55), False),
    (AUTHORS_RATIOS, True),
])
def test_sampled_rows_match_the_reference(files, ratios, retain_code):
    sel = select_rows([str(i) for i in range(N)], load_stats(files[1]), ratios, retain_code)
    assert sel.kept == reference_filter(ratios, retain_code)


def test_retain_code_keeps_code_outside_bucket_zero(files):
    sel = select_rows([str(i) for i in range(N)], load_stats(files[1]), AUTHORS_RATIOS, retain_code=True)
    code = [i for i in sel.kept if i % 2 == 0]
    assert code == sorted(i for i in range(N) if i % 2 == 0 and i % 9 != 0)  # bucket 8's code rows too


def test_filter_file_writes_rows_in_order_with_provenance(files, tmp_path):
    data, stats = files
    out = tmp_path / "out" / "x.filtered_sr.parquet"
    record = filter_file(data, out, stats_path=stats)
    kept = reference_filter(AUTHORS_RATIOS)
    table = pq.read_table(out)
    assert table.column("uid").to_pylist() == [str(i) for i in kept]
    assert table.column("reward_model").to_pylist() == [json.dumps({"ground_truth": str(i)}) for i in kept]
    assert table.column("success_rate").to_pylist() == [(i % 9) / 8 for i in kept]
    assert table.column("data_source_stat").to_pylist() == [source(i) for i in kept]
    assert {"successes", "attempts", "avg_score", "keep"} <= set(table.column_names)
    side = json.loads(provenance_path(out).read_text())
    assert side == record
    assert side["input"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert side["stats"]["sha256"] == hashlib.sha256(stats.read_bytes()).hexdigest()
    assert side["output"]["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert (side["input"]["rows"], side["output"]["rows"], side["output"]["code_rows"]) == (N, 50, 26)
    assert side["ratios"] == list(AUTHORS_RATIOS) and side["retain_code"] is False
    # the training reader keeps the original uids (the stats' join key)
    assert [p.uid for p in load_agentrl(out)] == [str(i) for i in kept]


def test_command_line(files, tmp_path):
    data, stats = files
    res = subprocess.run([sys.executable, "-m", "cleaner_jax.data.filter", "--input", str(data), "--stats", str(stats)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    out = data.with_name("Open-AgentRL-30K.filtered_sr.parquet")  # the documented default name
    assert pq.read_table(out).column("uid").to_pylist() == [str(i) for i in reference_filter(AUTHORS_RATIOS)]
    assert "kept 50 of 72 rows (26 code)" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "cleaner_jax.data.filter", "--input", str(data), "--ratios", "1,1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "9 comma-separated" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "cleaner_jax.data.filter", "--input", str(tmp_path / "no.parquet")],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert missing.returncode == 2 and "no.parquet" in missing.stderr


def test_shipped_statistics_give_the_authors_counts():
    """docs/authors.md §7.3: the pass-rate histogram, and about 15,353 rows (2,134 code) kept."""
    stats = load_stats(SHIPPED_STATS)
    sel = select_rows([str(i) for i in range(30128)], stats)
    assert [b["rows"] for b in sel.buckets] == [8886, 2249, 1856, 1864, 1914, 2163, 2575, 3370, 5251]
    assert len(sel.kept) == 15353 and sum(b["kept_code"] for b in sel.buckets) == 2134


def test_category_table_is_the_authors():
    assert data_category("train-code-leetcode-Medium") == "code"
    assert data_category("LiveCodeBench_v6") == "code"
    assert data_category("numinamath1.5_olympiads") == "math"
    assert data_category("mega-science") == "science"
    assert data_category("still3") == "other"
    assert data_category("a") == "code"  # their substring rule: "a" is inside "apps"
    assert data_category("unknown") == "other"


@pytest.mark.parametrize("name", ["qwen25_7b_cleaner", "qwen25_7b_dapo", "qwen25_7b_notool"])
def test_7b_configs_train_on_the_filtered_file(name, tmp_path, monkeypatch):
    c = load_config(name)
    assert c.data.train == "Open-AgentRL-30K.filtered_sr.parquet"
    c.model.path = str(tmp_path)
    monkeypatch.chdir(tmp_path)
    run = validate(c)  # the config is right; the file is made on the machine that runs it
    with pytest.raises(ConfigError, match=r"config\.data\.train: .*python -m cleaner_jax\.data\.filter --input"):
        check_environment(run)
    (tmp_path / "Open-AgentRL-30K.filtered_sr.parquet").touch()
    check_environment(run)
    assert load_config("qwen3_4b_cleaner").data.train == "Open-AgentRL-30K.parquet"  # 4B: the full set
