"""kube2iam's health check and /healthz: the instance ID read from the node's metadata service
(every 30 s), plus where addresses come from (the runtime's state), the API server's state
and the startup taint's.  Unhealthy — no instance ID, or the agent's own runtime link dead
(`cri/link.py`) — /healthz answers 500 with the reason (the liveness probe restarts the
container).  ``readiness`` says what a 503 from /readyz waits for (the workers' body)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from kiamfast.control import imds_client

if TYPE_CHECKING:
    from kiamfast.control.api_link import ApiLink
    from kiamfast.control.cri.source import RuntimeSource
    from kiamfast.control.publish.blobs import AuxPublisher

HEALTH_INTERVAL = 30.0

# What the start sequence (process.py) waits for, in order; the runtime's answer again
# while a lasting outage keeps /readyz at 503 (cri/source.py watch_link).
WAITING_PODS = "the pods' list from the API server"
WAITING_RUNTIME = "the container runtime's answer"
WAITING_CREDENTIALS = "the pods' credentials from STS"


class Health:
    def __init__(self, *, metadata_addr: str, host_ip: str, aux: AuxPublisher,
                 runtime: RuntimeSource, api: ApiLink,
                 token_reviews: Callable[[], str] | None) -> None:
        """``token_reviews``: the container-credentials listener's word on its reviews (None:
        no listener)."""
        self.metadata_addr = metadata_addr
        self.host_ip = host_ip
        self.aux = aux
        self.runtime = runtime
        self.api = api
        self.token_reviews = token_reviews
        self.instance_id = ""
        self.error = "no health check yet"
        self.waiting = WAITING_PODS        # "" once ready

    def readiness(self) -> str:
        """"ready", or "waiting for <what>[: <the outage that holds it>]"."""
        if not self.waiting:
            return "ready"
        holding = ""
        if self.waiting == WAITING_PODS and self.api.state.startswith("unreachable"):
            holding = f"the API server is {self.api.state}"
        elif self.waiting == WAITING_RUNTIME and self.runtime.state != "ok":
            holding = self.runtime.state
        return f"waiting for {self.waiting}" + (f": {holding}" if holding else "")

    @property
    def healthy(self) -> bool:
        return bool(self.instance_id) and not self.runtime.link.broken

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                self.instance_id = await loop.run_in_executor(None, imds_client.instance_id,
                                                              self.metadata_addr)
                self.error = ""
            except imds_client.ImdsError as e:
                self.instance_id, self.error = "", str(e)
            self.publish()
            await asyncio.sleep(HEALTH_INTERVAL)

    def wait_for(self, what: str) -> None:
        """The start sequence's next step (one of the WAITING_ texts), or "" once ready."""
        self.waiting = what
        self.publish()

    def publish(self) -> None:
        if not self.healthy:
            self.aux.health(None, self.runtime.link.broken or self.error)
            return
        body = {"hostIP": self.host_ip, "instanceId": self.instance_id,
                "runtime": self.runtime.state, "kubernetes": self.api.state,
                "taint": self.api.taint_state, "readiness": self.readiness()}
        if self.token_reviews is not None:
            body["containerCredentials"] = self.token_reviews()
        self.aux.health(body, "")
