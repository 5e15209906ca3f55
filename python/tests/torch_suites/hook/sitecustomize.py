"""Calls shmtensor.torch.install() at the start-up of every Python process of the installed run.

run_torch_suites.py puts this directory first on PYTHONPATH and sets
SHMTENSOR_TORCH_SUITES_INSTALL=1 for the installed run only. Python's `site` imports the first
`sitecustomize` on sys.path at every interpreter start, unless -S or -I is given, so install()
runs in the pytest process, in every process the tests start through the spawn and forkserver
start methods (a fresh interpreter with the parent's environment), and in any
`subprocess.run([sys.executable, ...])` they make; fork children inherit the installed state
from their parent. (usercustomize would also work, but is not imported under -s,
PYTHONNOUSERSITE or when the effective uid differs.)

A process in which install() fails must not go on as if stock: `site` would print one line and
continue, so the traceback is printed here and the process exits with status 86.

The sitecustomize this one shadows (Debian's, /etc/python3.X/sitecustomize.py) is run too.
"""
import importlib.util
import os
import sys

INSTALLED = False  # the runner's probe reads it in the parent, a fork and a spawn child


def _run_shadowed():
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        path = os.path.join(entry or os.getcwd(), "sitecustomize.py")
        if os.path.abspath(entry or os.getcwd()) != here and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


def _install():
    global INSTALLED
    try:
        import shmtensor.torch
        shmtensor.torch.install()
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.write(f"sitecustomize: shmtensor.torch.install() failed in pid {os.getpid()}; "
                         "exiting (status 86) rather than running stock\n")
        sys.stderr.flush()
        os._exit(86)
    INSTALLED = True


_run_shadowed()
if os.environ.get("SHMTENSOR_TORCH_SUITES_INSTALL") == "1":
    _install()
