"""What a test needs from the machine, and the one way to say it is missing.

Some tests drive real programs (nginx as a fast metadata service, wrk, ``ip`` and
``iptables`` for network namespaces, Node.js with the AWS SDK for JavaScript). On a machine
where ``tests/run`` has not installed them, such a test must skip with a reason that names
the tool and the command that provides it, never fail with FileNotFoundError halfway. In CI
(``CI=true``) the root conftest turns every skip into a failure, so a missing tool there is
loud, not silent.

Usage::

    from needs import need_tool, need_root, need_js_sdk
    need_tool("nginx")            # in a test or fixture: skips when nginx is not on PATH
    requires_nginx = tool_mark("nginx")   # as a decorator (module level)
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

SETUP = "tests/run"
JS_DIR = Path(__file__).resolve().parent / "js"

# Tool -> the Debian package that provides it (what tests/run installs as root).
PACKAGES = {
    "nginx": "nginx-light",
    "wrk": "wrk",
    "ip": "iproute2",
    "iptables": "iptables",
    "ip6tables": "iptables",
    "node": "nodejs",
    "containerd": "containerd",
    "runc": "runc",
    "curl": "curl",
}


def missing_tool(*tools: str) -> str | None:
    """The skip reason for the first of ``tools`` not on PATH, or None when all are there."""
    for tool in tools:
        if shutil.which(tool) is None:
            package = PACKAGES.get(tool, tool)
            return (f"needs {tool}: run {SETUP} as root "
                    f"(or apt-get install {package})")
    return None


def need_tool(*tools: str) -> None:
    """Skip the calling test when one of ``tools`` is not installed."""
    reason = missing_tool(*tools)
    if reason:
        pytest.skip(reason)


def tool_mark(*tools: str) -> pytest.MarkDecorator:
    """``need_tool`` as a decorator, decided at import time."""
    reason = missing_tool(*tools)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def not_root_reason(why: str) -> str | None:
    """The skip reason when this process is not root (``why``: what root is needed for)."""
    if os.geteuid() != 0:
        return f"needs root ({why}): run {SETUP} as root"
    return None


def need_root(why: str) -> None:
    reason = not_root_reason(why)
    if reason:
        pytest.skip(reason)


def missing_js_sdk() -> str | None:
    """Why the JavaScript SDK tests cannot run (node, or tests/js/node_modules), or None."""
    reason = missing_tool("node")
    if reason:
        return reason
    # The module tests/js/imds-credentials.js requires.
    if not (JS_DIR / "node_modules" / "@smithy" / "credential-provider-imds").is_dir():
        return ("needs the AWS SDK for JavaScript v3 in tests/js/node_modules: "
                f"run {SETUP} (or npm install --prefix tests/js)")
    return None


def need_js_sdk() -> None:
    reason = missing_js_sdk()
    if reason:
        pytest.skip(reason)
