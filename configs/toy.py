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
    c.data.eval_limit = 16
    c.data.toy_max_operand = 9  # one-digit operands and one operator: learnable by a tiny model in minutes
    c.data.toy_num_ops = 1
    c.eval.n = 2
    c.agent.max_assistant_turns = 4
    c.agent.max_user_turns = 4
    c.agent.max_prompt_tokens = 512
    c.agent.max_response_tokens = 384
    c.reward.overlong_buffer = 64
    c.sandbox.workers = 2
    c.algo.group_size = 4
    c.algo.prompts_per_step = 4
    c.algo.mini_batches_per_step = 1
    c.algo.micro_batch_size = 8
    c.algo.logprob_chunk = 128
    c.optim.lr = 1e-4
    c.optim.warmup_steps = 2
    c.mesh.fsdp = 1
    c.warmup_sft.steps = 150
    c.warmup_sft.lr = 3e-3
    c.warmup_sft.examples = 256
    c.train.steps = 8
    c.train.eval_every = 4
    c.train.checkpoint_every = 4
    return c
