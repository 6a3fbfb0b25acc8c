"""Shared, lazily built objects for the rollout tests (one engine compile per pytest process).

Kept in a plain module with functools.cache rather than fixtures so several test modules reuse
the same compiled engine; everything is built under one temporary directory.
"""
from __future__ import annotations

import functools
import tempfile
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
