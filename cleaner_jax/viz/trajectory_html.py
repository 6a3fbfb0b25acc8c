"""A self-contained HTML page that shows what SAAR did to each episode.

Left column: the raw record (every turn and observation as it happened, failed attempts and
the error feedback included); right column: the purified trajectory the learner trains on,
with spliced tokens highlighted. `viz/viewer.py` + `viz/serve.py` are the interactive viewer (per-token
mask, advantage and log-probs); this module stays for notebooks that want one static page. Reading a handful of these is the fastest way to check that
purification does what the paper says, and to see what the model actually writes.
"""
from __future__ import annotations

import html
from collections.abc import Callable, Sequence

from cleaner_jax.trajectory import Episode

Decode = Callable[[Sequence[int]], str]

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;background:#fafafa}
.ep{background:#fff;border:1px solid #ddd;border-radius:6px;margin-bottom:2em;padding:1em}
.cols{display:grid;grid-template-columns:1fr 1fr;gap:1em}
pre{white-space:pre-wrap;word-break:break-word;margin:0.3em 0;padding:0.4em;border-radius:4px;font-size:12px}
.prompt{background:#eef}.turn{background:#efe}.obs{background:#f4f4f4}
.failed{background:#fdd}.feedback{background:#ffe9cc}.spliced{background:#cfc;outline:2px solid #3a3}
.discarded{background:#eee;color:#888;text-decoration:line-through}
.tag{font-size:11px;color:#555}
table.ev{border-collapse:collapse;font-size:12px}table.ev td,table.ev th{border:1px solid #ccc;padding:2px 6px}
"""


def _block(cls: str, tag: str, text: str) -> str:
    return f'<div class="tag">{html.escape(tag)}</div><pre class="{cls}">{html.escape(text)}</pre>'


def _raw_column(ep: Episode, decode: Decode) -> str:
    parts = [_block("prompt", "prompt (tail)", decode(list(ep.raw.prompt_ids))[-600:])]
    for seg in ep.raw.segments:
        text = decode(list(seg.token_ids))
        if seg.kind == "turn":
            cls = "discarded" if seg.splice == "discarded" else "turn"
            sim = "" if seg.similarity is None else f", similarity {seg.similarity:.3f}"
            tag = f"turn {seg.turn} attempt {seg.attempt} [{seg.splice}{sim}]"
        else:
            cls = "failed" if seg.tool_failed else "obs"
            if seg.role == "feedback":
                cls = "feedback"
            tag = f"observation of turn {seg.turn} [{seg.role}{', ' + seg.error_label if seg.error_label else ''}]"
        parts.append(_block(cls, tag, text))
    return "".join(parts)


def _purified_column(ep: Episode, decode: Decode) -> str:
    """Spliced tokens are marked per token (`Trajectory.spliced`), not per segment: a shallow
    splice keeps the turn's original reasoning, which must not show as spliced."""
    t = ep.purified
    parts = []
    for span in t.segments:
        flags = t.spliced[span.start : span.end]
        runs, k = [], span.start
        while k < span.end:  # maximal runs of equal spliced flag
            j = k
            while j < span.end and t.spliced[j] == t.spliced[k]:
                j += 1
            text = html.escape(decode(t.response_ids[k:j].tolist()))
            runs.append(f'<span class="spliced">{text}</span>' if t.spliced[k] else text)
            k = j
        cls = "turn" if span.kind == "turn" else "obs"
        tag = f"{span.kind} {span.turn}" + (f" [spliced: {span.spliced}]" if flags.any() else "")
        parts.append(f'<div class="tag">{html.escape(tag)}</div><pre class="{cls}">{"".join(runs)}</pre>')
    return "".join(parts)


def _events_table(ep: Episode) -> str:
    if not ep.events:
        return "<p class=tag>no SAAR events</p>"
    rows = "".join(
        f"<tr><td>{e.turn}</td><td>{e.attempts}</td><td>{html.escape(', '.join(e.error_labels))}</td>"
        f"<td>{', '.join('-' if s is None else f'{s:.3f}' for s in e.similarities)}</td>"
        f"<td>{html.escape(', '.join(e.decisions))}</td><td>{e.outcome}</td></tr>"
        for e in ep.events
    )
    head = "<tr><th>turn</th><th>attempts</th><th>errors</th><th>similarity</th><th>decision</th><th>outcome</th></tr>"
    return f'<table class="ev">{head}{rows}</table>'


def render_episodes(episodes: Sequence[Episode], decode: Decode, *, title: str = "trajectories",
                    rewards: Sequence[float] | None = None) -> str:
    """HTML for a list of episodes; `decode` maps token ids to text (special tokens kept)."""
    body = []
    for i, ep in enumerate(episodes):
        reward = "" if rewards is None else f", reward {rewards[i]:+.3f}"
        body.append(
            f'<div class="ep"><h3>episode {i}: {ep.termination}, {ep.num_turns} turns{reward}</h3>'
            f"{_events_table(ep)}<div class=cols><div><h4>raw</h4>{_raw_column(ep, decode)}</div>"
            f"<div><h4>purified (trained on)</h4>{_purified_column(ep, decode)}</div></div></div>"
        )
    return f"<!doctype html><meta charset=utf-8><title>{html.escape(title)}</title><style>{_CSS}</style>" \
           f"<h1>{html.escape(title)}</h1>{''.join(body)}"
