"""vLLM's AsyncLLM: streamed outputs equal `LLM.generate`'s for every output kind, leaving a
stream early (break, cancellation, Ctrl-C) aborts its request and frees its blocks, a
failed step fails only its requests, pause_generation's three modes, and shutdown."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time

import pytest

from jaxvllm import LLM, AsyncEngineArgs, AsyncLLM, RequestOutputKind, SamplingParams
from jaxvllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64])
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """`LLM.generate`'s completions (token ids, text) per (params, prompt)."""
    with LLM(checkpoint, **ENGINE) as llm:
        return {name: [[(list(c.token_ids), c.text) for c in out.outputs]
                       for out in llm.generate(PROMPTS + [PROMPTS[0]], params, use_tqdm=False)]
                for name, params in (("greedy", GREEDY), ("seeded", SEEDED), ("long", LONG))}


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=checkpoint, **ENGINE))
    yield engine
    engine.shutdown()


def with_kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    params = params.clone()
    params.output_kind = kind
    return params


async def collect(engine: AsyncLLM, prompt, params: SamplingParams, request_id: str) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


async def started(engine: AsyncLLM, prompt, params: SamplingParams, request_id: str) -> tuple[asyncio.Task, list]:
    """A task streaming a request, once its first output has come: (the task, its outputs so far)."""
    seen: list = []

    async def run():
        async for out in engine.generate(prompt, params, request_id):
            seen.append(out)
        return seen

    task = asyncio.create_task(run())
    while not seen:
        await asyncio.sleep(0.001)
    return task, seen


def completions(outputs: list, kind: RequestOutputKind) -> list[tuple[list[int], str]]:
    """Each completion's tokens and text. As vLLM's, a streamed output of n > 1 holds only the
    completions that changed: the latest of each (CUMULATIVE), or all of them joined (DELTA)."""
    latest: dict[int, tuple[list[int], str]] = {}
    for out in outputs:
        for c in out.outputs:
            tokens, text = latest.get(c.index, ([], "")) if kind is RequestOutputKind.DELTA else ([], "")
            latest[c.index] = (tokens + list(c.token_ids), text + c.text)
    return [latest[i] for i in sorted(latest)]


def assert_idle(engine: AsyncLLM) -> None:
    stats = engine.engine.stats()
    assert engine.get_num_unfinished_requests() == 0
    assert not engine.engine.has_unfinished_requests()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"], "a KV block leaked"


async def settle(engine: AsyncLLM) -> None:
    """Wait until the engine thread has run every call queued so far."""
    await engine.is_sleeping()


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_streams_equal_generate(engine, reference, kind):
    async def main():
        runs = [collect(engine, p, with_kind(params, kind), f"{kind.name}-{name}-{i}")
                for name, params in (("greedy", GREEDY), ("seeded", SEEDED))
                for i, p in enumerate(PROMPTS + [PROMPTS[0]])]
        return await asyncio.gather(*runs)

    results = asyncio.run(main())
    want = reference["greedy"] + reference["seeded"]
    for outputs, expected in zip(results, want):
        assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
        assert completions(outputs, kind) == expected
        if kind is RequestOutputKind.FINAL_ONLY:
            assert len(outputs) == 1
        else:
            assert len(outputs) > 1  # (up to one a step: outputs a reader has not taken yet are merged)
    assert_idle(engine)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_slow_reader_gets_the_outputs_merged(engine, reference, kind):
    """As vLLM's RequestOutputCollector: what comes while the reader is away is merged into
    one output (DELTA tokens, text and logprobs appended; CUMULATIVE the latest), so a slow
    reader gets fewer outputs, and the same completions."""
    async def main(params, prompt, request_id):
        outputs = []
        async for out in engine.generate(prompt, with_kind(params, kind), request_id):
            outputs.append(out)
            await asyncio.sleep(0.05)  # (a slow reader: the engine runs a few steps meanwhile)
        return outputs

    params = SamplingParams(temperature=0, max_tokens=LONG.max_tokens, ignore_eos=True, logprobs=2)
    outputs = asyncio.run(main(params, PROMPTS[1], f"slow-{kind.name}"))
    assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
    assert completions(outputs, kind) == reference["long"][1]
    assert 1 < len(outputs) < LONG.max_tokens // 2
    logprobs = [lp for o in outputs for lp in o.outputs[0].logprobs] if kind is RequestOutputKind.DELTA \
        else outputs[-1].outputs[0].logprobs
    assert len(logprobs) == LONG.max_tokens and all(len(lp) >= 2 for lp in logprobs)
    seeded = asyncio.run(main(SEEDED, PROMPTS[0], f"slow-seeded-{kind.name}"))
    assert completions(seeded, kind) == reference["seeded"][0]
    assert_idle(engine)


def test_a_request_whose_loop_closed_with_an_output_unread_is_aborted(engine):
    """A reader that stops, its event loop closed while an output waits unread: the
    request ends at its next output, its blocks freed (it ran on to max_tokens)."""
    def generated() -> float:
        return next(m.value for m in engine.engine.get_metrics() if m.name == "vllm:generation_tokens")

    before, loop = generated(), asyncio.new_event_loop()
    stream = engine.generate(PROMPTS[0], LONG, "closed-loop")
    loop.run_until_complete(stream.__anext__())
    time.sleep(0.05)  # (the engine runs on: an output waits unread)
    loop.close()
    deadline = time.monotonic() + 60
    while engine.get_num_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.get_num_unfinished_requests() and generated() - before < LONG.max_tokens
    asyncio.run(settle(engine))
    assert_idle(engine)


def test_leaving_a_stream_early_aborts_its_request(engine, reference):
    async def main():
        other = asyncio.create_task(collect(engine, PROMPTS[1], LONG, "stays"))
        gen = engine.generate(PROMPTS[2], LONG, "leaves")
        async for _ in gen:
            break
        await gen.aclose()  # (what garbage collection does too, a little later)
        task, _ = await started(engine, PROMPTS[0], LONG, "cancelled")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        outputs = await other
        await settle(engine)
        return outputs

    outputs = asyncio.run(main())
    assert completions(outputs, RequestOutputKind.CUMULATIVE) == reference["long"][1]
    assert_idle(engine)


def test_abort_ends_the_stream_with_an_abort_output(engine):
    async def main():
        task, _ = await started(engine, PROMPTS[1], LONG, "aborted")
        await engine.abort("aborted")
        return await task

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < LONG.max_tokens
    assert_idle(engine)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_step_of_n_completions_and_their_abort_come_as_one_output(engine, kind):
    """As vLLM's output handler (a whole step put before its loop runs again): each output
    of a reader that keeps up holds every completion of an n > 1 request that moved that
    step, and an abort is one final output holding all n "abort" completions."""
    params = with_kind(SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=6, ignore_eos=True), kind)

    async def main():
        done = await collect(engine, PROMPTS[0], params, f"n3-{kind.name}")
        long = with_kind(SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=120, ignore_eos=True), kind)
        task, seen = await started(engine, PROMPTS[0], long, f"n3-aborted-{kind.name}")
        while len(seen) < 3:
            await asyncio.sleep(0.001)
        before = len(seen)
        await engine.abort(f"n3-aborted-{kind.name}")
        return done, (await task)[before:]

    for _ in range(3):  # (the race showed in every run)
        done, after_abort = asyncio.run(main())
        # (a reader slower than a step gets two merged: fewer outputs, each whole still)
        assert 1 < len(done) <= 6 and all(sorted(c.index for c in o.outputs) == [0, 1, 2] for o in done)
        aborted = [o for o in after_abort if any(c.finish_reason == "abort" for c in o.outputs)]
        assert len(aborted) == 1 and aborted[0] is after_abort[-1] and aborted[0].finished
        assert sorted((c.index, c.finish_reason) for c in aborted[0].outputs) == [(i, "abort") for i in range(3)]
    assert_idle(engine)


def test_bad_input_is_refused_and_others_go_on(engine, reference):
    async def main():
        task = asyncio.create_task(collect(engine, PROMPTS[1], LONG, "good"))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, "", GREEDY, "empty")
        with pytest.raises(ValueError, match="context length"):
            await collect(engine, {"prompt_token_ids": [5] * 200}, GREEDY, "long")
        with pytest.raises(ValueError, match="already in use"):
            await collect(engine, PROMPTS[0], GREEDY, "good")
        with pytest.raises(ValueError, match="temperature"):
            await collect(engine, PROMPTS[0], SamplingParams(temperature=-1), "bad")
        with pytest.raises(ValueError, match="data_parallel_rank"):
            [o async for o in engine.generate(PROMPTS[0], GREEDY, "rank", data_parallel_rank=3)]
        return await task

    outputs = asyncio.run(main())
    assert completions(outputs, RequestOutputKind.CUMULATIVE) == reference["long"][1]
    assert_idle(engine)


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(engine, reference, monkeypatch):
    runner = engine.engine.runner
    calls = []
    execute = runner.execute

    def fail_on_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected device fault")
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", fail_on_the_third)

    async def main():
        runs = [collect(engine, p, LONG, f"failing-{i}") for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*runs, return_exceptions=True)
        monkeypatch.setattr(runner, "execute", execute)
        again = await asyncio.gather(*(collect(engine, p, GREEDY, f"after-{i}") for i, p in enumerate(PROMPTS)))
        return results, again

    results, again = asyncio.run(main())
    assert all(isinstance(r, EngineGenerateError) and "injected device fault" in repr(r.__cause__) for r in results)
    assert [completions(o, RequestOutputKind.CUMULATIVE) for o in again] == reference["greedy"][:3]
    assert_idle(engine)


def test_ctrl_c_while_streaming_aborts_the_request(engine, reference):
    """asyncio.run turns SIGINT into a cancellation of its main task (Python 3.11): the
    stream's request is aborted, and the engine gives the same outputs afterwards."""
    # (Python's own handler, which asyncio.run replaces only when it finds it, whatever a
    # pytest-xdist worker or an earlier test left installed)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    timer = threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGINT))

    async def main():
        async for _ in engine.generate(PROMPTS[2], LONG, "interrupted"):
            if timer.ident is None:
                timer.start()  # (after the first output: the request is under way, far from its end)
            await asyncio.sleep(0.01)

    try:
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(main())
    finally:
        if timer.ident is not None:
            timer.join()
        signal.signal(signal.SIGINT, previous)

    async def again():
        await settle(engine)
        return await collect(engine, PROMPTS[2], LONG, "interrupted")

    outputs = asyncio.run(again())
    assert completions(outputs, RequestOutputKind.CUMULATIVE) == reference["long"][2]
    assert_idle(engine)


def test_pause_generation_modes(engine, reference):
    async def main():
        # keep: the request freezes (no outputs while paused), then ends as it would have
        task, seen = await started(engine, PROMPTS[1], LONG, "kept")
        await engine.pause_generation(mode="keep")
        assert await engine.is_paused()
        await asyncio.sleep(0.1)  # (outputs sent before the pause reach the consumer)
        count = len(seen)
        queued = asyncio.create_task(collect(engine, PROMPTS[0], GREEDY, "queued-while-kept"))
        await asyncio.sleep(0.3)
        assert len(seen) == count and not queued.done()
        await engine.resume_generation()
        kept, queued = await task, await queued

        # wait: returns once the request in flight has finished; new ones are refused meanwhile
        task, _ = await started(engine, PROMPTS[2], LONG, "waited")
        await engine.pause_generation(mode="wait", clear_cache=False)
        assert task.done() and (await task)[-1].outputs[0].finish_reason == "length"
        with pytest.raises(RuntimeError, match="paused"):
            await collect(engine, PROMPTS[0], GREEDY, "refused")
        await engine.resume_generation()

        # abort: the request in flight ends with an abort output
        task, _ = await started(engine, PROMPTS[2], LONG, "aborted-by-pause")
        await engine.pause_generation()
        aborted = await task
        with pytest.raises(RuntimeError, match="paused"):
            await collect(engine, PROMPTS[0], GREEDY, "refused")
        await engine.resume_generation()
        assert not await engine.is_paused()
        after = await collect(engine, PROMPTS[0], GREEDY, "after-pause")
        return kept, queued, aborted, after

    kept, queued, aborted, after = asyncio.run(main())
    assert completions(kept, RequestOutputKind.CUMULATIVE) == reference["long"][1]
    assert completions(queued, RequestOutputKind.CUMULATIVE) == reference["greedy"][0]
    assert aborted[-1].outputs[0].finish_reason == "abort"
    assert completions(after, RequestOutputKind.CUMULATIVE) == reference["greedy"][0]
    assert_idle(engine)


def test_engine_calls_run_between_steps(engine, reference):
    async def main():
        task = asyncio.create_task(collect(engine, PROMPTS[1], LONG, "during-calls"))
        await asyncio.sleep(0.05)
        reset = await engine.reset_prefix_cache(reset_running_requests=True)
        rpc = await engine.collective_rpc("is_sleeping")
        with pytest.raises(ValueError, match="not supported"):
            await engine.collective_rpc("no_such_method")
        return reset, rpc, await task

    reset, rpc, outputs = asyncio.run(main())
    assert reset is True and rpc == [False]
    assert completions(outputs, RequestOutputKind.CUMULATIVE) == reference["long"][1]
    assert asyncio.run(engine.get_tokenizer()) is engine.tokenizer is not None
    assert_idle(engine)


def test_vllm_engine_client_calls(engine, reference, caplog):
    """What vLLM's EngineClient offers and servers and rollout workers call."""
    import copy

    from jaxvllm import AsyncLLMEngine

    async def main():
        task, _ = await started(engine, PROMPTS[1], with_kind(LONG, RequestOutputKind.DELTA), "drained")
        await engine.wait_for_requests_to_drain(drain_timeout=60)
        assert engine.get_num_unfinished_requests() == 0
        deltas = await task
        waiting, _ = await started(engine, PROMPTS[2], LONG, "not-drained")
        with pytest.raises(TimeoutError, match="waiting for requests to drain"):
            await engine.wait_for_requests_to_drain(drain_timeout=0)
        await waiting
        # vLLM 0.11's positional order: lora_request, trace_headers, priority
        positional = await collect_positional()
        with caplog.at_level("INFO", logger="jaxvllm"):
            await engine.do_log_stats()
        await engine.reset_mm_cache()
        return (deltas, positional, await engine.get_tokenizer(), await engine.get_model_config(),
                await engine.get_supported_tasks(), await engine.is_tracing_enabled())

    async def collect_positional():
        return [out async for out in engine.generate(PROMPTS[0], GREEDY, "positional", None, None, 0)]

    deltas, positional, tokenizer, config, tasks, tracing = asyncio.run(main())
    assert AsyncLLMEngine is AsyncLLM
    assert tokenizer is engine.tokenizer and config is engine.model_config and config.max_model_len == 128
    assert tasks == ("generate",) and tracing is False
    assert completions(positional, RequestOutputKind.CUMULATIVE) == reference["greedy"][0]
    assert "Engine 000: Avg prompt throughput: " in caplog.text  # (AsyncEngineArgs: stats logging on)
    # RequestOutput.add merges a DELTA stream into what a CUMULATIVE one ends with
    merged = copy.deepcopy(deltas[0])
    for out in deltas[1:]:
        merged.add(out, aggregate=True)
    assert merged.finished and [(c.token_ids, c.text) for c in merged.outputs] == reference["long"][1]
    assert_idle(engine)


def test_shutdown_ends_streams_and_refuses_calls(checkpoint):
    engine = AsyncLLM(AsyncEngineArgs(model=checkpoint, **ENGINE))

    async def main():
        task, _ = await started(engine, PROMPTS[1], LONG, "cut")
        await asyncio.to_thread(engine.shutdown)
        outputs = await task
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(engine, PROMPTS[0], GREEDY, "late")
        with pytest.raises(EngineDeadError, match="shut down"):
            await engine.reset_prefix_cache()
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert engine.is_stopped and not engine.is_running and engine.errored  # (vLLM's: not running)
    assert engine.engine.runner.closed
    engine.shutdown()  # twice: harmless
    with pytest.raises(ValueError, match="data_parallel_size"):
        AsyncLLM(AsyncEngineArgs(model=checkpoint, data_parallel_size=2, **ENGINE))


def test_a_failed_engine_thread_fails_everything_with_engine_dead_error(checkpoint, monkeypatch):
    """vLLM's types: a fault of the thread's own code (not a step's) ends it; the streams in
    flight and every later call raise EngineDeadError, caused by the fault."""
    engine = AsyncLLM(AsyncEngineArgs(model=checkpoint, **ENGINE))

    def broken(output):
        raise ValueError("injected thread fault")

    async def main():
        monkeypatch.setattr(engine, "_deliver", broken)
        with pytest.raises(EngineDeadError) as streamed:
            await collect(engine, PROMPTS[0], GREEDY, "dies")
        with pytest.raises(EngineDeadError) as later:
            await collect(engine, PROMPTS[0], GREEDY, "late")
        return streamed.value, later.value

    streamed, later = asyncio.run(main())
    engine._thread.join(timeout=60)  # (the streams hear of the fault before the thread has freed the engine)
    assert all("injected thread fault" in repr(e.__cause__) for e in (streamed, later))
    assert engine.errored and not engine.is_running and isinstance(engine.dead_error, EngineDeadError)
    assert engine.engine.runner.closed
    engine.shutdown()


def test_cancelled_callers_and_resumed_pauses_leave_the_thread_serving(engine, reference, monkeypatch):
    """A coroutine cancelled while its call waits in the queue (its future cancelled), a
    "wait" pause given up by its caller, and a resume while a "wait" pause drains: the
    engine thread serves on (these once killed it, or left generation paused)."""
    step = engine.engine.step

    def slow_step():
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(engine.engine, "step", slow_step)

    async def main():
        task, _ = await started(engine, PROMPTS[1], LONG, "slowed")
        for call in (engine.reset_prefix_cache(), collect(engine, PROMPTS[0], GREEDY, "cancelled-add")):
            pending = asyncio.ensure_future(call)
            await asyncio.sleep(0)
            pending.cancel()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.pause_generation(mode="wait"), 0.3)
        assert await engine.is_paused()  # (the pause holds; it drains on)
        await engine.resume_generation()
        after = await collect(engine, PROMPTS[0], GREEDY, "after-resume")
        waiting = asyncio.ensure_future(engine.pause_generation(mode="wait"))
        await asyncio.sleep(0.1)
        assert await engine.is_paused() and not waiting.done()
        await engine.resume_generation()
        await waiting  # (ended by the resume)
        assert not await engine.is_paused()
        again = await collect(engine, PROMPTS[0], GREEDY, "after-second-resume")
        return await task, after, again

    slowed, after, again = asyncio.run(main())
    monkeypatch.undo()
    assert engine.is_running and not engine.errored
    assert completions(slowed, RequestOutputKind.CUMULATIVE) == reference["long"][1]
    assert completions(after, RequestOutputKind.CUMULATIVE) == completions(again, RequestOutputKind.CUMULATIVE) \
        == reference["greedy"][0]
    assert_idle(engine)


def test_params_are_copied_and_outputs_are_snapshots(engine, reference):
    """The caller may change its SamplingParams once generate has started (vLLM clones
    them); each CUMULATIVE output keeps the logprobs of its own tokens, not a list the
    engine thread goes on filling."""
    async def main():
        params = SamplingParams(temperature=0, max_tokens=LONG.max_tokens, ignore_eos=True, logprobs=2)
        gen = engine.generate(PROMPTS[1], params, "copied")
        first = await gen.__anext__()
        params.max_tokens, params.logprobs, params.temperature = 3, None, 1.0
        outputs = [first]
        async for out in gen:
            await asyncio.sleep(0.005)  # (a slow reader: the engine runs ahead)
            outputs.append(out)
        return outputs

    outputs = asyncio.run(main())
    assert completions(outputs, RequestOutputKind.CUMULATIVE) == reference["long"][1]
    for out in outputs:
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids)
    assert_idle(engine)


@pytest.mark.parametrize("last_call", ["none", "abort", "break"])
def test_dropping_the_last_reference_shuts_it_down(checkpoint, last_call):
    """Also when the call the engine thread ran last (an abort, a stream's own abort) left
    it idle: that call's closure holds the AsyncLLM, and the waiting thread must not."""
    engine = AsyncLLM(AsyncEngineArgs(model=checkpoint, **ENGINE))

    async def main():
        if last_call == "break":
            async for out in engine.generate(PROMPTS[0], LONG, "left"):
                if len(out.outputs[0].token_ids) >= 3:
                    break
            return
        outputs = await collect(engine, PROMPTS[0], GREEDY, "once")
        assert outputs[-1].finished
        if last_call == "abort":
            await engine.abort("no-such-request")

    asyncio.run(main())
    runner, thread = engine.engine.runner, engine._thread
    del engine
    gc.collect()
    thread.join(timeout=30)
    assert runner.closed and not thread.is_alive()
