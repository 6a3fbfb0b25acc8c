"""The toy world's tokenizer corpus: the texts the toy run reads and writes.

A real Qwen tokenizer (151k tokens) spends a few tokens on an English sentence or on the tool
schema of the system prompt. The generic 480-token vocabulary of `toy.checkpoint` spends one
token per two or three characters, which made toy sequences ~500 tokens long and the run
mostly compute on boilerplate. Training the tiny vocabulary on the toy's own texts (its
prompts rendered by the chat template, the teacher's turns, the sandbox's observations) gives
the toy the compression a real tokenizer has on its domain, and Qwen's digit-by-digit split
makes every number the same tokens wherever it appears. Deterministic: a fixed problem seed.
"""
from __future__ import annotations

import random
import tempfile

from cleaner_jax.toy import task as toy_task
from cleaner_jax.toy.checkpoint import CORPUS, Family, build_tokenizer

_NAMES = ("reslt", "result", "calc", "x")
TOY_VOCAB_SIZE = 768  # the model's embedding rows: BPE tokens + Qwen's added tokens


def toy_corpus(family: Family, n: int = 200, seed: int = 12345) -> list[str]:
    """Rendered toy prompts, teacher turns and observations for `n` random problems."""
    from cleaner_jax.chat.template import CODE_INTERPRETER_TOOL

    with tempfile.TemporaryDirectory() as scratch:
        generic = build_tokenizer(scratch, family)  # only to render the chat template as text
    rng = random.Random(seed)
    texts: list[str] = list(CORPUS)
    for p in toy_task.make_problems(n, seed=seed, max_operand=99, num_ops=2):
        expr = toy_task.expression_of(p)
        texts.append(generic.apply_chat_template(list(p.messages), tools=[CODE_INTERPRETER_TOOL],
                                                 tokenize=False, add_generation_prompt=True))
        value = str(rng.randint(-99, 999))
        for code in (toy_task.correct_code(expr), toy_task.shallow_slip_code(expr, rng), toy_task.deep_error_code(expr)):
            texts.append(toy_task.SHALLOW_REASONING + toy_task.tool_call_text(code) + "<|im_end|>")
            texts.append(toy_task.DEEP_REASONING + toy_task.tool_call_text(code) + "<|im_end|>")
        texts.append(f"<|im_start|>user\n<tool_response>\nTool call success\nstdout: {value}\n\n</tool_response>"
                     "<|im_end|>\n<|im_start|>assistant\n")
        texts.append(f"<|im_start|>user\n<tool_response>\nTool call failure\nreason: \nstderr: NameError at line "
                     f"{rng.randint(1, 2)}: name '{rng.choice(_NAMES)}' is not defined\n</tool_response><|im_end|>\n"
                     "<|im_start|>assistant\n")
        texts += [toy_task.answer_text(value), toy_task.guess_text(int(value)), toy_task.give_up_text(int(value)),
                  toy_task.TYPO_FIX_REASONING, toy_task.DEEP_FIX_REASONING]
    return texts
