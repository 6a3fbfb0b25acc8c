"""Weight sync: export → /update_weights_from_disk → version check → flush → probe vs learner."""
import asyncio

import pytest

from _rollout_common import call, checkpoint, engine, hf_greedy, hf_logprobs
from cleaner_jax.models import params
from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.server import start_server_in_thread
from cleaner_jax.rollout.weight_sync import WeightSyncError, export_and_sync, export_checkpoint, sync_weights

PROBE = [1, 5, 9, 40, 41, 42, 97, 300, 7, 2, 13]


@pytest.fixture(scope="module")
def two_servers():
    """Two HTTP front-ends over the same engine: the sync must visit and verify each one."""
    handles = [start_server_in_thread(engine=engine()) for _ in range(2)]
    yield handles
    for h in handles:
        h.stop()
    engine().update_weights_from_disk(checkpoint(0), "default")


def learner(seed):
    return lambda ids, start: hf_logprobs(ids, 1.0, seed=seed)[start - 1:]


def test_export_sync_and_probe_passes(two_servers, tmp_path):
    client = SGLangClient([h.url for h in two_servers])
    model = params.from_pretrained(checkpoint(1))

    async def go():
        await client([3, 4, 5], {"temperature": 0, "max_new_tokens": 2})  # leave something cached
        report = await export_and_sync(model, tmp_path / "step-7", client, "step-7", tokenizer_from=checkpoint(1),
                                       probe_ids=PROBE, probe_start=2, learner_logprobs=learner(1), max_mean_abs_gap=1e-4)
        after = await client([3, 4, 5], {"temperature": 0, "max_new_tokens": 2})
        await client.close()
        return report, after

    report, after = asyncio.run(go())
    assert set(report.probe_gap) == {h.url for h in two_servers}
    assert max(report.probe_gap.values()) < 1e-4
    assert after.weight_version == "step-7" and after.cached_tokens == 0
    assert after.output_ids == hf_greedy([3, 4, 5], 2, seed=1)


def test_probe_gap_fails_loudly_naming_server(two_servers):
    client = SGLangClient([h.url for h in two_servers])

    async def go():
        try:
            await sync_weights(client, checkpoint(0), "step-8", probe_ids=PROBE, learner_logprobs=learner(1))
        finally:
            await client.close()

    with pytest.raises(WeightSyncError, match=r"http://127\.0\.0\.1:\d+ disagrees with the learner.*mean \|Δ log-prob\|"):
        asyncio.run(go())


def test_bad_checkpoint_path_is_an_error(two_servers, tmp_path):
    """Caught by the export check, before any server is asked to load it (real SGLang may die on a
    bad directory); both servers keep their version and, since nothing was sent to them, stay in
    the rotation (issue 27 row 4: they used to leave it until a good sync)."""
    client = SGLangClient([h.url for h in two_servers], retries=0)
    before = [call(h.url, "GET", "/model_info")[1]["weight_version"] for h in two_servers]
    with pytest.raises(WeightSyncError, match=r"missing cannot be read as a Hugging Face model directory.*config\.json not found"):
        asyncio.run(sync_weights(client, tmp_path / "missing", "step-9"))
    assert [call(h.url, "GET", "/model_info")[1]["weight_version"] for h in two_servers] == before != ["step-9"] * 2
    assert client.out_of_rotation == {}


def test_bf16_export_is_the_rounded_hf_tensors_and_loads_in_transformers_with_the_learners_logits(tmp_path):
    """#15 item 6: the export in the compute dtype. Every tensor equals torch's bf16 rounding of
    the checkpoint's own (HF-layout) tensor, so casts and transposes are right; transformers loads
    the directory, and its bf16 logits match the learner's bf16 forward at bf16 tolerance."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = params.from_pretrained(checkpoint(1), param_dtype="float32", compute_dtype="bfloat16")
    timings: dict = {}
    out = export_checkpoint(model, tmp_path / "bf16", checkpoint(1), dtype="bfloat16", timings=timings)
    assert set(timings) == {"gather_s", "write_s"} and all(v > 0 for v in timings.values())
    exported = load_file(out / "model.safetensors")
    original = load_file(checkpoint(1) / "model.safetensors")
    assert set(exported) == set(original)
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, original[name].to(torch.bfloat16)), name
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval()
    ids = np.random.default_rng(0).integers(0, 512, (2, 12))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.float().numpy()
    ours = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids, jnp.int32)))
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() < 0.05 * scale  # bf16 keeps 8 mantissa bits
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_export_dtype_narrower_than_the_served_dtype_is_refused(two_servers, tmp_path):
    """A bf16 export to a float32 server would be served rounded: refused before any update."""
    client = SGLangClient([h.url for h in two_servers], retries=0)
    model = params.from_pretrained(checkpoint(1))
    before = [call(h.url, "GET", "/model_info")[1]["weight_version"] for h in two_servers]
    with pytest.raises(WeightSyncError, match=r"stored in \['bfloat16'\] but http://127\.0\.0\.1:\d+ serves in dtype 'float32'"):
        asyncio.run(export_and_sync(model, tmp_path / "bf16", client, "step-10", dtype="bfloat16"))
    assert [call(h.url, "GET", "/model_info")[1]["weight_version"] for h in two_servers] == before


def test_a_resumed_run_syncs_to_servers_that_kept_serving_a_discarded_step(two_servers, tmp_path):
    """Issue 27 row 1: servers that outlived a killed trainer still serve its step-7 export; the
    run resumes from checkpoint 5, and its first sync (step 5 again) must check its export against
    the served one and load it. After that sync the killed run's exports go."""
    from cleaner_jax.session import discard_after
    from cleaner_jax.train_steps.sync import remove_other_exports

    exports = tmp_path / "sync"
    client = SGLangClient([h.url for h in two_servers], retries=0)
    model = params.from_pretrained(checkpoint(1))
    kw = dict(tokenizer_from=checkpoint(1), probe_ids=PROBE, probe_start=2, learner_logprobs=learner(1),
              max_mean_abs_gap=1e-4)

    async def go():
        try:
            await export_and_sync(model, exports / "step_000007", client, "step-7", **kw)
            discard_after(tmp_path, exports, 5)  # what train.py does on resume
            return await export_and_sync(model, exports / "step_000005", client, "step-5", **kw)
        finally:
            await client.close()

    report = asyncio.run(go())
    assert max(report.probe_gap.values()) < 1e-4
    assert [call(h.url, "GET", "/model_info")[1]["weight_version"] for h in two_servers] == ["step-5"] * 2
    assert sorted(p.name for p in exports.iterdir()) == ["step_000005", "step_000007"]
    removed = remove_other_exports(exports, exports / "step_000005")
    assert [p.name for p in removed] == ["step_000007"]
    assert sorted(p.name for p in exports.iterdir()) == ["step_000005"]
