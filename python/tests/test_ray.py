"""shmtensor in a Ray job (docs/python.md, "In a Ray job"): actors that Ray starts on a local
cluster exchange torch tensors through a named Queue and a named Broadcast, writes seen both
ways, under both strategies. The job runs as its own driver process (ray_job.py), so that
Ray's processes and sockets are not this process's. Skipped, with the reason, where Ray is not
installed (the torch 2.x lane's venv pins it: docs/dependencies.md)."""
import json
import os
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed here (the torch 2.x lane pins it)")
pytest.importorskip("torch")

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_job.py")


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_ray_actors_share_tensors_through_named_channels(strategy):
    name = "ray_%s_%d_%d" % (strategy[5], os.getpid(), time.monotonic_ns() % 1000000)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run([sys.executable, JOB, strategy, name], capture_output=True, text=True,
                          timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["consumer"] == [1, [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]]  # after its write
    assert seen["producer_sees"] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    expected = [[i, [float(i)] * 4] for i in range(3)]
    assert seen["readers"] == [expected, expected]
    assert seen["writer_sees"] == [102.0] * 4
    assert seen["other_reader_sees"] == [102.0] * 4
