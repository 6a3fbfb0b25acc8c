"""Config errors fail at start-up with a message naming the key (and what is allowed); every
config file validates; `--config.a.b=v` overrides and launch/sweep.py still produce valid runs."""
import contextlib
import dataclasses
import importlib.util
import io
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from cleaner_jax import schema, wiring
from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.config import SECTIONS, ConfigError, RunConfig, base_config, check_environment, validate
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.saar.config import SaarConfig
from _configs import load_config

ROOT = Path(__file__).resolve().parents[1]
# run configs; a *_study.py file is a study config (tests/test_study_config.py)
CONFIG_FILES = sorted(p.stem for p in (ROOT / "configs").glob("*.py")
                      if not p.stem.startswith("_") and not p.stem.endswith("_study"))


def toy():
    return load_config("toy")


def rejects(c, pattern: str) -> str:
    with pytest.raises(ConfigError, match=pattern) as err:
        validate(c)
    return str(err.value)


def rejects_here(c, pattern: str) -> str:
    """A valid config that this machine cannot run: what train.main and evaluate.main say."""
    run = validate(c)
    with pytest.raises(ConfigError, match=pattern) as err:
        check_environment(run)
    return str(err.value)


# ----------------------------------------------------------------------------- every config file


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_every_config_file_validates(name, tmp_path):
    c = load_config(name)
    if not c.model.tiny_init:  # paper configs name local files that a test machine lacks
        c.model.path = str(tmp_path)
    if c.data.train != "toy":
        c.data.train = str(tmp_path / "train.parquet")
        Path(c.data.train).touch()
    run = validate(c)
    assert isinstance(run, RunConfig) and run.agent.saar is run.saar
    check_environment(run)


def test_the_config_files_are_all_found():
    assert {"qwen25_7b_cleaner", "qwen25_7b_dapo", "qwen25_7b_notool", "qwen3_4b_cleaner", "qwen3_4b_dapo",
            "qwen3_4b_notool", "toy"} <= set(CONFIG_FILES)


def test_paper_configs_match_the_authors_settings():
    """Values from the authors' scripts (docs/authors.md §4.1), written out by hand."""
    c4 = load_config("qwen3_4b_cleaner")
    c7 = load_config("qwen25_7b_cleaner")
    d4 = load_config("qwen3_4b_dapo")
    assert (c4.optim.lr, c7.optim.lr) == (2e-6, 1e-6)
    assert (c4.saar.rollback_probability, c7.saar.rollback_probability) == (1.0, 0.7)
    assert c4.saar.enable and not d4.saar.enable
    assert (c4.algo.clip_low, c4.algo.clip_high, c4.algo.dual_clip) == (0.2, 0.28, 10.0)
    assert (c4.algo.group_size, c4.algo.prompts_per_step) == (16, 128)
    assert (d4.algo.tis, d4.algo.tis_cap) == ("sequence", 2.0)
    assert c4.saar.gamma == 0.5 and c4.saar.max_retries == 3


def test_base_config_defaults_are_the_authors():
    """Faithful defaults, by hand (docs/authors.md §1.5, §2.1, §4.1)."""
    c = base_config()
    assert (c.algo.mini_batches_per_step, c.algo.micro_batch_size, c.algo.loss_agg) == (4, 8, "token-mean")
    assert (c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay, c.optim.grad_clip) == (2e-6, 20, 0.01, 1.0)
    assert (c.saar.max_retries, c.saar.gamma, c.saar.max_tool_entries) == (3, 0.5, 30)
    assert (c.agent.tool_call_parser, c.rollout.decode_backend, c.rollout.temperature) == ("json_repair", "auto", 1.0)
    assert (c.agent.max_prompt_tokens, c.agent.max_response_tokens, c.reward.overlong_buffer) == (2560, 20480, 4096)


def test_removed_keys_are_gone():
    c = base_config()
    for section, key in [("train", "log_every"), ("algo", "kl_coef"), ("algo", "kl_type"),
                         ("saar", "keep_failed_attempts"), ("saar", "error_labels")]:
        assert key not in c[section], f"{section}.{key}"


# ----------------------------------------------------------------------------- unknown and missing keys


def test_unknown_key_is_rejected_with_its_name_when_assigned():
    c = toy()
    with pytest.raises(AttributeError, match="gama"):
        c.saar.gama = 0.3


def test_unknown_key_is_rejected_by_validate():
    c = toy()
    with c.unlocked():
        c.saar.gama = 0.3
    msg = rejects(c, r"config\.saar\.gama: unknown key")
    assert "gamma" in msg and "max_retries" in msg  # the keys that do exist


def test_unknown_section_is_rejected():
    c = toy()
    with c.unlocked():
        c.sar = ml_collections.ConfigDict({"gamma": 0.5})
    rejects(c, r"config\.sar: unknown section; the sections are: model, data, rollout, agent, saar")


def test_missing_key_is_rejected():
    c = ml_collections.ConfigDict(toy().to_dict())
    del c.saar["gamma"]
    rejects(c, r"config\.saar\.gamma: missing; start the config from cleaner_jax\.config\.base_config\(\)")


def test_missing_section_is_rejected():
    c = ml_collections.ConfigDict(toy().to_dict())
    del c["optim"]
    rejects(c, r"config\.optim: missing section")


# ----------------------------------------------------------------------------- wrong types


@pytest.mark.parametrize("key,value,pattern", [
    ("train.steps", True, r"config\.train\.steps: True has the wrong type bool: expected int"),
    ("saar.gamma", None, r"config\.saar\.gamma: None is not allowed: expected float"),
    ("saar.similarity", None, r"config\.saar\.similarity: None is not allowed: expected one of 'call', 'code'"),
    ("rollout.server_urls", None, r"config\.rollout\.server_urls: None is not allowed: expected str"),
    ("agent.use_tools", None, r"config\.agent\.use_tools: None is not allowed: expected bool"),
])
def test_wrong_type_is_rejected(key, value, pattern):
    c = toy()
    section, name = key.split(".")
    c[section][name] = value  # ml_collections lets these through; validate must not
    rejects(c, pattern)


def test_wrong_type_in_an_unlocked_config_is_rejected():
    c = ml_collections.ConfigDict(toy().to_dict(), type_safe=False)
    c.saar.max_retries = 2.5
    rejects(c, r"config\.saar\.max_retries: 2\.5 has the wrong type float: expected int")
    c = ml_collections.ConfigDict(toy().to_dict(), type_safe=False)
    c.model.path = 3
    rejects(c, r"config\.model\.path: 3 has the wrong type int: expected str or None")
    # (ml_collections itself turns True into 1.0 for a float key; built directly it is caught)
    with pytest.raises(ConfigError, match=r"SaarConfig\.gamma: True has the wrong type bool: expected float"):
        SaarConfig(gamma=True)


def test_int_for_a_float_key_is_accepted_as_float():
    c = toy()
    c.saar.gamma = 1
    run = validate(c)
    assert run.saar.gamma == 1.0 and isinstance(run.saar.gamma, float)


# ----------------------------------------------------------------------------- ranges and choices


@pytest.mark.parametrize("key,value,pattern", [
    ("saar.gamma", 1.5, r"config\.saar\.gamma: 1\.5 is out of range: must be in \[0\.0, 1\.0\]"),
    ("saar.gamma", -0.1, r"config\.saar\.gamma: -0\.1 is out of range: must be in \[0\.0, 1\.0\]"),
    ("saar.max_retries", -1, r"config\.saar\.max_retries: -1 is out of range: must be >= 0"),
    ("saar.rollback_probability", 1.01, r"config\.saar\.rollback_probability: 1\.01 is out of range"),
    ("rollout.temperature", 0.0, r"config\.rollout\.temperature: 0\.0 is out of range: must be > 0\.0 "
                                 r"\(.*RL needs sampled log-probs"),
    ("rollout.top_p", 0.0, r"config\.rollout\.top_p: 0\.0 is out of range: must be in \(0\.0, 1\.0\]"),
    ("algo.clip_low", 1.0, r"config\.algo\.clip_low: 1\.0 is out of range: must be in \[0\.0, 1\.0\)"),
    ("algo.dual_clip", 1.0, r"config\.algo\.dual_clip: 1\.0 is out of range: must be > 1\.0"),
    ("algo.mini_batches_per_step", 0, r"config\.algo\.mini_batches_per_step: 0 is out of range: must be >= 1"),
    ("optim.lr", 0.0, r"config\.optim\.lr: 0\.0 is out of range: must be > 0\.0"),
    ("optim.b2", 1.0, r"config\.optim\.b2: 1\.0 is out of range: must be in \[0\.0, 1\.0\)"),
    ("agent.max_assistant_turns", 0, r"config\.agent\.max_assistant_turns: 0 is out of range: must be >= 1"),
    ("mesh.tp", 0, r"config\.mesh\.tp: 0 is out of range: must be >= 1"),
    ("train.checkpoint_every", 0, r"config\.train\.checkpoint_every: 0 is out of range: must be >= 1"),
    ("data.toy_max_operand", 1, r"config\.data\.toy_max_operand: 1 is out of range: must be >= 2"),
    ("data.eval_limit", 0, r"config\.data\.eval_limit: 0 is out of range: must be >= 1"),
])
def test_out_of_range_is_rejected(key, value, pattern):
    c = toy()
    section, name = key.split(".")
    c[section][name] = value
    rejects(c, pattern)


@pytest.mark.parametrize("key,value,allowed", [
    ("algo.advantage", "ppo", "'grpo', 'drgrpo', 'rloo'"),
    ("algo.loss", "dpo", "'ppo', 'nll'"),
    ("algo.loss_agg", "mean", "'token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean'"),
    ("algo.tis", "seq", "'none', 'token', 'sequence'"),
    ("model.compute_dtype", "float8", "'float32', 'bfloat16', 'float16'"),
    ("model.remat", "all", "'none', 'full', 'dots', 'dots_no_batch'"),
    ("model.attention_impl", "flash", "'xla', 'cudnn'"),
    ("model.tiny_family", "llama", "'qwen2', 'qwen3'"),
    ("rollout.backend", "vllm", "'embedded', 'sglang'"),
    ("rollout.decode_backend", "cuda", "'auto', 'xla', 'cpu_kernels'"),
    ("agent.tool_call_parser", "yaml", "'json_repair', 'strict'"),
    ("agent.observation_mode", "short", "'faithful', 'full'"),
    ("agent.chunk_template", "chatml", "'faithful', 'canonical'"),
    ("saar.similarity", "tokens", "'call', 'code'"),
    ("saar.logprob_mode", "learner", "'recompute', 'rollout'"),
    ("reward.math_mode", "lenient", "'strict', 'equivalence'"),
])
def test_value_not_allowed_is_rejected_listing_the_allowed_ones(key, value, allowed):
    c = toy()
    section, name = key.split(".")
    c[section][name] = value
    rejects(c, rf"config\.{key}: '{value}' is not allowed: use one of {allowed}")


def _bad_values(tp, meta):
    """Values just outside a declaration (from the declaration itself): every declared check
    must be live end to end, not only the hand-picked ones above."""
    optional, inner = schema.split_optional(tp)
    if "ge" in meta:
        yield meta["ge"] - (1 if inner is int else 1e-3)
    if "gt" in meta:
        yield meta["gt"]
    if "le" in meta:
        yield meta["le"] + (1 if inner is int else 1e-3)
    if "lt" in meta:
        yield meta["lt"]
    if typing.get_origin(inner) is typing.Literal:
        yield "not-a-choice"


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_declared_check_rejects_naming_the_key(section):
    cls = SECTIONS[section]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = {k: tp for k, (tp, _) in schema.defaults(cls).items()}
    checked = 0
    for key, tp in hints.items():
        for bad in _bad_values(tp, fields[key].metadata):
            c = toy()
            with c.unlocked():
                c[section][key] = bad
            rejects(c, rf"^config\.{section}\.{key}: ")
            checked += 1
    assert checked >= 1


# ----------------------------------------------------------------------------- contradictions


def _set(c, **values):
    for key, value in values.items():
        section, name = key.split("__")
        c[section][name] = value
    return c


@pytest.mark.parametrize("values,pattern", [
    (dict(model__tiny_init=False), r"config\.model\.path: no checkpoint given"),
    (dict(model__path="/tmp"), r"config\.model\.path: '/tmp' is set together with model\.tiny_init=True"),
    (dict(data__train_limit=10), r"config\.data\.train_limit: the toy task is generated without end"),
    (dict(data__eval="toy,aime23"), r"config\.data\.eval: unknown benchmark 'aime23'; use 'toy' or one of aime24, "),
    (dict(data__eval_limit=None), r"config\.data\.eval_limit: the toy benchmark is generated: give its size"),
    (dict(rollout__backend="sglang"), r"config\.rollout\.server_urls: backend=sglang needs at least one server URL"),
    (dict(rollout__backend="sglang", rollout__server_urls="http://h:1", rollout__decode_backend="xla"),
     r"config\.rollout\.decode_backend: 'xla' selects the embedded engine's kernels, but rollout\.backend='sglang'"),
    (dict(rollout__backend="sglang", rollout__server_urls="http://h:1", rollout__batch_invariant=False),
     r"config\.rollout\.batch_invariant: False sets the embedded engine's batch layout, but rollout\.backend='sglang'"),
    (dict(rollout__top_k=0), r"config\.rollout\.top_k: 0 is not allowed: use -1 \(off\) or k >= 1"),
    (dict(rollout__router_url="http://r:29900"), r"config\.rollout\.router_url: 'http://r:29900' with "
                                                 r"rollout\.backend='embedded': the embedded backend is one server"),
    (dict(rollout__backend="sglang", rollout__server_urls="http://w:1, http://r:29900/",
          rollout__router_url="http://r:29900"),
     r"config\.rollout\.router_url: 'http://r:29900' is also in rollout\.server_urls, which must name the workers "
     r"behind the router"),
    (dict(rollout__backend="sglang", rollout__server_urls="http://w:1", rollout__router_url="r:29900"),
     r"config\.rollout\.router_url: 'r:29900' is not of the form http://HOST:PORT"),
    (dict(rollout__backend="sglang", rollout__server_urls="http://w:1", rollout__router_url="http://r:29900/generate"),
     r"config\.rollout\.router_url: 'http://r:29900/generate' is not of the form http://HOST:PORT"),
    (dict(mesh__fsdp=0), r"config\.mesh\.fsdp: 0 is not allowed"),
    (dict(saar__logprob_mode="rollout", rollout__temperature=0.7), r"config\.saar\.logprob_mode: rollout mode "
                                                                    r"re-scores .* needs rollout\.temperature=1\.0"),
    (dict(agent__use_tools=False), r"config\.saar\.enable: SAAR needs tools"),
    (dict(reward__overlong_buffer=256), r"config\.reward\.overlong_buffer: 256 must be < "
                                        r"agent\.max_response_tokens=256"),
    (dict(algo__advantage="rloo", algo__group_size=1, algo__micro_batch_size=4),
     r"config\.algo\.advantage: rloo needs algo\.group_size >= 2"),
    (dict(algo__mini_batches_per_step=3), r"config\.algo\.mini_batches_per_step: 32 sequences per step do not split "
                                          r"into 3 mini-batches"),
    (dict(algo__micro_batch_size=3), r"config\.algo\.micro_batch_size: a mini-batch of 32 sequences does not split "
                                     r"into micro-batches of 3"),
    (dict(algo__loss="nll", algo__tis="token", saar__enable=False),
     r"config\.algo\.tis: truncated IS weights the ppo loss only; algo\.loss='nll' would ignore it"),
    (dict(algo__nll_sequences="positive_advantage"), r"config\.algo\.nll_sequences: applies to algo\.loss='nll' "
                                                     r"only; algo\.loss='ppo' would ignore it"),
    (dict(algo__tis="sequence"), r"config\.algo\.tis: truncated IS needs rollout log-probs of the purified tokens"),
    (dict(warmup_sft__examples=8), r"config\.warmup_sft\.examples: 8 demonstrations cannot fill a batch of "
                                   r"warmup_sft\.batch_size=16"),
])
def test_contradictions_are_rejected_naming_the_key(values, pattern):
    rejects(_set(toy(), **values), pattern)


@pytest.mark.parametrize("values,pattern", [
    (dict(model__tiny_init=False, model__path="/nonexistent/model"), r"config\.model\.path: '/nonexistent/model' "
                                                                     r"is not a directory"),
    (dict(data__train="/nonexistent/train.parquet", warmup_sft__steps=0),
     r"config\.data\.train: training data '/nonexistent/train\.parquet' not found"),
    (dict(data__train="/nonexistent/train.filtered_sr.parquet", warmup_sft__steps=0),
     r"config\.data\.train: the difficulty-filtered training set '/nonexistent/train\.filtered_sr\.parquet' does not "
     r"exist yet: make it .*`python -m cleaner_jax\.data\.filter"),
    (dict(data__eval="gpqa_diamond=/nonexistent/g.parquet"),
     r"config\.data\.eval: gpqa_diamond=/nonexistent/g\.parquet: file not found"),
    (dict(train__weight_export_dir="/nonexistent/shm"), r"config\.train\.weight_export_dir: '/nonexistent/shm' is not "
                                                        r"an existing directory"),
])
def test_what_the_machine_lacks_passes_validate_and_stops_the_start_up_check(values, pattern):
    rejects_here(_set(toy(), **values), pattern)


def test_validate_reads_nothing_from_the_machine(tmp_path, monkeypatch):
    """validate() is config in, RunConfig out: a config naming files that are not there, a model
    directory with a config.json whose heads break the attention bound, and a package that is not
    installed validates with every file-system and package probe refused; check_environment then
    names the first key this machine cannot run."""
    import builtins
    import importlib
    import os

    from cleaner_jax.rl import metrics_writer

    (tmp_path / "config.json").write_text('{"num_attention_heads": 4096}')  # 4096 heads: far over the bound
    c = _set(toy(), model__tiny_init=False, model__path=str(tmp_path), model__attention_impl="xla",
             data__train=str(tmp_path / "missing.parquet"), warmup_sft__steps=0,
             data__eval=f"toy,gpqa_diamond={tmp_path / 'missing.jsonl'}", train__weight_export_dir="/nonexistent/shm",
             train__compilation_cache_dir=str(tmp_path / "config.json"), train__loggers="tensorboard,wandb")

    def refuse(name: str):
        def probe(*args, **kwargs):
            raise AssertionError(f"validate() called {name}{args}")
        return probe

    with monkeypatch.context() as m:
        for where, module, name in [("os.path", os.path, "isdir"), ("os.path", os.path, "isfile"),
                                    ("os.path", os.path, "exists"), ("os", os, "stat"), ("builtins", builtins, "open"),
                                    ("importlib.util", importlib.util, "find_spec"), ("Path", Path, "is_file"),
                                    ("Path", Path, "exists"), ("Path", Path, "is_dir"),
                                    ("metrics_writer", metrics_writer, "wandb_installed")]:
            m.setattr(module, name, refuse(f"{where}.{name}"))
        run = validate(c)
    assert run.model.path == str(tmp_path)
    with pytest.raises(ConfigError, match=r"config\.model\.attention_impl: 'xla' materialises .* x 4096 heads"):
        check_environment(run)
    c.model.attention_impl, c.model.attention_block = "cudnn", 0  # the toy's query blocks are for 'xla' only
    rejects_here(c, r"config\.data\.train: training data .*missing\.parquet' not found")


def test_a_router_in_front_of_the_workers_validates_with_colocation_and_rollout_rescoring():
    """Neither contradicts it (checks._check_router says why); the key reaches the typed config."""
    c = _set(toy(), rollout__backend="sglang", rollout__server_urls="http://w:1,http://w:2",
             rollout__router_url="http://r:29900", rollout__colocated=True, train__xla_allocator="platform",
             train__xla_preallocate=False, saar__logprob_mode="rollout")
    assert validate(c).rollout.router_url == "http://r:29900"


def test_warm_start_needs_the_toy_task(tmp_path):
    c = toy()
    c.data.train = str(tmp_path / "train.jsonl")
    Path(c.data.train).touch()
    rejects(c, r"config\.warmup_sft\.steps: the scripted-teacher warm start exists for the toy task only")


def test_paper_config_requires_a_model_path():
    rejects(load_config("qwen3_4b_cleaner"), r"config\.model\.path")


def test_notool_baseline_with_saar_is_contradictory():
    c = load_config("qwen25_7b_notool")
    assert c.saar.enable is False and c.agent.use_tools is False
    c.saar.enable = True
    c.model.tiny_init = True
    c.model.path = None
    c.data.train = "toy"
    c.data.eval = ""
    rejects(c, r"config\.saar\.enable")


def test_rollout_logprob_mode_needs_untempered_sampling():
    c = toy()
    c.saar.logprob_mode = "rollout"
    validate(c)
    c.rollout.temperature = 0.7
    rejects(c, r"config\.saar\.logprob_mode")


# ----------------------------------------------------------------------------- components built directly


@pytest.mark.parametrize("build,pattern", [
    (lambda: SaarConfig(gamma=1.5), r"SaarConfig\.gamma: 1\.5 is out of range: must be in \[0\.0, 1\.0\]"),
    (lambda: SaarConfig(similarity="tokens"), r"SaarConfig\.similarity: 'tokens' is not allowed: use one of 'call', "),
    (lambda: AgentConfig(tool_call_parser="yaml"), r"AgentConfig\.tool_call_parser: 'yaml' is not allowed"),
    (lambda: AgentConfig(max_response_tokens=0), r"AgentConfig\.max_response_tokens: 0 is out of range"),
    (lambda: AgentConfig(saar={"gamma": 0.5}), r"AgentConfig\.saar: .* is not a SaarConfig"),
    (lambda: LearnerConfig(temperature=0.0), r"LearnerConfig\.temperature: 0\.0 is out of range: must be > 0\.0"),
    (lambda: OptimizerConfig(updates_per_lr_step=0), r"OptimizerConfig\.updates_per_lr_step: 0 is out of range"),
])
def test_components_built_directly_check_the_same_declarations(build, pattern):
    with pytest.raises(ConfigError, match=pattern):
        build()


# ----------------------------------------------------------------------------- wiring


def test_wiring_maps_each_key_onto_its_component_field():
    """The mapping written out by hand, with a distinct value per key."""
    c = _set(toy(), algo__loss="ppo", algo__clip_low=0.11, algo__clip_high=0.22, algo__dual_clip=3.5,
             algo__loss_agg="seq-mean-token-sum", algo__entropy_coef=0.01, algo__tis="token", algo__tis_cap=1.5,
             algo__logprob_chunk=64, algo__micro_batch_size=2, algo__mini_batches_per_step=2,
             optim__lr=3e-4, optim__warmup_steps=7, optim__weight_decay=0.05, optim__b1=0.8, optim__b2=0.95,
             optim__grad_clip=0.5, rollout__temperature=0.9,
             eval__temperature=0.7, eval__top_p=0.5, eval__top_k=5, saar__enable=False, saar__gamma=0.3, agent__tool_call_parser="strict")
    lc = wiring.learner_config(validate(c))
    loss, opt = lc.loss, lc.optimizer
    assert (loss.kind, loss.clip_low, loss.clip_high, loss.dual_clip_c, loss.agg) == ("ppo", 0.11, 0.22, 3.5,
                                                                                       "seq-mean-token-sum")
    assert (loss.entropy_coef, loss.tis, loss.tis_cap, loss.nll_sequences) == (0.01, "token", 1.5, "all")
    assert (opt.learning_rate, opt.warmup_steps, opt.weight_decay, opt.b1, opt.b2, opt.max_grad_norm) == (
        3e-4, 7, 0.05, 0.8, 0.95, 0.5)
    assert (opt.updates_per_lr_step, opt.eps) == (2, 1e-8)
    assert (lc.micro_batch_size, lc.logprob_micro_batch_size, lc.temperature, lc.logprob_chunk_size) == (2, 2, 0.9, 64)
    assert wiring.train_sampling(validate(c)) == {"temperature": 0.9, "top_p": 1.0, "top_k": -1}
    # truncated training sampling only without a ratio over the reported log-probs (tests/test_truncated_rollouts.py)
    truncated = _set(toy(), rollout__temperature=0.9, rollout__top_p=0.8, rollout__top_k=20)
    assert wiring.train_sampling(validate(truncated)) == {"temperature": 0.9, "top_p": 0.8, "top_k": 20}
    assert wiring.eval_sampling(validate(c)) == {"temperature": 0.7, "top_p": 0.5, "top_k": 5}  # apart from training's
    ac = validate(c).agent
    assert (ac.tool_call_parser, ac.max_assistant_turns, ac.saar.gamma, ac.saar.enable) == ("strict", 4, 0.3, False)


def test_wiring_data_sources_follow_the_config():
    c = toy()
    c.data.eval_limit = 3
    assert [len(v) for v in wiring.eval_benchmarks(validate(c)).values()] == [3]
    one = wiring.training_problems(validate(c))
    assert one(5) == one(5) and one(5) != one(6)  # deterministic per seed


# ----------------------------------------------------------------------------- the command line and sweeps


def _parse(argv: list[str]):
    """The config as `python -m cleaner_jax.train --config ... --config.a.b=v` builds it."""
    fv = flags.FlagValues()
    argv = ["prog", *argv]  # config_flags finds the `--config.*` overrides in argv when defined
    config_flags.DEFINE_config_file("config", None, "config file", flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    return fv.config


def test_command_line_overrides_are_typed_and_validated(tmp_path):
    c = _parse(["--config", str(ROOT / "configs/toy.py"), "--config.data.eval_limit=3", "--config.algo.dual_clip=4",
                "--config.agent.tool_call_parser=strict", "--config.rollout.decode_backend=xla"])
    run = validate(c)
    assert (run.data.eval_limit, run.algo.dual_clip, run.agent.tool_call_parser, run.rollout.decode_backend) == (
        3, 4.0, "strict", "xla")
    paper = _parse(["--config", str(ROOT / "configs/qwen3_4b_cleaner.py"), f"--config.model.path={tmp_path}"])
    assert paper.model.path == str(tmp_path)
    greedy = _parse(["--config", str(ROOT / "configs/toy.py"), "--config.rollout.temperature=0"])
    rejects(greedy, r"config\.rollout\.temperature: 0\.0 is out of range: must be > 0\.0")


def _sweep(argv: list[str]) -> str:
    spec = importlib.util.spec_from_file_location("sweep", ROOT / "launch" / "sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert mod.main(argv) == 0
    return out.getvalue()


def test_sweep_builds_valid_overrides(tmp_path):
    printed = _sweep(["--config", "configs/toy.py", "--workdir", str(tmp_path), "--grid", "saar.gamma=0.3,0.7",
                      "--grid", "algo.clip_high=0.2,0.28", "--set", "train.steps=20", "--print"])
    commands = [shlex.split(line) for line in printed.splitlines()]
    assert len(commands) == 4
    seen = set()
    for cmd in commands:
        assert cmd[:3] == [sys.executable, "-m", "cleaner_jax.train"]
        overrides = [a for a in cmd if a.startswith("--config.")]
        run = validate(_parse(["--config", str(ROOT / "configs/toy.py"), *overrides]))
        assert run.train.steps == 20
        seen.add((run.saar.gamma, run.algo.clip_high))
    assert seen == {(0.3, 0.2), (0.3, 0.28), (0.7, 0.2), (0.7, 0.28)}


@pytest.mark.parametrize("spec,pattern", [
    (["--grid", "saar.gama=0.3"], r"config\.saar\.gama: unknown key; the keys of config\.saar are: .*gamma"),
    (["--grid", "saar.gamma=0.3", "--set", "train.log_every=5"], r"config\.train\.log_every: unknown key"),
    (["--grid", "sar.gamma=0.3"], r"config\.sar\.gamma: unknown key; the sections are: "),
])
def test_sweep_rejects_an_unknown_key_before_any_run(spec, pattern, tmp_path):
    with pytest.raises(SystemExit, match=pattern):
        _sweep(["--config", "configs/toy.py", "--workdir", str(tmp_path), *spec])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("arg, named", [
    ("--config.saar.gama=0.3", "config.saar.gama: unknown key"),
    ("--config.sar.gamma=0.3", "config.sar: unknown key"),
    ("--config.saar.gamma.x=1", "config.saar.gamma.x: unknown key"),
])
def test_unknown_override_key_is_named_before_parsing(arg: str, named: str) -> None:
    from cleaner_jax.config import check_override_keys

    with pytest.raises(ConfigError, match=re.escape(named)):
        check_override_keys(["--workdir=x", arg])
    check_override_keys(["--config.saar.gamma=0.3", "--config.train.steps", "4"])  # known keys pass


def test_unknown_override_key_stops_the_cli_with_a_message(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "cleaner_jax.train", "--config", str(ROOT / "configs" / "toy.py"),
                          "--workdir", str(tmp_path), "--config.saar.gama=0.3"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    assert "error: config.saar.gama: unknown key" in out.stderr and "gamma" in out.stderr
    assert "Traceback" not in out.stderr


# ----------------------------------------------------------------------------- fleet checks (docs/scaling.md §5)


def _fleet(tmp_path, *, heads: int | None = 32, **values):
    """The toy config on a local model directory (with a config.json of `heads` heads, or none)."""
    if heads is not None:
        (tmp_path / "config.json").write_text(f'{{"num_attention_heads": {heads}}}')
    return _set(toy(), model__tiny_init=False, model__path=str(tmp_path), **values)


@pytest.mark.parametrize("fsdp", range(1, 9))
def test_micro_batch_must_split_over_the_fsdp_axis(fsdp, tmp_path):
    c = _fleet(tmp_path, mesh__fsdp=fsdp, algo__micro_batch_size=8, algo__mini_batches_per_step=1)
    if fsdp in (1, 2, 4, 8):  # the divisors of 8, listed by hand
        assert validate(c).mesh.fsdp == fsdp
    else:
        msg = rejects(c, r"config\.algo\.micro_batch_size: 8 rows per micro-batch \(train step and log-prob pass\) "
                         rf"do not split over the fsdp axis of mesh\.fsdp={fsdp}")
        assert f"multiple of {fsdp}" in msg


def test_all_devices_fsdp_is_checked_where_the_device_count_is_known(tmp_path):
    import jax

    from cleaner_jax.session import make_mesh

    assert jax.device_count() == 4  # tests/conftest.py
    c = _fleet(tmp_path, mesh__fsdp=-1, algo__micro_batch_size=2, algo__mini_batches_per_step=1)
    validate(c)  # -1: unknown until the devices are
    with pytest.raises(ConfigError, match=r"config\.algo\.micro_batch_size: 2 rows .* mesh\.fsdp=-1 \(= 4 on this "
                                          r"machine\): use a multiple of 4"):
        make_mesh(validate(c))
    c.algo.micro_batch_size = 4
    assert dict(make_mesh(validate(c)).shape) == {"fsdp": 4, "tp": 1}


def test_materialised_attention_scores_are_bounded(tmp_path):
    # one row per device (micro-batch 1, fsdp 1), 32 heads: 32 * T^2 * 4 bytes <= 8 GiB iff T <= 8192
    at = lambda t, **kw: _fleet(tmp_path, algo__micro_batch_size=1, agent__max_prompt_tokens=512,  # noqa: E731
                                agent__max_response_tokens=t - 512, **kw)
    assert 32 * 8192**2 * 4 == 8 * 2**30
    check_environment(validate(at(8192)))
    msg = rejects_here(at(8193), r"config\.model\.attention_impl: 'xla' materialises f32 attention scores per layer: "
                            r"1 row\(s\) per device x 32 heads / mesh\.tp=1 x T\^2 with T = agent\.max_prompt_tokens "
                            r"\+ agent\.max_response_tokens = 8193 is 8\.0 GiB, above the 8 GiB bound")
    assert "cudnn" in msg and "splash" in msg
    rejects_here(at(8193, model__attention_impl="xla_causal", model__attention_block=0),
                 r"config\.model\.attention_impl: 'xla_causal'")
    check_environment(validate(at(23040, model__attention_impl="cudnn", model__attention_block=0)))  # flash: no bound
    rejects(at(1024, model__attention_impl="cudnn", model__attention_block=32),  # blocks only the masked impl
            r"config\.model\.attention_block: 32 blocks the masked attention .* set model\.attention_block=0")
    check_environment(validate(at(23040, mesh__tp=8)))  # tp=8: 4 heads per device, 7.9 GiB
    # the paper's budget (23,040 tokens), 4 rows per micro-batch over fsdp=4: one row, 63.3 GiB
    paper = _fleet(tmp_path, algo__micro_batch_size=4, mesh__fsdp=4, agent__max_prompt_tokens=2560,
                   agent__max_response_tokens=20480)
    want = 1 * 32 * 23040**2 * 4 / 2**30
    rejects_here(paper, rf"per device x 32 heads .* = 23040 is {want:.1f} GiB")
    # validate() alone counts one head, a lower bound: 4 rows of one head at 23,040 tokens (7.9 GiB) pass,
    # 8 rows (15.8 GiB) are over the bound whatever config.json says
    validate(_fleet(tmp_path, algo__micro_batch_size=4, mesh__fsdp=1, agent__max_prompt_tokens=2560,
                    agent__max_response_tokens=20480))
    rejects(_fleet(tmp_path, algo__micro_batch_size=8, mesh__fsdp=1, agent__max_prompt_tokens=2560,
                   agent__max_response_tokens=20480),
            r"8 row\(s\) per device x 1 head \(a lower bound until the start-up check reads model\.path's "
            r"config\.json\)")


def test_attention_bound_without_a_config_json_counts_one_head(tmp_path):
    budget = dict(agent__max_prompt_tokens=2560, agent__max_response_tokens=20480)
    check_environment(validate(_fleet(tmp_path, heads=None, algo__micro_batch_size=4, **budget)))  # 7.9 GiB
    rejects(_fleet(tmp_path, heads=None, algo__micro_batch_size=8, **budget),
            r"8 row\(s\) per device x 1 head \(a lower bound until the start-up check reads")
    # where the device count is known (mesh.fsdp=-1), a directory without config.json still counts one head
    from cleaner_jax.config import check_mesh

    with pytest.raises(ConfigError, match=r"8 row\(s\) per device x 1 head \(model\.path has no config\.json yet: "
                                          r"at least 1\)"):
        check_mesh(validate(_fleet(tmp_path, heads=None, algo__micro_batch_size=8, mesh__fsdp=-1, **budget)), 1)


def test_sandbox_warning_above_the_authors_episodes_per_worker(tmp_path):
    from cleaner_jax.config import sandbox_warning

    paper = load_config("qwen3_4b_cleaner")
    paper.model.path = str(tmp_path)
    paper.data.train = str(tmp_path / "train.parquet")
    Path(paper.data.train).touch()
    assert paper.sandbox.workers == 64  # the paper configs use the authors' code-judge pool
    assert sandbox_warning(validate(paper)) is None
    paper.sandbox.workers = 4  # the default: 128 x 16 = 2048 episodes over 4 workers
    msg = sandbox_warning(validate(paper))
    assert msg is not None and msg.startswith("config.sandbox.workers=4 for 2048 concurrent episodes")
    assert "queue behind 511 others" in msg and "sandbox.workers >= 64" in msg  # 2048 / 32 = 64
    paper.sandbox.workers = 63
    assert sandbox_warning(validate(paper)) is not None
    assert sandbox_warning(validate(toy())) is None  # 16 episodes, 2 workers
    notool = load_config("qwen3_4b_notool")
    notool.model.path, notool.data.train = paper.model.path, paper.data.train
    assert sandbox_warning(validate(notool)) is None  # no tool calls at all


@pytest.mark.parametrize("name", [n for n in CONFIG_FILES if n.startswith("qwen")])
def test_paper_configs_pass_the_fleet_checks_with_a_real_head_count(name, tmp_path):
    c = load_config(name)
    (tmp_path / "config.json").write_text('{"num_attention_heads": 32}')  # Qwen3-4B's; Qwen2.5-7B has 28
    c.model.path = str(tmp_path)
    c.data.train = str(tmp_path / "train.parquet")
    Path(c.data.train).touch()
    check_environment(validate(c))  # flash attention: no score bound; micro-batch 4 over fsdp=-1 checked at make_mesh
    c.model.attention_impl = "xla"
    rejects_here(c, r"config\.model\.attention_impl: 'xla' materialises .* = 23040 is 63\.3 GiB")  # 32 * 23040^2 * 4 B


def test_an_unreadable_model_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    rejects_here(_fleet(tmp_path, heads=None), r"config\.model\.path: cannot read .*config\.json")
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    rejects_here(_fleet(tmp_path, heads=None),
                 r"config\.model\.path: .*config\.json has no integer num_attention_heads")
