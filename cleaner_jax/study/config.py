"""The study config: which run config, which arms (each a set of run-config overrides), which
seeds, and how the summary's statistics are formed. An ml-collections file like a run config
(`configs/toy_study.py`), declared with `cleaner_jax.schema` and checked before anything runs:
an unknown key, a wrong type, a value out of range and contradictory values are rejected as
`config.<key>: ...`; every arm's run config is built and validated by `cleaner_jax.config.validate`,
so an arm that names a run key that does not exist, or a value the run would reject, fails here
naming the arm and the key, not in the middle of the study.

    c.base_config = "configs/toy.py"          # the run config every arm starts from
    c.run.train.steps = 40                    # overrides of every arm (a partial run config)
    c.arms.grpo_raw.saar.enable = False       # one arm: its own overrides on top
    c.seeds = "0,1,2,3,4"                     # train.seed of each run of each arm
    c.arms.grpo_matched = ConfigDict({"match_generation": "cleaner"})  # an arm option (`ArmOptions`)
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path
from typing import Any, Literal

import ml_collections

from cleaner_jax import schema
from cleaner_jax.config import ConfigError, validate
from cleaner_jax.schema import field, section
from cleaner_jax.study import aggregate

ROOT = Path(__file__).resolve().parents[2]  # the repository: relative base_config paths start here
ARM_NAME = re.compile(r"[a-z][a-z0-9_]*")
# keys the study sets itself in every run: an arm or `run` setting them would contradict it
STUDY_SET = {("train", "seed"): "the study's seeds", ("warmup_sft", "cache_dir"): "share_warm_start",
             ("train", "compilation_cache_dir"): "share_compilation_cache"}


@section
class StudyConfig:
    base_config: str = field("configs/toy.py", help="the run config file every arm starts from (relative: to the repo)")
    seeds: str = field("0,1,2,3,4", help="comma-separated train.seed values; every arm runs each")
    parallel: int = field(1, ge=1, help="runs at once (each is its own train process with its own rollout server)")
    baseline: str = field("grpo_raw", help="the arm every other arm is compared with, paired by seed")
    benchmark: str = field("toy", help="the eval benchmark whose accuracy the summary reports (data.eval name)")
    share_warm_start: bool = field(
        True, help="keep warm starts and step-0 evaluations in <study>/warm_cache, shared by the runs of a seed")
    share_compilation_cache: bool = field(
        True, help="every run's train.compilation_cache_dir is <study>/xla_cache: a run loads the programs the runs "
        "before it compiled (its learner's and its rollout server's) instead of compiling them again")
    share_runs: bool = field(
        True, help="reuse a finished run with the same run config and code from <cache>/run_cache/ instead of "
        "training it again, and store each finished run there (study/run_cache.py): an ablation's default point "
        "and the main study's arm at the same seeds are one run")
    cache_dir: str = field(
        "", help="where warm_cache/, xla_cache/ and run_cache/ live: '' is the study's workdir; a directory (relative: to the "
        "current one) several studies of one base config name share their warm starts, step-0 evaluations and "
        "compiled programs (configs/_ablation.py)")
    tail_steps: int = field(1, ge=1, help="training-rollout metrics: the summary's 'last' is the mean of the last N steps")
    bootstrap_resamples: int = field(10_000, ge=100, help="resamples of the bootstrap CI over seeds")
    bootstrap_seed: int = field(0, ge=0, help="seed of the bootstrap")
    ci_level: float = field(0.95, gt=0.0, lt=1.0, help="confidence level of the CI over seeds")
    ci_method: Literal["percentile", "BCa"] = field(
        "percentile", help="scipy.stats.bootstrap method; BCa needs varying values and more seeds to be stable")
    primary_metric: str = field(
        "", help="the summary value whose paired p-values are Holm-corrected over the arms and lead summary.md; '' is "
        "heldout_acc_within_budget_after when every arm sets eval.tool_call_budget, else heldout_acc_after")
    paired_ci_method: Literal["percentile", "BCa"] = field(
        "BCa", help="scipy.stats.bootstrap method of the CI of each arm's mean difference from the baseline")
    permutation_resamples: int = field(
        100_000, ge=1000, help="random sign flips of the paired sign-flip test beyond 20 pairs (exact up to 20)")


@section
class ArmOptions:
    """The keys of an arm that are not run-config keys: how the study builds the arm's runs. Read
    off the arm's top level before the rest is applied to the run config."""
    match_generation: str = field(
        "", help="'' or another arm's name: this arm is the baseline arm's run config with algo.prompts_per_step "
        "scaled, per seed, so that its generated tokens per RL step match that arm's (study/matching.py); it runs "
        "after that arm and the baseline of its seed, and takes no run keys of its own")


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    overrides: dict[str, Any]  # dotted run key -> value, the `run` section's and then the arm's own
    # ArmOptions.match_generation: the arm whose budget this one matches ('' for an ordinary arm);
    # `overrides` are then the baseline's, and the runner adds the computed algo.prompts_per_step
    match_generation: str = ""


@dataclasses.dataclass(frozen=True)
class Study:
    settings: StudyConfig
    base_config: Path
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    primary_metric: str = "heldout_acc_after"  # `settings.primary_metric`, its '' resolved by validate_study

    def matched(self) -> dict[str, str]:
        """Each compute-matched arm -> the arm whose generation budget it matches."""
        return {a.name: a.match_generation for a in self.arms if a.match_generation}

    def shared_dirs(self, workdir: Path) -> dict[str, str]:
        """The directories the runs of a study under `workdir` share (run keys of STUDY_SET)."""
        keys = {}
        root = self.cache_root(workdir)
        if self.settings.share_warm_start:
            keys["warmup_sft.cache_dir"] = str(root / "warm_cache")
        if self.settings.share_compilation_cache:
            keys["train.compilation_cache_dir"] = str(root / "xla_cache")
        return keys

    def run_cache_dir(self, workdir: Path) -> Path | None:
        """Where finished runs are shared (`share_runs`), beside warm_cache/ and xla_cache/; None without it."""
        return self.cache_root(workdir) / "run_cache" if self.settings.share_runs else None

    def cache_root(self, workdir: Path) -> Path:
        """`cache_dir` (resolved), or the study's workdir when it is ''."""
        return Path(self.settings.cache_dir).resolve() if self.settings.cache_dir else workdir

    def run_config(self, arm: Arm, seed: int, workdir: Path | None) -> ml_collections.ConfigDict:
        """The run config of `arm` at `seed` in a study under `workdir`: the base file's, with the
        arm's overrides and the study's shared directories (None: without them)."""
        c = load_run_config(self.base_config)
        apply(c, {**arm.overrides, "train.seed": seed}, f"config.arms.{arm.name}")
        if workdir is not None:
            apply(c, self.shared_dirs(workdir), "config (the study's shared directories)")
        return c


def load_run_config(path: Path) -> ml_collections.ConfigDict:
    """`get_config()` of a run config file, as `--config path` loads it."""
    spec = importlib.util.spec_from_file_location(f"_study_run_config_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"config.base_config: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def flatten(node: Any, where: str) -> dict[str, Any]:
    """A partial run config (nested ConfigDicts) as dotted key -> value."""
    if not isinstance(node, ml_collections.ConfigDict):
        raise ConfigError(f"{where}: expected a partial run config (section.key = value), got {node!r}")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update({f"{key}.{k}": v for k, v in flatten(value, f"{where}.{key}").items()})
        else:
            out[key] = value
    return out


def apply(c: ml_collections.ConfigDict, overrides: dict[str, Any], where: str) -> None:
    """Set dotted run keys on the locked run config `c`; an unknown key is rejected naming it."""
    for dotted, value in overrides.items():
        path = dotted.split(".")
        node = c
        for i, name in enumerate(path):
            if not isinstance(node, ml_collections.ConfigDict) or name not in node:
                known = ", ".join(sorted(node.keys())) if isinstance(node, ml_collections.ConfigDict) else "none"
                raise ConfigError(f"{where}.{'.'.join(path[:i + 1])}: unknown run-config key; there: {known}")
            if i < len(path) - 1:
                node = node[name]
        if isinstance(node[path[-1]], ml_collections.ConfigDict):
            raise ConfigError(f"{where}.{dotted}: is a section, not a key")
        if value is None:
            raise ConfigError(f"{where}.{dotted}: None cannot be passed on the train command line; set it in the "
                              "base config file instead")
        try:
            node[path[-1]] = value
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}.{dotted}: {value!r} does not fit the run key: {e}") from None


BUDGET_PRIMARY = "heldout_acc_within_budget_after"  # the default primary metric where the runs log it


def summary_values() -> list[str]:
    """Every name `aggregate.run_summary` can give a run (which of them a run has depends on what it logs)."""
    names = ["heldout_acc_before", "heldout_acc_after", "heldout_acc_gain", "collapsed", "generated_tokens_per_step_mean"]
    names += [f"heldout_{m}_{when}" for m in aggregate.HELDOUT_OPTIONAL for when in ("before", "after")]
    return names + [f"{s}_{when}" for s in aggregate.TRAIN_SERIES for when in ("first", "last")]


def check_summary_value(name: str) -> None:
    """config.primary_metric names something the summary has ('' is the default)."""
    if name and name not in summary_values():
        raise ConfigError(f"config.primary_metric: {name!r} is not a summary value; the summary values are: "
                          f"{', '.join(summary_values())}")


def primary_metric(settings: StudyConfig, budgets: dict[str, int | None]) -> str:
    """The checked primary metric; `budgets` is each arm's eval.tool_call_budget (without one an arm's runs
    log no acc_within_budget)."""
    name = settings.primary_metric
    if not name:
        return BUDGET_PRIMARY if all(b is not None for b in budgets.values()) else "heldout_acc_after"
    check_summary_value(name)
    unbudgeted = [arm for arm, b in budgets.items() if b is None]
    if "acc_within_budget" in name and unbudgeted:
        raise ConfigError(f"config.primary_metric: {name!r} needs eval.tool_call_budget, which arm(s) "
                          f"{', '.join(unbudgeted)} leave unset, so their runs do not log it")
    return name


def study_config() -> ml_collections.ConfigDict:
    """Every study key at its default, plus the free-form `run` and `arms` partial run configs."""
    c = ml_collections.ConfigDict({k: v for k, (_, v) in schema.defaults(StudyConfig).items()})
    c.run = ml_collections.ConfigDict()
    c.arms = ml_collections.ConfigDict()
    return c


def parse_seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ConfigError(f"config.seeds: {text!r} is not a comma-separated list of integers, e.g. '0,1,2,3,4'") from None
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"config.seeds: {text!r}: seeds must be distinct and >= 0")
    return seeds


def arm_options(own: dict[str, Any], where: str) -> ArmOptions:
    """The arm's `ArmOptions`, taken out of `own` (its flattened keys; the rest are run keys)."""
    values = {k: own.pop(k) for k in schema.keys(ArmOptions) if k in own}
    return schema.build(ArmOptions, {**{k: v for k, (_, v) in schema.defaults(ArmOptions).items()}, **values}, where)


def matched_arms(arms: list[Arm], baseline: str) -> list[Arm]:
    """`arms` with each compute-matched arm's overrides made the baseline's; raises ConfigError
    naming `config.arms.<arm>.match_generation` when the reference is no arm, is itself matched or
    is the baseline, and when the baseline is matched."""
    by_name = {a.name: a for a in arms}
    out = []
    for arm in arms:
        ref, where = arm.match_generation, f"config.arms.{arm.name}.match_generation"
        if not ref:
            out.append(arm)
            continue
        if arm.name == baseline:
            raise ConfigError(f"{where}: {ref!r} on the baseline arm (config.baseline): a matched arm is built from "
                              "the baseline's run config, so the baseline itself cannot be one")
        if ref not in by_name:
            raise ConfigError(f"{where}: {ref!r} is not an arm; the arms are: {', '.join(by_name)}")
        if by_name[ref].match_generation:
            raise ConfigError(f"{where}: {ref!r} is itself a matched arm (config.arms.{ref}.match_generation="
                              f"{by_name[ref].match_generation!r}); match an arm that trains with settings of its own")
        if ref == baseline:
            raise ConfigError(f"{where}: {ref!r} is the baseline arm, whose budget the baseline has already; "
                              "name the arm whose extra generation the baseline should be given")
        out.append(dataclasses.replace(arm, overrides=dict(by_name[baseline].overrides)))
    return out


def validate_study(c: ml_collections.ConfigDict) -> Study:
    """The checked study; raises ConfigError naming the first key that cannot work."""
    values = c.to_dict()
    for name in ("run", "arms"):
        if not isinstance(values.get(name), dict):
            raise ConfigError(f"config.{name}: missing; start the study config from cleaner_jax.study.config.study_config()")
    settings = schema.build(StudyConfig, {k: v for k, v in values.items() if k not in ("run", "arms")}, "config")
    seeds = parse_seeds(settings.seeds)
    check_summary_value(settings.primary_metric)  # before the arms' run configs are built
    base = Path(settings.base_config)
    base = base if base.is_absolute() else ROOT / base
    if not base.is_file():
        raise ConfigError(f"config.base_config: {settings.base_config!r} is not a file (relative paths start at {ROOT})")
    if not c.arms:
        raise ConfigError("config.arms: no arms; add at least one, e.g. c.arms.cleaner = ml_collections.ConfigDict()")
    shared = flatten(c.run, "config.run")
    arms = []
    for name in c.arms:
        if not ARM_NAME.fullmatch(name):
            raise ConfigError(f"config.arms.{name}: an arm name is lower-case letters, digits and _ (it names a directory)")
        own = flatten(c.arms[name], f"config.arms.{name}")
        options = arm_options(own, f"config.arms.{name}")
        if options.match_generation and own:  # else the comparison is no longer "the baseline given that budget"
            raise ConfigError(f"config.arms.{name}.{sorted(own)[0]}: a matched arm (match_generation="
                              f"{options.match_generation!r}) is the baseline arm's run config with "
                              "algo.prompts_per_step scaled; it takes no run keys of its own")
        for where, keys in (("config.run", shared), (f"config.arms.{name}", own)):
            for dotted in keys:
                reason = STUDY_SET.get(tuple(dotted.split(".", 1)))  # type: ignore[arg-type]
                if reason is not None:
                    raise ConfigError(f"{where}.{dotted}: set by the study ({reason}); remove it here")
        arms.append(Arm(name, {**shared, **own}, options.match_generation))
    if settings.baseline not in c.arms:
        raise ConfigError(f"config.baseline: {settings.baseline!r} is not an arm; the arms are: {', '.join(c.arms)}")
    arms = matched_arms(arms, settings.baseline)
    study = Study(settings, base, tuple(arms), seeds)
    budgets: dict[str, int | None] = {}
    for arm in study.arms:  # every run config is built and checked now, not when its turn comes
        try:
            r = validate(study.run_config(arm, seeds[0], None))
            if not (settings.share_warm_start and r.warmup_sft.steps == 0):  # that one is named below
                validate(study.run_config(arm, seeds[0], Path("/nonexistent/study")))
        except ConfigError as e:
            raise ConfigError(f"config.arms.{arm.name} (with config.run): the run config is rejected: {e}") from None
        if settings.benchmark not in [n.split("=", 1)[0] for n in r.data.eval.split(",") if n]:
            raise ConfigError(f"config.benchmark: {settings.benchmark!r} is not evaluated by arm {arm.name!r} "
                              f"(data.eval={r.data.eval!r})")
        if settings.share_warm_start and r.warmup_sft.steps == 0:
            raise ConfigError(f"config.share_warm_start: arm {arm.name!r} has warmup_sft.steps=0, so there is no warm "
                              "start to share: set share_warm_start=False")
        budgets[arm.name] = r.eval.tool_call_budget
    return dataclasses.replace(study, primary_metric=primary_metric(settings, budgets))
