"""JAX engine vs HF transformers on the tiny checkpoint: tokens, log-probs, batching, prefix cache."""
import asyncio
import json

import numpy as np
import pytest

from _rollout_common import checkpoint, engine, hf_greedy, hf_logprobs
from cleaner_jax.rollout.request import GenRequest, SamplingParams
from cleaner_jax.rollout.scheduler import EngineGenerate

PROMPTS = [list(range(5, 13)), [40, 41, 42, 97, 98], [300, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25]]


def greedy(max_new: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **kw)


def run(reqs):
    return engine().generate_batch(reqs)


def test_greedy_matches_transformers_and_batch_equals_single():
    engine().flush_cache()
    batch = run([GenRequest(tuple(p), greedy(12), f"b{i}") for i, p in enumerate(PROMPTS)])
    for p, res in zip(PROMPTS, batch):
        assert res.output_ids == hf_greedy(p, 12)
        assert res.finish_type == "length" and res.prompt_tokens == len(p)
        ref = hf_logprobs(p + res.output_ids, 0.0)[len(p) - 1:]
        np.testing.assert_allclose(res.output_logprobs, ref, atol=1e-4)
    engine().flush_cache()
    for p, res in zip(PROMPTS, batch):
        single = run([GenRequest(tuple(p), greedy(12), "single")])[0]
        assert single.output_ids == res.output_ids
        np.testing.assert_allclose(single.output_logprobs, res.output_logprobs, atol=1e-5)


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.5, 1.0, -1), (1.0, 0.9, -1), (1.7, 0.95, 20)])
def test_sampled_logprobs_are_tempered_untruncated_reference(temperature, top_p, top_k):
    p = PROMPTS[1]
    sp = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=True, sampling_seed=7)
    res = run([GenRequest(tuple(p), sp, "t")])[0]
    ref = hf_logprobs(p + res.output_ids, temperature)[len(p) - 1:]
    np.testing.assert_allclose(res.output_logprobs, ref, atol=1e-4)


def test_seeded_sampling_batch_equals_single():
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True, sampling_seed=123)
    batch = run([GenRequest(tuple(p), sp, f"b{i}") for i, p in enumerate(PROMPTS)])
    engine().flush_cache()
    single = run([GenRequest(tuple(PROMPTS[2]), sp, "s")])[0]
    assert single.output_ids == batch[2].output_ids


def test_stop_tokens_kept_in_output_and_eos_from_generation_config(tmp_path):
    gen_cfg = json.loads((checkpoint(0) / "generation_config.json").read_text())
    assert set(engine().eos_ids) == set(gen_cfg["eos_token_id"])
    p = PROMPTS[0]
    free = hf_greedy(p, 12)
    stop = free[4]
    res = run([GenRequest(tuple(p), SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,)), "s")])[0]
    assert res.output_ids == free[: free.index(stop) + 1]
    assert (res.finish_type, res.matched) == ("stop", stop)
    ignored = run([GenRequest(tuple(p), greedy(12, stop_token_ids=(stop,)), "i")])[0]
    assert ignored.output_ids == free and ignored.finish_type == "length"  # SGLang: ignore_eos drops all token stops


def test_multi_turn_reuses_prefix_with_sglang_cached_tokens():
    eng = engine()
    eng.flush_cache()
    p1 = PROMPTS[1]
    r1 = run([GenRequest(tuple(p1), greedy(8), "t1")])[0]
    again = run([GenRequest(tuple(p1), greedy(8), "t1b")])[0]
    assert again.cached_tokens == len(p1) - 1 and again.output_ids == r1.output_ids
    p2 = p1 + r1.output_ids + [7, 8]
    r2 = run([GenRequest(tuple(p2), greedy(8), "t2")])[0]
    assert r2.cached_tokens == len(p1) + len(r1.output_ids) - 1
    assert r2.output_ids == hf_greedy(p2, 8)
    eng.flush_cache()
    cold = run([GenRequest(tuple(p2), greedy(8), "t2cold")])[0]
    assert cold.cached_tokens == 0 and cold.output_ids == r2.output_ids
    np.testing.assert_allclose(cold.output_logprobs, r2.output_logprobs, atol=1e-5)


def test_prompt_logprobs_sglang_form_and_tempered_score():
    eng = engine()
    p = PROMPTS[2]
    run([GenRequest(tuple(p), greedy(4), "warm")])  # leaves p's KV in the prefix cache
    res = run([GenRequest(tuple(p), greedy(0), "lp", logprob_start_len=3)])[0]
    assert res.output_ids == [] and res.finish_type == "length"
    assert res.cached_tokens == 3  # SGLang: min(logprob_start_len, prompt - 1)
    assert res.input_logprobs[0] is None and len(res.input_logprobs) == len(p) - 3
    np.testing.assert_allclose(res.input_logprobs[1:], hf_logprobs(p, 1.0)[3:], atol=1e-4)  # untempered
    gen = EngineGenerate.from_engine(eng)
    try:
        scored = asyncio.run(gen.score(p, start=5, temperature=0.7))
    finally:
        gen.close()
    np.testing.assert_allclose(scored, hf_logprobs(p, 0.7)[4:], atol=1e-4)


def test_weight_update_switches_outputs_and_flushes():
    eng = engine()
    p = PROMPTS[0]
    run([GenRequest(tuple(p), greedy(12), "before")])
    try:
        eng.update_weights_from_disk(checkpoint(1), "step-1")
        res = run([GenRequest(tuple(p), greedy(12), "after")])[0]
        assert res.cached_tokens == 0 and res.weight_version == "step-1"
        assert res.output_ids == hf_greedy(p, 12, seed=1) != hf_greedy(p, 12, seed=0)
    finally:
        eng.update_weights_from_disk(checkpoint(0), "default")


def test_concurrent_generate_calls_are_batched_and_correct():
    eng = engine()
    eng.flush_cache()
    gen = EngineGenerate.from_engine(eng, max_wait_s=0.05)

    async def many():
        return await asyncio.gather(*(
            gen(p, {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}) for p in PROMPTS + PROMPTS[:1]
        ))

    try:
        outs = asyncio.run(many())
        assert gen.scheduler.batches_run < len(outs)
    finally:
        gen.close()
    for p, out in zip(PROMPTS + PROMPTS[:1], outs):
        assert out.output_ids == hf_greedy(p, 6) and out.finish_reason == "length"
        assert len(out.output_logprobs) == 6


@pytest.mark.timeout(120)
def test_abort_returns_partial_output():
    eng = engine()
    gen = EngineGenerate.from_engine(eng)
    sched = gen.scheduler
    try:
        req = GenRequest(tuple(PROMPTS[0]), greedy(40), "to-abort")
        fut = sched.submit(req)
        sched.abort("to-abort")
        res = fut.result(timeout=100)
    finally:
        gen.close()
    assert res.finish_type == "abort" and len(res.output_ids) < 40


def test_an_abort_does_not_relabel_a_row_that_already_ended():
    """A pause aborts every request of the running batch; a row that had already ended keeps its
    finish (SGLang has answered it by then). Labelled "abort", a turn ending in its stop token
    would be continued past it (rollout.continue_aborted). Aborts sent before the batch runs:
    the short row ends at its prefill, before the first decode chunk sees them."""
    short, long = GenRequest(tuple(PROMPTS[0]), greedy(1), "ended"), GenRequest(tuple(PROMPTS[1]), greedy(40), "cut")
    engine().abort("ended")
    engine().abort("cut")
    done, cut = run([short, long])
    assert (done.finish_type, done.output_ids) == ("length", hf_greedy(PROMPTS[0], 1))
    assert cut.finish_type == "abort" and cut.output_ids == hf_greedy(PROMPTS[1], 1)


# ------------------------------------------------------------------ decode backends


@pytest.mark.parametrize("backend", ["xla", "cpu_kernels"])
def test_decode_backends_match_transformers(backend):
    """Both backends against the same HF reference: greedy tokens and log-probs of a ragged batch,
    and the tempered log-probs of seeded sampled rows."""
    eng = engine(backend)
    assert eng.decode_backend.name == backend
    eng.flush_cache()
    batch = eng.generate_batch([GenRequest(tuple(p), greedy(12), f"b{i}") for i, p in enumerate(PROMPTS)])
    for p, res in zip(PROMPTS, batch):
        assert res.output_ids == hf_greedy(p, 12)
        np.testing.assert_allclose(res.output_logprobs, hf_logprobs(p + res.output_ids, 0.0)[len(p) - 1:], atol=1e-4)
    sp = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, ignore_eos=True, sampling_seed=3)
    sampled = eng.generate_batch([GenRequest(tuple(p), sp, f"s{i}") for i, p in enumerate(PROMPTS)])
    for p, res in zip(PROMPTS, sampled):
        np.testing.assert_allclose(res.output_logprobs, hf_logprobs(p + res.output_ids, 0.8)[len(p) - 1:], atol=1e-4)


def test_decode_backend_is_what_the_model_step_runs():
    """The kernel backend's decode step and prefill step each call the attention kernel once per
    layer and nothing else of ours (its matmuls are XLA's); the XLA backend and the model's default
    call none (the backend reaches the model only as its `ops` argument)."""
    import jax
    import jax.numpy as jnp

    from cleaner_jax.models import params, qwen

    model = params.from_pretrained(checkpoint(0))
    cache = qwen.init_cache(model.config, 4, 32)
    ids = jnp.ones((4, 1), jnp.int32)

    def jaxpr(ops, ids=ids) -> str:
        kw = {} if ops is None else {"ops": ops}
        return str(jax.make_jaxpr(lambda i, c: model(i, cache=c, **kw))(ids, cache))

    kernels = engine("cpu_kernels").decode_backend
    layers = model.config.num_hidden_layers
    step = jaxpr(kernels)
    assert step.count("cj_cache_attention") == step.count("cj_") == layers
    prefill = jaxpr(kernels, jnp.ones((4, 3), jnp.int32))
    assert prefill.count("cj_cache_attention") == prefill.count("cj_") == layers
    assert jaxpr(engine("xla").decode_backend).count("cj_") == 0
    assert jaxpr(None).count("cj_") == 0


def test_auto_backend_without_a_compiler_warns_once_and_generates(tmp_path, caplog):
    import logging

    from cleaner_jax.models.ops import XLA
    from cleaner_jax.rollout import decode_backend
    from cleaner_jax.rollout.engine import Engine

    bad = str(tmp_path / "no-such-compiler")
    with caplog.at_level(logging.WARNING, logger=decode_backend.__name__):
        ops = decode_backend.resolve("auto", compute_dtype="float32", compiler=bad, cache_dir=tmp_path)
        decode_backend.resolve("auto", compute_dtype="float32", compiler=bad, cache_dir=tmp_path)
    assert ops is XLA
    assert len([r for r in caplog.records if "no-such-compiler" in r.getMessage()]) == 1
    eng = Engine(checkpoint(0), max_batch=8, decode_chunk=16, decode_backend=ops)
    assert eng.decode_backend is XLA
    res = eng.generate_batch([GenRequest(tuple(PROMPTS[0]), greedy(12), "auto")])[0]
    assert res.output_ids == hf_greedy(PROMPTS[0], 12)


def test_engine_rejects_a_decode_backend_that_cannot_apply():
    from cleaner_jax.rollout.engine import Engine

    with pytest.raises(ValueError, match=r"decode_backend='cpu_kernels' needs .*'bfloat16'"):
        Engine(checkpoint(0), dtype="bfloat16", decode_backend="cpu_kernels")
    with pytest.raises(ValueError, match=r"decode_backend='gpu'"):
        Engine(checkpoint(0), decode_backend="gpu")
    with pytest.raises(TypeError, match="decode_backend"):
        Engine(checkpoint(0), decode_backend=None)
