"""Docker's 64 MiB /dev/shm: torch's DataLoader, stock and with shmtensor.torch.install(),
side by side in a private mount namespace whose /dev/shm is a 64 MiB tmpfs (root only).
python/tests/test_torch_dev_shm.py asserts on it; `make run`'s demo (bench_torch.py --demo)
shows its 16 MiB cases.

Batches of 16 MiB (and 32 MiB), 2 forked workers, both sharing strategies, each case in a
forked child of one interpreter in the namespace. One loop drops each batch before it asks
for the next; the other ("keeping") keeps the previous batch while it waits for the next, as
a training loop that logs or checks it does. A batch takes its bytes and one page in shared
memory, torch's files (64 bytes of refcount before the data) as shmtensor's segments (a
page of header), so 64 MiB holds three 16 MiB batches, or one of 32 MiB; two workers with
torch's default prefetch may have five made or kept. Where /dev/shm cannot hold a batch,
stock torch's worker dies of SIGBUS (or torch raises), and shmtensor's segment becomes a
memfd, which /dev/shm's size does not bound (docs/torch.md, "Docker's /dev/shm").
"""
import json
import os
import shutil
import subprocess
import sys

BATCH = 4          # samples per batch
WORKERS = 2
BATCHES = 12


def scenario(mode, strategy, mib, keep):
    """Runs in a forked child of the namespace's interpreter: the DataLoader loop; returns
    what happened."""
    import gc
    import torch
    import torch.multiprocessing as tmp
    from torch.utils.data import DataLoader, Dataset
    tmp.set_sharing_strategy(strategy)
    if mode == "install":
        import shmtensor.torch as st
        st.install()
    floats = (mib << 20) // 4 // BATCH

    class Samples(Dataset):
        def __len__(self):
            return BATCHES * BATCH

        def __getitem__(self, i):
            return torch.full((floats,), float(i))

    got, wrong, error, kept = 0, [], None, None
    try:
        loader = DataLoader(Samples(), batch_size=BATCH, num_workers=WORKERS)
        for b in loader:
            first = got * BATCH
            want = torch.arange(first, first + BATCH, dtype=torch.float32).view(BATCH, 1)
            if b.shape != (BATCH, floats) or not bool((b == want).all()):
                wrong.append(got)
            got += 1
            kept = b if keep else None  # held while the loop waits for the next batch
            del b, want
        kept = None
    except Exception as e:  # stock torch's failure, reported as it is
        error = "%s: %s" % (type(e).__name__, str(e).strip().splitlines()[0][:200])
    loader = kept = None
    gc.collect()
    left = []
    if mode == "install":
        import shmtensor
        shmtensor.empty_cache()
        left = shmtensor_names(wait=True)
    return {"mode": mode, "strategy": strategy, "mib": mib, "keep": keep, "batches": got,
            "wrong": wrong, "error": error, "left": left}


def shmtensor_names(wait=False):
    import time
    deadline = time.monotonic() + (2.0 if wait else 0.0)
    while True:
        names = sorted(n for n in os.listdir("/dev/shm") if n.startswith("shmtensor_"))
        if not names or time.monotonic() >= deadline:
            return names
        time.sleep(0.02)


def run_forked(mode, strategy, mib, keep):
    """scenario(...) in a forked child; its result through a pipe. What escaped the scenario,
    or killed the child, is the case's error ("crash: ...")."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            out = json.dumps(scenario(mode, strategy, mib, keep)).encode()
        except BaseException as e:
            out = json.dumps({"crash": "%s: %s" % (type(e).__name__, e)}).encode()
            code = 1
        os.write(w, out)
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    got = json.loads(out) if out else {"crash": "the child died (wait status %d)" % status}
    if "crash" in got:
        got = {"mode": mode, "strategy": strategy, "mib": mib, "keep": keep, "batches": 0,
               "wrong": [], "error": "crash: " + got["crash"], "left": []}
    # What stock torch left (a worker killed by SIGBUS leaves its files): gone before the
    # next case, so that each starts with an empty /dev/shm. This tmpfs is private.
    for name in os.listdir("/dev/shm"):
        if name.startswith("torch_"):
            os.unlink(os.path.join("/dev/shm", name))
    return got


# (mode, strategy, MiB per batch, keeping the previous batch)
CASES = [("stock", "file_system", 16, False), ("install", "file_system", 16, False),
         ("stock", "file_descriptor", 16, False), ("install", "file_descriptor", 16, False),
         ("stock", "file_system", 16, True), ("install", "file_system", 16, True),
         ("stock", "file_descriptor", 16, True), ("install", "file_descriptor", 16, True),
         ("stock", "file_system", 32, False), ("install", "file_system", 32, False),
         ("stock", "file_descriptor", 32, False), ("install", "file_descriptor", 32, False),
         ("install", "file_system", 32, True), ("install", "file_descriptor", 32, True)]


def child_main(cases):
    """In the namespace, with the 64 MiB tmpfs mounted: the given cases, one JSON line
    each."""
    import torch  # noqa: F401  (imported once, before the forks)
    import shmtensor.torch  # noqa: F401
    for case in cases:
        print(json.dumps(run_forked(*case)), flush=True)


def skip_reason():
    if os.geteuid() != 0:
        return "needs root: a private mount namespace (unshare --mount) with a tmpfs on /dev/shm"
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux)"
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        "mount -t tmpfs -o size=64m tmpfs /dev/shm"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return "cannot mount a tmpfs in a private mount namespace: " + r.stderr.strip()[:200]
    return None


def run_in_namespace(mib=None, stock_mib=None):
    """The cases of CASES (of `mib` MiB batches only, when given; stock torch's of
    `stock_mib` MiB only, when given: a failing stock torch 2.x takes ~10 s to stop its
    workers) in a private mount namespace with a 64 MiB tmpfs on /dev/shm; their outcomes,
    in CASES's order. Check skip_reason() first. Raises RuntimeError when the namespace's
    run fails."""
    picked = [k for k, case in enumerate(CASES)
              if (mib is None or case[2] == mib)
              and (stock_mib is None or case[0] != "stock" or case[2] == stock_mib)]
    script = 'mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && exec "$0" "$1" --child "$2"'
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                        sys.executable, os.path.abspath(__file__),
                        ",".join(map(str, picked))],
                       capture_output=True, text=True, timeout=240)
    out = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode != 0 or len(out) != len(picked):
        raise RuntimeError("the namespace's run failed (exit %d): %s%s"
                           % (r.returncode, r.stdout[-2000:], r.stderr[-2000:]))
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    child_main([CASES[int(k)] for k in sys.argv[2].split(",") if k])
