#!/usr/bin/python3
"""Compiles every ```cpp block of README.md and docs/*.md against the *installed* package.

What it does, in order (each step fails the test with the reason):
  1. `cmake --install BUILD --prefix WORK/prefix`: the package as a user gets it.
  2. Each ```cpp block becomes one translation unit: an optional hidden prelude and epilogue
     (HTML comments right before the block, invisible on the rendered page) around the block:
         <!-- doctest-prelude
         #include <shmtensor/shmtensor.h>
         int main() {
         -->
         ```cpp
         ...the statements the reader sees...
         ```
         <!-- doctest-epilogue
         }
         -->
     A block whose first line is `// fragment` is deliberately incomplete and not compiled;
     one whose first line is `// compile-only` is compiled and linked but not run.
  3. One CMake project with `find_package(shmtensor)` builds every unit against
     shmtensor::shmtensor (the shared library); the first runnable one is also linked
     statically (shmtensor::shmtensor_static) and through pkg-config. A unit that includes
     <shmtensor/torch.h> links shmtensor::torch instead (find_package(shmtensor COMPONENTS
     torch)); where the package was built without libtorch it is skipped, saying so.
  4. Every unit with a main() runs (60 s each) and must exit 0.
  5. Manager discovery: a program copied away from the package (not next to shmtensor-manager,
     as a Python interpreter in /usr/bin is not) shares a tensor with file_system in a fresh
     manager directory; the daemon it started must be WORK/prefix/bin/shmtensor-manager, found
     next to the library, not the build tree's.
  6. No /dev/shm name is left.
Usage: doc_examples.py SOURCE_DIR BUILD_DIR WORK_DIR [build|run]
  build: steps 1 to 3 only (no program runs, nothing touches /dev/shm, so CTest runs it
  beside other tests); run: steps 4 to 6, on what `build` left in WORK_DIR (CTest's
  docs.examples, which shares /dev/shm with the other IPC tests and takes turns with them).
  Without either, all of it.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

FENCE = re.compile(r"^```cpp[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
HIDDEN = re.compile(r"<!--\s*doctest-(prelude|epilogue)[ \t]*\n(.*?)-->", re.S)


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def run(cmd, **kw):
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if r.returncode != 0:
        print(r.stdout)
        fail(f"{cmd[0]} exited {r.returncode}")
    return r.stdout


def hidden_parts(text, start, end):
    """The hidden prelude right before [start, end) and the epilogue right after it."""
    prelude = epilogue = ""
    before = text[:start].rstrip()
    for m in HIDDEN.finditer(text[:start]):
        if m.group(1) == "prelude" and m.end() == len(before):
            prelude = m.group(2)
    m = HIDDEN.match(text[end:].lstrip("\n"))
    if m and m.group(1) == "epilogue":
        epilogue = m.group(2)
    return prelude, epilogue


def extract(source_dir):
    files = [os.path.join(source_dir, "README.md")]
    docs = os.path.join(source_dir, "docs")
    files += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    units = []
    for path in files:
        text = open(path, encoding="utf-8").read()
        rel = os.path.relpath(path, source_dir)
        for i, m in enumerate(FENCE.finditer(text)):
            body = m.group(1)
            first = body.lstrip().split("\n", 1)[0].strip()
            line = text[: m.start()].count("\n") + 1
            name = re.sub(r"[^A-Za-z0-9]+", "_", rel.rsplit(".", 1)[0]).strip("_") + f"_{i}"
            if first == "// fragment":
                print(f"skip {rel}:{line} (marked as a fragment)")
                continue
            prelude, epilogue = hidden_parts(text, m.start(), m.end())
            code = f'#line 1 "{rel}:{line} (prelude)"\n{prelude}\n#line {line + 1} "{rel}"\n{body}\n{epilogue}\n'
            runnable = re.search(r"\bint\s+main\s*\(", code) is not None
            units.append({"name": name, "where": f"{rel}:{line}", "code": code,
                          "run": runnable and first != "// compile-only", "main": runnable,
                          "torch": "<shmtensor/torch.h>" in code})
    return units


def shm_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("shmtensor_")}


def processes_running(exe):
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{pid}/exe") == exe:
                found.append(int(pid))
        except OSError:
            pass
    return found


DISCOVER = r"""
#include <shmtensor/shmtensor.h>
#include <iostream>
namespace st = shmtensor;
int main() {
  st::set_sharing_strategy("file_system");
  st::Tensor t = st::Tensor::ones({256}).share_memory_();  // starts the manager
  std::cout << "shared " << t.numel() << " " << t.is_shared() << "\n";
}
"""


def build(source_dir, build_dir, work):
    """Steps 1 to 3: the programs to run, as (where, path) pairs, also in WORK/runs.json."""
    shutil.rmtree(work, ignore_errors=True)
    prefix = os.path.join(work, "prefix")
    proj = os.path.join(work, "examples")
    os.makedirs(proj)

    run(["cmake", "--install", build_dir, "--prefix", prefix])

    units = extract(source_dir)
    if not units:
        fail("no ```cpp block found")
    with_torch = any(os.path.exists(os.path.join(d, "cmake", "shmtensor", "shmtensorTorchTargets.cmake"))
                     for d in (os.path.join(prefix, "lib"),
                               os.path.join(prefix, "lib", "x86_64-linux-gnu")))
    if not with_torch:
        for u in units:
            if u["torch"]:
                print(f"skip {u['where']} (needs shmtensor::torch: built without libtorch)")
        units = [u for u in units if not u["torch"]]
    components = " COMPONENTS torch" if any(u["torch"] for u in units) else ""
    lines = ["cmake_minimum_required(VERSION 3.25)", "project(doc_examples CXX)",
             f"find_package(shmtensor REQUIRED{components})"]
    for u in units:
        open(os.path.join(proj, u["name"] + ".cc"), "w").write(u["code"])
        kind = "add_executable" if u["main"] else "add_library"
        extra = "" if u["main"] else " OBJECT"
        lib = "shmtensor::torch" if u["torch"] else "shmtensor::shmtensor"
        lines.append(f"{kind}({u['name']}{extra} {u['name']}.cc)")
        lines.append(f"target_link_libraries({u['name']} PRIVATE {lib})")
    first_run = next((u for u in units if u["run"] and not u["torch"]), None)
    if first_run is None:
        fail("no runnable example")
    lines.append(f"add_executable(static_link {first_run['name']}.cc)")
    lines.append("target_link_libraries(static_link PRIVATE shmtensor::shmtensor_static)")
    open(os.path.join(proj, "discover.cc"), "w").write(DISCOVER)
    lines.append("add_executable(discover discover.cc)")
    lines.append("target_link_libraries(discover PRIVATE shmtensor::shmtensor)")
    open(os.path.join(proj, "CMakeLists.txt"), "w").write("\n".join(lines) + "\n")

    out = os.path.join(work, "out")
    run(["cmake", "-G", "Ninja", "-S", proj, "-B", out, "-DCMAKE_BUILD_TYPE=Release",
         f"-DCMAKE_PREFIX_PATH={prefix}"])
    r = subprocess.run(["cmake", "--build", out, "-j2", "--", "-k", "0"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(r.stdout)
        failed = re.findall(r"^FAILED: .*$", r.stdout, re.M)
        bad = sorted({u["where"] for u in units for f in failed if f"/{u['name']}.cc" in f
                      or f"{u['name']}.dir" in f or f.endswith(" " + u["name"])})
        fail("documentation examples do not compile: " + ", ".join(bad))

    # pkg-config: the same program, compiled by hand as a Makefile user would.
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(prefix, "lib", "pkgconfig") + ":" +
               os.path.join(prefix, "lib", "x86_64-linux-gnu", "pkgconfig"))
    flags = run(["pkg-config", "--define-prefix", "--cflags", "--libs", "shmtensor"], env=env).split()
    libdir = run(["pkg-config", "--define-prefix", "--variable=libdir", "shmtensor"], env=env).strip()
    pc_exe = os.path.join(out, "pkgconfig_link")
    run(["c++", os.path.join(proj, first_run["name"] + ".cc"), "-o", pc_exe, *flags,
         f"-Wl,-rpath,{libdir}"])

    runs = [(u["where"], os.path.join(out, u["name"])) for u in units if u["run"]]
    runs += [("static link of " + first_run["where"], os.path.join(out, "static_link")),
             ("pkg-config link of " + first_run["where"], pc_exe)]
    summary = {"runs": runs, "units": len(units),
               "objects": sum(1 for u in units if not u["main"])}
    with open(os.path.join(work, "runs.json"), "w") as f:
        json.dump(summary, f)
    print(f"OK: {len(units)} examples compiled")
    return summary


def run_programs(work):
    """Steps 4 to 6, on what build() left in `work`."""
    try:
        with open(os.path.join(work, "runs.json")) as f:
            summary = json.load(f)
    except FileNotFoundError:
        fail(f"{work}/runs.json does not exist: the examples were not built (docs.examples_build)")
    prefix = os.path.join(work, "prefix")
    out = os.path.join(work, "out")
    runs = summary["runs"]
    names_before = shm_names()
    for where, exe in runs:
        print(f"run {where}", flush=True)
        try:
            r = subprocess.run([exe], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=60, cwd=work)
        except subprocess.TimeoutExpired:
            fail(f"{where}: did not finish in 60 s")
        if r.returncode != 0:
            print(r.stdout)
            fail(f"{where}: exited {r.returncode}")

    # Manager discovery from a program that is not next to shmtensor-manager.
    away = os.path.join(work, "elsewhere")
    shutil.rmtree(away, ignore_errors=True)
    os.makedirs(away)
    exe = shutil.copy(os.path.join(out, "discover"), away)
    mdir = os.path.join(work, "manager")
    shutil.rmtree(mdir, ignore_errors=True)
    os.makedirs(mdir, mode=0o700)
    want = os.path.realpath(os.path.join(prefix, "bin", "shmtensor-manager"))
    denv = {k: v for k, v in os.environ.items() if k != "SHMTENSOR_MANAGER"}
    denv.update(SHMTENSOR_MANAGER_DIR=mdir, SHMTENSOR_MANAGER_GRACE_MS="10000")
    r = subprocess.run([exe], env=denv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=60)
    if r.returncode != 0 or "shared 256 1" not in r.stdout:
        print(r.stdout)
        fail(f"discover exited {r.returncode}")
    # The daemon serves 10 s after its last client left: it is still there to be found.
    started = processes_running(want)
    for pid in started:
        os.kill(pid, 15)
    if not started:
        print(r.stdout)
        fail(f"the daemon started for a program away from the package was not {want}")
    print(f"manager found next to the library: {want}")

    deadline = time.time() + 5
    while time.time() < deadline and shm_names() - names_before:
        time.sleep(0.05)
    left = shm_names() - names_before
    if left:
        fail("names left in /dev/shm: " + ", ".join(sorted(left)))
    print(f"OK: {summary['units']} examples compiled, {len(runs)} programs ran, "
          f"{summary['objects']} compiled as objects")


def main():
    if len(sys.argv) not in (4, 5) or (len(sys.argv) == 5 and sys.argv[4] not in ("build", "run")):
        fail(__doc__)
    source_dir, build_dir, work = (os.path.abspath(a) for a in sys.argv[1:4])
    mode = sys.argv[4] if len(sys.argv) == 5 else "all"
    if mode in ("build", "all"):
        build(source_dir, build_dir, work)
    if mode in ("run", "all"):
        run_programs(work)


if __name__ == "__main__":
    main()
