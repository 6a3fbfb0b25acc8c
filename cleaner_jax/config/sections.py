"""The run config's sections: one frozen dataclass per concern (`cleaner_jax.schema` fields with
their types, allowed values, ranges and help), and `RunConfig`, the validated whole. The package
docstring (`cleaner_jax.config`) says how they become the ml-collections config and back."""
from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.distributed import DistributedConfig
from cleaner_jax.eval.settings import EvalSettings
from cleaner_jax.models.config import ARCHITECTURES, ATTENTION_IMPLS, REMAT_POLICIES, DtypeName
from cleaner_jax.rewards.choice import MODES as CHOICE_MODES
from cleaner_jax.rewards.code import THINK_SPLITS
from cleaner_jax.rl.advantages import Estimator
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.rl.loss_scale import LossScaleConfig
from cleaner_jax.rl.losses import LossConfig
from cleaner_jax.rl.step import StepConfig
from cleaner_jax.rollout.decode_backend import DECODE_BACKENDS
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.schema import borrow, field, section

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
    attention_block: int = field(
        0, ge=0, help="attention_impl xla without a KV cache (the learner's step and log-prob passes): split the "
        "queries into blocks of this many tokens, each attending only to the keys up to its end, so the causal upper "
        "triangle is never computed (exact up to float summation order; ~2x less attention work on CPU, "
        "bench/RESULTS.md); 0 = one block")
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
    server_urls: str = field(
        "", help="comma-separated SGLang server URLs (backend=sglang); with rollout.router_url, the workers behind "
        "the router")
    router_url: str | None = field(
        None, help="sglang-router in front of the workers of rollout.server_urls (backend=sglang; launch/router.sh, "
        "whose manual policy keeps each trajectory on one worker): generation, evaluation and SAAR's re-scoring go "
        "through it with each trajectory's routing key, so it balances the load; the weight sync, the context check "
        "and the health checks go to each worker directly. A sync pauses each worker in turn, which holds what the "
        "router sends it meanwhile (docs/scaling.md, Generation through sglang-router); None: the trainer routes "
        "over rollout.server_urls itself")
    decode_backend: Literal[DECODE_BACKENDS] = field(
        "auto", help="the embedded engine's decode kernels: auto (the C++ attention kernel where it builds and "
        "was measured faster: KV caches of 256+ slots), xla, cpu_kernels (the kernel on every decode step)")
    batch_invariant: bool = field(
        True, help="the embedded engine runs every batch at one width and prefills in fixed chunks, so a "
        "request's tokens and log-probs do not depend on what it is batched with (an exact resume needs it; "
        "docs/reliability.md). SGLang servers: their --enable-deterministic-inference instead")
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
    continue_aborted: bool = field(
        False, help="trajectories live through a weight sync: a turn cut by the sync's pause is continued on the "
        "new weights from the token where it stopped (each token keeps the policy version that sampled it), and a "
        "turn due while its server syncs waits for it (up to rollout.server_wait_s); False: such an episode is "
        "regenerated from its start (docs/reliability.md, row 1)")
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
    hang_grace_s: float = field(
        30.0, gt=0.0, help="seconds past timeout_s a worker may stay silent before it counts as hung: it is killed, "
        "replaced and the call retried (docs/reliability.md, row 2); the worker itself needs ~2 s to drain a "
        "killed call")
    infra_retries: int = field(
        1, ge=0, help="times a call that failed for the sandbox's own reasons (a worker died or hung, a kill from "
        "outside) is re-run on a fresh worker before it returns status infra and its episode is dropped")


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
    ratio_level = borrow(LossConfig, "ratio_level")
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
        "then that budget rounded up to 128; every:K = K, 2K, ... up to the budget rounded up to K (short rows: the "
        "toy's every:64); an ascending list 'w1,w2,...' whose largest covers the budget; off = "
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
    attention_block: int = field(
        0, ge=0, help="the warm start's model.attention_block: its long fit at one padded width pays the blocked "
        "program's longer compile back many times, where a short RL run at several widths does not (bench/RESULTS.md)")
    logprob_chunk: int = field(
        1024, ge=1, help="the warm-start learner's tokens per LM-head chunk (algo.logprob_chunk is the RL "
        "learner's): the fit's rows are one padded width, so one chunk over the whole row costs no more memory "
        "than the RL learner's and saves the per-chunk work (bench/RESULTS.md)")
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
        "sub-directory there; None: <workdir>/sync. Only the newest export is kept there (train.keep_exports keeps "
        "more, under <workdir>/exports/)")
    weight_export_shard_mb: float = field(
        5000.0, gt=0.0, help="largest safetensors file of a weight export, in MB (10^6 bytes; HF's max_shard_size "
        "'5GB'): a bigger model is written as model-0000k-of-0000n.safetensors + model.safetensors.index.json, "
        "one that fits as a single model.safetensors. In a multi-process run file k is written by process k mod N")
    keep_exports: Literal["latest", "latest,best", "latest,final", "latest,best,final"] = field(
        "latest", help="which weight exports a run keeps: latest (the newest, which the rollout servers serve; always "
        "kept), best (<workdir>/exports/best: the export of the step with the highest held-out eval/<benchmark>/mean@n "
        "of the first benchmark of data.eval, replaced only by a higher one), final (<workdir>/exports/final: the last "
        "step's). Copies of the sync's export (train.weight_export_dtype), each with export.json naming its step and "
        "metric (docs/exports.md)")
    dump_trajectories: bool = field(True, help="write each step's episodes under the workdir")
    max_staleness: int = field(
        0, ge=0, help="bounded-staleness asynchronous RL (docs/async.md): 0 = collect, update, sync, one after "
        "another (the synchronous loop); k >= 1 = the rollouts of later steps are collected while a step trains, and "
        "every token step n trains on was generated by weights at most k updates older than the ones step n starts "
        "from (policy version >= n - 1 - k); older groups are dropped and counted (async/dropped_groups)")
    debug_update_delay_s: float = field(
        0.0, ge=0.0, help="a test hook: sleep this long after every update, as if the learner were that much slower "
        "(to measure the rollout/update overlap of train.max_staleness on a CPU, where both share the cores); 0: off")
    loss_scale_init = borrow(LossScaleConfig, "init_scale")
    loss_scale_growth_interval = borrow(LossScaleConfig, "growth_interval")
    compilation_cache_dir: str | None = field(
        None, help="persistent XLA compilation cache directory (jax_compilation_cache_dir) of the learner and the "
        "embedded rollout server, set at start-up: a later run, or a resumed one, loads the compiled programs "
        "instead of compiling them again (cleaner_jax/models/compile_cache.py); None: off")
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
    loggers: str = field(
        "tensorboard", help="where the scalars go besides <workdir>/tb/metrics.jsonl (always written), comma-separated: "
        "tensorboard (event files in <workdir>/tb/), wandb (a Weights & Biases run under <workdir>/wandb/, same "
        "names and steps; needs pip install cleaner_jax[wandb]; WANDB_MODE=offline keeps it on disk for a later "
        "wandb sync), or both: 'tensorboard,wandb' (docs/metrics.md)")
    wandb_project: str | None = field(None, help="the W&B project (train.loggers has wandb); None: cleaner_jax")
    wandb_name: str | None = field(None, help="the W&B run's name (train.loggers has wandb); None: the workdir's name")


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
    tool_call_budget: int | None = field(
        None, ge=1, help="also report acc_within_budget: mean@n with a sample that executed more tool calls than this "
        "counted wrong (what a recovered error costs under a tight budget); None: not reported")


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
