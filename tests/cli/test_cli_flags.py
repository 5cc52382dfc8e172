"""The command line a kube2iam user already has must keep working, byte for byte.

These tests feed kube2iam's flags and the typical DaemonSet args to our parser, check Go's
syntaxes (strconv.ParseBool, time.ParseDuration), the environment fallbacks, and run
``python -m kiamfast`` as a subprocess for what a user sees: one line on stderr naming the
flag and exit code 2 for every mistake, ``--version`` in kube2iam's format, ``--help``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kiamfast
from kiamfast import cli
from kiamfast.cli import UsageError, parse_args, parse_go_duration
from kiamfast.config import (BASE_ARN_REGEXP, FLAGS, FLAGS_BY_NAME, Config, ConfigError,
                             format_go_duration)

REPO = Path(__file__).resolve().parents[2]

# kube2iam 0.15 flag -> (Config field, default) as documented in cmd/main.go / server.go.
KUBE2IAM_DEFAULTS = {
    "kubeconfig": ("kubeconfig", ""),
    "api-server": ("api_server", ""),
    "api-token": ("api_token", ""),
    "app-port": ("app_port", 8181),
    "metrics-port": ("metrics_port", 8181),
    "base-role-arn": ("base_role_arn", ""),
    "debug": ("debug", False),
    "default-role": ("default_role", ""),
    "iam-role-key": ("iam_role_key", "iam.amazonaws.com/role"),
    "iam-external-id": ("iam_external_id", "iam.amazonaws.com/external-id"),
    "iam-role-session-ttl": ("iam_role_session_ttl", 900.0),
    "iam-role-error-ttl": ("iam_role_error_ttl", 0.0),
    "insecure": ("insecure", False),
    "metadata-addr": ("metadata_addr", "169.254.169.254"),
    "iptables": ("iptables", False),
    "auto-discover-base-arn": ("auto_discover_base_arn", False),
    "auto-discover-default-role": ("auto_discover_default_role", False),
    "host-interface": ("host_interface", "docker0"),
    "namespace-restrictions": ("namespace_restrictions", False),
    "namespace-restriction-format": ("namespace_restriction_format", "glob"),
    "namespace-key": ("namespace_key", "iam.amazonaws.com/allowed-roles"),
    "cache-resync-period": ("cache_resync_period", 1800.0),
    "resolve-duplicate-cache-ips": ("resolve_duplicate_cache_ips", False),
    "host-ip": ("host_ip", ""),
    "node": ("node", ""),
    "backoff-max-interval": ("backoff_max_interval", 1.0),
    "backoff-max-elapsed-time": ("backoff_max_elapsed_time", 2.0),
    "log-format": ("log_format", "text"),
    "log-level": ("log_level", "info"),
    "use-regional-sts-endpoint": ("use_regional_sts_endpoint", False),
    "verbose": ("verbose", False),
    "version": ("version", False),
}

OUR_DEFAULTS = {
    "workers": 1, "wait_budget": 0.35, "imdsv2": "optional", "kubelet_url": "",
    "kubelet_insecure": False, "cri_endpoint": "auto", "sts_endpoint": "", "sts_region": "", "sts_qps": 5.0,
    "sts_burst": 100, "sts_account_qps": 0.0, "sts_fleet_nodes": 0, "session_duration": 3600.0, "min_credential_lifetime": 900.0,
    "session_name_policy": "node-role", "session_tags": False,
    "node_startup_taint": "kiamfast.io/agent-not-ready", "iptables_remove_on_exit": False,
    "iptables_backend": "auto", "namespace_permitted_key": "",
    "table_path": "/dev/shm/kiamfast-table", "ready_prefetch_timeout": 10.0,
    "metadata_ipv6": False, "host_ipv6": "", "listen_host": "",
    "token_key_file": "/dev/shm/kiamfast-token-key",
}

TYPICAL_ARGS = [
    "--base-role-arn=arn:aws:iam::123456789012:role/",
    "--iptables=true",
    "--host-ip=10.0.1.23",
    "--node=ip-10-0-1-23.ec2.internal",
    "--host-interface=eni+",
]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("HOST_IP", "NODE_NAME")}
    environ.update(env or {})
    environ["PYTHONPATH"] = str(REPO) + os.pathsep + environ.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "kiamfast", *args], capture_output=True,
                          text=True, timeout=60, env=environ, cwd=REPO)


# --------------------------------------------------------------------------------------------
# Defaults and acceptance
# --------------------------------------------------------------------------------------------


def test_every_kube2iam_flag_has_kube2iams_default():
    cfg = parse_args([], environ={})
    kube2iam_flags = {f.name for f in FLAGS if f.kube2iam}
    assert kube2iam_flags == set(KUBE2IAM_DEFAULTS)
    for flag, (field, default) in KUBE2IAM_DEFAULTS.items():
        assert getattr(cfg, field) == default, flag
    for field, default in OUR_DEFAULTS.items():
        assert getattr(cfg, field) == default, field


@pytest.mark.parametrize("flag", sorted(KUBE2IAM_DEFAULTS))
def test_every_kube2iam_flag_is_accepted_with_its_default_value(flag):
    f = next(x for x in FLAGS if x.name == flag)
    if f.kind == "duration":
        text = format_go_duration(f.default)
    elif f.kind == "bool":
        text = "false"
    else:
        text = str(f.default)
    cfg = parse_args([f"--{flag}={text}"], environ={})
    field, default = KUBE2IAM_DEFAULTS[flag]
    assert getattr(cfg, field) == default
    assert flag in cfg.explicit
    if f.kind != "bool":
        assert getattr(parse_args([f"--{flag}", text], environ={}), field) == default


def test_typical_kube2iam_daemonset_args_parse_unchanged():
    cfg = parse_args(TYPICAL_ARGS, environ={})
    assert cfg.base_role_arn == "arn:aws:iam::123456789012:role/"
    assert cfg.iptables is True
    assert cfg.host_ip == "10.0.1.23"
    assert cfg.node == "ip-10-0-1-23.ec2.internal"
    assert cfg.host_interface == "eni+"
    assert cfg.cri_endpoint == "auto"
    # The chart's other common flags.
    cfg = parse_args(TYPICAL_ARGS + [
        "--auto-discover-default-role=false", "--app-port=8181", "--log-level=info",
        "--log-format=json", "--namespace-restrictions", "--namespace-restriction-format",
        "regexp", "--verbose", "--use-regional-sts-endpoint", "--iam-role-session-ttl=30m",
        "--debug", "--metrics-port=9102", "--host-interface=cali+"], environ={})
    assert (cfg.log_format, cfg.namespace_restriction_format) == ("json", "regexp")
    assert cfg.effective_log_level == "debug" and cfg.verbose
    assert cfg.session_duration == 3600.0  # 2 x 30m, as kube2iam
    assert cfg.host_interface == "cali+" and cfg.metrics_port == 9102
    assert not cfg.metrics_on_app_port


@pytest.mark.parametrize("text", ["1", "t", "T", "TRUE", "true", "True"])
def test_true_spellings(text):
    assert parse_args([f"--iptables={text}", "--host-ip=10.0.0.1"], environ={}).iptables


@pytest.mark.parametrize("text", ["0", "f", "F", "FALSE", "false", "False"])
def test_false_spellings(text):
    assert not parse_args([f"--debug={text}"], environ={}).debug
    assert not parse_args(["--kubelet-insecure=" + text], environ={}).kubelet_insecure


@pytest.mark.parametrize("text", ["yes", "on", "tRUE", "", "2"])
def test_bad_bool_spellings(text):
    with pytest.raises(UsageError, match=f'invalid value "{text}" for flag --debug'):
        parse_args([f"--debug={text}"], environ={})


def test_bare_bool_and_last_occurrence_wins():
    assert parse_args(["--debug"], environ={}).debug
    assert not parse_args(["--debug", "--debug=false"], environ={}).debug
    assert parse_args(["--app-port=1", "--app-port", "2"], environ={}).app_port == 2
    # pflag takes the next argument as the value, whatever it looks like.
    assert parse_args(["--default-role", "--debug"], environ={}).default_role == "--debug"
    assert parse_args(["--default-role="], environ={}).default_role == ""
    assert parse_args(["--debug", "--"], environ={}).debug


@pytest.mark.parametrize("text,seconds", [
    ("15m", 900.0), ("1h30m", 5400.0), ("500ms", 0.5), ("1.5h", 5400.0),
    ("300us", 0.0003), ("300µs", 0.0003), ("300μs", 0.0003), ("0", 0.0), ("0s", 0.0),
    ("1h0m0s", 3600.0), ("2h45m30.5s", 9930.5), (".5s", 0.5), ("1.s", 1.0), ("+5s", 5.0),
    ("-1.5s", -1.5), ("10ns", 1e-8), ("1m1m", 120.0),
])
def test_go_durations(text, seconds):
    assert parse_go_duration(text) == pytest.approx(seconds, abs=1e-12)


@pytest.mark.parametrize("text", ["", "15", "1x", "m", ".s", "1.5.5s", "abc", "-", "1h 5m",
                                  "9999999999999h"])
def test_bad_go_durations(text):
    with pytest.raises(ValueError):
        parse_go_duration(text)


@pytest.mark.parametrize("seconds,text", [
    (900.0, "15m0s"), (0.35, "350ms"), (0.0, "0s"), (3600.0, "1h0m0s"), (1.5, "1.5s"),
    (5400.0, "1h30m0s"), (0.0003, "300µs"),
])
def test_go_duration_formatting(seconds, text):
    assert format_go_duration(seconds) == text
    assert parse_go_duration(text) == pytest.approx(seconds)


def test_durations_in_flags():
    cfg = parse_args(["--wait-budget=500ms", "--cache-resync-period=0",
                      "--backoff-max-elapsed-time", "1m30s"], environ={})
    assert (cfg.wait_budget, cfg.cache_resync_period, cfg.backoff_max_elapsed_time) == (
        0.5, 0.0, 90.0)


# --------------------------------------------------------------------------------------------
# Environment fallbacks
# --------------------------------------------------------------------------------------------


def test_environment_fills_host_ip_and_node_only_when_not_given():
    env = {"HOST_IP": "10.1.2.3", "NODE_NAME": "node-a",
           "AWS_ENDPOINT_URL_STS": "http://127.0.0.1:5000"}
    cfg = parse_args([], environ=env)
    assert (cfg.host_ip, cfg.node, cfg.sts_endpoint) == ("10.1.2.3", "node-a",
                                                         "http://127.0.0.1:5000")
    assert "host-ip" not in cfg.explicit
    cfg = parse_args(["--host-ip=10.9.9.9", "--node=node-b", "--sts-endpoint="], environ=env)
    assert (cfg.host_ip, cfg.node, cfg.sts_endpoint) == ("10.9.9.9", "node-b", "")


def test_host_ips_fills_the_ipv6_address():
    cfg = parse_args(["--metadata-ipv6"], environ={"HOST_IP": "10.1.2.3",
                                                   "HOST_IPS": "10.1.2.3,2600:1f18::7"})
    assert cfg.host_ipv6 == "2600:1f18::7"
    assert parse_args([], environ={"HOST_IP": "2600:1f18::7"}).host_ipv6 == "2600:1f18::7"


def test_bad_environment_value_names_the_flag_and_the_variable():
    with pytest.raises(UsageError, match=r'invalid value "not-an-ip" for flag --host-ip: '
                                         r'not an IP address \(from \$HOST_IP\)'):
        parse_args([], environ={"HOST_IP": "not-an-ip"})


def test_unexpanded_downward_api_reference_is_explained():
    # A kube2iam manifest passing --host-ip=$(HOST_IP) without defining HOST_IP in env.
    proc = run_cli("--host-ip=$(HOST_IP)")
    assert proc.returncode == 2
    assert proc.stderr == ('kiamfast: invalid value "$(HOST_IP)" for flag --host-ip: not an '
                           "IP address; Kubernetes did not expand $(HOST_IP): define HOST_IP "
                           "in the container's env\n")


# --------------------------------------------------------------------------------------------
# Validation and derived settings
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arn,normalised", [
    ("arn:aws:iam::123456789012:role/", "arn:aws:iam::123456789012:role/"),
    ("arn:aws:iam::123456789012:role", "arn:aws:iam::123456789012:role/"),
    ("arn:aws:iam::123456789012:role/team/", "arn:aws:iam::123456789012:role/team/"),
    ("arn:aws-cn:iam::123456789012:role/a.b-c_d", "arn:aws-cn:iam::123456789012:role/a.b-c_d/"),
    ("arn:aws-us-gov:iam::1:role/x", "arn:aws-us-gov:iam::1:role/x/"),
])
def test_base_role_arn_normalised(arn, normalised):
    assert parse_args([f"--base-role-arn={arn}"], environ={}).base_role_arn == normalised
    assert BASE_ARN_REGEXP.match(arn)


@pytest.mark.parametrize("arn", [
    "123456789012", "arn:aws:iam::123456789012:user/", "arn:aws:iam::abc:role/",
    "arn:aws:iam:us-east-1:123456789012:role/", "arn:aws:iam::123456789012:role/a@b",
    "arn:aws:sts::123456789012:role/", "arn:aws:iam::１２３:role/",
])
def test_base_role_arn_rejected(arn):
    with pytest.raises(UsageError, match="for flag --base-role-arn: expected"):
        parse_args([f"--base-role-arn={arn}"], environ={})


def test_auto_discovery_conflicts_are_fatal_like_kube2iam():
    with pytest.raises(UsageError, match="--auto-discover-base-arn"):
        parse_args(["--auto-discover-base-arn", "--base-role-arn=arn:aws:iam::1:role/"],
                   environ={})
    with pytest.raises(UsageError, match="--auto-discover-default-role"):
        parse_args(["--auto-discover-default-role", "--default-role=x"], environ={})
    assert parse_args(["--auto-discover-base-arn"], environ={}).auto_discover_base_arn


def test_session_duration_follows_kube2iams_ttl_only_when_given():
    assert parse_args([], environ={}).session_duration == 3600.0
    assert parse_args(["--iam-role-session-ttl=15m"], environ={}).session_duration == 1800.0
    assert parse_args(["--iam-role-session-ttl=20m", "--session-duration=45m"],
                      environ={}).session_duration == 2700.0
    with pytest.raises(UsageError, match="--iam-role-session-ttl.*15m0s-12h0m0s"):
        parse_args(["--iam-role-session-ttl=5m"], environ={})
    with pytest.raises(UsageError, match="--session-duration"):
        parse_args(["--session-duration=13h"], environ={})
    with pytest.raises(UsageError, match="--min-credential-lifetime"):
        parse_args(["--session-duration=15m"], environ={})


def test_cri_endpoint_values_and_the_kubelet_flags_kept_for_compatibility():
    for value in ("auto", "none", "", "unix:///run/containerd/containerd.sock",
                  "/var/run/crio/crio.sock"):
        assert parse_args([f"--cri-endpoint={value}"], environ={}).cri_endpoint == value
    with pytest.raises(UsageError, match="--cri-endpoint"):
        parse_args(["--cri-endpoint=tcp://10.0.0.5:1234"], environ={})
    # Earlier kiamfast DaemonSets keep starting: accepted, and without effect.
    cfg = parse_args(["--kubelet-url=https://10.0.0.5:10250", "--kubelet-insecure"], environ={})
    assert cfg.kubelet_url == "https://10.0.0.5:10250" and cfg.kubelet_insecure


@pytest.mark.parametrize("args,flag", [
    (["--iptables"], "--host-ip"),
    (["--app-port=0"], "--app-port"),
    (["--app-port=70000"], "--app-port"),
    (["--workers=0"], "--workers"),
    (["--workers=65"], "--workers"),
    (["--imdsv2=sometimes"], "--imdsv2"),
    (["--log-level=loud"], "--log-level"),
    (["--log-format=xml"], "--log-format"),
    (["--namespace-restriction-format=regex"], "--namespace-restriction-format"),
    (["--session-name-policy=random"], "--session-name-policy"),
    (["--sts-qps=0"], "--sts-qps"),
    (["--sts-burst=0"], "--sts-burst"),
    (["--passthrough-qps=0"], "--passthrough-qps"),
    (["--passthrough-burst=0"], "--passthrough-burst"),
    (["--passthrough-concurrency=0"], "--passthrough-concurrency"),
    (["--sts-account-qps=-1"], "--sts-account-qps"),
    (["--sts-fleet-nodes=-1"], "--sts-fleet-nodes"),
    (["--wait-budget=-1s"], "--wait-budget"),
    (["--node-startup-taint=not a key"], "--node-startup-taint"),
    (["--host-ipv6=10.0.0.1"], "--host-ipv6"),
    (["--sts-endpoint=sts.amazonaws.com"], "--sts-endpoint"),
    (["--iptables", "--host-ip=10.0.0.1", "--host-interface=waytoolonginterface"],
     "--host-interface"),
])
def test_invalid_settings_name_their_flag(args, flag):
    with pytest.raises(UsageError) as e:
        parse_args(args, environ={})
    assert flag in str(e.value)
    assert "\n" not in str(e.value)


def test_case_insensitive_choices_are_normalised():
    cfg = parse_args(["--log-level=WARNING", "--log-format=JSON",
                      "--namespace-restriction-format=RegExp"], environ={})
    assert (cfg.log_level, cfg.log_format, cfg.namespace_restriction_format) == (
        "warn", "json", "regexp")


def test_config_is_frozen_and_constructible_directly():
    cfg = Config(node="n1", host_ip="10.0.0.1")
    with pytest.raises(AttributeError):
        cfg.node = "n2"  # type: ignore[misc]
    assert cfg.replace(app_port=9000).app_port == 9000
    # Derived settings follow the fields they derive from; given ones stay.
    assert cfg.replace(iam_role_session_ttl=1200.0).session_duration == 2400.0
    given = Config(host_ip="10.0.0.1", session_duration=1800.0)
    assert given.replace(iam_role_session_ttl=1200.0).session_duration == 1800.0
    v6 = Config(host_ip="fd00::1")
    assert v6.host_ipv6 == "fd00::1"
    assert v6.replace(host_ip="10.0.0.1").host_ipv6 == ""
    assert cfg == Config(node="n1", host_ip="10.0.0.1")
    with pytest.raises(ConfigError) as e:
        Config(app_port=0)
    assert e.value.flag == "app-port"


def test_metadata_addr_with_port():
    cfg = parse_args(["--metadata-addr=127.0.0.1:1338"], environ={})
    assert cfg.metadata_addr == "127.0.0.1:1338" and cfg.metadata_host == "127.0.0.1"


# --------------------------------------------------------------------------------------------
# What a user sees: the real command
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,flag", [
    (["--app-port=abc"], "--app-port"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--no-such-flag=1"], "--no-such-flag"),
    (["-iptables"], "-iptables"),
    (["--iptables=maybe"], "--iptables"),
    (["--wait-budget=soon"], "--wait-budget"),
    (["--node"], "--node"),
    (["--iptables", "false"], "--iptables"),
    (["--base-role-arn=arn:aws:iam::123:user/x"], "--base-role-arn"),
    (["--auto-discover-base-arn", "--base-role-arn=arn:aws:iam::1:role/"],
     "--auto-discover-base-arn"),
])
def test_bad_command_line_one_line_on_stderr_exit_2(args, flag):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kiamfast: ")
    assert flag in lines[0]


@pytest.mark.parametrize("typed,meant", [
    ("--app-prot=8181", "--app-port"),
    ("--kubconfig", "--kubeconfig"),
    ("--iptable", "--iptables"),
    ("--base_role_arn=arn:aws:iam::1:role/", "--base-role-arn"),
    ("--Verbose", "--verbose"),
    ("--log-fromat=json", "--log-format"),
    ("--hepl", "--help"),
])
def test_an_unknown_flag_names_the_closest_one(typed, meant):
    proc = run_cli(typed)
    name = typed.split("=", 1)[0]
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"kiamfast: unknown flag: {name} (did you mean {meant}?)\n"


@pytest.mark.parametrize("typed", ["--x", "--no-such-flag", "--frobnicate=1"])
def test_an_unknown_flag_like_no_other_gets_no_guess(typed):
    proc = run_cli(typed)
    assert proc.returncode == 2
    assert proc.stderr == f"kiamfast: unknown flag: {typed.split('=', 1)[0]}\n"


def test_bad_value_message_format():
    proc = run_cli("--app-port=abc")
    assert proc.stderr == ('kiamfast: invalid value "abc" for flag --app-port: '
                           "must be an integer\n")


def checkout_commit_and_date() -> tuple[str, str]:
    out = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %ct"],
                         capture_output=True, text=True, timeout=30, check=True).stdout.split()
    return out[0], time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(out[1])))


def test_version_format():
    # From this checkout (an editable install has no build stamp): git's commit and date.
    commit, date = checkout_commit_and_date()
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout == f"Version: {kiamfast.__version__} - Commit: {commit} - Date: {date}\n"
    proc = run_cli("--version", env={"KIAMFAST_GIT_COMMIT": "4c4a2b4",
                                     "KIAMFAST_BUILD_DATE": "2026-05-08T00:00:00Z"})
    assert re.fullmatch(r"Version: \S+ - Commit: 4c4a2b4 - Date: 2026-05-08T00:00:00Z\n",
                        proc.stdout)
    # --version wins over settings that would otherwise be refused (as in kube2iam).
    assert run_cli("--version", "--iptables").returncode == 0


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_flag_with_default(flag):
    proc = run_cli(flag)
    assert proc.returncode == 0, proc.stderr
    for f in FLAGS:
        assert f"--{f.name}" in proc.stdout
        assert f"(default {f.display_default()})" in proc.stdout
    assert "(default 8181)" in proc.stdout and "(default 15m0s)" in proc.stdout
    assert '(default "docker0")' in proc.stdout


def test_flag_reference_table():
    table = cli.render_flag_reference()
    rows = [line for line in table.splitlines() if line.startswith("| `--")]
    assert len(rows) == len(FLAGS)
    assert all(line.count(" | ") >= 4 for line in rows)
    assert "| `--app-port` | int | `8181` | yes |" in table
    assert "| `--wait-budget` | duration | `350ms` |  |" in table


def test_without_supervisor_the_error_is_clear():
    # sys.modules[name] = None makes "import name" fail, as a broken install would.
    code = ("import sys; sys.modules['kiamfast.supervisor'] = None; "
            "from kiamfast.cli import main; raise SystemExit(main(['--node=n1']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 1
    assert proc.stderr.startswith("kiamfast: cannot start: kiamfast.supervisor is not "
                                  "available")
    assert len(proc.stderr.splitlines()) == 1


def test_passthrough_bounds_reach_the_workers():
    from kiamfast.supervisor import worker_settings
    settings = worker_settings(parse_args(["--passthrough-qps=2.5", "--passthrough-burst=7",
                                           "--passthrough-concurrency=3"]), token_key_fd=3)
    assert (settings.passthrough_rate, settings.passthrough_burst,
            settings.passthrough_concurrency) == (2.5, 7, 3)
    defaults = worker_settings(parse_args([]), token_key_fd=3)
    assert (defaults.passthrough_rate, defaults.passthrough_burst,
            defaults.passthrough_concurrency) == (10.0, 40, 4)


def test_the_fleet_budget_flags():
    cfg = parse_args(["--sts-account-qps=600", "--sts-fleet-nodes=2000"], environ={})
    assert (cfg.sts_account_qps, cfg.sts_fleet_nodes) == (600.0, 2000)


# ---- --help by topic, and the one-letter slips -------------------------------------------

def test_every_flag_is_in_exactly_one_help_group():
    grouped = [name for _, names in cli.HELP_GROUPS for name in names]
    assert sorted(grouped) == sorted(f.name for f in FLAGS)
    assert len(grouped) == len(set(grouped))


def test_help_shows_the_flags_by_topic_with_the_exit_codes():
    out = run_cli("--help").stdout
    titles = [title for title, _ in cli.HELP_GROUPS]
    positions = [out.index(f"\n{title}:\n") for title in titles]
    assert positions == sorted(positions)
    # each flag under its own topic
    for title, names in cli.HELP_GROUPS:
        section = out.split(f"\n{title}:\n", 1)[1].split("\n\n", 1)[0]
        assert re.findall(r"^  --([a-z0-9-]+)", section, re.M) == list(names), title
    assert "Exit codes: 0 stopped, 1 a failure a restart may cure, 2 a wrong flag, 78 a " \
           "configuration only a change cures" in " ".join(out.split())


@pytest.mark.parametrize("typed, says", [
    ("-v", "unknown flag: -v (kiamfast has no one-letter flags but -h; did you mean --verbose "
           "or --version?)"),
    ("--v", "unknown flag: --v (did you mean --verbose or --version?)"),
    ("--ver", "unknown flag: --ver (did you mean --verbose or --version?)"),
    ("-x", "unknown flag: -x (kiamfast has no one-letter flags but -h)"),
    ("-iptables", "unknown flag: -iptables (long flags take two dashes: --iptables)"),
])
def test_a_one_letter_or_short_flag_says_what_was_meant(typed, says):
    proc = run_cli(typed)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"kiamfast: {says}\n")


def test_the_kubelet_flags_do_not_claim_an_earlier_release():
    for name in ("kubelet-url", "kubelet-insecure"):
        assert "earlier kiamfast versions" not in FLAGS_BY_NAME[name].help
        assert FLAGS_BY_NAME[name].help.startswith("No effect")
