"""The warm-up's compiles on worker threads: a first set before the engine is ready, the
rest after it, each awaited by the step that needs it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack


from jaxvllm.interrupts import ProgressBar
from jaxvllm.utils.compilation_cache import CompileCounts, count_compilations

logger = logging.getLogger(__name__)

Job = tuple[Hashable, Callable[[], None]]  # (the key a step that needs it waits on, the compile)


class CompileJobs:
    """`run(now, later)` compiles `now` on the threads and returns, then leaves `later` to
    them (XLA compiles without the GIL); `wait(key)` returns once that compile is done,
    running it on the caller's thread if no worker has started it yet, so that a step
    waits for its own executable, never compiles one twice and never queues behind others.
    The counts and seconds cover every job, those left for later included."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="jaxvllm-compile")
        self._later: dict[Hashable, tuple[Future, Callable[[], None]]] = {}
        self._unfinished: set[Hashable] = set()
        self._lock = threading.Lock()
        self._counting = ExitStack()
        self.counts = CompileCounts()
        self.ready_seconds = 0.0  # until `run` returned
        self.done_seconds: float | None = 0.0  # until the last job finished (None: some are left)
        self._start = 0.0

    def run(self, now: list[Job], later: list[Job], desc: str) -> None:
        self._start, self.done_seconds = time.perf_counter(), None
        self.counts = self._counting.enter_context(count_compilations())
        self._unfinished = {key for key, _ in now + later}
        futures = [self._pool.submit(self._run, key, job, False) for key, job in now]
        try:
            for future in ProgressBar(futures, desc=desc, dynamic_ncols=True):
                future.result()
        except BaseException:
            self._pool.shutdown(cancel_futures=True)
            self._counting.close()
            raise
        self.ready_seconds = time.perf_counter() - self._start
        for key, job in later:  # (in order: each worker takes the next when it is free)
            self._later[key] = (self._pool.submit(self._run, key, job, True), job)
        self._pool.shutdown(wait=not later)  # (its threads end once the queue is empty)

    @property
    def pending(self) -> int:
        """Compiles not yet finished."""
        return len(self._unfinished)

    def wait(self, key: Hashable) -> None:
        if not self._later or key not in self._later:
            return
        future, job = self._later[key]
        if future.cancel():  # (not started, or started here and interrupted: nothing else compiles it)
            self._run(key, job, True)
        else:
            future.exception()  # (a failed compile is logged; the step compiles it again, and raises there)
        del self._later[key]

    def wait_all(self) -> None:
        for key in list(self._later):
            self.wait(key)

    def cancel(self, wait: bool = True) -> None:
        """Drop the compiles not begun; with `wait`, wait for those running (each a few
        seconds at most)."""
        for key, (future, _) in list(self._later.items()):
            if future.cancel():
                self._finished(key)
        self._later.clear()
        self._pool.shutdown(wait=wait)

    def _run(self, key: Hashable, job: Callable[[], None], later: bool) -> None:
        # At interpreter exit the main thread is no longer alive; the queued compiles are skipped
        # then (concurrent.futures would otherwise run every one before the process can end).
        try:
            if threading.main_thread().is_alive():
                job()
        except Exception:
            if not later:
                raise
            logger.exception("a warm-up compile failed (its step compiles it again when first used)")
        self._finished(key)

    def _finished(self, key: Hashable) -> None:
        with self._lock:
            self._unfinished.discard(key)
            if not self._unfinished and self.done_seconds is None:
                self.done_seconds = time.perf_counter() - self._start
                self._counting.close()
