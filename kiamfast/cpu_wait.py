"""The agent's own wait for the CPU: run delay, its cgroup's throttling, CPU pressure.

On a node whose CPUs are all busy (an ML node's data loaders), the agent gets the CPU weight
of its own request, and a request to it waits in the run queue before any of its code runs:
the pods see credential calls take tens or hundreds of milliseconds, and nothing in the
agent's request counters says why. This module measures that wait from the kernel's own
accounts and says it:

* **run delay**: the time each thread of the agent's processes (the supervisor and its
  children: the workers above all, the control process) spent runnable but not running,
  and how many times it got a CPU (``/proc/PID/task/TID/schedstat``: run time, run delay,
  time slices). A worker's mean run delay per time slice is what a request waits for the
  CPU each time the worker wakes for it;
* **throttling**: the agent's cgroup's CFS bandwidth periods and throttled periods and time
  (``cpu.stat``, v1 or v2), non-zero only under a CPU limit;
* **pressure**: the time some task of the agent's cgroup (v2 ``cpu.pressure``; the node's
  ``/proc/pressure/cpu`` where the cgroup's is not readable) waited for a CPU.

:meth:`CpuWait.poll` reads them (a few small /proc files; the control process calls it at
every publish) and keeps counters that never go back (a thread that exits leaves its share
behind); :meth:`CpuWait.lines` renders the CPU-wait series (docs/metrics.md). Once a window
holds enough worker wake-ups and their mean wait is over the threshold, one warning names the
fix (the CPU request, or the CPU limit when the cgroup was throttled), at most once per
``warn_every``. A leaf module: it imports nothing of the agent's but the metrics text.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kiamfast import metrics_text as text

log = logging.getLogger("kiamfast.cpu_wait")

# A request waits for the CPU at least as long as the worker does per wake-up, the slowest
# far longer: at a mean of 4.2 ms the bench's p99 was 0.6 s, at 0.3 ms or less (an idle node
# on a loaded machine) it was the machine's (docs/performance.md, "A saturated node").
THRESHOLD_S = 0.002
WINDOW_S = 10.0
MIN_SLICES = 10           # fewer wake-ups in a window: too few to judge
WARN_EVERY_S = 300.0
KINDS = ("worker", "control", "supervisor", "other")


def kind_of(cmdline: str) -> str:
    if "kiamfast.server.worker" in cmdline:
        return "worker"
    if "kiamfast.control" in cmdline:
        return "control"
    return "other"


@dataclass
class _Kind:
    delay_ns: int = 0
    slices: int = 0


@dataclass
class CgroupFiles:
    """Where the agent's cgroup keeps its cpu.stat and cpu.pressure (None: not found)."""
    cpu_stat: Path | None = None
    version: int = 0
    pressure: Path | None = None
    pressure_scope: str = ""        # "cgroup" or "node"


def find_cgroup(proc: Path = Path("/proc"), pid: str = "self") -> CgroupFiles:
    """The cgroup of ``pid`` in the cpu controller's hierarchy (v1) or the unified one
    (v2), mapped through /proc/PID/mountinfo to files this process can read."""
    found = CgroupFiles()
    try:
        membership = (proc / pid / "cgroup").read_text().splitlines()
        mounts = (proc / pid / "mountinfo").read_text().splitlines()
    except OSError:
        return found
    v1_path = v2_path = None
    for line in membership:
        num, controllers, path = line.split(":", 2)
        if num == "0" and controllers == "":
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    v1_mount = v2_mount = None
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        root, point, fstype, opts = fields[3], fields[4], rfields[0], rfields[2].split(",")
        if fstype == "cgroup" and "cpu" in opts:
            v1_mount = (root, point)
        elif fstype == "cgroup2":
            v2_mount = (root, point)
    v1_dir = _inside(v1_mount, v1_path)
    v2_dir = _inside(v2_mount, v2_path)
    if v1_dir is not None and (v1_dir / "cpu.stat").exists():
        found.cpu_stat, found.version = v1_dir / "cpu.stat", 1
    elif v2_dir is not None and (v2_dir / "cpu.stat").exists():
        found.cpu_stat, found.version = v2_dir / "cpu.stat", 2
    if v2_dir is not None and v2_path not in ("/", None) and (v2_dir / "cpu.pressure").exists():
        found.pressure, found.pressure_scope = v2_dir / "cpu.pressure", "cgroup"
    elif (proc / "pressure" / "cpu").exists():
        found.pressure, found.pressure_scope = proc / "pressure" / "cpu", "node"
    return found


def _inside(mount: tuple[str, str] | None, path: str | None) -> Path | None:
    """The directory of cgroup ``path`` under a mount of its hierarchy whose root is
    ``mount[0]`` (a container's namespace shows "/" for its own)."""
    if mount is None or path is None:
        return None
    root, point = mount
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return Path(point) / path.lstrip("/")


def read_cpu_stat(path: Path | None) -> dict[str, int]:
    if path is None:
        return {}
    try:
        pairs = (line.split() for line in path.read_text().splitlines())
        return {k: int(v) for k, v in pairs}
    except (OSError, ValueError):
        return {}


def read_pressure(path: Path | None) -> dict[str, int]:
    """{"some": µs, "full": µs} of total stall time (PSI), or {}."""
    if path is None:
        return {}
    out = {}
    try:
        for line in path.read_text().splitlines():
            kind, *pairs = line.split()
            for pair in pairs:
                key, _, value = pair.partition("=")
                if key == "total":
                    out[kind] = int(value)
    except (OSError, ValueError):
        return {}
    return out


@dataclass
class CpuWait:
    """The CPU wait of the agent whose supervisor is ``supervisor_pid`` (see the module)."""

    supervisor_pid: int
    threshold_s: float = THRESHOLD_S
    window_s: float = WINDOW_S
    warn_every_s: float = WARN_EVERY_S
    proc: Path = Path("/proc")
    clock: Callable[[], float] = time.monotonic
    policy_of: Callable[[int], int] = os.sched_getscheduler
    cgroup: CgroupFiles | None = None
    kinds: dict[str, _Kind] = field(default_factory=lambda: {k: _Kind() for k in KINDS})
    warnings: int = 0
    last_wait_s: dict[str, float] = field(default_factory=dict)    # the last window's mean

    def __post_init__(self) -> None:
        if self.cgroup is None:
            self.cgroup = find_cgroup(self.proc, str(self.supervisor_pid))
        self._threads: dict[tuple[int, int], tuple[str, int, int]] = {}
        self._window: tuple[float, dict[str, tuple[int, int]], int] | None = None
        self._warned_at = float("-inf")
        self._stat: dict[str, int] = {}
        self._pressure: dict[str, int] = {}

    # ---- reading ----------------------------------------------------------------------------

    def processes(self) -> dict[int, str]:
        """pid -> kind: the supervisor and its children."""
        out = {self.supervisor_pid: "supervisor"}
        try:
            children = (self.proc / str(self.supervisor_pid) / "task" / str(self.supervisor_pid)
                        / "children").read_text().split()
        except OSError:
            children = []
        for child in children:
            try:
                cmdline = (self.proc / child / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            out[int(child)] = kind_of(cmdline.decode(errors="replace"))
        return out

    def poll(self) -> None:
        seen: dict[tuple[int, int], tuple[str, int, int]] = {}
        for pid, kind in self.processes().items():
            try:
                tids = os.listdir(self.proc / str(pid) / "task")
            except OSError:
                continue
            for tid in tids:
                try:
                    _, delay, slices = (self.proc / str(pid) / "task" / tid
                                        / "schedstat").read_text().split()
                except (OSError, ValueError):
                    continue
                seen[(pid, int(tid))] = (kind, int(delay), int(slices))
        for key, (kind, delay, slices) in seen.items():
            _, old_delay, old_slices = self._threads.get(key, (kind, 0, 0))
            k = self.kinds[kind]
            k.delay_ns += max(0, delay - old_delay)
            k.slices += max(0, slices - old_slices)
        self._threads = seen
        assert self.cgroup is not None
        self._stat = read_cpu_stat(self.cgroup.cpu_stat)
        self._pressure = read_pressure(self.cgroup.pressure)
        self._judge()

    # ---- the warning ------------------------------------------------------------------------

    def _judge(self) -> None:
        now = self.clock()
        totals = {k: (v.delay_ns, v.slices) for k, v in self.kinds.items()}
        throttled = self.throttled_periods()
        if self._window is None:
            self._window = (now, totals, throttled)
            return
        start, before, throttled_before = self._window
        if now - start < self.window_s:
            return
        self._window = (now, totals, throttled)
        for kind in ("worker", "control"):
            delay = totals[kind][0] - before[kind][0]
            slices = totals[kind][1] - before[kind][1]
            if slices:
                self.last_wait_s[kind] = delay / slices / 1e9
        slices = totals["worker"][1] - before["worker"][1]
        wait = self.last_wait_s.get("worker", 0.0)
        if slices < MIN_SLICES or wait <= self.threshold_s:
            return
        if now - self._warned_at < self.warn_every_s:
            return
        self._warned_at = now
        self.warnings += 1
        if throttled > throttled_before:
            fix = ("its cgroup was throttled in %d CPU periods: remove the agent's CPU limit "
                   "(chart: resources.limits.cpu)" % (throttled - throttled_before))
        elif self.workers_realtime():
            fix = ("the workers are at real-time priority and past their CPU budget (a flood?): "
                   "raise the agent's CPU request (chart: resources.requests.cpu; "
                   "docs/install.md, \"A saturated node\")")
        else:
            fix = ("the node's CPUs are busy and the agent gets the CPU weight of its request: "
                   "run the workers at real-time priority (--worker-realtime: the chart's "
                   "realtimeWorkers, with CAP_SYS_NICE) or raise the agent's CPU request "
                   "(chart: resources.requests.cpu; docs/install.md, \"A saturated node\")")
        log.warning("the workers waited for the CPU %.1f ms per wake-up over the last %.0f s "
                    "(threshold %.1f ms): credential requests wait at least as long; %s",
                    wait * 1e3, now - start, self.threshold_s * 1e3, fix)

    def workers_realtime(self) -> bool:
        """Whether every worker runs at a real-time class now."""
        workers = [pid for pid, kind in self.processes().items() if kind == "worker"]
        try:
            return bool(workers) and all(
                self.policy_of(pid) & ~os.SCHED_RESET_ON_FORK
                in (os.SCHED_RR, os.SCHED_FIFO) for pid in workers)
        except OSError:
            return False

    def throttled_periods(self) -> int:
        return self._stat.get("nr_throttled", 0)

    # ---- the series -------------------------------------------------------------------------

    def metric_lines(self) -> list[str]:
        run_delay = text.Counter("kiamfast_cpu_run_delay_seconds_total", "Time the agent's "
                                 "threads were runnable but waited for a CPU (schedstat), by "
                                 "process.", ("process",))
        slices = text.Counter("kiamfast_cpu_timeslices_total", "Times the agent's threads got "
                              "a CPU (schedstat), by process: run delay ÷ time slices is the "
                              "mean wait per wake-up.", ("process",))
        for kind, k in self.kinds.items():
            run_delay.set(k.delay_ns / 1e9, kind)
            slices.set(k.slices, kind)
        lines = run_delay.lines() + slices.lines()
        wait = text.Gauge("kiamfast_cpu_wait_per_timeslice_seconds", "Mean run delay per "
                          "time slice over the last window, by process.", ("process",))
        for kind, value in self.last_wait_s.items():
            wait.set(value, kind)
        lines += wait.lines()
        lines += [*text.header("kiamfast_cpu_wait_warnings_total", "Warnings logged because "
                               "the workers waited for the CPU longer than the threshold.",
                               "counter"),
                  text.sample("kiamfast_cpu_wait_warnings_total", self.warnings)]
        if self._stat:
            throttled_s = (self._stat["throttled_time"] / 1e9 if "throttled_time" in self._stat
                           else self._stat.get("throttled_usec", 0) / 1e6)
            for name, help_text, value in (
                    ("kiamfast_cpu_cfs_periods_total", "CFS bandwidth periods of the agent's "
                     "cgroup (cpu.stat; only under a CPU limit).",
                     self._stat.get("nr_periods", 0)),
                    ("kiamfast_cpu_cfs_throttled_periods_total", "Periods in which the "
                     "agent's cgroup was throttled (cpu.stat).", self.throttled_periods()),
                    ("kiamfast_cpu_cfs_throttled_seconds_total", "Time the agent's cgroup "
                     "was throttled (cpu.stat).", throttled_s)):
                lines += [*text.header(name, help_text, "counter"), text.sample(name, value)]
        if self._pressure:
            assert self.cgroup is not None
            pressure = text.Counter("kiamfast_cpu_pressure_seconds_total", "Time some (or "
                                    "all) tasks waited for a CPU (PSI): of the agent's cgroup, "
                                    "or of the node where the cgroup's is not readable.",
                                    ("scope", "kind"))
            for kind, us in self._pressure.items():
                pressure.set(us / 1e6, self.cgroup.pressure_scope, kind)
            lines += pressure.lines()
        return lines
