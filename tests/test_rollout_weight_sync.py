"""Weight sync: export → /update_weights_from_disk → version check → flush → probe vs learner."""
import asyncio

import pytest

from _rollout_common import checkpoint, engine, hf_greedy, hf_logprobs
from cleaner_jax.models import qwen
from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.server import start_server_in_thread
from cleaner_jax.rollout.weight_sync import WeightSyncError, export_and_sync, sync_weights

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
    model = qwen.from_pretrained(checkpoint(1))

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
    client = SGLangClient([h.url for h in two_servers], retries=0)
    with pytest.raises(Exception, match="refused the weights"):
        asyncio.run(sync_weights(client, tmp_path / "missing", "step-9"))
