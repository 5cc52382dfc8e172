"""The ownership model: which pod owns which address, as written into a real table file."""
from kiamfast import table as tablemod
from kiamfast.control.mappings.policy import RolePolicy
from kiamfast.control.mappings import report
from kiamfast.decisions import IdentityKind
from kiamfast.control.mappings.model import NodeModel
from kiamfast.control.mappings.canonical import canonical_ip, pod_ips

from control_support import (BASE, NS_KEY, ROLE_KEY, Kernel, lookup, namespace, pod,
                             runtime_view, sandbox)

ROLE, NO_ROLE, DENIED = tablemod.POD_ROLE, tablemod.POD_NO_ROLE, tablemod.POD_DENIED


def test_pod_with_role_is_written_with_its_credential_slot(make_model, table, sink):
    m = make_model()
    m.apply_pod(pod("a", ips=("10.0.0.5",), role="app", ext="x"))
    m.commit()
    assert lookup(table, "10.0.0.5") == ("a", ROLE, sink.slot_for(BASE + "app", "x"))
    req = sink.requests["a"]
    assert (req.role_arn, req.external_id, req.namespace, req.pod_name, req.service_account,
            req.pod_ip) == (BASE + "app", "x", "default", "pod-a", "sa", "10.0.0.5")


def test_credentials_are_prefetched_before_the_pod_has_an_address(make_model, table, sink):
    m = make_model()
    m.apply_pod(pod("a", phase="Pending", role="app"))
    m.commit()
    assert "a" in sink.holders and sink.requests["a"].pod_ip is None
    assert table.pending_pods == 1
    m.apply_pod(pod("a", ips=("10.0.0.5",), role="app", rv=2))
    m.commit()
    assert lookup(table, "10.0.0.5") == ("a", ROLE, sink.slot_for(BASE + "app"))
    assert table.pending_pods == 0
    assert sink.requests["a"].pod_ip == "10.0.0.5"   # the manager learns the address


def test_unannotated_and_denied_pods_are_written_as_such(make_model, table):
    m = make_model(namespace_restrictions=True)
    m.apply_namespace(namespace("default", {NS_KEY: '["ok"]'}))
    m.apply_pod(pod("plain", ips=("10.0.0.1",)))
    m.apply_pod(pod("bad", ips=("10.0.0.2",), role="not-allowed"))
    m.apply_pod(pod("good", ips=("10.0.0.3",), role="ok"))
    m.commit()
    assert lookup(table, "10.0.0.1") == ("plain", NO_ROLE, -1)
    assert lookup(table, "10.0.0.2") == ("bad", DENIED, -1)
    assert lookup(table, "10.0.0.3")[:2] == ("good", ROLE)


def test_terminal_phase_releases_at_once_and_terminating_keeps(make_model, table, sink):
    m = make_model()
    m.apply_pod(pod("a", ips=("10.0.0.1",), role="r"))
    m.apply_pod(pod("b", ips=("10.0.0.2",), role="r"))
    m.commit()
    m.apply_pod(pod("a", ips=("10.0.0.1",), role="r", terminating=True, rv=2))
    m.apply_pod(pod("b", ips=("10.0.0.2",), role="r", phase="Succeeded", rv=3))
    m.commit()
    assert lookup(table, "10.0.0.1")[0] == "a"
    assert lookup(table, "10.0.0.2") is None
    assert "b" not in sink.holders and "a" in sink.holders


def test_host_network_pods_own_nothing(make_model, table):
    m = make_model()
    m.apply_pod(pod("h", ips=("192.168.1.10",), role="r", host_network=True))
    m.commit()
    assert lookup(table, "192.168.1.10") is None
    assert table.pending_pods == 0


def test_dual_stack_pods_own_every_address(make_model, table):
    m = make_model()
    m.apply_pod(pod("a", ips=("10.0.0.1", "fd00::0001"), role="r"))
    m.commit()
    assert lookup(table, "10.0.0.1")[0] == "a"
    assert lookup(table, "fd00::1")[0] == "a"


def test_pod_ip_helpers_canonicalise():
    assert canonical_ip("::ffff:10.0.0.1") == "10.0.0.1"
    assert canonical_ip("FD00:0::1") == "fd00::1"
    assert canonical_ip("nope") is None
    assert pod_ips({"status": {"podIP": "10.0.0.1"}}) == ("10.0.0.1",)
    assert pod_ips({"status": {"podIP": "10.0.0.1", "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}]}}) \
        == ("10.0.0.1", "fd00::1")


# ---- address reuse -------------------------------------------------------------------------

def test_late_delete_of_old_pod_keeps_new_owner(make_model, table, sink):
    m = make_model()
    m.apply_pod(pod("old", ips=("10.0.0.9",), role="old-role", rv=10))
    m.commit()
    m.apply_pod(pod("new", ips=("10.0.0.9",), role="new-role", rv=20, created="2024-01-01T00:05:00Z"))
    m.commit()
    assert lookup(table, "10.0.0.9") == ("new", ROLE, sink.slot_for(BASE + "new-role"))
    m.delete_pod(pod("old", ips=("10.0.0.9",), role="old-role", rv=30))
    m.commit()
    assert lookup(table, "10.0.0.9") == ("new", ROLE, sink.slot_for(BASE + "new-role"))


def test_late_update_of_old_pod_never_takes_the_address_back(make_model, table):
    m = make_model()
    m.apply_pod(pod("old", ips=("10.0.0.9",), role="old-role", rv=10))
    m.apply_pod(pod("new", ips=("10.0.0.9",), role="new-role", rv=20))
    m.commit()
    # The old pod's status still says Running with the address; it is being deleted.
    m.apply_pod(pod("old", ips=("10.0.0.9",), role="old-role", rv=25, terminating=True))
    m.commit()
    assert lookup(table, "10.0.0.9")[0] == "new"
    # The new pod ends first: the address is free, never the stale old pod's again.
    m.apply_pod(pod("new", ips=("10.0.0.9",), role="new-role", rv=26, phase="Failed"))
    m.commit()
    assert lookup(table, "10.0.0.9") is None
    m.delete_pod(pod("old", rv=27))
    m.commit()
    assert lookup(table, "10.0.0.9") is None
    m.apply_pod(pod("third", ips=("10.0.0.9",), role="r3", rv=28))
    m.commit()
    assert lookup(table, "10.0.0.9")[0] == "third"


def test_older_pod_that_gets_a_recycled_address_later_wins_by_watch_order(make_model, table):
    # Created first, but its sandbox got the address after the newer pod's died: the
    # resourceVersion of the publication decides, not creationTimestamp.
    m = make_model()
    m.apply_pod(pod("slow", phase="Pending", role="a", created="2024-01-01T00:00:00Z", rv=5))
    m.apply_pod(pod("quick", ips=("10.0.0.4",), role="b", created="2024-01-01T00:01:00Z", rv=6))
    m.commit()
    m.apply_pod(pod("slow", ips=("10.0.0.4",), role="a", created="2024-01-01T00:00:00Z", rv=9))
    m.commit()
    assert lookup(table, "10.0.0.4")[0] == "slow"


def test_initial_list_with_duplicate_address_prefers_newer_pod(make_model, table):
    m = make_model()
    m.replace_pods([
        pod("new", ips=("10.0.0.7",), role="b", created="2024-01-01T00:02:00Z", rv=3),
        pod("old", ips=("10.0.0.7",), role="a", created="2024-01-01T00:01:00Z", rv=40,
            terminating=True),
    ], list_rv=50)
    m.commit()
    assert lookup(table, "10.0.0.7")[0] == "new"


def test_address_moves_in_one_write(make_model, table):
    class Recorder:
        def __init__(self, inner):
            self.inner, self.calls = inner, []

        def __getattr__(self, name):
            fn = getattr(self.inner, name)

            def call(*a, **kw):
                self.calls.append((name, a))
                return fn(*a, **kw)
            return call

    rec = Recorder(table)
    m = make_model()
    m.addresses.table = rec
    m.apply_pod(pod("old", ips=("10.0.0.9",), role="a", rv=1))
    m.commit()
    rec.calls.clear()
    m.apply_pod(pod("old", ips=("10.0.0.9",), role="a", rv=2, phase="Failed"))
    m.apply_pod(pod("new", ips=("10.0.0.9",), role="b", rv=3))
    m.commit()
    writes = [c for c in rec.calls if c[0] in ("claim_ip", "release_ip")]
    assert [w[0] for w in writes] == ["claim_ip"]


# ---- relists ------------------------------------------------------------------------------

def test_relist_updates_before_removing_and_never_drops_a_listed_pod(make_model, table):
    m = make_model()
    m.replace_pods([pod("a", ips=("10.0.0.1",), role="r", rv=1),
                    pod("b", ips=("10.0.0.2",), role="r", rv=2)], list_rv=2)
    m.commit()
    released = []
    real_release = table.release_ip

    class Spy:
        def __getattr__(self, name):
            return getattr(table, name)

        def release_ip(self, ip, uid):
            # at the moment of any release, every listed live pod is still mapped
            assert lookup(table, "10.0.0.1")[0] == "a"
            assert lookup(table, "10.0.0.3")[0] == "c"
            released.append(ip)
            return real_release(ip, uid)
    m.addresses.table = Spy()
    m.replace_pods([pod("a", ips=("10.0.0.1",), role="r", rv=1),
                    pod("c", ips=("10.0.0.3",), role="r", rv=9)], list_rv=9)
    m.commit()
    assert released == ["10.0.0.2"]
    assert lookup(table, "10.0.0.2") is None


def test_relist_claims_new_to_the_list_beat_claims_seen_before_the_gap(make_model, table):
    m = make_model()
    m.apply_pod(pod("old", ips=("10.0.0.9",), role="a", rv=10, created="2024-01-01T00:09:00Z"))
    m.commit()
    # During the gap: old died (status not yet updated) and an older-created pod got the IP.
    m.replace_pods([
        pod("old", ips=("10.0.0.9",), role="a", rv=10, created="2024-01-01T00:09:00Z"),
        pod("recycled", ips=("10.0.0.9",), role="b", rv=15, created="2024-01-01T00:01:00Z"),
    ], list_rv=20)
    m.commit()
    assert lookup(table, "10.0.0.9")[0] == "recycled"


def test_delete_of_unknown_pod_is_harmless(make_model, table):
    m = make_model()
    m.commit()   # the first commit publishes the status words
    m.delete_pod(pod("ghost", ips=("10.0.0.1",)))
    assert m.commit() is False


# ---- namespaces ---------------------------------------------------------------------------

def test_namespace_annotation_change_re_evaluates_its_pods(make_model, table, sink):
    m = make_model(namespace_restrictions=True)
    m.apply_namespace(namespace("team", {NS_KEY: "[]"}))
    m.apply_namespace(namespace("other", {NS_KEY: "[]"}))
    m.apply_pod(pod("a", ns="team", ips=("10.0.0.1",), role="app"))
    m.apply_pod(pod("b", ns="other", ips=("10.0.0.2",), role="app"))
    m.commit()
    assert lookup(table, "10.0.0.1") == ("a", DENIED, -1)
    m.apply_namespace(namespace("team", {NS_KEY: '["app"]'}, rv=2))
    m.commit()
    assert lookup(table, "10.0.0.1") == ("a", ROLE, sink.slot_for(BASE + "app"))
    assert lookup(table, "10.0.0.2") == ("b", DENIED, -1)
    m.apply_namespace(namespace("team", {NS_KEY: '["else"]'}, rv=3))
    m.commit()
    assert lookup(table, "10.0.0.1") == ("a", DENIED, -1)
    assert "a" not in sink.holders


def test_pod_in_a_namespace_not_seen_yet_waits_then_is_denied(make_model, table, clock):
    m = make_model(namespace_restrictions=True)
    m.apply_pod(pod("a", ns="late", ips=("10.0.0.1",), role="app"))
    m.commit()
    assert lookup(table, "10.0.0.1") == ("a", tablemod.POD_UNDECIDED, -1)
    assert table.pending_pods == 1
    m.apply_namespace(namespace("late", {NS_KEY: '["app"]'}))
    m.commit()
    assert lookup(table, "10.0.0.1")[:2] == ("a", ROLE) and table.pending_pods == 0
    m.apply_pod(pod("b", ns="never", ips=("10.0.0.2",), role="app"))
    m.commit()
    clock.advance(m.decider.namespace_grace + 1)
    m.expire()
    m.commit()
    assert lookup(table, "10.0.0.2") == ("b", DENIED, -1) and table.pending_pods == 0


def test_default_role_pod_does_not_wait_for_its_namespace(make_model, table):
    m = make_model(namespace_restrictions=True, default_role="fallback")
    m.apply_pod(pod("a", ns="late", ips=("10.0.0.1",)))
    m.commit()
    assert lookup(table, "10.0.0.1")[:2] == ("a", ROLE)


def test_role_annotation_change_re_acquires(make_model, table, sink):
    m = make_model()
    m.apply_pod(pod("a", ips=("10.0.0.1",), role="one"))
    m.commit()
    m.apply_pod(pod("a", ips=("10.0.0.1",), role="two", rv=2))
    m.commit()
    assert lookup(table, "10.0.0.1") == ("a", ROLE, sink.slot_for(BASE + "two"))
    m.apply_pod(pod("a", ips=("10.0.0.1",), rv=3))
    m.commit()
    assert lookup(table, "10.0.0.1") == ("a", NO_ROLE, -1)
    assert "a" not in sink.holders


# ---- the container runtime ----------------------------------------------------------------------

def view(*sandboxes, started_ns=1_000):
    """A runtime poll: (uid, ip or ips, annotations) per READY sandbox."""
    from kiamfast.control.cri.client import RuntimeView, Sandbox
    sbs = []
    for uid, ips, ann in sandboxes:
        ips = (ips,) if isinstance(ips, str) else tuple(ips)
        sbs.append(Sandbox(id=f"sb-{uid}", pod_uid=uid, name=f"pod-{uid}", namespace="default",
                           ips=ips, annotations=ann, created_ns=0))
    return RuntimeView(started_ns=started_ns, sandboxes=tuple(sbs),
                       owners={ip: sb for sb in sbs for ip in sb.ips}, conflicts=frozenset())


def test_runtime_owner_gets_its_role_before_the_api_has_its_address(make_model, table, sink):
    m = make_model()
    m.apply_pod(pod("a", phase="Pending", role="app"))
    m.commit()
    m.apply_runtime(view(("a", "10.0.0.3", {"iam.amazonaws.com/role": "app"})))
    m.commit()
    assert lookup(table, "10.0.0.3") == ("a", ROLE, sink.slot_for(BASE + "app"))
    assert table.runtime_mode and table.verified_ns == 1_000
    assert sink.requests["a"].pod_ip == "10.0.0.3"


def test_runtime_beats_the_api_on_a_reused_address(make_model, table, sink):
    m = make_model()
    m.apply_pod(pod("old", ips=("10.0.0.3",), role="x", rv=5))
    m.apply_pod(pod("new", phase="Pending", role="y", rv=6))
    m.commit()
    assert lookup(table, "10.0.0.3")[0] == "old"
    m.apply_runtime(view(("new", "10.0.0.3", {})))
    m.commit()
    assert lookup(table, "10.0.0.3") == ("new", ROLE, sink.slot_for(BASE + "y"))
    m.apply_pod(pod("old", ips=("10.0.0.3",), role="x", rv=7))   # the API, still late
    m.commit()
    assert lookup(table, "10.0.0.3")[0] == "new"


def test_an_address_no_ready_sandbox_holds_is_nobodys_whatever_the_api_says(make_model, table):
    """The API still shows a Running on its address after its sandbox stopped: a is never
    answered there; the address waits (503) while the API claims it, and is free once the
    API lets it go."""
    m = make_model()
    m.apply_pod(pod("a", ips=("10.0.0.4",), role="r"))
    m.commit()
    m.apply_runtime(view())
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", tablemod.POD_UNDECIDED, -1)
    m.delete_pod(pod("a", rv=2))
    m.commit()
    assert lookup(table, "10.0.0.4") is None


def test_pod_only_the_runtime_knows_is_decided_from_its_sandbox(make_model, table, sink):
    m = make_model()
    m.apply_runtime(view(("k", "10.0.0.8", {"iam.amazonaws.com/role": "from-sandbox"})))
    m.commit()
    assert lookup(table, "10.0.0.8") == ("k", ROLE, sink.slot_for(BASE + "from-sandbox"))
    m.apply_pod(pod("k", ips=("10.0.0.8",), role="from-api"))        # the API wins the policy
    m.commit()
    assert lookup(table, "10.0.0.8") == ("k", ROLE, sink.slot_for(BASE + "from-api"))
    m.delete_pod(pod("k"))           # deleted (forced) while its sandbox runs: still its own
    m.commit()
    assert lookup(table, "10.0.0.8") == ("k", ROLE, sink.slot_for(BASE + "from-sandbox"))
    m.apply_runtime(view(started_ns=2_000))                           # the sandbox stopped
    m.commit()
    assert lookup(table, "10.0.0.8") is None and "k" not in sink.holders


def test_runtime_owner_whose_namespace_is_unknown_waits(make_model, table, clock):
    m = make_model(namespace_restrictions=True)
    m.apply_runtime(view(("w", "10.0.0.9", {"iam.amazonaws.com/role": "r"})))
    m.commit()
    assert lookup(table, "10.0.0.9") == ("w", tablemod.POD_UNDECIDED, -1)
    m.apply_namespace(namespace("default", {NS_KEY: '["r"]'}))
    m.commit()
    assert lookup(table, "10.0.0.9")[:2] == ("w", ROLE)


UNDECIDED = tablemod.POD_UNDECIDED


# ---- the kernel's proof (--address-proof=netns) -----------------------------------------------

def test_a_ready_sandbox_owns_only_what_the_kernel_shows_in_its_namespace(make_model, table,
                                                                          sink):
    """CRI-O's stop order: the network of a's sandbox is torn down (its address back in
    IPAM) while the sandbox is still READY, and b's sandbox gets the address.  The view
    says both hold it; the kernel says b's namespace does."""
    kernel = Kernel()
    m = make_model(proof=kernel)
    m.apply_pod(pod("a", ips=("10.0.0.4",), role="role-a"))
    m.apply_pod(pod("b", phase="Pending", role="role-b"))
    kernel.add("ns-a", "10.0.0.4")
    m.apply_runtime(runtime_view(sandbox("a", "10.0.0.4")))
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", ROLE, sink.slot_for(BASE + "role-a"))
    kernel.remove("ns-a", "10.0.0.4")                  # CNI DEL of a, a still READY
    m.kernel_changed()
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", UNDECIDED, -1)   # at once, not at the next poll
    kernel.add("ns-b", "10.0.0.4")                     # CNI ADD of b
    m.apply_runtime(runtime_view(sandbox("a", "10.0.0.4"), sandbox("b", "10.0.0.4"),
                                 started_ns=2_000))
    m.commit()
    assert lookup(table, "10.0.0.4") == ("b", ROLE, sink.slot_for(BASE + "role-b"))


def test_a_partial_view_never_lets_another_sandboxs_claim_stand(make_model, table, sink):
    """a is stuck READY after its network went; b's status failed, so the view leaves b out.
    The view says the address is a's; the kernel shows it in a namespace no view sandbox
    has: nobody is answered with a role there."""
    kernel = Kernel()
    m = make_model(proof=kernel)
    kernel.add("ns-a", "10.0.0.4")
    m.apply_runtime(runtime_view(sandbox("a", "10.0.0.4", annotations={ROLE_KEY: "role-a"})))
    m.commit()
    assert lookup(table, "10.0.0.4")[:2] == ("a", ROLE)
    kernel.remove("ns-a", "10.0.0.4")
    kernel.add("ns-b", "10.0.0.4")
    m.apply_runtime(runtime_view(sandbox("a", "10.0.0.4", annotations={ROLE_KEY: "role-a"}),
                                 started_ns=2_000))
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", UNDECIDED, -1)
    assert "a" in sink.holders      # its credentials stay: its pod lives, it owns nothing


def test_during_an_outage_the_kernel_keeps_each_owner_exactly_while_it_holds_the_address(
        make_model, table, sink):
    """The agent's link to the runtime broke while the kubelet went on.  Owners whose
    namespace still holds their address keep it, whoever else starts on the node (a pod
    stuck Pending, a pod the watch has not delivered); the address a stopped sandbox gave up
    is nobody's, whatever the API and the last view say (found by review on the route
    witness, which took an unchanged route as proof: CRI-O changes the route before the
    view)."""
    kernel = Kernel()
    m = make_model(proof=kernel)
    m.apply_pod(pod("a", ips=("10.0.0.4",), role="role-a", rv=5))
    m.apply_pod(pod("s", ips=("10.0.0.5",), role="role-s", rv=5))
    kernel.add("ns-a", "10.0.0.4")
    kernel.add("ns-s", "10.0.0.5")
    m.apply_runtime(runtime_view(sandbox("a", "10.0.0.4"), sandbox("s", "10.0.0.5")))
    m.runtime_failed(5_000)
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", ROLE, sink.slot_for(BASE + "role-a"))
    m.apply_pod(pod("n", phase="Pending", role="role-n", rv=9))   # unplaced: changes nothing
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", ROLE, sink.slot_for(BASE + "role-a"))
    kernel.remove("ns-a", "10.0.0.4")                   # a stopped; b got its address
    kernel.add("ns-b", "10.0.0.4")
    m.kernel_changed()
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", UNDECIDED, -1)       # the API still says a
    assert lookup(table, "10.0.0.5") == ("s", ROLE, sink.slot_for(BASE + "role-s"))
    m.delete_pod(pod("a", rv=10))
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", UNDECIDED, -1)       # the last view's claim
    m.apply_runtime(runtime_view(sandbox("b", "10.0.0.4", annotations={ROLE_KEY: "role-b"}),
                                 sandbox("s", "10.0.0.5"), started_ns=6_000))   # back
    m.commit()
    assert lookup(table, "10.0.0.4") == ("b", ROLE, sink.slot_for(BASE + "role-b"))


def test_an_address_in_two_namespaces_is_nobodys(make_model, table):
    kernel = Kernel()
    m = make_model(proof=kernel)
    kernel.add("ns-a", "10.0.0.4")
    kernel.add("ns-x", "10.0.0.4")                      # a namespace no sandbox names
    m.apply_runtime(runtime_view(sandbox("a", "10.0.0.4", annotations={ROLE_KEY: "r"})))
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", UNDECIDED, -1)
    kernel.delete("ns-x")
    m.kernel_changed()
    m.commit()
    assert lookup(table, "10.0.0.4")[:2] == ("a", ROLE)


def test_a_sandbox_owns_every_address_of_its_namespace_an_eks_ipv6_pods_egress_too(
        make_model, table, sink):
    """EKS IPv6: the pod's IPv6 address is in its status and the runtime's; its IPv4 egress
    address (169.254.172.0/22, the VPC CNI's egress plugin) is in neither, and that is the
    address its calls to 169.254.169.254 come from."""
    kernel = Kernel()
    m = make_model(proof=kernel)
    m.apply_pod(pod("v6", ips=("2600:1f14::7",), role="role-v6"))
    kernel.add("ns-v6", "2600:1f14::7", "169.254.172.9")
    m.apply_runtime(runtime_view(sandbox("v6", "2600:1f14::7")))
    m.commit()
    slot = sink.slot_for(BASE + "role-v6")
    assert lookup(table, "169.254.172.9") == ("v6", ROLE, slot)
    assert lookup(table, "2600:1f14::7") == ("v6", ROLE, slot)
    kernel.delete("ns-v6")                              # stopped; the next pod gets .9
    kernel.add("ns-next", "2600:1f14::8", "169.254.172.9")
    m.apply_runtime(runtime_view(sandbox("next", "2600:1f14::8"), started_ns=2_000))
    m.commit()
    assert lookup(table, "169.254.172.9")[0] == "next"


def test_without_the_kernel_a_stale_view_proves_nothing(make_model, table, sink):
    """--address-proof=runtime: READY is taken at its word only while the runtime answers;
    while it cannot, every address the last view showed waits."""
    m = make_model()
    m.apply_pod(pod("a", ips=("10.0.0.4",), role="role-a"))
    m.apply_runtime(view(("a", "10.0.0.4", {})))
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", ROLE, sink.slot_for(BASE + "role-a"))
    m.runtime_failed(5_000)
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", UNDECIDED, -1)
    assert table.runtime_mode and table.failed_ns == 5_000
    m.apply_runtime(view(("a", "10.0.0.4", {}), started_ns=6_000))
    m.commit()
    assert lookup(table, "10.0.0.4")[:2] == ("a", ROLE) and table.verified_ns == 6_000


def test_a_pod_deleted_during_an_outage_is_not_rebuilt_from_the_stale_view(make_model, table,
                                                                           sink):
    kernel = Kernel()
    m = make_model(proof=kernel)
    m.apply_pod(pod("k", ips=("10.0.0.8",), role="r"))
    kernel.add("ns-k", "10.0.0.8")
    m.apply_runtime(runtime_view(sandbox("k", "10.0.0.8", annotations={ROLE_KEY: "r"})))
    m.runtime_failed(5_000)
    m.commit()
    assert lookup(table, "10.0.0.8")[:2] == ("k", ROLE)
    m.delete_pod(pod("k", rv=9))
    m.commit()
    assert lookup(table, "10.0.0.8") == ("k", UNDECIDED, -1)
    assert m.decision("k") is None and "k" not in sink.holders   # no sandbox pod either


def test_view_date_is_published_after_its_addresses(make_model, table):
    """Workers trust the slots for connections older than verified_ns: the date must never
    be visible before the addresses it vouches for."""
    order = []
    real_claim, real_verified = table.claim_ip, table.set_verified
    table_calls = type("T", (), {})()
    m = make_model()
    m.addresses.table = table_calls
    table_calls.claim_ip = lambda *a, **k: (order.append("claim"), real_claim(*a, **k))
    table_calls.release_ip = table.release_ip
    table_calls.set_status = table.set_status
    table_calls.set_verified = lambda ns: (order.append("verified"), real_verified(ns))
    m.apply_runtime(view(("a", "10.0.0.1", {}), ("b", "10.0.0.2", {})))
    m.commit()
    assert order == ["claim", "claim", "verified"]


# ---- a restarted control process -------------------------------------------------------------------

def test_restart_releases_addresses_of_pods_gone_during_the_outage(table, sink):
    table.claim_ip("10.0.0.5", "uid-a", ROLE, 0)          # what the dead process left
    table.claim_ip("10.0.0.6", "uid-b", ROLE, 1)
    adopted = {e["ip"]: (e["pod_uid"], e["pod_state"], e["cred_slot"]) for e in table.snapshot()}
    m = NodeModel(policy=RolePolicy(base_role_arn=BASE), table=table, sink=sink, adopted=adopted)
    assert m.slot_refs[0] and m.slot_refs[1]
    m.replace_pods([pod("uid-b", ips=("10.0.0.6",), role="b")], list_rv=50)
    m.commit()
    assert lookup(table, "10.0.0.5") is not None           # not synced: keep serving
    m.set_synced(True)
    m.commit()
    assert lookup(table, "10.0.0.5") is None               # a was deleted meanwhile
    assert m.addresses.snapshot() == {"10.0.0.6": ("uid-b", ROLE, sink.slot_for(BASE + "b"))}


def adopted_model(table, sink, clock=None, **policy_kw):
    """A new control process over what the dead one left in `table`."""
    adopted = {e["ip"]: (e["pod_uid"], e["pod_state"], e["cred_slot"]) for e in table.snapshot()}
    kw = {} if clock is None else {"clock": clock}
    return NodeModel(policy=RolePolicy(base_role_arn=BASE, **policy_kw), table=table, sink=sink,
                     adopted=adopted, expect_runtime=True, **kw)


def test_restart_while_the_runtime_is_down_holds_the_adopted_owners_until_it_answers(
        table, sink):
    slot = sink.acquire("uid-a", type("R", (), {"role_arn": BASE + "a", "external_id": None}))
    table.claim_ip("10.0.0.5", "uid-a", ROLE, slot)          # what the dead process left
    m = adopted_model(table, sink)
    m.runtime_failed(5_000)                                  # the first attempt fails
    m.commit()
    # Nothing proves the adopted owner: undecided (503, retried), not released (404), and
    # the API's agreement proves nothing about the namespace behind the address.
    assert lookup(table, "10.0.0.5") == ("uid-a", UNDECIDED, -1)
    m.replace_pods([pod("uid-a", ips=("10.0.0.5",), role="a")], list_rv=50)
    m.set_synced(True)
    m.commit()
    assert lookup(table, "10.0.0.5") == ("uid-a", UNDECIDED, -1)
    m.apply_runtime(view(("uid-a", "10.0.0.5", {}), started_ns=6_000))
    m.commit()
    assert lookup(table, "10.0.0.5") == ("uid-a", ROLE, slot)


def test_restart_during_an_api_outage_keeps_adopted_roles_of_restricted_namespaces(
        table, sink, clock):
    """Namespace restrictions on, the control process restarted while the API server is down:
    the runtime shows the established pods, their namespaces are unknown.  A role the
    previous process decided stands (it was served at once, and it is after the grace
    period), until the API can overrule it.  A denial it decided is no current evidence:
    that pod waits like any pod whose namespace is unknown, then is denied for that."""
    req = type("R", (), {"role_arn": BASE + "app", "external_id": None})
    slot = sink.acquire("uid-w", req)
    table.claim_ip("10.0.0.9", "uid-w", ROLE, slot)
    table.claim_ip("10.0.0.10", "uid-d", DENIED, -1)
    m = adopted_model(table, sink, clock, namespace_restrictions=True)
    m.apply_runtime(view(("uid-w", "10.0.0.9", {"iam.amazonaws.com/role": "app"}),
                         ("uid-d", "10.0.0.10", {"iam.amazonaws.com/role": "other"})))
    m.commit()
    assert lookup(table, "10.0.0.9") == ("uid-w", ROLE, slot)
    assert lookup(table, "10.0.0.10") == ("uid-d", UNDECIDED, -1)
    clock.advance(60)
    m.expire()
    m.commit()
    assert lookup(table, "10.0.0.9") == ("uid-w", ROLE, slot)
    assert lookup(table, "10.0.0.10") == ("uid-d", DENIED, -1)   # its namespace never came
    m.apply_namespace(namespace("default", {NS_KEY: '["other"]'}))   # the API is back
    m.commit()
    assert lookup(table, "10.0.0.9")[:2] == ("uid-w", DENIED)
    assert lookup(table, "10.0.0.10") == ("uid-d", ROLE, sink.slot_for(BASE + "other"))


def test_restart_during_an_api_outage_keeps_a_pod_served_by_token_only(table, sink, clock):
    """A pod served by token only has its address written denied, naming its slot.  A
    control process restarted while the API server is down (namespace restrictions on, so
    the decision needs the namespace) keeps its role for the token path from that slot,
    never reads the denied address as a policy denial, and never serves it by address."""
    slot = sink.acquire("uid-t", type("R", (), {"role_arn": BASE + "app", "external_id": None}))
    m = NodeModel(
        policy=RolePolicy(base_role_arn=BASE, namespace_restrictions=True),
        table=table, sink=sink, clock=clock, token_only=lambda spec: True)
    m.apply_namespace(namespace("default", {NS_KEY: '["app"]'}))
    m.apply_pod(with_containers(pod("uid-t", ips=("10.0.0.7",), role="app"), by_token()))
    m.commit()
    assert lookup(table, "10.0.0.7") == ("uid-t", DENIED, slot)   # the slot, for a successor
    assert m.decision("uid-t").role_arn == BASE + "app"

    restarted = adopted_model(table, sink, clock, namespace_restrictions=True)
    restarted.apply_runtime(view(("uid-t", "10.0.0.7", {"iam.amazonaws.com/role": "app"})))
    restarted.commit()
    clock.advance(60)                       # past the namespace grace: still its role
    restarted.expire()
    restarted.commit()
    adopted = restarted.decision("uid-t")
    assert adopted.identity.kind == IdentityKind.ROLE and adopted.source == "adopted"
    assert adopted.role_arn == BASE + "app" and adopted.cred_slot == slot
    assert lookup(table, "10.0.0.7") == ("uid-t", DENIED, slot)   # never by address


def test_an_adopted_slot_of_another_role_is_not_taken_over(table, sink, clock):
    slot = sink.acquire("uid-w", type("R", (), {"role_arn": BASE + "old", "external_id": None}))
    table.claim_ip("10.0.0.9", "uid-w", ROLE, slot)
    m = adopted_model(table, sink, clock, namespace_restrictions=True)
    m.apply_runtime(view(("uid-w", "10.0.0.9", {"iam.amazonaws.com/role": "new"})))
    m.commit()
    assert lookup(table, "10.0.0.9") == ("uid-w", UNDECIDED, -1)   # waits for its namespace


# ---- status, notify, credentials ---------------------------------------------------------------

def test_notify_once_per_commit_with_changes(make_model, table):
    m = make_model()
    m.apply_pod(pod("a", ips=("10.0.0.1",), role="r"))
    m.apply_pod(pod("b", ips=("10.0.0.2",), role="r"))
    m.commit()
    assert len(m.notes) == 1
    m.apply_pod(pod("a", ips=("10.0.0.1",), role="r", rv=2))   # nothing a worker sees changes
    m.commit()
    assert len(m.notes) == 1
    m.set_synced(True)
    m.commit()
    assert len(m.notes) == 2 and table.synced


def test_credentials_released_only_after_the_table_stops_naming_the_pod(make_model, table, sink):
    m = make_model()
    m.apply_pod(pod("a", ips=("10.0.0.1",), role="r"))
    m.commit()
    seen = []
    real = sink.release

    def release(uid):
        seen.append(lookup(table, "10.0.0.1"))
        real(uid)
    sink.release = release
    m.delete_pod(pod("a"))
    m.commit()
    assert seen == [None]


def test_acquire_failure_leaves_the_pod_waiting_and_is_retried(make_model, table, sink):
    sink.fail = True
    m = make_model()
    m.apply_pod(pod("a", ips=("10.0.0.1",), role="r"))
    m.commit()
    assert lookup(table, "10.0.0.1") == ("a", tablemod.POD_UNDECIDED, -1)
    assert table.pending_pods == 1
    sink.fail = False
    m.expire()
    m.commit()
    assert lookup(table, "10.0.0.1")[:2] == ("a", ROLE) and table.pending_pods == 0


def test_stale_event_for_a_pod_is_ignored(make_model, table):
    m = make_model()
    m.apply_pod(pod("a", ips=("10.0.0.1",), role="r", rv=10, phase="Failed"))
    m.apply_pod(pod("a", ips=("10.0.0.1",), role="r", rv=9))
    m.commit()
    assert lookup(table, "10.0.0.1") is None


def test_namespace_denials_name_role_and_namespace_for_kube2iams_text(make_model, table):
    m = make_model(namespace_restrictions=True)
    m.apply_namespace(namespace("shop", {NS_KEY: '["shop-*"]'}))
    m.apply_pod(pod("in", ns="shop", ips=("10.0.0.1",), role="billing-admin"))
    m.apply_pod(pod("ok", ns="shop", ips=("10.0.0.2",), role="shop-cart"))
    m.commit()
    assert lookup(table, "10.0.0.1")[1] == DENIED
    assert report.denials(m) == {"in": (BASE + "billing-admin", "shop")}


def test_an_unchanged_view_only_moves_the_date_on(make_model, table, sink):
    """The client hands back the previous view's objects when the READY set is unchanged."""
    import dataclasses
    m = make_model()
    first = view(("a", "10.0.0.3", {"iam.amazonaws.com/role": "app"}), started_ns=1_000)
    m.apply_runtime(first)
    m.commit()
    claims = report.counters(m)["claims"]
    m.apply_runtime(dataclasses.replace(first, started_ns=2_000))
    m.commit()
    assert table.verified_ns == 2_000 and report.counters(m)["claims"] == claims
    assert lookup(table, "10.0.0.3") == ("a", ROLE, sink.slot_for(BASE + "app"))
    m.runtime_failed(3_000)                     # after a failure the same objects apply in full
    m.apply_pod(pod("b", ips=("10.0.0.9",), role="r"))
    m.commit()
    assert lookup(table, "10.0.0.3") == ("a", UNDECIDED, -1)   # nothing proves a now
    assert lookup(table, "10.0.0.9") == ("b", UNDECIDED, -1)   # the API's claim waits
    m.apply_runtime(dataclasses.replace(first, started_ns=4_000))
    m.commit()
    assert lookup(table, "10.0.0.3")[:2] == ("a", ROLE) and table.verified_ns == 4_000
    assert lookup(table, "10.0.0.9") == ("b", UNDECIDED, -1)


def by_token(uri: str = "http://169.254.170.23/v1/credentials") -> list[dict]:
    return [{"name": "AWS_CONTAINER_CREDENTIALS_FULL_URI", "value": uri},
            {"name": "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "value": "/var/run/t/token"}]


def with_containers(obj: dict, *envs: list[dict]) -> dict:
    obj["spec"]["containers"] = [{"name": f"c{i}", "env": env} for i, env in enumerate(envs)]
    return obj


def test_a_pod_that_asks_by_token_is_refused_on_the_metadata_path(table, sink, clock):
    from kiamfast.container_credentials.token_only import predicate
    m = NodeModel(
        policy=RolePolicy(base_role_arn=BASE), table=table, sink=sink, clock=clock,
        token_only=predicate([("169.254.170.23", 80), ("fd00:ec2::23", 80)]))
    m.apply_pod(with_containers(pod("tok", ips=("10.0.0.1",), role="app"), by_token(),
                                by_token("http://[fd00:ec2::23]:80/v1/credentials")))
    # one container that does not ask here keeps the pod on the address contract
    m.apply_pod(with_containers(pod("mixed", ips=("10.0.0.2",), role="app"), by_token(), []))
    m.apply_pod(with_containers(pod("other", ips=("10.0.0.3",), role="app"),
                                by_token("http://169.254.170.2/v1/credentials")))
    m.apply_pod(with_containers(pod("plain", ips=("10.0.0.4",), role="app"), []))
    m.commit()
    # denied on the metadata path; the slot is named for a restarted control process
    assert lookup(table, "10.0.0.1") == ("tok", DENIED, sink.slot_for(BASE + "app"))
    for uid, ip in (("mixed", "10.0.0.2"), ("other", "10.0.0.3"), ("plain", "10.0.0.4")):
        assert lookup(table, ip)[:2] == (uid, ROLE)
    # its credentials are still fetched and kept: the token path answers from that slot
    assert m.decision("tok").cred_slot == sink.slot_for(BASE + "app") and "tok" in sink.holders
    assert "tok" not in report.denials(m)   # not the namespace-denial text of kube2iam


def test_without_a_listener_no_pod_is_token_only():
    from kiamfast.container_credentials.token_only import predicate
    spec = {"containers": [{"name": "c", "env": by_token()}]}
    assert predicate([])(spec) is False
    assert predicate([("169.254.170.23", 80)])(spec) is True
    assert predicate([("0.0.0.0", 80)])(spec) is True       # every address, that port
    assert predicate([("169.254.170.23", 8080)])(spec) is False
    assert predicate([("169.254.170.23", 80)])({"containers": []}) is False
    no_file = {"containers": [{"name": "c", "env": by_token()[:1]}]}
    assert predicate([("169.254.170.23", 80)])(no_file) is False


def test_a_host_network_pod_that_asks_by_token_is_decided_but_owns_no_address(table, sink,
                                                                              clock):
    from kiamfast.container_credentials.token_only import predicate
    m = NodeModel(
        policy=RolePolicy(base_role_arn=BASE), table=table, sink=sink, clock=clock,
        token_only=predicate([("169.254.170.23", 80)]))
    m.apply_pod(with_containers(pod("host-tok", ips=("10.9.9.9",), role="app",
                                    host_network=True), by_token()))
    m.apply_pod(with_containers(pod("host-plain", ips=("10.9.9.9",), role="other",
                                    host_network=True), []))
    m.commit()
    assert lookup(table, "10.9.9.9") is None          # the node's address: nobody's
    tok, plain = m.decision("host-tok"), m.decision("host-plain")
    assert tok.identity.role_arn == BASE + "app" and tok.cred_slot >= 0
    assert sink.requests["host-tok"].pod_ip is None   # never named after the node's address
    assert plain.cred_slot == -1 and "host-plain" not in sink.holders
    m.apply_pod(with_containers(pod("host-tok", ips=("10.9.9.9",), role="app", rv=2,
                                    phase="Succeeded", host_network=True), by_token()))
    m.commit()
    assert m.decision("host-tok").cred_slot == -1     # finished: its credentials go
