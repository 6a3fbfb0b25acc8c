"""The run config's rules across keys (`check_combinations`, the one place for them) and the rules
that need one number more than the config (the learner processes, the fsdp size), each raising
ConfigError as `config.<section>.<key>: ...` with what would work.

Everything here is pure: config in, ConfigError out, no file read and no package probed, so that
`validate()` gives the same answer on any machine. What the machine must provide (the files and
directories the config names, model.path's config.json, the packages it asks for) is checked by
`cleaner_jax.config.environment.check_environment` where a run starts.
"""
from __future__ import annotations

import urllib.parse

from cleaner_jax import distributed, schema
from cleaner_jax.config.sections import TOY, DataConfig, RunConfig
from cleaner_jax.data import livecodebench
from cleaner_jax.data.benchmarks import USER_BENCHMARKS, check_user_file, parse_eval_spec
from cleaner_jax.data.problems import BENCHMARKS
from cleaner_jax.eval.settings import EvalSettings, parse_overrides, settings_for
from cleaner_jax.rl import metrics_writer
from cleaner_jax.rl.batch import bucket_widths
from cleaner_jax.schema import ConfigError


def _require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config.{key}: {msg}")


# Fleet checks (docs/scaling.md §5). Attention implementations that materialise f32 scores
# [rows, heads, T, T] per layer (cudnn and splash are flash kernels that never do):
MATERIALISED_ATTENTION = ("xla", "xla_causal")
# The largest such score tensor, per device and layer, a run may build: 8 GiB is one row of
# 32 heads at 8,192 tokens (23,040 tokens, the paper's budget, would be 63 GiB).
SCORES_LIMIT_BYTES = 8 * 2**30
# Concurrent episodes per sandbox worker above which the start-up log warns: the authors' own
# ratio, 128 prompts x 16 samples over code-judge's 64 workers (docs/authors.md §6).
EPISODES_PER_SANDBOX_WORKER = 32
# How the attention bound counts heads before model.path's config.json is read: one, a lower
# bound, so that the bound never refuses what might fit (the start-up check counts them all).
HEADS_UNREAD = "1 head (a lower bound until the start-up check reads model.path's config.json)"


def attention_scores_bytes(rows: int, heads: int, tp: int, tokens: int) -> int:
    """Bytes of one layer's f32 scores [rows, heads / tp, tokens, tokens] on one device."""
    return rows * -(-heads // tp) * tokens * tokens * 4


def check_micro_batch_split(r: RunConfig, fsdp: int) -> None:
    """algo.micro_batch_size against the fsdp size: at validation when mesh.fsdp is given, and in
    `check_mesh` (where the device count is known) when mesh.fsdp=-1.

    Micro-batch rows are split over fsdp (`rl.batch.split_micro_batches`), in the train step and
    in the log-prob pass, which uses the same micro-batch size (`wiring.learner_config`)."""
    a = r.algo
    where = f"mesh.fsdp={r.mesh.fsdp}" if r.mesh.fsdp > 0 else f"mesh.fsdp=-1 (= {fsdp} on this machine)"
    _require(a.micro_batch_size % fsdp == 0, "algo.micro_batch_size",
             f"{a.micro_batch_size} rows per micro-batch (train step and log-prob pass) do not split over the fsdp "
             f"axis of {where}: use a multiple of {fsdp} or a mesh.fsdp that divides it")


def attention_rows(r: RunConfig) -> int:
    """Rows per device of one micro-batch, as far as the config says: with mesh.fsdp=-1 the device
    count is unknown until `check_mesh`, so at least one."""
    return r.algo.micro_batch_size // r.mesh.fsdp if r.mesh.fsdp > 0 else 1


def check_attention_budget(r: RunConfig, rows: int, heads: int, counted: str) -> None:
    """The bound on materialised attention scores (`SCORES_LIMIT_BYTES`) for `rows` rows per
    device of `heads` heads; `counted` says the heads in the message (how they were counted)."""
    m = r.model
    if m.attention_impl not in MATERIALISED_ATTENTION:
        return
    tokens = r.agent.max_model_len
    need = attention_scores_bytes(rows, heads, r.mesh.tp, tokens)
    _require(need <= SCORES_LIMIT_BYTES, "model.attention_impl",
             f"{m.attention_impl!r} materialises f32 attention scores per layer: {rows} row(s) per device x {counted} "
             f"/ mesh.tp={r.mesh.tp} x T^2 with T = agent.max_prompt_tokens + agent.max_response_tokens = {tokens} "
             f"is {need / 2**30:.1f} GiB, above the {SCORES_LIMIT_BYTES / 2**30:.0f} GiB bound: use a flash kernel "
             "(model.attention_impl=cudnn on GPU, splash on TPU) or lower agent.max_response_tokens / "
             "agent.max_prompt_tokens (or algo.micro_batch_size)")


def sandbox_warning(r: RunConfig) -> str | None:
    """A start-up warning when a step's concurrent tool calls far outnumber the sandbox workers.

    Every episode of a step runs at once and has at most one tool call in flight, so up to
    prompts_per_step x group_size calls queue for sandbox.workers processes; the queue wait does
    not count against sandbox.timeout_s (results stay right, only slower), hence a warning, not an
    error. Warned above the authors' ratio, EPISODES_PER_SANDBOX_WORKER."""
    episodes = r.algo.prompts_per_step * r.algo.group_size
    if not r.agent.use_tools or episodes <= EPISODES_PER_SANDBOX_WORKER * r.sandbox.workers:
        return None
    wanted = -(-episodes // EPISODES_PER_SANDBOX_WORKER)
    return (f"config.sandbox.workers={r.sandbox.workers} for {episodes} concurrent episodes (algo.prompts_per_step x "
            f"algo.group_size): each tool call can queue behind {episodes // r.sandbox.workers - 1} others, and one call "
            f"per episode at sandbox.timeout_s={r.sandbox.timeout_s:g} s can take {episodes * r.sandbox.timeout_s / r.sandbox.workers:.0f} s "
            f"of sandbox time per step; the authors ran 64 workers for 2048 episodes: set sandbox.workers >= {wanted} "
            "(at most the CPU cores the sandbox may use)")


def check_processes(r: RunConfig, processes: int) -> None:
    """What train's loop does not split over several learner processes yet (docs/scaling.md
    "Several hosts: the learner"); raises ConfigError naming the key."""
    if processes <= 1:
        return
    _require(not r.algo.dynamic_sampling, "algo.dynamic_sampling",
             f"True with {processes} learner processes (distributed.*): the rounds of DAPO dynamic sampling are not "
             "yet agreed across processes; set algo.dynamic_sampling=False or run one process")
    _require(not r.rollout.colocated, "rollout.colocated",
             f"True with {processes} learner processes (distributed.*): releasing and resuming the rollout memory "
             "is done by one trainer process only; set rollout.colocated=False or run one process")
    _require(r.train.max_staleness == 0, "train.max_staleness",
             f"{r.train.max_staleness} with {processes} learner processes (distributed.*): the overlapped collection "
             "runs in one trainer process only yet; set train.max_staleness=0 or run one process")


def check_combinations(r: RunConfig) -> None:
    """Rules across keys (and the few a range cannot say), in one place."""
    m, d, ro, a, s = r.model, r.data, r.rollout, r.algo, r.saar
    _require(m.attention_block == 0 or m.attention_impl == "xla", "model.attention_block",
             f"{m.attention_block} blocks the masked attention (model.attention_impl='xla'), but attention_impl is "
             f"{m.attention_impl!r}, a causal kernel that skips the upper triangle itself: set model.attention_block=0")
    if r.train.max_staleness > 0:  # the overlapped loop (train_steps/overlap.py) and what it cannot run with
        _require(not ro.colocated, "train.max_staleness",
                 f"{r.train.max_staleness} with rollout.colocated=True: colocated servers give their memory to the "
                 "learner during the update, so no rollout can run beside it; set train.max_staleness=0 or "
                 "rollout.colocated=False")
        _require(ro.continue_aborted, "train.max_staleness",
                 f"{r.train.max_staleness} with rollout.continue_aborted=False: every weight sync would cut the turns "
                 "of the collections running beside the update, and their episodes would be regenerated from the "
                 "start (or lost after rollout.max_episode_restarts); set rollout.continue_aborted=True, or "
                 "train.max_staleness=0")
        _require(not a.dynamic_sampling, "train.max_staleness",
                 f"{r.train.max_staleness} with algo.dynamic_sampling=True: DAPO's extra sampling rounds depend on "
                 "the step's own groups and are not prefetched yet; set train.max_staleness=0 or "
                 "algo.dynamic_sampling=False")
    # model and data
    _require(m.tiny_init or m.path is not None, "model.path",
             "no checkpoint given: set --config.model.path=DIR (a local HF directory) or model.tiny_init=True")
    _require(not (m.tiny_init and m.path is not None), "model.path",
             f"{m.path!r} is set together with model.tiny_init=True, which builds a random checkpoint instead; "
             "unset one of them")
    _require(d.train != TOY or d.train_limit is None, "data.train_limit",
             "the toy task is generated without end; a limit applies to a file dataset only")
    _require(d.train != TOY or not d.skip_bad_rows, "data.skip_bad_rows",
             "the toy task is generated and has no bad rows; the option applies to a file dataset only")
    try:
        entries = parse_eval_spec(d.eval)
    except ValueError as e:
        raise ConfigError(f"config.data.eval: {e}") from None
    for name, path in entries:
        _require(name in (TOY, *BENCHMARKS, *USER_BENCHMARKS), "data.eval",
                 f"unknown benchmark {name!r}; use 'toy' or one of {', '.join(sorted(BENCHMARKS))} (shipped), or a "
                 f"user file as NAME=PATH ({', '.join(f'{n}=PATH' for n in USER_BENCHMARKS)})")
        _require(name != TOY or path is None, "data.eval", "the toy benchmark is generated: name it without a path")
        if path is None or name in BENCHMARKS:  # a user file's path is looked at by the start-up check
            problem = check_user_file(name, path)
            _require(problem is None, "data.eval", str(problem))
    names = [name for name, _ in entries]
    _require(TOY not in names or d.eval_limit is not None, "data.eval_limit",
             "the toy benchmark is generated: give its size, e.g. --config.data.eval_limit=16")
    for key, day in (("lcb_start_date", d.lcb_start_date), ("lcb_end_date", d.lcb_end_date)):
        if day is None:
            continue
        _require(livecodebench.NAME in names, f"data.{key}",
                 f"{day!r} windows LiveCodeBench, which data.eval does not name (add livecodebench=PATH or unset it)")
        try:
            livecodebench.parse_day(day)
        except ValueError:
            raise ConfigError(f"config.data.{key}: {day!r} is not a day in YYYY-MM-DD form") from None
    _require(d.lcb_start_date is None or d.lcb_end_date is None
             or livecodebench.parse_day(d.lcb_start_date) <= livecodebench.parse_day(d.lcb_end_date),
             "data.lcb_end_date", f"{d.lcb_end_date!r} is before data.lcb_start_date={d.lcb_start_date!r}")
    # rollout
    _require(ro.backend != "sglang" or bool(ro.server_urls.strip()), "rollout.server_urls",
             "backend=sglang needs at least one server URL")
    _check_router(r)
    _require(ro.backend == "embedded" or ro.decode_backend == "auto", "rollout.decode_backend",
             f"{ro.decode_backend!r} selects the embedded engine's kernels, but rollout.backend={ro.backend!r}")
    _require(ro.backend == "embedded" or ro.batch_invariant, "rollout.batch_invariant",
             f"False sets the embedded engine's batch layout, but rollout.backend={ro.backend!r} (SGLang's "
             "servers choose theirs: --enable-deterministic-inference)")
    _require(ro.top_k != 0, "rollout.top_k", "0 is not allowed: use -1 (off) or k >= 1")
    _require(r.mesh.fsdp != 0, "mesh.fsdp", "0 is not allowed: use -1 (all devices not used by tp) or a size >= 1")
    distributed.check(r.distributed)  # the learner processes: cross-key rules of the section
    if r.distributed.mode == "explicit":  # auto mode: train.main checks once the processes joined
        check_processes(r, r.distributed.num_processes)
    _check_xla_memory(r)
    # SAAR and the agent
    _require(not (s.enable and s.logprob_mode == "rollout" and ro.temperature != 1.0), "saar.logprob_mode",
             "rollout mode re-scores spliced spans on the rollout server, which (like SGLang) scores prompts "
             "untempered: it needs rollout.temperature=1.0 (or use logprob_mode=recompute)")
    _require(not (s.enable and not r.agent.use_tools), "saar.enable",
             "SAAR needs tools: agent.use_tools=False (a notool baseline) requires saar.enable=False")
    _require(r.reward.overlong_buffer < r.agent.max_response_tokens, "reward.overlong_buffer",
             f"{r.reward.overlong_buffer} must be < agent.max_response_tokens={r.agent.max_response_tokens}")
    # the RL step
    _require(a.advantage != "rloo" or a.group_size >= 2, "algo.advantage", "rloo needs algo.group_size >= 2")
    seqs = a.group_size * a.prompts_per_step
    _require(seqs % a.mini_batches_per_step == 0, "algo.mini_batches_per_step",
             f"{seqs} sequences per step do not split into {a.mini_batches_per_step} mini-batches")
    mini = seqs // a.mini_batches_per_step
    _require(mini % a.micro_batch_size == 0, "algo.micro_batch_size",
             f"a mini-batch of {mini} sequences does not split into micro-batches of {a.micro_batch_size}")
    if r.mesh.fsdp > 0:  # mesh.fsdp=-1: session.make_mesh checks it with the device count
        check_micro_batch_split(r, r.mesh.fsdp)
    check_attention_budget(r, attention_rows(r), 1, HEADS_UNREAD)
    try:
        bucket_widths(a.bucket_widths, r.agent.max_model_len, "bucket_widths")
    except ValueError as e:
        raise ConfigError(f"config.algo.{e}") from None
    _check_loggers(r)
    cache = r.train.compilation_cache_dir
    _require(cache is None or bool(cache.strip()), "train.compilation_cache_dir",
             f"{cache!r} is not a usable directory path (it is created if missing); None turns the cache off")
    _require(a.loss == "ppo" or a.tis == "none", "algo.tis",
             f"truncated IS weights the ppo loss only; algo.loss={a.loss!r} would ignore it")
    _require(a.loss == "nll" or a.nll_sequences == "all", "algo.nll_sequences",
             f"applies to algo.loss='nll' only; algo.loss={a.loss!r} would ignore it")
    _require(a.loss == "ppo" or a.ratio_level == "token", "algo.ratio_level",
             f"{a.ratio_level!r} (GSPO) is a ppo ratio; algo.loss={a.loss!r} has no ratio: use algo.ratio_level="
             "'token' or algo.loss='ppo'")
    _require(not (a.tis != "none" and s.enable and s.logprob_mode == "recompute" and s.splice_correction == "none"),
             "algo.tis", "truncated IS needs rollout log-probs of the purified tokens: use saar.logprob_mode=rollout, "
             "saar.enable=False, or a saar.splice_correction (spliced tokens then leave rollout IS)")
    # the engine and SGLang report each sampled token's log-prob under the untruncated (tempered)
    # distribution, while top-p / top-k sample from the truncated, renormalised one: a ratio that
    # divides by the reported log-prob would not be pi / pi_behaviour (docs/estimators.md, "Truncated sampling")
    uses = [name for name, on in (("algo.tis", a.tis != "none"), ("algo.old_logprobs='rollout'", a.old_logprobs == "rollout"),
                                  ("saar.splice_correction", s.enable and s.splice_correction in ("tis", "mask"))) if on]
    truncating = r.rollout.top_p < 1.0 or r.rollout.top_k > 0
    _require(not (truncating and uses), "rollout.top_p" if r.rollout.top_p < 1.0 else "rollout.top_k",
             f"training rollouts sampled with top_p={r.rollout.top_p}, top_k={r.rollout.top_k} report each token's "
             f"untruncated log-prob, not the probability it was drawn with, and {', '.join(uses)} divides by it: "
             "sample training rollouts untruncated (rollout.top_p=1.0, rollout.top_k=-1) or turn those off")
    _require(a.tis != "none" or a.tis_mode == "truncate", "algo.tis_mode",
             f"{a.tis_mode!r} applies to rollout IS, which is off (algo.tis='none')")
    _require(a.tis_mode == "truncate" or a.tis_cap > 1.0, "algo.tis_cap",
             f"tis_mode={a.tis_mode!r} keeps ratios in [1/cap, cap], which needs a cap > 1, got {a.tis_cap}")
    _require(not (a.tis != "none" and a.old_logprobs == "rollout"), "algo.tis",
             "rollout IS with algo.old_logprobs='rollout' (bypass) is pi_rollout / pi_rollout = 1: use "
             "algo.old_logprobs='recompute' (decoupled, the authors' baselines) or algo.tis='none'")
    _require(not (a.old_logprobs == "rollout" and s.enable and s.logprob_mode == "recompute"
                  and s.splice_correction != "exclude"), "algo.old_logprobs",
             "bypass mode trains against the rollout log-probs, which for spliced tokens are only re-scored "
             "in the purified context with saar.logprob_mode=rollout (or use saar.splice_correction=exclude)")
    _require(s.enable or s.splice_correction == "none", "saar.splice_correction",
             f"{s.splice_correction!r} corrects SAAR's spliced tokens, but saar.enable=False splices none")
    _require(a.loss == "ppo" or s.splice_correction in ("none", "exclude"), "saar.splice_correction",
             f"{s.splice_correction!r} weights the ppo loss only; algo.loss={a.loss!r} (exclude works for nll too)")
    _require(a.advantage == "grpo" or a.adv_std_floor == 0.0, "algo.adv_std_floor",
             f"a floor on the std applies to grpo only; algo.advantage={a.advantage!r} does not divide by it")
    # the toy warm start
    w = r.warmup_sft
    _require(w.steps == 0 or w.examples >= w.batch_size, "warmup_sft.examples",
             f"{w.examples} demonstrations cannot fill a batch of warmup_sft.batch_size={w.batch_size}")
    _require(w.steps == 0 or d.train == TOY, "warmup_sft.steps",
             "the scripted-teacher warm start exists for the toy task only (data.train='toy')")
    _require(w.cache_dir is None or w.steps > 0, "warmup_sft.cache_dir",
             f"{w.cache_dir!r} caches warm starts, but warmup_sft.steps=0 makes none: set steps or unset the cache")
    _require(w.cache_dir is None or bool(w.cache_dir.strip()),
             "warmup_sft.cache_dir", f"{w.cache_dir!r} is not a usable directory path (it is created if missing)")
    # evaluation
    _require(r.eval.top_k != 0, "eval.top_k", "0 is not allowed: use -1 (off) or k >= 1")
    with_saar = sorted(name for name, e in eval_settings(r).items() if e.saar != "off")
    _require(r.agent.use_tools or not with_saar, "eval.saar",
             f"SAAR needs tools, but agent.use_tools=False and SAAR is on at evaluation for {', '.join(with_saar)}: "
             "set eval.saar=off (and no saar=on in eval.overrides)")


def _check_router(r: RunConfig) -> None:
    """rollout.router_url names sglang-router, and rollout.server_urls the workers behind it: the
    calls the router does not forward (the weight sync, /server_info, /health) go to each of those.
    Colocated servers and SAAR's rollout re-scoring are allowed behind it: nothing generates while
    the workers' memory is released, and the routing key sends a trajectory's re-scoring to the
    worker that holds its prefix, as its turns."""
    ro = r.rollout
    if ro.router_url is None:
        return
    url = urllib.parse.urlsplit(ro.router_url)
    _require(url.scheme in ("http", "https") and bool(url.hostname) and url.path in ("", "/") and not url.query,
             "rollout.router_url",
             f"{ro.router_url!r} is not of the form http://HOST:PORT (what launch/router.sh prints)")
    _require(ro.backend == "sglang", "rollout.router_url",
             f"{ro.router_url!r} with rollout.backend={ro.backend!r}: the embedded backend is one server of the "
             "trainer's own, with no router in front; use rollout.backend=sglang with the workers behind the router "
             "in rollout.server_urls, or unset rollout.router_url")
    workers = [u.strip().rstrip("/") for u in ro.server_urls.split(",") if u.strip()]
    _require(ro.router_url.rstrip("/") not in workers, "rollout.router_url",
             f"{ro.router_url!r} is also in rollout.server_urls, which must name the workers behind the router: the "
             "weight sync and the context check go to each of them, and the router answers those calls 404; list "
             "only the workers there")


def _check_loggers(r: RunConfig) -> None:
    """train.loggers names known loggers once each; W&B's keys only with wandb in it (whether the
    package is installed is the start-up check's)."""
    t = r.train
    try:
        loggers = metrics_writer.parse_loggers(t.loggers)
    except ValueError as e:
        raise ConfigError(f"config.train.loggers: {t.loggers!r}: {e}") from None
    for key in ("wandb_project", "wandb_name"):
        _require("wandb" in loggers or getattr(t, key) is None, f"train.{key}",
                 f"{getattr(t, key)!r} names a W&B run, but train.loggers={t.loggers!r} has no wandb: add it "
                 "('tensorboard,wandb') or unset the key")


def _check_xla_memory(r: RunConfig) -> None:
    """The XLA allocator keys against each other and against rollout.colocated (docs/scaling.md,
    Colocated placement): memory a released rollout engine frees is usable by the learner (or
    the engine's memory by a resumed server) only if the process that frees it hands it back to
    the device, which only XLA's platform allocator does."""
    t = r.train
    _require(not (t.xla_allocator == "platform" and t.xla_preallocate), "train.xla_preallocate",
             "the platform allocator allocates each buffer on demand and preallocates nothing: set "
             "train.xla_preallocate=False (preallocation is the bfc pool's)")
    _require(t.xla_allocator != "platform" or t.xla_mem_fraction is None, "train.xla_mem_fraction",
             f"{t.xla_mem_fraction} sizes the bfc pool, which train.xla_allocator=platform does not use: unset it")
    _require(not r.rollout.colocated or t.xla_allocator == "platform", "train.xla_allocator",
             f"{t.xla_allocator!r} with rollout.colocated=True: the bfc pool keeps the memory it frees, so the "
             "rollout memory a released server frees (its own JAX process) never reaches the learner, and what the "
             "learner frees never reaches the server again at resume; set train.xla_allocator=platform and "
             "train.xla_preallocate=False")


def eval_benchmark_names(d: DataConfig) -> list[str]:
    """The benchmark names of data.eval, in order (an entry `NAME=PATH` is named NAME)."""
    return [name for name, _ in parse_eval_spec(d.eval)]


def eval_settings(r: RunConfig) -> dict[str, EvalSettings]:
    """Benchmark name -> its evaluation settings: the `eval` keys with its `eval.overrides`."""
    names = eval_benchmark_names(r.data)
    base = schema.gather(EvalSettings, r.eval)
    # a config file may set a benchmark's settings before the command line names it in data.eval
    known = list(dict.fromkeys([*names, TOY, *sorted(BENCHMARKS), *USER_BENCHMARKS]))
    over = parse_overrides(r.eval.overrides, known)
    return {name: settings_for(base, over.get(name, {}), f"config.eval.overrides: {name}") for name in names}
