"""One blocking HTTP request with urllib, for tests and the fixture recorder.

Deliberately independent of `cleaner_jax.rollout.client`, so conformance checks of the server
(ours or real SGLang) do not go through the code under test.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def http_call(
    url: str, method: str, path: str, body: Any = None, *, raw: bytes | None = None, timeout: float = 120
) -> tuple[int, Any]:
    """Send `body` as JSON (or `raw` bytes as they are) to `url + path`; return (status, the
    parsed JSON response, or its text when it is not JSON). HTTP errors are returned, not raised."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text
