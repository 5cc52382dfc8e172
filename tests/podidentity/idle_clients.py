"""Clients that hold connections to a listener and send nothing: leaking pools, or a pod
trying to keep every connection place (tests/podidentity/test_hostile_clients.py and
bench/container_credentials.py)."""
from __future__ import annotations

import asyncio


async def open_many(port: int, sources: list[str], per_source: int, *,
                    parallel: int = 200) -> list[asyncio.StreamWriter]:
    """``per_source`` connections from each address, opened ``parallel`` at a time and left
    idle (the listener closes or resets those it has no place for)."""
    gate = asyncio.Semaphore(parallel)
    opened: list[asyncio.StreamWriter] = []

    async def one(source: str) -> None:
        async with gate:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(source, 0)), 30)
                opened.append(writer)
            except (OSError, asyncio.TimeoutError):
                pass                      # refused in the handshake: as idle as it gets
    await asyncio.gather(*(one(s) for s in sources for _ in range(per_source)))
    return opened


async def hoard(port: int, source: str, keep: int, stop: asyncio.Event, *,
                again_after: float = 0.0) -> None:
    """Hold ``keep`` idle connections from ``source``, opening each again ``again_after``
    seconds after the listener closed it, until ``stop``."""
    async def slot() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                               local_addr=(source, 0))
            except OSError:
                await asyncio.sleep(max(again_after, 0.01))
                continue
            stopped = asyncio.ensure_future(stop.wait())
            closed = asyncio.ensure_future(reader.read())
            try:
                await asyncio.wait([closed, stopped], return_when=asyncio.FIRST_COMPLETED)
            finally:
                for f in (closed, stopped):
                    if f.done() and not f.cancelled():
                        f.exception()     # a reset: retrieved, not logged as lost
                    f.cancel()
                writer.close()
            if again_after and not stop.is_set():
                await asyncio.sleep(again_after)
    await asyncio.gather(*(slot() for _ in range(keep)), return_exceptions=True)
