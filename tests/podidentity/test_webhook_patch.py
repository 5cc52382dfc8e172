"""The injection webhook's answers, as the API server would apply them (no server here).

What a user checks: the pod that opts in ends up with the two variables in every container and
a read-only projected token with kiamfast's audience; nothing else changes, and nothing the
webhook cannot read stops a pod from being created.
"""
from __future__ import annotations

import base64
import copy
import json

import jsonpatch
import pytest

from kiamfast.webhook import cli as webhook_cli
from kiamfast.webhook import patch
from kiamfast.webhook import admission as webhook_review

ROLE_KEY = "iam.amazonaws.com/role"
SETTINGS = {"role_key": ROLE_KEY, "audience": "kiamfast.io/container-credentials",
            "expiration": 600}
OPTED_IN = {ROLE_KEY: "role-a", patch.OPT_IN_ANNOTATION: "true"}
TOKEN_PATH = f"{patch.MOUNT_PATH}/{patch.TOKEN_FILE}"


def pod(annotations=None, **spec):
    spec.setdefault("containers", [{"name": "app", "image": "app:test"}])
    spec.setdefault("serviceAccountName", "default")
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "annotations": annotations or {}}, "spec": spec}


def review(obj, *, operation="CREATE", kind="Pod", uid="uid-1"):
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": uid, "operation": operation, "namespace": "ns",
                                   "kind": {"group": "", "version": "v1", "kind": kind},
                                   "object": obj}}).encode()


def admitted(obj, **kw):
    """The pod as the API server stores it after the webhook's answer."""
    answer = webhook_review.review_answer(review(obj, **kw), **SETTINGS)
    assert answer["apiVersion"] == "admission.k8s.io/v1"
    assert answer["kind"] == "AdmissionReview"
    assert answer["response"]["allowed"] is True
    assert answer["response"]["uid"] == kw.get("uid", "uid-1")
    if "patch" not in answer["response"]:
        return obj
    assert answer["response"]["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(answer["response"]["patch"]))
    return jsonpatch.apply_patch(copy.deepcopy(obj), ops)


def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_every_container_of_an_opting_in_pod_gets_the_variables_and_the_token():
    original = pod(OPTED_IN,
                   initContainers=[{"name": "init", "image": "i", "env": [{"name": "A",
                                                                           "value": "1"}]}],
                   containers=[{"name": "app", "image": "a"},
                               {"name": "side", "image": "s", "volumeMounts": [
                                   {"name": "data", "mountPath": "/data"}]}],
                   volumes=[{"name": "data", "emptyDir": {}}])
    out = admitted(original)
    for c in out["spec"]["initContainers"] + out["spec"]["containers"]:
        env = env_of(c)
        assert env["AWS_CONTAINER_CREDENTIALS_FULL_URI"] == "http://169.254.170.23/v1/credentials"
        assert env["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"] == TOKEN_PATH
        assert {"name": patch.VOLUME, "mountPath": patch.MOUNT_PATH,
                "readOnly": True} in c["volumeMounts"]
    assert env_of(out["spec"]["initContainers"][0])["A"] == "1"
    assert {"name": "data", "mountPath": "/data"} in out["spec"]["containers"][1]["volumeMounts"]
    assert out["spec"]["volumes"] == [
        {"name": "data", "emptyDir": {}},
        {"name": patch.VOLUME, "projected": {"sources": [{"serviceAccountToken": {
            "audience": "kiamfast.io/container-credentials", "expirationSeconds": 600,
            "path": "token"}}]}}]


@pytest.mark.parametrize("annotations", [
    {}, {ROLE_KEY: "role-a"}, {patch.OPT_IN_ANNOTATION: "true"},
    {ROLE_KEY: "role-a", patch.OPT_IN_ANNOTATION: "yes"},
    {ROLE_KEY: "", patch.OPT_IN_ANNOTATION: "true"}])
def test_a_pod_that_does_not_opt_in_is_untouched(annotations):
    original = pod(annotations)
    assert admitted(original) == original


def test_a_pod_without_a_service_account_name_gets_no_token_the_api_server_would_refuse():
    original = pod(OPTED_IN, serviceAccountName="")
    assert admitted(original) == original


def test_a_container_with_its_own_provider_settings_is_left_alone():
    """Adding the token file beside someone else's URI would send kiamfast's token there."""
    own = {"name": "own", "image": "o",
           "env": [{"name": "AWS_CONTAINER_CREDENTIALS_FULL_URI", "value": "http://elsewhere"}]}
    out = admitted(pod(OPTED_IN, containers=[own, {"name": "app", "image": "a"}]))
    assert out["spec"]["containers"][0] == own
    assert env_of(out["spec"]["containers"][1])["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"] \
        == TOKEN_PATH


def test_null_lists_are_replaced_not_appended_to():
    """A patch the API server cannot apply fails the pod's creation, whatever failurePolicy."""
    out = admitted(pod(OPTED_IN, containers=[{"name": "app", "env": None,
                                              "volumeMounts": None}], volumes=None))
    assert env_of(out["spec"]["containers"][0])["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"] \
        == TOKEN_PATH
    assert [v["name"] for v in out["spec"]["volumes"]] == [patch.VOLUME]


def test_a_pod_already_injected_is_not_changed_again():
    once = admitted(pod(OPTED_IN))
    assert admitted(once) == once


def test_only_pod_creations_are_patched():
    original = pod(OPTED_IN)
    assert admitted(original, operation="UPDATE") == original
    assert admitted(original, kind="Deployment") == original


@pytest.mark.parametrize("body", [
    b"", b"not json", b"[]", b'{"request": {}}', b'{"request": {"uid": 7}}',
    review({"metadata": ["x"]}), review({"metadata": {"annotations": ["x"]}}),
    review(pod(OPTED_IN, containers="app")),
    review(pod(OPTED_IN, containers=[{"name": "app", "env": {"A": "1"}}])),
    review(None)])
def test_a_review_it_cannot_read_admits_without_a_patch_and_says_so(body, caplog):
    answer = webhook_review.review_answer(body, **SETTINGS)
    assert answer["kind"] == "AdmissionReview"
    assert answer["response"]["allowed"] is True
    assert "patch" not in answer["response"]
    assert "not understood" in caplog.text


def test_token_expiration_below_the_api_minimum_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        webhook_cli.parse_args(["--tls-cert", "c", "--tls-key", "k", "--token-expiration", "599"])
    assert e.value.code == 2
    assert "at least 600" in capsys.readouterr().err


# ---- --service-account-opt-in: the pod's ServiceAccount opts it in -----------------------

class Accounts:
    """What ``AccountAnnotations.get`` answers, by (namespace, name); records the asks."""

    def __init__(self, annotations=None):
        self.annotations = annotations        # None: the read failed
        self.asked = []

    def get(self, namespace, name):
        self.asked.append((namespace, name))
        return self.annotations


def admitted_with(obj, accounts):
    answer = webhook_review.review_answer(review(obj), accounts=accounts, **SETTINGS)
    assert answer["response"]["allowed"] is True
    if "patch" not in answer["response"]:
        return obj
    return jsonpatch.apply_patch(copy.deepcopy(obj),
                                 json.loads(base64.b64decode(answer["response"]["patch"])))


def injected(obj):
    return any(v["name"] == patch.VOLUME for v in obj["spec"].get("volumes") or [])


@pytest.mark.parametrize("annotations", [None, {}, {"other": "x"}])
def test_a_pod_of_an_opted_in_account_gets_the_accounts_role_and_the_injection(annotations):
    accounts = Accounts(OPTED_IN)
    original = pod(annotations, serviceAccountName="app")
    if annotations is None:
        del original["metadata"]["annotations"]
    out = admitted_with(original, accounts)
    assert accounts.asked == [("ns", "app")]      # the request's namespace, the pod's account
    assert out["metadata"]["annotations"] == {**(annotations or {}), ROLE_KEY: "role-a"}
    assert patch.OPT_IN_ANNOTATION not in out["metadata"]["annotations"]
    assert env_of(out["spec"]["containers"][0])["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"] \
        == TOKEN_PATH
    assert injected(out)


def test_a_role_key_with_a_slash_is_escaped_in_the_patch():
    settings = {**SETTINGS, "role_key": "example.com/role~x"}
    accounts = Accounts({"example.com/role~x": "role-b", patch.OPT_IN_ANNOTATION: "true"})
    original = pod({"keep": "1"})
    answer = webhook_review.review_answer(review(original), accounts=accounts, **settings)
    out = jsonpatch.apply_patch(original, json.loads(base64.b64decode(
        answer["response"]["patch"])))
    assert out["metadata"]["annotations"] == {"keep": "1", "example.com/role~x": "role-b"}


@pytest.mark.parametrize("own, account, role", [
    ({ROLE_KEY: "own-role"}, OPTED_IN, "own-role"),                  # the pod's role wins
    ({patch.OPT_IN_ANNOTATION: "true"}, {ROLE_KEY: "role-a"}, "role-a"),
    ({ROLE_KEY: "own-role"}, {patch.OPT_IN_ANNOTATION: "true"}, "own-role"),
    ({patch.OPT_IN_ANNOTATION: "false"}, OPTED_IN, None),           # the pod opts out
    ({patch.OPT_IN_ANNOTATION: "no"}, OPTED_IN, None),              # only "true" opts in
    ({ROLE_KEY: ""}, OPTED_IN, None),                                 # its own empty role
    ({}, {ROLE_KEY: "role-a"}, None),                                 # the account: no opt-in
    ({}, {patch.OPT_IN_ANNOTATION: "true"}, None),                  # ... no role
    ({}, {ROLE_KEY: "role-a", patch.OPT_IN_ANNOTATION: "True"}, None)])
def test_the_pods_own_annotations_win_over_its_accounts(own, account, role):
    out = admitted_with(pod(own), Accounts(account))
    assert injected(out) == (role is not None)
    assert out["metadata"]["annotations"].get(ROLE_KEY) == (role or own.get(ROLE_KEY))


@pytest.mark.parametrize("own", [OPTED_IN, {patch.OPT_IN_ANNOTATION: "false"},
                                 {ROLE_KEY: "r", patch.OPT_IN_ANNOTATION: "false"},
                                 {patch.OPT_IN_ANNOTATION: "yes"},
                                 {ROLE_KEY: "", patch.OPT_IN_ANNOTATION: "true"}])
def test_the_account_is_not_read_when_the_pod_decides(own):
    accounts = Accounts(OPTED_IN)
    admitted_with(pod(own), accounts)
    assert accounts.asked == []


@pytest.mark.parametrize("own", [{}, {ROLE_KEY: "r"}, {patch.OPT_IN_ANNOTATION: "true"}])
def test_the_account_is_read_when_the_pod_leaves_an_annotation_to_it(own):
    accounts = Accounts({})
    admitted_with(pod(own), accounts)
    assert accounts.asked == [("ns", "default")]


def test_an_account_that_cannot_be_read_opts_nobody_in():
    original = pod({ROLE_KEY: "role-a"})
    assert admitted_with(original, Accounts(None)) == original
    assert admitted_with(pod(OPTED_IN), Accounts(None))["spec"]["volumes"]   # its own opt-in


def test_without_the_flag_no_account_is_read_and_the_pod_annotation_alone_opts_in():
    original = pod({}, serviceAccountName="app")
    assert admitted(original) == original       # review_answer without accounts


def test_a_pod_whose_containers_all_bring_their_own_settings_gets_no_role_either():
    own = {"name": "own", "image": "o",
           "env": [{"name": "AWS_CONTAINER_CREDENTIALS_FULL_URI", "value": "http://elsewhere"}]}
    original = pod({}, containers=[own])
    assert admitted_with(original, Accounts(OPTED_IN)) == original


def test_reinvoked_after_injection_nothing_changes_again():
    accounts = Accounts(OPTED_IN)
    once = admitted_with(pod({}), accounts)
    assert admitted_with(once, accounts) == once


def test_the_flags_parse():
    args = webhook_cli.parse_args(["--tls-cert", "c", "--tls-key", "k"])
    assert args.service_account_opt_in is False and args.kubeconfig == ""
    args = webhook_cli.parse_args(["--tls-cert", "c", "--tls-key", "k", "--service-account-opt-in",
                               "--kubeconfig", "/k"])
    assert args.service_account_opt_in is True and args.kubeconfig == "/k"


def test_a_kubeconfig_that_does_not_load_is_a_one_line_error(capsys, tmp_path):
    missing = tmp_path / "missing"
    assert webhook_cli.main(["--tls-cert", "c", "--tls-key", "k", "--service-account-opt-in",
                         "--kubeconfig", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--kubeconfig {missing}" in err


def test_without_in_cluster_credentials_a_read_fails_and_the_pod_opt_in_still_works(
        monkeypatch, caplog):
    """Outside a pod (no KUBERNETES_SERVICE_HOST): the webhook is not down for it."""
    from kiamfast.webhook import accounts
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cache = accounts.AccountAnnotations(accounts.service_account_read(
        accounts.api_client))
    assert admitted_with(pod({}), cache) == pod({})
    assert "cannot read ServiceAccounts" in caplog.text
    assert injected(admitted_with(pod(OPTED_IN), cache))
