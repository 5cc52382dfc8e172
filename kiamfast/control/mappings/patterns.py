"""Role patterns as kube2iam and kiam match them, in Python: Go's glob
(github.com/ryanuber/go-glob: only `*` is special) and Go's regexp syntax (RE2), translated
to Python's `re` syntax and compiled with RE2 (linear time whatever a namespace's author
writes)."""
from __future__ import annotations

import re

import re2

# RE2 options for namespace patterns: errors become GoRegexpError, not lines on stderr.
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False


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
