"""Clients of the container-credentials listener, honest and not, each from a loopback source
address standing for a pod's (tests/podidentity/test_review_backlog.py and
bench/container_credentials.py).

* `like_botocore`: a pod's SDK asking with its token as botocore's container provider does
  (2 s an attempt, 1 s between attempts), until it is answered 200;
* `forged_flood`: one connection's worth of forged tokens, each sent once, as fast as the
  listener answers;
* `unread_pipeline`: one connection sending pipelined requests and never reading a byte of
  the answers (a small receive buffer), opened again 0.1 s after it is closed (not a
  reconnect flood: bench/container_credentials.py measures those apart);
* `rotations_beside_forged_floods`: pods asking with their new tokens, spread over a few
  seconds, while addresses flood forged tokens.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable

ATTEMPT_TIMEOUT, ATTEMPT_SLEEP = 2.0, 1.0    # botocore's ContainerMetadataFetcher


def ask(port: int, token: str, source: str, timeout: float) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                      source_address=(source, 0))
    try:
        conn.request("GET", "/v1/credentials", headers={"Authorization": token})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def like_botocore(port: int, token: str, source: str, *, within: float) -> tuple[float, list]:
    """Seconds from the first attempt to a 200 (inf if none within ``within``), and what
    each attempt got (a status, or the client's error)."""
    started = time.monotonic()
    attempts: list = []
    while time.monotonic() - started < within:
        try:
            status, body = ask(port, token, source, ATTEMPT_TIMEOUT)
        except (OSError, ValueError) as e:
            attempts.append(type(e).__name__)
        else:
            attempts.append(status)
            if status == 200 and body.get("AccessKeyId"):
                return time.monotonic() - started, attempts
        time.sleep(ATTEMPT_SLEEP)
    return float("inf"), attempts


def forged_flood(port: int, tokens: list[str], source: str, stop: threading.Event,
                 answers: dict) -> None:
    """Until ``stop``: each of ``tokens`` in turn, a new connection each; ``answers`` counts
    what came back by status (0: the connection was reset, its address cooling down)."""
    i = 0
    while not stop.is_set():
        try:
            status, _ = ask(port, tokens[i % len(tokens)], source, 5)
        except (OSError, ValueError):
            status = 0
            time.sleep(0.05)
        answers[status] = answers.get(status, 0) + 1
        i += 1


def pipelined(tokens: list[str]) -> bytes:
    return b"".join(f"GET /v1/credentials HTTP/1.1\r\nHost: 169.254.170.23\r\n"
                    f"Authorization: {token}\r\n\r\n".encode() for token in tokens)


def unread_pipeline(port: int, tokens: list[str], source: str, stop: threading.Event,
                    counts: dict) -> None:
    """Until ``stop``: send ``tokens``' requests pipelined, whole requests only, and never
    read; ``counts["let go"]`` the connections the listener ended, ``counts["stuck"]`` the
    times the listener stopped reading (its answers waiting in the socket's buffers)."""
    data = pipelined(tokens)
    while not stop.is_set():
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            client.bind((source, 0))
            client.connect(("127.0.0.1", port))
        except OSError:
            client.close()
            time.sleep(0.1)
            continue
        client.setblocking(False)
        left, stuck = memoryview(data), False
        try:
            while not stop.is_set():
                try:
                    left = left[client.send(left):] or memoryview(data)
                except BlockingIOError:
                    if not stuck:
                        stuck = True
                        counts["stuck"] = counts.get("stuck", 0) + 1
                    time.sleep(0.05)
        except OSError:
            counts["let go"] = counts.get("let go", 0) + 1
        finally:
            client.close()
        time.sleep(0.1)


def rotations_beside_forged_floods(port: int, rotations: list[tuple[Callable[[], str], str]],
                                   forgers: list[tuple[str, list[str]]], *, connections: int,
                                   spread: float, within: float, answers: dict,
                                   meanwhile: Callable[[], None] = lambda: None
                                   ) -> list[tuple[float, list]]:
    """Each of ``forgers`` (its address, its forged tokens) floods over ``connections``
    connections, 3 s first (their reviews queued first); then the i-th of ``rotations`` (how
    its pod gets a new token, its address) asks with it as botocore does, ``spread`` * i / n
    seconds later, while ``meanwhile()`` runs.  What each rotation got (`like_botocore`), in
    order; ``answers`` counts the floods' answers."""
    stop = threading.Event()
    floods = [threading.Thread(target=forged_flood, daemon=True, args=(
        port, forged[c::connections], source, stop, answers))
        for source, forged in forgers for c in range(connections)]
    got: list = [None] * len(rotations)

    def rotate(i: int, new_token: Callable[[], str], source: str, when: float) -> None:
        time.sleep(max(0.0, when - time.monotonic()))
        got[i] = like_botocore(port, new_token(), source, within=within)
    try:
        for t in floods:
            t.start()
        time.sleep(3.0)
        start = time.monotonic()
        threads = [threading.Thread(target=rotate, args=(
            i, new_token, source, start + spread * i / len(rotations)))
            for i, (new_token, source) in enumerate(rotations)]
        for t in threads:
            t.start()
        meanwhile()
        for t in threads:
            t.join()
    finally:
        stop.set()
        for t in floods:
            t.join(10)
    return got
