"""Every setting of the agent, in one frozen value.

kiamfast is a drop-in replacement for kube2iam 0.15, so its settings start from kube2iam's
command-line flags: same names (snake_case here), same defaults, same meaning where kube2iam's
meaning is sound. Our own settings follow them. The single table :data:`FLAGS` describes every
flag once (name, type, default, help, whether kube2iam has it); the command-line parser
(:mod:`kiamfast.cli`), ``--help``, the README's configuration reference and the defaults of
:class:`Config` are all derived from it, so they can never disagree.

:class:`Config` is what the rest of the program receives. Building one validates and
normalises it (a trailing ``/`` on the base role ARN, the session duration derived from
kube2iam's ``--iam-role-session-ttl``, ...), and a
setting that makes no sense raises :class:`ConfigError` naming the flag, so a misconfigured
DaemonSet fails at once with one clear line instead of serving wrong credentials later.

This module must never touch the network, the file system or the environment: it is pure
data. Environment fallbacks (``HOST_IP``, ``NODE_NAME``, ``AWS_ENDPOINT_URL_STS``) are applied
by the parser, which passes them in explicitly.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = [
    "BASE_ARN_REGEXP",
    "Config",
    "ConfigError",
    "DEFAULT_STARTUP_TAINT",
    "DurationError",
    "FLAGS",
    "FLAGS_BY_NAME",
    "Flag",
    "LOG_LEVELS",
    "format_go_duration",
    "parse_go_duration",
    "split_host_port",
]


class ConfigError(ValueError):
    """A setting is invalid. ``flag`` is the flag's name without dashes (e.g. ``app-port``)."""

    def __init__(self, flag: str, message: str, *, value: Any = None) -> None:
        self.flag = flag
        self.value = value
        self.message = message
        if value is None:
            text = f"invalid flag --{flag}: {message}"
        else:
            text = f'invalid value "{value}" for flag --{flag}: {message}'
        super().__init__(text)


class DurationError(ValueError):
    """A string is not a Go duration (time.ParseDuration syntax)."""


# ---------------------------------------------------------------------------------------------
# Go durations
# ---------------------------------------------------------------------------------------------

_UNIT_NS = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # MICRO SIGN, accepted by Go
    "\u03bcs": 1_000,  # GREEK SMALL LETTER MU, accepted by Go
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60 * 1_000_000_000,
    "h": 3600 * 1_000_000_000,
}
_MAX_NS = (1 << 63) - 1


def parse_go_duration(text: str) -> float:
    """Parse a Go duration (``15m``, ``1h30m``, ``500ms``, ``1.5h``, ``300us``, ``0``) to seconds.

    Follows Go's ``time.ParseDuration``: an optional sign, then one or more decimal numbers
    each followed by a unit (ns, us/µs, ms, s, m, h); ``0`` alone needs no unit. The value is
    computed in integer nanoseconds like Go (fractions below a nanosecond are dropped) and
    must fit in an int64. Raises :class:`DurationError`.
    """
    if not isinstance(text, str):
        raise DurationError(f"not a string: {text!r}")
    s = text
    negative = False
    if s[:1] in ("-", "+"):
        negative = s[0] == "-"
        s = s[1:]
    if s == "0":
        return 0.0
    if s == "":
        raise DurationError(f'invalid duration "{text}"')
    total = 0
    while s:
        i = 0
        while i < len(s) and s[i].isascii() and s[i].isdigit():
            i += 1
        whole = s[:i]
        s = s[i:]
        frac = ""
        if s[:1] == ".":
            s = s[1:]
            i = 0
            while i < len(s) and s[i].isascii() and s[i].isdigit():
                i += 1
            frac = s[:i]
            s = s[i:]
            if not whole and not frac:
                raise DurationError(f'invalid duration "{text}"')
        elif not whole:
            raise DurationError(f'invalid duration "{text}"')
        i = 0
        while i < len(s) and s[i] != "." and not (s[i].isascii() and s[i].isdigit()):
            i += 1
        unit = s[:i]
        s = s[i:]
        if unit == "":
            raise DurationError(f'missing unit in duration "{text}"')
        scale = _UNIT_NS.get(unit)
        if scale is None:
            raise DurationError(f'unknown unit "{unit}" in duration "{text}"')
        value = int(whole or "0") * scale
        if frac:
            value += int(frac) * scale // (10 ** len(frac))
        total += value
        if total > _MAX_NS + (1 if negative else 0):
            raise DurationError(f'invalid duration "{text}"')
    if negative:
        total = -total
    return total / 1e9


def format_go_duration(seconds: float) -> str:
    """Format seconds the way Go's ``time.Duration.String`` does (``15m0s``, ``350ms``, ``0s``)."""
    ns = round(seconds * 1e9)
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    ns = abs(ns)
    if ns < 1_000_000_000:
        for unit, scale in (("ms", 1_000_000), ("\u00b5s", 1_000), ("ns", 1)):
            if ns >= scale:
                return sign + _fixed(ns, scale) + unit
    hours, rest = divmod(ns, 3600 * 1_000_000_000)
    minutes, rest = divmod(rest, 60 * 1_000_000_000)
    out = sign
    if hours:
        out += f"{hours}h"
    if hours or minutes:
        out += f"{minutes}m"
    return out + _fixed(rest, 1_000_000_000) + "s"


def _fixed(ns: int, scale: int) -> str:
    whole, frac = divmod(ns, scale)
    if not frac:
        return str(whole)
    digits = str(frac).rjust(len(str(scale)) - 1, "0").rstrip("0")
    return f"{whole}.{digits}"


# ---------------------------------------------------------------------------------------------
# The flag table
# ---------------------------------------------------------------------------------------------

#: kube2iam's base ARN check (iam/arn.go), with Go's ASCII-only ``\w`` and ``\d``.
BASE_ARN_REGEXP = re.compile(r"^arn:(\w|-)*:iam::\d+:role\/?(\w+|-|\/|\.)*$", re.ASCII)

#: logrus level names (case-insensitive) -> canonical name.
LOG_LEVELS = {
    "panic": "panic",
    "fatal": "fatal",
    "error": "error",
    "warn": "warn",
    "warning": "warn",
    "info": "info",
    "debug": "debug",
    "trace": "trace",
}

#: Taint keys are qualified names: optional DNS-subdomain prefix and "/", then a name.
_QUALIFIED_NAME = re.compile(
    r"^(?:(?=.{1,253}/)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(?=.{1,63}$)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
    re.ASCII,
)
_INTERFACE = re.compile(r"^!?[^\s/!:]{1,15}$")
_LINK_NAME = re.compile(r"^[^\s/:]{1,15}$")      # IFNAMSIZ 16 with its NUL

DEFAULT_STARTUP_TAINT = "kiamfast.io/agent-not-ready"


@dataclass(frozen=True)
class Flag:
    """One command-line flag.

    ``kind`` is one of ``str``, ``int``, ``float``, ``bool``, ``duration`` (Go syntax, stored
    as float seconds) or ``choice`` (one of ``choices``, compared case-insensitively and
    stored lower-case). ``default`` is the parsed value; ``shown_default`` overrides how it is
    displayed when the real default is derived from other settings.
    """

    name: str
    kind: str
    default: Any
    help: str
    kube2iam: bool = False
    choices: tuple[str, ...] = ()
    shown_default: str | None = None
    env: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        return self.name.replace("-", "_")

    def display_default(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        if self.kind == "duration":
            return format_go_duration(self.default)
        if self.kind == "bool":
            return "true" if self.default else "false"
        if self.kind in ("str", "choice"):
            return f'"{self.default}"'
        return str(self.default)


def _f(name: str, kind: str, default: Any, help: str, **kw: Any) -> Flag:
    return Flag(name, kind, default, help, **kw)


FLAGS: tuple[Flag, ...] = (
    # ---- kube2iam 0.15 flags, same names and defaults --------------------------------------
    _f("kubeconfig", "str", "", "Path to a kubeconfig file; when set it wins over every other "
       "way of reaching the API server (otherwise in-cluster configuration).", kube2iam=True),
    _f("api-server", "str", "", "Kubernetes API server URL; used only together with "
       "--api-token.", kube2iam=True),
    _f("api-token", "str", "", "Bearer token for --api-server.", kube2iam=True),
    _f("app-port", "int", 8181, "HTTP port the agent listens on (the DNAT target port).",
       kube2iam=True),
    _f("metrics-port", "int", 8181, "Port for /metrics; when equal to --app-port, /metrics is "
       "served on the main listener, otherwise on a second listener serving only /metrics.",
       kube2iam=True),
    _f("base-role-arn", "str", "", "Prefix for role names that are not full ARNs, e.g. "
       "arn:aws:iam::123456789012:role/ (a trailing / is added if missing). Must match "
       "kube2iam's pattern " + BASE_ARN_REGEXP.pattern + ".", kube2iam=True),
    _f("debug", "bool", False, "Serve /debug/store (the IP -> role/namespace view).",
       kube2iam=True),
    _f("default-role", "str", "", "Role for pods without a role annotation (relative to "
       "--base-role-arn unless a full ARN).", kube2iam=True),
    _f("iam-role-key", "str", "iam.amazonaws.com/role", "Pod annotation key holding the role.",
       kube2iam=True),
    _f("iam-external-id", "str", "iam.amazonaws.com/external-id", "Pod annotation key holding "
       "the STS ExternalId.", kube2iam=True),
    _f("iam-role-session-ttl", "duration", 900.0, "kube2iam's credential cache TTL. kiamfast "
       "refreshes ahead instead of caching for a TTL; when this flag is given explicitly the "
       "STS session duration is 2x this value, as in kube2iam (see --session-duration).",
       kube2iam=True),
    _f("iam-role-error-ttl", "duration", 0.0, "How long a failed AssumeRole is remembered "
       "before STS is asked again (0 = not cached beyond the rate limiter's backoff).",
       kube2iam=True),
    _f("insecure", "bool", False, "Skip TLS verification of the Kubernetes API server.",
       kube2iam=True),
    _f("metadata-addr", "str", "169.254.169.254", "Address (host[:port]) of the real instance "
       "metadata service: upstream of the passthrough, and (its host part) the -d of the DNAT "
       "rule.", kube2iam=True),
    _f("iptables", "bool", False, "Install the DNAT rule that sends pods' metadata traffic "
       "(tcp to --metadata-addr:80 arriving on --host-interface) to --host-ip:--app-port. "
       "Needs --host-ip.", kube2iam=True),
    _f("auto-discover-base-arn", "bool", False, "Derive --base-role-arn from the instance's "
       "own role (metadata iam/info). Cannot be combined with --base-role-arn.", kube2iam=True),
    _f("auto-discover-default-role", "bool", False, "Use the instance's own role as "
       "--default-role (and derive --base-role-arn from it). Cannot be combined with "
       "--default-role.", kube2iam=True),
    _f("host-interface", "str", "docker0", "-i of the DNAT rule: the interface pods' traffic "
       "arrives on (docker0, cali+, cni0, eni+ for the EKS VPC CNI, lxc+ for Cilium, ...). A "
       "trailing + is a wildcard; a leading ! (kiam's !eth0) means every interface but this "
       "one. Must exist unless it has a + or a !.", kube2iam=True),
    _f("namespace-restrictions", "bool", False, "Only allow roles listed in the pod's "
       "namespace annotation (--namespace-key).", kube2iam=True),
    _f("namespace-restriction-format", "choice", "glob", "How --namespace-key entries match "
       "role ARNs: glob (only * is special) or regexp (unanchored, as in kube2iam).",
       kube2iam=True, choices=("glob", "regexp")),
    _f("namespace-key", "str", "iam.amazonaws.com/allowed-roles", "Namespace annotation key "
       "holding a JSON array of allowed roles.", kube2iam=True),
    _f("cache-resync-period", "duration", 1800.0, "Full relist period of the pod and "
       "namespace watches (0 = never).", kube2iam=True),
    _f("resolve-duplicate-cache-ips", "bool", False, "When two known pods claim one IP, ask "
       "the API server which one is running. kiamfast resolves IP reuse by itself; accepted "
       "for compatibility.", kube2iam=True),
    _f("host-ip", "str", "", "The node's IP: DNAT target and /healthz hostIP. Falls back to "
       "$HOST_IP.", kube2iam=True, env=("HOST_IP",)),
    _f("node", "str", "", "Only watch pods scheduled on this node (spec.nodeName). Falls back "
       "to $NODE_NAME.", kube2iam=True, env=("NODE_NAME",)),
    _f("backoff-max-interval", "duration", 1.0, "kube2iam's lookup retry interval cap. "
       "kiamfast waits for the pod instead of retrying (see --wait-budget); accepted for "
       "compatibility.", kube2iam=True),
    _f("backoff-max-elapsed-time", "duration", 2.0, "kube2iam's lookup retry budget. kiamfast "
       "waits at most --wait-budget instead; accepted for compatibility.", kube2iam=True),
    _f("log-format", "choice", "text", "Log format: text or json.", kube2iam=True,
       choices=("text", "json")),
    _f("log-level", "choice", "info", "Log level: panic, fatal, error, warn, info, debug or "
       "trace.", kube2iam=True, choices=tuple(LOG_LEVELS)),
    _f("use-regional-sts-endpoint", "bool", False, "Accepted for compatibility; no effect "
       "(as in kube2iam 0.15). Use --sts-region / --sts-endpoint.", kube2iam=True),
    _f("verbose", "bool", False, "Log at debug level (overrides --log-level).", kube2iam=True),
    _f("version", "bool", False, "Print the version and exit.", kube2iam=True),
    # ---- kiamfast's own flags ------------------------------------------------------------
    _f("workers", "int", 1, "Number of HTTP worker processes, 1-64; they share the listening "
       "socket the supervisor binds once (no other process can bind --app-port beside it)."),
    _f("worker-realtime", "bool", False, "Run the workers at real-time priority (SCHED_RR, the "
       "lowest), each within 10% of a CPU (earned and spent every 100 ms), beyond which it runs at "
       "its fair share: "
       "credential requests are answered at once on a node whose CPUs are all busy. Needs "
       "CAP_SYS_NICE; without it the workers say so and stay at their fair share."),
    _f("wait-budget", "duration", 0.35, "How long a credential request may wait for an "
       "unknown pod or for pending credentials before the agent answers 503 (keep it under "
       "the SDKs' 1s metadata timeout)."),
    _f("passthrough-qps", "float", 10.0, "Per pod address and worker: sustained rate of "
       "requests passed through to the node's metadata service; beyond it (and the burst) "
       "the pod gets 429, so one pod cannot make the node's metadata service throttle the "
       "agent and the other pods."),
    _f("passthrough-burst", "int", 40, "Per pod address and worker: passthrough requests "
       "allowed at once after a quiet spell."),
    _f("passthrough-concurrency", "int", 4, "Per pod address and worker: passthrough "
       "requests upstream at the same time."),
    _f("imdsv2", "choice", "optional", "optional: token-less (IMDSv1) credential requests "
       "are answered; required: they get 401, like an instance with HttpTokens=required.",
       choices=("optional", "required")),
    _f("token-key-file", "str", "/dev/shm/kiamfast-token-key", "File holding the HMAC key "
       "that signs IMDSv2 tokens, created (random, mode 0600) if missing, so tokens survive "
       "agent restarts; an existing file is reused only if it is a regular file of the "
       "agent's user with mode 0600, otherwise replaced; \"\" = a new random key at every "
       "start, kept in memory only."),
    _f("cri-endpoint", "str", "auto", "Container runtime (CRI v1) socket the agent asks which "
       "pod each sandbox is and where its network namespace is: the runtime knows a pod's "
       "sandbox the moment it is made and when it stopped, seconds before the API server "
       "(the kernel proves which sandbox holds an address: --address-proof). auto = the "
       "first of unix:///run/containerd/containerd.sock, "
       "unix:///var/run/containerd/containerd.sock, unix:///var/run/crio/crio.sock that "
       "exists, looked up again until one does (the API server's view meanwhile); \"\" or "
       "none = the API server's view only."),
    _f("address-proof", "choice", "netns", "What proves that a sandbox holds an address "
       "before the address is answered with its pod's role (with a container runtime): "
       "netns = the kernel shows the address configured in that sandbox's network "
       "namespace now and in no other (needs the runtime's network namespace files, "
       "/var/run/netns, mounted into the agent, and the NET_ADMIN and NET_BROADCAST "
       "capabilities: the chart gives all three); runtime = a READY sandbox is taken to hold "
       "the addresses the runtime reports, true of containerd's order of a stop and false "
       "of CRI-O's (which frees a stopping sandbox's address while it is still READY), and "
       "nothing is answered while the runtime cannot be asked: for pods without network "
       "namespaces of their own, as `kiamfast demo`'s.", choices=("netns", "runtime")),
    _f("kubelet-url", "str", "", "No effect (a warning at start): accepted so that a manifest "
       "written for kiamfast's development builds, which asked the kubelet's /pods, still "
       "starts. The kubelet's /pods only mirrors the API server for ordinary pods; the "
       "container runtime (--cri-endpoint) knows a pod's address first."),
    _f("kubelet-insecure", "bool", False, "No effect (a warning at start), as --kubelet-url."),
    _f("sts-endpoint", "str", "", "STS endpoint URL; falls back to $AWS_ENDPOINT_URL_STS, "
       "then botocore's regional endpoint.", env=("AWS_ENDPOINT_URL_STS",)),
    _f("sts-region", "str", "", "Region of the STS client (\"\" = botocore's default chain: "
       "$AWS_REGION, $AWS_DEFAULT_REGION, config file)."),
    _f("sts-qps", "float", 5.0, "Sustained rate limit of STS calls per second."),
    _f("sts-burst", "int", 100, "Burst size of the STS rate limit: the calls a node may "
       "make at once, such as one per role when it starts with its pods already asking."),
    _f("sts-account-qps", "float", 0.0, "The fleet's share of the account's STS budget "
       "(calls/s; AWS allows 600 per account and Region, shared by every STS caller). "
       "Each node may always send --sts-account-qps / --sts-fleet-nodes calls/s; above "
       "that it goes up to --sts-qps while STS accepts, and throttling halves its rate, "
       "never below that share. 0 = no fleet budget (throttling may halve down to "
       "--sts-qps / 16)."),
    _f("sts-fleet-nodes", "int", 0, "Number of nodes (agents) sharing --sts-account-qps; "
       "size it for the largest the cluster scales to. 0 = the cluster's node count, "
       "listed from the API every minute (needs list on nodes)."),
    _f("session-duration", "duration", 3600.0, "DurationSeconds of AssumeRole (15m-12h; "
       "sessions chained from an instance role are capped at 1h by AWS).",
       shown_default="1h0m0s, or 2x --iam-role-session-ttl when that is given"),
    _f("min-credential-lifetime", "duration", 900.0, "Never serve credentials with less than "
       "this left; they are refreshed before (SDKs misbehave below 15m)."),
    _f("session-name-policy", "choice", "node-role", "RoleSessionName: node-role = "
       "<node>-<role name> (one session per role and node); pod = <namespace>.<pod> (one "
       "session per pod, best CloudTrail attribution, more STS calls); kube2iam = "
       "<fnv32a of pod IP>-<role name> as kube2iam does.",
       choices=("node-role", "pod", "kube2iam")),
    _f("session-tags", "bool", False, "Pass session tags (pod namespace, name, "
       "service account, node; see --session-tag-keys) to AssumeRole; the role's trust "
       "policy must allow sts:TagSession."),
    _f("session-tag-keys", "choice", "kiamfast", "Tag keys of --session-tags: kiamfast = "
       "kiamfast-namespace, -pod, -serviceaccount, -node (one session per role and tag "
       "values); eks = EKS Pod Identity's kubernetes-namespace, -service-account, -pod-name, "
       "-pod-uid, so its policies work unchanged (one session per pod, named "
       "eks-<cluster>-<pod>-<uid>).", choices=("kiamfast", "eks")),
    _f("cluster-name", "str", "", "This cluster's name, sent with --session-tags as "
       "eks-cluster-name (eks keys) or kiamfast-cluster, and in EKS-style session names. "
       "\"\" = no cluster tag."),
    _f("node-startup-taint", "str", DEFAULT_STARTUP_TAINT, "Taint key removed from this "
       "node once the agent is ready (register nodes with it so no pod starts before the "
       "agent). \"\" disables."),
    _f("iptables-remove-on-exit", "bool", False, "Remove the DNAT rule on shutdown. By "
       "default it stays, so pods without an agent get a refused connection, never the "
       "node's role."),
    _f("iptables-backend", "choice", "auto", "iptables backend: auto (the one the node's "
       "kube-proxy uses, detected like kubernetes-sigs/iptables-wrappers), nft or legacy.",
       choices=("auto", "nft", "legacy")),
    _f("namespace-permitted-key", "str", "", "Namespace annotation key holding a regexp of "
       "permitted role ARNs, anchored (^...$), like kiam's iam.amazonaws.com/permitted; when "
       "set it is checked in addition to --namespace-restrictions, and a namespace without "
       "the annotation permits no role (as in kiam). \"\" disables."),
    _f("table-path", "str", "/dev/shm/kiamfast-table", "File on tmpfs holding the shared "
       "table between the control process and the workers. A restarted or upgraded agent "
       "adopts the one it finds (a regular file of the agent's user, mode 0600, the same "
       "layout) and keeps its credentials; the chart puts it in the hostPath stateDir."),
    _f("ready-prefetch-timeout", "duration", 10.0, "At startup, how long to wait for the "
       "credentials of this node's pods before reporting ready anyway."),
    _f("metadata-ipv6", "bool", False, "Also redirect the IPv6 metadata address "
       "fd00:ec2::254 (ip6tables; needs an IPv6 --host-ip or --host-ipv6)."),
    _f("host-ipv6", "str", "", "The node's IPv6 address, DNAT target of the IPv6 rule; "
       "falls back to an IPv6 --host-ip, then $HOST_IPV6, then the IPv6 entry of $HOST_IPS "
       "(downward API status.hostIPs).", env=("HOST_IPV6",)),
    _f("listen-host", "str", "", "Address to listen on (\"\" = all interfaces, IPv4 and "
       "IPv6)."),
    _f("container-credentials-addr", "str", "", "Preview: also serve the container-"
       "credentials protocol (AWS_CONTAINER_CREDENTIALS_FULL_URI, a projected service-"
       "account token as Authorization) at these comma-separated ip:port, e.g. "
       "169.254.170.23:80,[fd00:ec2::23]:80 (each address must be local to the node: see "
       "--container-credentials-link); \"\" = off. Needs --node (a token of another "
       "node's pod is refused) and RBAC to create tokenreviews."),
    _f("container-credentials-link", "str", "", "Before listening, make sure a dummy link "
       "of this name exists and holds each --container-credentials-addr address (/32, "
       "/128), adding what is missing; kept when the agent stops. An IPv6 address that "
       "cannot be added (IPv6 disabled) is skipped with a log line. Needs NET_ADMIN. \"\" "
       "= the agent does not manage addresses."),
    _f("container-credentials-audience", "str", "kiamfast.io/container-credentials",
       "Audience a container-credentials token must be issued for (the projected token "
       "volume's audience)."),
    # ---- handing the node over (docs/architecture.md, "Handing the node over") ------------
    _f("socket-keeper", "str", "", "Unix socket of the pod's socket keeper (a second "
       "container running `kiamfast keep-sockets --socket PATH`, PATH in an emptyDir both "
       "mount): the listening sockets are deposited there and taken back when this "
       "container restarts, so pods' connections wait in the backlog instead of being "
       "refused. \"\" = off."),
    _f("handover-socket", "str", "", "Unix socket (mode 0600, in a directory only root "
       "reaches, e.g. the stateDir /run/kiamfast) where this agent hands the node over to "
       "the next one: a new agent that finds --app-port taken and this socket live takes "
       "the listening sockets and the table over without a refused "
       "connection (surge upgrades and rollbacks). \"\" = off: a second agent stops at "
       "bind."),
    _f("handover-port", "int", 0, "Where --app-port is held by a process that cannot hand "
       "over (kube2iam, a kiamfast without --handover-socket): serve on this port, insert a "
       "DNAT rule to it ahead of the old one once ready, and move back to --app-port when "
       "the old process lets go of it. 0 = off: stop at bind."),
    _f("ready-file", "str", "", "A file (in the container's own file system, not the "
       "hostPath) that exists exactly while this agent's own control process is ready, for "
       "an exec readiness probe (`test -f`): on a port two agents share during a handover, "
       "an HTTP probe cannot tell which one answered. \"\" = off."),
    _f("iptables-backstop", "bool", False, "With --iptables: also reject (TCP reset) pods' "
       "connections to the metadata address that were not redirected, in the filter "
       "table's INPUT and FORWARD chains, so a pod never reaches the node's metadata "
       "service while the DNAT rule is missing (e.g. deleted by kube2iam's preStop hook). "
       "Kept on exit like the DNAT rule."),
    _f("iptables-check-interval", "duration", 0.0, "With --iptables: check this often that "
       "the DNAT rule (and the backstop) are still there and put back what is missing; "
       "with the nft backend a rule change is also noticed at once (netlink). 0 = install "
       "once at start."),
    _f("iptables-remove-on-uninstall", "bool", False, "With --iptables: when this agent's "
       "pod stops because the DaemonSet that owns it is deleted or being deleted (helm "
       "uninstall, kubectl delete), remove the DNAT rule and the backstop, so the node is "
       "left as it was before the agent; an upgrade, a restart, a crash or a deleted pod "
       "keeps them, and so does any stop where that cannot be known. Needs --pod-name and "
       "--pod-namespace, and RBAC get, list and watch on that DaemonSet."),
    _f("pod-name", "str", "", "This agent's own pod (the downward API's metadata.name), for "
       "--iptables-remove-on-uninstall. Falls back to $POD_NAME.", env=("POD_NAME",)),
    _f("pod-namespace", "str", "", "The namespace of this agent's pod (metadata.namespace). "
       "Falls back to $POD_NAMESPACE.", env=("POD_NAMESPACE",)),
)

FLAGS_BY_NAME: dict[str, Flag] = {f.name: f for f in FLAGS}


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

def _default(name: str) -> Any:
    return field(default=FLAGS_BY_NAME[name].default)


TAG_VALUE_MAX = 256
_TAG_PUNCT = frozenset("_.:/=+-@")


def tag_value_problem(value: str) -> str:
    """Why STS would refuse ``value`` as a session tag's value (at most 256 letters,
    separators, numbers and ``_.:/=+-@``), or "" when it takes it."""
    if len(value) > TAG_VALUE_MAX:
        return f"{len(value)} characters (at most {TAG_VALUE_MAX})"
    bad = sorted({ch for ch in value
                  if ch not in _TAG_PUNCT and unicodedata.category(ch)[0] not in "LZN"})
    return f"characters STS refuses: {''.join(bad)!r}" if bad else ""


@dataclass(frozen=True)
class Config:
    """All settings, validated and normalised. Durations are float seconds.

    Construct it directly in tests (``Config(node="n1", host_ip="10.0.0.1")``) or from the
    command line with :func:`kiamfast.cli.parse_args`. ``explicit`` holds the names of the
    flags the user gave (``{"iam-role-session-ttl", ...}``); it only matters for settings
    whose default depends on whether another flag was given.
    """

    # kube2iam flags
    kubeconfig: str = _default("kubeconfig")
    api_server: str = _default("api-server")
    api_token: str = _default("api-token")
    app_port: int = _default("app-port")
    metrics_port: int = _default("metrics-port")
    base_role_arn: str = _default("base-role-arn")
    debug: bool = _default("debug")
    default_role: str = _default("default-role")
    iam_role_key: str = _default("iam-role-key")
    iam_external_id: str = _default("iam-external-id")
    iam_role_session_ttl: float = _default("iam-role-session-ttl")
    iam_role_error_ttl: float = _default("iam-role-error-ttl")
    insecure: bool = _default("insecure")
    metadata_addr: str = _default("metadata-addr")
    iptables: bool = _default("iptables")
    auto_discover_base_arn: bool = _default("auto-discover-base-arn")
    auto_discover_default_role: bool = _default("auto-discover-default-role")
    host_interface: str = _default("host-interface")
    namespace_restrictions: bool = _default("namespace-restrictions")
    namespace_restriction_format: str = _default("namespace-restriction-format")
    namespace_key: str = _default("namespace-key")
    cache_resync_period: float = _default("cache-resync-period")
    resolve_duplicate_cache_ips: bool = _default("resolve-duplicate-cache-ips")
    host_ip: str = _default("host-ip")
    node: str = _default("node")
    backoff_max_interval: float = _default("backoff-max-interval")
    backoff_max_elapsed_time: float = _default("backoff-max-elapsed-time")
    log_format: str = _default("log-format")
    log_level: str = _default("log-level")
    use_regional_sts_endpoint: bool = _default("use-regional-sts-endpoint")
    verbose: bool = _default("verbose")
    version: bool = _default("version")
    # kiamfast flags
    workers: int = _default("workers")
    worker_realtime: bool = _default("worker-realtime")
    wait_budget: float = _default("wait-budget")
    passthrough_qps: float = _default("passthrough-qps")
    passthrough_burst: int = _default("passthrough-burst")
    passthrough_concurrency: int = _default("passthrough-concurrency")
    imdsv2: str = _default("imdsv2")
    token_key_file: str = _default("token-key-file")
    cri_endpoint: str = _default("cri-endpoint")
    address_proof: str = _default("address-proof")
    kubelet_url: str = _default("kubelet-url")
    kubelet_insecure: bool = _default("kubelet-insecure")
    sts_endpoint: str = _default("sts-endpoint")
    sts_region: str = _default("sts-region")
    sts_qps: float = _default("sts-qps")
    sts_burst: int = _default("sts-burst")
    sts_account_qps: float = _default("sts-account-qps")
    sts_fleet_nodes: int = _default("sts-fleet-nodes")
    session_duration: float | None = None  # None = 1h, or 2x an explicit session TTL
    min_credential_lifetime: float = _default("min-credential-lifetime")
    session_name_policy: str = _default("session-name-policy")
    session_tags: bool = _default("session-tags")
    session_tag_keys: str = _default("session-tag-keys")
    cluster_name: str = _default("cluster-name")
    node_startup_taint: str = _default("node-startup-taint")
    iptables_remove_on_exit: bool = _default("iptables-remove-on-exit")
    iptables_backend: str = _default("iptables-backend")
    namespace_permitted_key: str = _default("namespace-permitted-key")
    table_path: str = _default("table-path")
    ready_prefetch_timeout: float = _default("ready-prefetch-timeout")
    metadata_ipv6: bool = _default("metadata-ipv6")
    host_ipv6: str = _default("host-ipv6")
    listen_host: str = _default("listen-host")
    container_credentials_addr: str = _default("container-credentials-addr")
    container_credentials_link: str = _default("container-credentials-link")
    container_credentials_audience: str = _default("container-credentials-audience")
    socket_keeper: str = _default("socket-keeper")
    handover_socket: str = _default("handover-socket")
    handover_port: int = _default("handover-port")
    ready_file: str = _default("ready-file")
    iptables_backstop: bool = _default("iptables-backstop")
    iptables_check_interval: float = _default("iptables-check-interval")
    iptables_remove_on_uninstall: bool = _default("iptables-remove-on-uninstall")
    pod_name: str = _default("pod-name")
    pod_namespace: str = _default("pod-namespace")
    # bookkeeping
    explicit: frozenset[str] = frozenset()
    #: Fields whose value was derived from others (so replace() derives them again).
    derived: frozenset[str] = field(init=False, repr=False, compare=False,
                                    default=frozenset())

    def __post_init__(self) -> None:
        _normalise_and_validate(self)

    # ---- derived views -------------------------------------------------------------------
    @property
    def effective_log_level(self) -> str:
        """The logrus level name in force: ``debug`` when --verbose, else --log-level."""
        return "debug" if self.verbose else self.log_level

    @property
    def metadata_host(self) -> str:
        """The host part of --metadata-addr (the -d of the DNAT rule)."""
        return split_host_port(self.metadata_addr)[0]

    @property
    def metrics_on_app_port(self) -> bool:
        return self.metrics_port == self.app_port

    def replace(self, **changes: Any) -> "Config":
        """A copy with some fields changed, validated again; derived settings (
        session duration, IPv6 host address) are derived again unless given."""
        for name in self.derived:
            changes.setdefault(name, None if name != "host_ipv6" else "")
        return dataclasses.replace(self, **changes)


def split_host_port(addr: str) -> tuple[str, int | None]:
    """``"1.2.3.4:80"`` -> ("1.2.3.4", 80); ``"[fd00::1]:80"``; ``"1.2.3.4"`` -> (.., None)."""
    if addr.startswith("["):
        end = addr.find("]")
        if end < 0:
            raise ValueError(f"unclosed [ in {addr!r}")
        host, rest = addr[1:end], addr[end + 1:]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise ValueError(f"junk after ] in {addr!r}")
        return host, _port(rest[1:], addr)
    if addr.count(":") == 1:
        host, port = addr.split(":")
        return host, _port(port, addr)
    return addr, None


def _port(text: str, addr: str) -> int:
    if not text.isascii() or not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"bad port in {addr!r}")
    return int(text)


def _set(cfg: Config, name: str, value: Any) -> None:
    object.__setattr__(cfg, name, value)


def _ip(value: str, flag: str, *, version: int | None = None) -> ipaddress._BaseAddress:
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        why = "not an IP address"
        if value.startswith("$("):
            why += (f"; Kubernetes did not expand {value}: define {value[2:-1]} in the "
                    f"container's env")
        raise ConfigError(flag, why, value=value) from None
    if version is not None and ip.version != version:
        raise ConfigError(flag, f"not an IPv{version} address", value=value)
    return ip


def _url(value: str, flag: str) -> None:
    if not re.match(r"^https?://[^/\s]+", value):
        raise ConfigError(flag, "must be an http:// or https:// URL", value=value)


def container_credentials_addrs(value: str) -> list[tuple[str, int]]:
    """``"169.254.170.23:80,[fd00:ec2::23]:80"`` -> [(host, port), ...], each ip:port (IPv6
    in brackets: the listeners are bound before anything resolves names), none twice."""
    flag = "container-credentials-addr"
    addrs: list[tuple[str, int]] = []
    for addr in value.split(","):
        addr = addr.strip()
        if not addr:
            raise ConfigError(flag, "an empty entry in the list", value=value)
        try:
            host, port = split_host_port(addr)
        except ValueError as e:
            raise ConfigError(flag, str(e), value=addr) from None
        if port is None:
            raise ConfigError(flag, "needs a port (ip:port, [ipv6]:port)", value=addr)
        host = str(_ip(host, flag))
        if (host, port) in addrs:
            raise ConfigError(flag, "listed twice", value=addr)
        addrs.append((host, port))
    return addrs


def _container_credentials_link(c: Config) -> None:
    flag = "container-credentials-link"
    if not c.container_credentials_addr:
        raise ConfigError(flag, "needs --container-credentials-addr",
                          value=c.container_credentials_link)
    if not _LINK_NAME.match(c.container_credentials_link):
        raise ConfigError(flag, "not a link name (1-15 characters, no space, / or :)",
                          value=c.container_credentials_link)
    for host, _ in container_credentials_addrs(c.container_credentials_addr):
        if ipaddress.ip_address(host).is_unspecified:
            raise ConfigError(flag, f"cannot put {host} on a link: list the addresses to "
                              "serve in --container-credentials-addr",
                              value=c.container_credentials_link)


def _normalise_and_validate(c: Config) -> None:
    derived: set[str] = set()
    # Ports and counts.
    for name in ("app-port", "metrics-port"):
        port = getattr(c, name.replace("-", "_"))
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ConfigError(name, "must be a port number 1-65535", value=port)
    if c.handover_port and (not 0 < c.handover_port < 65536
                            or c.handover_port in (c.app_port, c.metrics_port)):
        raise ConfigError("handover-port", "must be 0 (off) or a port number 1-65535 other "
                          "than --app-port and --metrics-port", value=c.handover_port)
    if not 1 <= c.workers <= 64:
        raise ConfigError("workers", "must be between 1 and 64", value=c.workers)
    if not c.passthrough_qps > 0:
        raise ConfigError("passthrough-qps", "must be greater than 0", value=c.passthrough_qps)
    for name in ("passthrough-burst", "passthrough-concurrency"):
        if getattr(c, name.replace("-", "_")) < 1:
            raise ConfigError(name, "must be at least 1", value=getattr(c, name.replace("-", "_")))
    if not c.sts_qps > 0:
        raise ConfigError("sts-qps", "must be greater than 0", value=c.sts_qps)
    if c.sts_burst < 1:
        raise ConfigError("sts-burst", "must be at least 1", value=c.sts_burst)
    if c.sts_account_qps < 0:
        raise ConfigError("sts-account-qps", "must be 0 (off) or greater",
                          value=c.sts_account_qps)
    if c.sts_fleet_nodes < 0:
        raise ConfigError("sts-fleet-nodes", "must be 0 or greater", value=c.sts_fleet_nodes)

    # Durations are never negative.
    for flag in FLAGS:
        if flag.kind == "duration":
            value = getattr(c, flag.field)
            if value is not None and value < 0:
                raise ConfigError(flag.name, "must not be negative",
                                  value=format_go_duration(value))

    # Choices, case-insensitive like kube2iam's comparisons.
    for flag in FLAGS:
        if flag.kind == "choice":
            value = str(getattr(c, flag.field)).lower()
            if value not in flag.choices:
                raise ConfigError(flag.name, "must be one of " + ", ".join(
                    dict.fromkeys(LOG_LEVELS.values()) if flag.name == "log-level"
                    else flag.choices), value=getattr(c, flag.field))
            if flag.name == "log-level":
                value = LOG_LEVELS[value]
            _set(c, flag.field, value)

    # Base ARN and the auto-discovery combinations (fatal in kube2iam).
    if c.base_role_arn:
        if not BASE_ARN_REGEXP.match(c.base_role_arn):
            raise ConfigError("base-role-arn", "expected " + BASE_ARN_REGEXP.pattern,
                              value=c.base_role_arn)
        if not c.base_role_arn.endswith("/"):
            _set(c, "base_role_arn", c.base_role_arn + "/")
        if c.auto_discover_base_arn:
            raise ConfigError("auto-discover-base-arn",
                              "cannot be used if --base-role-arn is specified")
    if c.auto_discover_default_role and c.default_role:
        raise ConfigError("auto-discover-default-role",
                          "cannot be used together with --default-role")
    if not c.iam_role_key:
        raise ConfigError("iam-role-key", "must not be empty", value="")

    # Addresses.
    if c.host_ip:
        _ip(c.host_ip, "host-ip")
    if c.host_ipv6:
        _ip(c.host_ipv6, "host-ipv6", version=6)
    elif c.host_ip and ipaddress.ip_address(c.host_ip).version == 6:
        _set(c, "host_ipv6", c.host_ip)
        derived.add("host_ipv6")
    if c.iptables and not c.host_ip:
        raise ConfigError("host-ip", "must be set when --iptables is enabled")
    if c.iptables_remove_on_uninstall and not (c.pod_name and c.pod_namespace):
        raise ConfigError("iptables-remove-on-uninstall", "needs --pod-name and "
                          "--pod-namespace ($POD_NAME and $POD_NAMESPACE from the downward "
                          "API): the agent tells an uninstall by its pod's DaemonSet")
    try:
        host, _ = split_host_port(c.metadata_addr)
    except ValueError as e:
        raise ConfigError("metadata-addr", str(e), value=c.metadata_addr) from None
    if not host:
        raise ConfigError("metadata-addr", "must not be empty", value=c.metadata_addr)
    if c.iptables or c.metadata_ipv6:
        if not _INTERFACE.match(c.host_interface):
            raise ConfigError("host-interface", "not an interface name (at most 15 "
                              "characters, optionally !-negated)", value=c.host_interface)
        if c.iptables:
            _ip(host, "metadata-addr", version=4)

    if c.container_credentials_addr:
        container_credentials_addrs(c.container_credentials_addr)
        if not c.container_credentials_audience:
            raise ConfigError("container-credentials-audience", "must not be empty", value="")

    if c.container_credentials_link:
        _container_credentials_link(c)
    if c.container_credentials_addr and not c.node:
        # Without it the pod view holds every node's pods: any valid token of any pod of
        # the cluster would be answered here.
        raise ConfigError("node", "must be set with --container-credentials-addr (else "
                          "this agent would answer the tokens of every node's pods)")

    # URLs.
    if c.cri_endpoint not in ("", "none", "auto") and not (
            c.cri_endpoint.startswith("unix://") or c.cri_endpoint.startswith("/")):
        raise ConfigError("cri-endpoint", "must be auto, none, \"\", a unix:// URL or a "
                          "socket path", value=c.cri_endpoint)
    if c.sts_endpoint:
        _url(c.sts_endpoint, "sts-endpoint")
    if c.api_server:
        _url(c.api_server, "api-server")

    # Session tags: a cluster name STS takes as a tag value, EKS keys only with tags on.
    problem = tag_value_problem(c.cluster_name)
    if problem:
        raise ConfigError("cluster-name", f"not an STS session tag value: {problem}",
                          value=c.cluster_name)
    if c.session_tag_keys == "eks":
        if not c.session_tags:
            raise ConfigError("session-tag-keys", "eks needs --session-tags", value="eks")
        if c.session_name_policy != "node-role":
            raise ConfigError("session-name-policy", "cannot be used with "
                              "--session-tag-keys=eks, which names each session after its "
                              "pod as EKS Pod Identity does", value=c.session_name_policy)

    # Session duration: 1h, or kube2iam's 2x TTL when the TTL was given.
    if c.session_duration is None:
        derived.add("session_duration")
        ttl_given = ("iam-role-session-ttl" in c.explicit
                     or c.iam_role_session_ttl != FLAGS_BY_NAME["iam-role-session-ttl"].default)
        _set(c, "session_duration",
             2 * c.iam_role_session_ttl if ttl_given
             else FLAGS_BY_NAME["session-duration"].default)
        culprit = "iam-role-session-ttl" if ttl_given else "session-duration"
    else:
        culprit = "session-duration"
    if not 900 <= c.session_duration <= 43200:
        raise ConfigError(culprit, f"the STS session duration "
                          f"{format_go_duration(c.session_duration)} is outside STS's "
                          f"range 15m0s-12h0m0s",
                          value=format_go_duration(getattr(c, culprit.replace("-", "_"))))
    if c.min_credential_lifetime >= c.session_duration:
        raise ConfigError("min-credential-lifetime", "must be shorter than the session "
                          f"duration {format_go_duration(c.session_duration)}",
                          value=format_go_duration(c.min_credential_lifetime))

    # Keys and paths.
    if c.node_startup_taint and not _QUALIFIED_NAME.match(c.node_startup_taint):
        raise ConfigError("node-startup-taint", "not a valid taint key",
                          value=c.node_startup_taint)
    if not c.table_path:
        raise ConfigError("table-path", "must not be empty", value="")
    if not isinstance(c.explicit, frozenset):
        _set(c, "explicit", frozenset(c.explicit))
    _set(c, "derived", frozenset(derived))


# A process that finds the configuration unusable (no cluster configured, a kubeconfig that
# does not load) exits with this code after one line naming what to fix; the supervisor then
# stops instead of restarting it (EX_CONFIG of sysexits.h).
EXIT_CONFIG = 78


# ---- the control process's configuration, handed over on its command line ------------------

def config_to_json(config: Config) -> str:
    """The control process's configuration, handed over on its command line.  Fields the
    config derived from others are left out, so the child derives them the same way."""
    doc = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)
           if f.init and f.name not in config.derived}
    doc["explicit"] = sorted(config.explicit)
    return orjson.dumps(doc).decode()


def config_from_json(text: str) -> Config:
    doc = orjson.loads(text)
    doc["explicit"] = frozenset(doc.get("explicit", ()))
    return Config(**doc)
