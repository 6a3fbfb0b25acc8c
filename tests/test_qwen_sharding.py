"""Loading straight onto a 4-device (fsdp=2, tp=2) mesh of forced host devices."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from cleaner_jax.models import params, qwen, sharding
from cleaner_jax.models.config import QwenConfig
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=11, num_shards=2,
                                with_tokenizer=False)


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces 4 host devices)")
    return sharding.make_mesh(2, 2, devices=jax.devices()[:4])


@nnx.jit
def forward(model, ids):
    return model(ids)


def test_mesh_load_gives_same_logits_and_really_shards(checkpoint, mesh, monkeypatch):
    requested: list[list[tuple[int, ...]]] = []  # block shapes read from the file, per tensor
    real_reader = params._slice_reader

    def recording_reader(tensor, transpose, np_dtype):
        read = real_reader(tensor, transpose, np_dtype)
        blocks: list[tuple[int, ...]] = []
        requested.append(blocks)

        def wrapped(index):
            block = read(index)
            blocks.append(block.shape)
            return block

        return wrapped

    monkeypatch.setattr(params, "_slice_reader", recording_reader)
    sharded = params.from_pretrained(checkpoint, mesh=mesh)
    monkeypatch.undo()
    single = params.from_pretrained(checkpoint)

    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (4, 10)), jnp.int32)
    ref = np.asarray(forward(single, ids))
    with jax.set_mesh(mesh):
        out = forward(sharded, jax.device_put(ids, NamedSharding(mesh, sharding.BATCH_SPEC)))
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)

    cfg = sharded.config
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q = sharded.layers[0].self_attn.q_proj.kernel.get_value()  # [H, N*hd] on (fsdp, tp)
    assert q.sharding.spec == jax.P("fsdp", "tp")
    assert {s.data.shape for s in q.addressable_shards} == {(h // 2, cfg.num_attention_heads * hd // 2)}
    down = sharded.layers[1].mlp.down_proj.kernel.get_value()  # [I, H] on (tp, fsdp)
    assert {s.data.shape for s in down.addressable_shards} == {(i // 2, h // 2)}
    emb = sharded.embed_tokens.embedding.get_value()
    assert {s.data.shape for s in emb.addressable_shards} == {(cfg.vocab_size // 2, h // 2)}
    norm = sharded.norm.weight.get_value()
    assert {s.data.shape for s in norm.addressable_shards} == {(h,)}
    assert len({s.device for s in q.addressable_shards}) == 4
    # No host read of a sharded tensor was ever bigger than one shard.
    assert len(requested) == len(params.param_table(cfg))
    for blocks in requested:
        assert len(set(blocks)) == 1  # every block of one tensor is one shard
    assert (h // 2, cfg.num_attention_heads * hd // 2) in {b for bl in requested for b in bl}


def test_save_of_a_sharded_model_equals_the_source(checkpoint, mesh, tmp_path):
    sharded = params.from_pretrained(checkpoint, mesh=mesh)
    out = params.save_pretrained(sharded, tmp_path / "out")
    again = params.from_pretrained(out)
    ref = params.from_pretrained(checkpoint)
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(again, nnx.Param)), nnx.to_flat_state(nnx.state(ref, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(p))


def test_state_shardings_and_indivisible_axes(mesh):
    cfg = QwenConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    abstract = nnx.eval_shape(lambda: qwen.Qwen(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    shard_tree = sharding.state_shardings(state, mesh)
    assert shard_tree["layers"][0]["mlp"]["up_proj"]["kernel"].spec == jax.P("fsdp", "tp")
    odd = QwenConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    abstract = nnx.eval_shape(lambda: qwen.Qwen(odd, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"embed_tokens\.embedding.*101.*'tp'"):
        sharding.state_shardings(nnx.state(abstract, nnx.Param), mesh)
