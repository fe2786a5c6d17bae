"""Engine lifecycle in one process: shutdown, context manager, del, and a second LLM.

A notebook keeps references around (its output history, the last traceback), so an LLM
that is no longer wanted must be able to give its device memory back explicitly, and one
that is dropped must not linger through reference cycles. "Memory" here is what JAX holds
on the device: the count and total bytes of `jax.live_arrays()`.
"""

import gc
import os
import signal
import subprocess
import sys
import time
import weakref

import jax
import pytest

from jaxvllm import LLM, SamplingParams

ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)
PROMPTS = ["Hello, my name is", {"prompt_token_ids": [5, 6, 7, 8]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=1)


def live_device_memory() -> tuple[int, int]:
    """(number, total bytes) of the arrays JAX holds on its devices now."""
    gc.collect()
    arrays = jax.live_arrays()
    return len(arrays), sum(a.nbytes for a in arrays)


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return str(tiny_checkpoint("qwen3"))


def kv_cache_bytes(llm: LLM) -> int:
    runner = llm.llm_engine.runner
    return runner.num_blocks * runner.kv_spec.bytes_per_block


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_shutdown_frees_device_memory_even_while_referenced(path):
    before = live_device_memory()
    llm = LLM(path, **ENGINE_ARGS)
    first = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    during = live_device_memory()
    assert during[1] >= before[1] + kv_cache_bytes(llm)  # the KV cache alone
    history = [llm, llm.llm_engine, llm.llm_engine.runner]  # what a notebook's Out[] might hold

    llm.shutdown()
    assert live_device_memory() == before
    assert llm.is_shutdown
    llm.shutdown()  # twice: harmless

    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.stats()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.llm_engine.step()
    del history

    # A second LLM in the same process works and answers the same.
    second = LLM(path, **ENGINE_ARGS)
    assert token_ids(second.generate(PROMPTS, GREEDY, use_tqdm=False)) == first
    second.shutdown()
    assert live_device_memory() == before


def test_shutdown_aborts_requests_added_by_hand(path):
    before = live_device_memory()
    llm = LLM(path, **ENGINE_ARGS)
    llm.llm_engine.add_request("a", "Hello", SamplingParams(max_tokens=50))
    llm.llm_engine.step()
    assert llm.llm_engine.has_unfinished_requests()
    llm.shutdown()
    assert not llm.llm_engine.has_unfinished_requests()
    assert live_device_memory() == before


def test_context_manager_frees_on_exit_and_on_error(path):
    before = live_device_memory()
    with LLM(path, **ENGINE_ARGS) as llm:
        assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 2
        assert live_device_memory()[1] > before[1]
    assert llm.is_shutdown
    assert live_device_memory() == before

    with pytest.raises(ValueError, match="empty"):
        with LLM(path, **ENGINE_ARGS) as llm:
            llm.generate([""], use_tqdm=False)
    assert live_device_memory() == before


def test_del_frees_device_memory_without_cycles(path):
    """Dropping the last reference frees the engine at once: nothing holds it in a cycle."""
    before = live_device_memory()
    llm = LLM(path, **ENGINE_ARGS)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    runner = weakref.ref(llm.llm_engine.runner)
    gc.disable()  # refcounting alone must free it
    try:
        del llm
        assert runner() is None
        assert (len(jax.live_arrays()), sum(a.nbytes for a in jax.live_arrays())) == before
    finally:
        gc.enable()


def test_the_first_llm_of_a_process_is_freed_by_del_and_keeps_nothing(path):
    """In a fresh process (a notebook's first cell), whose first LLM imports transformers'
    config module and torch: that import left a cycle of frames holding the LLM (freed only
    by a full collection), and every engine's batch builder stayed cached for the process."""
    code = f"""
import gc, sys, weakref
import jax
gc.disable()
from jaxvllm import LLM, SamplingParams
from jaxvllm.batch_builder import BatchBuilder
for i in range(2):
    llm = LLM({path!r} if i else "dummy:tiny", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)
    llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], SamplingParams(max_tokens=2), use_tqdm=False)
    ref = weakref.ref(llm)
    del llm
    assert ref() is None and not jax.live_arrays(), i
gc.enable(); gc.collect()
assert not [o for o in gc.get_objects() if isinstance(o, BatchBuilder)]
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def test_second_llm_while_first_alive_then_replace(path):
    """Two engines side by side are independent; rebinding the name frees the first."""
    before = live_device_memory()
    a = LLM(path, **ENGINE_ARGS)
    one = live_device_memory()
    b = LLM(path, **ENGINE_ARGS)
    assert live_device_memory()[1] - one[1] == one[1] - before[1]  # two full sets, nothing shared
    assert token_ids(a.generate(PROMPTS, GREEDY, use_tqdm=False)) == token_ids(b.generate(PROMPTS, GREEDY, use_tqdm=False))
    a = LLM(path, **ENGINE_ARGS)  # the notebook habit: run the cell again
    assert live_device_memory() == (2 * one[0] - before[0], 2 * one[1] - before[1])
    del a, b
    assert live_device_memory() == before


def test_generate_freezes_older_objects_only_while_it_runs(path):
    """generate keeps the objects that existed before it out of full collections (a
    process with jax, transformers and torch imported holds about a million) and gives
    them back to the collector when it returns or is interrupted; a freeze the user made
    is left as it was."""
    llm = LLM(path, **ENGINE_ARGS)
    first = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    seen, step = [], llm.llm_engine.step

    def spy(interrupt_at=None):
        def spying_step():
            seen.append(gc.get_freeze_count())
            if len(seen) == interrupt_at:
                raise KeyboardInterrupt
            return step()
        return spying_step

    assert gc.get_freeze_count() == 0
    llm.llm_engine.step = spy()
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == first
    assert seen and min(seen) > 0
    assert gc.get_freeze_count() == 0

    seen.clear()
    llm.llm_engine.step = spy(interrupt_at=2)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert gc.get_freeze_count() == 0

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        llm.llm_engine.step = step
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == first
        assert 0 < gc.get_freeze_count() <= frozen  # (some frozen objects were freed meanwhile)
    finally:
        gc.unfreeze()
    llm.shutdown()


@pytest.mark.parametrize("where", ["loading dummy weights", "quantizing", "making the KV cache", "warm-up",
                                   "after the runner"])
def test_a_failed_start_frees_its_device_memory_at_once(where, monkeypatch, tmp_path):
    """An LLM(...) that fails part way (here a Ctrl-C) frees what it made before the error
    reaches the caller, not when its traceback goes (a notebook keeps the last one): the
    weights loaded so far, the KV cache (on a CPU still being zeroed beside the warm-up),
    a built runner's arrays and a dummy model's temporary folder."""
    import tempfile

    import jaxvllm.engine
    import jaxvllm.loader
    from jaxvllm.model_runner import ModelRunner

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    extra = {}
    if where == "loading dummy weights":
        calls, put = [], jaxvllm.loader._put

        def put_then_interrupt(*args):
            put(*args)
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt

        monkeypatch.setattr(jaxvllm.loader, "_put", put_then_interrupt)
    elif where == "quantizing":  # (online fp8: the weights loaded, two of them quantized)
        calls, quantize = [], jaxvllm.loader.quantize_in_place

        def interrupt_the_third(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return quantize(*args, **kwargs)

        monkeypatch.setattr(jaxvllm.loader, "quantize_in_place", interrupt_the_third)
        extra = dict(quantization="fp8")
    elif where == "making the KV cache":  # (a real Ctrl-C while LLM(...) waits for it: on a CPU, its zero-fill)
        allocate = ModelRunner._allocate_kv_caches

        def allocate_then_ctrl_c(self, num_blocks):
            caches = allocate(self, num_blocks)
            time.sleep(0.2)  # (the main thread is waiting for the caches by now)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # (the main thread waits for the caches meanwhile)
            return caches

        monkeypatch.setattr(ModelRunner, "_allocate_kv_caches", allocate_then_ctrl_c)
        extra = dict(enforce_eager=True)
    elif where == "warm-up":
        monkeypatch.setattr(ModelRunner, "warmup", interrupt)
    else:
        monkeypatch.setattr(jaxvllm.engine, "KVCacheManager", interrupt)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (its own: the other pytest worker makes dummy folders too)
    before = live_device_memory()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a Python main process's)
    try:
        with pytest.raises(KeyboardInterrupt) as held:  # (the traceback stays alive in `held`)
            LLM("dummy:tiny", **ENGINE_ARGS, token_buckets=[64], **extra)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert held.value.__traceback__ is not None
    count, size = live_device_memory()
    # (the interrupted loop's frames keep its PRNG keys: 16 bytes each, no weight)
    assert size - before[1] <= (48 if where == "loading dummy weights" else 0) and count - before[0] <= 3
    assert not list(tmp_path.glob("jaxvllm-dummy-*"))


def test_shutdown_from_another_thread_while_generate_runs(path):
    """A notebook's worker thread generating while the user shuts the LLM down: the step
    under way ends first (its arrays are not deleted under it), and generate raises that
    the engine was shut down."""
    import sys
    import threading
    import traceback

    llm = LLM(path, **ENGINE_ARGS)
    engine, stepped, errors = llm.llm_engine, threading.Event(), []
    step = engine.step

    def step_then_signal():
        outputs = step()
        stepped.set()
        return outputs

    engine.step = step_then_signal

    def work():
        try:
            llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(8)],
                         SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=work)
    worker.start()
    deadline = time.monotonic() + 600  # (a step may first wait for its bucket's compile, on a loaded machine)
    while not stepped.wait(1):
        assert worker.is_alive(), f"generate ended before its first step: {errors!r}"
        assert time.monotonic() < deadline, "no step in 600 s; the threads' stacks:\n" + "\n".join(
            f"{thread.name}:\n{''.join(traceback.format_stack(sys._current_frames()[thread.ident]))}"
            for thread in threading.enumerate() if thread.ident in sys._current_frames())
    llm.shutdown()
    worker.join(60)
    assert not worker.is_alive() and len(errors) == 1
    assert isinstance(errors[0], RuntimeError) and "shut down" in str(errors[0])
    assert engine.runner.closed


def test_is_shutdown_from_the_start_of_shutdown(path):
    """A shutdown on another thread aborts the requests before it closes the runner: from its
    start the LLM says it is shut down, so a generate that finds its requests gone reports
    the shutdown (it raised "ended without a final output" in that window, a CI flake)."""
    import threading

    llm = LLM(path, **ENGINE_ARGS)
    runner, entered, release = llm.llm_engine.runner, threading.Event(), threading.Event()
    close = runner.close

    def slow_close():
        entered.set()
        release.wait(60)
        close()

    runner.close = slow_close
    closer = threading.Thread(target=llm.shutdown)
    closer.start()
    try:
        assert entered.wait(60) and not runner.closed
        assert llm.is_shutdown
        with pytest.raises(RuntimeError, match="this LLM was shut down"):
            llm._check_open()
    finally:
        release.set()
        closer.join(60)
    assert runner.closed and llm.is_shutdown


def test_shutdown_inside_a_step_on_the_same_thread(path):
    """A signal handler (SIGTERM's graceful shutdown, a custom SIGINT handler) runs on the
    thread that is stepping, inside the step: shutdown then frees the engine as the step
    returns, instead of waiting for a step that waits for it."""
    llm = LLM(path, **ENGINE_ARGS)
    engine = llm.llm_engine
    step = engine._step

    def step_then_a_handler_shuts_down():
        outputs = step()
        llm.shutdown()  # (what a handler does, between two bytecodes of the step)
        assert not engine.runner.closed  # (not yet: the step is under way)
        return outputs

    engine._step = step_then_a_handler_shuts_down
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=50), use_tqdm=False)
    assert engine.runner.closed


def test_shutdown_inside_a_shutdown_on_the_same_thread(path):
    """A signal handler that shuts down (SIGTERM's) runs while this thread is already in
    shutdown, waiting for the warm-up's compiles: it returns, and the first shutdown frees
    everything. Before, it waited for good on the lock its own thread held."""
    import threading

    llm = LLM(path, **ENGINE_ARGS)
    engine = llm.llm_engine
    close, nested = engine.runner.close, []

    def close_after_a_handler_shuts_down():
        engine.shutdown()  # (what the handler does, between two bytecodes of the shutdown)
        nested.append(engine.runner.closed)
        close()

    engine.runner.close = close_after_a_handler_shuts_down
    worker = threading.Thread(target=llm.shutdown, daemon=True)  # (so that a deadlock fails, not hangs, the test)
    worker.start()
    worker.join(60)
    assert not worker.is_alive() and nested == [False] and engine.runner.closed


def test_a_second_thread_is_refused_while_one_generates(path):
    """An LLM is not thread-safe (nor is vLLM's): a second thread's generate, chat, enqueue,
    wait_for_completion or beam_search while one runs raises, and the first one's outputs
    are as they would be. Before, the second call's start aborted the first one's requests."""
    import threading

    from jaxvllm import BeamSearchParams

    llm = LLM(path, **ENGINE_ARGS)
    engine, stepped, results = llm.llm_engine, threading.Event(), []
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = token_ids(llm.generate(PROMPTS, long, use_tqdm=False))
    step, release = engine.step, threading.Event()

    def step_then_wait():
        outputs = step()
        stepped.set()
        release.wait(30)  # (the other thread tries meanwhile)
        return outputs

    engine.step = step_then_wait
    worker = threading.Thread(target=lambda: results.append(token_ids(llm.generate(PROMPTS, long, use_tqdm=False))))
    worker.start()
    assert stepped.wait(60)
    calls = [lambda: llm.generate(PROMPTS, long, use_tqdm=False), lambda: llm.enqueue(PROMPTS, long),
             lambda: llm.wait_for_completion(use_tqdm=False),
             lambda: llm.chat([{"role": "user", "content": "Hi"}], long, use_tqdm=False),
             lambda: llm.beam_search(["Hi"], BeamSearchParams(beam_width=2, max_tokens=2))]
    for call in calls:
        with pytest.raises(RuntimeError, match="another thread is in a call of this LLM: an LLM is not thread-safe"):
            call()
    release.set()
    worker.join(60)
    engine.step = step
    assert results == [want]
    assert token_ids(llm.generate(PROMPTS, long, use_tqdm=False)) == want  # (and this thread's turn now)
    llm.shutdown()


def test_a_ctrl_c_while_shutdown_deletes_the_arrays_leaves_it_shut_down(path):
    """A real SIGINT as shutdown deletes the device arrays lands once the runner is marked
    closed: the LLM refuses work (before, it said it was open, over deleted arrays), and a
    second shutdown ends the rest."""
    from jaxvllm.model_runner import ModelRunner
    from tests.engine.test_faults import sigint_in

    llm = LLM(path, **ENGINE_ARGS)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    sigint_in(ModelRunner.close, "self._delete_arrays(")
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.shutdown()
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGINT, previous)
    assert llm.llm_engine.runner.closed
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()


@pytest.mark.parametrize("call", ["update_weights", "wake_up"])
def test_shutdown_from_another_thread_waits_for_a_weight_call(path, call):
    """shutdown while another thread's update_weights or wake_up runs frees the runner after
    it, so what that call placed is freed too. Before, it freed the runner under the call,
    which then placed arrays that nobody deleted (held until the LLM itself was dropped)."""
    import threading

    from safetensors.numpy import load_file

    before = live_device_memory()
    llm = LLM(path, **ENGINE_ARGS, enable_sleep_mode=True)
    runner, started, errors = llm.llm_engine.runner, threading.Event(), []
    weights = load_file(f"{path}/model.safetensors")
    if call == "wake_up":
        llm.sleep(1)
    real = getattr(runner, call)

    def slow(*args):
        started.set()
        time.sleep(0.5)  # (the other thread shuts down meanwhile)
        return real(*args)

    setattr(runner, call, slow)

    def work():
        try:
            llm.update_weights(weights) if call == "update_weights" else llm.wake_up()
        except RuntimeError as e:
            errors.append(e)

    worker = threading.Thread(target=work)
    worker.start()
    assert started.wait(60)
    llm.shutdown()
    worker.join(60)
    assert not worker.is_alive() and not errors and runner.closed
    assert live_device_memory()[1] <= before[1]


def test_a_second_shutdown_signal_inside_a_deferred_shutdown_returns(path):
    """A SIGTERM handler's shutdown inside a step is done as the step ends; a second one
    landing inside that shutdown returns, where it ran a whole shutdown inside the first."""
    llm = LLM(path, **ENGINE_ARGS)
    engine = llm.llm_engine
    depth, deepest = [0], [0]
    real_shutdown, real_abort, real_step = engine._shutdown, engine.abort_request, engine._step

    def counted_shutdown():
        depth[0] += 1
        deepest[0] = max(deepest[0], depth[0])
        try:
            return real_shutdown()
        finally:
            depth[0] -= 1

    def abort_after_a_second_handler(ids):
        engine.shutdown()  # (the second handler, inside the shutdown)
        return real_abort(ids)

    def step_then_a_handler_shuts_down():
        outputs = real_step()
        engine.shutdown()  # (the first handler, inside the step: deferred to its end)
        return outputs

    engine._shutdown, engine.abort_request, engine._step = (counted_shutdown, abort_after_a_second_handler,
                                                            step_then_a_handler_shuts_down)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=20))
    engine.step()
    assert deepest == [1] and engine.runner.closed and not engine._shutdown_requested
