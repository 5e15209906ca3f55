"""Untimed waits of the native transport that Ctrl-C interrupts.

A native wait releases the GIL and sleeps in C++, where a signal does not reach Python: a
get() without a timeout in the main thread would sleep through Ctrl-C, where
multiprocessing's raises KeyboardInterrupt. So there such a wait is made in slices of
0.1 s, back in the interpreter between them (which runs the signal's handler). Other
threads, which Python's signal handlers never run in, wait in one call.
"""
import threading

SLICE = 0.1


def untimed(call, timed_out):
    """call(None)'s result, or that of call(SLICE) repeated while timed_out(result) in the
    main thread."""
    if threading.current_thread() is not threading.main_thread():
        return call(None)
    while True:
        result = call(SLICE)
        if not timed_out(result):
            return result
