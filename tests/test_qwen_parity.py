"""Logits of the NNX Qwen port vs Hugging Face transformers (torch, float32) on tiny random checkpoints."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx
import jax.numpy as jnp
from transformers import AutoModelForCausalLM

from cleaner_jax.models import params, qwen
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint

CASES = {
    "qwen3_tied": ("qwen3", {}),
    "qwen2_untied": ("qwen2", {}),
    "qwen3_untied_theta_headdim": ("qwen3", dict(tie_word_embeddings=False, rope_theta=1e6, head_dim=24)),
    "qwen2_tied_theta": ("qwen2", dict(tie_word_embeddings=True, rope_theta=5e5)),
    "qwen3_mqa_eps": ("qwen3", dict(num_key_value_heads=1, rms_norm_eps=1e-5)),
    "qwen3_attention_bias": ("qwen3", dict(attention_bias=True)),  # biases on q/k/v and o_proj
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(our model, the transformers model) loaded from one random checkpoint."""
    family, overrides = CASES[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family, seed=3, with_tokenizer=False, **overrides)
    return params.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def hf_logits(hf_model, ids: np.ndarray, **kw) -> np.ndarray:
    with torch.no_grad():
        kw = {k: torch.tensor(v) for k, v in kw.items()}
        return hf_model(torch.tensor(ids), **kw).logits.numpy()


@nnx.jit
def forward(model, ids, positions=None, attention_mask=None):
    return model(ids, positions, attention_mask=attention_mask)


def test_logits_match_transformers(case):
    model, hf_model = case
    ids = np.random.default_rng(0).integers(0, 512, (2, 16))
    ours = np.asarray(forward(model, jnp.asarray(ids, jnp.int32)))
    ref = hf_logits(hf_model, ids)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.abs(ref).max() > 1.0  # the logits carry signal, so a 1e-4 match means something
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


SUBSET = ("qwen3_tied", "qwen2_untied")  # cases for the slower mask/hidden-state checks (keep the suite fast)


@pytest.mark.parametrize("case", SUBSET, indirect=True)
def test_left_padded_batch_with_mask_and_positions(case):
    """Left padding: pad keys are never attended and positions skip the pads, as in HF."""
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 512, (2, 10))
    mask = np.ones((2, 10), np.int64)
    mask[1, :4] = 0
    ids[1, :4] = 0
    positions = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    model, hf_model = case
    ours = np.asarray(forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(positions, jnp.int32),
                              jnp.asarray(mask, jnp.int32)))
    ref = hf_logits(hf_model, ids, attention_mask=mask, position_ids=positions)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)
    # And the padded row's real tokens equal the unpadded sequence alone.
    alone = hf_logits(hf_model, ids[1:, 4:])
    np.testing.assert_allclose(ours[1, 4:], alone[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", SUBSET, indirect=True)
def test_hidden_states_and_lm_head_kernel_give_logits(case):
    model, hf_model = case
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 512, (1, 8)), jnp.int32)
    logits = nnx.jit(lambda m, x: qwen.logits_from_hidden(m.hidden_states(x), m.lm_head_kernel()))(model, ids)
    ref = hf_logits(hf_model, np.asarray(ids))
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("rows", [1, 2, 8, 9])
def test_xla_ops_match_numpy(rows):
    """The model's default ops (models/ops.py): plain x @ w and x @ w_t^T for any row count."""
    import jax

    from cleaner_jax.models.ops import XLA

    rng = np.random.default_rng(rows)
    x, w = rng.normal(size=(rows, 48)).astype(np.float32), rng.normal(size=(48, 40)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    for fn, weight in ((XLA.dense, w), (XLA.dense_t, np.ascontiguousarray(w.T))):
        got = np.asarray(jax.jit(fn)(jnp.asarray(x), jnp.asarray(weight)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        dots = [e for e in jax.make_jaxpr(fn)(x, weight).eqns if e.primitive.name == "dot_general"]
        assert len(dots) == 1, "one plain dot, no dispatch"
