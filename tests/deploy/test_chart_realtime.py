"""The chart runs the agent's workers at real-time priority by default (realtimeWorkers:
--worker-realtime, and CAP_SYS_NICE for it), rendered by the real helm; the requests stay
small (docs/install.md, "A saturated node")."""
from __future__ import annotations

import pytest
from test_chart import agent_config, container, render, values_file


def added(objs: list[dict]) -> list[str]:
    return container(objs)["securityContext"].get("capabilities", {}).get("add", [])


def test_by_default_the_workers_run_real_time_with_sys_nice_and_a_20m_request():
    objs = render()
    c = container(objs)
    assert "--worker-realtime" in c["args"]
    assert added(objs) == ["NET_ADMIN", "NET_RAW", "NET_BROADCAST", "SYS_NICE"]
    assert c["resources"]["requests"]["cpu"] == "20m"
    assert "limits" not in c["resources"] or "cpu" not in c["resources"]["limits"]


def test_the_agents_parser_accepts_what_the_chart_renders():
    cfg, _ = agent_config(render())
    assert cfg.worker_realtime is True


def test_off_neither_the_flag_nor_the_capability(tmp_path):
    objs = render(values_file(tmp_path, {"realtimeWorkers": False}))
    assert "--worker-realtime" not in container(objs)["args"]
    assert added(objs) == ["NET_ADMIN", "NET_RAW", "NET_BROADCAST"]   # (the runtime's)
    cfg, _ = agent_config(objs)
    assert cfg.worker_realtime is False


@pytest.mark.parametrize("security, expected_add", [
    ({"capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]}},
     ["NET_ADMIN", "NET_BROADCAST", "SYS_NICE"]),
    ({"capabilities": {"add": ["SYS_NICE", "NET_ADMIN"]}},
     ["SYS_NICE", "NET_ADMIN", "NET_BROADCAST"]),
    ({"privileged": True}, ["NET_ADMIN", "NET_RAW"])])   # privileged has every capability
def test_a_users_security_context_gets_sys_nice_once(tmp_path, security, expected_add):
    objs = render(values_file(tmp_path, {"securityContext": security}))
    assert added(objs) == expected_add
