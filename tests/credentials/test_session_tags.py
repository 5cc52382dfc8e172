"""Session tags and per-pod session names against moto's STS server (behind the fault proxy).

What STS received is read from the proxy's record of each AssumeRole call (moto does not
echo tags back); the session name is also checked the way a user would: GetCallerIdentity
with the credentials the pod got names ``assumed-role/<role>/<session name>``.

moto does not evaluate trust policies, so "the trust policy lacks sts:TagSession" is the
proxy answering STS's own AccessDenied error document (HTTP 403, ``ErrorResponse``) instead
of forwarding the call; what the agent does with it does not depend on STS's message.
"""
from __future__ import annotations

import asyncio
import logging

import boto3
import pytest

from kiamfast import table as tbl
from kiamfast.config import Config, ConfigError
from kiamfast.container_credentials.token_review import TokenRejected
from kiamfast.container_credentials.pod_view import container_document
from kiamfast import credential_parts
from kiamfast.control.iam.manager import CredentialManager

from test_manager import _slots, settle

UID_A = "3f2b9c1e-7d4a-4c2b-9a1e-0b5c6d7e8f90"
UID_B = "a1b2c3d4-0000-4000-8000-000000000001"
EKS_KEYS = {"eks-cluster-name", "kubernetes-namespace", "kubernetes-service-account",
            "kubernetes-pod-name", "kubernetes-pod-uid"}


def eks(h, **kwargs):
    kwargs.setdefault("session_tags", True)
    return h.manager(tag_keys="eks", cluster_name="prod-1", **kwargs)


def caller_arn(moto_sts, document: dict) -> str:
    client = boto3.client("sts", region_name="us-east-1", endpoint_url=moto_sts.url,
                          aws_access_key_id=document["AccessKeyId"],
                          aws_secret_access_key=document["SecretAccessKey"],
                          aws_session_token=document["Token"])
    return client.get_caller_identity()["Arn"]


def test_eks_keys_tag_the_call_and_name_the_session_after_the_pod(h, moto_sts):
    async def main():
        async with eks(h) as mgr:
            slot = mgr.acquire(UID_A, h.req("app", pod="web-0", namespace="shop", sa="web"))
            await h.wait_state(slot, tbl.CRED_READY)
            return slot

    slot = h.run(main())
    (call,) = h.proxy.assume_role_calls()
    assert call.tags == {"eks-cluster-name": "prod-1", "kubernetes-namespace": "shop",
                         "kubernetes-service-account": "web", "kubernetes-pod-name": "web-0",
                         "kubernetes-pod-uid": UID_A}
    transitive = {v for k, v in call.params.items() if k.startswith("TransitiveTagKeys.member.")}
    assert transitive == EKS_KEYS            # kept through role chaining, as EKS sends them
    assert call.session_name == "eks-prod-1-web-0-3f2b9c1e"
    assert caller_arn(moto_sts, h.document(slot)).endswith(
        "assumed-role/app/eks-prod-1-web-0-3f2b9c1e")


def test_two_pods_of_one_role_get_two_sessions(h, moto_sts):
    async def main():
        async with eks(h) as mgr:
            a = mgr.acquire(UID_A, h.req("app", pod="web-0", namespace="shop"))
            b = mgr.acquire(UID_B, h.req("app", pod="web-1", namespace="shop"))
            for s in (a, b):
                await h.wait_state(s, tbl.CRED_READY)
            return a, b

    a, b = h.run(main())
    assert a != b
    calls = h.proxy.assume_role_calls()
    assert sorted(c.tags["kubernetes-pod-uid"] for c in calls) == sorted([UID_A, UID_B])
    arns = {caller_arn(moto_sts, h.document(s)) for s in (a, b)}
    assert {arn.rsplit("/", 1)[1] for arn in arns} == {"eks-prod-1-web-0-3f2b9c1e",
                                                       "eks-prod-1-web-1-a1b2c3d4"}


def test_a_restart_adopts_each_pods_session_without_a_call(h):
    async def main():
        async with eks(h) as first:
            slots = [first.acquire(uid, h.req("app", pod=pod))
                     for uid, pod in ((UID_A, "web-0"), (UID_B, "web-1"))]
            for s in slots:
                await h.wait_state(s, tbl.CRED_READY)
        before = [h.document(s) for s in slots]
        calls = len(h.proxy.assume_role_calls())
        async with eks(h) as second:                # a new control process, same table
            assert second.adopt(_slots(h.table)) == 2
            again = [second.acquire(uid, h.req("app", pod=pod))
                     for uid, pod in ((UID_A, "web-0"), (UID_B, "web-1"))]
            await settle(second)
        return slots, again, before, [h.document(s) for s in again], calls

    slots, again, before, after, calls = h.run(main())
    assert again == slots and after == before
    assert len(h.proxy.assume_role_calls()) == calls


def test_long_pod_names_keep_the_uid_in_a_64_character_name(h):
    pod = "p" * 200

    async def main():
        async with eks(h) as mgr:
            await h.wait_state(mgr.acquire(UID_A, h.req("app", pod=pod)), tbl.CRED_READY)

    h.run(main())
    (call,) = h.proxy.assume_role_calls()
    assert len(call.session_name) == 64 and call.session_name.endswith("-3f2b9c1e")
    assert call.tags["kubernetes-pod-name"] == pod        # the tag keeps the whole name


def test_without_a_cluster_name_no_cluster_tag_is_sent(h):
    async def main():
        async with h.manager(session_tags=True, tag_keys="eks") as mgr:
            await h.wait_state(mgr.acquire(UID_A, h.req("app", pod="web-0")), tbl.CRED_READY)

    h.run(main())
    (call,) = h.proxy.assume_role_calls()
    assert set(call.tags) == EKS_KEYS - {"eks-cluster-name"}
    assert call.session_name == "eks-web-0-3f2b9c1e"


def test_default_keys_are_unchanged(h):
    async def main():
        async with h.manager(session_tags=True) as mgr:
            a = mgr.acquire(UID_A, h.req("app", pod="web-0"))
            b = mgr.acquire(UID_B, h.req("app", pod="web-0"))   # same name, same tags
            await h.wait_state(a, tbl.CRED_READY)
            return a, b

    a, b = h.run(main())
    assert a == b
    (call,) = h.proxy.assume_role_calls()
    assert call.tags == {"kiamfast-namespace": "ns", "kiamfast-pod": "web-0",
                         "kiamfast-serviceaccount": "default", "kiamfast-node": "node-1"}
    assert call.session_name == "node-1-app"
    assert not any(k.startswith("TransitiveTagKeys") for k in call.params)


def test_a_tag_value_sts_cannot_take_denies_that_pod_without_a_call(h, caplog):
    caplog.set_level(logging.WARNING, logger="kiamfast.credentials")

    async def main():
        async with eks(h) as mgr:
            bad = mgr.acquire(UID_A, h.req("app", pod="web-0", sa="a" * 300))
            good = mgr.acquire(UID_B, h.req("app", pod="web-1"))
            await h.wait_state(good, tbl.CRED_READY)
            mgr.wanted(bad)
            await settle(mgr)
            return bad, good

    bad, good = h.run(main())
    assert [c.tags["kubernetes-pod-uid"] for c in h.proxy.assume_role_calls()] == [UID_B]
    document = h.document(bad)
    assert document["Code"] == credential_parts.ERROR_CODE
    assert "InvalidSessionTag" in document["Message"]
    assert "kubernetes-service-account" in document["Message"]
    assert any("web-0" in r.getMessage() and "kubernetes-service-account" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(TokenRejected) as refused:      # the container-credentials answer
        container_document(credential_parts.parse_response(
            h.state(bad)[2][tbl.PART_DOCUMENT])[2], h.role("app"))
    assert refused.value.status == 403 and "InvalidSessionTag" in refused.value.message


def test_sts_refusing_tags_is_denied_with_the_tagsession_hint_never_untagged(h, caplog):
    caplog.set_level(logging.WARNING, logger="kiamfast.credentials")
    h.proxy.add_fault("deny")

    async def main():
        async with eks(h, error_ttl=0.0, error_ttl_floor=0.05, error_ttl_max=0.05) as mgr:
            slot = mgr.acquire(UID_A, h.req("app", pod="web-0"))
            await h.wait_state(slot, tbl.CRED_READY)
            await asyncio.sleep(0.5)    # retried as any refusal while the pod lives: tagged
            return slot

    slot = h.run(main())
    calls = h.proxy.assume_role_calls()
    assert len(calls) >= 2 and all(set(c.tags) == EKS_KEYS for c in calls)
    assert all(c.outcome == "deny" for c in calls)
    message = h.document(slot)["Message"]
    assert "AccessDenied" in message and "sts:TagSession" in message
    assert any("sts:TagSession" in r.getMessage() for r in caplog.records)
    with pytest.raises(TokenRejected) as refused:
        container_document(credential_parts.parse_response(
            h.state(slot)[2][tbl.PART_DOCUMENT])[2], h.role("app"))
    assert refused.value.status == 403 and "sts:TagSession" in refused.value.message


def test_untagged_refusals_say_nothing_of_tagsession(h):
    h.proxy.add_fault("deny")

    async def main():
        async with h.manager() as mgr:
            slot = mgr.acquire(UID_A, h.req("app"))
            await h.wait_state(slot, tbl.CRED_READY)
            return slot

    slot = h.run(main())
    assert "TagSession" not in h.document(slot)["Message"]


# ---- flags ---------------------------------------------------------------------------------

def test_flags_reach_the_manager(h):
    config = Config(node="node-1", session_tags=True, session_tag_keys="eks",
                    cluster_name="prod-1")

    async def main():
        mgr = CredentialManager.from_config(config, table=h.table, sts=h.sts,
                                            notify=h.notify)
        return mgr.naming.tags, mgr.naming.key_for(h.req("app", pod="web-0"), UID_A)

    tags, key = h.run(main())
    assert set(tags) == EKS_KEYS
    assert dict(key.tags)["kubernetes-pod-uid"] == UID_A


@pytest.mark.parametrize("kwargs, flag", [
    (dict(session_tag_keys="eks"), "session-tag-keys"),
    (dict(session_tags=True, session_tag_keys="eks", session_name_policy="pod"),
     "session-name-policy"),
    (dict(cluster_name="prod,1"), "cluster-name"),
    (dict(cluster_name="x" * 257), "cluster-name"),
])
def test_bad_combinations_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError) as err:
        Config(**kwargs)
    assert err.value.flag == flag and "\n" not in str(err.value)
