"""The study's run cache (cleaner_jax/study/run_cache.py): a finished run is stored once and copied
into any study that would train the same run config with the same code; a started run resumes
instead; a failed one is not stored; and the recoverable world's ablations share exactly their
default point with the main study's `cleaner` arm."""
import json
import sys
from pathlib import Path

import ml_collections
from _configs import ROOT, load_module

from cleaner_jax.study import run_cache, runner
from cleaner_jax.study.config import validate_study

# a stand-in for `python -m cleaner_jax.train`: counts its starts in COUNT, writes a metrics file, exits with RC
FAKE_TRAIN = """
import pathlib, sys
count, workdir, rc = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
count.write_text(str(int(count.read_text() or 0) + 1) if count.exists() else "1")
(workdir / "tb").mkdir(exist_ok=True)
(workdir / "tb" / "metrics.jsonl").write_text('{"step": 1, "reward/acc": 0.25}\\n')
sys.exit(rc)
"""


def spec(tmp: Path, name: str, key: str, rc: int = 0) -> runner.RunSpec:
    workdir = tmp / "studies" / name / "runs" / "cleaner" / "seed_0"
    return runner.RunSpec("cleaner", 0, workdir, (sys.executable, "-c", FAKE_TRAIN, str(tmp / "count"), str(workdir),
                                                  str(rc)), tmp / "cache" / "run_cache", key)


def starts(tmp: Path) -> int:
    return int((tmp / "count").read_text()) if (tmp / "count").exists() else 0


def test_a_finished_run_is_stored_once_and_copied_where_the_same_run_comes_again(tmp_path):
    first = spec(tmp_path, "main", "k1")
    out = runner.execute(first, runner._Children())
    assert (out.rc, out.reused_from) == (0, None) and starts(tmp_path) == 1
    stored = tmp_path / "cache" / "run_cache" / "k1"
    assert (stored / "tb" / "metrics.jsonl").read_bytes() == (first.workdir / "tb" / "metrics.jsonl").read_bytes()
    trained = json.loads((first.workdir / "DONE").read_text())["seconds"]

    again = spec(tmp_path, "ablation", "k1")
    out = runner.execute(again, runner._Children())
    assert (out.rc, out.reused_from) == (0, stored) and starts(tmp_path) == 1  # not trained again
    assert (again.workdir / "tb" / "metrics.jsonl").read_bytes() == (first.workdir / "tb" / "metrics.jsonl").read_bytes()
    done = json.loads((again.workdir / "DONE").read_text())
    assert done["command"] == list(again.command) and done["reused_from"] == str(stored)
    assert done["trained_seconds"] == trained and done["seconds"] == 0.0
    assert runner.is_done(again)

    other = spec(tmp_path, "lr", "k2")  # another run config: trained
    assert runner.execute(other, runner._Children()).reused_from is None and starts(tmp_path) == 2


def test_a_started_run_resumes_and_a_failed_run_is_not_stored(tmp_path):
    runner.execute(spec(tmp_path, "main", "k1"), runner._Children())
    killed = spec(tmp_path, "ablation", "k1")
    killed.workdir.mkdir(parents=True)
    (killed.workdir / "console.log").write_text("a run killed before its end\n")
    out = runner.execute(killed, runner._Children())
    assert out.reused_from is None and starts(tmp_path) == 2  # its own train resumed it
    assert "killed before its end" in (killed.workdir / "console.log").read_text()

    failed = spec(tmp_path, "k", "k3", rc=3)
    assert runner.execute(failed, runner._Children()).rc == 3
    assert not (tmp_path / "cache" / "run_cache" / "k3").exists() and not runner.is_done(failed)


def test_the_run_key_covers_every_value_and_the_code(monkeypatch):
    c = ml_collections.ConfigDict({"saar": {"gamma": 0.9, "max_retries": 3}, "train": {"seed": 0}})
    same = ml_collections.ConfigDict({"train": {"seed": 0}, "saar": {"max_retries": 3, "gamma": 0.9}})
    assert run_key(c) == run_key(same)
    for section, key, value in (("saar", "gamma", 0.5), ("saar", "max_retries", 5), ("train", "seed", 1)):
        changed = ml_collections.ConfigDict(c.to_dict())
        changed[section][key] = value
        assert run_key(changed) != run_key(c), (section, key)
    before = run_key(c)
    monkeypatch.setattr(run_cache, "source_fingerprint", lambda: "other code")
    assert run_key(c) != before


def run_key(c):
    return run_cache.run_key(c)


def test_the_ablations_share_their_default_point_with_the_main_study_and_nothing_else(tmp_path, monkeypatch):
    """configs/_ablation.py: gamma 0.9, K 3 and learning rate x1 are the main study's `cleaner` (the
    recoverable world's defaults) on seeds 0-4; every other point, and the main study's other arms,
    are runs of their own."""
    monkeypatch.chdir(tmp_path)  # the shared cache_dir is relative to the current directory

    def keys(name):
        study = validate_study(load_module(ROOT / "configs" / f"{name}.py").get_config())
        return {(r.arm, r.seed): r.key for r in runner.plan(study, tmp_path / name)}

    main = keys("recoverable_study")
    ablations = {name: keys(name) for name in ("recoverable_gamma_study", "recoverable_k_study", "recoverable_lr_study")}
    by_key = {}
    for study, ks in [("recoverable_study", main), *ablations.items()]:
        for (arm, seed), key in ks.items():
            by_key.setdefault(key, set()).add((study, arm, seed))
    shared = {frozenset(v) for v in by_key.values() if len(v) > 1}
    assert shared == {frozenset({("recoverable_study", "cleaner", s), ("recoverable_gamma_study", "gamma_0_9", s),
                                 ("recoverable_k_study", "k_3", s), ("recoverable_lr_study", "lr_x_1", s)})
                      for s in range(5)}
    assert len({r.cache for r in runner.plan(validate_study(load_module(
        ROOT / "configs" / "recoverable_k_study.py").get_config()), tmp_path / "k")}) == 1


def test_share_runs_off_trains_every_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = load_module(ROOT / "configs" / "recoverable_k_study.py").get_config()
    c.share_runs = False
    assert {r.cache for r in runner.plan(validate_study(c), tmp_path / "k")} == {None}
