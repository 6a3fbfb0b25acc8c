"""Where process 0's coordinator service listens: on the address the config gives, not on every
interface (jax's default, `[::]:PORT`, put a loopback run's coordinator on the network).

The two-process runs themselves are tests/test_multihost*.py; here one explicit-mode process
joins alone (about a second) so that the socket it listens on can be read back.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cleaner_jax import distributed
from cleaner_jax.distributed import DistributedConfig
from cleaner_jax.rollout.fleet import free_loopback_port
from cleaner_jax.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXPLICIT = dict(mode="explicit", coordinator_address="127.0.0.1:8476", num_processes=2, process_id=0)


@pytest.mark.parametrize("cfg,expected", [
    (EXPLICIT, "127.0.0.1:8476"),
    ({**EXPLICIT, "coordinator_address": "[::1]:9000"}, "[::1]:9000"),
    ({**EXPLICIT, "coordinator_address": "node-0.cluster:8476"}, "node-0.cluster:8476"),
    ({**EXPLICIT, "coordinator_bind_address": "[::]:8476"}, "[::]:8476"),  # every interface, when asked
    ({**EXPLICIT, "coordinator_bind_address": "10.0.0.1:8476"}, "10.0.0.1:8476"),
    (dict(mode="auto"), None),  # jax's default on the detected coordinator's port
    (dict(mode="auto", coordinator_bind_address="10.0.0.1:8476"), "10.0.0.1:8476"),
], ids=["loopback", "ipv6", "name", "wildcard", "key", "auto", "auto-key"])
def test_initialize_binds_the_coordinator_to_the_address_given(monkeypatch, cfg, expected):
    calls = []
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(distributed.jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.jax.config, "update", lambda *a: None)  # gloo: nothing to set here
    assert distributed.initialize(DistributedConfig(**cfg))
    [(args, kwargs)] = calls
    assert kwargs["coordinator_bind_address"] == expected
    if cfg["mode"] == "explicit":
        assert args == (cfg["coordinator_address"],)


@pytest.mark.parametrize("cfg,message", [
    ({**EXPLICIT, "coordinator_bind_address": "0.0.0.0"},
     r"^config\.distributed\.coordinator_bind_address: '0\.0\.0\.0' is not HOST:PORT \(e\.g\. \[::\]:8476\)$"),
    (dict(mode="off", coordinator_bind_address="127.0.0.1:1"),
     r"^config\.distributed\.coordinator_bind_address: '127\.0\.0\.1:1' is set but distributed\.mode='off'"),
])
def test_a_bad_bind_address_is_named(cfg, message):
    with pytest.raises(ConfigError, match=message):
        distributed.check(DistributedConfig(**cfg))


def test_a_loopback_coordinator_listens_on_loopback_only():
    """A real jax.distributed service (one process, explicit mode): the socket on the coordinator's
    port is bound to 127.0.0.1, not to `::` or 0.0.0.0."""
    port = free_loopback_port()
    code = f"""
import json, psutil
from cleaner_jax.distributed import DistributedConfig, initialize
initialize(DistributedConfig(mode="explicit", coordinator_address="127.0.0.1:{port}", num_processes=1, process_id=0,
                             initialization_timeout_s=30))
print(json.dumps([c.laddr.ip for c in psutil.Process().net_connections("inet")
                  if c.status == psutil.CONN_LISTEN and c.laddr.port == {port}]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    ips = json.loads(out.stdout.splitlines()[-1])
    assert ips and all(ip.removeprefix("::ffff:") == "127.0.0.1" for ip in ips), ips  # gRPC's dual-stack socket
