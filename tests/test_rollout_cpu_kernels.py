"""The C++ cache attention kernel (rollout/cpu_kernels.py) against a float64 NumPy reference,
its dispatch by the `cpu_kernels` decode backend (rollout/decode_backend.py), which leaves every
matmul to XLA, how choosing a backend fails, and that the model and the learner never reach it.
The engine's parity tests (tests/test_rollout_engine.py) run both backends against Hugging Face
`generate`."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cleaner_jax.models.ops import XLA
from cleaner_jax.rollout import cpu_kernels, decode_backend
from cleaner_jax.rollout.decode_backend import CpuKernelOps


@pytest.fixture(scope="module")
def kernels() -> CpuKernelOps:
    """The kernel ops, built: a failed build fails these tests instead of passing them on XLA."""
    ops = decode_backend.resolve("cpu_kernels", compute_dtype="float32")
    assert isinstance(ops, CpuKernelOps)
    return ops


def ffi_calls(fn, *args) -> int:
    """Calls of our FFI targets in fn's program."""
    return str(jax.make_jaxpr(fn)(*args)).count("cj_")


@pytest.mark.parametrize("rows", [1, 2, 8, 9])
def test_matmuls_stay_xla(kernels, rows):
    """The backend's dense ops are XLA's one plain dot at every row count (the few-row C++ matmuls
    were removed: bench/RESULTS.md), with values as x @ w in float64."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 24)).astype(np.float32)
    w = rng.standard_normal((24, 40)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    for fn, weight in ((kernels.dense, w), (kernels.dense_t, np.ascontiguousarray(w.T))):
        assert ffi_calls(fn, x, weight) == 0
        dots = [e for e in jax.make_jaxpr(fn)(x, weight).eqns if e.primitive.name == "dot_general"]
        assert len(dots) == 1
        np.testing.assert_allclose(np.asarray(jax.jit(fn)(x, weight)), want, rtol=1e-5, atol=1e-5)


def reference_attention(q, k, v, mask) -> np.ndarray:
    """q [B, KV, G, hd]; k, v [B, KV, S, hd]; mask [B, S] -> [B, KV, G, hd], in float64: softmax
    over the valid slots, or uniform over all slots when none is valid."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("bkgh,bksh->bkgs", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(mask[:, None, None, :], scores, -np.inf)
    scores[~mask.any(-1)] = 0.0  # all slots equal: uniform
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bkgs,bksh->bkgh", w, v)


def reference_chunk_attention(q, k, v, mask) -> np.ndarray:
    """q [B, T, KV, G, hd]; mask [B, T, S] -> [B, T, KV, G, hd]: `reference_attention` per query."""
    return np.stack([reference_attention(q[:, t], k, v, mask[:, t]) for t in range(q.shape[1])], axis=1)


def make_inputs(rng, b, kv, g, hd, s):
    q = rng.standard_normal((b, kv, g, hd)).astype(np.float32)
    k = rng.standard_normal((b, kv, s, hd)).astype(np.float32)
    v = rng.standard_normal((b, kv, s, hd)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("b,kv,g,hd,s", [(3, 2, 2, 64, 40), (2, 1, 4, 16, 7), (5, 2, 1, 8, 257), (1, 4, 3, 32, 1),
                                         (3, 2, 2, 20, 33)])
def test_decode_attention_matches_float64_reference(kernels, b, kv, g, hd, s):
    rng = np.random.default_rng(b * 100 + s)
    q, k, v = make_inputs(rng, b, kv, g, hd, s)
    mask = rng.random((b, s)) < 0.6
    mask[-1, 0] = True
    if b > 1:
        mask[0, :] = False  # no valid slot (a padding row): uniform weights
    if b > 2:
        mask[1, s // 2:] = False  # valid slots, then an empty tail, which the kernel skips
        mask[2, :] = True
    got = jax.jit(cpu_kernels.cache_attention, static_argnums=4)(q[:, None], k, v, mask[:, None], hd**-0.5)[:, 0]
    np.testing.assert_allclose(np.asarray(got), reference_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b,kv,g,hd,s,t,cached", [(3, 2, 2, 16, 96, 8, 20), (2, 1, 4, 64, 40, 5, 0),
                                                   (4, 2, 1, 8, 257, 16, 100)])
def test_chunk_attention_matches_float64_reference(kernels, b, kv, g, hd, s, t, cached):
    """A prefill chunk: T queries per row, each causal over the row's cached prefix and the chunk
    so far (the engine's mask), a row idle in the chunk (no valid slot: uniform weights, XLA's
    answer) and a row with a hole in its mask."""
    rng = np.random.default_rng(b * 1000 + s + t)
    q = rng.standard_normal((b, t, kv, g, hd)).astype(np.float32)
    _, k, v = make_inputs(rng, b, kv, g, hd, s)
    pos = cached + np.arange(t)  # [T] the chunk's slots
    mask = np.arange(s)[None, None, :] <= pos[None, :, None]  # [1, T, S]
    mask = np.broadcast_to(mask, (b, t, s)).copy()
    mask[0] = False  # idle in this chunk
    if b > 2:
        mask[2, :, 1] = False
    got = jax.jit(cpu_kernels.cache_attention, static_argnums=4)(q, k, v, mask, hd**-0.5)
    np.testing.assert_allclose(np.asarray(got), reference_chunk_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_attention_dispatch_and_gradient(kernels):
    """One new token and a chunk of them go to the kernel, bfloat16 to XLA; gradients flow
    through the XLA form."""
    rng = np.random.default_rng(0)
    b, kv, g, hd, s = 2, 2, 2, 16, 24
    q, k, v = make_inputs(rng, b, kv, g, hd, s)
    q = q.reshape(b, 1, kv * g, hd)  # the model's layout: [B, T, N, hd]
    mask = np.zeros((b, 1, s), bool)
    mask[0, 0, :5] = True
    mask[1, 0, [0, 3, 9]] = True

    def attend(ops):
        return lambda q, k, v, mask: ops.attention(q, k, v, mask, "xla")

    assert ffi_calls(attend(kernels), q, k, v, mask) == 1
    q2, mask2 = np.concatenate([q, q], axis=1), np.concatenate([mask, mask], 1)
    assert ffi_calls(attend(kernels), q2, k, v, mask2) == 1
    want2 = reference_chunk_attention(q2.reshape(b, 2, kv, g, hd), k, v, mask2).reshape(b, 2, kv * g, hd)
    np.testing.assert_allclose(np.asarray(attend(kernels)(q2, k, v, mask2)), want2, rtol=1e-5, atol=1e-5)
    assert ffi_calls(attend(kernels), q.astype(jnp.bfloat16), k, v, mask) == 0
    assert ffi_calls(attend(XLA), q, k, v, mask) == 0

    want = reference_attention(q.reshape(b, kv, g, hd), k, v, mask[:, 0]).reshape(b, 1, kv * g, hd)
    for ops in (kernels, XLA):
        np.testing.assert_allclose(np.asarray(attend(ops)(q, k, v, mask)), want, rtol=1e-5, atol=1e-5)

    # d(sum out)/dv[s] is the total attention weight on slot s: the softmax weights, by hand.
    grad_v = jax.grad(lambda v: attend(kernels)(q, k, v, mask).sum())(v)
    scores = np.einsum("bkgh,bksh->bkgs", q.reshape(b, kv, g, hd).astype(np.float64), k) / np.sqrt(hd)
    scores = np.where(mask[:, 0][:, None, None], scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    want_grad_v = np.broadcast_to(w.sum(2)[..., None], v.shape)
    np.testing.assert_allclose(np.asarray(grad_v), want_grad_v, rtol=1e-5, atol=1e-6)


def test_auto_runs_the_kernel_only_over_caches_where_it_pays(kernels):
    """`auto`: the kernel from 256 cache slots on (decode_backend.KERNEL_MIN_SLOTS, the measured
    rule), XLA's attention below; `cpu_kernels`, and `auto` in a batch-invariant engine, run it at
    every size."""
    auto = decode_backend.resolve("auto", compute_dtype="float32")
    assert isinstance(auto, CpuKernelOps) and auto.name == "auto:cpu_kernels" and kernels.name == "cpu_kernels"
    # a batch-invariant engine's auto: the kernel everywhere (S follows the batch's longest request)
    invariant = decode_backend.resolve("auto", compute_dtype="float32", batch_invariant=True)
    rng = np.random.default_rng(1)
    for s, auto_calls in ((128, 0), (255, 0), (256, 1), (512, 1)):
        q, k, v = make_inputs(rng, 2, 2, 2, 16, s)
        q = q.reshape(2, 1, 4, 16)
        mask = np.ones((2, 1, s), bool)
        attend = lambda ops: lambda q, k, v, m: ops.attention(q, k, v, m, "xla")  # noqa: E731
        assert ffi_calls(attend(auto), q, k, v, mask) == auto_calls, s
        assert ffi_calls(attend(kernels), q, k, v, mask) == 1, s
        assert ffi_calls(attend(invariant), q, k, v, mask) == 1, s
        want = reference_attention(q.reshape(2, 2, 2, 16), k, v, mask[:, 0]).reshape(2, 1, 4, 16)
        np.testing.assert_allclose(np.asarray(jax.jit(attend(auto))(q, k, v, mask)), want, rtol=1e-5, atol=1e-5)


def test_cpu_kernels_fail_loudly_and_auto_warns_once(tmp_path, caplog):
    bad = str(tmp_path / "no-such-compiler")
    with pytest.raises(cpu_kernels.CpuKernelBuildError, match=r"(?s)decode_backend='cpu_kernels'.*no-such-compiler"):
        decode_backend.resolve("cpu_kernels", compute_dtype="float32", compiler=bad, cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger=decode_backend.__name__):
        assert decode_backend.resolve("auto", compute_dtype="float32", compiler=bad, cache_dir=tmp_path) is XLA
        assert decode_backend.resolve("auto", compute_dtype="float32", compiler=bad, cache_dir=tmp_path) is XLA
    warnings = [r for r in caplog.records if "no-such-compiler" in r.getMessage()]
    assert len(warnings) == 1, "the fallback is announced once, naming the failed compiler"
    assert "decode_backend='auto'" in warnings[0].getMessage()
    assert not list(tmp_path.rglob("*.so")), "no partial library is left behind"


def test_backend_names_and_where_kernels_apply():
    with pytest.raises(ValueError, match=r"decode_backend='fast'.*auto, xla, cpu_kernels"):
        decode_backend.resolve("fast", compute_dtype="float32")
    with pytest.raises(ValueError, match=r"decode_backend='cpu_kernels' needs .*'bfloat16'"):
        decode_backend.resolve("cpu_kernels", compute_dtype="bfloat16")
    assert decode_backend.resolve("auto", compute_dtype="bfloat16") is XLA  # the kernels are float32 only
    assert decode_backend.resolve("xla", compute_dtype="float32") is XLA


def test_model_and_learner_never_import_the_kernels():
    """A fresh interpreter runs the model's forward, a cached decode step and a learner gradient
    (batch 4, float32, on CPU: where the kernels would apply) and never loads them."""
    script = textwrap.dedent("""
        import sys
        import jax, jax.numpy as jnp
        from flax import nnx
        from cleaner_jax.models import qwen
        from cleaner_jax.models.config import QwenConfig
        from cleaner_jax.rl import learner, logprobs
        cfg = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        model = qwen.Qwen(cfg, rngs=nnx.Rngs(0))
        ids = jnp.arange(4 * 6, dtype=jnp.int32).reshape(4, 6) % 64
        logits, cache = nnx.jit(lambda m, x, c: m(x, cache=c))(model, ids, qwen.init_cache(cfg, 4, 8))
        step, _ = nnx.jit(lambda m, x, c: m(x, cache=c))(model, ids[:, :1], cache)

        def loss(m):
            h = m.hidden_states(ids)
            return -logprobs.token_logprobs(h, m.lm_head_kernel(), ids)[0].sum()

        grads = nnx.jit(nnx.grad(loss))(model)
        assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
        assert step.shape == (4, 1, 64), step.shape
        loaded = sorted(m for m in sys.modules if m.startswith("cleaner_jax.rollout"))
        print("ROLLOUT_MODULES", loaded)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ROLLOUT_MODULES []" in proc.stdout, proc.stdout
