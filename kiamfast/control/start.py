"""The control process's entry (``python -m kiamfast.control``): what it builds before it may
write the table, the wait for the writer's lock, and the one-line answers to a start that
cannot work.

The order is the start path's (docs/architecture.md, "Node start and stop"): the arguments
the supervisor handed down, the API server's configuration (an unusable one is one line
naming the flag and exit 78, before the lock: a process taking the node over finds out in
standby, while the other agent still serves), the STS client (built on its own thread: in
standby at once, otherwise when ``ControlProcess.run`` says), the lock, the table, then
``ControlProcess.run``.
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Any

from kiamfast import logs
from kiamfast import table as tbl
from kiamfast.config import EXIT_CONFIG, Config, config_from_json
from kiamfast.control import imds_client, writer_lock
from kiamfast.iptables import runner
from kiamfast.control.iam.sts import StsClient
from kiamfast.control.cri.source import NetnsUnavailable
from kiamfast.control.lifecycle import TaskFailed
from kiamfast.control.process import ControlProcess
from kiamfast.sockets import raise_fd_limit

log = logging.getLogger("kiamfast.control")


class Prepared:
    """What the control process builds before it may write the table: a process taking the
    node over from another agent does this in standby, while the other still writes (a
    configuration error ends it here, with one line, before it ever holds the lock)."""

    def __init__(self, *, api_config: Any, sts: StsClient) -> None:
        self.api_config = api_config
        self.sts = sts

    @classmethod
    def load(cls, config: Config) -> "Prepared":
        from kiamfast.kube.config import load_config   # ConfigError: exit 78 (main)
        api_config = load_config(kubeconfig=config.kubeconfig, api_server=config.api_server,
                                 api_token=config.api_token, insecure=config.insecure)
        return cls(api_config=api_config, sts=StsClient.from_config(config, start=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiamfast-control")
    parser.add_argument("--table", required=True)
    parser.add_argument("--channel-fds", default="")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--container-credentials-fds", default="")
    parser.add_argument("--table-lock-fd", type=int, default=-1,
                        help="inherited descriptor of the table's lock file: held before "
                             "the table is written (control/writer_lock.py)")
    parser.add_argument("--ready-fd", type=int, default=-1,
                        help="inherited pipe: one byte once in standby for the lock")
    args = parser.parse_args(argv)
    config = config_from_json(args.config_json)
    logs.setup(log_format=config.log_format, level=config.effective_log_level,
               process="control")
    raise_fd_limit()
    from kiamfast.kube.errors import ConfigError
    try:
        prepared = Prepared.load(config)      # before the lock: standby does this meanwhile
    except ConfigError as e:
        log.error("cannot start: %s", e)
        return EXIT_CONFIG
    if args.table_lock_fd >= 0:
        if args.ready_fd >= 0:
            prepared.sts.prepare()            # standby: the other agent serves meanwhile
        writer_lock.hold(args.table_lock_fd, ready_fd=args.ready_fd)
    try:
        return _serve(config, args, prepared)
    finally:
        if args.table_lock_fd >= 0:
            writer_lock.release(args.table_lock_fd)


def _serve(config: Config, args: argparse.Namespace, prepared: Prepared) -> int:
    table = tbl.Table.attach(args.table, writer=True)
    if table.repaired:
        log.warning("repaired %d slots a previous control process left half-written or "
                    "unreachable (a compaction it did not finish)", table.repaired)
    channels = [socket.socket(fileno=int(fd)) for fd in args.channel_fds.split(",") if fd]
    container_socks = [socket.socket(fileno=int(fd))
                       for fd in args.container_credentials_fds.split(",") if fd]
    for sock in [*channels, *container_socks]:
        sock.setblocking(False)
    try:
        import uvloop
        uvloop.run(ControlProcess(config, table, channels, container_socks, sts=prepared.sts,
                                  api_config=prepared.api_config).run())
    except writer_lock.NotSoleWriter as e:
        log.error("control process exiting: %s", e)
        return 1
    except NetnsUnavailable as e:
        log.error("cannot start: --address-proof=netns: the addresses of pods' network "
                  "namespaces cannot be watched (rtnetlink: %s): the agent needs the "
                  "NET_ADMIN and NET_BROADCAST capabilities in the host's network namespace "
                  "(the chart gives both), or run with --cri-endpoint=none", e)
        return EXIT_CONFIG
    except runner.IptablesNotFound as e:
        log.error("cannot start: --iptables: %s: install iptables (kiamfast's image has it), or "
                  "run with --iptables=false", e)
        return EXIT_CONFIG
    except runner.IptablesNotPermitted as e:
        log.error("cannot start: --iptables: the kernel refused the DNAT rule (%s): the agent "
                  "needs the NET_ADMIN capability in the host's network namespace "
                  "(hostNetwork: true), or run with --iptables=false", e)
        return EXIT_CONFIG
    except runner.IptablesError as e:
        log.error("--iptables: cannot install the DNAT rule: %s", e)
        return 1
    except imds_client.ImdsError as e:
        which = "--auto-discover-default-role" if config.auto_discover_default_role else \
            "--auto-discover-base-arn"
        log.error("%s: cannot read the node's instance role from the metadata service at "
                  "--metadata-addr=%s: %s", which, config.metadata_addr, e)
        return 1
    except TaskFailed as e:
        log.error("control process exiting: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
