"""Which problems each RL step trains on, reproducibly and resumably.

The sampler's whole state is one integer (problems handed out so far), saved in checkpoints:
epoch e visits the problems in the order of a permutation drawn from (seed, e), so position p
always maps to the same problem and a resumed run continues with exactly the next ones.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from cleaner_jax.data.problems import Problem


class ProblemSampler:
    def __init__(self, problems: Sequence[Problem] | Callable[[int], Problem], seed: int, position: int = 0) -> None:
        """`problems`: a training set, or a generator `seed -> Problem` (an endless stream,
        e.g. the toy task) called with a seed derived from (seed, position)."""
        if not callable(problems) and not problems:
            raise ValueError("ProblemSampler: the training set is empty")
        self.problems = problems
        self.seed = seed
        self.position = position

    def _at(self, pos: int) -> Problem:
        if callable(self.problems):
            return self.problems(self.seed * 1_000_003 + pos)
        epoch, idx = divmod(pos, len(self.problems))
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.problems))
        return self.problems[int(order[idx])]

    def take(self, n: int) -> list[Problem]:
        out = [self._at(self.position + i) for i in range(n)]
        self.position += n
        return out
