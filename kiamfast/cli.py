"""The ``kiamfast`` command: kube2iam-compatible flag parsing and dispatch.

A kube2iam DaemonSet must keep working when only its image is swapped, so the parser accepts
exactly what kube2iam's parser (spf13/pflag) accepts: ``--flag=value`` and ``--flag value``,
bare booleans (``--iptables``) and ``--iptables=<Go strconv.ParseBool value>``, Go durations,
the last occurrence of a repeated flag winning, ``--`` ending the flags. Like pflag it does
not accept single-dash long flags (``-iptables``). Unlike pflag it refuses stray positional
arguments: pflag silently ignores them, which turns ``--iptables false`` (two arguments) into
``--iptables=true``.

Every mistake ends the same way: exactly one line on stderr naming the flag, exit code 2.
The parser is generated from :data:`kiamfast.config.FLAGS`, as are ``--help`` and
:func:`render_flag_reference` (the README's configuration reference).

``kiamfast demo ...`` runs the demo (:mod:`kiamfast.demo`), ``kiamfast webhook ...`` the
injection webhook (:mod:`kiamfast.webhook`), ``kiamfast keep-sockets ...`` the socket
keeper (:mod:`kiamfast.socket_keeper`); anything else parses the
flags and hands the :class:`~kiamfast.config.Config` to :func:`kiamfast.supervisor.run`. All are
imported only when needed, so ``--help`` and ``--version`` work without them.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from kiamfast import __version__
from kiamfast.buildinfo import build_info
from kiamfast.config import (
    FLAGS,
    FLAGS_BY_NAME,
    Config,
    ConfigError,
    DurationError,
    Flag,
    parse_go_duration,
)

__all__ = [
    "UsageError",
    "build_info",
    "main",
    "parse_args",
    "parse_bool",
    "parse_go_duration",
    "render_flag_reference",
    "render_help",
    "version_string",
]

PROG = "kiamfast"

# Go strconv.ParseBool.
_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


class UsageError(Exception):
    """The command line is wrong. ``str()`` is the one line shown to the user."""

    def __init__(self, message: str, *, flag: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag


class _Exit(Exception):
    """--help or --version: print ``text`` and exit 0."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


def parse_bool(text: str) -> bool:
    """Go's ``strconv.ParseBool``: 1 t T TRUE true True / 0 f F FALSE false False."""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"invalid syntax: {text!r}")


def _convert(flag: Flag, text: str) -> Any:
    """One flag value from its text; raises UsageError naming the flag."""

    def bad(why: str) -> UsageError:
        return UsageError(f'invalid value "{text}" for flag --{flag.name}: {why}',
                          flag=flag.name)

    if flag.kind == "str":
        return text
    if flag.kind == "bool":
        try:
            return parse_bool(text)
        except ValueError:
            raise bad("must be a boolean (true, false, 1, 0, t, f)") from None
    if flag.kind == "int":
        t = text.strip()
        body = t[1:] if t[:1] in "+-" else t
        if not body or not body.isascii() or not body.isdigit():
            raise bad("must be an integer")
        return int(t)
    if flag.kind == "float":
        try:
            value = float(text)
        except ValueError:
            raise bad("must be a number") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise bad("must be a finite number")
        return value
    if flag.kind == "duration":
        try:
            return parse_go_duration(text)
        except DurationError:
            raise bad("must be a Go duration such as 350ms, 15m, 1h30m") from None
    if flag.kind == "choice":
        if text.lower() not in flag.choices:
            raise bad("must be one of " + ", ".join(flag.choices))
        return text.lower()
    raise AssertionError(f"unknown flag kind {flag.kind}")


def _did_you_mean(name: str) -> str:
    """`` (did you mean --x?)`` for the flag closest to ``name``, or "" when none is close
    (also the usual slips: an underscore for a dash, a capital letter, the start of a name:
    ``v`` is ``--verbose`` or ``--version``)."""
    import difflib
    names = [*FLAGS_BY_NAME, "help"]
    guess = name.lower().replace("_", "-")
    if guess in names:
        return f" (did you mean --{guess}?)"
    started = [n for n in names if guess and n.startswith(guess)]
    if 1 <= len(started) <= 3:
        return f" (did you mean {' or '.join(f'--{n}' for n in started)}?)"
    close = difflib.get_close_matches(guess, names, n=1, cutoff=0.75)
    return f" (did you mean --{close[0]}?)" if close else ""


def _scan(argv: Sequence[str]) -> dict[str, Any]:
    """pflag's scan of ``argv`` into {flag name: value}; --help / --version raise _Exit."""
    values: dict[str, Any] = {}
    args = list(argv)
    i = 0
    previous_bool: str | None = None
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            if i < len(args):
                raise UsageError(f'unexpected argument "{args[i]}": kiamfast takes flags only')
            break
        if not arg.startswith("-") or arg == "-":
            hint = ""
            if previous_bool and arg in _TRUE | _FALSE:
                hint = f" (a boolean takes its value as --{previous_bool}={arg})"
            raise UsageError(f'unexpected argument "{arg}": kiamfast takes flags only{hint}',
                             flag=previous_bool)
        previous_bool = None
        if not arg.startswith("--"):
            # pflag reads "-xyz" as shorthand flags; kiamfast defines none but -h.
            if arg in ("-h", "-help"):
                raise _Exit(render_help())
            name = arg.lstrip("-").split("=", 1)[0]
            if name in FLAGS_BY_NAME:
                raise UsageError(f"unknown flag: {arg} (long flags take two dashes: -{arg})",
                                 flag=name)
            guess = _did_you_mean(name).strip(" ()")
            raise UsageError(f"unknown flag: {arg} (kiamfast has no one-letter flags but -h"
                             f"{'; ' + guess if guess else ''})", flag=name)
        name, eq, inline = arg[2:].partition("=")
        if name == "help":
            raise _Exit(render_help())
        flag = FLAGS_BY_NAME.get(name)
        if flag is None or not name:
            raise UsageError(f"unknown flag: --{name}{_did_you_mean(name)}", flag=name)
        if eq:
            text = inline
        elif flag.kind == "bool":
            text = "true"
            previous_bool = name
        elif i < len(args):
            # pflag takes the next argument as the value whatever it looks like.
            text = args[i]
            i += 1
        else:
            raise UsageError(f"flag needs an argument: --{name}", flag=name)
        values[name] = _convert(flag, text)
    return values


def _environment_fallbacks(values: dict[str, Any], environ: Mapping[str, str]) -> None:
    """Fill --host-ip, --node, --sts-endpoint, --host-ipv6 from the environment if not given."""
    for flag in FLAGS:
        if flag.name in values:
            continue
        for var in flag.env:
            if environ.get(var):
                try:
                    values[flag.name] = _convert(flag, environ[var])
                except UsageError as e:
                    raise UsageError(f"{e} (from ${var})", flag=flag.name) from None
                break
    if "host-ipv6" not in values and environ.get("HOST_IPS"):
        # Downward API status.hostIPs: comma-separated, one per family.
        for item in environ["HOST_IPS"].split(","):
            try:
                if ipaddress.ip_address(item.strip()).version == 6:
                    values["host-ipv6"] = item.strip()
                    break
            except ValueError:
                continue


def parse_args(argv: Sequence[str], *, environ: Mapping[str, str] | None = None) -> Config:
    """Parse kube2iam-style flags into a validated :class:`Config`.

    Raises :class:`UsageError` (one line, names the flag) for any mistake, and returns only
    after ``--version`` / ``--help`` handling has been left to :func:`main`.
    """
    values = _scan(argv)
    explicit = frozenset(values)
    environ_used = os.environ if environ is None else environ
    _environment_fallbacks(values, environ_used)
    kwargs = {FLAGS_BY_NAME[name].field: value for name, value in values.items()}
    try:
        return Config(explicit=explicit, **kwargs)
    except ConfigError as e:
        where = ""
        if e.flag not in explicit:
            var = next((v for v in FLAGS_BY_NAME[e.flag].env if v in environ_used), None) \
                if e.flag in FLAGS_BY_NAME else None
            where = f" (from ${var})" if var else ""
        raise UsageError(str(e) + where, flag=e.flag) from None


def version_string() -> str:
    """kube2iam's format: ``Version: <v> - Commit: <sha> - Date: <date>``."""
    commit, date = build_info()
    return f"Version: {__version__} - Commit: {commit} - Date: {date}"


def _type_name(flag: Flag) -> str:
    if flag.kind == "choice":
        return "|".join(flag.choices) if flag.name != "log-level" else "level"
    return {"str": "string", "float": "float", "int": "int", "bool": "",
            "duration": "duration"}[flag.kind]


# --help and the configuration reference, by topic: (title, flag names) in the order shown.
# Every flag is in exactly one group (tests/cli/test_cli_flags.py).
HELP_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("The Kubernetes API", ("kubeconfig", "api-server", "api-token", "insecure", "node",
                            "cache-resync-period")),
    ("Pods' roles", ("base-role-arn", "default-role", "iam-role-key", "iam-external-id",
                     "auto-discover-base-arn", "auto-discover-default-role",
                     "namespace-restrictions", "namespace-restriction-format",
                     "namespace-key", "namespace-permitted-key")),
    ("STS and credentials", ("sts-endpoint", "sts-region", "sts-qps", "sts-burst",
                             "sts-account-qps", "sts-fleet-nodes", "session-duration",
                             "iam-role-session-ttl", "iam-role-error-ttl",
                             "min-credential-lifetime", "ready-prefetch-timeout",
                             "session-name-policy", "session-tags", "session-tag-keys",
                             "cluster-name")),
    ("Serving pods", ("app-port", "metrics-port", "listen-host", "workers", "worker-realtime",
                      "wait-budget",
                      "imdsv2", "token-key-file", "metadata-addr", "passthrough-qps",
                      "passthrough-burst", "passthrough-concurrency")),
    ("The node: DNAT rule, container runtime, startup taint", (
        "iptables", "host-ip", "host-interface", "host-ipv6", "metadata-ipv6",
        "iptables-backend", "iptables-backstop", "iptables-check-interval",
        "iptables-remove-on-exit", "iptables-remove-on-uninstall", "pod-name",
        "pod-namespace", "cri-endpoint", "address-proof", "node-startup-taint")),
    ("State and handing the node over", ("table-path", "handover-socket", "handover-port",
                                         "socket-keeper", "ready-file")),
    ("Container credentials (preview)", ("container-credentials-addr",
                                         "container-credentials-link",
                                         "container-credentials-audience")),
    ("Logs and debugging", ("log-format", "log-level", "verbose", "debug", "version")),
    ("Accepted for older manifests, no effect", (
        "use-regional-sts-endpoint", "resolve-duplicate-cache-ips", "backoff-max-interval",
        "backoff-max-elapsed-time", "kubelet-url", "kubelet-insecure")),
)


def grouped_flags() -> list[tuple[str, list[Flag]]]:
    return [(title, [FLAGS_BY_NAME[name] for name in names]) for title, names in HELP_GROUPS]


def render_help() -> str:
    """``--help``: every flag with its type, default and meaning, by topic."""
    lines = [
        f"Usage: {PROG} [flags]",
        f"       {PROG} demo [demo flags]",
        f"       {PROG} webhook --tls-cert F --tls-key F [webhook flags]",
        f"       {PROG} keep-sockets --socket PATH   (the socket keeper: --socket-keeper)",
        "",
        "kube2iam-compatible IAM credential agent for Kubernetes. Flags (pflag syntax: "
        "--flag=value or --flag value; booleans also as bare --flag; [kiamfast]: not a "
        "kube2iam flag). Exit codes: 0 stopped, 1 a failure a restart may cure, 2 a wrong "
        "flag, 78 a configuration only a change cures (docs/configuration.md).",
    ]
    for title, flags in grouped_flags():
        lines += ["", f"{title}:"]
        for flag in flags:
            head = f"  --{flag.name}"
            if _type_name(flag):
                head += " " + _type_name(flag)
            lines.append(head)
            mark = "" if flag.kube2iam else " [kiamfast]"
            lines.append(f"        {flag.help} (default {flag.display_default()}){mark}")
    lines += ["", "  -h, --help", "        Show this help and exit."]
    return "\n".join(lines) + "\n"


def render_flag_reference() -> str:
    """The configuration reference as a markdown table (for the README)."""
    rows = [
        "| Flag | Type | Default | kube2iam | Description |",
        "|---|---|---|---|---|",
    ]
    for title, flags in grouped_flags():
        rows.append(f"| **{title}** | | | | |")
        rows += [_reference_row(flag) for flag in flags]
    return "\n".join(rows) + "\n"


def _reference_row(flag: Flag) -> str:
    kind = {"str": "string", "choice": " \\| ".join(flag.choices)}.get(flag.kind, flag.kind)
    if flag.name == "log-level":
        kind = "level"
    default = flag.display_default().replace("|", "\\|")
    text = flag.help.replace("|", "\\|")
    if flag.env:
        text += " Env: " + ", ".join(f"`{v}`" for v in flag.env) + "."
    return (f"| `--{flag.name}` | {kind} | `{default}` | {'yes' if flag.kube2iam else ''} | "
            f"{text} |")


def _fail(message: str, stream: TextIO) -> int:
    stream.write(f"{PROG}: {message}\n")
    stream.flush()
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kiamfast`` console script and ``python -m kiamfast``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "demo":
        try:
            from kiamfast import demo  # imported lazily: it pulls in moto and friends
        except ImportError as e:
            sys.stderr.write(f"{PROG}: the demo is not available ({e})\n")
            return 1
        return int(demo.main(args[1:]) or 0)
    if args and args[0] == "webhook":
        from kiamfast.webhook import cli as webhook
        return webhook.main(args[1:])
    if args and args[0] == "keep-sockets":
        from kiamfast import socket_keeper
        return socket_keeper.main(args[1:])
    try:
        values = _scan(args)
        if values.get("version"):
            sys.stdout.write(version_string() + "\n")
            return 0
        config = parse_args(args)
    except _Exit as e:
        sys.stdout.write(e.text)
        return 0
    except UsageError as e:
        return _fail(str(e), sys.stderr)
    try:
        from kiamfast import supervisor
    except ImportError as e:
        sys.stderr.write(f"{PROG}: cannot start: kiamfast.supervisor is not available "
                         f"({e})\n")
        return 1
    return int(supervisor.run(config) or 0)
