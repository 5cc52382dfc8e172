"""Where the Authorization header (and an exec plugin's client certificate) comes from.

Four sources, as a kubeconfig or the pod's ServiceAccount names them:

* ``StaticToken`` and ``BasicAuth``: a value that never changes (``--api-token``, a
  kubeconfig's ``token`` or ``username``/``password``).
* ``TokenFile``: a file re-read when it changes, checked at most every ``check_interval``
  seconds (client-go's cached token source re-reads each minute). The kubelet rotates a
  projected ServiceAccount token by swapping a symlink, so the file's inode, size or mtime
  tells. A 401 marks the token stale: the next call reads the file whatever the clock says.
* ``ExecPlugin``: a command printing an ``ExecCredential`` (client.authentication.k8s.io
  v1 or v1beta1), e.g. ``aws eks get-token``. Its answer is cached until its
  ``expirationTimestamp``, and dropped on a 401 so the next call runs the command again.

``authorization()`` may block (a file read, a command): the asyncio client calls it on a
thread when ``fresh()`` says it would. No source retries by itself; the caller's next call
picks up what a 401 invalidated.
"""
from __future__ import annotations

import base64
import datetime
import os
import subprocess
import threading
import time
from typing import Any, Callable

import orjson

from kiamfast.kube.errors import ApiUnavailable, ConfigError

EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
EXEC_TIMEOUT = 60.0


class CredentialError(ApiUnavailable):
    """A credential could not be had right now (an exec plugin failed): retry later."""


class Credentials:
    """No credentials at all (a kubeconfig user with none, or a cluster without auth)."""

    def authorization(self) -> str | None:
        """The Authorization header's value, or None."""
        return None

    def client_cert(self) -> tuple[bytes, bytes] | None:
        """(certificate PEM, key PEM) that changes with the credential (exec plugins only)."""
        return None

    def fresh(self) -> bool:
        """True if ``authorization()`` will answer at once, without a read or a command."""
        return True

    def rejected(self, authorization: str | None) -> None:
        """The API server answered 401 to ``authorization``: get a new one next time."""


class StaticToken(Credentials):
    def __init__(self, token: str) -> None:
        self._value = f"Bearer {token}"

    def authorization(self) -> str | None:
        return self._value


class BasicAuth(Credentials):
    def __init__(self, username: str, password: str) -> None:
        pair = f"{username}:{password}".encode()
        self._value = "Basic " + base64.b64encode(pair).decode()

    def authorization(self) -> str | None:
        return self._value


class TokenFile(Credentials):
    """A bearer token in a file that is replaced while we run (projected tokens)."""

    def __init__(self, path: str, *, what: str, check_interval: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``what`` names the file in a ConfigError (the flag or kubeconfig that gave it)."""
        self.path = path
        self.check_interval = check_interval
        self.clock = clock
        self._lock = threading.Lock()
        try:
            self._identity = _identity(os.stat(path))
            token = _read_token(path)
        except FileNotFoundError:
            raise ConfigError(f"{what}: no such file") from None
        except OSError as e:
            raise ConfigError(f"{what}: cannot read it ({e.strerror})") from None
        if not token:
            raise ConfigError(f"{what}: the file is empty")
        self._value = f"Bearer {token}"
        self._next_check = clock() + check_interval
        self._stale = False
        self.reads = 1

    def fresh(self) -> bool:
        return not self._stale and self.clock() < self._next_check

    def authorization(self) -> str | None:
        if not self.fresh():
            with self._lock:
                self._check()
        return self._value

    def rejected(self, authorization: str | None) -> None:
        if authorization == self._value:
            self._stale = True

    def _check(self) -> None:
        now = self.clock()
        if not self._stale and now < self._next_check:
            return                      # another thread checked while we waited
        self._next_check = now + self.check_interval
        try:
            identity = _identity(os.stat(self.path))
            if identity == self._identity and not self._stale:
                return
            token = _read_token(self.path)
        except OSError:
            return                      # mid-swap, or gone for now: keep the token we have
        self._stale = False
        if token:                       # an empty read is a file being written: keep ours
            self._identity = identity
            self._value = f"Bearer {token}"
            self.reads += 1


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _read_token(path: str) -> str:
    with open(path, "rb") as f:
        return f.read(65536).decode("utf-8", "replace").strip()


class ExecPlugin(Credentials):
    """A credential plugin (``users[].user.exec``), run when its answer is missing, expired
    or was refused. Thread-safe: one run at a time."""

    def __init__(self, *, command: str, args: list[str], env: dict[str, str],
                 api_version: str, what: str, cluster: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.time, timeout: float = EXEC_TIMEOUT) -> None:
        """``what`` names the user in error messages; ``cluster``: the ExecCredential's
        ``spec.cluster`` when the kubeconfig sets provideClusterInfo."""
        self.argv = [command, *args]
        self.env = env
        self.api_version = api_version
        self.what = what
        self.cluster = cluster
        self.clock = clock
        self.timeout = timeout
        self._lock = threading.Lock()
        self._value: str | None = None
        self._cert: tuple[bytes, bytes] | None = None
        self._expires: float | None = None
        self._have = False
        self.runs = 0

    def fresh(self) -> bool:
        return self._have and (self._expires is None or self.clock() < self._expires)

    def authorization(self) -> str | None:
        self._ensure()
        return self._value

    def client_cert(self) -> tuple[bytes, bytes] | None:
        self._ensure()
        return self._cert

    def rejected(self, authorization: str | None) -> None:
        with self._lock:
            if authorization == self._value:
                self._have = False

    def _ensure(self) -> None:
        if self.fresh():
            return
        with self._lock:
            if not self.fresh():
                self._run()

    def _run(self) -> None:
        spec: dict[str, Any] = {"interactive": False}
        if self.cluster is not None:
            spec["cluster"] = self.cluster
        env = {**os.environ, **self.env, "KUBERNETES_EXEC_INFO": orjson.dumps({
            "apiVersion": self.api_version, "kind": "ExecCredential", "spec": spec}).decode()}
        self.runs += 1
        try:
            done = subprocess.run(self.argv, env=env, stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=self.timeout, check=False)
        except subprocess.TimeoutExpired:
            raise CredentialError(f"{self.what}: exec plugin {self.argv[0]!r} gave no "
                                  f"answer in {self.timeout:g}s") from None
        except OSError as e:
            raise CredentialError(f"{self.what}: cannot run exec plugin {self.argv[0]!r}: "
                                  f"{e.strerror}") from None
        if done.returncode != 0:
            last = (done.stderr.decode("utf-8", "replace").strip().splitlines() or [""])[-1]
            raise CredentialError(f"{self.what}: exec plugin {self.argv[0]!r} exited with "
                                  f"{done.returncode}: {last[:300]}")
        self._parse(done.stdout)
        self._have = True

    def _parse(self, out: bytes) -> None:
        def bad(why: str) -> CredentialError:
            return CredentialError(f"{self.what}: exec plugin {self.argv[0]!r}: {why}")
        try:
            cred = orjson.loads(out)
        except orjson.JSONDecodeError:
            raise bad("its output is not JSON") from None
        if not isinstance(cred, dict) or cred.get("kind") != "ExecCredential":
            raise bad("its output is not an ExecCredential")
        if cred.get("apiVersion") != self.api_version:
            raise bad(f"it answered {cred.get('apiVersion')!r}, not {self.api_version!r}")
        status = cred.get("status")
        if not isinstance(status, dict):
            raise bad("its ExecCredential has no status")
        token = status.get("token")
        cert, key = status.get("clientCertificateData"), status.get("clientKeyData")
        if bool(cert) != bool(key):
            raise bad("it gave a client certificate without its key, or a key without one")
        if not token and not cert:
            raise bad("its ExecCredential has neither a token nor a client certificate")
        expires = status.get("expirationTimestamp")
        try:
            self._expires = parse_time(expires) if expires else None
        except ValueError:
            raise bad(f"expirationTimestamp {expires!r} is not an RFC 3339 time") from None
        self._value = f"Bearer {token}" if token else None
        self._cert = (cert.encode(), key.encode()) if cert else None


def parse_time(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 time (``2024-05-01T12:00:00Z``)."""
    stamp = datetime.datetime.fromisoformat(text)
    if stamp.tzinfo is None:
        raise ValueError("no time zone")
    return stamp.timestamp()
