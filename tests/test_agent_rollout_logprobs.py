"""`saar.logprob_mode = "rollout"`: after purification every policy token's rollout log-prob is
log p(token | purified prefix) at the sampling temperature — re-scored spliced spans and kept
tokens alike — checked against a Hugging Face (PyTorch) forward of the purified sequence."""
import asyncio
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.scripted import ScriptedPolicy, code_call
from cleaner_jax.agent.tools import SandboxExecutor
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.models import params
from cleaner_jax.rollout.rescore import ModelRescorer, PrefixCachedRescorer
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint
from cleaner_jax.tools.sandbox import Sandbox

T = 0.7
MESSAGES = [{"role": "user", "content": "What is 1+2?"}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3")
    model = params.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with Sandbox(workers=1) as sb:
        # one instance each: every instance compiles its own forward
        scorers = {"full": ModelRescorer(model), "prefix_cached": PrefixCachedRescorer(model)}
        yield AutoTokenizer.from_pretrained(path), scorers, hf, sb


def _hf_logprobs(hf, ids):
    """log_softmax(logits / T) of each token given its prefix; index 0 gets 0."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double() / T
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return np.concatenate([[0.0], lp.numpy()])


SCENARIOS = {
    # shallow splice twice (original reasoning kept), then recovery and more turns
    "shallow_x2": [code_call("print(bad)", "Let me compute. "), code_call("print(bad)", "Again. "),
                   code_call("print(1+2)", "Fixed. "), code_call("print(2+2)", "Check. ")],
    # deep splice (very different call), recovery
    "deep": [code_call("values = [bad] * 10\n" + "total = sum(values) + len(values) * 3\n" * 6, "Plan A. "),
             code_call("import math\nprint(math.comb(3, 1))", "Use combinatorics instead. ")],
    # regeneration without a call: kept raw, on-policy
    "kept_raw": [code_call("print(bad)", "Let me compute. "), "No tool then. \\boxed{3}"],
}


@pytest.mark.parametrize("scenario,rescorer_kind", [
    ("shallow_x2", "prefix_cached"), ("deep", "prefix_cached"), ("kept_raw", "prefix_cached"),
    pytest.param("shallow_x2", "full", marks=pytest.mark.slow),
    pytest.param("deep", "full", marks=pytest.mark.slow),
])
def test_rollout_mode_logprobs_equal_a_forward_of_the_purified_sequence(setup, scenario, rescorer_kind):
    tok, scorers, hf, sandbox = setup
    behaviour = scorers["full"]

    def engine_logprobs(input_ids, output_ids):  # what an engine returns while sampling
        return behaviour.logprobs(input_ids + output_ids, len(input_ids), T)

    policy = ScriptedPolicy(tok, SCENARIOS[scenario], final="So \\boxed{3}.", logprob_fn=engine_logprobs)
    rescorer = scorers[rescorer_kind]
    config = AgentConfig(saar=SaarConfig(logprob_mode="rollout"))
    loop = AgentLoop(policy, SandboxExecutor(sandbox), ChatFormat(tok), config, {"temperature": T},
                     rescorer=rescorer, rng=random.Random(0))
    ep = asyncio.run(loop.run(MESSAGES))
    p = ep.purified
    assert ep.stats.triggered == 1
    ref = _hf_logprobs(hf, p.full_ids.tolist())[len(p.prompt_ids):]
    policy_tokens = p.loss_mask.astype(bool)
    np.testing.assert_allclose(p.rollout_logprobs[policy_tokens], ref[policy_tokens], atol=1e-4)
    assert (p.rollout_logprobs[~policy_tokens] == 0).all()
    if scenario != "kept_raw":
        # the sampled (error-conditioned) log-probs of the spliced tokens are really different
        spliced = p.spliced & policy_tokens
        assert spliced.sum() > 10
        assert np.abs(p.behaviour_logprobs[spliced] - ref[spliced]).max() > 1e-2
    else:
        assert not p.spliced.any()


def test_prefix_cached_rescorer_computes_only_the_suffix(setup):
    tok, scorers, hf, _ = setup
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 4, add_special_tokens=False)
    scorer = scorers["prefix_cached"]
    scorer.extend(ids)
    before = scorer.tokens_computed
    edited = ids[:-8] + tok.encode(" 0 1 2 3", add_special_tokens=False)
    got = asyncio.run(scorer.score(edited, len(ids) - 8, T))
    assert scorer.tokens_computed - before == len(edited) - (len(ids) - 9)
    np.testing.assert_allclose(got, _hf_logprobs(hf, edited)[len(ids) - 8:], atol=1e-4)
