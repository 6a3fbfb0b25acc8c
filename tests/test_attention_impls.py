"""The long-sequence attention implementations (`model.attention_impl`): causal with per-row
lengths from a right-padded attention_mask, no materialised [B, 1, T, T] mask or bias.

On CPU: `xla_causal` (the cuDNN path's `jax.nn.dot_product_attention` call with JAX's XLA
implementation) and `splash` (the TPU kernel in the Pallas interpreter) equal a torch float64
reference and the existing masked attention, values and gradients, on right-padded rows; the
model with `xla_causal` matches Hugging Face; the cuDNN call itself is lowered for CUDA (cuDNN's
presence faked, nothing compiled or run) so it cannot rot; requests a device cannot serve fail
at model build naming the key. The masked path in query blocks (`model.attention_block`) equals
the same reference and Hugging Face."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from cleaner_jax.models import layers, params, qwen
from cleaner_jax.models.config import QwenConfig
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint

B, T, N, KV, HD = 3, 20, 4, 2, 16
LENS = np.array([20, 13, 1])  # full, right-padded, a single real token


def _inputs(seed: int = 0):
    r = np.random.default_rng(seed)
    q = r.normal(size=(B, T, N, HD)).astype(np.float32)
    k = r.normal(size=(B, T, KV, HD)).astype(np.float32)
    v = r.normal(size=(B, T, KV, HD)).astype(np.float32)
    w = r.normal(size=(B, T, N, HD)).astype(np.float32)  # cotangent of the output
    return q, k, v, w


REAL = np.arange(T)[None] < LENS[:, None]  # [B, T] real (query) positions
ATTN_MASK = REAL.astype(np.int32)


def torch_reference(q, k, v, w):
    """float64 causal GQA attention over the real keys, and the gradients of
    sum(out * w * real) (padding queries excluded: their outputs are unspecified)."""
    qt, kt, vt = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, k, v))
    g = N // KV
    kr, vr = kt.repeat_interleave(g, dim=2), vt.repeat_interleave(g, dim=2)  # [B, T, N, hd]
    scores = torch.einsum("btnh,bsnh->bnts", qt, kr) / HD**0.5
    t_idx, s_idx = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (s_idx <= t_idx)[None, None] & (torch.arange(T)[None, None, None, :] < torch.tensor(LENS)[:, None, None, None])
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = torch.einsum("bnts,bsnh->btnh", probs, vr)
    (out * torch.tensor(w, dtype=torch.float64) * torch.tensor(REAL[..., None, None], dtype=torch.float64)).sum().backward()
    return out.detach().numpy(), tuple(a.grad.numpy() for a in (qt, kt, vt))


def masked(q, k, v):  # the existing path: [B, T, T] mask, k/v in the cache layout [B, KV, S, hd]
    mask = layers.causal_mask(jnp.asarray(ATTN_MASK), B, T)
    return layers.grouped_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)


def lengths_based(impl: str):
    lengths = layers.right_padded_lengths(jnp.asarray(ATTN_MASK))
    if impl == "splash":
        return lambda q, k, v: layers.splash_attention(q, k, v, lengths, interpret=True)
    return lambda q, k, v: layers.causal_attention(q, k, v, lengths, impl)


def values_and_grads(fn, q, k, v, w):
    real = jnp.asarray(REAL[..., None, None], jnp.float32)
    out = fn(q, k, v)
    grads = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w * real), argnums=(0, 1, 2))(q, k, v)
    return np.asarray(out), tuple(np.asarray(g) for g in grads)


@pytest.mark.parametrize("impl", ["xla_causal", "splash"])
def test_lengths_attention_equals_torch_and_the_masked_attention(impl):
    q, k, v, w = _inputs()
    ref_out, ref_grads = torch_reference(q, k, v, w)
    out, grads = values_and_grads(lengths_based(impl), *map(jnp.asarray, (q, k, v, w)))
    old_out, old_grads = values_and_grads(masked, *map(jnp.asarray, (q, k, v, w)))
    assert np.abs(ref_out[REAL]).max() > 0.1
    np.testing.assert_allclose(out[REAL], ref_out[REAL], atol=2e-5, rtol=0)
    np.testing.assert_allclose(out[REAL], old_out[REAL], atol=2e-5, rtol=0)
    for name, g, ref, old in zip("qkv", grads, ref_grads, old_grads):
        assert np.abs(ref).max() > 0.1, name
        np.testing.assert_allclose(g, ref, atol=5e-5, rtol=0, err_msg=name)
        np.testing.assert_allclose(g, old, atol=5e-5, rtol=0, err_msg=name)


@pytest.mark.parametrize("block", [2, 6, 19])  # 10 blocks, a ragged last block (20 = 3 x 6 + 2), nearly whole
def test_query_blocks_equal_torch(block):
    """`model.attention_block`: each query block against the keys up to its end only."""
    q, k, v, w = _inputs()
    ref_out, ref_grads = torch_reference(q, k, v, w)
    mask = layers.causal_mask(jnp.asarray(ATTN_MASK), B, T)

    def blocked(q, k, v):
        return layers.causal_query_blocks(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, block,
                                          layers.grouped_attention)

    out, grads = values_and_grads(jax.jit(blocked), *map(jnp.asarray, (q, k, v, w)))
    assert np.abs(ref_out[REAL]).max() > 0.1
    np.testing.assert_allclose(out[REAL], ref_out[REAL], atol=2e-5, rtol=0)
    for name, g, ref in zip("qkv", grads, ref_grads):
        assert np.abs(ref).max() > 0.1, name
        np.testing.assert_allclose(g, ref, atol=5e-5, rtol=0, err_msg=name)


def test_query_blocks_only_with_the_masked_impl():
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"attention_block=8 blocks the masked attention_impl='xla' only"):
        QwenConfig(**kw, attention_impl="xla_causal", attention_block=8)
    with pytest.raises(ValueError, match=r"attention_block must be an int >= 0"):
        QwenConfig(**kw, attention_block=-1)


def test_lengths_from_a_right_padded_mask_and_all_padding_rows():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(np.asarray(layers.right_padded_lengths(jnp.asarray(mask))), [3, 1, 1, 4])
    # an all-padding row (length clamped to 1) stays finite, forward and backward
    q, k, v, _ = _inputs(1)
    lengths = jnp.asarray([T, 0, 5], jnp.int32)
    fn = lambda q, k, v: layers.causal_attention(q, k, v, jnp.maximum(lengths, 1), "xla_causal")  # noqa: E731
    g = jax.grad(lambda q: fn(q, jnp.asarray(k), jnp.asarray(v)).sum())(jnp.asarray(q))
    assert np.isfinite(np.asarray(fn(*map(jnp.asarray, (q, k, v))))).all() and np.isfinite(np.asarray(g)).all()


def test_left_padding_is_refused_where_it_can_be_checked():
    layers.check_right_padded(ATTN_MASK, "cudnn")  # right-padded: fine
    left = np.array([[1, 1, 1], [0, 1, 1]])
    with pytest.raises(ValueError, match=r"row 1 is not right-padded.*model\.attention_impl='cudnn'.*'xla'"):
        layers.check_right_padded(left, "cudnn")
    cfg = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, attention_impl="xla_causal")
    model = qwen.Qwen(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"row 1 is not right-padded"):
        model(jnp.zeros((2, 3), jnp.int32), attention_mask=jnp.asarray(left))  # eager call: a concrete mask


def test_kernels_are_refused_on_a_device_that_lacks_them():
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU messages")
    for impl, device in (("cudnn", "GPU"), ("splash", "TPU")):
        cfg = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, attention_impl=impl, compute_dtype="bfloat16")
        with pytest.raises(RuntimeError, match=rf"model\.attention_impl='{impl}' needs .*{device}.*'cpu'"):
            nnx.eval_shape(lambda: qwen.Qwen(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"compute_dtype bfloat16 or float16"):
        q, k, v, _ = _inputs()
        layers.causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), None, "cudnn")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("attn"), "qwen3", seed=8, with_tokenizer=False,
                                num_key_value_heads=2)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("impl,block", [("xla_causal", 0), ("xla", 4)])
def test_model_with_xla_causal_or_query_blocks_matches_transformers_on_right_padded_rows(checkpoint, scan_layers,
                                                                                         impl, block):
    ids = np.random.default_rng(3).integers(0, 512, (2, 14))
    mask = (np.arange(14)[None] < np.array([[14], [9]])).astype(np.int64)
    model = params.from_pretrained(checkpoint, attention_impl=impl, attention_block=block, scan_layers=scan_layers)
    ours = np.asarray(nnx.jit(lambda m, x, a: m(x, attention_mask=a))(model, jnp.asarray(ids, jnp.int32),
                                                                        jnp.asarray(mask, jnp.int32)))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    real = mask.astype(bool)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)


@pytest.fixture
def fake_cudnn(monkeypatch):
    """Let JAX lower its cuDNN attention for CUDA on a machine without cuDNN: the version and
    compute-capability probes (JAX internals) answer as a Hopper GPU with cuDNN 9.10 would."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    class FakeCudaVersions:
        @staticmethod
        def cudnn_get_version() -> int:
            return 91000

    monkeypatch.setattr(fa, "cuda_versions", FakeCudaVersions)
    monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)


def _cuda_lowering(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_cudnn_call_lowers_to_flash_attention_with_causal_padding_and_no_bias(fake_cudnn):
    q = jax.ShapeDtypeStruct((B, T, N, HD), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, KV, HD), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32)

    def loss(q, k, v, lengths):
        return layers.causal_attention(q, k, v, lengths, "cudnn").astype(jnp.float32).sum()

    text = _cuda_lowering(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, lengths)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @__cudnn$fmha" in line]
    assert len(calls) == 2 and "fmhaSoftmaxBackward" in calls[1], calls
    for line in calls:
        assert re.search(r'mask_type\\22: \\22PADDING_CAUSAL', line), line[:400]
    assert not re.search(rf"tensor<[0-9x]*{T}x{T}x", text), "a [.., T, T] tensor was materialised"


@pytest.mark.parametrize("scan_layers", [False, True])
def test_model_gradient_with_cudnn_lowers_for_cuda_without_a_mask(fake_cudnn, monkeypatch, scan_layers):
    """The whole train-style computation (forward + gradient of every parameter) of a
    cudnn model, abstract inputs: one flash call per layer (one in the scanned body), padding
    and causality from the lengths, and no [B, T, T] mask anywhere in the program."""
    monkeypatch.setattr(QwenConfig, "check_backend", lambda self, backend: None)  # build it on CPU
    layers_n, t = 3, 24
    cfg = QwenConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers_n,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, compute_dtype="bfloat16",
                     attention_impl="cudnn", remat="full", scan_layers=scan_layers)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: qwen.Qwen(cfg, rngs=nnx.Rngs(0))))

    def loss(state, ids, mask):
        return nnx.merge(graphdef, state)(ids, attention_mask=mask).sum()

    ids = jax.ShapeDtypeStruct((2, t), jnp.int32)
    text = _cuda_lowering(jax.grad(loss), state, ids, ids)
    forward = len(re.findall(r"custom_call @__cudnn\$fmhaSoftmax\(", text))
    backward = len(re.findall(r"custom_call @__cudnn\$fmhaSoftmaxBackward\(", text))
    per_program = 1 if scan_layers else layers_n
    # remat="full" recomputes each layer's forward before its backward: a second forward call
    assert (forward, backward) == (2 * per_program, per_program), (forward, backward)
    assert not re.search(rf"tensor<[0-9x]*{t}x{t}x", text), "a [.., T, T] tensor was materialised"


@pytest.mark.parametrize("name", ["qwen3_4b_cleaner", "qwen3_4b_dapo", "qwen3_4b_notool", "qwen25_7b_cleaner",
                                  "qwen25_7b_dapo", "qwen25_7b_notool"])
def test_paper_configs_select_the_cudnn_flash_path(name):
    from _configs import load_config

    c = load_config(name)
    assert c.model.attention_impl == "cudnn"
    assert c.model.compute_dtype in ("float16", "bfloat16")  # what cuDNN flash attention accepts


def test_splash_under_a_mesh_runs_per_shard_and_equals_one_device():
    """With the learner's mesh set, the Pallas kernel runs inside a shard_map (rows over fsdp,
    heads over tp) and gives the single-device values and gradients."""
    from cleaner_jax.models import sharding

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces 4 host devices)")
    q, k, v, w = map(jnp.asarray, _inputs(2))
    q, k, v, w = (jnp.concatenate([a, a[:1]]) for a in (q, k, v, w))  # 4 rows: divisible by fsdp=2
    lengths = jnp.asarray([T, 13, 1, 7], jnp.int32)

    def loss(q, k, v):
        return jnp.sum(layers.splash_attention(q, k, v, lengths, interpret=True) * w)

    ref = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    mesh = sharding.make_mesh(2, 2, devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(loss)(q, k, v))
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-6)
