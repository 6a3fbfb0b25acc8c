"""The step's trajectory dump for the viewer (`viz/dumps.py`, `python -m cleaner_jax.viz.serve`):
every episode of the step with the advantage and old log-probs it was trained with (what the RL
step computed, `rl.step.StepOutputs`) and the γ that decided each splice.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cleaner_jax import distributed
from cleaner_jax.trajectory import ScoredEpisode
from cleaner_jax.viz.dumps import token_pieces, write_step


class StepDump:
    """Writes <workdir>/trajectories/step_N.jsonl.gz, decoding with the run's tokenizer."""

    def __init__(self, workdir: Path, tokenizer: Any, gamma: float) -> None:
        self.wd, self.tokenizer, self.gamma = workdir, tokenizer, gamma

    def write(self, step: int, scored: list[ScoredEpisode], advantages: np.ndarray,
              old_logprobs: Sequence[np.ndarray | None]) -> None:
        """Dump step `step`'s episodes `scored` (every process's); `advantages` and `old_logprobs`
        are this process's episodes' (its `rl_step_outputs`). Every process calls it: the
        processes' parts are gathered, in the order of `scored`, and process 0 writes."""
        advantages = [a for part in distributed.gather_objects(np.asarray(advantages).tolist()) for a in part]
        old_logprobs = [lp for part in distributed.gather_objects(list(old_logprobs)) for lp in part]
        if not distributed.is_main():
            return
        tok = self.tokenizer
        write_step(self.wd, step, scored, advantages=advantages, gamma=self.gamma, pieces=token_pieces(tok),
                   decode=lambda ids: tok.decode(list(ids), skip_special_tokens=False), old_logprobs=old_logprobs)
