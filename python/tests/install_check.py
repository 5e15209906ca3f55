#!/usr/bin/python3
"""The Python package as users install it, imported from outside any build tree.

  install_check.py cmake BUILD_DIR WORK_DIR PYTHON_INSTALL_DIR
      `cmake --install BUILD_DIR --prefix WORK_DIR/prefix --component python`; the package
      must be in WORK_DIR/prefix/PYTHON_INSTALL_DIR (relative: the interpreter's platlib
      under the prefix).
  install_check.py pip SOURCE_DIR WORK_DIR
      `git clone SOURCE_DIR` (a fresh clone: what is committed), then
      `/usr/bin/python3 -m pip install --no-build-isolation --no-deps --target WORK_DIR/target`
      of the clone (the clone's own build directory is kept under WORK_DIR between runs, so
      ccache and CMake rebuild little).
  install_check.py pip-build SOURCE_DIR WORK_DIR
  install_check.py pip-verify SOURCE_DIR WORK_DIR
      The two halves of `pip`: the clone and pip's build and install; the check of what it
      installed (CTest runs the build beside other tests and the check in turn with them).
Then, in a fresh interpreter with only that directory on PYTHONPATH and the working
directory elsewhere: import shmtensor from there, share an array with a forked child both
ways, and start the manager daemon (file_system, a fresh manager directory), which must be
the shmtensor-manager installed beside the module. No /dev/shm name may be left.
"""
import os
import shutil
import subprocess
import sys
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


def verify(package_root, work):
    package = os.path.join(package_root, "shmtensor")
    for f in ("__init__.py", "numpy.py", "shmtensor-manager", "py.typed", "_C.pyi"):
        if not os.path.exists(os.path.join(package, f)):
            fail(f"{f} is not installed in {package}")
    away = os.path.join(work, "elsewhere")
    mdir = os.path.join(work, "manager")
    shutil.rmtree(mdir, ignore_errors=True)
    os.makedirs(away, exist_ok=True)
    os.makedirs(mdir, mode=0o700)
    env = {k: v for k, v in os.environ.items() if k not in ("SHMTENSOR_MANAGER", "PYTHONPATH")}
    env.update(PYTHONPATH=package_root, SHMTENSOR_MANAGER_DIR=mdir,
               SHMTENSOR_MANAGER_GRACE_MS="10000")
    names_before = shm_names()
    out = run(["/usr/bin/python3", "-c", VERIFY, package], cwd=away, env=env, timeout=120)
    if "OK" not in out:
        fail("the check printed no OK:\n" + out)
    # The daemon serves 10 s after its last client left: it is still there to be found.
    want = os.path.realpath(os.path.join(package, "shmtensor-manager"))
    started = processes_running(want)
    for pid in started:
        os.kill(pid, 15)
    if not started:
        fail(f"no daemon running from {want}: the installed package did not find its own")
    deadline = time.time() + 5
    while time.time() < deadline and shm_names() - names_before:
        time.sleep(0.05)
    left = shm_names() - names_before
    if left:
        fail("names left in /dev/shm: " + ", ".join(sorted(left)))
    print(next((l for l in out.splitlines() if l.startswith("shmtensor._torch")), ""))
    print(f"OK: imported from {package}, daemon {want}")


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in ("cmake", "pip", "pip-build", "pip-verify"):
        fail(__doc__)
    mode = sys.argv[1]
    if mode == "cmake" and len(sys.argv) == 5:
        build, work, rel = os.path.abspath(sys.argv[2]), os.path.abspath(sys.argv[3]), sys.argv[4]
        prefix = os.path.join(work, "prefix")
        shutil.rmtree(prefix, ignore_errors=True)
        run(["cmake", "--install", build, "--prefix", prefix, "--component", "python"])
        verify(os.path.join(prefix, rel), work)
    elif mode.startswith("pip") and len(sys.argv) == 4:
        source, work = os.path.abspath(sys.argv[2]), os.path.abspath(sys.argv[3])
        clone, target = os.path.join(work, "src"), os.path.join(work, "target")
        if mode == "pip-verify":
            if not os.path.isdir(target):
                fail(f"{target} does not exist: pip-build did not run or failed")
            verify(target, work)
            return
        # The clone is replaced, its build directory kept (outside it), so that a rerun is
        # incremental.
        shutil.rmtree(clone, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        run(["git", "clone", "--quiet", "--no-hardlinks", source, clone])
        os.makedirs(os.path.join(work, "build-pip"), exist_ok=True)
        os.symlink(os.path.join(work, "build-pip"), os.path.join(clone, "build-pip"))
        env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get(
            "CMAKE_BUILD_PARALLEL_LEVEL", "2"), PIP_NO_INPUT="1", PIP_NO_INDEX="1",
            PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")
        started = time.time()
        run(["/usr/bin/python3", "-m", "pip", "install", "--no-build-isolation", "--no-deps",
             "--target", target, clone], env=env, cwd=work, timeout=1500)
        print(f"pip install took {time.time() - started:.0f} s", flush=True)
        if mode == "pip":
            verify(target, work)
    else:
        fail(__doc__)


if __name__ == "__main__":
    main()
