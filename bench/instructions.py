"""User-space instructions per request of the server worker's hot path, beside the Python
ceiling's: callgrind counts them, the same on any machine however busy (a timing here never
is).

Each scenario feeds ``n`` requests straight into one protocol instance in a fresh
interpreter under ``valgrind --tool=callgrind``, once with 1,000 and once with 6,000
requests; the difference over 5,000 is the cost of one request without the start-up:

* ``baseline``: bench/baseline_server.py's fixed-response protocol (uvloop + httptools, no
  routing, no lookup: the Python ceiling of bench/agent_load.py);
* ``get``: the worker's ``Core`` answering a credential GET with an IMDSv2 token, over a
  table bench_agent.fill_table filled (parse, route, token, table lookup, response);
* ``put``: the same worker signing a token.

The kernel's TCP work, about two thirds of the CPU under load, is the same for both and not
counted (the transport is a stand-in that drops what is written).

    python bench/instructions.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from benchutil import ROOT, pod_addresses

from loadgen import TOKEN_PUT, credentials_path, metadata_get

SCENARIOS = ("baseline", "get", "put")
NAMES = {"baseline": "baseline (fixed bytes, no work)",
         "get": "kiamfast credential GET (with token)", "put": "kiamfast token PUT"}
TOKEN_KEY = b"bench-token-key-0123456789abcdef"
ROLES = 16


class _NullTransport:
    """Stands in for the socket: the same cost for both servers; keeps the first answer's
    status line, so a count of wrong answers is not reported as a cost."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.first = b""

    def get_extra_info(self, name: str):
        return (self.peer, 40000, 0, 0) if name == "peername" else None

    def write(self, data: bytes) -> None:
        if not self.first:
            self.first = data[:13]

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _loop(scenario: str, n: int, table_path: str) -> None:
    """Feed ``n`` requests straight into one protocol instance (run under callgrind)."""
    import asyncio

    from baseline_server import FixedResponseProtocol
    from bench_agent import role_name

    from kiamfast import table
    from kiamfast._server import Core
    from kiamfast.server.settings import WorkerSettings
    from kiamfast.server.tokens import TokenSigner

    t = table.Table.attach(table_path)
    ip = "::ffff:" + pod_addresses(1)[0]       # pod 0: role 0
    if scenario == "baseline":
        proto = FixedResponseProtocol(b"HTTP/1.1 200 OK\r\nContent-Length: 1250\r\n\r\n"
                                      + b"x" * 1250)
        request = metadata_get(credentials_path(role_name(0)), b"x" * 44)
    else:
        core = Core(WorkerSettings(token_key=TOKEN_KEY, metadata_addr="127.0.0.1:9"), t,
                    loop=asyncio.new_event_loop())
        proto = core.protocol()
        token = TokenSigner(TOKEN_KEY).issue(table.ip_key(ip), 21600, int(time.time()))
        request = (metadata_get(credentials_path(role_name(0)), token) if scenario == "get"
                   else TOKEN_PUT)
    transport = _NullTransport(ip)
    proto.connection_made(transport)
    feed = proto.data_received
    for _ in range(n):
        feed(request)
    if transport.first != b"HTTP/1.1 200 ":
        raise SystemExit(f"{scenario}: the answer was {transport.first!r}, not a 200")


def run() -> dict[str, float] | None:
    """Instructions per request of each scenario (None without valgrind)."""
    from bench_agent import fill_table

    if not shutil.which("valgrind"):
        return None
    py = os.path.realpath(sys.executable)
    counts: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kiamfast-bench-instructions-") as tmp:
        table_path = os.path.join(tmp, "table")
        fill_table(table_path, pod_addresses(256), roles=ROLES)
        for scenario in SCENARIOS:
            totals = []
            for n in (1000, 6000):
                proc = subprocess.run(
                    ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", py,
                     __file__, "--loop", scenario, str(n), table_path],
                    capture_output=True, text=True, timeout=600,
                    env=dict(os.environ, PYTHONPATH=str(ROOT)))
                found = [line for line in proc.stderr.splitlines() if "Collected :" in line]
                if proc.returncode != 0 or not found:
                    raise RuntimeError(f"callgrind of {scenario} failed: {proc.stderr[-2000:]}")
                totals.append(int(found[-1].rsplit(":", 1)[1]))
            counts[scenario] = (totals[1] - totals[0]) / 5000
    return counts


def markdown(counts: dict[str, float]) -> str:
    base = counts["baseline"]
    lines = ["| scenario | instructions/request | ratio to baseline |", "|---|---:|---:|"]
    lines += [f"| {NAMES[k]} | {counts[k]:,.0f} | {base / counts[k]:.2f} |" for k in SCENARIOS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loop", nargs=3, metavar=("SCENARIO", "N", "TABLE"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.loop:
        scenario, n, table_path = args.loop
        _loop(scenario, int(n), table_path)
        return 0
    counts = run()
    if counts is None:
        print("valgrind is not installed: nothing counted")
        return 1
    print(markdown(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
