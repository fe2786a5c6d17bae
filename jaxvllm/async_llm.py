"""vLLM's asyncio front end (`vllm.v1.engine.async_llm.AsyncLLM`): coroutines add requests
and stream their outputs, as servers and RL rollout workers do.

One background thread owns the `LLMEngine` and steps it while any request is unfinished.
The engine is not thread-safe, so every call on it (adding, aborting, sleep, weight
updates) is queued to that thread and runs between two steps; outputs go back to the
coroutine that asked for them through that coroutine's event loop. A step's device work
releases the GIL, so the event loop runs on while the engine waits for the device.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import sys
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from jaxvllm.config import EngineConfig
from jaxvllm.engine import LLMEngine
from jaxvllm.lora.request import LoRARequest
from jaxvllm.model_config import ModelConfig
from jaxvllm.outputs import RequestOutput
from jaxvllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
_STOP = object()  # queued by shutdown(): the engine thread ends


class EngineGenerateError(RuntimeError):
    """vLLM's: a request failed because a step raised (the error is its `__cause__`); the
    engine serves on."""


class EngineDeadError(RuntimeError):
    """vLLM's: the engine takes no more requests, since its thread failed or it was shut
    down (the thread's error, if any, is the `__cause__`)."""


class _Stream:
    """Where one request's outputs go, for the coroutine on `loop` that reads them. As in
    vLLM's RequestOutputCollector, an output that comes before the reader took the last one
    is merged into it (DELTA completions appended, others replaced): a slow reader gets
    fewer, larger outputs, and the engine thread wakes the loop once per read, not once
    per output. An error replaces what was unread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, aggregate: bool) -> None:
        self.loop = loop
        self.aggregate = aggregate
        self._lock = threading.Lock()  # (put runs on the engine thread, get on the loop)
        self._unread: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> bool:
        """False when the loop is closed: nobody will read this stream again."""
        with self._lock:
            wake = self._unread is None or isinstance(item, BaseException)
            if wake:
                self._unread = item
            elif isinstance(self._unread, RequestOutput):
                self._unread.add(item, aggregate=self.aggregate)
        if not wake:
            return not self.loop.is_closed()  # (a reader that left with an output unread: its request ends)
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
            return True
        except RuntimeError:
            return False

    async def get(self) -> RequestOutput | BaseException:
        while True:
            with self._lock:
                item, self._unread = self._unread, None
                if item is None:
                    self._ready.clear()  # (a wake-up for an item taken already: wait for the next)
            if item is not None:
                return item
            await self._ready.wait()


@dataclass
class _Call:
    """A call to run on the engine thread; `future` (None: nobody waits) gets its result."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future | None = None

    def run(self) -> None:
        if self.future is not None and not self.future.set_running_or_notify_cancel():
            return  # (its coroutine was cancelled while it waited here: not run)
        try:
            result = self.fn()
        except Exception as e:
            if self.future is None:
                logger.exception("AsyncLLM: a call on the engine thread failed")
            else:
                self.future.set_exception(e)
        else:
            if self.future is not None:
                self.future.set_result(result)

    def cancel(self, error: BaseException) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_exception(error)


def _resolve(future: concurrent.futures.Future, error: BaseException | None = None) -> None:
    """Give a waiter its end, unless its coroutine was cancelled meanwhile."""
    if not future.done():
        future.set_result(None) if error is None else future.set_exception(error)


def _engine_thread(ref: weakref.ref, calls: queue.SimpleQueue) -> None:
    """The engine thread: rounds of queued calls and a step. Between rounds it holds the
    AsyncLLM only weakly, so that dropping the last reference to it shuts it down."""
    call = None
    while True:
        llm = ref()
        if llm is None or not llm._round(call):
            return
        idle = llm._paused or not llm.engine.has_unfinished_requests()
        del llm
        call = None  # (the call run last may hold the AsyncLLM: not while this thread waits)
        if idle:
            call = calls.get()


class AsyncLLM:
    """`AsyncLLM(config)` or `AsyncLLM.from_engine_args(AsyncEngineArgs(model=...))`.

    `generate(prompt, sampling_params, request_id)` is an async generator of the request's
    `RequestOutput`s, as its `output_kind` asks (CUMULATIVE by default, DELTA, or
    FINAL_ONLY); leaving it early (break, cancellation) aborts the request. A step that
    raises fails every request in flight (their generators raise `EngineGenerateError`;
    vLLM's engine dies there) and leaves the engine serving new ones. Once the engine takes
    no more requests (shut down, or its thread failed) every call raises `EngineDeadError`. `shutdown()`, or dropping the last
    reference, stops the thread and frees the device memory.
    """

    def __init__(self, config: EngineConfig, log_requests: bool = False) -> None:
        if config.data_parallel_size > 1:
            raise ValueError(f"AsyncLLM runs one engine; data_parallel_size={config.data_parallel_size} needs LLM "
                             "(which builds the replicas and spreads requests over them)")
        self.engine = LLMEngine(config)
        self._log_requests = log_requests
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # _Call, or _STOP
        self._lock = threading.Lock()  # orders queueing a call against the thread's end
        self._stopped = False  # no more calls are taken
        self._closed = False  # the streams are ended and the engine shut down
        self._error: BaseException | None = None  # what ended the engine thread, if it failed
        # The engine thread's own state:
        self._streams: dict[str, _Stream] = {}
        self._paused = False  # no steps until resume_generation()
        self._rejecting = False  # new requests are refused (a pause in "abort" or "wait" mode)
        self._pauses = 0  # pauses and resumes so far: a drained "wait" pause freezes only if none came after it
        self._drain_waiters: list[tuple[concurrent.futures.Future, int, bool]] = []  # "wait" pauses: (waiter, pause, clear_cache)
        self._thread = threading.Thread(target=_engine_thread, args=(weakref.ref(self), self._calls),
                                        name="jaxvllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig, start_engine_loop: bool = True,
                         usage_context: Any = None, stat_loggers: list | None = None) -> "AsyncLLM":
        """vLLM's constructor. The engine thread starts at once whatever `start_engine_loop`
        says (it idles until a request comes); custom `stat_loggers` are not supported."""
        if stat_loggers:
            raise ValueError("AsyncLLM stat_loggers are not supported; read the engine's get_metrics() instead")
        return cls(engine_args, log_requests=getattr(engine_args, "enable_log_requests", False))

    def __del__(self) -> None:
        # (not when __init__ failed; nor at interpreter exit, where the thread is gone)
        if getattr(self, "_thread", None) is not None and not sys.is_finalizing():
            self.shutdown()

    # -- requests ------------------------------------------------------------------------

    async def generate(self, prompt: Any, sampling_params: SamplingParams | None, request_id: str,
                       lora_request: LoRARequest | None = None, trace_headers: Any = None, priority: int = 0,
                       data_parallel_rank: int | None = None, *, prompt_text: str | None = None,
                       tokenization_kwargs: dict[str, Any] | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Add a request and yield its outputs until the finished one. Bad input raises from
        the first `__anext__` (ValueError, TypeError), with nothing added. The params are
        copied first, as vLLM's are: changing them afterwards changes nothing here.
        `prompt_text` and `trace_headers` are accepted, as by vLLM's engine;
        `data_parallel_rank` may only name this engine's rank."""
        if data_parallel_rank not in (None, self.engine.config.data_parallel_rank):
            raise ValueError(f"data_parallel_rank={data_parallel_rank!r}: this AsyncLLM runs one engine, of rank "
                             f"{self.engine.config.data_parallel_rank}")
        params = sampling_params.clone() if isinstance(sampling_params, SamplingParams) else sampling_params
        stream = _Stream(asyncio.get_running_loop(),
                         aggregate=getattr(params, "output_kind", None) == RequestOutputKind.DELTA)

        def add() -> None:
            if self._rejecting:
                raise RuntimeError(f"request {request_id!r} refused: generation is paused (pause_generation); "
                                   "call resume_generation() first")
            self.engine.add_request(request_id, prompt, params, lora_request=lora_request,
                                    tokenization_kwargs=tokenization_kwargs, priority=priority)
            self._streams[request_id] = stream
            if self._log_requests:
                logger.info("Added request %s.", request_id)

        try:
            await self._on_engine(add)
            while True:
                item = await stream.get()
                if isinstance(item, EngineDeadError):
                    raise EngineDeadError(f"request {request_id!r} failed: {item}") from item.__cause__
                if isinstance(item, BaseException):
                    raise EngineGenerateError(f"request {request_id!r} failed: {item!r}") from item
                yield item
                if item.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            # The caller left (or was cancelled) before the end: the request stops, its
            # blocks freed. (If the add was still queued, it is not run, or the abort runs
            # after it; if the add failed, the id may be another request's: left alone.)
            def abort_own() -> None:
                if self._streams.get(request_id) is stream:
                    self._abort([request_id])

            with contextlib.suppress(RuntimeError):  # (shut down: every request was aborted)
                self._queue(_Call(abort_own))
            raise

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop requests and free their blocks; each one's generator then yields its final
        output (finish_reason "abort"), as vLLM's does. Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self._on_engine(lambda: self._abort(ids))

    def get_num_unfinished_requests(self) -> int:
        return self.engine.get_num_unfinished_requests()  # (safe from another thread)

    # -- pausing, for weight updates -----------------------------------------------------

    async def pause_generation(self, *, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """vLLM's: stop stepping until `resume_generation()`. "abort" aborts the requests in
        flight and "wait" lets them finish first, both refusing new requests from the call
        on; "keep" freezes the requests where they are and queues new ones. `clear_cache`
        empties the prefix cache once paused (under "keep", the frozen requests give up
        their blocks and are recomputed on resume, their outputs unchanged). A resume
        while a "wait" pause drains ends that pause."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause_generation mode {mode!r}: choose from 'abort', 'wait', 'keep'")
        drained: concurrent.futures.Future = concurrent.futures.Future()

        def pause() -> None:
            self._pauses += 1
            self._rejecting = mode != "keep"
            if mode == "abort":
                self._abort(list(self._streams))
            if mode == "wait" and self.engine.has_unfinished_requests():
                self._paused = False  # ("wait" after "keep": the frozen requests run to their end first)
                self._drain_waiters.append((drained, self._pauses, clear_cache))  # (the thread freezes it when idle)
            else:
                self._freeze(clear_cache)
                _resolve(drained)

        await self._on_engine(pause)
        await asyncio.wrap_future(drained)

    async def resume_generation(self) -> None:
        def resume() -> None:
            self._pauses += 1
            self._paused = self._rejecting = False
            for waiter, _, _ in self._drain_waiters:
                _resolve(waiter)
            self._drain_waiters.clear()

        await self._on_engine(resume)

    async def is_paused(self) -> bool:
        """True from a pause on (a "wait" pause's drain too), until the resume."""
        return self._paused or self._rejecting

    def _freeze(self, clear_cache: bool) -> None:
        self._paused = True
        if clear_cache:
            self.engine.reset_prefix_cache(reset_running_requests=True)

    # -- the engine's other calls, run between steps ---------------------------------------

    async def reset_prefix_cache(self, device: Any = None, *, reset_running_requests: bool = False) -> bool:
        return await self._on_engine(
            lambda: self.engine.reset_prefix_cache(device, reset_running_requests=reset_running_requests))

    async def sleep(self, level: int = 1) -> None:
        await self._on_engine(lambda: self.engine.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return await self._on_engine(lambda: self.engine.wake_up(tags))

    async def is_sleeping(self) -> bool:
        return await self._on_engine(self.engine.is_sleeping)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return await self._on_engine(lambda: self.engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._on_engine(lambda: self.engine.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return await self._on_engine(self.engine.list_loras)

    async def pin_lora(self, lora_id: int) -> bool:
        return await self._on_engine(lambda: self.engine.pin_lora(lora_id))

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """The engine's `collective_rpc` (weight updates: "update_weights", "reload_weights")."""
        return await self._on_engine(lambda: self.engine.collective_rpc(method, timeout, args, kwargs))

    async def start_profile(self, profile_prefix: str | None = None) -> None:
        await self._on_engine(lambda: self.engine.start_profile(profile_prefix))

    async def stop_profile(self) -> None:
        await self._on_engine(self.engine.stop_profile)

    async def check_health(self) -> None:
        """Raises if the engine thread has stopped."""
        self._check_running()

    async def get_tokenizer(self):
        """vLLM's (a coroutine); ValueError under skip_tokenizer_init=True."""
        return self.engine.get_tokenizer()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        """The model's config as the engine reads it (`max_model_len` included), as vLLM's."""
        return self.engine.model_config

    async def get_model_config(self) -> ModelConfig:
        return self.engine.model_config

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return self.engine.get_supported_tasks()

    async def is_tracing_enabled(self) -> bool:
        """vLLM's: whether OpenTelemetry traces are exported; never here (trace_headers are accepted, unused)."""
        return False

    async def do_log_stats(self) -> None:
        """vLLM's: log the engine's stats line now, unless `disable_log_stats`."""
        await self._on_engine(self.engine.do_log_stats)

    async def reset_mm_cache(self) -> None:
        await self._on_engine(self.engine.reset_mm_cache)

    async def wait_for_requests_to_drain(self, drain_timeout: float = 300) -> None:
        """vLLM's: return once no request is unfinished; TimeoutError after `drain_timeout` seconds."""
        deadline = time.monotonic() + drain_timeout
        while self.engine.get_num_unfinished_requests():
            self._check_running()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"Timeout reached after {drain_timeout} seconds waiting for requests to drain.")
            await asyncio.sleep(0.05)

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    @property
    def is_stopped(self) -> bool:
        return self._stopped

    @property
    def errored(self) -> bool:
        """vLLM's: the engine takes no more requests (its thread failed, or it was shut down)."""
        return self._error is not None or self._stopped

    def shutdown(self) -> None:
        """Abort every request (their generators end with the abort output), stop the engine
        thread and free the device memory. Calling it twice is harmless."""
        with self._lock:
            if not self._stopped:
                self._calls.put(_STOP)
        if self._thread is not threading.current_thread():
            self._thread.join()
        if not self._closed:  # (the thread let go of a dropped AsyncLLM, or failed)
            self._end(EngineDeadError("the AsyncLLM was shut down"))

    # -- the engine thread ---------------------------------------------------------------

    @property
    def dead_error(self) -> EngineDeadError:
        """The error calls get once the engine takes no more requests (vLLM's)."""
        if self._error is not None:
            error = EngineDeadError(f"the AsyncLLM engine thread died: {self._error!r}")
            error.__cause__ = self._error
            return error
        if self._stopped:
            return EngineDeadError("this AsyncLLM was shut down (AsyncLLM.shutdown()); create a new one")
        return EngineDeadError("the AsyncLLM engine is not running")  # (vLLM's gives one, whatever the state)

    def _check_running(self) -> None:
        if self._error is not None or self._stopped:
            raise self.dead_error

    def _queue(self, call: _Call) -> None:
        with self._lock:
            self._check_running()
            self._calls.put(call)

    async def _on_engine(self, fn: Callable[[], Any]) -> Any:
        call = _Call(fn, concurrent.futures.Future())
        self._queue(call)
        return await asyncio.wrap_future(call.future)

    def _round(self, call: _Call | None) -> bool:
        """One round of the engine thread: `call` and every call queued, then a step if a
        request is unfinished. False once the thread is to end (it has ended everything)."""
        try:
            while True:
                if call is _STOP:
                    if not self._closed:
                        self._end(EngineDeadError("the AsyncLLM was shut down"))
                    return False
                if call is not None:
                    call.run()
                try:
                    call = self._calls.get_nowait()
                except queue.Empty:
                    break
            if self.engine.has_unfinished_requests() and not self._paused:
                self._step()
            if self._drain_waiters and not self.engine.has_unfinished_requests():
                for waiter, pause, clear_cache in self._drain_waiters:
                    if pause == self._pauses:  # (no pause or resume since)
                        self._freeze(clear_cache)
                    _resolve(waiter)
                self._drain_waiters.clear()
            return True
        except BaseException as e:  # a fault of the thread's own code: nothing can run any more
            logger.exception("AsyncLLM: the engine thread failed")
            self._error = e
            self._end(self.dead_error)
            return False

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # the engine has recovered (LLMEngine.step): its requests fail with the error
            logger.exception("AsyncLLM: an engine step failed; its %d requests are aborted", len(self._streams))
            streams, self._streams = self._streams, {}
            try:
                self.engine.abort_request(list(streams))
            finally:  # (gone from the engine before their generators hear of it)
                for stream in streams.values():
                    stream.put(e)
            return
        self._deliver_all(outputs)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """One put per request: the outputs of a request's n completions in one step (or one
        abort) reach its reader as one output, as vLLM's output handler puts a whole step
        before its loop runs again (a reader here could take them apart between puts)."""
        merged: dict[str, RequestOutput] = {}
        for output in outputs:
            first, stream = merged.get(output.request_id), self._streams.get(output.request_id)
            if first is None:
                merged[output.request_id] = output
            elif stream is not None:
                first.add(output, aggregate=stream.aggregate)
        for output in merged.values():
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:  # (aborted by a generator that left; the abort is queued)
            return
        if output.finished:
            del self._streams[output.request_id]
            if self._log_requests:
                logger.info("Finished request %s.", output.request_id)
        if not stream.put(output) and not output.finished:  # its event loop is gone
            self._abort([output.request_id])

    def _abort(self, request_ids: list[str]) -> None:
        if self._log_requests:
            logger.info("Aborted request(s) %s.", ",".join(request_ids))
        self._deliver_all(self.engine.abort_request(request_ids))
        for rid in request_ids:
            self._streams.pop(rid, None)

    def _end(self, error: BaseException) -> None:
        """Take no more calls, fail the queued ones, end every stream (with its abort output
        after a shutdown, with `error` after a fault) and free the engine."""
        with self._lock:
            self._stopped = True
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not _STOP:
                call.cancel(error)
        for waiter, _, _ in self._drain_waiters:
            _resolve(waiter, error)
        self._drain_waiters.clear()
        try:
            if self._error is None:
                self._abort(list(self._streams))
        finally:
            for stream in self._streams.values():
                stream.put(error)
            self._streams.clear()
            self._closed = True
            self._calls.put(_STOP)  # (wakes the thread, if it ends here from __del__ on another one)
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("AsyncLLM: shutting the engine down failed")


# vLLM's name for the same engine (`vllm.AsyncLLMEngine`, V1's alias of AsyncLLM).
AsyncLLMEngine = AsyncLLM
