"""kiamfast/cpu_wait.py over a /proc and cgroup tree this test writes: what it counts, when it
warns and what the warning names (the starved real agent: test_cpu_wait_starved.py)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kiamfast.cpu_wait import CgroupFiles, CpuWait, find_cgroup


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.sup = 100

    def process(self, pid: int, cmdline: str, threads: dict[int, tuple[int, int]]) -> None:
        d = self.root / str(pid)
        (d / "task").mkdir(parents=True, exist_ok=True)
        (d / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode() + b"\0")
        for old in (d / "task").iterdir():
            if int(old.name) not in threads:
                for f in old.iterdir():
                    f.unlink()
                old.rmdir()
        for tid, (delay, slices) in threads.items():
            (d / "task" / str(tid)).mkdir(exist_ok=True)
            (d / "task" / str(tid) / "schedstat").write_text(f"1000 {delay} {slices}\n")

    def children(self, pids: list[int]) -> None:
        (self.root / str(self.sup) / "task" / str(self.sup) / "children").write_text(
            " ".join(map(str, pids)) + " ")


@pytest.fixture
def proc(tmp_path):
    p = FakeProc(tmp_path / "proc")
    p.process(100, "python -m kiamfast", {100: (0, 0)})
    return p


def series(w: CpuWait) -> dict[str, float]:
    return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
            for line in w.metric_lines() if not line.startswith("#")}


def test_run_delay_is_summed_by_process_kind_and_never_goes_back(proc, tmp_path):
    proc.process(200, "python -m kiamfast.server.worker --table t", {200: (5_000_000, 10),
                                                                      201: (1_000_000, 2)})
    proc.process(300, "python -m kiamfast.control --table t", {300: (2_000_000, 4)})
    proc.children([200, 300])
    w = CpuWait(supervisor_pid=100, proc=proc.root, cgroup=CgroupFiles())
    w.poll()
    s = series(w)
    assert s['kiamfast_cpu_run_delay_seconds_total{process="worker"}'] == pytest.approx(0.006)
    assert s['kiamfast_cpu_timeslices_total{process="worker"}'] == 12
    assert s['kiamfast_cpu_run_delay_seconds_total{process="control"}'] == pytest.approx(0.002)
    # a worker thread exits and a new worker replaces the old one: what they waited stays
    proc.process(200, "python -m kiamfast.server.worker --table t", {200: (6_000_000, 11)})
    proc.process(400, "python -m kiamfast.server.worker --table t", {400: (3_000_000, 1)})
    proc.children([300, 400])
    w.poll()
    s = series(w)
    assert s['kiamfast_cpu_run_delay_seconds_total{process="worker"}'] == pytest.approx(0.009)
    assert s['kiamfast_cpu_timeslices_total{process="worker"}'] == 13


def _starve(proc, w, clock, per_slice_ns: int, *, windows: int = 1) -> None:
    """``windows`` windows of polls every 2 s, the worker waking 10 times a second and
    waiting ``per_slice_ns`` each time (clock[1:] keeps its schedstat)."""
    if len(clock) == 1:
        clock += [0, 0]
        w.poll()
    for _ in range(windows * 5):
        clock[0] += 2.0
        clock[1] += 20 * per_slice_ns
        clock[2] += 20
        proc.process(200, "python -m kiamfast.server.worker", {200: (clock[1], clock[2])})
        w.poll()


def test_one_warning_names_the_request_when_the_workers_wait_past_the_threshold(
        proc, caplog):
    proc.process(200, "python -m kiamfast.server.worker", {200: (0, 0)})
    proc.children([200])
    clock = [0.0]
    w = CpuWait(supervisor_pid=100, proc=proc.root, cgroup=CgroupFiles(),
                clock=lambda: clock[0], policy_of=lambda pid: os.SCHED_OTHER)
    with caplog.at_level(logging.WARNING, logger="kiamfast.cpu_wait"):
        _starve(proc, w, clock, 1_000_000)        # 1 ms per wake-up: no warning
        assert not caplog.records
        _starve(proc, w, clock, 30_000_000, windows=3)   # 30 ms: one warning, not three
    assert len(caplog.records) == 1 and w.warnings == 1
    text = caplog.records[0].getMessage()
    assert "waited for the CPU 30.0 ms per wake-up" in text
    assert "run the workers at real-time priority (--worker-realtime" in text
    assert "raise the agent's CPU request (chart: resources.requests.cpu" in text
    assert series(w)['kiamfast_cpu_wait_per_timeslice_seconds{process="worker"}'] == \
        pytest.approx(0.03)


def test_real_time_workers_still_waiting_are_past_their_budget(proc, caplog):
    proc.process(200, "python -m kiamfast.server.worker", {200: (0, 0)})
    proc.children([200])
    clock = [0.0]
    w = CpuWait(supervisor_pid=100, proc=proc.root, cgroup=CgroupFiles(),
                clock=lambda: clock[0], policy_of=lambda pid: os.SCHED_RR)
    with caplog.at_level(logging.WARNING, logger="kiamfast.cpu_wait"):
        _starve(proc, w, clock, 30_000_000)
    text = caplog.records[0].getMessage()
    assert "at real-time priority and past their CPU budget" in text
    assert "--worker-realtime" not in text


def test_a_throttled_cgroup_is_told_to_drop_its_cpu_limit(proc, tmp_path, caplog):
    stat = tmp_path / "cpu.stat"
    stat.write_text("nr_periods 10\nnr_throttled 0\nthrottled_time 0\n")
    proc.process(200, "python -m kiamfast.server.worker", {200: (0, 0)})
    proc.children([200])
    clock = [0.0]
    w = CpuWait(supervisor_pid=100, proc=proc.root, cgroup=CgroupFiles(cpu_stat=stat, version=1),
                clock=lambda: clock[0], policy_of=lambda pid: os.SCHED_OTHER)
    w.poll()
    stat.write_text("nr_periods 110\nnr_throttled 40\nthrottled_time 2500000000\n")
    with caplog.at_level(logging.WARNING, logger="kiamfast.cpu_wait"):
        _starve(proc, w, clock, 30_000_000)
    assert "throttled in 40 CPU periods: remove the agent's CPU limit" in \
        caplog.records[0].getMessage()
    s = series(w)
    assert s["kiamfast_cpu_cfs_throttled_periods_total"] == 40
    assert s["kiamfast_cpu_cfs_throttled_seconds_total"] == pytest.approx(2.5)


def test_few_wake_ups_are_not_judged(proc, caplog):
    proc.process(200, "python -m kiamfast.server.worker", {200: (0, 0)})
    proc.children([200])
    clock = [0.0]
    w = CpuWait(supervisor_pid=100, proc=proc.root, cgroup=CgroupFiles(),
                clock=lambda: clock[0], policy_of=lambda pid: os.SCHED_OTHER)
    w.poll()
    clock[0] += 11.0
    proc.process(200, "python -m kiamfast.server.worker", {200: (900_000_000, 3)})
    with caplog.at_level(logging.WARNING, logger="kiamfast.cpu_wait"):
        w.poll()
    assert not caplog.records


def test_the_cgroup_is_found_through_the_mount_of_its_hierarchy(tmp_path):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "pressure").mkdir()
    (proc / "pressure" / "cpu").write_text("some avg10=1.00 avg60=0 avg300=0 total=4000000\n"
                                           "full avg10=0 avg60=0 avg300=0 total=0\n")
    cpu = tmp_path / "cg" / "cpu"
    unified = tmp_path / "cg" / "unified"
    (cpu / "pod" / "agent").mkdir(parents=True)
    (cpu / "pod" / "agent" / "cpu.stat").write_text("nr_periods 0\n")
    (unified / "pod" / "agent").mkdir(parents=True)
    (unified / "pod" / "agent" / "cpu.pressure").write_text(
        "some avg10=0 avg60=0 avg300=0 total=1500000\n")
    (proc / "self" / "cgroup").write_text(
        "4:memory:/kubepods/x\n2:cpu,cpuacct:/kubepods/pod/agent\n0::/kubepods/pod/agent\n")
    (proc / "self" / "mountinfo").write_text(
        f"32 31 0:29 /kubepods {cpu} rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
        f"41 31 0:38 /kubepods {unified} rw,relatime - cgroup2 cgroup2 rw\n")
    found = find_cgroup(proc)
    assert (found.cpu_stat, found.version) == (cpu / "pod" / "agent" / "cpu.stat", 1)
    assert (found.pressure, found.pressure_scope) == (
        unified / "pod" / "agent" / "cpu.pressure", "cgroup")
    w = CpuWait(supervisor_pid=1, proc=proc, cgroup=found)
    w.poll()
    assert series(w)['kiamfast_cpu_pressure_seconds_total{scope="cgroup",kind="some"}'] == 1.5
