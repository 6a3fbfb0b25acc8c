// The trajectory viewer: a list of dumped episodes with filters, and one episode's raw and
// purified versions side by side, token by token. Data comes from an inlined JSON blob (the
// export) or from the server's api/ (viz/serve.py); see cleaner_jax/viz/dumps.py for the fields.
"use strict";

const SPLICE_NAMES = { 1: "shallow", 2: "deep" };
const REPLACED = {  // what the retry did to a failed attempt (struck-through tokens are not trained on)
  shallow: "its call is replaced by the retry's", deep: "replaced whole by the retry",
  kept_raw: "kept, the retry follows it with the error in view", discarded: "kept, the retry was dropped at the turn cap",
};
const inlined = document.getElementById("dump-data");
const EXPORT = inlined ? JSON.parse(inlined.textContent) : null;
const stepCache = {};

// GET a JSON route of viz/serve.py; an error answer's {"error": ...} (which names the file or
// step) becomes the thrown message, and a server that does not answer at all is said to be gone
async function getJSON(url) {
  let r;
  try {
    r = await fetch(url);
  } catch (err) {
    throw new Error(`${url}: no answer from the server (${err.message}); is viz.serve still running? Restart it and reload.`);
  }
  if (!r.ok) {
    let msg = `HTTP ${r.status} ${r.statusText}`;
    try { const body = await r.json(); if (body && body.error) msg = body.error; } catch (_) { /* not JSON */ }
    throw new Error(`${url}: ${msg}`);
  }
  return r.json();
}

async function loadIndex() {
  if (EXPORT) return EXPORT.index;
  return getJSON("api/index.json");
}

async function loadStep(step) {
  if (EXPORT) {
    const eps = EXPORT.steps[String(step)];
    if (eps === undefined) {
      const bad = (EXPORT.index.bad_files || []).find(b => b.step === step);
      throw new Error(bad ? `step ${step} is not in this export: ${bad.file}: ${bad.error}`
                          : `no such step: this export holds steps ${EXPORT.index.steps.join(", ") || "(none)"}`);
    }
    return eps;
  }
  if (!stepCache[step]) stepCache[step] = await getJSON(`api/step/${step}.json`);
  return stepCache[step];
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

const fmt = (x, d = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));

// ---- policy versions: run-length encoded, [[version, count], ...] (viz/dumps.py); -1 is unknown
// (no policy sampled the token, or its weights are not known). A dump written before versions
// were kept has none: every token of it is unknown.

function expandRuns(runs, n) {
  if (runs === null || runs === undefined) return new Array(n).fill(-1);
  const out = [];
  for (const [v, c] of runs) for (let j = 0; j < c; j++) out.push(v);
  if (out.length !== n) throw new Error(`policy versions cover ${out.length} tokens, the segment has ${n}`);
  return out;
}

const versionText = v => (v < 0 ? "unknown" : String(v));

// a token whose version differs from the one before it in the same turn gets a visible marker
function versionAttrs(versions, i, first) {
  const attrs = { "data-version": versions[i] };
  if (i > first && versions[i] !== versions[i - 1]) {
    attrs["data-vlabel"] = `v${versions[i] < 0 ? "?" : versions[i]}`;
    attrs["data-vprev"] = versions[i - 1];
  }
  return attrs;
}

function versionTitle(attrs) {
  const v = attrs["data-version"];
  return `\npolicy version ${versionText(v)}` +
         ("data-vprev" in attrs ? ` (changes here from ${versionText(attrs["data-vprev"])})` : "");
}

// "policy version 4" / "policy versions 4 → 5" for a turn's label; "" when every token's is unknown
function versionLabel(versions) {
  const seen = versions.filter((v, i) => i === 0 || v !== versions[i - 1]);
  if (seen.every(v => v < 0)) return "";
  return seen.length === 1 ? `, policy version ${versionText(seen[0])}`
                           : `, policy versions ${seen.map(versionText).join(" → ")}`;
}

// ---- list page

function saarLabel(row) { return row.saar_outcome; }
function spliceLabel(row) { return row.splice_kinds.length ? row.splice_kinds.join(", ") : "none"; }

function readFilters() {
  const v = id => document.getElementById(id).value;
  return { step: v("f-step"), rmin: v("f-reward-min"), rmax: v("f-reward-max"), correct: v("f-correct"),
           saar: v("f-saar"), splice: v("f-splice"), error: v("f-error") };
}

function keep(row, f) {
  if (f.step !== "" && String(row.step) !== f.step) return false;
  if (f.rmin !== "" && !(row.score !== null && row.score >= Number(f.rmin))) return false;
  if (f.rmax !== "" && !(row.score !== null && row.score <= Number(f.rmax))) return false;
  if (f.correct === "yes" && !row.acc) return false;
  if (f.correct === "no" && row.acc) return false;
  if (f.saar !== "" && row.saar_outcome !== f.saar) return false;
  if (f.splice === "none" && row.splice_kinds.length) return false;
  if (f.splice !== "" && f.splice !== "none" && !row.splice_kinds.includes(f.splice)) return false;
  if (f.error === "none" && row.error_types.length) return false;
  if (f.error !== "" && f.error !== "none" && !row.error_types.includes(f.error)) return false;
  return true;
}

function renderList(index) {
  const f = readFilters();
  const rows = index.rows.filter(r => keep(r, f));
  const body = document.querySelector("#episodes tbody");
  body.replaceChildren(...rows.map(r => {
    const tr = el("tr", { "data-step": r.step, "data-index": r.index },
      el("td", { text: r.step }), el("td", { text: r.index }), el("td", { text: r.uid }),
      el("td", { text: r.error ? "invalid" : fmt(r.score) }), el("td", { text: r.acc ? "yes" : "no" }),
      el("td", { text: fmt(r.advantage) }), el("td", { text: saarLabel(r) }), el("td", { text: spliceLabel(r) }),
      el("td", { text: r.error ? r.error : r.error_types.join(", ") }), el("td", { text: r.termination || "–" }),
      el("td", { text: r.tokens }));
    tr.addEventListener("click", () => { location.hash = `#ep=${r.step}:${r.index}`; });
    return tr;
  }));
  document.getElementById("count").textContent = `${rows.length} of ${index.rows.length} trajectories`;
}

// what the list page says when there is nothing to list, and which dump files could not be read
function emptyHint(index) {
  const dir = `${index.workdir}/trajectories/`;
  if (index.rows.length) return null;
  if ((index.bad_files || []).length || index.legacy_steps.length)
    return `No episode to show: every dump under ${dir} is unreadable or old-format (listed above).`;
  return `No trajectory dumps under ${dir} yet. A training run writes one file per step there ` +
         `(step_XXXXXX.jsonl.gz) while train.dump_trajectories is True, the default ` +
         `(--config.train.dump_trajectories=True); a run that has not finished its first step has none yet: reload later.`;
}

function showProblems(index) {
  const bad = index.bad_files || [];
  const box = document.getElementById("bad-files");
  box.hidden = !bad.length;
  if (bad.length)
    box.replaceChildren(el("p", { text: (bad.length > 1 ? `${bad.length} dump files could not be read and are`
                                                         : "1 dump file could not be read and is") +
                                        " not shown (the other steps are):" }),
                        el("ul", {}, ...bad.map(b => el("li", { "data-step": b.step, text: `step ${b.step}: ${b.file}: ${b.error}` }))));
  const hint = emptyHint(index);
  const empty = document.getElementById("empty");
  empty.hidden = hint === null;
  empty.textContent = hint || "";
}

function setupFilters(index) {
  const stepSel = document.getElementById("f-step");
  for (const s of index.steps) stepSel.append(el("option", { value: s, text: s }));
  const errSel = document.getElementById("f-error");
  const labels = [...new Set(index.rows.flatMap(r => r.error_types))].sort();
  for (const l of labels) errSel.append(el("option", { value: l, text: l }));
  for (const e of document.querySelectorAll("#filters select, #filters input"))
    e.addEventListener("input", () => renderList(index));
  if (index.legacy_steps.length) {
    const p = document.getElementById("legacy");
    p.hidden = false;
    p.textContent = `steps ${index.legacy_steps.join(", ")} are old-format dumps (no decoded text) and are not shown`;
  }
}

// ---- episode page

function advColour(adv) {
  if (!adv) return "#e6e6e6";
  const light = 92 - 24 * Math.min(1, Math.abs(adv));
  return `hsl(${adv > 0 ? 120 : 0}, 60%, ${light}%)`;
}

function token(piece, cls, title, attrs = {}) {
  return el("span", { class: `tok ${cls}` + ("data-vlabel" in attrs ? " vchange" : ""), title, ...attrs, text: piece });
}

function segBlock(cls, label, ...content) {
  return el("div", { class: `seg ${cls}` }, el("div", { class: "label", text: label }),
            el("div", { class: "text" }, ...content));
}

function decision(sim, gamma, splice) {
  return sim === null ? splice : `similarity ${fmt(sim)} ${sim < gamma ? "<" : "≥"} γ ${fmt(gamma, 2)} → ${splice}`;
}

function rawColumn(ep) {
  const v = ep.view;
  const out = [el("details", { class: "seg prompt" }, el("summary", { text: "prompt" }),
                  el("div", { class: "text", text: v.prompt_text }))];
  for (const s of v.raw) {
    let label, cls;
    const versions = expandRuns(s.versions, s.pieces.length);
    if (s.kind === "turn") {
      cls = s.failed_attempt ? "failed" : "turn";
      label = `turn ${s.turn}, attempt ${s.attempt}` + versionLabel(versions);
      if (s.attempt > 0) label += `: regeneration, ${decision(s.similarity, ep.gamma, s.splice)}`;
      if (s.splice === "shallow") label += " (only its call is spliced in; its reasoning is dropped)";
      if (s.failed_attempt) label += " — failed attempt; " + (REPLACED[s.replaced_by] || s.replaced_by);
    } else {
      cls = s.tool_failed ? "failed obs" : "obs";
      label = `observation of turn ${s.turn} (${s.role}${s.error_label ? ", " + s.error_label : ""})`;
      if (s.role === "feedback") label += " — error shown for the retry";
    }
    if (s.erased) { cls += " erased"; label += " — erased from the purified trajectory"; }
    // the raw tokens a splice carried over: the call of a shallow regeneration, all of a deep one
    const from = s.splice === "shallow" ? s.call_start : (s.splice === "deep" ? 0 : null);
    const toks = s.pieces.map((p, i) => {
      // a shallow splice keeps the failed attempt's reasoning: the retry's own, before its call, is dropped
      const dropped = s.splice === "shallow" && s.call_start !== null && i < s.call_start;
      const replaced = s.replaced_from !== null && i >= s.replaced_from;
      const sp = (from !== null && i >= from ? (s.splice === "deep" ? " sp2" : " sp1") : "") +
                 (dropped || replaced ? " gone" : "");
      const lp = s.logprobs ? `behaviour log-prob ${fmt(s.logprobs[i], 4)}` : "no log-prob (not sampled)";
      const why = dropped ? "\nnot trained: the shallow splice keeps the failed attempt's reasoning, not this retry's"
                : replaced ? "\nnot trained: replaced by the retry" : "";
      if (s.kind !== "turn") return token(p, "m0" + sp, `raw #${i}: ${JSON.stringify(p)}\n${lp}${why}`);
      const va = versionAttrs(versions, i, 0);
      return token(p, "m1" + sp, `raw #${i}: ${JSON.stringify(p)}\n${lp}${versionTitle(va)}${why}`, va);
    });
    out.push(segBlock(cls, label, ...toks));
  }
  return out;
}

function purifiedColumn(ep) {
  const t = ep.view.purified;
  const versions = expandRuns(t.policy_version, t.ids.length);
  const out = [];
  for (const span of t.segments) {
    const toks = [];
    for (let i = span.start; i < span.end; i++) {
      const m = t.loss_mask[i], k = t.splice_kind[i];
      const va = m ? versionAttrs(versions, i, span.start) : {};
      const cls = `m${m}` + (k ? ` sp${k}` : "");
      const gap = t.behaviour_logprobs[i] - t.rollout_logprobs[i];
      const title = `#${i}: ${JSON.stringify(t.pieces[i])}\nloss mask ${m}` +
        (m ? `, advantage ${fmt(ep.advantage)}` : "") + (k ? `\nspliced (${SPLICE_NAMES[k]})` : "") +
        (m ? versionTitle(va) : "") +
        (m ? `\nbehaviour log-prob ${fmt(t.behaviour_logprobs[i], 4)}\nrollout log-prob ${fmt(t.rollout_logprobs[i], 4)}` +
             `\nbehaviour − rollout ${fmt(gap, 4)}` +
             (t.old_logprobs ? `\nlearner (old) log-prob ${fmt(t.old_logprobs[i], 4)}` +
                               `\nbehaviour − learner ${fmt(t.behaviour_logprobs[i] - t.old_logprobs[i], 4)}` : "") : "");
      const tok = token(t.pieces[i], cls, title, { "data-i": i, "data-splice": k, "data-mask": m, ...va });
      if (m) tok.style.setProperty("--bg", advColour(ep.advantage));
      toks.push(tok);
    }
    const label = span.kind === "turn" ? `turn ${span.turn}` + (span.spliced !== "none" ? ` (spliced: ${span.spliced})` : "") +
                                         versionLabel(versions.slice(span.start, span.end))
                                       : `observation of turn ${span.turn} (${span.role})`;
    out.push(segBlock(span.kind === "turn" ? "turn" : "obs", label, ...toks));
  }
  if (t.truncated) out.push(el("p", { text: "(truncated to the response budget)" }));
  return out;
}

function eventsTable(ep) {
  const ev = ep.view.events;
  if (!ev.length) return [el("caption", { text: "no SAAR events" })];
  const head = el("tr", {}, ...["turn", "attempts", "errors", "similarity vs γ → decision", "outcome",
                                "tokens removed / inserted"].map(h => el("th", { text: h })));
  const rows = ev.map(e => el("tr", {},
    el("td", { text: e.turn }), el("td", { text: e.attempts }), el("td", { text: e.error_labels.join(", ") }),
    el("td", { text: e.decisions.map((d, j) => decision(e.similarities[j], ep.gamma, d)).join("; ") }),
    el("td", { text: e.outcome }), el("td", { text: `${e.tokens_removed} / ${e.tokens_inserted}` })));
  return [el("caption", { text: `SAAR events (γ = ${fmt(ep.gamma, 2)})` }), head, ...rows];
}

async function showEpisode(step, index) {
  const eps = await loadStep(step);
  const ep = eps.find(e => e.index === index);
  if (ep === undefined)
    throw new Error(`no such episode: step ${step} has episodes ${eps.length ? `0 to ${eps.length - 1}` : "(none)"}`);
  document.getElementById("ep-title").textContent = `step ${step}, episode ${index}: ${ep.uid}`;
  document.getElementById("ep-meta").textContent =
    `reward ${ep.error ? "invalid (" + ep.error + ")" : fmt(ep.score)} · correct ${ep.acc ? "yes" : "no"} · ` +
    `advantage ${fmt(ep.advantage)} · ${ep.reward_detail || ""} · end: ${ep.termination || "–"} · SAAR ${ep.saar_outcome}`;
  const raw = document.getElementById("raw"), pur = document.getElementById("purified");
  if (!ep.view) {
    raw.replaceChildren(el("p", { text: "no record: the rollout failed" }));
    pur.replaceChildren();
    document.getElementById("events").replaceChildren();
    return;
  }
  document.getElementById("events").replaceChildren(...eventsTable(ep));
  raw.replaceChildren(...rawColumn(ep));
  pur.replaceChildren(...purifiedColumn(ep));
}

// ---- routing: "#ep=STEP:INDEX" shows an episode, anything else the list

function clearEpisode(title, message) {
  document.getElementById("ep-title").textContent = title;
  document.getElementById("ep-meta").textContent = "";
  for (const id of ["raw", "purified", "events"]) document.getElementById(id).replaceChildren();
  const e = document.getElementById("ep-error");
  e.hidden = message === null;
  e.textContent = message || "";
}

async function route(index) {
  const wantsEpisode = location.hash.startsWith("#ep=");
  const m = location.hash.match(/^#ep=(\d+):(\d+)$/);
  document.getElementById("list-page").hidden = wantsEpisode;
  document.getElementById("episode-page").hidden = !wantsEpisode;
  if (!wantsEpisode) {
    document.body.dataset.ready = "list";
    return;
  }
  clearEpisode("", null);
  try {
    if (!m) throw new Error(`no such episode: ${JSON.stringify(location.hash)} is not #ep=STEP:INDEX (e.g. #ep=3:0)`);
    await showEpisode(Number(m[1]), Number(m[2]));
    document.body.dataset.ready = "episode";
  } catch (err) {  // shown on the page, never an uncaught error: the list is one click away
    clearEpisode(m ? `step ${m[1]}, episode ${m[2]}` : location.hash, err.message);
    document.body.dataset.ready = "episode-error";
  }
}

async function main() {
  const index = await loadIndex();
  document.getElementById("workdir").textContent = index.workdir;
  setupFilters(index);
  showProblems(index);
  renderList(index);
  const colour = document.getElementById("colour");
  const applyColour = () => {
    for (const id of ["raw", "purified"]) document.getElementById(id).classList.toggle("colour", colour.checked);
  };
  colour.addEventListener("change", applyColour);
  applyColour();
  window.addEventListener("hashchange", () => route(index));
  await route(index);
}

main().catch(err => {
  document.body.dataset.ready = "error";
  document.querySelector("main").prepend(el("pre", { class: "error", text: String(err) }));
});
