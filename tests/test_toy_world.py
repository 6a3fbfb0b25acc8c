"""The toy world: its problems, its tokenizer, and the teacher whose habits the warm start copies.

References are independent of the code under test: answers from `operator` on the parsed
expression, the partition recomputed with zlib, rates counted from the teacher's own plans,
similarities from difflib on hand-written calls, and SAAR outcomes replayed through the real
agent loop and sandbox.
"""
from __future__ import annotations

import asyncio
import difflib
import operator
import random
import zlib

import pytest

from cleaner_jax.agent.config import AgentConfig
from cleaner_jax.agent.loop import AgentLoop
from cleaner_jax.agent.tools import SandboxExecutor
from cleaner_jax.chat.template import ChatFormat
from cleaner_jax.saar.config import SaarConfig
from cleaner_jax.tools.sandbox import Sandbox
from cleaner_jax.toy import task as toy_task
from cleaner_jax.toy.checkpoint import ADDED_TOKENS, build_tokenizer
from cleaner_jax.toy.vocabulary import TOY_VOCAB_SIZE, toy_corpus

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _value(expr: str) -> int:
    a, op, b = expr.split()
    return OPS[op](int(a), int(b))


def test_problems_have_exact_answers_and_a_disjoint_held_out_side():
    heldout = toy_task.make_problems(128, seed=987_654, max_operand=19, num_ops=1, split="heldout", distinct=True)
    train = toy_task.make_problems(3000, seed=1, max_operand=19, num_ops=1, split="train")
    held_exprs = [toy_task.expression_of(p) for p in heldout]
    assert len(set(held_exprs)) == 128  # distinct: each held-out problem counts once
    for p in heldout + train[:200]:
        expr = toy_task.expression_of(p)
        assert int(p.ground_truth) == _value(expr)
        a, _, b = expr.split()
        assert 2 <= int(a) <= 19 and 2 <= int(b) <= 19
    assert all(zlib.crc32(e.encode()) % 4 == 0 for e in held_exprs)
    train_exprs = {toy_task.expression_of(p) for p in train}
    assert not train_exprs & set(held_exprs)
    # 18 * 18 * 3 expressions; the training side is about three quarters of them
    assert 0.7 * 972 < len(train_exprs) <= 972 - len(set(held_exprs))


def test_a_space_too_small_for_a_distinct_held_out_set_is_an_error():
    with pytest.raises(ValueError, match="data.toy_max_operand"):
        toy_task.make_problems(128, seed=0, max_operand=9, num_ops=1, split="heldout", distinct=True)


def test_teacher_habits_happen_at_their_rates(toy_tokenizer):
    habits = toy_task.TeacherHabits(error_rate=0.5, deep_share=0.5, guess_rate=0.3, give_up_rate=0.4)
    tok = toy_tokenizer
    problems = toy_task.make_problems(2000, seed=3, max_operand=19, num_ops=1, split="train")
    rng = random.Random(0)
    teachers = [toy_task.ToyTeacher(tok, p, rng, habits=habits) for p in problems]
    n = len(teachers)
    guess = sum(t.guesses for t in teachers) / n
    tool_users = [t for t in teachers if not t.guesses]
    fail = sum(t.first_error is not None for t in tool_users) / len(tool_users)
    deep = sum(t.first_error == "deep" for t in tool_users) / sum(t.first_error is not None for t in tool_users)
    # 2000 draws: a binomial rate is within 3.5 standard errors (<= 0.04) of its target
    assert abs(guess - 0.3) < 0.04 and abs(fail - 0.5) < 0.04 and abs(deep - 0.5) < 0.05
    for t in teachers[:50]:
        first = t.turn_text(None)
        if t.guesses:
            assert "<tool_call>" not in first and f"\\boxed{{{t.wrong}}}" in first
            assert t.wrong != _value(t.expr)
        elif t.first_error == "deep":
            assert first.startswith(toy_task.DEEP_REASONING) and "calc(" in first


def test_the_recoverable_teachers_plans_give_the_regime_by_hand(toy_tokenizer):
    """configs/toy_recoverable.py's habits, drawn for 4000 problems: the plans' shares of right
    answers, of recovered failed first calls and of correct plans holding a failed call equal the
    hand-computed ones, (1-g)(1-e*u), 1-u and e(1-u) / ((1-e) + e(1-u)), and meet the regime the
    world is for (docs/toy_world.md, "The recoverable world")."""
    from _configs import load_config
    w = load_config("toy_recoverable").warmup_sft
    g, e, u = w.guess_rate, w.error_rate, w.give_up_rate
    habits = toy_task.TeacherHabits(error_rate=e, deep_share=w.deep_error_share, guess_rate=g, give_up_rate=u)
    problems = toy_task.make_problems(4000, seed=5, max_operand=19, num_ops=1, split="train")
    rng = random.Random(1)
    teachers = [toy_task.ToyTeacher(toy_tokenizer, p, rng, habits=habits) for p in problems]
    failed_first = [t for t in teachers if not t.guesses and t.first_error is not None]
    correct = [t for t in teachers if not t.guesses and (t.first_error is None or not t.gives_up)]
    acc, recovered = len(correct) / len(teachers), sum(not t.gives_up for t in failed_first) / len(failed_first)
    with_failure = sum(t.first_error is not None for t in correct) / len(correct)
    # 4000 draws: each share within ~3.5 standard errors of its value
    assert acc == pytest.approx((1 - g) * (1 - e * u), abs=0.03)
    assert recovered == pytest.approx(1 - u, abs=0.03)
    assert with_failure == pytest.approx(e * (1 - u) / ((1 - e) + e * (1 - u)), abs=0.04)
    assert acc <= 0.6 and recovered >= 0.7 and with_failure >= 0.25


@pytest.fixture(scope="module")
def toy_tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("toytok"), "qwen3", vocab_size=TOY_VOCAB_SIZE - len(ADDED_TOKENS),
                           corpus=toy_corpus("qwen3"), qwen_split=True)


def test_toy_vocabulary_splits_digits_and_fits_the_model(toy_tokenizer):
    assert len(toy_tokenizer) <= TOY_VOCAB_SIZE
    for number in ("17", "-243", "361"):
        pieces = [toy_tokenizer.decode([i]) for i in toy_tokenizer.encode(f"stdout: {number}", add_special_tokens=False)]
        assert [p for p in pieces if p.strip().lstrip("-").isdigit()] == [d for d in number if d.isdigit()]
    # the toy's boilerplate is a few tokens per word, not per character
    text = toy_task.SHALLOW_REASONING + toy_task.tool_call_text(toy_task.correct_code("12 * 7"))
    assert len(toy_tokenizer.encode(text, add_special_tokens=False)) < len(text) / 2.5


def _call(code: str) -> str:
    return toy_task.tool_call_text(code) + "<|im_end|>"


def test_the_two_error_kinds_fall_on_either_side_of_the_toy_gamma():
    """difflib on the decoded call segments (SAAR's faithful `call` mode) with the toy's gamma 0.9."""
    rng = random.Random(1)
    for expr in ("3 * 8", "19 - 12", "7 + 15"):
        fix = _call(toy_task.correct_code(expr))
        typo = difflib.SequenceMatcher(None, _call(toy_task.shallow_slip_code(expr, rng)), fix).ratio()
        deep = difflib.SequenceMatcher(None, _call(toy_task.deep_error_code(expr)), fix).ratio()
        assert typo >= 0.9 > deep, (expr, typo, deep)


@pytest.mark.parametrize("kind, splice", [("shallow", "call_only"), ("deep", "full_turn")])
def test_a_failing_then_recovering_demonstration_replays_with_the_expected_saar_outcome(toy_tokenizer, kind, splice):
    """The teacher's first call fails (a typo or a wrong approach); SAAR sends the error back, the
    teacher writes the fix, and the splice is shallow for the typo and deep for the other."""
    habits = toy_task.TeacherHabits(error_rate=1.0, deep_share=1.0 if kind == "deep" else 0.0)
    problem = toy_task.make_problems(1, seed=21, max_operand=19, num_ops=1, split="train")[0]
    cfg = AgentConfig(max_assistant_turns=4, max_user_turns=4, max_prompt_tokens=512, max_response_tokens=256,
                      saar=SaarConfig(enable=True, gamma=0.9, logprob_mode="recompute"))
    with Sandbox(workers=1) as sandbox:
        teacher = toy_task.ToyTeacher(toy_tokenizer, problem, random.Random(0), habits=habits)
        loop = AgentLoop(teacher, SandboxExecutor(sandbox), ChatFormat(toy_tokenizer), cfg, {"temperature": 1.0},
                         rng=random.Random(0))
        episode = asyncio.run(loop.run(problem.messages))
    assert [e.outcome for e in episode.events] == ["recovered"]
    assert getattr(episode.stats, splice) == 1 and episode.stats.recovered == 1
    purified = toy_tokenizer.decode(episode.purified.response_ids.tolist())
    raw = toy_tokenizer.decode(episode.raw.flatten().response_ids.tolist())
    assert purified.endswith(f"\\boxed{{{problem.ground_truth}}}.<|im_end|>")
    assert "Tool call failure" in raw and "Tool call failure" not in purified
    if kind == "deep":  # the whole turn is replaced: the wrong approach's reasoning is gone too
        assert toy_task.DEEP_REASONING not in purified and "calc(" not in purified
    else:  # only the call is replaced: the turn's reasoning stays
        assert purified.startswith(toy_task.SHALLOW_REASONING)


def test_a_teacher_that_gives_up_answers_wrong_without_a_second_call(toy_tokenizer):
    habits = toy_task.TeacherHabits(error_rate=1.0, give_up_rate=1.0)
    problem = toy_task.make_problems(1, seed=22, max_operand=19, num_ops=1, split="train")[0]
    cfg = AgentConfig(max_assistant_turns=4, max_user_turns=4, max_prompt_tokens=512, max_response_tokens=256,
                      saar=SaarConfig(enable=False))
    with Sandbox(workers=1) as sandbox:
        teacher = toy_task.ToyTeacher(toy_tokenizer, problem, random.Random(0), habits=habits)
        loop = AgentLoop(teacher, SandboxExecutor(sandbox), ChatFormat(toy_tokenizer), cfg, {"temperature": 1.0},
                         rng=random.Random(0))
        episode = asyncio.run(loop.run(problem.messages))
    raw = toy_tokenizer.decode(episode.raw.flatten().response_ids.tolist())
    assert raw.count("<tool_call>") == 1 and "Tool call failure" in raw
    assert raw.endswith(f"\\boxed{{{teacher.wrong}}}.<|im_end|>") and teacher.wrong != int(problem.ground_truth)
