"""Why kiamfast answers differently from kube2iam, per case of docs/kube2iam-record.json.

REASONS: a case (``"<config>: <case>"``) whose status or body differs, and why.
NOT_DELIBERATE: a case that differs for no known reason: a bug to fix, or a reason to find.
FORMAT_REASONS: a header or trailing-newline difference, keyed as the deviation table shows it
(``"<part>: <kube2iam> → <kiamfast>"``); such a difference alone is no deviation.
The deviation table (docs/switching-from-kube2iam.md) shows all three; a test fails when an
entry matches nothing in the record or a difference has no entry.
"""

_EMPTY_LISTING = ("kube2iam maps an unannotated pod to the bare base ARN: a 200 listing "
                  "with an empty body, which every SDK takes for a failure; kiamfast says "
                  "the pod has no role (404)")
_ROLE_NAME = ("the listing is the role's name (its last ARN segment), as real IMDS lists "
              "it; the credentials URL takes that name, kube2iam's form or the full ARN")
_BY_NAME = ("the pod's own role, asked for by the name the listing gave (kube2iam takes "
            "only its own form of the role)")
_NOT_AN_ARN = ("an annotation that is not a role ARN (a bare name without --base-role-arn) "
               "is denied; kube2iam passes it to STS, which in AWS refuses it (moto here "
               "issues a key for RoleArn `app-role`)")
_PATHS = ("paths are canonicalised before routing, so every spelling of a path routes like "
          "its canonical form and none reaches the node's metadata service under iam/ "
          "(kube2iam redirects: not every SDK follows)")

_OTHER_ROLE = ("a role name that is not the pod's gets 404 (kube2iam: 403), same text: real "
               "IMDS answers 404 for a name that is not the instance's role, and SDKs act on "
               "it: Java's provider looks the name up again after a 404, a 403 ends its "
               "fetch; credentials spec 2.1 clients (AWS_EC2_INSTANCE_PROFILE_NAME) ask for a "
               "name directly")

REASONS: dict[str, str] = {
    "base: another role": _OTHER_ROLE,
    "default-role: no annotation: another role": _OTHER_ROLE,
    "keys: custom keys: the default key's role": _OTHER_ROLE,
    "base: own role, trailing slash": ("a trailing slash names the same document (paths are "
                                       "canonicalised before routing); kube2iam takes "
                                       "`app-role/` for another role"),
    "base: no annotation: listing": _EMPTY_LISTING,
    "base: no annotation: a role": _EMPTY_LISTING,
    "keys: only the default key: listing": _EMPTY_LISTING,
    "base: cross-account ARN: listing": _ROLE_NAME,
    "base: role with a path: listing": _ROLE_NAME,
    "no-base-arn: annotation is a full ARN: listing": _ROLE_NAME,
    "glob: star entry: listing": _ROLE_NAME,
    "regexp: glob-style entry read as regexp: listing": _ROLE_NAME,
    "base: cross-account ARN: by name": _BY_NAME,
    "base: role with a path: by name": _BY_NAME,
    "no-base-arn: annotation is a full ARN: by name": _BY_NAME,
    "no-base-arn: listing": _NOT_AN_ARN,
    "no-base-arn: bare role name": _NOT_AN_ARN,
    "base: STS denies the role": ("as real IMDS: 200 with Code AssumeRoleUnauthorizedAccess, "
                                  "which SDKs report as it is; kube2iam's 500 is retried"),
    "base: passthrough: iam/info": ("synthesised for the pod's role: kube2iam passes the "
                                    "node's instance profile to every pod"),
    "base: passthrough: security-credentials-extended": ("answered for the pod's role, as "
                                                         "real IMDS has it; kube2iam passes "
                                                         "it to the node's service"),
    "base: passthrough: iam index": ("under meta-data/iam/ only the routes kiamfast answers "
                                     "exist: nothing there is passed to the node's service"),
    "base: passthrough: user-data": "the node's bootstrap data (secrets): blocked",
    "base: passthrough: identity-credentials": "the node's own credentials: blocked",
    "base: non-canonical path: double slash": _PATHS,
    "base: non-canonical path: dot segment": _PATHS,
    "base: token PUT without TTL": ("kiamfast answers token requests itself (tokens bound "
                                    "to the pod's address); its 400 says what is missing"),
    "base: healthz": ("kube2iam's two fields, plus where addresses come from (`runtime`), "
                      "the API server's state (`kubernetes`), the startup taint's "
                      "removal (`taint`) and what the start waits for (`readiness`)"),
}

NOT_DELIBERATE: dict[str, str] = {}

FORMAT_REASONS: dict[str, str] = {
    "content-type: `text/plain; charset=utf-8` → `text/plain`":
        "kube2iam sets none and Go's sniffing adds one; kiamfast sends real IMDS's",
    "content-type: (none) → `text/plain`":
        "kube2iam's empty answers have nothing to sniff; kiamfast always names the type",
    "newline after body: `True` → `False`":
        "real IMDS ends a credential document without a newline; JSON parsers ignore it",
    "server: (none) → `EC2ws`":
        "kiamfast sends IMDS's Server header on every answer, kube2iam on its IAM routes",
    "content-type: `text/plain; version=0.0.4; charset=utf-8; escaping=underscores` → "
    "`text/plain; version=0.0.4; charset=utf-8`":
        "kube2iam's newer Prometheus client names its escaping; the same text format",
    "x-aws-ec2-metadata-token-ttl-seconds: (none) → `the token's remaining seconds`":
        "kiamfast checks tokens itself and, as real IMDS, tells the token's TTL",
}
