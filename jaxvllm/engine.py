"""LLMEngine, the engine core: requests in, one scheduler + model step at a time,
RequestOutputs out; and recovery when a step fails.

Requests are validated and built by the input processor (`jaxvllm/input_processor.py`)
and their outputs assembled by the output processor (`jaxvllm/output_processor.py`).
With async scheduling (the default, vLLM's `async_scheduling`) a step schedules and
dispatches step N+1 before it reads step N's tokens, so that the host's scheduling,
batch building and output processing run while the device computes: decoding requests
take their next input id from step N's sampled ids on the device, and a token computed
for a request that stopped meanwhile is dropped.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import jax

from jaxvllm.config import EngineConfig, check_int
from jaxvllm.dummy import resolve_model
from jaxvllm.input_processor import InputProcessor, eos_token_ids, load_tokenizer
from jaxvllm.interrupts import defer_interrupts
from jaxvllm.kv_cache_manager import KVCacheManager
from jaxvllm.loader import checkpoint_tensors, load_config
from jaxvllm.lora.request import LoRARequest
from jaxvllm.metrics import Metric, MetricsCollector, StatLogger, spec_decode_rates
from jaxvllm.model_config import ModelConfig, read_generation_config
from jaxvllm.model_runner import ModelRunner, PendingStep, RunnerOutput
from jaxvllm.output_processor import OutputProcessor
from jaxvllm.outputs import RequestOutput
from jaxvllm.request import ParentRequest, Request, RequestStatus, ScheduledBatch
from jaxvllm.sampling_params import SamplingParams
from jaxvllm.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jaxvllm.sharding import gather_over_processes
from jaxvllm.spec_decode.draft_model import check_draft_model
from jaxvllm.spec_decode.eagle import EagleHead, check_eagle_head
from jaxvllm.spec_decode.ngram_proposer import ContextArrays, MissBackoff, NgramProposer
from jaxvllm.structured_output import StructuredOutputManager
from jaxvllm.utils.compilation_cache import use_compilation_cache

logger = logging.getLogger(__name__)


class LLMEngine:
    """`runner_class` builds the model runner from the engine's config (vLLM's
    `executor_class`): the host benchmark passes a stub device there."""

    def __init__(self, config: EngineConfig, runner_class: Callable[[EngineConfig], ModelRunner] = ModelRunner) -> None:
        importing_torch = "torch" not in sys.modules
        use_compilation_cache(config.compilation_cache)  # process-wide, as JAX's cache is
        names = config.served_model_name
        model_name = (names if isinstance(names, str) else names[0]) if names else config.model  # as vLLM's
        # A missing folder fails first; dummy:NAME becomes a temporary folder that lives as long as the engine.
        self._model_source = resolve_model(config.model)
        try:
            self._set_up(config, runner_class, model_name)
        except BaseException:  # (freed now, not when the traceback goes: a notebook keeps the last one)
            if self.__dict__.get("runner") is not None:
                self.runner.close()
            if self.__dict__.get("structured_outputs") is not None:
                self.structured_outputs.shutdown()
            self._model_source.close()
            raise
        finally:
            if importing_torch and "torch" in sys.modules:
                # transformers imported torch for the first time in this process, and torch.fx leaves
                # a cycle of frames that holds their callers (the LLM being built) until a full
                # collection: freed now, once.
                gc.collect()

    def _set_up(self, config: EngineConfig, runner_class: Callable[[EngineConfig], ModelRunner], model_name: str
                ) -> None:
        config = self._model_source.engine_config(config)
        # (a bad config.json or max_model_len is refused before the tokenizer or any weight loads)
        model_config = load_config(config.model, config.hf_overrides)
        max_model_len = model_config.checked_max_model_len(config.max_model_len)
        self.config = config = config.for_platform(jax.default_backend(), max_model_len)
        self.tokenizer = load_tokenizer(config)
        spec = config.speculative_config
        method = spec.method if spec is not None else None
        if spec is not None and spec.max_model_len is not None and spec.max_model_len > max_model_len:  # (vLLM's words)
            raise ValueError(f"speculative_max_model_len={spec.max_model_len} cannot be larger than "
                             f"target_max_model_len={max_model_len}")
        if method == "draft_model":
            check_draft_model(config, self.tokenizer)  # (before any weights load)
        elif method in ("eagle", "eagle3"):
            check_eagle_head(config)  # (the same)
        self.generation_config = read_generation_config(config)  # (a bad one is refused before any weight loads)
        if jax.process_count() > 1:
            self._check_same_arguments(model_config)
        self.runner = runner_class(config)
        self.model_config = self.runner.cfg
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        max_model_len = self.runner.max_model_len
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
                            long_prefill_token_threshold=config.long_prefill_token_threshold,
                            policy=config.scheduling_policy, fill_buckets=self.runner.fill_buckets,
                            max_loras=config.max_loras if config.enable_lora else 0,
                            lookahead=self.runner.spec_tokens if self.runner.device_drafts else 0),
            self.kv_cache_manager,
        )
        # for get_metrics(); vLLM labels each data-parallel replica
        self.metrics = MetricsCollector(model_name, max_model_len, engine=str(config.data_parallel_rank))
        self.stat_logger = StatLogger(self.metrics, config.data_parallel_rank)
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None  # async: the step not yet read
        self.weight_updates, self.weight_update_seconds = 0, 0.0
        self._parents: dict[str, ParentRequest] = {}
        self._num_by_hand = 0  # of those, not queued by an `LLM`
        self._unreported: list[Request] = []  # finished by a failed step: final outputs still to return
        # The requests of the step being processed and their token counts before it: what a
        # failure before its outputs are committed takes them back to (`Request.roll_back`).
        self._processing: tuple[list[Request], list[int]] | None = None
        # The metrics that step records, applied once its outputs are committed: tokens a
        # failure takes back are counted once, when they come again.
        self._metrics_due: list[Callable[[], None]] = []
        # Outputs a step committed and could not return (an interrupt held during its last
        # statements is raised on its way out): the next `step()` returns them.
        self._carried: list[RequestOutput] = []
        self._recovering = False  # a recovery failed part way (`_recover`)
        # Held by a step and the calls that change device state (`_exclusive`), and by shutdown:
        # from another thread it waits for them; from a signal handler on the thread inside one
        # it is done as that call ends; inside this thread's own shutdown it is left to that one.
        self._lock = threading.RLock()
        self._busy: int | None = None  # the thread in a step or such a call
        self._shutdown_requested = False
        self._shutting_down = False
        # Across processes (jax.distributed) each one schedules for itself: the requests are
        # compared once they change, before the next step.
        self._multiprocess = jax.process_count() > 1
        self._requests_changed = False
        self._use_tokenizer(self.tokenizer)
        # Speculative decoding: drafts proposed on the host after each (synchronous) step, or
        # under async scheduling by the draft model or EAGLE head on the device (`runner.device_drafts`).
        # The scheduler then takes requests one at a time: its vectorized path has no drafts.
        self.proposer, self._contexts, self._backoff = None, None, None
        spec = config.speculative_config
        if spec is not None and spec.method == "ngram":
            self.proposer = NgramProposer(config, max_model_len=max_model_len)
            self._contexts = ContextArrays()
            if self.runner.fill_buckets is not None:  # (a CPU: a verify costs several decode steps)
                self._backoff = MissBackoff()
        elif spec is not None:
            self.proposer = self.runner.drafter
        if spec is not None:
            self.scheduler.vectorized = False
            self.metrics.enable_spec_decode(config.speculative_config.num_speculative_tokens)
        if not config.disable_log_stats:  # (vLLM's `log_engine_initialized`)
            logger.info("Engine %03d: vllm cache_config_info with initialization after num_gpu_blocks is: %d",
                        config.data_parallel_rank, self.kv_cache_manager.pool.num_blocks)

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig, usage_context: Any = None, stat_loggers: list | None = None,
                         enable_multiprocessing: bool = False) -> "LLMEngine":
        """vLLM's constructor from `EngineArgs` (an `EngineConfig`). The engine runs in this
        process whatever `enable_multiprocessing` says; custom `stat_loggers` are not supported."""
        if stat_loggers:
            raise ValueError("LLMEngine stat_loggers are not supported; read get_metrics() instead")
        return cls(engine_args)

    @classmethod
    def validate_outputs(cls, outputs, output_type):
        """vLLM's: the outputs as they are (they are always `output_type` here)."""
        return outputs

    # -- requests ----------------------------------------------------------------------

    def make_requests(self, request_id: str, prompt: Any, params: SamplingParams | None, priority: int = 0,
                      *, add_special_tokens: bool = True, lora_request: LoRARequest | None = None) -> ParentRequest:
        """Validate everything about a request (its n completions) without queueing it
        (its LoRA adapter is read, and checked, if the engine has not read it yet)."""
        if not isinstance(request_id, str):  # (vLLM's words)
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        self._check_open()
        self._check_awake("a request")
        lora_id = self.lora_id(lora_request)
        parent = self.input_processor.process(request_id, prompt, params, priority,
                                              add_special_tokens=add_special_tokens, lora_id=lora_id,
                                              lora_path=lora_request.lora_path if lora_request is not None else None)
        parent.lora_request = lora_request
        return parent

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    tokenization_kwargs: dict[str, Any] | None = None, trace_headers: Any = None,
                    priority: int = 0) -> None:
        """vLLM's signature. `arrival_time` (time.time()'s clock) replaces now as the
        request's arrival in its metrics; `tokenization_kwargs` may say `add_special_tokens`,
        and `truncation` with a `max_length` (vLLM's form of `truncate_prompt_tokens`, which
        it takes precedence over); `trace_headers` is accepted (jaxvllm does no tracing). As
        vLLM's, the request keeps a copy of `params`: the caller may change or reuse them for
        the next request (the engine reads some fields only when the request is first scheduled)."""
        tokenization_kwargs = dict(tokenization_kwargs or {})
        unknown = sorted(set(tokenization_kwargs) - {"add_special_tokens", "truncation", "max_length"})
        if unknown:
            raise ValueError(f"tokenization_kwargs {unknown} are not supported; only 'add_special_tokens', "
                             "'truncation' and 'max_length' are")
        add_special_tokens = tokenization_kwargs.get("add_special_tokens", True)
        if isinstance(params, SamplingParams):
            params = params.clone()
        if tokenization_kwargs.get("truncation") and tokenization_kwargs.get("max_length") is not None:
            params = params if params is not None else SamplingParams()
            params.truncate_prompt_tokens = check_int("tokenization_kwargs max_length",
                                                      tokenization_kwargs["max_length"], low=1)
        if arrival_time is not None:
            arrival_time = float(arrival_time)  # (a bad one fails before the request takes an arrival number)
        parent = self.make_requests(request_id, prompt, params, priority, add_special_tokens=add_special_tokens,
                                    lora_request=lora_request)
        if arrival_time is not None:
            for child in parent.children:
                child.metrics.arrival_time = arrival_time
        try:
            self.add_parent(parent)
        except ValueError:  # (its id in use: it takes no arrival)
            self.input_processor.take_back([parent])
            raise

    # -- LoRA adapters (vLLM's names) -------------------------------------------------------

    def lora_id(self, lora_request: LoRARequest | None) -> int:
        """The id a request with `lora_request` runs under (0: none), the adapter read and
        checked if this engine has not read it yet."""
        if lora_request is None:
            return 0
        manager = self._lora_manager(lora_request)  # (an engine without LoRA refuses any, first)
        with defer_interrupts():
            self._forget_removed(lora_request.lora_int_id)
            manager.add(lora_request)  # (read once: held ones are not read again)
        return lora_request.lora_int_id

    def _forget_removed(self, lora_id: int) -> None:
        """An id removed while requests used it is the old adapter's only until they end."""
        if lora_id in self.runner.lora.removed and not self._lora_users(lora_id):
            self.runner.lora.forget(lora_id)

    def _lora_manager(self, lora_request: Any = None):
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        return self.runner.lora

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's: read an adapter (checked against the model) so that requests can use it;
        an id held from the same folder, unchanged, is only marked recently used. An id
        held from another folder, or from files saved since (an adapter trained further:
        adapter-only RL), is read again and replaced, in its device slot too (the blocks
        cached under the old one serve it no more: see `LoRAManager.versions`); refused
        while unfinished requests use it."""
        with self._exclusive():
            self.check_add_lora(lora_request)
            with defer_interrupts():
                self._forget_removed(lora_request.lora_int_id)
                self.runner.lora.add(lora_request, replace=True)
            return True

    def check_add_lora(self, lora_request: LoRARequest) -> None:
        """Raise what `add_lora` would refuse, changing nothing."""
        self._check_open()
        manager = self._lora_manager(lora_request)
        lora_id = lora_request.lora_int_id
        if lora_id in manager.requests and manager.changes(lora_request) and (users := self._lora_users(lora_id)):
            raise RuntimeError(f"add_lora would replace adapter {lora_id} while unfinished requests use it "
                               f"{users[:4]}: let them finish or abort them first")

    def remove_lora(self, lora_id: int) -> bool:
        """vLLM's: forget an adapter held (False if none is). Unfinished requests that use it
        go on, as in vLLM: it is read again from its folder when they next need it."""
        with self._exclusive():
            self.check_remove_lora(lora_id)
            with defer_interrupts():
                return self.runner.lora.remove(lora_id, in_use=bool(self._lora_users(lora_id)))

    def check_remove_lora(self, lora_id: int) -> None:
        """Raise what `remove_lora` would refuse, changing nothing."""
        self._check_open()
        self._lora_manager()

    def _lora_users(self, lora_id: int) -> list[str]:
        return [r.request_id for r in self.scheduler.requests.values() if r.lora_id == lora_id]

    def list_loras(self) -> set[int]:
        return self._lora_manager().list()

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora_manager().pin(lora_id)

    def add_parent(self, parent: ParentRequest) -> None:
        """Queue all of a request's completions, or (on any error) none of them."""
        for rid in (parent.request_id, *(c.request_id for c in parent.children)):
            if self._in_use(rid):
                raise ValueError(f"request id {rid!r} is already in use")
        # This engine's reading of the adapter: the request's blocks are keyed by it.
        versions = self.runner.lora.versions if self.runner.lora is not None else {}
        for child in parent.children:
            if child.lora_id and child.lora_id not in versions:
                raise ValueError(f"LoRA adapter {child.lora_id} is not known to this engine (removed since the "
                                 f"request was made?)")
        self._finish_recovery()
        with defer_interrupts():
            try:
                for child in parent.children:
                    child.lora_version = versions.get(child.lora_id, 0)
                    self.scheduler.add_request(child)
                self._parents[parent.request_id] = parent
            except BaseException:
                self._parents.pop(parent.request_id, None)
                self._recover()  # (the children queued so far are nobody's: dropped)
                raise
            self._requests_changed = True
            self._num_by_hand += not parent.queued_by_llm

    def _in_use(self, request_id: str) -> bool:
        """A request's id, or a completion's ("{index}_{id}" for n > 1) of a request not yet
        done, finished completions too (an abort of their request would reach a newcomer)."""
        if request_id in self._parents or request_id in self.scheduler.requests:
            return True
        parent = self._parents.get(request_id.partition("_")[2])
        return parent is not None and any(c.request_id == request_id for c in parent.children)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks; unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._finish_recovery()
        outputs = []
        with defer_interrupts():
            # (outputs a failed step committed go too: a finished request's final output among them)
            aborted = set(ids)
            self._carried = [o for o in self._carried if o.request_id not in aborted]
            try:
                for rid in ids:
                    parent = self._parents.pop(rid, None)
                    if parent is None:
                        continue
                    self._num_by_hand -= not parent.queued_by_llm
                    self._requests_changed = True
                    running = [child for child in parent.children if not child.is_finished]
                    for child in running:
                        self.scheduler.finish(child, "abort")
                        self.metrics.forget(child)  # (a completion that finished before was counted then)
                    self.runner.release(c.request_id for c in running)
                    # As a step's: a streamed n > 1 request's output per completion aborted (one
                    # that finished before was reported then), else the request's one output.
                    outputs += self.output_processor.step_outputs(running or parent.children,
                                                                  {parent.request_id: parent})[0]
                self._keep_ngram_state()  # (an id aborted may come back before the next step)
            except BaseException:
                self._recover()  # (the children of a parent popped so far are nobody's: dropped)
                raise
            self.output_processor.commit()
            self._drop_step_of_ended_requests()
        return outputs

    def set_tokenizer(self, tokenizer) -> None:
        """vLLM's (`LLM.set_tokenizer`): prompts' text, outputs' text, chat templates, the
        end ids and structured outputs use `tokenizer` from now on. Refused while requests
        are unfinished (their text is the old tokenizer's)."""
        with self._exclusive():
            self.check_set_tokenizer()
            self._use_tokenizer(tokenizer)

    def check_set_tokenizer(self) -> None:
        """Raise what `set_tokenizer` would refuse, changing nothing."""
        self._check_open()
        if self.has_unfinished_requests():
            raise RuntimeError("set_tokenizer() while requests are unfinished: finish or abort them first")

    def _use_tokenizer(self, tokenizer) -> None:
        """The tokenizer and what is built on it: the end ids, the input, output and
        structured-output processors."""
        config, vocab = self.config, self.model_config.vocab_size
        old = self.__dict__.get("input_processor"), self.__dict__.get("structured_outputs")
        eos = eos_token_ids(self.model_config.eos_token_ids, self.generation_config, tokenizer)
        structured = None if tokenizer is None else StructuredOutputManager(
            tokenizer, vocab, config.structured_outputs_config, wait=self._multiprocess)
        try:
            inputs = InputProcessor(config, tokenizer, vocab, self.runner.max_model_len, eos, self.scheduler.check_fits,
                                    structured, digests=self._multiprocess)
            outputs = OutputProcessor(tokenizer)
        except BaseException:
            if structured is not None:
                structured.shutdown()
            raise
        if old[0] is not None:  # (unseeded requests' seeds go on from the arrivals so far)
            inputs.next_arrival = old[0].next_arrival
        try:
            with defer_interrupts():  # (all of them switch, or none: not prompts read by one, outputs by the other)
                self.tokenizer, self.eos_token_ids, self.structured_outputs = tokenizer, eos, structured
                self.input_processor, self.output_processor = inputs, outputs
        finally:  # (a Ctrl-C held during the swap lands after it: the old compiler pool ends all the same)
            if old[1] is not None and self.structured_outputs is not old[1]:
                old[1].shutdown()

    def get_model_config(self) -> ModelConfig:
        """vLLM's: the model's config as the engine reads it (also `model_config`)."""
        return self.model_config

    def reset_mm_cache(self) -> None:
        """vLLM's: empty the multi-modal input cache; text models have none here."""
        self._check_open()

    def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: what the model serves; generation only here (no pooling tasks)."""
        return ("generate",)

    def request_ids(self) -> list[str]:
        """The requests added and not done (their final output not yet returned)."""
        return list(self._parents)

    def num_completions(self, request_ids: Iterable[str]) -> dict[str, int]:
        """n of each of these requests that was added and is not done."""
        return {rid: len(self._parents[rid].children) for rid in request_ids if rid in self._parents}

    def num_requests_by_hand(self) -> int:
        """Of those, how many an `LLM` did not queue (it collects the outputs of its own)."""
        return self._num_by_hand

    def get_num_unfinished_requests(self) -> int:
        """Completions added and not yet finished: as vLLM's, a request of n > 1 counts each
        of its n until it finishes."""
        # (the list is made at once: AsyncLLM asks from another thread while its engine thread steps)
        return sum(not c.is_finished for parent in list(self._parents.values()) for c in parent.children)

    def has_unfinished_requests(self) -> bool:
        """Requests to finish, a dispatched step still to read, or outputs still to return."""
        return (self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._carried)
                or any(c.parent_id in self._parents for c in self._unreported))

    # -- one step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch a step, read the tokens of the step before (async) or of
        this one, and return outputs of the requests that got new tokens, as their
        `output_kind` asks (FINAL_ONLY: only when finished).

        A failed or interrupted step changes nothing a later step could notice: the
        bookkeeping runs with Ctrl-C held back (`defer_interrupts`), so an interrupt lands
        only while the host waits for the device (`generate` holds it to the step's end as
        well, until it has the outputs); after any exception, `_recover` puts
        every running request back to be recomputed, then the exception propagates. The
        outputs it would have returned come with a later step: DELTA streams resend what
        it built, and a request it finished gets its final output then; outputs it had
        committed already are what the next step returns.

        The engine is not thread-safe, but `shutdown` from another thread waits for a step
        under way to end (a later step raises that the engine was shut down).
        """
        with self._exclusive():
            return self._step()

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Run a step, or a call that changes device state, under the lock (see `_lock`):
        shutdown from another thread frees the runner after it, not under it (an update or a
        wake-up then placed arrays on a closed runner, which nobody deleted)."""
        with self._lock:
            outer, self._busy = self._busy, threading.get_ident()
            try:
                yield
            finally:
                self._busy = outer
                if outer is None and self._shutdown_requested:
                    self._shutdown_once()

    def _step(self) -> list[RequestOutput]:
        self._check_open()
        if self._carried:
            outputs, self._carried = self._carried, []
            return outputs
        if self._requests_changed:
            self._check_same_requests()
        self._finish_recovery()
        committed = None
        try:
            with defer_interrupts():
                if self.runner.device_drafts:
                    self._device_drafts()
                out = self.scheduler.schedule()
                self.runner.release(r.request_id for r in out.preempted)
                launched = (out, self.runner.execute(out.scheduled)) if out.scheduled else None
                self.kv_cache_manager.commit()  # dispatched: the blocks it registered will be written
                if self.config.async_scheduling:
                    launched, self._in_flight = self._in_flight, launched
                    if launched is None:  # nothing to read first: the step in flight samples now
                        self._sample_constrained()
                else:
                    self._sample_constrained(launched)
            updated = []
            if launched is not None:
                result = launched[1].result()  # waits for the device
                with defer_interrupts():
                    updated = self._process(launched[0], result, launched[1].batch.grammar_rows)
                    self._drop_step_of_ended_requests()
                    self._sample_constrained()
            with defer_interrupts() as held:
                # (with the completions a failed step finished: their final outputs are still due)
                outputs, done = self.output_processor.step_outputs(self._unreported + updated, self._parents)
                # A Ctrl-C held so far lands here, before the commit: raised after it, on
                # the way out, it would take outputs that count as sent with it.
                held.deliver()
                self.output_processor.commit()  # (from here on the outputs are the caller's)
                self._unreported, self._processing, committed = [], None, outputs
                for parent in done:  # (all forgotten before a failure in the metrics can stop it)
                    del self._parents[parent.request_id]
                    self._num_by_hand -= not parent.queued_by_llm
                due, self._metrics_due = self._metrics_due, []
                for record in due:
                    record()
                for parent in done:
                    self.metrics.record_parent_finished(parent.children)
                if not self.config.disable_log_stats and self.stat_logger.due():
                    self.do_log_stats()
                return outputs
        except BaseException:
            with defer_interrupts():
                self._recover()
                if committed is not None:
                    self._carried = committed
            raise

    def _drop_step_of_ended_requests(self) -> None:
        """Async: once no request is unfinished (the last ones stopped or were aborted after
        the step in flight was dispatched), that step's tokens are theirs only: it is never read."""
        if not self.scheduler.has_unfinished_requests():
            self._in_flight = None

    def _sample_constrained(self, launched: tuple[SchedulerOutput, PendingStep] | None = None) -> None:
        """Sample a step with structured-output rows (default: the one in flight), whose
        forward is already dispatched: their bitmasks need every token before, so under
        async scheduling the sampler waits until the step before was read (vLLM's order:
        the forward still overlaps the host's work, the sampling does not)."""
        launched = launched or self._in_flight
        if launched is None or not launched[1].awaits_bitmask:
            return
        step = launched[1]
        mask = self.structured_outputs.bitmask(step.batch.grammar_masks(), step.batch.layout.num_logits)
        self.runner.sample(step, mask)

    def _process(self, out: SchedulerOutput, result: RunnerOutput, grammar_rows=()) -> list[Request]:
        """Append a step's tokens and apply the stop checks; the requests to output (those
        that got tokens or ended).
        `grammar_rows`: the step's (scheduled index, grammar, drafts) of structured-output rows."""
        now = time.time()  # when the host has this step's tokens (the scheduler stamps first tokens too)
        requests = out.scheduled.requests
        lengths = [len(r.token_ids) for r in requests]
        self._processing = requests, lengths
        ended, ending = self._end_dead_ends(out, result, grammar_rows)
        updated = self.scheduler.update_from_output(out, result.sampled, result.num_accepted, result.draft_ids)
        for request in ending:
            if not request.is_finished:
                self._finish_at_dead_end(request)
        appended = None
        if result.num_accepted is not None:  # (tokens a request got: more than one when it accepted drafts)
            appended = [len(r.token_ids) - n for r, n in zip(requests, lengths)]
            self._metrics_due.append(partial(self.metrics.record_spec_decode, out.scheduled.num_drafts,
                                             result.num_accepted))
            if self._backoff is not None:
                for request, drafts, accepted in zip(requests, out.scheduled.num_drafts, result.num_accepted):
                    self._backoff.record(request.request_id, int(drafts), int(accepted))
        if result.logprobs is not None or result.prompt_logprobs is not None:
            self.output_processor.record_logprobs(out.scheduled, result, set(map(id, updated)), appended)
        finished, done = [r.request_id for r in ended], []
        for request in updated:
            if request.has_stop_strings and self.output_processor.detokenize(request) and not request.is_finished:
                self.scheduler.finish(request, "stop")  # a stop string ends it
            if request.status is RequestStatus.FINISHED:
                finished.append(request.request_id)
                done.append(request)
        # (counted once stop strings were checked: accepted drafts past one are dropped)
        num_tokens = None if appended is None else sum(len(r.token_ids) for r in requests) - sum(lengths)
        self._metrics_due.append(partial(self.metrics.record_step, updated, now, num_tokens))
        self._metrics_due.extend(partial(self.metrics.record_finished, request) for request in done)
        self.runner.release(finished)
        if self.proposer is not None and not self.runner.device_drafts:
            self._propose_drafts(out.scheduled)
        return updated + ended

    def _propose_drafts(self, scheduled: ScheduledBatch) -> None:
        """Draft tokens for each running request's next step, from its tokens so far. Only
        once a request decodes, with room left for a draft under its max_tokens; none while
        more requests run than `disable_by_batch_size`. A structured output's drafts stop
        before the first its grammar refuses. An EAGLE head drafts for requests of the step
        just done (`scheduled`) only, and reads every step, drafts or not."""
        requests, caps = [], []
        threshold = self.config.speculative_config.disable_by_batch_size
        busy = threshold is not None and len(self.scheduler.running) > threshold
        for request in self.scheduler.running:
            request.spec_token_ids = []
            if busy:
                continue
            room = request.max_num_tokens - request.num_tokens - 1  # (a step adds drafts + 1 at most)
            if room <= 0 or request.num_pending or request.num_computed_tokens != request.num_tokens - 1:
                continue
            requests.append(request)
            caps.append(room)
        if isinstance(self.proposer, NgramProposer):
            self._keep_ngram_state()
            if self._backoff is not None:  # (requests whose drafts keep failing pause)
                kept = [i for i, r in enumerate(requests) if self._backoff.allow(r.request_id)]
                requests, caps = [requests[i] for i in kept], [caps[i] for i in kept]
            contexts = [self._contexts.get(r.request_id, r.token_ids) for r in requests]
            for request, drafts in zip(requests, self.proposer.propose_batch(contexts, caps)):
                self._set_drafts(request, drafts)
            return
        k, kv = self.proposer.k, self.kv_cache_manager
        eagle = isinstance(self.proposer, EagleHead)
        if eagle:  # (it drafts from the hidden states of the step just done: for its requests only)
            in_step = set(map(id, scheduled.requests))
            kept = [i for i, r in enumerate(requests) if id(r) in in_step]
            requests, caps = [requests[i] for i in kept], [caps[i] for i in kept]
        # The draft model and the head write their K/V for K tokens from the newest on: their slots
        # first, only where they lie within the draft's max_model_len (as the scheduler's lookahead
        # under async: within the engine's).
        fits = self.runner.draft_max_model_len - k + 1
        ready = [(r, cap) for r, cap in zip(requests, caps)
                 if r.num_tokens <= fits and kv.allocate_slots(r, k) is not None]
        blocks = [kv.req_blocks[r.request_id] for r, _ in ready]
        if eagle:  # (every step, drafts or not: the head's K/V of the step's tokens)
            drafts = self.runner.propose_eagle(scheduled, [r for r, _ in ready], blocks)
        elif ready:
            drafts = self.runner.propose_drafts([r.request_id for r, _ in ready], [r.token_ids[-1] for r, _ in ready],
                                                [r.num_tokens - 1 for r, _ in ready], blocks)
        else:
            return
        for (request, cap), row in zip(ready, drafts.tolist()):
            self._set_drafts(request, row[:cap])

    def _keep_ngram_state(self) -> None:
        """The n-gram proposer's state (token arrays, pauses) of running requests only."""
        if self._contexts is not None:
            running = {r.request_id for r in self.scheduler.running}
            self._contexts.keep(running)
            if self._backoff is not None:
                self._backoff.keep(running)

    def _device_drafts(self) -> None:
        """Under async scheduling with a draft model or EAGLE head: each running request
        whose newest drafts are on the device (`InputBatch.drafted`) verifies them in the next
        step, as many as fit under its max_tokens counting every pending token (-1s: the
        runner reads them there). None for a structured output, whose masks need the drafts on the host, or
        while more requests run than `disable_by_batch_size`."""
        k, rows = self.runner.spec_tokens, self.runner.builder.input_batch
        threshold = self.config.speculative_config.disable_by_batch_size
        busy = threshold is not None and len(self.scheduler.running) > threshold
        for request in self.scheduler.running:
            row = rows.row_of.get(request.request_id)
            room = request.max_num_tokens - request.num_tokens - request.num_pending - 1
            drafted = row is not None and rows.drafted[row] and request.grammar is None and not busy
            request.spec_token_ids = [-1] * min(k, room) if drafted and room > 0 else []

    @staticmethod
    def _set_drafts(request: Request, drafts: list[int]) -> None:
        if request.grammar is not None and drafts:
            drafts = drafts[: request.grammar.valid_prefix(drafts)]
        request.spec_token_ids = drafts

    def _end_dead_ends(self, out: SchedulerOutput, result: RunnerOutput, grammar_rows
                       ) -> tuple[list[Request], list[Request]]:
        """The requests of this step whose grammar the model's vocabulary cannot go on with
        (their mask allowed only ids the tokenizer alone has). At a row's first position the
        request is finished now, before its tokens are appended, so the token it sampled
        without a constraint is dropped (the first list). Past drafts it accepted, it keeps
        those drafts and nothing after (`result` is cut back here), and the caller finishes
        it once they are appended (the second list)."""
        ended, ending = [], []
        for i, grammar, drafts in grammar_rows:
            request = out.scheduled[i].request
            if request.is_finished:
                continue
            if grammar.dead_end:
                self._finish_at_dead_end(request)
                self.metrics.record_finished(request)  # (before its tokens: a failure leaves it finished)
                ended.append(request)
            elif grammar.dead_end_at is not None and result.num_accepted[i] >= grammar.dead_end_at:
                result.num_accepted, result.sampled = result.num_accepted.copy(), result.sampled.copy()  # (read-only)
                result.num_accepted[i], result.sampled[i] = grammar.dead_end_at - 1, drafts[grammar.dead_end_at - 1]
                ending.append(request)
        return ended, ending

    def _finish_at_dead_end(self, request: Request) -> None:
        reason = request.grammar.dead_end_reason
        if reason == "abort":
            logger.warning("request %s: its grammar allows only token ids past the model's vocabulary (%d) next; "
                           "ended", request.request_id, self.model_config.vocab_size)
        self.scheduler.finish(request, reason)

    def _check_same_arguments(self, model_config: ModelConfig) -> None:
        """Across processes the steps are collective: processes given different engine
        arguments, config.json or generation_config.json would compile or schedule different
        steps and wait on each other for good. So they are compared before anything loads
        (one host collective; one per argument to name those that differ)."""
        fields = {**self.config.shared_fields(), "config.json": repr(model_config),
                  "generation_config.json": repr(sorted(self.generation_config.items()))}

        def differs(text: str) -> bool:
            digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
            return len(set(gather_over_processes(int.from_bytes(digest, "little", signed=True)))) > 1

        if differs(repr(sorted(fields.items()))):
            names = [name for name, value in fields.items() if differs(value)]  # (every process asks alike)
            raise ValueError(f"the {jax.process_count()} processes were given different {', '.join(names)}: under "
                             "jax.distributed every process must build the engine alike (only paths, logging and "
                             "gpu_memory_utilization may differ)")

    def _check_same_requests(self) -> None:
        """Across processes every process runs this same engine and the steps are collective:
        processes holding different requests would dispatch different steps, so they are
        compared here (one host collective, only after requests were added or aborted)."""
        self._requests_changed = False
        if not self._multiprocess:
            return
        digest = hashlib.blake2b(b"".join(p.digest for p in self._parents.values()), digest_size=8).digest()
        digests = gather_over_processes(int.from_bytes(digest, "little", signed=True))
        if len(set(digests)) > 1:
            raise RuntimeError(
                f"the {len(digests)} processes hold different requests: under jax.distributed every process "
                "must add the same requests (same prompts, parameters and order); nothing was run"
            )

    def _recover(self) -> None:
        """Bring the engine back to a state every later step can trust, after a failure
        anywhere in a step or in the bookkeeping of adding and aborting: the step in flight
        is dropped, blocks registered for a step that never ran are forgotten, the scheduler
        and the KV blocks are made anew from the requests the caller knows (`_parents`),
        each recomputed from its tokens on the host, and donated buffers a failed call
        consumed are made anew (the prefix cache too, if the KV cache was). A step whose
        outputs were not committed gives back the tokens it appended: its bookkeeping may
        have stopped anywhere (tokens without logprobs, text or finish checks). A failure in
        here (out of memory making a cache anew) leaves `_recovering` set: the next step
        recovers again first."""
        self._recovering = True
        self._metrics_due = []
        if self._processing is not None:
            requests, lengths = self._processing
            self._processing = None
            for request, n in zip(requests, lengths):
                if len(request.token_ids) != n:
                    request.roll_back(n)
        self._recompute_all()
        self.output_processor.rollback()
        self._unreported = [child for parent in self._parents.values() for i, child in enumerate(parent.children)
                            if child.is_finished and i not in parent.finals_sent]
        if self.runner.recover():
            self._reset_prefix_cache()
        self._recovering = False

    def _finish_recovery(self) -> None:
        """Recover again if a recovery failed part way, before anything that changes requests."""
        if self._recovering:
            with defer_interrupts():
                self._recover()

    def _recompute_all(self, preempting: bool = False) -> None:
        """Drop the step in flight (its tokens come out the same when recomputed) and the
        blocks registered for a step never dispatched; the scheduler and KV blocks are made
        anew from the requests the caller knows (`_parents`), each to be recomputed."""
        self._in_flight = None
        self.kv_cache_manager.rollback()
        self.scheduler.recompute_all((child for parent in self._parents.values() for child in parent.children),
                                     preempting)

    # -- state ---------------------------------------------------------------------------

    def finish_warmup(self) -> None:
        """Wait for the compiles start-up left for after it (on a CPU, every token bucket but
        the smallest): what benchmarks do before they time steps."""
        self.runner.compiles.wait_all()

    def stats(self) -> dict:
        so, runner, kv = self.structured_outputs, self.runner, self.kv_cache_manager
        return {
            "num_gpu_blocks": runner.num_blocks,
            "tensor_parallel_size": len(runner.devices),
            "kv_cache_per_device": runner.kv_cache_per_device(),  # blocks and bytes on each device
            "kv_cache_dtype": runner.kv_spec.dtype_name,  # e.g. "bfloat16", "float8_e4m3fn"
            "weight_bytes_per_device": runner.weight_bytes_per_device(),  # (quantized: values and scales)
            # "fp8" / "gptq-dummy" (online), "<method> (checkpoint)" for a quantized checkpoint, or None
            "quantization": (f"{runner.cfg.quant_method} (checkpoint)" if runner.cfg.quant_method
                             else self.config.quantization),
            "num_free_blocks": kv.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_compiled_buckets": runner.num_compiled_buckets(),
            "num_compiled_sampler_variants": runner.num_compiled_sampler_variants(),
            "block_table_widths": list(runner.builder.widths),
            "async_scheduling": self.config.async_scheduling,
            "token_buckets": list(runner.builder.buckets),
            # start-up: weights loaded, KV cache sized (profiled on a GPU), warm-up compiled (until
            # ready: on a CPU the smallest bucket; the compiles left for after it pending, then done)
            "load_seconds": runner.load_seconds,
            "profile_seconds": runner.profile_seconds,
            "warmup_seconds": runner.warmup_seconds,
            "warmup_pending_compiles": runner.compiles.pending,
            "warmup_done_seconds": runner.compiles.done_seconds,
            # the warm-up's XLA compilations (those left for after ready included), and how many
            # the persistent compilation cache served
            "warmup_compilations": runner.compiles.counts.compilations,
            "compilation_cache_hits": runner.compiles.counts.cache_hits,
            "compilation_cache_misses": runner.compiles.counts.cache_misses,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "prefix_cache_queries": kv.stats.queries,
            "prefix_cache_hits": kv.stats.hits,
            "prefix_cache_hit_rate": kv.stats.hit_rate,
            # (lookups of requests readmitted after a preemption, apart: vLLM's)
            "prefix_cache_preempted_queries": kv.stats.preempted_queries,
            "prefix_cache_preempted_hits": kv.stats.preempted_hits,
            # host time spent filling structured-output bitmasks, and the steps that needed one
            "structured_output_mask_seconds": so.mask_seconds if so else 0.0,
            "structured_output_mask_steps": so.mask_steps if so else 0,
            # update_weights: calls and their seconds, summed
            "weight_updates": self.weight_updates,
            "weight_update_seconds": self.weight_update_seconds,
            **self._spec_decode_stats(),
            **self._lora_stats(),
        }

    def _lora_stats(self) -> dict:
        """LoRA: adapters loaded into device slots and read from disk so far."""
        lora = self.runner.lora
        if lora is None:
            return {}
        return {"lora_slot_loads": lora.slot_loads, "lora_adapter_reads": lora.host_reads,
                "lora_adapters": len(lora.requests), "lora_slots": list(lora.slot_ids)}

    def _spec_decode_stats(self) -> dict:
        """Speculative decoding's counters, acceptance rate and mean accepted length."""
        if self.proposer is None:
            return {}
        m = self.metrics
        counts = {"num_drafts": m.spec_num_drafts, "num_draft_tokens": m.spec_num_draft_tokens,
                  "num_accepted_tokens": m.spec_num_accepted_tokens}
        return {f"spec_decode_{k}": v for k, v in {**counts, **spec_decode_rates(**counts)}.items()}

    def get_metrics(self) -> list[Metric]:
        """vLLM's `LLMEngine.get_metrics()`: every metric now, with vLLM's names and labels
        (see jaxvllm/metrics.py); gauges are the scheduler's state at this moment."""
        kv = self.kv_cache_manager
        return self.metrics.snapshot(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache=kv.stats,
            cache_config=self._cache_config_info(),
        )

    def _cache_config_info(self) -> dict[str, str]:
        """vLLM's CacheConfig fields that jaxvllm has, as `vllm:cache_config_info` labels them."""
        c = self.config
        fields = dict(block_size=c.block_size, gpu_memory_utilization=c.gpu_memory_utilization, swap_space=c.swap_space,
                      cache_dtype=c.kv_cache_dtype, is_attention_free=False,
                      num_gpu_blocks_override=c.num_gpu_blocks_override, sliding_window=None,
                      enable_prefix_caching=c.enable_prefix_caching, prefix_caching_hash_algo=c.prefix_caching_hash_algo,
                      cpu_offload_gb=c.cpu_offload_gb, calculate_kv_scales=c.calculate_kv_scales,
                      num_gpu_blocks=self.kv_cache_manager.pool.num_blocks, num_cpu_blocks=None,
                      kv_cache_memory_bytes=c.kv_cache_memory_bytes)
        return {key: str(value) for key, value in fields.items()}

    def do_log_stats(self) -> None:
        """vLLM's: log the stats line now (`metrics.StatLogger`), unless `disable_log_stats`."""
        if self.config.disable_log_stats:
            return
        kv = self.kv_cache_manager
        self.stat_logger.log(len(self.scheduler.running), len(self.scheduler.waiting), kv.usage, kv.stats.hit_rate)

    # -- sleep mode and weights (vLLM's names) ------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep (needs enable_sleep_mode=True): level 1 moves the weights to host
        memory and frees the KV cache; level 2 frees both. The prefix cache starts empty after
        waking. Refused while requests are unfinished; asleep already, it warns and returns
        (as vLLM's executor)."""
        with self._exclusive():
            self.check_sleep(level)
            if self.is_sleeping():
                logger.warning("sleep(): the engine is asleep already")
                return
            with defer_interrupts():
                self._reset_prefix_cache()  # (first: no cached block may outlive the cache it names)
                self.runner.sleep(level)

    def check_sleep(self, level: int = 1) -> None:
        """Raise as `sleep(level)` refuses; changes nothing (`LLM` asks every replica first)."""
        self._check_open()
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep() needs an engine started with enable_sleep_mode=True")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.has_unfinished_requests():
            raise RuntimeError("sleep() while requests are unfinished: finish or abort them first")

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back the weights and the KV cache (`tags`: "weights", "kv_cache"; None:
        both). After sleep(2), the weights come back with undefined contents, for
        update_weights or collective_rpc("reload_weights"). Returns whether fully awake."""
        with self._exclusive():
            self._check_open()
            tags = ["weights", "kv_cache"] if tags is None else list(tags)
            unknown = set(tags) - {"weights", "kv_cache"}
            if unknown:
                raise ValueError(f"wake_up tags {sorted(unknown)}: choose from 'weights', 'kv_cache'")
            with defer_interrupts():
                self.runner.wake_up(tags)
            return not self.is_sleeping()

    def is_sleeping(self) -> bool:
        return bool(self.runner.asleep)

    def _check_awake(self, what: str) -> None:
        if self.runner.weights_gone:
            raise RuntimeError(f"{what} with no weights: reload_weights() failed part-way; call it again")
        if self.runner.asleep:
            raise RuntimeError(f"{what} while the engine sleeps ({', '.join(sorted(self.runner.asleep))} not "
                               f"awake): call wake_up() first")

    def reload_weights(self, weights_iterator: Any = None, weights_path: str | None = None,
                       is_checkpoint_format: bool = True) -> None:
        """Read the weights again (vLLM's collective_rpc "reload_weights"): from the checkpoint,
        or (as `update_weights`) from `weights_path`, a folder of the model's safetensors (a
        trainer's save), or `weights_iterator`, (HF name, tensor) pairs."""
        self.check_reload_weights(weights_iterator, weights_path, is_checkpoint_format)
        if weights_iterator is not None or weights_path is not None:
            self.update_weights(weights_iterator if weights_path is None else checkpoint_tensors(weights_path))
            return
        with self._exclusive():
            self._check_open()  # (a shutdown from another thread may have come meanwhile)
            with defer_interrupts():
                self._reset_prefix_cache()  # (first: no cached block may outlive the weights that made it)
                self.runner.reload_weights()

    def check_reload_weights(self, weights_iterator: Any = None, weights_path: str | None = None,
                             is_checkpoint_format: bool = True) -> None:
        """Raise as `reload_weights(...)` refuses before it reads anything; changes nothing."""
        self._check_open()
        if not is_checkpoint_format:
            raise ValueError("reload_weights(is_checkpoint_format=False) is not supported: give HF-named tensors, or "
                             "the params' own pytree (get_params()'s) to update_weights")
        if weights_iterator is not None and weights_path is not None:
            raise ValueError("reload_weights takes weights_iterator or weights_path, not both")
        if weights_iterator is not None or weights_path is not None:
            self.check_update_weights()
        elif self.has_unfinished_requests():
            raise RuntimeError("reload_weights while requests are unfinished: finish or abort them first")

    def update_weights(self, weights) -> int:
        """Replace some or all of the model's weights in place (HF names; see
        `jaxvllm.weight_update`): every name and shape is checked before anything changes.
        Refused while requests are unfinished. The prefix cache is reset (its blocks came
        from the old weights). Returns the number of tensors replaced."""
        self.check_update_weights()
        start = time.perf_counter()
        if isinstance(weights, Iterator):  # (read with Ctrl-C let through, and no lock held: a trainer's generator
            weights = list(weights)  # may block for good; the update holds every tensor before it changes any anyway)
        with self._exclusive():
            self.check_update_weights()  # (again: a shutdown from another thread may have come meanwhile)
            with defer_interrupts():
                self._reset_prefix_cache()  # (first: no cached block may outlive the weights that made it)
                count = self.runner.update_weights(weights)
            jax.block_until_ready(self.runner.params)
            self.weight_updates += 1
            self.weight_update_seconds += time.perf_counter() - start
            return count

    def check_update_weights(self, weights: Any = None) -> None:
        """Raise as `update_weights` refuses whatever the weights; changes nothing."""
        self._check_open()
        if self.has_unfinished_requests():
            raise RuntimeError("update_weights while requests are unfinished: finish or abort them first")
        self.check_weights("update_weights")

    def check_weights(self, what: str) -> None:
        """Raise unless the weights are there (the KV cache may sleep); `what` names the call."""
        if self.runner.weights_gone:
            raise RuntimeError(f"{what} with no weights: reload_weights() failed part-way; call it again")
        if "weights" in self.runner.asleep:
            raise RuntimeError(f"{what} while the weights sleep: call wake_up(tags=['weights']) first")

    def reset_prefix_cache(self, device: Any = None, *, reset_running_requests: bool = False) -> bool:
        """vLLM's: forget every cached block. While running requests hold KV blocks it is
        refused (False, with a warning) unless `reset_running_requests` (newer vLLM's, by
        name): then they are preempted and recomputed from their tokens, their outputs
        unchanged. `device` is vLLM 0.11's first argument: None or its `Device.GPU`, the one
        KV cache there is (no CPU offload cache)."""
        with self._exclusive():
            if device is not None and str(getattr(device, "name", device)).lower() != "gpu":
                hint = " (reset_running_requests is passed by name)" if isinstance(device, bool) else ""
                raise ValueError(f"reset_prefix_cache device={device!r}: only the KV cache in use can be reset (None or "
                                 f"Device.GPU){hint}")
            self._check_open()
            holders = [rid for rid, blocks in self.kv_cache_manager.req_blocks.items() if blocks]
            if holders:
                if not reset_running_requests:
                    logger.warning("prefix cache not reset: %d running requests hold KV blocks (finish or abort them, "
                                   "or pass reset_running_requests=True)", len(holders))
                    return False
                with defer_interrupts():
                    self._recompute_all(preempting=True)
                    self.runner.release(holders)  # (their rows' device state is rebuilt on readmission)
            self._reset_prefix_cache()
            return True

    def _reset_prefix_cache(self) -> None:
        self.metrics.track_prefix_cache(self.kv_cache_manager.stats)  # (the reset starts new stats)
        self.kv_cache_manager.reset_prefix_cache()

    def get_tokenizer(self):
        """The HF tokenizer; ValueError under skip_tokenizer_init=True (as vLLM)."""
        if self.tokenizer is None:
            raise ValueError("skip_tokenizer_init=True: this engine has no tokenizer (chat() and text prompts need one)")
        return self.tokenizer

    # The methods collective_rpc runs (vLLM's name for a call on every worker).
    RPC_METHODS = ("reload_weights", "update_weights", "sleep", "wake_up", "is_sleeping", "reset_prefix_cache")

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's: run one of `RPC_METHODS` on this engine's one worker (itself, in this
        process: `timeout` never applies); returns [its result]."""
        self.check_rpc(method, timeout, args, kwargs)
        return [getattr(self, method)(*args, **(kwargs or {}))]

    def check_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                  kwargs: dict | None = None) -> None:
        """Raise as `collective_rpc` refuses before the method changes anything (its own
        `check_` method's refusals too); changes nothing."""
        self._check_open()
        if method not in self.RPC_METHODS:
            raise ValueError(f"collective_rpc method {method!r} is not supported; choose from {self.RPC_METHODS}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"collective_rpc timeout must be a positive number of seconds or None, got {timeout!r}")
        check = getattr(self, "check_" + method, None)
        if check is not None:
            check(*args, **(kwargs or {}))

    @property
    def is_shut_down(self) -> bool:
        """Shut down, or being shut down (on another thread: its requests may be aborted
        already, while the runner is not closed yet)."""
        return self._shutting_down or self.runner.closed

    def _check_open(self) -> None:
        if self.runner.closed:
            raise RuntimeError("this engine was shut down; create a new LLM")

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: start a trace of everything this process runs (jax.profiler's, of the host and
        the device), into profiler_config's jax_profiler_dir, else $VLLM_TORCH_PROFILER_DIR
        (vLLM 0.11's switch), under `profile_prefix` if given."""
        self._check_open()
        given = self.config.profiler_config
        folder = given["jax_profiler_dir"] if given is not None else os.environ.get("VLLM_TORCH_PROFILER_DIR")
        if not folder:
            raise RuntimeError('profiling is not enabled: start the engine with profiler_config={"profiler": "jax", '
                               '"jax_profiler_dir": FOLDER}, or set VLLM_TORCH_PROFILER_DIR')
        jax.profiler.start_trace(os.path.join(folder, profile_prefix) if profile_prefix else folder)

    def stop_profile(self) -> None:
        """Write the trace `start_profile` began."""
        jax.profiler.stop_trace()

    def shutdown(self) -> None:
        """Abort every request and free the device memory (weights, KV cache, sampler state),
        once a step under way has ended: on another thread, by waiting for it; on this one
        (a signal handler that runs inside the step), as the step returns."""
        if self._busy == threading.get_ident():
            self._shutdown_requested = True
            return
        with self._lock:
            self._shutdown_once()

    def _shutdown_once(self) -> None:
        """`_shutdown`, unless this thread is in it already (a signal handler's shutdown
        inside it: that one finishes it)."""
        if self._shutting_down:
            return
        self._shutting_down, self._shutdown_requested = True, False
        try:
            self._shutdown()
        finally:
            self._shutting_down = False

    def _shutdown(self) -> None:
        self._recovering = False  # (nothing to mend in what is freed: a failed recovery must not keep it)
        try:
            self.abort_request(list(self._parents))
        finally:
            self.runner.close()
            if self.structured_outputs is not None:
                self.structured_outputs.shutdown()
            self._model_source.close()
