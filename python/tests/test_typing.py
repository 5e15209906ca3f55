"""The package's type information (PEP 561) against the package under test.

* py.typed and the stubs of the extension modules (_C.pyi, _torch.pyi) are in the package.
* _C.pyi names exactly what shmtensor._C has (classes, their methods and properties,
  functions, exceptions and their bases), with the parameters (names, kinds, defaults)
  that pybind11 writes into each docstring, and the simple types there; so does
  _torch.pyi for shmtensor._torch where it is built.
* mypy.stubtest finds no difference between each stub and its module (_torch's where it is
  built).
* `mypy --strict` type-checks typing_example.py, a user's program, with no error, and
  reports each deliberately wrong call of a small program, and nothing else.

mypy is Debian's python3-mypy, which `make deps` installs for /usr/bin/python3: there these
tests fail without it. Another interpreter (the torch 2.x lane's virtual environment, which
holds only its pinned packages) skips those that need mypy, saying so.
"""
import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import shmtensor

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(os.path.abspath(shmtensor.__file__))
PACKAGE_ROOT = os.path.dirname(PACKAGE)
HAS_MYPY = importlib.util.find_spec("mypy") is not None
DEBIAN_PYTHON = os.path.realpath(sys.executable) == os.path.realpath("/usr/bin/python3")
HAS_TORCH_MODULE = importlib.util.find_spec("shmtensor._torch") is not None

if os.environ.get("SHMTENSOR_TEST_SANITIZE"):
    pytest.skip("the type information is the same in every build: checked in the plain one",
                allow_module_level=True)


def need_mypy():
    if HAS_MYPY:
        return
    if DEBIAN_PYTHON:
        pytest.fail("/usr/bin/python3 cannot import mypy: install Debian's python3-mypy "
                    "(`make deps` does)")
    pytest.skip(f"mypy is not installed for {sys.executable} (make deps installs Debian's "
                "python3-mypy for /usr/bin/python3 only)")


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mypy-cache"))


def run_mypy(module, args, cwd):
    """`python -m <module> args` with the package under test importable (its directory first
    on PYTHONPATH) and found by mypy as an installed package (py.typed), from `cwd`."""
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    r = subprocess.run([sys.executable, "-m", module] + args, cwd=cwd, env=env, timeout=600,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return r.returncode, r.stdout


# ---- the files ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["py.typed", "_C.pyi", "_torch.pyi"])
def test_typing_files_are_in_the_package(name):
    assert os.path.isfile(os.path.join(PACKAGE, name)), (
        f"{name} is not in {PACKAGE}: python/CMakeLists.txt copies and installs it")


# ---- the stubs against the modules, without mypy ----------------------------------------------


def _is_alias(node):
    return (isinstance(node, ast.AnnAssign) and isinstance(node.annotation, ast.Name)
            and node.annotation.id == "TypeAlias")


def _decorators(node):
    return {ast.unparse(d) for d in node.decorator_list}


def stub_module(path):
    """{name: [FunctionDef...] | ClassDef | AnnAssign} of a stub's top level. Type aliases,
    imports and version-dependent blocks (`if sys.version_info ...`) are left out: the
    aliases exist for the stub only, and stubtest checks the rest."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    names = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.setdefault(node.name, []).append(node)
        elif isinstance(node, ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and not _is_alias(node):
            names[node.target.id] = node
    return names


def stub_members(cls):
    """{name: [FunctionDef...]} of a stub class: methods and properties. The buffer protocol's
    methods are left out: Python-level methods from 3.12 on (test_tensor_is_a_buffer)."""
    members = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name not in ("__buffer__",
                                                                   "__release_buffer__"):
            members.setdefault(node.name, []).append(node)
    return members


def runtime_members(cls):
    """What a pybind11 class defines: its methods and properties (the type's slot wrappers,
    pybind11's __init__ that raises "No constructor defined" among them, are not, nor
    pybind11's own _pybind11_conduit_v1_ of newer versions)."""
    return {name: v for name, v in vars(cls).items()
            if (isinstance(v, property) or type(v).__name__ in ("instancemethod", "function"))
            and not name.startswith("_pybind11_")}


def split_top(text):
    """Splits at the commas outside brackets and quotes."""
    parts, depth, quote, cur = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


SIGNATURE = re.compile(r"^(?:\d+\. )?(\w*)\((.*)\) -> (.+)$")


def runtime_signatures(obj, name):
    """[(params, return type)] from pybind11's docstring of a function or property getter;
    params are (name, kind, type, default or None); kind is "positional" for pybind11's
    unnamed arguments (argN), "star" for *args, else "keyword". Several for an overloaded
    function."""
    doc = obj.__doc__ or ""
    found = []
    for line in doc.splitlines():
        m = SIGNATURE.match(line.strip())
        if not m or m.group(1) not in (name, ""):
            continue
        params = []
        for p in split_top(m.group(2)):
            if p.startswith("**"):
                params.append((p[2:].split(":")[0], "starstar", None, None))
                continue
            if p.startswith("*"):
                params.append((p[1:].split(":")[0], "star", None, None))
                continue
            head, _, default = p.partition(" = ")
            pname, _, ptype = head.partition(": ")
            kind = "positional" if re.fullmatch(r"arg\d+", pname) else "keyword"
            params.append((pname, kind, ptype.strip(), default.strip() or None))
        found.append((params, m.group(3).strip()))
    assert found, f"no pybind11 signature in the docstring of {name}: {doc!r}"
    return found


def stub_signature(fn, method):
    """(params, return annotation) of a stub function, params as runtime_signatures'."""
    a = fn.args
    params = []
    positional = [(p, "positional") for p in a.posonlyargs] + [(p, "keyword") for p in a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for (p, kind), d in zip(positional, defaults):
        params.append((p.arg, kind, ast.unparse(p.annotation) if p.annotation else None,
                       None if d is None else ast.unparse(d)))
    if a.vararg:
        params.append((a.vararg.arg, "star", None, None))
    assert not a.kwonlyargs, f"{fn.name}: keyword-only parameters (pybind11 has none here)"
    if a.kwarg:
        params.append((a.kwarg.arg, "starstar", None, None))
    if method:
        assert params and params[0][0] == "self", f"{fn.name}: no self"
        params = params[1:]
    return params, ast.unparse(fn.returns) if fn.returns else None


# Runtime (pybind11) spellings of simple types, and how the stub may spell them.
SIMPLE = {"None": {"None"}, "bool": {"bool"}, "int": {"int", "SupportsIndex"},
          "float": {"float"}, "str": {"str", "bytes | str"}, "bytes": {"bytes"}}


def _normalized(runtime_type):
    t = re.sub(r"\btyping\.", "", runtime_type)
    m = re.fullmatch(r"Optional\[(.*)\]", t)
    if m:
        t = m.group(1) + " | None"
    return t


def _same_type(runtime_type, stub_type):
    """False only where the runtime type is a simple one (bool, int, ..., or one of them
    | None) and the stub says something else; other types are the stub's to be precise
    about (a pybind11 `object` or `tuple` says little)."""
    t = _normalized(runtime_type)
    base, optional = (t[:-len(" | None")], True) if t.endswith(" | None") else (t, False)
    if base not in SIMPLE:
        return True
    allowed = {s + " | None" if optional else s for s in SIMPLE[base]}
    return stub_type in allowed


def signature_problems(where, runtime_obj, stub_fns, method):
    """What differs between the stub's function (its overloads) and pybind11's signature."""
    name = where.rsplit(".", 1)[-1]
    runtime = runtime_signatures(runtime_obj, name)
    if len(runtime) != 1:
        return [f"{where}: overloaded at run time ({len(runtime)} signatures): compare by hand"]
    rparams, rreturn = runtime[0]
    if method:
        assert rparams and rparams[0][0] in ("self", "arg0"), (where, rparams)
        rparams = rparams[1:]
    overloaded = len(stub_fns) > 1
    problems = []
    matched = False
    for fn in stub_fns:
        sparams, sreturn = stub_signature(fn, method)
        mine = []
        if len(sparams) != len(rparams):
            mine.append(f"{len(sparams)} parameters in the stub, {len(rparams)} at run time")
        for (sn, sk, st, sd), (rn, rk, rt, rd) in zip(sparams, rparams):
            if sk != rk:
                mine.append(f"parameter {sn}: {sk} in the stub, {rk} ({rn}) at run time")
            elif sk == "keyword" and sn != rn:
                mine.append(f"parameter {sn} in the stub is {rn} at run time")
            if (sd is None) != (rd is None) and not overloaded:
                mine.append(f"parameter {sn}: default {sd} in the stub, {rd} at run time")
            elif sd is not None and rd is not None and ast.literal_eval(sd) != ast.literal_eval(rd):
                mine.append(f"parameter {sn}: default {sd} in the stub, {rd} at run time")
            if st is not None and rt is not None and not _same_type(rt, st):
                mine.append(f"parameter {sn}: {st} in the stub, {rt} at run time")
        if not overloaded and not _same_type(rreturn, sreturn):
            mine.append(f"returns {sreturn} in the stub, {rreturn} at run time")
        if not mine:
            matched = True
        elif not overloaded:
            problems += [f"{where}: {p}" for p in mine]
    if overloaded and not matched:
        problems.append(f"{where}: no overload of the stub matches the run-time signature "
                        f"{runtime[0]}")
    return problems


@pytest.mark.parametrize("module_name", ["_C", pytest.param("_torch", marks=pytest.mark.skipif(
    not HAS_TORCH_MODULE, reason="shmtensor._torch is not built (no libtorch)"))])
def test_stub_names_and_signatures(module_name):
    module = importlib.import_module("shmtensor." + module_name)
    stub = stub_module(os.path.join(PACKAGE, module_name + ".pyi"))
    runtime = {n for n in dir(module) if not (n.startswith("__") and n.endswith("__"))}
    assert sorted(runtime - set(stub)) == [], f"in shmtensor.{module_name}, not in the stub"
    assert sorted(set(stub) - runtime) == [], f"in the stub, not in shmtensor.{module_name}"
    problems = []
    for name, node in sorted(stub.items()):
        obj = getattr(module, name)
        if isinstance(node, list):
            problems += signature_problems(name, obj, node, method=False)
            continue
        if isinstance(node, ast.AnnAssign):
            if type(obj).__name__ != ast.unparse(node.annotation):
                problems.append(f"{name}: {ast.unparse(node.annotation)} in the stub, "
                                f"{type(obj).__name__} at run time")
            continue
        bases = [ast.unparse(b) for b in node.bases]
        want = [b.__name__ for b in obj.__bases__ if b.__name__ != "pybind11_object"]
        if bases != want:
            problems.append(f"{name}: bases {bases} in the stub, {want} at run time")
        if issubclass(obj, BaseException):
            continue  # the exceptions: their attributes are set on each instance (errors.cc)
        members = stub_members(node)
        have = runtime_members(obj)
        for missing in sorted(set(have) - set(members)):
            problems.append(f"{name}.{missing}: at run time, not in the stub")
        for extra in sorted(set(members) - set(have)):
            problems.append(f"{name}.{extra}: in the stub, not at run time")
        for member in sorted(set(members) & set(have)):
            fns, value = members[member], have[member]
            where = f"{name}.{member}"
            is_property = any("property" in _decorators(fn) for fn in fns)
            if is_property != isinstance(value, property):
                problems.append(f"{where}: a property in only one of the stub and the module")
            elif is_property:
                if value.fset is not None:
                    problems.append(f"{where}: settable at run time, read-only in the stub")
                (_, rreturn), = runtime_signatures(value.fget, "")
                sreturn = ast.unparse(fns[0].returns)
                if not _same_type(rreturn, sreturn):
                    problems.append(f"{where}: {sreturn} in the stub, {rreturn} at run time")
            else:
                problems += signature_problems(where, value, fns, method=True)
    assert problems == []


def test_tensor_is_a_buffer():
    # What the stub's __buffer__ says, on every Python version.
    t = shmtensor.zeros((2, 3), "int16")
    with memoryview(t) as m:
        assert (m.format, m.shape, m.readonly) == ("h", (2, 3), False)


def test_loader_next_signature_is_the_stubs():
    # _loader_next is a CPython function, not pybind11's: what inspect (and so stubtest) reads
    # of it is the stub's signature on every version, the module not a parameter (CPython 3.13
    # gives a METH_O function without a text signature one of its own, `(self, object, /)` for
    # an unbound one).
    import inspect
    f = shmtensor._C._loader_next
    assert str(inspect.signature(f)) == "(iterator, /)"
    assert (f.__module__, f.__self__) == ("shmtensor._C", shmtensor._C)


# ---- stubtest ---------------------------------------------------------------------------------

# Differences stubtest reports that are the module's nature, not drift (an unused entry is
# an error too, so this list stays true).
ALLOWLIST_C = [
    # pybind11's metaclass (pybind11_builtins.pybind11_type), which no stub can name.
    "shmtensor._C.Tensor", "shmtensor._C._Connection", "shmtensor._C._Frame",
    "shmtensor._C._Queue", "shmtensor._C.device", "shmtensor._C._Broadcast",
    "shmtensor._C._BroadcastReader", "shmtensor._C._IndexBoardWriter",
    "shmtensor._C._IndexBoardReader",
    # Classes without a constructor: pybind11's __init__(self, *args, **kwargs) raises
    # TypeError; the stub declares none.
    "shmtensor._C.Tensor.__init__", "shmtensor._C._Connection.__init__",
    "shmtensor._C._Frame.__init__", "shmtensor._C._BroadcastReader.__init__",
]
if sys.version_info < (3, 12):
    # The buffer protocol's Python-level methods (PEP 688), declared for every version as
    # typeshed declares them for bytes; the type has the protocol itself (test above).
    ALLOWLIST_C += ["shmtensor._C.Tensor.__buffer__", "shmtensor._C.Tensor.__release_buffer__"]


def stubtest(module, allowlist, tmp_path, cache):
    need_mypy()
    path = tmp_path / "allowlist.txt"
    path.write_text("".join(entry + "\n" for entry in allowlist))
    config = tmp_path / "mypy.ini"
    config.write_text(f"[mypy]\ncache_dir = {cache}\n")
    rc, out = run_mypy("mypy.stubtest", [module, "--allowlist", str(path),
                                         "--mypy-config-file", str(config)], tmp_path)
    assert rc == 0, out


def test_stubtest_c(tmp_path, mypy_cache):
    stubtest("shmtensor._C", ALLOWLIST_C, tmp_path, mypy_cache)


@pytest.mark.skipif(not HAS_TORCH_MODULE, reason="shmtensor._torch is not built (no libtorch)")
def test_stubtest_torch(tmp_path, mypy_cache):
    stubtest("shmtensor._torch", [], tmp_path, mypy_cache)


# ---- a user's program -------------------------------------------------------------------------


def mypy_errors(program, tmp_path, cache):
    """mypy --strict's error lines for `program` (a path), as (line, message)."""
    need_mypy()
    rc, out = run_mypy("mypy", ["--strict", "--no-error-summary", "--show-error-codes",
                                "--cache-dir", cache, program], tmp_path)
    errors = []
    for line in out.splitlines():
        m = re.match(r"^[^:]+:(\d+): error: (.*)$", line)
        if m:
            errors.append((int(m.group(1)), m.group(2)))
        elif ": note:" not in line:
            assert False, f"mypy (exit {rc}): {out}"
    assert (rc == 0) == (not errors), out
    return errors


def test_user_program_type_checks(tmp_path, mypy_cache):
    assert mypy_errors(os.path.join(HERE, "typing_example.py"), tmp_path, mypy_cache) == []


# Each line marked `# E` is a wrong use mypy must report; no other line may be reported.
WRONG = '''\
import numpy as np
import shmtensor
import shmtensor.multiprocessing as smp
import shmtensor.numpy as snp

t = shmtensor.zeros("3")  # E
n: str = t.numel()  # E
t.size("0")  # E
t.view(2.5)  # E
shmtensor.set_busy_poll("fast")  # E
shmtensor.set_sharing_strategy(1)  # E
shmtensor.Tensor((2, 3))  # E
snp.zeros(3, order="X")  # E
snp.is_shared(np.zeros(3), 1)  # E
q = smp.Queue()
q.put_many(5)  # E
q.get(timeout="1")  # E
q.qsize = 3  # E
a, b = smp.Pipe()
a.send_bytes(3)  # E
b.poll(timeout="now")  # E
smp.spawn(print, nprocs="2")  # E
smp.get_context().Queue(maxsize=None)  # E
shmtensor.zeros(3, device=1.5)  # E
t.to(dtype="int16").device.index + 1  # E
ok = t.shape + t.strides
'''


def test_wrong_calls_are_reported(tmp_path, mypy_cache):
    program = tmp_path / "wrong.py"
    program.write_text(WRONG)
    expected = {i for i, line in enumerate(WRONG.splitlines(), 1) if line.endswith("# E")}
    errors = mypy_errors(str(program), tmp_path, mypy_cache)
    reported = {line for line, _ in errors}
    assert reported == expected, "\n".join(f"{line}: {msg}" for line, msg in errors)
