"""The trajectory viewer in a real headless browser (Debian's chromium driven by Playwright,
loopback only): a short real toy run's dumps plus a scripted step with a shallow and a deep
splice, served by `viz.serve`; the DOM is checked against the dump and against expectations
computed from the tokenizer alone, the filters against the dump's episodes, and the static
export (opened via file://) against the served list. Screenshots are saved under tmp_path.

Needs /usr/bin/chromium (`apt-get install -y chromium`; .ci/run installs it) and the dev
extra's playwright, which must not download browsers of its own."""
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from _viz_common import chromium_browser, scripted_step
from test_console import console_run
from cleaner_jax.toy.checkpoint import build_tokenizer
from cleaner_jax.viz.dumps import list_steps, read_step, token_pieces, write_step
from cleaner_jax.viz.serve import serve_in_thread

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[1]
SCRIPTED_STEP = 2  # after the toy run's step 1


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real 1-step toy run (its dumps and plots: the session's `console_run`, copied), plus a
    scripted step written by the same writer."""
    wd = tmp_path_factory.mktemp("viz_run") / "run"
    shutil.copytree(console_run(tmp_path_factory)[0], wd)
    tok = build_tokenizer(tempfile.mkdtemp(), "qwen3")
    s = scripted_step(tok)
    write_step(wd, SCRIPTED_STEP, s.scored, advantages=s.advantages, gamma=0.5, pieces=token_pieces(tok),
               decode=lambda ids: tok.decode(list(ids)))
    return wd, s


@pytest.fixture(scope="module")
def browser(run_dir):  # after run_dir: Playwright's sync API keeps an event loop running in this thread
    yield from chromium_browser()


@pytest.fixture(scope="module")
def served(run_dir):
    server, url = serve_in_thread(run_dir[0])
    assert url.startswith("http://127.0.0.1:")
    yield url
    server.shutdown()
    server.server_close()


def all_episodes(wd):
    return [d for step in list_steps(wd) for d in read_step(wd, step)]


def listed(page):
    return [(int(r.get_attribute("data-step")), int(r.get_attribute("data-index")))
            for r in page.locator("#episodes tbody tr").all()]


def open_list(browser, url):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: errors.append(f"non-local request {r.url}")
            if not r.url.startswith(("http://127.0.0.1", "file://", "data:")) else None)
    page.goto(url)
    page.wait_for_selector("body[data-ready=list]")
    return page, errors


def test_served_list_and_filters_match_the_dump(browser, served, run_dir):
    wd, _ = run_dir
    eps = all_episodes(wd)
    page, errors = open_list(browser, served)
    assert listed(page) == [(d.step, d.index) for d in eps]

    def after(select, value, keep):
        page.select_option(select, value)
        got = listed(page)
        page.select_option(select, "")
        assert got == [(d.step, d.index) for d in eps if keep(d)], (select, value)
        return got

    kinds = lambda d: set(d.episode.purified.splice_kind.tolist())  # noqa: E731
    assert after("#f-splice", "shallow", lambda d: 1 in kinds(d)) == [(2, 0), (2, 2)]
    assert after("#f-splice", "deep", lambda d: 2 in kinds(d)) == [(2, 1)]
    after("#f-splice", "none", lambda d: kinds(d) == {0})
    assert after("#f-saar", "recovered", lambda d: d.episode.events
                 and all(e.outcome == "recovered" for e in d.episode.events)) == [(2, 0), (2, 1)]
    assert after("#f-saar", "failed", lambda d: any(e.outcome != "recovered" for e in d.episode.events)) == [
        (2, 2), (2, 4)]
    after("#f-saar", "none", lambda d: not d.episode.events)
    after("#f-correct", "yes", lambda d: d.acc)
    after("#f-correct", "no", lambda d: not d.acc)
    after("#f-error", "NameError", lambda d: any("NameError" in e.error_labels for e in d.episode.events))
    page.fill("#f-reward-min", "0.5")
    assert listed(page) == [(d.step, d.index) for d in eps if d.score is not None and d.score >= 0.5]
    page.fill("#f-reward-max", "0.9")
    assert listed(page) == []
    page.fill("#f-reward-min", "")
    page.fill("#f-reward-max", "")
    assert len(listed(page)) == len(eps)
    assert errors == []


@pytest.mark.parametrize("index, kind", [(0, 1), (1, 2)], ids=["shallow", "deep"])
def test_exactly_the_spliced_tokens_are_highlighted(browser, served, run_dir, tmp_path, index, kind):
    wd, s = run_dir
    dumped = read_step(wd, SCRIPTED_STEP)[index]
    page, errors = open_list(browser, served)
    page.locator(f"#episodes tbody tr[data-step='{SCRIPTED_STEP}'][data-index='{index}']").click()
    page.wait_for_selector("body[data-ready=episode]")
    highlighted = {int(i) for i in page.eval_on_selector_all(
        "#purified .tok.sp1, #purified .tok.sp2", "els => els.map(e => e.dataset.i)")}
    splice_kind = dumped.view["purified"]["splice_kind"]
    assert highlighted == {i for i, k in enumerate(splice_kind) if k}  # the dump's per-token data
    assert highlighted == s.expected_spliced[index]  # shallow: the call tokens only; deep: the whole turn
    assert page.locator(f"#purified .tok.sp{kind}").count() == len(highlighted)
    assert page.locator("#purified .tok").count() == len(splice_kind)  # every token shown once
    # loss mask per token, and the log-probs on hover
    masks = page.eval_on_selector_all("#purified .tok", "els => els.map(e => Number(e.dataset.mask))")
    assert masks == dumped.view["purified"]["loss_mask"]
    first = sorted(highlighted)[0]
    title = page.locator(f"#purified .tok[data-i='{first}']").get_attribute("title")
    assert f"behaviour log-prob {dumped.view['purified']['behaviour_logprobs'][first]:.4f}" in title
    assert f"advantage {s.advantages[index]:.3f}" in title
    # the erased error observation is on the raw side, after the failed attempt; never on the purified side
    erased = page.locator("#raw .seg.erased")
    assert erased.count() == 1 and "NameError" in erased.inner_text()
    failed = page.locator("#raw .seg.failed").first
    assert failed.inner_text().count("failed attempt") == 1
    assert failed.locator(".tok.gone").count() == s.expected_gone[index]  # shallow: its call; deep: all of it
    assert "NameError" not in page.locator("#purified").inner_text()
    # the similarity that decided, and γ
    sim = dumped.episode.events[0].similarities[0]
    events = page.locator("#events").inner_text()
    assert f"similarity {sim:.3f}" in events and "γ 0.50" in events
    shot = tmp_path / f"viewer_{'shallow' if kind == 1 else 'deep'}.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000 and errors == []


def test_static_export_renders_the_same_list_offline(browser, served, run_dir, tmp_path):
    wd, s = run_dir
    out = tmp_path / "export.html"
    proc = subprocess.run([sys.executable, "-m", "cleaner_jax.viz.serve", "--workdir", str(wd), "--export", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    html = out.read_text()
    assert "<script src=" not in html and 'rel="stylesheet"' not in html and "http://" not in html and "https://" not in html
    page, errors = open_list(browser, served)
    served_rows = listed(page)
    served_text = page.locator("#episodes tbody").inner_text()
    offline, offline_errors = open_list(browser, out.as_uri())
    assert listed(offline) == served_rows and offline.locator("#episodes tbody").inner_text() == served_text
    offline.goto(out.as_uri() + f"#ep={SCRIPTED_STEP}:0")
    offline.wait_for_selector("#purified .tok")
    highlighted = {int(i) for i in offline.eval_on_selector_all("#purified .tok.sp1", "els => els.map(e => e.dataset.i)")}
    assert highlighted == s.expected_spliced[0]
    shot = tmp_path / "export_list.png"
    offline.goto(out.as_uri())
    offline.wait_for_selector("body[data-ready=list]")
    offline.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    assert errors == [] and offline_errors == []


def test_the_run_left_its_plots(run_dir):
    wd, _ = run_dir
    import matplotlib.image as mpimg
    names = sorted(p.name for p in (wd / "plots").glob("*.png"))
    assert names == sorted(["reward.png", "accuracy.png", "tool_error_rate.png", "saar_recovery.png",
                            "splice_share.png", "logprob_gap.png", "zero_adv_groups.png"])
    img = mpimg.imread(wd / "plots" / "reward.png")
    assert img.shape[0] > 100 and img.std() > 0.01  # drawn, not blank
