"""``kiamfast demo``: the whole product on a bare machine, checked by real clients, in seconds.

Why it exists: it is the README's first command. On a laptop with no cluster, no AWS account
and no root it starts everything a node has, on loopback (:mod:`kiamfast.demo.env`): the
Kubernetes API server emulator, the node's container runtime (a CRI double speaking the real
gRPC protocol), moto's STS, a fake EC2 metadata
service standing for the node's own, and the unmodified agent (``python -m kiamfast`` with
kube2iam's flags). It creates two namespaces that restrict their roles and pods annotated
with roles, each on its own 127/8 address (:mod:`kiamfast.demo.scenario`), and then plays
every pod with a real botocore client whose connections leave from the pod's address
(:mod:`kiamfast.demo.pod`). What a pod received is what the local STS says its credentials
belong to (``GetCallerIdentity``), judged by :mod:`kiamfast.demo.check`.

Then it replays the two races that made the agents before kiamfast hand out wrong or no
credentials, and checks each pod still got its own role:

1. a pod asks before the API server knows its IP (only the container runtime does);
2. an address is reused while the API server still shows the old pod Running with it.

Exit status: 0 when every check passed, 1 when any pod got a wrong or no credential (or
anything else the demo checks went wrong), 2 when the demo could not run at all (a
component did not start; the agent's log is shown). ``--keep-running`` leaves it all up
with a curl line to try by hand; ``--json`` prints the results as one JSON document on
stdout (progress goes to stderr); ``--expect POD=ROLE`` changes an expectation, to see the
demo fail.

What it must never do: send a packet off loopback, report success for anything it did not
observe through a pod's own client, or leave a process or file behind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from kiamfast.demo import scenario as sc
from kiamfast.demo.check import Verdict, judge
from kiamfast.demo.cluster import DemoCluster
from kiamfast.demo.env import DemoEnvironment, check_extra
from kiamfast.demo.errors import DemoError, MissingExtra
from kiamfast.demo.ui import Ui, fmt_ms

__all__ = ["main"]

EXIT_OK, EXIT_WRONG, EXIT_BROKEN = 0, 1, 2


@dataclass
class CheckResult:
    """One thing the demo verified, as printed and as reported in ``--json``."""

    section: str                   # "pods", "race-late-ip", "race-ip-reuse", "identity"
    name: str
    ok: bool
    problem: str | None = None
    pod: str | None = None
    ip: str | None = None
    annotation: str | None = None
    expected_role: str | None = None
    received: str | None = None
    received_account: str | None = None
    first_call_ms: float | None = None
    note: str | None = None
    observed: dict | None = None


@dataclass
class Report:
    ok: bool = False
    exit_code: int = EXIT_BROKEN
    error: str | None = None
    elapsed_s: float = 0.0
    agent: dict[str, Any] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    sts: dict[str, Any] = field(default_factory=dict)

    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.ok]

    def to_json(self) -> str:
        doc = asdict(self)
        doc["pods"] = [c for c in doc["checks"] if c["section"] == "pods"]
        return json.dumps(doc, indent=2)


class _Interrupted(Exception):
    pass


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise _Interrupted(signal.Signals(signum).name)


# ---------------------------------------------------------------------------------------------
# pieces of the run
# ---------------------------------------------------------------------------------------------

def _pod_check(section: str, pod: sc.DemoPod, observed: dict, *, name: str | None = None
               ) -> CheckResult:
    verdict: Verdict = judge(pod.expect, observed, ip=pod.ip)
    shown = {k: v for k, v in observed.items() if k != "access_key"}
    return CheckResult(
        section=section, name=name or pod.ref, ok=verdict.ok, problem=verdict.problem,
        pod=pod.ref, ip=pod.ip, annotation=pod.role, expected_role=pod.expect,
        received=verdict.received, received_account=verdict.account,
        first_call_ms=observed.get("first_call_ms"), note=pod.note or None, observed=shown)


def _received_text(check: CheckResult) -> str:
    text = check.received or "?"
    if check.received_account and check.received_account != sc.ACCOUNT:
        text += f" @{check.received_account}"
    return text


def _populate(cluster: DemoCluster, pods: tuple[sc.DemoPod, ...]) -> None:
    """Namespaces with their allowed roles, and the Running pods."""
    for ns in sc.NAMESPACES:
        cluster.api.namespaces.add(ns, annotations=sc.namespace_annotations(ns))
    for pod in pods:
        uid = cluster.api.pods.create(pod.namespace, pod.name, node=sc.NODE,
                                     annotations=pod.annotations, ips=[pod.ip],
                                     phase="Running")["metadata"]["uid"]
        cluster.run_sandbox(pod, uid)


def _pod_table(ui: Ui, checks: list[CheckResult]) -> None:
    header = ["pod", "address", "role annotated", "role received (STS)", "first call"]
    rows, styles, notes = [], [], []
    for c in checks:
        rows.append([c.pod or c.name, c.ip or "",
                     c.annotation if c.annotation is not None else "(none)",
                     _received_text(c), fmt_ms(c.first_call_ms)])
        styles.append(["" if c.ok else "bad", "",
                       "" if c.annotation is not None else "dim",
                       "" if c.ok else "bad", ""])
        notes.append((c.problem, "bad") if c.problem else c.note)
    ui.table(header, rows, marks=[c.ok for c in checks], styles=styles, right={4},
             notes=notes)


def _race_line(ui: Ui, check: CheckResult, what: str) -> None:
    got = _received_text(check)
    text = f"{what}: {check.pod} got {got}"
    if check.first_call_ms is not None:
        text += f" (first call {fmt_ms(check.first_call_ms)})"
    ui.check_line(check.ok, text, problem=check.problem, indent="    ")


def _wait_events_sent(cluster: DemoCluster, before: int, *, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.api.traffic.stats()["watch_events_sent"] > before:
            return True
        time.sleep(0.005)
    return False


def _race_late_ip(env: DemoEnvironment, ui: Ui, pod: sc.DemoPod) -> list[CheckResult]:
    ui.title("Race 1 — a pod asks before the API server knows its IP")
    ui.para(f"{pod.ref} starts and calls its SDK at once: its IP ({pod.ip}) is known to the "
            f"node's container runtime (CNI gave it to the sandbox), not yet to the API "
            f"server. kube2iam serves the default role ({sc.DEFAULT_ROLE}) here; kiam retries "
            f"for 5 s, past the SDK's 1 s timeout.")
    client = env.pods.spawn(pod.ip)   # the container's process, started and waiting
    client.wait_ready()
    # The pod is scheduled (the API server has it, Pending, without an IP) and the agent
    # has seen it, as it would have during the seconds of image pull and sandbox set-up...
    cluster = env.cluster
    before = cluster.api.traffic.stats()["watch_events_sent"]
    uid = cluster.api.pods.create(pod.namespace, pod.name, node=sc.NODE,
                                 annotations=pod.annotations, ips=None,
                                 phase="Pending")["metadata"]["uid"]
    _wait_events_sent(cluster, before)
    env.agent.wait_pending_pods()
    # ...then the kubelet creates its sandbox (CNI gives it its IP) and starts the container,
    # which calls at once, before the pod's status update reaches the API server.
    cluster.run_sandbox(pod, uid)
    agent_knew = env.agent.owner_of(pod.ip) is not None
    observed = client.go()
    check = _pod_check("race-late-ip", pod, observed, name="asks before the API knows its IP")
    check.note = ("the agent's table already had the address before the pod asked"
                  if agent_knew else "the agent's table had no entry for the address when "
                                     "the pod asked; it asked the container runtime")
    # The API server catches up; the pod runs on.
    cluster.api.pods.set_ips(pod.namespace, pod.name, [pod.ip])
    cluster.api.pods.set_phase(pod.namespace, pod.name, "Running")
    _race_line(ui, check, "before the API server had its IP")
    ui.write(f"      ↳ {check.note}", "dim")
    return [check]


def _race_ip_reuse(env: DemoEnvironment, ui: Ui, old: sc.DemoPod, new: sc.DemoPod
                   ) -> list[CheckResult]:
    ui.title("Race 2 — an address is reused while the API still shows the old pod Running")
    ui.para(f"{old.ref} dies and its address {old.ip} goes to {new.ref}'s sandbox; the API "
            f"server still lists {old.name} Running with it, and its delete arrives later. "
            f"kube2iam then serves {old.name}'s role, or fails on \"2 pods with the IP\".")
    cluster = env.cluster
    checks = []
    c = _pod_check("race-ip-reuse", old, env.pods.run(old.ip), name="old pod, before the reuse")
    _race_line(ui, c, f"{old.name} alone on {old.ip}")
    checks.append(c)

    cluster.stop_sandbox(old)                   # the old pod's sandbox is gone...
    new_uid = cluster.api.pods.create(new.namespace, new.name, node=sc.NODE,
                                     annotations=new.annotations, ips=[new.ip],
                                     phase="Running")["metadata"]["uid"]
    cluster.run_sandbox(new, new_uid)           # ...and its address is the new one's
    if not env.agent.wait_owner(new.ip, new_uid):
        checks.append(CheckResult("race-ip-reuse", "agent saw the new pod's add", False,
                                  problem=f"the agent never moved {new.ip} to {new.ref}",
                                  pod=new.ref, ip=new.ip))
        ui.check_line(False, f"the agent moved {new.ip} to {new.ref}",
                      problem=checks[-1].problem, indent="    ")
        return checks
    c = _pod_check("race-ip-reuse", new, env.pods.run(new.ip),
                   name="new pod, old pod not deleted yet")
    _race_line(ui, c, f"{old.name} not deleted yet")
    checks.append(c)

    before = cluster.api.traffic.stats()["watch_events_sent"]
    cluster.api.pods.delete(old.namespace, old.name)
    delivered = _wait_events_sent(cluster, before)
    time.sleep(0.2)  # let the agent apply it (its effect, by design, is invisible: a no-op)
    c = _pod_check("race-ip-reuse", new, env.pods.run(new.ip),
                   name="new pod, after the old pod's late delete")
    if not delivered:
        c.ok, c.problem = False, "the API server never delivered the delete to the agent"
    _race_line(ui, c, f"after {old.name}'s late delete")
    checks.append(c)
    return checks


def _identity_checks(cluster: DemoCluster, ui: Ui, pods: tuple[sc.DemoPod, ...]
                     ) -> list[CheckResult]:
    ui.title("Never another identity")
    checks = []
    leaked = cluster.node_secret_requests()
    checks.append(CheckResult(
        "identity", "node metadata service never asked for secrets", not leaked,
        problem=f"it received {', '.join(sorted(set(leaked)))}" if leaked else None))
    ui.check_line(not leaked, "the node's metadata service never received a request for "
                              "credentials or user data", problem=checks[-1].problem)
    calls = cluster.assume_role_calls()
    refused = sorted({sc.role_arn(p.role) for p in pods if p.expect is None and p.role})
    assumed = sorted({c.role_arn for c in calls} & set(refused))
    if refused:
        names = ", ".join(r.rsplit("/", 1)[-1] for r in refused)
        checks.append(CheckResult(
            "identity", "refused roles never assumed", not assumed,
            problem=f"AssumeRole was called for {', '.join(assumed)}" if assumed else None))
        ui.check_line(not assumed, f"STS never saw an AssumeRole for a refused pod's role "
                                   f"({names})", problem=checks[-1].problem)
    return checks


def _sts_summary(cluster: DemoCluster) -> dict[str, Any]:
    calls = cluster.assume_role_calls()
    per_role: dict[str, int] = {}
    for c in calls:
        per_role[c.role_arn] = per_role.get(c.role_arn, 0) + 1
    return {"assume_role_calls": len(calls), "roles": len(per_role),
            "max_calls_per_role": max(per_role.values(), default=0),
            "outcomes": sorted({c.outcome for c in calls})}


def _keep_running(env: DemoEnvironment, ui: Ui, pods: tuple[sc.DemoPod, ...]) -> None:
    pod = next((p for p in pods if p.expect and p.role), pods[0])
    refused = next((p for p in pods if p.expect is None), None)
    role = pod.expect.rsplit("/", 1)[-1] if pod.expect else ""
    base = f"http://127.0.0.1:{env.agent.port}/latest/meta-data/iam/security-credentials/"
    ui.title("Still running (Ctrl-C to stop). Be a pod by hand:")
    ui.write(f"  # {pod.ref}: its role's name, then its credentials", "dim")
    ui.write(f"  curl -s --interface {pod.ip} {base}; echo")
    ui.write(f"  curl -s --interface {pod.ip} {base}{role}")
    if refused is not None:
        ui.write(f"  # {refused.ref}: refused", "dim")
        ui.write(f"  curl -s -w ' %{{http_code}}\\n' --interface {refused.ip} {base}")
    ui.write(f"  # {pod.ref} as botocore, checked with STS GetCallerIdentity", "dim")
    ui.write(f"  python -m kiamfast.demo.pod --ip {pod.ip} --imds {env.agent.url} "
             f"--sts-endpoint {env.cluster.sts_url}")
    ui.write("  # the cluster as kubectl sees it (the API server emulator)", "dim")
    ui.write(f"  kubectl --kubeconfig {env.cluster.kubeconfig} get pods -A -o 'custom-columns="
             "NAMESPACE:.metadata.namespace,POD:.metadata.name,IP:.status.podIP,"
             "ROLE:.metadata.annotations.iam\\.amazonaws\\.com/role'")
    ui.write()
    ui.para("Pods: " + ", ".join(f"{p.ref} {p.ip}" for p in pods))
    ui.para(f"kubeconfig: {env.cluster.kubeconfig}   agent log: {env.agent.log}")
    while True:
        env.agent.check()
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------

def _run(env: DemoEnvironment, ui: Ui, report: Report, *, overrides: dict[str, str | None],
         keep_running: bool, started: float) -> None:
    table_pods = sc.apply_expectations(sc.PODS, overrides)
    late = sc.apply_expectations((sc.LATE_IP_POD,), overrides)[0]
    old, new = sc.apply_expectations((sc.REUSE_OLD_POD, sc.REUSE_NEW_POD), overrides)
    ui.write("kiamfast demo — an emulated node on loopback: no cluster, no AWS, no root",
             "bold")
    with ui.step("starting the Kubernetes API server emulator") as s:
        env.cluster.start_apiserver()
        s.detail = env.cluster.api.url
    with ui.step("starting the node's container runtime (a CRI v1 double)") as s:
        env.cluster.start_runtime()
        s.detail = env.cluster.runtime.endpoint
    with ui.step("starting STS (moto, local)") as s:
        env.cluster.start_sts()
        s.detail = env.cluster.sts_url
    with ui.step("starting a fake EC2 metadata service (the node's own)") as s:
        env.cluster.start_imds()
        s.detail = env.cluster.imds.url
    with ui.step(f"creating {len(sc.NAMESPACES)} namespaces with allowed roles and "
                 f"{len(table_pods) + 1} pods") as s:
        _populate(env.cluster, table_pods + (old,))
        s.detail = "; ".join(f"{ns}: {', '.join(r)}" for ns, r in sc.NAMESPACES.items())
    with ui.step("starting the kiamfast agent") as s:
        env.agent.start()
        report.agent = {"command": ["python", *env.agent.argv()[1:]], "url": env.agent.url,
                        "log": str(env.agent.log)}
        s.detail = f"listening on 127.0.0.1:{env.agent.port}"
    with ui.step("waiting for it: synced, credentials prefetched, node taint removed"):
        env.agent.wait_ready()
    with ui.step(f"running a botocore client as each of the {len(table_pods)} pods") as s:
        observed = env.pods.run_all([p.ip for p in table_pods])
        s.detail = "each from its own 127.0.10.x address"
    pod_checks = [_pod_check("pods", p, o) for p, o in zip(table_pods, observed)]
    report.checks.extend(pod_checks)

    ui.title("Each pod, as its SDK sees it (role received = what STS GetCallerIdentity says)")
    _pod_table(ui, pod_checks)

    report.checks.extend(_race_late_ip(env, ui, late))
    report.checks.extend(_race_ip_reuse(env, ui, old, new))
    report.checks.extend(_identity_checks(env.cluster, ui, table_pods + (late, old, new)))
    report.sts = _sts_summary(env.cluster)
    ui.write(f"  (STS saw {report.sts['assume_role_calls']} AssumeRole calls for "
             f"{report.sts['roles']} roles: at most {report.sts['max_calls_per_role']} per role)",
             "dim")
    env.agent.check()
    failed = report.failed()
    report.ok = not failed
    report.exit_code = EXIT_OK if report.ok else EXIT_WRONG
    total = len(report.checks)
    elapsed = time.monotonic() - started
    if report.ok:
        ui.summary(True, f"all {total} checks passed: every pod got its own role and "
                         f"nothing else ({elapsed:.1f} s)")
    else:
        first = "; ".join(f"{c.pod or c.name}: {c.problem}" for c in failed[:3])
        ui.summary(False, f"{len(failed)} of {total} checks failed — {first}")
    if keep_running:
        _keep_running(env, ui, table_pods)


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="kiamfast demo",
        description="Run kiamfast on an emulated node on loopback (Kubernetes API emulator, "
                    "local STS, fake metadata service, pods as real botocore clients on "
                    "127.0.10.x) and check every pod gets its own role. Needs the demo "
                    "extra: pip install -e '.[demo]'. Exit status: 0 all right, 1 a pod got "
                    "a wrong or no credential, 2 the demo could not run.")
    ap.add_argument("--keep-running", action="store_true",
                    help="leave everything running afterwards, with a curl line to try "
                         "(Ctrl-C stops it)")
    ap.add_argument("--json", action="store_true",
                    help="print the results as JSON on stdout (progress goes to stderr)")
    ap.add_argument("--expect", action="append", default=[], metavar="NAMESPACE/POD=ROLE",
                    help="change what a pod must get (a role name, an ARN, or 'none'), e.g. "
                         "to watch the demo catch a wrong credential; repeatable")
    ap.add_argument("--workers", type=int, default=1, help="agent worker processes "
                                                            "(default 1)")
    ap.add_argument("--no-color", action="store_true", help="no ANSI colours")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    try:
        overrides = dict(sc.parse_expectation(e) for e in args.expect)
    except sc.ExpectationError as e:
        sys.stderr.write(f"kiamfast demo: {e}\n")
        return EXIT_BROKEN
    ui = Ui(sys.stderr if args.json else sys.stdout, color=False if args.no_color else None)
    # No AWS client in this process may ever look for the real metadata service.
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    report = Report()
    try:
        check_extra()
    except MissingExtra as e:
        ui.write(f"kiamfast demo: {e}")
        report.error = str(e)
        if args.json:
            sys.stdout.write(report.to_json() + "\n")
        return EXIT_BROKEN
    # SIGINT too, as the agent does: Python leaves it ignored when the demo inherits it so
    # (a background job of a script), and "Ctrl-C to stop" would then never stop it.
    previous = {s: signal.signal(s, _raise_interrupted)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    env = DemoEnvironment(workers=args.workers)
    try:
        _run(env, ui, report, overrides=overrides, keep_running=args.keep_running,
             started=started)
    except BrokenPipeError:
        # The reader went away (``kiamfast demo | head``): stop quietly, clean up.
        ui.stream = open(os.devnull, "w")  # noqa: SIM115 - lives until exit
        report.error = "output closed"
        report.ok, report.exit_code = False, EXIT_BROKEN
    except (_Interrupted, KeyboardInterrupt):
        if not args.keep_running or not report.checks:
            report.error = "interrupted"
            report.ok, report.exit_code = False, EXIT_BROKEN
        ui.write()
        ui.write("stopping…", "dim")
    except Exception as e:  # noqa: BLE001 - DemoError, or a bug: said, cleaned up, exit 1/2
        report.error = str(e) if isinstance(e, DemoError) else f"{type(e).__name__}: {e}"
        report.ok, report.exit_code = False, EXIT_BROKEN if not report.checks else EXIT_WRONG
        ui.write()
        ui.check_line(False, f"the demo could not go on: {report.error}", indent="")
        if not isinstance(e, DemoError):
            for line in traceback.format_exc().rstrip().splitlines():
                ui.write("  " + line, "dim")
        tail = env.agent.log_tail()
        if tail:
            ui.write(f"last lines of the agent's log ({env.agent.log}):", "dim")
            for line in tail:
                ui.write("  " + line, "dim")
    finally:
        report.steps = [asdict(s) | {"ms": round(s.ms, 1)} for s in ui.steps]
        report.elapsed_s = round(time.monotonic() - started, 2)
        try:
            # Keep the agent's log and kubeconfig when something went wrong, not when the
            # user stopped the demo.
            env.close(keep_workdir=not report.ok and report.error not in (
                "interrupted", "output closed"))
        except DemoError as e:
            ui.write(f"kiamfast demo: {e}", "dim")
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not report.ok and env.workdir.exists():
        ui.write(f"(files kept for a look: {env.workdir})", "dim")
    if args.json:
        sys.stdout.write(report.to_json() + "\n")
        sys.stdout.flush()
    return report.exit_code
