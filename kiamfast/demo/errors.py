"""What can stop ``kiamfast demo`` from running at all, as types :mod:`kiamfast.demo.run`
turns into exit status 2 and one line for the user.

Why it exists: the cluster, the agent and the pods (:mod:`~kiamfast.demo.cluster`,
:mod:`~kiamfast.demo.agent`, :mod:`~kiamfast.demo.pod_processes`) each raise these, and the
command catches them in one place.
"""

from __future__ import annotations

__all__ = ["AgentDied", "DemoError", "MissingExtra"]


class DemoError(Exception):
    """The demo could not set its world up (a component did not start, timed out...)."""


class MissingExtra(DemoError):
    """The demo's dependencies (the ``demo`` extra) are not installed."""


class AgentDied(DemoError):
    """The agent process exited while the demo needed it."""
