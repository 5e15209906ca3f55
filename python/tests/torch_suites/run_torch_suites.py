"""Runs torch's own test_multiprocessing.py and test_dataloader.py, stock and with
shmtensor.torch.install() active, and reports the tests that pass stock but not installed.

    /usr/bin/python3 python/tests/torch_suites/run_torch_suites.py --build-dir build \
        [--full] [--stock-all] [--python PYTHON --package-dir DIR] [--debian-suite SUITE | --sources DIR]

Each file runs installed first; then stock, only the tests that did not pass installed (a
test that passes installed is no regression, whatever it does stock), or the whole file when
the installed run ended early or with --stock-all, which also lists the tests that fail stock
and pass installed.

The files come from Debian's source package of the installed python3-torch (fetch_sources.py)
into BUILD/torch-suites/, where the logs, the per-test results and report.txt go too; with
--debian-suite SUITE, from the newest pytorch source package of that Debian release (trixie:
torch 2.6's files), and with --sources, from DIR/test/ (a pytorch source tree). Either is run
by --python (e.g. the torch 2.x lane's venv) with the package in --package-dir: torch's
newer suites against another torch (the torch 2.x lane does so).
docs/torch.md ("torch's own test suites") says what is stubbed, what the quick subset leaves
out and why the allow-list holds what it holds.

Exit status: 0 when every test that passes stock passes installed (or fails as the allow-list
says); 1 on any other regression, or when the stock run itself breaks; 77 (CTest's skip code)
when torch or the sources cannot be had, or when shmtensor.torch does not exist (unless
--stock-only, which runs and reports the stock side alone).
"""
import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree for the modules below

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from fetch_sources import SourcesUnavailable, fetch  # noqa: E402
from suite_lists import ALLOWED_REGRESSIONS, FILES, QUICK_DESELECT  # noqa: E402

SKIP = 77
PYTHON = "/usr/bin/python3"
STUBS = os.path.join(HERE, "stubs")
HOOK = os.path.join(HERE, "hook")
# Variables that change what torch's test utilities run (CI=true turns on torch's CI mode,
# which, among other things, makes test_dataloader's import fail without psutil): removed, so
# a run means the same on a developer's machine and in CI.
TORCH_TEST_VARIABLES = ("CI", "SANDCASTLE", "TW_JOB_USER", "SLOW_TESTS_FILE", "DISABLED_TESTS_FILE",
                        "NO_MULTIPROCESSING_SPAWN", "BUILD_ENVIRONMENT")
RUN_TIMEOUT = {"quick": 900, "full": 1800}  # seconds per file and run
OUTCOMES = ("passed", "failed", "error", "skipped", "timeout", "crashed")


def base_env():
    env = {k: v for k, v in os.environ.items()
           if k not in TORCH_TEST_VARIABLES and not k.startswith("PYTORCH_")}
    env.pop("SHMTENSOR_TORCH_SUITES_INSTALL", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def mode_env(mode, package_dir, full):
    env = base_env()
    if full:
        env["PYTORCH_TEST_WITH_SLOW"] = "1"  # torch's @slowTest tests: test_proper_exit
    if mode == "stock":
        env["PYTHONPATH"] = STUBS
    else:
        env["PYTHONPATH"] = os.pathsep.join([HOOK, STUBS, package_dir])
        env["SHMTENSOR_TORCH_SUITES_INSTALL"] = "1"
    return env


def shm_names():
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(("torch_", "shmtensor_"))}
    except FileNotFoundError:
        return set()


def installed_run_possible(package_dir):
    """None when shmtensor.torch can be imported from package_dir, else why not."""
    code = ("import importlib.util, sys; import shmtensor; "
            "sys.exit(0 if importlib.util.find_spec('shmtensor.torch') else 3)")
    env = base_env()
    env["PYTHONPATH"] = package_dir
    r = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True)
    if r.returncode == 3:
        return f"shmtensor.torch does not exist in {package_dir}/shmtensor yet"
    if r.returncode != 0:
        return f"cannot import shmtensor from {package_dir}: {r.stderr.strip().splitlines()[-1:]}"
    return None


class Run:
    """One pytest run of one file in one mode, and its per-test results."""

    def __init__(self, test_dir, file, mode, out_dir):
        self.file, self.mode = file, mode
        name = os.path.splitext(file)[0]
        self.log = os.path.join(out_dir, mode, name + ".log")
        self.results_path = os.path.join(out_dir, mode, name + ".jsonl")
        self.test_dir = test_dir
        self.results, self.deselected = {}, []
        self.seconds, self.returncode, self.timed_out = 0.0, None, False
        self.shm_left = []

    def execute(self, env, deselect, timeout, only=None):
        """Runs the file, or the node ids in `only` (all of this file)."""
        os.makedirs(os.path.dirname(self.log), exist_ok=True)
        open(self.results_path, "w").close()
        env = dict(env, SHMTENSOR_SUITE_RESULTS=self.results_path, SHMTENSOR_SUITE_DESELECT="\n".join(deselect))
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], HERE])  # the results plugin
        cmd = [PYTHON, "-m", "pytest", "-c", "pytest.ini", "--rootdir", ".", "-p", "no:cacheprovider",
               "-p", "results_plugin", "-q", "-rfE", *(only if only else [self.file])]
        shm_before = shm_names()
        start = time.monotonic()
        with open(self.log, "w") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=self.test_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                self.returncode = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.timed_out = True
            # Whatever the tests left running in their session (workers of a hung loader, or
            # a killed run's children) goes with the run.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        self.seconds = time.monotonic() - start
        self._read_results()
        left = shm_names() - shm_before
        if left:
            time.sleep(2)  # names that exiting processes are still unlinking
            left &= shm_names()
        self.shm_left = sorted(left)
        return self

    def _read_results(self):
        started = []
        with open(self.results_path, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if record["event"] == "start":
                    started.append(record["id"])
                elif record["event"] == "end":
                    self.results[record["id"]] = record
                else:
                    self.deselected.append(record["id"])
        for test_id in started:
            if test_id not in self.results:
                outcome = "timeout" if self.timed_out else "crashed"
                self.results[test_id] = {"outcome": outcome, "seconds": 0.0,
                                         "text": f"the run ended while this test ran ({outcome})"}

    def counts(self):
        c = {o: 0 for o in OUTCOMES}
        for r in self.results.values():
            c[r["outcome"]] += 1
        return c


def compare(stock, installed):
    """(regressions, allowed): lists of (test id, installed outcome, allow reason or text)."""
    regressions, allowed = [], []
    for test_id, r in sorted(stock.results.items()):
        if r["outcome"] != "passed":
            continue
        got = installed.results.get(test_id, {"outcome": "not run", "text": ""})
        if got["outcome"] == "passed":
            continue
        fragment, reason = ALLOWED_REGRESSIONS.get(test_id, (None, None))
        if fragment is not None and got["outcome"] == "failed" and fragment in got["text"]:
            allowed.append((test_id, got["outcome"], reason))
        else:
            regressions.append((test_id, got["outcome"], _summary(got["text"])))
    return regressions, allowed


def _summary(text):
    """One line of a failure's text: pytest's first `E   ` line (the exception), else its last."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("E ")]
    return (errors[0][1:].strip() if errors else (lines[-1:] or [""])[0])[:160]


def file_report(file, subset, stock, installed, out, stock_all):
    out.append(f"== {file} ({subset}) ==")
    out.append(f"{'':<10}" + "".join(f"{o:>9}" for o in OUTCOMES) + f"{'deselected':>11}{'time':>10}")
    for run in (installed, stock):
        if run is None:
            continue
        if run.returncode is None and not run.timed_out:
            out.append(f"{run.mode:<10}not run: every test passed installed")
            continue
        c = run.counts()
        extra = "  (killed: per-file time limit)" if run.timed_out else ""
        part = "" if run is installed or stock_all else "  (the tests that did not pass installed)"
        out.append(f"{run.mode:<10}" + "".join(f"{c[o]:>9}" for o in OUTCOMES)
                   + f"{len(run.deselected):>11}{run.seconds:>9.1f}s{extra}{part}")
    not_ours = [(t, r) for t, r in sorted(stock.results.items()) if r["outcome"] not in ("passed", "skipped")]
    out.append(f"fail stock (not our concern): {len(not_ours) or 'none'}")
    out += [f"  {r['outcome']:<8} {t}" for t, r in not_ours]
    regressions = []
    if installed is not None:
        regressions, allowed = compare(stock, installed)
        out.append(f"regressions (pass stock, not with install()): {len(regressions) or 'none'}")
        out += [f"  {o:<8} {t}\n           {why}" for t, o, why in regressions if o != "not run"]
        not_run = [t for t, o, _ in regressions if o == "not run"]
        if not_run:
            out.append(f"  not run  {len(not_run)} tests (the installed run ended before them): "
                       + " ".join(t.split("::", 1)[1] for t in not_run[:5]) + (" ..." if len(not_run) > 5 else ""))
        out.append(f"allowed regressions (suite_lists.ALLOWED_REGRESSIONS): {len(allowed) or 'none'}")
        out += [f"  {o:<8} {t}\n           {why}" for t, o, why in allowed]
        unused = [t for t in ALLOWED_REGRESSIONS if t.startswith(file + "::")
                  and installed.results.get(t, {}).get("outcome") == "passed"]
        out += [f"  on the allow-list but passed installed: {t}" for t in unused]
        if stock_all:
            fixed = [t for t, r in stock.results.items()
                     if r["outcome"] in ("failed", "error")
                     and installed.results.get(t, {}).get("outcome") == "passed"]
            out += [f"  fail stock, pass installed: {t}" for t in sorted(fixed)]
    for run in (stock, installed):
        if run is not None and run.shm_left:
            out.append(f"left in /dev/shm after the {run.mode} run: {' '.join(run.shm_left)}")
    out.append("")
    return regressions


def skipped(work, why):
    """Says why in one line, there and in report.txt (no older report stays behind)."""
    line = f"torch's test suites skipped: {why}"
    print(line)
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "report.txt"), "w") as f:
        f.write(line + "\n")
    return SKIP


def main(argv=None):
    global PYTHON
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", required=True, help="the CMake build tree")
    parser.add_argument("--package-dir", help="where the built package is (default BUILD/python)")
    parser.add_argument("--full", action="store_true", default=os.environ.get("SHMTENSOR_TORCH_SUITES") == "full",
                        help="run every test, torch's slow ones too (default: the quick subset; "
                             "also SHMTENSOR_TORCH_SUITES=full)")
    parser.add_argument("--stock-only", action="store_true", help="run the stock side only")
    parser.add_argument("--python", default=PYTHON,
                        help="the interpreter that runs the suites (default /usr/bin/python3)")
    parser.add_argument("--sources", help="a pytorch source tree holding test/ (default: "
                                          "Debian's source package, fetched)")
    parser.add_argument("--debian-suite",
                        help="fetch the test files from the newest pytorch source package of "
                             "this Debian release (e.g. trixie: torch 2.x's, for the torch 2.x "
                             "lane's wheel) instead of the installed python3-torch's")
    parser.add_argument("--stock-all", action="store_true",
                        help="run every test stock (default: those that did not pass installed)")
    args = parser.parse_args(argv)
    # A path (not a name PATH finds) is made absolute: the runs' working directory is the tests'.
    PYTHON = os.path.abspath(args.python) if os.sep in args.python else args.python
    build_dir = os.path.abspath(args.build_dir)
    package_dir = os.path.abspath(args.package_dir or os.path.join(build_dir, "python"))
    work = os.path.join(build_dir, "torch-suites")
    subset = "full" if args.full else "quick subset"

    if importlib.util.find_spec("torch") is None:
        return skipped(work, f"{PYTHON} cannot import torch (Debian's python3-torch)")
    try:
        test_root = (os.path.abspath(args.sources) if args.sources
                     else fetch(work, FILES, os.path.join(work, "fetch.log"), args.debian_suite))
    except SourcesUnavailable as e:
        return skipped(work, f"the sources cannot be had ({e}; details in {work}/fetch.log)")
    test_dir = os.path.join(test_root, "test")
    with open(os.path.join(test_dir, "pytest.ini"), "w") as f:
        # faulthandler_timeout: a test still running after 5 minutes has its threads' stacks
        # dumped into the log (the runner's own time limit then kills the run).
        f.write("[pytest]\nfaulthandler_timeout = 300\n")

    why_not = None if not args.stock_only else "--stock-only was given"
    why_not = why_not or installed_run_possible(package_dir)
    if why_not is not None and not args.stock_only:
        # Nothing to compare with: the stock side alone is --stock-only's job.
        return skipped(work, f"{why_not} (--stock-only runs the stock side)")
    lines = [f"torch's own test suites, {subset}; torch from {PYTHON}; results in {work}/runs", ""]
    if why_not is None:
        print("install() hook check (installed run's environment):", flush=True)
        probe = subprocess.run([PYTHON, os.path.join(HERE, "probe_hook.py")],
                               env=mode_env("installed", package_dir, False), capture_output=True, text=True)
        print(probe.stdout + probe.stderr, flush=True)
        lines[1:1] = ["", "install() in the installed run's processes:", *probe.stdout.splitlines()]
        if probe.returncode != 0:
            print("the install() hook does not reach every process: the installed run would not mean anything")
            return 1

    deselect = [] if args.full else list(QUICK_DESELECT)
    status = 0
    for path in FILES:
        file = os.path.basename(path)
        mine = [t for t in deselect if t.startswith(file + "::")]
        timeout = RUN_TIMEOUT["full" if args.full else "quick"]
        installed = None
        only = None
        if why_not is None:
            print(f"{file}: installed run ...", flush=True)
            installed = Run(test_dir, file, "installed", os.path.join(work, "runs")).execute(
                mode_env("installed", package_dir, args.full), mine, timeout)
            whole = args.stock_all or installed.timed_out or installed.returncode not in (0, 1)
            if not whole:
                only = sorted(t for t, r in installed.results.items() if r["outcome"] != "passed")
        stock = Run(test_dir, file, "stock", os.path.join(work, "runs"))
        if only != []:
            print(f"{file}: stock run{f' of {len(only)} tests' if only else ''} ...", flush=True)
            stock.execute(mode_env("stock", package_dir, args.full), mine, timeout, only)
            if stock.returncode not in (0, 1, 5) and not stock.timed_out:
                print(f"{file}: the stock run ended with status {stock.returncode}; see {stock.log}")
                status = 1
        if file_report(file, subset, stock, installed, lines, only is None):
            status = 1
    if why_not is not None:
        lines.append(f"installed run not done: {why_not}")
    report = "\n".join(lines) + "\n"
    with open(os.path.join(work, "report.txt"), "w") as f:
        f.write(report)
    print(report + f"(written to {work}/report.txt)")
    return status


if __name__ == "__main__":
    sys.exit(main())
