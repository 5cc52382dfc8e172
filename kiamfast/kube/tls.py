"""The TLS context for one API server: its CA (or the system's), TLS 1.2 or newer, and a
client certificate when the configuration has one.

Python's ssl module loads a certificate chain only from a file; certificate data from a
kubeconfig or an exec plugin goes through an anonymous memory file (memfd), never the disk.
"""
from __future__ import annotations

import os
import ssl
from typing import Protocol


class TlsSettings(Protocol):
    """What a context is made of: the fields of ``kiamfast.kube.config.ClientConfig`` it reads
    (described here, so that this module, which the configuration imports, never imports it
    back)."""

    verify: bool
    ca_file: str | None
    ca_data: bytes | None
    client_cert_files: tuple[str, str] | None
    client_cert_data: tuple[bytes, bytes] | None


def ssl_context(config: TlsSettings, cert: tuple[bytes, bytes] | None = None
                ) -> ssl.SSLContext:
    """A client context for ``config``; ``cert`` (PEM certificate, PEM key) overrides the
    configured client certificate (an exec plugin's). Raises ssl.SSLError or OSError."""
    if config.verify:
        cadata = config.ca_data.decode("ascii", "replace") if config.ca_data else None
        # With a CA given only that CA is trusted; without, the system's store.
        context = ssl.create_default_context(cafile=config.ca_file, cadata=cadata)
    else:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    pem = cert or config.client_cert_data
    if pem is not None:
        _load_cert_data(context, *pem)
    elif config.client_cert_files is not None:
        context.load_cert_chain(*config.client_cert_files)
    return context


def _load_cert_data(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    fd = os.memfd_create("kiamfast-client-cert", os.MFD_CLOEXEC)
    try:
        os.write(fd, cert.rstrip(b"\n") + b"\n" + key)
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
