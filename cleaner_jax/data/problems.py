"""Problems: the unit a rollout group is drawn from, and readers that produce them.

A `Problem` carries the chat messages to render and everything the reward needs; readers turn
the shipped benchmark files and Open-AgentRL-style training files (verl row format, parquet or
jsonl) into Problems. Nothing here touches the network.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any, Literal

from cleaner_jax.data import prompts

Kind = Literal["math", "choice", "code"]

DATA_DIR = Path(__file__).resolve().parents[2] / "data"

# name -> (path under data/, kind)
BENCHMARKS: dict[str, tuple[str, Kind]] = {
    "aime24": ("aime24/aime24.jsonl", "math"),
    "aime25": ("aime25/aime25.jsonl", "math"),
    "amc23": ("amc23/amc23.jsonl", "math"),
    "math500": ("math500/math500.jsonl", "math"),
    "gsm8k": ("gsm8k/gsm8k_test.jsonl", "math"),
    "humaneval": ("humaneval/humaneval.jsonl", "code"),
    "leetcode": ("leetcode/leetcode_v0.3.1_test.jsonl", "code"),
}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt of a GRPO group.

    `ground_truth` is the answer string for math/choice problems, and for code problems a dict
    with the tests (`{"tests": [...], "test": checker, "entry_point": ..., "import_prefix": ...}`
    or `{"inputs": [...], "outputs": [...]}` for stdin/stdout problems).
    """

    uid: str
    data_source: str
    messages: tuple[dict[str, str], ...]
    kind: Kind
    ground_truth: Any

    @property
    def prompt_text(self) -> str:
        return self.messages[-1]["content"]


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a `.jsonl`, `.jsonl.gz` or `.parquet` file, in file order."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data file not found: {p} (give an existing local path)")
    name = p.name
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(p, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    raise ValueError(f"{p}: unsupported data file type (use .jsonl, .jsonl.gz or .parquet)")


def load_benchmark(name: str, *, tool: bool = True, limit: int | None = None) -> list[Problem]:
    """A shipped benchmark (see data/README.md) as Problems, prompts in the authors' format."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; shipped: {sorted(BENCHMARKS)}")
    rel, kind = BENCHMARKS[name]
    rows = read_rows(DATA_DIR / rel)[:limit]
    out = []
    for row in rows:
        if kind == "math":
            text, truth = prompts.math_eval_prompt(row["problem"], tool=tool), row["answer"]
        else:
            text = prompts.code_eval_prompt(row["problem"], tool=tool)
            truth = {k: row[k] for k in ("tests", "test", "entry_point", "import_prefix") if k in row}
        out.append(Problem(row["id"], name, ({"role": "user", "content": text},), kind, truth))
    return out


def load_agentrl(path: str | Path, *, limit: int | None = None) -> list[Problem]:
    """Open-AgentRL-30K-style rows (verl format) as Problems, prompts as the authors train.

    Columns: `prompt` (list of {role, content}), `data_source`, `reward_model.ground_truth`,
    optional `uid` (else the row index, as the authors' stats file assumes).
    """
    rows = read_rows(path)[:limit]
    out = []
    for i, row in enumerate(rows):
        for key in ("prompt", "data_source", "reward_model"):
            if key not in row:
                raise KeyError(f"{path}: row {i} has no {key!r} column (expected verl row format)")
        messages = [dict(m) for m in _as_json(row["prompt"])]
        messages[-1]["content"] = prompts.train_prompt_faithful(messages[-1]["content"])
        source = str(row["data_source"])
        kind: Kind = "code" if "code" in source else "math"
        truth = _as_json(row["reward_model"])["ground_truth"]
        if kind == "code":  # tests may be a JSON string; a math answer like "[0, 1]" must stay a string
            truth = _as_json(truth)
        out.append(Problem(str(row.get("uid", i)), source, tuple(messages), kind, truth))
    return out


def _as_json(value: Any) -> Any:
    """verl parquet stores some nested fields as JSON strings; accept both forms."""
    return json.loads(value) if isinstance(value, str) else value
