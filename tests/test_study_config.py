"""The study config: configs/toy_study.py's arms, and every rejection naming its key."""
import dataclasses
import sys

import pytest
from _configs import ROOT, load_config, load_module
from ml_collections import ConfigDict

from cleaner_jax.config import ConfigError, check_environment, validate
from cleaner_jax.study import runner
from cleaner_jax.study.__main__ import check_top_level_keys
from cleaner_jax.study.config import study_config, validate_study


def toy_study() -> ConfigDict:
    return load_module(ROOT / "configs" / "toy_study.py").get_config()


def test_toy_study_arms_and_their_run_configs(tmp_path):
    study = validate_study(toy_study())
    assert study.seeds == (0, 1, 2, 3, 4)
    assert {a.name for a in study.arms} == {"grpo_raw", "cleaner", "supervised", "cleaner_splice_corr"}
    toy = validate(load_config("toy"))
    runs = {a.name: validate(study.run_config(a, 3, tmp_path)) for a in study.arms}
    assert not runs["grpo_raw"].saar.enable
    assert runs["cleaner"].saar == toy.saar and runs["cleaner"].algo == toy.algo  # the toy defaults
    assert runs["supervised"].algo.loss == "nll" and runs["supervised"].algo.nll_sequences == "correct"
    assert runs["cleaner_splice_corr"].saar.splice_correction == "tis"
    assert runs["cleaner_splice_corr"].saar.enable and runs["cleaner_splice_corr"].algo.loss == toy.algo.loss
    for r in runs.values():
        assert r.train.seed == 3 and r.train.eval_before_train
        assert r.warmup_sft.cache_dir == str(tmp_path / "warm_cache")
        assert r.train.compilation_cache_dir == str(tmp_path / "xla_cache")
        assert r.model == toy.model and r.warmup_sft.steps == toy.warmup_sft.steps


def test_train_command_round_trips_through_the_train_flags(tmp_path):
    """The runner's command line, parsed by absl's config flags the way train parses it, gives the
    run config the study validated."""
    from absl import flags
    from ml_collections import config_flags
    study = validate_study(toy_study())
    arm = next(a for a in study.arms if a.name == "supervised")
    cmd = runner.train_command(study, arm, 2, tmp_path)
    fv = flags.FlagValues()
    argv = ["train", *cmd[3:]]  # config_flags finds the `--config.*` overrides in argv when defined
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
    flags.DEFINE_string("workdir", None, "", flag_values=fv)
    fv(argv)
    parsed = validate(fv.config)
    assert parsed == validate(study.run_config(arm, 2, tmp_path))
    assert fv.workdir == str(tmp_path / "runs" / "supervised" / "seed_2")
    assert cmd[:3] == (sys.executable, "-m", "cleaner_jax.train")


def _study(**top) -> ConfigDict:
    c = study_config()
    c.arms.grpo_raw = ConfigDict({"saar": {"enable": False}})
    c.arms.cleaner = ConfigDict()
    for k, v in top.items():
        c[k] = v
    return c


@pytest.mark.parametrize("edit, key", [
    (lambda c: c.__setitem__("parallel", 0), "config.parallel"),
    (lambda c: c.__setitem__("ci_method", "student"), "config.ci_method"),
    (lambda c: c.__setitem__("seeds", "0,x"), "config.seeds"),
    (lambda c: c.__setitem__("seeds", "1,1"), "config.seeds"),
    (lambda c: c.__setitem__("baseline", "dapo"), "config.baseline"),
    (lambda c: c.__setitem__("base_config", "configs/nope.py"), "config.base_config"),
    (lambda c: c.__setitem__("benchmark", "aime24"), "config.benchmark"),
    (lambda c: c.__setitem__("bootstrap_resamples", 10), "config.bootstrap_resamples"),
    (lambda c: c.arms.cleaner.__setitem__("saar", ConfigDict({"nope": 1})), "config.arms.cleaner.saar.nope"),
    (lambda c: c.arms.cleaner.__setitem__("sar", ConfigDict({"enable": True})), "config.arms.cleaner.sar"),
    (lambda c: c.run.__setitem__("train", ConfigDict({"seed": 3})), "config.run.train.seed"),
    (lambda c: c.arms.cleaner.__setitem__("warmup_sft", ConfigDict({"cache_dir": "/tmp/x"})),
     "config.arms.cleaner.warmup_sft.cache_dir"),
    (lambda c: c.run.__setitem__("train", ConfigDict({"compilation_cache_dir": "/tmp/x"})),
     "config.run.train.compilation_cache_dir"),
    (lambda c: c.arms.cleaner.__setitem__("model", ConfigDict({"path": None})), "config.arms.cleaner.model.path"),
    (lambda c: c.arms.__setitem__("Bad-Name", ConfigDict()), "config.arms.Bad-Name"),
    # the arm's run config itself is rejected by the run schema: named with the arm and the run key
    (lambda c: c.arms.cleaner.__setitem__("algo", ConfigDict({"loss": "nll"})) or
     c.arms.cleaner.__setitem__("saar", ConfigDict({"splice_correction": "tis"})), "config.saar.splice_correction"),
    (lambda c: c.run.__setitem__("warmup_sft", ConfigDict({"steps": 0})), "config.share_warm_start"),
])
def test_rejections_name_the_key(edit, key):
    c = _study()
    edit(c)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_study(c)


def test_unknown_study_key_and_no_arms():
    c = _study()
    c.nope = 1
    with pytest.raises(ConfigError, match=r"config\.nope: unknown key"):
        validate_study(c)
    empty = study_config()
    with pytest.raises(ConfigError, match=r"config\.arms: no arms"):
        validate_study(empty)
    with pytest.raises(ConfigError, match=r"config\.paralel: unknown study key"):
        check_top_level_keys(["--config.paralel=2"])
    check_top_level_keys(["--config.parallel=2", "--config.arms.cleaner.saar.gamma=0.3"])


def test_warm_cache_dir_rejections(tmp_path):
    c = load_config("toy")
    c.warmup_sft.cache_dir = str(tmp_path)
    validate(c)
    c.warmup_sft.steps = 0
    with pytest.raises(ConfigError, match=r"config\.warmup_sft\.cache_dir: .*warmup_sft\.steps=0"):
        validate(c)
    c = load_config("toy")
    (tmp_path / "file").write_text("x")
    c.warmup_sft.cache_dir = str(tmp_path / "file")
    with pytest.raises(ConfigError, match=r"config\.warmup_sft\.cache_dir: .*not a usable directory"):
        check_environment(validate(c))  # an existing file: the start-up check's
    c.warmup_sft.cache_dir = " "
    with pytest.raises(ConfigError, match=r"config\.warmup_sft\.cache_dir: .*not a usable directory"):
        validate(c)


def test_the_recoverable_world_and_its_studies(tmp_path, monkeypatch):
    """configs/toy_recoverable.py is configs/toy.py with the recovering student (give-up 0.1), the
    tool-call budget and 32 steps; its main study has the toy study's four arms over 8 seeds; each
    ablation is CLEANER at the grid's values of one key, the default point its baseline; all four
    share one cache directory (relative to the current one)."""
    monkeypatch.chdir(tmp_path)
    toy = validate(load_config("toy"))
    rec = validate(load_config("toy_recoverable"))
    assert (rec.warmup_sft.give_up_rate, rec.eval.tool_call_budget, rec.train.steps) == (0.1, 1, 32)
    assert rec.model == toy.model and rec.saar == toy.saar and rec.algo == toy.algo and rec.optim == toy.optim
    main = validate_study(load_module(ROOT / "configs" / "recoverable_study.py").get_config())
    assert main.seeds == tuple(range(8)) and {a.name for a in main.arms} == {a.name for a in validate_study(toy_study()).arms}
    grids = {"recoverable_gamma_study": ("saar", "gamma", [0.0, 0.5, 0.9, 1.0], "gamma_0_9"),
             "recoverable_k_study": ("saar", "max_retries", [1, 3, 5], "k_3"),
             "recoverable_lr_study": ("optim", "lr", [0.3e-3, 1e-3, 3e-3], "lr_x_1")}
    cache = tmp_path / "runs" / "recoverable_cache"
    for name, (section, key, values, baseline) in grids.items():
        study = validate_study(load_module(ROOT / "configs" / f"{name}.py").get_config())
        assert study.seeds == (0, 1, 2, 3, 4) and study.settings.baseline == baseline
        runs = [validate(study.run_config(a, 1, tmp_path / name)) for a in study.arms]
        assert [getattr(getattr(r, section), key) for r in runs] == pytest.approx(values)
        for r in runs:
            assert r.saar.enable and r.algo == rec.algo and r.warmup_sft == dataclasses.replace(
                rec.warmup_sft, cache_dir=str(cache / "warm_cache"))
            assert r.train.compilation_cache_dir == str(cache / "xla_cache")
    for r in (validate(main.run_config(a, 1, tmp_path / "main")) for a in main.arms):
        assert r.warmup_sft.cache_dir == str(cache / "warm_cache")


def test_the_collapse_studies_put_cleaner_beside_tis_and_mask_on_the_same_seeds(tmp_path, monkeypatch):
    """configs/toy_collapse_study.py (the README world) and configs/recoverable_study.py with
    configs/recoverable_mask_study.py (the recoverable world): faithful CLEANER, `tis` and `mask`
    on the same 8 seeds in each world, 16 CLEANER seed-runs in all; the arms differ from CLEANER in
    the splice correction alone, and the mask arm uses the main study's warm starts."""
    monkeypatch.chdir(tmp_path)
    readme = validate_study(load_module(ROOT / "configs" / "toy_collapse_study.py").get_config())
    main = validate_study(load_module(ROOT / "configs" / "recoverable_study.py").get_config())
    mask = validate_study(load_module(ROOT / "configs" / "recoverable_mask_study.py").get_config())
    assert readme.seeds == main.seeds == mask.seeds == tuple(range(8))
    assert [a.name for a in readme.arms] == ["cleaner", "cleaner_splice_corr", "cleaner_splice_mask"]
    assert [a.name for a in mask.arms] == ["cleaner_splice_mask"]
    worlds = {"toy": {a.name: validate(readme.run_config(a, 3, tmp_path / "readme")) for a in readme.arms},
              "toy_recoverable": {**{a.name: validate(main.run_config(a, 3, tmp_path / "main")) for a in main.arms},
                                  **{a.name: validate(mask.run_config(a, 3, tmp_path / "mask")) for a in mask.arms}}}
    for world, runs in worlds.items():
        base = validate(load_config(world))
        cleaner = runs["cleaner"]
        assert cleaner.saar == base.saar and cleaner.saar.enable and cleaner.saar.splice_correction == "none"
        for arm, corr in (("cleaner_splice_corr", "tis"), ("cleaner_splice_mask", "mask")):
            assert runs[arm].saar == dataclasses.replace(cleaner.saar, splice_correction=corr)
            assert runs[arm].warmup_sft == cleaner.warmup_sft and runs[arm].train == cleaner.train


def test_the_async_study_differs_from_synchronous_cleaner_in_the_staleness_alone(tmp_path, monkeypatch):
    """configs/toy_async_study.py: CLEANER at max_staleness 0, 1 and 2 on the toy study's seeds and
    warm starts; the overlapped arms change train.max_staleness and the continuation it needs, nothing
    else."""
    monkeypatch.chdir(tmp_path)
    study = validate_study(load_module(ROOT / "configs" / "toy_async_study.py").get_config())
    toy = validate_study(load_module(ROOT / "configs" / "toy_study.py").get_config())
    assert study.seeds == toy.seeds == (0, 1, 2, 3, 4) and study.settings.baseline == "cleaner"
    runs = {a.name: validate(study.run_config(a, 2, tmp_path / "s")) for a in study.arms}
    sync = validate(toy.run_config(next(a for a in toy.arms if a.name == "cleaner"), 2, tmp_path / "s"))
    assert runs["cleaner"] == sync and sync.train.max_staleness == 0
    for arm, k in (("cleaner_async1", 1), ("cleaner_async2", 2)):
        assert runs[arm] == dataclasses.replace(
            sync, train=dataclasses.replace(sync.train, max_staleness=k),
            rollout=dataclasses.replace(sync.rollout, continue_aborted=True)), arm
