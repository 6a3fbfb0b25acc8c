"""The one config schema of a training run, and its start-up validation.

Every config file in `configs/` starts from `base_config()` and changes values; the returned
ConfigDict is locked, so assigning a key that the schema does not have (in the file or as a
`--config.a.b=...` override) fails at once with the key's name. `validate()` then rejects
contradictory or out-of-range values before any model is loaded. Defaults are the authors'
faithful choices (research/open_cleaner.md); each deviation is a named option.
"""
from __future__ import annotations

import os

import ml_collections

from cleaner_jax.models.config import REMAT_POLICIES

# Keys whose value may legitimately be None in a finished config (placeholders are typed so
# that overrides are type-checked by ml_collections).
_OPTIONAL = ml_collections.config_dict.placeholder


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.path = _OPTIONAL(str)  # local HF checkpoint directory (never downloaded)
    c.model.tiny_init = False  # build a random tiny checkpoint in the workdir instead (toy run)
    c.model.tiny_family = "qwen3"
    c.model.tiny_hidden_size = 64
    c.model.tiny_num_layers = 2
    c.model.param_dtype = "float32"  # float32 | bfloat16 | float16
    c.model.compute_dtype = "float32"
    c.model.attention_impl = "xla"  # xla | cudnn (GPU only)
    c.model.remat = "none"  # none | full | dots | dots_no_batch (per decoder layer)

    c.data = ml_collections.ConfigDict()
    c.data.train = "toy"  # "toy" (built-in arithmetic task) or a local .parquet/.jsonl path
    c.data.train_limit = _OPTIONAL(int)
    c.data.eval = "toy"  # "toy", a shipped benchmark name(s) "aime24,aime25", or "" for none
    c.data.eval_limit = _OPTIONAL(int)
    c.data.seed = 0
    c.data.toy_max_operand = 99  # toy task: operands in [2, toy_max_operand]
    c.data.toy_num_ops = 2  # toy task: operators per expression

    c.rollout = ml_collections.ConfigDict()
    c.rollout.backend = "embedded"  # embedded (our server, started by the trainer) | sglang
    c.rollout.server_urls = ""  # comma-separated, for backend=sglang
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = -1
    c.rollout.eval_top_p = 0.6
    c.rollout.eval_n = 16
    c.rollout.request_timeout_s = 600.0

    c.agent = ml_collections.ConfigDict()
    c.agent.max_assistant_turns = 16
    c.agent.max_user_turns = 16
    c.agent.max_prompt_tokens = 2560
    c.agent.max_response_tokens = 20480
    c.agent.observation_mode = "faithful"  # faithful | full
    c.agent.observation_max_chars = 256
    c.agent.chunk_template = "faithful"  # faithful (no newline after <|im_end|>) | canonical
    c.agent.use_tools = True  # False = the authors' *_notool baselines

    c.saar = ml_collections.ConfigDict()
    c.saar.enable = True
    c.saar.max_retries = 3  # K
    c.saar.gamma = 0.5  # deep (full-turn) replacement iff similarity < gamma
    c.saar.rollback_probability = 1.0
    c.saar.similarity = "call"  # call (authors: decoded call segment) | code (code only)
    c.saar.autojunk = True  # authors' difflib default; False is the measured-better option
    c.saar.logprob_mode = "recompute"  # recompute (authors' code) | rollout (paper §4.3)
    c.saar.keep_failed_attempts = False  # negative-sample stream for later study

    c.sandbox = ml_collections.ConfigDict()
    c.sandbox.workers = 4
    c.sandbox.timeout_s = 4.0
    c.sandbox.memory_mb = 512

    c.reward = ml_collections.ConfigDict()
    c.reward.math_mode = "strict"  # strict (authors) | equivalence (math-verify)
    c.reward.overlong_buffer = 4096  # tokens; 0 disables DAPO overlong shaping
    c.reward.overlong_factor = 1.0

    c.algo = ml_collections.ConfigDict()
    c.algo.loss = "ppo"  # ppo | nll (plain NLL on purified trajectories: the imitation control)
    c.algo.advantage = "grpo"  # grpo | drgrpo | rloo
    c.algo.adv_eps = 1e-6
    c.algo.group_size = 16  # responses per prompt
    c.algo.prompts_per_step = 128
    c.algo.mini_batches_per_step = 4  # policy updates per rollout batch (ppo_mini_batch)
    c.algo.micro_batch_size = 8  # sequences per gradient-accumulation micro-batch
    c.algo.dynamic_sampling = False  # DAPO group filtering (off in the authors' runs)
    c.algo.dynamic_sampling_max_rounds = 3
    c.algo.clip_low = 0.2
    c.algo.clip_high = 0.28
    c.algo.dual_clip = 10.0
    c.algo.loss_agg = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean
    c.algo.kl_coef = 0.0
    c.algo.kl_type = "k3"  # k1 | k3
    c.algo.entropy_coef = 0.0
    c.algo.tis = "none"  # none | token | sequence (truncated IS vs rollout log-probs)
    c.algo.tis_cap = 2.0
    c.algo.logprob_chunk = 1024  # tokens per chunk in log-prob/entropy computation

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 2e-6
    c.optim.warmup_steps = 20
    c.optim.weight_decay = 0.01
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.grad_clip = 1.0

    c.mesh = ml_collections.ConfigDict()
    c.mesh.fsdp = -1  # -1: all devices not used by tp
    c.mesh.tp = 1

    c.warmup_sft = ml_collections.ConfigDict()  # toy only: RA-SFT analogue from a scripted teacher
    c.warmup_sft.steps = 0
    c.warmup_sft.lr = 3e-3
    c.warmup_sft.examples = 256
    c.warmup_sft.error_rate = 0.3
    c.warmup_sft.batch_size = 16

    c.train = ml_collections.ConfigDict()
    c.train.steps = 235
    c.train.seed = 0
    c.train.eval_every = 10
    c.train.eval_before_train = False
    c.train.checkpoint_every = 10
    c.train.log_every = 1
    c.train.weight_sync_probe_tol = 0.05  # mean |Δlogprob| allowed after a weight sync
    c.train.dump_trajectories = True
    c.lock()
    return c


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config.{key}: {msg}")


def validate(c: ml_collections.ConfigDict) -> None:
    """Reject impossible or contradictory values at start-up, naming the key."""
    _check(c.model.tiny_init or c.model.path is not None, "model.path",
           "no checkpoint given: set --config.model.path=DIR (a local HF directory) or model.tiny_init=True")
    if c.model.path is not None and not c.model.tiny_init:
        _check(os.path.isdir(c.model.path), "model.path", f"{c.model.path!r} is not a directory")
    for key in ("param_dtype", "compute_dtype"):
        _check(c.model[key] in ("float32", "bfloat16", "float16"), f"model.{key}",
               f"{c.model[key]!r} is not one of float32, bfloat16, float16")
    _check(c.model.attention_impl in ("xla", "cudnn"), "model.attention_impl", "must be xla or cudnn")
    _check(c.model.remat in REMAT_POLICIES, "model.remat", f"{c.model.remat!r} is not one of {REMAT_POLICIES}")
    if c.data.train != "toy":
        _check(os.path.exists(c.data.train), "data.train",
               f"training data {c.data.train!r} not found (give a local .parquet/.jsonl path, or 'toy')")
    _check(c.data.toy_max_operand >= 2, "data.toy_max_operand", "must be >= 2")
    _check(c.data.toy_num_ops >= 1, "data.toy_num_ops", "must be >= 1")
    _check(c.rollout.backend in ("embedded", "sglang"), "rollout.backend", "must be embedded or sglang")
    _check(c.rollout.backend != "sglang" or bool(c.rollout.server_urls), "rollout.server_urls",
           "backend=sglang needs at least one server URL")
    _check(c.rollout.temperature >= 0, "rollout.temperature", "must be >= 0")
    _check(0 < c.rollout.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    _check(0 <= c.saar.gamma <= 1, "saar.gamma", f"{c.saar.gamma} is outside [0, 1]")
    _check(c.saar.max_retries >= 0, "saar.max_retries", f"K={c.saar.max_retries} must be >= 0")
    _check(0 <= c.saar.rollback_probability <= 1, "saar.rollback_probability", "must be in [0, 1]")
    _check(c.saar.similarity in ("call", "code"), "saar.similarity", "must be call or code")
    _check(c.saar.logprob_mode in ("recompute", "rollout"), "saar.logprob_mode", "must be recompute or rollout")
    _check(not (c.saar.enable and c.saar.logprob_mode == "rollout" and c.rollout.temperature != 1.0),
           "saar.logprob_mode", "rollout mode re-scores spliced spans on the rollout server, which (like SGLang) "
           "scores prompts untempered: it needs rollout.temperature=1.0 (or use logprob_mode=recompute)")
    _check(not (c.saar.enable and not c.agent.use_tools), "saar.enable",
           "SAAR needs tools: agent.use_tools=False (a notool baseline) requires saar.enable=False")
    _check(c.agent.observation_mode in ("faithful", "full"), "agent.observation_mode", "must be faithful or full")
    _check(c.agent.chunk_template in ("faithful", "canonical"), "agent.chunk_template", "must be faithful or canonical")
    _check(c.agent.max_assistant_turns >= 1, "agent.max_assistant_turns", "must be >= 1")
    _check(c.reward.math_mode in ("strict", "equivalence"), "reward.math_mode", "must be strict or equivalence")
    _check(0 <= c.reward.overlong_buffer < c.agent.max_response_tokens, "reward.overlong_buffer",
           "must be in [0, agent.max_response_tokens)")
    _check(c.algo.loss in ("ppo", "nll"), "algo.loss", "must be ppo or nll")
    _check(c.algo.advantage in ("grpo", "drgrpo", "rloo"), "algo.advantage", "must be grpo, drgrpo or rloo")
    _check(c.algo.group_size >= 1, "algo.group_size", "must be >= 1")
    _check(c.algo.advantage != "rloo" or c.algo.group_size >= 2, "algo.advantage", "rloo needs group_size >= 2")
    seqs = c.algo.group_size * c.algo.prompts_per_step
    _check(seqs % c.algo.mini_batches_per_step == 0, "algo.mini_batches_per_step",
           f"{seqs} sequences per step do not split into {c.algo.mini_batches_per_step} mini-batches")
    mini = seqs // c.algo.mini_batches_per_step
    _check(mini % c.algo.micro_batch_size == 0, "algo.micro_batch_size",
           f"a mini-batch of {mini} sequences does not split into micro-batches of {c.algo.micro_batch_size}")
    _check(0 <= c.algo.clip_low < 1 and c.algo.clip_high >= 0, "algo.clip_low", "clip ranges must be in [0, 1)")
    _check(c.algo.dual_clip > 1, "algo.dual_clip", "dual-clip c must be > 1")
    _check(c.algo.loss_agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"), "algo.loss_agg",
           "must be token-mean, seq-mean-token-sum or seq-mean-token-mean")
    _check(c.algo.kl_type in ("k1", "k3"), "algo.kl_type", "must be k1 or k3")
    _check(c.algo.tis in ("none", "token", "sequence"), "algo.tis", "must be none, token or sequence")
    _check(not (c.algo.tis != "none" and c.saar.enable and c.saar.logprob_mode == "recompute"), "algo.tis",
           "truncated IS needs rollout log-probs of the purified tokens: use saar.logprob_mode=rollout or saar.enable=False")
    _check(c.warmup_sft.steps == 0 or c.warmup_sft.examples >= c.warmup_sft.batch_size, "warmup_sft.examples",
           f"{c.warmup_sft.examples} demonstrations cannot fill a batch of warmup_sft.batch_size={c.warmup_sft.batch_size}")
    _check(c.warmup_sft.steps == 0 or c.data.train == "toy", "warmup_sft.steps",
           "the scripted-teacher warm start exists for the toy task only (data.train='toy')")
    _check(c.optim.lr > 0, "optim.lr", "must be > 0")
    _check(c.mesh.tp >= 1, "mesh.tp", "must be >= 1")
    _check(c.train.steps >= 0, "train.steps", "must be >= 0")
