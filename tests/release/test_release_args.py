"""deploy/release.sh and deploy/image/build.sh refuse bad arguments before building anything:
exit 2, nothing on stdout, one line naming what is wrong. ``--help`` and ``--dry-run`` run
nothing (stand-ins for buildah and helm record any run); the dry run prints every command of a
release, and its ``docker buildx build`` (the route for users with docker) is linted against
the real buildx plugin's options and the Dockerfile, with no docker engine anywhere."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kiamfast import __version__

REPO = Path(__file__).resolve().parents[2]
RELEASE = REPO / "deploy" / "release.sh"
BUILD = REPO / "deploy" / "image" / "build.sh"
BUILD_BUILDX = REPO / "tests" / "tools" / "build_buildx.sh"


def refused(argv: list[str], **env: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                            env={**os.environ, "HELM": "true", **env})
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    (line,) = result.stderr.splitlines()
    return line


USAGE = ("usage: deploy/release.sh [--builder buildah|docker] [--plain-http] [--dry-run] "
         "VERSION REPOSITORY")


@pytest.mark.parametrize("args, says", [
    ([], USAGE),
    ([__version__], USAGE),
    (["--plain-http", __version__, "reg.example/kiamfast", "extra"], "usage: "),
    (["--insecure", __version__, "reg.example/kiamfast"], "unknown flag: --insecure"),
    (["v" + __version__, "reg.example/kiamfast"], f"VERSION v{__version__}: not a version"),
    ([__version__ + "+build.1", "reg.example/kiamfast"], "not a version like 0.1.0"),
    (["99.0.0", "reg.example/kiamfast"],
     f"VERSION 99.0.0: kiamfast is {__version__} (kiamfast/__init__.py): bump it first"),
    ([__version__, "https://reg.example/kiamfast"], "REPOSITORY https://reg.example/kiamfast: "),
    ([__version__, "Reg.Example/Kiamfast"], "not a registry host and path"),
    (["--builder", "podman", __version__, "reg.example/kiamfast"],
     "--builder podman: buildah or docker"),
    (["--builder"], "--builder needs buildah or docker"),
])
def test_release_refuses_bad_arguments_in_one_line(args, says):
    line = refused([str(RELEASE), *args])
    assert line.startswith("deploy/release.sh: ") and says in line, line


def test_release_without_helm_says_so():
    line = refused([str(RELEASE), __version__, "reg.example/kiamfast"],
                   HELM="/nonexistent/helm")
    assert line == "deploy/release.sh: needs helm (HELM=/nonexistent/helm)"


def test_build_refuses_a_platform_it_does_not_build():
    line = refused([str(BUILD), "localhost/kiamfast/kiamfast:x"], KIAMFAST_PLATFORM="linux/s390x")
    assert line == ("deploy/image/build.sh: KIAMFAST_PLATFORM=linux/s390x: linux/amd64 or "
                    "linux/arm64")


# ---- --help and --dry-run: nothing is built, pushed or run ---------------------------------

def recording_tools(directory: Path, *names: str) -> Path:
    """A directory of stand-ins for ``names`` that only record that they were run (in
    ``ran``): put first on PATH, they show that a dry run runs none of them."""
    directory.mkdir()
    for name in names:
        tool = directory / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >>"{directory}/ran"\n')
        tool.chmod(0o755)
    return directory


def dry_run(tmp_path: Path, *args: str, env: dict | None = None) -> list[str]:
    tools = recording_tools(tmp_path / "tools", "buildah", "helm")
    result = subprocess.run(
        [str(RELEASE), "--dry-run", *args], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}",
             "HELM": str(tools / "helm"), **(env or {})})
    assert result.returncode == 0, result.stderr
    assert "dry run" in result.stderr and "nothing is built or pushed" in result.stderr
    assert not (tools / "ran").exists(), (tools / "ran").read_text()
    return result.stdout.splitlines()


def test_help_says_every_flag_and_runs_nothing(tmp_path):
    tools = recording_tools(tmp_path / "tools", "buildah", "helm")
    for flag in ("--help", "-h"):
        result = subprocess.run([str(RELEASE), flag, __version__, "reg.example/kiamfast"],
                                capture_output=True, text=True, timeout=30,
                                env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}"})
        assert (result.returncode, result.stderr) == (0, "")
        for text in ("deploy/release.sh [--builder buildah|docker] [--plain-http] [--dry-run]",
                     "--dry-run", "--builder docker", "--plain-http", "HELM", "vVERSION"):
            assert text in result.stdout, text
        assert not result.stdout.startswith("#!")
    assert not (tools / "ran").exists()


def test_a_dry_run_prints_the_buildah_release_and_runs_none_of_it(tmp_path):
    lines = dry_run(tmp_path, __version__, "reg.example/platform")
    image = f"reg.example/platform/kiamfast:{__version__}"
    builds = [shlex.split(line) for line in lines if "deploy/image/build.sh" in line]
    assert [(b[1], b[-1]) for b in builds] == [
        ("KIAMFAST_PLATFORM=linux/amd64", f"localhost/kiamfast/release:{__version__}-amd64"),
        ("KIAMFAST_PLATFORM=linux/arm64", f"localhost/kiamfast/release:{__version__}-arm64")]
    (push,) = [shlex.split(line) for line in lines if line.startswith("buildah manifest push")]
    assert push[-1] == f"docker://{image}"
    (helm_push,) = [shlex.split(line) for line in lines if " push " in f" {line} "
                    and "helm" in line.split()[0]]
    assert helm_push[-1] == "oci://reg.example/platform/charts"
    assert lines[-3:] == [f"chart: oci://reg.example/platform/charts/kiamfast --version "
                          f"{__version__}", f"image: {image}",
                          "reg.example/platform/kiamfast@sha256:<the pushed index's digest>"]


def buildx_plugin() -> Path:
    """The docker CLI plugin tests/tools/build_buildx.sh builds (the docker CLI is the
    machine's; no docker engine is needed or asked)."""
    tools = Path(os.environ.get("KIAMFAST_TOOLS") or Path.home() / ".cache/kiamfast/tools")
    version = re.search(r"^BUILDX_VERSION=(\S+)$", BUILD_BUILDX.read_text(), re.M).group(1)
    plugin = tools / f"buildx-{version}" / "docker-buildx"
    if not shutil.which("docker") or not plugin.exists():
        pytest.skip(f"needs the docker CLI and its buildx plugin ({plugin}): run "
                    "tests/tools/build_buildx.sh")
    return plugin


def docker_config(tmp_path: Path) -> dict[str, str]:
    """A docker configuration whose CLI plugins are the buildx plugin, and no engine."""
    plugins = tmp_path / "docker" / "cli-plugins"
    plugins.mkdir(parents=True)
    (plugins / "docker-buildx").symlink_to(buildx_plugin())
    return {"DOCKER_CONFIG": str(tmp_path / "docker"),
            "DOCKER_HOST": f"unix://{tmp_path}/no-docker-engine.sock"}


def test_the_docker_buildx_route_renders_one_linted_multi_arch_build_and_push(tmp_path):
    env = docker_config(tmp_path)
    lines = dry_run(tmp_path, "--builder", "docker", __version__, "reg.example/platform",
                    env=env)
    (build,) = [shlex.split(line) for line in lines if line.startswith("docker buildx build")]
    # Linted by buildx itself: every option is one `docker buildx build` takes.
    helped = subprocess.run(["docker", "buildx", "build", "--help"], capture_output=True,
                            text=True, timeout=60, env={**os.environ, **env})
    assert helped.returncode == 0, helped.stderr
    options = set(re.findall(r"(--[a-z][a-z-]*)", helped.stdout))
    given = [a for a in build[3:] if a.startswith("--")]
    assert set(given) <= options, set(given) - options
    # ... and means what the release needs, against the Dockerfile it builds.
    pairs, args = {}, iter(build[3:-1])
    for option in args:
        if option != "--push":      # the one option without a value
            pairs.setdefault(option, next(args))
    assert pairs["--platform"] == "linux/amd64,linux/arm64"
    assert pairs["--tag"] == f"reg.example/platform/kiamfast:{__version__}"
    assert "--push" in build and build[-1] == str(REPO)
    assert pairs["--file"] == str(REPO / "Dockerfile")
    dockerfile = (REPO / "Dockerfile").read_text()
    secret = dict(p.split("=", 1) for p in pairs["--secret"].split(","))
    assert f"type=secret,id={secret['id']}" in dockerfile
    assert Path(secret["src"]).is_file()
    build_args = dict(build[i + 1].split("=", 1) for i, a in enumerate(build) if a == "--build-arg")
    declared = set(re.findall(r"^ARG (\w+)", dockerfile, re.M))
    assert set(build_args) == {"GIT_COMMIT", "BUILD_DATE", "SOURCE_DATE_EPOCH"} <= declared
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert build_args["GIT_COMMIT"] == commit
    assert not any(line.startswith(("buildah", "env ")) for line in lines)


def test_the_docker_route_refuses_plain_http_and_a_docker_without_buildx(tmp_path):
    line = refused([str(RELEASE), "--builder", "docker", "--plain-http", __version__,
                    "reg.example/kiamfast"])
    assert line.startswith("deploy/release.sh: --plain-http: buildah only")
    empty = tmp_path / "docker"
    empty.mkdir()
    line = refused([str(RELEASE), "--builder=docker", __version__, "reg.example/kiamfast"],
                   DOCKER_CONFIG=str(empty))
    assert "needs docker with the buildx plugin" in line


def test_the_ci_workflow_example_releases_its_tag_with_the_docker_route(tmp_path):
    """deploy/ci/github-actions-release.yaml's release step, as a pushed tag vVERSION runs
    it, with --dry-run added: the version it derives from the tag and its registry are
    taken, and the build is the buildx one."""
    workflow = yaml.safe_load((REPO / "deploy" / "ci" / "github-actions-release.yaml")
                              .read_text())
    assert workflow[True]["push"]["tags"] == ["v*.*.*"]        # YAML reads `on:` as True
    assert workflow["permissions"]["id-token"] == "write"
    (step,) = [s for s in workflow["jobs"]["release"]["steps"] if s.get("name") == "release"]
    command = step["run"].replace("deploy/release.sh", f"{RELEASE} --dry-run", 1)
    env = {**docker_config(tmp_path), **workflow["env"], "GITHUB_REF_NAME": f"v{__version__}"}
    tools = recording_tools(tmp_path / "tools", "helm")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60,
                            env={**os.environ, **env, "PATH": f"{tools}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr
    assert f"image: {workflow['env']['REGISTRY']}/kiamfast:{__version__}" in result.stdout
    assert any(line.startswith("docker buildx build") for line in result.stdout.splitlines())


def test_the_changelog_has_this_version_and_says_the_tag_convention():
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(__version__)}\b", changelog, re.M), "no section"
    assert "the git tag is `vX.Y.Z`" in " ".join(changelog.split())
    assert (REPO / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version",
                                                           "2.0,"]
