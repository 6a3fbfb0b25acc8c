"""Shared settings of the authors' paper runs (docs/authors.md §4.1), one function per
variant so every paper config differs from its siblings only where the authors' scripts do."""
from cleaner_jax.config import base_config


def paper_config(*, model: str, cleaner: bool, tools: bool = True):
    """model: "qwen3_4b" | "qwen25_7b"; cleaner: SAAR on (CLEANER) or off (DAPO baseline)."""
    c = base_config()
    c.model.path = None  # set --config.model.path=/local/Qwen3-4B-RA-SFT (never downloaded)
    c.model.param_dtype = "float32"  # master weights and Adam moments in f32 (as FSDP mixed precision)
    c.model.compute_dtype = "float16"  # authors: fp16 actor compute + fp16 SGLang
    c.model.remat = "full"
    # cuDNN flash attention, causal with per-row lengths: XLA's masked attention would build f32
    # scores of ~68 GB per layer for one 23k-token sequence (a GPU-only choice: on TPU set
    # --config.model.attention_impl=splash, on CPU xla)
    c.model.attention_impl = "cudnn"
    # one scanned layer body: the AOT memory report (docs/scaling.md) puts the unrolled 36-layer
    # Qwen3-4B step at 23k tokens at ~119 GiB per device on 4 devices against ~45 GiB scanned
    c.model.scan_layers = True
    # the servers (launch/sglang_servers.sh) serve float16 = the compute dtype: a float16 export is
    # exact for them and half the bytes of float32 (docs/reliability.md row 8); on a machine whose
    # /dev/shm holds the export, add --config.train.weight_export_dir=/dev/shm
    c.train.weight_export_dtype = "compute"
    c.sandbox.workers = 64  # the authors' sandbox pool (MAX_WORKERS=64, docs/authors.md §6)
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
    # evaluation (docs/authors.md §8): T=1.0 and top_p=0.6 are the eval defaults; n=16 for Qwen3-4B,
    # 32 for Qwen2.5-7B, 10 for LiveCodeBench; SAAR (K=3, p=1.0) only in the Qwen3-4B AIME/GPQA script
    c.eval.n = 16 if model == "qwen3_4b" else 32
    c.eval.saar = "on" if model == "qwen3_4b" and cleaner and tools else "off"
    c.eval.saar_rollback_probability = 1.0
    c.eval.overrides = "livecodebench:n=10,saar=off"
    # every run recomputes old log-probs with the learner (decoupled mode, docs/authors.md §3)
    c.algo.old_logprobs = "recompute"
    if not cleaner:  # baselines collect rollout log-probs: truncated sequence-level IS, cap 2,
        # weight min(exp(sum_t log pi_old - log pi_rollout), 2) on the policy loss
        c.algo.tis = "sequence"
        c.algo.tis_mode = "truncate"
        c.algo.tis_cap = 2.0
    return c
