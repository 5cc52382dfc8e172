"""Pods replaced through the real token server, in this process: what the token path keeps
per pod and per token once they are gone (tests/podidentity/test_token_churn_memory.py and
bench/container_credentials.py measure it with tracemalloc).

The listener is the real one (`ContainerCredentialsServer` on a loopback socket, its
reviewer, review queue, verdict caches and budgets), asked over real connections from
loopback addresses reused as a node reuses pod addresses.  Two stand-ins, for what the token
server does not own: the API server's TokenReview (`api_review`: it authenticates a token
naming a pod, as the real one does for a genuine token, and refuses the forged ones with
the real server's text), and the control process's pod view (`LivePods`: the pods live
now).  Time is a clock of the churn's own (`Clock`), moved on by `STEP` a replaced pod, so
a run goes through the tokens' and the budgets' lifetimes in seconds.

A replaced pod: a new pod at the next address (pods are live `STEADY` at a time), its token
asked twice (one review, one cached verdict), the kubelet's next token asked once (one more
review), every `FORGED_EVERY`th pod a forged token asked twice (a refusal, then a cached
one), then the oldest pod deleted and its token asked once more from its old address (a
replay: refused by the view, without a review).
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import socket

from kiamfast.container_credentials import pod_view
from kiamfast.container_credentials import server as srv
from kiamfast.container_credentials.token_review import (
    POD_NAME_EXTRA,
    POD_UID_EXTRA,
    BoundPod,
    TokenReviewer,
)

AUDIENCE = "kiamfast.io/container-credentials"
CREDS = b'{"AccessKeyId":"ASIACHURN","SecretAccessKey":"s","Token":"t","AccountId":' \
        b'"123456789012","Expiration":"2030-01-01T00:00:00Z"}'
STEADY = 30
STEP = 0.05                 # simulated seconds between replaced pods: 20 a second
TOKEN_LIFE = 600.0
FORGED_EVERY = 10
ADDRESSES = [f"127.1.{i // 250}.{i % 250 + 1}" for i in range(250)]   # reused in turn
FORGED_ERROR = "[invalid bearer token, go-jose/go-jose: error in cryptographic primitive]"


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _b64json(doc: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()


def token(pod: BoundPod, *, serial: int, forged: bool = False) -> str:
    claims = {"aud": [AUDIENCE], "exp": int(pod.expires), "jti": str(serial),
              "kubernetes.io": {"namespace": pod.namespace,
                                "pod": {"name": pod.name, "uid": pod.uid},
                                "serviceaccount": {"name": pod.service_account, "uid": "sa"}}}
    return f"{_b64json({'alg': 'ES256'})}.{_b64json(claims)}.{'forged' if forged else 'sig'}"


def api_review(tok: str, audience: str) -> dict:
    """What kube-apiserver's TokenReview says of these tokens."""
    head, payload, signature = tok.split(".")
    if signature == "forged":
        return {"authenticated": False, "error": FORGED_ERROR}
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    k8s = claims["kubernetes.io"]
    return {"authenticated": True, "audiences": [audience], "user": {
        "username": f"system:serviceaccount:{k8s['namespace']}:"
                    f"{k8s['serviceaccount']['name']}",
        "extra": {POD_NAME_EXTRA: [k8s["pod"]["name"]], POD_UID_EXTRA: [k8s["pod"]["uid"]]}}}


class LivePods:
    """The pod view: the pods live now, each answered with its credentials."""

    def __init__(self) -> None:
        self.pods: dict[str, BoundPod] = {}

    def known(self, uid: str) -> bool:
        return uid in self.pods

    def resolve(self, pod: BoundPod, now: float) -> bytes | pod_view.Wait:
        if pod.uid not in self.pods:
            return pod_view.Wait(pod_view.forbidden(f"pod {pod.namespace}/{pod.name} is not on node n1"))
        return CREDS

    def want(self, slot: int) -> None:
        pass


class Churn:
    """The real listener on loopback and the pods that replace each other through it."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.view = LivePods()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        reviewer = TokenReviewer(api_review, audience=AUDIENCE, clock=self.clock)
        reviewer.queue.clock = self.clock
        self.server = srv.ContainerCredentialsServer([self.sock], reviewer=reviewer,
                                                     view=self.view, wait_budget=0.0,
                                                     clock=self.clock)
        self.server.limits.clock = self.clock
        self.live: list[tuple[BoundPod, str, str]] = []     # (pod, its token, its address)
        self.serial = itertools.count()
        self.replaced = 0
        self.statuses: dict[int, int] = {}
        self.wrong = 0                     # answers that were not what the pod should get

    async def ask(self, tok: str, source: str) -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port,
                                                       local_addr=(source, 0))
        try:
            writer.write(f"GET /v1/credentials HTTP/1.1\r\nAuthorization: {tok}\r\n"
                         "Connection: close\r\n\r\n".encode())
            answer = await reader.read()
        finally:
            writer.close()
        status = int(answer.split(b" ", 2)[1])
        self.statuses[status] = self.statuses.get(status, 0) + 1
        return status

    async def expect(self, want: int, tok: str, source: str) -> None:
        if await self.ask(tok, source) != want:
            self.wrong += 1

    async def replace(self, n: int) -> None:
        """Replace ``n`` pods (the first `STEADY` calls only add them)."""
        for _ in range(n):
            self.clock.now += STEP
            i = next(self.serial)
            pod = BoundPod(namespace="churn", service_account="app", name=f"pod-{i}",
                           uid=f"uid-{i:08d}", expires=self.clock.now + TOKEN_LIFE)
            source = ADDRESSES[i % len(ADDRESSES)]
            first = token(pod, serial=i)
            self.view.pods[pod.uid] = pod
            self.live.append((pod, first, source))
            await self.expect(200, first, source)
            await self.expect(200, first, source)                       # cached
            await self.expect(200, token(pod, serial=-i - 1), source)    # rotated
            if i % FORGED_EVERY == 0:
                forged = token(pod, serial=i, forged=True)
                await self.expect(400, forged, source)
                await self.expect(400, forged, source)                   # cached refusal
            if len(self.live) > STEADY:
                gone, gone_token, gone_source = self.live.pop(0)
                del self.view.pods[gone.uid]
                await self.expect(403, gone_token, gone_source)          # a replay
                self.replaced += 1

    async def __aenter__(self) -> "Churn":
        self.task = asyncio.create_task(self.server.run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.server.close()
        self.sock.close()
