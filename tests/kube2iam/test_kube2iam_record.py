"""kube2iam's recorded behaviour, beside kiamfast's, still true of both; the deviation table
of docs/switching-from-kube2iam.md still what the record says.

The record (docs/kube2iam-record.json) is rewritten by
``python3 tests/kube2iam/kube2iam_record.py --update`` after a deliberate change.
"""
from __future__ import annotations

import pytest

import kube2iam_record as rec
from kube2iam_harness import BUILD_SCRIPT, kube2iam_binary
from deviation_reasons import FORMAT_REASONS, NOT_DELIBERATE, REASONS


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    if kube2iam_binary() is None:
        pytest.skip(f"needs kube2iam: run {BUILD_SCRIPT.relative_to(rec.REPO)}")
    return rec.run_all(tmp_path_factory.mktemp("kube2iam-record"))


def changed_cases(record: dict, answers: dict, agent: str) -> list[str]:
    recorded = {c["case"]: c[agent] for c in record["cases"]}
    return [f"{case}:\n  recorded {recorded.get(case)}\n  now      {now}"
            for case, now in answers[agent].items() if recorded.get(case) != now]


@pytest.mark.slow
@pytest.mark.timeout(900)   # the first one runs both agents under every config (~1 min idle)
@pytest.mark.parametrize("agent", ["kube2iam", "kiamfast"])
def test_each_agent_still_answers_as_recorded(answers, agent):
    record = rec.load_record()
    assert sorted(c["case"] for c in record["cases"]) == sorted(answers[agent]), \
        "the cases changed: run tests/kube2iam/kube2iam_record.py --update"
    changed = changed_cases(record, answers, agent)
    assert not changed, (f"{agent} no longer answers as recorded "
                         "(after a deliberate change: kube2iam_record.py --update):\n"
                         + "\n".join(changed))


def test_the_record_holds_every_case_once_and_the_flags_they_ran_with():
    record = rec.load_record()
    expected = [(rec.case_id(config, case), rec.CONFIGS[config], f"{case.method} {case.path}")
                for config, cases in rec.CASES.items() for case in cases]
    assert [(c["case"], c["flags"], c["request"]) for c in record["cases"]] == expected


def test_the_switching_page_table_is_the_one_generated_from_the_record():
    assert rec.page_table(rec.PAGE.read_text()) == rec.render_table(rec.load_record()), \
        f"{rec.PAGE.relative_to(rec.REPO)}'s deviation table is stale: run " \
        "tests/kube2iam/kube2iam_record.py --update"


def test_every_deviation_has_a_reason_and_every_reason_a_deviation():
    record = rec.load_record()
    differing = {c["case"] for c in rec.deviations(record)}
    explained = set(REASONS) | set(NOT_DELIBERATE)
    assert not set(REASONS) & set(NOT_DELIBERATE)
    assert sorted(differing - explained) == [], "deviations without a reason"
    assert sorted(explained - differing) == [], "reasons for cases that do not differ"
    assert sorted(set(FORMAT_REASONS) - set(rec.format_differences(record))) == [], \
        "format reasons no case shows"
    texts = [*REASONS.values(), *NOT_DELIBERATE.values(), *FORMAT_REASONS.values()]
    assert all(text.strip() for text in texts)


def own_role(config: str, pod: str) -> str | None:
    """The role ARN kube2iam's rules give ``pod`` under ``config``'s flags."""
    flags = dict(flag[2:].split("=", 1) for flag in rec.CONFIGS[config] if "=" in flag)
    base = flags.get("base-role-arn", "")
    role = rec.PODS[pod].annotations.get(flags.get("iam-role-key", rec.ROLE_KEY))
    role = role or flags.get("default-role")
    if role is None:
        return None
    return role if role.lower().startswith("arn:") else base + role


@pytest.mark.parametrize("agent", ["kube2iam", "kiamfast"])
def test_credentials_are_only_ever_for_the_asking_pods_own_role(agent):
    """The worst defect, checked on every recorded answer that carries a key from STS."""
    checked = 0
    for case in rec.load_record()["cases"]:
        body = case[agent]["body"]
        if "/iam/security-credentials" in case["request"] and isinstance(body, dict) \
                and "key issued for" in body:
            config = case["case"].split(": ", 1)[0]
            assert body["key issued for"] == own_role(config, case["from"]), case["case"]
            checked += 1
    assert checked >= 15
