"""notebooks/*.ipynb run top to bottom in a real Jupyter kernel (nbclient + ipykernel) on a small
real study (two arms × two seeds, two RL steps each, made by `python -m cleaner_jax.study`:
tests/_study_common.py, shared with tests/test_study_e2e.py), and
what they show is checked against the study's files read here independently (json, gzip, numpy);
the committed notebooks carry no outputs."""
import collections
import gzip
import itertools
import json
import re
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

from _study_common import ARMS, SEEDS, STUDY_TIMEOUT_S
from _viz_common import scripted_step
from cleaner_jax.study import plots as study_plots
from cleaner_jax.toy.checkpoint import build_tokenizer
from cleaner_jax.viz.dumps import token_pieces, write_step
from cleaner_jax.viz.plots import study_runs

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
# the first test to ask for the shared study waits for it (minutes on a loaded 2-core box)
pytestmark = pytest.mark.timeout(STUDY_TIMEOUT_S)


@pytest.fixture(scope="session")
def study(small_study) -> Path:  # the session's study (tests/conftest.py)
    """The shared small study's workdir (tests/_study_common.py: 2 arms x 2 seeds, 2 RL steps)."""
    return small_study.workdir


def parameters_index(nb) -> int:
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"expected one cell tagged 'parameters', found cells {tagged}"
    return tagged[0]


def execute(name: str, params: dict[str, object], cwd: Path):
    """Run notebooks/<name> in a fresh python3 kernel, `params` injected after its parameters cell
    (as papermill does); a cell that raises fails the test with the cell's traceback."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    at = parameters_index(nb)
    source = "\n".join(f"{k} = {v!r}" for k, v in params.items())
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]}))
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def stdout(nb) -> str:
    return "".join(o["text"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
                   if o["output_type"] == "stream" and o["name"] == "stdout")


def rich(nb, mime: str) -> list[str]:
    return [o["data"][mime] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o["output_type"] in ("display_data", "execute_result") and mime in o["data"]]


def metrics_rows(run: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for line in (run / "tb" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    return rows


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_are_committed_without_outputs(path):
    raw = json.loads(path.read_text(encoding="utf-8"))
    for i, cell in enumerate(raw["cells"]):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, (
                f"{path.name} cell {i} has outputs: clear them before committing (Jupyter: Edit > Clear outputs of all "
                f"cells, or `jupyter nbconvert --clear-output --inplace {path.relative_to(ROOT)}`)")
    nbformat.validate(nbformat.reads(path.read_text(encoding="utf-8"), as_version=4))
    parameters_index(nbformat.reads(path.read_text(encoding="utf-8"), as_version=4))


def cell_stats(cell: str) -> tuple[float, float, float, float]:
    """`aggregate.markdown`'s 'mean ± std [lo, hi]' back as numbers (3 decimals)."""
    m = re.fullmatch(r"(-?[\d.]+) ± (-?[\d.]+) \[(-?[\d.]+), (-?[\d.]+)\]", cell.strip())
    assert m, f"not a 'mean ± std [lo, hi]' cell: {cell!r}"
    return tuple(float(x) for x in m.groups())


def table_row(markdown: str, label_start: str) -> dict[str, str]:
    """arm -> cell of the first table row whose label starts with `label_start`."""
    lines = markdown.splitlines()
    header = next(ln for ln in lines if ln.startswith("| metric |"))
    arms = [a.strip() for a in header.strip("|").split("|")[1:]]
    row = next(ln for ln in lines if ln.startswith(f"| {label_start}"))
    return dict(zip(arms, [c.strip() for c in row.strip("|").split("|")[1:]]))


def expected_stats(values: list[float]) -> tuple[float, float, float, float]:
    """mean, std (ddof=1) and, for two seeds, the percentile-bootstrap interval of the mean, which
    is [min, max]: a resample's mean is min, the midpoint or max with probability 1/4, 1/2, 1/4,
    so the 2.5 % and 97.5 % quantiles of a thousand resamples or more are min and max."""
    x = np.asarray(values, dtype=np.float64)
    assert len(x) == 2
    return float(x.mean()), float(x.std(ddof=1)), float(x.min()), float(x.max())


def table_lines(markdown: str) -> list[str]:
    return [ln for ln in markdown.splitlines() if ln.startswith("|")]


def test_study_notebook(study, tmp_path):
    settings = json.loads((study / "study_config.json").read_text())  # the study's own, as it ran
    ci = {"resamples": settings["bootstrap_resamples"], "seed": settings["bootstrap_seed"],
          "level": settings["ci_level"], "method": settings["ci_method"]}
    nb = execute("ablation.ipynb", {"STUDY_DIR": str(study), "BENCHMARK": settings["benchmark"],
                                    "BASELINE": settings["baseline"], "TAIL_STEPS": settings["tail_steps"], "CI": ci},
                 tmp_path)
    out = stdout(nb)
    for arm in ARMS:  # the runs it found: every arm with both seeds
        assert f"{arm}: seeds {', '.join(map(str, SEEDS))}\n" in out
    drawn = re.findall(r"^curve: (.*)$", out, re.M)
    per_arm = re.findall(r"^per arm: (.*)$", out, re.M)
    images = rich(nb, "image/png")
    assert len(images) == len(drawn) + len(per_arm) and len(drawn) >= 2
    # the ablation figures: held-out accuracy after RL per arm is in every study's summary
    assert "heldout_acc_after" in per_arm and set(per_arm) <= set(study_plots.ARM_FIGURES)
    assert any(t.startswith("heldout_accuracy (eval/toy/mean@2)") for t in drawn)
    assert any(t.startswith("train_accuracy (reward/acc)") for t in drawn)
    assert all(len(img) > 1000 for img in images)  # base64 PNGs, not empty figures
    assert (study / "notebook_plots" / "heldout_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (table,) = [md for md in rich(nb, "text/markdown") if "| metric |" in md]
    # the same numbers as the study's own summary (both tables, the paired differences included;
    # summary.md goes on with the paired tests and the generation budgets, which the notebook does not draw)
    own = (study / "summary.md").read_text()
    drawn_part = own[:min(own.index(h) for h in ("## Primary metric", "## Generation budget") if h in own)]
    assert table_lines(table) == table_lines(drawn_part)
    assert any("Difference from `grpo_raw`" in ln for ln in table.splitlines())
    runs = {arm: {s: metrics_rows(study / "runs" / arm / f"seed_{s}") for s in SEEDS} for arm in ARMS}
    after = table_row(table, "held-out accuracy after RL")
    train_acc = table_row(table, "training-rollout accuracy, last RL steps")
    for arm, per_seed in runs.items():
        last_eval = [rows[max(s for s in rows if "eval/toy/mean@2" in rows[s])]["eval/toy/mean@2"]
                     for rows in per_seed.values()]
        last_acc = [rows[max(s for s in rows if "reward/acc" in rows[s])]["reward/acc"] for rows in per_seed.values()]
        for shown, values in ((after[arm], last_eval), (train_acc[arm], last_acc)):
            np.testing.assert_allclose(cell_stats(shown), expected_stats(values), atol=5.1e-4, err_msg=f"{arm}: {shown}")


def dump_lines(run: Path) -> list[dict]:
    lines = []
    for path in sorted((run / "trajectories").glob("step_*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines += [json.loads(t) for t in f]
    return lines


def marked_reference(pieces: list[str], kinds: list[int]) -> str:
    """The purified response with spliced runs wrapped «shallow: ...» / «deep: ...» (1 / 2 in the
    dump's splice_kind), built with itertools.groupby."""
    names = {1: "shallow", 2: "deep"}
    parts = []
    for kind, group in itertools.groupby(zip(pieces, kinds), key=lambda pk: pk[1]):
        text = "".join(p for p, _ in group)
        parts.append(f"«{names[kind]}: {text}»" if kind in names else text)
    return "".join(parts)


def test_trajectories_notebook(study, tmp_path):
    run = study / "runs" / "cleaner" / "seed_0"
    nb = execute("trajectories.ipynb", {"RUN_DIR": str(run), "SHOW": 2}, tmp_path)
    out = stdout(nb)
    lines = [d for d in dump_lines(run) if d["has_episode"]]
    steps = {d["step"] for d in lines}
    assert f"{len(lines)} episodes from {len(steps)} steps\n" in out
    outcomes = collections.Counter(e["outcome"] for d in lines for e in d["events"])
    assert f"SAAR outcomes: {dict(outcomes)}\n" in out
    assert len(rich(nb, "image/png")) == 1  # the similarity histogram, drawn inline
    shown = [(int(s), int(i)) for s, i in re.findall(r"^=== step (\d+) episode (\d+) ", out, re.M)]
    assert len(shown) == min(2, len(lines))
    by_key = {(d["step"], d["index"]): d for d in lines}
    spliced = [d for d in lines if d["splice_kinds"]]
    if spliced:  # spliced episodes are shown first
        assert by_key[shown[0]]["splice_kinds"]
    for key in shown:
        d = by_key[key]
        block = out.split(f"=== step {key[0]} episode {key[1]} ", 1)[1].split("--- end ---", 1)[0]
        raw, purified = block.split("--- raw ---\n", 1)[1].split("--- purified ---\n", 1)
        for seg in d["view"]["raw"]:
            assert seg["text"] in raw
        assert purified == marked_reference(d["view"]["purified"]["pieces"], d["view"]["purified"]["splice_kind"]) + "\n"
    page = (run / "trajectories.html").read_text(encoding="utf-8")
    assert page.startswith("<!") and lines[0]["uid"] in page


def test_study_runs_finds_the_finished_runs_only(study, tmp_path):
    """`viz.plots.study_runs` (the notebook's first step) against a listing of runs/ by hand; a run
    without the study's DONE marker (still running, or failed) is left out; no study is an error
    naming the layouts it looks for."""
    assert study_runs(study) == {arm: {s: study / "runs" / arm / f"seed_{s}" for s in SEEDS} for arm in ARMS}
    for arm in ("a", "b"):
        (tmp_path / "runs" / arm / "seed_3").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "seed_3" / "DONE").write_text("{}")
    (tmp_path / "runs" / "a" / "notes").mkdir()
    assert study_runs(tmp_path) == {"a": {3: tmp_path / "runs" / "a" / "seed_3"}}
    with pytest.raises(FileNotFoundError, match=r"no study under .*runs/<arm>/seed_<s>/DONE"):
        study_runs(tmp_path / "runs" / "b")


def test_trajectories_notebook_marks_the_spliced_spans(tmp_path):
    """The spans the notebook marks as spliced, on dumps of scripted episodes (the real agent loop
    and sandbox, tests/_viz_common.py: a shallow splice, a deep one, a give-up, ...), against the
    token indices each splice must cover, computed there from the tokenizer alone. (The small
    study's policy is too young to splice reliably, so this is where both kinds are sure to occur.)"""
    tok = build_tokenizer(str(tmp_path / "tok"), "qwen3")
    s = scripted_step(tok)
    write_step(tmp_path / "run", 5, s.scored, advantages=s.advantages, gamma=0.5, pieces=token_pieces(tok),
               decode=lambda ids: tok.decode(list(ids)))
    nb = execute("trajectories.ipynb", {"RUN_DIR": str(tmp_path / "run"), "SHOW": len(s.scored)}, tmp_path)
    out = stdout(nb)
    assert f"{len(s.scored)} episodes from 1 steps\n" in out
    shown = [int(i) for i in re.findall(r"^=== step 5 episode (\d+) ", out, re.M)]
    assert sorted(shown) == list(range(len(s.scored)))
    assert sorted(shown[:3]) == sorted(i for i, k in enumerate(s.expected_kind) if k)  # spliced ones first
    names = {1: "shallow", 2: "deep"}
    for i, scored in enumerate(s.scored):
        ids = scored.episode.purified.response_ids.tolist()
        pieces = [tok.decode([t]) for t in ids]
        kinds = [s.expected_kind[i] if j in s.expected_spliced[i] else 0 for j in range(len(ids))]
        expected = marked_reference(pieces, kinds)
        block = out.split(f"=== step 5 episode {i} ", 1)[1].split("--- end ---", 1)[0]
        assert block.split("--- purified ---\n", 1)[1] == expected + "\n", i
        if s.expected_kind[i]:
            assert expected.count(f"«{names[s.expected_kind[i]]}: ") == 1
