"""The run config: one typed section per concern, declared once, as the ml-collections config
that `--config configs/x.py --config.a.b=v` edits and as the typed `RunConfig` it validates to.

Each key is a field of a frozen dataclass (`cleaner_jax.schema`): the component configs are the
sections where they exist (`saar` is `SaarConfig`, `agent` is `AgentConfig`); the other
sections are declared below, and keys that are a component field under another name borrow it
(`algo.loss` is `LossConfig.kind`). From these declarations `base_config()` generates the locked
ConfigDict every file in `configs/` starts from, and `validate()` converts it back, rejecting an
unknown or missing key, a wrong type, a value outside its allowed values or range, and (in
`_check_combinations`, the one place for rules across keys) contradictory values, always as
`config.<section>.<key>: ...` with what is allowed. Defaults are the authors' faithful choices
(docs/authors.md); each deviation is a named option.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
import os
import typing
from typing import Literal

import ml_collections

from cleaner_jax import distributed, schema
from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.data import livecodebench
from cleaner_jax.distributed import DistributedConfig
from cleaner_jax.data.benchmarks import USER_BENCHMARKS, check_user_file, parse_eval_spec
from cleaner_jax.data.filter import FILTERED_SUFFIX
from cleaner_jax.data.problems import BENCHMARKS
from cleaner_jax.eval.settings import EvalSettings, parse_overrides, settings_for
from cleaner_jax.models.config import ARCHITECTURES, ATTENTION_IMPLS, REMAT_POLICIES, DtypeName
from cleaner_jax.rewards.choice import MODES as CHOICE_MODES
from cleaner_jax.rewards.code import THINK_SPLITS
from cleaner_jax.rl.advantages import Estimator
from cleaner_jax.rl.batch import bucket_widths
from cleaner_jax.rl.learner import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.loss_scale import LossScaleConfig
from cleaner_jax.rl.losses import LossConfig
from cleaner_jax.rl.step import StepConfig
from cleaner_jax.rollout.decode_backend import DECODE_BACKENDS
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.schema import ConfigError, borrow, field, section

__all__ = ["ConfigError", "RunConfig", "base_config", "check_override_keys", "validate"]

ModelFamily = Literal[tuple(ARCHITECTURES)]
TOY = "toy"  # data.train / data.eval: the built-in arithmetic task


@section
class ModelConfig:
    path: str | None = field(None, help="a local HF checkpoint directory (never downloaded)")
    tiny_init: bool = field(False, help="build a random tiny checkpoint in the workdir instead (toy run)")
    tiny_family: ModelFamily = field("qwen3", help="architecture of the tiny checkpoint")
    tiny_hidden_size: int = field(64, ge=1, help="hidden size of the tiny checkpoint")
    tiny_num_layers: int = field(2, ge=1, help="decoder layers of the tiny checkpoint")
    param_dtype: DtypeName = field("float32", help="dtype of the stored parameters (and Adam moments)")
    compute_dtype: DtypeName = field("float32", help="dtype of the forward pass")
    attention_impl: Literal[ATTENTION_IMPLS] = field(
        "xla", help="learner / prefill attention: xla = masked, f32 scores materialised (any device); cudnn = cuDNN "
        "flash, causal + per-row lengths of the right-padded batch, no mask or bias (NVIDIA GPU, bf16/fp16); "
        "splash = the Pallas splash kernel, same semantics (TPU); xla_causal = cudnn's call with JAX's XLA "
        "implementation (any device, for checks). A kernel the device lacks fails at model build; the KV-cache "
        "(decode) path always uses xla")
    remat: Literal[REMAT_POLICIES] = field("none", help="activation rematerialisation per decoder layer")
    scan_layers: bool = field(
        False, help="run the decoder layers as one nnx.scan over stacked [L, ...] parameters (one layer compiled "
        "instead of L; remat applies inside the scanned body); HF checkpoints load and save unchanged, Orbax "
        "checkpoints only into the same setting")


@section
class DataConfig:
    train: str = field(TOY, help="'toy' (built-in arithmetic task) or a local .parquet/.jsonl path")
    train_limit: int | None = field(None, ge=1, help="use only the first N training rows (a file dataset)")
    skip_bad_rows: bool = field(
        False, help="a file dataset: leave out (and count, at start-up) rows that cannot be read (bad JSON, not "
        "UTF-8, a missing field, a wrong type, an empty prompt) instead of stopping with the error naming the row")
    overlong_prompts: Literal["error", "filter"] = field(
        "error", help="a file dataset: a prompt rendered longer than agent.max_prompt_tokens stops the run at "
        "start-up naming the row (error; the authors filter nothing, and such a prompt would silently eat the "
        "response budget) or is left out and counted (filter, like verl's filter_overlong_prompts); never truncated")
    eval: str = field(TOY, help="comma-separated benchmarks: 'toy', shipped names (aime24,aime25,...) and user files "
                      "as NAME=PATH (gpqa_diamond=/d/gpqa.parquet,livecodebench=/d/lcb.jsonl); '' for none")
    eval_limit: int | None = field(None, ge=1, help="problems per benchmark; None = all (the generated toy set needs N)")
    seed: int | None = field(
        None, ge=0, help="order in which training problems are drawn; None: train.seed (set it to hold the data "
        "order fixed while train.seed varies the rollouts)")
    toy_max_operand: int = field(99, ge=2, help="toy task: operands in [2, toy_max_operand]")
    toy_num_ops: int = field(2, ge=1, help="toy task: operators per expression")
    lcb_start_date: str | None = field(
        None, help="livecodebench: keep problems with contest_date >= this day (YYYY-MM-DD, LiveCodeBench's "
        "--start_date); the authors' v6 window is 2025-02-01..2025-05-31")
    lcb_end_date: str | None = field(
        None, help="livecodebench: keep problems with contest_date <= this day at 00:00 (YYYY-MM-DD, LiveCodeBench's "
        "--end_date)")


@section
class RolloutConfig:
    backend: Literal["embedded", "sglang"] = field(
        "embedded", help="embedded: our server, started by the trainer; sglang: servers at rollout.server_urls")
    server_urls: str = field("", help="comma-separated SGLang server URLs (backend=sglang)")
    decode_backend: Literal[DECODE_BACKENDS] = field(
        "auto", help="the embedded engine's decode kernels: auto (fastest that builds), xla, cpu_kernels")
    temperature = borrow(LearnerConfig, "temperature")
    top_p: float = field(1.0, gt=0.0, le=1.0, help="nucleus sampling of training rollouts")
    top_k: int = field(-1, ge=-1, help="top-k sampling; -1 = off")
    request_timeout_s: float = field(
        600.0, gt=0.0, help="seconds a generation request may wait for its answer, plus "
        "rollout.read_timeout_per_token_s per max_new_tokens; a request past it is retried on another server")
    read_timeout_per_token_s: float = field(
        0.1, ge=0.0, help="seconds of answer time allowed per max_new_tokens on top of request_timeout_s (0.1: a "
        "20,480-token turn may take 600 + 2048 s, i.e. decode at >= 10 tokens/s under load)")
    connect_timeout_s: float = field(10.0, gt=0.0, help="seconds to open a connection to a rollout server")
    max_connections: int | None = field(
        None, ge=1, help="HTTP connections to the rollout servers at most; None: algo.prompts_per_step x "
        "algo.group_size (every concurrent trajectory has one; waiting for a free one is never timed)")
    max_episode_restarts: int = field(
        3, ge=0, help="times an episode whose rollout server died, timed out or left the rotation is regenerated "
        "from its start (same seeds) before it is lost (counted in infra/lost_episodes)")
    server_wait_s: float = field(
        300.0, gt=0.0, help="seconds to wait for a rollout server (the embedded one restarted, or one at "
        "rollout.server_urls answering /health) when none is left; then the run writes a checkpoint and stops")
    max_lost_fraction: float = field(
        0.01, ge=0.0, le=1.0, help="a step that lost more than this fraction of its episodes to rollout-server "
        "faults writes a checkpoint and stops instead of training on a silently smaller batch")
    sync_idle_timeout_s: float = field(
        30.0, gt=0.0, help="weight sync: seconds a paused server may take to finish its requests before its "
        "/flush_cache succeeds (SGLang refuses the flush while any request runs); then the sync fails")
    colocated: bool = field(
        False, help="the rollout servers share the learner's accelerators: each step releases their weights and KV "
        "memory (/release_memory_occupation) after the rollouts and resumes it before the weight sync; needs "
        "train.xla_allocator=platform, and real SGLang servers started with --enable-memory-saver "
        "(docs/scaling.md, Colocated placement)")


@section
class SandboxConfig:
    workers: int = field(4, ge=1, help="sandbox worker processes")
    timeout_s: float = field(4.0, gt=0.0, help="seconds per code execution")
    memory_mb: int = field(512, ge=1, help="memory limit per execution")


@section
class RewardConfig:
    math_mode: Literal["strict", "equivalence"] = field(
        "strict", help="strict: the authors' last-boxed exact match; equivalence: math-verify")
    overlong_buffer: int = field(4096, ge=0, help="DAPO overlong shaping buffer in tokens; 0 disables it")
    overlong_factor: float = field(1.0, ge=0.0, help="DAPO overlong penalty factor")
    think_split: Literal[THINK_SPLITS] = field(
        "faithful", help="code rewards after </think>: faithful = the authors' split('</think>')[1] (their bug for "
        "multi-turn thinking output), last = the text after the last </think>")
    choice_mode: Literal[CHOICE_MODES] = field(
        "faithful", help="multiple choice (GPQA): faithful = the last boxed letter exactly (the authors); lenient also "
        "accepts (B), \\text{B}, B)")


@section
class AlgoConfig:
    loss = borrow(LossConfig, "kind")
    advantage: Estimator = field("grpo", help="group advantage estimator")
    adv_eps: float = field(1e-6, gt=0.0, help="std-normalisation epsilon")
    group_size: int = field(16, ge=1, help="responses per prompt")
    prompts_per_step: int = field(128, ge=1, help="prompts per RL step")
    mini_batches_per_step = borrow(OptimizerConfig, "updates_per_lr_step", default=4)  # authors: ppo_mini_batch
    micro_batch_size = borrow(LearnerConfig, "micro_batch_size", default=8)
    dynamic_sampling: bool = field(False, help="DAPO group filtering (off in the authors' runs)")
    dynamic_sampling_max_rounds: int = field(3, ge=1, help="dynamic sampling: rollout rounds per step at most")
    clip_low = borrow(LossConfig, "clip_low")
    clip_high = borrow(LossConfig, "clip_high")
    dual_clip = borrow(LossConfig, "dual_clip_c")
    loss_agg = borrow(LossConfig, "agg")
    entropy_coef = borrow(LossConfig, "entropy_coef")
    old_logprobs = borrow(StepConfig, "old_logprobs")
    tis = borrow(LossConfig, "tis")
    tis_cap = borrow(LossConfig, "tis_cap")
    tis_mode = borrow(LossConfig, "tis_mode")
    nll_sequences = borrow(LossConfig, "nll_sequences")
    adv_std_floor = borrow(StepConfig, "std_floor")
    adv_singleton = borrow(StepConfig, "singleton")
    exclude_zero_adv_groups = borrow(StepConfig, "exclude_zero_adv_groups")
    logprob_chunk = borrow(LearnerConfig, "logprob_chunk_size")
    bucket_widths: str = field(
        "pow2", help="learner micro-batch widths (length bucketing; same loss and gradients, fewer padded tokens, "
        "one compile per width): pow2 = 128, 256, ... below agent.max_prompt_tokens + agent.max_response_tokens, "
        "then that budget rounded up to 128; an ascending list 'w1,w2,...' whose largest covers the budget; off = "
        "every row padded to the step's longest (a new width, a new compile)")


@section
class OptimConfig:
    lr = borrow(OptimizerConfig, "learning_rate")
    warmup_steps = borrow(OptimizerConfig, "warmup_steps")
    weight_decay = borrow(OptimizerConfig, "weight_decay")
    b1 = borrow(OptimizerConfig, "b1")
    b2 = borrow(OptimizerConfig, "b2")
    grad_clip = borrow(OptimizerConfig, "max_grad_norm")


@section
class MeshConfig:
    fsdp: int = field(-1, ge=-1, help="FSDP axis size; -1: all devices not used by tp")
    tp: int = field(1, ge=1, help="tensor-parallel axis size")


@section
class WarmupSftConfig:
    """Toy only: an RA-SFT analogue from a scripted teacher."""

    steps: int = field(0, ge=0, help="supervised warm-start steps before RL (toy task only)")
    lr: float = field(3e-3, gt=0.0, help="warm-start learning rate")
    examples: int = field(256, ge=1, help="scripted demonstrations")
    error_rate: float = field(0.3, ge=0.0, le=1.0, help="share of the tool-using demonstrations whose first call fails")
    deep_error_share: float = field(
        0.0, ge=0.0, le=1.0, help="of the failing first calls, the share that are a wrong approach (a `calc` helper "
        "that does not exist, fixed by a different program); the rest are typos fixed by a similar call")
    guess_rate: float = field(
        0.0, ge=0.0, le=1.0, help="share of demonstrations that answer at once, without the tool, with a wrong number")
    give_up_rate: float = field(
        0.0, ge=0.0, le=1.0, help="after a failed call, the share of demonstrations that guess instead of fixing it")
    batch_size: int = field(16, ge=1, help="warm-start batch size")
    cache_dir: str | None = field(
        None, help="directory where warm starts (and the step-0 evaluation) are kept and reused by every run "
        "whose warm-start config values and code match (cleaner_jax/toy/warm_cache.py, docs/study.md); None: "
        "each run makes its own")


@section
class TrainConfig:
    steps: int = field(235, ge=0, help="RL steps")
    seed: int = field(
        0, ge=0, help="the run's seed: tiny-model init, warm start, data order (unless data.seed), every "
        "rollout's sampling seed and the evaluation seeds")
    eval_every: int = field(10, ge=0, help="evaluate every N steps (and after the last); 0 = never")
    eval_before_train: bool = field(False, help="evaluate once before the first step")
    checkpoint_every: int = field(10, ge=1, help="checkpoint every N steps (and after the last)")
    weight_sync_probe_tol: float = field(0.05, ge=0.0, help="mean |Δlogprob| allowed after a weight sync")
    weight_export_dtype: Literal["param", "compute"] = field(
        "param", help="dtype of the weights written for the rollout servers: param (model.param_dtype, lossless "
        "whatever the servers serve in) or compute (model.compute_dtype: half the bytes for bf16/fp16; exactly "
        "what a server serving in that dtype would round to itself, and checked against each server's dtype)")
    weight_export_dir: str | None = field(
        None, help="existing directory for the weight exports (e.g. /dev/shm): the run writes into its own "
        "sub-directory there; None: <workdir>/sync. Only the newest export is kept")
    weight_export_shard_mb: float = field(
        5000.0, gt=0.0, help="largest safetensors file of a weight export, in MB (10^6 bytes; HF's max_shard_size "
        "'5GB'): a bigger model is written as model-0000k-of-0000n.safetensors + model.safetensors.index.json, "
        "one that fits as a single model.safetensors. In a multi-process run file k is written by process k mod N")
    dump_trajectories: bool = field(True, help="write each step's episodes under the workdir")
    loss_scale_init = borrow(LossScaleConfig, "init_scale")
    loss_scale_growth_interval = borrow(LossScaleConfig, "growth_interval")
    compilation_cache_dir: str | None = field(
        None, help="persistent XLA compilation cache directory (jax_compilation_cache_dir), set at start-up: a "
        "later run, or a resumed one, loads the compiled steps instead of compiling them again; None: off")
    max_consecutive_skips: int = field(
        20, ge=1, help="stop the run (after writing a checkpoint) once this many optimizer updates in a row were "
        "skipped for a non-finite loss or gradient")
    xla_mem_fraction: float | None = field(
        None, gt=0.0, le=1.0, help="XLA_CLIENT_MEM_FRACTION of the trainer (and of the embedded rollout server it "
        "starts, which inherits it), set by train's main before JAX starts: the share of each GPU the bfc pool "
        "preallocates or may grow to; None: JAX's default (0.75)")
    xla_preallocate: bool = field(
        True, help="XLA_PYTHON_CLIENT_PREALLOCATE of the trainer and its embedded server: the bfc pool takes its "
        "fraction at start-up (JAX's default) or grows on demand (False)")
    xla_allocator: Literal["default", "bfc", "platform"] = field(
        "default", help="XLA_PYTHON_CLIENT_ALLOCATOR of the trainer and its embedded server: default (JAX's: bfc), "
        "bfc (a pool that keeps what it frees), platform (cudaMalloc/cudaFree per buffer, slower: the only one that "
        "gives freed memory back to the device, which rollout.colocated needs)")


@section
class EvalConfig:
    """Evaluation (`evaluate` and the trainer's periodic one), separate from training's sampling."""

    n = borrow(EvalSettings, "n")
    temperature = borrow(EvalSettings, "temperature")
    top_p = borrow(EvalSettings, "top_p")
    top_k = borrow(EvalSettings, "top_k")
    saar = borrow(EvalSettings, "saar")
    overrides: str = field(
        "", help="per-benchmark settings, e.g. 'aime24:n=32,temperature=0.6;livecodebench:n=10,saar=off' "
        "(keys: n, temperature, top_p, top_k, saar)")
    saar_rollback_probability: float = field(
        1.0, ge=0.0, le=1.0, help="SAAR at evaluation: per-trajectory probability that it is on (authors' eval: 1.0)")
    seed: int | None = field(None, ge=0, help="evaluation sampling seed; None: train.seed")
    bootstrap_resamples: int = field(1000, ge=1, help="resamples of best@k, maj@k and the CI (authors: 1000)")
    bootstrap_seed: int = field(42, ge=0, help="seed of the bootstrap (authors: 42)")
    ci_level: float = field(0.95, gt=0.0, lt=1.0, help="confidence level of the interval of mean@n over problems")
    max_concurrent_problems: int = field(
        16, ge=1, help="problems evaluated at once (each with its n samples); results do not depend on it")
    resume: bool = field(True, help="evaluate: skip problems already in <out>/samples/*.jsonl; False: start afresh")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The validated run config; `agent.saar` is the `saar` section."""

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    agent: AgentConfig
    saar: SaarConfig
    sandbox: SandboxConfig
    reward: RewardConfig
    algo: AlgoConfig
    optim: OptimConfig
    mesh: MeshConfig
    warmup_sft: WarmupSftConfig
    train: TrainConfig
    eval: EvalConfig
    distributed: DistributedConfig


SECTIONS: dict[str, type] = typing.get_type_hints(RunConfig)


def base_config() -> ml_collections.ConfigDict:
    """Every key at its default, locked: assigning a key the schema does not have fails at once."""
    c = ml_collections.ConfigDict()
    for name, cls in SECTIONS.items():
        sub = ml_collections.ConfigDict()
        for key, (tp, default) in schema.defaults(cls).items():
            optional, inner = schema.split_optional(tp)
            if optional:  # typed, so that `--config.a.b=v` parses v as the right type
                scalar = str if typing.get_origin(inner) is Literal else inner
                sub[key] = ml_collections.FieldReference(default, field_type=scalar)
            else:
                sub[key] = default
        c[name] = sub
    c.lock()
    return c


def check_override_keys(argv: Sequence[str], flag: str = "config") -> None:
    """Reject `--config.a.b=v` overrides whose key the schema does not have, before absl parses
    them (absl would stop with a traceback), naming the key and the section's keys."""
    base = base_config()
    prefix = f"--{flag}."
    for arg in argv:
        if not arg.startswith(prefix):
            continue
        path = arg[len(prefix):].split("=", 1)[0].split(".")
        node, where = base, flag
        for name in path:
            if not isinstance(node, ml_collections.ConfigDict) or name not in node:
                known = ", ".join(sorted(node.keys())) if isinstance(node, ml_collections.ConfigDict) else "none"
                raise ConfigError(f"{where}.{name}: unknown key (in {arg!r}); {where} has: {known}")
            node, where = node[name], f"{where}.{name}"


def validate(c: ml_collections.ConfigDict) -> RunConfig:
    """`c` as the typed RunConfig; raises ConfigError naming the first key that cannot work."""
    values = c.to_dict()
    unknown = sorted(set(values) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config.{unknown[0]}: unknown section; the sections are: {', '.join(SECTIONS)}")
    for name in SECTIONS:
        if not isinstance(values.get(name), dict):
            raise ConfigError(f"config.{name}: missing section; start the config from cleaner_jax.config.base_config()")
    built = {name: schema.build(cls, values[name], f"config.{name}") for name, cls in SECTIONS.items()
             if name != "agent"}
    built["agent"] = schema.build(AgentConfig, values["agent"], "config.agent", saar=built["saar"])
    run = RunConfig(**built)
    _check_combinations(run)
    return run


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


def attention_scores_bytes(rows: int, heads: int, tp: int, tokens: int) -> int:
    """Bytes of one layer's f32 scores [rows, heads / tp, tokens, tokens] on one device."""
    return rows * -(-heads // tp) * tokens * tokens * 4


def model_heads(m: ModelConfig) -> int | None:
    """num_attention_heads of model.path's config.json; None where there is none to read (a
    tiny_init checkpoint is written later, a test directory may be empty)."""
    if m.path is None or not os.path.isfile(os.path.join(m.path, "config.json")):
        return None
    try:
        with open(os.path.join(m.path, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config.model.path: cannot read {m.path}/config.json: {e}") from None
    if not isinstance(hf, dict) or not isinstance(hf.get("num_attention_heads"), int):
        raise ConfigError(f"config.model.path: {m.path}/config.json has no integer num_attention_heads")
    return hf["num_attention_heads"]


def check_mesh(r: RunConfig, fsdp: int) -> None:
    """The rules that need the fsdp size: at validation when mesh.fsdp is given, and in
    `session.make_mesh` (where the device count is known) when mesh.fsdp=-1.

    Micro-batch rows are split over fsdp (`rl.batch.split_micro_batches`), in the train step and
    in the log-prob pass, which uses the same micro-batch size (`wiring.learner_config`)."""
    a = r.algo
    where = f"mesh.fsdp={r.mesh.fsdp}" if r.mesh.fsdp > 0 else f"mesh.fsdp=-1 (= {fsdp} on this machine)"
    _require(a.micro_batch_size % fsdp == 0, "algo.micro_batch_size",
             f"{a.micro_batch_size} rows per micro-batch (train step and log-prob pass) do not split over the fsdp "
             f"axis of {where}: use a multiple of {fsdp} or a mesh.fsdp that divides it")
    _check_attention_budget(r, a.micro_batch_size // fsdp)


def _check_attention_budget(r: RunConfig, rows: int) -> None:
    m = r.model
    if m.attention_impl not in MATERIALISED_ATTENTION:
        return
    heads = model_heads(m)
    tokens = r.agent.max_model_len
    need = attention_scores_bytes(rows, heads or 1, r.mesh.tp, tokens)
    counted = f"{heads} heads" if heads is not None else "1 head (model.path has no config.json yet: at least 1)"
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


def _check_combinations(r: RunConfig) -> None:
    """Rules across keys (and the few a range cannot say), in one place."""
    m, d, ro, a, s = r.model, r.data, r.rollout, r.algo, r.saar
    # model and data
    _require(m.tiny_init or m.path is not None, "model.path",
             "no checkpoint given: set --config.model.path=DIR (a local HF directory) or model.tiny_init=True")
    _require(not (m.tiny_init and m.path is not None), "model.path",
             f"{m.path!r} is set together with model.tiny_init=True, which builds a random checkpoint instead; "
             "unset one of them")
    if m.path is not None:
        _require(os.path.isdir(m.path), "model.path", f"{m.path!r} is not a directory")
    if d.train != TOY and d.train.endswith(FILTERED_SUFFIX):
        _require(os.path.exists(d.train), "data.train",
                 f"the difficulty-filtered training set {d.train!r} does not exist yet: make it from the released "
                 f"Open-AgentRL-30K parquet with `python -m cleaner_jax.data.filter --input "
                 f"/path/to/Open-AgentRL-30K.parquet --output {d.train}` (the authors' 7B filter, "
                 "docs/authors.md §7.3)")
    elif d.train != TOY:
        _require(os.path.exists(d.train), "data.train",
                 f"training data {d.train!r} not found (give a local .parquet/.jsonl path, or 'toy')")
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
    _require(ro.backend == "embedded" or ro.decode_backend == "auto", "rollout.decode_backend",
             f"{ro.decode_backend!r} selects the embedded engine's kernels, but rollout.backend={ro.backend!r}")
    _require(ro.top_k != 0, "rollout.top_k", "0 is not allowed: use -1 (off) or k >= 1")
    _require(r.mesh.fsdp != 0, "mesh.fsdp", "0 is not allowed: use -1 (all devices not used by tp) or a size >= 1")
    distributed.check(r.distributed)  # the learner processes: cross-key rules of the section
    if r.distributed.mode == "explicit":  # auto mode: train.main checks once the processes joined
        check_processes(r, r.distributed.num_processes)
    _check_xla_memory(r)
    export_dir = r.train.weight_export_dir
    _require(export_dir is None or os.path.isdir(export_dir), "train.weight_export_dir",
             f"{export_dir!r} is not an existing directory (e.g. /dev/shm; the run writes its own sub-directory)")
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
    if r.mesh.fsdp > 0:
        check_mesh(r, r.mesh.fsdp)
    else:  # mesh.fsdp=-1: session.make_mesh checks again with the device count; here >= 1 row per device
        _check_attention_budget(r, 1)
    try:
        bucket_widths(a.bucket_widths, r.agent.max_model_len, "bucket_widths")
    except ValueError as e:
        raise ConfigError(f"config.algo.{e}") from None
    cache = r.train.compilation_cache_dir
    _require(cache is None or (bool(cache.strip()) and not os.path.isfile(cache)), "train.compilation_cache_dir",
             f"{cache!r} is not a usable directory path (it is created if missing); None turns the cache off")
    _require(a.loss == "ppo" or a.tis == "none", "algo.tis",
             f"truncated IS weights the ppo loss only; algo.loss={a.loss!r} would ignore it")
    _require(a.loss == "nll" or a.nll_sequences == "all", "algo.nll_sequences",
             f"applies to algo.loss='nll' only; algo.loss={a.loss!r} would ignore it")
    _require(not (a.tis != "none" and s.enable and s.logprob_mode == "recompute" and s.splice_correction == "none"),
             "algo.tis", "truncated IS needs rollout log-probs of the purified tokens: use saar.logprob_mode=rollout, "
             "saar.enable=False, or a saar.splice_correction (spliced tokens then leave rollout IS)")
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
    _require(w.cache_dir is None or (bool(w.cache_dir.strip()) and not os.path.isfile(w.cache_dir)),
             "warmup_sft.cache_dir", f"{w.cache_dir!r} is not a usable directory path (it is created if missing)")
    # evaluation
    _require(r.eval.top_k != 0, "eval.top_k", "0 is not allowed: use -1 (off) or k >= 1")
    with_saar = sorted(name for name, e in eval_settings(r).items() if e.saar != "off")
    _require(r.agent.use_tools or not with_saar, "eval.saar",
             f"SAAR needs tools, but agent.use_tools=False and SAAR is on at evaluation for {', '.join(with_saar)}: "
             "set eval.saar=off (and no saar=on in eval.overrides)")


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
