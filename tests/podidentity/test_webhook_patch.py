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

from kiamfast.container_credentials import webhook

ROLE_KEY = "iam.amazonaws.com/role"
SETTINGS = {"role_key": ROLE_KEY, "audience": "kiamfast.io/container-credentials",
            "expiration": 600}
OPTED_IN = {ROLE_KEY: "role-a", webhook.OPT_IN_ANNOTATION: "true"}
TOKEN_PATH = f"{webhook.MOUNT_PATH}/{webhook.TOKEN_FILE}"


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
    answer = webhook.review_answer(review(obj, **kw), **SETTINGS)
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
        assert {"name": webhook.VOLUME, "mountPath": webhook.MOUNT_PATH,
                "readOnly": True} in c["volumeMounts"]
    assert env_of(out["spec"]["initContainers"][0])["A"] == "1"
    assert {"name": "data", "mountPath": "/data"} in out["spec"]["containers"][1]["volumeMounts"]
    assert out["spec"]["volumes"] == [
        {"name": "data", "emptyDir": {}},
        {"name": webhook.VOLUME, "projected": {"sources": [{"serviceAccountToken": {
            "audience": "kiamfast.io/container-credentials", "expirationSeconds": 600,
            "path": "token"}}]}}]


@pytest.mark.parametrize("annotations", [
    {}, {ROLE_KEY: "role-a"}, {webhook.OPT_IN_ANNOTATION: "true"},
    {ROLE_KEY: "role-a", webhook.OPT_IN_ANNOTATION: "yes"},
    {ROLE_KEY: "", webhook.OPT_IN_ANNOTATION: "true"}])
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
    assert [v["name"] for v in out["spec"]["volumes"]] == [webhook.VOLUME]


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
    answer = webhook.review_answer(body, **SETTINGS)
    assert answer["kind"] == "AdmissionReview"
    assert answer["response"]["allowed"] is True
    assert "patch" not in answer["response"]
    assert "not understood" in caplog.text


def test_token_expiration_below_the_api_minimum_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        webhook.parse_args(["--tls-cert", "c", "--tls-key", "k", "--token-expiration", "599"])
    assert e.value.code == 2
    assert "at least 600" in capsys.readouterr().err
