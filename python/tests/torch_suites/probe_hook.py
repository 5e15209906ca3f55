"""Checks, under the installed run's environment, that install() is active in this process and in
children of the fork, spawn and forkserver start methods. Prints one line per process and
exits 0 when all four report it, 1 otherwise.

It also prints which function ForkingPickler now uses for torch.UntypedStorage (what install()
is expected to replace), whether shmtensor.torch has its C++ bridge, and which iterator a
DataLoader gets (DataLoader._get_iterator), for the report only: how install() hooks torch is its own
business.
"""
import multiprocessing
import sys


def report(_=None):
    import sitecustomize
    import torch
    import torch.multiprocessing  # registers torch's reducers, as in every test
    from multiprocessing.reduction import ForkingPickler
    reducer = ForkingPickler._extra_reducers.get(torch.UntypedStorage)
    name = f"{reducer.__module__}.{reducer.__qualname__}" if reducer else "none"
    installed = bool(getattr(sitecustomize, "INSTALLED", False))
    if installed:
        # Whether existing storages can move into arenas (the C++ bridge), when it says so.
        import shmtensor.torch
        bridge = getattr(shmtensor.torch, "has_bridge", None)
        name += f"; C++ bridge: {'yes' if bridge() else 'no'}" if bridge else ""
    from torch.utils.data import DataLoader
    get = DataLoader._get_iterator
    name += f"; DataLoader._get_iterator: {get.__module__}.{get.__qualname__}"
    return installed, name


def main():
    results = {"parent": report()}
    for method in ("fork", "spawn", "forkserver"):
        with multiprocessing.get_context(method).Pool(1) as pool:
            results[method] = pool.apply(report)
    for who, (installed, reducer) in results.items():
        print(f"  {who:<10} install() active: {'yes' if installed else 'NO'}; "
              f"UntypedStorage reducer: {reducer}")
    return 0 if all(installed for installed, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
