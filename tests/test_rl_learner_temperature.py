"""Learner.logprobs at an explicit temperature (the weight-sync probe asks for untempered ones)."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from cleaner_jax.models import params
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.learner_config import LearnerConfig
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint


def test_logprobs_follow_the_requested_temperature(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=3, with_tokenizer=False)
    ids = np.random.default_rng(0).integers(0, 512, size=(2, 12)).astype(np.int32)
    learner = Learner(params.from_pretrained(path), LearnerConfig(temperature=0.7, logprob_micro_batch_size=2))
    attn = np.ones_like(ids)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(path).float()(torch.tensor(ids, dtype=torch.long)).logits
    for temperature, got in ((0.7, learner.logprobs(ids, attn)), (1.0, learner.logprobs(ids, attn, temperature=1.0))):
        ref = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, torch.tensor(ids[:, 1:, None], dtype=torch.long))
        np.testing.assert_allclose(got[:, 1:], ref[..., 0].numpy(), atol=2e-5)
        assert np.all(got[:, 0] == 0)
    with pytest.raises(ValueError, match="temperature"):
        learner.logprobs(ids, attn, temperature=0.0)
