"""The image as users get it: built by deploy/image/build.sh, run by a real containerd.

* what it is: debian:bookworm-slim with Debian's python3, kiamfast in the /opt/venv venv,
  ENTRYPOINT kiamfast as uid 0; no compiler, no source tree, no wheel, and nothing of the CA
  bundle the build's pip trusted, in any layer;
* what it does: ``kiamfast --version`` and ``/bin/kube2iam --version`` say the version and
  the commit it was built from; a bad flag is one line naming it, exit 2;
* its iptables works with the node's backend, nft and legacy: in the node's network
  namespace a kube-proxy's hint chain says which backend the node uses, the agent's own
  detection (kiamfast.iptables.runner, as --iptables-backend=auto) picks it from inside the
  container and installs the DNAT rule there, and the node sees exactly that rule in that
  backend's nat table and nothing in the other's.
"""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from kiamfast import __version__

# The first test's setup builds the image: about 8 minutes cold on this 2-core machine.
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
FORBIDDEN = re.compile(r"^(usr/bin/(gcc|cc|c\+\+|g\+\+|x86_64-linux-gnu-gcc)(-\d+)?|"
                       r"usr/lib/gcc/|usr/include/python3|src/|wheels/)")


def blob(outer: tarfile.TarFile, digest: str) -> tarfile.ExFileObject:
    return outer.extractfile("blobs/sha256/" + digest.split(":", 1)[1])


PEM = re.compile(rb"-----BEGIN CERTIFICATE-----\s*(.*?)-----END CERTIFICATE-----", re.S)


def machine_only_certificates() -> set[bytes]:
    """The first base64 line of each certificate the machine's bundle adds to Debian's
    (a TLS-intercepting proxy's CA, say): what pip needed and no layer may keep."""
    def first_lines(data: bytes) -> set[bytes]:
        return {body.split(b"\n", 1)[0].strip() for body in PEM.findall(data)}
    stock = set()
    for cert in Path("/usr/share/ca-certificates").rglob("*.crt"):
        stock |= first_lines(cert.read_bytes())
    return first_lines(CA_BUNDLE.read_bytes()) - stock


@pytest.fixture(scope="module")
def oci(image_archive):
    """(config, [(path, holds a machine-only certificate) for each member of each layer])."""
    extra = machine_only_certificates()
    with tarfile.open(image_archive) as outer:
        (manifest_desc,) = json.load(outer.extractfile("index.json"))["manifests"]
        manifest = json.load(blob(outer, manifest_desc["digest"]))
        config = json.load(blob(outer, manifest["config"]["digest"]))
        members = []
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=blob(outer, layer["digest"]), mode="r|*") as tar:
                for m in tar:
                    data = tar.extractfile(m).read() if m.isfile() else b""
                    members.append((m.name.removeprefix("./"),
                                    any(line in data for line in extra)))
    return config, members


def test_image_config_is_the_agent_as_root(oci):
    config, _ = oci
    assert config["architecture"] == "amd64" and config["os"] == "linux"
    process = config["config"]
    assert process["Entrypoint"] == ["kiamfast"]
    assert process["User"] == "0"
    assert "8181/tcp" in process["ExposedPorts"]
    env = dict(e.split("=", 1) for e in process["Env"])
    assert env["PATH"].split(":")[0] == "/opt/venv/bin"
    assert env["KIAMFAST_GIT_COMMIT"] == git_commit()


def test_no_compiler_sources_wheels_or_build_ca_in_any_layer(oci):
    _, members = oci
    names = [name for name, _ in members]
    assert "opt/venv/bin/kiamfast" in names
    assert not [n for n in names if FORBIDDEN.match(n)]
    assert not [n for n in names if n.startswith("dev/")]   # no device nodes
    # The machine's CA bundle reached pip as a secret mount: none of its own certificates
    # is in any file of any layer (Debian's ca-certificates, which python3-venv pulls in,
    # is the image's bundle).
    assert not [n for n, holds_machine_ca in members if holds_machine_ca]


def git_commit() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_debian_python_in_a_venv(image):
    result = image.run(["python3", "-c", "import sys, kiamfast._table; "
                        "print(sys.version_info[:2], sys.prefix, sys.base_prefix)"])
    assert (result.returncode, result.stdout) == (0, "(3, 11) /opt/venv /usr\n"), result.stderr
    release = image.run(["cat", "/etc/os-release"])
    assert 'VERSION_CODENAME=bookworm' in release.stdout, release.stderr


SOURCES = """
import hashlib, json, pathlib, kiamfast
root = pathlib.Path(kiamfast.__file__).parent
print(json.dumps({str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                  for p in sorted(root.rglob("*.py"))}))
"""


def test_image_runs_this_checkouts_code(image):
    # What a cached layer could get wrong: every module of the checkout, byte for byte.
    result = image.run(["python3", "-c", SOURCES])
    assert result.returncode == 0, result.stderr
    installed = json.loads(result.stdout)
    # The one module the wheel's build adds (setup.py: the commit --version names, which
    # test_version checks).
    assert installed.pop("_build_stamp.py", None) is not None, "no build stamp in the wheel"
    root = REPO / "kiamfast"
    checkout = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*.py"))}
    assert installed == checkout


@pytest.mark.parametrize("exe", ["kiamfast", "/bin/kube2iam"])
def test_version(image, exe):
    result = image.run([exe, "--version"])
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(rf"Version: {re.escape(__version__)} - Commit: {git_commit()} - "
                        r"Date: \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\n", result.stdout), result.stdout
    assert result.stderr == ""


@pytest.mark.parametrize("exe", ["kiamfast", "/bin/kube2iam"])
def test_bad_flag_is_one_line_naming_it(image, exe):
    result = image.run([exe, "--no-such-flag"])
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == ["kiamfast: unknown flag: --no-such-flag"], \
        result.stderr


@pytest.mark.parametrize("backend", ["nft", "legacy"])
def test_iptables_version(image, backend):
    result = image.run([f"iptables-{backend}", "--version"])
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(rf"iptables v1\.8\.\d+ \({'nf_tables' if backend == 'nft' else 'legacy'}"
                        r"\)\n", result.stdout), result.stdout


RULE = ("169.254.169.254", "10.89.0.1", 8181, "kfc+")
DNAT = ("-A PREROUTING -d 169.254.169.254/32 -i kfc+ -p tcp -m tcp --dport 80 -j DNAT "
        "--to-destination 10.89.0.1:8181")
INSTALL = f"""
from kiamfast.iptables.runner import ensure_rule, resolve_backend
from kiamfast.iptables.rules import Rule
backend = resolve_backend("auto")
ensure_rule(Rule(*{RULE!r}), backend=backend)
print(backend)
"""


def nat_rules(image, backend: str) -> list[str]:
    listed = image.node.run([f"iptables-{backend}", "-w", "5", "-t", "nat", "-S", "PREROUTING"])
    return [line for line in listed.stdout.splitlines() if line.startswith("-A ")]


@pytest.fixture
def node_backend(image, request):
    """The node's kube-proxy uses ``request.param``: its hint chain in the mangle table."""
    backend = request.param
    hint = [f"iptables-{backend}", "-w", "5", "-t", "mangle"]
    image.node.run([*hint, "-N", "KUBE-IPTABLES-HINT"])
    try:
        yield backend
    finally:
        image.node.run([*hint, "-X", "KUBE-IPTABLES-HINT"])
        for line in nat_rules(image, backend):
            image.node.run([f"iptables-{backend}", "-w", "5", "-t", "nat",
                            *line.replace("-A", "-D", 1).split()])


@pytest.mark.parametrize("node_backend", ["nft", "legacy"], indirect=True)
def test_dnat_rule_from_inside_the_container_in_the_nodes_backend(image, node_backend):
    other = {"nft": "legacy", "legacy": "nft"}[node_backend]
    # Without NET_ADMIN (ctr's default capabilities) the rule cannot be added.
    denied = image.run(["python3", "-c", INSTALL])
    assert denied.returncode != 0 and nat_rules(image, node_backend) == []
    result = image.run(["python3", "-c", INSTALL], caps=["CAP_NET_ADMIN"])
    assert (result.returncode, result.stdout) == (0, f"{node_backend}\n"), result.stderr
    assert nat_rules(image, node_backend) == [DNAT]
    assert nat_rules(image, other) == []
    # Installing again (an agent restart) leaves one copy.
    again = image.run(["python3", "-c", INSTALL], caps=["CAP_NET_ADMIN"])
    assert again.returncode == 0, again.stderr
    assert nat_rules(image, node_backend) == [DNAT]
