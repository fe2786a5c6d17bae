"""Ctrl-C that waits for the engine's bookkeeping to be consistent.

A KeyboardInterrupt can land between any two bytecodes, for example after a jitted call
has consumed its donated KV cache but before the runner holds the new one. The engine
runs each step's host bookkeeping inside `defer_interrupts()`: a SIGINT that arrives
there is held and raised as soon as the block ends, when the engine is consistent again,
or earlier where the block calls `deliver()` (before a point of no return).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class HeldInterrupts:
    """The SIGINTs held by one `defer_interrupts()` block."""

    def __init__(self) -> None:
        self.previous = None  # the handler the block replaced (None: nothing is held)
        self.received: list[tuple] = []

    def hold(self, *args) -> None:
        self.received.append(args)

    def deliver(self) -> None:
        """Raise a held SIGINT now (through the previous handler: Python's default raises
        KeyboardInterrupt), so that it lands before what follows, not after the block."""
        if not self.received:
            return
        args, self.received = self.received[0], []
        if callable(self.previous):
            self.previous(*args)
        elif self.previous == signal.SIG_DFL:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.raise_signal(signal.SIGINT)


@contextmanager
def defer_interrupts() -> Iterator[HeldInterrupts]:
    """Hold SIGINT until the block ends, then deliver it to the previous handler. Only the
    main thread receives signals; elsewhere this holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield HeldInterrupts()
        return
    held = HeldInterrupts()
    held.previous = signal.signal(signal.SIGINT, held.hold)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, held.previous)
        held.deliver()
