"""Property: whatever order the node's events arrive in, no address maps to a pod that does not
own it, and once everything has arrived every published address maps to its pod.

The test simulates one node at three levels:

* truth: the CNI hands addresses out from a small pool (so they are reused), never twice at
  once; a pod dies and its address is free at once;
* the API server: every change of a pod is a write with a resourceVersion; a pod's status
  (its address, its death) is published *later* than the truth, so the API can show a dead
  pod Running with an address that already belongs to a newer pod;
* what the model hears: the watch delivers the writes in order but may drop (a relist of
  the API state follows, as after a 410); the container runtime's polls show the truth
  (READY sandboxes and their addresses) at the moment they are taken; the runtime can
  become unreachable; the control process can be killed and restarted from the table a
  previous one left, while the world goes on (pods die, addresses are reused).

Two oracles.  While the model follows the runtime, the table must follow the last poll:
every address maps to the pod whose sandbox held it then, and nothing else is answered (an
address the API still claims waits, undecided); while the runtime cannot be asked, nothing is
answered (this model takes READY at its word, ``--address-proof=runtime``: without the
kernel a stale view proves nothing; the kernel's proof has its own property test,
test_ownership_kernel_property.py).  While it follows the API, a mapping ip -> pod is wrong
when the model has been told of a newer owner of that ip, or that the pod's claim ended, or
was never told the pod has that ip.
"""
from __future__ import annotations

import copy
import os
import tempfile
import time

from control_support import BASE, NS_KEY, ROLE_KEY, SlotSink, namespace, pod
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from kiamfast import table as tablemod
from kiamfast.control.mappings.model import NodeModel
from kiamfast.control.mappings.policy import RolePolicy
from kiamfast.decisions import IdentityKind
from kiamfast.control.cri.client import RuntimeView, Sandbox

POOL = ["10.0.0.1", "10.0.0.2"]
NAMESPACES = ("a", "b")
ALLOWED = ('["r1"]', '["r1", "r2"]', "[]")
STATE = {IdentityKind.ROLE: tablemod.POD_ROLE, IdentityKind.NO_ROLE: tablemod.POD_NO_ROLE,
         IdentityKind.DENIED: tablemod.POD_DENIED}


class World:
    def __init__(self) -> None:
        self.rv = 100
        self.api: dict[str, dict] = {}            # uid -> current object (not deleted)
        self.order: dict[str, int] = {}           # uid -> creation index
        self.queue: list[tuple[str, dict, dict]] = []   # undelivered writes (kind, obj, claims)
        self.truth_ip: dict[str, str | None] = {}
        self.alive: dict[str, bool] = {}
        self.cni: dict[str, str] = {}             # ip -> uid holding it now
        self.tseq = 0
        self.assigned: dict[tuple[str, str], int] = {}   # (uid, ip) -> seq of its latest assignment
        self.ns = {"a": '["r1"]', "b": '["r1", "r2"]'}
        self.n = 0
        self.created: dict[str, dict] = {}        # uid -> the object as created (sandbox copy)
        self.polls = 0

    # ---- truth ------------------------------------------------------------------------------
    def api_claims(self, uid: str) -> dict[str, int]:
        obj = self.api.get(uid)
        if obj is None or obj["status"]["phase"] not in ("Pending", "Running"):
            return {}
        return {e["ip"]: self.assigned[(uid, e["ip"])] for e in obj["status"].get("podIPs", [])}

    def free_ips_for(self, uid: str) -> list[str]:
        out = []
        for ip in POOL:
            if ip in self.cni:
                continue
            # A stale API claimant of this ip (dead, status not yet published) must be older
            # than the new owner: the only order the initial-list tiebreak can know.
            stale = [u for u in self.api if ip in self.api_claims(u)]
            if all(self.order[u] < self.order[uid] for u in stale):
                out.append(ip)
        return out

    # ---- API writes ---------------------------------------------------------------------------
    def write(self, uid: str, obj: dict | None, kind: str = "pod") -> None:
        self.rv += 1
        if obj is None:
            obj = copy.deepcopy(self.api.pop(uid))
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.queue.append(("delete", obj, {}))
            return
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.api[uid] = obj
        self.queue.append((kind, copy.deepcopy(obj), self.api_claims(uid)))

    def create(self, ns: str, role: str | None) -> None:
        self.n += 1
        uid = f"p{self.n}"
        self.order[uid] = self.n
        self.alive[uid] = True
        self.truth_ip[uid] = None
        obj = pod(uid, ns=ns, role=role, phase="Pending",
                  created=f"2024-01-01T{self.n // 3600:02d}:{self.n // 60 % 60:02d}:{self.n % 60:02d}Z")
        self.created[uid] = copy.deepcopy(obj)
        self.write(uid, obj)

    def set_status(self, uid: str, *, ips=None, phase=None, terminating=None, role=None) -> None:
        obj = copy.deepcopy(self.api[uid])
        if ips is not None:
            obj["status"]["podIPs"] = [{"ip": ip} for ip in ips]
            obj["status"]["podIP"] = ips[0] if ips else ""
        if phase is not None:
            obj["status"]["phase"] = phase
        if terminating:
            obj["metadata"]["deletionTimestamp"] = "2024-01-02T00:00:00Z"
        if role is not None:
            ann = obj["metadata"]["annotations"]
            if role == "":
                ann.pop(ROLE_KEY, None)
            else:
                ann[ROLE_KEY] = role
        self.write(uid, obj)

    def runtime_view(self) -> RuntimeView:
        """A runtime poll now: the READY sandboxes, with the pod's annotations as created."""
        sbs = []
        for ip, uid in sorted(self.cni.items()):
            obj = self.created[uid]
            sbs.append(Sandbox(id=f"sb-{uid}-{ip}", pod_uid=uid, name=obj["metadata"]["name"],
                               namespace=obj["metadata"]["namespace"], ips=(ip,),
                               annotations=dict(obj["metadata"]["annotations"]),
                               created_ns=0))
        self.polls += 1
        return RuntimeView(started_ns=self.polls, sandboxes=tuple(sbs),
                           owners={sb.ips[0]: sb for sb in sbs}, conflicts=frozenset())


class Oracle:
    def __init__(self, policy: RolePolicy) -> None:
        self.policy = policy
        self.delivered: dict[tuple[str, str], int] = {}   # (uid, ip) -> seq the model heard of
        self.api_shown: set[tuple[str, str, int]] = set()
        self.ended: set[tuple[str, str, int]] = set()
        self.newest: dict[str, int] = {}
        self.api_obj: dict[str, dict] = {}
        self.ns_rules = {}

    def heard_claim(self, uid: str, ip: str, seq: int, *, api: bool) -> None:
        self.delivered[(uid, ip)] = max(seq, self.delivered.get((uid, ip), 0))
        self.newest[ip] = max(self.newest.get(ip, 0), seq)
        if api:
            self.api_shown.add((uid, ip, seq))

    def heard_api(self, obj: dict, claims: dict[str, int], *, deleted: bool = False) -> None:
        uid = obj["metadata"]["uid"]
        live = not deleted and obj["status"]["phase"] in ("Pending", "Running")
        for (u, ip), seq in list(self.delivered.items()):
            if u != uid:
                continue
            if not live or ((u, ip, seq) in self.api_shown and ip not in claims):
                self.ended.add((u, ip, seq))
        if live:
            for ip, seq in claims.items():
                self.heard_claim(uid, ip, seq, api=True)
        if deleted:
            self.api_obj.pop(uid, None)
        else:
            self.api_obj[uid] = obj

    def check_runtime(self, t: tablemod.Table, view: RuntimeView) -> None:
        mapped = {e["ip"]: e["pod_uid"] for e in t.snapshot()}
        answered = {e["ip"]: e["pod_uid"] for e in t.snapshot()
                    if e["pod_state"] != tablemod.POD_UNDECIDED}
        shown = {ip: sb.pod_uid for ip, sb in view.owners.items()}
        assert {ip: mapped.get(ip) for ip in shown} == shown, \
            f"table {mapped} != the last runtime poll {shown}"
        assert answered.items() <= shown.items(), \
            f"table {answered} answers what the last runtime poll {shown} does not show"

    def check_stale(self, t: tablemod.Table) -> None:
        """The runtime cannot be asked while sandboxes go on starting and stopping, and
        without the kernel nothing proves who holds an address: nothing is answered."""
        answered = [e for e in t.snapshot() if e["pod_state"] != tablemod.POD_UNDECIDED]
        assert answered == [], f"answered while nothing proves an owner: {answered}"

    def check(self, t: tablemod.Table, sink: SlotSink, entries=None) -> None:
        for entry in (t.snapshot() if entries is None else entries):
            ip, uid = entry["ip"], entry["pod_uid"]
            seq = self.delivered.get((uid, ip))
            assert seq is not None, f"{ip} -> {uid}: the model was never told {uid} has it"
            assert (uid, ip, seq) not in self.ended, f"{ip} -> {uid}: its claim has ended"
            assert seq == self.newest[ip], f"{ip} -> {uid}: a newer owner is known"
            obj = self.api_obj.get(uid)
            if obj is not None:
                ident = self.policy.decide(obj["metadata"]["annotations"],
                                           self.ns_rules.get(obj["metadata"]["namespace"]))
                assert entry["pod_state"] == STATE[ident.kind], (ip, uid, ident)
                if ident.kind == IdentityKind.ROLE:
                    assert entry["cred_slot"] == sink.slot_for(ident.role_arn,
                                                                ident.external_id or None)


def table_view(t: tablemod.Table) -> RuntimeView:
    """The table's mapping as a runtime view (only `owners[ip].pod_uid` is read)."""
    owners = {e["ip"]: Sandbox(id=e["pod_uid"], pod_uid=e["pod_uid"], name="", namespace="",
                               ips=(e["ip"],), annotations={}, created_ns=0)
              for e in t.snapshot()}
    return RuntimeView(started_ns=0, sandboxes=(), owners=owners, conflicts=frozenset())

# Weighted towards churn on the small address pool, where the races are.
ACTIONS = (["create"] * 3 + ["sandbox"] * 4 + ["publish"] * 3 + ["die"] * 3 + ["publish_death"] * 2
           + ["delete"] * 2 + ["deliver"] * 8 + ["runtime"] * 3
           + ["terminate", "recreate", "role", "ns", "relist", "runtime_failed", "restart"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_no_address_ever_maps_to_a_pod_that_does_not_own_it(data):
    world = World()
    policy = RolePolicy(base_role_arn=BASE, namespace_restrictions=True)
    oracle = Oracle(policy)
    sink = SlotSink()
    fd, path = tempfile.mkstemp(prefix="kiamfast-prop-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.close(fd)
    t = tablemod.Table.create(path, ip_capacity=64, cred_capacity=8, value_size=256,
                              aux_count=0, aux_size=64, max_workers=1)
    last_view: list[RuntimeView] = []
    stale: list[bool] = []        # the runtime cannot be asked (the fallback decides)

    def start_model(adopted=None) -> NodeModel:
        m = NodeModel(policy=policy, table=t, sink=sink, adopted=adopted)
        for name, ann in world.ns.items():
            m.apply_namespace(namespace(name, {NS_KEY: ann}))
            oracle.ns_rules[name] = policy.namespace_rules(name, {NS_KEY: ann})
        return m

    def relist(m: NodeModel) -> None:
        world.queue.clear()
        items = [copy.deepcopy(o) for o in world.api.values()]
        m.replace_pods(items, list_rv=world.rv)
        listed = {o["metadata"]["uid"] for o in items}
        for uid in list(oracle.api_obj):
            if uid not in listed:
                oracle.heard_api(oracle.api_obj[uid], {}, deleted=True)
        for o in items:
            oracle.heard_api(o, world.api_claims(o["metadata"]["uid"]))

    try:
        model = start_model()
        model.set_synced(True)
        model.commit()

        def deliver_one() -> None:
            kind, obj, claims = world.queue.pop(0)
            note(f"  deliver {kind} {obj['metadata']['uid']} rv={obj['metadata']['resourceVersion']} claims={claims}")
            if kind == "delete":
                model.delete_pod(obj)
                oracle.heard_api(obj, {}, deleted=True)
            else:
                model.apply_pod(obj)
                oracle.heard_api(obj, claims)

        for _ in range(data.draw(st.integers(10, 120), label="steps")):
            action = data.draw(st.sampled_from(ACTIONS), label="action")
            live = [u for u, o in world.api.items() if o["status"]["phase"] in ("Pending", "Running")]
            if action == "create":
                world.create(data.draw(st.sampled_from(NAMESPACES)),
                             data.draw(st.sampled_from([None, "r1", "r2"])))
            elif action == "sandbox":
                cands = [u for u in live if world.alive[u] and not world.truth_ip[u]]
                if not cands:
                    continue
                uid = data.draw(st.sampled_from(cands))
                free = world.free_ips_for(uid)
                if not free:
                    continue
                ip = data.draw(st.sampled_from(free))
                world.tseq += 1
                world.truth_ip[uid], world.cni[ip] = ip, uid
                world.assigned[(uid, ip)] = world.tseq
            elif action == "recreate":
                cands = [u for u in live if world.alive[u] and world.truth_ip[u]]
                if not cands:
                    continue
                uid = data.draw(st.sampled_from(cands))
                free = [ip for ip in world.free_ips_for(uid) if ip != world.truth_ip[uid]]
                if not free:
                    continue
                del world.cni[world.truth_ip[uid]]
                ip = data.draw(st.sampled_from(free))
                world.tseq += 1
                world.truth_ip[uid], world.cni[ip] = ip, uid
                world.assigned[(uid, ip)] = world.tseq
            elif action == "publish":
                cands = [u for u in live if world.alive[u] and world.truth_ip[u]
                         and world.api_claims(u) != {world.truth_ip[u]: world.assigned[(u, world.truth_ip[u])]}]
                if not cands:
                    continue
                uid = data.draw(st.sampled_from(cands))
                world.set_status(uid, ips=[world.truth_ip[uid]], phase="Running")
            elif action == "die":
                cands = [u for u in live if world.alive[u]]
                if not cands:
                    continue
                uid = data.draw(st.sampled_from(cands))
                world.alive[uid] = False
                if world.truth_ip[uid]:
                    del world.cni[world.truth_ip[uid]]
                world.truth_ip[uid] = None
            elif action == "publish_death":
                cands = [u for u in live if not world.alive[u]]
                if not cands:
                    continue
                world.set_status(data.draw(st.sampled_from(cands)),
                                 phase=data.draw(st.sampled_from(["Failed", "Succeeded"])))
            elif action == "terminate":
                cands = [u for u in live if not world.api[u]["metadata"].get("deletionTimestamp")]
                if not cands:
                    continue
                world.set_status(data.draw(st.sampled_from(cands)), terminating=True)
            elif action == "delete":
                cands = [u for u in world.api if not world.alive[u]]
                if not cands:
                    continue
                world.write(data.draw(st.sampled_from(cands)), None)
            elif action == "role":
                if not live:
                    continue
                world.set_status(data.draw(st.sampled_from(live)),
                                 role=data.draw(st.sampled_from(["", "r1", "r2"])))
            elif action == "ns":
                name = data.draw(st.sampled_from(NAMESPACES))
                ann = data.draw(st.sampled_from(ALLOWED))
                world.ns[name] = ann
                model.apply_namespace(namespace(name, {NS_KEY: ann}))
                oracle.ns_rules[name] = policy.namespace_rules(name, {NS_KEY: ann})
            elif action == "deliver":
                if not world.queue:
                    continue
                deliver_one()
            elif action == "relist":
                # The watch dropped (or 410): relist the API as it is now; the watch resumes
                # after it, so the queued writes are covered by the list.
                relist(model)
            elif action == "runtime":
                v = world.runtime_view()
                model.apply_runtime(v)
                last_view[:] = [v]
                stale.clear()
            elif action == "runtime_failed":
                if not last_view and not stale:
                    last_view[:] = [table_view(t)]   # no view yet: the table stands in
                model.runtime_failed(time.monotonic_ns())
                stale[:] = [True]
            elif action == "restart":
                # kill -9 of the control process; a new one starts from the table, lists the
                # API (the world went on meanwhile) and polls the runtime if it has one.  It
                # knows what the table and the list say, no more: the API oracle starts over
                # (with the API alone, a dead pod the list still shows Running with an
                # address looks like its owner; the runtime view settles that).
                oracle = Oracle(policy)
                oracle.ns_rules = {n: policy.namespace_rules(n, {NS_KEY: a})
                                   for n, a in world.ns.items()}
                model = start_model(adopted={e["ip"]: (e["pod_uid"], e["pod_state"],
                                                       e["cred_slot"]) for e in t.snapshot()})
                relist(model)
                model.set_synced(True)
                if last_view or stale:
                    v = world.runtime_view()
                    model.apply_runtime(v)
                    last_view[:] = [v]
                    stale.clear()
            note(f"{action}: api={ {u: (o['status']['phase'], [e['ip'] for e in o['status'].get('podIPs', [])], o['metadata']['resourceVersion']) for u, o in world.api.items()} } "
                 f"truth={ {u: ip for u, ip in world.truth_ip.items() if ip} } queue={len(world.queue)} "
                 f"table={ {e['ip']: e['pod_uid'] for e in t.snapshot()} }")
            model.commit()
            if stale:
                oracle.check_stale(t)
            elif last_view:
                oracle.check_runtime(t, last_view[0])
            else:
                oracle.check(t, sink)

        if last_view or stale:
            # The runtime answers once more: the table is exactly what it shows.
            v = world.runtime_view()
            model.apply_runtime(v)
            model.commit()
            oracle.check_runtime(t, v)
            return
        # Everything arrives: every address the API shows for a live owner is mapped to it.
        while world.queue:
            note(f"final deliver {world.queue[0][0]} {world.queue[0][1]['metadata']['uid']} rv={world.queue[0][1]['metadata']['resourceVersion']}")
            deliver_one()
            model.commit()
            oracle.check(t, sink)
        mapped = {e["ip"]: e["pod_uid"] for e in t.snapshot()}
        for uid, obj in world.api.items():
            claims = world.api_claims(uid)
            for ip, seq in claims.items():
                if world.cni.get(ip) == uid and world.assigned[(uid, ip)] == seq:
                    assert mapped.get(ip) == uid, f"{ip} should map to {uid}, maps to {mapped.get(ip)}"
        assert t.pending_pods == model.pending_pods
    finally:
        t.close()
        os.unlink(path)
