"""Builds shmtensor._C with the project's CMake build (pyproject.toml names setuptools as the
backend; scikit-build-core is not in Debian bookworm).

build_ext configures the repository with CMake (tests, benchmarks, examples and the libtorch
bridge off), builds the module and shmtensor-manager, and installs the CMake component
`python` into the build_lib directory: _C, the .py files, libshmtensor.so.<major>.<minor>, the
daemon, and under _bridge/ the torch bridge's sources and headers, all in shmtensor/.
setuptools then installs that directory as it is.

The torch bridge (shmtensor._torch) is never built here: pip builds in an isolated
environment without the user's torch, and a bridge built against another torch must not be
imported. The package compiles it at first import against the torch that runs, and caches
it (python/shmtensor/_bridge.py, docs/python.md).

The CMake build directory is build-pip/temp.<platform>-<interpreter>/cmake, one per
interpreter version; its CMake cache is made anew on every build (a previous pip run's
isolated environment, with its pybind11 and cmake, is gone), its objects are reused where
their compile commands are the same.

Environment: CMAKE_BUILD_PARALLEL_LEVEL (jobs, default: every CPU), SHMTENSOR_CMAKE_ARGS
(extra configure arguments, split on spaces). ccache is used when installed.
"""
import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        target = os.path.abspath(self.get_ext_fullpath(ext.name))
        install_dir = os.path.dirname(os.path.dirname(target))  # build_lib, above shmtensor/
        build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        cache = os.path.join(build_dir, "CMakeCache.txt")
        if os.path.exists(cache):
            os.unlink(cache)
        configure = [
            "cmake", "-S", ROOT, "-B", build_dir,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DSHMTENSOR_PYTHON_INSTALL_DIR={install_dir}",
            "-DSHMTENSOR_BUILD_PYTHON=ON",
            "-DSHMTENSOR_BUILD_TORCH=OFF",
            "-DSHMTENSOR_BUILD_TESTS=OFF",
            "-DSHMTENSOR_BUILD_BENCHMARKS=OFF",
            "-DSHMTENSOR_BUILD_EXAMPLES=OFF",
        ]
        try:  # pybind11 from the build environment (pyproject.toml), else the system's
            import pybind11
            configure.append(f"-Dpybind11_DIR={pybind11.get_cmake_dir()}")
        except ImportError:
            pass
        if shutil.which("ninja") and not os.path.exists(os.path.join(build_dir, "Makefile")):
            configure += ["-G", "Ninja"]
        if shutil.which("ccache"):
            configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
        configure += shlex.split(os.environ.get("SHMTENSOR_CMAKE_ARGS", ""))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        for cmd in (configure,
                    ["cmake", "--build", build_dir, "-j", jobs,
                     "--target", "shmtensor_python", "shmtensor-manager"],
                    ["cmake", "--install", build_dir, "--component", "python"]):
            print("+ " + " ".join(cmd), flush=True)
            subprocess.check_call(cmd)
        if not os.path.exists(target):
            raise RuntimeError(f"the CMake build did not produce {target}")


setup(
    packages=find_packages("python", exclude=["tests", "tests.*"]),
    package_dir={"": "python"},
    ext_modules=[CMakeExtension("shmtensor._C")],
    cmdclass={"build_ext": CMakeBuild},
    # Not build/: that is the CMake build directory of `make`.
    options={"build": {"build_base": "build-pip"}},
    zip_safe=False,
)
