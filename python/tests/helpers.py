"""Helpers for the Python tests: running code in a forked child with a verdict."""
import os
import sys
import traceback


def run_in_child(fn):
    """Forks; the child runs fn() and exits 0, or prints the traceback and exits 1 if it
    raised (an assert included). Returns the child's exit status (128 + signal if killed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def forget_inherited_forkserver():
    """In a forked child: forget the parent's forkserver, so that this process starts its
    own. multiprocessing keeps the server's pid in its state, and a forked child that asks
    for a forkserver child calls waitpid() on a pid that is not its child
    (ChildProcessError), a limit of the standard library's."""
    from multiprocessing import forkserver
    fs = forkserver._forkserver
    if fs._forkserver_alive_fd is not None:
        os.close(fs._forkserver_alive_fd)
    fs._forkserver_pid = fs._forkserver_address = fs._forkserver_alive_fd = None
