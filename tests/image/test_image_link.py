"""The image can put the container-credentials addresses on the node (--container-credentials-
link manages its link with iproute2's ``ip``, which the image must ship): run from inside the
built image, on the node's network, as the DaemonSet's container runs."""
from __future__ import annotations

import json
import subprocess

ENSURE = """
from kiamfast.container_credentials.link import ensure_addresses
print(ensure_addresses("kiamfast0", ["169.254.170.23", "fd00:ec2::23"]))
"""


def link_addresses(image) -> set[str] | None:
    shown = subprocess.run(["ip", "-n", image.node.name, "-j", "addr", "show", "dev",
                            "kiamfast0"], capture_output=True, text=True, timeout=20)
    if shown.returncode != 0:
        return None
    return {a["local"] for a in json.loads(shown.stdout)[0].get("addr_info", ())}


def test_the_image_puts_both_addresses_on_the_agents_link(image):
    assert image.run(["ip", "-V"]).stdout.startswith("ip utility, iproute2-")
    try:
        # Without NET_ADMIN (ctr's default capabilities) nothing is created.
        denied = image.run(["python3", "-c", ENSURE])
        assert denied.returncode != 0 and "Operation not permitted" in denied.stderr
        assert link_addresses(image) is None
        made = image.run(["python3", "-c", ENSURE], caps=["CAP_NET_ADMIN"])
        assert made.returncode == 0, made.stderr
        assert made.stdout == "['169.254.170.23', 'fd00:ec2::23']\n"
        assert {"169.254.170.23", "fd00:ec2::23"} <= link_addresses(image)
        # A restarted container finds them and adds nothing.
        again = image.run(["python3", "-c", ENSURE], caps=["CAP_NET_ADMIN"])
        assert (again.returncode, again.stdout) == (0, made.stdout), again.stderr
    finally:
        subprocess.run(["ip", "-n", image.node.name, "link", "del", "kiamfast0"],
                       capture_output=True, timeout=20)
