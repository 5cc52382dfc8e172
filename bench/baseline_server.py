"""The yardstick for the hot-path benchmarks: uvloop + httptools, one fixed response.

This is the cheapest HTTP/1.1 server one can write on the same stack as the kiamfast worker:
one ``HttpRequestParser`` per connection, ``on_url`` and ``on_message_complete`` only, no
routing, no lookup, no token check, the same pre-built bytes for every request, keep-alive
and pipelining (a batch answered with one write). bench/agent_load.py measures the agent
(or one worker) against it in the same run, bench/instructions.py counts its instructions
beside the worker's, so the ratio says what kiamfast's real work (routing,
the shared-table lookup, token checks, splicing headers) costs on top of the event loop and
the parser, independent of how fast or busy the machine is.

    python bench/baseline_server.py --port 8182 --response-file resp.bin
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys

import httptools
import uvloop


class FixedResponseProtocol(asyncio.Protocol):
    __slots__ = ("transport", "parser", "response", "out")

    def __init__(self, response: bytes) -> None:
        self.response = response
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()
            return
        out = self.out
        if out:
            assert self.transport is not None
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()

    def on_url(self, url: bytes) -> None:
        pass

    def on_message_complete(self) -> None:
        self.out.append(self.response)


def listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve(response: bytes, sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: FixedResponseProtocol(response), sock=sock,
                                      backlog=2048)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--response-file", required=True,
                        help="file holding the complete HTTP response to send")
    args = parser.parse_args(argv)
    with open(args.response_file, "rb") as f:
        response = f.read()
    uvloop.run(serve(response, listen(args.host, args.port)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
