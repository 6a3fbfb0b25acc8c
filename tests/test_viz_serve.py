"""The viewer's server (loopback, JSON API, static files) and its export, without a browser."""
import gzip
import json
import re
import shutil
import tempfile
import urllib.error
import urllib.request

import pytest

from _viz_common import scripted_step
from cleaner_jax.toy.checkpoint import build_tokenizer
from cleaner_jax.viz.dumps import DumpReadError, dump_path, read_lines, token_pieces, write_step
from cleaner_jax.viz.episode_io import write_scored_episodes
from cleaner_jax.viz.serve import main, serve_in_thread
from cleaner_jax.viz.viewer import page, parse_steps


@pytest.fixture(scope="module")
def scripted():
    tok = build_tokenizer(tempfile.mkdtemp(), "qwen3")
    return tok, scripted_step(tok)


def write(wd, step, tok, s):
    return write_step(wd, step, s.scored, advantages=s.advantages, gamma=0.5, pieces=token_pieces(tok),
                      decode=lambda ids: tok.decode(list(ids)))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, scripted):
    wd = tmp_path_factory.mktemp("serve")
    tok, s = scripted
    write(wd, 7, tok, s)
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


def exported(path):
    html = path.read_text()
    return json.loads(re.search(r'<script type="application/json" id="dump-data">(.*?)</script>', html, re.S).group(1))


@pytest.fixture(scope="module")
def broken(tmp_path_factory, scripted):
    """A good step 7, a truncated gzip at step 8 (a trainer killed mid-write), a file that is not
    gzip at step 9 and a gzip of something other than JSON lines at step 10."""
    wd = tmp_path_factory.mktemp("broken")
    tok, s = scripted
    good = write(wd, 7, tok, s).read_bytes()
    dump_path(wd, 8).write_bytes(good[: len(good) // 2])
    dump_path(wd, 9).write_bytes(b"not gzip at all\n")
    dump_path(wd, 10).write_bytes(gzip.compress(b'{"format": 2, "step": 10}\n{"format": 2, "ste'))
    return wd, s


def test_an_unreadable_dump_names_its_file(broken):
    wd, _ = broken
    for step, problem in ((8, "EOFError: Compressed file ended before the end-of-stream marker was reached"),
                          (9, "BadGzipFile: Not a gzipped file (b'no')"),
                          (10, "line 2: JSONDecodeError")):
        with pytest.raises(DumpReadError) as err:
            read_lines(wd, step)
        assert err.value.path == dump_path(wd, step) and problem in err.value.problem, err.value.problem
        assert str(err.value).startswith(f"{dump_path(wd, step)}: unreadable dump (") and "delete it" in str(err.value)


def test_the_index_lists_the_good_steps_and_names_the_bad_files(broken):
    wd, s = broken
    server, url = serve_in_thread(wd)
    try:
        index = json.loads(get(url + "api/index.json")[2])
        assert index["steps"] == [7] and index["legacy_steps"] == []
        assert [(r["step"], r["index"]) for r in index["rows"]] == [(7, i) for i in range(len(s.scored))]
        assert [(b["step"], b["file"]) for b in index["bad_files"]] == [(n, str(dump_path(wd, n))) for n in (8, 9, 10)]
        assert "EOFError" in index["bad_files"][0]["error"] and "BadGzipFile" in index["bad_files"][1]["error"]
        assert len(json.loads(get(url + "api/step/7.json")[2])) == len(s.scored)  # the good step still opens
        for step, problem in ((8, "EOFError"), (9, "BadGzipFile"), (10, "JSONDecodeError")):
            with pytest.raises(urllib.error.HTTPError) as err:
                get(url + f"api/step/{step}.json")
            body = json.loads(err.value.read())
            assert err.value.code == 500 and err.value.headers["Content-Type"] == "application/json"
            assert body["file"] == str(dump_path(wd, step)) and body["error"].startswith(str(dump_path(wd, step)))
            assert problem in body["error"]
    finally:
        server.shutdown()
        server.server_close()


def test_any_server_error_is_answered_as_json(workdir, monkeypatch):
    import cleaner_jax.viz.serve as serve

    def boom(_):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(serve, "viewer_index", boom)
    server, url = serve_in_thread(workdir[0])
    try:
        with pytest.raises(urllib.error.HTTPError) as err:  # not a dropped connection (the page's "Failed to fetch")
            get(url + "api/index.json")
        assert err.value.code == 500
        assert json.loads(err.value.read())["error"] == "/api/index.json: RuntimeError: disk on fire"
    finally:
        server.shutdown()
        server.server_close()


def test_the_export_leaves_out_a_bad_file_and_names_it(broken, tmp_path, capsys):
    wd, s = broken
    out = tmp_path / "x.html"
    main(["--workdir", str(wd), "--export", str(out)])
    printed = capsys.readouterr()
    assert f"wrote {out}: 1 steps, {len(s.scored)} episodes" in printed.out and "3 unreadable dumps left out" in printed.out
    for step in (8, 9, 10):
        assert f"warning: step {step} left out of the export: {dump_path(wd, step)}: unreadable dump" in printed.err
    data = exported(out)
    assert sorted(data["steps"]) == ["7"]
    assert [b["file"] for b in data["index"]["bad_files"]] == [str(dump_path(wd, n)) for n in (8, 9, 10)]


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory, scripted):
    wd = tmp_path_factory.mktemp("six")
    tok, s = scripted
    write(wd, 1, tok, s)
    for step in range(2, 7):
        shutil.copy(dump_path(wd, 1), dump_path(wd, step))  # the rows say step 1; only the file names matter here
    return wd


@pytest.mark.parametrize("args, steps", [(["--steps", "2:4"], ["2", "3", "4"]), (["--steps", "5"], ["5"]),
                                         (["--steps", "5:"], ["5", "6"]), (["--steps", ":2"], ["1", "2"]),
                                         (["--every", "2"], ["2", "4", "6"]),
                                         (["--steps", "3:", "--every", "2"], ["4", "6"]), ([], list("123456"))])
def test_the_export_takes_a_step_range(six_steps, tmp_path, args, steps):
    out = tmp_path / "x.html"
    main(["--workdir", str(six_steps), "--export", str(out), *args])
    data = exported(out)
    assert sorted(data["steps"], key=int) == steps and data["index"]["steps"] == [int(x) for x in steps]


@pytest.mark.parametrize("args, message", [
    (["--steps", "4:2"], "the first step 4 is after the last 2"), (["--steps", "a:b"], "expected FIRST:LAST"),
    (["--every", "0"], "expected a positive number of steps"), (["--steps", "1:2"], "select what --export writes")])
def test_a_bad_step_range_is_named(six_steps, tmp_path, args, message):
    export = ["--export", str(tmp_path / "x.html")] if args[0] != "--steps" or args[1] != "1:2" else []
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["--workdir", str(six_steps), *export, *args])
    assert not (tmp_path / "x.html").exists()


def test_parse_steps():
    assert parse_steps("3:7") == (3, 7) and parse_steps("3:") == (3, None) and parse_steps(":7") == (None, 7)
    assert parse_steps("5") == (5, 5) and parse_steps(":") == (None, None)
