"""torch's CUDA tensors between processes: torch's own CUDA IPC against shmtensor's fd path,
side by side in one run (docs/cuda.md, "torch's CUDA tensors"). Needs a GPU and a CUDA torch.

  python3 python/bench/bench_torch_cuda.py [--small N] [--large N] [--json FILE]

Each case starts one spawn consumer and measures, after a warm-up:
- "small": fresh 4 KiB CUDA tensors (1,024 float32) sent one way through a queue; the consumer
  checks every 64th tensor's first value (a device-to-host read) and answers once at the end:
  tensors per second, producer's time from the first put to the consumer's answer;
- "large": a 64 MiB CUDA tensor (the same tensor each time) sent to the consumer, which
  answers with a small acknowledgement: the median time from put to the answer, beside one
  device-to-device copy of the same 64 MiB (torch's copy_, synchronized);
- "echo" (shmtensor only: torch refuses to send a CUDA tensor it received): the consumer
  sends the tensor itself back, and it arrives as the same storage.

The modes: "torch" (torch.multiprocessing, stock) and "shmtensor" (shmtensor.torch.install(),
the same torch.multiprocessing code). A case that fails prints its error as its result.
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback


def _consumer(mode, case, inq, outq, n):
    import torch
    if mode != "torch":
        import shmtensor.torch
        shmtensor.torch.install()
    torch.cuda.init()
    try:
        if case == "small":
            bad = 0
            for i in range(n):
                t = inq.get()
                if i % 64 == 0 and int(t[0].item()) != i:
                    bad += 1
                del t
            outq.put(("ok", bad))
        elif case == "large":
            for _ in range(n):
                t = inq.get()
                outq.put(True)  # an acknowledgement: the tensor arrived and is mapped
                del t
            outq.put(("ok", 0))
        else:  # echo
            for _ in range(n):
                t = inq.get()
                outq.put(t)
                del t
            outq.put(("ok", 0))
    except BaseException:
        outq.put(("error", traceback.format_exc()))


def run_case(mode, case, n):
    import torch
    import torch.multiprocessing as tmp
    if mode != "torch":
        import shmtensor.torch
        shmtensor.torch.install()
    ctx = tmp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_consumer, args=(mode, case, inq, outq, n))
    p.start()
    try:
        if case == "small":
            # All made before the clock starts: the figure is the sharing, not the kernels.
            ts = [torch.full((1024,), float(i), device="cuda") for i in range(n)]
            torch.cuda.synchronize()
            start = time.perf_counter()
            for t in ts:
                inq.put(t)
            status, detail = outq.get(timeout=600)
            secs = time.perf_counter() - start
            if status != "ok":
                raise RuntimeError(detail)
            result = {"tensors_per_s": n / secs, "wrong_values": detail}
        else:
            t = torch.ones(16 * 1024 * 1024, device="cuda")  # 64 MiB
            torch.cuda.synchronize()
            rounds = []
            for i in range(n):
                start = time.perf_counter()
                inq.put(t)
                back = outq.get(timeout=60)
                torch.cuda.synchronize()
                rounds.append(time.perf_counter() - start)
                if isinstance(back, tuple):
                    raise RuntimeError(back[1])
                same = back is True or back.data_ptr() == t.data_ptr()
                del back
            status, detail = outq.get(timeout=600)
            if status != "ok":
                raise RuntimeError(detail)
            dst = torch.empty_like(t)
            copies = []
            for _ in range(20):
                torch.cuda.synchronize()
                start = time.perf_counter()
                dst.copy_(t)
                torch.cuda.synchronize()
                copies.append(time.perf_counter() - start)
            warm = rounds[min(5, len(rounds) - 1):]
            result = {"round_trip_us_p50": 1e6 * statistics.median(warm),
                      "round_trip_us_min": 1e6 * min(warm),
                      "first_round_trip_us": 1e6 * rounds[0],
                      "dtod_copy_us_p50": 1e6 * statistics.median(copies),
                      "same_address_back": same}
    finally:
        if p.is_alive() and "result" not in locals():
            p.kill()
    p.join(60)
    result["consumer_exit"] = p.exitcode
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--large", type=int, default=25)
    ap.add_argument("--modes", default="torch,shmtensor")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, python {sys.version.split()[0]}",
          flush=True)
    results = {}
    for mode in args.modes.split(","):
        cases = [("small", args.small), ("large", args.large)]
        if mode != "torch":  # torch refuses to send a CUDA tensor it received
            cases.append(("echo", args.large))
        for case, n in cases:
            # Each case in a process of its own: torch's and shmtensor's state do not mix.
            import subprocess
            code = ("import json, sys; sys.path.insert(0, %r); import bench_torch_cuda as b; "
                    "print('RESULT ' + json.dumps(b.run_case(%r, %r, %d)))"
                    % (os.path.dirname(os.path.abspath(__file__)), mode, case, n))
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  timeout=120)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if line:
                r = json.loads(line[-1][7:])
            else:
                r = {"error": (proc.stderr or proc.stdout)[-1500:]}
            r["wall_s"] = round(time.perf_counter() - start, 1)
            results[f"{mode}/{case}"] = r
            print(f"{mode:10s} {case:6s} {json.dumps(r)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
