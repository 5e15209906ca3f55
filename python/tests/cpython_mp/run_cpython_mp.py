"""Runs CPython's own multiprocessing tests (the installed interpreter's
Lib/test/_test_multiprocessing.py; Debian's libpython3.X-testsuite) stock and with
shmtensor.multiprocessing's Queue, SimpleQueue, JoinableQueue, Pipe, Pool and get_context in
place of multiprocessing's, under one start method, and reports the difference.

    PYTHONPATH=build/python /usr/bin/python3 python/tests/cpython_mp/run_cpython_mp.py \\
        --method spawn [--out DIR] [--only PATTERN] [--full]

Every test runs with ours; then stock, the tests that did not pass with ours (a test that
passes with ours is no regression, whatever it does stock), or every test with --full, which
also lists the tests that pass with ours only. That halves the run: about 1 to 2 minutes
per start method on 2 cores instead of 2.5 to 3.5.

"With ours" means what a user who changes `import multiprocessing` gets: before the test
module is imported (in this process and, through __main__, in every child it starts) the
names multiprocessing.Queue, SimpleQueue, JoinableQueue, Pipe, Pool and get_context are
shmtensor.multiprocessing's. The tests of the 'processes' type and the module's own TestCase
classes run; the 'threads' (multiprocessing.dummy) and 'manager' types do not touch them.

Each test, and each class or module fixture between tests, runs under faulthandler: one
that takes longer than --test-timeout seconds (120) has every thread's stack printed and
its process killed; the test counts as 'hung' (a fixture's hang or a crash is charged to
the test after it) and the run goes on with the next test in a new process. A regression's
stacks are printed in the report. A test that passes stock and not with ours is run
again, both ways, once (CPython's suite has tests that are timing-sensitive on a loaded
machine); it is a regression when it passes stock and fails with ours again.

Exit status: 0 when every test that passes stock passes with ours (or fails as ALLOWED
below says, for the reason it gives); 1 otherwise; 77 (CTest's
skip code) when the interpreter has no test._test_multiprocessing.
"""
import argparse
import faulthandler
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import unittest

SKIP = 77
IMPLS = ("stock", "shmtensor")
# Tests that pass stock and not with ours, and why (docs/python.md, "Where
# shmtensor.multiprocessing differs"): the test's name without the module, the start
# methods it is allowed under, the reason.
ALLOWED = {
    "TestIgnoreEINTR.test_ignore": ("forkserver",),
    "TestStartMethod.test_mixed_startmethod": ("spawn",),  # it skips itself under the others
}
ALLOWED_WHY = {
    "TestIgnoreEINTR.test_ignore":
        "it signals a child after the child's send_bytes() of 16 MiB, counting on that child "
        "being blocked until the parent reads (a pipe holds 64 KiB). Ours returns once the "
        "message is in shared memory, the child exits, and under forkserver (whose server "
        "reaps it at once) os.kill() finds no such process. Under fork and spawn the exited "
        "child is still a zombie of the test's process and the test passes by that.",
    "TestStartMethod.test_mixed_startmethod":
        "(CPython 3.11.5 and later) it asserts that a Queue of the fork context cannot be "
        "passed to a spawn or forkserver child, whose start raises 'A SemLock created in a "
        "fork context is being shared with a process in a spawn context'. Ours has no "
        "SemLock: its Queue reaches a child of any start method (test_mp_dropin.py), so "
        "start() succeeds where the test expects the refusal.",
}
ENV_IMPL = "SHMTENSOR_CPYTHON_MP_IMPL"
ENV_METHOD = "SHMTENSOR_CPYTHON_MP_METHOD"
ENV_TIMEOUT = "SHMTENSOR_CPYTHON_MP_TEST_TIMEOUT"


def substitute():
    """multiprocessing's names that a changed import replaces, made shmtensor's."""
    import multiprocessing
    import shmtensor.multiprocessing as smp

    def Pool(*args, **kwargs):
        return smp.get_context().Pool(*args, **kwargs)

    multiprocessing.Queue = smp.Queue
    multiprocessing.SimpleQueue = smp.SimpleQueue
    multiprocessing.JoinableQueue = smp.JoinableQueue
    multiprocessing.Pipe = smp.Pipe
    multiprocessing.Pool = Pool
    multiprocessing.get_context = smp.get_context


# ---- the worker: this file as __main__ (and, under spawn and forkserver, as __mp_main__ in
# every child, which must see the same substitution and the same test classes) -------------

_method = os.environ.get(ENV_METHOD)
if _method:
    # Tests send SIGINT and expect KeyboardInterrupt: a process started in the background by
    # a shell (CI's, CTest's) inherits SIGINT ignored, and Python then leaves it so.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get(ENV_IMPL) == "shmtensor":
        substitute()
    import test._test_multiprocessing as _suite

    _suite.install_tests_in_module_dict(globals(), _method)


def selected(name):
    """The test classes this runner takes from the installed module dict."""
    obj = globals().get(name)
    if not (isinstance(obj, type) and issubclass(obj, unittest.TestCase)):
        return False
    return not name.startswith(("WithThreads", "WithManager"))


class _Recorder(unittest.TextTestResult):
    """Writes one JSON line per test start and outcome, flushed, so that the driver knows
    which test a killed process was in."""

    def __init__(self, stream, descriptions, verbosity, *, log, timeout):
        super().__init__(stream, descriptions, verbosity)
        self._log = log
        self._timeout = timeout
        self._outcome = None

    def _write(self, **record):
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()

    def startTest(self, test):
        self._outcome = "passed"
        self._write(event="start", test=test.id())
        faulthandler.dump_traceback_later(self._timeout, exit=True)
        super().startTest(test)

    def stopTest(self, test):
        super().stopTest(test)
        # Armed again, not cancelled: the class and module fixtures between two tests
        # (a Pool's tearDownClass joins its workers) are bounded too.
        faulthandler.dump_traceback_later(self._timeout, exit=True)
        self._write(event="end", test=test.id(), outcome=self._outcome)

    def addError(self, test, err):
        super().addError(test, err)
        if self._outcome is not None:
            self._outcome = "error"

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._outcome = "failed"

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._outcome = "skipped"

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._outcome = "skipped"

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._outcome = "failed"


def worker(ids, log_path, timeout):
    main = sys.modules["__main__"]
    names = [i[len("__main__."):] if i.startswith("__main__.") else i for i in ids]
    suite = unittest.defaultTestLoader.loadTestsFromNames(names, main)
    faulthandler.dump_traceback_later(timeout, exit=True)  # setUpModule, the first setUpClass
    with open(log_path, "a") as log:
        runner = unittest.TextTestRunner(
            stream=sys.stderr, verbosity=2,
            resultclass=lambda *a: _Recorder(*a, log=log, timeout=timeout))
        runner.run(suite)
    faulthandler.cancel_dump_traceback_later()


# ---- the driver --------------------------------------------------------------------------


def list_tests(method):
    env = dict(os.environ, **{ENV_METHOD: method, ENV_IMPL: "stock"})
    out = subprocess.run([sys.executable, __file__, "--list"], env=env, check=True,
                         capture_output=True, text=True).stdout
    return out.split()


def tail(path, lines=60):
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def run_impl(impl, method, ids, out_dir, timeout, tag, stacks):
    """Runs `ids` with `impl`, a new process after each hang or crash: {test id: outcome}.
    The output tail of each process that ended in a hang or crash goes to `stacks`, by the
    test it was in."""
    log_path = os.path.join(out_dir, "%s-%s%s.jsonl" % (method, impl, tag))
    text_path = os.path.join(out_dir, "%s-%s%s.log" % (method, impl, tag))
    open(log_path, "w").close()
    env = dict(os.environ, **{ENV_METHOD: method, ENV_IMPL: impl, ENV_TIMEOUT: str(timeout)})
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    outcomes = {}
    remaining = list(ids)
    with open(text_path, "w") as text:
        while remaining:
            try:
                # faulthandler ends a test or fixture that outlives `timeout`; this bounds
                # what it cannot see (a process stuck outside the interpreter).
                subprocess.run([sys.executable, __file__, "--worker", log_path] + remaining,
                               env=env, stdout=text, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, timeout=timeout * (len(remaining) + 10))
                killed = False
            except subprocess.TimeoutExpired:
                killed = True
            text.flush()
            started = None
            with open(log_path) as log:
                for line in log:
                    record = json.loads(line)
                    if record["event"] == "start":
                        started = record["test"]
                    else:
                        outcomes[record["test"]] = record["outcome"]
                        started = None
            after = [t for t in remaining if t not in outcomes]
            if not after:
                break
            # Ended early: in a test (hung, or the process died in it), or in a fixture
            # before the next one (charged to that test), which the next process skips.
            culprit = started if started is not None and started not in outcomes else after[0]
            stacks[(impl, culprit)] = tail(text_path)
            hung = killed or "Timeout (" in stacks[(impl, culprit)]
            outcomes[culprit] = "hung" if hung else "crashed"
            remaining = [t for t in after if t != culprit]
    return outcomes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=("fork", "spawn", "forkserver"))
    parser.add_argument("--out", default=None, help="where the logs go (default: a temp dir)")
    parser.add_argument("--only", default=None, help="test ids containing this substring")
    parser.add_argument("--test-timeout", type=float, default=120.0)
    parser.add_argument("--full", action="store_true",
                        help="run every test stock too (default: those that fail with ours)")
    parser.add_argument("--worker", metavar="LOG", default=None)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("ids", nargs="*")
    args = parser.parse_args()

    if args.list:
        loader = unittest.defaultTestLoader
        main_module = sys.modules["__main__"]
        for name in sorted(n for n in list(globals()) if selected(n)):
            for test in loader.loadTestsFromName(name, main_module):
                print(test.id())
        return 0
    if args.worker:
        worker(args.ids, args.worker, float(os.environ[ENV_TIMEOUT]))
        return 0

    if importlib.util.find_spec("test._test_multiprocessing") is None:
        print("SKIPPED: %s has no test._test_multiprocessing (Debian: libpython%d.%d-testsuite)"
              % (sys.executable, *sys.version_info[:2]))
        return SKIP
    if args.method is None:
        parser.error("--method is required")
    out_dir = args.out
    if out_dir is None:
        import tempfile
        out_dir = tempfile.mkdtemp(prefix="cpython-mp-")
    os.makedirs(out_dir, exist_ok=True)
    ids = list_tests(args.method)
    if args.only:
        ids = [t for t in ids if args.only in t]

    stacks = {}

    def run_counted(impl, run_ids):
        t0 = time.monotonic()
        outcomes = run_impl(impl, args.method, run_ids, out_dir, args.test_timeout, "", stacks)
        counts = {}
        for outcome in outcomes.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        print("%-9s %-10s %5.0f s  %3d tests: %s"
              % (impl, args.method, time.monotonic() - t0, len(run_ids),
                 " ".join("%s=%d" % kv for kv in sorted(counts.items()))), flush=True)
        return outcomes

    # Ours first, on every test; stock on every test with --full, else on those that did not
    # pass with ours: a test that passes with ours is no regression whatever stock does.
    ours = run_counted("shmtensor", ids)
    stock = run_counted("stock", ids if args.full else
                        [t for t in ids if ours.get(t) != "passed"])
    if not any(o == "passed" for o in list(stock.values()) + list(ours.values())):
        print("neither run passed a test: the runner is broken (logs: %s)" % out_dir)
        return 1
    suspects = [t for t in ids if stock.get(t) == "passed" and ours.get(t) != "passed"]
    regressions = []
    allowed = []
    if suspects:
        print("passed stock, not with ours: %d; each again, both ways" % len(suspects), flush=True)
        again_stock = run_impl("stock", args.method, suspects, out_dir, args.test_timeout,
                               "-again", {})
        again_ours = run_impl("shmtensor", args.method, suspects, out_dir, args.test_timeout,
                              "-again", stacks)
        for t in suspects:
            short = t.split(".", 1)[1]
            if again_stock.get(t) == "passed" and again_ours.get(t) != "passed":
                if args.method in ALLOWED.get(short, ()):
                    print("  allowed: %s (%s, then %s): %s"
                          % (t, ours[t], again_ours.get(t), ALLOWED_WHY[short]))
                    allowed.append(t)
                    continue
                regressions.append((t, ours[t], again_ours.get(t)))
            else:
                print("  flaky, not counted: %s (stock again: %s, ours again: %s)"
                      % (t, again_stock.get(t), again_ours.get(t)))
    if args.full:
        for t in ids:
            if ours.get(t) == "passed" and stock.get(t) != "passed":
                print("  passes with ours only: %s (stock: %s)" % (t, stock.get(t)))
    with open(os.path.join(out_dir, "report-%s.json" % args.method), "w") as f:
        json.dump({"stock": stock, "shmtensor": ours,
                   "regressions": [r[0] for r in regressions]}, f, indent=1)
    if regressions:
        print("REGRESSIONS (%s): passed stock, not with ours, twice:" % args.method)
        for t, first, second in regressions:
            print("  %s: %s, then %s" % (t, first, second))
        for t, _, _ in regressions:
            if ("shmtensor", t) in stacks:
                print("---- %s with ours: the end of its process's output (stacks of a hang) ----"
                      % t)
                print(stacks[("shmtensor", t)])
        print("logs (each test's output): %s" % out_dir)
        return 1
    print("%s: every test that passes stock passes with shmtensor.multiprocessing, but %d "
          "allowed (%d of %d pass with ours)" % (args.method, len(allowed),
                                                 sum(1 for t in ids if ours.get(t) == "passed"),
                                                 len(ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
