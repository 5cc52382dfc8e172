"""--container-credentials-addr (a list of ip:port) and --container-credentials-link as a user
types them: a good list parses to the addresses the supervisor binds; every mistake is one
line on stderr naming the flag, exit code 2, before anything is bound or changed."""
from __future__ import annotations

import pytest
from test_cli_flags import run_cli

from kiamfast.cli import UsageError, parse_args
from kiamfast.config import container_credentials_addrs

BOTH = "169.254.170.23:80,[fd00:ec2::23]:80"


def test_a_list_of_both_addresses_parses_in_order():
    cfg = parse_args([f"--container-credentials-addr={BOTH}",
                      "--container-credentials-link=kiamfast0", "--node=n1"])
    assert container_credentials_addrs(cfg.container_credentials_addr) == [
        ("169.254.170.23", 80), ("fd00:ec2::23", 80)]
    assert cfg.container_credentials_link == "kiamfast0"


def test_one_address_still_works_and_link_defaults_to_unmanaged():
    cfg = parse_args(["--container-credentials-addr=127.0.0.1:8190"], environ={
        "NODE_NAME": "n1"})
    assert container_credentials_addrs(cfg.container_credentials_addr) == [("127.0.0.1", 8190)]
    assert cfg.container_credentials_link == ""


def test_the_listener_needs_the_node_name():
    """Without --node the agent knows every node's pods, so any valid token of any pod in
    the cluster would be answered here: refused at start, one line naming --node."""
    with pytest.raises(UsageError, match="invalid flag --node: must be set"):
        parse_args(["--container-credentials-addr=127.0.0.1:8190"], environ={})
    proc = run_cli("--container-credentials-addr=127.0.0.1:8190")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "kiamfast: invalid flag --node: must be set with --container-credentials-addr (else "
        "this agent would answer the tokens of every node's pods)"]
    assert parse_args(["--container-credentials-addr=127.0.0.1:8190", "--node=n1"]).node == "n1"
    # $NODE_NAME, as the chart and the DaemonSet give it, is the node name too.
    assert parse_args(["--container-credentials-addr=127.0.0.1:8190"],
                      environ={"NODE_NAME": "n1"}).node == "n1"


@pytest.mark.parametrize("args, flag, why", [
    (["--container-credentials-addr=169.254.170.23,[fd00:ec2::23]:80"],
     "--container-credentials-addr", "needs a port"),
    (["--container-credentials-addr=169.254.170.23:80,[fd00:ec2::23]"],
     "--container-credentials-addr", "needs a port"),
    (["--container-credentials-addr=metadata.local:80"],
     "--container-credentials-addr", "not an IP address"),
    (["--container-credentials-addr=169.254.170.23:80,"],
     "--container-credentials-addr", "an empty entry"),
    (["--container-credentials-addr=169.254.170.23:99999"],
     "--container-credentials-addr", "bad port"),
    (["--container-credentials-addr=169.254.170.23:80,169.254.170.23:80"],
     "--container-credentials-addr", "listed twice"),
    ([f"--container-credentials-addr={BOTH}",
      "--container-credentials-link=kiamfast-container0"],   # 19 > IFNAMSIZ-1
     "--container-credentials-link", "not a link name"),
    ([f"--container-credentials-addr={BOTH}", "--container-credentials-link=kf/0"],
     "--container-credentials-link", "not a link name"),
    (["--container-credentials-link=kiamfast0"],
     "--container-credentials-link", "needs --container-credentials-addr"),
    (["--container-credentials-addr=0.0.0.0:80", "--container-credentials-link=kiamfast0"],
     "--container-credentials-link", "cannot put 0.0.0.0 on a link"),
])
def test_bad_values_one_line_naming_the_flag(args, flag, why):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kiamfast: ")
    assert f"flag {flag}:" in lines[0], lines[0]
    assert why in lines[0]
