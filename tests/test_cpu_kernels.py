"""The C++ decode-attention kernel (models/cpu_kernels.py) against a float64 NumPy reference,
its dispatch from `layers.cached_attention`, and what happens when it cannot be built."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cleaner_jax.models import cpu_kernels, layers


@pytest.fixture
def kernels_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail instead of falling back, so these tests never pass without the kernel."""
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "on")
    assert cpu_kernels.available()


def reference_attention(q, k_t, v, mask) -> np.ndarray:
    """q [B, KV, G, hd]; k_t [B, KV, hd, S]; v [B, KV, S, hd]; mask [B, S] -> [B, KV, G, hd], in
    float64: softmax over the valid slots, or uniform over all slots when none is valid."""
    q, k_t, v = (np.asarray(a, np.float64) for a in (q, k_t, v))
    scores = np.einsum("bkgh,bkhs->bkgs", q, k_t) / np.sqrt(q.shape[-1])
    valid = mask[:, None, None, :]
    scores = np.where(valid, scores, -np.inf)
    none_valid = ~mask.any(-1)
    scores[none_valid] = 0.0  # all slots equal: uniform
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bkgs,bksh->bkgh", w, v)


def make_inputs(rng, b, kv, g, hd, s):
    q = rng.standard_normal((b, kv, g, hd)).astype(np.float32)
    k_t = rng.standard_normal((b, kv, hd, s)).astype(np.float32)
    v = rng.standard_normal((b, kv, s, hd)).astype(np.float32)
    return q, k_t, v


@pytest.mark.parametrize("b,kv,g,hd,s", [(3, 2, 2, 64, 40), (2, 1, 4, 16, 7), (5, 2, 1, 8, 257), (1, 4, 3, 32, 1)])
def test_decode_attention_matches_float64_reference(kernels_on, b, kv, g, hd, s):
    rng = np.random.default_rng(b * 100 + s)
    q, k_t, v = make_inputs(rng, b, kv, g, hd, s)
    mask = rng.random((b, s)) < 0.6
    mask[-1, 0] = True
    if b > 1:
        mask[0, :] = False  # no valid slot (a padding row): uniform weights
    if b > 2:
        mask[1, s // 2:] = False  # valid slots, then an empty tail, which the kernel skips
        mask[2, :] = True
    got = jax.jit(cpu_kernels.decode_attention, static_argnums=4)(q, k_t, v, mask, hd**-0.5)
    np.testing.assert_allclose(np.asarray(got), reference_attention(q, k_t, v, mask), rtol=1e-5, atol=1e-5)


def test_cached_attention_dispatch_and_gradient(kernels_on, monkeypatch):
    """One new token goes to the kernel, more go to XLA; gradients flow through the XLA form."""
    rng = np.random.default_rng(0)
    b, kv, g, hd, s = 2, 2, 2, 16, 24
    q, k_t, v = make_inputs(rng, b, kv, g, hd, s)
    q = q.reshape(b, 1, kv * g, hd)  # the model's layout: [B, T, N, hd]
    mask = np.zeros((b, 1, s), bool)
    mask[0, 0, :5] = True
    mask[1, 0, [0, 3, 9]] = True

    def ffi_calls(fn, *args) -> int:
        # a fresh lambda each time: JAX caches traces per function, and the mode is read at trace time
        return str(jax.make_jaxpr(lambda *a: fn(*a))(*args)).count("cj_decode_attention")

    assert ffi_calls(layers.cached_attention, q, k_t, v, mask) == 1
    q2 = np.concatenate([q, q], axis=1)
    assert ffi_calls(layers.cached_attention, q2, k_t, v, np.concatenate([mask, mask], 1)) == 0
    assert ffi_calls(layers.cached_attention, q.astype(jnp.bfloat16), k_t, v, mask) == 0

    want = reference_attention(q.reshape(b, kv, g, hd), k_t, v, mask[:, 0]).reshape(b, 1, kv * g, hd)
    np.testing.assert_allclose(np.asarray(layers.cached_attention(q, k_t, v, mask)), want, rtol=1e-5, atol=1e-5)

    # d(sum out)/dv[s] is the total attention weight on slot s: the softmax weights, by hand.
    grad_v = jax.grad(lambda v: layers.cached_attention(q, k_t, v, mask).sum())(v)
    scores = np.einsum("bkgh,bkhs->bkgs", q.reshape(b, kv, g, hd).astype(np.float64), k_t) / np.sqrt(hd)
    scores = np.where(mask[:, 0][:, None, None], scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    want_grad_v = np.broadcast_to(w.sum(2)[..., None], v.shape)
    np.testing.assert_allclose(np.asarray(grad_v), want_grad_v, rtol=1e-5, atol=1e-6)

    monkeypatch.setenv(cpu_kernels.ENV_VAR, "off")
    assert ffi_calls(layers.cached_attention, q, k_t, v, mask) == 0


def test_build_failure_raises_when_on_and_warns_when_auto(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "on")
    with pytest.raises(cpu_kernels.CpuKernelBuildError, match="no-such-compiler"):
        cpu_kernels.available()

    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "auto")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.available() is False
        assert cpu_kernels.available() is False
    warnings = [r for r in caplog.records if "no-such-compiler" in r.getMessage()]
    assert len(warnings) == 1, "the fallback is announced once, naming the failed compiler"
    assert not list(tmp_path.rglob("*.so")), "no partial library is left behind"

    monkeypatch.setenv(cpu_kernels.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=cpu_kernels.ENV_VAR):
        cpu_kernels.available()
