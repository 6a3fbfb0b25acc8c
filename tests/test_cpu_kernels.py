"""The C++ decode kernels (models/cpu_kernels.py) against float64 NumPy references, their
dispatch from `layers`, and what happens when they cannot be built. The engine's parity tests
(tests/test_rollout_engine.py) run them against Hugging Face `generate`."""
from __future__ import annotations

import logging
import os

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


def ffi_calls(fn, *args) -> int:
    """Calls of our FFI targets in fn's program: a fresh lambda per trace, because JAX caches
    traces per function and the kernels' mode is read at trace time."""
    return str(jax.make_jaxpr(lambda *a: fn(*a))(*args)).count("cj_")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("k,n", [(256, 768), (37, 100), (768, 129), (8, 16)])
def test_small_matmuls_match_float64(kernels_on, rows, k, n):
    """Both layouts, with tails past the vector width in K and N and an odd N."""
    rng = np.random.default_rng(rows * 1000 + k + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    tol = dict(rtol=1e-5, atol=2e-5 * np.sqrt(k))
    np.testing.assert_allclose(np.asarray(jax.jit(cpu_kernels.small_matmul)(x, w)), want, **tol)
    w_t = np.ascontiguousarray(w.T)
    np.testing.assert_allclose(np.asarray(jax.jit(cpu_kernels.small_matmul_t)(x, w_t)), want, **tol)


def test_matmul_dispatch_and_gradients(kernels_on):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 24)).astype(np.float32)
    w = rng.standard_normal((24, 40)).astype(np.float32)
    w_t = np.ascontiguousarray(w.T)
    assert ffi_calls(layers.matmul, x, w) == 1 and ffi_calls(layers.matmul_t, x, w_t) == 1
    x9 = rng.standard_normal((9, 24)).astype(np.float32)
    assert ffi_calls(layers.matmul, x9, w) == 0 and ffi_calls(layers.matmul_t, x9, w_t) == 0
    assert ffi_calls(layers.matmul, x[:1], w) == 0 and ffi_calls(layers.matmul_t, x[:1], w_t) == 0
    assert ffi_calls(layers.matmul, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)) == 0

    # d/dx sum((x @ w) * g) = g @ w^T and d/dw = x^T @ g, by hand in float64
    g = rng.standard_normal((4, 40)).astype(np.float32)
    x64, w64, g64 = (a.astype(np.float64) for a in (x, w, g))
    dx, dw = jax.grad(lambda x, w: (layers.matmul(x, w) * g).sum(), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(dx), g64 @ w64.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), x64.T @ g64, rtol=1e-5, atol=1e-5)
    dx, dw_t = jax.grad(lambda x, w_t: (layers.matmul_t(x, w_t) * g).sum(), argnums=(0, 1))(x, w_t)
    np.testing.assert_allclose(np.asarray(dx), g64 @ w64.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw_t), (x64.T @ g64).T, rtol=1e-5, atol=1e-5)


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


def test_mode_while_tracing_sets_and_restores(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "auto")
    with cpu_kernels.mode_while_tracing("off"):
        assert cpu_kernels.mode() == "off"
    assert cpu_kernels.mode() == "auto"
    monkeypatch.delenv(cpu_kernels.ENV_VAR)
    with pytest.raises(RuntimeError), cpu_kernels.mode_while_tracing("on"):
        raise RuntimeError("the block fails")
    assert cpu_kernels.ENV_VAR not in os.environ, "an unset variable is unset again"
    with pytest.raises(ValueError, match=cpu_kernels.ENV_VAR), cpu_kernels.mode_while_tracing("yes"):
        pass
