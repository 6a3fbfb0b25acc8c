"""bench/dump_writer.py cannot rot: `--tiny` times the old and the new dump writer on a few small
synthetic episodes (a failed rollout, shallow and deep splices, re-scored retries among them) and
checks that the new dump reads back exactly as the old writer's did."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_times_both_writers_and_the_dumps_agree():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "dump_writer.py"), "--tiny"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    (r,) = [json.loads(x) for x in run.stdout.splitlines()]
    assert r["trajectories"] == 8 and r["compared"] == 8  # every line of the new dump read back as the old one's
    assert r["failed_rollouts"] == 1 and r["rescored_episodes"] >= 1 and r["shallow"] > 0 and r["deep"] > 0
    assert 0 < r["tokens"] < 7 * 700  # small episodes (about 100 to 600 tokens)
    for name in ("old", "new"):
        assert r[name]["s_per_step"] > 0 and r[name]["us_per_token"] > 0 and r[name]["bytes"] > 0
