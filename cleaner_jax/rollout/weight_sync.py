"""Learner → rollout servers weight sync over HF safetensors on disk, checked, canaried and probed.

The portable path (works on real SGLang, GPU or CPU, and on our server) of docs/sglang_api.md
§5.1 and docs/honest_rl.md rule 4. No server may generate rollouts on weights the sync has not
verified, so every target leaves the client's rotation when its sync starts and returns only
after it passed (meanwhile a client that waits for syncs holds the trajectories pinned to it,
`SGLangClient.sync_wait_s`; a failure loses them). Behind sglang-router the rotation cannot
steer generation: the paused worker holds what the router sends it, and between its
`/continue_generation` and its probe it serves weights whose version is checked but not yet
probed; a probe that fails stops the run (docs/scaling.md, "Generation through sglang-router").
Per sync:

1. **Check the export** against what each server loaded at start (its config and tensor shapes,
   read from the directory `/model_info` names, and its `/server_info` dtype), before any update:
   real SGLang dies on a wrong shape (its rollback reloads the bad directory), so one bad export
   sent to every server would take the fleet down.
2. **Canary:** the first server is updated and probed; the rest only after it passed.
3. **Per server:** `/pause_generation` (abort mode: SGLang refuses `/flush_cache` while any
   request runs) → `/update_weights_from_disk` with a `weight_version` → `/flush_cache` (retried
   until the server is idle, bounded) → `/continue_generation` → the version check → the probe: a
   fixed sequence re-scored on the server and compared with the learner's own log-probs (null or
   NaN log-probs, a gap above the threshold, or another version afterwards fail the sync).

A failure raises `WeightSyncError` naming the server and the phase; a server that stops
answering during its update is reported as having died there.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from safetensors import SafetensorError, safe_open

from cleaner_jax.models import params
from cleaner_jax.rollout.client import SGLangClient
from cleaner_jax.rollout.sglang_answers import InvalidLogprobsError, RolloutRequestError, RolloutServerError

log = logging.getLogger(__name__)

# learner_logprobs(probe_ids, start) -> log p(probe_ids[i] | <i) for i >= start, at T = 1.
LearnerLogprobs = Callable[[list[int], int], Sequence[float] | Awaitable[Sequence[float]]]

# config.json keys that fix the architecture; compared where both the export and the served
# directory have them (tensor shapes cover the rest).
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias")
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class WeightSyncError(RuntimeError):
    """A server did not take the new weights, reports another version, disagrees with the learner,
    or the export does not fit what the servers serve."""


class ContextBudgetError(ValueError):
    """The agent's token budget does not fit a server's context."""


@dataclasses.dataclass(frozen=True)
class SyncReport:
    weight_version: str
    model_path: str
    probe_gap: dict[str, float]  # server url -> mean |server log-prob - learner log-prob|
    seconds: float  # the sync, after the export
    # phase -> seconds: gather_s, write_s (export, when it ran here), check_s (the export against the
    # served models), load_s (pause, update, flush, resume, version; all servers), probe_s
    phases: dict[str, float] = dataclasses.field(default_factory=dict)


def export_checkpoint(model: Any, out_dir: str | Path, tokenizer_from: str | Path | None, *,
                      dtype: str | None = None, timings: dict[str, float] | None = None,
                      max_shard_bytes: int = params.DEFAULT_SHARD_BYTES) -> Path:
    """Write the learner's NNX model as an HF directory that SGLang and our server load, in `dtype`
    (None: the param dtype), index-sharded above `max_shard_bytes` per file (train.weight_export_shard_mb);
    NaN/Inf parameters are refused (`params.NonFiniteWeightsError`). Collective in a multi-process
    run: every process calls it (`params.save_pretrained`)."""
    return params.save_pretrained(model, Path(out_dir), tokenizer_from=tokenizer_from, dtype=dtype, timings=timings,
                             max_shard_bytes=max_shard_bytes)


# ----------------------------------------------------------------------------- the export check

@dataclasses.dataclass(frozen=True)
class Signature:
    """What must agree between an export and a served model: architecture keys, tensor shapes."""

    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    dtypes: frozenset[str]


def read_signature(path: str | Path) -> Signature:
    """The signature of an HF directory from config.json and the safetensors headers (no tensor
    data is read); raises WeightSyncError naming what is missing or unreadable."""
    path = Path(path)
    try:
        config = params.read_config(path)
        files = params.weight_files(path)  # from the index when the directory is sharded
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: set[str] = set()
        for f in sorted(set(files.values())):
            with safe_open(f, framework="numpy") as handle:
                held, listed = set(handle.keys()), {n for n, g in files.items() if g == f}
                if held != listed:  # a server loads by the index: a stray or absent tensor is a torn export
                    raise ValueError(f"{f.name} holds {sorted(held - listed)[:4]} not listed for it in {params.INDEX} "
                                     f"and lacks {sorted(listed - held)[:4]} listed for it")
                for name in handle.keys():
                    tensor = handle.get_slice(name)
                    shapes[name] = tuple(tensor.get_shape())
                    dtypes.add(_ST_DTYPES.get(tensor.get_dtype(), tensor.get_dtype()))
    except (OSError, ValueError, KeyError, SafetensorError) as exc:  # JSONDecodeError is a ValueError
        raise WeightSyncError(f"{path} cannot be read as a Hugging Face model directory: {type(exc).__name__}: {exc}") from exc
    return Signature({k: config[k] for k in ARCH_KEYS if k in config}, shapes, frozenset(dtypes))


def _ignorable(name: str, config: dict[str, Any]) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (bool(config.get("tie_word_embeddings")) and name == "lm_head.weight")


def signature_mismatch(export: Signature, served: Signature) -> list[str]:
    """Human-readable differences that would make the server fail (or die) loading the export."""
    out = [f"config.json {k}: export {export.config[k]!r}, served {served.config[k]!r}"
           for k in ARCH_KEYS if k in export.config and k in served.config and export.config[k] != served.config[k]]
    for name in sorted(set(export.shapes) | set(served.shapes)):
        a, b = export.shapes.get(name), served.shapes.get(name)
        if a is not None and b is not None and a != b:
            out.append(f"tensor {name}: export {list(a)}, served {list(b)}")
        elif a is None and not _ignorable(name, served.config):
            out.append(f"tensor {name}: served, missing from the export")
        elif b is None and not _ignorable(name, export.config):
            out.append(f"tensor {name}: in the export, not in the served model")
    return out


async def check_export(client: SGLangClient, path: str, urls: Sequence[str]) -> None:
    """Compare the export at `path` with what each server serves; raise WeightSyncError listing the
    differences for the first server that disagrees. The served model is the directory its
    `/model_info` names (it must be readable here: the servers load our exports from this
    filesystem anyway), and its `/server_info` dtype bounds the export dtype."""
    export = read_signature(path)
    seen: dict[str, Signature] = {}
    for url in urls:
        info = await client.model_info(url)
        served_path = info.get("model_path")
        if not isinstance(served_path, str):
            raise WeightSyncError(f"{url}/model_info has no model_path, so the export cannot be checked against it: {info}")
        if served_path not in seen:
            try:
                seen[served_path] = read_signature(served_path)
            except WeightSyncError as exc:
                raise WeightSyncError(f"{url} serves {served_path}, which cannot be read here to check the export "
                                      f"{path} against ({exc}); start the server from a directory this host can "
                                      "read") from exc
        diffs = signature_mismatch(export, seen[served_path])
        if diffs:
            raise WeightSyncError(
                f"the export {path} does not fit what {url} serves ({served_path}): {'; '.join(diffs[:6])}"
                f"{f' (and {len(diffs) - 6} more)' if len(diffs) > 6 else ''}. No server was updated (a wrong shape "
                "kills a real SGLang server); export the model the servers were started with")
        served_dtype = (await client.server_info(url)).get("dtype")
        narrow = sorted(export.dtypes - {"float32", served_dtype})
        if narrow:
            raise WeightSyncError(
                f"the export {path} is stored in {narrow} but {url} serves in dtype {served_dtype!r}: the weights "
                "would be rounded twice (bf16 and fp16 keep different bits). Use train.weight_export_dtype=param "
                "or serve in model.compute_dtype")


# ----------------------------------------------------------------------------- the context check

def require_context_budget(budget: int, keys: str, context: int, server: str, where: str) -> None:
    """Raise ContextBudgetError unless `budget` tokens fit a context of `context` tokens (`where`
    says whose): SGLang generates at most context - 1 tokens, so prompt + response = context ends
    one short with finish=length, and is refused like a budget over the context."""
    if budget >= context:
        raise ContextBudgetError(
            f"{keys} = {budget} tokens, but {server} serves at most {context - 1} tokens per request (context "
            f"{context} from {where}, less the one SGLang keeps): lower {keys.replace(' + ', ' or ')}, or serve with "
            "a longer context (SGLang: --context-length, --max-total-tokens)")


async def check_context_budget(client: SGLangClient, budget: int, keys: str) -> dict[str, int]:
    """Each server's context (tokens one request may hold; behind a router, each worker's),
    checked against `budget` (the agent's prompt + response tokens, named by `keys`); returns
    url -> context. A budget over a server's
    context would be answered 400 mid-rollout (or, past SGLang's KV pool, silently clamped); one equal
    to it ends one token short with finish=length (SGLang serves at most context - 1 tokens).

    The context is `/v1/models` `max_model_len` (both servers), bounded by `/server_info`
    `max_total_num_tokens` where the server reports it (SGLang's KV pool)."""
    out = {}
    for server in client.servers:
        models = await client.models(server.url)
        limits = {"/v1/models max_model_len": int(models["data"][0]["max_model_len"])}
        pool = (await client.server_info(server.url)).get("max_total_num_tokens")
        if isinstance(pool, int):
            limits["/server_info max_total_num_tokens"] = pool
        where, context = min(limits.items(), key=lambda kv: kv[1])
        require_context_budget(budget, keys, context, server.url, where)
        out[server.url] = context
    return out


# ----------------------------------------------------------------------------- the sync

async def _load_one(client: SGLangClient, url: str, path: str, version: str, idle_timeout_s: float) -> None:
    """pause → update → flush (until idle) → continue → version check, on one server. A server
    that stops answering on the way is reported as having died there."""
    phase = "pausing generation"
    try:
        await client.pause_generation(url)
        phase = "loading the weights"
        try:
            await client.update_weights_from_disk(url, path, version)
        except RolloutServerError as exc:
            if await client.health(url):
                raise WeightSyncError(f"{url} refused the update to {version!r}: {exc}") from exc
            raise
        phase = "flushing its cache"
        deadline = time.monotonic() + idle_timeout_s
        while not await client.flush_cache_once(url):
            if time.monotonic() > deadline:
                await client.continue_generation(url)
                raise WeightSyncError(
                    f"{url}/flush_cache still answers 400 'Flush cache failed.' {idle_timeout_s:g} s after generation "
                    "was paused: some request is still running or queued there (another client?), and its prefix "
                    "cache may hold KV of the old weights (rollout.sync_idle_timeout_s)")
            await asyncio.sleep(0.05)
        phase = "resuming generation"
        await client.continue_generation(url)
    except RolloutServerError as exc:
        if not await client.health(url):
            raise WeightSyncError(
                f"{url} died during its weight update to {version!r} from {path} (while {phase}: {exc}; /health no "
                "longer answers): see that server's log") from exc
        raise WeightSyncError(f"{url} failed while {phase} for {version!r}: {exc}") from exc
    await _check_version(client, url, version, path, "after loading")


async def _check_version(client: SGLangClient, url: str, version: str, path: str, when: str) -> None:
    got = (await client.model_info(url)).get("weight_version")
    if got != version:
        raise WeightSyncError(f"{url} reports weight_version={got!r} {when} {path} as {version!r} (another client "
                              "updating it, or a server that ignores weight_version)")


async def _probe_one(client: SGLangClient, url: str, probe_ids: list[int], probe_start: int, ref: list[float],
                     max_gap: float, version: str, path: str) -> float:
    try:
        served = await client.score(probe_ids, probe_start, server=url)
    except InvalidLogprobsError as exc:
        raise WeightSyncError(f"{url} serves non-finite weights after loading {version!r} from {path}: {exc}") from exc
    if len(served) != len(ref):
        raise WeightSyncError(f"{url}: probe gave {len(served)} log-probs, learner {len(ref)}")
    gap = sum(abs(a - b) for a, b in zip(served, ref)) / max(len(ref), 1)
    if not gap <= max_gap:  # also catches NaN
        raise WeightSyncError(
            f"{url} disagrees with the learner after loading {version!r} from {path}: "
            f"mean |Δ log-prob| = {gap:.3g} over {len(ref)} probe tokens > {max_gap:g}"
        )
    await _check_version(client, url, version, path, "after the probe of")
    return gap


async def sync_weights(
    client: SGLangClient,
    model_path: str | Path,
    weight_version: str,
    *,
    urls: Sequence[str] | None = None,
    probe_ids: Sequence[int] | None = None,
    probe_start: int = 1,
    learner_logprobs: LearnerLogprobs | None = None,
    max_mean_abs_gap: float = 1e-3,
    idle_timeout_s: float = 30.0,
    timings: dict[str, float] | None = None,
) -> SyncReport:
    """Load `model_path` on `urls` (None: every server of `client`), canary first. Raises WeightSyncError.

    Each target is out of the client's rotation from the start of the sync until it passed;
    after a failure the failed server and those not yet updated stay out (with the reason), so
    no rollout runs on weights the sync did not verify. An export refused by its check, before
    any server was sent anything, leaves the rotation as it was: every server still serves the
    weights it was verified on. `learner_logprobs` gets (probe_ids,
    probe_start) and returns the learner's untempered log-probs of probe_ids[probe_start:]
    (computed once, sync or async). Without a probe, only the version and the flush are checked.
    Pick the threshold for the dtypes involved (~1e-4 for f32 on both sides; bf16 needs ~1e-2).
    `timings` (the export's gather_s/write_s) is copied into the report's phases.
    """
    t0 = time.perf_counter()
    path = str(Path(model_path).resolve())
    targets = [s.url for s in client.servers] if urls is None else [client._by_url(u).url for u in urls]
    if not targets:
        raise ValueError("sync_weights: urls is empty")
    if probe_ids is not None and learner_logprobs is None:
        raise ValueError("probe_ids given without learner_logprobs to compare against")
    before = client.out_of_rotation  # the reasons servers were out already, to put back if nothing is sent
    for url in targets:
        client.take_out_of_rotation(url, f"not yet verified on weights {weight_version!r}", syncing=True)
    phases = dict(timings or {})
    t = time.perf_counter()
    try:
        try:
            await check_export(client, path, targets)
        except (RolloutServerError, RolloutRequestError) as exc:
            raise WeightSyncError(f"could not read what the servers serve to check the export {path}: {exc}") from exc
    except WeightSyncError:
        # refused before any server was sent anything: each still serves the weights it was verified
        # on, so the rotation is as it was before this sync
        for url in targets:
            if url in before:
                client.take_out_of_rotation(url, before[url])
            else:
                client.put_in_rotation(url)
        raise
    phases["check_s"] = time.perf_counter() - t
    phases["load_s"] = phases["probe_s"] = 0.0
    ref: list[float] | None = None
    gaps: dict[str, float] = {}
    for i, url in enumerate(targets):
        try:
            t = time.perf_counter()
            await _load_one(client, url, path, weight_version, idle_timeout_s)
            phases["load_s"] += time.perf_counter() - t
            if probe_ids is not None:
                t = time.perf_counter()
                if ref is None:
                    ref = await _learner_reference(learner_logprobs, list(probe_ids), probe_start)
                gaps[url] = await _probe_one(client, url, list(probe_ids), probe_start, ref, max_mean_abs_gap,
                                             weight_version, path)
                phases["probe_s"] += time.perf_counter() - t
        except (WeightSyncError, RolloutServerError, RolloutRequestError) as exc:
            err = exc if isinstance(exc, WeightSyncError) else WeightSyncError(f"{url}: weight sync to {weight_version!r} failed: {exc}")
            client.take_out_of_rotation(url, f"failed the sync to {weight_version!r}: {err}")
            for later in targets[i + 1:]:
                client.take_out_of_rotation(later, f"not updated to {weight_version!r}: the sync stopped at {url}")
            if i == 0 and len(targets) > 1:
                err = WeightSyncError(f"{err} (canary: the other {len(targets) - 1} server(s) were not touched)")
            raise err from exc
        client.put_in_rotation(url)
        log.info("weight sync %s: %s passed%s", weight_version, url, f" (probe gap {gaps[url]:.3g})" if url in gaps else "")
    report = SyncReport(weight_version, path, gaps, time.perf_counter() - t0, phases)
    log.info("weight sync %s to %d server(s): %s", weight_version, len(targets),
             ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    return report


async def _learner_reference(learner_logprobs: LearnerLogprobs, probe_ids: list[int], start: int) -> list[float]:
    ref = learner_logprobs(probe_ids, start)
    if inspect.isawaitable(ref):
        ref = await ref
    ref = [float(x) for x in ref]
    if not all(math.isfinite(x) for x in ref):
        raise WeightSyncError("the learner's own probe log-probs are not finite: its weights are broken")
    return ref


async def export_and_sync(
    model: Any,
    out_dir: str | Path,
    client: SGLangClient,
    weight_version: str,
    *,
    tokenizer_from: str | Path | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = params.DEFAULT_SHARD_BYTES,
    **sync: Any,
) -> SyncReport:
    """`export_checkpoint` (in `dtype`, None = param dtype; files up to `max_shard_bytes`) then
    `sync_weights` (its keyword arguments)."""
    timings: dict[str, float] = {}
    path = await asyncio.get_running_loop().run_in_executor(
        None, lambda: export_checkpoint(model, out_dir, tokenizer_from, dtype=dtype, timings=timings,
                                        max_shard_bytes=max_shard_bytes))
    return await sync_weights(client, path, weight_version, timings=timings, **sync)


def fixed_reference(probe_ids: list[int], start: int, ref: list[float]) -> Callable[[list[int], int], list[float]]:
    """`sync_weights`' learner_logprobs for the one probe sequence, computed beforehand: with
    several learner processes the learner's log-probs are collective, and a probe (or a server's
    re-admission by the fleet) runs on one process."""
    def learner_logprobs(ids: list[int], at: int) -> list[float]:
        if list(ids) != list(probe_ids) or at != start:
            raise ValueError("fixed_reference: asked for another sequence than the weight-sync probe's")
        return ref
    return learner_logprobs
