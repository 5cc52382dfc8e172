"""Property: under either runtime's order of a stop, whatever the interleaving of CNI ADD and
DEL, sandbox states, failed statuses, polls, outages and restarts, no address is ever
answered with a pod whose sandbox's network namespace does not hold it, exclusively, as the
kernel showed it when the model last read it (after each poll, each failed attempt, each
batch of notifications).

The world: a small pool of addresses (so they are reused), sandboxes with a namespace each;
CNI ADD puts an address in a sandbox's namespace once no namespace holds it, CNI DEL takes
it out.  containerd's stop: NOTREADY, then CNI DEL.  CRI-O's: CNI DEL, then (later, or never
while a container will not stop) NOTREADY.  The runtime's polls list the READY sandboxes,
leaving out those whose status fails; the agent's link to the runtime can break; the
control process can be restarted from the table the previous one left.  The API is late:
a pod's address is published (or not) at any time, a dead pod stays Running with it.  The
kernel the model reads is a snapshot taken when the source would read it (the real watch is
tested against the real kernel in tests/netns).

The oracle reads the table as a worker would: only once a poll or a failed attempt is dated
(a restarted process's table has no date until its first), every entry answered with a role,
no role or a denial names a pod one of whose sandboxes (of the view the model holds) had its
namespace hold the address, and no other namespace held it, in the kernel the model last
read.
"""
from __future__ import annotations

import copy
import os
import tempfile

from control_support import BASE, ROLE_KEY, Kernel, SlotSink, pod, runtime_view, sandbox
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from kiamfast import table as tablemod
from kiamfast.control.mappings.policy import RolePolicy
from kiamfast.control.mappings.model import NodeModel

POOL = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
ACTIONS = (["create"] * 3 + ["ready"] * 3 + ["stop"] * 3 + ["finish"] * 2 + ["remove"]
           + ["publish"] * 2 + ["api_delete"] + ["fail_status", "heal_status"]
           + ["poll"] * 4 + ["drain"] * 2 + ["runtime_failed"] * 2 + ["restart"])


class World:
    def __init__(self, order: str) -> None:
        self.order = order
        self.kernel: dict[str, set[str]] = {}       # netns -> addresses held now (truth)
        self.sandboxes: dict[str, dict] = {}        # id -> uid, ips, ready, netns, stopping
        self.failing: set[str] = set()              # ids whose status fails
        self.api: dict[str, dict] = {}              # uid -> pod object
        self.rv = 10
        self.n = 0

    def holder(self, ip: str) -> set[str]:
        return {ns for ns, held in self.kernel.items() if ip in held}

    def free(self) -> list[str]:
        return [ip for ip in POOL if not self.holder(ip)]

    def create(self, ip: str, role: str) -> None:
        self.n += 1
        uid, sid = f"p{self.n}", f"s{self.n}"
        self.rv += 1
        self.api[uid] = pod(uid, role=role, phase="Pending", rv=self.rv)
        self.kernel[f"ns-{sid}"] = {ip}               # CNI ADD, before READY
        self.sandboxes[sid] = {"uid": uid, "ips": (ip,), "ready": False, "netns": f"ns-{sid}",
                               "role": role}

    def cni_del(self, sid: str) -> None:
        self.kernel.get(self.sandboxes[sid]["netns"], set()).clear()

    def stop(self, sid: str) -> None:
        sb = self.sandboxes[sid]
        if self.order == "containerd":
            sb["ready"] = False
            self.cni_del(sid)
            self.kernel.pop(sb["netns"], None)
        else:
            self.cni_del(sid)                         # still READY until finish
            sb["stopping"] = True

    def finish(self, sid: str) -> None:
        sb = self.sandboxes[sid]
        sb["ready"], sb["stopping"] = False, False
        self.kernel.pop(sb["netns"], None)

    def view(self, started_ns: int):
        shown = [sandbox(sb["uid"], *sb["ips"], sandbox_id=sid, netns=sb["netns"],
                         annotations={ROLE_KEY: sb["role"]})
                 for sid, sb in sorted(self.sandboxes.items())
                 if sb["ready"] and sid not in self.failing]
        return runtime_view(*shown, started_ns=started_ns)


def check(t: tablemod.Table, kernel: Kernel, view_sandboxes: dict[str, set[str]]) -> None:
    """``view_sandboxes``: uid -> the namespaces of its sandboxes in the view the model
    holds (the last view, also while the runtime cannot be asked)."""
    if max(t.verified_ns, t.failed_ns) == 0:
        return                                   # no date: workers answer nothing yet
    for entry in t.snapshot():
        if entry["pod_state"] == tablemod.POD_UNDECIDED:
            continue
        ip, uid = entry["ip"], entry["pod_uid"]
        holders = {ns for ns, held in kernel.held.items() if ip in held}
        assert len(holders) == 1, f"{ip} -> {uid} answered; namespaces holding it: {holders}"
        assert holders <= view_sandboxes.get(uid, set()), \
            f"{ip} -> {uid} answered, held by {holders}, not by {uid}'s sandbox"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_no_address_is_answered_with_a_pod_whose_namespace_does_not_hold_it(data):
    world = World(data.draw(st.sampled_from(["crio", "containerd"]), label="order"))
    policy = RolePolicy(base_role_arn=BASE)
    sink = SlotSink()
    kernel = Kernel()                           # what the model last read
    fd, path = tempfile.mkstemp(prefix="kiamfast-kprop-",
                                dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.close(fd)
    t = tablemod.Table.create(path, ip_capacity=64, cred_capacity=16, value_size=256,
                              aux_count=0, aux_size=64, max_workers=1)
    clock = [1_000]
    held: dict[str, set[str]] = {}              # uid -> namespaces, of the view applied

    def read_kernel() -> None:
        kernel.held = copy.deepcopy(world.kernel)

    def new_model(adopted=None) -> NodeModel:
        m = NodeModel(policy=policy, table=t, sink=sink, proof=kernel, expect_runtime=True,
                      adopted=adopted)
        m.replace_pods([copy.deepcopy(o) for o in world.api.values()], list_rv=world.rv)
        m.set_synced(True)
        return m

    try:
        model = new_model()
        for _ in range(data.draw(st.integers(10, 80), label="steps")):
            action = data.draw(st.sampled_from(ACTIONS), label="action")
            sids = sorted(world.sandboxes)
            clock[0] += 1_000
            if action == "create":
                free = world.free()
                if not free:
                    continue
                world.create(data.draw(st.sampled_from(free)),
                             data.draw(st.sampled_from(["r1", "r2", "r3"])))
            elif action in ("ready", "stop", "finish", "remove", "fail_status", "heal_status"):
                if not sids:
                    continue
                sid = data.draw(st.sampled_from(sids))
                sb = world.sandboxes[sid]
                if action == "ready" and sb["netns"] in world.kernel and not sb.get("stopping"):
                    sb["ready"] = True
                elif action == "stop" and sb["netns"] in world.kernel:
                    world.stop(sid)
                elif action == "finish" and sb.get("stopping"):
                    world.finish(sid)
                elif action == "remove" and not sb["ready"]:
                    world.kernel.pop(sb["netns"], None)
                    del world.sandboxes[sid]
                elif action == "fail_status":
                    world.failing.add(sid)
                elif action == "heal_status":
                    world.failing.discard(sid)
            elif action == "publish":
                cands = [sid for sid in sids if world.sandboxes[sid]["uid"] in world.api]
                if not cands:
                    continue
                sb = world.sandboxes[data.draw(st.sampled_from(cands))]
                world.rv += 1
                obj = pod(sb["uid"], ips=sb["ips"], role=sb["role"], rv=world.rv)
                world.api[sb["uid"]] = obj
                model.apply_pod(copy.deepcopy(obj))
            elif action == "api_delete":
                if not world.api:
                    continue
                uid = data.draw(st.sampled_from(sorted(world.api)))
                world.rv += 1
                obj = world.api.pop(uid)
                obj["metadata"]["resourceVersion"] = str(world.rv)
                model.delete_pod(obj)
            elif action == "poll":
                read_kernel()                    # the source reads the kernel after the poll
                view = world.view(clock[0])
                model.kernel_changed()
                model.apply_runtime(view)
                held.clear()
                for sb in view.sandboxes:
                    held.setdefault(sb.pod_uid, set()).add(sb.netns)
            elif action == "drain":
                read_kernel()
                model.kernel_changed()
            elif action == "runtime_failed":
                read_kernel()
                model.kernel_changed()
                model.runtime_failed(clock[0])
            elif action == "restart":
                t.reset_freshness()              # the supervisor's, when it adopts the table
                model = new_model(adopted={e["ip"]: (e["pod_uid"], e["pod_state"],
                                                     e["cred_slot"]) for e in t.snapshot()})
                held.clear()
            note(f"{action}: kernel={world.kernel} ready="
                 f"{ {s: (b['uid'], b['ready']) for s, b in world.sandboxes.items()} } "
                 f"failing={world.failing} table="
                 f"{ {e['ip']: (e['pod_uid'], e['pod_state']) for e in t.snapshot()} }")
            model.commit()
            check(t, kernel, held)
    finally:
        t.close()
        os.unlink(path)
