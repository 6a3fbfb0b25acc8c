"""End to end: `python -m cleaner_jax.evaluate` on a tiny random model (the toy benchmark, and
GPQA-Diamond and LiveCodeBench rows from files the test writes, SAAR off and on), killed with
SIGKILL after a few problems are written and started again, reports exactly what an
uninterrupted evaluation reports; the killed run evaluates an Orbax training checkpoint of the same weights
(`--checkpoint`), the uninterrupted one the HF directory, so the same comparison also shows
that a checkpoint is restored and served faithfully."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBLEMS = 8
SMALL = [
    f"--config.data.eval_limit={PROBLEMS}", "--config.eval.n=2", "--config.eval.saar=both",
    "--config.agent.max_prompt_tokens=1024",  # room for the GPQA and LiveCodeBench prompts
    "--config.eval.max_concurrent_problems=1", "--config.eval.bootstrap_resamples=200",
    "--config.agent.max_response_tokens=48", "--config.agent.max_assistant_turns=2",
    "--config.agent.max_user_turns=2", "--config.reward.overlong_buffer=8", "--config.sandbox.workers=2",
]


GPQA_ROWS = [  # the plain form of data/gpqa.py
    {"id": "g1", "problem": "Which is a noble gas?\n(A) Oxygen (B) Neon (C) Iron (D) Sodium", "answer": "B",
     "domain": "Chemistry"},
    {"id": "g2", "problem": "2 + 2 = ?\n(A) 3 (B) 5 (C) 4 (D) 22", "answer": "C", "domain": "Physics"},
]
LCB_ROWS = [  # the authors' form of data/livecodebench.py (JSON strings), stdin/stdout tests
    {"problem": "Read n and print n + 1.", "data_source": "livecodebench",
     "reward_model": json.dumps({"ground_truth": json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})}),
     "extra_info": json.dumps({"question_id": "q1"})},
    {"problem": "Read a line and print it twice.", "data_source": "livecodebench",
     "reward_model": json.dumps({"ground_truth": json.dumps({"inputs": ["ab\n"], "outputs": ["ab\nab\n"]})}),
     "extra_info": json.dumps({"question_id": "q2"})},
]


def evaluate_cmd(workdir: Path, out: Path, *model: str) -> list[str]:
    files = {}
    for name, rows in (("gpqa_diamond", GPQA_ROWS), ("livecodebench", LCB_ROWS)):
        files[name] = workdir / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    benchmarks = f"toy,gpqa_diamond={files['gpqa_diamond']},livecodebench={files['livecodebench']}"
    return [sys.executable, "-m", "cleaner_jax.evaluate", "--config", str(ROOT / "configs/toy.py"),
            "--workdir", str(workdir), "--out", str(out), *model, *SMALL, f"--config.data.eval={benchmarks}"]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny HF checkpoint and an Orbax training checkpoint (step 1) holding the same weights."""
    from cleaner_jax import wiring
    from cleaner_jax.config import validate
    from cleaner_jax.models import params
    from cleaner_jax.rl.learner import Learner
    from cleaner_jax.session import make_mesh, prepare_model_dir
    from test_config import load_config

    wd = tmp_path_factory.mktemp("eval_run")
    c = validate(load_config("toy"))
    hf = prepare_model_dir(c, wd)  # <wd>/init_model, as a toy training writes it
    mesh = make_mesh(c)
    learner = Learner(params.from_pretrained(hf, mesh=mesh), wiring.learner_config(c), mesh,
                      checkpoint_dir=wd / "checkpoints")
    learner.save(1, {"data_position": 0})
    learner.close()
    return wd, hf


def results_without_timing(out: Path) -> list[dict]:
    report = json.loads((out / "results.json").read_text())
    for r in report:
        r.pop("timing")
    return report


def metric_table(out: Path) -> str:
    """results.md from below its title (which names the model) up to the latency section."""
    md = (out / "results.md").read_text()
    return md.split("\n", 1)[1].split("## Latency")[0]


def records(out: Path, name: str) -> dict[str, dict]:
    rows = [json.loads(line) for line in (out / "samples" / name).read_text().splitlines()]
    assert len({r["uid"] for r in rows}) == len(rows), "a problem was evaluated twice"
    for r in rows:
        r.pop("wall_s")
    return {r["uid"]: r for r in rows}


def assert_same(x, y, path=""):
    """Equal, except behaviour log-probs to float32 rounding: the server's prefix cache holds
    other prompts after a restart, and a prefill from cache rounds differently (the sampled
    tokens, answers and scores must be identical)."""
    assert type(x) is type(y), path
    if isinstance(x, dict):
        assert x.keys() == y.keys(), path
        for k in x:
            assert_same(x[k], y[k], f"{path}/{k}")
    elif isinstance(x, list):
        assert len(x) == len(y), path
        if path.endswith("logprobs"):
            assert x == pytest.approx(y, rel=1e-5, abs=1e-6), path
        else:
            for i, (u, v) in enumerate(zip(x, y)):
                assert_same(u, v, f"{path}[{i}]")
    else:
        assert x == y or (x != x and y != y), f"{path}: {x!r} != {y!r}"


def killed_and_resumed(wd: Path, b: Path) -> subprocess.CompletedProcess:
    """The evaluation of checkpoint 1 into `b`, SIGKILLed after two problems, then run again to the end."""
    first = b / "samples" / "toy.saar_off.jsonl"
    proc = subprocess.Popen(evaluate_cmd(wd, b, "--checkpoint", str(wd / "checkpoints" / "1")), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    try:
        while not (first.exists() and first.read_text().count("\n") >= 2):  # killed after two problems
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            assert time.time() < deadline, "no problem written within the deadline"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = first.read_bytes()
    kept = before[:before.rfind(b"\n") + 1]  # the complete lines (a torn last one is dropped on resume)
    written = kept.count(b"\n")
    assert 2 <= written < PROBLEMS, f"the kill came too late to test a resume ({written} problems written)"
    assert not (b / "results.json").exists()
    out = run(evaluate_cmd(wd, b, "--checkpoint", str(wd / "checkpoints" / "1")))
    assert first.read_bytes().startswith(kept)  # the problems written before the kill were kept, not re-run
    return out


def test_killed_and_resumed_evaluation_reports_what_an_uninterrupted_one_does(model, tmp_path):
    wd, hf = model
    a = tmp_path / "a"  # the uninterrupted evaluation, meanwhile (its own server, its own outputs)
    log = tmp_path / "a.console"  # a file, not a pipe: nobody reads it while the other evaluation runs
    with open(log, "w") as console:
        uninterrupted = subprocess.Popen(evaluate_cmd(wd, a, "--model_dir", str(hf)), cwd=ROOT, stdout=console,
                                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        b = tmp_path / "b"
        out = killed_and_resumed(wd, b)
        assert uninterrupted.wait(timeout=600) == 0, log.read_text()[-6000:]
    finally:
        if uninterrupted.poll() is None:
            os.killpg(uninterrupted.pid, signal.SIGKILL)
            uninterrupted.wait()
    assert "toy SAAR off" in out.stderr  # the progress bar of each benchmark and SAAR setting
    assert results_without_timing(a) == results_without_timing(b)

    assert metric_table(a) == metric_table(b)
    sizes = {"toy": PROBLEMS, "gpqa_diamond": len(GPQA_ROWS), "livecodebench": len(LCB_ROWS)}
    for bench, size in sizes.items():
        for saar in ("off", "on"):
            ra, rb = records(a, f"{bench}.saar_{saar}.jsonl"), records(b, f"{bench}.saar_{saar}.jsonl")
            assert len(ra) == size
            assert all(x["termination"] != "context_full" for r in ra.values() for x in r["samples"])  # prompts fit
            assert_same(ra, rb)
    for saar in ("off", "on"):  # the export for LiveCodeBench's own evaluator, keyed by question_id
        export = json.loads((a / f"livecodebench.saar_{saar}.lcb_custom_outputs.json").read_text())
        assert [e["question_id"] for e in export] == ["q1", "q2"] and all(len(e["code_list"]) == 2 for e in export)
        assert export == json.loads((b / f"livecodebench.saar_{saar}.lcb_custom_outputs.json").read_text())

    report = json.loads((a / "results.json").read_text())
    assert [(r["name"], r["saar"]) for r in report] == [(b_, s_) for b_ in sizes for s_ in (False, True)]
    for r in report:
        assert r["samples_per_problem"] == 2
        assert r["problems"] + r["problems_without_valid_samples"] == sizes[r["name"]]
        assert r["settings"] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1}  # configs/toy.py: eval.top_p = 1.0
        assert r["ci"]["low"] <= r["mean_at_n"] <= r["ci"]["high"]
        assert set(r["pass_at_k"]) <= {"1", "2"} and set(r["maj_at_k"]) <= {"2"}
        assert r["timing"]["wall_s_per_problem"] > 0
    # a sample line holds what the report needs, and what a reader needs to audit it
    on, off = records(a, "toy.saar_on.jsonl"), records(a, "toy.saar_off.jsonl")
    uid = next(iter(on))
    assert {"answer", "vote", "score", "acc", "valid", "error", "detail", "response", "tool", "saar_events",
            "episode"} <= set(on[uid]["samples"][0])
    assert on[uid]["seed"] == off[uid]["seed"]  # SAAR on and off are compared on the same draws
    manifest = json.loads((b / "manifest.json").read_text())
    assert manifest["model"].endswith("step 1") and manifest["plan"]["seed"] == 0
    assert "SAAR adds" in (a / "results.md").read_text()
