"""The viewer's server (loopback, JSON API, static files) and its export, without a browser."""
import json
import re
import tempfile
import urllib.error
import urllib.request

import pytest

from _viz_common import scripted_step
from cleaner_jax.toy.checkpoint import build_tokenizer
from cleaner_jax.viz.dumps import token_pieces, write_step
from cleaner_jax.viz.episode_io import write_scored_episodes
from cleaner_jax.viz.serve import main, serve_in_thread
from cleaner_jax.viz.viewer import page


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    wd = tmp_path_factory.mktemp("serve")
    tok = build_tokenizer(tempfile.mkdtemp(), "qwen3")
    s = scripted_step(tok)
    write_step(wd, 7, s.scored, advantages=s.advantages, gamma=0.5, pieces=token_pieces(tok),
               decode=lambda ids: tok.decode(list(ids)))
    write_scored_episodes(wd / "trajectories" / "step_000003.jsonl", s.scored)  # an old-format step
    return wd, s


def get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.headers["Content-Type"], r.read()


def test_api_and_static_files(workdir):
    wd, s = workdir
    server, url = serve_in_thread(wd)
    try:
        assert server.server_address[0] == "127.0.0.1"  # loopback unless told otherwise
        _, ctype, body = get(url + "api/index.json")
        index = json.loads(body)
        assert ctype == "application/json" and index["steps"] == [7] and index["legacy_steps"] == [3]
        assert [(r["step"], r["index"], r["uid"]) for r in index["rows"]] == [(7, i, x.uid) for i, x in enumerate(s.scored)]
        assert [r["tokens"] for r in index["rows"]] == [len(x.episode.purified.response_ids) for x in s.scored]
        step = json.loads(get(url + "api/step/7.json")[2])
        assert step[1]["view"]["purified"]["splice_kind"] == s.scored[1].episode.purified.splice_kind.tolist()
        assert "prompt_ids" not in step[0]  # the browser gets the view, not the raw record
        html = get(url)[2].decode()
        assert '<script src="app.js">' in html and 'href="style.css"' in html
        assert get(url + "app.js")[1].startswith("text/javascript")
        for missing, why in (("api/step/8.json", "no dump of step 8"), ("api/step/3.json", "old-format dump"),
                             ("etc/passwd", "no such page")):
            with pytest.raises(urllib.error.HTTPError) as err:
                get(url + missing)
            assert err.value.code == 404 and why in err.value.read().decode()
    finally:
        server.shutdown()
        server.server_close()


def test_export_inlines_everything(workdir, tmp_path, capsys):
    wd, s = workdir
    out = tmp_path / "x.html"
    main(["--workdir", str(wd), "--export", str(out)])
    assert str(out) in capsys.readouterr().out
    html = out.read_text()
    blob = re.search(r'<script type="application/json" id="dump-data">(.*?)</script>', html, re.S).group(1)
    data = json.loads(blob)
    assert sorted(data["steps"]) == ["7"] and len(data["steps"]["7"]) == len(s.scored)
    assert "<script src=" not in html and 'rel="stylesheet"' not in html and "https://" not in html


def test_inlined_data_cannot_close_its_script_tag():
    html = page({"index": {"text": "a</script><script>alert(1)</script>"}, "steps": {}})
    blob = re.search(r'<script type="application/json" id="dump-data">(.*?)</script>', html, re.S).group(1)
    assert json.loads(blob)["index"]["text"] == "a</script><script>alert(1)</script>"


def test_a_directory_without_dumps_is_named(tmp_path):
    with pytest.raises(SystemExit, match="trajectories does not exist"):
        main(["--workdir", str(tmp_path)])
