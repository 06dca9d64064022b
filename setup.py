"""Builds randattn._core by configuring this repository's CMake project with only the Python
module enabled (no tests, benchmarks or examples) and building that one target. Package
metadata lives in pyproject.toml.

Environment: CMAKE_BUILD_PARALLEL_LEVEL (compile jobs, default 2), CMAKE_CXX_COMPILER_LAUNCHER
(e.g. ccache; read by CMake itself), RANDATTN_CMAKE_ARGS (extra configure arguments),
RANDATTN_CMAKE_BUILD_DIR (CMake's build directory; default: under setuptools' build_temp).
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """An extension built by CMake: no sources of its own for setuptools to compile."""

    def __init__(self, name, target):
        super().__init__(name, sources=[])
        self.target = target


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("RANDATTN_CMAKE_BUILD_DIR") or Path(self.build_temp) / "cmake").resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        config = "Debug" if self.debug else "Release"
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_BUILD_TYPE={config}",
            f"-DPython_EXECUTABLE={sys.executable}",
            "-DRANDATTN_PYTHON=ON",
            f"-DRANDATTN_PYTHON_OUTPUT_DIR={out_dir}",
            "-DRANDATTN_BUILD_TESTS=OFF",
            "-DRANDATTN_BUILD_BENCHMARKS=OFF",
            "-DRANDATTN_BUILD_EXAMPLES=OFF",
            "-DRANDATTN_INSTALL=OFF",
        ] + shlex.split(os.environ.get("RANDATTN_CMAKE_ARGS", ""))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")
        build = ["cmake", "--build", str(build_dir), "--config", config, "--target", ext.target, "-j", jobs]
        subprocess.run(configure, check=True)
        subprocess.run(build, check=True)


setup(
    ext_modules=[CMakeExtension("randattn._core", target="randattn_python")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
