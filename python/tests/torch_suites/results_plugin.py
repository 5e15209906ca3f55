"""pytest plugin (-p results_plugin): one JSON line per test in $SHMTENSOR_SUITE_RESULTS, and
the tests named in $SHMTENSOR_SUITE_DESELECT (one node id a line) deselected, by exact id
(pytest's own --deselect matches prefixes: test_sampler would take test_sampler_reproducibility).

A "start" line is written before each test and an "end" line after it, flushed at once, so a
run killed by the runner's timeout still tells which tests finished and which one hung.
Outcomes: passed, failed (the test body), error (setup or teardown), skipped.
"""
import json
import os

_MAX_TEXT = 4000
_out = None
_current = {}


def pytest_configure(config):
    global _out
    path = os.environ.get("SHMTENSOR_SUITE_RESULTS")
    if path:
        _out = open(path, "a", buffering=1, encoding="utf-8")


def _write(record):
    if _out is not None:
        _out.write(json.dumps(record) + "\n")
        _out.flush()


def pytest_runtest_logstart(nodeid, location):
    _current[nodeid] = {"outcome": "passed", "seconds": 0.0, "text": ""}
    _write({"event": "start", "id": nodeid})


def pytest_runtest_logreport(report):
    state = _current.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0, "text": ""})
    state["seconds"] += report.duration
    if report.skipped and state["outcome"] == "passed":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        state["outcome"], state["text"] = "skipped", reason
    elif report.failed and state["outcome"] in ("passed", "skipped"):
        state["outcome"] = "failed" if report.when == "call" else "error"
        state["text"] = str(report.longrepr)[-_MAX_TEXT:]


def pytest_runtest_logfinish(nodeid, location):
    state = _current.pop(nodeid)
    _write({"event": "end", "id": nodeid, **state})


def pytest_collection_modifyitems(config, items):
    names = set(os.environ.get("SHMTENSOR_SUITE_DESELECT", "").splitlines())
    dropped = [item for item in items if item.nodeid in names]
    if dropped:
        items[:] = [item for item in items if item.nodeid not in names]
        config.hook.pytest_deselected(items=dropped)


def pytest_deselected(items):
    for item in items:
        _write({"event": "deselected", "id": item.nodeid})
