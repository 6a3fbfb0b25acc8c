"""One process of a multi-process HF export, started by tests/test_sharded_export.py.

Each process joins a `jax.distributed` run on a loopback coordinator with its own CPU devices
(gloo collectives), loads a checkpoint onto one global (fsdp, tp) mesh over every process's
devices (so tensors span both processes), and calls `params.save_pretrained` like the trainer would,
once per `--steps` entry, in order, each to OUT/<step>:
  unrolled, scanned   export that layout (`scan_layers`);
  failK@P             unrolled, but process P's write of shard file K raises, as a full disk would;
  private             unrolled, each process to its own OUT/private/p<id> (a file system the
                      processes do not share).
`--stall-on-file K` makes this process write half of file K, touch `--marker` and sleep (to be
killed). Each step prints `STEP <step> EXPORTED <dir> wrote <n> file(s)` or `STEP <step> FAILED
<error type>: <message>`; the exit status is 0 unless something outside the exports crashed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--local-devices", type=int, default=2)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-shard-bytes", type=int, required=True)
    ap.add_argument("--steps", default="unrolled")
    ap.add_argument("--stall-on-file", type=int, default=None)
    ap.add_argument("--marker", type=Path, default=None)
    args = ap.parse_args()

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", args.num_processes, args.process_id,
                               initialization_timeout=120, heartbeat_timeout_seconds=10)
    from cleaner_jax.models import params, sharding

    assert jax.process_count() == args.num_processes and len(jax.local_devices()) == args.local_devices
    mesh = sharding.make_mesh(2, len(jax.devices()) // 2)
    real_save = params.save_file
    state = {"written": 0, "fail_on": None}

    def save_file(tensors, filename, metadata=None):
        name = Path(filename).name
        k = int(name.split("-")[1]) if "-of-" in name else 1
        state["written"] += 1
        if k == state["fail_on"]:
            raise OSError(28, f"No space left on device (injected by the test into process {args.process_id})")
        real_save(tensors, filename, metadata=metadata)
        if k == args.stall_on_file:
            os.truncate(filename, os.path.getsize(filename) // 2)
            args.marker.touch()
            time.sleep(600)

    params.save_file = save_file
    for step in args.steps.split(","):
        state["written"], state["fail_on"] = 0, None
        out = args.out / step
        if step.startswith("fail"):
            k, p = step[len("fail"):].split("@")
            state["fail_on"] = int(k) if int(p) == args.process_id else None
        elif step == "private":
            out = args.out / step / f"p{args.process_id}"
        model = params.from_pretrained(args.checkpoint, mesh=mesh, scan_layers=step == "scanned")
        try:
            out = params.save_pretrained(model, out, max_shard_bytes=args.max_shard_bytes, tokenizer_from=args.checkpoint)
        except Exception as exc:
            print(f"STEP {step} FAILED {type(exc).__name__}: {exc}", flush=True)
            continue
        print(f"STEP {step} EXPORTED {out} wrote {state['written']} file(s)", flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
