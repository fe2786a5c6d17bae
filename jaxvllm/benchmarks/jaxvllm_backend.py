"""jaxvllm on a benchmark request list, with the same interface as `hf_backend.HFBackend`.

Construction (weights, KV cache, compiling every token bucket) is timed apart from
the runs. A run can also split each engine step into the time the host spends waiting
for the device's tokens and the rest (scheduling, building the numpy batch, appending
tokens, detokenizing), by wrapping the engine's and runner's methods on this one
instance: the engine itself is not changed for it. With async scheduling the host's
work overlaps the device's; the host waits only when it is ahead.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from jaxvllm.benchmarks.common import RunTimings
from jaxvllm.benchmarks.datasets import BenchRequest
from jaxvllm.llm import LLM
from jaxvllm.sampling_params import SamplingParams


@dataclass
class StepTiming:
    """Where the engine steps of a run spent their time (seconds, summed over steps)."""

    steps: int = 0
    step_seconds: float = 0.0  # LLMEngine.step, all of it
    # Host parts of it: Scheduler.schedule; BatchBuilder.prepare (the packed batch), ModelRunner.launch
    # (dispatching the jitted forward and sampler, the batch's transfer included); appending
    # the tokens read, stop checks and outputs (LLMEngine._process).
    schedule_seconds: float = 0.0
    prepare_seconds: float = 0.0
    launch_seconds: float = 0.0
    # Of launch: the calls of the jitted forward (the batch's transfer in it) and sampler (a
    # structured-output step's sampler is called after launch, when its masks are ready).
    forward_call_seconds: float = 0.0
    sampler_call_seconds: float = 0.0
    process_seconds: float = 0.0
    wait_seconds: float = 0.0  # blocked on a step's tokens (the device was busy meanwhile)

    @property
    def host_seconds(self) -> float:
        """Host work: the step time the host did not spend waiting for the device."""
        return self.step_seconds - self.wait_seconds

    def to_dict(self) -> dict[str, float]:
        share = self.host_seconds / self.step_seconds if self.step_seconds else 0.0
        per_step = lambda seconds: 1e3 * seconds / self.steps if self.steps else 0.0  # noqa: E731
        return {**asdict(self), "host_seconds": self.host_seconds, "host_share": share,
                "wait_share": 1.0 - share if self.step_seconds else 0.0, "mean_step_ms": per_step(self.step_seconds),
                "host_ms_per_step": {part: per_step(getattr(self, f"{part}_seconds"))
                                     for part in ("schedule", "prepare", "launch", "forward_call", "sampler_call",
                                                  "process", "host")}}


@contextmanager
def time_steps(llm: LLM) -> Iterator[StepTiming]:
    """Accumulate a StepTiming while inside; the instance's own methods come back on exit."""
    timing = StepTiming()
    engine, runner = llm.llm_engine, llm.llm_engine.runner

    def timed(fn: Callable, field_name: str, count: bool = False) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(timing, field_name, getattr(timing, field_name) + time.perf_counter() - start)
                timing.steps += count

        return wrapper

    def execute(*args: Any, **kwargs: Any):  # the step's PendingStep: time the wait for its results
        pending = execute_method(*args, **kwargs)
        pending.result = timed(pending.result, "wait_seconds")
        return pending

    execute_method = runner.execute
    patches = [(engine, "step", "step_seconds", True), (engine.scheduler, "schedule", "schedule_seconds", False),
               (runner.builder, "prepare", "prepare_seconds", False), (runner, "launch", "launch_seconds", False),
               (runner, "_forward", "forward_call_seconds", False), (runner, "_sampler", "sampler_call_seconds", False),
               (engine, "_process", "process_seconds", False)]
    # (methods come back by deleting the wrapper; the jitted functions are instance attributes)
    own = [(obj, name, obj.__dict__[name]) for obj, name, _, _ in patches if name in obj.__dict__]
    for obj, name, field_name, count in patches:
        setattr(obj, name, timed(getattr(obj, name), field_name, count))
    runner.execute = execute
    try:
        yield timing
    finally:
        for obj, name in [(o, n) for o, n, _, _ in patches] + [(runner, "execute")]:
            delattr(obj, name)
        for obj, name, value in own:
            setattr(obj, name, value)


class JaxvllmBackend:
    """An `LLM` built once (load and warm-up timed), then run on request lists."""

    name = "jaxvllm"

    def __init__(self, path: str, **engine_kwargs: Any) -> None:
        start = time.perf_counter()
        self.llm = LLM(path, **engine_kwargs)
        ready = time.perf_counter() - start
        self.llm.llm_engine.finish_warmup()  # (steps are timed with every bucket compiled)
        self.init_seconds = time.perf_counter() - start
        self.warmup_seconds = self.init_seconds - ready + self.llm.stats()["warmup_seconds"]
        self.load_seconds = self.init_seconds - self.warmup_seconds  # weights, KV cache, tokenizer
        self.last_step_timing: StepTiming | None = None

    def warmup(self, requests: list[BenchRequest]) -> float:
        """Nothing to do: construction compiled every token bucket (see `warmup_seconds`)."""
        return 0.0

    def run(self, requests: list[BenchRequest], *, temperature: float = 0.0, use_tqdm: bool = True,
            lora_requests: list | None = None) -> RunTimings:
        """One timed run (`lora_requests`: each request's LoRA adapter, or None). It starts
        with an empty prefix cache: a run before it on the same prompts (a warm-up pass)
        would otherwise spare it their prefill."""
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        # A constrained completion ends with its grammar: EOS is not ignored there.
        params = [SamplingParams(temperature=temperature, max_tokens=r.output_len,
                                 ignore_eos=r.structured_outputs is None and not r.stop_at_eos,
                                 structured_outputs=r.structured_outputs)
                  for r in requests]
        self.llm.reset_prefix_cache()
        with time_steps(self.llm) as timing:
            start_wall, start = time.time(), time.perf_counter()
            outputs = self.llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_requests)
            elapsed = time.perf_counter() - start
        self.last_step_timing = timing
        ttft, e2e = [], []
        for out in outputs:  # engine metrics are wall-clock (time.time) stamps
            m = out.metrics
            ttft.append(m.first_token_time - start_wall)
            e2e.append(m.finished_time - start_wall)
        return RunTimings(elapsed=elapsed, output_token_ids=[o.outputs[0].token_ids for o in outputs],
                          ttft=ttft, e2e=e2e, output_texts=[o.outputs[0].text for o in outputs])

    def stats(self) -> dict:
        return self.llm.stats()

    def close(self) -> None:
        del self.llm
        gc.collect()
