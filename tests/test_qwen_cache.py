"""KV-cache decoding vs full forward passes and vs transformers `generate`."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from cleaner_jax.models import params, qwen
from cleaner_jax.testing.decode import greedy_decoder
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def case(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5, with_tokenizer=False,
                                initializer_range=0.05)  # 0.02 makes tied qwen3 repeat one token
    return params.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@nnx.jit
def forward(model, ids):
    return model(ids)


@nnx.jit
def step(model, ids, cache, attention_mask=None):
    return model(ids, attention_mask=attention_mask, cache=cache)


def test_incremental_decoding_equals_full_forward(case):
    model, _ = case
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 12)), jnp.int32)
    full = np.asarray(forward(model, ids))
    cache = qwen.init_cache(model.config, batch=2, max_len=16)
    logits, cache = step(model, ids[:, :5], cache)  # prefill 5, then one token at a time
    pieces = [np.asarray(logits)]
    for t in range(5, 12):
        logits, cache = step(model, ids[:, t : t + 1], cache)
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [12, 12])


def test_greedy_tokens_equal_transformers_generate(case):
    model, hf_model = case
    prompt = np.random.default_rng(1).integers(0, 512, (2, 6))
    steps = 40
    ours = np.asarray(greedy_decoder(model, steps)(jnp.asarray(prompt, jnp.int32)))
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long), do_sample=False,
            max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0,
        )[:, prompt.shape[1]:].numpy()
    assert min(len(set(r.tolist())) for r in ref) > 10  # the model is not stuck on one token
    np.testing.assert_array_equal(ours, ref)


def test_right_padded_prefill_of_different_lengths_equals_per_row(case):
    """One batched prefill of prompts of lengths 7, 3, 9, then 4 decode steps, vs each row run alone in HF."""
    model, hf_model = case
    rng = np.random.default_rng(2)
    lengths = [7, 3, 9]
    prompts = [rng.integers(0, 512, n) for n in lengths]
    continuation = rng.integers(0, 512, (3, 4))
    ids = np.zeros((3, max(lengths)), np.int64)
    mask = np.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, : len(p)], mask[b, : len(p)] = p, 1
    cache = qwen.init_cache(model.config, batch=3, max_len=16)
    logits, cache = step(model, jnp.asarray(ids, jnp.int32), cache, jnp.asarray(mask, jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    last_prefill = np.asarray(logits)[np.arange(3), np.array(lengths) - 1]  # [3, V]
    decoded = []
    for t in range(4):
        logits, cache = step(model, jnp.asarray(continuation[:, t : t + 1], jnp.int32), cache)
        decoded.append(np.asarray(logits)[:, 0])
    for b, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf_model(torch.tensor(np.concatenate([p, continuation[b]])[None])).logits[0].numpy()
        np.testing.assert_allclose(last_prefill[b], ref[len(p) - 1], atol=1e-4, rtol=0)
        np.testing.assert_allclose(np.stack([d[b] for d in decoded]), ref[len(p):], atol=1e-4, rtol=0)


def test_cached_mask_by_hand():
    """Row 0: 2 cached tokens, then 2 real new ones of 3; row 1 idle in this call (no real new
    token): a real query sees the cache and the new tokens up to itself, a pad query nothing."""
    import numpy as np

    from cleaner_jax.models.layers import cached_mask

    got = np.asarray(cached_mask(np.array([2, 1]), np.array([[1, 1, 0], [0, 0, 0]]), 3, 6))
    want = np.zeros((2, 3, 6), bool)
    want[0, 0, :3] = True  # slots 0-1 cached, slot 2 itself
    want[0, 1, :4] = True
    assert got.tolist() == want.tolist()
