"""Ctrl-C that waits for the engine's bookkeeping to be consistent.

A KeyboardInterrupt can land between any two bytecodes, for example after a jitted call
has consumed its donated KV cache but before the runner holds the new one. The engine
runs each step's host bookkeeping inside `defer_interrupts()`: a SIGINT that arrives
there is held and raised as soon as the block ends, when the engine is consistent again,
or earlier where the block calls `deliver()` (before a point of no return).
Progress bars hold it too (`ProgressBar`).
"""

from __future__ import annotations

import signal
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm.auto import tqdm


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


class ProgressBar(tqdm):
    """tqdm.auto's bar (a widget in Jupyter), whose lock a Ctrl-C cannot leave held.

    tqdm takes one process-wide lock to create, draw and close any bar, and draws without a
    try/finally: a KeyboardInterrupt landing in there left the lock held by the main thread,
    and every bar of another thread (a notebook's worker thread calling generate, tqdm's
    monitor) then waited for good. These calls run with SIGINT held, and under a lock of
    this class's own, which a Ctrl-C in the user's own bars cannot leave held. (No monitor
    thread: a bar draws when it is updated.)
    """

    _lock = threading.RLock()
    _instances: weakref.WeakSet = weakref.WeakSet()
    monitor_interval = 0
    monitor = None

    @classmethod
    def _get_free_pos(cls, instance=None) -> int:
        """The first line no bar holds, the user's bars too (tqdm counts its own under its
        lock): generate's bar inside a user's loop over a bar goes below it."""
        try:
            theirs = list(tqdm._instances)
        except RuntimeError:  # (changed by another thread meanwhile)
            theirs = []
        taken = {abs(bar.pos) for bar in [*cls._instances, *theirs] if bar is not instance and hasattr(bar, "pos")}
        return min(set(range(len(taken) + 1)) - taken)

    def __new__(cls, *args, **kwargs):
        with defer_interrupts():
            return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, **kwargs) -> None:
        with defer_interrupts():
            super().__init__(*args, **kwargs)

    def refresh(self, *args, **kwargs):
        if self.disable:  # (drawing nothing, it locks nothing: no need to pay for the deferral)
            return None
        with defer_interrupts():
            return super().refresh(*args, **kwargs)

    def clear(self, *args, **kwargs) -> None:
        with defer_interrupts():
            super().clear(*args, **kwargs)

    def close(self) -> None:
        if getattr(self, "disable", True):  # (closed, or never drawn)
            return
        with defer_interrupts():
            super().close()
