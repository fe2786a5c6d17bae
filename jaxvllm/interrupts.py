"""Ctrl-C that waits for the engine's bookkeeping to be consistent.

A KeyboardInterrupt can land between any two bytecodes, for example after a jitted call
has consumed its donated KV cache but before the runner holds the new one. The engine
runs each step's host bookkeeping inside `defer_interrupts()`: a SIGINT that arrives
there is held and raised as soon as the block ends, when the engine is consistent again.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def defer_interrupts() -> Iterator[None]:
    """Hold SIGINT until the block ends, then deliver it to the previous handler. Only the
    main thread receives signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[tuple] = []
    previous = signal.signal(signal.SIGINT, lambda *args: received.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and callable(previous):
            previous(*received[0])  # Python's default handler raises KeyboardInterrupt here
        elif received and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)
