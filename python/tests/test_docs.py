"""Every ```python block of README.md and docs/*.md runs, as a script of its own, against the
package under test and exits 0. A block whose first line is `# fragment` is skipped. CUDA
examples run on the fake driver with two devices (docs/cuda.md, "Testing without a GPU")."""
import os
import re
import subprocess
import sys

import pytest

import shmtensor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def blocks():
    files = [os.path.join(ROOT, "README.md")]
    docs = os.path.join(ROOT, "docs")
    files += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    found = []
    for path in files:
        text = open(path, encoding="utf-8").read()
        for m in FENCE.finditer(text):
            code = m.group(1)
            if code.lstrip().startswith("# fragment"):
                continue
            line = text[:m.start()].count("\n") + 2
            found.append(pytest.param(code, id=f"{os.path.relpath(path, ROOT)}:{line}"))
    return found


@pytest.mark.parametrize("code", blocks())
def test_block_runs(code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(shmtensor.__file__)))
    env.update(SHMTENSOR_CUDA_DRIVER="fake", SHMTENSOR_FAKE_CUDA_DEVICES="2")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, timeout=120,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert r.returncode == 0, r.stdout
