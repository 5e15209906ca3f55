"""The leak check itself: a test that leaves an fd, a shmtensor mapping or a /dev/shm name
behind fails (run in a separate pytest over a scratch copy of conftest.py)."""
import os
import shutil
import subprocess
import sys

import shmtensor

LEAKY = '''
import os
import numpy as np
import shmtensor, shmtensor.numpy as snp
kept = []

def test_clean():
    a = snp.zeros(10)

def test_fd():
    kept.append(os.open("/dev/null", os.O_RDONLY))

def test_mapping():
    kept.append(snp.zeros(10))

def test_name():
    shmtensor.set_sharing_strategy("file_system")
    try:
        kept.append(snp.zeros(10))
    finally:
        shmtensor.set_sharing_strategy("file_descriptor")
'''


def test_leaks_fail_the_test_that_made_them(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    shutil.copy(os.path.join(here, "conftest.py"), tmp_path)
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(shmtensor.__file__)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                        str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, cwd=tmp_path, env=env, timeout=120)
    out = r.stdout
    assert r.returncode == 1, out
    assert "PASSED test_leaky.py::test_clean" in out
    assert "ERROR at teardown of test_fd" in out and "leaked fd" in out and "/dev/null" in out
    assert "ERROR at teardown of test_mapping" in out and "memfd:shmtensor" in out
    assert "ERROR at teardown of test_name" in out and "leaked /dev/shm name: shmtensor_" in out
