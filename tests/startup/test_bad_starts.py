"""Every missing or broken dependency at start gets one line naming what fixes it.

The real ``kiamfast`` command (supervisor, workers, control) is started the way an operator
starts it, with one thing wrong, and we read what they read: its log and exit code, or
``/healthz``.  Two kinds (docs/architecture.md, "Node start and stop"):

* **a configuration error** — no cluster configured, a kubeconfig that is missing, does not
  parse or names no context, a missing credential, iptables missing or refused with
  ``--iptables``, a state file the agent cannot write: one ``error`` line naming the flag,
  no traceback, and the agent stops (78 = ``EXIT_CONFIG`` for what only a configuration
  change cures; 1 for a port another process holds, which a restart may find free); the
  supervisor never restarts a control process that exited 78;
* **an outage** — the API server, the container runtime or STS unreachable or refusing: the
  agent keeps running and answering, says so in one ``warning`` line (at most one every
  30 s) and in ``/healthz``.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from agent_process import POD_IP, ROLE, Fakes, free_port, http

from kiamfast.config import EXIT_CONFIG

BASE_ARN = "arn:aws:iam::123456789012:role/"
LINE = re.compile(r"^\S+Z (\w+)\s+(\S+): (.*)$")    # kiamfast/logs.py's text format
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
CRI_AUTO = ("/run/containerd/containerd.sock", "/var/run/containerd/containerd.sock",
            "/var/run/crio/crio.sock")


@pytest.fixture(scope="module")
def fakes():
    f = Fakes()
    yield f
    f.stop()


def clean_env(**extra: str | None) -> dict[str, str]:
    """The agent's environment: static AWS credentials, no metadata service of the host, no
    in-cluster configuration (CI may run inside a pod), plus ``extra`` (None removes)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KUBERNETES_SERVICE_", "AWS_"))}
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_EC2_METADATA_DISABLED="true", AWS_REGION="us-east-1")
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def agent_argv(tmp: Path, fakes: Fakes | None, *extra: str, port: int | None = None,
               kubeconfig: bool = True) -> list[str]:
    """The agent's command line: everything right (loopback, no iptables, no runtime) but
    what ``extra`` changes; later flags win."""
    port = port or free_port()
    argv = [sys.executable, "-m", "kiamfast", "--node=n1", "--host-ip=127.0.0.1",
            f"--base-role-arn={BASE_ARN}", f"--app-port={port}", f"--metrics-port={port}",
            f"--table-path={tmp / 'table'}", f"--token-key-file={tmp / 'token-key'}",
            "--cri-endpoint=none", "--iptables=false", "--node-startup-taint="]
    if fakes is not None:
        argv += [f"--sts-endpoint={fakes.sts.url}", f"--metadata-addr={fakes.imds.addr}"]
        if kubeconfig:
            argv.append(f"--kubeconfig={fakes.api.write_kubeconfig(str(tmp / 'kubeconfig'))}")
    return [*argv, *extra]


def hiding(*directories: str) -> list[str]:
    """A command prefix that runs the agent with ``directories`` empty (a tmpfs over each
    that exists, in a mount namespace of its own); [] when none exists."""
    present = sorted({os.path.realpath(d) for d in directories if os.path.isdir(d)})
    if not present:
        return []
    if os.geteuid() != 0:
        pytest.skip(f"needs root (a mount namespace hiding {', '.join(present)}): run "
                    "tests/run as root")
    mounts = " && ".join(f"mount -t tmpfs none {d}" for d in present)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'{mounts} && exec "$@"', "sh"]


def records(text: str) -> list[tuple[str, str, str]]:
    """(level, logger, message) of every line; a line that is not a log record (a
    traceback, a stray print) fails the test."""
    out = []
    for line in text.splitlines():
        match = LINE.match(line)
        assert match, f"not a log line: {line!r} in\n{text}"
        out.append(match.groups())
    return out


def loud(text: str) -> list[str]:
    """The messages at warning or above."""
    return [msg for level, _, msg in records(text) if level not in ("info", "debug")]


def start_and_exit(argv: list[str], *, env: dict[str, str] | None = None,
                   timeout: float = 60) -> tuple[int, str]:
    """Run the agent until it exits by itself: (exit code, its log)."""
    proc = subprocess.run(argv, env=env or clean_env(), capture_output=True, text=True,
                          timeout=timeout, cwd="/")
    assert proc.stdout == ""
    return proc.returncode, proc.stderr


def assert_one_line(code: int, log: str, *, exit_code: int, says: list[str]) -> str:
    """The agent stopped with ``exit_code`` after exactly one error line holding ``says``."""
    lines = loud(log)
    assert code == exit_code, log
    assert len(lines) == 1, log
    assert lines[0].startswith("cannot start: "), log
    for words in says:
        assert words in lines[0], (words, log)
    return lines[0]


class Running:
    """An agent that must keep running: its log so far, /healthz, a clean stop."""

    def __init__(self, argv: list[str], tmp: Path, env: dict[str, str] | None = None,
                 popen_prefix: tuple[str, ...] = ()) -> None:
        self.port = int(next(a for a in argv if a.startswith("--app-port=")).split("=")[1])
        self.log_path = tmp / "agent.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*popen_prefix, *argv], env=env or clean_env(),
                                         stdout=log, stderr=log, cwd="/",
                                         start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()

    def health(self) -> dict:
        status, body = http(self.port, "GET /healthz")
        assert status == 200, body
        return orjson.loads(body)

    def wait(self, what, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the agent exited:\n" + self.log()
            try:
                got = what()
            except (OSError, AssertionError, ValueError):
                got = None
            if got:
                return got
            time.sleep(0.1)
        raise AssertionError("never happened; the agent's log:\n" + self.log())

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


# ---- configuration errors: one line, exit, never restarted --------------------------------------

def test_no_cluster_configured_is_one_line_and_exit_78_of_the_whole_agent(tmp_path):
    code, log = start_and_exit(agent_argv(tmp_path, None))
    line = assert_one_line(code, log, exit_code=EXIT_CONFIG,
                           says=["no cluster configured", "--kubeconfig", "--api-server",
                                 "--api-token", "ServiceAccount"])
    assert "Traceback" not in log
    # Said before anything started (tests/cli/test_no_cluster_start.py: nor bound a port).
    started = [m for _, _, m in records(log) if m.startswith("started ")]
    assert started == [], log
    assert "restarting" not in log
    assert "ServiceAccount" in line


@pytest.mark.parametrize("content,says", [
    (None, ["--kubeconfig=", "no such file"]),
    ("clusters: [\n  - a: b\n", ["--kubeconfig=", "does not parse (line 2)"]),
    ("just text", ["--kubeconfig=", "not a kubeconfig"]),
    ("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://x:6443'}}]"
     "\nusers: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, "
     "user: u}}]\n", ["--kubeconfig=", "no current-context", "use-context"]),
    ("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://x:6443'}}]"
     "\nusers: [{name: u, user: {tokenFile: /nonexistent/token}}]\ncontexts: [{name: x, "
     "context: {cluster: c, user: u}}]\ncurrent-context: x\n",
     ["--kubeconfig=", "tokenFile /nonexistent/token", "no such file"]),
], ids=["missing", "not-yaml", "not-a-kubeconfig", "no-context", "token-file-missing"])
def test_a_kubeconfig_that_does_not_load_is_one_line_naming_it(tmp_path, content, says):
    path = tmp_path / "kubeconfig"
    if content is not None:
        path.write_text(content)
    code, log = start_and_exit(agent_argv(tmp_path, None, f"--kubeconfig={path}"))
    line = assert_one_line(code, log, exit_code=EXIT_CONFIG, says=says)
    assert str(path) in line


@pytest.mark.parametrize("flags,env,says", [
    (["--api-server=https://127.0.0.1:6443"], {},
     ["--api-server is used only together with --api-token"]),
    (["--api-token=abc"], {}, ["--api-token is used only together with --api-server"]),
    ([], {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"},
     ["in-cluster configuration", "serviceaccount/token"]),
], ids=["api-server-without-token", "token-without-api-server", "in-cluster-without-token"])
def test_a_missing_credential_is_one_line_naming_it(tmp_path, flags, env, says):
    # In a pod (CI may run in one) the ServiceAccount's token is there: hidden for the agent.
    prefix = hiding(SERVICE_ACCOUNT_DIR) if env else []
    code, log = start_and_exit([*prefix, *agent_argv(tmp_path, None, *flags)],
                               env=clean_env(**env))
    assert_one_line(code, log, exit_code=EXIT_CONFIG, says=says)


def test_iptables_missing_is_one_line_naming_the_flag(tmp_path, fakes):
    # No iptables on PATH (the children run the interpreter by its full path): nothing can
    # touch this host's rules.
    bare = tmp_path / "bin"
    bare.mkdir()
    code, log = start_and_exit(
        agent_argv(tmp_path, fakes, "--iptables", "--host-interface=lo"),
        env=clean_env(PATH=str(bare)))
    assert_one_line(code, log, exit_code=EXIT_CONFIG,
                    says=["--iptables", "iptables not found", "--iptables=false"])


def test_iptables_refused_is_one_line_naming_the_flag_and_the_capability(tmp_path, fakes):
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables: run tests/run as root (or apt-get install iptables)")
    prefix: list[str] = []
    if os.geteuid() == 0:
        # Root without CAP_NET_ADMIN, as a container without the capability: refused (and
        # without it no rule of this host's can change).
        prefix = ["setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin"]
    argv = [*prefix, *agent_argv(tmp_path, fakes, "--iptables", "--host-interface=lo")]
    code, log = start_and_exit(argv)
    assert_one_line(code, log, exit_code=EXIT_CONFIG,
                    says=["--iptables", "Permission denied", "NET_ADMIN", "--iptables=false"])


def test_the_port_taken_is_one_line_naming_app_port(tmp_path, fakes):
    with socket.socket(socket.AF_INET6) as holder:
        holder.bind(("::", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, log = start_and_exit(agent_argv(tmp_path, fakes, port=port))
    assert_one_line(code, log, exit_code=1,
                    says=[f"--app-port={port}", "another process listens",
                          "Address already in use"])


@pytest.mark.parametrize("flag,path,says", [
    ("table-path", "/nonexistent-dir/table", "the directory /nonexistent-dir does not exist"),
    ("table-path", "/sys/kiamfast-table", "is not writable"),
    ("token-key-file", "/nonexistent-dir/key", "the directory /nonexistent-dir does not exist"),
    ("token-key-file", "/sys/kiamfast-key", "is not writable"),
])
def test_a_state_file_it_cannot_write_is_one_line_naming_the_flag(tmp_path, fakes, flag, path,
                                                                   says):
    code, log = start_and_exit(agent_argv(tmp_path, fakes, f"--{flag}={path}"))
    line = assert_one_line(code, log, exit_code=EXIT_CONFIG, says=[f"--{flag}={path}", says])
    if flag == "token-key-file":
        assert "--token-key-file= for a key in memory only" in line


# ---- outages: keep running, one line, /healthz (and /readyz while it holds the start) say why ----

def test_the_api_server_unreachable_keeps_the_agent_up_and_healthz_says_so(tmp_path, fakes):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]       # nothing listens there once closed
    kubeconfig = tmp_path / "dead-kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{dead}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n")
    agent = Running(agent_argv(tmp_path, fakes, f"--kubeconfig={kubeconfig}"), tmp_path)
    try:
        health = agent.wait(lambda: (h := agent.health())["kubernetes"].startswith(
            "unreachable:") and h)
        assert f"127.0.0.1:{dead}" in health["kubernetes"], health
        # /readyz's 503 says what the start waits for, and why.
        status, body = http(agent.port, "GET /readyz")
        assert status == 503, body
        assert body.startswith(b"not ready: waiting for the pods' list from the API server: "
                               b"the API server is unreachable: "), body
        assert f"127.0.0.1:{dead}".encode() in body, body
        time.sleep(8)              # many retries meanwhile (backoff from 50 ms)
        assert agent.proc.poll() is None, agent.log()
        lines = loud(agent.log())
        assert len(lines) == 1, agent.log()     # at most one line every 30 s
        assert "pods list failed" in lines[0] and f"127.0.0.1:{dead}" in lines[0]
        assert "logged at most every 30s" in lines[0]
        assert agent.health()["kubernetes"].startswith("unreachable:")
    finally:
        assert agent.stop() == 0, agent.log()


def test_a_runtime_socket_missing_keeps_the_agent_up_and_healthz_says_so(tmp_path, fakes):
    socket_path = tmp_path / "no-containerd.sock"
    agent = Running(agent_argv(tmp_path, fakes, f"--cri-endpoint={socket_path}"), tmp_path)
    try:
        health = agent.wait(lambda: (h := agent.health())["runtime"].startswith(
            "unreachable:") and h)
        assert str(socket_path) in health["runtime"], health
        # Nothing proves who holds the pod's address (no runtime view, no host route to a
        # loopback address): never served on the API's word alone, but always answered.
        status, _ = http(agent.port, "GET /latest/meta-data/iam/security-credentials/",
                         source=POD_IP)
        assert status in (404, 503), status
        time.sleep(5)
        lines = [m for m in loud(agent.log()) if "runtime" in m]
        # One line for the outage, one for what it means to the addresses' owners.
        assert len(lines) <= 2, agent.log()
        assert any(str(socket_path) in m for m in lines), agent.log()
    finally:
        assert agent.stop() == 0, agent.log()


def test_no_runtime_found_by_auto_is_api_mode_and_healthz_says_so(tmp_path, fakes):
    # A machine running a container runtime: its sockets hidden for the agent.
    prefix = hiding(*(os.path.dirname(p) for p in CRI_AUTO))
    agent = Running(agent_argv(tmp_path, fakes, "--cri-endpoint=auto"), tmp_path,
                    popen_prefix=tuple(prefix))
    try:
        health = agent.wait(lambda: (h := agent.health())["runtime"].startswith(
            "none found:") and h)
        assert "--cri-endpoint=auto" in health["runtime"], health
        assert health["kubernetes"] == "ok"
        agent.wait(lambda: http(agent.port, "GET /latest/meta-data/iam/security-credentials/",
                                source=POD_IP) == (200, ROLE.encode()))
        lines = loud(agent.log())
        assert len(lines) == 1 and "--cri-endpoint=auto" in lines[0], agent.log()
    finally:
        assert agent.stop() == 0, agent.log()


def test_no_aws_credentials_is_one_line_and_what_was_fetched_is_still_served(tmp_path, fakes):
    """The agent's own AWS credentials gone (NoCredentialsError): an outage of STS."""
    # A first start fetches the pod's role into the table ...
    first = Running(agent_argv(tmp_path, fakes), tmp_path)
    try:
        first.wait(lambda: http(first.port, "GET /latest/meta-data/iam/security-credentials/"
                                f"{ROLE}", source=POD_IP)[0] == 200)
    finally:
        assert first.stop() == 0, first.log()
    # ... the next one has no credentials of its own and a new pod to fetch for.
    fakes.api.pods.create("team", "other", node="n1", phase="Running", ips=["127.0.0.6"],
                          annotations={"iam.amazonaws.com/role": "other-role"})
    try:
        second = Running(agent_argv(tmp_path, fakes, port=first.port), tmp_path,
                         env=clean_env(AWS_ACCESS_KEY_ID=None, AWS_SECRET_ACCESS_KEY=None,
                                       AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
                                       AWS_CONFIG_FILE="/nonexistent"))
        try:
            second.wait(lambda: http(second.port, "GET /latest/meta-data/iam/"
                                     f"security-credentials/{ROLE}", source=POD_IP)[0] == 200)
            second.wait(lambda: loud(second.log()))
            time.sleep(3)                       # retries of other-role meanwhile
            lines = loud(second.log())
            assert len(lines) == 1, second.log()
            assert "no AWS credentials of its own" in lines[0]
            assert "instance role" in lines[0] and "AWS_ACCESS_KEY_ID" in lines[0]
        finally:
            assert second.stop() == 0, second.log()
    finally:
        fakes.api.pods.delete("team", "other")
