"""Untimed waits of the native transport that Ctrl-C interrupts.

A native wait releases the GIL and sleeps in C++, where a signal does not reach Python: a
get() without a timeout in the main thread would sleep through Ctrl-C, where
multiprocessing's raises KeyboardInterrupt. So there such a wait is made in slices of
0.1 s, back in the interpreter between them (which runs the signal's handler). Other
threads, which Python's signal handlers never run in, wait in one call.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    _T = TypeVar("_T")

SLICE = 0.1


def untimed(call: Callable[[float | None], _T | None]) -> _T:
    """call(None)'s result, or in the main thread that of call(SLICE) repeated while it is
    false (the native calls say "timed out" with None, False or an empty list)."""
    if threading.current_thread() is not threading.main_thread():
        return call(None)  # type: ignore[return-value]  # (untimed: never None)
    while True:
        result = call(SLICE)
        if result:
            return result
