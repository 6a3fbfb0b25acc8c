"""Shared, lazily built objects for the rollout tests (one engine compile per pytest process).

Kept in a plain module with functools.cache rather than fixtures so several test modules reuse
the same compiled engine; everything is built under one temporary directory.
"""
from __future__ import annotations

import contextlib
import functools
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from cleaner_jax.testing.http import http_call
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint


@functools.cache
def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="rollout-tests-"))


@functools.cache
def checkpoint(seed: int = 0) -> Path:
    return make_tiny_checkpoint(workdir() / f"ckpt{seed}", seed=seed)


@functools.cache
def engine(decode_backend: str = "auto"):
    """The shared engine on checkpoint(0); "auto" is the default every other test uses."""
    from cleaner_jax.rollout.engine import Engine

    return Engine(checkpoint(0), max_batch=8, decode_chunk=16, decode_backend=decode_backend)


@functools.cache
def hf_model(seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint(seed)), dtype=torch.float32).eval()


def hf_greedy(prompt: list[int], max_new: int, seed: int = 0) -> list[int]:
    """transformers generate, greedy, EOS ignored (the reference for our greedy tokens)."""
    import torch

    with torch.no_grad():
        out = hf_model(seed).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def hf_logprobs(ids: list[int], temperature: float, seed: int = 0) -> np.ndarray:
    """[len(ids)-1]: log_softmax(logits / T)[ids[t+1]] from one full HF forward (T=0 → raw)."""
    import torch

    with torch.no_grad():
        logits = hf_model(seed)(torch.tensor([ids])).logits[0].double()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


def call(url: str, method: str, path: str, body=None, raw: bytes | None = None):
    """One HTTP request with urllib (independent of our client); returns (status, JSON or text)."""
    return http_call(url, method, path, body, raw=raw)


@contextlib.contextmanager
def decode_gate(eng, chunks: int) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Stop the next generation of `eng` inside its batch after `chunks` decode chunks, until the
    test sets `go`: a request that is surely running (its batch inside the engine, holding it)
    while the test pauses, flushes or syncs the server, however fast the box decodes (a
    2000-token greedy run of the tiny model takes 0.3 s on an idle box). Yields (reached, go);
    `reached` is set when the gate holds the batch; the gate opens on exit."""
    real = eng._decode
    reached, go = threading.Event(), threading.Event()
    calls = 0

    def gated(*args):
        nonlocal calls
        calls += 1
        if calls == chunks + 1:
            reached.set()
            if not go.wait(120):
                raise RuntimeError("decode_gate: the test never opened the gate")
        return real(*args)

    eng._decode = gated
    try:
        yield reached, go
    finally:
        go.set()
        eng._decode = real
