"""The trajectory viewer's data and its self-contained export.

The page itself is plain HTML + one vanilla JS file + one CSS file under `viz/static/`. It gets
its data either from the live server (`viz/serve.py`: `api/index.json`, `api/step/N.json`) or,
in an export, from a JSON blob inlined in the page; the JS reads whichever is there. Nothing is
loaded from the network: no CDN, no web font.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cleaner_jax.viz.dumps import DumpReadError, dump_path, list_steps, read_lines

STATIC = Path(__file__).parent / "static"
SUMMARY_KEYS = ("step", "index", "uid", "group", "score", "acc", "error", "advantage", "gamma", "termination",
                "saar_outcome", "splice_kinds", "error_types")


@functools.lru_cache(maxsize=32)
def _lines_at(workdir: str, step: int, mtime_ns: int) -> list[dict[str, Any]] | None:
    return read_lines(workdir, step)


def _lines(workdir: str | Path, step: int) -> list[dict[str, Any]] | None:
    """`read_lines`, cached while the step's file is unchanged: the live server re-reads the
    index on every page load, and a long run's dumps take seconds to decompress."""
    path = dump_path(workdir, step)
    return _lines_at(str(workdir), step, path.stat().st_mtime_ns if path.exists() else -1)


def _summary(line: dict[str, Any]) -> dict[str, Any]:
    row = {k: line[k] for k in SUMMARY_KEYS}
    row["tokens"] = 0 if line["view"] is None else len(line["view"]["purified"]["ids"])
    return row


def viewer_index(workdir: str | Path, keep: Callable[[int], bool] | None = None) -> dict[str, Any]:
    """Every dumped episode's summary row (what the list page filters), the steps whose dumps
    are in the old format (listed, not shown: they carry no decoded text) and the dump files that
    cannot be read (`bad_files`: step, file, error; the other steps are shown all the same).
    `keep(step)`: only those steps (the export's `--steps` / `--every`)."""
    rows, legacy, bad, good = [], [], [], []
    steps = [s for s in list_steps(workdir) if keep is None or keep(s)]
    for step in steps:
        try:
            lines = _lines(workdir, step)
        except DumpReadError as err:
            bad.append({"step": step, "file": str(err.path), "error": err.problem})
            continue
        if lines is None:
            legacy.append(step)
            continue
        good.append(step)
        rows.extend(_summary(d) for d in lines)
    return {"workdir": str(Path(workdir).resolve()), "steps": good, "legacy_steps": legacy, "bad_files": bad,
            "rows": rows}


def viewer_step(workdir: str | Path, step: int) -> list[dict[str, Any]]:
    """One step's episodes for the trajectory page: summary + view (no raw record)."""
    lines = _lines(workdir, step)
    if lines is None:
        raise ValueError(f"step {step} of {workdir} has only an old-format dump (step_{step:06d}.jsonl), which holds "
                         "no decoded text; the viewer shows format-2 and -3 dumps (viz/dumps.py)")
    return [{**_summary(d), "reward_detail": d["reward_detail"], "view": d["view"]} for d in lines]


def page(data: dict[str, Any] | None = None) -> str:
    """index.html; with `data`, CSS, JS and data inlined (the export), else linked (the server)."""
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    if data is None:
        return html.replace("<!--STYLE-->", '<link rel="stylesheet" href="style.css">') \
                   .replace("<!--DATA-->", "").replace("<!--SCRIPT-->", '<script src="app.js"></script>')
    blob = json.dumps(data).replace("</", "<\\/")  # a "</script>" inside the data must not end the tag
    css = (STATIC / "style.css").read_text(encoding="utf-8")
    js = (STATIC / "app.js").read_text(encoding="utf-8")
    return html.replace("<!--STYLE-->", f"<style>\n{css}</style>") \
               .replace("<!--DATA-->", f'<script type="application/json" id="dump-data">{blob}</script>') \
               .replace("<!--SCRIPT-->", f"<script>\n{js}</script>")


def parse_steps(spec: str) -> tuple[int | None, int | None]:
    """`--steps`: "3:7" (steps 3 to 7, both included), "3:" (3 on), ":7" (up to 7), "5" (step 5)."""
    lo, sep, hi = spec.partition(":")
    try:
        first = int(lo) if lo.strip() else None
        last = (int(hi) if hi.strip() else None) if sep else first
    except ValueError:
        raise ValueError(f"--steps {spec!r}: expected FIRST:LAST (both included; either may be left out, "
                         "e.g. 3:7, 3:, :7) or one step, e.g. 5") from None
    if first is not None and last is not None and first > last:
        raise ValueError(f"--steps {spec!r}: the first step {first} is after the last {last}")
    return first, last


def step_filter(steps: str | None = None, every: int | None = None) -> Callable[[int], bool] | None:
    """The export's step selection: within `steps` (`parse_steps`) and a multiple of `every`."""
    if every is not None and every < 1:
        raise ValueError(f"--every {every}: expected a positive number of steps (e.g. 10: steps 10, 20, ...)")
    if steps is None and every is None:
        return None
    first, last = parse_steps(steps) if steps is not None else (None, None)
    return lambda s: ((first is None or s >= first) and (last is None or s <= last)
                      and (every is None or s % every == 0))


def export(workdir: str | Path, out: str | Path, keep: Callable[[int], bool] | None = None) -> tuple[Path, dict[str, Any]]:
    """One self-contained HTML file with every readable format-2 or -3 step of `workdir` inlined (only
    those `keep` selects, if given). An unreadable dump is left out, and listed in the page with
    its file and error (`index["bad_files"]`). Returns the file and the index it holds."""
    index = viewer_index(workdir, keep)
    steps = {str(s): viewer_step(workdir, s) for s in index["steps"]}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page({"index": index, "steps": steps}), encoding="utf-8")
    return out, index


def export_html(workdir: str | Path, out: str | Path, keep: Callable[[int], bool] | None = None) -> Path:
    """`export`'s file alone."""
    return export(workdir, out, keep)[0]
