"""Role normalisation and namespace policy: kube2iam's semantics, and where we differ on purpose."""
import logging
import re
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiamfast.control.mappings.patterns import (GoRegexpError, compile_go_regexp, go_glob,
                                           translate_go_regexp)
from kiamfast.control.mappings.policy import InvalidBaseArn, RolePolicy
from kiamfast.decisions import NO_ROLE, IdentityKind, PodIdentity

BASE = "arn:aws:iam::123456789012:role/"
ROLE_KEY = "iam.amazonaws.com/role"
EXT_KEY = "iam.amazonaws.com/external-id"
NS_KEY = "iam.amazonaws.com/allowed-roles"


def ns(policy, annotations, name="team"):
    return policy.namespace_rules(name, annotations)


# ---- normalisation -------------------------------------------------------------------------

def test_base_arn_gets_a_trailing_slash():
    assert RolePolicy(base_role_arn="arn:aws:iam::123456789012:role").base_role_arn == BASE
    assert RolePolicy(base_role_arn=BASE).base_role_arn == BASE


@pytest.mark.parametrize("bad", ["arn:aws:iam::123:user/", "role/", "arn:aws:iam::abc:role/",
                                 "arn:aws:s3:::bucket"])
def test_invalid_base_arn_is_refused(bad):
    with pytest.raises(InvalidBaseArn):
        RolePolicy(base_role_arn=bad)


def test_role_names_are_relative_to_the_base_arn_and_full_arns_verbatim():
    p = RolePolicy(base_role_arn=BASE)
    assert p.role_arn("app") == BASE + "app"
    assert p.role_arn("team/app") == BASE + "team/app"
    other = "arn:aws:iam::999999999999:role/x"
    assert p.role_arn(other) == other
    assert p.role_arn("ARN:aws:iam::999999999999:role/x") == "ARN:aws:iam::999999999999:role/x"


def test_pod_with_role_annotation_gets_it_with_external_id():
    p = RolePolicy(base_role_arn=BASE)
    assert p.decide({ROLE_KEY: "app", EXT_KEY: "xyz"}, None) == PodIdentity.role(BASE + "app", "xyz")
    assert p.decide({ROLE_KEY: "app"}, None) == PodIdentity.role(BASE + "app", "")


def test_custom_annotation_keys():
    p = RolePolicy(base_role_arn=BASE, role_key="r", external_id_key="e")
    assert p.decide({"r": "app", "e": "1"}, None) == PodIdentity.role(BASE + "app", "1")
    assert p.decide({ROLE_KEY: "app"}, None) == NO_ROLE


def test_unannotated_pod_without_default_role_has_no_role():
    assert RolePolicy().decide({}, None) == NO_ROLE


def test_base_arn_without_default_role_is_no_role_not_the_bare_base_arn():
    # kube2iam maps such a pod to the bare base ARN and lists it as an empty 200 body,
    # which every SDK treats as a failure; kiamfast answers 404 (NO_ROLE).
    p = RolePolicy(base_role_arn=BASE)
    assert p.default_role_arn == ""
    assert p.decide({}, None) == NO_ROLE


def test_default_role_applies_to_unannotated_pods():
    p = RolePolicy(base_role_arn=BASE, default_role="fallback")
    assert p.default_role_arn == BASE + "fallback"
    assert p.decide({EXT_KEY: "e"}, None) == PodIdentity.role(BASE + "fallback", "e")


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_role_annotation_is_denied_not_defaulted(value, caplog):
    p = RolePolicy(base_role_arn=BASE, default_role="fallback")
    with caplog.at_level(logging.WARNING):
        ident = p.decide({ROLE_KEY: value}, None, namespace="ns", pod="p")
    assert ident.kind == IdentityKind.DENIED
    assert "ns/p" in caplog.text


def test_bare_role_name_without_base_arn_is_denied():
    ident = RolePolicy().decide({ROLE_KEY: "app"}, None)
    assert ident.kind == IdentityKind.DENIED


def test_annotation_whitespace_is_ignored():
    p = RolePolicy(base_role_arn=BASE)
    assert p.decide({ROLE_KEY: " app\n"}, None) == PodIdentity.role(BASE + "app")


def test_listing_name_strips_the_base_arn_only_when_under_it():
    p = RolePolicy(base_role_arn=BASE)
    assert p.listing_name(BASE + "team/app") == "team/app"
    assert p.listing_name("arn:aws:iam::999999999999:role/x") == "arn:aws:iam::999999999999:role/x"


# ---- namespace restrictions: glob ------------------------------------------------------------

def restricted(fmt="glob", **kw):
    return RolePolicy(base_role_arn=BASE, namespace_restrictions=True,
                      namespace_restriction_format=fmt, **kw)


def test_glob_allows_listed_and_denies_others():
    p = restricted()
    rules = ns(p, {NS_KEY: '["role-a", "my-path/*"]'})
    assert p.decide({ROLE_KEY: "role-a"}, rules).kind == IdentityKind.ROLE
    assert p.decide({ROLE_KEY: "my-path/deep/x"}, rules).kind == IdentityKind.ROLE
    assert p.decide({ROLE_KEY: "role-ab"}, rules).kind == IdentityKind.DENIED
    assert p.decide({ROLE_KEY: "other"}, rules).kind == IdentityKind.DENIED


def test_glob_entries_for_other_accounts_must_be_full_arns():
    p = restricted()
    other = "arn:aws:iam::999999999999:role/x"
    assert p.decide({ROLE_KEY: other}, ns(p, {NS_KEY: '["x"]'})).kind == IdentityKind.DENIED
    assert p.decide({ROLE_KEY: other}, ns(p, {NS_KEY: f'["{other}"]'})).kind == IdentityKind.ROLE


def test_glob_question_mark_and_brackets_are_literal():
    p = restricted()
    rules = ns(p, {NS_KEY: '["a?c", "[ab]"]'})
    assert p.decide({ROLE_KEY: "abc"}, rules).kind == IdentityKind.DENIED
    assert p.decide({ROLE_KEY: "a"}, rules).kind == IdentityKind.DENIED


def test_default_role_is_always_allowed():
    p = restricted(default_role="fallback")
    rules = ns(p, {NS_KEY: "[]"})
    assert p.decide({}, rules) == PodIdentity.role(BASE + "fallback")
    assert p.decide({ROLE_KEY: "fallback"}, rules).kind == IdentityKind.ROLE
    assert p.decide({}, None).kind == IdentityKind.ROLE


@pytest.mark.parametrize("raw", ["not json", '{"a": 1}', '"role-a"', '["role-a", 1]', "null", ""])
def test_invalid_or_missing_allowed_roles_allow_nothing(raw, caplog):
    p = restricted()
    rules = ns(p, {NS_KEY: raw})
    assert p.decide({ROLE_KEY: "role-a"}, rules).kind == IdentityKind.DENIED


def test_unknown_namespace_is_denied_and_says_so():
    ident = restricted().decide({ROLE_KEY: "role-a"}, None, namespace="gone")
    assert ident.kind == IdentityKind.DENIED and ident.namespace_unknown


def test_without_restrictions_namespace_annotations_do_not_matter():
    p = RolePolicy(base_role_arn=BASE)
    assert p.decide({ROLE_KEY: "x"}, ns(p, {NS_KEY: "[]"})).kind == IdentityKind.ROLE
    assert p.decide({ROLE_KEY: "x"}, None).kind == IdentityKind.ROLE


def test_format_is_case_insensitive_and_anything_else_is_glob():
    assert restricted("RegExp").regexp_format
    assert not restricted("weird").regexp_format


# ---- namespace restrictions: regexp ------------------------------------------------------------

def test_regexp_is_unanchored_like_go_matchstring():
    p = restricted("regexp")
    rules = ns(p, {NS_KEY: '["role/foo"]'})   # normalised: BASE + "role/foo"
    assert p.decide({ROLE_KEY: "role/foobar"}, rules).kind == IdentityKind.ROLE
    rules = ns(p, {NS_KEY: '["arn:aws:iam::123456789012:role/app-.*"]'})
    assert p.decide({ROLE_KEY: "app-x"}, rules).kind == IdentityKind.ROLE
    assert p.decide({ROLE_KEY: "other"}, rules).kind == IdentityKind.DENIED


def test_bad_regexp_is_skipped_with_a_log_and_the_rest_still_apply(caplog):
    p = restricted("regexp")
    with caplog.at_level(logging.ERROR):
        rules = ns(p, {NS_KEY: '["(unclosed", "(?=look)", "good"]'})
    assert "skipping" in caplog.text
    assert len(rules.allowed_regexps) == 1
    assert p.decide({ROLE_KEY: "good"}, rules).kind == IdentityKind.ROLE
    assert p.decide({ROLE_KEY: "unclosed"}, rules).kind == IdentityKind.DENIED


# ---- kiam's permitted annotation ---------------------------------------------------------------

def test_permitted_is_anchored_on_the_full_arn():
    p = RolePolicy(base_role_arn=BASE, permitted_key="iam.amazonaws.com/permitted")
    rules = ns(p, {"iam.amazonaws.com/permitted": "arn:aws:iam::123456789012:role/app-.*"})
    assert p.decide({ROLE_KEY: "app-1"}, rules).kind == IdentityKind.ROLE
    rules = ns(p, {"iam.amazonaws.com/permitted": "app-.*"})
    assert p.decide({ROLE_KEY: "app-1"}, rules).kind == IdentityKind.DENIED


def test_permitted_missing_or_bad_permits_nothing_but_the_default():
    p = RolePolicy(base_role_arn=BASE, default_role="d", permitted_key="k")
    assert p.decide({ROLE_KEY: "x"}, ns(p, {})).kind == IdentityKind.DENIED
    assert p.decide({ROLE_KEY: "x"}, ns(p, {"k": "(bad"})).kind == IdentityKind.DENIED
    assert p.decide({}, ns(p, {})) == PodIdentity.role(BASE + "d")


def test_both_policies_must_allow():
    p = RolePolicy(base_role_arn=BASE, namespace_restrictions=True, permitted_key="k")
    both = ns(p, {NS_KEY: '["a", "b"]', "k": ".*/a"})
    assert p.decide({ROLE_KEY: "a"}, both).kind == IdentityKind.ROLE
    assert p.decide({ROLE_KEY: "b"}, both).kind == IdentityKind.DENIED


# ---- go-glob and the RE2 translation -------------------------------------------------------------

def glob_as_regex(pattern, subject):
    if "*" not in pattern:
        return pattern == subject
    rx = "".join(".*" if c == "*" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, subject, re.DOTALL) is not None


@settings(max_examples=500)
@given(st.text(alphabet="ab*/", max_size=8), st.text(alphabet="ab/", max_size=8))
def test_go_glob_is_a_star_only_anchored_match(pattern, subject):
    assert go_glob(pattern, subject) == glob_as_regex(pattern, subject)


@pytest.mark.parametrize("go,subject,expected", [
    ("(?i)role/APP", "arn:role/app", True),
    ("a(?i)b|c", "C", True),           # flags run to the end of the group, across |
    ("a(?i)b|c", "aB", True),
    ("(a(?i)b)c", "aBC", False),       # ...but not past the group's end
    ("(a(?i)b)c", "aBc", True),
    ("x{,3}", "x{,3}", True),          # not a repetition in RE2: literal
    ("x{,3}", "xxx", False),
    ("^[[:alpha:]]+$", "abc", True),
    ("^[[:alpha:]]+$", "ab1", False),
    ("\\Qa.b\\E", "a.b", True),
    ("\\Qa.b\\E", "axb", False),
    ("end\\z", "the end", True),
    ("\\x{41}", "A", True),
    ("(?P<n>a)(?<m>b)", "ab", True),
    ("[]a]", "]", True),
])
def test_go_regexp_translation_matches_like_go(go, subject, expected):
    assert bool(compile_go_regexp(go).search(subject)) is expected


@pytest.mark.parametrize("go", ["(?=a)", "(?!a)", "(?<=a)b", "\\1", "(a)\\1", "a*+", "(?U)a",
                                "\\pL", "[[:^alpha:]]", "(", ")", "[a", "\\Z", "x{2000}",
                                "a**"])
def test_go_rejected_or_untranslatable_patterns_raise(go):
    with pytest.raises(GoRegexpError):
        compile_go_regexp(go)


@settings(max_examples=300)
@given(st.text(alphabet="ab.*+?|()[]^$", max_size=10), st.text(alphabet="ab", max_size=6))
def test_translation_agrees_with_python_on_the_common_subset(pattern, subject):
    # For the syntax both dialects share, the translation must not change the meaning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            expected = re.compile(pattern, re.ASCII)
        except (re.error, FutureWarning):
            return
    try:
        translated = translate_go_regexp(pattern)
        got = re.compile(translated, re.ASCII)
    except (GoRegexpError, re.error):
        return   # rejected: denies, never allows more
    assert bool(got.search(subject)) == bool(expected.search(subject))
