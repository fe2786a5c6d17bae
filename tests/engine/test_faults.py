"""Faults: a Ctrl-C or an exception at any point of a step leaves the LLM usable, with the
same outputs afterwards and no KV block leaked."""

import inspect
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import pytest
from tqdm.std import tqdm as std_tqdm

import jaxvllm.llm
from jaxvllm import LLM, SamplingParams
from jaxvllm.batch_builder import BatchBuilder
from jaxvllm.detokenizer import IncrementalDetokenizer
from jaxvllm.engine import LLMEngine
from jaxvllm.input_batch import InputBatch
from jaxvllm.kv_cache_manager import BlockPool, KVCacheManager
from jaxvllm.model_runner import ModelRunner, PendingStep
from jaxvllm.output_processor import OutputProcessor
from jaxvllm.request import Request
from jaxvllm.scheduler import Scheduler, WaitingQueue
from tests.spec_decode.eagle_heads import passing_head

ENGINE = dict(max_model_len=160, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=[32],
              num_gpu_blocks_override=24)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompts():
    """Prompts sharing a 2-block prefix (prefix cache hits), some long enough to be chunked."""
    rng = np.random.default_rng(5)
    prefix = [int(t) for t in rng.integers(3, 384, size=32)]
    return [{"prompt_token_ids": prefix + [int(t) for t in rng.integers(3, 384, size=n)]} for n in (1, 5, 17, 40, 3, 9)]


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """SIGINT raises KeyboardInterrupt, as in a Python or Jupyter main process, whatever an
    earlier test of this pytest process (a worker of `-n 2`) left installed."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module", params=["async", "sync", "async-draft", "async-eagle"])
def case(request, tiny_checkpoint, tmp_path_factory):
    """An engine and its outputs. Drafts on the device: async-draft's from another random
    model of the same shape (most rejected), async-eagle's from an EAGLE head that drafts
    the last token again (some accepted)."""
    path = tiny_checkpoint("qwen3")
    spec = None
    if request.param == "async-draft":
        spec = {"method": "draft_model", "model": str(tiny_checkpoint("qwen3", seed=1)), "num_speculative_tokens": 2}
    elif request.param == "async-eagle":
        head = passing_head(path, tmp_path_factory.mktemp("eagle") / "head")
        spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    llm = LLM(path, async_scheduling=request.param != "sync", speculative_config=spec, **ENGINE)
    want = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    yield llm, want
    llm.shutdown()


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_healthy(llm: LLM, want) -> None:
    """Nothing queued or leaked, and the next call's outputs are those of an uninterrupted run."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"], "a KV block leaked"
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
    assert len(engine.runner.builder.input_batch) == 0 and not any(r.num_pending for r in engine.scheduler.requests.values())


def fail_once(monkeypatch, owner, name: str, at_call: int, error=RuntimeError) -> list:
    """Make `owner.name` raise `error("injected")` at its `at_call`-th call; the calls made
    so far (a list that grows)."""
    real, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            raise error("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return calls


STAGES = [
    (Scheduler, "schedule"),  # before anything is dispatched
    (BatchBuilder, "prepare"),  # after blocks were registered for the step
    (ModelRunner, "launch"),  # dispatch
    (PendingStep, "result"),  # waiting for the device (where a Ctrl-C usually lands)
    (Scheduler, "update_from_output"),  # output processing
]


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("owner,name", STAGES, ids=[n for _, n in STAGES])
@pytest.mark.parametrize("at_call", [1, 4])
def test_fault_at_each_stage(case, monkeypatch, owner, name, error, at_call):
    llm, want = case
    fail_once(monkeypatch, owner, name, at_call, error)
    with pytest.raises(error, match="injected"):
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_healthy(llm, want)


def run_by_hand(engine: LLMEngine, kind) -> dict:
    """Requests of 2-7 tokens stepped by hand through `LLMEngine.step()`, whose failures are
    skipped: per request, its tokens as the outputs add up, its finish reason and how many
    of its outputs said finished."""
    from jaxvllm import RequestOutputKind

    for i, prompt in enumerate(prompts()):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True,
                                                           output_kind=kind))
    seen = {}
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except (RuntimeError, KeyboardInterrupt):
            continue
        for out in outputs:
            tokens_so_far, _, finals = seen.get(out.request_id, ([], None, 0))
            c = out.outputs[0]
            got = tokens_so_far + c.token_ids if kind == RequestOutputKind.DELTA else c.token_ids
            seen[out.request_id] = (got, c.finish_reason, finals + out.finished)
    return seen


@pytest.mark.parametrize("kind", ["DELTA", "CUMULATIVE"])
@pytest.mark.parametrize("name,at_call", [("step_outputs", 3), ("output", 2), ("output", 7)])
def test_outputs_of_a_failed_step_come_with_a_later_one(case, monkeypatch, kind, name, at_call):
    """Stepped by hand, a step that fails after it appended its tokens (here while it builds
    its outputs) loses none of them: DELTA pieces still add up, and a request it finished
    gets its final output from the next step."""
    from jaxvllm import RequestOutputKind

    llm, want = case
    engine, kind = llm.llm_engine, RequestOutputKind[kind]
    reference = run_by_hand(engine, kind)
    calls = fail_once(monkeypatch, OutputProcessor, name, at_call)
    got = run_by_hand(engine, kind)
    monkeypatch.undo()
    assert len(calls) > at_call and got == reference
    assert all(finals == 1 and reason == "length" for _, reason, finals in got.values())
    assert not engine._parents
    assert_healthy(llm, want)


@pytest.mark.parametrize("kind", ["DELTA", "CUMULATIVE"])
@pytest.mark.parametrize("at_call", [3, 6])
def test_ctrl_c_while_a_step_builds_its_outputs_loses_none(case, monkeypatch, kind, at_call):
    """A real SIGINT while `step()` builds its outputs is held until they are built, then
    raised before they count as sent: the next step sends them again."""
    from jaxvllm import RequestOutputKind

    llm, want = case
    engine, kind = llm.llm_engine, RequestOutputKind[kind]
    reference = run_by_hand(engine, kind)
    real, calls = OutputProcessor.step_outputs, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            signal.raise_signal(signal.SIGINT)  # (held: the step's bookkeeping is under way)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(OutputProcessor, "step_outputs", interrupted)
    got = run_by_hand(engine, kind)
    monkeypatch.undo()
    assert len(calls) > at_call and got == reference
    assert all(finals == 1 and reason == "length" for _, reason, finals in got.values())
    assert_healthy(llm, want)


@pytest.mark.parametrize("error", ["SIGINT", "RuntimeError"])
@pytest.mark.parametrize("kind", ["DELTA", "CUMULATIVE"])
def test_a_failure_after_a_step_committed_its_outputs_loses_none(case, monkeypatch, kind, error):
    """A SIGINT or an exception after a step committed its outputs (here while it records
    the metrics of the requests it finished) is raised on the step's way out, and the next
    step returns those outputs. Before, they were lost: sent, as far as the engine knew."""
    from jaxvllm import RequestOutputKind
    from jaxvllm.metrics import MetricsCollector

    llm, want = case
    engine, kind = llm.llm_engine, RequestOutputKind[kind]
    reference = run_by_hand(engine, kind)
    real, calls = MetricsCollector.record_parent_finished, []

    def interrupted(self, children):
        calls.append(1)
        if len(calls) in (1, 3):
            if error == "RuntimeError":
                raise RuntimeError("injected")
            signal.raise_signal(signal.SIGINT)  # (held: the step's bookkeeping is under way)
        return real(self, children)

    monkeypatch.setattr(MetricsCollector, "record_parent_finished", interrupted)
    got = run_by_hand(engine, kind)
    monkeypatch.undo()
    assert len(calls) > 3 and got == reference
    assert all(finals == 1 and reason == "length" for _, reason, finals in got.values())
    assert_healthy(llm, want)


def test_outputs_a_failed_step_committed_go_with_the_requests_generate_aborts(case, monkeypatch):
    """A failure after a step committed its outputs, inside generate: its cleanup aborts the
    requests, and their committed outputs (kept for the next step) go too. Before, the
    engine kept reporting unfinished requests (sleep refused) and the next step returned
    final outputs of requests generate had aborted."""
    from jaxvllm.metrics import MetricsCollector

    llm, want = case
    fail_once(monkeypatch, MetricsCollector, "record_parent_finished", 1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt, match="injected"):
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.llm_engine._carried and not llm._finished
    assert_healthy(llm, want)


def sigint_in(function, text: str, when=lambda frame: True) -> None:
    """Send a real SIGINT as the line of `function` holding `text` is about to run, the first
    time `when(frame)` holds there (in a decorated function, its own code's)."""
    function = inspect.unwrap(function)
    lines, first = inspect.getsourcelines(function)
    (line,) = [first + i for i, source in enumerate(lines) if text in source]

    def in_function(frame, event, arg):
        if event == "line" and frame.f_lineno == line and when(frame):
            sys.settrace(None)
            signal.raise_signal(signal.SIGINT)
        return in_function

    sys.settrace(lambda frame, event, arg: in_function if frame.f_code is function.__code__ else None)


@pytest.mark.parametrize("where", ["after a step", "handing back"])
def test_a_ctrl_c_in_wait_for_completion_loses_no_output(case, where):
    """A SIGINT right after a step returned final outputs, or while wait_for_completion hands
    them back: the next wait_for_completion returns every request enqueued. Before, the
    outputs in hand were dropped, silently."""
    llm, want = case
    ids = llm.enqueue(prompts(), GREEDY, use_tqdm=False)
    if where == "after a step":
        sigint_in(LLM._step_until, "self._finished.update", lambda frame: frame.f_locals["outputs"])
    else:
        sigint_in(LLM.wait_for_completion, "self._finished.pop(rid, None)")
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.wait_for_completion(use_tqdm=False)
    finally:
        sys.settrace(None)
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == ids and tokens(outputs) == want
    assert_healthy(llm, want)


def test_a_ctrl_c_as_enqueue_records_its_requests_loses_none(case):
    """A SIGINT between enqueue's records of what it queued lands after both: the next
    wait_for_completion returns every request (they were nobody's: never returned)."""
    llm, want = case
    sigint_in(LLM._enqueue, "self._enqueued += queued")
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.enqueue(prompts(), GREEDY)
    finally:
        sys.settrace(None)
    assert tokens(llm.wait_for_completion(use_tqdm=False)) == want
    assert_healthy(llm, want)


def raise_at_line(function, text: str = "", line: int | None = None, hit: int = 1) -> None:
    """Raise RuntimeError("injected") the `hit`-th time the line of `function` that holds
    `text` (or line number `line`) is about to run: an exception where no Ctrl-C can land
    (a bug, a MemoryError)."""
    if line is None:
        lines, first = inspect.getsourcelines(function)
        (line,) = [first + i for i, source in enumerate(lines) if text in source]
    hits = []

    def in_function(frame, event, arg):
        if event == "line" and frame.f_lineno == line:
            hits.append(1)
            if len(hits) == hit:
                sys.settrace(None)
                raise RuntimeError("injected")
        return in_function

    sys.settrace(lambda frame, event, arg: in_function if frame.f_code is function.__code__ else None)


# Where the engine's bookkeeping is half done: each left state that the next calls
# tripped over (a request nobody answers for, a leaked block or row, a row count off by one).
HALF_DONE = [
    (Scheduler.add_request, "self.waiting.add(request)"),  # in `requests`, in no queue
    (LLMEngine.add_parent, "self._parents[parent.request_id] = parent"),  # children queued, parent unknown
    (Scheduler.finish, "del self.requests[request.request_id]"),  # finished, still in `requests`
    (Scheduler.finish, "self.kv.free(request)"),  # finished, holding its blocks
    (BlockPool.allocate, "self._evict(b)"),  # blocks taken from the free queue, given to nobody
    (InputBatch.add, "self.num_special += self._special(row)"),  # a row taken, not counted
    (InputBatch.remove, "self._free_rows.append(row)"),  # a row given back to nobody
]


@pytest.mark.parametrize("function,text", HALF_DONE, ids=[f"{f.__qualname__}:{t.split('(')[0]}" for f, t in HALF_DONE])
def test_an_exception_in_half_done_bookkeeping(case, function, text):
    """The failure is recovered from like a failed step: the scheduler, the KV blocks and
    the rows are made anew from the requests the caller knows."""
    llm, want = case
    raise_at_line(function, text)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            llm.generate(prompts(), GREEDY, use_tqdm=False)
    finally:
        sys.settrace(None)
    engine = llm.llm_engine
    pool, rows = engine.kv_cache_manager.pool, engine.runner.builder.input_batch
    assert not engine.scheduler.requests and not engine.scheduler.running and not len(engine.scheduler.waiting)
    assert sorted(pool.free_blocks()) == list(range(pool.num_blocks)) and not any(pool.ref_counts)
    assert len(rows._free_rows) == rows.max_num_seqs and rows.num_special == 0
    assert_healthy(llm, want)


# Where a step's tokens are appended and its outputs built.
OUTPUT_BOOKKEEPING = [LLMEngine._process, Scheduler.update_from_output, Request.append_token,
                      OutputProcessor.record_logprobs, OutputProcessor.detokenize, IncrementalDetokenizer.update,
                      OutputProcessor.step_outputs, OutputProcessor.output]


def stream(engine: LLMEngine, params: list[SamplingParams]) -> tuple[dict, int]:
    """DELTA outputs stepped by hand, failed steps skipped: per request, what its pieces add
    up to (tokens, logprobs, text, finish and stop reasons, final outputs); and the failures."""
    for i, (prompt, p) in enumerate(zip(prompts(), params)):
        engine.add_request(f"r{i}", prompt, p)
    seen, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except RuntimeError:
            failures += 1
            continue
        for out in outputs:
            c = out.outputs[0]
            got, logprobs, text, finals, _, _ = seen.get(out.request_id, ([], [], "", 0, None, None))
            logprobs = logprobs + [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in c.logprobs]
            seen[out.request_id] = (got + list(c.token_ids), logprobs, text + c.text, finals + out.finished,
                                    c.finish_reason, c.stop_reason)
    return seen, failures


def counted(engine: LLMEngine) -> tuple:
    """The metrics a run of `stream` adds to: tokens, finishes and histogram counts (with
    drafts, steps recomputed after a failure may emit a request's tokens in other steps:
    inter-token gaps, one per step a request gets tokens in, are not counted then)."""
    m = engine.metrics
    gaps = sum(m.inter_token_latency.counts) if engine.proposer is None else None
    return (m.generation_tokens, m.prompt_tokens, m.prompt_tokens_computed, dict(m.request_success), gaps,
            *(sum(h.counts) for h in (m.time_to_first_token, m.e2e_request_latency, m.request_decode_time)),
            m.request_generation_tokens.sum, m.iteration_tokens.sum)


def added(before: tuple, after: tuple) -> tuple:
    return tuple({k: after[i][k] - v for k, v in b.items()} if isinstance(b, dict)
                 else None if b is None else after[i] - b for i, b in enumerate(before))


def test_an_exception_at_any_line_of_the_output_bookkeeping(case):
    """Wherever a step's output bookkeeping stops (a bug, a MemoryError: a Ctrl-C waits for
    it to end), the tokens it appended are taken back and recomputed: the streamed pieces,
    logprobs, text, stop strings, finish reasons and a structured output come out as in a
    run without the failure. Before, a request could keep a token without its logprob,
    go past max_tokens, or leave its detokenizer or grammar a token ahead; and its metrics
    counted the tokens taken back twice."""
    from jaxvllm import RequestOutputKind, StructuredOutputsParams

    llm, want = case
    engine = llm.llm_engine
    common = dict(temperature=0, logprobs=2, output_kind=RequestOutputKind.DELTA)
    texts = [o.outputs[0].text for o in llm.generate(prompts(), SamplingParams(max_tokens=8, **common),
                                                      use_tqdm=False)]
    params = [SamplingParams(max_tokens=4 + i, ignore_eos=True, stop=[text[3:5]] if i % 2 and len(text) >= 5 else None, min_tokens=i % 3,
                             include_stop_str_in_output=i == 3, **common) for i, text in enumerate(texts)]
    params[4] = SamplingParams(max_tokens=10, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,5} \d{1,2}"),
                               **common)
    before = counted(engine)
    reference, _ = stream(engine, params)
    reference_metrics = added(before, counted(engine))
    assert reference_metrics[0] == sum(len(got) for got, *_ in reference.values())  # (drafts past a stop: dropped)
    assert any(reason == "stop" for *_, reason, _ in reference.values())
    injected = 0
    for function in OUTPUT_BOOKKEEPING:
        first = function.__code__.co_firstlineno
        for line in sorted({n for *_, n in function.__code__.co_lines() if n is not None and n > first}):
            raise_at_line(function, line=line, hit=2)
            before = counted(engine)
            try:
                got, failures = stream(engine, params)
            finally:
                sys.settrace(None)
            where = f"{function.__qualname__}, line {line - first}"
            assert got == reference or not failures, where
            assert added(before, counted(engine)) == reference_metrics, where  # (tokens taken back count once)
            injected += failures
            stats = llm.stats()
            assert stats["num_free_blocks"] == stats["num_gpu_blocks"], where
    assert injected > 100
    assert_healthy(llm, want)


def test_sleep_resets_the_prefix_cache_before_it_frees_the_kv_cache(tiny_checkpoint):
    """A failure part-way through sleep leaves no cached block that names the freed cache
    (a wake_up would give zeros for it: wrong outputs), and an engine that wakes; one in
    wake_up, an engine that wakes; one in reload_weights, an engine that reloads."""
    llm = LLM(tiny_checkpoint("qwen3"), enable_sleep_mode=True, **ENGINE)
    want = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    assert llm.stats()["prefix_cache_hits"] > 0
    for function, text in ((ModelRunner.sleep, "self.params = self.kv_caches = None"),
                           (ModelRunner.sleep, "if self.eagle is not None"),  # (params gone: asleep before)
                           (ModelRunner.sleep, "array.delete()")):
        raise_at_line(function, text)
        try:
            with pytest.raises(RuntimeError, match="injected"):
                llm.sleep(1)
        finally:
            sys.settrace(None)
        assert not llm.llm_engine.kv_cache_manager.pool.cached and llm.llm_engine.is_sleeping()
        llm.wake_up()
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
    # A failure in wake_up, after the weights are placed: the next wake_up still has their copy.
    llm.sleep(1)
    raise_at_line(ModelRunner.wake_up, 'self._asleep.discard("weights")')
    try:
        with pytest.raises(RuntimeError, match="injected"):
            llm.wake_up()
    finally:
        sys.settrace(None)
    llm.wake_up()
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
    # A reload_weights whose read fails (an I/O error): an engine that says so and reloads.
    with pytest.MonkeyPatch.context() as m:
        fail_once(m, ModelRunner, "_load", 1, OSError)
        with pytest.raises(OSError, match="injected"):
            llm.collective_rpc("reload_weights")
    for call in (lambda: llm.generate(prompts(), GREEDY, use_tqdm=False), llm.wake_up):
        with pytest.raises(RuntimeError, match=r"reload_weights\(\) failed part-way; call it again"):
            call()
    llm.collective_rpc("reload_weights")
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
    llm.sleep(1)  # (asleep, the host copy stays until the new weights are in: it wakes)
    with pytest.MonkeyPatch.context() as m:
        fail_once(m, ModelRunner, "_load", 1, OSError)
        with pytest.raises(OSError, match="injected"):
            llm.collective_rpc("reload_weights")
    llm.wake_up()
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
    llm.shutdown()


@pytest.mark.parametrize("owner,name", [(BlockPool, "release_all"), (ModelRunner, "recover")])
def test_a_failure_inside_the_recovery_is_mended_by_the_next_step(case, monkeypatch, owner, name):
    """A second fault while the engine recovers from a first (the KV cache could not be made
    anew: out of memory) leaves its state half mended; the next step mends it first."""
    llm, want = case
    fail_once(monkeypatch, PendingStep, "result", 2)
    fail_once(monkeypatch, owner, name, 1, MemoryError)
    with pytest.raises(MemoryError, match="injected"):
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_healthy(llm, want)


def test_shutdown_frees_an_engine_whose_recovery_keeps_failing(tiny_checkpoint, monkeypatch):
    """Out of memory at every attempt to make a consumed cache anew: shutdown still frees
    what there is (it mends nothing it is about to free)."""
    llm = LLM(tiny_checkpoint("llama"), **ENGINE)
    fail_once(monkeypatch, PendingStep, "result", 2)
    monkeypatch.setattr(ModelRunner, "recover", lambda self: (_ for _ in ()).throw(MemoryError("injected")))
    with pytest.raises(MemoryError, match="injected"):
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    llm.shutdown()
    assert llm.llm_engine.runner.closed


def test_failed_call_that_consumed_the_kv_cache(case, monkeypatch):
    """A jitted step that took the donated caches and then failed: the runner makes new ones
    (and forgets the prefix cache, whose contents went with them)."""
    llm, want = case
    runner = llm.llm_engine.runner
    forward = runner._forward

    def consume_then_fail(*args, **kwargs):
        forward(*args, **kwargs)  # the donated caches are gone now
        raise RuntimeError("device error")

    monkeypatch.setattr(runner, "_forward", consume_then_fail)
    with pytest.raises(RuntimeError, match="device error"):
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert all(not k.is_deleted() for k in runner.kv_caches)
    assert_healthy(llm, want)


def test_interrupt_before_the_loop_does_not_lock_the_engine_out(case, monkeypatch):
    """An interrupt after the requests are queued, while the progress bar is being made."""
    llm, want = case

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(jaxvllm.llm, "ProgressBar", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts(), GREEDY)
    monkeypatch.undo()
    assert_healthy(llm, want)


def test_a_ctrl_c_while_a_bar_draws_leaves_other_threads_their_bars(case):
    """A real SIGINT as generate's progress bar draws, holding the bars' lock (tqdm's refresh
    takes it with no try/finally): it lands once the lock is released, and generate from
    another thread (a notebook's worker) runs with its bar. Before, that thread waited for
    good, the lock held by the main thread: a CI run hung so, after
    test_sigint_at_random_moments."""
    llm, want = case
    sigint_in(std_tqdm.refresh, "self.display()")
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts(), GREEDY, use_tqdm=True)
    finally:
        sys.settrace(None)
    got = []
    worker = threading.Thread(target=lambda: got.append(tokens(llm.generate(prompts(), GREEDY, use_tqdm=True))),
                              daemon=True)
    worker.start()
    worker.join(120)
    stuck = worker.is_alive()
    if stuck:  # (let the worker end, so that the tests after this one can run)
        jaxvllm.llm.ProgressBar.get_lock().release()
        worker.join()
    assert not stuck and got == [want]
    assert_healthy(llm, want)


def test_tqdms_lock_held_by_another_bar_leaves_generates_bars_alone(case):
    """tqdm's lock left held by the main thread, as a Ctrl-C inside a bar of the user's own
    leaves it: generate from another thread, with its bar shown, still runs (its bars have a
    lock of their own). Before, it waited for good."""
    llm, want = case
    got = []
    worker = threading.Thread(target=lambda: got.append(tokens(llm.generate(prompts(), GREEDY, use_tqdm=True))),
                              daemon=True)
    std_tqdm.get_lock().acquire()
    try:
        worker.start()
        worker.join(120)
        stuck = worker.is_alive()
    finally:
        std_tqdm.get_lock().release()
    worker.join()
    assert not stuck and got == [want]


def test_generates_bar_goes_below_a_users_bar():
    """Its own lock apart, generate's bar takes the first line no bar holds, the user's
    too: inside a loop over a bar of theirs, it goes below it, as vLLM's does."""
    import io

    from jaxvllm.interrupts import ProgressBar

    with std_tqdm(total=2, file=io.StringIO()) as outer, ProgressBar(total=2, file=io.StringIO()) as inner:
        assert (outer.pos, inner.pos) == (0, 1)


def test_interrupt_right_after_a_request_is_queued_does_not_lock_generate_out(case, monkeypatch):
    """A Ctrl-C held back while a request is queued lands just after: before, `generate`'s
    cleanup did not know that request, and every later call refused ("unfinished requests
    added by hand")."""
    llm, want = case
    real, calls = LLMEngine.add_parent, []

    def add_parent(self, parent):
        real(self, parent)
        calls.append(parent.request_id)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(LLMEngine, "add_parent", add_parent)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts()[:3], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_healthy(llm, want)


def test_a_second_interrupt_during_the_cleanup_does_not_lock_generate_out(case, monkeypatch):
    """A second Ctrl-C that cuts `generate`'s cleanup short: the next call aborts what the
    interrupted one left queued, and nothing else."""
    llm, want = case
    real_step, real_abort, steps, aborts = LLMEngine.step, LLMEngine.abort_request, [], []

    def step(self):
        steps.append(1)
        if len(steps) == 2:
            raise KeyboardInterrupt  # the first Ctrl-C
        return real_step(self)

    def abort_request(self, request_ids):
        aborts.append(1)
        if len(aborts) == 1:
            raise KeyboardInterrupt  # the second, before anything is aborted
        return real_abort(self, request_ids)

    monkeypatch.setattr(LLMEngine, "step", step)
    monkeypatch.setattr(LLMEngine, "abort_request", abort_request)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    monkeypatch.undo()
    engine = llm.llm_engine
    assert engine.scheduler.has_unfinished_requests()  # left queued by the cut-short cleanup
    by_hand = engine.make_requests("by-hand", {"prompt_token_ids": [5, 6]}, GREEDY)
    engine.add_parent(by_hand)
    with pytest.raises(RuntimeError, match="unfinished requests added by hand"):
        llm.generate(prompts(), GREEDY, use_tqdm=False)  # a request added by hand is never aborted
    assert set(engine.scheduler.requests) == {"by-hand"}  # the interrupted call's ones were
    engine.abort_request("by-hand")
    assert_healthy(llm, want)


def send_sigints(llm: LLM, want, call, want_call, delays: list[float]) -> int:
    """A real SIGINT `delay` seconds into each `call()`; each interrupted call raises, each
    finished one returns the tokens `want_call`, and after each the LLM serves as if
    nothing happened. Returns how many calls were interrupted."""
    interrupted = 0
    for delay in delays:
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        try:
            timer.start()  # (a short delay may land in here already)
            out = call()
            timer.join()  # the signal may still come: let it land here, outside the call
        except KeyboardInterrupt:
            interrupted += 1
        else:
            assert tokens(out) == want_call
        finally:
            timer.cancel()
            try:
                timer.join()
            except KeyboardInterrupt:
                pass
        assert_healthy(llm, want)
    return interrupted


def seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


@pytest.mark.slow
@pytest.mark.parametrize("use_tqdm", [False, True])
def test_sigint_at_random_moments(case, use_tqdm):
    """Real SIGINTs at random times during generate (over the time an uninterrupted call
    takes, so that they land inside it): no lock-out, no wrong output, no leaked block."""
    llm, want = case
    call = lambda: llm.generate(prompts(), GREEDY, use_tqdm=use_tqdm)  # noqa: E731
    duration = min(seconds(call) for _ in range(3))
    rng = random.Random(0)
    delays = [rng.uniform(0.0, duration) for _ in range(30)]
    interrupted = send_sigints(llm, want, call, want, delays)
    print(f"\n{interrupted} of {len(delays)} SIGINTs interrupted generate ({duration * 1e3:.1f} ms a call)")
    assert interrupted >= len(delays) // 2


@pytest.mark.slow
def test_sigint_while_a_long_prompt_list_is_queued(case, monkeypatch):
    """Real SIGINTs while generate validates and queues a long prompt list (before its first
    step), where a queued request and the caller's record of it were once apart."""
    llm, want = case
    many, one = prompts() * 40, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    call = lambda: llm.generate(many, one, use_tqdm=False)  # noqa: E731
    want_many = tokens(call())
    real, first_step = LLMEngine.step, []
    monkeypatch.setattr(LLMEngine, "step", lambda self: first_step.append(time.perf_counter()) or real(self))
    start = time.perf_counter()
    call()
    monkeypatch.undo()
    queueing = first_step[0] - start  # validating and queueing every prompt
    rng = random.Random(1)
    delays = [rng.uniform(0.0, queueing) for _ in range(40)]
    interrupted = send_sigints(llm, want, call, want_many, delays)
    print(f"\n{interrupted} of {len(delays)} SIGINTs interrupted generate while it queued {len(many)} prompts")
    assert interrupted >= len(delays) // 2


def test_child_ids_are_checked_before_any_is_queued(case):
    llm, _ = case
    engine = llm.llm_engine
    engine.add_request("1_x", {"prompt_token_ids": [5, 6]}, GREEDY)
    with pytest.raises(ValueError, match="'1_x' is already in use"):
        engine.add_request("x", {"prompt_token_ids": [5, 6]}, SamplingParams(n=2, max_tokens=2))
    assert set(engine.scheduler.requests) == {"1_x"}  # no orphaned "0_x"
    engine.abort_request("1_x")
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.scheduler.requests


def test_generate_names_the_bad_prompt(case):
    llm, _ = case
    with pytest.raises(ValueError, match="^The decoder prompt cannot be empty") as error:
        llm.generate([{"prompt_token_ids": [5]}, {"prompt_token_ids": []}], GREEDY, use_tqdm=False)
    assert error.value.__notes__ == ["(prompt 1 of 2)"]  # vLLM's message; the note names the prompt
    assert not llm.llm_engine.has_unfinished_requests()


def test_allowed_tokens_that_are_all_stop_tokens_with_min_tokens_are_refused(case):
    llm, _ = case
    eos = llm.llm_engine.eos_token_ids[0]
    with pytest.raises(ValueError, match="^allowed_token_ids .* are all stop tokens"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(allowed_token_ids=[eos], min_tokens=2), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(allowed_token_ids=[eos, 7], min_tokens=2,
                                                                   max_tokens=3, temperature=0), use_tqdm=False)
    assert out[0].outputs[0].token_ids[:2] == [7, 7]  # below min_tokens only the allowed non-stop token is left


def test_stop_of_the_wrong_type_and_add_request_after_shutdown(tiny_checkpoint):
    with pytest.raises(ValueError, match="stop must be a non-empty string or a list of them, got 5"):
        SamplingParams(stop=5)
    llm = LLM(tiny_checkpoint("qwen3"), **ENGINE)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.llm_engine.add_request("a", {"prompt_token_ids": [5]}, GREEDY)
