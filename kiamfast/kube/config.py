"""Where the API server is and how to prove who we are: kube2iam's precedence.

``load_config`` takes the agent's flags: ``--kubeconfig`` wins, then ``--api-server`` with
``--api-token``, then the pod's ServiceAccount (in-cluster); ``--insecure`` turns off
verification of the server's certificate. Every way this can fail raises ``ConfigError``
with one line naming the flag or file that fixes it: a configuration error is not an
outage and must not be retried.

A kubeconfig is read once (YAML, parsed with PyYAML's C loader when present): its context
(``current-context`` unless one is named), the cluster's ``server``, ``certificate-
authority(-data)``, ``insecure-skip-tls-verify``, ``tls-server-name`` and ``proxy-url``, the
user's ``token``, ``tokenFile``, ``client-certificate(-data)``/``client-key(-data)``,
``username``/``password`` and ``exec`` plugins; ``auth-provider`` is refused (its
providers were removed from client-go; use an exec plugin). Relative paths are resolved
against the kubeconfig's directory, as kubectl does.

Proxies, as client-go does for https servers: a cluster's ``proxy-url``, else
``HTTPS_PROXY``/``https_proxy`` unless ``NO_PROXY``/``no_proxy`` matches (``*``, a host or
domain suffix, an IP, a CIDR, host:port); loopback addresses and ``localhost`` are never
proxied. Only ``http://`` proxies (CONNECT) are supported; another scheme is a ConfigError.
``HTTP_PROXY`` is not used: the API server is always reached over TLS here, except the
tests' plain-http emulator, which is never proxied.
"""
from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping
from urllib.parse import unquote, urlsplit

from kiamfast.kube import credentials as creds
from kiamfast.kube.cluster import missing_cluster
from kiamfast.kube.errors import ConfigError
from kiamfast.kube.tls import ssl_context

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class ClientConfig:
    """Everything the client needs to reach and authenticate to one API server."""
    server: str                           # the URL as configured, without a trailing /
    scheme: str                           # "https" (or "http": the tests' emulator)
    host: str                             # to connect to (no brackets around IPv6)
    port: int
    base_path: str                        # a path prefix of the server URL ("" mostly)
    credentials: creds.Credentials
    origin: str                           # what configured it: a flag or "in-cluster"
    verify: bool = True
    ca_file: str | None = None
    ca_data: bytes | None = None          # PEM
    tls_server_name: str | None = None    # the name the certificate is checked against
    client_cert_files: tuple[str, str] | None = None
    client_cert_data: tuple[bytes, bytes] | None = None   # PEM certificate, PEM key
    proxy: tuple[str, int] | None = None  # an http:// proxy to CONNECT through
    proxy_authorization: str | None = None
    ssl: ssl.SSLContext | None = field(default=None, repr=False, compare=False)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == (443 if self.scheme == "https" else 80) else \
            f"{host}:{self.port}"


def load_config(*, kubeconfig: str = "", api_server: str = "", api_token: str = "",
                insecure: bool = False, context: str = "",
                service_account_dir: str = SERVICE_ACCOUNT_DIR,
                environ: Mapping[str, str] | None = None,
                token_check_interval: float = 5.0,
                clock: Callable[[], float] = time.monotonic) -> ClientConfig:
    """The client configuration from the agent's flags (see the module docstring)."""
    env = os.environ if environ is None else environ
    if kubeconfig:
        return _from_kubeconfig(kubeconfig, context=context, insecure=insecure, environ=env)
    if api_server and api_token:
        return _build(server=api_server, what="--api-server", origin="--api-server",
                      credentials=creds.StaticToken(api_token), verify=not insecure,
                      environ=env)
    problem = missing_cluster(kubeconfig=kubeconfig, api_server=api_server,
                              api_token=api_token, environ=env)
    if problem:
        raise ConfigError(problem)
    host, port = env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]
    token_path = os.path.join(service_account_dir, "token")
    ca_path = os.path.join(service_account_dir, "ca.crt")
    what = "in-cluster configuration (KUBERNETES_SERVICE_HOST is set)"
    token = creds.TokenFile(token_path, what=f"{what}: {token_path}",
                            check_interval=token_check_interval, clock=clock)
    if not os.path.isfile(ca_path):
        raise ConfigError(f"{what}: {ca_path}: no such file")
    host_part = f"[{host}]" if ":" in host else host
    return _build(server=f"https://{host_part}:{port}", what=what, origin="in-cluster",
                  credentials=token, verify=not insecure, ca_file=ca_path, environ=env)


def _build(*, server: str, what: str, origin: str, credentials: creds.Credentials,
           verify: bool, environ: Mapping[str, str], ca_file: str | None = None,
           ca_data: bytes | None = None, tls_server_name: str | None = None,
           client_cert_files: tuple[str, str] | None = None,
           client_cert_data: tuple[bytes, bytes] | None = None,
           proxy_url: str = "") -> ClientConfig:
    if "://" not in server:
        server = "https://" + server          # Go's rest.Config takes host:port as https
    url = urlsplit(server.rstrip("/"))
    try:
        port = url.port
    except ValueError:
        raise ConfigError(f"{what}: server {server!r} has a bad port") from None
    if url.scheme not in ("https", "http") or not url.hostname:
        raise ConfigError(f"{what}: server {server!r} is not an https:// URL")
    proxy, proxy_auth = None, None
    if url.scheme == "https":
        proxy, proxy_auth = _proxy(url.hostname, port or 443, proxy_url, what, environ)
    config = ClientConfig(
        server=server.rstrip("/"), scheme=url.scheme, host=url.hostname,
        port=port or (443 if url.scheme == "https" else 80), base_path=url.path.rstrip("/"),
        credentials=credentials, origin=origin, verify=verify,
        ca_file=ca_file if verify else None, ca_data=ca_data if verify else None,
        tls_server_name=tls_server_name, client_cert_files=client_cert_files,
        client_cert_data=client_cert_data, proxy=proxy, proxy_authorization=proxy_auth)
    if config.scheme == "https":
        try:
            context = ssl_context(config)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"{what}: the certificate authority or client certificate "
                              f"cannot be loaded ({_ssl_reason(e)})") from None
        object.__setattr__(config, "ssl", context)
    return config


def _ssl_reason(e: BaseException) -> str:
    return getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e)


# ---- kubeconfig ---------------------------------------------------------------------------------

def _from_kubeconfig(path: str, *, context: str, insecure: bool,
                     environ: Mapping[str, str]) -> ClientConfig:
    what = f"--kubeconfig={path}"
    doc = _read_kubeconfig(path, what)
    base = os.path.dirname(os.path.abspath(path))
    name = context or doc.get("current-context") or ""
    if not name:
        raise ConfigError(f"{what}: no current-context (name one with kubectl config "
                          "use-context)")
    ctx = _named(doc, "contexts", "context", name, what)
    if ctx is None:
        raise ConfigError(f"{what}: no context {name!r}")
    what = f"{what}: context {name!r}"
    cluster_name = ctx.get("cluster") or ""
    cluster = _named(doc, "clusters", "cluster", cluster_name, what) if cluster_name else None
    if cluster is None:
        raise ConfigError(f"{what} names no cluster" if not cluster_name else
                          f"{what}: cluster {cluster_name!r} is not in clusters")
    user_name = ctx.get("user") or ""
    user: dict[str, Any] = {}
    if user_name:
        found = _named(doc, "users", "user", user_name, what)
        if found is None:
            raise ConfigError(f"{what}: user {user_name!r} is not in users")
        user = found
    server = cluster.get("server") or ""
    if not isinstance(server, str) or not server:
        raise ConfigError(f"{what}: cluster {cluster_name!r} has no server")
    skip_verify = bool(cluster.get("insecure-skip-tls-verify"))
    ca_file = _path(cluster.get("certificate-authority"), base)
    ca_data = _b64(cluster.get("certificate-authority-data"),
                   f"{what}: cluster {cluster_name!r}: certificate-authority-data")
    if skip_verify and (ca_file or ca_data):
        raise ConfigError(f"{what}: cluster {cluster_name!r} has both a certificate "
                          "authority and insecure-skip-tls-verify: keep one")
    if ca_file and not ca_data:
        _must_exist(ca_file, f"{what}: cluster {cluster_name!r}: certificate-authority")
    who = f"{what}: user {user_name!r}"
    cert_files, cert_data = _client_cert(user, base, who)
    exec_cluster = None
    if isinstance(user.get("exec"), dict) and user["exec"].get("provideClusterInfo"):
        exec_cluster = {k: v for k, v in {
            "server": server, "tls-server-name": cluster.get("tls-server-name"),
            "insecure-skip-tls-verify": skip_verify or None,
            "certificate-authority-data": base64.b64encode(
                ca_data or _read(ca_file or "", f"{what}: certificate-authority")).decode()
            if ca_data or ca_file else None,
            "proxy-url": cluster.get("proxy-url")}.items() if v}
    return _build(server=server, what=f"{what}: cluster {cluster_name!r}",
                  origin=f"--kubeconfig={path}",
                  credentials=_credentials(user, base, who, exec_cluster),
                  verify=not (insecure or skip_verify),
                  ca_file=None if ca_data else ca_file, ca_data=ca_data,
                  tls_server_name=cluster.get("tls-server-name") or None,
                  client_cert_files=cert_files, client_cert_data=cert_data,
                  proxy_url=cluster.get("proxy-url") or "", environ=environ)


def _read_kubeconfig(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{what}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{what}: a directory, not a file") from None
    except OSError as e:
        raise ConfigError(f"{what}: cannot read it ({e.strerror})") from None
    import yaml   # only here: in-cluster agents never pay for it
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        doc = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or "not YAML"
        raise ConfigError(f"{what}: does not parse{where}: {problem}") from None
    if not isinstance(doc, dict) or not any(k in doc for k in ("clusters", "contexts")):
        raise ConfigError(f"{what}: not a kubeconfig (no clusters or contexts)")
    return doc


def _named(doc: dict[str, Any], section: str, key: str, name: str,
           what: str) -> dict[str, Any] | None:
    entries = doc.get(section) or []
    if not isinstance(entries, list):
        raise ConfigError(f"{what}: {section} is not a list")
    for entry in entries:
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(key) or {}
            if not isinstance(value, dict):
                raise ConfigError(f"{what}: {section} entry {name!r} has no {key} mapping")
            return value
    return None


def _credentials(user: dict[str, Any], base: str, who: str,
                 exec_cluster: dict[str, Any] | None) -> creds.Credentials:
    if user.get("auth-provider"):
        provider = (user["auth-provider"] or {}).get("name", "?")
        raise ConfigError(f"{who} uses auth-provider {provider!r}, which kiamfast does not "
                          "support: use an exec plugin or a token")
    methods = [m for m, present in (
        ("token", user.get("token") or user.get("tokenFile")),
        ("username/password", user.get("username") or user.get("password")),
        ("exec", user.get("exec"))) if present]
    if len(methods) > 1:
        raise ConfigError(f"{who} has more than one way to authenticate "
                          f"({', '.join(methods)}): keep one")
    if user.get("tokenFile"):
        return creds.TokenFile(_path(user["tokenFile"], base) or "",
                               what=f"{who}: tokenFile {user['tokenFile']}")
    if user.get("token"):
        return creds.StaticToken(str(user["token"]))
    if user.get("username") or user.get("password"):
        if not (user.get("username") and user.get("password")):
            raise ConfigError(f"{who} has a username without a password, or a password "
                              "without a username")
        return creds.BasicAuth(str(user["username"]), str(user["password"]))
    if user.get("exec"):
        return _exec_plugin(user["exec"], base, who, exec_cluster)
    return creds.Credentials()


def _exec_plugin(spec: Any, base: str, who: str,
                 cluster: dict[str, Any] | None) -> creds.ExecPlugin:
    if not isinstance(spec, dict) or not spec.get("command"):
        raise ConfigError(f"{who}: exec has no command")
    version = spec.get("apiVersion") or ""
    if version not in creds.EXEC_API_VERSIONS:
        raise ConfigError(f"{who}: exec apiVersion {version!r} is not supported "
                          f"(use {' or '.join(creds.EXEC_API_VERSIONS)})")
    if spec.get("interactiveMode") == "Always":
        raise ConfigError(f"{who}: exec interactiveMode Always needs a terminal, which the "
                          "agent has not")
    env = {}
    for item in spec.get("env") or []:
        if not isinstance(item, dict) or not item.get("name"):
            raise ConfigError(f"{who}: exec env entries need a name and a value")
        env[str(item["name"])] = str(item.get("value", ""))
    command = str(spec["command"])
    if "/" in command and not os.path.isabs(command):
        command = os.path.normpath(os.path.join(base, command))   # as client-go does
    import shutil   # here: it brings bz2 and lzma, which nothing else needs
    search_path = env.get("PATH", os.environ.get("PATH", os.defpath))
    if shutil.which(command, path=search_path) is None:
        hint = f" ({' '.join(str(spec['installHint']).split())})" if spec.get(
            "installHint") else ""
        raise ConfigError(f"{who}: exec command {spec['command']!r} not found{hint}")
    args = spec.get("args") or []
    if not isinstance(args, list):
        raise ConfigError(f"{who}: exec args is not a list")
    return creds.ExecPlugin(command=command, args=[str(a) for a in args], env=env,
                            api_version=version, what=who, cluster=cluster)


def _client_cert(user: dict[str, Any], base: str, who: str
                 ) -> tuple[tuple[str, str] | None, tuple[bytes, bytes] | None]:
    cert_data = _b64(user.get("client-certificate-data"), f"{who}: client-certificate-data")
    key_data = _b64(user.get("client-key-data"), f"{who}: client-key-data")
    cert_file = _path(user.get("client-certificate"), base)
    key_file = _path(user.get("client-key"), base)
    has_cert, has_key = bool(cert_data or cert_file), bool(key_data or key_file)
    if has_cert != has_key:
        raise ConfigError(f"{who} has a client certificate without its key, or a key "
                          "without a certificate")
    if not has_cert:
        return None, None
    if cert_file and key_file:        # files are read at each connection: they may rotate
        _must_exist(cert_file, f"{who}: client-certificate")
        _must_exist(key_file, f"{who}: client-key")
        return (cert_file, key_file), None
    cert = cert_data or _read(cert_file or "", f"{who}: client-certificate")
    key = key_data or _read(key_file or "", f"{who}: client-key")
    return None, (cert, key)


def _path(value: Any, base: str) -> str | None:
    if not value:
        return None
    value = os.path.expanduser(str(value))
    return value if os.path.isabs(value) else os.path.normpath(os.path.join(base, value))


def _b64(value: Any, what: str) -> bytes | None:
    if not value:
        return None
    try:
        return base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{what}: not base64") from None


def _must_exist(path: str, what: str) -> None:
    if not os.path.exists(path):
        raise ConfigError(f"{what} {path}: no such file")
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path}: not a file")


def _read(path: str, what: str) -> bytes:
    """The file's bytes; ``what`` names the field that gave ``path``."""
    _must_exist(path, what)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read it ({e.strerror})") from None


# ---- proxies ------------------------------------------------------------------------------------

def _proxy(host: str, port: int, proxy_url: str, what: str, environ: Mapping[str, str]
           ) -> tuple[tuple[str, int] | None, str | None]:
    """The http:// proxy to reach ``host:port`` through, if any (see the module docstring)."""
    source = f"{what}: proxy-url"
    if not proxy_url:
        for name in ("HTTPS_PROXY", "https_proxy"):
            if environ.get(name):
                proxy_url, source = environ[name], name
                break
        if not proxy_url or _bypass(host, port, environ):
            return None, None
    if "://" not in proxy_url:
        proxy_url = "http://" + proxy_url
    url = urlsplit(proxy_url)
    if url.scheme != "http" or not url.hostname:
        raise ConfigError(f"{source}={proxy_url}: only http:// proxies are supported")
    auth = None
    if url.username is not None:
        pair = f"{unquote(url.username)}:{unquote(url.password or '')}".encode()
        auth = "Basic " + base64.b64encode(pair).decode()
    try:
        return (url.hostname, url.port or 80), auth
    except ValueError:
        raise ConfigError(f"{source}={proxy_url}: bad port") from None


def _bypass(host: str, port: int, environ: Mapping[str, str]) -> bool:
    """Go's httpproxy rules: loopback and localhost never go through a proxy; NO_PROXY."""
    host = host.lower().rstrip(".")
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if host == "localhost" or (ip is not None and ip.is_loopback):
        return True
    no_proxy = environ.get("NO_PROXY") or environ.get("no_proxy") or ""
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if not entry:
            continue
        if entry == "*":
            return True
        if "/" in entry:
            try:
                if ip is not None and ip in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        entry_port = None
        if entry.count(":") == 1 or entry.startswith("["):
            entry, _, port_text = entry.rpartition(":")
            entry_port = int(port_text) if port_text.isdigit() else None
        entry = entry.strip("[]")
        if entry_port is not None and entry_port != port:
            continue
        if entry.startswith("*."):
            entry = entry[1:]
        if host == entry or (entry.startswith(".") and host.endswith(entry)) or (
                not entry.startswith(".") and host.endswith("." + entry)):
            return True
    return False
