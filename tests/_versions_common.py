"""A hand-built step whose episodes carry policy versions, for the dump and viewer tests of
per-token versions (no sandbox, no tokenizer: token i shows as "<i>")."""
from cleaner_jax.saar.purify import purify
from cleaner_jax.trajectory import Episode, RawTrajectory, ScoredEpisode, Segment, ToolStats

U = -1  # UNKNOWN_VERSION, written out: the dump stores the number


def pieces(ids):
    return [f"<{int(i)}>" for i in ids]


def decode(ids):
    return "".join(pieces(ids))


def _turn(ids, turn, versions, attempt=0, cs=None, splice="none"):
    return Segment("turn", tuple(ids), turn, attempt, cs, tuple(-0.5 for _ in ids), splice=splice,
                   versions=None if versions is None else tuple(versions))


def _obs(ids, turn, role, failed=False):
    return Segment("obs", tuple(ids), turn, role=role, tool_failed=failed, error_label="NameError" if failed else None)


# Episode 0: turn 1 (ids 10 11 480 12 2) sampled by version 4, its call failed; the retry
# (20 480 21 22 2) by version 5, spliced shallow: the purified turn is 10 11 | 480 21 22 2 with
# versions 4 4 | 5 5 5 5; the answer turn (40 41 2) spans an update: versions 5 5 6.
# Episode 1: one turn (30 31 2) without versions (as a scripted policy or an old record).
RAW = [
    RawTrajectory((1, 2), (
        _turn([10, 11, 480, 12, 2], 1, [4] * 5, cs=2),
        _obs([100], 1, "feedback", failed=True),
        _turn([20, 480, 21, 22, 2], 1, [5] * 5, attempt=1, cs=1, splice="shallow"),
        _obs([103, 104], 1, "result"),
        _turn([40, 41, 2], 2, [5, 5, 6]),
    )),
    RawTrajectory((1, 2), (_turn([30, 31, 2], 1, None),)),
]
PURIFIED_IDS = [[10, 11, 480, 21, 22, 2, 103, 104, 40, 41, 2], [30, 31, 2]]
PURIFIED_VERSIONS = [[4, 4, 5, 5, 5, 5, U, U, 5, 5, 6], [U, U, U]]
# run-length encoded, [[version, count], ...]: the purified trajectories and each raw segment
PURIFIED_RUNS = [[[4, 2], [5, 4], [U, 2], [5, 2], [6, 1]], [[U, 3]]]
RAW_RUNS = [[[[4, 5]], None, [[5, 5]], None, [[5, 2], [6, 1]]], [None]]


def versioned_step() -> list[ScoredEpisode]:
    episodes = [Episode(raw, purify(raw), (), ToolStats(), "answer", True, 3) for raw in RAW]
    return [ScoredEpisode(f"v{i}", i, ep, 1.0, acc=True, reward_detail="correct") for i, ep in enumerate(episodes)]
