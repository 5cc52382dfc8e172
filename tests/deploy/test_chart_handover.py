"""The chart's side of handing a node over (issue 33), rendered by the real helm.

By default the DaemonSet rolls by the surge handover: ``maxSurge`` as a percentage and
``maxUnavailable: 0`` (the DaemonSet API takes exactly one of them non-zero); no container
declares a port (with host networking a declared port is a hostPort, and the scheduler's
NodePorts filter would keep the surge pod Pending beside the old one); the agent hands over
through a socket in its node directory, serves a second port where the old process cannot
hand over, keeps its readiness in a file of its pod's own emptyDir (probed with ``test -f``,
since two pods share the port during a handover), and keeps its DNAT rule in place; the
socket keeper is a second container sharing that emptyDir, as the agent's user. A kube2iam
values file's ``maxUnavailable`` keeps kube2iam's meaning, and every value that cannot work
fails the render with one line. The real rollouts are
tests/k8s/test_chart_upgrade_and_rollback.py.
"""
from __future__ import annotations

import shutil

import pytest
import yaml
from test_chart import (CHART, VALUES, agent_config, container, notes, one, pod_spec, render,
                        render_error, values_file)

READY_FILE = "/run/kiamfast-pod/ready"


def strategy(objs: list[dict]) -> dict:
    return one(objs, "DaemonSet")["spec"]["updateStrategy"]


def keeper(objs: list[dict]) -> dict:
    (found,) = [c for c in pod_spec(objs)["containers"] if c["name"] == "socket-keeper"]
    return found


def test_the_default_rollout_is_the_surge_handover():
    objs = render()
    assert strategy(objs) == {"type": "RollingUpdate",
                              "rollingUpdate": {"maxSurge": "10%", "maxUnavailable": 0}}


def test_no_container_declares_a_port_the_scheduler_would_reserve():
    for objs in (render(), render(VALUES / "servicemonitor.yaml")):
        for c in [*pod_spec(objs)["containers"], *pod_spec(objs).get("initContainers", [])]:
            assert "ports" not in c, c["name"]
    # The metrics Service reaches the pods by port number, not by a container port's name.
    service = one(render(VALUES / "servicemonitor.yaml"), "Service")
    assert service["spec"]["ports"][0]["targetPort"] == 9543


def test_the_agent_hands_over_through_its_node_directory_and_is_ready_by_its_own_file():
    objs = render()
    cfg, _ = agent_config(objs)
    spec, agent = pod_spec(objs), container(objs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    assert cfg.handover_socket == "/run/kiamfast/handover.sock"
    assert "hostPath" in volumes[mounts["/run/kiamfast"]]        # shared by the node's pods
    assert cfg.handover_port == 8182
    assert cfg.ready_file == READY_FILE
    assert "emptyDir" in volumes[mounts["/run/kiamfast-pod"]]    # this pod's alone
    assert agent["readinessProbe"]["exec"] == {"command": ["test", "-f", READY_FILE]}
    # Liveness stays on the node's port (whichever agent serves the node answers it).
    assert agent["livenessProbe"]["httpGet"]["port"] == cfg.app_port


def test_the_socket_keeper_shares_the_pods_directory_and_the_agents_user():
    objs = render()
    cfg, _ = agent_config(objs)
    spec, agent, kept = pod_spec(objs), container(objs), keeper(objs)
    assert [c["name"] for c in spec["containers"]] == ["kiamfast", "socket-keeper"]
    assert "initContainers" not in spec   # a plain container: every supported kubelet runs it
    assert kept["image"] == agent["image"]
    assert kept["command"] == ["python", "-m", "kiamfast.socket_keeper"]
    assert kept["args"] == ["--socket", cfg.socket_keeper]
    assert cfg.socket_keeper == "/run/kiamfast-pod/keeper.sock"
    assert {m["name"]: m["mountPath"] for m in kept["volumeMounts"]} == {
        "pod-local": "/run/kiamfast-pod"}
    security = kept["securityContext"]
    assert security["runAsUser"] == agent["securityContext"]["runAsUser"] == 0
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["readOnlyRootFilesystem"] is True
    assert kept["resources"] == {"requests": {"cpu": "1m", "memory": "8Mi"},
                                 "limits": {"memory": "32Mi"}}
    annotations = one(objs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["kubectl.kubernetes.io/default-container"] == "kiamfast"


def test_the_socket_keeper_logs_as_the_agent_does(tmp_path):
    """One format in the pod's logs: the agent's --log-format and --log-level (kube2iam's
    extraArgs, or verbose) reach the keeper too, which starts with them."""
    import subprocess
    import sys
    import time
    objs = render(values_file(tmp_path, {"extraArgs": {"log-format": "json",
                                                       "log-level": "warn"}}))
    assert keeper(objs)["args"][2:] == ["--log-format=json", "--log-level=warn"]
    cfg, _ = agent_config(objs)
    assert (cfg.log_format, cfg.log_level) == ("json", "warn")
    verbose = render(values_file(tmp_path, {"verbose": True}))
    assert keeper(verbose)["args"][2:] == ["--log-level=debug"]
    for n, args in enumerate((keeper(objs)["args"], keeper(verbose)["args"])):
        path = tmp_path / f"keeper-{n}.sock"
        proc = subprocess.Popen([sys.executable, "-m", "kiamfast.socket_keeper", "--socket",
                                 str(path), *args[2:]], stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert path.exists() and proc.poll() is None, proc.stderr.read()
        finally:
            proc.terminate()
            proc.wait(10)


def test_without_the_keeper_one_container_and_no_keeper_flag(tmp_path):
    objs = render(values_file(tmp_path, {"socketKeeper": {"enabled": False}}))
    assert [c["name"] for c in pod_spec(objs)["containers"]] == ["kiamfast"]
    assert agent_config(objs)[0].socket_keeper == ""


def test_the_dnat_rule_is_kept_in_place_only_where_the_agent_installs_it(tmp_path):
    cfg, _ = agent_config(render(values_file(tmp_path, {"host": {"iptables": True}})))
    assert cfg.iptables_backstop is True and cfg.iptables_check_interval == 10.0
    cfg, _ = agent_config(render(values_file(tmp_path, {"host": {"iptables": True}, "dnatRule": {
        "backstop": False, "checkInterval": "0"}})))
    assert cfg.iptables_backstop is False and cfg.iptables_check_interval == 0.0
    cfg, args = agent_config(render())     # host.iptables false: no rule to keep
    assert not any(a.startswith(("--iptables-backstop", "--iptables-check-interval",
                                 "--iptables-remove-on-uninstall")) for a in args)


def uninstall_parts(objs: list[dict]) -> tuple[bool, set[str], list[dict]]:
    """(the agent's --iptables-remove-on-uninstall, its pod-identity env, the ClusterRole's
    rules on daemonsets)."""
    cfg, _ = agent_config(objs)
    env = {e["name"] for e in container(objs)["env"]} & {"POD_NAME", "POD_NAMESPACE"}
    rules = [r for r in one(objs, "ClusterRole")["rules"] if "daemonsets" in r["resources"]]
    return cfg.iptables_remove_on_uninstall, env, rules


def test_an_uninstall_removes_the_rules_and_only_the_own_daemonset_is_watched(tmp_path):
    on, env, rules = uninstall_parts(render(values_file(tmp_path, {"host": {"iptables": True}})))
    assert on is True and env == {"POD_NAME", "POD_NAMESPACE"}
    assert rules == [{"apiGroups": ["apps"], "resources": ["daemonsets"],
                      "resourceNames": ["kube2iam-kiamfast"],
                      "verbs": ["get", "list", "watch"]}]
    # Off, or without a rule to remove: neither the flag nor what it needs.
    for values in ({"host": {"iptables": True}, "dnatRule": {"removeOnUninstall": False}},
                   {"host": {"iptables": False}}):
        assert uninstall_parts(render(values_file(tmp_path, values))) == (False, set(), [])


def test_a_kube2iam_values_files_max_unavailable_rolls_without_the_surge(tmp_path):
    # kube2iam's charts default to maxUnavailable 1, and users copy it: it keeps its
    # meaning (old pod first), the API refusing both non-zero, and the notes say so.
    given = values_file(tmp_path, {"maxUnavailable": 1})
    assert strategy(render(given)) == {"type": "RollingUpdate",
                                       "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert "maxUnavailable is 1 (kube2iam's charts' way" in notes(tmp_path, given)
    (tmp_path / "default").mkdir()
    assert "maxUnavailable is" not in notes(tmp_path / "default", values_file(tmp_path, {}))


def test_the_first_switch_from_kube2iam_surges_through_the_second_port(tmp_path):
    switch = values_file(tmp_path, {"kube2iamChart": "kube2iam-chart"})
    objs = render(switch)
    assert strategy(objs)["rollingUpdate"] == {"maxSurge": "10%", "maxUnavailable": 0}
    assert agent_config(objs)[0].handover_port == 8182
    assert "serves on port\n8182 and takes pods' new connections from kube2iam" in \
        notes(tmp_path, switch)


def test_an_explicit_map_strategy_is_kept(tmp_path):
    given = {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {
        "maxSurge": 1, "maxUnavailable": 0}}}
    assert strategy(render(values_file(tmp_path, given))) == given["updateStrategy"]


REFUSED = [
    ({"maxSurge": 0}, "maxSurge and maxUnavailable are both 0: a RollingUpdate needs one"),
    ({"maxSurge": "150%"}, "maxSurge 150%: a percentage of the nodes, at most 100%"),
    ({"maxUnavailable": "one"}, "maxUnavailable one: a number of nodes or a percentage"),
    ({"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "10%"}}},
     "updateStrategy.rollingUpdate.maxSurge needs maxUnavailable: 0 beside it"),
    ({"handoverPort": 8181}, "handoverPort 8181: the second port must differ from host.port"),
    ({"handoverPort": 9543, "prometheus": {"metricsPort": 9543}},
     "handoverPort 9543: the second port must differ"),
    ({"handoverPort": "8182"}, "at '/handoverPort': got string, want integer"),
    ({"handoverPort": 70000}, "handoverPort 70000: a port number, or 0 for none"),
    ({"handoverPort": 0, "kube2iamChart": "kube2iam"},
     "handoverPort 0 with kube2iamChart and the surge: kube2iam cannot hand its port over"),
    ({"socketKeeper": {"enabled": "yes"}}, "at '/socketKeeper/enabled': got string, want "
                                           "boolean"),
    ({"dnatRule": {"checkInterval": 10}}, "dnatRule.checkInterval 10: a duration such as 10s"),
    ({"dnatRule": {"backstop": "true"}}, "at '/dnatRule/backstop': got string, want boolean"),
    ({"dnatRule": {"removeOnUninstall": "no"}},
     "at '/dnatRule/removeOnUninstall': got string, want boolean"),
    ({"extraArgs": {"iptables-remove-on-uninstall": True}},
     "extraArgs.iptables-remove-on-uninstall: the chart sets --iptables-remove-on-uninstall "
     "from its own value (dnatRule.removeOnUninstall)"),
    ({"readinessProbe": {"path": "/healthz"}},
     "readinessProbe.path /healthz: the readiness probe is no HTTP request any more"),
    ({"stateDir": "/run"}, "stateDir /run: /run/kiamfast-pod is the pod's own directory"),
    ({"extraArgs": {"handover-socket": "/tmp/h.sock"}},
     "extraArgs.handover-socket: the chart sets --handover-socket from its own value (stateDir)"),
    ({"extraArgs": {"iptables-backstop": True}},
     "extraArgs.iptables-backstop: the chart sets --iptables-backstop from its own value "
     "(dnatRule.backstop)"),
    ({"extraArgs": {"ready-file": "/tmp/r"}},
     "extraArgs.ready-file: the chart sets --ready-file from its own value (readinessProbe)"),
]


@pytest.mark.parametrize("values,message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_a_rollout_value_that_cannot_work_fails_the_render(tmp_path, values, message):
    assert message in render_error(tmp_path, values)


def test_the_neighbours_of_the_refused_values_render(tmp_path):
    for values in ({"maxSurge": 0, "maxUnavailable": 1}, {"maxSurge": "100%"},
                   {"handoverPort": 0}, {"handoverPort": 9000},
                   {"handoverPort": 0, "kube2iamChart": "kube2iam", "maxUnavailable": 1},
                   {"dnatRule": {"checkInterval": "1m30s"}},
                   {"readinessProbe": {"path": "/readyz"}},   # an older release's default
                   {"stateDir": "/var/run/kiamfast"}):
        render(values_file(tmp_path, values))


# ---- helm upgrade --reuse-values of a release installed before these values ----------------

def chart_with_older_values(tmp_path, **older: object):
    """A copy of the chart whose values.yaml is the one before the handover: what `helm
    upgrade --reuse-values` renders with for a release installed then (helm keeps the
    installed chart's values.yaml)."""
    chart = tmp_path / f"chart-older-values-{len(list(tmp_path.glob('chart-older-*')))}"
    shutil.copytree(CHART, chart)
    values = yaml.safe_load((chart / "values.yaml").read_text())
    for key in ("maxSurge", "handoverPort", "socketKeeper", "dnatRule"):
        del values[key]
    values["readinessProbe"]["path"] = "/readyz"
    values.update(older)
    (chart / "values.yaml").write_text(yaml.safe_dump(values))
    return chart


def test_an_upgrade_reusing_an_older_releases_values_gets_the_handover(tmp_path):
    given = values_file(tmp_path, {"host": {"iptables": True}})
    older = chart_with_older_values(tmp_path, maxUnavailable=0)
    new, old = one(render(given), "DaemonSet"), one(render(given, chart=older), "DaemonSet")
    assert old["spec"] == new["spec"]
    # A release of the handover's first version had dnatRule without removeOnUninstall.
    older = chart_with_older_values(tmp_path, maxUnavailable=0, dnatRule={
        "checkInterval": "10s", "backstop": True})
    assert one(render(given, chart=older), "DaemonSet")["spec"] == new["spec"]


def test_an_older_releases_max_unavailable_keeps_rolling_it_without_the_surge(tmp_path):
    # The chart's old default (1) is in the installed release's values: the handover's
    # flags and the keeper come, the rollout stays a rolling one until the values change.
    older = chart_with_older_values(tmp_path, maxUnavailable=1)
    objs = render(chart=older)
    assert strategy(objs)["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert keeper(objs) and agent_config(objs)[0].handover_socket
