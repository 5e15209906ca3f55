"""A module of shmtensor.multiprocessing that stands for one of multiprocessing's: the names
it defines are its own, every other name is the standard library module's (looked up when
asked for, so a name replaced there later is seen here too)."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import multiprocessing
import pkgutil
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import importlib.machinery
    import types
    from collections.abc import Callable, Sequence
    from typing import Any


def reexport(
    namespace: dict[str, Any], module: types.ModuleType
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's __getattr__ and __dir__ that fall back to `module`."""

    def __getattr__(name: str) -> Any:
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError("module %r has no attribute %r"
                                 % (namespace["__name__"], name)) from None

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(dir(module)))

    return __getattr__, __dir__


# multiprocessing's submodules that shmtensor.multiprocessing has no module of its own for:
# `import shmtensor.multiprocessing.util` (and attribute access) gives the standard library's
# module itself, not a copy. connection, context, queues and spawn are shmtensor's, with
# everything else of the standard library's module of that name (reexport above). Those of
# another platform (popen_spawn_win32 imports msvcrt) are left out, so that dir() lists only
# what can be imported here.
OWN = frozenset({"connection", "context", "queues", "spawn"})
ALIASED = frozenset(m.name for m in pkgutil.iter_modules(multiprocessing.__path__)
                    if m.name not in OWN and not m.name.endswith("_win32"))
PACKAGE = "shmtensor.multiprocessing"


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds shmtensor.multiprocessing.X (and X.Y) for X in ALIASED, and loads it as
    multiprocessing.X: the placeholder module the import system makes is replaced in
    sys.modules by the real one before the import returns."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(PACKAGE + "."):
            return None
        rest = fullname[len(PACKAGE) + 1:]
        if rest.partition(".")[0] not in ALIASED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        real = importlib.import_module("multiprocessing." + module.__name__[len(PACKAGE) + 1:])
        sys.modules[module.__name__] = real


def install_aliases() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
