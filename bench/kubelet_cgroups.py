"""Cgroups shaped as the kubelet's cgroupfs driver makes them, for a node the benchmarks own.

The kubelet (k8s.io/kubernetes v1.34, pkg/kubelet/cm) turns a CPU request into a weight and
puts every pod under one tree whose QoS tiers decide what competes with what:

* ``kubepods``: cpu.shares of the node's allocatable CPU (node_container_manager_linux.go);
* a Guaranteed pod directly under it (``kubepods/pod<uid>``), a Burstable one under
  ``kubepods/burstable`` (shares: the sum of the Burstable pods' requests,
  qos_container_manager_linux.go ``setCPUCgroupConfig``), a BestEffort one under
  ``kubepods/besteffort`` (2 shares, ``MinShares``); each pod's cgroup, then its
  container's, at the pod's or container's request (helpers_linux.go
  ``ResourceConfigForPod``);
* a request becomes shares as ``MilliCPUToShares``: m × 1024 / 1000, at least 2, at most
  262144; on cgroup v2 the same shares become cpu.weight as ``getCPUWeight``
  (cgroup_manager_linux.go): 1 + (shares − 2) × 9999 / 262142, integer arithmetic, so a
  20m request is weight 1 there;
* the kernel turns a cpu.weight back into a group weight as ``sched_weight_from_cgroup``:
  weight × 1024 / 100, rounded (kernel/sched/core.c ``cpu_weight_write_u64``).

:class:`Hierarchy` makes such a tree under a root of its own in v1's ``cpu`` hierarchy or in
the cgroup v2 hierarchy, moves processes in, and takes it all away again (processes back to
the root they came from). ``V2_ON_V1`` writes, through v1's cpu.shares, the group weights the
kernel derives from the cpu.weight a v2 kubelet writes: the scheduler sees the same weights,
but it is v1's interface, and the report says so.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path

V1_CPU = Path("/sys/fs/cgroup/cpu")
V2_CANDIDATES = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
MIN_SHARES, MAX_SHARES = 2, 262144

V1, V2, V2_ON_V1 = "v1", "v2", "v2 weights on v1"
VERSIONS = (V1, V2, V2_ON_V1)


def milli_to_shares(milli: int) -> int:
    """kubelet's MilliCPUToShares."""
    if milli == 0:
        return MIN_SHARES
    return max(MIN_SHARES, min(MAX_SHARES, milli * 1024 // 1000))


def shares_to_weight(shares: int) -> int:
    """kubelet's getCPUWeight (cgroup v2): [2, 262144] -> [1, 10000]."""
    if shares >= MAX_SHARES:
        return 10000
    return 1 + (shares - 2) * 9999 // 262142


def kernel_weight_of_cpu_weight(weight: int) -> int:
    """The group weight (v1 shares' unit) the kernel sets for a cpu.weight."""
    return (weight * 1024 + 50) // 100


def group_weight(milli: int | None, version: str, *, shares: int | None = None) -> int:
    """What the scheduler weighs a group at, for a request (``milli``) or given v1 shares."""
    s = milli_to_shares(milli or 0) if shares is None else shares
    return s if version == V1 else kernel_weight_of_cpu_weight(shares_to_weight(s))


def v2_root() -> Path | None:
    for p in V2_CANDIDATES:
        if (p / "cgroup.controllers").exists():
            return p
    return None


def unavailable(version: str) -> str | None:
    """Why this machine cannot make the tree of ``version``, or None."""
    if os.geteuid() != 0:
        return "not root: cgroups need it"
    if version in (V1, V2_ON_V1):
        if not (V1_CPU / "cpu.shares").exists():
            return f"no cgroup v1 cpu controller at {V1_CPU}"
        return None
    root = v2_root()
    if root is None:
        return "no cgroup v2 hierarchy mounted"
    if "cpu" not in (root / "cgroup.controllers").read_text().split():
        return (f"cgroup v2 at {root} has no cpu controller (controllers: "
                f"{(root / 'cgroup.controllers').read_text().strip() or 'none'}): the cpu "
                "controller is bound to cgroup v1 on this machine, and rebinding it would "
                "take it from everything else running here")
    return None


def _rt_read(group: Path) -> int:
    try:
        return int((group / "cpu.rt_runtime_us").read_text())
    except (OSError, ValueError):
        return 0


def _rt_free(group: Path) -> int:
    """The real-time runtime ``group``'s parent has left for it beside its siblings."""
    siblings = sum(_rt_read(g) for g in group.parent.iterdir()
                   if g.is_dir() and g != group)
    return max(0, _rt_read(group.parent) - siblings)


class Hierarchy:
    """A kubelet-shaped tree under a root of its own (``kubepods`` and below are made by
    :meth:`group`); :meth:`close` moves every process back and removes it."""

    def __init__(self, version: str) -> None:
        reason = unavailable(version)
        if reason:
            raise RuntimeError(reason)
        self.version = version
        base = V1_CPU if version in (V1, V2_ON_V1) else v2_root()
        assert base is not None
        self.base = base
        self.root = base / f"kiamfast-bench-{os.getpid()}-{secrets.token_hex(3)}"
        self.root.mkdir()
        self.groups: list[Path] = [self.root]
        if version == V2:
            self._enable_cpu(self.base)

    @staticmethod
    def _enable_cpu(path: Path) -> None:
        (path / "cgroup.subtree_control").write_text("+cpu")

    def group(self, rel: str, *, milli: int | None = None, shares: int | None = None,
              quota_milli: int | None = None) -> Path:
        """The cgroup ``rel`` (parents first, made as needed) weighted as the kubelet weighs
        a request of ``milli`` (or ``shares`` directly), CFS quota for a limit."""
        path = self.root / rel
        for i in range(1, len(path.relative_to(self.root).parts) + 1):
            part = self.root.joinpath(*path.relative_to(self.root).parts[:i])
            if not part.exists():
                if self.version == V2:      # a parent holds no process: it may delegate
                    self._enable_cpu(part.parent)
                part.mkdir()
                self.groups.append(part)
        s = milli_to_shares(milli or 0) if shares is None else shares
        if self.version == V1:
            (path / "cpu.shares").write_text(str(s))
        elif self.version == V2_ON_V1:
            (path / "cpu.shares").write_text(str(group_weight(None, V2, shares=s)))
        else:
            (path / "cpu.weight").write_text(str(shares_to_weight(s)))
        if quota_milli is not None:
            quota = quota_milli * 100_000 // 1000
            if self.version == V2:
                (path / "cpu.max").write_text(f"{quota} 100000")
            else:
                (path / "cpu.cfs_quota_us").write_text(str(quota))
        return path

    def root_rt_runtime(self) -> int:
        f = self.base / "cpu.rt_runtime_us"
        return int(f.read_text()) if f.exists() else 0

    def set_rt_runtime(self, rel: str, runtime_us: int, *, parents: bool = True) -> int:
        """v1 with CONFIG_RT_GROUP_SCHED: let ``rel``'s tasks run real-time for
        ``runtime_us`` of every period (its parents get as much first; ``parents=False``:
        ``rel`` and its pod's group only, leaf first, to take it back).  A level gets no more
        than its parent has left beside its siblings (another job's groups may hold some):
        returns what ``rel`` got, which may be less, or 0."""
        parts = rel.split("/")
        levels = range(len(parts) + 1) if parents else range(len(parts), len(parts) - 2, -1)
        granted = runtime_us
        for i in levels:
            f = self.root.joinpath(*parts[:i]) / "cpu.rt_runtime_us"
            if not f.exists():
                continue
            if runtime_us:
                granted = min(granted, _rt_free(f.parent))
            try:
                f.write_text(str(granted))
            except OSError:            # the kernel's own sum says no: nothing real-time
                granted = 0
                with contextlib.suppress(OSError):
                    f.write_text("0")
        return granted

    def move(self, path: Path, pids: list[int]) -> None:
        """Every thread of each process into ``path`` (cgroup.procs moves a whole process)."""
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, OSError):
                (path / "cgroup.procs").write_text(str(pid))

    def stat(self, path: Path) -> dict[str, int]:
        try:
            text = (path / "cpu.stat").read_text()
        except OSError:
            return {}
        return {k: int(v) for k, v in (line.split() for line in text.splitlines() if line)}

    def close(self) -> None:
        """Processes left inside go back to the base; the groups go, leaves first."""
        for path in reversed(self.groups):
            with contextlib.suppress(OSError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (self.base / "cgroup.procs").write_text(pid)
        for path in sorted(self.groups, key=lambda p: len(p.parts), reverse=True):
            # real-time runtime handed back first: a group that will not go (a process
            # still leaving it) must not keep it from the next tree (the kernel sums it)
            with contextlib.suppress(OSError):
                if _rt_read(path):
                    (path / "cpu.rt_runtime_us").write_text("0")
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
