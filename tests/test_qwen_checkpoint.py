"""HF checkpoint I/O: round trips through transformers, bit-identical reloads, and clear errors."""
from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from cleaner_jax.models import params
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q3"), "qwen3", seed=7)


@pytest.fixture(scope="module")
def qwen2_sharded_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q2"), "qwen2", seed=8, num_shards=3, with_tokenizer=False)


def hf_logits(path, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(torch.tensor(ids)).logits.numpy()


def params_of(model) -> dict:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("which", ["qwen3_dir", "qwen2_sharded_dir"])
def test_save_then_transformers_load_gives_same_logits(which, request, tmp_path):
    src = request.getfixturevalue(which)
    ids = np.random.default_rng(0).integers(0, 512, (2, 9))
    out = params.save_pretrained(params.from_pretrained(src), tmp_path / "out")
    assert load_file(str(out / "model.safetensors")) is not None
    np.testing.assert_allclose(hf_logits(out, ids), hf_logits(src, ids), atol=1e-6, rtol=0)


def test_save_writes_hf_names_and_copies_tokenizer(qwen3_dir, tmp_path):
    out = params.save_pretrained(params.from_pretrained(qwen3_dir), tmp_path / "out", tokenizer_from=qwen3_dir)
    original = load_file(str(qwen3_dir / "model.safetensors"))
    saved = load_file(str(out / "model.safetensors"))
    assert sorted(saved) == sorted(original)
    for name in original:  # f32 round trip is exact
        np.testing.assert_array_equal(saved[name], original[name], err_msg=name)
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "numpy") as f:
        assert f.metadata() == {"format": "pt"}
    tok, ref_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(qwen3_dir)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert json.loads((out / "generation_config.json").read_text()) == \
        json.loads((qwen3_dir / "generation_config.json").read_text())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_save_load_is_bit_identical(qwen2_sharded_dir, tmp_path, dtype):
    first = params.from_pretrained(qwen2_sharded_dir, dtype=dtype)
    params.save_pretrained(first, tmp_path / "a")
    second = params.from_pretrained(tmp_path / "a", dtype=dtype)
    a, b = params_of(first), params_of(second)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(a[name].view(np.uint8), b[name].view(np.uint8), err_msg=name)


def test_save_shards_large_models_with_an_index(qwen3_dir, tmp_path):
    model = params.from_pretrained(qwen3_dir)
    out = params.save_pretrained(model, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (out / "model.safetensors").exists()
    ids = np.random.default_rng(3).integers(0, 512, (1, 7))
    np.testing.assert_allclose(hf_logits(out, ids), hf_logits(qwen3_dir, ids), atol=1e-6, rtol=0)


# ---- bad input -------------------------------------------------------------------------------

def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_directory_or_weights_name_the_path(qwen3_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        params.from_pretrained(tmp_path / "nowhere")
    d = copy_ckpt(qwen3_dir, tmp_path / "c")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        params.from_pretrained(d)


def test_missing_shard_file_is_named(qwen2_sharded_dir, tmp_path):
    d = copy_ckpt(qwen2_sharded_dir, tmp_path / "c")
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        params.from_pretrained(d)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, ValueError, "LlamaForCausalLM"),
        ({"architectures": ["Qwen3MoeForCausalLM"]}, ValueError, "Qwen3MoeForCausalLM"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, NotImplementedError, "yarn"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, NotImplementedError, "linear"),
        ({"use_sliding_window": True, "sliding_window": 128}, NotImplementedError, "sliding"),
        ({"hidden_act": "gelu"}, ValueError, "gelu"),
    ],
)
def test_unsupported_config_is_rejected_with_the_reason(qwen3_dir, tmp_path, change, error, match):
    d = copy_ckpt(qwen3_dir, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(error, match=match) as info:
        params.from_pretrained(d)
    assert "config.json" in str(info.value)


def test_transformers5_rope_parameters_are_read(qwen3_dir, tmp_path):
    d = copy_ckpt(qwen3_dir, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["rope_theta"], cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.0}
    (d / "config.json").write_text(json.dumps(cfg))
    assert params.from_pretrained(d).config.rope_theta == 12345.0


def _rewrite_weights(d, edit):
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_mismatched_tensor_shape_names_file_and_tensor(qwen3_dir, tmp_path):
    d = copy_ckpt(qwen3_dir, tmp_path / "c")
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite_weights(d, lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(ValueError, match=rf"model\.safetensors.*{name}.*\(127, 64\)"):
        params.from_pretrained(d)


def test_missing_and_unexpected_tensors_are_named(qwen3_dir, tmp_path):
    d = copy_ckpt(qwen3_dir, tmp_path / "c")
    _rewrite_weights(d, lambda t: t.pop("model.layers.0.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"lacks tensors \['model\.layers\.0\.self_attn\.k_norm\.weight'\]"):
        params.from_pretrained(d)
    d2 = copy_ckpt(qwen3_dir, tmp_path / "c2")
    _rewrite_weights(d2, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", np.zeros(64, np.float32)))
    with pytest.raises(ValueError, match=r"does not use: \['model\.layers\.0\.self_attn\.q_proj\.bias'\]"):
        params.from_pretrained(d2)


def test_in_place_weight_update_reaches_a_compiled_forward(qwen3_dir, tmp_path):
    """Weight sync: nnx.update(model, new_state) changes what an already-jitted forward computes."""
    other = make_tiny_checkpoint(tmp_path / "other", "qwen3", seed=99, with_tokenizer=False)
    model = params.from_pretrained(qwen3_dir)
    forward = nnx.jit(lambda m, x: m(x))
    ids = np.random.default_rng(4).integers(0, 512, (1, 6))
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(ids, jnp.int32))), hf_logits(qwen3_dir, ids),
                               atol=1e-4, rtol=0)
    nnx.update(model, nnx.state(params.from_pretrained(other), nnx.Param))
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(ids, jnp.int32))), hf_logits(other, ids),
                               atol=1e-4, rtol=0)
