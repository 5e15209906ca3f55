"""A two-node torchrun job on this machine (c10d rendezvous on 127.0.0.1, gloo): DDP over a
small model, each rank's DataLoader with shmtensor.torch.install() and torch's
DistributedSampler (ddp_job.py). Every rank sees exactly its shard, the ranks' shards make
the dataset, and the trained parameters are those of the same job without shmtensor."""
import os
import socket
import subprocess
import sys
import uuid

import ast

import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed")
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("this torch has no torch.distributed with gloo", allow_module_level=True)

if os.environ.get("SHMTENSOR_TEST_SANITIZE"):
    pytest.skip("a torchrun job of whole interpreters: the plain build runs it (its processes "
                "would all preload the sanitizer runtime)", allow_module_level=True)

from helpers import own_manager_group  # noqa: E402,F401 (fixture)

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_job.py")
BROADCAST_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "broadcast_job.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tcp_store_refused():
    """Why a TCPStore as torchrun's rendezvous makes it (the default backend) cannot start
    with this torch, or None. From torch 2.4 the default is libuv's, which torchrun's c10d
    and static rendezvous both take; a torch built without libuv (Debian 13's 2.6) refuses
    it, and every torchrun job fails stock before a rank starts (pytorch#148283)."""
    try:
        store = torch.distributed.TCPStore("127.0.0.1", free_port(), 1, True)
    except RuntimeError as e:
        return str(e) if "libuv" in str(e) else None
    del store
    return None


# A mark, not a module-level skip: pytest exits 5 (nothing collected) on the latter, which
# CTest counts as a failure unless the test's SKIP_REGULAR_EXPRESSION matches.
_refused = _tcp_store_refused()
needs_rendezvous = pytest.mark.skipif(
    bool(_refused),
    reason=f"torchrun cannot rendezvous with this torch {torch.__version__}: {_refused}")


def run_job(out_dir, install, method):
    """Two launchers (node ranks 0 and 1, one process each), as two machines would run."""
    env = dict(os.environ, SHMTENSOR_JOB_INSTALL="1" if install else "0",
               SHMTENSOR_JOB_METHOD=method or "", OMP_NUM_THREADS="1")
    endpoint = "127.0.0.1:%d" % free_port()
    run_id = uuid.uuid4().hex
    launchers = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                          "--nproc_per_node", "1", "--node_rank", str(node),
                          "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
                          "--rdzv_id", run_id, "--max_restarts", "0",
                          # torch 1.13's torchrun reads its default "0" for these as None
                          # under Python 3.11 (an IntFlag's 0 is no longer iterated) and
                          # fails; 2 (stderr, to a log and the console) is read right.
                          "--redirects", "2", "--tee", "2",
                          "--log_dir", str(out_dir / ("logs%d" % node)), JOB, str(out_dir)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for node in (0, 1)]
    outputs = []
    try:
        for p in launchers:
            outputs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(launchers, outputs):
        assert p.returncode == 0, out[-4000:]
    return [torch.load(os.path.join(out_dir, "rank%d.pt" % r)) for r in (0, 1)]


@needs_rendezvous
@pytest.mark.parametrize("method", [None, "forkserver"])
def test_two_node_ddp_job_with_install_matches_the_job_without(tmp_path, method):
    stock_dir, ours_dir = tmp_path / "stock", tmp_path / "installed"
    stock_dir.mkdir()
    ours_dir.mkdir()
    stock = run_job(stock_dir, False, method)
    ours = run_job(ours_dir, True, method)
    from ddp_job import EPOCHS, SAMPLES
    for results, installed in ((stock, False), (ours, True)):
        assert [r["rank"] for r in results] == [0, 1] and results[0]["world"] == 2
        for epoch in range(EPOCHS):
            g = torch.Generator().manual_seed(7 + epoch)  # DistributedSampler's own order
            order = torch.randperm(SAMPLES, generator=g).tolist()
            for r in results:
                assert r["seen"][epoch] == order[r["rank"]::2]  # exactly its shard
            assert sorted(results[0]["seen"][epoch] + results[1]["seen"][epoch]) == \
                list(range(SAMPLES))
        for r in results:
            assert set(r["installed"]) == {installed}
    for a, b in zip(stock, ours):
        assert len(a["params"]) == len(b["params"]) == 2
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q)
    assert torch.equal(ours[0]["params"][0], ours[1]["params"][0])  # DDP kept them equal


@needs_rendezvous
def test_a_torchrun_nodes_ranks_share_a_named_broadcast(tmp_path, own_manager_group):
    """docs/python.md's torchrun pattern, run by torchrun (3 ranks on this node,
    broadcast_job.py): local rank 0 makes the named Broadcast, the others open it by name;
    every reader gets rank 0's torch tensor as one shared block, and rank 0 sees their
    writes."""
    import shmtensor.torch as st  # noqa: PLC0415
    if not st.has_bridge():
        pytest.skip("shmtensor._torch (the C++ bridge) is not built")
    endpoint = "127.0.0.1:%d" % free_port()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                        "--nproc_per_node", "3", "--rdzv_backend", "c10d",
                        "--rdzv_endpoint", endpoint, "--rdzv_id", uuid.uuid4().hex,
                        "--max_restarts", "0", "--redirects", "2", "--tee", "2",
                        "--log_dir", str(tmp_path / "logs"), BROADCAST_JOB, str(tmp_path)],
                       env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=240)
    assert p.returncode == 0, p.stdout.decode(errors="replace")[-4000:]
    seen = [ast.literal_eval(open(tmp_path / ("rank%d.txt" % r)).read()) for r in range(3)]
    assert seen[0] == [0.0, 101.0, 102.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    for r in (1, 2):
        assert seen[r] == [3, [float(i) for i in range(8)], True]
