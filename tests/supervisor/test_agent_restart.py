"""A restarted agent keeps its pods' credentials (issue 20, item 5a).

The whole agent (supervisor, workers, control process) is killed with SIGKILL, as an OOM
kill or a failed liveness probe ends a container, and started again with the same
--table-path, as the restarted container (or the new pod of a DaemonSet upgrade, through the
hostPath) finds it.  A pod that was there all along gets the exact credentials it had, and
STS sees no new AssumeRole.  Without a container runtime (this agent follows the API server)
an address whose pod went away during the downtime is never answered from the old table,
even before the new agent has synced.  STS is judged by its own records (the fault proxy in
front of moto records every call).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import orjson
import pytest

from agent_process import LISTING, POD_IP, ROLE, Agent, Fakes, http
from kiamfast import table
from kiamfast.testing.sts import FaultProxy

REUSED_IP = "127.0.0.6"


@pytest.fixture
def fakes():
    fakes = Fakes()
    fakes.proxy = FaultProxy(fakes.sts.url).start()
    try:
        yield fakes
    finally:
        fakes.proxy.stop()
        fakes.stop()


def start(fakes: Fakes, workdir: Path, *, port: int | None = None) -> Agent:
    return Agent(fakes, workdir, port=port, extra=[f"--sts-endpoint={fakes.proxy.url}"])


def credentials(port: int, ip: str) -> tuple[str, dict]:
    """(role name, credentials document) the agent serves the pod at ``ip``."""
    status, role = http(port, f"GET {LISTING}", source=ip)
    assert status == 200, role
    status, body = http(port, f"GET {LISTING}{role.decode()}", source=ip)
    assert status == 200, body
    return role.decode(), orjson.loads(body)


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")   # a zombie holds no socket and no lock


def kill_everything(agent: Agent) -> None:
    """SIGKILL the supervisor and its children at once; return once none of them runs."""
    pids = [agent.proc.pid, *agent.children("kiamfast.control"),
            *agent.children("kiamfast.server.worker")]
    assert len(pids) == 3, pids
    os.killpg(agent.proc.pid, signal.SIGKILL)
    agent.proc.wait()
    wait_until(lambda: all(map(gone, pids)), f"processes {pids} still run")


def test_a_killed_agent_restarts_with_the_same_credentials_and_no_sts_call(fakes, tmp_path):
    fakes.api.pods.create("team", "leaving", node="n1", annotations={
        "iam.amazonaws.com/role": "leaving-role"}, ips=[REUSED_IP], phase="Running")
    agent = start(fakes, tmp_path)
    try:
        agent.wait_ready()
        role, before = credentials(agent.port, POD_IP)
        assert role == ROLE
        assert credentials(agent.port, REUSED_IP)[0] == "leaving-role"
        calls = len(fakes.proxy.assume_role_calls())
        assert calls == 2
    finally:
        kill_everything(agent)

    # While the agent is down, a pod goes and another one takes its address.
    fakes.api.pods.delete("team", "leaving")
    fakes.api.pods.create("team", "arriving", node="n1", annotations={
        "iam.amazonaws.com/role": "arriving-role"}, ips=[REUSED_IP], phase="Running")
    # The new agent syncs late: its first answers come from the table.
    fakes.api.faults.slow_list(3.0)

    again = start(fakes, tmp_path, port=agent.port)
    try:
        wait_until(lambda: again.proc.poll() is None and http_status(again.port) == 503,
                   "the restarted agent's workers never answered")
        status, body = http(again.port, f"GET {LISTING}", source=REUSED_IP)
        assert status == 503, (status, body)   # never the leaving pod's role from the table
        fakes.api.faults.slow_list(0)
        again.wait_ready()

        role, after = credentials(again.port, POD_IP)
        assert role == ROLE
        assert after["AccessKeyId"] == before["AccessKeyId"], again.log()
        assert after == before
        assert credentials(again.port, REUSED_IP)[0] == "arriving-role"
        assert [c.role_arn.rsplit("/", 1)[1] for c in fakes.proxy.assume_role_calls()][calls:] \
            == ["arriving-role"]
    finally:
        again.stop()


def test_a_new_agent_leaves_the_table_alone_while_the_old_control_process_lives(fakes,
                                                                              tmp_path):
    """The supervisor dies first; its control process (the table's writer) is still
    finishing.  A new agent on the same port binds it, but touches the table only once the
    old writer is gone, then serves the same credentials."""
    agent = start(fakes, tmp_path)
    control = None
    try:
        agent.wait_ready()
        _, before = credentials(agent.port, POD_IP)
        [control] = agent.children("kiamfast.control")
        workers = agent.children("kiamfast.server.worker")
        os.kill(control, signal.SIGSTOP)          # it stops only when we say so
        for pid in (agent.proc.pid, *workers):
            os.kill(pid, signal.SIGKILL)
        agent.proc.wait()
        wait_until(lambda: all(map(gone, workers)), f"workers {workers} still run")

        again = start(fakes, tmp_path, port=agent.port)
        try:
            wait_until(lambda: "is held; waiting" in again.log(), "no wait for the lock")
            with table.Table.attach(str(tmp_path / "table")) as t:
                assert t.ready                    # the old agent's: not adopted yet
            os.kill(control, signal.SIGKILL)
            again.wait_ready()
            assert credentials(again.port, POD_IP)[1] == before
        finally:
            again.stop()
    finally:
        if control is not None and not gone(control):
            os.kill(control, signal.SIGKILL)


def http_status(port: int) -> int:
    try:
        return http(port, "GET /readyz")[0]
    except OSError:
        return 0


def test_with_a_runtime_the_first_poll_confirms_the_adopted_owners_before_the_api_answers(
        fakes, tmp_path):
    """A node with a container runtime: after a kill -9 the new agent serves the pods whose
    sandboxes still hold their addresses from the adopted table as soon as its first runtime
    poll confirms them, with the API server not answering at all; an address another pod's
    sandbox took meanwhile is never answered with the old pod's role."""
    from kiamfast.testing.cri_fault import CriFault, fake_sandbox

    app = fakes.api.pods.get("team", "app")
    leaving = fakes.api.pods.create("team", "leaving", node="n1", annotations={
        "iam.amazonaws.com/role": "leaving-role"}, ips=[REUSED_IP], phase="Running")
    with CriFault() as runtime:
        def sandbox(pod: dict, ip: str):
            meta = pod["metadata"]
            return fake_sandbox(name=meta["name"], namespace=meta["namespace"], ip=ip,
                                uid=meta["uid"], annotations=meta.get("annotations"))
        old = sandbox(leaving, REUSED_IP)
        runtime.put(sandbox(app, POD_IP), old)
        # loopback pods: no namespace of their own for the kernel to show
        flags = [f"--cri-endpoint={runtime.endpoint}", "--address-proof=runtime"]
        agent = Agent(fakes, tmp_path, extra=[f"--sts-endpoint={fakes.proxy.url}", *flags])
        try:
            agent.wait_ready()
            _, before = credentials(agent.port, POD_IP)
            assert credentials(agent.port, REUSED_IP)[0] == "leaving-role"
        finally:
            kill_everything(agent)

        statuses = runtime.calls["PodSandboxStatus"]
        runtime.remove(old.id)                     # the pod goes, another takes its address
        arriving = fake_sandbox(name="arriving", namespace="team", ip=REUSED_IP,
                                annotations={"iam.amazonaws.com/role": "arriving-role"})
        runtime.put(arriving)
        fakes.api.faults.slow_list(8.0)                   # the API answers no list meanwhile

        earlier = len(agent.log())
        again = Agent(fakes, tmp_path, port=agent.port,
                      extra=[f"--sts-endpoint={fakes.proxy.url}", *flags])
        new_log = lambda: again.log()[earlier:]   # noqa: E731 - one log file for both
        try:
            wait_until(lambda: "adopted the table" in new_log(), "no adoption")
            wait_until(lambda: http_status(again.port) != 0, "never listening")
            role, after = credentials(again.port, POD_IP)
            assert (role, after) == (ROLE, before), new_log()
            assert "start: pods listed" not in new_log()   # served before the API listed
            # the app's sandbox came from the file the previous process kept: one status,
            # the newcomer's (control/cri/kept_sandboxes.py)
            assert runtime.calls["PodSandboxStatus"] == statuses + 1
            status, body = http(again.port, f"GET {LISTING}", source=REUSED_IP)
            assert status != 200 or body == b"arriving-role", (status, body)
            fakes.api.faults.slow_list(0)
            again.wait_ready()
            assert "start: pods listed" in new_log()
        finally:
            fakes.api.faults.slow_list(0)
            again.stop()
