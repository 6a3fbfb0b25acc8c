"""The viewer's pages in a real headless browser (Debian's chromium, Playwright, loopback only),
on dumps written by the writer from the scripted episodes of `_viz_common` (no training run):
an unreadable dump next to a good one, links to episodes that are not there, an empty
`trajectories/`, the advantage colour under a splice, and a shallow retry's dropped reasoning.
Needs what tests/test_viz_browser.py needs (/usr/bin/chromium, the dev extra's playwright)."""
import colorsys
import re
import tempfile
from pathlib import Path

import pytest

from _viz_common import chromium_browser, scripted_step
from cleaner_jax.toy.checkpoint import build_tokenizer
from cleaner_jax.viz.dumps import dump_path, read_step, token_pieces, write_step
from cleaner_jax.viz.serve import serve_in_thread
from cleaner_jax.viz.viewer import export_html

pytestmark = pytest.mark.browser
GOOD, BAD = 2, 3


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """`run`: step 2 scripted, step 3 the same file truncated (a trainer killed mid-write);
    `empty`: a run directory whose trajectories/ has no dump yet. Built before the browser starts
    (Playwright's sync API keeps an event loop running in this thread)."""
    root = tmp_path_factory.mktemp("viz_pages")
    tok = build_tokenizer(tempfile.mkdtemp(), "qwen3")
    s = scripted_step(tok)
    run = root / "run"
    good = write_step(run, GOOD, s.scored, advantages=s.advantages, gamma=0.5, pieces=token_pieces(tok),
                      decode=lambda ids: tok.decode(list(ids))).read_bytes()
    dump_path(run, BAD).write_bytes(good[: len(good) // 2])
    (root / "empty" / "trajectories").mkdir(parents=True)
    export = export_html(run, root / "export.html")
    return {"run": run, "empty": root / "empty", "export": export, "tok": tok, "scripted": s}


@pytest.fixture(scope="module")
def browser(dumps):
    yield from chromium_browser()


@pytest.fixture(scope="module")
def served(dumps):
    urls, servers = {}, []
    for name in ("run", "empty"):
        server, urls[name] = serve_in_thread(dumps[name])
        servers.append(server)
    yield urls
    for server in servers:
        server.shutdown()
        server.server_close()


def open_page(browser, url, ready):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))  # an uncaught JS error (the old TypeError)
    page.on("request", lambda r: errors.append(f"non-local request {r.url}")
            if not r.url.startswith(("http://127.0.0.1", "file://", "data:")) else None)
    page.goto(url)
    page.wait_for_selector(f"body[data-ready={ready}]")
    return page, errors


def listed(page):
    return [(int(r.get_attribute("data-step")), int(r.get_attribute("data-index")))
            for r in page.locator("#episodes tbody tr").all()]


@pytest.mark.parametrize("where", ["served", "export"])
def test_a_truncated_dump_is_named_and_the_good_step_is_listed(browser, served, dumps, where):
    url = served["run"] if where == "served" else dumps["export"].as_uri()
    page, errors = open_page(browser, url, "list")
    n = len(dumps["scripted"].scored)
    assert listed(page) == [(GOOD, i) for i in range(n)]
    assert page.locator("#count").inner_text() == f"{n} of {n} trajectories"
    bad = page.locator("#bad-files li")
    assert bad.count() == 1 and bad.get_attribute("data-step") == str(BAD)
    text = bad.inner_text()
    assert text.startswith(f"step {BAD}: {dump_path(dumps['run'], BAD)}: unreadable dump (") and "EOFError" in text
    assert page.locator("#empty").is_hidden() and errors == []


@pytest.mark.parametrize("where", ["served", "export"])
def test_a_link_to_a_missing_episode_says_so(browser, served, dumps, where):
    url = served["run"] if where == "served" else dumps["export"].as_uri()
    n = len(dumps["scripted"].scored)
    bad_file = str(dump_path(dumps["run"], BAD))
    no_step = ("no dump of step 9 under" if where == "served" else f"no such step: this export holds steps {GOOD}")
    for frag, expected in ((f"#ep={GOOD}:99", f"no such episode: step {GOOD} has episodes 0 to {n - 1}"),
                           ("#ep=9:0", no_step),
                           (f"#ep={BAD}:0", bad_file),
                           ("#ep=oops", 'no such episode: "#ep=oops" is not #ep=STEP:INDEX')):
        page, errors = open_page(browser, url + frag, "episode-error")
        message = page.locator("#ep-error").inner_text()
        assert expected in message, (frag, message)
        assert page.locator("#raw .seg, #purified .seg").count() == 0 and errors == [], frag
    # the page recovers: back to the list, then to an episode that is there
    page.goto(url + f"#ep={GOOD}:0")
    page.wait_for_selector("body[data-ready=episode]")
    assert page.locator("#ep-error").is_hidden() and page.locator("#purified .tok").count() > 0


def test_an_empty_trajectories_dir_says_where_dumps_come_from(browser, served, dumps):
    page, errors = open_page(browser, served["empty"], "list")
    assert page.locator("#count").inner_text() == "0 of 0 trajectories"
    hint = page.locator("#empty").inner_text()
    assert f"No trajectory dumps under {dumps['empty'].resolve()}/trajectories/ yet" in hint
    assert "train.dump_trajectories" in hint and "step_XXXXXX.jsonl.gz" in hint and errors == []


def rgb(css):
    return [float(x) for x in re.findall(r"[\d.]+", css)[:3]]


@pytest.mark.parametrize("index, kind, shadow", [(0, 1, "rgb(31, 111, 209)"), (1, 2, "rgb(138, 43, 226)")],
                         ids=["shallow", "deep"])
def test_a_spliced_token_keeps_its_advantage_colour(browser, served, dumps, index, kind, shadow):
    s = dumps["scripted"]
    adv = s.advantages[index]  # 0.7 (green), -0.7 (red): hsl(120 or 0, 60 %, 92 − 24·0.7 = 75.2 %)
    expected = [255 * c for c in colorsys.hls_to_rgb(1 / 3 if adv > 0 else 0.0, (92 - 24 * abs(adv)) / 100, 0.6)]
    page, errors = open_page(browser, served["run"] + f"#ep={GOOD}:{index}", "episode")
    style = "els => els.map(e => [getComputedStyle(e).backgroundColor, getComputedStyle(e).boxShadow])"
    spliced = page.eval_on_selector_all(f"#purified .tok.sp{kind}", style)
    plain = page.eval_on_selector_all("#purified .tok.m1:not(.sp1):not(.sp2)", style)
    assert len(spliced) == len(s.expected_spliced[index]) and plain
    for bg, box in spliced:
        assert rgb(bg) == pytest.approx(expected, abs=0.6), bg  # the advantage colour, not a splice colour
        assert shadow in box, box  # the splice is the underline
    for bg, box in plain:
        assert rgb(bg) == pytest.approx(expected, abs=0.6) and box == "none"
    assert errors == []


def test_a_shallow_retrys_own_reasoning_is_struck_through(browser, served, dumps):
    """Episode 0: FAIL_1 = "Let me compute. <call print(bad)>", the retry FIX = "Fixed it. <call
    print(1+2)>"; the shallow splice keeps "Let me compute. " and FIX's call, so the retry's
    "Fixed it. " is not trained on and must be struck through, and nothing else of the retry."""
    view = read_step(dumps["run"], GOOD)[0].view
    k = next(k for k, seg in enumerate(view["raw"]) if seg["kind"] == "turn" and seg["splice"] == "shallow")
    page, errors = open_page(browser, served["run"] + f"#ep={GOOD}:0", "episode")
    retry = page.locator("#raw > .seg").nth(k + 1)  # after the prompt
    assert "attempt 1" in retry.locator(".label").inner_text()
    gone = retry.locator(".tok.gone").all_inner_texts()
    assert "".join(gone) == "Fixed it. "
    assert len(gone) == len(dumps["tok"].encode("Fixed it. ", add_special_tokens=False))
    assert retry.locator(".tok.sp1.gone").count() == 0  # the spliced-in call is not struck through
    assert "Fixed it." not in page.locator("#purified").inner_text() and errors == []
