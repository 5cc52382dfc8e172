"""The environment of an AWS client in a test, a benchmark or the demo: static keys, never
the machine's metadata service (``AWS_EC2_METADATA_DISABLED``), never a profile, a config
file or an endpoint from the machine. So botocore, moto and the agent's own STS client can
only reach what the harness points them at, on loopback.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

__all__ = ["STATIC", "UNSET", "offline_env", "offline"]

STATIC = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
          "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
          "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
# What would send a client elsewhere or give it another identity than the static keys.
UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL",
         "AWS_ENDPOINT_URL_STS", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
         "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
         "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")


def offline_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """A child process's environment: ``base`` (default: this process's) without ``UNSET``,
    with ``STATIC``, then ``extra`` (which may override either)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in UNSET}
    env.update(STATIC)
    env.update(extra)
    return env


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """This process's environment as :func:`offline_env` makes it, for the duration (moto
    and botocore clients in-process), then as it was."""
    saved = {k: os.environ.get(k) for k in (*STATIC, *UNSET)}
    os.environ.update(STATIC)
    for k in UNSET:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
