"""Stateless IMDSv2 session tokens.

A pod's SDK asks ``PUT /latest/api/token`` for a session token and sends it back on every
GET. The worker answers the PUT itself, at once and without looking the pod up (a slow PUT
silently downgrades botocore to IMDSv1 and Go for good, sdk-imds.md §2). The token must:

* be valid for at least the TTL the worker echoes (Go caches it for exactly that long);
* survive a worker restart and verify in any worker: it carries its own expiry under a MAC
  whose key every worker shares, so no worker keeps token state;
* be useless from another pod: the MAC also covers the 16-byte address of the client that
  asked, and verification uses the address of the client that presents it;
* be a bare base64 string (a trailing newline or space breaks clients).

Wire form: base64(version u8 | expiry u64 LE | MAC[:24]) = 44 characters, no padding,
where MAC = keyed BLAKE2b (personalisation ``kiamfast-imdsv2``) over version | expiry |
address. ``expiry`` is in whole epoch seconds and the token is valid while
``now < expiry``; it is set one second past ``now + ttl`` so the whole TTL is honoured
whatever the fraction of the current second.

The implementation is Cython (``kiamfast._server.TokenSigner``, on the request path); this
module is its public face.
"""

from __future__ import annotations

from kiamfast._server import TokenSigner, parse_ttl

__all__ = ["MAX_TTL", "MIN_TTL", "TOKEN_CHARS", "TokenSigner", "parse_ttl"]

MIN_TTL = 1
MAX_TTL = 21600
TOKEN_CHARS = 44
