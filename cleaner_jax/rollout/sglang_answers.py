"""What the rollout client reads from SGLang's native API and adds to its requests
(docs/sglang_api.md §5.3; the server's side of the format is `rollout/wire.py`): a /generate
answer into `GenOutput` (finish reason, output ids, log-probs checked finite), the routing-key
header sglang-router's `manual` policy reads, and the errors a server's answer raises. Pure
functions over JSON bodies: `rollout/client.py` does the HTTP."""
from __future__ import annotations

import math
from typing import Any

from cleaner_jax.rollout.protocol import GenOutput


class RolloutServerError(RuntimeError):
    """A server could not be reached or failed (5xx) after every retry."""


class RolloutRequestError(ValueError):
    """The server rejected the request as invalid (HTTP 400); retrying would not help."""


class InvalidLogprobsError(RolloutServerError):
    """The server answered, but with null or NaN log-probs: its weights are not finite (real SGLang
    returns NaN log-probs as JSON null). A `RolloutServerError`, so the collector counts the
    episode as an infrastructure failure instead of training on it or scoring it."""


ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sglang-router's key for its `manual` (sticky) policy
ROUTER_404_HINT = (" (if this URL is an sglang-router: it forwards generation and /flush_cache but not "
                   "/server_info or the weight-sync calls; give the trainer the workers' URLs in "
                   "rollout.server_urls and the router's in rollout.router_url, docs/scaling.md, "
                   "\"Generation through sglang-router\")")


def routing_headers(route_key: str | None) -> dict[str, str] | None:
    """The trajectory's route key as sglang-router's routing-key header, so that behind a router
    (`launch/router.sh`, `--policy manual`) every turn of a trajectory reaches the worker that
    holds its prefix, as this client's own sticky map does across direct server URLs. SGLang and
    our server ignore the header."""
    return None if route_key is None else {ROUTING_KEY_HEADER: route_key}


def to_gen_output(resp: dict[str, Any]) -> GenOutput:
    """One SGLang /generate response → GenOutput (checks log-probs line up with output_ids)."""
    meta = resp["meta_info"]
    fr = meta["finish_reason"] or {}
    kind = fr.get("type")
    if kind not in ("stop", "length", "abort"):
        raise RolloutServerError(f"unexpected finish_reason {fr!r}")
    lps = meta.get("output_token_logprobs")
    where = f"generation {meta.get('id')!r} on weights {meta.get('weight_version')!r}"
    logprobs = checked_logprobs([e[0] for e in lps], where) if lps is not None else None
    matched = fr.get("matched") if kind == "stop" and isinstance(fr.get("matched"), int) else None
    return GenOutput(
        output_ids=[int(t) for t in resp["output_ids"]],
        output_logprobs=logprobs,
        finish_reason=kind,
        matched_stop=matched,
        cached_tokens=int(meta.get("cached_tokens", 0)),
        weight_version=meta.get("weight_version"),
    )


def checked_logprobs(values: list[Any], where: str) -> list[float]:
    """`values` as floats; raises InvalidLogprobsError when any is null or NaN (non-finite served
    weights: SGLang sends NaN as JSON null), naming the positions. -inf is a valid log-prob."""
    bad = [i for i, v in enumerate(values) if v is None or math.isnan(float(v))]
    if bad:
        raise InvalidLogprobsError(
            f"{where}: {len(bad)} of {len(values)} log-probs are null or NaN (first at positions {bad[:8]}); "
            "the served weights are probably not finite: check the last weight sync")
    return [float(v) for v in values]
