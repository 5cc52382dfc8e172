"""What each child is started with: its command line and the descriptors it inherits from
the supervisor, which holds them itself, and why:

* the listening socket(s), bound once by the supervisor without ``SO_REUSEPORT`` and inherited by every
  worker: no other process on the host network can bind the port beside it and take a share
  of the pods' connections, and connections wait in the backlog while a worker restarts;
* the IMDSv2 token key, in an in-memory file (memfd) each worker inherits.  With
  ``--token-key-file`` it is loaded from (or created in) that file so tokens survive
  restarts; with ``--token-key-file ""`` it exists only in memory, new at every start;
* with ``--container-credentials-addr``, one listening socket per address, inherited by
  the control process only (it answers that protocol), so requests wait in their backlog
  while the control process restarts; with ``--container-credentials-link`` the addresses
  are first put on that link (kiamfast/container_credentials/link.py);
* the table lock (``<table>.lock``, flock), inherited by the control process: while any
  process of an agent that can write the table lives, no other supervisor touches it;
* one end of a channel per worker (kiamfast/channel.py), the other ends to the control
  process.
"""
from __future__ import annotations

import socket

from kiamfast.config import Config, config_to_json
from kiamfast.server.settings import WorkerSettings
from kiamfast.supervisor.children import CHILD_PYTHON, Child
from kiamfast.supervisor.listeners import APP, CONTAINER, METRICS, SECOND, Listeners


def worker_settings(config: Config, *, token_key_fd: int,
                    metrics_port: int | None = None) -> WorkerSettings:
    return WorkerSettings(
        app_port=config.app_port,
        listen_host=config.listen_host or None,
        metrics_port=config.metrics_port if metrics_port is None else metrics_port,
        metadata_addr=config.metadata_addr,
        imdsv2=config.imdsv2,
        token_key_fd=token_key_fd,
        wait_budget=config.wait_budget,
        passthrough_rate=config.passthrough_qps,
        passthrough_burst=config.passthrough_burst,
        passthrough_concurrency=config.passthrough_concurrency,
        debug=config.debug,
        host_ip=config.host_ip,
        base_role_arn=config.base_role_arn,
        realtime=config.worker_realtime,
    )


def worker(config: Config, index: int, *, listeners: Listeners, table_path: str,
           channel_end: socket.socket, token_key_fd: int) -> Child:
    app = listeners.of_kind(APP) or listeners.of_kind(SECOND)
    extra = listeners.of_kind(SECOND) if listeners.of_kind(APP) else []
    metrics = listeners.of_kind(METRICS)
    listen_args = ["--listen-fd", str(app[0].sock.fileno())]
    if metrics:
        listen_args += ["--metrics-listen-fd", str(metrics[0].sock.fileno())]
    if extra:
        listen_args += ["--extra-listen-fds", ",".join(str(lst.sock.fileno())
                                                       for lst in extra)]
    # a separate metrics port another process still holds: /metrics on the app port
    settings = worker_settings(config, token_key_fd=token_key_fd,
                               metrics_port=None if metrics else config.app_port).to_json()
    return Child(
        name=f"worker-{index}",
        argv=[*CHILD_PYTHON, "-m", "kiamfast.server.worker", "--table", table_path,
              "--channel-fd", str(channel_end.fileno()), "--worker-index", str(index),
              *listen_args, "--settings-json", settings,
              "--log-format", config.log_format, "--log-level", config.effective_log_level],
        fds=(channel_end.fileno(), token_key_fd,
             *(lst.sock.fileno() for lst in [*app[:1], *metrics, *extra])))


def control(config: Config, *, listeners: Listeners, table_path: str,
            channel_ends: list[socket.socket], lock_fd: int) -> Child:
    channel_fds = tuple(end.fileno() for end in channel_ends)
    container_fds = tuple(lst.sock.fileno() for lst in listeners.of_kind(CONTAINER))
    container_args: list[str] = []
    if container_fds:
        container_args = ["--container-credentials-fds", ",".join(map(str, container_fds))]
    return Child(
        name="control",
        argv=[*CHILD_PYTHON, "-m", "kiamfast.control", "--table", table_path,
              "--channel-fds", ",".join(map(str, channel_fds)),
              "--table-lock-fd", str(lock_fd),
              *container_args, "--config-json", config_to_json(config)],
        fds=(*channel_fds, *container_fds, lock_fd))
