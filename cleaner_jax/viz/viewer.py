"""The trajectory viewer's data and its self-contained export.

The page itself is plain HTML + one vanilla JS file + one CSS file under `viz/static/`. It gets
its data either from the live server (`viz/serve.py`: `api/index.json`, `api/step/N.json`) or,
in an export, from a JSON blob inlined in the page; the JS reads whichever is there. Nothing is
loaded from the network: no CDN, no web font.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from cleaner_jax.viz.dumps import dump_path, list_steps, read_lines

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


def viewer_index(workdir: str | Path) -> dict[str, Any]:
    """Every dumped episode's summary row (what the list page filters), and the steps whose dumps
    are in the old format (listed, not shown: they carry no decoded text)."""
    rows, legacy = [], []
    steps = list_steps(workdir)
    for step in steps:
        lines = _lines(workdir, step)
        if lines is None:
            legacy.append(step)
            continue
        rows.extend(_summary(d) for d in lines)
    return {"workdir": str(Path(workdir).resolve()), "steps": [s for s in steps if s not in legacy],
            "legacy_steps": legacy, "rows": rows}


def viewer_step(workdir: str | Path, step: int) -> list[dict[str, Any]]:
    """One step's episodes for the trajectory page: summary + view (no raw record)."""
    lines = _lines(workdir, step)
    if lines is None:
        raise ValueError(f"step {step} of {workdir} has only an old-format dump (step_{step:06d}.jsonl), which holds "
                         "no decoded text; the viewer shows format-2 dumps (viz/dumps.py)")
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


def export_html(workdir: str | Path, out: str | Path) -> Path:
    """One self-contained HTML file with every format-2 step of `workdir` inlined."""
    index = viewer_index(workdir)
    steps = {str(s): viewer_step(workdir, s) for s in index["steps"]}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page({"index": index, "steps": steps}), encoding="utf-8")
    return out
