"""Which build this is: the commit and date ``--version`` and ``/metrics`` show.

First match wins:

1. ``KIAMFAST_GIT_COMMIT`` / ``KIAMFAST_BUILD_DATE`` in the environment: the image sets them
   (deploy/image/build.sh, the Dockerfile's build args), as its labels say.
2. ``kiamfast/_build_stamp.py``, written into the wheel by setup.py when it is built: the
   commit ``git rev-parse`` named then, and its date (``SOURCE_DATE_EPOCH`` if set, else the
   commit's date), so a ``pip install`` of a wheel knows where it came from.
3. A source checkout (an editable install has no stamp): ``git`` asked once, now.
4. ``unknown``.

Read once per process (the control process publishes it with its metrics every few
seconds).
"""
from __future__ import annotations

import functools
import os
import subprocess
import time

__all__ = ["build_info", "git_commit_and_date"]

UNKNOWN = "unknown"


def git_commit_and_date(where: str) -> tuple[str, str]:
    """The short commit of the checkout holding ``where`` and its committer date in UTC
    (``%Y-%m-%dT%H:%M:%SZ``); ``unknown`` for each that git cannot tell."""
    try:
        out = subprocess.run(["git", "-C", where, "log", "-1", "--format=%h %ct"],
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN, UNKNOWN
    parts = out.stdout.split()
    if out.returncode != 0 or len(parts) != 2 or not parts[1].isdigit():
        return UNKNOWN, UNKNOWN
    return parts[0], time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(parts[1])))


@functools.lru_cache(maxsize=1)
def _from_package() -> tuple[str, str]:
    try:
        from kiamfast import _build_stamp  # type: ignore[attr-defined]
    except ImportError:
        package = os.path.dirname(os.path.abspath(__file__))
        if not os.path.exists(os.path.join(os.path.dirname(package), "setup.py")):
            return UNKNOWN, UNKNOWN      # installed without a stamp: no checkout to ask
        return git_commit_and_date(package)
    return _build_stamp.COMMIT or UNKNOWN, _build_stamp.DATE or UNKNOWN


def build_info() -> tuple[str, str]:
    """(commit, build date), see the module docstring."""
    commit = os.environ.get("KIAMFAST_GIT_COMMIT") or ""
    date = os.environ.get("KIAMFAST_BUILD_DATE") or ""
    if commit and date:
        return commit, date
    stamped_commit, stamped_date = _from_package()
    return commit or stamped_commit, date or stamped_date
