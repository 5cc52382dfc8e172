"""kube2iam's health check and /healthz: the instance ID read from the node's metadata service
(every 30 s), plus where addresses come from (the runtime's state), the API server's state
and the startup taint's.  Unhealthy — no instance ID, or the agent's own runtime link dead
(`cri/link.py`) — /healthz answers 500 with the reason (the liveness probe restarts the
container)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kiamfast.control import imds_client

HEALTH_INTERVAL = 30.0


class Health:
    def __init__(self, *, metadata_addr: str, host_ip: str, aux: Any) -> None:
        self.metadata_addr = metadata_addr
        self.host_ip = host_ip
        self.aux = aux                     # publish.aux.AuxPublisher
        self.runtime: Any = None           # cri.source.RuntimeSource
        self.kubernetes = "connecting"     # | ok | unreachable: <error>
        self.instance_id = ""
        self.error = "no health check yet"

    @property
    def healthy(self) -> bool:
        return bool(self.instance_id) and not self.runtime.link.broken

    async def run(self, publish: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                self.instance_id = await loop.run_in_executor(None, imds_client.instance_id,
                                                              self.metadata_addr)
                self.error = ""
            except imds_client.ImdsError as e:
                self.instance_id, self.error = "", str(e)
            publish()
            await asyncio.sleep(HEALTH_INTERVAL)

    def publish(self, *, container: Any, taint: Any) -> None:
        if not self.healthy:
            self.aux.health(None, self.runtime.link.broken or self.error)
            return
        body = {"hostIP": self.host_ip, "instanceId": self.instance_id,
                "runtime": self.runtime.state, "kubernetes": self.kubernetes,
                "taint": taint.state if taint is not None else "pending"}
        if container is not None:
            body["containerCredentials"] = container.health()
        self.aux.health(body, "")
