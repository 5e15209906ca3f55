"""multiprocessing.spawn, and torch.multiprocessing's spawn / start_processes /
ProcessContext: the first child that fails makes join() stop the others and raise, with the
child's traceback text in the parent's exception.

This module stands for multiprocessing.spawn (get_preparation_data, spawn_main, ... are
the standard library's, looked up there), and is callable: shmtensor.multiprocessing.spawn
(fn, nprocs=...) is spawn.spawn(fn, nprocs=...), as torch.multiprocessing.spawn(...) is.
So torch's function takes nothing away from the module of the same name.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.spawn as _mpspawn
import signal
import sys
import traceback
import types
import warnings
from typing import TYPE_CHECKING

from shmtensor._C import Error
from shmtensor.multiprocessing._reexport import reexport

if TYPE_CHECKING:
    import multiprocessing.process
    import multiprocessing.queues
    from collections.abc import Callable, Sequence
    from typing import Any


class ProcessException(Error):
    """A child of spawn()/start_processes failed (C++ shmtensor::ProcessException): a
    shmtensor.Error, as every exception shmtensor raises on purpose."""

    __slots__ = ["error_index", "error_pid"]

    def __init__(self, msg: str, error_index: int, pid: int | None) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.pid = pid

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.msg, self.error_index, self.pid)


class ProcessRaisedException(ProcessException):
    """A child raised: msg holds its traceback."""

    def __init__(self, msg: str, error_index: int, error_pid: int | None) -> None:
        super().__init__(msg, error_index, error_pid)


class ProcessExitedException(ProcessException):
    """A child exited with a non-zero code or was killed by a signal."""

    __slots__ = ["exit_code"]

    def __init__(self, msg: str, error_index: int, error_pid: int | None, exit_code: int,
                 signal_name: str | None = None) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self),
                (self.msg, self.error_index, self.pid, self.exit_code, self.signal_name))


def _wrap(fn: Callable[..., object], i: int, args: Sequence[Any],
          error_queue: multiprocessing.queues.SimpleQueue[str]) -> None:
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        pass  # the parent stopped us
    except Exception:
        error_queue.put(traceback.format_exc())
        sys.exit(1)


class ProcessContext:
    def __init__(self, processes: Sequence[multiprocessing.process.BaseProcess],
                 error_queues: Sequence[multiprocessing.queues.SimpleQueue[str]]) -> None:
        self.error_queues = error_queues
        self.processes = processes
        self.sentinels = {p.sentinel: i for i, p in enumerate(processes)}

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.processes]

    def join(self, timeout: float | None = None) -> bool:
        """Waits up to timeout (None: until one exits). True when every child has exited
        with 0, False while some run; if one failed, stops the others and raises
        ProcessRaisedException (with its traceback) or ProcessExitedException."""
        if not self.sentinels:
            return True
        ready = multiprocessing.connection.wait(list(self.sentinels), timeout=timeout)
        error_index = None
        for sentinel in ready:
            index = self.sentinels.pop(sentinel)
            process = self.processes[index]
            process.join()
            if process.exitcode != 0:
                error_index = index
                break
        if error_index is None:
            return not self.sentinels
        for process in self.processes:
            if process.is_alive():
                process.terminate()
            process.join()
        failed = self.processes[error_index]
        if self.error_queues[error_index].empty():
            code = failed.exitcode
            if code < 0:
                name = signal.Signals(-code).name
                raise ProcessExitedException(
                    "process %d terminated with signal %s" % (error_index, name),
                    error_index=error_index, error_pid=failed.pid, exit_code=code,
                    signal_name=name)
            raise ProcessExitedException(
                "process %d terminated with exit code %d" % (error_index, code),
                error_index=error_index, error_pid=failed.pid, exit_code=code)
        trace = self.error_queues[error_index].get()
        msg = "\n\n-- Process %d terminated with the following error:\n" % error_index
        raise ProcessRaisedException(msg + trace, error_index, failed.pid)


def start_processes(fn: Callable[..., object], args: tuple[Any, ...] = (), nprocs: int = 1,
                    join: bool = True, daemon: bool = False,
                    start_method: str = "spawn") -> ProcessContext | None:
    """Starts nprocs processes running fn(i, *args) with any start method. join=False
    returns the ProcessContext."""
    ctx = multiprocessing.get_context(start_method)
    processes, error_queues = [], []
    for i in range(nprocs):
        error_queue = ctx.SimpleQueue()
        process = ctx.Process(target=_wrap, args=(fn, i, args, error_queue), daemon=daemon)
        process.start()
        error_queues.append(error_queue)
        processes.append(process)
    context = ProcessContext(processes, error_queues)
    if not join:
        return context
    while not context.join():
        pass


def spawn(fn: Callable[..., object], args: tuple[Any, ...] = (), nprocs: int = 1,
          join: bool = True, daemon: bool = False,
          start_method: str = "spawn") -> ProcessContext | None:
    """torch.multiprocessing.spawn: always the spawn start method (use start_processes for
    another)."""
    if start_method != "spawn":
        warnings.warn("This method only supports start_method=spawn (got: %s).\n"
                      "To use a different start_method use:\n\t\t"
                      " shmtensor.multiprocessing.start_processes(...)" % start_method)
    return start_processes(fn, args, nprocs, join, daemon, start_method="spawn")


__getattr__, __dir__ = reexport(globals(), _mpspawn)


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> ProcessContext | None:
        return spawn(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
