"""The metadata server: the worker processes pods talk to instead of the EC2 metadata service.

* :mod:`kiamfast.server.worker` — process entry point, sockets, signals;
* ``kiamfast._server`` (ext/_server.pyx) — the per-request path in Cython;
* :mod:`kiamfast.server.routes` — path normalisation and routing;
* :mod:`kiamfast.server.tokens` — stateless IMDSv2 tokens;
* :mod:`kiamfast.server.upstream` — the passthrough with the agent's own token;
* :mod:`kiamfast.server.responses`, :mod:`kiamfast.server.metrics` — what workers render;
* :mod:`kiamfast.server.settings` — :class:`WorkerSettings`.

Workers only read the shared table; they never import ``kubernetes`` or ``botocore``.
"""
