"""The recoverable toy world: the toy run of configs/toy.py with a student that recovers from most
of its tool-call errors inside the trajectory, the regime CLEANER's argument rests on
(docs/toy_world.md, "The recoverable world").

In the README's world a failed call is mostly followed by giving up (`warmup_sft.give_up_rate`
0.6), so a failed call mostly ends in a wrong answer and GRPO's reward alone removes it. Here the
student fixes 9 in 10 of its failed calls, so on raw trajectories a failed call rides along in
correct, positive-advantage trajectories, where GRPO reinforces it and SAAR's purification
removes it. A recovered error still costs tokens and a tool turn: the evaluation reports tokens
and tool calls per solved problem, and accuracy within one tool call (`eval.tool_call_budget`).

`python -m cleaner_jax.train --config configs/toy_recoverable.py --workdir runs/recoverable`
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import get_config as toy_config  # noqa: E402


def get_config():
    c = toy_config()
    c.warmup_sft.give_up_rate = 0.1  # after a failed call, 9 in 10 fix it (toy.py: 0.6)
    # guesses keep the held-out accuracy after the warm start at about half (toy.py: 0.4), so RL has
    # room beyond removing the failed calls
    c.warmup_sft.guess_rate = 0.45
    c.warmup_sft.error_rate = 0.6  # 6 in 10 tool-using first calls fail, half typos, half a wrong approach
    c.warmup_sft.deep_error_share = 0.5
    c.eval.tool_call_budget = 1  # acc_within_budget: a solve that needed a second call counts as wrong
    c.train.steps = 32
    c.train.eval_every = 8
    c.train.checkpoint_every = 8
    return c
