"""Worker settings: the one value the supervisor hands to every server worker.

A worker is started as ``python -m kiamfast.server.worker --settings-json JSON`` (or through
``run_worker(settings, ...)`` in-process), so everything it needs to know must survive a
JSON round trip: plain numbers, strings and booleans only. The IMDSv2 token key is secret
and shared by every worker (tokens must verify in any worker and across restarts). The
supervisor hands it over as ``token_key_fd``, an inherited in-memory file (memfd) it wrote
the key into, so the key never shows up in a process listing and, with
``--token-key-file ""``, never touches a file system; tests pass it as hex in
``token_key`` or as a path in ``token_key_file``.

This module must stay importable without uvloop, httptools, kubernetes or botocore: the
supervisor builds settings, the worker consumes them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any


class SettingsError(ValueError):
    """A worker setting is missing, malformed or out of range."""


IMDSV2_MODES = ("optional", "required")


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a server worker needs, independent of the table and the channel."""

    app_port: int = 8181
    listen_host: str | None = None  # None: "::" dual-stack (IPv4 peers as ::ffff:a.b.c.d)
    metrics_port: int | None = None  # None or == app_port: /metrics on the app port only
    metadata_addr: str = "169.254.169.254"  # upstream host[:port] for the passthrough
    imdsv2: str = "optional"  # "required": a GET without a token gets 401
    token_key: bytes | None = None  # HMAC key for IMDSv2 tokens (>= 16 bytes)
    token_key_file: str | None = None  # or: a file holding that key (raw bytes)
    token_key_fd: int | None = None  # or: an inherited fd holding it (what the supervisor uses)
    wait_budget: float = 0.35  # seconds a request may wait for an unknown or pending pod
    debug: bool = False  # serve /debug/store
    host_ip: str = ""  # reported by /healthz (kube2iam shape)
    base_role_arn: str = ""  # for error texts
    upstream_timeout: float = 0.3  # whole passthrough exchange, connect included
    upstream_token_ttl: int = 21600  # TTL the worker asks for its own upstream token
    # Passthrough bound per worker and client address (429 beyond it): one pod cannot make
    # the node's metadata service throttle the agent and the other pods.
    passthrough_rate: float = 10.0  # requests per second, refilled continuously
    passthrough_burst: int = 40  # requests at once after a quiet spell
    passthrough_concurrency: int = 4  # requests upstream at the same time
    idle_timeout: float = 60.0  # keep-alive connection with no request in progress
    request_timeout: float = 10.0  # one request, first byte to last (slow clients)
    max_url: int = 8192  # request target bytes -> 414
    max_header_bytes: int = 16384  # all header names + values -> 431
    max_headers: int = 100  # header count -> 431
    max_body: int = 65536  # request body bytes -> 413
    max_pipeline: int = 32  # queued responses before the worker stops reading
    max_connections: int = 16384  # per worker; beyond it new connections are closed
    # per worker and client address: one pod holding idle connections cannot lock the
    # others out (load generators from one address: raise it)
    max_connections_per_client: int = 256
    # SO_REUSEPORT when a worker binds the port itself (tests). The supervisor binds once
    # and hands every worker the same socket, so no other process can share the port.
    reuse_port: bool = False
    backlog: int = 2048
    # --worker-realtime: SCHED_RR within a CPU budget (server/realtime.py)
    realtime: bool = False

    def __post_init__(self) -> None:
        if self.imdsv2 not in IMDSV2_MODES:
            raise SettingsError(f"imdsv2 must be one of {IMDSV2_MODES}, not {self.imdsv2!r}")
        if not 0 < self.app_port < 65536:
            raise SettingsError(f"app_port out of range: {self.app_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise SettingsError(f"metrics_port out of range: {self.metrics_port}")
        if not 0 <= self.wait_budget <= 5:
            raise SettingsError(f"wait_budget must be within 0..5 s, not {self.wait_budget}")
        if self.token_key is not None and len(self.token_key) < 16:
            raise SettingsError("token_key must be at least 16 bytes")
        if not 1 <= self.upstream_token_ttl <= 21600:
            raise SettingsError("upstream_token_ttl must be within 1..21600")
        if not self.passthrough_rate > 0:
            raise SettingsError("passthrough_rate must be positive")
        for name in ("max_url", "max_header_bytes", "max_headers", "max_pipeline",
                     "max_connections", "max_connections_per_client", "passthrough_burst",
                     "passthrough_concurrency"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be positive")
        self.upstream  # validates metadata_addr

    # -- derived values ---------------------------------------------------------------

    @property
    def upstream(self) -> tuple[str, int]:
        """``metadata_addr`` as (host, port); ``[v6]:port`` and bare hosts accepted."""
        addr = self.metadata_addr.strip()
        if not addr:
            raise SettingsError("metadata_addr is empty")
        if addr.startswith("http://"):
            addr = addr[len("http://"):].rstrip("/")
        if addr.startswith("["):
            host, _, rest = addr[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ""
        elif addr.count(":") == 1:
            host, _, port = addr.partition(":")
        else:
            host, port = addr, ""
        try:
            port_n = int(port) if port else 80
        except ValueError:
            raise SettingsError(f"bad port in metadata_addr {self.metadata_addr!r}") from None
        if not host or not 0 < port_n < 65536:
            raise SettingsError(f"bad metadata_addr {self.metadata_addr!r}")
        return host, port_n

    @property
    def separate_metrics_port(self) -> bool:
        return self.metrics_port is not None and self.metrics_port not in (0, self.app_port)

    def load_token_key(self) -> bytes:
        """The HMAC key for IMDSv2 tokens: ``token_key`` or the contents of the key file."""
        if self.token_key is not None:
            return self.token_key
        if self.token_key_fd is not None:
            try:
                key = os.pread(self.token_key_fd, 4096, 0)
            except OSError as e:
                raise SettingsError(f"cannot read token_key_fd: {e}") from e
            if len(key) < 16:
                raise SettingsError("token_key_fd holds fewer than 16 bytes")
            return key
        if self.token_key_file:
            try:  # never through a symlink someone planted at the path
                fd = os.open(self.token_key_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with os.fdopen(fd, "rb") as f:
                    key = f.read()
            except OSError as e:
                raise SettingsError(f"cannot read token_key_file: {e}") from e
            if len(key) < 16:
                raise SettingsError("token_key_file holds fewer than 16 bytes")
            return key
        raise SettingsError("no IMDSv2 token key: set token_key, token_key_fd or token_key_file")

    # -- JSON round trip ----------------------------------------------------------------

    def to_json(self) -> str:
        data: dict[str, Any] = dataclasses.asdict(self)
        if self.token_key is not None:
            data["token_key"] = self.token_key.hex()
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "WorkerSettings":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise SettingsError(f"settings are not JSON: {e}") from e
        if not isinstance(data, dict):
            raise SettingsError("settings JSON must be an object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SettingsError(f"unknown worker settings: {', '.join(unknown)}")
        key = data.get("token_key")
        if isinstance(key, str):
            try:
                data["token_key"] = bytes.fromhex(key)
            except ValueError as e:
                raise SettingsError("token_key must be hex in JSON") from e
        try:
            return cls(**data)
        except TypeError as e:
            raise SettingsError(str(e)) from e
