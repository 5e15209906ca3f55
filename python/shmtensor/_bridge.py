"""The C++ bridge shmtensor._torch for the torch that this interpreter imports.

A CMake build (`make`, `cmake --install`) compiles shmtensor._torch against the libtorch it
found at configure time and puts it in the package. A pip build does not: pip builds in an
isolated environment that holds no torch, and a bridge compiled against one torch must never
be imported by another (the bridge reaches into c10::StorageImpl, whose layout and symbols
change between releases). There, the bridge is compiled here, the first time shmtensor.torch
is imported, against the torch that is running, from the sources and headers the package
ships in _bridge/, and kept in a cache directory keyed by everything the result depends on:

    $SHMTENSOR_CACHE_DIR, else $XDG_CACHE_HOME/shmtensor, else ~/.cache/shmtensor
      torch-bridge/<torch version>-<sha256 key>/_torch<EXT_SUFFIX>

The key covers the sources and headers, torch's version, git revision, directory and C++ ABI,
the interpreter, the compiler and its version, and this package's directory (the module's
RPATH names it), so that a stale entry can never be loaded: anything else builds anew.

SHMTENSOR_TORCH_BRIDGE: `auto` (default: the package's own _torch, else the cache, else
compile), `off` (no bridge), `compile` (ignore the package's own _torch; the cache, else
compile). A compile that failed is not tried again with the same inputs (the cache entry
keeps the reason in `failed`; remove it to try again). CXX names the compiler (default c++).
load() never raises: without a bridge it returns the reason, and shmtensor.torch works
without it (docs/python.md).
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from types import ModuleType

SOURCES = ("torch_module.cc", "torch_storage.cc", "torch_tensor.cc")
MODULE = "shmtensor._torch"


def _package_dir() -> str:
    return os.path.dirname(os.path.realpath(__file__))


def cache_root() -> str:
    explicit = os.environ.get("SHMTENSOR_CACHE_DIR")
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "shmtensor")


def _library() -> str | None:
    """The libshmtensor.so that _C loaded (beside it where installed; in the build tree,
    build/): the bridge must link that one, a process holds one copy of the library."""
    import shmtensor._C  # noqa: F401, PLC0415
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip()
            if os.path.basename(path).startswith("libshmtensor.so"):
                return path
    return None


def _compiler() -> tuple[list[str], str] | None:
    cxx = os.environ.get("CXX", "c++").split()
    if not cxx or shutil.which(cxx[0]) is None:
        return None
    try:
        version = subprocess.run(cxx + ["--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return cxx, version


def _key(parts: list[str], files: list[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() + b"\0")
    for f in files:
        h.update(f.encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()[:24]


def _import(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[MODULE] = module
    return module


def _compile(torch: ModuleType, src: str, lib: str, cxx: list[str], out: str,
             log: str) -> str | None:
    """Compiles SOURCES into `out`; returns None, or why it failed."""
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    torch_lib = os.path.join(torch_dir, "lib")
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    py_include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(py_include, "Python.h")):
        return f"Python's headers are not installed ({py_include}/Python.h; Debian: python3-dev)"
    flags = ["-std=c++20", "-O2", "-DNDEBUG", "-fPIC", "-fvisibility=hidden",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", os.path.join(src, "include"),
             "-isystem", os.path.join(torch_dir, "include"),
             "-isystem", os.path.join(torch_dir, "include", "torch", "csrc", "api", "include"),
             "-isystem", py_include]
    objects, procs = [], []
    with open(log, "w") as logf:
        for name in SOURCES:
            obj = out + "." + name + ".o"
            cmd = cxx + flags + ["-c", os.path.join(src, name), "-o", obj]
            logf.write("+ " + " ".join(cmd) + "\n")
            logf.flush()
            procs.append(subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT))
            objects.append(obj)
        failed = [p.args for p in procs if p.wait() != 0]
        if not failed:
            link = cxx + ["-shared", "-o", out] + objects + [
                lib, "-L", torch_lib, "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10",
                f"-Wl,-rpath,{os.path.dirname(lib)}", f"-Wl,-rpath,{torch_lib}"]
            logf.write("+ " + " ".join(link) + "\n")
            logf.flush()
            if subprocess.run(link, stdout=logf, stderr=subprocess.STDOUT).returncode != 0:
                failed.append(link)
    for obj in objects:
        try:
            os.unlink(obj)
        except FileNotFoundError:
            pass
    if failed:
        with open(log) as f:
            tail = "".join(f.readlines()[-15:])
        return f"compiling it failed (the whole log: {log}):\n{tail}"
    return None


def load() -> tuple[ModuleType | None, str | None]:
    """(the bridge module, None), or (None, why there is none)."""
    mode = os.environ.get("SHMTENSOR_TORCH_BRIDGE", "auto")
    if mode not in ("auto", "off", "compile"):
        return None, f"SHMTENSOR_TORCH_BRIDGE is {mode!r}: use auto, off or compile"
    if mode == "off":
        return None, "SHMTENSOR_TORCH_BRIDGE=off"
    pkg = _package_dir()
    own_error = None
    if mode == "auto" and importlib.util.find_spec(MODULE) is not None:
        # Built with the package (CMake), against the libtorch found then.
        try:
            import shmtensor._torch as built  # noqa: PLC0415
            return built, None
        except ImportError as e:
            own_error = f"the package's own shmtensor._torch did not load ({e})"
    src = os.path.join(pkg, "_bridge")
    lib = _library()
    if not os.path.isdir(src) or lib is None:
        return None, own_error or f"{pkg} holds neither shmtensor._torch nor its sources"
    compiler = _compiler()
    if compiler is None:
        return None, (f"no C++ compiler ({os.environ.get('CXX', 'c++')}) to build it against "
                      "this torch (Debian: g++; or set CXX)")
    cxx, cxx_version = compiler
    import torch  # noqa: PLC0415

    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs
                   if f.endswith((".cc", ".h")))
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    key = _key([torch.__version__, str(getattr(torch.version, "git_version", "")), torch_dir,
                str(torch._C._GLIBCXX_USE_CXX11_ABI), sys.version, sys.executable,
                sysconfig.get_config_var("EXT_SUFFIX") or "", " ".join(cxx), cxx_version, pkg,
                os.path.realpath(lib)], files)
    where = os.path.join(cache_root(), "torch-bridge",
                         f"{torch.__version__.replace('+', '_')}-{key}")
    out = os.path.join(where, "_torch" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    try:
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, ".lock"), "w") as lock:
            # Processes importing at once: one compiles, the others wait and load its result.
            fcntl.flock(lock, fcntl.LOCK_EX)
            failed = os.path.join(where, "failed")
            if not os.path.exists(out):
                if os.path.exists(failed):  # the same inputs failed before: not again
                    with open(failed) as f:
                        return None, (f.read() + f"\n(kept from an earlier try with the same "
                                      f"torch, compiler and sources: remove {failed} to "
                                      "compile again)")
                print(f"shmtensor: compiling the torch bridge for torch {torch.__version__} "
                      f"(once per torch; cached in {where})", file=sys.stderr, flush=True)
                tmp = f"{out}.{os.getpid()}.tmp"
                why = _compile(torch, src, lib, cxx, tmp, os.path.join(where, "build.log"))
                if why is not None:
                    # Every process that imports shmtensor.torch (each DataLoader worker)
                    # would otherwise spend the same compile again.
                    with open(failed + ".tmp", "w") as f:
                        f.write(why)
                    os.replace(failed + ".tmp", failed)
                    return None, why
                os.replace(tmp, out)
    except OSError as e:
        return None, f"its cache directory {where} is not usable: {e}"
    try:
        return _import(out), None
    except ImportError as e:
        return None, f"{out} did not load: {e}"
