"""A checkpoint directory's `transformers` tokenizer, as `AutoTokenizer.from_pretrained` returns it.

`AutoTokenizer` reads the model's config through `AutoConfig`, whose import chain imports torch
where torch is installed: about a second per process (bench/RESULTS.md, 2026-12-07 (later),
"Trainers and rollout servers no longer import torch"). Every trainer, evaluator and embedded
rollout server loads one tokenizer, and the toy world starts many such processes. For the one
tokenizer class whose resolution is plain, `load_tokenizer` constructs it directly; every other
checkpoint (real Qwen ones: `Qwen2Tokenizer`) goes through `AutoTokenizer` unchanged.

The plain case: `tokenizer_config.json` names `PreTrainedTokenizerFast` (in transformers 5 the
same class as `TokenizersBackend`; the toy checkpoints save it), declares no `auto_map` (remote
code), and `config.json`'s `model_type` is `qwen3`. Then `AutoTokenizer.from_pretrained` ends in
`TokenizersBackend.from_pretrained(path)`: qwen3's registered class (`Qwen2Tokenizer`) differs
from the declared one, and transformers trusts the declared class for qwen3, which is the
generic backend. Not for `qwen2`: transformers lists it among the model types whose checkpoints
declare a wrong class and loads its registered `Qwen2Tokenizer` instead, so a qwen2 checkpoint
always goes through `AutoTokenizer`. tests/test_tokenizer_load.py checks both against
`AutoTokenizer` itself.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PLAIN_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
PLAIN_MODEL_TYPES = ("qwen3",)


def is_plain(model_dir: str | Path) -> bool:
    """Whether `load_tokenizer` constructs the tokenizer without `AutoTokenizer` (see the module's docstring)."""
    path = Path(model_dir)
    try:
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
        model_config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        return False
    return (tok_config.get("tokenizer_class") in PLAIN_CLASSES and "auto_map" not in tok_config
            and model_config.get("model_type") in PLAIN_MODEL_TYPES)


def load_tokenizer(model_dir: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained(model_dir)`'s tokenizer, without importing torch where the
    class is plain. Raises what `from_pretrained` raises."""
    if is_plain(model_dir):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
