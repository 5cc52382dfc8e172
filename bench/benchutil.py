"""Small helpers every benchmark in bench/ shares: processes, /proc readings, stats (ports,
pod addresses and AWS environments are kiamfast.testing's, re-exported here).

The benchmarks start real processes (the agent, nginx, the Python baseline, load
generators) and read what they cost from /proc, because a shared two-core machine is too
noisy for anything but ratios and distributions measured side by side in one run. Nothing
here measures anything by itself; it only reads and summarises.

Never kill by name: every process a benchmark starts is stopped through its own Popen.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
for _p in (str(ROOT), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# kiamfast.testing's helpers (one definition each), for every bench script: this
# checkout's kiamfast, from the sys.path above.
from kiamfast.testing.aws_env import offline as aws_env  # noqa: E402
from kiamfast.testing.aws_env import offline_env  # noqa: E402
from kiamfast.testing.net import free_port, pod_addresses, wait_port  # noqa: E402
from kiamfast.testing.procs import children, cmdline  # noqa: E402

__all__ = ["BENCH", "ROOT", "aws_env", "child_env", "children", "cmdline", "cpu_seconds",
           "free_port", "machine_facts", "median", "pod_addresses", "python", "rss_bytes",
           "set_affinity", "stop", "summarize_us", "wait_port"]


class Unavailable(RuntimeError):
    """A benchmark cannot run on this machine (a peer not built): bench/run reports the
    section skipped with this reason, and fails it only in CI (CI=true), as the test
    suite's skips (tests/conftest.py)."""


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a child process: static AWS credentials (never the real metadata
    service, never a profile from the machine), this checkout on PYTHONPATH."""
    path = os.environ.get("PYTHONPATH")
    return offline_env(PYTHONPATH=str(ROOT) + (os.pathsep + path if path else ""), **extra)


def stop(proc: subprocess.Popen | None, *, timeout: float = 10.0) -> None:
    """SIGTERM this process (only it), wait, SIGKILL if it does not go."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- /proc -----------------------------------------------------------------------------------

_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process, all its threads (0.0 if it is gone).

    Read from the process's CPU-time clock, in nanoseconds: /proc's clock ticks (10 ms) round
    a short measurement to nothing. The clock id is what glibc's clock_getcpuclockid(pid)
    returns on Linux (Python has no wrapper); /proc is the fallback."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)   # MAKE_PROCESS_CPUCLOCK(pid, SCHED)
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TCK


def proc_memory(pid: int, *, smaps: bool = True) -> dict[str, int]:
    """A process's memory as /proc shows it, in bytes, by the kernel's own field names:
    ``status``'s (VmRSS, VmHWM, ...) and, with ``smaps``, ``smaps_rollup``'s (Rss, Pss,
    Pss_Shmem, Anonymous, Private_Dirty, ...: a walk of its mappings, dearer); {} once it is
    gone.  The one reader of the benches; only a child measuring its own imports reads
    /proc itself (importing this module would be part of what it measures)."""
    out: dict[str, int] = {}
    try:
        for name in ("status", "smaps_rollup") if smaps else ("status",):
            with open(f"/proc/{pid}/{name}") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    value = rest.split()
                    if len(value) == 2 and value[1] == "kB":
                        out[key] = int(value[0]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def rss_bytes(pid: int) -> int:
    return proc_memory(pid, smaps=False).get("VmRSS", 0)


def set_affinity(pids: Iterable[int], cpus: set[int] | None) -> None:
    if not cpus:
        return
    for pid in pids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, cpus)


# ---- statistics ------------------------------------------------------------------------------

def summarize_us(lat_us: np.ndarray) -> dict[str, float]:
    """p50/p90/p99/p99.9/max in milliseconds of latencies given in microseconds."""
    if lat_us.size == 0:
        nan = float("nan")
        return {"n": 0, "p50": nan, "p90": nan, "p99": nan, "p999": nan, "max": nan,
                "mean": nan}
    q = np.percentile(lat_us, [50, 90, 99, 99.9]) / 1e3
    return {"n": int(lat_us.size), "p50": float(q[0]), "p90": float(q[1]),
            "p99": float(q[2]), "p999": float(q[3]), "max": float(lat_us.max()) / 1e3,
            "mean": float(lat_us.mean()) / 1e3}


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]
    return float(np.median(xs)) if xs else float("nan")


# ---- machine facts ---------------------------------------------------------------------------

def _version(cmd: list[str]) -> str:
    if not shutil.which(cmd[0]):
        return "not installed"
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    text = (p.stdout or p.stderr).strip().splitlines()
    return text[0] if text else "?"


def machine_facts() -> dict[str, str]:
    import importlib.metadata as md
    facts = {
        "date (UTC)": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "cpus (nproc)": str(len(os.sched_getaffinity(0))),
        "cpu model": _cpu_model(),
        "memory": f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB",
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "kernel": platform.release(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
    }
    for dist in ("kiamfast", "uvloop", "httptools", "Cython", "orjson", "kubernetes",
                 "botocore", "moto", "numpy", "matplotlib"):
        try:
            facts[dist] = md.version(dist)
        except md.PackageNotFoundError:
            facts[dist] = "not installed"
    facts["nginx"] = _version(["nginx", "-v"]).replace("nginx version: ", "")
    facts["wrk"] = _version(["wrk", "--version"]).split(" [")[0]
    return facts


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def python() -> str:
    return sys.executable
