"""The webhook's serving certificate, reloaded when its files change (cert-manager's
renewals, the kubelet's update of a Secret volume) without a restart."""
from __future__ import annotations

import logging
import os
import ssl

log = logging.getLogger("kiamfast.webhook")


class ServingCertificate:
    """The TLS context of a certificate and key file pair, loaded again when either file
    changes: a stat of each per new connection (cheap next to a handshake) spots the
    kubelet's swap of a Secret volume's ``..data`` link or a file written in place.  A pair
    that does not load (half written, key and certificate not matching, missing) keeps the
    previous one and logs a line; it is tried again once the files change again."""

    def __init__(self, cert: str, key: str) -> None:
        self.cert, self.key = cert, key
        self._seen = self._signature()
        self._context = self._load()        # at start a pair that does not load is fatal

    def context(self) -> ssl.SSLContext:
        seen = self._signature()
        if seen != self._seen:
            self._seen = seen
            try:
                self._context = self._load()
                log.info("serving certificate %s reloaded", self.cert)
            except (OSError, ssl.SSLError) as e:
                log.warning("serving certificate %s and key %s not loaded, serving the "
                            "previous pair: %s", self.cert, self.key, e)
        return self._context

    def _signature(self) -> tuple:
        signature = []
        for path in (self.cert, self.key):
            try:
                s = os.stat(path)           # through the links, to the current files
                signature.append((s.st_dev, s.st_ino, s.st_mtime_ns, s.st_size))
            except OSError as e:
                signature.append(e.errno)
        return tuple(signature)

    def _load(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        return context
