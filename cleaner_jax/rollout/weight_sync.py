"""Learner → rollout servers weight sync over HF safetensors on disk, verified and probed.

The portable path (works on real SGLang, GPU or CPU, and on our server) of docs/sglang_api.md
§5.1 and docs/honest_rl.md rule 4: write the learner's params as an HF directory, ask every server to
`/update_weights_from_disk` with a `weight_version`, check every server reports that version,
flush every prefix cache (KV computed with old weights must never be reused), then re-score a
fixed probe sequence on every server and compare with the learner's own log-probs. A gap above
the threshold means the server is not serving what the learner trains: fail loudly.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from cleaner_jax.rollout.client import SGLangClient

# learner_logprobs(probe_ids, start) -> log p(probe_ids[i] | <i) for i >= start, at T = 1.
LearnerLogprobs = Callable[[list[int], int], Sequence[float] | Awaitable[Sequence[float]]]


class WeightSyncError(RuntimeError):
    """A server did not take the new weights, reports another version, or disagrees with the learner."""


@dataclasses.dataclass(frozen=True)
class SyncReport:
    weight_version: str
    model_path: str
    probe_gap: dict[str, float]  # server url -> mean |server log-prob - learner log-prob|
    seconds: float


def export_checkpoint(model: Any, out_dir: str | Path, tokenizer_from: str | Path | None) -> Path:
    """Write the learner's NNX model as an HF directory that SGLang and our server load."""
    from cleaner_jax.models import qwen

    return qwen.save_pretrained(model, out_dir, tokenizer_from=tokenizer_from)


async def sync_weights(
    client: SGLangClient,
    model_path: str | Path,
    weight_version: str,
    *,
    probe_ids: Sequence[int] | None = None,
    probe_start: int = 1,
    learner_logprobs: LearnerLogprobs | None = None,
    max_mean_abs_gap: float = 1e-3,
) -> SyncReport:
    """Load `model_path` on every server of `client`, verify, flush, probe. Raises WeightSyncError.

    `learner_logprobs` gets (probe_ids, probe_start) and returns the learner's untempered
    log-probs of probe_ids[probe_start:]; it may be sync or async. Without a probe, only the
    version and the flush are checked. Pick the threshold for the dtypes involved (~1e-4 for
    f32 on both sides; bf16 needs ~1e-2).
    """
    t0 = time.perf_counter()
    path = str(Path(model_path).resolve())
    urls = [s.url for s in client.servers]
    await asyncio.gather(*(client.update_weights_from_disk(u, path, weight_version) for u in urls))
    infos = await asyncio.gather(*(client.model_info(u) for u in urls))
    for url, info in zip(urls, infos):
        if info.get("weight_version") != weight_version:
            raise WeightSyncError(
                f"{url} reports weight_version={info.get('weight_version')!r} after loading "
                f"{path} as {weight_version!r}"
            )
    await client.flush_cache()
    gaps: dict[str, float] = {}
    if probe_ids is not None:
        if learner_logprobs is None:
            raise ValueError("probe_ids given without learner_logprobs to compare against")
        ref = learner_logprobs(list(probe_ids), probe_start)
        if inspect.isawaitable(ref):
            ref = await ref
        ref = [float(x) for x in ref]
        for url in urls:
            served = await client.score(list(probe_ids), probe_start, server=url)
            if len(served) != len(ref):
                raise WeightSyncError(f"{url}: probe gave {len(served)} log-probs, learner {len(ref)}")
            gap = sum(abs(a - b) for a, b in zip(served, ref)) / max(len(ref), 1)
            gaps[url] = gap
            if not gap <= max_mean_abs_gap:  # also catches NaN
                raise WeightSyncError(
                    f"{url} disagrees with the learner after loading {weight_version!r} from {path}: "
                    f"mean |Δ log-prob| = {gap:.3g} over {len(ref)} probe tokens > {max_mean_abs_gap:g}"
                )
        await client.flush_cache()  # the probe itself must not leave KV behind either
    return SyncReport(weight_version, path, gaps, time.perf_counter() - t0)


async def export_and_sync(
    model: Any,
    out_dir: str | Path,
    client: SGLangClient,
    weight_version: str,
    *,
    tokenizer_from: str | Path | None = None,
    **probe: Any,
) -> SyncReport:
    """`export_checkpoint` then `sync_weights` (probe kwargs as in sync_weights)."""
    path = await asyncio.get_running_loop().run_in_executor(None, export_checkpoint, model, out_dir, tokenizer_from)
    return await sync_weights(client, path, weight_version, **probe)
