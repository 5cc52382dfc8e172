"""The injection webhook picks up a renewed serving certificate without a restart.

The files are laid out and replaced as the kubelet's atomic writer does for a Secret volume
(cert-manager renews the Secret; k8s.io/kubernetes pkg/volume/util/atomic_writer.go): the
user-visible ``tls.crt`` and ``tls.key`` are links into ``..data``, itself a link to a
timestamped directory; an update writes a new directory, points ``..data_tmp`` at it and
renames that over ``..data``.  What a user checks is the certificate a new TLS connection
is shown, with a real handshake on loopback.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import ssl
import threading
from pathlib import Path

import kube
import pytest

from kiamfast.webhook import server as webhook_server

SETTINGS = {"role_key": "iam.amazonaws.com/role", "audience": "kiamfast.io/container-credentials",
            "expiration": 600}


class SecretVolume:
    """A directory the way the kubelet projects a kubernetes.io/tls Secret into a pod."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.generation = 0

    def publish(self, cert: bytes, key: bytes) -> None:
        self.generation += 1
        ts_dir = self.root / f"..2026_12_02_04_00_0{self.generation}.{self.generation}"
        ts_dir.mkdir()
        (ts_dir / "tls.crt").write_bytes(cert)
        (ts_dir / "tls.key").write_bytes(key)
        old = os.readlink(self.root / "..data") if (self.root / "..data").exists() else None
        os.symlink(ts_dir.name, self.root / "..data_tmp")
        os.rename(self.root / "..data_tmp", self.root / "..data")
        for name in ("tls.crt", "tls.key"):
            if not (self.root / name).is_symlink():
                os.symlink(f"..data/{name}", self.root / name)
        if old:
            shutil.rmtree(self.root / old)

    @property
    def cert(self) -> Path:
        return self.root / "tls.crt"

    @property
    def key(self) -> Path:
        return self.root / "tls.key"


def new_pair(directory: Path) -> tuple[bytes, bytes]:
    pki = kube.make_pki(directory)
    return pki["cert"].read_bytes(), pki["key"].read_bytes()


def served_certificate(server) -> bytes:
    """The DER certificate a new TLS connection to the webhook is shown."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE       # which certificate, not whether it is trusted
    with socket.create_connection(server.server_address, timeout=5) as raw:
        with context.wrap_socket(raw) as tls:
            return tls.getpeercert(binary_form=True)


def der(pem: bytes) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.decode())


@pytest.fixture
def volume(tmp_path):
    return SecretVolume(tmp_path / "tls")


@pytest.fixture
def serve(volume):
    servers = []

    def start():
        srv = webhook_server.make_server(listen=("127.0.0.1", 0), cert=str(volume.cert),
                                  key=str(volume.key), settings=SETTINGS)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_a_swapped_secret_volume_is_served_on_the_next_connection(tmp_path, volume, serve):
    first = new_pair(tmp_path / "first")
    volume.publish(*first)
    server = serve()
    assert served_certificate(server) == der(first[0])

    renewed = new_pair(tmp_path / "renewed")
    volume.publish(*renewed)
    assert served_certificate(server) == der(renewed[0])
    assert served_certificate(server) == der(renewed[0])


def test_a_mismatched_pair_keeps_the_previous_one_and_says_so_once(tmp_path, volume, serve,
                                                                   caplog):
    good = new_pair(tmp_path / "good")
    other = new_pair(tmp_path / "other")
    volume.publish(*good)
    server = serve()
    caplog.set_level(logging.INFO, logger="kiamfast.webhook")

    volume.publish(other[0], good[1])                  # a certificate with another's key
    assert served_certificate(server) == der(good[0])
    assert served_certificate(server) == der(good[0])
    # One line per change of the files, not one per connection.
    assert caplog.text.count("not loaded, serving the previous pair") == 1
    assert "KEY_VALUES_MISMATCH" in caplog.text

    volume.publish(*other)                             # then a good pair again
    assert served_certificate(server) == der(other[0])
    assert "reloaded" in caplog.text


def test_files_rewritten_in_place_half_written_then_whole(tmp_path, caplog):
    # `kiamfast webhook` run on its own, with plain files a tool rewrites in place.
    first, second = new_pair(tmp_path / "a"), new_pair(tmp_path / "b")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(first[0])
    key.write_bytes(first[1])
    server = webhook_server.make_server(listen=("127.0.0.1", 0), cert=str(cert), key=str(key),
                                 settings=SETTINGS)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert served_certificate(server) == der(first[0])
        caplog.set_level(logging.INFO, logger="kiamfast.webhook")
        key.write_bytes(second[1])
        cert.write_bytes(second[0][: len(second[0]) // 2])   # caught half way
        assert served_certificate(server) == der(first[0])
        assert "not loaded, serving the previous pair" in caplog.text
        cert.write_bytes(second[0])
        assert served_certificate(server) == der(second[0])
    finally:
        server.shutdown()
        server.server_close()


def test_a_pair_that_does_not_load_at_start_stops_the_webhook(tmp_path, volume):
    good, other = new_pair(tmp_path / "good"), new_pair(tmp_path / "other")
    volume.publish(other[0], good[1])
    with pytest.raises(ssl.SSLError):
        webhook_server.make_server(listen=("127.0.0.1", 0), cert=str(volume.cert),
                            key=str(volume.key), settings=SETTINGS)
