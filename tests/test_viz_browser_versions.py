"""Policy versions in the viewer, in a real headless browser (Debian's chromium, Playwright, the
export opened via file://): each policy token's tooltip gives its version, a marker stands where
the version changes inside a turn, the turn labels list the versions; a dump written before
versions were kept shows them as unknown, without markers. Episodes of `_versions_common`
(hand-built, no sandbox); needs what tests/test_viz_browser.py needs."""
import gzip
import json

import pytest

from _versions_common import decode, pieces, versioned_step
from _viz_common import chromium_browser
from cleaner_jax.viz.dumps import write_step
from cleaner_jax.viz.viewer import export_html

pytestmark = pytest.mark.browser
NEW, OLD = 1, 2  # the step written with versions, and the same step as an old dump without them


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    run = tmp_path_factory.mktemp("viz_versions") / "run"
    scored = versioned_step()
    write_step(run, NEW, scored, advantages=[0.5, 0.5], gamma=0.5, pieces=pieces, decode=decode)
    old = write_step(run, OLD, scored, advantages=[0.5, 0.5], gamma=0.5, pieces=pieces, decode=decode)
    with gzip.open(old, "rt", encoding="utf-8") as f:
        lines = [json.loads(x) for x in f]
    for line in lines:  # as written before versions were kept
        for s in line["segments"] + line["view"]["raw"]:
            del s["versions"]
        del line["view"]["purified"]["policy_version"]
    with gzip.open(old, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    return export_html(run, run.parent / "export.html")


@pytest.fixture(scope="module")
def browser(export):
    yield from chromium_browser()


def open_episode(browser, export, step, index):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(export.as_uri() + f"#ep={step}:{index}")
    page.wait_for_selector("body[data-ready=episode]")
    return page, errors


MARKERS = "els => els.map(e => [e.dataset.i, e.dataset.vlabel, getComputedStyle(e, '::before').content, " \
          "getComputedStyle(e).borderLeftColor, e.title])"


def test_version_changes_inside_a_turn_are_marked_and_every_token_says_its_version(browser, export):
    """Episode 0's purified response: 10 11 | 480 21 22 2 (versions 4 4 | 5 5 5 5: the shallow
    splice's call from the retry), 103 104 (observation), 40 41 2 (versions 5 5 6). The
    version changes inside a turn at tokens 2 (4 -> 5) and 10 (5 -> 6); token 8 starts a turn,
    so its 5 after the observation is no change inside a turn."""
    page, errors = open_episode(browser, export, NEW, 0)
    marked = page.eval_on_selector_all("#purified .tok.vchange", MARKERS)
    assert [(i, label, content) for i, label, content, _, _ in marked] == [("2", "v5", '"v5"'), ("10", "v6", '"v6"')]
    assert all(colour == "rgb(224, 112, 0)" for _, _, _, colour, _ in marked)  # the orange bar
    assert "policy version 5 (changes here from 4)" in marked[0][4]
    titles = page.eval_on_selector_all("#purified .tok", "els => els.map(e => e.title)")
    assert ["policy version 4" in t for t in titles[:2]] == [True, True]
    assert "policy version 6" in titles[10] and "policy version" not in titles[6]  # observations have none
    labels = page.locator("#purified .seg .label").all_inner_texts()
    assert labels[0].endswith("policy versions 4 → 5") and labels[2].endswith("policy versions 5 → 6")
    raw = page.locator("#raw > div.seg:not(.obs)")  # the turns: the failed attempt, its retry, the answer
    raw_labels = raw.locator(".label").all_inner_texts()
    assert "attempt 0, policy version 4" in raw_labels[0] and "attempt 1, policy version 5" in raw_labels[1]
    assert "policy versions 5 → 6" in raw_labels[2]
    # raw side: one change inside a turn, the answer's third token
    assert raw.nth(2).locator(".tok.vchange").evaluate_all("els => els.map(e => e.dataset.vlabel)") == ["v6"]
    assert page.locator("#raw .tok.vchange").count() == 1 and errors == []


@pytest.mark.parametrize("step, index", [(NEW, 1), (OLD, 0), (OLD, 1)], ids=["no-versions", "old-0", "old-1"])
def test_unknown_versions_show_as_unknown_without_markers(browser, export, step, index):
    page, errors = open_episode(browser, export, step, index)
    assert page.locator(".tok.vchange").count() == 1  # the legend's sample only
    titles = page.eval_on_selector_all("#purified .tok.m1", "els => els.map(e => e.title)")
    assert titles and all("policy version unknown" in t for t in titles)
    assert not any("policy version" in x for x in page.locator("#purified .label, #raw .label").all_inner_texts())
    assert errors == []
