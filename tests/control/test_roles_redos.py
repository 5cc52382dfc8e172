"""A pod author must not be able to stall role decisions (issue 15, ReDoS).

The role annotation is the pod author's text; the namespace patterns are the namespace
owner's.  With a backtracking engine, `([a-z-]+)+-prod` takes seconds on 55 characters and
`.*-.*-prod` grows with the square of the annotation, and every decision runs on the
control process's event loop.  Here each decision runs in a child process with a deadline,
so an engine that backtracks fails the test instead of hanging it; the decision's own time
is measured inside the child.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from kiamfast.control.mappings.policy import RolePolicy
from kiamfast.decisions import IdentityKind

BASE = "arn:aws:iam::123456789012:role/"
ROLE_KEY = "iam.amazonaws.com/role"
NS_KEY = "iam.amazonaws.com/allowed-roles"
PERMITTED_KEY = "iam.amazonaws.com/permitted"
MAX_ROLE_ARN_LENGTH = 2048   # STS: RoleArn is at most 2,048 characters
DEADLINE_S = 20.0          # for the whole child process, imports included
DECISION_BOUND_S = 0.050   # generous: RE2 takes well under a millisecond here

TIMED_DECISION = r"""
import json, sys, time
from kiamfast.control.mappings.policy import RolePolicy
args = json.loads(sys.argv[1])
policy = RolePolicy(**args["policy"])
rules = policy.namespace_rules("team", args["namespace"])
start = time.perf_counter()
identity = policy.decide({"iam.amazonaws.com/role": args["role"]}, rules,
                         namespace="team", pod="attacker")
print(json.dumps({"kind": identity.kind.name, "reason": identity.reason,
                  "seconds": time.perf_counter() - start}))
"""


def timed_decision(*, policy: dict, namespace: dict, role: str) -> dict:
    """Decide in a child process; a decision that does not end within the deadline fails."""
    args = json.dumps({"policy": policy, "namespace": namespace, "role": role})
    try:
        done = subprocess.run([sys.executable, "-c", TIMED_DECISION, args],
                              capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a decision on a {len(role)}-character role took over {DEADLINE_S} s")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def role_of_length(n: int, *, suffix: str = "x") -> str:
    """A role name whose ARN (base + name) is exactly `n` characters: `a-a-a-...<suffix>`."""
    body = n - len(BASE) - len(suffix)
    return ("a-" * n)[:body] + suffix


REGEXP = {"base_role_arn": BASE, "namespace_restrictions": True,
          "namespace_restriction_format": "regexp"}
PERMITTED = {"base_role_arn": BASE, "permitted_key": PERMITTED_KEY}


@pytest.mark.parametrize("policy,namespace", [
    (REGEXP, {NS_KEY: '["([a-z-]+)+-prod"]'}),
    (REGEXP, {NS_KEY: '[".*-.*-prod"]'}),
    (PERMITTED, {PERMITTED_KEY: BASE + "([a-z-]+)+-prod"}),
], ids=["nested-plus", "dot-star-twice", "kiam-permitted"])
def test_pathological_patterns_on_a_2kb_role_decide_fast(policy, namespace):
    denied = timed_decision(policy=policy, namespace=namespace,
                            role=role_of_length(MAX_ROLE_ARN_LENGTH))
    assert denied["kind"] == "DENIED"
    assert denied["seconds"] < DECISION_BOUND_S
    # Same pattern, a role it does allow: matching still means what it meant.
    allowed = timed_decision(policy=policy, namespace=namespace,
                             role=role_of_length(MAX_ROLE_ARN_LENGTH, suffix="-prod"))
    assert allowed["kind"] == "ROLE"
    assert allowed["seconds"] < DECISION_BOUND_S


def test_a_32kb_annotation_is_denied_without_matching():
    """`.*` allows every role, so a denial can only come from the length cap."""
    result = timed_decision(policy=REGEXP, namespace={NS_KEY: '[".*"]'},
                            role=role_of_length(32 * 1024))
    assert result["kind"] == "DENIED"
    assert "longer than 2048" in result["reason"]
    assert result["seconds"] < DECISION_BOUND_S


def test_the_cap_is_stss_limit_exactly():
    p = RolePolicy(**REGEXP)
    rules = p.namespace_rules("team", {NS_KEY: '[".*"]'})
    at_limit = p.decide({ROLE_KEY: role_of_length(MAX_ROLE_ARN_LENGTH)}, rules)
    assert at_limit.kind == IdentityKind.ROLE and len(at_limit.role_arn) == 2048
    over = p.decide({ROLE_KEY: role_of_length(MAX_ROLE_ARN_LENGTH + 1)}, rules)
    assert over.kind == IdentityKind.DENIED


def test_the_log_line_names_the_pod_and_length_not_the_annotation(caplog):
    p = RolePolicy(**REGEXP)
    role = role_of_length(32 * 1024)
    with caplog.at_level(logging.WARNING, logger="kiamfast.control.mappings.policy"):
        p.decide({ROLE_KEY: role}, p.namespace_rules("team", {NS_KEY: '[".*"]'}),
                 namespace="team", pod="attacker")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "team/attacker" in lines[0] and str(len(BASE + role)) in lines[0]
    assert "a-a-a-a-a-a-a-a-" not in lines[0]


def test_a_pattern_re2_rejects_is_logged_and_skipped(caplog):
    p = RolePolicy(**REGEXP)
    with caplog.at_level(logging.ERROR, logger="kiamfast.control.mappings.policy"):
        rules = p.namespace_rules("team", {NS_KEY: '["(a)\\\\1", "(?=x)y", "app"]'})
    assert caplog.text.count("skipping") == 2
    assert len(rules.allowed_regexps) == 1
    assert p.decide({ROLE_KEY: "app"}, rules).kind == IdentityKind.ROLE
    assert p.decide({ROLE_KEY: "aa"}, rules).kind == IdentityKind.DENIED
