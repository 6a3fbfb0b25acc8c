"""Start-up checks run before the expensive work and end in one line (issue #27, items 13 and 14).

The trainer reads and checks every data file (train and eval) and the served context before it
builds a model, runs the warm start or starts a rollout server: those three are replaced here by
recorders that must never be called. The entry points print a bad data file as one `error:` line
and exit 1, without a traceback. The bad file's message is written out by hand from its row. A
config naming what this machine lacks (a file, a directory, a package) passes `validate()` and is
stopped the same way by the start-up check (`config.check_environment`), a study before its first
run.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from _configs import ROOT, load_config
from cleaner_jax import session as session_module
from cleaner_jax import train
from cleaner_jax.config import ConfigError, validate
from cleaner_jax.data.problems import DataError
from cleaner_jax.rollout.weight_sync import ContextBudgetError

TINY_CONTEXT = 4096  # max_position_embeddings of the toy run's tiny checkpoint (session.prepare_model_dir)


def _bad_gpqa(tmp_path: Path) -> Path:
    """A GPQA file whose row 0 has no `problem`."""
    path = tmp_path / "bad_gpqa.jsonl"
    path.write_text(json.dumps({"domain": "Physics", "solution": "A"}) + "\n")
    return path


@pytest.fixture
def expensive(monkeypatch) -> list[str]:
    """Records (and refuses) every expensive step of `Trainer.run`."""
    called: list[str] = []

    def refuse(name: str):
        def call(*args, **kwargs):
            called.append(name)
            raise AssertionError(f"{name} ran before the start-up checks failed")
        return call

    monkeypatch.setattr(train.params, "from_pretrained", refuse("params.from_pretrained"))
    monkeypatch.setattr(train, "warm_start", refuse("warm_start"))
    monkeypatch.setattr(train, "make_mesh", refuse("make_mesh"))
    monkeypatch.setattr(session_module, "rollout_backend", refuse("rollout_backend"))
    return called


def _config(**agent: int):
    c = load_config("toy")
    c.sandbox.workers = 1
    for key, value in agent.items():
        setattr(c.agent, key, value)
    return c


def test_a_bad_eval_file_stops_the_trainer_before_any_model_is_built(tmp_path, expensive):
    c = _config()
    c.data.eval = f"toy,gpqa_diamond={_bad_gpqa(tmp_path)}"
    with pytest.raises(DataError, match=r"bad_gpqa\.jsonl: row 0, field 'problem': missing"):
        train.Trainer(validate(c), tmp_path / "run").run()
    assert expensive == []


def test_a_budget_equal_to_the_embedded_context_stops_the_trainer_before_any_model_is_built(tmp_path, expensive):
    c = _config(max_prompt_tokens=512, max_response_tokens=TINY_CONTEXT - 512)
    with pytest.raises(ContextBudgetError, match=rf"= {TINY_CONTEXT} tokens, but the embedded rollout server serves "
                                                 rf"at most {TINY_CONTEXT - 1} tokens"):
        train.Trainer(validate(c), tmp_path / "run").run()
    assert expensive == []


class _ContextServer(BaseHTTPRequestHandler):
    """An external server's two context answers (SGLang's shapes): a context of 1000 tokens."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = {"/v1/models": {"object": "list", "data": [{"id": "m", "max_model_len": 1000}]},
                "/server_info": {"max_total_num_tokens": 4096}}.get(self.path)
        data = json.dumps(body).encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_an_external_servers_context_is_asked_before_any_model_is_built(tmp_path, expensive):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ContextServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        c = _config(max_prompt_tokens=500, max_response_tokens=500)
        c.rollout.backend = "sglang"
        c.rollout.server_urls = url
        with pytest.raises(ContextBudgetError, match=rf"= 1000 tokens, but {url} serves at most 999 tokens"):
            train.Trainer(validate(c), tmp_path / "run").run()
    finally:
        server.shutdown()
        server.server_close()
    assert expensive == []


@pytest.mark.parametrize("entry", ["train", "evaluate"])
def test_a_bad_data_file_is_one_error_line_and_exit_1(tmp_path, entry):
    bad = _bad_gpqa(tmp_path)
    cmd = [sys.executable, "-m", f"cleaner_jax.{entry}", "--config", str(ROOT / "configs/toy.py"),
           "--workdir", str(tmp_path / "run"), "--config.sandbox.workers=1", f"--config.data.eval=toy,gpqa_diamond={bad}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.strip().splitlines()[-1] == f"error: {bad}: row 0, field 'problem': missing (columns present: domain, solution)", proc.stderr[-4000:]


@pytest.mark.parametrize("entry", ["train", "evaluate"])
def test_what_the_machine_lacks_is_one_error_line_naming_the_key(tmp_path, entry):
    """validate() accepts the config (it reads nothing from the machine); the entry point's
    start-up check (`check_environment`) then stops it before any log or model, naming the key."""
    cmd = [sys.executable, "-m", f"cleaner_jax.{entry}", "--config", str(ROOT / "configs/toy.py"),
           "--workdir", str(tmp_path / "run"), "--config.model.tiny_init=False",
           "--config.model.path=/nonexistent/model"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.strip().splitlines()[-1] == "error: config.model.path: '/nonexistent/model' is not a directory"
    assert not (tmp_path / "run").exists()  # stopped before the workdir was made


def test_a_study_checks_every_arm_against_the_machine_before_any_run(tmp_path):
    """The study runner's start-up check: an arm whose run config names a missing file stops the
    study before its first run, naming the arm and the key."""
    from ml_collections import ConfigDict

    from cleaner_jax.study import runner
    from cleaner_jax.study.config import study_config, validate_study

    c = study_config()
    c.arms.grpo_raw = ConfigDict({"saar": {"enable": False}})
    c.arms.cleaner = ConfigDict({"train": {"weight_export_dir": str(tmp_path / "missing_shm")}})
    study = validate_study(c)  # the configs alone are right
    with pytest.raises(ConfigError, match=r"^config\.arms\.cleaner \(with config\.run\): the run config cannot run "
                                          r"on this machine: config\.train\.weight_export_dir: '.*missing_shm' is not "
                                          r"an existing directory"):
        runner.run_study(study, tmp_path / "study")
    assert not (tmp_path / "study" / "runs").exists()
    (tmp_path / "missing_shm").mkdir()
    runner.check_environments(study, tmp_path / "study")
