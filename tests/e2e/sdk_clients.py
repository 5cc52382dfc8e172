"""The Go and Java SDK clients of tests/sdk, found in the tools cache and run inside a pod.

``tests/sdk/build.sh`` builds the AWS SDK for Go v2 client into
``$KIAMFAST_TOOLS/sdk-go-<hash>/kiamfast-go-client`` and the AWS SDK for Java v2 client into
``$KIAMFAST_TOOLS/sdk-java-<hash>/kiamfast-java-client.jar``; the hash covers the client's
sources, so this module computes it the same way and finds exactly the build of the sources
in this checkout (a stale build of older sources is never picked up). A test whose client is
not built skips, naming the command that builds it.

A client runs like any application in a pod: an environment without credentials (so the
SDK's chain ends at 169.254.169.254), the region, and ``AWS_ENDPOINT_URL_STS`` pointing at
moto on the node, where it sends GetCallerIdentity with the credentials it got. Both print
one JSON line (see tests/sdk/go/main.go and JavaClient.java); :func:`run_client` returns it
with the exit status added.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SDK_DIR = REPO / "tests" / "sdk"
BUILD = "tests/sdk/build.sh"

# client name -> (SDK, provider flag value)
CLIENTS = {
    "go-default": ("go", "default"),
    "go-ec2rolecreds": ("go", "ec2rolecreds"),
    "java-instance-profile": ("java", "instance-profile"),
    "java-default": ("java", "default"),
}


def tools_dir() -> Path:
    return Path(os.environ.get("KIAMFAST_TOOLS")
                or Path.home() / ".cache" / "kiamfast" / "tools")


def _content_hash(base: Path, names: list[str]) -> str:
    """What build.sh computes: sha256 of the files concatenated in order, 12 hex digits."""
    digest = hashlib.sha256()
    for name in names:
        digest.update((base / name).read_bytes())
    return digest.hexdigest()[:12]


def go_client() -> Path:
    src = SDK_DIR / "go"
    return (tools_dir() / f"sdk-go-{_content_hash(src, ['go.mod', 'main.go'])}"
            / "kiamfast-go-client")


def java_client() -> Path:
    src = SDK_DIR / "java"
    sources = sorted(p.relative_to(src).as_posix() for p in (src / "src").rglob("*.java"))
    return (tools_dir() / f"sdk-java-{_content_hash(src, ['pom.xml', *sources])}"
            / "kiamfast-java-client.jar")


def missing_reason(sdk: str) -> str | None:
    """Why the ``sdk`` ("go" or "java") client cannot run here, or None."""
    if sdk == "go":
        if not os.access(go_client(), os.X_OK):
            return f"needs the Go SDK client: run {BUILD}"
        return None
    if shutil.which("java") is None:
        return "needs java (a JDK 17): apt-get install openjdk-17-jdk-headless"
    if not java_client().is_file():
        return f"needs the Java SDK client: run {BUILD}"
    return None


def need_client(client: str) -> None:
    """Skip the calling test when ``client`` (a key of CLIENTS) is not built."""
    reason = missing_reason(CLIENTS[client][0])
    if reason:
        pytest.skip(reason)


def run_client(pod: Any, client: str, *, loop: int = 1, interval: float = 1.0,
               cache_window: float | None = None, timeout: float = 60.0,
               **env: str) -> dict[str, Any]:
    """Run ``client`` in ``pod``; its JSON line plus ``exit`` (and ``stderr`` on failure).

    ``cache_window`` (seconds): how long before the Expiration the metadata service sent
    the SDK's own cache treats credentials as expired (Go: the credential cache's
    ExpiryWindow; Java: InstanceProfileCredentialsProvider's staleTime). ``env`` is added
    to the pod's environment (e.g. ``AWS_EC2_METADATA_V1_DISABLED="true"``)."""
    sdk, provider = CLIENTS[client]
    home = pod.env()["HOME"]
    if sdk == "go":
        argv = [str(go_client()), "--provider", provider, "--loop", str(loop),
                "--interval", f"{interval}s"]
        if cache_window is not None:
            argv += ["--expiry-window", f"{cache_window}s"]
    else:
        # user.home: Java reads ~/.aws from the passwd entry, not $HOME; keep the pod's own.
        argv = ["java", f"-Duser.home={home}", "-jar", str(java_client()),
                "--provider", provider, "--loop", str(loop), "--interval", str(interval)]
        if cache_window is not None:
            argv += ["--stale-time", str(cache_window)]
    proc = pod.run(argv, env=pod.env(AWS_REGION="us-east-1",
                                     AWS_ENDPOINT_URL_STS=pod.node.sts.moto_url, **env),
                   timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": f"exit {proc.returncode}, no JSON", "exit": proc.returncode,
                "stderr": proc.stderr[-3000:]}
    doc = json.loads(lines[-1])
    doc["exit"] = proc.returncode
    if proc.returncode != 0:
        doc["stderr"] = proc.stderr[-3000:]
    return doc
