"""Opt-in real-time scheduling for a server worker (``--worker-realtime``), with a bound on
the harm it can do to the node's other work.

On a node whose CPUs are all busy, the kubelet gives the agent the CPU weight of its small
request, and the fair scheduler lets it run only that share: each wake-up for a request
waits tens of milliseconds behind the workload (docs/performance.md, "A saturated node").
A worker at SCHED_RR (the lowest real-time priority) runs the moment a request arrives, and
a request costs it tens of microseconds. What keeps it from taking the node:

* **its own budget**, a token bucket of CPU time: it earns ``budget`` (10 %) of every second,
  holds at most one window's worth, and every ``window`` (100 ms) pays for the CPU time its
  thread used at real-time priority. In debt, it drops to SCHED_OTHER and competes at its
  fair weight like any process until the debt is paid. Over any stretch of time it takes at
  most ``budget`` of a CPU ahead of the node's work, plus one window;
* **the kernel's backstop**: RLIMIT_RTTIME: a real-time run of ``RTTIME_SOFT`` without
  sleeping sends SIGXCPU, upon which the worker drops to SCHED_OTHER at once (a loop stuck in
  one callback never reaches the window's check); the hard limit kills it (the supervisor
  starts another). The kernel's own real-time throttling (sched_rt_runtime_us) holds above
  both;
* SCHED_RESET_ON_FORK: nothing it starts inherits the class.

It needs CAP_SYS_NICE (and, on kernels with CONFIG_RT_GROUP_SCHED, real-time runtime for the
container's cgroup, which no kubelet gives): without it the worker says so once and stays
SCHED_OTHER.
"""
from __future__ import annotations

import logging
import os
import resource
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kiamfast.worker")

PRIORITY = 1                 # the lowest real-time priority: every other real-time task wins
BUDGET = 0.10                # of one CPU at real-time priority, earned as time passes
WINDOW = 0.1                 # seconds between two checks; one window's budget may be saved
RTTIME_SOFT_US = 50_000      # one real-time run without sleeping: SIGXCPU, back to SCHED_OTHER
RTTIME_HARD_US = 1_000_000   # and the kernel kills a worker stuck that long


@dataclass
class RealtimeGovernor:
    """Runs the calling thread (a worker's event loop) at SCHED_RR within its budget."""

    budget: float = BUDGET
    window: float = WINDOW
    cpu_clock: Callable[[], float] = time.thread_time
    set_scheduler: Callable[[int, int, Any], None] = os.sched_setscheduler
    realtime: bool = False
    demotions: int = 0
    credit: float = 0.0             # CPU seconds it may still use at real-time priority
    _last_cpu: float = field(default=0.0, repr=False)
    _demoted_mid_window: bool = field(default=False, repr=False)
    _loop: Any = field(default=None, repr=False)     # set once started

    def start(self, loop: Any) -> bool:
        """Real time from now on, with the budget checked on ``loop``; False (said once in
        the log) when the kernel refuses."""
        if not self._promote():
            return False
        try:
            resource.setrlimit(resource.RLIMIT_RTTIME, (RTTIME_SOFT_US, RTTIME_HARD_US))
        except (ValueError, OSError) as e:
            log.info("RLIMIT_RTTIME not set (%s): the worker's own budget still holds", e)
        loop.add_signal_handler(signal.SIGXCPU, self._ran_too_long)
        self._last_cpu = self.cpu_clock()
        self.credit = self.budget * self.window
        self._loop = loop
        loop.call_later(self.window, self._tick)
        log.info("worker runs at real-time priority (SCHED_RR %d) within %.0f%% of a CPU",
                 PRIORITY, self.budget * 100)
        return True

    def _tick(self) -> None:
        """Earn this window's budget, pay what the window used at real-time priority (a
        window is real time or not as a whole: the class changes here and at SIGXCPU, whose
        window counts as real time)."""
        cpu = self.cpu_clock()
        used, self._last_cpu = cpu - self._last_cpu, cpu
        paid = used if (self.realtime or self._demoted_mid_window) else 0.0
        self._demoted_mid_window = False
        self.credit = min(self.credit + self.budget * self.window - paid,
                          self.budget * self.window)
        if self.credit <= 0 and self.realtime:
            self._demote()
        elif self.credit > 0 and not self.realtime:
            self._promote()
        self._loop.call_later(self.window, self._tick)

    def _ran_too_long(self) -> None:
        if self.realtime:
            self._demote()
            self._demoted_mid_window = True

    def _promote(self) -> bool:
        try:
            self.set_scheduler(0, os.SCHED_RR | os.SCHED_RESET_ON_FORK,
                               os.sched_param(PRIORITY))
        except OSError as e:
            if self._loop is None:      # refused at start: said once
                log.warning("--worker-realtime: the kernel refused SCHED_RR (%s; it needs "
                            "CAP_SYS_NICE, and on kernels with CONFIG_RT_GROUP_SCHED real-time "
                            "runtime for the container's cgroup): the worker stays at its "
                            "fair share", e.strerror or e)
            return False
        self.realtime = True
        return True

    def _demote(self) -> None:
        try:
            self.set_scheduler(0, os.SCHED_OTHER | os.SCHED_RESET_ON_FORK, os.sched_param(0))
        except OSError:
            return
        self.realtime = False
        self.demotions += 1
