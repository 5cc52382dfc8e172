"""A start with no cluster configured stops before it binds a port or starts a process.

``kiamfast`` with no ``--kubeconfig``, no ``--api-server``/``--api-token`` pair and no
in-cluster environment cannot serve any pod: it says so in one line and exits 78 without
binding ``--app-port`` (which the test holds itself: a bind would fail there with another
message and exit 1) or starting a worker or the control process. A configuration that names a
cluster goes on to the bind as before (exit 1 on the held port), so the check stops only this
case.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kiamfast.config import EXIT_CONFIG
from kiamfast.kube.cluster import NO_CLUSTER

pytestmark = pytest.mark.timeout(120)


def start(tmp_path, *flags: str, **env: str) -> tuple[int, str, int]:
    """(exit code, stderr, the port) of kiamfast started on a port this test holds."""
    held = socket.create_server(("127.0.0.1", 0))
    port = held.getsockname()[1]
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("KUBERNETES_SERVICE_", "AWS_"))}
    try:
        result = subprocess.run(
            [sys.executable, "-m", "kiamfast", "--node=n1", "--host-ip=127.0.0.1",
             "--listen-host=127.0.0.1", f"--app-port={port}", f"--metrics-port={port}",
             f"--table-path={tmp_path / 'table'}", f"--token-key-file={tmp_path / 'key'}",
             "--cri-endpoint=none", "--node-startup-taint=", *flags],
            capture_output=True, text=True, timeout=60, cwd="/", env={**clean, **env})
    finally:
        held.close()
    return result.returncode, result.stderr, port


def test_no_cluster_stops_before_the_bind_and_before_any_process(tmp_path):
    code, log, _ = start(tmp_path)
    assert code == EXIT_CONFIG, log
    errors = [line for line in log.splitlines() if " error " in f" {line} ".lower()
              or "ERROR" in line]
    assert len(errors) == 1 and f"cannot start: {NO_CLUSTER}" in errors[0], log
    assert "listens on port" not in log       # it never tried the held port
    assert "started " not in log              # no worker, no control process
    assert not (tmp_path / "table").exists()  # nor made its state


def test_half_an_api_server_pair_says_which_half(tmp_path):
    code, log, _ = start(tmp_path, "--api-server=https://127.0.0.1:6443")
    assert code == EXIT_CONFIG and "--api-server is used only together with --api-token" in log


@pytest.mark.parametrize("flags, env", [
    (["--api-server=https://127.0.0.1:6443", "--api-token=abc"], {}),
    ([], {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}),
], ids=["api-server-and-token", "in-cluster"])
def test_a_cluster_named_goes_on_to_the_bind(tmp_path, flags, env):
    code, log, port = start(tmp_path, *flags, **env)
    assert code == 1 and f"another process listens on port {port}" in log, log
