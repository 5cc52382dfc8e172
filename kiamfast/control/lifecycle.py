"""The control process's start as the list it is (Cilium's hive, reduced to what this process
needs): each step starts one room that is already built, in order, and is timed into the
start's milestones (``start: <step> after <s>``); the rooms started are stopped in reverse.

Long-running work is a task of :class:`Tasks`: a task that ends is a failure of the whole
process (the supervisor restarts it; the table keeps serving meanwhile), unless it was made
with ``for_life=False`` (the start's own wait for readiness, which may end).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kiamfast import milestones

log = logging.getLogger("kiamfast.control")

Action = Callable[[], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class Step:
    name: str                       # the milestone once its start returned
    start: Action
    stop: Action | None = None


async def _call(action: Action) -> None:
    result = action()
    if inspect.isawaitable(result):
        await result


class Lifecycle:
    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self._started: list[Step] = []

    async def start(self) -> None:
        for step in self.steps:
            await _call(step.start)
            self._started.append(step)
            milestones.mark(step.name)

    async def stop(self) -> None:
        """Stop what started, the last first; one step's failure does not keep the others
        from stopping."""
        while self._started:
            step = self._started.pop()
            if step.stop is None:
                continue
            try:
                await _call(step.stop)
            except Exception:   # noqa: BLE001 - logged: the rest must still stop
                log.exception("stopping %s failed", step.name)


class TaskFailed(Exception):
    """A task that must run for the life of the control process ended."""


class Tasks:
    """The process's long-running tasks, by name."""

    def __init__(self) -> None:
        self._for_life: list[asyncio.Task] = []
        self._others: list[asyncio.Task] = []

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str, *,
              for_life: bool = True) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        if for_life:
            self._for_life.append(task)
        else:
            self._others.append(task)
            task.add_done_callback(_log_end)
        return task

    async def until_stopped_or_failed(self, stop: asyncio.Event) -> None:
        """Wait for ``stop``, or a task for life ending: then TaskFailed (logged)."""
        stopped = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([stopped, *self._for_life],
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        failed = [t for t in done if t is not stopped]
        for task in failed:
            _log_end(task)
        if failed:
            raise TaskFailed(", ".join(t.get_name() for t in failed))

    async def cancel(self, *names: str) -> None:
        """Cancel the tasks of these names (all of them without names) and wait for them."""
        tasks = [t for t in (*self._for_life, *self._others)
                 if not names or t.get_name() in names]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._for_life = [t for t in self._for_life if t not in tasks]
        self._others = [t for t in self._others if t not in tasks]


def _log_end(task: asyncio.Task) -> None:
    if task.cancelled():
        return
    if task.exception() is not None:
        log.error("control task %s failed", task.get_name(), exc_info=task.exception())
    elif task.get_name() != "ready":
        log.error("control task %s ended", task.get_name())
