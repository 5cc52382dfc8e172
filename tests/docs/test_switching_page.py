"""docs/switching-from-kube2iam.md's differences that no single recorded answer shows (the
generated table is tests/kube2iam/test_kube2iam_record.py's): each row says what the code,
the flags and the manifests do, checked here against them."""

import sys
from pathlib import Path

from kiamfast.config import FLAGS_BY_NAME
from kiamfast.control.iam.keys import CredentialRequest, SessionNaming, fnv32a
from kiamfast.server.responses import PASSTHROUGH_LIMITED
from kiamfast.server.upstream import PassthroughLimit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "deploy"))
from kustomize_lite import render as kustomize  # noqa: E402

PAGE = (ROOT / "docs" / "switching-from-kube2iam.md").read_text()
ROLE = "arn:aws:iam::123456789012:role/team/app-role"


def row(first_cell: str) -> str:
    """The row of the page's hand-written table whose first cell starts so."""
    rows = [line for line in PAGE.splitlines() if line.startswith(f"| {first_cell}")]
    assert len(rows) == 1, f"no single row for {first_cell!r} in the switching page"
    return rows[0]


def session_name(policy: str, request: CredentialRequest) -> str:
    naming = SessionNaming(node_name="node-a", session_policy=policy)
    key = naming.key_for(request)
    return naming.session_name(key, [("uid-1", request)])


def test_the_session_name_row_names_what_sts_is_sent():
    text = row("STS session name")
    pod = CredentialRequest(ROLE, namespace="shop", pod_name="cart-1", pod_ip="10.0.0.7")
    assert FLAGS_BY_NAME["session-name-policy"].default == "node-role"
    assert "`--session-name-policy=node-role`, the default" in text
    assert session_name("node-role", pod) == "node-a-app-role" and "`<node>-<role name>`" in text
    assert session_name("pod", pod) == "shop.cart-1" and "`<namespace>.<pod>`" in text
    # kube2iam's form: fnv32a of the pod's address, unpadded hex, then the role's name.
    assert session_name("kube2iam", pod) == f"{fnv32a('10.0.0.7'):x}-app-role"
    assert "`<fnv32a of the asking pod's IP>-<role name>`" in text


def test_the_passthrough_row_gives_the_defaults_and_the_429():
    text = row("many passthrough requests")
    rate, burst, concurrency = (FLAGS_BY_NAME[f"passthrough-{name}"].default
                                for name in ("qps", "burst", "concurrency"))
    assert f"`--passthrough-qps` ({rate:g}/s)" in text
    assert f"`--passthrough-burst` ({burst})" in text
    assert f"`--passthrough-concurrency` ({concurrency})" in text
    status_line, _, body = PASSTHROUGH_LIMITED.partition(b"\r\n\r\n")
    assert status_line.startswith(b"HTTP/1.1 429 ")
    assert f"**429** `{body.decode().strip()}`" in text
    # Under the defaults one address gets its burst, then is refused until the bucket refills.
    now = [0.0]
    limit = PassthroughLimit(rate=rate, burst=burst, concurrency=burst + 1,
                             clock=lambda: now[0])
    granted = 0
    while limit.acquire(b"10.0.0.7"):
        limit.release(b"10.0.0.7")
        granted += 1
    assert granted == burst
    assert limit.acquire(b"10.0.0.8"), "another address keeps its own share"
    now[0] += 1.0 / rate
    assert limit.acquire(b"10.0.0.7")


def test_the_imdsv2_row_matches_the_eks_overlay_and_the_base():
    text = row("token-less (IMDSv1) requests, with `deploy/overlays/eks`")

    def agent_args(directory: str) -> list[str]:
        daemonset, = [o for o in kustomize(ROOT / directory) if o["kind"] == "DaemonSet"]
        return daemonset["spec"]["template"]["spec"]["containers"][0]["args"]

    assert "--imdsv2=required" in agent_args("deploy/overlays/eks")
    assert not [a for a in agent_args("deploy/base") if a.startswith("--imdsv2")]
    assert FLAGS_BY_NAME["imdsv2"].default == "optional"
    assert "passes `--imdsv2=required`" in text and "**401**" in text
