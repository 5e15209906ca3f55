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
