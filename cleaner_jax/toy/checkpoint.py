"""Build tiny random Qwen2/Qwen3 Hugging Face checkpoints entirely offline.

A checkpoint directory made here has what a real Qwen directory has — `config.json`,
`generation_config.json`, `model.safetensors` (or an index-sharded set) and a fast tokenizer
with a Qwen-style chat template — so every loader, server and test exercises the same code
path as a real model. Weights are written from NumPy with HF tensor names, independently of
our own NNX port, so parity tests compare two separate implementations.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from safetensors.numpy import save_file

from cleaner_jax.chat.qwen_templates import QWEN2_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE

Family = Literal["qwen2", "qwen3"]

# Qwen's added tokens. The first three are "special" (skipped by skip_special_tokens); the
# tool/think markers are ordinary added tokens, as in the real Qwen tokenizers.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

CORPUS = [
    "You are a helpful assistant. Solve the problem step by step and put the final answer in \\boxed{}.",
    "What is 12 * 7 + 3? Let me compute this with Python. The answer is \\boxed{87}.",
    'Tool call success\nstdout: 42\n', "Tool call failure\nreason: \nstderr: NameError at line 1: name 'x' is not defined",
    '{"name": "code_interpreter", "arguments": {"code": "print(1 + 2)"}}',
    "import numpy as np\nimport math\nfrom sympy import symbols, solve\nx = symbols('x')\nprint(solve(x**2 - 4, x))",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n",
    "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        seen = {}\n",
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } < > , . : ; ' \"",
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n<tools></tools>",
    "ZeroDivisionError SyntaxError TypeError ValueError KeyError IndexError AttributeError timeout",
] * 3


# Qwen2/Qwen3's pre-tokenizer split (their tokenizer.json): every digit is a token of its own,
# so a number is the same tokens wherever it appears (question, code, tool output, \boxed{}).
QWEN_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer(out_dir: str | os.PathLike, family: Family = "qwen3", vocab_size: int = 480,
                    corpus: Sequence[str] | None = None, qwen_split: bool = False):
    """Train a small byte-level BPE tokenizer on a fixed corpus and save it with a chat template.

    `corpus` replaces the generic built-in one (the toy world trains its vocabulary on its own
    texts, `cleaner_jax.toy.vocabulary`); `qwen_split` pre-tokenizes the way Qwen's tokenizers
    do (digits one by one) instead of GPT-2's byte-level regex. Returns the `transformers`
    tokenizer (also saved to `out_dir`). Deterministic: the same arguments always produce the
    same vocabulary.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if qwen_split:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS if corpus is None else list(corpus), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=None,
    )
    hf_tok.add_tokens(ADDED_TOKENS, special_tokens=False)
    hf_tok.chat_template = QWEN2_CHAT_TEMPLATE if family == "qwen2" else QWEN3_CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def tiny_config(family: Family = "qwen3", **overrides: Any) -> dict[str, Any]:
    """An HF `config.json` dict for a tiny model, written the way real Qwen checkpoints are."""
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": family,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": family == "qwen3",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if family == "qwen3":
        cfg.update(head_dim=16, attention_bias=False)
    cfg.update(overrides)
    return cfg


def hf_param_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor names and (out, in) shapes for a Qwen2/Qwen3 config."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    qwen2 = cfg["model_type"] == "qwen2"
    bias = cfg.get("attention_bias", qwen2)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (nh * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (nkv * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (nkv * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, nh * hd)
        if bias:
            shapes[p + "self_attn.q_proj.bias"] = (nh * hd,)
            shapes[p + "self_attn.k_proj.bias"] = (nkv * hd,)
            shapes[p + "self_attn.v_proj.bias"] = (nkv * hd,)
            if not qwen2:  # Qwen3's attention_bias also biases o_proj (Qwen2 never does)
                shapes[p + "self_attn.o_proj.bias"] = (h,)
        if not qwen2:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def make_tiny_checkpoint(
    out_dir: str | os.PathLike,
    family: Family = "qwen3",
    *,
    seed: int = 0,
    num_shards: int = 1,
    with_tokenizer: bool = True,
    tokenizer_corpus: Sequence[str] | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a random tiny Qwen checkpoint (+ tokenizer) to `out_dir` and return the path.

    Norm weights are drawn around 1 and biases around 0 so that every parameter matters for
    parity tests. `num_shards > 1` writes `model-0000k-of-0000n.safetensors` plus
    `model.safetensors.index.json`, like large hub checkpoints.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = None
    if with_tokenizer:
        tok = (build_tokenizer(out, family) if tokenizer_corpus is None else
               build_tokenizer(out, family, vocab_size=config_overrides.get("vocab_size", 512) - len(ADDED_TOKENS),
                               corpus=tokenizer_corpus, qwen_split=True))
    cfg = tiny_config(family, **config_overrides)
    if tok is not None:
        cfg["eos_token_id"] = tok.convert_tokens_to_ids("<|im_end|>")
        cfg["bos_token_id"] = tok.convert_tokens_to_ids("<|endoftext|>")
        if len(tok) > cfg["vocab_size"]:
            raise ValueError(f"tokenizer has {len(tok)} tokens but vocab_size={cfg['vocab_size']}")
    rng = np.random.default_rng(seed)
    std = cfg["initializer_range"]
    tensors: dict[str, np.ndarray] = {}
    for name, shape in hf_param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            arr = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            arr = 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name or "lm_head" in name:
            arr = 0.3 * rng.standard_normal(shape)  # logits of O(1-10): peaked but not one-hot
        else:
            arr = std * 4 * rng.standard_normal(shape)
        tensors[name] = arr.astype(np.float32)
    _write_safetensors(out, tensors, num_shards)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    eos = [cfg["eos_token_id"]]
    if tok is not None:
        eos.append(tok.convert_tokens_to_ids("<|endoftext|>"))
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos, "pad_token_id": eos[-1]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def _write_safetensors(out: Path, tensors: dict[str, np.ndarray], num_shards: int) -> None:
    names = sorted(tensors)
    if num_shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for k, chunk in enumerate(np.array_split(np.array(names, dtype=object), num_shards)):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
    total = int(sum(t.nbytes for t in tensors.values()))
    numel = int(sum(t.size for t in tensors.values()))
    index = {"metadata": {"total_parameters": numel, "total_size": total}, "weight_map": weight_map}
    # as transformers writes it (modeling_utils.save_pretrained)
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
