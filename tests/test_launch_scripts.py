"""The launch scripts (launch/*.sh): syntax, the exact commands of --dry-run (hand-written
expected lines), prerequisite checks that fail with a clear message, and cleanup that stops the
processes a script started and nothing else (a decoy of the same name, as another user's
server would be, survives; the old exit trap ran `pkill -f`).

The servers and the trainer are stand-ins here: a `python` on PATH that sleeps for
`-m sglang.launch_server` (a server that stays up) and records its arguments for
`-m cleaner_jax.train`, and a `curl` that says every server is healthy. The real router runs in
tests/test_router.py.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cleaner_jax.rollout.fleet import free_loopback_port

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
SCRIPTS = sorted(LAUNCH.glob("*.sh"))


def run(script: str, *args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 60):
    return subprocess.run(["bash", str(LAUNCH / script), *args], capture_output=True, text=True, timeout=timeout,
                          env=env or dict(os.environ), cwd=cwd or ROOT)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_launch_script_parses(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_no_launch_script_kills_by_name():
    for script in SCRIPTS:
        text = "\n".join(line for line in script.read_text().splitlines() if not line.lstrip().startswith("#"))
        for word in ("pkill", "killall"):
            assert word not in text, f"{script.name} uses {word}: stop processes by the pid the script started"


# ----------------------------------------------------------------------------- dry runs


def test_sglang_servers_dry_run_binds_the_chosen_address():
    out = run("sglang_servers.sh", "--dry-run", "--host", "10.1.2.3", "--log-dir", "/tmp/l",
              "--deterministic-inference", "/models/m", "2", "31000", "bfloat16")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "+ env CUDA_VISIBLE_DEVICES=0 python -m sglang.launch_server --model-path /models/m --host 10.1.2.3 "
        "--port 31000 --tp 1 --dtype bfloat16 --mem-fraction-static 0.6 --skip-tokenizer-init "
        "--enable-deterministic-inference >/tmp/l/sglang-0.log 2>&1",
        "+ env CUDA_VISIBLE_DEVICES=1 python -m sglang.launch_server --model-path /models/m --host 10.1.2.3 "
        "--port 31001 --tp 1 --dtype bfloat16 --mem-fraction-static 0.6 --skip-tokenizer-init "
        "--enable-deterministic-inference >/tmp/l/sglang-1.log 2>&1",
        "http://10.1.2.3:31000,http://10.1.2.3:31001",
    ]


def test_sglang_servers_dry_run_resolves_an_interface():
    """`lo` is 127.0.0.1 on every Linux machine; the defaults are 4 GPUs from port 30000 in float16."""
    out = run("sglang_servers.sh", "--dry-run", "--interface", "lo", "--python", sys.executable,
              "--mem-fraction", "0.5", "/m")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (f"+ env CUDA_VISIBLE_DEVICES=0 {sys.executable} -m sglang.launch_server --model-path /m "
                        "--host 127.0.0.1 --port 30000 --tp 1 --dtype float16 --mem-fraction-static 0.5 "
                        "--skip-tokenizer-init >logs/sglang-0.log 2>&1")
    assert len(lines) == 5 and lines[3].startswith("+ env CUDA_VISIBLE_DEVICES=3 ") and " --port 30003 " in lines[3]
    assert lines[4] == "http://127.0.0.1:30000,http://127.0.0.1:30001,http://127.0.0.1:30002,http://127.0.0.1:30003"


def test_router_dry_run():
    out = run("router.sh", "--dry-run", "--host", "10.1.2.3", "--port", "31000", "--prometheus-port", "29100",
              "http://10.1.2.4:30000,http://10.1.2.4:30001", "http://10.1.2.5:30000", "--", "--log-level", "debug")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "+ python -m sglang_router.launch_router --host 10.1.2.3 --port 31000 --worker-urls http://10.1.2.4:30000 "
        "http://10.1.2.4:30001 http://10.1.2.5:30000 --policy manual --assignment-mode min_group "
        "--prometheus-host 10.1.2.3 --prometheus-port 29100 --health-check-interval-secs 5 "
        "--health-failure-threshold 2 --cb-failure-threshold 3 --request-timeout-secs 3600 --log-level debug "
        ">logs/router.log 2>&1",
        "http://10.1.2.3:31000",
    ]
    other = run("router.sh", "--dry-run", "--policy", "round_robin", "http://h:1")
    assert other.returncode == 0, other.stderr
    assert " --policy round_robin --prometheus-host 127.0.0.1 " in other.stdout  # min_group is the manual policy's


def _port(line: str, flag: str) -> int:
    cmd = shlex.split(line[2:].split(" >")[0])
    return int(cmd[cmd.index(flag) + 1])


def test_the_router_does_not_default_to_a_worker_port():
    """Both used to default to 30000, so a router and the servers' launcher on one node with their
    defaults collided. The router's port is also outside the range where SGLang picks each worker's
    NCCL port (100 to 1000 above the worker's, and upwards from there)."""
    servers = run("sglang_servers.sh", "--dry-run", "/m", "8").stdout.splitlines()
    router = run("router.sh", "--dry-run", "http://h:1").stdout.splitlines()
    worker_ports = {_port(line, "--port") for line in servers[:-1]}
    assert worker_ports == set(range(30000, 30008))  # 8 GPUs from the default first port
    port, metrics = _port(router[0], "--port"), _port(router[0], "--prometheus-port")
    assert port not in worker_ports and port != metrics and port < min(worker_ports)
    assert router[1] == f"http://127.0.0.1:{port}"


@pytest.fixture
def hostname_lists(tmp_path):
    """PATH with a `hostname` whose -I lists the given addresses."""
    def make(addresses: str) -> dict:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "hostname").write_text(f'#!/bin/sh\n[ "$1" = -I ] && echo "{addresses}" || echo node-7\n')
        (bin_dir / "hostname").chmod(0o755)
        return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return make


@pytest.mark.parametrize("script,args", [("router.sh", ["http://h:1"]), ("sglang_servers.sh", ["/m", "2"])])
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_bind_to_every_interface_prints_a_reachable_url(hostname_lists, script, args, host):
    """`--host 0.0.0.0` binds every interface, but http://0.0.0.0:PORT is no address another node
    can use: the URL names this node's first address, and stderr says which others it has."""
    out = run(script, "--dry-run", "--host", host, *args, env=hostname_lists("10.9.8.7 172.17.0.1 fd00::7"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert all(f" --host {host} " in line for line in lines[:-1])  # the bind itself is as asked
    assert "0.0.0.0" not in lines[-1] and "[::]" not in lines[-1]
    assert lines[-1].startswith("http://10.9.8.7:") and lines[-1].count("http://10.9.8.7:") == len(lines) - 1
    assert (f"{script}: --host {host} binds every interface; the URL names this node as 10.9.8.7, the first of its "
            "addresses (10.9.8.7 172.17.0.1 fd00::7): if the other nodes reach it by another, use that one "
            "(or --interface IFACE)") in out.stderr


def test_a_bind_to_every_interface_without_addresses_names_the_node(hostname_lists):
    out = run("router.sh", "--dry-run", "--host", "0.0.0.0", "http://h:1", env=hostname_lists(""))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "http://node-7:29900"
    v6 = run("router.sh", "--dry-run", "--host", "::", "http://h:1", env=hostname_lists("fd00::7"))
    assert v6.stdout.splitlines()[-1] == "http://[fd00::7]:29900"


def test_learner_node_dry_run_joins_the_distributed_run():
    out = run("learner_node.sh", "--dry-run", "--server-urls", "http://10.0.0.1:30000,http://10.0.0.2:30000",
              "--shared-dir", "/mnt/shared/sync", "--coordinator", "10.0.1.1:1234", "--num-processes", "2",
              "--process-id", "1", "--gpus", "0,1,2,3", "configs/c.py", "/models/Q", "/data/d.parquet", "runs/x",
              "--", "--config.train.steps=5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "+ env CUDA_VISIBLE_DEVICES=0,1,2,3 python -m cleaner_jax.train "
        "--config configs/c.py --workdir runs/x --config.model.path=/models/Q --config.data.train=/data/d.parquet "
        "--config.rollout.backend=sglang --config.rollout.server_urls=http://10.0.0.1:30000,http://10.0.0.2:30000 "
        "--config.train.weight_export_dir=/mnt/shared/sync --config.train.xla_mem_fraction=0.9 "
        "--config.distributed.mode=explicit "
        "--config.distributed.coordinator_address=10.0.1.1:1234 --config.distributed.num_processes=2 "
        "--config.distributed.process_id=1 --config.train.steps=5",
    ]
    single = run("learner_node.sh", "--dry-run", "--server-urls", "http://h:1", "--shared-dir", "/s", "c", "m", "d", "w")
    assert single.returncode == 0, single.stderr
    assert single.stdout.splitlines() == [
        "+ python -m cleaner_jax.train --config c --workdir w "
        "--config.model.path=m --config.data.train=d --config.rollout.backend=sglang "
        "--config.rollout.server_urls=http://h:1 --config.train.weight_export_dir=/s "
        "--config.train.xla_mem_fraction=0.9",
    ]


def test_learner_node_passes_the_router_and_keeps_the_workers_for_the_weight_sync(tmp_path):
    """--router-url is rollout.router_url in the run config the trainer validates; --server-urls
    stays the workers (the weight sync and the context check go to each); a router URL not of the
    form http://HOST:PORT is named."""
    data = tmp_path / "train.parquet"
    data.touch()
    base = ["--dry-run", "--server-urls", "http://10.0.0.1:30000,http://10.0.0.2:30000", "--shared-dir", str(tmp_path)]
    out = run("learner_node.sh", *base, "--router-url", "http://10.0.0.9:29900", "c", str(tmp_path), str(data), "w")
    assert out.returncode == 0, out.stderr
    config = _trainer_config(out.stdout.splitlines()[0])
    assert (config.rollout.router_url, config.rollout.server_urls) == (
        "http://10.0.0.9:29900", "http://10.0.0.1:30000,http://10.0.0.2:30000")
    bad = run("learner_node.sh", *base, "--router-url", "10.0.0.9:29900", "c", "m", "d", "w")
    assert bad.returncode == 2 and "router URL '10.0.0.9:29900' is not of the form http://HOST:PORT" in bad.stderr


def _trainer_config(line: str):
    """The run config the trainer builds from a dry-run line (the paper's configs/qwen3_4b_cleaner.py
    in place of its --config): absl's config flags parse the overrides as train's main does, then
    the schema validates them."""
    from absl import flags
    from ml_collections import config_flags

    from cleaner_jax.config import validate

    argv = shlex.split(line[2:])
    argv = ["train", *argv[argv.index("cleaner_jax.train") + 1:]]
    argv[argv.index("--config") + 1] = str(ROOT / "configs" / "qwen3_4b_cleaner.py")
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
    flags.DEFINE_string("workdir", None, "", flag_values=fv)
    fv(argv)
    return validate(fv.config)


def test_the_mem_fraction_reaches_the_trainer_as_its_config_key(tmp_path):
    """--mem-fraction is train.xla_mem_fraction in the run config the trainer validates (an
    XLA_PYTHON_CLIENT_MEM_FRACTION in the environment is dropped by session.apply_xla_memory, so
    the scripts used to run the learner at JAX's 0.75); a key after `--` wins; `none` leaves the
    config's value."""
    data = tmp_path / "train.parquet"
    data.touch()
    paths = [str(tmp_path), str(data)]  # the schema checks that the model directory and the data exist
    base = ["--dry-run", "--server-urls", "http://h:1", "--shared-dir", str(tmp_path), "c", *paths, "w"]
    for args, expected in [([], 0.9), (["--mem-fraction", "0.55"], 0.55), (["--mem-fraction", "none"], None),
                           (["--mem-fraction", "0.55", "--", "--config.train.xla_mem_fraction=0.7"], 0.7)]:
        out = run("learner_node.sh", *base, *args)
        assert out.returncode == 0, out.stderr
        assert _trainer_config(out.stdout.splitlines()[0]).train.xla_mem_fraction == expected, args
    single = run("train_single_node.sh", "--dry-run", "c", *paths, "w", "1", "2")
    assert single.returncode == 0, single.stderr
    assert _trainer_config(single.stdout.splitlines()[-1]).train.xla_mem_fraction == 0.9


@pytest.mark.parametrize("value", ["0", "1.5", "0.9x", "-0.5"])
def test_a_bad_mem_fraction_is_named(value):
    out = run("learner_node.sh", "--dry-run", "--server-urls", "http://h:1", "--shared-dir", "/s",
              "--mem-fraction", value, "c", "m", "d", "w")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert f"--mem-fraction must be a number in (0, 1] (e.g. 0.9) or none (the config's train.xla_mem_fraction), " \
           f"got '{value}'" in out.stderr


def test_no_launch_script_sets_the_xla_memory_variables():
    """train's main sets them from the config and drops or replaces what it finds in the
    environment (session.apply_xla_memory), so a script that sets one has no effect: it must
    pass the config key instead."""
    from cleaner_jax import session

    for script in SCRIPTS:
        code = "\n".join(line for line in script.read_text().splitlines() if not line.lstrip().startswith("#"))
        for name in [session.DEPRECATED_MEM_FRACTION, *session.XLA_MEMORY_ENV]:
            assert f"{name}=" not in code, (f"{script.name} sets {name}, which train's main ignores: pass "
                                            f"--config.{session.XLA_MEMORY_ENV.get(name, 'train.xla_mem_fraction')}")


def test_the_learner_overrides_are_keys_of_the_config_schema():
    """Every --config.KEY=VALUE the learner script passes names a key the trainer accepts (the
    trainer's own check, run before absl parses them), and the check does reject a wrong one."""
    from cleaner_jax.config import check_override_keys
    from cleaner_jax.schema import ConfigError

    out = run("learner_node.sh", "--dry-run", "--server-urls", "http://h:1", "--shared-dir", "/s",
              "--coordinator", "h:1", "--num-processes", "2", "--process-id", "0", "c", "m", "d", "w")
    argv = shlex.split(out.stdout.splitlines()[0][2:])
    overrides = [a for a in argv if a.startswith("--config.")]
    assert len(overrides) == 10, overrides
    check_override_keys(overrides)
    with pytest.raises(ConfigError, match="config.distributed.process_rank: unknown key"):
        check_override_keys(["--config.distributed.process_rank=0"])


def test_train_single_node_dry_run_prints_the_servers_and_the_trainer():
    out = run("train_single_node.sh", "--dry-run", "--deterministic-inference", "cfg.py", "/models/Q", "/d.parquet",
              "runs/x", "1", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "+ env CUDA_VISIBLE_DEVICES=0 python -m sglang.launch_server --model-path /models/Q --host 127.0.0.1 "
        "--port 30000 --tp 1 --dtype float16 --mem-fraction-static 0.6 --skip-tokenizer-init "
        "--enable-deterministic-inference >logs/sglang-0.log 2>&1",
        "+ env CUDA_VISIBLE_DEVICES=1,2 python -m cleaner_jax.train --config cfg.py "
        "--workdir runs/x --config.model.path=/models/Q --config.data.train=/d.parquet --config.rollout.backend=sglang "
        "--config.rollout.server_urls=http://127.0.0.1:30000 --config.train.xla_mem_fraction=0.9",
    ]


def test_dry_run_quotes_words_a_shell_would_split():
    out = run("learner_node.sh", "--dry-run", "--server-urls", "http://h:1", "--shared-dir", "/s", "my cfg.py", "m",
              "d", "it's")
    assert out.returncode == 0, out.stderr
    assert "--config 'my cfg.py' --workdir 'it'\"'\"'s' " in out.stdout  # as shlex.quote writes them


# ----------------------------------------------------------------------------- prerequisites


def fake_python(tmp_path: Path, importable: bool) -> Path:
    py = tmp_path / "fakepython"
    py.write_text("#!/bin/sh\n" + ("exit 0\n" if importable else 'echo "ModuleNotFoundError" >&2; exit 1\n'))
    py.chmod(0o755)
    return py


@pytest.mark.parametrize("script,args,module", [
    ("sglang_servers.sh", ["/m", "1"], "sglang"),
    ("router.sh", ["http://127.0.0.1:1"], "sglang_router"),
])
def test_a_missing_python_package_is_named(tmp_path, script, args, module):
    py = fake_python(tmp_path, importable=False)
    out = run(script, "--python", str(py), "--log-dir", str(tmp_path / "logs"), *args)
    assert out.returncode == 2
    assert f"prerequisite: python package '{module}' is not importable by {py}" in out.stderr
    assert "pip install" in out.stderr


def test_a_missing_python_is_named(tmp_path):
    out = run("sglang_servers.sh", "--python", "/nonexistent/python3", "/m", "1")
    assert out.returncode == 2
    assert "prerequisite: python '/nonexistent/python3' not found (pass --python PATH)" in out.stderr


def test_a_missing_binary_is_named(tmp_path):
    """PATH with only what the script needs before its checks: curl is missing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "basename"):
        (bin_dir / tool).symlink_to(subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True,
                                                   text=True).stdout.strip())
    out = run("sglang_servers.sh", "--python", sys.executable, "/m", "1", env={"PATH": str(bin_dir)})
    assert out.returncode == 2
    assert "prerequisite: 'curl' is not on PATH (the readiness check polls each server's /health)" in out.stderr


def test_an_unknown_interface_is_named():
    out = run("sglang_servers.sh", "--interface", "nosuch0", "--python", sys.executable, "/m", "1")
    assert out.returncode == 2
    assert "prerequisite: network interface 'nosuch0' not found (this node has: " in out.stderr
    assert " lo" in out.stderr.split("this node has:")[1] or "lo " in out.stderr.split("this node has:")[1]


@pytest.mark.parametrize("shared,message", [
    ("/nonexistent/shared", "prerequisite: --shared-dir '/nonexistent/shared' does not exist (or is not a directory)"),
    ("/proc", "prerequisite: --shared-dir '/proc' is not writable (a file could not be created there)"),
])
def test_an_unusable_shared_dir_is_named(shared, message):
    out = run("learner_node.sh", "--python", sys.executable, "--server-urls", "http://127.0.0.1:1",
              "--shared-dir", shared, "c", "m", "d", "w")
    assert out.returncode == 2
    assert message in out.stderr


def test_a_rollout_server_that_never_answers_is_named(tmp_path):
    dead = f"http://127.0.0.1:{free_loopback_port()}"
    out = run("learner_node.sh", "--python", sys.executable, "--server-urls", dead, "--shared-dir", str(tmp_path),
              "--wait-servers", "1", "c", "m", "d", "w")
    assert out.returncode == 2
    assert f"{dead} did not answer /health within 1 s" in out.stderr


@pytest.mark.parametrize("script,args,message", [
    ("router.sh", [], "no worker URL given"),
    ("router.sh", ["10.0.0.1:30000"], "worker URL '10.0.0.1:30000' is not of the form http://HOST:PORT"),
    ("learner_node.sh", ["--shared-dir", "/s", "c", "m", "d", "w"], "--server-urls is required"),
    ("learner_node.sh", ["--server-urls", "http://h:1", "c", "m", "d", "w"], "--shared-dir is required"),
    ("learner_node.sh", ["--server-urls", "http://h:1", "--shared-dir", "/s", "--process-id", "0", "c", "m", "d", "w"],
     "--coordinator, --num-processes and --process-id go together"),
    ("learner_node.sh", ["--server-urls", "http://h:1", "--shared-dir", "/s", "--coordinator", "h:1",
                         "--num-processes", "2", "--process-id", "2", "c", "m", "d", "w"],
     "--process-id 2 must be in 0 .. --num-processes-1 (2)"),
    ("sglang_servers.sh", ["--interface", "lo", "--host", "1.2.3.4", "/m"], "--interface and --host are exclusive"),
    ("train_single_node.sh", ["c", "m", "d", "w", "4", "4"], "ROLLOUT_GPUS (4) must be at least 1 and below TOTAL_GPUS (4)"),
])
def test_bad_arguments_are_named_even_in_a_dry_run(script, args, message):
    out = run(script, "--dry-run", *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr



@pytest.mark.parametrize("script,args", [
    ("sglang_servers.sh", ["--log-dir"]),
    ("sglang_servers.sh", ["--log-dir", "", "/m"]),
    ("router.sh", ["http://h:1", "--port"]),
    ("learner_node.sh", ["--server-urls", "http://h:1", "--shared-dir"]),
])
def test_an_option_without_its_value_stops_with_the_usage(script, args):
    out = run(script, "--dry-run", *args)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert f"usage: {LAUNCH / script} " in out.stderr and not out.stdout


@pytest.mark.parametrize("script,args,unknown", [
    ("sglang_servers.sh", ["--bogus", "/m"], "--bogus"),
    ("sglang_servers.sh", ["--", "/m"], "--"),  # the SGLang flags' `--` comes after MODEL_DIR
    ("train_single_node.sh", ["--", "c", "m", "d", "w"], "--"),
    ("router.sh", ["http://h:1", "--nope"], "--nope"),
    ("learner_node.sh", ["--server-urls", "http://h:1", "--what", "c", "m", "d", "w"], "--what"),
])
def test_an_unknown_option_is_named_with_the_usage(script, args, unknown):
    out = run(script, "--dry-run", *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert f"{script}: unknown option {unknown}; usage: " in out.stderr


@pytest.mark.parametrize("script,args", [
    ("sglang_servers.sh", ["-h"]), ("router.sh", ["--help"]), ("learner_node.sh", ["-h"]),
    ("train_single_node.sh", ["--help", "--bogus"]),
])
def test_help_prints_the_usage_and_runs_nothing(script, args):
    out = run(script, *args)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: {LAUNCH / script} [--dry-run] ") and out.stdout.count("\n") == 1


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.name != "_common.sh"], ids=lambda p: p.name)
def test_every_launch_script_is_executable_in_git(script):
    """docs/scaling.md runs them as `launch/x.sh`: without the mode bit in git a checkout gives
    "Permission denied" (learner_node.sh was 100644); the other tests run them through `bash`."""
    mode = subprocess.run(["git", "ls-files", "-s", str(script.relative_to(ROOT))], capture_output=True, text=True,
                          cwd=ROOT, check=True).stdout.split()[0]
    assert mode == "100755", f"{script.name} is {mode} in git: git update-index --chmod=+x launch/{script.name}"
    assert os.access(script, os.X_OK), f"{script.name} is not executable here: chmod +x launch/{script.name}"


@pytest.mark.parametrize("script", ["sglang_servers.sh", "router.sh", "learner_node.sh", "train_single_node.sh"])
def test_scripts_run_directly_as_the_docs_say(script):
    out = subprocess.run([f"launch/{script}", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: launch/{script} [--dry-run] ")


def test_options_and_arguments_mix_where_the_script_passes_words_through():
    """router.sh and learner_node.sh take options after their arguments too; the words after `--`
    go to the program as they are, options included."""
    out = run("router.sh", "--dry-run", "http://a:1", "--port", "5", "http://b:2,http://c:3", "--", "--port", "6")
    assert out.returncode == 0, out.stderr
    cmd = shlex.split(out.stdout.splitlines()[0][2:].split(" >")[0])
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--policy")] == ["http://a:1", "http://b:2", "http://c:3"]
    assert cmd[cmd.index("--port") + 1] == "5" and cmd[-2:] == ["--port", "6"]
    assert out.stdout.splitlines()[1] == "http://127.0.0.1:5"
    out = run("learner_node.sh", "--dry-run", "c", "--server-urls", "http://h:1", "m", "--shared-dir", "/s", "d", "w",
              "--", "--config.train.steps=2")
    assert out.returncode == 0, out.stderr
    cmd = shlex.split(out.stdout.splitlines()[0][2:])
    assert cmd[cmd.index("--config") + 1] == "c" and cmd[cmd.index("--workdir") + 1] == "w"
    assert "--config.model.path=m" in cmd and "--config.data.train=d" in cmd and cmd[-1] == "--config.train.steps=2"


def test_servers_take_their_arguments_after_the_options_only():
    """sglang_servers.sh stops reading options at MODEL_DIR: an option after it is refused, named."""
    out = run("sglang_servers.sh", "--dry-run", "/m", "1", "--log-dir")
    assert out.returncode == 2
    assert ("sglang_servers.sh: option '--log-dir' among the arguments: this script's options go before MODEL_DIR, "
            "flags for sglang.launch_server after '--'; usage: ") in out.stderr


def test_sglang_flags_after_the_arguments_reach_every_server():
    """What colocated rollouts need from real SGLang (docs/scaling.md, "Colocated placement"):
    the words after `--` end every server's command line, as they are (quoted for the shell)."""
    flags = ["--enable-memory-saver", "--enable-weights-cpu-backup", "--json-model-override-args", '{"a": 1}']
    for args in (["/m", "2", "31000", "bfloat16"], ["/m", "2"]):  # after DTYPE, or before the defaults
        out = run("sglang_servers.sh", "--dry-run", *args, "--", *flags)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert len(lines) == 3, lines
        for g, line in enumerate(lines[:2]):
            cmd, log = line[2:].split(" >")
            assert shlex.split(cmd)[-5:] == ["--skip-tokenizer-init", *flags], line
            assert log == f"logs/sglang-{g}.log 2>&1"
        assert lines[2].count("http://") == 2  # the URL line
    out = run("sglang_servers.sh", "--dry-run", "/m", "1", "--")  # an empty pass-through is none
    assert out.returncode == 0 and out.stdout.splitlines()[0].endswith(" --skip-tokenizer-init >logs/sglang-0.log 2>&1")


@pytest.mark.parametrize("script,args,message", [
    ("sglang_servers.sh", ["/m", "1", "30000", "float16", "--enable-memory-saver"],
     "option '--enable-memory-saver' among the arguments: this script's options go before MODEL_DIR, flags for "
     "sglang.launch_server after '--'"),
    ("sglang_servers.sh", ["/m", "1", "30000", "float16", "extra"],
     "unexpected argument 'extra': the arguments are MODEL_DIR NUM_GPUS FIRST_PORT DTYPE, flags for "
     "sglang.launch_server after '--'"),
    ("train_single_node.sh", ["c", "m", "d", "w", "1", "2", "x"],
     "unexpected argument 'x': the arguments are CONFIG MODEL_DIR TRAIN_DATA WORKDIR ROLLOUT_GPUS TOTAL_GPUS; usage: "),
    ("train_single_node.sh", ["c", "m", "d", "w", "--", "--config.train.steps=1"],
     "unexpected argument '--config.train.steps=1' after '--': this script passes no flags through; usage: "),
])
def test_a_word_a_script_cannot_place_is_refused(script, args, message):
    """The servers' launcher used to drop every word after DTYPE (exit 0, the flags lost)."""
    out = run(script, "--dry-run", *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert f"{script}: {message}" in out.stderr and not out.stdout


def test_a_switch_given_twice_is_passed_twice():
    out = run("train_single_node.sh", "--dry-run", "--deterministic-inference", "--deterministic-inference",
              "c", "m", "d", "w", "1", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].count(" --enable-deterministic-inference") == 2

# ----------------------------------------------------------------------------- cleanup


@pytest.fixture
def stand_ins(tmp_path):
    """PATH with a `python` whose servers sleep (recording their pids) and a healthy `curl`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f"""#!/bin/sh
case "$*" in
  *sglang.launch_server*) echo $$ >> {tmp_path}/server_pids; exec sleep 300 ;;
  *cleaner_jax.train*) echo "$@" >> {tmp_path}/trainer_argv; sleep 1; exit 0 ;;
  *) exit 0 ;;
esac
""")
    (bin_dir / "curl").write_text("#!/bin/sh\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _pids(path: Path, n: int, timeout_s: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and len(path.read_text().split()) >= n):
        assert time.monotonic() < deadline, f"{path} did not list {n} pids"
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


def _gone(pids: list[int], timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def decoy():
    """Another user's 'server' on the same node: the same command line as the stand-in servers."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_sglang_servers_stop_their_own_servers_and_nothing_else(tmp_path, stand_ins, decoy):
    script = subprocess.Popen(["bash", str(LAUNCH / "sglang_servers.sh"), "--urls-file", str(tmp_path / "urls"),
                               "/models/m", "2", "31000"], cwd=tmp_path, env=stand_ins,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert script.stdout.readline().strip() == "http://127.0.0.1:31000,http://127.0.0.1:31001"
        assert (tmp_path / "urls").read_text().strip() == "http://127.0.0.1:31000,http://127.0.0.1:31001"
        servers = _pids(tmp_path / "server_pids", 2)
        assert all(psutil.pid_exists(p) for p in servers)
        assert script.poll() is None  # it stays in the foreground while its servers run
        os.kill(script.pid, signal.SIGTERM)
        script.wait(60)
        assert _gone(servers), "the script's servers survived its exit"
        assert decoy.poll() is None, "the script killed a process it did not start"
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait(10)
        for p in _pids(tmp_path / "server_pids", 0) if (tmp_path / "server_pids").exists() else []:
            if psutil.pid_exists(p):
                os.kill(p, signal.SIGKILL)


def test_train_single_node_stops_its_servers_when_the_trainer_ends(tmp_path, stand_ins, decoy):
    out = subprocess.run(["bash", str(LAUNCH / "train_single_node.sh"), "cfg.py", "/models/Q", "/d.parquet", "runs/x",
                          "2", "4"], cwd=tmp_path, env=stand_ins, capture_output=True, text=True, timeout=120)
    servers = _pids(tmp_path / "server_pids", 2, timeout_s=1)
    try:
        assert out.returncode == 0, out.stderr
        argv = (tmp_path / "trainer_argv").read_text().split()
        assert "--config.rollout.server_urls=http://127.0.0.1:30000,http://127.0.0.1:30001" in argv
        assert _gone(servers), "the servers outlived the run"
        assert decoy.poll() is None, "the script killed a process it did not start"
    finally:
        for p in servers:
            if psutil.pid_exists(p):
                os.kill(p, signal.SIGKILL)


def _stand_in_bin(tmp_path: Path, python: str, curl_status: int) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text("#!/bin/sh\n" + python)
    (bin_dir / "curl").write_text(f"#!/bin/sh\nexit {curl_status}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STOP_GRACE_S": "1"}


def test_a_router_that_exits_before_it_is_ready_is_named_with_its_log(tmp_path):
    env = _stand_in_bin(tmp_path, 'case "$*" in *launch_router*) echo "bind failed: port taken"; exit 3 ;; esac\n',
                        curl_status=7)  # never ready
    port = free_loopback_port()
    out = run("router.sh", "--port", str(port), "--log-dir", str(tmp_path / "logs"), "http://127.0.0.1:1",
              env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert f"exited before http://127.0.0.1:{port}/readiness answered; see {tmp_path}/logs/router.log" in out.stderr
    assert "bind failed: port taken" in out.stderr  # the end of its log, to see why
    assert not out.stdout  # no URL: nothing is ready


def test_train_single_node_names_a_servers_launcher_that_failed(tmp_path):
    """sglang_servers.sh dies on its prerequisite check: the run stops, with that script's message,
    before any trainer starts."""
    env = _stand_in_bin(tmp_path, 'case "$*" in *"import sglang"*) exit 1 ;; *cleaner_jax.train*) touch trained ;; '
                                  'esac\nexit 0\n', curl_status=0)
    out = subprocess.run(["bash", str(LAUNCH / "train_single_node.sh"), "c", "m", "d", "w", "1", "2"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "launch/sglang_servers.sh exited before its servers were healthy; see logs/" in out.stderr
    assert "prerequisite: python package 'sglang' is not importable by python" in out.stderr
    assert not (tmp_path / "trained").exists()
