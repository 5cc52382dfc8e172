"""The `kiamfast` main process: creates the shared table and channels, starts the children,
restarts them when they die, and stops them cleanly on SIGTERM.

Start order is the node-start order of docs/architecture.md: the workers listen first (a pod
that asks now is held, never answered with another identity), and only then does the control
process start, install the DNAT rule, sync, prefetch and mark the agent ready.

The supervisor never touches Kubernetes, STS or a request.  If the control process dies, the
workers keep serving what the table holds until it is restarted and has rebuilt it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import orjson

from kiamfast import channel, logs
from kiamfast.config import Config
from kiamfast.server.settings import WorkerSettings
from kiamfast.table import Table

log = logging.getLogger("kiamfast.supervisor")

RESTART_BACKOFF_MIN = 0.5
RESTART_BACKOFF_MAX = 10.0
HEALTHY_AFTER = 30.0          # a child that ran this long restarts with the minimum backoff
STOP_GRACE = 10.0


def config_to_json(config: Config) -> str:
    """The control process's configuration, handed over on its command line.  Fields the
    config derived from others are left out, so the child derives them the same way."""
    doc = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)
           if f.init and f.name not in config.derived}
    doc["explicit"] = sorted(config.explicit)
    return orjson.dumps(doc).decode()


def config_from_json(text: str) -> Config:
    doc = orjson.loads(text)
    doc["explicit"] = frozenset(doc.get("explicit", ()))
    return Config(**doc)


def worker_settings(config: Config, token_key_file: str) -> WorkerSettings:
    return WorkerSettings(
        app_port=config.app_port,
        listen_host=config.listen_host or None,
        metrics_port=config.metrics_port,
        metadata_addr=config.metadata_addr,
        imdsv2=config.imdsv2,
        token_key_file=token_key_file,
        wait_budget=config.wait_budget,
        debug=config.debug,
        host_ip=config.host_ip,
        base_role_arn=config.base_role_arn,
    )


def ensure_token_key(path: str) -> str:
    """The IMDSv2 token key all workers share; kept in a file so tokens survive restarts."""
    try:
        with open(path, "rb") as f:
            if len(f.read()) >= 16:
                return path
    except FileNotFoundError:
        pass
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    os.rename(path + ".tmp", path)
    return path


@dataclasses.dataclass
class Child:
    name: str
    argv: list[str]
    fds: tuple[int, ...]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    backoff: float = RESTART_BACKOFF_MIN
    restart_at: float = 0.0
    restarts: int = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, pass_fds=self.fds)
        self.started = time.monotonic()
        log.info("started %s", self.name, extra={"pid": self.proc.pid})


class Supervisor:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.stopping = False
        self.children: list[Child] = []

    # ---- set-up -----------------------------------------------------------------------------

    def prepare(self) -> None:
        cfg = self.config
        self.table = Table.create(cfg.table_path, max_workers=max(64, cfg.workers))
        key_file = ensure_token_key(cfg.token_key_file or cfg.table_path + ".token-key")
        self.pairs = [channel.socketpair() for _ in range(cfg.workers)]
        settings = worker_settings(cfg, key_file).to_json()
        py = sys.executable
        for i, (_, worker_end) in enumerate(self.pairs):
            self.children.append(Child(
                name=f"worker-{i}",
                argv=[py, "-m", "kiamfast.server.worker", "--table", cfg.table_path,
                      "--channel-fd", str(worker_end.fileno()), "--worker-index", str(i),
                      "--settings-json", settings],
                fds=(worker_end.fileno(),)))
        control_fds = tuple(c.fileno() for c, _ in self.pairs)
        self.control = Child(
            name="control",
            argv=[py, "-m", "kiamfast.control", "--table", cfg.table_path,
                  "--channel-fds", ",".join(map(str, control_fds)),
                  "--config-json", config_to_json(cfg)],
            fds=control_fds)

    def wait_listening(self, timeout: float = 10.0) -> bool:
        host = self.config.listen_host or "127.0.0.1"
        if host in ("::", "0.0.0.0"):
            host = "127.0.0.1"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(c.proc and c.proc.poll() is not None for c in self.children):
                return False
            try:
                socket.create_connection((host, self.config.app_port), timeout=0.2).close()
                return True
            except OSError:
                time.sleep(0.02)
        return False

    # ---- running ----------------------------------------------------------------------------

    def run(self) -> int:
        self.prepare()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for child in self.children:
            child.start()
        if not self.wait_listening():
            log.error("workers did not start listening on port %d", self.config.app_port)
            self.stop()
            return 1
        self.control.start()
        self.children.append(self.control)
        while not self.stopping:
            self._reap_and_restart()
            time.sleep(0.1)
        self.stop()
        return 0

    def _on_signal(self, signum, frame) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        self.stopping = True

    def _reap_and_restart(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.proc is None:
                if now >= child.restart_at:
                    child.start()
                continue
            code = child.proc.poll()
            if code is None:
                continue
            ran = now - child.started
            child.backoff = RESTART_BACKOFF_MIN if ran > HEALTHY_AFTER else min(
                child.backoff * 2, RESTART_BACKOFF_MAX)
            child.restart_at = now + child.backoff
            child.restarts += 1
            child.proc = None
            log.warning("%s exited with %s after %.1fs; restarting in %.1fs", child.name, code,
                        ran, child.backoff)

    def stop(self) -> None:
        """SIGTERM every child (workers finish in-flight requests), then SIGKILL stragglers."""
        live = [c.proc for c in self.children if c.proc and c.proc.poll() is None]
        for p in live:
            p.terminate()
        deadline = time.monotonic() + STOP_GRACE
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.info("stopped")


def run(config: Config) -> int:
    logs.setup(log_format=config.log_format, level=config.effective_log_level)
    return Supervisor(config).run()
