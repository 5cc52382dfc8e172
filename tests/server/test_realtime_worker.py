"""--worker-realtime (kiamfast/server/realtime.py): the worker runs at SCHED_RR and keeps to
its budget, on a real kernel with the real agent (root) and in its arithmetic."""
from __future__ import annotations

import logging
import os
import subprocess
import time

import pytest

from agent_process import POD_IP, ROLE, Agent, Fakes, http
from kiamfast.server.realtime import RealtimeGovernor


class Loop:
    def __init__(self) -> None:
        self.timers: list = []
        self.handlers: dict = {}

    def call_later(self, delay, fn):
        self.timers.append(fn)

    def add_signal_handler(self, sig, fn):
        self.handlers[sig] = fn


def governor(cpu: list[float], calls: list, *, refuse: bool = False) -> RealtimeGovernor:
    def set_scheduler(pid, policy, param):
        if refuse:
            raise PermissionError(1, "Operation not permitted")
        calls.append(policy & ~os.SCHED_RESET_ON_FORK)
    return RealtimeGovernor(cpu_clock=lambda: cpu[0], set_scheduler=set_scheduler)


def test_over_budget_the_worker_runs_at_its_fair_share_until_its_debt_is_paid():
    cpu, calls, loop = [0.0], [], Loop()
    g = governor(cpu, calls)
    assert g.start(loop) and calls == [os.SCHED_RR] and g.realtime
    cpu[0] += 0.005         # 5 ms of a 100 ms window: within its 10 %
    loop.timers.pop(0)()
    assert g.realtime
    cpu[0] += 0.100         # a flood takes the whole window: 100 ms for 20 earned
    loop.timers.pop(0)()
    assert not g.realtime
    windows = 0
    while not g.realtime:   # at its fair share the flood goes on, costing nothing real-time
        cpu[0] += 0.02
        loop.timers.pop(0)()
        windows += 1
    assert windows == 8     # 10 ms earned per window: the 80 ms debt is paid in 800 ms
    assert calls == [os.SCHED_RR, os.SCHED_OTHER, os.SCHED_RR] and g.demotions == 1


def test_under_a_flood_real_time_takes_no_more_than_its_budget_and_a_window():
    cpu, calls, loop = [0.0], [], Loop()
    g = governor(cpu, calls)
    g.start(loop)
    realtime_cpu = 0.0
    for _ in range(100):    # 10 s of a flood: at real time it takes all of each window
        used = 0.1 if g.realtime else 0.02
        realtime_cpu += used if g.realtime else 0.0
        cpu[0] += used
        loop.timers.pop(0)()
    assert realtime_cpu <= 0.10 * 10 + 0.1


def test_sigxcpu_a_real_time_run_too_long_drops_to_the_fair_share_at_once():
    import signal
    cpu, calls, loop = [0.0], [], Loop()
    g = governor(cpu, calls)
    g.start(loop)
    loop.handlers[signal.SIGXCPU]()
    assert not g.realtime and calls[-1] == os.SCHED_OTHER


def test_a_kernel_that_refuses_leaves_the_worker_at_its_fair_share_and_says_why(caplog):
    with caplog.at_level(logging.WARNING, logger="kiamfast.worker"):
        assert not governor([0.0], [], refuse=True).start(Loop())
    assert "the kernel refused SCHED_RR" in caplog.text and "CAP_SYS_NICE" in caplog.text


def _policy(pid: int) -> int:
    return os.sched_getscheduler(pid) & ~os.SCHED_RESET_ON_FORK


@pytest.mark.root
@pytest.mark.slow
def test_a_real_worker_runs_real_time_and_drops_it_under_a_flood(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: SCHED_RR")
    fakes = Fakes()
    agent = Agent(fakes, tmp_path / "agent", extra=["--listen-host=127.0.0.1",
                                                    "--worker-realtime"])
    try:
        agent.wait_ready(60)
        (worker,) = agent.children("kiamfast.server.worker")
        (control,) = agent.children("kiamfast.control")
        assert _policy(worker) == os.SCHED_RR, agent.log()
        assert _policy(control) == os.SCHED_OTHER and _policy(agent.pid) == os.SCHED_OTHER
        status, _ = http(agent.port, f"GET /latest/meta-data/iam/security-credentials/{ROLE}",
                         source=POD_IP)
        assert status == 200
        # a flood takes far more than 10 % of a CPU: the worker leaves real time while it lasts
        wrk = subprocess.Popen(["wrk", "-t1", "-c8", "-d4s", f"http://127.0.0.1:{agent.port}/"
                                "latest/meta-data/iam/security-credentials/x"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seen = set()
        try:
            time.sleep(0.5)
            while wrk.poll() is None:
                seen.add(_policy(worker))
                time.sleep(0.05)
        finally:
            wrk.wait(30)
        assert os.SCHED_OTHER in seen, seen
        deadline = time.monotonic() + 5
        while _policy(worker) != os.SCHED_RR and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _policy(worker) == os.SCHED_RR     # quiet again: real time again
    finally:
        agent.stop()
        fakes.stop()
