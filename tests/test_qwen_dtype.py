"""Dtype policy, remat (gradients vs torch autograd) and the attention-implementation switch."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from cleaner_jax.models import params
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q2"), "qwen2", seed=13, with_tokenizer=False)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


IDS = np.random.default_rng(0).integers(0, 512, (2, 12))


@pytest.mark.parametrize("overrides", [dict(dtype="bfloat16"), pytest.param(dict(dtype="float16"), marks=pytest.mark.slow),
                                       dict(param_dtype="float32", compute_dtype="bfloat16")])
def test_low_precision_runs_and_is_close_to_float32(checkpoint, hf_model, overrides):
    model = params.from_pretrained(checkpoint, **overrides)
    cfg = model.config
    assert model.layers[0].mlp.up_proj.kernel.get_value().dtype == jnp.dtype(cfg.param_dtype)
    h = nnx.jit(lambda m, x: m.hidden_states(x))(model, jnp.asarray(IDS, jnp.int32))
    assert h.dtype == jnp.dtype(cfg.compute_dtype)
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(IDS, jnp.int32)))
    assert logits.dtype == np.float32
    with torch.no_grad():
        ref = hf_model(torch.tensor(IDS)).logits.numpy()
    scale = np.abs(ref).max()
    err = np.abs(logits - ref).max()
    assert err < 0.05 * scale, (err, scale)  # close-ish: bf16 has 8 mantissa bits
    assert err > 1e-6  # really computed in low precision
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def next_token_loss(logits, ids):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


# "dots" in the default run: the gradient math is the same for every policy, remat only changes
# what is stored, so one policy checks both the backward pass and the remat wiring.
@pytest.mark.parametrize("remat", ["dots", pytest.param("none", marks=pytest.mark.slow),
                                   pytest.param("full", marks=pytest.mark.slow),
                                   pytest.param("dots_no_batch", marks=pytest.mark.slow)])
def test_gradients_match_torch_autograd(checkpoint, hf_model, remat):
    model = params.from_pretrained(checkpoint, remat=remat)
    graphdef, state = nnx.split(model)

    @jax.jit
    def grad_fn(state, ids):
        return jax.grad(lambda s: next_token_loss(nnx.merge(graphdef, s)(ids), ids))(state)

    grads = grad_fn(state, jnp.asarray(IDS, jnp.int32))
    hf_model.zero_grad()
    ids_t = torch.tensor(IDS)
    torch.nn.functional.cross_entropy(hf_model(ids_t).logits[:, :-1].reshape(-1, 512), ids_t[:, 1:].reshape(-1)).backward()
    named = dict(hf_model.named_parameters())
    pairs = {
        "model.layers.0.self_attn.q_proj.weight": grads["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value().T,
        "model.layers.0.self_attn.k_proj.bias": grads["layers"][0]["self_attn"]["k_proj"]["bias"].get_value(),
        "model.layers.1.mlp.down_proj.weight": grads["layers"][1]["mlp"]["down_proj"]["kernel"].get_value().T,
        "model.layers.1.input_layernorm.weight": grads["layers"][1]["input_layernorm"]["weight"].get_value(),
        "model.embed_tokens.weight": grads["embed_tokens"]["embedding"].get_value(),
        "lm_head.weight": grads["lm_head"]["kernel"].get_value().T,
    }
    for name, ours in pairs.items():
        ref = named[name].grad.numpy()
        assert np.abs(ref).max() > 1e-4, name
        np.testing.assert_allclose(np.asarray(ours), ref, atol=2e-6 + 1e-4 * np.abs(ref).max(), rtol=0, err_msg=name)


def test_cudnn_attention_on_cpu_fails_clearly(checkpoint):
    if jax.default_backend() == "gpu":
        pytest.skip("this checks the CPU error message")
    # fails when the model is built, before anything is traced, naming the config key
    with pytest.raises(RuntimeError, match=r"model\.attention_impl='cudnn'.*GPU.*'cpu'.*attention_impl='xla'"):
        params.from_pretrained(checkpoint, dtype="bfloat16", attention_impl="cudnn")
    with pytest.raises(RuntimeError, match=r"model\.attention_impl='splash'.*TPU.*'cpu'.*attention_impl='xla'"):
        params.from_pretrained(checkpoint, dtype="bfloat16", attention_impl="splash")


def test_bad_policy_values_are_rejected(checkpoint):
    with pytest.raises(ValueError, match="compute_dtype"):
        params.from_pretrained(checkpoint, compute_dtype="float8")
    with pytest.raises(ValueError, match="remat"):
        params.from_pretrained(checkpoint, remat="everything")
