"""The warm-start cache: its key follows exactly the values the warm start reads, and its
entries are reused and copied whole (cleaner_jax/toy/warm_cache.py)."""
import dataclasses
import json
import typing

import pytest
from _configs import load_config

from cleaner_jax import schema
from cleaner_jax.config import SECTIONS, validate
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.toy import warm_cache

def key(edit=None):
    c = load_config("toy")
    if edit is not None:
        edit(c)
    return warm_cache.warm_key(validate(c)), warm_cache.eval_key(validate(c))


def setter(path, value):
    section, name = path.split(".")
    return lambda c: c[section].__setitem__(name, value)


BASE = key()


@pytest.mark.parametrize("path, value", [
    ("saar.enable", False), ("saar.splice_correction", "tis"), ("saar.gamma", 0.3), ("algo.loss", "nll"),
    ("algo.group_size", 8), ("algo.advantage", "rloo"), ("optim.lr", 3e-5), ("optim.warmup_steps", 7),
    ("train.steps", 3), ("train.eval_every", 1), ("warmup_sft.cache_dir", "/somewhere/else"),
    ("train.compilation_cache_dir", "/somewhere/xla"),
    ("rollout.temperature", 0.7), ("sandbox.workers", 3),
    # how a sandbox fault is handled, not what a demonstration's call may do
    ("sandbox.hang_grace_s", 5.0), ("sandbox.infra_retries", 0),
    ("algo.logprob_chunk", 64),  # the RL learner's chunking; the fit's is warmup_sft.logprob_chunk
    ("model.attention_block", 0),  # the RL learner's query blocks; the fit's are warmup_sft.attention_block
])
def test_keys_the_warm_start_does_not_read_keep_the_key(path, value):
    assert key(setter(path, value))[0] == BASE[0]


def other(value, path):
    """A valid value of the key `path` that differs from `value` (the key is computed from the
    validated config, as the trainer passes it)."""
    section, name = path.split(".")
    _, tp = schema.split_optional(schema.defaults(SECTIONS[section])[name][0])
    if typing.get_origin(tp) is typing.Literal:
        return next(v for v in typing.get_args(tp) if v != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1 if isinstance(value, int) else value * 0.5 + 0.0123
    return f"{value}_other"


@pytest.mark.parametrize("path", [
    "train.seed", "data.toy_max_operand", "data.toy_num_ops", "model.tiny_hidden_size", "model.tiny_num_layers",
    "model.compute_dtype", "agent.max_response_tokens", "agent.chunk_template", "agent.observation_max_chars",
    "sandbox.timeout_s", "mesh.fsdp",
    # every warmup_sft key (the fit and the teacher's habits), whatever keys the section has now
    *(f"warmup_sft.{k}" for k in load_config("toy").warmup_sft if k != "cache_dir"),
])
def test_keys_the_warm_start_reads_change_the_key(path):
    section, name = path.split(".")
    current = load_config("toy")[section][name]
    assert key(setter(path, other(current, path)))[0] != BASE[0]


def test_reuse_by_other_code_warns(tmp_path, caplog):
    c = load_config("toy")
    c.warmup_sft.cache_dir = str(tmp_path / "cache")
    build = lambda out: (out.mkdir(parents=True), (out / "config.json").write_text("{}"))  # noqa: E731
    warm_cache.fetch_warm_start(validate(c), tmp_path / "a", build)
    key_file = tmp_path / "cache" / warm_cache.warm_key(validate(c)) / "key.json"
    recorded = json.loads(key_file.read_text())
    assert recorded["code"] == warm_cache.source_fingerprint() and len(recorded["code"]) == 64
    with caplog.at_level("WARNING", logger="cleaner_jax.toy.warm_cache"):
        warm_cache.fetch_warm_start(validate(c), tmp_path / "b", build)
    assert "other code" not in caplog.text
    key_file.write_text(json.dumps({**recorded, "code": "0" * 64}))
    with caplog.at_level("WARNING", logger="cleaner_jax.toy.warm_cache"):
        warm_cache.fetch_warm_start(validate(c), tmp_path / "c", build)
    assert "made by other code (source fingerprint 000000000000" in caplog.text


@pytest.mark.parametrize("path, same", [
    ("saar.enable", True), ("saar.splice_correction", True), ("saar.splice_cap", True), ("algo.loss", True),
    ("saar.logprob_mode", True), ("saar.rollback_probability", True), ("optim.lr", True),
    ("rollout.continue_aborted", True),
    ("eval.n", False), ("data.eval_limit", False), ("eval.temperature", False), ("eval.seed", False),
    ("saar.gamma", False), ("saar.max_retries", False), ("eval.saar", False), ("rollout.decode_backend", False),
    ("reward.math_mode", False),
])
def test_step0_evaluation_key(path, same):
    section, name = path.split(".")
    current = load_config("toy")[section][name]
    assert (key(setter(path, 3 if current is None else other(current, path)))[1] == BASE[1]) == same


def test_teacher_runs_with_the_faithful_saar_settings_whatever_the_arm():
    raw, cleaner = load_config("toy"), load_config("toy")
    raw.saar.enable = False
    raw.saar.splice_correction = "none"
    cleaner.saar.splice_correction = "tis"
    a, b = warm_cache.teacher_agent(validate(raw).agent), warm_cache.teacher_agent(validate(cleaner).agent)
    assert a == b and a.saar == SaarConfig()
    assert dataclasses.replace(a, saar=validate(raw).agent.saar) == validate(raw).agent  # only saar is replaced


def test_warm_start_built_once_then_copied(tmp_path):
    c = load_config("toy")
    c.warmup_sft.cache_dir = str(tmp_path / "cache")
    calls = []

    def build(out):
        calls.append(out)
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"built": len(calls)}))
        return out

    assert warm_cache.fetch_warm_start(validate(c), tmp_path / "run_a" / "warm_start_model", build) is False
    assert warm_cache.fetch_warm_start(validate(c), tmp_path / "run_b" / "warm_start_model", build) is True
    assert len(calls) == 1
    for run in ("run_a", "run_b"):
        assert json.loads((tmp_path / run / "warm_start_model" / "config.json").read_text()) == {"built": 1}
        assert not list((tmp_path / run).glob(".*"))  # no partial copy left behind
    entry = tmp_path / "cache" / warm_cache.warm_key(validate(c))
    assert json.loads((entry / "key.json").read_text())["config"]["train"] == {"seed": 0}
    c.train.seed = 1  # another seed: another warm start
    assert warm_cache.fetch_warm_start(validate(c), tmp_path / "run_c" / "warm_start_model", build) is False
    assert len(calls) == 2


def test_step0_evaluation_stored_and_loaded(tmp_path):
    c = load_config("toy")
    c.warmup_sft.cache_dir = str(tmp_path / "cache")
    assert warm_cache.load_step0_eval(validate(c), tmp_path / "a" / "eval" / "step_000000") is None
    ev = tmp_path / "first" / "eval" / "step_000000"
    (ev / "samples").mkdir(parents=True)
    (ev / "results.json").write_text("{}")
    (ev / "samples" / "toy.saar_off.jsonl").write_text('{"x": 1}\n')
    metrics = {"eval/toy/mean@2": 0.1 + 0.2, "eval/toy/pass@1": 1 / 3}
    warm_cache.store_step0_eval(validate(c), ev, metrics)
    warm_cache.store_step0_eval(validate(c), ev, {"eval/toy/mean@2": 9.0})  # a second writer keeps the first
    out = tmp_path / "second" / "eval" / "step_000000"
    assert warm_cache.load_step0_eval(validate(c), out) == metrics  # floats exactly, through JSON
    assert (out / "samples" / "toy.saar_off.jsonl").read_text() == '{"x": 1}\n'
    c.saar.enable = False  # another arm of the seed: the same evaluation
    assert warm_cache.load_step0_eval(validate(c), tmp_path / "third" / "eval" / "step_000000") == metrics
    c.eval.n = c.eval.n + 1  # other evaluation settings: not cached
    assert warm_cache.load_step0_eval(validate(c), tmp_path / "fourth" / "eval" / "step_000000") is None
