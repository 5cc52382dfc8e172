"""docs/install.md's IAM policies are what kiamfast's calls need, for the example values the
page uses: the node's role may assume (and, with session tags, tag) exactly the roles under
``--base-role-arn``'s path, and a pod's role trusts the node's role for that call. The
policies are checked against what the agent sends: the role ARN it assumes for a pod's
annotation (kiamfast's own policy code), and the action botocore calls."""
from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

from kiamfast.config import Config

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "install.md").read_text()
SECTION = PAGE.split("## IAM: the pods' roles and the node's role", 1)[1].split("\n## ", 1)[0]
BASE = "arn:aws:iam::123456789012:role/k8s/"


def policies() -> list[dict]:
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)```", SECTION, re.S)]


def test_the_node_may_assume_exactly_the_roles_under_the_base_path():
    node, _ = policies()
    (statement,) = node["Statement"]
    assert statement["Effect"] == "Allow" and statement["Action"] == ["sts:AssumeRole"]
    # The ARN the agent assumes for `iam.amazonaws.com/role: my-app` with this base ARN.
    from kiamfast.control.mappings.policy import RolePolicy
    policy = RolePolicy.from_config(Config(base_role_arn=BASE))
    assumed = policy.role_arn("my-app")
    assert assumed == BASE + "my-app"
    assert fnmatch.fnmatchcase(assumed, statement["Resource"])
    assert not fnmatch.fnmatchcase("arn:aws:iam::123456789012:role/admin", statement["Resource"])
    assert f"--base-role-arn={BASE}" in " ".join(SECTION.split())


def test_a_pods_role_trusts_the_nodes_role_for_assume_role():
    _, trust = policies()
    (statement,) = trust["Statement"]
    assert statement["Effect"] == "Allow" and statement["Action"] == "sts:AssumeRole"
    assert re.fullmatch(r"arn:aws:iam::\d{12}:role/[\w+=,.@-]+", statement["Principal"]["AWS"])
    assert "sts:TagSession" in SECTION    # what --session-tags adds, said beside both
