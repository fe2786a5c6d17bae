"""Faults: a Ctrl-C or an exception at any point of a step leaves the LLM usable, with the
same outputs afterwards and no KV block leaked."""

import os
import random
import signal
import threading

import numpy as np
import pytest

import jaxvllm.llm
from jaxvllm import LLM, SamplingParams
from jaxvllm.batch_builder import BatchBuilder
from jaxvllm.model_runner import ModelRunner, PendingStep
from jaxvllm.scheduler import Scheduler

ENGINE = dict(max_model_len=160, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=[32],
              num_gpu_blocks_override=24)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompts():
    """Prompts sharing a 2-block prefix (prefix cache hits), some long enough to be chunked."""
    rng = np.random.default_rng(5)
    prefix = [int(t) for t in rng.integers(3, 384, size=32)]
    return [{"prompt_token_ids": prefix + [int(t) for t in rng.integers(3, 384, size=n)]} for n in (1, 5, 17, 40, 3, 9)]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def case(request, tiny_checkpoint):
    llm = LLM(tiny_checkpoint("qwen3"), async_scheduling=request.param, **ENGINE)
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
    real = getattr(owner, name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            raise error("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    with pytest.raises(error, match="injected"):
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_healthy(llm, want)


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
    assert all(not k.is_deleted() for layer in runner.kv_caches for k in layer)
    assert_healthy(llm, want)


def test_interrupt_before_the_loop_does_not_lock_the_engine_out(case, monkeypatch):
    """An interrupt after the requests are queued, while the progress bar is being made."""
    llm, want = case

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(jaxvllm.llm, "tqdm", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts(), GREEDY)
    monkeypatch.undo()
    assert_healthy(llm, want)


@pytest.mark.slow
@pytest.mark.parametrize("use_tqdm", [False, True])
def test_sigint_at_random_moments(case, use_tqdm):
    """Real SIGINTs at random times during generate; each interrupted call raises, and the
    same LLM then serves as if nothing happened."""
    llm, want = case
    rng = random.Random(0)
    interrupted = 0
    for _ in range(12):
        timer = threading.Timer(rng.uniform(0.0, 0.25), os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            out = llm.generate(prompts(), GREEDY, use_tqdm=use_tqdm)
            timer.join()  # the signal may still come: let it land here, outside generate
        except KeyboardInterrupt:
            interrupted += 1
        else:
            assert tokens(out) == want
        finally:
            timer.cancel()
            try:
                timer.join()
            except KeyboardInterrupt:
                pass
        assert_healthy(llm, want)
    assert interrupted > 0


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
