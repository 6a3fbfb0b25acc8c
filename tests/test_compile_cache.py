"""The embedded rollout server's persistent compilation cache (`--compilation-cache-dir`, passed by
the trainer from train.compilation_cache_dir; cleaner_jax/models/compile_cache.py): a first server
fills the directory, and a second one on the same model compiles nothing new (every program it
needs is found there). The learner's side: tests/test_rl_bucketing.py."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from _rollout_common import checkpoint
from cleaner_jax.rollout.fleet import EmbeddedServerProcess


def serve_one_request(model: Path, cache: Path) -> dict:
    server = EmbeddedServerProcess(model, dtype="float32", decode_backend="auto", max_batch=8,
                                   batch_invariant=True, compilation_cache_dir=cache)
    try:
        server.start()
        server.wait_ready_blocking(180)
        body = json.dumps({"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
        req = urllib.request.Request(server.url + "/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())
    finally:
        server.stop()


def test_a_second_server_finds_every_program_in_the_cache(tmp_path):
    cache = tmp_path / "xla"
    first = serve_one_request(checkpoint(0), cache)
    entries = {p.name for p in cache.iterdir()}
    assert entries, "the server wrote no compiled program to --compilation-cache-dir"
    second = serve_one_request(checkpoint(0), cache)
    assert {p.name for p in cache.iterdir()} == entries  # nothing compiled anew
    assert second["output_ids"] == first["output_ids"]  # greedy: the cached programs decode the same
