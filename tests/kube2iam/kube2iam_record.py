"""The record of kube2iam's answers beside kiamfast's, and the deviation table made from it.

Both agents get the same requests from the same pod addresses under the same flags (one
"config" per set of flags) and each answer is reduced to what a client reads: the status,
the headers SDKs and operators look at, and the body — exact for listings and error texts,
for a credential document its shape and the role STS issued its key for.  The reduced
answers are checked in as docs/kube2iam-record.json; the deviation table of
docs/switching-from-kube2iam.md is generated from the cases where the two differ, each with its reason from
``deviation_reasons.REASONS``.

    python3 tests/kube2iam/kube2iam_record.py --update   # re-run both, rewrite record + table

tests/kube2iam/test_kube2iam_record.py re-runs both and fails when either side no longer
answers as recorded, or when that page, the record and the reasons disagree.
"""
from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from deviation_reasons import FORMAT_REASONS, NOT_DELIBERATE, REASONS  # noqa: E402
from kube2iam_harness import BASE_ARN, NODE, Cluster, Kiamfast, Kube2iam, request  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECORD = REPO / "docs" / "kube2iam-record.json"
PAGE = REPO / "docs" / "switching-from-kube2iam.md"   # holds the table
TABLE_START = "<!-- kube2iam-deviations:start -->"
TABLE_END = "<!-- kube2iam-deviations:end -->"

ROLE_KEY = "iam.amazonaws.com/role"
NAMESPACE_KEY = "iam.amazonaws.com/allowed-roles"
CUSTOM_ROLE_KEY = "example.com/role"
CUSTOM_NAMESPACE_KEY = "example.com/allowed-roles"
OTHER_ACCOUNT_ROLE = "arn:aws:iam::210987654321:role/cross-role"
DENIED_ROLE = BASE_ARN + "denied-role"   # STS answers AccessDenied for it
HOST = "127.0.0.1"                        # the node itself: health, metrics
UNKNOWN = "127.0.0.99"                    # an address no pod has


@dataclass(frozen=True)
class Pod:
    address: str
    namespace: str
    annotations: dict = field(default_factory=dict)


PODS = {
    "app": Pod("127.0.0.11", "team", {ROLE_KEY: "app-role"}),
    "plain": Pod("127.0.0.12", "team"),
    "cross": Pod("127.0.0.13", "team", {ROLE_KEY: OTHER_ACCOUNT_ROLE}),
    "pathed": Pod("127.0.0.14", "team", {ROLE_KEY: "team/path-role"}),
    "full-arn": Pod("127.0.0.15", "team", {ROLE_KEY: BASE_ARN + "app-role"}),
    "denied": Pod("127.0.0.16", "team", {ROLE_KEY: "denied-role"}),
    "glob-exact": Pod("127.0.0.21", "globns", {ROLE_KEY: "app-role"}),
    "glob-star": Pod("127.0.0.22", "globns", {ROLE_KEY: "team/x-role"}),
    "glob-denied": Pod("127.0.0.23", "globns", {ROLE_KEY: "other-role"}),
    "rx-prefix": Pod("127.0.0.31", "rxns", {ROLE_KEY: "app-role-admin"}),
    "rx-denied": Pod("127.0.0.32", "rxns", {ROLE_KEY: "other-role"}),
    "rx-anchored": Pod("127.0.0.33", "rxns", {ROLE_KEY: "team/y-role"}),
    "keyed": Pod("127.0.0.41", "keysns", {ROLE_KEY: "app-role", CUSTOM_ROLE_KEY: "custom-role"}),
}
NAMESPACES = {
    "team": {},
    "globns": {NAMESPACE_KEY: '["app-role", "team/*"]'},
    "rxns": {NAMESPACE_KEY: '["app-role", "^arn:aws:iam::123456789012:role/team/.+$"]'},
    "keysns": {NAMESPACE_KEY: '["app-role"]', CUSTOM_NAMESPACE_KEY: '["custom-role"]'},
}

BASE = f"--base-role-arn={BASE_ARN}"
CONFIGS = {
    "base": [BASE],
    "no-base-arn": ["--base-role-arn="],
    "default-role": [BASE, "--default-role=default-role"],
    "glob": [BASE, "--namespace-restrictions"],
    "regexp": [BASE, "--namespace-restrictions", "--namespace-restriction-format=regexp"],
    "keys": [BASE, "--namespace-restrictions", f"--iam-role-key={CUSTOM_ROLE_KEY}",
             f"--namespace-key={CUSTOM_NAMESPACE_KEY}"],
}

CREDS = "/latest/meta-data/iam/security-credentials/"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_TTL = 21600


@dataclass(frozen=True)
class Case:
    name: str
    source: str           # a pod name, or an address
    method: str
    path: str
    headers: tuple = ()   # (name, value) pairs; the value "<token>" is a fresh IMDSv2 token

    @property
    def address(self) -> str:
        return PODS[self.source].address if self.source in PODS else self.source


def get(name: str, source: str, path: str, headers: tuple = ()) -> Case:
    return Case(name, source, "GET", path, headers)


CASES = {
    "base": [
        get("listing", "app", CREDS),
        get("listing without slash", "app", CREDS.rstrip("/")),
        get("listing, dated version", "app", "/2016-09-02/meta-data/iam/security-credentials/"),
        get("own role", "app", CREDS + "app-role"),
        get("own role, dated version", "app", "/2016-09-02/meta-data/iam/security-credentials/app-role"),
        get("own role, trailing slash", "app", CREDS + "app-role/"),
        get("own role as full ARN in URL", "app", CREDS + BASE_ARN + "app-role"),
        get("another role", "app", CREDS + "other-role"),
        Case("POST own role", "app", "POST", CREDS + "app-role"),
        Case("PUT own role", "app", "PUT", CREDS + "app-role"),
        Case("DELETE own role", "app", "DELETE", CREDS + "app-role"),
        Case("HEAD own role", "app", "HEAD", CREDS + "app-role"),
        Case("POST listing", "app", "POST", CREDS),
        get("no annotation: listing", "plain", CREDS),
        get("no annotation: a role", "plain", CREDS + "app-role"),
        get("unknown address: listing", UNKNOWN, CREDS),
        get("unknown address: a role", UNKNOWN, CREDS + "app-role"),
        get("cross-account ARN: listing", "cross", CREDS),
        get("cross-account ARN: by name", "cross", CREDS + "cross-role"),
        get("cross-account ARN: by ARN", "cross", CREDS + OTHER_ACCOUNT_ROLE),
        get("role with a path: listing", "pathed", CREDS),
        get("role with a path: by path", "pathed", CREDS + "team/path-role"),
        get("role with a path: by name", "pathed", CREDS + "path-role"),
        get("annotation is a full ARN: listing", "full-arn", CREDS),
        get("annotation is a full ARN: by name", "full-arn", CREDS + "app-role"),
        get("STS denies the role", "denied", CREDS + "denied-role"),
        get("passthrough: instance-id", "app", "/latest/meta-data/instance-id"),
        get("passthrough: meta-data index", "app", "/latest/meta-data/"),
        get("passthrough: iam/info", "app", "/latest/meta-data/iam/info"),
        get("passthrough: iam index", "app", "/latest/meta-data/iam/"),
        get("passthrough: security-credentials-extended", "app",
            "/latest/meta-data/iam/security-credentials-extended/"),
        get("passthrough: user-data", "app", "/latest/user-data"),
        get("passthrough: identity document", "app", "/latest/dynamic/instance-identity/document"),
        get("passthrough: identity-credentials", "app",
            "/latest/meta-data/identity-credentials/ec2/security-credentials/ec2-instance"),
        get("non-canonical path: double slash", "app", "/latest/meta-data/iam//security-credentials/"),
        get("non-canonical path: dot segment", "app", "/latest/meta-data/./iam/security-credentials/"),
        get("non-canonical path: encoded slash", "app",
            "/latest/meta-data/iam/security-credentials%2Fapp-role"),
        Case("token PUT", "app", "PUT", "/latest/api/token", ((TTL_HEADER, str(TOKEN_TTL)),)),
        Case("token PUT without TTL", "app", "PUT", "/latest/api/token"),
        get("listing with a token", "app", CREDS, (("X-aws-ec2-metadata-token", "<token>"),)),
        get("own role with a token", "app", CREDS + "app-role",
            (("X-aws-ec2-metadata-token", "<token>"),)),
        get("healthz", HOST, "/healthz"),
        get("metrics names", HOST, "/metrics"),   # last: after every other request
    ],
    "no-base-arn": [
        get("listing", "app", CREDS),
        get("bare role name", "app", CREDS + "app-role"),
        get("no annotation: listing", "plain", CREDS),
        get("annotation is a full ARN: listing", "full-arn", CREDS),
        get("annotation is a full ARN: by name", "full-arn", CREDS + "app-role"),
    ],
    "default-role": [
        get("no annotation: listing", "plain", CREDS),
        get("no annotation: default role", "plain", CREDS + "default-role"),
        get("no annotation: another role", "plain", CREDS + "app-role"),
        get("annotated: listing", "app", CREDS),
    ],
    "glob": [
        get("exact entry: listing", "glob-exact", CREDS),
        get("exact entry: own role", "glob-exact", CREDS + "app-role"),
        get("star entry: listing", "glob-star", CREDS),
        get("star entry: own role", "glob-star", CREDS + "team/x-role"),
        get("not allowed: listing", "glob-denied", CREDS),
        get("not allowed: own role", "glob-denied", CREDS + "other-role"),
        get("namespace without the key: listing", "app", CREDS),
        get("no star, no prefix match: listing", "rx-prefix", CREDS),
        get("regexp entry is no glob: listing", "rx-anchored", CREDS),
    ],
    "regexp": [
        get("unanchored entry matches a longer name: listing", "rx-prefix", CREDS),
        get("unanchored entry matches a longer name: own role", "rx-prefix",
            CREDS + "app-role-admin"),
        get("entry starting with ^, so prefixed with the base ARN: listing", "rx-anchored",
            CREDS),
        get("not allowed: listing", "rx-denied", CREDS),
        get("glob-style entry read as regexp: listing", "glob-star", CREDS),
    ],
    "keys": [
        get("custom keys: listing", "keyed", CREDS),
        get("custom keys: own role", "keyed", CREDS + "custom-role"),
        get("custom keys: the default key's role", "keyed", CREDS + "app-role"),
        get("only the default key: listing", "app", CREDS),
    ],
}


def case_id(config: str, case: Case) -> str:
    return f"{config}: {case.name}"


# ---- the cluster every config runs against ------------------------------------------------

def populate(cluster: Cluster) -> None:
    for name, namespace_annotations in NAMESPACES.items():
        cluster.api.namespaces.add(name, annotations=namespace_annotations or None)
    for name, pod in PODS.items():
        cluster.api.pods.create(pod.namespace, name, node=NODE, annotations=pod.annotations,
                                ips=[pod.address], phase="Running")
    cluster.sts.add_fault("deny", roles=[DENIED_ROLE])


# ---- one answer, reduced to what a client reads ------------------------------------------

READ_HEADERS = ("content-type", "server", "location", TTL_HEADER.lower())
_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:?\d\d)?$")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_VOLATILE = {"SecretAccessKey", "Token", "taint"}   # secrets, and kiamfast's taint progress


def shape(value: str) -> str:
    """A timestamp's format, digits replaced: 2026-05-08T12:00:00Z -> 9999-99-99T99:99:99Z."""
    return re.sub(r"\d", "9", value)


def reduce_json(doc: dict, cluster: Cluster) -> dict:
    out = {}
    for key, value in doc.items():
        if key in _VOLATILE:
            out[key] = "<varies>"
        elif key == "AccessKeyId":
            out["key issued for"] = key_origin(str(value), cluster)
        elif isinstance(value, str) and _TIMESTAMP.match(value):
            out[key] = shape(value)
        else:
            out[key] = value
    return out


def key_origin(access_key_id: str, cluster: Cluster) -> str:
    if access_key_id.startswith(cluster.imds.identity.node_access_key[:8]):
        return "the node (its own credentials)"
    role = cluster.role_issued(access_key_id)
    return role if role else "no STS call"


def reduce_body(case: Case, status: int, body: bytes, cluster: Cluster):
    if case.name == "metrics names":
        return metric_labels(body.decode())
    if case.path.endswith("/api/token") and status == 200 and body:
        return "<a token>"
    text = body.decode("utf-8", "replace")
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        return reduce_json(doc, cluster)
    return _UUID.sub("<uuid>", text)[:300]


def metric_labels(text: str) -> dict[str, list[str]]:
    """kube2iam_* family -> the label names its samples carry (histogram ``le`` aside)."""
    from prometheus_client.parser import text_string_to_metric_families
    families = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("kube2iam_"):
            labels = {name for sample in family.samples for name in sample.labels}
            families[family.name] = sorted(labels - {"le"})
    return dict(sorted(families.items()))


def observe(agent, case: Case, cluster: Cluster, token: str | None) -> dict:
    headers = {k: (token if v == "<token>" else v) for k, v in case.headers}
    status, fields, body = request(agent.port, case.method, case.path, source=case.address,
                                   headers=headers)
    read = {k: fields[k] for k in READ_HEADERS if k in fields}
    if TTL_HEADER.lower() in read and case.method != "PUT":
        read[TTL_HEADER.lower()] = remaining_ttl(read[TTL_HEADER.lower()])
    answer = {"status": status, "headers": read,
              "body": reduce_body(case, status, body, cluster)}
    if isinstance(answer["body"], dict) and "Code" in answer["body"]:
        answer["newline after body"] = body.endswith(b"\n")
    return answer


def remaining_ttl(value: str) -> str:
    """A token's remaining seconds, told on answers to token-bearing requests: it ticks
    down between the PUT and the request, so only its plausibility is recorded."""
    fresh = value.isdigit() and TOKEN_TTL - 60 <= int(value) <= TOKEN_TTL
    return "the token's remaining seconds" if fresh else value


def fresh_token(agent, case: Case) -> str | None:
    if not any(v == "<token>" for _, v in case.headers):
        return None
    status, _, body = request(agent.port, "PUT", "/latest/api/token", source=case.address,
                              headers={TTL_HEADER: str(TOKEN_TTL)})
    return body.decode() if status == 200 else "no-token"


def run_agent(agent, config: str, cluster: Cluster) -> dict[str, dict]:
    """Every case of ``config`` in order against one started agent."""
    agent.wait_ready(60)
    answers = {}
    for case in CASES[config]:
        answers[case_id(config, case)] = observe(agent, case, cluster, fresh_token(agent, case))
    return answers


def run_config(config: str, cluster: Cluster, workdir: Path) -> dict[str, dict[str, dict]]:
    """Both agents under ``config``'s flags, side by side: {agent name: {case id: answer}}."""
    agents = [Kube2iam(cluster, workdir / config / "kube2iam", CONFIGS[config]),
              Kiamfast(cluster, workdir / config / "kiamfast", CONFIGS[config])]
    try:
        with ThreadPoolExecutor(len(agents)) as pool:
            runs = [pool.submit(run_agent, agent, config, cluster) for agent in agents]
            return {agent.name: run.result() for agent, run in zip(agents, runs)}
    finally:
        for agent in agents:
            agent.stop()


def run_all(workdir: Path) -> dict[str, dict[str, dict]]:
    cluster = Cluster()
    try:
        populate(cluster)
        answers: dict[str, dict[str, dict]] = {"kube2iam": {}, "kiamfast": {}}
        for config in CONFIGS:
            for agent, per_case in run_config(config, cluster, workdir).items():
                answers[agent].update(per_case)
        return answers
    finally:
        cluster.stop()


# ---- the record and the table -------------------------------------------------------------

def build_record(answers: dict[str, dict[str, dict]]) -> dict:
    cases = []
    for config, config_cases in CASES.items():
        for case in config_cases:
            cid = case_id(config, case)
            cases.append({"case": cid, "flags": CONFIGS[config], "from": case.source,
                          "request": f"{case.method} {case.path}",
                          **({"headers": dict(case.headers)} if case.headers else {}),
                          "kube2iam": answers["kube2iam"][cid],
                          "kiamfast": answers["kiamfast"][cid]})
    return {"about": "kube2iam 4c4a2b4 and kiamfast (--cri-endpoint=none) answering the same "
                     "requests; written by tests/kube2iam/kube2iam_record.py --update",
            "pods": {name: {"address": p.address, "namespace": p.namespace,
                            "annotations": p.annotations} for name, p in PODS.items()},
            "namespaces": NAMESPACES, "cases": cases}


def load_record() -> dict:
    return json.loads(RECORD.read_text())


def differing_parts(case: dict) -> list[str]:
    """The parts of the two answers that differ, in the order status, headers, body."""
    a, b = case["kube2iam"], case["kiamfast"]
    parts = ["status"] if a["status"] != b["status"] else []
    for name in sorted(set(a["headers"]) | set(b["headers"])):
        if a["headers"].get(name) != b["headers"].get(name):
            parts.append(name)
    if a["body"] != b["body"]:
        parts.append("body")
    newline = "newline after body"   # only comparable where both sent a document
    if newline in a and newline in b and a[newline] != b[newline]:
        parts.append(newline)
    return parts


def part_value(answer: dict, part: str):
    if part in ("status", "body", "newline after body"):
        return answer.get(part)
    return answer["headers"].get(part)


def format_difference(case: dict, part: str) -> str | None:
    """The key of FORMAT_REASONS this header or trailing-newline difference falls under."""
    if part in ("status", "body"):
        return None
    key = (f"{part}: {cell(part_value(case['kube2iam'], part))} → "
           f"{cell(part_value(case['kiamfast'], part))}")
    return key if key in FORMAT_REASONS else None


def answer_parts(case: dict) -> list[str]:
    """The differing parts no format reason covers: what makes the case a deviation."""
    return [p for p in differing_parts(case) if format_difference(case, p) is None]


def deviations(record: dict) -> list[dict]:
    return [c for c in record["cases"] if answer_parts(c)]


def format_differences(record: dict) -> dict[str, list[str]]:
    """FORMAT_REASONS key -> the cases showing that difference."""
    found: dict[str, list[str]] = {}
    for case in record["cases"]:
        for part in differing_parts(case):
            key = format_difference(case, part)
            if key is not None:
                found.setdefault(key, []).append(case["case"])
    return found


def summary(answer: dict, other: dict, parts: list[str]) -> str:
    """``answer``'s status and the ``parts`` where it differs from ``other``."""
    shown = [str(answer["status"])]
    for part in parts:
        value = part_value(answer, part)
        if part == "body" and isinstance(value, dict) and isinstance(other["body"], dict):
            value = {k: v for k, v in value.items() if other["body"].get(k) != v}
            part = "body differs in"
        if part != "status":
            shown.append(f"{part}: {cell(value)}")
    return "; ".join(shown)


def cell(value) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, dict) and "key issued for" in value:
        text = f"{value.get('Code')} credentials, key issued for {value['key issued for']}"
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, separators=(",", ":"))
    else:
        text = str(value)
    text = text.replace("\n", "\\n")
    if len(text) > 90:
        text = text[:87] + "..."
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def why(case_name: str) -> str:
    if case_name in NOT_DELIBERATE:
        return f"**not deliberate (open)**: {NOT_DELIBERATE[case_name]}"
    return REASONS.get(case_name, "**no reason given**")


def render_table(record: dict) -> str:
    found = deviations(record)
    rows = [f"{len(record['cases'])} recorded cases; {len(found)} answered differently "
            "(status or body):", "",
            "| case (flags: see the record) | request, from | kube2iam 0.15 (4c4a2b4) | "
            "kiamfast | why |", "|---|---|---|---|---|"]
    for case in found:
        parts = answer_parts(case)
        rows.append(f"| {case['case']} | `{case['request']}` from {case['from']} | "
                    f"{summary(case['kube2iam'], case['kiamfast'], parts)} | "
                    f"{summary(case['kiamfast'], case['kube2iam'], parts)} | "
                    f"{why(case['case'])} |")
    rows += ["", "Differences of form, wherever they occur:", "",
             "| header or form: kube2iam → kiamfast | cases | why |", "|---|---|---|"]
    for key, cases in format_differences(record).items():
        rows.append(f"| {key} | {len(cases)} | {FORMAT_REASONS[key]} |")
    return "\n".join(rows)


def page_table(page: str) -> str:
    start, end = page.index(TABLE_START), page.index(TABLE_END)
    return page[start + len(TABLE_START):end].strip("\n")


def with_table(page: str, table: str) -> str:
    start, end = page.index(TABLE_START), page.index(TABLE_END)
    return page[:start + len(TABLE_START)] + "\n" + table + "\n" + page[end:]


def write(record: dict) -> None:
    RECORD.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    PAGE.write_text(with_table(PAGE.read_text(), render_table(record)))


def main(argv: list[str]) -> int:
    import tempfile
    if argv != ["--update"]:
        print(__doc__)
        return 2
    with tempfile.TemporaryDirectory(prefix="kube2iam-record-") as tmp:
        write(build_record(run_all(Path(tmp))))
    record = load_record()
    print(f"{RECORD.relative_to(REPO)}: {len(record['cases'])} cases, "
          f"{len(deviations(record))} deviations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
