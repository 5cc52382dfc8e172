"""Build the Cython hot path: every ext/_<name>.pyx becomes kiamfast._<name>; and stamp the
wheel with the commit it was built from (kiamfast/buildinfo.py reads it for --version)."""
import glob
import os
import subprocess
import time

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

DEBUG = os.environ.get("KIAMFAST_DEBUG", "0") == "1"
HERE = os.path.dirname(os.path.abspath(__file__))

extensions = [
    Extension(
        f"kiamfast.{os.path.splitext(os.path.basename(path))[0]}",
        [path],
        include_dirs=["ext"],
        extra_compile_args=["-O2", "-std=gnu11"] + (["-UNDEBUG", "-g"] if DEBUG else []),
    )
    for path in sorted(glob.glob("ext/_*.pyx"))
]


def build_stamp():
    """(commit, date) of this build: $KIAMFAST_GIT_COMMIT, else the checkout's commit (none
    in the image's build context: the image's environment names it); the date from
    $SOURCE_DATE_EPOCH (reproducible builds), else the commit's date."""
    commit = os.environ.get("KIAMFAST_GIT_COMMIT", "")
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "")
    try:
        out = subprocess.run(["git", "-C", HERE, "log", "-1", "--format=%h %ct"],
                             capture_output=True, text=True, timeout=30, check=False)
        found = out.stdout.split() if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        found = []
    if len(found) == 2:
        commit = commit or found[0]
        epoch = epoch or found[1]
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(epoch))) \
        if epoch.isdigit() and int(epoch) > 0 else ""
    return commit, date


class BuildPyWithStamp(build_py):
    """build_py, plus kiamfast/_build_stamp.py in the build (never in the source tree: an
    editable install asks git instead, so its answer follows new commits)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        commit, date = build_stamp()
        path = os.path.join(self.build_lib, "kiamfast", "_build_stamp.py")
        with open(path, "w") as f:
            f.write('"""Written by setup.py when this wheel was built."""\n'
                    f"COMMIT = {commit!r}\nDATE = {date!r}\n")


setup(
    cmdclass={"build_py": BuildPyWithStamp},
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    ),
)
