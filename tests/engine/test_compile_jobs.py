"""The warm-up's compiles after start-up (a CPU's larger token buckets): `CompileJobs` on
plain functions, then an engine that serves before they are done."""

import gc
import json
import subprocess
import sys
import threading
import time
import weakref

import jax
import pytest

from jaxvllm import LLM, SamplingParams
from jaxvllm.model_runner import StepLowering
from jaxvllm.utils.compile_jobs import CompileJobs


def recorder():
    ran: list[tuple[str, str]] = []

    def job(name: str, seconds: float = 0.0, error: BaseException | None = None):
        def run():
            time.sleep(seconds)
            if error is not None:
                raise error
            ran.append((name, threading.current_thread().name))
        return run

    return ran, job


def test_now_before_run_returns_later_after():
    ran, job = recorder()
    jobs = CompileJobs(2)
    jobs.run([("a", job("a", 0.05)), ("b", job("b"))], [("c", job("c", 0.2)), ("d", job("d", 0.2))], desc="test")
    assert {name for name, _ in ran} == {"a", "b"} and jobs.pending == 2 and jobs.done_seconds is None
    jobs.wait_all()
    assert {name for name, _ in ran[2:]} == {"c", "d"} and jobs.pending == 0
    assert jobs.done_seconds >= jobs.ready_seconds > 0


def test_wait_runs_a_job_no_thread_has_begun_on_the_callers_thread():
    ran, job = recorder()
    jobs = CompileJobs(1)
    jobs.run([], [("slow", job("slow", 1.0)), ("queued", job("queued")), ("last", job("last"))], desc="test")
    jobs.wait("queued")  # (the one thread is busy with "slow")
    assert ran == [("queued", threading.current_thread().name)]
    jobs.wait("slow")  # (begun: waited for, not run again)
    jobs.wait("unknown")
    jobs.wait_all()
    assert [name for name, _ in ran] == ["queued", "slow", "last"] and jobs.pending == 0


def test_a_failed_later_job_is_logged_and_left_to_its_step(caplog):
    ran, job = recorder()
    jobs = CompileJobs(1)
    jobs.run([], [("bad", job("bad", error=ValueError("no"))), ("good", job("good"))], desc="test")
    jobs.wait_all()  # (no raise: the step's own call compiles it again, and raises there)
    assert ran[0][0] == "good" and jobs.pending == 0 and "a warm-up compile failed" in caplog.text
    with pytest.raises(ValueError, match="no"):  # one that start-up needs fails start-up
        CompileJobs(1).run([("bad", job("bad", error=ValueError("no")))], [], desc="test")


def test_an_interrupted_wait_runs_the_job_again_next_time():
    ran, job = recorder()
    interrupt = [KeyboardInterrupt()]

    def flaky():
        if interrupt:
            raise interrupt.pop()
        ran.append(("flaky", threading.current_thread().name))

    jobs = CompileJobs(1)
    jobs.run([], [("slow", job("slow", 1.0)), ("flaky", flaky)], desc="test")
    with pytest.raises(KeyboardInterrupt):
        jobs.wait("flaky")
    assert jobs.pending == 2
    jobs.wait("flaky")
    assert ran == [("flaky", threading.current_thread().name)]
    jobs.wait_all()
    assert jobs.pending == 0


def test_cancel_drops_what_no_thread_has_begun():
    ran, job = recorder()
    jobs = CompileJobs(1)
    jobs.run([], [("slow", job("slow", 1.0))] + [(i, job(str(i))) for i in range(5)], desc="test")
    jobs.cancel()
    assert [name for name, _ in ran] == ["slow"] and jobs.pending == 0


# -- an engine ---------------------------------------------------------------------------------

ENGINE = dict(max_model_len=128, max_num_seqs=8, token_buckets=[4, 8, 16], compilation_cache_dir="")
PROMPTS = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (14, 3)] + [  # a 17-token step: bucket 16
    {"prompt_token_ids": [7, 8, 9] * 4}]  # (n-gram drafts)
GREEDY = SamplingParams(temperature=0, max_tokens=5)


STEPS = {f"jit({name})" for name in ("_forward", "_sample", "_prompt_logprobs", "_propose", "_propose_rows",
                                     "_prefill", "_prefill_rows", "_decode", "_decode_rows")}


@pytest.fixture
def step_compiles(monkeypatch):
    """The forwards the warm-up's jobs compiled, by runner, and the step executables that
    compiled on the main thread outside a job (a step's own jit call compiling one: what
    must not happen)."""
    in_job, forwards, misses = threading.local(), [], []
    run, compile_forward = CompileJobs._run, StepLowering.forward

    def run_flagged(self, *args):
        in_job.on = True
        try:
            run(self, *args)
        finally:
            in_job.on = False

    def forward(self, layout, packed):
        compile_forward(self, layout, packed)
        forwards.append((id(self.forward_shapes), layout))  # (the runner's set: which runner)

    def listen(event, seconds, fun_name=None, **kwargs):
        if (event == "/jax/core/compile/backend_compile_duration" and fun_name in STEPS
                and threading.current_thread() is threading.main_thread() and not getattr(in_job, "on", False)):
            misses.append(fun_name)

    monkeypatch.setattr(CompileJobs, "_run", run_flagged)
    monkeypatch.setattr(StepLowering, "forward", forward)
    jax.monitoring.register_event_duration_secs_listener(listen)
    yield forwards, misses
    jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize("drafter", [None, "draft_model", "ngram"])
def test_a_cpu_engine_is_ready_after_its_smallest_bucket(drafter, tiny_checkpoint, step_compiles):
    """Ready with bucket 4 compiled; a step of bucket 16 right away waits for (or itself
    runs) its compile, and no step executable compiles twice or outside the warm-up's
    jobs, a drafter's included. The outputs are those of the same engine with everything
    compiled."""
    path = tiny_checkpoint("llama")
    spec = {"draft_model": {"model": str(path)}, "ngram": {"prompt_lookup_max": 3, "prompt_lookup_min": 1},
            None: None}[drafter]
    if spec is not None:
        spec.update(method=drafter, num_speculative_tokens=3)
    llm = LLM(path, speculative_config=spec, **ENGINE)
    try:
        stats = llm.stats()
        assert stats["warmup_pending_compiles"] > 0 and stats["warmup_done_seconds"] is None
        first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.llm_engine.finish_warmup()
        stats = llm.stats()
        assert stats["warmup_pending_compiles"] == 0 and stats["warmup_done_seconds"] >= stats["warmup_seconds"]
        assert stats["num_compiled_buckets"] == (3 if spec is None else 6)  # (with drafts: each also verifying)
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
        if drafter == "draft_model":
            assert stats["spec_decode_num_accepted_tokens"] > 0
        runner = id(llm.llm_engine.runner._forward_shapes)
    finally:
        llm.shutdown()
    forwards, misses = step_compiles
    layouts = [layout for owner, layout in forwards if owner == runner]
    assert len(layouts) == len(set(layouts)) == stats["num_compiled_buckets"] and not misses


def test_shutdown_and_exit_with_compiles_left(tiny_checkpoint):
    """Shutting down drops the compiles not begun; a script that ends with some left ends
    at once (concurrent.futures would otherwise run them all first), without an error."""
    llm = LLM(tiny_checkpoint("llama"), **ENGINE)
    assert llm.stats()["warmup_pending_compiles"] > 0
    llm.shutdown()
    assert llm.llm_engine.runner.compiles.pending == 0
    llm = LLM(tiny_checkpoint("llama"), **ENGINE)  # dropped with compiles left: freed at once, and they dropped
    compiles, runner = llm.llm_engine.runner.compiles, weakref.ref(llm.llm_engine.runner)
    gc.disable()
    try:
        del llm
        assert runner() is None
    finally:
        gc.enable()
    compiles.cancel()  # (waits for the ones begun)
    assert compiles.pending == 0
    script = ("from jaxvllm import LLM; import sys, json; "
              "llm = LLM(sys.argv[1], **json.loads(sys.argv[2])); "
              "print(llm.stats()['warmup_pending_compiles'])")
    done = subprocess.run([sys.executable, "-c", script, str(tiny_checkpoint("llama")),
                           json.dumps({**ENGINE, "token_buckets": [4, 8, 16, 32, 64, 128, 256]})],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.strip().splitlines()[-1]) > 6
    assert "Traceback" not in done.stderr and "failed" not in done.stderr
