"""Shared settings of the authors' paper runs (research/open_cleaner.md §4.1), one function per
variant so every paper config differs from its siblings only where the authors' scripts do."""
from cleaner_jax.config import base_config


def paper_config(*, model: str, cleaner: bool, tools: bool = True):
    """model: "qwen3_4b" | "qwen25_7b"; cleaner: SAAR on (CLEANER) or off (DAPO baseline)."""
    c = base_config()
    c.model.path = None  # set --config.model.path=/local/Qwen3-4B-RA-SFT (never downloaded)
    c.model.param_dtype = "float32"  # master weights and Adam moments in f32 (as FSDP mixed precision)
    c.model.compute_dtype = "float16"  # authors: fp16 actor compute + fp16 SGLang
    c.model.remat = "full"
    c.data.train = "Open-AgentRL-30K.parquet"  # override with the local path of the training file
    c.data.eval = "aime24,aime25"
    c.rollout.backend = "sglang"
    c.rollout.server_urls = "http://127.0.0.1:30000"
    c.algo.group_size = 16
    c.algo.prompts_per_step = 128
    c.algo.mini_batches_per_step = 4
    c.algo.micro_batch_size = 4
    c.optim.lr = 2e-6 if model == "qwen3_4b" else 1e-6
    c.optim.warmup_steps = 20
    c.mesh.tp = 1
    c.train.steps = 235 if model == "qwen3_4b" else 119
    c.train.eval_every = 10
    c.train.checkpoint_every = 10
    c.train.eval_before_train = model == "qwen3_4b"
    c.saar.enable = cleaner and tools
    c.saar.max_retries = 3
    c.saar.rollback_probability = 1.0 if model == "qwen3_4b" else 0.7
    c.agent.use_tools = tools
    if not cleaner:  # baselines collect rollout log-probs and use sequence-level TIS, cap 2
        c.saar.logprob_mode = "rollout"
        c.algo.tis = "sequence"
        c.algo.tis_cap = 2.0
    return c
