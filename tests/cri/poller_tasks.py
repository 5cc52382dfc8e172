"""Running a RuntimePoller in a test: start its run() task, and stop it, checking it never
returned or raised on its own (run() must survive every runtime fault)."""
from __future__ import annotations

import asyncio

import pytest


async def running(poller) -> asyncio.Task:
    task = asyncio.create_task(poller.run())
    await asyncio.sleep(0)
    return task


async def stop(task: asyncio.Task) -> None:
    assert not task.done(), task   # run() must never have returned or raised
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
