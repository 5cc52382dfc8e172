"""A pod's own token, answered 200 on 169.254.170.23 and [fd00:ec2::23] through the node.

The e2e tier's node (tests/e2e: a node network namespace, a pod namespace behind its bridge,
moto's STS and the fake IMDS inside) with the agent started as the chart starts it
(``--container-credentials-addr=169.254.170.23:80,[fd00:ec2::23]:80
--container-credentials-link=kiamfast0``) and pointed at the session's real kube-apiserver
through a TCP proxy listening inside the node namespace. The pod is a real API object bound
to the node; its token comes from the TokenRequest API, bound to the pod, with the agent's
audience, in a file, as the kubelet's projected volume would hold it.

What a user checks: botocore's default chain in the pod, given only the two variables, gets
the pod's own role (STS says so) from either address, and never asks IMDS; with IPv6 off on
the node, a pod whose variables name the IPv6 address (not listened on) keeps its role on
the metadata path.
"""
from __future__ import annotations

import secrets
import socket

import pytest
import yaml
from podid import create_pod, create_service_account, pod_token

pytestmark = [pytest.mark.kube_apiserver, pytest.mark.root]

POD_IP = "10.77.0.10"


@pytest.fixture
def node(cluster, peers, tmp_path, test_failed):
    import netns
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    from e2e_cluster import Node, reporting_on_failure
    from tcp_proxy import TcpProxy
    with reporting_on_failure(Node(tmp_path / "node", taint=False), test_failed) as n:
        listener = netns.call_in_netns(n.net.ns,
                                       lambda: socket.create_server(("127.0.0.1", 0)))
        proxy = TcpProxy(target_port=cluster.apiserver.port, listener=listener)
        token = yaml.safe_load(peers.kubeconfig.read_text())["users"][0]["user"]["token"]
        n.real_kubeconfig = cluster.kubeconfig_for(token, name=f"link-{n.name}",
                                                   server=proxy.url)
        cluster.admin.create_node(n.name)
        try:
            yield n
        finally:
            proxy.close()


def test_botocore_gets_its_pods_role_from_both_addresses(cluster, node):
    from e2e_cluster import Pod, assert_own_role
    from test_e2e_container_credentials_link import FLAGS, give_ipv6

    admin = cluster.admin
    ns = f"link-{secrets.token_hex(3)}"
    admin.create_namespace(ns)
    create_service_account(admin, ns, "app")
    pod = Pod(node, node.net.add_pod(POD_IP), name="app", namespace=ns, role="link-role")
    give_ipv6(node, pod)
    uid = create_pod(admin, ns, "app", node=node.name, sa="app", ip=POD_IP, role=pod.role)
    token_file = node.workdir / "token"
    token_file.write_text(pod_token(admin, ns, "app", "app", uid))

    node.start_agent(extra_args=[*FLAGS, f"--kubeconfig={node.real_kubeconfig}"])
    for host in ("169.254.170.23", "[fd00:ec2::23]"):
        creds = pod.botocore_credentials(
            AWS_CONTAINER_CREDENTIALS_FULL_URI=f"http://{host}/v1/credentials",
            AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE=str(token_file))
        assert creds.get("method") == "container-role", creds
        assert_own_role(pod, creds)
    assert node.imds_credential_requests() == []


def test_with_ipv6_off_a_pod_sent_to_the_ipv6_address_keeps_the_metadata_path(cluster, node):
    """IPv6 disabled on the node: the agent skips the [fd00:ec2::23] listener, so a pod
    whose variables name it (a webhook with uriFamily=ipv6) would get nothing by token and,
    if judged token-only, nothing by address either.  Token-only is judged from the sockets
    the agent holds: that pod keeps its role on the metadata path; a pod sent to the IPv4
    listener is refused there, as it asks by token."""
    import subprocess

    from e2e_cluster import Pod, assert_own_role
    from test_e2e_container_credentials_link import FLAGS

    subprocess.run(["ip", "netns", "exec", node.name, "sysctl", "-qw",
                    "net.ipv6.conf.all.disable_ipv6=1",
                    "net.ipv6.conf.default.disable_ipv6=1"], check=True, timeout=20)
    admin = cluster.admin
    ns = f"link6-{secrets.token_hex(3)}"
    admin.create_namespace(ns)
    create_service_account(admin, ns, "app")
    token_file = "/var/run/secrets/kiamfast.io/container-credentials/token"
    pods = {}
    for name, ip, host in (("to-v6", "10.77.0.11", "[fd00:ec2::23]"),
                           ("to-v4", "10.77.0.12", "169.254.170.23")):
        pod = Pod(node, node.net.add_pod(ip), name=name, namespace=ns, role="link-role")
        create_pod(admin, ns, name, node=node.name, sa="app", ip=ip, role=pod.role, env={
            "AWS_CONTAINER_CREDENTIALS_FULL_URI": f"http://{host}/v1/credentials",
            "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE": token_file})
        pods[name] = pod

    agent = node.start_agent(extra_args=[*FLAGS, f"--kubeconfig={node.real_kubeconfig}"])
    assert sum("not serving container credentials on [fd00:ec2::23]" in line
               for line in agent.log().splitlines()) == 1, agent.log()
    # The SDK's default chain without the variables: IMDS by address, through the DNAT.
    creds = pods["to-v6"].botocore_credentials()
    assert creds.get("method") == "iam-role", creds
    assert_own_role(pods["to-v6"], creds)
    assert pods["to-v4"].fetch().status == 404

