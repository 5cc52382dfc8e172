"""Build the Cython hot path: every ext/_<name>.pyx becomes kiamfast._<name>."""
import glob
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("KIAMFAST_DEBUG", "0") == "1"

extensions = [
    Extension(
        f"kiamfast.{os.path.splitext(os.path.basename(path))[0]}",
        [path],
        include_dirs=["ext"],
        extra_compile_args=["-O2", "-std=gnu11"] + (["-UNDEBUG", "-g"] if DEBUG else []),
        define_macros=[("KIAMFAST_DEBUG", "1" if DEBUG else "0")],
    )
    for path in sorted(glob.glob("ext/_*.pyx"))
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    ),
)
