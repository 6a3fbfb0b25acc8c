"""Config errors fail at start-up with a message naming the key."""
import importlib.util
from pathlib import Path

import pytest

from cleaner_jax.config import ConfigError, base_config, validate

ROOT = Path(__file__).resolve().parents[1]


def load_config(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def toy():
    return load_config("toy")


def test_toy_config_is_valid():
    validate(toy())


def test_unknown_key_is_rejected_with_its_name():
    c = toy()
    with pytest.raises(AttributeError, match="gama"):
        c.saar.gama = 0.3


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("saar.gamma", 1.5, "config.saar.gamma"),
        ("saar.gamma", -0.1, "config.saar.gamma"),
        ("saar.max_retries", -1, "config.saar.max_retries"),
        ("data.train", "/nonexistent/train.parquet", "config.data.train"),
        ("algo.advantage", "ppo", "config.algo.advantage"),
        ("algo.micro_batch_size", 3, "config.algo.micro_batch_size"),
        ("model.compute_dtype", "float8", "config.model.compute_dtype"),
    ],
)
def test_bad_values_fail_naming_the_key(key, value, needle):
    c = toy()
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        validate(c)


def test_rollout_logprob_mode_needs_untempered_sampling():
    c = toy()
    c.saar.logprob_mode = "rollout"
    validate(c)
    c.rollout.temperature = 0.7
    with pytest.raises(ConfigError, match=r"config\.saar\.logprob_mode"):
        validate(c)


def test_paper_config_requires_a_model_path():
    c = load_config("qwen3_4b_cleaner")
    with pytest.raises(ConfigError, match=r"config\.model\.path"):
        validate(c)


def test_notool_baseline_with_saar_is_contradictory():
    c = load_config("qwen25_7b_notool")
    assert c.saar.enable is False and c.agent.use_tools is False
    c.saar.enable = True
    c.model.tiny_init = True
    c.data.train = "toy"
    with pytest.raises(ConfigError, match=r"config\.saar\.enable"):
        validate(c)


def test_paper_configs_match_the_authors_settings():
    """Values from the authors' scripts (open_cleaner.md §4.1), written out by hand."""
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
