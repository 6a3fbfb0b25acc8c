"""The per-step work of a training run, in small parts, with `StepLoop` their orchestrator.

    loop.py        StepLoop: the order of one step's parts (the crash contract), the run summary
    overlap.py     train.max_staleness >= 1: the next steps' collections run while a step trains
    collection.py  the step's rollouts from every learner process, their fault counters, the lost-episode stop
    colocate.py    rollout.colocated: release and resume of the rollout servers' memory around the update
    sync.py        the weight sync after the update: export, load, probe; WeightSyncFailedError
    dump.py        the step's trajectory dump, with the advantages and old log-probs the step trained with
    evaluation.py  the periodic and the step-0 evaluation (the latter from the study's cache when it has it)
    skips.py       skipped non-finite updates: their episodes, and NonFiniteTrainingError
    seeds.py       the seeds of a step's rollouts and of an evaluation
    staleness.py   the staleness bound: which weights may have produced a token a step trains on

`train.Trainer` opens the resources (session, learner, writer) and hands them to `StepLoop`.
Imports inside the package point down, as `.importlinter` declares: `loop` above the parts,
the parts independent of each other, `seeds` and `skips` below them.
"""
from cleaner_jax.train_steps.step_loop import StepLoop
from cleaner_jax.train_steps.seeds import EVAL_OFFSET, SEED_STRIDE, eval_seed, rollout_seed
from cleaner_jax.train_steps.skips import NonFiniteTrainingError, stop_if_stuck, update_episode_ids
from cleaner_jax.train_steps.sync import WeightSyncFailedError

__all__ = ["EVAL_OFFSET", "SEED_STRIDE", "NonFiniteTrainingError", "StepLoop", "WeightSyncFailedError",
           "eval_seed", "rollout_seed", "stop_if_stuck", "update_episode_ids"]
