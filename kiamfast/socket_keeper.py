"""The socket keeper: holds the agent's listening sockets while its container restarts.

    kiamfast keep-sockets --socket PATH [--log-format text|json] [--log-level LEVEL]
    (or: python -m kiamfast.socket_keeper ...)

Run as a second container of the agent's pod, with ``PATH`` in an emptyDir both containers
mount.  The supervisor (``--socket-keeper PATH``) deposits the listening sockets it serves
on and takes them back when its container starts again.  The keeper never accepts: while
the agent's container is down (a crash, an OOM kill, ``kill -9`` of its PID 1, a failed
liveness probe), the kernel keeps completing pods' connections into the sockets' backlog,
and the restarted agent answers them.  Without a keeper the sockets close with the
container and every connection meanwhile is refused.

It holds one deposit: a short JSON note of the supervisor's (which table it serves, whether
it handed the node to another agent) and at most ``fdpass.MAX_FDS`` listening TCP sockets.
Requests, one per connection (``kiamfast.fdpass`` frames, only from our own uid):

    {"op": "get"}                           -> {"op": "held", "note": {..}, "sockets": [..]} + fds
    {"op": "put", "note": {..}, "sockets": [..]} + fds   -> {"op": "ok"}

``sockets`` describes each descriptor, in order (``{"kind": "app", "host": "::", "port":
8181}``); the keeper only checks that each is a listening TCP socket and hands the
descriptions back as they came: the supervisor checks them against its own configuration.

Small on purpose: the standard library's socket, json and os and :mod:`kiamfast.fdpass`,
no logging package, no event loop; it waits in accept() and costs nothing between requests.
Its few lines come in the agent's formats all the same (``--log-format``: kiamfast/logs.py's
text, or one JSON object a line with the same keys).
"""
from __future__ import annotations

import json
import signal
import socket
import sys
import time

from kiamfast import fdpass

REQUEST_TIMEOUT = 5.0   # one client cannot keep the keeper from the next for longer


LEVELS = {"trace": 0, "debug": 0, "info": 1, "warn": 2, "warning": 2, "error": 3,
          "fatal": 4, "panic": 4}
_output = {"format": "text", "level": 1}


def log(message: str, *, level: str = "info") -> None:
    """One line on stderr, as kiamfast/logs.py writes it (without the logging package)."""
    if LEVELS[level] < _output["level"]:
        return
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if _output["format"] == "json":
        line = json.dumps({"level": level, "msg": message, "time": stamp,
                           "logger": "kiamfast.socket_keeper"})
    else:
        line = f"{stamp} {level:5} kiamfast.socket_keeper: {message}"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class Keeper:
    """The deposit and the requests that change or read it."""

    def __init__(self) -> None:
        self.note: dict = {}
        self.descriptions: list[dict] = []
        self.sockets: list[socket.socket] = []

    def handle(self, conn: socket.socket) -> None:
        """One request on ``conn`` (a connection from our uid, with a timeout)."""
        message, received = fdpass.receive(conn)
        op = message.get("op")
        if op == "get":
            for sock in received:
                sock.close()
            fdpass.send(conn, {"op": "held", "note": self.note, "sockets": self.descriptions},
                        [s.fileno() for s in self.sockets])
        elif op == "put":
            problem = self._check_deposit(message, received)
            if problem:
                for sock in received:
                    sock.close()
                fdpass.send(conn, {"op": "error", "error": problem})
                log(f"refused a deposit: {problem}", level="warning")
                return
            old = self.sockets
            self.note, self.descriptions, self.sockets = (message.get("note") or {},
                                                          message["sockets"], received)
            for sock in old:          # the sockets live on in the new deposit's descriptors
                sock.close()
            fdpass.send(conn, {"op": "ok"})
            where = ", ".join(f"{d.get('kind')} {d.get('host')} port {d.get('port')}"
                              for d in self.descriptions)
            log(f"holding {len(self.sockets)} socket(s): {where or 'none'}")
        else:
            for sock in received:
                sock.close()
            fdpass.send(conn, {"op": "error", "error": f"unknown op {op!r}"})

    @staticmethod
    def _check_deposit(message: dict, received: list[socket.socket]) -> str:
        descriptions = message.get("sockets")
        if not isinstance(descriptions, list) or len(descriptions) != len(received):
            return (f"{len(received)} descriptor(s) came with "
                    f"{len(descriptions) if isinstance(descriptions, list) else 'no'} "
                    "description(s)")
        if not isinstance(message.get("note", {}), dict):
            return "the note is not a JSON object"
        for description, sock in zip(descriptions, received):
            if not isinstance(description, dict):
                return "a description is not a JSON object"
            if fdpass.listening_address(sock) is None:
                return f"{description.get('kind')!r} is not a listening TCP socket"
        return ""


def serve(path: str) -> None:
    """Accept requests at ``path`` until SIGTERM/SIGINT."""
    listener = fdpass.listen(path)
    keeper = Keeper()
    log(f"listening on {path}")
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(REQUEST_TIMEOUT)
            try:
                fdpass.check_peer(conn)
                keeper.handle(conn)
            except fdpass.FdPassError as e:
                log(f"a request failed: {e}", level="warning")


def _stop(signum, frame) -> None:
    # The held sockets close with the process: the pod is going away (both containers get
    # SIGTERM together), and the agent holds its own descriptors until it has drained.
    log(f"received {signal.Signals(signum).name}, exiting")
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    values = {"socket": "", "log-format": "text", "log-level": "info"}
    while args:
        arg = args.pop(0)
        name, eq, value = arg.removeprefix("--").partition("=")
        if arg in ("-h", "--help"):
            sys.stdout.write(__doc__ or "")
            return 0
        if not arg.startswith("--") or name not in values or not (eq or args):
            sys.stderr.write(f"kiamfast keep-sockets: unexpected argument {arg!r} (flags: "
                             "--socket PATH, --log-format text|json, --log-level LEVEL)\n")
            return 2
        values[name] = value if eq else args.pop(0)
    if values["log-format"] not in ("text", "json") or values["log-level"] not in LEVELS:
        sys.stderr.write("kiamfast keep-sockets: --log-format is text or json, --log-level "
                         f"one of {', '.join(LEVELS)}\n")
        return 2
    _output.update(format=values["log-format"], level=LEVELS[values["log-level"]])
    path = values["socket"]
    if not path:
        sys.stderr.write("kiamfast keep-sockets: --socket PATH is required\n")
        return 2
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        serve(path)
    except OSError as e:
        log(f"cannot listen on --socket {path}: {e.strerror or e}", level="error")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
