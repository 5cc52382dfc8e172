"""The chart turns on the agent's container-credentials listener (containerCredentials.*),
rendered by the real helm.

What a user checks: off by default (kube2iam's contract alone, least privilege); on, the
agent gets the EKS Pod Identity addresses, the link and the audience, its ClusterRole may
create tokenreviews (and nothing else more), and the webhook injects exactly the address and
audience the agent serves; values that would make the two disagree, or send pods where no
agent answers, fail the render with the reason.
"""
from __future__ import annotations

import pytest
from test_chart import (CHART, NAMESPACE, agent_config, container, helm, notes,
                        render, render_error, values_file)
from test_deploy_manifests import AGENT_CALLS, UNINSTALL_CALLS

from kiamfast.webhook import cli as webhook_cli

ON = {"containerCredentials": {"enabled": True}}
FLAGS = ("--container-credentials-addr", "--container-credentials-link",
         "--container-credentials-audience")
TOKEN_REVIEW = ("authentication.k8s.io", "tokenreviews", "create")
EVENTS = ("", "events", "create")   # the Event on a pod created without its injection


def cc_args(objs: list[dict]) -> list[str]:
    return [a for a in container(objs)["args"] if a.startswith(FLAGS)]


def granted(objs: list[dict], *, webhook_role: bool = False) -> set[tuple[str, str, str]]:
    """What the agent's ClusterRole grants (or the webhook's: ``webhook_role``)."""
    (role,) = [o for o in objs if o["kind"] == "ClusterRole"
               and o["metadata"]["name"].endswith("-webhook") == webhook_role]
    return {(g, res, v) for r in role["rules"] for g in r["apiGroups"]
            for res in r["resources"] for v in r["verbs"]}


def test_off_by_default_no_listener_and_no_token_reviews():
    objs = render()
    assert cc_args(objs) == []
    assert agent_config(objs)[0].container_credentials_addr == ""
    # (host.iptables is off by default: no rules, so no DaemonSet to watch for an uninstall)
    assert granted(objs) == set(AGENT_CALLS) - UNINSTALL_CALLS


def test_on_the_agent_serves_both_addresses_on_its_link(tmp_path):
    assert cc_args(render(values_file(tmp_path, ON))) == [
        "--container-credentials-addr=169.254.170.23:80,[fd00:ec2::23]:80",
        "--container-credentials-link=kiamfast0",
        "--container-credentials-audience=kiamfast.io/container-credentials"]


@pytest.mark.parametrize("values, expected", [
    ({"ipv6": False}, ["--container-credentials-addr=169.254.170.23:80",
                       "--container-credentials-link=kiamfast0",
                       "--container-credentials-audience=kiamfast.io/container-credentials"]),
    ({"link": "", "audience": "sts.example.com"},
     ["--container-credentials-addr=169.254.170.23:80,[fd00:ec2::23]:80",
      "--container-credentials-audience=sts.example.com"])])
def test_the_values_set_the_flags(tmp_path, values, expected):
    objs = render(values_file(tmp_path, {"containerCredentials": {"enabled": True, **values}}))
    assert cc_args(objs) == expected


def test_the_agents_parser_accepts_what_the_chart_renders(tmp_path):
    cfg, _ = agent_config(render(values_file(tmp_path, ON)))
    assert cfg.container_credentials_addr == "169.254.170.23:80,[fd00:ec2::23]:80"
    assert cfg.container_credentials_link == "kiamfast0"
    assert cfg.container_credentials_audience == "kiamfast.io/container-credentials"
    cfg, _ = agent_config(render(values_file(tmp_path, {"containerCredentials": {
        "enabled": True, "ipv6": False, "link": "", "audience": "sts.example.com"}})))
    assert cfg.container_credentials_addr == "169.254.170.23:80"
    assert cfg.container_credentials_link == ""
    assert cfg.container_credentials_audience == "sts.example.com"


@pytest.mark.parametrize("security, expected_add", [
    ({}, ["NET_ADMIN", "NET_RAW", "NET_BROADCAST", "NET_BIND_SERVICE"]),
    ({"capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_BIND_SERVICE"]}},
     ["NET_ADMIN", "NET_BIND_SERVICE", "NET_BROADCAST"]),
    ({"privileged": True}, ["NET_ADMIN", "NET_RAW"])])   # privileged has every capability
def test_on_the_agent_may_bind_port_80(tmp_path, security, expected_add):
    # Root whose capabilities were dropped cannot bind a port under 1024 without this one
    # (NET_BROADCAST: the runtime's, tests/deploy/test_chart.py; real-time workers' SYS_NICE
    # apart: tests/deploy/test_chart_realtime.py).
    objs = render(values_file(tmp_path, {**ON, "securityContext": security,
                                         "realtimeWorkers": False}))
    assert container(objs)["securityContext"]["capabilities"]["add"] == expected_add
    off = render(values_file(tmp_path, {"securityContext": security,
                                        "realtimeWorkers": False}))
    own = (security.get("capabilities") or {}).get("add", ["NET_ADMIN", "NET_RAW"])
    assert container(off)["securityContext"].get("capabilities", {}).get("add") == (
        own if security.get("privileged") or "NET_BROADCAST" in own
        else [*own, "NET_BROADCAST"])


def test_on_the_cluster_role_adds_token_reviews_and_events_and_nothing_else(tmp_path):
    assert granted(render(values_file(tmp_path, ON))) == \
        (set(AGENT_CALLS) - UNINSTALL_CALLS) | {TOKEN_REVIEW, EVENTS}


def test_the_webhook_sends_pods_where_the_agent_listens_with_its_audience(tmp_path):
    objs = render(values_file(tmp_path, {
        "extraArgs": {"iam-role-key": "example.com/role"},
        "containerCredentials": {"enabled": True, "audience": "sts.example.com",
                                 "webhook": {"enabled": True}}}))
    cfg = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in cc_args(objs)}
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    args = webhook_cli.parse_args(deployment["spec"]["template"]["spec"]["containers"][0][
        "args"][1:])
    assert args.audience == cfg["--container-credentials-audience"] == "sts.example.com"
    assert args.iam_role_key == "example.com/role"
    assert "--iam-role-key=example.com/role" in container(objs)["args"]
    # The injected URI's host and port (80, implied by http://) are one the agent listens on.
    assert args.full_uri == "http://169.254.170.23/v1/credentials"
    assert "169.254.170.23:80" in cfg["--container-credentials-addr"].split(",")


def test_ipv6_only_pods_are_sent_to_the_ipv6_address(tmp_path):
    objs = render(values_file(tmp_path, {"containerCredentials": {
        "enabled": True, "webhook": {"enabled": True, "uriFamily": "ipv6"}}}))
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    args = webhook_cli.parse_args(deployment["spec"]["template"]["spec"]["containers"][0][
        "args"][1:])
    assert args.full_uri == "http://[fd00:ec2::23]/v1/credentials"
    assert "[fd00:ec2::23]:80" in cc_args(objs)[0].split("=", 1)[1].split(",")


def test_rbac_off_says_what_the_service_account_needs(tmp_path):
    text = notes(tmp_path, values_file(tmp_path, {"rbac": {"create": False}, **ON}))
    assert "and create on tokenreviews.authentication.k8s.io and on events" in text
    assert "Container credentials: the agents serve http://169.254.170.23/v1/credentials" \
        in text
    other = tmp_path / "rbac-alone"
    other.mkdir()
    assert "tokenreviews" not in notes(other, values_file(other, {"rbac": {"create": False}}))


WEBHOOK = {"containerCredentials": {"enabled": True, "webhook": {"enabled": True}}}
NO_SA_OPT_IN = {"containerCredentials": {"enabled": True, "webhook": {
    "enabled": True, "serviceAccountOptIn": False}}}


def webhook_pod(objs: list[dict]) -> dict:
    return next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]


def test_the_webhook_reads_service_accounts_by_default_with_get_alone(tmp_path):
    objs = render(values_file(tmp_path, WEBHOOK))
    pod = webhook_pod(objs)
    args = webhook_cli.parse_args(pod["containers"][0]["args"][1:])
    assert args.service_account_opt_in is True
    assert args.kubeconfig == ""                                   # in-cluster
    assert "automountServiceAccountToken" not in pod               # it needs its token
    (account,) = [o for o in objs if o["kind"] == "ServiceAccount"
                  and o["metadata"]["name"] == pod["serviceAccountName"]]
    assert account["metadata"]["namespace"] == NAMESPACE
    assert granted(objs, webhook_role=True) == {("", "serviceaccounts", "get")}
    (binding,) = [o for o in objs if o["kind"] == "ClusterRoleBinding"
                  and o["metadata"]["name"].endswith("-webhook")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": binding["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod[
        "serviceAccountName"], "namespace": NAMESPACE}]
    # The agent's own role gains nothing from it.
    assert granted(objs) == (set(AGENT_CALLS) - UNINSTALL_CALLS) | {TOKEN_REVIEW, EVENTS}


def test_the_api_servers_call_outlasts_the_webhooks_service_account_read(tmp_path):
    from kiamfast.webhook import accounts
    config = next(o for o in render(values_file(tmp_path, WEBHOOK))
                  if o["kind"] == "MutatingWebhookConfiguration")
    assert config["webhooks"][0]["timeoutSeconds"] > accounts.READ_TIMEOUT + 1


def test_without_the_service_account_opt_in_the_webhook_calls_no_api(tmp_path):
    objs = render(values_file(tmp_path, NO_SA_OPT_IN))
    pod = webhook_pod(objs)
    assert webhook_cli.parse_args(pod["containers"][0]["args"][1:]).service_account_opt_in is False
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod
    assert not [o for o in objs if o["metadata"]["name"].endswith("-webhook")
                and o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]


def test_the_webhooks_extra_env_is_its_containers_env_alone(tmp_path):
    """Where pods cannot reach the `kubernetes` Service (no kube-proxy), the user points the
    webhook's in-cluster client at the API server: the kubelet test tier does so."""
    assert "env" not in webhook_pod(render(values_file(tmp_path, WEBHOOK)))["containers"][0]
    objs = render(values_file(tmp_path, {"containerCredentials": {
        "enabled": True, "webhook": {"enabled": True, "extraEnv": {
            "KUBERNETES_SERVICE_PORT": 6443, "KUBERNETES_SERVICE_HOST": "10.0.0.10"}}}}))
    assert webhook_pod(objs)["containers"][0]["env"] == [
        {"name": "KUBERNETES_SERVICE_HOST", "value": "10.0.0.10"},
        {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"}]
    assert not {"KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"} & {
        e["name"] for e in container(objs)["env"]}                 # not the agent's


def test_with_rbac_off_the_webhook_runs_as_the_given_account_and_the_chart_grants_nothing(
        tmp_path):
    objs = render(values_file(tmp_path, {**WEBHOOK, "rbac": {
        "create": False, "serviceAccountName": "kiam-sa"}}))
    assert webhook_pod(objs)["serviceAccountName"] == "kiam-sa"
    assert not [o for o in objs if o["kind"] in ("ServiceAccount", "ClusterRole",
                                                  "ClusterRoleBinding")]


def test_notes_say_how_to_opt_in_and_what_rbac_off_needs(tmp_path):
    text = " ".join(notes(tmp_path, values_file(tmp_path, {**WEBHOOK, "rbac": {
        "create": False}})).split())
    assert 'kiamfast.io/container-credentials="true" on itself or on its ServiceAccount ' \
           '(the pod\'s own annotations win; "false" on a pod opts it out)' in text
    assert "the injection webhook runs as it too and needs get on serviceaccounts" in text
    other = tmp_path / "no-sa"
    other.mkdir()
    text = notes(other, values_file(other, {**NO_SA_OPT_IN, "rbac": {"create": False}}))
    assert "ServiceAccount (the pod" not in text and "serviceaccounts" not in text


REFUSED = [
    ({"containerCredentials": {"webhook": {"enabled": True}}},
     "containerCredentials.webhook.enabled needs containerCredentials.enabled: injected pods "
     "would send their SDK to 169.254.170.23, which no agent would serve"),
    ({"extraArgs": {"container-credentials-addr": "169.254.170.23:80"}},
     "extraArgs.container-credentials-addr: the chart sets --container-credentials-addr "
     "from its own value (containerCredentials.enabled and containerCredentials.ipv6)"),
    ({**ON, "extraArgs": {"container-credentials-audience": "sts.example.com"}},
     "extraArgs.container-credentials-audience: the chart sets "
     "--container-credentials-audience from its own value (containerCredentials.audience)"),
    ({"containerCredentials": {"enabled": True, "ipv6": False, "webhook": {
        "enabled": True, "uriFamily": "ipv6"}}},
     "containerCredentials.webhook.uriFamily ipv6 needs containerCredentials.ipv6"),
    ({"containerCredentials": {"enabled": True, "webhook": {"uriFamily": "IPv6"}}},
     "containerCredentials.webhook.uriFamily IPv6: ipv4 (http://169.254.170.23) or ipv6"),
    ({"containerCredentials": {"enabled": True, "audience": ""}},
     "containerCredentials.audience: empty: a projected token without an audience is one "
     "for the API server itself"),
    ({"containerCredentials": {"enabled": True, "webhook": {
        "enabled": True, "tokenExpirationSeconds": 599}}},
     "containerCredentials.webhook.tokenExpirationSeconds 599: at least 600"),
    ({"containerCredentials": {"enabled": True, "webhook": {
        "enabled": True, "serviceAccountOptIn": "false"}}},
     # values.schema.json's (a string such as "false" would read as on)
     "at '/containerCredentials/webhook/serviceAccountOptIn': got string, want boolean"),
    ({"containerCredentials": {"enabled": True, "webhook": {
        "enabled": True, "certManager": {"enabled": True, "issuerRef": "my-ca"}}}},
     "at '/containerCredentials/webhook/certManager/issuerRef': got string, want object"),
    ({"containerCredentials": {"enabled": True, "webhook": {
        "enabled": True, "certManager": {"enabled": True, "issuerRef": {"kind": "Issuer"}}}}},
     "containerCredentials.webhook.certManager.issuerRef: {} (the chart makes its own CA"),
    ({"containerCredentials": {"enabled": True, "webhook": {
        "enabled": True, "extraEnv": {"HTTPS_PROXY": {"host": "proxy"}}}}},
     "at '/containerCredentials/webhook/extraEnv/HTTPS_PROXY': got object, want boolean or "
     "number or string"),
    ({"containerCredentials": {"enabled": True, "webhook": {
        "enabled": True, "extraEnv": ["HTTPS_PROXY=http://proxy:3128"]}}},
     "at '/containerCredentials/webhook/extraEnv': got array, want object"),
    ({"extraEnv": {"NO_PROXY": ["169.254.169.254"]}},
     "at '/extraEnv/NO_PROXY': got array, want boolean or number or string"),
]


@pytest.mark.parametrize("values, message", REFUSED, ids=[m[:48] for _, m in REFUSED])
def test_values_that_would_disagree_or_strand_pods_fail_the_render(tmp_path, values,
                                                                    message):
    assert message in render_error(tmp_path, values)


def test_on_lints_clean(tmp_path):
    result = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, "-f",
                  str(values_file(tmp_path, {"containerCredentials": {
                      "enabled": True, "webhook": {"enabled": True}}})))
    assert result.returncode == 0, result.stdout + result.stderr


# containerCredentials as the chart's values.yaml first had it (the webhook alone).
FIRST_SHAPE = {"webhook": ("enabled", "replicas", "port", "tokenExpirationSeconds",
                           "namespaceSelector", "resources")}


def chart_with_first_values(tmp_path) -> object:
    """A copy of the chart whose values.yaml lacks every containerCredentials key added
    since its first shape: what `helm upgrade --reuse-values` renders with for a release
    installed then (helm keeps the installed chart's values.yaml; the new defaults are not
    read)."""
    import shutil
    import yaml
    chart = tmp_path / "chart-first-values"
    shutil.copytree(CHART, chart)
    values = yaml.safe_load((chart / "values.yaml").read_text())
    cc = values["containerCredentials"]
    values["containerCredentials"] = {
        "webhook": {k: cc["webhook"][k] for k in FIRST_SHAPE["webhook"]}}
    (chart / "values.yaml").write_text(yaml.safe_dump(values))
    return chart


def essentials(objs: list[dict]) -> dict:
    """What a render decides, without what is generated anew each time (certificates)."""
    out = {"kinds": sorted((o["kind"], o["metadata"]["name"]) for o in objs),
           "agent": container(objs)["args"], "rules": sorted(granted(objs))}
    if any(o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("-webhook")
           for o in objs):
        out["webhook_rules"] = sorted(granted(objs, webhook_role=True))
    for o in objs:
        if o["kind"] == "Deployment":
            out["webhook"] = o["spec"]["template"]["spec"]["containers"][0]["args"]
        if o["kind"] == "MutatingWebhookConfiguration":
            out["annotations"] = o["metadata"].get("annotations")
    return out


@pytest.mark.parametrize("values", [{}, {"containerCredentials": {"enabled": True}},
                                    {"containerCredentials": {"enabled": True, "webhook": {
                                        "enabled": True}}},
                                    {"containerCredentials": {"enabled": True, "webhook": {
                                        "enabled": True, "certManager": {"enabled": True}}}},
                                    NO_SA_OPT_IN],
                         ids=["off", "on", "webhook", "cert-manager", "no-sa-opt-in"])
def test_an_upgrade_reusing_an_older_releases_values_renders_as_a_new_install(tmp_path,
                                                                              values):
    older = chart_with_first_values(tmp_path)
    given = values_file(tmp_path, values)
    assert essentials(render(given, chart=older)) == essentials(render(given))
