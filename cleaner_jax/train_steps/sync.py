"""The weight sync after a step: export the learner's weights, load them on every rollout
server in the rotation (canary first), probe each server's log-probs against the learner's.

The probe is a fixed sequence, the first toy prompt: a measuring instrument, the same for every
seed. On any failure (`WeightSyncError`, non-finite weights refused by the export, no server
left) no server that missed the new weights stays in the rotation and `WeightSyncFailedError`
stops the run; the step loop first writes the step's metrics, dump and checkpoint, so a resume
restores exactly that state (docs/reliability.md row 5).

Only the newest export stays in the export directory. `train.keep_exports` also keeps the best
export by the held-out evaluation and the final one, as copies under <workdir>/exports/
(`keep_exports`, docs/exports.md).
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np

from cleaner_jax import distributed
from cleaner_jax.config import RunConfig
from cleaner_jax.models.atomic_dir import commit_dir, partial_dir, recover_replaced
from cleaner_jax.models.params import ExportFailedError, NonFiniteWeightsError
from cleaner_jax.rl.learner import Learner
from cleaner_jax.rollout.fleet import RolloutUnavailableError
from cleaner_jax.rollout.weight_sync import SyncReport, WeightSyncError, export_checkpoint, fixed_reference, sync_weights
from cleaner_jax.session import Session, export_root
from cleaner_jax.toy import task as toy_task

log = logging.getLogger("cleaner_jax.train")


class WeightSyncFailedError(RuntimeError):
    """The weight sync failed (`WeightSyncError`, or non-finite weights refused by the export); the
    learner state is checkpointed and no rollout ran on unverified weights."""


class WeightSync:
    """Loads the learner's weights on the session's rollout servers, exported under the run's
    export directory (`train.weight_export_dir`, linked as <workdir>/sync)."""

    def __init__(self, r: RunConfig, workdir: Path, session: Session, learner: Learner, model_dir: Path) -> None:
        self.r, self.wd, self.session, self.learner, self.model_dir = r, workdir, session, learner, model_dir
        probe = toy_task.make_problems(1, seed=4242)[0]  # fixed: the first toy prompt
        self.probe_ids = list(session.chat.prompt_ids(probe.messages))[:64]
        self.synced: Path | None = None  # the export every server serves (after the last good sync)

    def sync(self, step: int) -> SyncReport | None:
        """Export the learner's weights and load them on every rollout server (canary first, probed).

        Several learner processes: every process computes the probe reference and takes part in
        the export (both collective); process 0 alone loads the export on the servers and probes
        them, then broadcasts the outcome, so that on a failure every process stops here.
        Returns the report on process 0 (None on the others)."""
        r, main = self.r, distributed.is_main()
        root = export_root(self.wd, r.train.weight_export_dir)
        link = self.wd / "sync"
        if main and root != link and not link.is_symlink() and not link.exists():
            root.mkdir(parents=True, exist_ok=True)
            link.symlink_to(root, target_is_directory=True)  # `evaluate --workdir` finds the newest export there
        distributed.barrier("train: the export directory")
        dtype = r.model.param_dtype if r.train.weight_export_dtype == "param" else r.model.compute_dtype
        fleet = self.session.fleet  # row 1: sync the servers in the rotation; one that is back later gets these weights
        version, timings = f"step-{step}", {}
        report: SyncReport | None = None
        failure: Exception | None = None
        # the learner's probe log-probs of these weights, once (collective): the probe below and every
        # later re-admission of a server (`fleet.set_current`) compare against them
        probe = dict(probe_ids=self.probe_ids, probe_start=1,
                     learner_logprobs=fixed_reference(self.probe_ids, 1, self.learner_logprobs(self.probe_ids, 1)),
                     max_mean_abs_gap=r.train.weight_sync_probe_tol, idle_timeout_s=r.rollout.sync_idle_timeout_s)
        path = root / f"step_{step:06d}"
        try:
            path = export_checkpoint(self.learner.model(), path, self.model_dir, dtype=dtype, timings=timings,
                                     max_shard_bytes=int(r.train.weight_export_shard_mb * 10**6))
            if main:
                # at least one server up (restarted / waited for); behind a router, the workers
                # whose /health is silent are out first, so the sync covers the live ones
                self.session.run(fleet.recover())
                report = self.session.run(sync_weights(self.session.client, path, version, urls=fleet.live_urls(),
                                                       timings=timings, **probe))
        except (WeightSyncError, NonFiniteWeightsError, ExportFailedError, RolloutUnavailableError) as err:
            failure = err  # an export failure is raised on every process (`params.save_pretrained`)
        if jax.process_count() > 1:  # process 0's outcome, so that every process stops together
            said = distributed.broadcast_text("" if failure is None else f"{type(failure).__name__}: {failure}")
            if said and failure is None:
                failure = WeightSyncError(f"on learner process 0: {said}")
        if failure is not None:
            log.error("weight sync to step-%d failed: %s", step, failure)
            raise WeightSyncFailedError(
                f"the weight sync after step {step} failed, so the run stops (checkpoint {step} is on disk; no "
                f"rollout ran on unverified weights): {failure}. Out of the rotation: "
                f"{self.session.client.out_of_rotation}. Fix the server or the export and run the same command "
                "to resume") from failure
        fleet.set_current(path, version, **probe)
        self.synced = path
        if not main:
            return None
        log.info("weight sync step-%d: %s (export dtype %s)", step,
                 ", ".join(f"{k} {v:.3f}" for k, v in report.phases.items()), dtype)
        remove_other_exports(root, path)
        return report

    def keep(self, step: int, evaluated: Mapping[str, float]) -> list[str]:
        """Process 0, after step `step`'s evaluation (`evaluated`: its metrics, {} without one): keep
        the served export as <workdir>/exports/best and /final as `train.keep_exports` asks."""
        if self.synced is None:
            return []
        return keep_exports(self.wd, self.r.train.keep_exports, step, self.synced, evaluated,
                            last=step == self.r.train.steps)

    def learner_logprobs(self, ids: list[int], start: int) -> list[float]:
        """Untempered learner log-probs of ids[start:] (what the server's probe returns)."""
        mb = self.learner.cfg.logprob_micro_batch_size
        arr = np.zeros((mb, len(ids)), np.int32)
        arr[:] = ids
        lp = self.learner.logprobs(arr, np.ones_like(arr), temperature=1.0)
        return lp[0, start:].tolist()


def remove_other_exports(root: Path, synced: Path) -> list[Path]:
    """After a good sync every server serves `synced`: remove the other exports under `root`. Not
    "all but the newest by name": after a resume the killed run's later exports are still there
    (`session.discard_after` keeps them for servers that kept running), and the export just
    synced is an earlier step."""
    removed = [old for old in sorted(root.glob("step_*")) if old.resolve() != synced.resolve()]
    for old in removed:
        shutil.rmtree(old)
    return removed


def sync_metrics(report: SyncReport | None) -> dict[str, float]:
    """The step's `time/weight_sync*` and `weight_sync/*` metrics (docs/metrics.md); none
    without a report (another learner process, or a failed sync)."""
    if report is None:
        return {}
    return {"time/weight_sync_s": report.seconds, "weight_sync/probe_gap": max(report.probe_gap.values(), default=0.0),
            **{f"time/weight_sync/{phase}": seconds for phase, seconds in report.phases.items()}}


KEPT_DIR = "exports"  # <workdir>/exports/{best,final}
KEPT_INFO = "export.json"  # in each kept export: its step and the metric it was kept for
# the run's primary held-out metric: mean@n of a benchmark (with eval.saar=both, of one SAAR level)
PRIMARY_METRIC = re.compile(r"eval/[^/]+(/saar_(on|off))?/mean@\d+")


def primary_metric(evaluated: Mapping[str, float]) -> tuple[str, float] | None:
    """The evaluation's primary metric and value: `eval/<benchmark>/mean@<n>` of the first benchmark
    of data.eval (the first the evaluation reports; with eval.saar=both, SAAR off, reported first).
    None: no evaluation."""
    for name, value in evaluated.items():
        if PRIMARY_METRIC.fullmatch(name):
            return name, float(value)
    return None


def kept_export(workdir: Path, name: str) -> dict | None:
    """The `export.json` of <workdir>/exports/<name> (None: no such export). A swap killed between
    its two renames (`atomic_dir.commit_dir`) left the previous export as `.<name>.replaced`: it
    is put back first, so a crash never loses it."""
    final = workdir / KEPT_DIR / name
    if recover_replaced(final):
        log.warning("put back %s: the swap that replaced it was killed half-way", final)
    info = final / KEPT_INFO
    return json.loads(info.read_text()) if info.is_file() else None


def keep_export(workdir: Path, name: str, source: Path, info: dict) -> Path:
    """Make <workdir>/exports/<name> a copy of the export `source` (hard links where it is on the
    same file system: the export's files are never changed in place, and the sync's removal of
    `source` unlinks only its own names) with `info` as its export.json. Written whole, then
    swapped in (`atomic_dir`): the previous one stays until the new one is complete."""
    final = workdir / KEPT_DIR / name
    tmp = partial_dir(final)
    for f in sorted(source.iterdir()):
        if f.is_file():
            try:
                os.link(f, tmp / f.name)
            except OSError:  # another file system (train.weight_export_dir on /dev/shm), or no hard links
                shutil.copyfile(f, tmp / f.name)
    (tmp / KEPT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return commit_dir(tmp, final)


def keep_exports(workdir: Path, keep: str, step: int, export: Path, evaluated: Mapping[str, float], *,
                 last: bool) -> list[str]:
    """`train.keep_exports` after step `step`, whose served export is `export` and whose evaluation
    gave `evaluated` ({}: none after this step). best: kept when the primary metric is finite and
    higher than the kept best's (a tie keeps the earlier step; a kept best measured by another
    metric, after a change of eval.n or data.eval, is replaced); final: kept after the last step.
    Returns the names kept now."""
    wanted = set(keep.split(",")) - {"latest"}
    metric = primary_metric(evaluated)
    info = {"step": step, "metric": None if metric is None else metric[0],
            "value": None if metric is None else metric[1], "source": str(export)}
    kept = []
    if "best" in wanted and metric is not None and math.isfinite(metric[1]):
        old = kept_export(workdir, "best")
        if old is None or old.get("metric") != metric[0] or metric[1] > float(old["value"]):
            keep_export(workdir, "best", export, info)
            kept.append("best")
    if "final" in wanted and last:
        keep_export(workdir, "final", export, info)
        kept.append("final")
    if kept:
        log.info("step %d: kept its export %s as %s (%s)", step, export, ", ".join(kept),
                 "no evaluation" if metric is None else f"{metric[0]} = {metric[1]:.4f}")
    return kept
