"""A real OCI registry on loopback: Debian's docker-registry (the CNCF distribution registry,
tests/run installs it), on a free port of 127.0.0.1 with a temporary storage directory, plain
HTTP. ``get`` speaks the distribution API itself (manifests, blobs), so what a test checks
is what the registry serves, not what a client made of it."""
from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

# What a client asks for a tag that may be a multi-arch index or one platform's manifest.
MANIFEST_TYPES = ", ".join([
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Registry:
    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        directory.mkdir(parents=True, exist_ok=True)
        config = directory / "config.yml"
        config.write_text(yaml.safe_dump({
            "version": 0.1,
            "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(directory / "storage")}},
            "http": {"addr": self.host},
        }))
        self.log = directory / "registry.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(["docker-registry", "serve", str(config)],
                                            stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(20)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, self.log.read_text()
            try:
                if self.get("/v2/")[0] == 200:
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"registry not up: {self.log.read_text()}"
            time.sleep(0.1)

    def get(self, path: str, *, accept: str = MANIFEST_TYPES) -> tuple[int, dict, bytes]:
        """(status, headers, body) of GET http://127.0.0.1:PORT<path>."""
        request = urllib.request.Request(f"http://{self.host}{path}",
                                         headers={"Accept": accept})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def manifest(self, repository: str, reference: str) -> tuple[str, dict]:
        """(the registry's Docker-Content-Digest, the parsed manifest) of a tag or digest."""
        status, headers, body = self.get(f"/v2/{repository}/manifests/{reference}")
        assert status == 200, (status, body[:500])
        return headers["Docker-Content-Digest"], json.loads(body)

    def blob(self, repository: str, digest: str) -> bytes:
        status, _, body = self.get(f"/v2/{repository}/blobs/{digest}", accept="*/*")
        assert status == 200, (status, body[:500])
        return body

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
