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

import enum
import logging
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import orjson
import re2

log = logging.getLogger(__name__)

DEFAULT_ROLE_KEY = "iam.amazonaws.com/role"
DEFAULT_EXTERNAL_ID_KEY = "iam.amazonaws.com/external-id"
DEFAULT_NAMESPACE_KEY = "iam.amazonaws.com/allowed-roles"
KIAM_PERMITTED_KEY = "iam.amazonaws.com/permitted"

# kube2iam's check of --base-role-arn (cmd/main.go), kept verbatim.
_BASE_ARN_RE = re.compile(r"^arn:(\w|-)*:iam::\d+:role\/?(\w+|-|\/|\.)*$", re.ASCII)
# What STS can accept as a role ARN: partition, account, optional path, name
# (IAM name characters are [\w+=,.@-]).
_ROLE_ARN_RE = re.compile(r"^arn:[\w-]+:iam::\d+:role/[\w+=,.@/-]*[\w+=,.@-]$",
                          re.ASCII | re.IGNORECASE)
# STS's maximum RoleArn length: a longer role cannot be assumed, so it is never matched.
MAX_ROLE_ARN_LENGTH = 2048

# RE2 options for namespace patterns: errors become GoRegexpError, not lines on stderr.
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False


class InvalidBaseArn(ValueError):
    """`--base-role-arn` is not a role ARN prefix (kube2iam exits on this too)."""


class IdentityKind(enum.IntEnum):
    ROLE = 1
    NO_ROLE = 2
    DENIED = 3


@dataclass(frozen=True, slots=True)
class PodIdentity:
    """The decision for one pod.  Compare with `==`: equal decisions need no table write."""

    kind: IdentityKind
    role_arn: str = ""
    external_id: str = ""
    reason: str = ""
    # DENIED only because the pod's namespace is not (yet) known to the agent.
    namespace_unknown: bool = False

    @classmethod
    def role(cls, arn: str, external_id: str = "") -> "PodIdentity":
        return cls(IdentityKind.ROLE, arn, external_id)

    @classmethod
    def denied(cls, reason: str) -> "PodIdentity":
        return cls(IdentityKind.DENIED, reason=reason)


NO_ROLE = PodIdentity(IdentityKind.NO_ROLE)


# ---- Go glob (github.com/ryanuber/go-glob) --------------------------------------------------

def go_glob(pattern: str, subject: str) -> bool:
    """ryanuber/go-glob's `Glob`, line for line: only `*` is special and it matches any run of
    characters including `/`; no `*` means plain equality."""
    if pattern == "":
        return subject == pattern
    if pattern == "*":
        return True
    parts = pattern.split("*")
    if len(parts) == 1:
        return subject == pattern
    leading = pattern.startswith("*")
    trailing = pattern.endswith("*")
    end = len(parts) - 1
    for i in range(end):
        idx = subject.find(parts[i])
        if i == 0:
            if not leading and idx != 0:
                return False
        elif idx < 0:
            return False
        subject = subject[idx + len(parts[i]):]
    return trailing or subject.endswith(parts[end])


# ---- Go regexp (RE2 syntax) -> Python re ----------------------------------------------------

class GoRegexpError(ValueError):
    """A pattern Go's regexp package would reject, or one this translation cannot express."""


_POSIX_CLASSES = {
    "alnum": "0-9A-Za-z", "alpha": "A-Za-z", "ascii": "\\x00-\\x7f", "blank": "\\t ",
    "cntrl": "\\x00-\\x1f\\x7f", "digit": "0-9", "graph": "!-~", "lower": "a-z",
    "print": " -~", "punct": "!-/:-@\\[-`{-~", "space": "\\t\\n\\v\\f\\r ", "upper": "A-Z",
    "word": "0-9A-Za-z_", "xdigit": "0-9A-Fa-f",
}
_GO_FLAG_CHARS = set("imsU")
# Escapes that mean the same thing in RE2 and Python (ASCII mode).
_SAME_ESCAPES = set("afnrtvdDsSwWbBA")
_REPEAT_RE = re.compile(r"\{(\d+)(,(\d*))?\}")


def _translate_escape(p: str, i: int, *, in_class: bool) -> tuple[str, int]:
    """Translate the escape starting at p[i] == '\\'; returns (python text, next index)."""
    if i + 1 >= len(p):
        raise GoRegexpError("trailing backslash")
    c = p[i + 1]
    if c.isdigit():
        # RE2: a backreference (unsupported) or an octal escape; reject both, Go rejects \1-\9.
        raise GoRegexpError(f"unsupported escape \\{c}")
    if c == "z" and not in_class:
        return r"\Z", i + 2
    if c == "x":
        if i + 2 < len(p) and p[i + 2] == "{":
            close = p.find("}", i + 3)
            if close < 0:
                raise GoRegexpError("unterminated \\x{")
            try:
                cp = int(p[i + 3:close], 16)
            except ValueError as e:
                raise GoRegexpError("bad \\x{} escape") from e
            if cp > 0x10FFFF:
                raise GoRegexpError("bad \\x{} escape")
            return re.escape(chr(cp)), close + 1
        hexd = p[i + 2:i + 4]
        if len(hexd) != 2 or not all(ch in "0123456789abcdefABCDEF" for ch in hexd):
            raise GoRegexpError("bad \\x escape")
        return "\\x" + hexd, i + 4
    if c in _SAME_ESCAPES:
        if in_class and c in "bBA":
            raise GoRegexpError(f"invalid escape \\{c} in character class")
        return "\\" + c, i + 2
    if c.isalnum() or c == "_":
        # \p{..}, \P, \C, \Z, \u, ... : Go rejects or Python cannot express them faithfully.
        raise GoRegexpError(f"unsupported escape \\{c}")
    # Any escaped punctuation is that literal character in both dialects.
    return re.escape(c), i + 2


def _translate_class(p: str, i: int) -> tuple[str, int]:
    """Translate a bracket expression starting at p[i] == '['."""
    out = ["["]
    i += 1
    if i < len(p) and p[i] == "^":
        out.append("^")
        i += 1
    first = True
    while True:
        if i >= len(p):
            raise GoRegexpError("missing closing ]")
        c = p[i]
        if c == "]" and not first:
            out.append("]")
            return "".join(out), i + 1
        first = False
        if c == "[" and p.startswith("[:", i):
            close = p.find(":]", i + 2)
            if close < 0:
                out.append("\\[")
                i += 1
                continue
            name = p[i + 2:close]
            if name.startswith("^"):
                raise GoRegexpError(f"negated POSIX class [:{name}:] is not supported")
            if name not in _POSIX_CLASSES:
                raise GoRegexpError(f"invalid character class range [:{name}:]")
            out.append(_POSIX_CLASSES[name])
            i = close + 2
            continue
        if c == "\\":
            text, i = _translate_escape(p, i, in_class=True)
            out.append(text)
            continue
        if c in "[&~|":
            # Literal in RE2; Python warns about (future) set operations on these.
            out.append("\\" + c)
            i += 1
            continue
        out.append(c)
        i += 1


def translate_go_regexp(pattern: str) -> str:
    """Translate an RE2 (Go `regexp`) pattern to an equivalent Python `re` pattern.

    Handles the differences that change a match: mid-pattern flag groups (RE2 scopes them to
    the rest of the enclosing group, across `|`), `\\z`, `\\Q...\\E`, `\\x{...}`, POSIX
    classes, `(?<name>`, and `{` that is not a repetition (literal in RE2, a repetition in
    Python for `{,n}`).  Raises `GoRegexpError` for what Go rejects or Python cannot express.
    """
    out: list[str] = []
    # Per open group: flag-groups opened inside it (RE2 "(?i)" mid-group), to re-open after
    # each "|" and close at the group's end.
    stack: list[list[str]] = [[]]
    i = 0
    n = len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            if pattern.startswith("\\Q", i):
                end = pattern.find("\\E", i + 2)
                lit = pattern[i + 2:] if end < 0 else pattern[i + 2:end]
                out.append(re.escape(lit))
                i = n if end < 0 else end + 2
                continue
            text, i = _translate_escape(pattern, i, in_class=False)
            out.append(text)
            continue
        if c == "[":
            text, i = _translate_class(pattern, i)
            out.append(text)
            continue
        if c == "(":
            if pattern.startswith("(?", i):
                j = i + 2
                if pattern.startswith("P<", j) or pattern.startswith("<", j):
                    start = j + (2 if pattern[j] == "P" else 1)
                    close = pattern.find(">", start)
                    name = pattern[start:close] if close >= 0 else ""
                    if close < 0 or not name.isidentifier():
                        raise GoRegexpError("invalid named capture")
                    out.append(f"(?P<{name}>")
                    stack.append([])
                    i = close + 1
                    continue
                k = j
                while k < n and (pattern[k] in _GO_FLAG_CHARS or pattern[k] == "-"):
                    k += 1
                if k == j and k < n and pattern[k] == ":":
                    out.append("(?:")
                    stack.append([])
                    i = k + 1
                    continue
                if k >= n or pattern[k] not in "):" or k == j:
                    # lookaround, atomic groups, comments, backreferences: RE2 has none.
                    raise GoRegexpError(f"invalid or unsupported group syntax at {i}")
                flags = pattern[j:k]
                on, _, off = flags.partition("-")
                if "U" in flags:
                    raise GoRegexpError("the U (ungreedy) flag is not supported")
                if "-" in off or (not on and not off) or (flags.endswith("-")):
                    raise GoRegexpError("invalid flag group")
                spec = on + (f"-{off}" if off else "")
                if pattern[k] == ":":
                    out.append(f"(?{spec}:")
                    stack.append([])
                else:
                    # "(?i)" mid-group: applies to the rest of the enclosing group.
                    out.append(f"(?{spec}:")
                    stack[-1].append(f"(?{spec}:")
                i = k + 1
                continue
            out.append("(")
            stack.append([])
            i += 1
            continue
        if c == ")":
            if len(stack) == 1:
                raise GoRegexpError("unexpected )")
            out.append(")" * len(stack.pop()))
            out.append(")")
            i += 1
            continue
        if c == "|":
            opened = stack[-1]
            out.append(")" * len(opened))
            out.append("|")
            out.extend(opened)
            i += 1
            continue
        if c == "{":
            m = _REPEAT_RE.match(pattern, i)
            if m:
                lo = int(m.group(1))
                hi = m.group(3)
                if lo > 1000 or (hi and int(hi) > 1000) or (hi and int(hi) < lo):
                    raise GoRegexpError("invalid repeat count")
                out.append(m.group(0))
                i = m.end()
            else:
                out.append("\\{")
                i += 1
            continue
        if c == "}":
            out.append("\\}")
            i += 1
            continue
        if c in "*+?" and i + 1 < n and pattern[i + 1] == "+":
            raise GoRegexpError("invalid nested repetition operator")
        out.append(c)
        i += 1
    if len(stack) != 1:
        raise GoRegexpError("missing closing )")
    out.append(")" * len(stack[0]))
    return "".join(out)


def compile_go_regexp(pattern: str) -> re2._Regexp:
    """Compile a Go pattern with RE2 for `search` (Go `MatchString`) or `fullmatch`.

    RE2 compiles the pattern as written (its syntax is Go's); the translation only vets it,
    so a pattern Go or the translation rejects is refused rather than matched differently."""
    try:
        translate_go_regexp(pattern)
        return re2.compile(pattern, options=_RE2_OPTIONS)
    except re2.error as e:
        message = e.args[0] if e.args else e
        if isinstance(message, bytes):
            message = message.decode(errors="replace")
        raise GoRegexpError(str(message)) from e


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
            if not _BASE_ARN_RE.match(base_role_arn):
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
