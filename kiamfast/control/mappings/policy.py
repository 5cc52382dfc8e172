"""Which IAM role a pod may have: kube2iam's role semantics, decided once per pod change.

kube2iam decides a pod's role on every request (mappings/mapper.go); kiamfast decides it when
the pod or its namespace changes and writes the answer into the table, so this module is the
one place where the annotation rules live.  It is pure: no I/O, no clock, no Kubernetes
client.  The output is a `PodIdentity`:

* `ROLE(arn, external_id)`: the pod's role, normalised to a full ARN;
* `NO_ROLE`: the pod has no role annotation and no default role is configured;
* `DENIED(reason)`: the pod asks for a role it may not have (namespace policy), or its
  annotation cannot be a role at all.

Rules kept from kube2iam 0.15.0 (reference/kube2iam.md section 2):

* `role_arn(x)`: `x` starting with `arn:` (case-insensitive) is used verbatim, anything else is
  appended to the base ARN (`--base-role-arn`, a trailing `/` added).  Role names may carry
  a path (`team/app`).
* The default role (`--default-role`) is normalised the same way and is always allowed by the
  namespace policy.
* The external ID comes from the pod annotation named by `--iam-external-id`; empty means none.
* `--namespace-restrictions`: the namespace annotation (`iam.amazonaws.com/allowed-roles`)
  is a JSON array; each entry is normalised with `role_arn` and compared with the pod's
  role by go-glob (only `*` is special and it matches `/` too; no `*` means equality) or,
  with `--namespace-restriction-format=regexp`, by Go's unanchored `regexp.MatchString`.
  Invalid JSON gives no allowed roles; a bad regexp is skipped with a log line; a namespace
  the agent does not know denies.

Where kiamfast deliberately differs (each is a case where kube2iam hands out something
useless or wrong):

* With a base ARN and no default role, kube2iam's default role evaluates to the bare base ARN,
  so an unannotated pod gets a 200 listing with an empty body, which every SDK treats as a
  failure (reference/sdk-imds.md).  kiamfast answers such a pod `NO_ROLE` (404).
* An annotation that is present but empty, or normalises to something that is not a role ARN
  (a bare name without a base ARN, a typo'd prefix), is `DENIED` with a log line: kube2iam
  would pass it to STS (500) or, for an empty value, list the bare base ARN.  Never another
  identity.  Surrounding whitespace in annotation values is ignored.
* Patterns are matched by RE2 (PyPI `google-re2`), the engine whose syntax and linear-time
  matching Go's regexp shares: a pod author controls the role annotation, and a backtracking
  engine would let one pathological namespace pattern and a long annotation stall every
  decision of the control process.  Each pattern is first checked by `translate_go_regexp`,
  which rejects what Go rejects (backreferences, lookaround) and what it cannot vouch for, so
  a pattern allows exactly what it allowed under kube2iam or, where it cannot, nothing.
* A role longer than STS's 2,048-character RoleArn limit is denied before any pattern sees
  it (STS would refuse it anyway; the limit also bounds the matching work).

kiam's namespace annotation `iam.amazonaws.com/permitted` is supported as well (enabled by
giving `permitted_key`): a regexp matched against the whole role ARN (anchored); a namespace
without it permits no role except the default one.  When both policies are enabled, both
must allow.

What this module must never do: pick a role for a pod other than the one its annotation (or
the default role) names.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import orjson

import re2

from kiamfast.config import BASE_ARN_REGEXP
from kiamfast.control.mappings.patterns import GoRegexpError, compile_go_regexp, go_glob
from kiamfast.decisions import NO_ROLE, IdentityKind, PodIdentity

log = logging.getLogger(__name__)

DEFAULT_ROLE_KEY = "iam.amazonaws.com/role"
DEFAULT_EXTERNAL_ID_KEY = "iam.amazonaws.com/external-id"
DEFAULT_NAMESPACE_KEY = "iam.amazonaws.com/allowed-roles"

# What STS can accept as a role ARN: partition, account, optional path, name
# (IAM name characters are [\w+=,.@-]).
_ROLE_ARN_RE = re.compile(r"^arn:[\w-]+:iam::\d+:role/[\w+=,.@/-]*[\w+=,.@-]$",
                          re.ASCII | re.IGNORECASE)
# STS's maximum RoleArn length: a longer role cannot be assumed, so it is never matched.
MAX_ROLE_ARN_LENGTH = 2048


class InvalidBaseArn(ValueError):
    """`--base-role-arn` is not a role ARN prefix (kube2iam exits on this too)."""


# ---- namespace rules -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class NamespaceRules:
    """A namespace's policy inputs, parsed once per namespace change."""

    name: str
    # kube2iam allowed-roles entries, normalised: globs as strings, regexps compiled.
    allowed_globs: tuple[str, ...] = ()
    allowed_regexps: tuple[re2._Regexp, ...] = ()
    # kiam: None = no (usable) annotation, which permits nothing but the default role.
    permitted: re2._Regexp | None = None


class RolePolicy:
    """The configured role rules: normalisation, default role, namespace policy.

    Build one from the flags; call `namespace_rules` when a namespace changes and `decide`
    when a pod (or its namespace's rules) changes.
    """

    def __init__(
        self,
        *,
        base_role_arn: str = "",
        default_role: str = "",
        role_key: str = DEFAULT_ROLE_KEY,
        external_id_key: str = DEFAULT_EXTERNAL_ID_KEY,
        namespace_restrictions: bool = False,
        namespace_restriction_format: str = "glob",
        namespace_key: str = DEFAULT_NAMESPACE_KEY,
        permitted_key: str = "",
    ) -> None:
        if base_role_arn:
            if not BASE_ARN_REGEXP.match(base_role_arn):
                raise InvalidBaseArn(f"{base_role_arn!r} is not a valid base role ARN")
            if not base_role_arn.endswith("/"):
                base_role_arn += "/"
        self.base_role_arn = base_role_arn
        self.role_key = role_key
        self.external_id_key = external_id_key
        self.namespace_restrictions = namespace_restrictions
        # kube2iam: compared case-insensitively; anything but "regexp" is glob.
        self.regexp_format = namespace_restriction_format.lower() == "regexp"
        self.namespace_key = namespace_key
        self.permitted_key = permitted_key
        # Deliberate difference: no --default-role means no default role, even with a base
        # ARN (kube2iam would use the bare base ARN; see the module docstring).
        self.default_role_arn = self.role_arn(default_role.strip()) if default_role.strip() else ""
        if self.default_role_arn and not _ROLE_ARN_RE.match(self.default_role_arn):
            log.error("default role %r does not name a role ARN; STS will refuse it",
                      self.default_role_arn)

    @classmethod
    def from_config(cls, config: Any) -> "RolePolicy":
        """From `kiamfast.config.Config` (after base ARN / default role auto-discovery)."""
        return cls(
            base_role_arn=config.base_role_arn,
            default_role=config.default_role,
            role_key=config.iam_role_key,
            external_id_key=config.iam_external_id,
            namespace_restrictions=config.namespace_restrictions,
            namespace_restriction_format=config.namespace_restriction_format,
            namespace_key=config.namespace_key,
            permitted_key=config.namespace_permitted_key,
        )

    @property
    def uses_namespaces(self) -> bool:
        """Whether decisions depend on namespace annotations at all."""
        return self.namespace_restrictions or bool(self.permitted_key)

    def role_arn(self, role: str) -> str:
        """kube2iam `RoleARN`: full ARNs verbatim, names relative to the base ARN."""
        if role.lower().startswith("arn:"):
            return role
        return self.base_role_arn + role

    def listing_name(self, arn: str) -> str:
        """The name the listing shows for `arn`: relative to the base ARN when under it."""
        if self.base_role_arn and arn.startswith(self.base_role_arn):
            return arn[len(self.base_role_arn):]
        return arn

    # ---- namespaces -----------------------------------------------------------------------

    def namespace_rules(self, name: str, annotations: Mapping[str, str] | None) -> NamespaceRules:
        """Parse a namespace's annotations into rules (logging, never raising, on bad input)."""
        annotations = annotations or {}
        globs: list[str] = []
        regexps: list[re2._Regexp] = []
        if self.namespace_restrictions:
            for entry in self._allowed_entries(name, annotations.get(self.namespace_key, "")):
                normalised = self.role_arn(entry)
                if self.regexp_format:
                    try:
                        regexps.append(compile_go_regexp(normalised))
                    except GoRegexpError as e:
                        log.error("namespace %s: skipping allowed-roles regexp %r: %s",
                                  name, entry, e)
                else:
                    globs.append(normalised)
        permitted = None
        if self.permitted_key:
            expr = (annotations.get(self.permitted_key) or "").strip()
            if expr:
                try:
                    permitted = compile_go_regexp(expr)
                except GoRegexpError as e:
                    log.error("namespace %s: ignoring %s regexp %r: %s",
                              name, self.permitted_key, expr, e)
        return NamespaceRules(name, tuple(globs), tuple(regexps), permitted)

    def _allowed_entries(self, namespace: str, raw: str) -> Sequence[str]:
        if not raw:
            return ()
        try:
            decoded = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            log.error("namespace %s: unable to decode %s %r: %s; no roles allowed",
                      namespace, self.namespace_key, raw, e)
            return ()
        if decoded is None:
            return ()
        if not isinstance(decoded, list) or not all(isinstance(x, str) for x in decoded):
            log.error("namespace %s: %s must be a JSON array of strings, got %r; no roles allowed",
                      namespace, self.namespace_key, raw)
            return ()
        return decoded

    # ---- pods -----------------------------------------------------------------------------

    def decide(
        self,
        annotations: Mapping[str, str] | None,
        rules: NamespaceRules | None,
        *,
        namespace: str = "",
        pod: str = "",
    ) -> PodIdentity:
        """The identity of a pod with these annotations in a namespace with these rules
        (`rules` None = the namespace is unknown)."""
        annotations = annotations or {}
        raw = annotations.get(self.role_key)
        external_id = (annotations.get(self.external_id_key) or "").strip()
        if raw is None:
            if not self.default_role_arn:
                return NO_ROLE
            return PodIdentity.role(self.default_role_arn, external_id)
        raw = raw.strip()
        if not raw:
            log.warning("pod %s/%s: empty %s annotation; denying", namespace, pod, self.role_key)
            return PodIdentity.denied(f"empty {self.role_key} annotation")
        arn = self.role_arn(raw)
        if len(arn) > MAX_ROLE_ARN_LENGTH:
            # Neither the annotation (the pod author's text, of any size) nor a pattern
            # match: one line with its length.
            log.warning("pod %s/%s: %s annotation makes a %d-character role, longer than "
                        "STS allows (%d); denying", namespace, pod, self.role_key, len(arn),
                        MAX_ROLE_ARN_LENGTH)
            return PodIdentity.denied(f"role is {len(arn)} characters, longer than "
                                      f"{MAX_ROLE_ARN_LENGTH}")
        if not _ROLE_ARN_RE.match(arn):
            log.warning("pod %s/%s: %s=%r does not name a role ARN (%r); denying",
                        namespace, pod, self.role_key, raw, arn)
            return PodIdentity.denied(f"{arn!r} is not a role ARN")
        if arn != self.default_role_arn and self.uses_namespaces:
            reason = self._namespace_denial(arn, rules, namespace)
            if reason:
                return PodIdentity(IdentityKind.DENIED, role_arn=arn, reason=reason,
                                   namespace_unknown=rules is None)
        return PodIdentity.role(arn, external_id)

    def _namespace_denial(self, arn: str, rules: NamespaceRules | None, namespace: str) -> str:
        if rules is None:
            return f"role requested {arn} not valid for namespace {namespace} (namespace unknown)"
        if self.namespace_restrictions:
            allowed = any(go_glob(g, arn) for g in rules.allowed_globs) or any(
                r.search(arn) for r in rules.allowed_regexps)
            if not allowed:
                return f"role requested {arn} not valid for namespace {namespace}"
        if self.permitted_key:
            if rules.permitted is None or not rules.permitted.fullmatch(arn):
                return (f"role requested {arn} not permitted by {self.permitted_key} "
                        f"of namespace {namespace}")
        return ""
