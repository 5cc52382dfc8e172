"""The environment of every process the demo starts (the agent, the pod clients).

Why it exists: a user's shell may hold AWS keys, a profile, a kubeconfig or a proxy; a
child that inherited them could send a request off loopback or answer with the user's
identity instead of the one the demo gave it. Only the variables the demo sets reach the
agent and the pods.
"""

from __future__ import annotations

import os

__all__ = ["clean_env"]

#: Environment variables that would send a client anywhere but where the demo points it.
_DROP_ENV_PREFIXES = ("AWS_", "BOTO_", "KUBECONFIG")
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
               "all_proxy")


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without AWS, kubeconfig or proxy settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_DROP_ENV_PREFIXES) and k not in _PROXY_VARS}
    env["NO_PROXY"] = env["no_proxy"] = "*"
    env.update(extra)
    return env
