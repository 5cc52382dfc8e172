"""The injection webhook under hostile clients: its memory (RSS) and whether the API server's
calls are still answered.

Any pod can reach the webhook's Service, so any pod can send it large bodies, many at once,
or trickle bytes to hold its connections.  This starts the real ``kiamfast webhook`` process
(TLS on loopback, the test PKI) and measures, each scenario on a fresh process:

* ``idle``: after start and a few small reviews;
* ``one 4 MiB body`` and ``64 × 4 MiB bodies at once``: a pod's review padded with
  environment variables (the densest shape a valid pod has: the API server adds managed
  fields per variable), sent whole;
* ``64 × 1 MiB pod reviews at once``: the same shape at 1 MiB, which the webhook parses;
* ``one body at the cap, worst shape`` and ``64 × that``: a body of ``MAX_REVIEW_BYTES``
  (read from the running code) made of empty objects, what the JSON parser turns into the
  most Python objects per byte;
* ``one review of 124,000 empty containers`` and ``64 × that``: 372 KB whose parse fits the
  budget and whose answer (two patch operations a container) does not: issue 42's review,
  which took the webhook to 355 MiB before answers were budgeted;
* ``one review filling the parse and answer budgets`` and ``64 × that``: as many empty
  containers as half the budget answers, padded with empty objects up to the other half:
  the most memory one review is allowed to take (read from the running code's budgets);
* ``200 slow senders``: 200 connections that each send a request head announcing a body
  and then one byte a second, reconnecting whenever they are closed, for ``--duration``
  seconds; and ``200 slow heads``: the same, trickling the head itself.

Throughout each scenario an "API server" (a client doing what client-go does for an admission
call: a new connection, a 5 s deadline, retrying a 429/5xx that carries ``Retry-After``
within the deadline), from an address of its own, sends a small review every 100 ms; the scenario reports how many it got
answered (200 with an AdmissionReview) and their latency.  The goal: the peak RSS stays
under the chart's memory limit (96 MiB), for any one review under three quarters of it,
and every API server call is answered.

    python3 bench/webhook_load.py [--quick] [--only NAME,...]     # or bench/run --only webhook
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchutil import ROOT, rss_bytes

for _sub in ("tests", "tests/k8s"):
    if str(ROOT / _sub) not in sys.path:
        sys.path.insert(0, str(ROOT / _sub))

import kube  # noqa: E402

CHART_LIMIT_MIB = 96            # values.yaml containerCredentials.webhook.resources.limits
ONE_REVIEW_GOAL_MIB = CHART_LIMIT_MIB * 3 / 4     # the worst single review (issue 42)
SINGLE = ("one 4 MiB body", "one body at the cap, worst shape",
          "one review of 124,000 empty containers",
          "one review filling the parse and answer budgets")
API_DEADLINE = 5.0              # the chart's timeoutSeconds
API_INTERVAL = 0.1
API_SOURCE = "127.0.0.2"        # the API server's own address; the hostile pods' is 127.0.0.1


@dataclass
class Options:
    duration: float = 20.0      # the slow senders' scenarios
    senders: int = 200
    only: tuple[str, ...] = ()


QUICK = Options(duration=8.0)


@dataclass
class Outcome:
    name: str
    peak_rss_mib: float = 0.0
    idle_rss_mib: float = 0.0
    api_sent: int = 0
    api_answered: int = 0
    api_ms: list[float] = field(default_factory=list)
    api_errors: dict[str, int] = field(default_factory=dict)
    attack: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def review(uid: str, *, env: int = 0, filler: bytes = b"") -> bytes:
    pod = {"metadata": {"name": f"p-{uid}", "annotations": {
               "iam.amazonaws.com/role": "role-a", "kiamfast.io/container-credentials": "true"}},
           "spec": {"serviceAccountName": "default", "containers": [
               {"name": "app", "image": "app", "env": [
                   {"name": f"V{i}", "value": "x"} for i in range(env)]}]}}
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": uid, "operation": "CREATE", "namespace": "default",
                                   "kind": {"group": "", "version": "v1", "kind": "Pod"},
                                   "object": pod}}, separators=(",", ":")).encode()
    if filler:     # an extra field of the review, after the pod
        body = body[:-2] + b',"x":' + filler + b"}}"
    return body


def env_review(size: int) -> bytes:
    """A pod review of at most ``size`` bytes, padded with environment variables."""
    low, high = 0, size // 10
    while low < high:                     # the most variables that fit
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(review("u", env=mid)) <= size else (low, mid - 1)
    return review("u", env=low)


def containers_review(n: int, filler: bytes = b"") -> bytes:
    """An opting-in pod of ``n`` empty containers (3 bytes each), and ``filler``."""
    pod = {"metadata": {"name": "many", "annotations": {
               "iam.amazonaws.com/role": "role-a", "kiamfast.io/container-credentials": "true"}},
           "spec": {"serviceAccountName": "default", "containers": [{}] * n}}
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": "u", "operation": "CREATE", "namespace": "default",
                                   "kind": {"group": "", "version": "v1", "kind": "Pod"},
                                   "object": pod}}, separators=(",", ":")).encode()
    return body[:-2] + b',"x":' + filler + b"}}" if filler else body


def budget_filling_review() -> bytes:
    """As many empty containers as half a large review's share of the parse budget answers,
    padded with empty objects until its parse and answer costs fill the rest."""
    from kiamfast.webhook import limits
    from kiamfast.webhook.patch import FULL_URI
    room = limits.PARSE_BUDGET - limits.KEEP_FOR_SMALL
    n = (room // 2 - limits.ANSWER_FIXED) // (limits.ANSWER_PER_CONTAINER + 8 * len(FULL_URI))
    answer = limits.answer_cost(n, FULL_URI)

    def body(objects: int) -> bytes:
        return containers_review(n, b"[" + b",".join([b"{}"] * objects) + b"]")
    low, high = 0, room // 96
    while low < high:                     # the most padding that still fits
        mid = (low + high + 1) // 2
        low, high = (mid, high) if limits.parse_cost(body(mid)) + answer <= room \
            else (low, mid - 1)
    return body(low)


def dense_review(size: int) -> bytes:
    """A review of ``size`` bytes whose padding is empty objects: the most Python objects
    per byte of JSON."""
    n = max(1, (size - len(review("u")) - 8) // 3)
    return review("u", filler=b"[" + b",".join([b"{}"] * n) + b"]")


class Webhook:
    def __init__(self, workdir: Path) -> None:
        self.pki = kube.make_pki(workdir / "pki")
        self.port = kube.free_port()
        self.log = (workdir / "webhook.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kiamfast", "webhook", "--tls-cert", str(self.pki["cert"]),
             "--tls-key", str(self.pki["key"]), "--listen", f"127.0.0.1:{self.port}",
             "--token-expiration", "600", "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.context = ssl.create_default_context(cafile=str(self.pki["ca"]))
        self.peak = 0
        self._stop = threading.Event()
        deadline = time.monotonic() + 20
        while not self.healthy():
            assert self.process.poll() is None and time.monotonic() < deadline, "not started"
            time.sleep(0.05)
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def healthy(self) -> bool:
        try:
            conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context,
                                               timeout=2)
            conn.request("GET", "/healthz")
            return conn.getresponse().status == 200
        except OSError:
            return False

    def rss(self) -> int:
        return rss_bytes(self.process.pid)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.rss())
            except OSError:
                return
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._sampler.join()
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.log.close()


def post(webhook: Webhook, body: bytes, timeout: float,
         source: str = "127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPSConnection("127.0.0.1", webhook.port, context=webhook.context,
                                       timeout=timeout, source_address=(source, 0))
    try:
        conn.request("POST", "/mutate?timeout=5s", body,
                     {"Content-Type": "application/json", "Accept": "application/json"})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


class ApiServer:
    """What client-go's admission call does: a 5 s deadline over the whole call, a retry
    after ``Retry-After`` seconds for a 429/5xx that carries it, nothing else retried."""

    def __init__(self, webhook: Webhook, outcome: Outcome) -> None:
        self.webhook, self.outcome = webhook, outcome
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            self.outcome.api_sent += 1
            started = time.monotonic()
            deadline = started + API_DEADLINE
            error = ""
            while True:
                try:
                    status, headers, body = post(self.webhook, review(f"api-{n}"),
                                                 max(0.1, deadline - time.monotonic()),
                                                 source=API_SOURCE)
                except OSError as e:
                    error = type(e).__name__
                    break
                if status == 200 and json.loads(body)["response"]["uid"] == f"api-{n}":
                    self.outcome.api_answered += 1
                    self.outcome.api_ms.append((time.monotonic() - started) * 1e3)
                    break
                wait = headers.get("Retry-After")
                if (status == 429 or status >= 500) and wait and wait.isdigit() \
                        and time.monotonic() + int(wait) < deadline:
                    time.sleep(int(wait))
                    continue
                error = f"HTTP {status}"
                break
            if error:
                self.outcome.api_errors[error] = self.outcome.api_errors.get(error, 0) + 1
            self._stop.wait(max(0.0, API_INTERVAL - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def bodies_at_once(webhook: Webhook, body: bytes, count: int, outcome: Outcome) -> None:
    results: list[str] = []

    def one() -> None:
        try:
            results.append(str(post(webhook, body, 60)[0]))
        except OSError as e:
            results.append(type(e).__name__)
    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        outcome.attack[r] = outcome.attack.get(r, 0) + 1


async def _slow_sender(webhook: Webhook, *, head_only: bool, until: float,
                       counts: dict[str, int], announce: int) -> None:
    head = (f"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {announce}\r\n\r\n").encode()
    while time.monotonic() < until:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                "127.0.0.1", webhook.port, ssl=webhook.context,
                server_hostname="127.0.0.1"), 10)
        except (OSError, asyncio.TimeoutError):
            counts["connect failed"] = counts.get("connect failed", 0) + 1
            await asyncio.sleep(0.1)
            continue
        counts["connections"] = counts.get("connections", 0) + 1
        started = time.monotonic()
        try:
            if not head_only:
                writer.write(head)
            trickle = head if head_only else b"{" * 3600
            for i in range(len(trickle)):
                if time.monotonic() >= until:
                    break
                writer.write(trickle[i:i + 1])
                await writer.drain()
                try:           # one byte a second; an answer or a close ends the connection
                    await asyncio.wait_for(reader.read(1024), 1.0)
                    break
                except asyncio.TimeoutError:
                    pass
        except (OSError, ssl.SSLError):
            pass
        finally:
            counts["held_s"] = counts.get("held_s", 0) + int(time.monotonic() - started)
            writer.close()


def slow_senders(webhook: Webhook, options: Options, *, head_only: bool,
                 outcome: Outcome, announce: int = 1 << 20) -> None:
    until = time.monotonic() + options.duration

    async def all_of_them() -> None:
        await asyncio.gather(*(_slow_sender(webhook, head_only=head_only, until=until,
                                            counts=outcome.attack, announce=announce)
                               for _ in range(options.senders)))
    asyncio.run(all_of_them())


def scenario(name: str, workdir: Path, attack, log) -> Outcome:
    outcome = Outcome(name)
    webhook = Webhook(workdir)
    started = time.monotonic()
    try:
        for i in range(5):
            post(webhook, review(f"warm-{i}"), 5)
        time.sleep(0.2)
        outcome.idle_rss_mib = webhook.rss() / 2**20
        api = ApiServer(webhook, outcome)
        try:
            attack(webhook, outcome)
            time.sleep(1.0)                 # the API server's calls right after
        finally:
            api.stop()
        outcome.peak_rss_mib = webhook.peak / 2**20
        assert webhook.process.poll() is None, f"the webhook exited: {webhook.process.returncode}"
    finally:
        webhook.stop()
    outcome.seconds = time.monotonic() - started
    log(f"webhook_load: {name}: peak RSS {outcome.peak_rss_mib:.1f} MiB, API answered "
        f"{outcome.api_answered}/{outcome.api_sent}, {outcome.attack}")
    return outcome


def max_review_bytes() -> int:
    try:
        from kiamfast.webhook import server
        return server.MAX_REVIEW_BYTES
    except ImportError:
        from kiamfast.container_credentials import webhook
        return webhook.MAX_REVIEW_BYTES


def run(options: Options, *, log=print) -> list[Outcome]:
    big = env_review(4 << 20)          # the cap before issue 30
    mid = env_review(1 << 20)
    cap = dense_review(max_review_bytes())
    many = containers_review(124_000)
    filling = budget_filling_review()
    scenarios = {
        "idle": lambda w, o: time.sleep(1.0),
        "one 4 MiB body": lambda w, o: bodies_at_once(w, big, 1, o),
        "64 × 4 MiB bodies at once": lambda w, o: bodies_at_once(w, big, 64, o),
        "64 × 1 MiB pod reviews at once": lambda w, o: bodies_at_once(w, mid, 64, o),
        "one body at the cap, worst shape": lambda w, o: bodies_at_once(w, cap, 1, o),
        "64 × bodies at the cap, worst shape": lambda w, o: bodies_at_once(w, cap, 64, o),
        "one review of 124,000 empty containers": lambda w, o: bodies_at_once(w, many, 1, o),
        "64 × reviews of 124,000 empty containers at once":
            lambda w, o: bodies_at_once(w, many, 64, o),
        "one review filling the parse and answer budgets":
            lambda w, o: bodies_at_once(w, filling, 1, o),
        "64 × reviews filling the budgets at once":
            lambda w, o: bodies_at_once(w, filling, 64, o),
        f"{options.senders} slow senders": lambda w, o: slow_senders(
            w, options, head_only=False, outcome=o),
        f"{options.senders} slow heads": lambda w, o: slow_senders(
            w, options, head_only=True, outcome=o),
    }
    out = []
    with tempfile.TemporaryDirectory() as d:
        for i, (name, attack) in enumerate(scenarios.items()):
            if options.only and not any(o in name for o in options.only):
                continue
            workdir = Path(d) / str(i)
            workdir.mkdir()
            out.append(scenario(name, workdir, attack, log))
    return out


def _pct(values: list[float], p: float) -> str:
    if not values:
        return "—"
    values = sorted(values)
    return f"{values[min(len(values) - 1, int(p / 100 * len(values)))]:.1f}"


def markdown(outcomes: list[Outcome]) -> str:
    rows = ["| scenario | idle RSS MiB | peak RSS MiB | API calls answered | API p50 / p99 ms "
            "| API errors | hostile clients |",
            "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        rows.append(f"| {o.name} | {o.idle_rss_mib:.1f} | {o.peak_rss_mib:.1f} | "
                    f"{o.api_answered}/{o.api_sent} | {_pct(o.api_ms, 50)} / "
                    f"{_pct(o.api_ms, 99)} | {o.api_errors or '—'} | {o.attack or '—'} |")
    return "\n".join(rows) + "\n"


def headline(outcomes: list[Outcome]) -> list[tuple[str, str, str, str]]:
    def ok(b: bool) -> str:
        return "ok" if b else "MISSED"
    peak = max((o.peak_rss_mib for o in outcomes), default=0.0)
    sent = sum(o.api_sent for o in outcomes)
    answered = sum(o.api_answered for o in outcomes)
    single = max((o.peak_rss_mib for o in outcomes if o.name in SINGLE), default=0.0)
    return [("webhook: peak RSS under hostile clients", f"{peak:.0f} MiB",
             f"< {CHART_LIMIT_MIB} MiB", ok(peak < CHART_LIMIT_MIB)),
            ("webhook: peak RSS, the worst single review under the 2 MiB body limit",
             f"{single:.0f} MiB", f"< {ONE_REVIEW_GOAL_MIB:.0f} MiB (¾ of the chart's limit)",
             ok(single < ONE_REVIEW_GOAL_MIB)),
            ("webhook: API server calls answered under hostile clients",
             f"{answered}/{sent}", "all", ok(answered == sent))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated parts of scenario names")
    args = ap.parse_args(argv)
    options = QUICK if args.quick else Options()
    options.only = tuple(o for o in args.only.split(",") if o)
    outcomes = run(options, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(markdown(outcomes))
    for row in headline(outcomes):
        print(" | ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
