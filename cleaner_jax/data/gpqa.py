"""GPQA-Diamond from a file the user supplies (never shipped: the dataset card asks that its
examples not be published in plain text).

Two forms, any of `.parquet`, `.jsonl`, `.jsonl.gz`, `.csv`:
- the authors' file (Open-AgentRL-Eval `gpqa-diamond/gpqa_diamond.parquet`): `problem` (the
  question with its lettered options already in the text), `solution` (the correct letter),
  `domain` (Physics, Chemistry, Biology), optionally `data_source`;
- a plain file: `problem`, `answer` (the correct letter), `domain`, optionally `id`.
A row with both `solution` and `answer` must have them equal.

The prompt is the authors' (`prompts.gpqa_eval_prompt`), and the problems are multiple choice
(`kind="choice"`): the reward is the last boxed letter, compared exactly (docs/authors.md §5,
`rewards/choice.py`). The letter is stored as given: one uppercase letter, nothing stripped, so
a malformed gold answer is an error here rather than a question nobody can answer.
"""
from __future__ import annotations

from pathlib import Path

from cleaner_jax.data import prompts
from cleaner_jax.data.problems import Problem, read_rows, require, row_error

NAME = "gpqa_diamond"


def load_gpqa(path: str | Path, *, tool: bool = True, limit: int | None = None) -> list[Problem]:
    rows = read_rows(path)
    if not rows:
        raise row_error(path, 0, "problem", "the file has no rows")
    out: list[Problem] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows[:limit]):
        problem = require(row, "problem", path, i)
        domain = require(row, "domain", path, i)
        if not domain.strip():
            raise row_error(path, i, "domain", "empty (the prompt names the domain)")
        letter = _gold_letter(row, path, i)
        uid = str(row["id"]) if row.get("id") is not None else str(i)
        if uid in seen:
            raise row_error(path, i, "id", f"{uid!r} repeats row {seen[uid]} (ids key the results)")
        seen[uid] = i
        source = require(row, "data_source", path, i) if row.get("data_source") is not None else NAME
        text = prompts.gpqa_eval_prompt(problem, domain, tool=tool)
        out.append(Problem(uid, source, ({"role": "user", "content": text},), "choice", letter))
    return out


def _gold_letter(row: dict, path: str | Path, i: int) -> str:
    present = [k for k in ("solution", "answer") if row.get(k) is not None]
    if not present:
        raise row_error(path, i, "solution", "missing: give the correct letter in `solution` (the authors' "
                        "file) or `answer` (the plain form)")
    letters = {k: require(row, k, path, i) for k in present}
    if len(set(letters.values())) > 1:
        raise row_error(path, i, "answer", f"disagrees with `solution` ({letters})")
    key = present[0]
    letter = letters[key]
    if len(letter) != 1 or not ("A" <= letter <= "Z"):
        raise row_error(path, i, key, f"{letter!r} is not one uppercase letter A-Z (the reward compares the "
                        "boxed letter to it exactly)")
    return letter
