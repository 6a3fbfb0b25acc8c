"""QwenConfig: the subset of a Hugging Face Qwen2/Qwen3 `config.json` that the NNX port uses.

Reading is strict on purpose: a config this port would silently compute wrong (another
architecture, a RoPE scaling type, an enabled sliding window) is rejected with the reason, so
a model never "loads fine" and then generates garbage.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
# xla: the masked reference ([B, T, S] mask, f32 scores materialised; every path, every device).
# The others serve the full-sequence (learner / prefill) path only, causal with per-row lengths
# from a right-padded attention_mask, never a materialised mask or bias: cudnn = cuDNN flash
# attention (NVIDIA GPU), splash = the Pallas splash kernel (TPU), xla_causal = the same
# `jax.nn.dot_product_attention` call as cudnn with JAX's XLA implementation (any device; the
# CPU stand-in that keeps the cudnn code path tested, scores materialised like xla).
ATTENTION_IMPLS = ("xla", "cudnn", "xla_causal", "splash")
# The JAX backend an attention implementation needs (None: any).
ATTENTION_BACKENDS: dict[str, str | None] = {"xla": None, "cudnn": "gpu", "xla_causal": None, "splash": "tpu"}

DtypeName = Literal["float32", "bfloat16", "float16"]


@dataclasses.dataclass(frozen=True)
class QwenConfig:
    """Architecture plus run-time policy (dtypes, attention kernel, remat).

    Frozen and hashable: it is a static attribute of the NNX module, so it lives in the graph
    definition and a different config means a different compiled program.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    model_type: Literal["qwen2", "qwen3"] = "qwen3"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (always on for Qwen2)
    o_proj_bias: bool = False  # Qwen3 with attention_bias=True also biases o_proj, as HF does
    qk_norm: bool = True  # Qwen3: per-head RMSNorm on q and k before RoPE
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Run-time policy (not architecture).
    param_dtype: DtypeName = "float32"
    compute_dtype: DtypeName = "float32"
    attention_impl: Literal["xla", "cudnn", "xla_causal", "splash"] = "xla"
    # attention_impl "xla" without a KV cache (the learner's passes): query blocks of this many tokens,
    # each against the keys up to its end (`layers.causal_query_blocks`); 0 = the whole sequence.
    attention_block: int = 0
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
    # Decoder layers as one stacked module ([L, ...] parameters) run by `jax.lax.scan`: one layer
    # body is traced and compiled instead of L copies. The HF checkpoint layout is unchanged.
    scan_layers: bool = False

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type must be one of {sorted(ARCHITECTURES)}, got {self.model_type!r}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        if not isinstance(self.attention_block, int) or self.attention_block < 0:
            raise ValueError(f"attention_block must be an int >= 0 (0 = no query blocks), got {self.attention_block!r}")
        if self.attention_block and self.attention_impl != "xla":
            raise ValueError(f"attention_block={self.attention_block} blocks the masked attention_impl='xla' only; "
                             f"{self.attention_impl!r} is a causal kernel already: set attention_block=0")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers must be a bool, got {self.scan_layers!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (GQA needs whole groups)"
            )
        if isinstance(self.eos_token_id, list):  # keep the config hashable
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    def check_backend(self, backend: str) -> None:
        """Refuse an attention implementation the JAX backend `backend` cannot run, at model build
        time rather than deep inside the first traced step."""
        needed = ATTENTION_BACKENDS[self.attention_impl]
        if needed is not None and backend != needed:
            what = {"gpu": "an NVIDIA GPU (cuDNN flash attention)", "tpu": "a TPU (Pallas splash attention)"}[needed]
            raise RuntimeError(
                f"model.attention_impl={self.attention_impl!r} needs {what} but JAX's backend is {backend!r}; "
                f"use attention_impl='xla' (the default) or 'xla_causal' on {backend}"
            )

    @property
    def num_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **overrides: Any) -> "QwenConfig":
        """Build from a parsed HF `config.json` (transformers 4 or 5 field names)."""
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        if model_type not in ARCHITECTURES or any(a != ARCHITECTURES[model_type] for a in archs):
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r}, architectures={archs!r}; "
                f"this port implements only {sorted(ARCHITECTURES.values())}"
            )
        _reject_sliding_window(hf)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not implemented (only 'silu', as in all Qwen2/Qwen3 models)")
        heads = hf["num_attention_heads"]
        qwen2 = model_type == "qwen2"
        attention_bias = True if qwen2 else bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        fields: dict[str, Any] = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            model_type=model_type,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and not qwen2,
            qk_norm=not qwen2,
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """A `config.json` dict that `transformers.AutoConfig` reads back to the same architecture."""
        hf: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_dropout": 0.0,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.model_type == "qwen3":
            hf["attention_bias"] = self.attention_bias
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            eos = self.eos_token_id
            hf["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
        return hf


def _rope_theta(hf: dict[str, Any]) -> float:
    """rope_theta from transformers-4 (`rope_theta`, `rope_scaling`) or -5 (`rope_parameters`) fields."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    for source, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        if block is None:
            continue
        kind = block.get("rope_type", block.get("type", "default"))
        if kind not in (None, "default"):
            raise NotImplementedError(
                f"{source} type {kind!r} is not implemented (only default RoPE); "
                "remove it from config.json only if the checkpoint was trained without it"
            )
    if params is not None and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(hf.get("rope_theta", 10000.0))


def _reject_sliding_window(hf: dict[str, Any]) -> None:
    layer_types = hf.get("layer_types") or []
    if hf.get("use_sliding_window") or "sliding_attention" in layer_types:
        raise NotImplementedError(
            f"sliding-window attention is enabled (use_sliding_window={hf.get('use_sliding_window')}, "
            f"sliding_window={hf.get('sliding_window')}); this port implements full attention only"
        )
