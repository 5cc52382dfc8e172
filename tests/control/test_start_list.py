"""The control process's start list (control/process.py, control/lifecycle.py): a worker's
message that arrives while ``--auto-discover-*`` reads the node's role (an ``await`` before
any room exists) reaches its room once the rooms are built, and nothing fails on the loop;
the start's steps are timed in order and stopped in reverse."""
from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from kiamfast import channel, milestones
from kiamfast import table as tbl
from kiamfast.config import Config
from kiamfast.control import imds_client, lifecycle
from kiamfast.control.iam.manager import CredentialManager
from kiamfast.control.iam.sts import StsClient
from kiamfast.control.process import ControlProcess
from kiamfast.kube.config import load_config
from kiamfast.supervisor.statefiles import table_layout
from kiamfast.testing.aws_env import offline
from kiamfast.testing.fake_imds import FakeImds
from kiamfast.testing.net import free_port


def control_for(tmp_path, **overrides) -> tuple[ControlProcess, socket.socket, tbl.Table]:
    """A control process with nothing around it: no API server answers (its watch retries),
    no runtime (``--cri-endpoint=none``), no metadata service."""
    dead = f"127.0.0.1:{free_port()}"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://{dead}'}}}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
        "users: [{name: u, user: {token: t}}]\n")
    overrides.setdefault("metadata_addr", dead)
    config = Config(node="node-a", host_ip="127.0.0.2",
                    kubeconfig=str(kubeconfig), cri_endpoint="none", iptables=False,
                    table_path=str(tmp_path / "table"), node_startup_taint="",
                    sts_endpoint=f"http://{dead}", sts_region="us-east-1", **overrides)
    table = tbl.Table.create(config.table_path, **table_layout(config))
    ours, workers = channel.socketpair()
    control = ControlProcess(config, table, [ours],
                             sts=StsClient.from_config(config, start=False),
                             api_config=load_config(kubeconfig=config.kubeconfig))
    return control, workers, table


@pytest.mark.parametrize("flag", ["auto_discover_base_arn", "auto_discover_default_role"])
def test_a_workers_message_during_auto_discovery_reaches_its_room(tmp_path, monkeypatch,
                                                                   flag):
    discovering = threading.Event()
    release = threading.Event()

    real_discover = imds_client.discover_roles

    def discover(config: Config) -> Config:      # the metadata service answering slowly
        discovering.set()
        release.wait(10)
        return real_discover(config)

    wanted: list[int] = []
    monkeypatch.setattr(imds_client, "discover_roles", discover)
    monkeypatch.setattr(CredentialManager, "wanted", lambda self, slot: wanted.append(slot))
    imds = FakeImds().start()
    with offline():
        control, workers, table = control_for(tmp_path, metadata_addr=imds.addr,
                                              **{flag: True})
    loop_errors: list[dict] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
        running = asyncio.create_task(control.run())
        await loop.run_in_executor(None, discovering.wait, 10)
        assert channel.send(workers, channel.want_credentials(3))   # a worker's miss, now
        await asyncio.sleep(0.2)       # the loop runs meanwhile: the message waits unread
        release.set()
        for _ in range(200):
            if wanted:
                break
            await asyncio.sleep(0.02)
        control._stop.set()
        await asyncio.wait_for(running, 20)

    try:
        with offline():
            asyncio.run(scenario())
    finally:
        workers.close()
        table.close()
        imds.stop()
    assert loop_errors == []
    assert wanted == [3]
    # kube2iam's flags: the node's instance role (the fake's) as base ARN, and as default role
    assert control.config.base_role_arn == "arn:aws:iam::111122223333:role/"
    assert control.config.default_role == (
        "arn:aws:iam::111122223333:role/eks-node-role"
        if flag == "auto_discover_default_role" else "")


def test_steps_start_in_order_are_timed_and_stop_in_reverse(monkeypatch):
    marked: list[str] = []
    monkeypatch.setattr(milestones, "mark", marked.append)
    done: list[str] = []

    async def slow_start() -> None:
        await asyncio.sleep(0.01)
        done.append("start b")

    def failing_stop() -> None:
        done.append("stop b")
        raise RuntimeError("b cannot stop")

    steps = [lifecycle.Step("a", lambda: done.append("start a"), lambda: done.append("stop a")),
             lifecycle.Step("b", slow_start, failing_stop),
             lifecycle.Step("c", lambda: done.append("start c"))]

    async def scenario() -> None:
        life = lifecycle.Lifecycle(steps)
        await life.start()
        await life.stop()

    asyncio.run(scenario())
    assert marked == ["a", "b", "c"]
    # b's failure to stop is logged; a still stops
    assert done == ["start a", "start b", "start c", "stop b", "stop a"]


def test_a_task_for_life_that_ends_fails_the_process_and_the_others_are_cancelled():
    async def scenario() -> tuple[str, bool]:
        tasks = lifecycle.Tasks()
        forever = tasks.spawn(asyncio.sleep(3600), "forever")
        tasks.spawn(asyncio.sleep(0.01), "short")
        with pytest.raises(lifecycle.TaskFailed) as failed:
            await tasks.until_stopped_or_failed(asyncio.Event())
        await tasks.cancel()
        return str(failed.value), forever.cancelled()

    assert asyncio.run(scenario()) == ("short", True)
