"""Issue 40 item 3: `python -m cleaner_jax.export` (a training checkpoint as an HF directory) and
`train.keep_exports` (the best and final weight exports kept besides the newest).

The export is checked against independent references: the path a resumed run and `evaluate
--checkpoint` take (a `Learner` restores the whole checkpoint, `params.save_pretrained` writes it),
the weights the learner held when it saved, and transformers' forward pass. The kept exports are
driven with fake evaluations on fake export directories (a training run would cost minutes)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file

from cleaner_jax import export as export_cmd
from cleaner_jax.config import ConfigError, base_config, validate
from cleaner_jax.models import params
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rl.learner_config import LearnerConfig, OptimizerConfig
from cleaner_jax.toy.checkpoint import make_tiny_checkpoint
from cleaner_jax.train_steps import sync

ROOT = Path(__file__).resolve().parents[1]
TORCH = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def learner_for(model_dir: Path, checkpoints: Path) -> Learner:
    cfg = LearnerConfig(optimizer=OptimizerConfig(), micro_batch_size=2, logprob_micro_batch_size=2)
    return Learner(params.from_pretrained(model_dir), cfg, checkpoint_dir=checkpoints)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A toy run's workdir as train leaves it: config.json, init_model/ and checkpoints 3 and 5,
    whose weights differ from the initial ones and from each other. Returns the workdir and each
    step's embedding as the learner held it when it saved."""
    wd = tmp_path_factory.mktemp("run")
    make_tiny_checkpoint(wd / "init_model", "qwen3", seed=3)
    c = base_config()
    c.model.tiny_init = True
    (wd / "config.json").write_text(c.to_json_best_effort(indent=2))
    learner = learner_for(wd / "init_model", wd / "checkpoints")
    embeds = {}
    for step, (scale, shift) in ((3, (1.5, 0.01)), (5, (0.5, -0.02))):
        learner.params = jax.tree.map(lambda x, a=scale, b=shift: x * a + b, learner.params)
        embeds[step] = np.asarray(learner.params["embed_tokens"]["embedding"].get_value())
        learner.save(step, {"data_position": step})
    learner.close()
    return wd, embeds


def reference(wd: Path, step: int, dtype: str, out: Path) -> tuple[Path, nnx.Module]:
    """What `evaluate --checkpoint` does: a learner restores the whole checkpoint into the run's
    model, `params.save_pretrained` writes it; also returns the restored model."""
    learner = learner_for(wd / "init_model", wd / "checkpoints")
    try:
        learner.restore(step)
        model = learner.model()
        return params.save_pretrained(model, out, tokenizer_from=wd / "init_model", dtype=dtype), model
    finally:
        learner.close()


def tensors(d: Path) -> dict[str, torch.Tensor]:
    return load_file(d / "model.safetensors")


@pytest.mark.parametrize("flag,dtype", [("bf16", "bfloat16"), ("f32", "float32")])
def test_export_equals_save_pretrained_of_the_restored_model_and_transformers_agrees(run, tmp_path, flag, dtype):
    from transformers import AutoModelForCausalLM

    wd, embeds = run
    out, ckpt = export_cmd.export(str(tmp_path / "hf"), checkpoint=str(wd / "checkpoints" / "3"), dtype=flag)
    assert out == tmp_path / "hf" and ckpt.step == 3 and ckpt.workdir == wd
    ref, model = reference(wd, 3, dtype, tmp_path / "ref")
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
    got, want = tensors(out), tensors(ref)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == TORCH[dtype], name
        assert torch.equal(got[name], want[name]), name
    # the checkpoint's weights, not the initial model's: the embedding the learner saved, rounded to `dtype`
    saved = torch.from_numpy(embeds[3].copy()).to(TORCH[dtype])
    assert torch.equal(got["model.embed_tokens.weight"], saved)

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=TORCH[dtype]).eval()
    ids = np.random.default_rng(1).integers(0, 512, (2, 10))
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.float().numpy()
    ours = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids, jnp.int32)))  # the learner's f32 forward
    scale = np.abs(ours).max()
    if dtype == "float32":
        np.testing.assert_allclose(theirs, ours, atol=1e-4 * scale, rtol=0)
    else:  # bf16 weights and forward: 8 mantissa bits
        assert np.abs(theirs - ours).max() < 0.05 * scale
        assert (theirs.argmax(-1) == ours.argmax(-1)).mean() >= 0.9


def test_workdir_takes_the_newest_step_or_the_one_named_and_overwrite_replaces_whole(run, tmp_path):
    wd, embeds = run
    out = tmp_path / "hf"
    out.mkdir()  # an empty directory is not refused
    export_cmd.export(str(out), workdir=str(wd), dtype="float32")
    np.testing.assert_array_equal(tensors(out)["model.embed_tokens.weight"].numpy(), embeds[5])
    (out / "stale.txt").write_text("from before")
    export_cmd.export(str(out), workdir=str(wd), step=3, dtype="f32", overwrite=True)
    np.testing.assert_array_equal(tensors(out)["model.embed_tokens.weight"].numpy(), embeds[3])
    assert not (out / "stale.txt").exists()  # replaced, not merged
    # the checkpoints directory itself: its newest step
    _, ckpt = export_cmd.export(str(tmp_path / "c"), checkpoint=str(wd / "checkpoints"), dtype="f32")
    assert ckpt.step == 5


def test_a_write_that_fails_leaves_the_output_as_it_was(run, tmp_path, monkeypatch):
    wd, _ = run
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("previous export")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(params, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_cmd.export(str(out), checkpoint=str(wd / "checkpoints" / "3"), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def error_line(**kwargs) -> str:
    """The command's exit for these inputs: a one-line `error: ...` (a str SystemExit: status 1)."""
    with pytest.raises(SystemExit) as exc:
        export_cmd.run_command(**kwargs)
    message = exc.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    return message


def test_each_bad_input_is_one_error_line(run, tmp_path):
    wd, _ = run
    ck3 = str(wd / "checkpoints" / "3")
    out = str(tmp_path / "out")
    assert error_line(out=out, checkpoint=str(wd / "checkpoints" / "7")) == \
        f"error: no such checkpoint: {wd / 'checkpoints' / '7'}"
    assert "no such checkpoint: step 9 is not in" in error_line(out=out, workdir=str(wd), step=9)
    assert "it has [3, 5]" in error_line(out=out, workdir=str(wd), step=9)
    # not a training checkpoint: an HF directory, a run's workdir, a step whose save never committed
    assert error_line(out=out, checkpoint=str(wd / "init_model")).startswith(
        f"error: {wd / 'init_model'} is not a training checkpoint")
    assert "(a run's workdir: use --workdir)" in error_line(out=out, checkpoint=str(wd))
    torn = tmp_path / "checkpoints" / "8"
    shutil.copytree(wd / "checkpoints" / "3", torn)
    (torn / "commit_success.txt").unlink()
    assert error_line(out=out, checkpoint=str(torn)).startswith(f"error: {torn} is not a training checkpoint: no params/")
    assert error_line(out=out, checkpoint=ck3, dtype="int8") == \
        "error: unknown --dtype 'int8': use bf16, f16 or f32 (or bfloat16, float16, float32)"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    assert error_line(out=str(tmp_path / "full"), checkpoint=ck3) == (
        f"error: --out {tmp_path / 'full'} exists and is not empty: pass --overwrite to replace it, or choose "
        "another --out")
    assert (tmp_path / "full" / "x").read_text() == "mine"
    assert "is or contains" in error_line(out=str(wd), checkpoint=ck3, overwrite=True)  # would delete the run
    assert "neither --checkpoint and --workdir" in error_line(out=out)
    assert not Path(out).exists()


def test_a_checkpoint_outside_its_workdir_needs_model_dir(run, tmp_path):
    wd, _ = run
    moved = tmp_path / "moved" / "3"
    shutil.copytree(wd / "checkpoints" / "3", moved)
    assert "pass --model_dir" in error_line(out=str(tmp_path / "o"), checkpoint=str(moved))
    out, ckpt = export_cmd.export(str(tmp_path / "o"), checkpoint=str(moved), model_dir=str(wd / "init_model"))
    assert ckpt.workdir is None and (out / "model.safetensors").is_file()


def test_the_module_exits_1_with_one_line(run, tmp_path):
    wd, _ = run
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    missing = wd / "checkpoints" / "42"
    p = subprocess.run([sys.executable, "-m", "cleaner_jax.export", "--checkpoint", str(missing), "--out",
                        str(tmp_path / "o"), "--dtype", "bf16"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1
    assert p.stderr.strip() == f"error: no such checkpoint: {missing}", p.stderr
    assert p.stdout == ""


# ------------------------------------------------------------------------------ train.keep_exports

def fake_export(root: Path, step: int) -> Path:
    d = root / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_text(f"weights of step {step}")
    (d / "config.json").write_text("{}")
    return d


def evaluation(value: float, n: int = 4) -> dict[str, float]:
    """An evaluation's metrics as `eval.report.metric_dict` names them: the first benchmark first."""
    return {f"eval/toy/mean@{n}/ci_low": 0.0, f"eval/toy/mean@{n}": value, f"eval/toy/pass@{n}": 1.0,
            "eval/aime24/mean@16": 0.99}


def kept(wd: Path, name: str) -> tuple[dict, str]:
    d = wd / "exports" / name
    return json.loads((d / "export.json").read_text()), (d / "model.safetensors").read_text()


def test_primary_metric_is_the_first_benchmarks_mean_at_n():
    assert sync.primary_metric(evaluation(0.25)) == ("eval/toy/mean@4", 0.25)
    both = {"eval/toy/saar_off/mean@8": 0.5, "eval/toy/saar_on/mean@8": 0.75}
    assert sync.primary_metric(both) == ("eval/toy/saar_off/mean@8", 0.5)
    assert sync.primary_metric({}) is None


def test_keep_exports_keeps_the_best_and_the_final_with_their_steps(tmp_path):
    wd, root = tmp_path / "wd", tmp_path / "sync"
    history = {10: 0.3, 20: 0.5, 30: 0.4, 35: None, 40: 0.5}  # 35: no evaluation; 40 ties step 20
    for step, value in history.items():
        export = fake_export(root, step)
        got = sync.keep_exports(wd, "latest,best,final", step, export, {} if value is None else evaluation(value),
                                last=step == 40)
        assert got == {10: ["best"], 20: ["best"], 40: ["final"]}.get(step, [])
        shutil.rmtree(export)  # the next sync removes it (`remove_other_exports`): the kept copies stay whole
    info, weights = kept(wd, "best")
    assert info == {"step": 20, "metric": "eval/toy/mean@4", "value": 0.5, "source": str(root / "step_000020")}
    assert weights == "weights of step 20"
    info, weights = kept(wd, "final")
    assert (info["step"], info["value"], weights) == (40, 0.5, "weights of step 40")
    assert sorted(p.name for p in (wd / "exports").iterdir()) == ["best", "final"]  # no leftovers
    # a NaN evaluation is never the best; another metric (eval.n changed on resume) replaces it
    assert sync.keep_exports(wd, "latest,best", 50, fake_export(root, 50), evaluation(float("nan")), last=False) == []
    assert sync.keep_exports(wd, "latest,best", 60, fake_export(root, 60), evaluation(0.1, n=8), last=False) == ["best"]
    assert kept(wd, "best")[0]["step"] == 60


@pytest.mark.parametrize("keep", ["latest", "latest,final"])
def test_keep_exports_keeps_only_what_is_asked(tmp_path, keep):
    wd = tmp_path / "wd"
    sync.keep_exports(wd, keep, 10, fake_export(tmp_path / "sync", 10), evaluation(0.9), last=True)
    names = sorted(p.name for p in (wd / "exports").iterdir()) if (wd / "exports").exists() else []
    assert names == ([] if keep == "latest" else ["final"])


def test_a_crash_never_loses_the_previous_best(tmp_path, monkeypatch):
    wd, root = tmp_path / "wd", tmp_path / "sync"
    sync.keep_exports(wd, "latest,best", 10, fake_export(root, 10), evaluation(0.5), last=False)
    # killed while writing a better one: the partial copy is never seen, the kept best is intact
    real_link = os.link

    def dies_midway(src, dst):
        if Path(src).name == "config.json":
            raise KeyboardInterrupt("killed")
        real_link(src, dst)

    monkeypatch.setattr(sync.os, "link", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        sync.keep_exports(wd, "latest,best", 20, fake_export(root, 20), evaluation(0.9), last=False)
    monkeypatch.undo()
    info, weights = kept(wd, "best")
    assert (info["step"], weights) == (10, "weights of step 10")
    # killed between the swap's two renames (`atomic_dir.commit_dir`): best is absent, the old one is
    # `.best.replaced`; the next keep puts it back before comparing, and keeps it against a worse step
    best = wd / "exports" / "best"
    os.rename(best, best.parent / ".best.replaced")
    assert sync.keep_exports(wd, "latest,best", 30, fake_export(root, 30), evaluation(0.2), last=False) == []
    assert kept(wd, "best")[0]["step"] == 10 and not (best.parent / ".best.replaced").exists()


def test_the_step_loop_keeps_after_the_last_step_of_train_steps(tmp_path):
    """`WeightSync.keep`, as the step loop calls it on process 0: the config's key and train.steps."""
    c = base_config()
    c.model.tiny_init = True
    c.data.eval_limit = 4
    c.train.steps = 2
    c.train.keep_exports = "latest,best,final"
    weights = sync.WeightSync.__new__(sync.WeightSync)  # its parts the keep reads (no session or learner)
    weights.r, weights.wd, weights.synced = validate(c), tmp_path / "wd", None
    assert weights.keep(1, evaluation(0.5)) == []  # nothing synced yet
    weights.synced = fake_export(tmp_path / "sync", 1)
    assert weights.keep(1, evaluation(0.5)) == ["best"]
    weights.synced = fake_export(tmp_path / "sync", 2)
    assert weights.keep(2, evaluation(0.25)) == ["final"]
    c.train.keep_exports = "best,latest"
    with pytest.raises(ConfigError, match=r"^config\.train\.keep_exports: 'best,latest' is not allowed: use one of "
                                          r"'latest', 'latest,best', 'latest,final', 'latest,best,final'"):
        validate(c)
