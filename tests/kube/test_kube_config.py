"""kiamfast.kube.config: kube2iam's precedence, every kubeconfig form the agent accepts, and
one line naming the flag or file for every configuration it cannot use."""
from __future__ import annotations

import base64
import os
import ssl

import pytest
import yaml

from kiamfast.kube import credentials as creds
from kiamfast.kube.cluster import NO_CLUSTER
from kiamfast.kube.config import load_config
from kiamfast.kube.errors import ConfigError

NO_ENV: dict[str, str] = {}


def config_error(**kw) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(**{"environ": NO_ENV, **kw})
    text = str(e.value)
    assert "\n" not in text and text, text
    return text


def kubeconfig(tmp_path, *, cluster=None, user=None, context=None, name="kc",
               current="test", **extra):
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": current,
           "clusters": [{"name": "c", "cluster": {"server": "https://10.0.0.1:6443",
                                                  **(cluster or {})}}],
           "users": [{"name": "u", "user": user or {"token": "tok"}}],
           "contexts": [{"name": "test", "context": context or {"cluster": "c", "user": "u"}}],
           **extra}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.fixture
def sa_dir(tmp_path, pki):
    d = tmp_path / "serviceaccount"
    d.mkdir()
    (d / "token").write_text("sa-token\n")
    (d / "ca.crt").write_bytes(pki["ca"].read_bytes())
    return d


IN_CLUSTER = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


# ---- precedence -------------------------------------------------------------------------------

def test_nothing_configured_is_one_line_naming_the_flags():
    assert config_error() == NO_CLUSTER
    assert "--kubeconfig" in NO_CLUSTER and "--api-server with --api-token" in NO_CLUSTER


def test_api_server_without_token_says_it_needs_one():
    assert config_error(api_server="https://k8s:6443") == (
        NO_CLUSTER + " (--api-server is used only together with --api-token)")
    assert config_error(api_token="t").endswith(
        "(--api-token is used only together with --api-server)")


def test_api_server_with_token_uses_both_and_the_system_roots():
    cfg = load_config(api_server="https://k8s.example:6443/", api_token="abc", environ=NO_ENV)
    assert (cfg.scheme, cfg.host, cfg.port, cfg.base_path) == ("https", "k8s.example", 6443, "")
    assert cfg.credentials.authorization() == "Bearer abc"
    assert cfg.verify and cfg.ssl is not None and cfg.ssl.verify_mode == ssl.CERT_REQUIRED
    assert cfg.origin == "--api-server"
    # Go's rest.Config takes a bare host:port as https, as kube2iam passes it on.
    assert load_config(api_server="k8s:443", api_token="a", environ=NO_ENV).server == \
        "https://k8s:443"


def test_insecure_turns_verification_off():
    cfg = load_config(api_server="https://k8s:6443", api_token="abc", insecure=True,
                      environ=NO_ENV)
    assert not cfg.verify and cfg.ssl.verify_mode == ssl.CERT_NONE
    assert cfg.ssl.minimum_version == ssl.TLSVersion.TLSv1_2


def test_kubeconfig_wins_over_api_server_and_in_cluster(tmp_path, sa_dir):
    path = kubeconfig(tmp_path)
    cfg = load_config(kubeconfig=path, api_server="https://other:1", api_token="x",
                      service_account_dir=str(sa_dir), environ=IN_CLUSTER)
    assert cfg.host == "10.0.0.1" and cfg.credentials.authorization() == "Bearer tok"
    assert cfg.origin == f"--kubeconfig={path}"


def test_api_server_wins_over_in_cluster(sa_dir):
    cfg = load_config(api_server="https://k8s:6443", api_token="abc",
                      service_account_dir=str(sa_dir), environ=IN_CLUSTER)
    assert cfg.host == "k8s"


# ---- in-cluster -------------------------------------------------------------------------------

def test_in_cluster_reads_the_service_account(sa_dir, pki):
    cfg = load_config(service_account_dir=str(sa_dir), environ=IN_CLUSTER)
    assert cfg.server == "https://10.96.0.1:443" and cfg.origin == "in-cluster"
    assert cfg.ca_file == str(sa_dir / "ca.crt")
    assert isinstance(cfg.credentials, creds.TokenFile)
    assert cfg.credentials.authorization() == "Bearer sa-token"


def test_in_cluster_ipv6_service_host_is_bracketed(sa_dir):
    cfg = load_config(service_account_dir=str(sa_dir), environ={
        "KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"})
    assert cfg.server == "https://[fd00::1]:443" and cfg.host == "fd00::1"
    assert cfg.host_header == "[fd00::1]"


def test_in_cluster_without_a_token_names_the_file(sa_dir):
    os.unlink(sa_dir / "token")
    text = config_error(service_account_dir=str(sa_dir), environ=IN_CLUSTER)
    assert text == ("in-cluster configuration (KUBERNETES_SERVICE_HOST is set): "
                    f"{sa_dir}/token: no such file")


def test_in_cluster_with_an_empty_token_or_no_ca_names_the_file(sa_dir):
    (sa_dir / "token").write_text("")
    assert config_error(service_account_dir=str(sa_dir), environ=IN_CLUSTER).endswith(
        f"{sa_dir}/token: the file is empty")
    (sa_dir / "token").write_text("t")
    os.unlink(sa_dir / "ca.crt")
    assert config_error(service_account_dir=str(sa_dir), environ=IN_CLUSTER).endswith(
        f"{sa_dir}/ca.crt: no such file")


# ---- kubeconfig: files that cannot be used ----------------------------------------------------

def test_missing_kubeconfig_names_the_flag_and_file(tmp_path):
    path = tmp_path / "nope"
    assert config_error(kubeconfig=str(path)) == f"--kubeconfig={path}: no such file"
    assert config_error(kubeconfig=str(tmp_path)) == \
        f"--kubeconfig={tmp_path}: a directory, not a file"


def test_kubeconfig_that_does_not_parse_gives_the_line(tmp_path):
    path = tmp_path / "kc"
    path.write_text("apiVersion: v1\nclusters:\n  - name: c\n    cluster: [unclosed\n")
    text = config_error(kubeconfig=str(path))
    assert text.startswith(f"--kubeconfig={path}: does not parse (line ")


def test_a_yaml_file_that_is_no_kubeconfig(tmp_path):
    path = tmp_path / "kc"
    for content in ("just a string\n", "- a\n- list\n", "kind: Pod\n"):
        path.write_text(content)
        assert config_error(kubeconfig=str(path)) == \
            f"--kubeconfig={path}: not a kubeconfig (no clusters or contexts)"


def test_context_problems_name_the_context(tmp_path):
    assert config_error(kubeconfig=kubeconfig(tmp_path, current="")).endswith(
        ": no current-context (name one with kubectl config use-context)")
    assert config_error(kubeconfig=kubeconfig(tmp_path, current="gone")).endswith(
        ": no context 'gone'")
    path = kubeconfig(tmp_path, context={"user": "u"})
    assert config_error(kubeconfig=path) == f"--kubeconfig={path}: context 'test' names no cluster"
    path = kubeconfig(tmp_path, context={"cluster": "x", "user": "u"})
    assert config_error(kubeconfig=path) == \
        f"--kubeconfig={path}: context 'test': cluster 'x' is not in clusters"
    path = kubeconfig(tmp_path, context={"cluster": "c", "user": "who"})
    assert config_error(kubeconfig=path) == \
        f"--kubeconfig={path}: context 'test': user 'who' is not in users"


def test_a_named_context_overrides_current_context(tmp_path):
    path = kubeconfig(tmp_path, current="gone")
    assert load_config(kubeconfig=path, context="test", environ=NO_ENV).host == "10.0.0.1"


def test_cluster_without_server(tmp_path):
    path = kubeconfig(tmp_path, cluster={"server": ""})
    assert config_error(kubeconfig=path).endswith(": cluster 'c' has no server")
    path = kubeconfig(tmp_path, cluster={"server": "ftp://x"})
    assert config_error(kubeconfig=path).endswith("server 'ftp://x' is not an https:// URL")


# ---- kubeconfig: clusters ---------------------------------------------------------------------

def test_certificate_authority_is_resolved_against_the_kubeconfig_dir(tmp_path, pki):
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "ca.pem").write_bytes(pki["ca"].read_bytes())
    path = kubeconfig(tmp_path, cluster={"certificate-authority": "certs/ca.pem"})
    cfg = load_config(kubeconfig=path, environ=NO_ENV)
    assert cfg.ca_file == str(tmp_path / "certs" / "ca.pem")
    assert cfg.ssl.verify_mode == ssl.CERT_REQUIRED and cfg.ssl.check_hostname
    assert len(cfg.ssl.get_ca_certs()) == 1     # only that CA, not the system's


def test_missing_certificate_authority_names_the_field_and_file(tmp_path):
    path = kubeconfig(tmp_path, cluster={"certificate-authority": "ca.pem"})
    assert config_error(kubeconfig=path) == (
        f"--kubeconfig={path}: context 'test': cluster 'c': certificate-authority "
        f"{tmp_path}/ca.pem: no such file")


def test_certificate_authority_data(tmp_path, pki):
    data = base64.b64encode(pki["ca"].read_bytes()).decode()
    cfg = load_config(kubeconfig=kubeconfig(tmp_path, cluster={
        "certificate-authority-data": data}), environ=NO_ENV)
    assert cfg.ca_data == pki["ca"].read_bytes() and len(cfg.ssl.get_ca_certs()) == 1
    path = kubeconfig(tmp_path, cluster={"certificate-authority-data": "not base64!"})
    assert config_error(kubeconfig=path).endswith("certificate-authority-data: not base64")
    garbage = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    path = kubeconfig(tmp_path, cluster={"certificate-authority-data": garbage.decode()})
    assert "the certificate authority or client certificate cannot be loaded" in \
        config_error(kubeconfig=path)


def test_insecure_skip_tls_verify_and_tls_server_name(tmp_path, pki):
    cfg = load_config(kubeconfig=kubeconfig(tmp_path, cluster={
        "insecure-skip-tls-verify": True}), environ=NO_ENV)
    assert not cfg.verify and cfg.ssl.verify_mode == ssl.CERT_NONE
    path = kubeconfig(tmp_path, cluster={"insecure-skip-tls-verify": True,
                                         "certificate-authority": str(pki["ca"])})
    assert config_error(kubeconfig=path).endswith(
        "has both a certificate authority and insecure-skip-tls-verify: keep one")
    cfg = load_config(kubeconfig=kubeconfig(tmp_path, cluster={
        "tls-server-name": "kubernetes.default"}), environ=NO_ENV)
    assert cfg.tls_server_name == "kubernetes.default"


def test_server_path_prefix_is_kept(tmp_path):
    cfg = load_config(kubeconfig=kubeconfig(tmp_path, cluster={
        "server": "https://rancher.example/k8s/clusters/c-1/"}), environ=NO_ENV)
    assert (cfg.host, cfg.port, cfg.base_path) == ("rancher.example", 443,
                                                   "/k8s/clusters/c-1")


# ---- kubeconfig: users --------------------------------------------------------------------------

def test_token_file_is_relative_to_the_kubeconfig(tmp_path):
    (tmp_path / "tok").write_text("from-file\n")
    cfg = load_config(kubeconfig=kubeconfig(tmp_path, user={"tokenFile": "tok"}),
                      environ=NO_ENV)
    assert isinstance(cfg.credentials, creds.TokenFile)
    assert cfg.credentials.authorization() == "Bearer from-file"
    path = kubeconfig(tmp_path, user={"tokenFile": "missing"})
    assert config_error(kubeconfig=path) == (
        f"--kubeconfig={path}: context 'test': user 'u': tokenFile missing: no such file")


def test_basic_auth(tmp_path):
    cfg = load_config(kubeconfig=kubeconfig(tmp_path, user={"username": "ann",
                                                            "password": "pw"}),
                      environ=NO_ENV)
    assert cfg.credentials.authorization() == "Basic " + base64.b64encode(b"ann:pw").decode()
    path = kubeconfig(tmp_path, user={"username": "ann"})
    assert config_error(kubeconfig=path).endswith(
        "user 'u' has a username without a password, or a password without a username")


def test_two_ways_to_authenticate_are_refused(tmp_path):
    path = kubeconfig(tmp_path, user={"token": "t", "username": "a", "password": "b"})
    assert config_error(kubeconfig=path).endswith(
        "user 'u' has more than one way to authenticate (token, username/password): keep one")


def test_a_user_with_nothing_sends_no_authorization(tmp_path):
    cfg = load_config(kubeconfig=kubeconfig(tmp_path, context={"cluster": "c"}),
                      environ=NO_ENV)
    assert cfg.credentials.authorization() is None


def test_client_certificate_files_and_data(tmp_path, pki):
    cfg = load_config(kubeconfig=kubeconfig(tmp_path, user={
        "client-certificate": str(pki["cert"]), "client-key": str(pki["key"])}),
        environ=NO_ENV)
    assert cfg.client_cert_files == (str(pki["cert"]), str(pki["key"]))
    cfg = load_config(kubeconfig=kubeconfig(tmp_path, user={
        "client-certificate-data": base64.b64encode(pki["cert"].read_bytes()).decode(),
        "client-key-data": base64.b64encode(pki["key"].read_bytes()).decode()}),
        environ=NO_ENV)
    assert cfg.client_cert_data == (pki["cert"].read_bytes(), pki["key"].read_bytes())
    path = kubeconfig(tmp_path, user={"client-certificate": str(pki["cert"])})
    assert config_error(kubeconfig=path).endswith(
        "user 'u' has a client certificate without its key, or a key without a certificate")
    # A key that does not belong to the certificate fails at load, not at the first call.
    other = tmp_path / "other.key"
    other.write_bytes(pki["sa_key"].read_bytes())
    path = kubeconfig(tmp_path, user={"client-certificate": str(pki["cert"]),
                                      "client-key": str(other)})
    assert "cannot be loaded" in config_error(kubeconfig=path)


def test_auth_provider_is_refused_with_what_to_use(tmp_path):
    path = kubeconfig(tmp_path, user={"auth-provider": {"name": "gcp", "config": {}}})
    assert config_error(kubeconfig=path) == (
        f"--kubeconfig={path}: context 'test': user 'u' uses auth-provider 'gcp', which "
        "kiamfast does not support: use an exec plugin or a token")


def test_exec_plugin_problems_found_at_load(tmp_path):
    path = kubeconfig(tmp_path, user={"exec": {
        "apiVersion": "client.authentication.k8s.io/v1beta1", "command": "no-such-aws",
        "args": ["eks", "get-token"], "installHint": "Install the AWS CLI:\n  pip install awscli"}})
    assert config_error(kubeconfig=path).endswith(
        "user 'u': exec command 'no-such-aws' not found "
        "(Install the AWS CLI: pip install awscli)")
    path = kubeconfig(tmp_path, user={"exec": {
        "apiVersion": "client.authentication.k8s.io/v1alpha1", "command": "true"}})
    assert "exec apiVersion 'client.authentication.k8s.io/v1alpha1' is not supported" in \
        config_error(kubeconfig=path)
    path = kubeconfig(tmp_path, user={"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": "true",
        "interactiveMode": "Always"}})
    assert config_error(kubeconfig=path).endswith(
        "exec interactiveMode Always needs a terminal, which the agent has not")


def test_exec_command_with_a_slash_is_relative_to_the_kubeconfig(tmp_path):
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "get-token"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    cfg = load_config(kubeconfig=kubeconfig(tmp_path, user={"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": "./bin/get-token",
        "args": ["a", 1], "env": [{"name": "X", "value": "y"}], "provideClusterInfo": True}},
        cluster={"tls-server-name": "k"}), environ=NO_ENV)
    plugin = cfg.credentials
    assert isinstance(plugin, creds.ExecPlugin)
    assert plugin.argv == [str(tmp_path / "bin" / "get-token"), "a", "1"]
    assert plugin.env == {"X": "y"}
    assert plugin.cluster == {"server": "https://10.0.0.1:6443", "tls-server-name": "k"}


# ---- proxies ----------------------------------------------------------------------------------

def test_https_proxy_and_no_proxy():
    def proxy(server, **env):
        return load_config(api_server=server, api_token="t", environ=env).proxy
    assert proxy("https://k8s.example:6443", HTTPS_PROXY="http://proxy:3128") == ("proxy", 3128)
    assert proxy("https://k8s.example:6443", https_proxy="proxy") == ("proxy", 80)
    for no_proxy in ("*", "k8s.example", ".example", "example", "k8s.example:6443"):
        assert proxy("https://k8s.example:6443", HTTPS_PROXY="http://p:1",
                     NO_PROXY=no_proxy) is None, no_proxy
    assert proxy("https://k8s.example:6443", HTTPS_PROXY="http://p:1",
                 NO_PROXY="k8s.example:443") == ("p", 1)
    assert proxy("https://10.1.2.3", HTTPS_PROXY="http://p:1", no_proxy="10.0.0.0/8") is None
    assert proxy("https://[fd00::1]:443", HTTPS_PROXY="http://p:1", NO_PROXY="fd00::/8") is None
    # Loopback never goes through a proxy (Go's rule); HTTP_PROXY is not for TLS servers.
    assert proxy("https://127.0.0.1:6443", HTTPS_PROXY="http://p:1") is None
    assert proxy("https://localhost:6443", HTTPS_PROXY="http://p:1") is None
    assert proxy("https://k8s.example", HTTP_PROXY="http://p:1") is None


def test_proxy_credentials_and_unsupported_schemes(tmp_path):
    cfg = load_config(api_server="https://k8s", api_token="t",
                      environ={"HTTPS_PROXY": "http://us%40er:p%3Aw@proxy:8080"})
    assert cfg.proxy == ("proxy", 8080)
    assert cfg.proxy_authorization == "Basic " + base64.b64encode(b"us@er:p:w").decode()
    assert config_error(api_server="https://k8s", api_token="t",
                        environ={"HTTPS_PROXY": "socks5://p:1080"}) == \
        "HTTPS_PROXY=socks5://p:1080: only http:// proxies are supported"
    path = kubeconfig(tmp_path, cluster={"proxy-url": "http://kc-proxy:3128"})
    assert load_config(kubeconfig=path, environ={"NO_PROXY": "*"}).proxy == ("kc-proxy", 3128)
