"""A release as users get it: deploy/release.sh pushes a two-architecture image and the OCI
chart to a real registry on loopback (Debian's docker-registry), and everything is then read
back the way users read it.

* the tag is one index of linux/amd64 and linux/arm64, at the digest the script printed (the
  registry's own Docker-Content-Digest and the sha256 of the bytes it serves);
* each platform's manifest and config, read through the distribution API, name its
  architecture and this checkout's commit;
* ``buildah pull --platform`` by tag and by the index digest, into an empty storage, gives the
  same image, whose compiled extensions (kiamfast/_server*.so, _table*.so) are ELF files of
  that architecture, and which runs there (arm64 under qemu): Python reports that machine
  and imports both extensions, ``kiamfast --version`` says the release and the commit;
  deploy/image/check_arch.sh, which every build runs, passes each and refuses each as the
  other architecture;
* the chart pulls from ``oci://`` with version = appVersion = the tag, no file of it names the
  unpublished default image, and ``helm install oci://...`` against the session's real
  kube-apiserver stores a DaemonSet running the pushed image at that tag (a node selector no
  node has keeps it from running anywhere; the chart running under a real kubelet is
  tests/k8s/test_chart_install.py's).
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

# The release fixture builds both images: arm64 emulated, about 25 minutes cold on this
# 2-core machine; amd64 is the image tier's cache hit.
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(4200)]

REPO = Path(__file__).resolve().parents[2]
PLATFORMS = ("linux/amd64", "linux/arm64")
REPOSITORY = "kiamfast/kiamfast"   # the image's path in the registry
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
# platform -> (ELF e_machine, what Python's platform.machine() says there)
MACHINES = {"linux/amd64": (62, "x86_64"), "linux/arm64": (183, "aarch64")}
CHECK_ARCH = REPO / "deploy" / "image" / "check_arch.sh"


def git_commit() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def index_of(release) -> dict:
    digest, index = release.registry.manifest(REPOSITORY, release.version)
    assert digest == release.digest
    return index


def platform_manifest_digest(release, platform: str) -> str:
    os_, arch = platform.split("/")
    (digest,) = [m["digest"] for m in index_of(release)["manifests"]
                 if (m["platform"]["os"], m["platform"]["architecture"]) == (os_, arch)]
    return digest


def config_of(release, platform: str) -> tuple[str, dict]:
    """(the config's digest, the config) of ``platform``'s image, from the registry."""
    _, manifest = release.registry.manifest(REPOSITORY,
                                            platform_manifest_digest(release, platform))
    digest = manifest["config"]["digest"]
    return digest, json.loads(release.registry.blob(REPOSITORY, digest))


def pull(pulled, platform: str, reference: str) -> str:
    """The image ID of ``buildah pull --platform`` (plain HTTP to the loopback registry)."""
    out = pulled.buildah("pull", "--quiet", "--tls-verify=false", "--platform", platform,
                         reference)
    return out.split()[-1]


def test_the_tag_is_one_index_of_both_platforms_at_the_printed_digest(release):
    status, headers, body = release.registry.get(f"/v2/{REPOSITORY}/manifests/{release.version}")
    assert status == 200
    assert headers["Docker-Content-Digest"] == release.digest
    assert "sha256:" + hashlib.sha256(body).hexdigest() == release.digest
    index = json.loads(body)
    assert index["mediaType"] in INDEX_TYPES
    platforms = sorted(f"{m['platform']['os']}/{m['platform']['architecture']}"
                       for m in index["manifests"])
    assert platforms == sorted(PLATFORMS)
    # and the script said where everything went
    assert f"image: {release.image}:{release.version}" in release.output.splitlines()
    assert f"chart: {release.chart} --version {release.version}" in release.output.splitlines()


@pytest.mark.parametrize("platform", PLATFORMS)
def test_each_platforms_config_is_its_architecture_and_this_commit(release, platform):
    _, config = config_of(release, platform)
    assert f"{config['os']}/{config['architecture']}" == platform
    env = dict(e.split("=", 1) for e in config["config"]["Env"])
    assert env["KIAMFAST_GIT_COMMIT"] == git_commit()
    assert config["config"]["Entrypoint"] == ["kiamfast"]


def elf_machine(path: Path) -> int:
    header = path.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and header[4] == 2 and header[5] == 1   # 64-bit, LE
    return struct.unpack_from("<H", header, 18)[0]


RUNS_HERE = "import platform, kiamfast._server, kiamfast._table; print(platform.machine())"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_each_platform_pulls_by_tag_and_digest_and_runs_as_its_architecture(
        release, pulled, platform):
    config_digest, _ = config_of(release, platform)
    by_tag = pull(pulled, platform, f"{release.image}:{release.version}")
    by_digest = pull(pulled, platform, f"{release.image}@{release.digest}")
    # An image's ID is its config's digest: both pulls are that platform's image.
    assert by_tag == by_digest == config_digest.removeprefix("sha256:")

    machine, python_machine = MACHINES[platform]
    ctr = pulled.buildah("from", "--pull-never", by_tag).strip()
    try:
        root = Path(pulled.buildah("mount", ctr).strip())
        extensions = sorted((root / "opt" / "venv" / "lib").glob(
            "python3*/site-packages/kiamfast/_*.so"))
        assert [p.name.split(".")[0] for p in extensions] == ["_server", "_table"]
        assert {p.name: elf_machine(p) for p in extensions} == \
            {p.name: machine for p in extensions}
        ran = pulled.buildah("run", "--isolation", "chroot", ctr, "--",
                             "python3", "-c", RUNS_HERE, timeout=300)
        assert ran == f"{python_machine}\n"
        version = pulled.buildah("run", "--isolation", "chroot", ctr, "--",
                                 "kiamfast", "--version", timeout=300)
        assert version.startswith(f"Version: {release.version} - Commit: {git_commit()} - ")
    finally:
        pulled.buildah("rm", ctr)


def check_arch(pulled, image: str, arch: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CHECK_ARCH), image, arch], capture_output=True, text=True,
                          timeout=120,
                          env=dict(os.environ, CONTAINERS_STORAGE_CONF=str(pulled.conf)))


def test_the_arch_check_passes_each_image_and_refuses_it_as_the_other(release, pulled):
    amd64 = pull(pulled, "linux/amd64", f"{release.image}@{release.digest}")
    arm64 = pull(pulled, "linux/arm64", f"{release.image}@{release.digest}")
    for image, arch in ((amd64, "amd64"), (arm64, "arm64")):
        ok = check_arch(pulled, image, arch)
        assert (ok.returncode, ok.stderr) == (0, "")
    for image, claimed, machine in ((amd64, "arm64", 62), (arm64, "amd64", 183)):
        refused = check_arch(pulled, image, claimed)
        assert refused.returncode == 1
        (line,) = refused.stderr.splitlines()
        assert line.startswith(f"deploy/image/check_arch.sh: {image} is not {claimed} ")
        assert "_server.cpython-311-" in line and f"is ELF machine {machine}" in line


def test_the_chart_pulls_from_the_registry_with_the_tag_as_version_and_app_version(
        release, tmp_path):
    release.helm("pull", release.chart, "--version", release.version, "--plain-http",
                 "--destination", str(tmp_path))
    with tarfile.open(tmp_path / f"kiamfast-{release.version}.tgz") as chart:
        meta = yaml.safe_load(chart.extractfile("kiamfast/Chart.yaml"))
        naming_ghcr = [m.name for m in chart if m.isfile()
                       and b"ghcr.io/kiamfast" in chart.extractfile(m).read()]
    assert (meta["name"], meta["version"], meta["appVersion"]) == \
        ("kiamfast", release.version, release.version)
    # ghcr.io/kiamfast/kiamfast is not published: the released chart names the pushed image.
    assert naming_ghcr == []


@pytest.mark.kube_apiserver
def test_helm_install_from_the_registry_deploys_the_pushed_image(release, kube_cluster):
    name = f"kf-release-{secrets.token_hex(3)}"
    kubeconfig = kube_cluster.kubeconfig_for(kube_cluster.admin.token, name=name)
    target = ["--namespace", name, "--kubeconfig", str(kubeconfig)]
    release.helm("install", name, release.chart, "--version", release.version, "--plain-http",
                 "--create-namespace", *target,
                 # stored, never scheduled: other tests' controllers share this etcd
                 "--set", "nodeSelector.kiamfast\\.io/release-test=no-such-node")
    try:
        (listed,) = json.loads(release.helm("list", "--output", "json", *target))
        assert (listed["chart"], listed["app_version"]) == \
            (f"kiamfast-{release.version}", release.version)
        daemonsets = kube_cluster.admin.call(
            "GET", f"/apis/apps/v1/namespaces/{name}/daemonsets")["items"]
        images = {c["name"]: c["image"] for ds in daemonsets
                  for c in ds["spec"]["template"]["spec"]["containers"]}
        # the agent and its socket keeper, one image
        assert images == {"kiamfast": f"{release.image}:{release.version}",
                          "socket-keeper": f"{release.image}:{release.version}"}
        assert daemonsets[0]["spec"]["template"]["spec"]["nodeSelector"] == \
            {"kiamfast.io/release-test": "no-such-node"}
    finally:
        release.helm("uninstall", name, "--wait", *target)
        kube_cluster.admin.request("DELETE", f"/api/v1/namespaces/{name}")
