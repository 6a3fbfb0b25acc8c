"""`chat.tokenizer.load_tokenizer` returns what `transformers.AutoTokenizer` returns (the reference),
and for the toy's qwen3 checkpoints without importing torch."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cleaner_jax.chat.tokenizer import is_plain, load_tokenizer
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "What is 12 * 7?",
    '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(2**10)"}}\n</tool_call><|im_end|>',
    "  leading spaces, tabs\tand\nnewlines, digits 3.14159 and ünïcödé  ",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_the_same_tokenizer_as_auto_tokenizer(checkpoint):
    ref, tok = AutoTokenizer.from_pretrained(str(checkpoint)), load_tokenizer(checkpoint)
    assert type(tok) is type(ref)
    assert tok.get_vocab() == ref.get_vocab()
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (ref.eos_token_id, ref.pad_token_id,
                                                                      ref.bos_token_id)
    assert tok.all_special_ids == ref.all_special_ids
    for text in TEXTS:
        ids = ref.encode(text)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    for generation_prompt in (False, True):
        assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt) == \
            ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)


def test_only_qwen3_checkpoints_of_the_generic_class_skip_auto_tokenizer(checkpoint, tmp_path):
    family = json.loads((checkpoint / "config.json").read_text())["model_type"]
    # transformers replaces a qwen2 checkpoint's declared class by its registered Qwen2Tokenizer
    assert is_plain(checkpoint) == (family == "qwen3")
    assert not is_plain(tmp_path)  # no tokenizer files: AutoTokenizer says why
    remote = tmp_path / "remote"
    remote.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (remote / name).write_bytes((checkpoint / name).read_bytes())
    tok_config = json.loads((remote / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": ["x", "y"]}
    (remote / "tokenizer_config.json").write_text(json.dumps(tok_config))
    assert not is_plain(remote)  # remote code: AutoTokenizer decides


def test_the_toy_tokenizer_loads_without_torch(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")  # the toy world's family (configs/toy.py)
    code = ("import sys; from cleaner_jax.chat.tokenizer import load_tokenizer; "
            f"tok = load_tokenizer({str(checkpoint)!r}); "
            "print(tok.encode('1 + 1'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    ids, torch_imported = out.rsplit(" ", 1)
    assert torch_imported.strip() == "False"
    assert ids == str(AutoTokenizer.from_pretrained(str(checkpoint)).encode("1 + 1"))
