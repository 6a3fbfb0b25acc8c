"""CPU toy run: a tiny random Qwen3, warm-started on scripted tool-use demonstrations, then
trained with CLEANER (GRPO + SAAR) on the built-in arithmetic task against the embedded
rollout server. Runs in minutes on 2 cores: `python -m cleaner_jax.train --config configs/toy.py`.
"""
from cleaner_jax.config import base_config


def get_config():
    c = base_config()
    c.model.tiny_init = True
    c.model.tiny_family = "qwen3"
    c.model.tiny_hidden_size = 64
    c.model.tiny_num_layers = 2
    c.data.train = "toy"
    c.data.eval = "toy"
    c.data.eval_limit = 128  # held-out problems (a different seed from the training ones)
    c.data.toy_max_operand = 19  # 972 expressions, a quarter of them held out (toy.task.split_of)
    c.data.toy_num_ops = 1
    c.eval.n = 4
    # held-out evaluation samples like training does (the authors' evaluation top-p 0.6 would mostly
    # hide the habits RL is meant to change: a 30% first-token choice falls outside the nucleus)
    c.eval.top_p = 1.0
    c.eval.max_concurrent_problems = 32
    c.agent.max_assistant_turns = 4
    c.agent.max_user_turns = 4
    c.agent.max_prompt_tokens = 512
    c.agent.max_response_tokens = 256
    c.reward.overlong_buffer = 64
    c.sandbox.workers = 2
    # every call shares ~60 characters of JSON boilerplate, so any two toy calls have a difflib
    # ratio >= 0.8: gamma 0.9 puts the line between a typo fix (~0.99) and a different program
    # (~0.85), as 0.5 does for the paper's long calls (docs/toy_world.md)
    c.saar.gamma = 0.9
    c.algo.group_size = 8
    c.algo.prompts_per_step = 4
    c.algo.mini_batches_per_step = 1
    c.algo.micro_batch_size = 16
    c.algo.logprob_chunk = 128
    # the toy's rows are ~150-350 tokens: pow2's 256/512 padded ~35-40% of a batch's slots, widths every
    # 64 tokens ~12% (bench/RESULTS.md, 2026-12-07): fewer padded tokens in every update, more widths to compile
    c.algo.bucket_widths = "every:64"
    # the learner's queries in blocks of 32 tokens skip the causal upper triangle (exact up to float
    # summation order): its step is ~1.4x faster at the toy's head_dim 16 (bench/RESULTS.md, 2026-12-07, late)
    c.model.attention_block = 32
    c.optim.lr = 1e-3
    c.optim.warmup_steps = 2
    c.mesh.fsdp = 1
    # the warm start: a student with habits (docs/toy_world.md)
    # 2048 demonstrations (the 729 training expressions ~3 times over) and 800 steps: with 256
    # demonstrations seen ~19 times each the fit memorised each expression's answer instead of
    # learning to copy the tool's output, and then mis-copied on held-out problems (docs/toy_world.md)
    c.warmup_sft.steps = 800
    c.warmup_sft.lr = 3e-3
    c.warmup_sft.examples = 2048
    c.warmup_sft.error_rate = 0.6
    c.warmup_sft.deep_error_share = 0.5
    c.warmup_sft.guess_rate = 0.4
    c.warmup_sft.give_up_rate = 0.6
    # query blocks of 32 tokens skip the causal upper triangle: the warm start's step is ~1.5x faster
    # (its rows are ~340 tokens, head_dim 16: the [T, T] softmax work dominates; bench/RESULTS.md)
    c.warmup_sft.attention_block = 32
    c.train.steps = 16
    c.train.eval_before_train = True
    c.train.eval_every = 16
    c.train.checkpoint_every = 8
    return c
