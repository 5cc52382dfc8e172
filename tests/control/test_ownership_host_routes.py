"""The runtime fallback with the host's routes as a second witness (issue 30, finding 5).

While the container runtime cannot be asked, a pod the last view did not show and whose
address the API has not published (one stuck Pending on a volume for hours) used to make
every address of the node undecided (503).  Where the CNI routes each pod's address to its
own veth, the host's route says whether the sandbox behind an address can have changed:
unchanged since the last view began, the address keeps its agreed owner whoever else is
starting; changed, it loses it.  `HostRoutes` stands in for the kernel here
(kiamfast.control.cri.routes is tested against the real one in tests/cri).
"""
from kiamfast import table as tablemod
from kiamfast.control.mappings.model import NodeModel
from kiamfast.control.iam.policy import RolePolicy

from control_support import BASE, lookup, pod

ROLE, UNDECIDED = tablemod.POD_ROLE, tablemod.POD_UNDECIDED


class HostRoutes:
    """The kernel as `RouteWatch` reports it: each routed address changed at some instant;
    the watch has seen everything since `watching_since`."""

    def __init__(self, *, watching_since: int = 0) -> None:
        self.watching_since = watching_since
        self.changed_at: dict[str, int] = {}      # ip -> when its host route last changed
        self.generation = 0
        self.asked: list[tuple[str, int]] = []

    def route(self, ip: str, *, at: int) -> None:
        self.changed_at[ip] = at
        self.generation += 1

    def path_kept(self, ip: str, since_ns: int) -> bool | None:
        self.asked.append((ip, since_ns))
        if since_ns <= self.watching_since or ip not in self.changed_at:
            return None
        return self.changed_at[ip] <= since_ns


def view(*sandboxes, started_ns=1_000):
    from kiamfast.control.cri.client import RuntimeView, Sandbox
    sbs = [Sandbox(id=f"sb-{uid}", pod_uid=uid, name=f"pod-{uid}", namespace="default",
                   ips=(ip,), annotations={}, created_ns=0) for uid, ip in sandboxes]
    return RuntimeView(started_ns=started_ns, sandboxes=tuple(sbs),
                       owners={sb.ips[0]: sb for sb in sbs}, conflicts=frozenset())


def model(table, sink, routes, **kw):
    return NodeModel(policy=RolePolicy(base_role_arn=BASE), table=table, sink=sink,
                     routes=routes, **kw)


def established(table, sink, routes):
    """Pods a (routed, 10.0.0.4) and b (bridge-like: no host route, 10.0.0.5), the view at
    1 000 ns, then the runtime's link breaks (attempt at 5 000 ns)."""
    m = model(table, sink, routes)
    m.apply_pod(pod("a", ips=("10.0.0.4",), role="role-a"))
    m.apply_pod(pod("b", ips=("10.0.0.5",), role="role-b"))
    routes.route("10.0.0.4", at=500)
    m.apply_runtime(view(("a", "10.0.0.4"), ("b", "10.0.0.5"), started_ns=1_000))
    m.commit()
    m.runtime_failed(5_000)
    m.commit()
    return m


def test_an_unplaced_newcomer_leaves_an_address_with_an_unchanged_host_route_its_owner(
        table, sink):
    routes = HostRoutes()
    m = established(table, sink, routes)
    assert lookup(table, "10.0.0.4") == ("a", ROLE, sink.slot_for(BASE + "role-a"))
    m.apply_pod(pod("n", phase="Pending", role="role-n", rv=9))   # stuck: no sandbox, no IP
    m.commit()
    # The replies to 10.0.0.4 still go down the veth the last view's sandbox had: whoever
    # n is, it is not behind that address.
    assert lookup(table, "10.0.0.4") == ("a", ROLE, sink.slot_for(BASE + "role-a"))
    assert ("10.0.0.4", 1_000) in routes.asked          # dated by the last view's start
    assert table.pending_pods == 1                      # n's own requests still wait


def test_without_a_host_route_the_unplaced_newcomer_still_suspends_the_agreement(table, sink):
    """A bridge CNI gives no per-pod route: nothing proves who is behind 10.0.0.5."""
    routes = HostRoutes()
    m = established(table, sink, routes)
    assert lookup(table, "10.0.0.5") == ("b", ROLE, sink.slot_for(BASE + "role-b"))
    m.apply_pod(pod("n", phase="Pending", role="role-n", rv=9))
    m.commit()
    assert lookup(table, "10.0.0.5") == ("b", UNDECIDED, -1)
    m.apply_pod(pod("n", ips=("10.0.0.9",), role="role-n", rv=10))   # n is elsewhere
    m.commit()
    assert lookup(table, "10.0.0.5") == ("b", ROLE, sink.slot_for(BASE + "role-b"))


def test_a_host_route_changed_since_the_last_view_takes_the_owner_away(table, sink):
    """The sandbox behind the address may have changed (a's sandbox stopped, another got the
    address: a new veth, a new route) while the API still shows a there: never a's role,
    whether or not the API shows a newcomer (the watch may not have delivered it)."""
    routes = HostRoutes()
    m = established(table, sink, routes)
    assert lookup(table, "10.0.0.4") == ("a", ROLE, sink.slot_for(BASE + "role-a"))
    routes.route("10.0.0.4", at=6_000)
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", UNDECIDED, -1)
    assert lookup(table, "10.0.0.5") == ("b", ROLE, sink.slot_for(BASE + "role-b"))
    m.apply_runtime(view(("x", "10.0.0.4"), ("b", "10.0.0.5"), started_ns=7_000))
    m.commit()                                          # back: the runtime decides
    assert lookup(table, "10.0.0.4")[0] == "x"


def test_a_route_changed_before_the_last_view_is_that_views_own(table, sink):
    """The newest view (even one that changed nothing) vouches for the routes before it."""
    routes = HostRoutes()
    m = model(table, sink, routes)
    m.apply_pod(pod("a", ips=("10.0.0.4",), role="role-a"))
    routes.route("10.0.0.4", at=2_000)                  # a's sandbox came up at 2 000
    m.apply_runtime(view(("a", "10.0.0.4"), started_ns=1_000))
    m.apply_runtime(view(("a", "10.0.0.4"), started_ns=3_000))
    m.commit()
    m.runtime_failed(5_000)
    m.apply_pod(pod("n", phase="Pending", role="role-n", rv=9))
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", ROLE, sink.slot_for(BASE + "role-a"))
    assert routes.asked[-1] == ("10.0.0.4", 3_000)


def test_a_restarted_process_without_a_view_of_its_own_keeps_the_strict_rule(table, sink):
    """The routes a previous control process saw are not known: its table is no view the
    kernel's evidence can be dated against."""
    slot = sink.acquire("a", type("R", (), {"role_arn": BASE + "role-a", "external_id": None}))
    table.claim_ip("10.0.0.4", "a", ROLE, slot)
    routes = HostRoutes(watching_since=100)
    routes.route("10.0.0.4", at=50)
    adopted = {e["ip"]: (e["pod_uid"], e["pod_state"], e["cred_slot"]) for e in table.snapshot()}
    m = model(table, sink, routes, adopted=adopted, expect_runtime=True)
    m.runtime_failed(5_000)
    m.replace_pods([pod("a", ips=("10.0.0.4",), role="role-a"),
                    pod("n", phase="Pending", role="role-n")], list_rv=50)
    m.set_synced(True)
    m.commit()
    assert lookup(table, "10.0.0.4") == ("a", UNDECIDED, -1)
