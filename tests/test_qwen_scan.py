"""Scanned decoder layers (`model.scan_layers`: stacked [L, ...] parameters run by nnx.scan):
the same logits and gradients as Hugging Face / torch autograd and as the unrolled model, the
same HF checkpoint files in and out, the stacked layout sharded with a leading replicated axis,
remat applied inside the scanned body, and the KV-cache path still per layer."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

from cleaner_jax.models import params, qwen, sharding
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint

LAYERS = 3


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def checkpoint(request, tmp_path_factory):
    # qwen3 here has q/k norms and untied embeddings; qwen2 has q/k/v biases and a tied head
    extra = dict(tie_word_embeddings=False) if request.param == "qwen3" else dict(tie_word_embeddings=True)
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=21, num_shards=2,
                                with_tokenizer=False, num_hidden_layers=LAYERS, **extra)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


rng = np.random.default_rng(5)
IDS = rng.integers(0, 512, (2, 12))
MASK = (np.arange(12)[None] < np.array([[12], [7]])).astype(np.int32)  # row 1 right-padded


def next_token_loss(logits, ids, mask):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:])
    w = mask[:, 1:]
    return (ce * w).sum() / w.sum()


def flat_params(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_scanned_model_stacks_every_layer_parameter(checkpoint):
    model = params.from_pretrained(checkpoint, scan_layers=True)
    flat = flat_params(model)
    layer_keys = [k for k in flat if k.startswith("layers.")]
    assert layer_keys and all(not k.split(".")[1].isdigit() for k in layer_keys)  # no per-layer index
    cfg = model.config
    assert flat["layers.mlp.up_proj.kernel"].shape == (LAYERS, cfg.hidden_size, cfg.intermediate_size)
    assert flat["layers.input_layernorm.weight"].shape == (LAYERS, cfg.hidden_size)
    # Layer i of the stack is HF's model.layers.{i} (transposed to [in, out]), read from the files.
    files = {}
    for f in sorted(checkpoint.glob("model-*.safetensors")):
        files.update(load_file(f))
    for i in range(LAYERS):
        np.testing.assert_array_equal(flat["layers.mlp.up_proj.kernel"][i], files[f"model.layers.{i}.mlp.up_proj.weight"].T)
        np.testing.assert_array_equal(flat["layers.post_attention_layernorm.weight"][i],
                                      files[f"model.layers.{i}.post_attention_layernorm.weight"])


# remat="full" here (remat wraps the scanned body, the forward is the same function); without
# remat the scanned forward is checked against the unrolled one by the mesh test below.
@pytest.mark.parametrize("remat", ["full", pytest.param("none", marks=pytest.mark.slow)])
def test_scanned_logits_match_transformers_and_the_unrolled_model(checkpoint, hf_model, remat):
    scanned = params.from_pretrained(checkpoint, scan_layers=True, remat=remat)
    unrolled = params.from_pretrained(checkpoint)
    run = nnx.jit(lambda m, x, a: m(x, attention_mask=a))
    ids, mask = jnp.asarray(IDS, jnp.int32), jnp.asarray(MASK)
    ours = np.asarray(run(scanned, ids, mask))
    with torch.no_grad():
        ref = hf_model(torch.tensor(IDS), attention_mask=torch.tensor(MASK)).logits.numpy()
    real = MASK.astype(bool)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours, np.asarray(run(unrolled, ids, mask)), atol=2e-5, rtol=0)


@pytest.mark.parametrize("remat", ["dots", pytest.param("none", marks=pytest.mark.slow),
                                   pytest.param("full", marks=pytest.mark.slow),
                                   pytest.param("dots_no_batch", marks=pytest.mark.slow)])
def test_scanned_gradients_match_torch_autograd_and_the_unrolled_model(checkpoint, hf_model, remat):
    """Every parameter's gradient: the stacked [L, ...] gradient's slice i is HF's layer i."""
    scanned = params.from_pretrained(checkpoint, scan_layers=True, remat=remat)
    unrolled = params.from_pretrained(checkpoint, remat=remat)
    ids, mask = jnp.asarray(IDS, jnp.int32), jnp.asarray(MASK, jnp.float32)

    def grads_of(model):
        g = nnx.jit(nnx.grad(lambda m: next_token_loss(m(ids, attention_mask=mask), ids, mask)))(model)
        return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(g)}

    ours, flat_unrolled = grads_of(scanned), grads_of(unrolled)
    hf_model.zero_grad()
    logits = hf_model(torch.tensor(IDS), attention_mask=torch.tensor(MASK)).logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           torch.tensor(IDS[:, 1:]).reshape(-1), reduction="none")
    w = torch.tensor(MASK[:, 1:], dtype=torch.float32).reshape(-1)
    ((ce * w).sum() / w.sum()).backward()
    named = dict(hf_model.named_parameters())
    checked = 0
    for e in params.param_table(scanned.config):
        key = ".".join(map(str, e.path))
        got = ours[key] if e.layer is None else ours[key][e.layer]
        got = got.T if e.transpose else got
        ref = named[e.hf_name].grad.numpy()
        np.testing.assert_allclose(got, ref, atol=2e-6 + 1e-4 * np.abs(ref).max(), rtol=0, err_msg=e.hf_name)
        if e.layer is not None:  # and the unrolled model's gradient of the same tensor
            unrolled_key = ".".join(map(str, ("layers", e.layer) + e.path[1:]))
            np.testing.assert_allclose(ours[key][e.layer], flat_unrolled[unrolled_key], atol=1e-6, rtol=1e-5,
                                       err_msg=e.hf_name)
        checked += 1
    assert checked == len(named) or scanned.config.tie_word_embeddings


def _scan_eqns(jaxpr) -> list:
    return [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]


def _primitives(j) -> set[str]:
    from jax.extend.core import jaxprs_in_params

    names = set()
    for e in j.eqns:
        names.add(e.primitive.name)
        for sub in jaxprs_in_params(e.params):
            names |= _primitives(sub)
    return names


def test_remat_runs_inside_the_scanned_body(checkpoint):
    """The policy wraps each layer inside the scan (a checkpoint in the scan body), and it works:
    under grad, what the forward scan stores for the backward shrinks from "none" to "full"."""
    ids = jnp.zeros((4, 256), jnp.int32)  # only traced: enough tokens that activations outweigh the weights

    def traced(remat: str, grad: bool):
        graphdef, state = nnx.split(params.from_pretrained(checkpoint, scan_layers=True, remat=remat))
        loss = lambda st: nnx.merge(graphdef, st)(ids).sum()  # noqa: E731
        return jax.make_jaxpr(jax.grad(loss) if grad else loss)(state)

    for remat in ("none", "dots", "full"):
        scans = _scan_eqns(traced(remat, grad=False))
        assert len(scans) == 1 and scans[0].params["length"] == LAYERS
        # jax.checkpoint's primitive ("remat2" in jax 0.10, "checkpoint" in older/newer names)
        has_checkpoint = bool({"remat2", "checkpoint"} & _primitives(scans[0].params["jaxpr"].jaxpr))
        assert has_checkpoint == (remat != "none"), remat

    def stored_bytes(remat: str) -> int:  # the forward scan's stacked [L, ...] outputs = residuals
        forward = _scan_eqns(traced(remat, grad=True))[0]
        return sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in forward.outvars
                   if v.aval.shape[:1] == (LAYERS,))

    none, full = stored_bytes("none"), stored_bytes("full")
    assert full < none / 3, (full, none)


def test_save_unstacks_to_the_same_hf_files(checkpoint, tmp_path):
    scanned = params.from_pretrained(checkpoint, scan_layers=True)
    out = params.save_pretrained(scanned, tmp_path / "out")
    original, saved = {}, {}
    for f in sorted(checkpoint.glob("model-*.safetensors")):
        original.update(load_file(f))
    for f in sorted(out.glob("*.safetensors")):
        saved.update(load_file(f))
    assert set(saved) == set(original) - {"lm_head.weight"} if scanned.config.tie_word_embeddings else set(original)
    for name, tensor in saved.items():
        np.testing.assert_array_equal(tensor, original[name], err_msg=name)
    # and an unrolled model loads the export to the same parameters as the original files
    a, b = flat_params(params.from_pretrained(out)), flat_params(params.from_pretrained(checkpoint))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_stacked_sharding_rules_add_a_replicated_layer_axis():
    P = jax.P
    assert sharding.param_spec(("layers", "self_attn", "q_proj", "kernel")) == P(None, "fsdp", "tp")
    assert sharding.param_spec(("layers", "mlp", "down_proj", "kernel")) == P(None, "tp", "fsdp")
    assert sharding.param_spec(("layers", "input_layernorm", "weight")) == P(None)
    assert sharding.param_spec(("layers", 2, "self_attn", "q_proj", "kernel")) == P("fsdp", "tp")
    assert sharding.param_spec(("embed_tokens", "embedding")) == P("tp", "fsdp")


def test_scanned_model_loads_onto_a_mesh_shard_by_shard(checkpoint):
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces 4 host devices)")
    mesh = sharding.make_mesh(2, 2, devices=jax.devices()[:4])
    sharded = params.from_pretrained(checkpoint, mesh=mesh, scan_layers=True)
    cfg = sharded.config
    q = sharded.layers.self_attn.q_proj.kernel.get_value()  # [L, H, N*hd] on (None, fsdp, tp)
    assert q.sharding.spec == jax.P(None, "fsdp", "tp")
    assert {s.data.shape for s in q.addressable_shards} == {
        (LAYERS, cfg.hidden_size // 2, cfg.num_attention_heads * cfg.head_dim // 2)}
    single = params.from_pretrained(checkpoint)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (4, 10)), jnp.int32)
    ref = np.asarray(nnx.jit(lambda m, x: m(x))(single, ids))
    with jax.set_mesh(mesh):
        out = nnx.jit(lambda m, x: m(x))(sharded, jax.device_put(ids, NamedSharding(mesh, sharding.BATCH_SPEC)))
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)
    shard_tree = sharding.state_shardings(nnx.state(sharded, nnx.Param), mesh)
    assert shard_tree["layers"]["mlp"]["up_proj"]["kernel"].spec == jax.P(None, "fsdp", "tp")


def test_kv_cache_path_of_a_scanned_model_equals_the_unrolled_one(checkpoint):
    """The cache stays one array per layer; a scanned model slices its layers for it."""
    scanned = params.from_pretrained(checkpoint, scan_layers=True)
    unrolled = params.from_pretrained(checkpoint)
    step = nnx.jit(lambda m, x, a, c: m(x, attention_mask=a, cache=c))
    ids, mask = jnp.asarray(IDS, jnp.int32), jnp.asarray(MASK)
    cache = qwen.init_cache(unrolled.config, 2, 16)
    (l1, c1), (l2, c2) = step(scanned, ids, mask, cache), step(unrolled, ids, mask, cache)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), atol=2e-5, rtol=0)
    assert len(c1.k) == LAYERS
    for a, b in zip(c1.k + c1.v, c2.k + c2.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(c1.lengths), MASK.sum(-1))


def test_learner_update_with_scanned_layers_equals_the_unrolled_learner(tmp_path):
    """The whole learner (micro-batches, remat, optimizer) on scanned layers with the lengths-based
    attention gives the unrolled, masked-attention learner's loss, gradient norm and new weights."""
    from cleaner_jax.rl.batch import Batch
    from cleaner_jax.rl.learner import Learner
    from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig

    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=4, with_tokenizer=False, num_hidden_layers=2)
    rng = np.random.default_rng(0)
    b, t = 4, 16
    lens = np.array([16, 11, 7, 13])
    attn = (np.arange(t)[None] < lens[:, None]).astype(np.float32)
    loss = attn.copy()
    loss[:, :3] = 0
    batch = Batch(input_ids=np.where(attn > 0, rng.integers(3, 512, (b, t)), 0).astype(np.int32),
                  attention_mask=attn, loss_mask=loss, advantages=rng.normal(size=(b,)).astype(np.float32))
    lcfg = LearnerConfig(optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=0, eps=1e-4),
                         micro_batch_size=2, logprob_micro_batch_size=2, logprob_chunk_size=8)
    results = []
    for overrides in (dict(), dict(scan_layers=True, attention_impl="xla_causal", remat="full")):
        learner = Learner(params.from_pretrained(ckpt, **overrides), lcfg)
        metrics = learner.update(batch).metrics
        results.append((metrics, flat_params(learner.model())))
    (m1, p1), (m2, p2) = results
    assert m1["grad_norm"] > 0
    for k in ("loss", "grad_norm"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    for key, value in p2.items():
        if key.startswith("layers."):
            for i in range(2):
                parts = key.split(".")
                np.testing.assert_allclose(value[i], p1[".".join([parts[0], str(i), *parts[1:]])], atol=2e-6, err_msg=key)
        else:
            np.testing.assert_allclose(value, p1[key], atol=2e-6, err_msg=key)


def test_compile_time_bench_runs_in_process_at_a_toy_shape():
    """bench/compile_time.py's measurement (in this process, 2 layers) so the script cannot rot."""
    import queue

    from _configs import ROOT, load_module

    bench = load_module(ROOT / "bench" / "compile_time.py")
    shape = dict(bench.SHAPES["small"], num_hidden_layers=2, vocab_size=128, hidden_size=32, intermediate_size=64,
                 head_dim=8, seq=16)
    out: queue.Queue = queue.Queue()
    for scan in (False, True):
        bench._measure(shape, scan, "full", "float32", True, out)
        result = out.get_nowait()
        assert result["scan"] is scan and result["compile_s"] > 0 and result["lower_s"] > 0 and result["step_s"] > 0


@pytest.mark.parametrize("scan_layers,remat", [(False, "full"), (True, "dots")])
def test_learner_logprobs_under_remat_equal_the_plain_model(checkpoint, hf_model, scan_layers, remat):
    """The learner's old-log-prob pass merges the model inside `lax.map`; with remat (every paper
    config) or scanned layers it must compile and give what transformers gives."""
    import torch

    from cleaner_jax.rl.learner import Learner
    from cleaner_jax.rl.learner_config import LearnerConfig

    ids = np.random.default_rng(3).integers(0, 256, size=(4, 12)).astype(np.int32)
    attn = np.ones_like(ids)
    attn[1, 9:] = 0  # right padding on one row
    model = params.from_pretrained(checkpoint, scan_layers=scan_layers, remat=remat)
    learner = Learner(model, LearnerConfig(micro_batch_size=2, logprob_micro_batch_size=2))
    got = learner.logprobs(ids, attn, temperature=1.0)  # [B, T]
    with torch.no_grad():
        logits = hf_model(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(attn)).logits.double()
    want = torch.log_softmax(logits, -1)[:, :-1].gather(-1, torch.tensor(ids[:, 1:, None], dtype=torch.long))[..., 0]
    real = attn[:, 1:] > 0
    np.testing.assert_allclose(got[:, 1:][real], want.numpy()[real], atol=2e-4)
