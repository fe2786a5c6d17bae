"""`LLM`: vLLM's offline API (generate a batch of prompts) over `LLMEngine`."""

from __future__ import annotations

import dataclasses
import functools
import gc
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from tqdm.auto import tqdm

from jaxvllm.beam_search import BeamSearchOutput, beam_search
from jaxvllm.chat_utils import render_chat
from jaxvllm.config import EngineConfig
from jaxvllm.engine import LLMEngine
from jaxvllm.inputs import TokensPrompt, prompt_list
from jaxvllm.interrupts import ProgressBar, defer_interrupts
from jaxvllm.lora.request import LoRARequest
from jaxvllm.model_config import default_sampling_fields
from jaxvllm.outputs import RequestOutput
from jaxvllm.sampling_params import RequestOutputKind, SamplingParams


@contextmanager
def old_objects_frozen() -> Iterator[None]:
    """Leave the objects that exist now out of the collector's full passes for the block.
    A process that imported jax, transformers and torch holds about a million objects, and
    a full collection walks them all (a pause of 0.1-0.3 s in the middle of a generate that
    makes many short-lived objects). vLLM freezes its engine's heap at start-up for the
    same reason; here the freeze is undone on leaving, so that an engine the user drops
    later is still collected. A freeze someone else made is left alone."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    try:  # (freezing inside: a Ctrl-C before it leaves nothing frozen)
        gc.freeze()
        yield
    finally:
        gc.unfreeze()


def _one_thread_at_a_time(method: Callable) -> Callable:
    """An LLM call that steps the engines: refused while another thread is in one (the LLM
    is not thread-safe, as vLLM's is not; that call's start aborted the first one's
    requests). The same thread may nest them (beam search calls generate)."""
    @functools.wraps(method)
    def call(self: "LLM", *args, **kwargs):
        me, entered = threading.get_ident(), False
        try:
            with self._caller_lock:
                outer = self._caller
                if outer not in (None, me):
                    raise RuntimeError(f"LLM.{method.__name__} while another thread is in a call of this LLM: an LLM "
                                       "is not thread-safe; use one LLM per thread, or AsyncLLM")
                entered = True  # (before the next line: restoring `outer`, this thread's or None, is right)
                self._caller = me
            return method(self, *args, **kwargs)
        finally:
            if entered:
                self._caller = outer
    return call


class LLM:
    """An engine over a local checkpoint folder, e.g. `LLM("weights/tiny-qwen3")`.

    Keyword arguments are vLLM's engine arguments (see `EngineConfig`). Construction loads
    the weights, sizes and allocates the KV cache and compiles every token bucket; a
    persistent JAX compilation cache (~/.cache/jaxvllm/jax unless you set
    `jax_compilation_cache_dir`) makes the second start fast.

    `llm.shutdown()` frees the engine's device memory at once (weights, KV cache); so does
    leaving a `with LLM(...) as llm:` block, or dropping the last reference (`del llm`).

    `data_parallel_size=M` builds M engine replicas, each on `tensor_parallel_size` devices
    of its own, in this process; `generate` spreads its requests over them by load and
    steps them in turn (each dispatches its next step before waiting for its last), so their
    devices work at once. `llm_engine` is replica 0.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        config = EngineConfig(model=str(model), **{"disable_log_stats": True, **kwargs})  # (vLLM's LLM default)
        self.engines = [LLMEngine(dataclasses.replace(config, data_parallel_rank=rank))
                        for rank in range(config.data_parallel_size)]
        self.llm_engine = self.engines[0]
        self._request_counter = 0
        self._default_sampling: dict[str, Any] | None = None
        # The ids of the generate call under way, recorded before any of them is queued: an
        # interrupt wherever it lands leaves nothing queued that is not aborted (by that call's
        # cleanup, or, if a second interrupt cuts the cleanup short, by the next call).
        self._generating: list[str] = []
        self._enqueued: list[str] = []  # queued by `enqueue`, not yet returned by `wait_for_completion`
        self._finished: dict[str, RequestOutput] = {}  # final outputs not yet returned, by request id
        self._caller: int | None = None  # the thread in a call that steps the engines (`_one_thread_at_a_time`)
        self._caller_lock = threading.Lock()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling settings the checkpoint's generation_config.json recommends
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), over
        `SamplingParams()`'s defaults; `SamplingParams()` when it has none, or when the
        engine's `generation_config` is "vllm"; `override_generation_config` over either.
        `generate` and `chat` use these when given no sampling params, as vLLM's do."""
        if self._default_sampling is None:
            engine = self.llm_engine
            self._default_sampling = default_sampling_fields(engine.config, engine.generation_config)
        return SamplingParams(**self._default_sampling)

    def get_tokenizer(self):
        """The HF tokenizer; ValueError under skip_tokenizer_init=True (as vLLM), so chat() refuses too."""
        return self.llm_engine.get_tokenizer()

    def set_tokenizer(self, tokenizer) -> None:
        """vLLM's: use `tokenizer` (an HF tokenizer) from now on, for text, chat templates and
        the end ids (`LLMEngine.set_tokenizer`)."""
        for engine in self.engines:  # (all or none: each refuses while it has requests)
            engine.check_set_tokenizer()
        self._on_every_replica(lambda e: e.set_tokenizer(tokenizer))

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def is_shutdown(self) -> bool:
        return self.llm_engine.is_shut_down

    def shutdown(self) -> None:
        """Free the device memory now (weights, KV cache, sampler state) and abort any request
        added by hand. The LLM cannot generate afterwards (RuntimeError); the memory is freed
        even where other references to this object remain (a notebook's output history, a
        traceback). Calling it twice is harmless."""
        self._on_every_replica(lambda e: e.shutdown())

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def _check_open(self) -> None:
        if self.is_shutdown:
            raise RuntimeError("this LLM was shut down (LLM.shutdown()); create a new LLM to generate again")

    @_one_thread_at_a_time
    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: int | Sequence[int] | None = None,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order.

        prompts: a str, a `TextPrompt` {"prompt": str}, a `TokensPrompt` {"prompt_token_ids":
        [int]} (either dict may carry a "cache_salt"), or a list of those. sampling_params:
        one for all prompts or one per prompt. priority: one int for all prompts or one per
        prompt (lower runs first); giving it selects
        the priority scheduling policy. lora_request: a `LoRARequest` for all prompts or one
        per prompt (None: the base model; needs enable_lora=True). Every prompt is validated
        before any is queued, so a bad one leaves the engine as it was.
        """
        self._check_open()
        return self._run(prompt_list(prompts), sampling_params, priority, use_tqdm, lora_request=lora_request)

    @_one_thread_at_a_time
    def enqueue(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: Any = None,
        priority: int | Sequence[int] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
    ) -> list[str]:
        """vLLM's: queue prompts (as `generate` takes them) without running them; returns their
        request ids. `wait_for_completion()` runs them; a `generate` in between runs them along
        with its own, and returns only its own. All are queued, or (on any error) none.
        `use_tqdm` is accepted, as vLLM's (queueing shows no bar here)."""
        self._check_open()
        return self._enqueue(prompt_list(prompts), sampling_params, priority, lora_request)

    def _enqueue(self, prompts, sampling_params, priority, lora_request, add_special_tokens: bool = True) -> list[str]:
        self._abort_generating()
        try:  # (queued as generate's are until all are: an interrupt aborts them, or the next call does)
            with old_objects_frozen():  # (a full collection walking the requests queued so far: a pause)
                self._queue(prompts, sampling_params, priority, lora_request, add_special_tokens,
                            record=self._generating, copy_params=True)
        except BaseException:
            self._abort_generating()
            raise
        with defer_interrupts():  # (between the two, the queued requests were nobody's)
            queued, self._generating = self._generating, []
            self._enqueued += queued
        return queued

    @_one_thread_at_a_time
    def wait_for_completion(self, output_type: Any = None, *, use_tqdm: bool | Callable[..., tqdm] = True
                            ) -> list[RequestOutput]:
        """vLLM's: run what `enqueue` queued until every request has finished; their outputs, in
        the order queued. Interrupted, they stay queued and the next call goes on with them
        (what finished meanwhile is kept). `output_type` is accepted, as vLLM's (jaxvllm makes
        `RequestOutput`s only)."""
        self._check_open()
        self._abort_generating()
        self._check_no_requests_by_hand()
        with old_objects_frozen():
            self._step_until(self._enqueued, use_tqdm)
        ids = self._enqueued
        outputs = [self._finished[rid] for rid in ids if rid in self._finished]  # (none if aborted by hand)
        try:
            with defer_interrupts():  # (a Ctrl-C meanwhile lands at the end, and is undone below)
                for rid in ids:
                    self._finished.pop(rid, None)
                self._enqueued = []
        except BaseException:  # the next call returns them
            self._finished.update((o.request_id, o) for o in outputs)
            self._enqueued = ids
            raise
        return outputs

    @_one_thread_at_a_time
    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a
        list of them, rendered with the tokenizer's chat template (or `chat_template`), with
        vLLM's arguments in vLLM's order. `continue_final_message`, `chat_template_kwargs`
        and `tools` go to the template (transformers' `apply_chat_template`). Content may be
        a string, a list of OpenAI text parts or None; the template gets it as one string or
        as parts (`chat_template_content_format`: "auto" detects which the template reads).
        `mm_processor_kwargs`: vLLM's, refused unless empty (the models read text only)."""
        self._check_open()
        prompts = self._chat_prompts(messages, chat_template, chat_template_content_format, add_generation_prompt,
                                     continue_final_message, tools, chat_template_kwargs, mm_processor_kwargs)
        # The template writes any BOS itself, so the rendered text is tokenized without special tokens.
        return self._run(prompts, sampling_params, priority, use_tqdm, add_special_tokens=False,
                         lora_request=lora_request)

    @_one_thread_at_a_time
    def enqueue_chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        priority: int | Sequence[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """vLLM's: `chat`'s conversations queued as `enqueue` queues prompts; their request ids."""
        self._check_open()
        prompts = self._chat_prompts(messages, chat_template, chat_template_content_format, add_generation_prompt,
                                     continue_final_message, tools, chat_template_kwargs, mm_processor_kwargs)
        return self._enqueue(prompts, sampling_params, priority, lora_request, add_special_tokens=False)

    def preprocess_chat(
        self,
        messages: list[dict] | list[list[dict]],
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[TokensPrompt]:
        """vLLM's: each conversation as `chat` renders it, tokenized (the template writes
        any special tokens), for `generate` or other calls to take as they are."""
        self._check_open()
        texts = self._chat_prompts(messages, chat_template, chat_template_content_format, add_generation_prompt,
                                   continue_final_message, tools, chat_template_kwargs, mm_processor_kwargs)
        tokenizer = self.get_tokenizer()
        return [TokensPrompt(prompt_token_ids=tokenizer.encode(text, add_special_tokens=False)) for text in texts]

    def _chat_prompts(self, messages, chat_template, chat_template_content_format, add_generation_prompt,
                      continue_final_message, tools, chat_template_kwargs, mm_processor_kwargs) -> list[str]:
        """Each conversation rendered with the chat template."""
        if mm_processor_kwargs:
            raise ValueError(f"mm_processor_kwargs {mm_processor_kwargs!r} are not supported: jaxvllm's models read "
                             "text only")
        if not isinstance(messages, (list, tuple)):
            raise TypeError("messages must be a list of message dicts, or a list of such lists")
        if not messages:  # (no conversations, as vLLM's: no outputs)
            return []
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        return render_chat(self.get_tokenizer(), conversations, chat_template=chat_template,
                           content_format=chat_template_content_format, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, tools=tools,
                           chat_template_kwargs=chat_template_kwargs)

    @staticmethod
    def _per_prompt(value, n: int, name: str, default) -> list:
        """One value for all prompts, or a list with one per prompt."""
        if value is None:
            return [default] * n
        if not isinstance(value, (list, tuple)):
            return [value] * n
        if len(value) != n:
            kind = "params" if name == "sampling_params" else name
            raise ValueError(f"The lengths of prompts and {kind} must be the same. ({name} must have one entry per "
                             f"prompt ({n}), got {len(value)})")
        return list(value)

    def _abort_generating(self) -> None:
        """Abort what an interrupted generate left queued; nothing else."""
        if not self._generating:
            return
        for e in self.engines:
            e.abort_request(self._generating)
        for rid in self._generating:
            self._finished.pop(rid, None)
        self._generating = []

    def _check_no_requests_by_hand(self) -> None:
        """Stepping the engines here would take the outputs of requests added through
        `llm_engine` (only `enqueue`'s and this call's are the LLM's to collect)."""
        if any(e.num_requests_by_hand() for e in self.engines):
            raise RuntimeError("the engine has unfinished requests added by hand (llm_engine.add_request); finish "
                               "or abort them first")

    def _run(self, prompts, sampling_params, priority, use_tqdm, add_special_tokens: bool = True,
             lora_request=None):
        self._abort_generating()
        with old_objects_frozen():
            try:  # from the first request queued on: an interrupt anywhere leaves the engines clean
                requests = self._queue(prompts, sampling_params, priority, lora_request, add_special_tokens,
                                       record=self._generating)
                self._step_until(self._generating, use_tqdm)
            except BaseException:  # KeyboardInterrupt or a device error: this call's requests are aborted
                self._abort_generating()
                raise
        if missing := [r.request_id for r in requests if r.request_id not in self._finished]:
            self._abort_generating()
            raise RuntimeError(f"requests {missing[:4]} ended without a final output (aborted by another thread?)")
        outputs = [self._finished[r.request_id] for r in requests]
        for r in requests:  # (interrupted: the next call's _abort_generating drops the rest)
            self._finished.pop(r.request_id)
        self._generating = []
        return outputs

    def _queue(self, prompts, sampling_params, priority, lora_request, add_special_tokens: bool = True, *,
               record: list[str], copy_params: bool = False) -> list:
        """Validate every prompt and build its requests, then queue them all, spread over the
        replicas by load, for their final outputs only. Their ids go in `record` before the
        first is queued: whoever handles an interrupt knows each one queued. `copy_params`:
        the requests keep copies of the params (as vLLM's engine): requests left queued read
        some fields only when first scheduled, and the caller may change them meanwhile."""
        self._check_no_requests_by_hand()
        engine = self.llm_engine  # validates and builds the requests; any replica may run them
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = self._per_prompt(sampling_params, len(prompts), "sampling_params", None)
        if copy_params:  # (one copy per object given)
            copies = {id(sp): sp.clone() for sp in params if isinstance(sp, SamplingParams)}
            params = [copies.get(id(sp), sp) for sp in params]
        priorities = self._per_prompt(priority, len(prompts), "priority", 0)
        loras = self._per_prompt(lora_request, len(prompts), "lora_request", None)
        requests = []
        try:
            for i, (p, sp, pr, lr) in enumerate(zip(prompts, params, priorities, loras)):
                rid = str(self._request_counter + i)
                try:
                    requests.append(engine.make_requests(rid, p, sp, pr, add_special_tokens=add_special_tokens,
                                                         lora_request=lr))
                except (ValueError, TypeError) as e:
                    # The message stays vLLM's (scripts match on it); the traceback names the prompt.
                    e.add_note(f"(prompt {i} of {len(prompts)})")
                    raise
            for e in self.engines[1:]:  # every replica reads the adapters (replica 0 did, checking the requests)
                for lora in {lr.lora_int_id: lr for lr in loras if lr is not None}.values():
                    e.lora_id(lora)
        except BaseException:  # (a Ctrl-C as well)
            engine.input_processor.take_back(requests)  # (none is queued: the next call draws as if none came)
            raise
        self._request_counter += len(requests)
        for e in self.engines:  # (the order of requests queued before stays as it was)
            if priority is not None:
                e.scheduler.set_policy("priority")
            elif not e.has_unfinished_requests():
                e.scheduler.set_policy(e.config.scheduling_policy)
        record += [r.request_id for r in requests]  # (before the first is queued)
        # Tokens (prompt + most to generate) each replica holds, the requests queued before too
        # (one replica: nothing to weigh; a sum over its queue each call made N enqueues O(N^2)).
        load = [sum(r.num_prompt_tokens + r.max_tokens for r in e.scheduler.requests.values())
                for e in self.engines] if len(self.engines) > 1 else [0]
        for request in requests:
            request.output_kind = RequestOutputKind.FINAL_ONLY  # the LLM keeps only the final outputs
            request.queued_by_llm = True
            rank = load.index(min(load))
            self.engines[rank].add_parent(request)
            load[rank] += sum(c.num_prompt_tokens + c.max_tokens for c in request.children)
        return requests

    def _step_until(self, request_ids: list[str], use_tqdm) -> None:
        """Step the replicas until each of `request_ids` has its final output in `_finished`
        (with the outputs of the other requests queued here that finish meanwhile)."""
        waiting = set(request_ids) - self._finished.keys()
        # As vLLM's, the bar counts completions (n of each request) and shows the token speeds.
        done = {rid: len(self._finished[rid].outputs) for rid in set(request_ids) - waiting}
        total = sum(done.values()) + sum(sum(e.num_completions(waiting).values()) for e in self.engines)
        speed = "est. speed input: {:.2f} toks/s, output: {:.2f} toks/s"
        # (vLLM's: a tqdm-like factory may be given, called with the arguments vLLM gives it)
        make_bar = use_tqdm if callable(use_tqdm) else functools.partial(ProgressBar, disable=not use_tqdm)
        bar = make_bar(total=total, desc="Processed prompts", dynamic_ncols=True, postfix=speed.format(0, 0))
        try:
            bar.update(sum(done.values()))
            start, num_input_tokens, num_output_tokens = time.perf_counter(), 0, 0
            while waiting and (busy := [e for e in self.engines if e.has_unfinished_requests()]):
                for e in busy:
                    # The outputs a step returns are committed (the caller's): a Ctrl-C during
                    # the step is held until they are kept here, and lands then. (The step's own
                    # deferral raised one that came after its commit on the way out: lost outputs.)
                    with defer_interrupts():
                        outputs = e.step()
                        self._finished.update((output.request_id, output) for output in outputs)
                    for output in outputs:
                        if output.request_id in waiting:
                            waiting.discard(output.request_id)
                            num_input_tokens += len(output.prompt_token_ids) * len(output.outputs)
                            num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                            elapsed = time.perf_counter() - start
                            bar.postfix = speed.format(num_input_tokens / elapsed, num_output_tokens / elapsed)
                            bar.update(len(output.outputs))
            if waiting:  # (no engine runs them any more: shut down, or aborted by hand)
                self._check_open()
        finally:
            bar.close()

    @_one_thread_at_a_time
    def beam_search(
        self,
        prompts: Any,
        params: Any,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
        priority: int | Sequence[int] | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search with `params` (a `BeamSearchParams`): a `BeamSearchOutput` per
        prompt (a str, a `TextPrompt`, a `TokensPrompt` or a list of them) holding its
        `params.beam_width` best sequences, best first, prompt tokens included.
        Each step is one `generate` call over every live beam (see jaxvllm/beam_search.py).
        concurrency_limit: search at most this many prompts at once (None: all). priority:
        one for all prompts or one per prompt, as generate's."""
        self._check_open()
        n = len(prompt_list(prompts))
        return beam_search(self.llm_engine, self.generate, prompts, params, use_tqdm=use_tqdm,
                           concurrency_limit=concurrency_limit,
                           lora_requests=self._per_prompt(lora_request, n, "lora_request", None),
                           priorities=None if priority is None else self._per_prompt(priority, n, "priority", 0))

    def stats(self) -> dict:
        """Replica 0's figures (KV blocks, preemptions, compiled buckets, ...); with data
        parallelism, every replica's under "replicas"."""
        self._check_open()
        stats = self.llm_engine.stats()
        if len(self.engines) > 1:
            stats["replicas"] = [e.stats() for e in self.engines]
        return stats

    def update_weights(self, weights) -> int:
        """Replace some or all of the model's weights in place, between `generate` calls:
        `weights` is (HF name, array) pairs (vLLM's `load_weights` contract), a mapping of
        names to arrays, or a pytree whose key paths are the names. Arrays may be numpy,
        jax (a device array is never moved through the host) or torch (CPU). Every name,
        shape and dtype is checked before anything changes; the prefix cache is reset.
        Returns the number of tensors replaced (per replica: each gets them all)."""
        self._check_open()
        for e in self.engines:  # (what one refuses, none does)
            e.check_update_weights()
        weights = self._for_every_replica(weights)
        return self._on_every_replica(lambda e: e.update_weights(weights))[0]

    def _on_every_replica(self, call: Callable[[LLMEngine], Any]) -> list:
        """`call(engine)` on each replica in turn, all of them: a Ctrl-C meanwhile lands after
        the last (between two, it left them apart: one on new weights, one on the old)."""
        if len(self.engines) == 1:
            return [call(self.engines[0])]
        with defer_interrupts():
            return [call(e) for e in self.engines]

    def _for_every_replica(self, value):
        """A one-shot iterator (a generator of weights) read into a list when several
        replicas read it: the first would otherwise leave the others nothing."""
        return list(value) if len(self.engines) > 1 and isinstance(value, Iterator) else value

    # -- LoRA adapters: LLMEngine's, on every replica (`llm_engine` is replica 0 alone) --------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """`LLMEngine.add_lora` on every replica: what one refuses, none does."""
        self._check_open()
        for e in self.engines:
            e.check_add_lora(lora_request)
        return all(self._on_every_replica(lambda e: e.add_lora(lora_request)))

    def remove_lora(self, lora_id: int) -> bool:
        """`LLMEngine.remove_lora` on every replica: what one refuses, none does."""
        self._check_open()
        for e in self.engines:
            e.check_remove_lora(lora_id)
        return any(self._on_every_replica(lambda e: e.remove_lora(lora_id)))

    def pin_lora(self, lora_id: int) -> bool:
        self._check_open()
        return all(self._on_every_replica(lambda e: e.pin_lora(lora_id)))

    def list_loras(self) -> set[int]:
        self._check_open()
        return self.llm_engine.list_loras()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (`enable_sleep_mode=True`): level 1 moves the weights to host
        memory and frees the KV cache; level 2 frees both (for new weights). `generate` is
        refused until `wake_up`; waking compiles nothing."""
        self._check_open()
        for e in self.engines:  # (what one refuses, none does)
            e.check_sleep(level)
        self._on_every_replica(lambda e: e.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back "weights" and / or "kv_cache" (None: both); returns whether fully awake.
        The RL sequence after sleep(2): wake_up(["weights"]), update_weights(...),
        wake_up(["kv_cache"])."""
        self._check_open()
        return all(self._on_every_replica(lambda e: e.wake_up(tags)))

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's: run an engine method (`LLMEngine.RPC_METHODS`) on every replica; returns
        their results."""
        self._check_open()
        args = tuple(self._for_every_replica(a) for a in args)
        kwargs = {k: self._for_every_replica(v) for k, v in (kwargs or {}).items()}
        for e in self.engines:  # (what one refuses, none does)
            e.check_rpc(method, timeout, args, kwargs)
        results = self._on_every_replica(lambda e: e.collective_rpc(method, timeout, args, kwargs))
        return [r for replica in results for r in replica]

    def get_params(self) -> dict:
        """The model's params pytree as the engine runs it (replica 0's): the layers' weights
        stacked (or one per layer on a CPU, each matrix stored inputs first as a
        `jaxvllm.layers.InputMajorWeight`), heads explicit; see `jaxvllm.models.common`."""
        self._check_open()
        self.llm_engine.check_weights("get_params()")
        return self.llm_engine.runner.params

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: trace what runs from here to `stop_profile()` (jax.profiler's trace, host and
        device, of the whole process) into profiler_config's jax_profiler_dir."""
        self.llm_engine.start_profile(profile_prefix)

    def stop_profile(self) -> None:
        self.llm_engine.stop_profile()

    def reset_prefix_cache(self, device: Any = None, *, reset_running_requests: bool = False) -> bool:
        """Forget all cached prefix blocks (their memory stays with the KV pool). Returns
        False, as vLLM does, while running requests hold blocks, unless
        `reset_running_requests` (they are preempted and recomputed). `device`: vLLM 0.11's
        (`LLMEngine.reset_prefix_cache`)."""
        self._check_open()
        return all([e.reset_prefix_cache(device, reset_running_requests=reset_running_requests) for e in self.engines])

    def get_metrics(self) -> list:
        """vLLM's: a snapshot of the engine's metrics since it was created, a list of
        `jaxvllm.metrics` `Counter`, `Gauge` and `Histogram` (vLLM's reader classes) with
        vLLM's names ("vllm:prompt_tokens", "vllm:time_to_first_token_seconds", ...) and
        labels (model_name, engine: the data-parallel replica). Counters never go back
        (reset_prefix_cache included); gauges are the state now. Also readable after shutdown()."""
        return [metric for e in self.engines for metric in e.get_metrics()]

