"""Host time per engine step with the device step stubbed out, and how well async
scheduling hides it under a (simulated) device step.

At a few ms per decode step on an accelerator, Python on the host (scheduling,
building the numpy batch, appending tokens and detokenizing) can become the
bottleneck; this measures it for N decoding requests without loading a model:

    python -m jaxvllm.benchmarks.host_step [--num-requests 256 1024] [--steps 50] [--json PATH]
        [--output-len 1000]           # each request has already generated this many tokens
        [--device-ms 2 8]             # pipelining: LLMEngine.step against a stub device
        [--nanovllm PATH]             # nano-vllm's scheduler + batch building, same run

The real Scheduler, ModelRunner.prepare and LLMEngine._output run; ModelRunner and
LLMEngine are built with __new__ so that no model is loaded and nothing compiles, and
the sampled tokens are random ids below the tiny test tokenizer's vocabulary.

Pipelining: the whole `LLMEngine.step()` runs, with `ModelRunner.launch` replaced by a
stub device whose results are ready D ms after it starts a step (steps run one after
another, as on one stream). Synchronous scheduling costs host + D per step; async
scheduling should cost max(host, D).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from jaxvllm.detokenizer import IncrementalDetokenizer
from jaxvllm.engine import LLMEngine, ParentRequest
from jaxvllm.input_batch import InputBatch, block_table_widths
from jaxvllm.kv_cache_manager import KVCacheManager
from jaxvllm.metrics import MetricsCollector
from jaxvllm.model_runner import ModelRunner, RunnerOutput, default_buckets
from jaxvllm.request import Request
from jaxvllm.sampling_params import RequestOutputKind, SamplingParams
from jaxvllm.scheduler import Scheduler, SchedulerConfig

# "outputs" is detokenizing every running request into a RequestOutput, which a
# streaming caller of `LLMEngine.step()` pays; `LLM.generate` (final_only) skips it.
PARTS = ("schedule", "prepare", "update", "outputs", "total")
VOCAB = 384  # make_tokenizer's default vocabulary
MAX_MODEL_LEN = 4096
BLOCK_SIZE = 16


def make_tokenizer():
    """The tiny byte-level BPE of the tests, trained into a temp dir (no download)."""
    from jaxvllm.dummy import make_tokenizer as make

    with tempfile.TemporaryDirectory() as tmp:
        return make(tmp, vocab_size=VOCAB)


def build(num_requests: int, prompt_len: int, output_len: int, tokenizer, rng: np.random.Generator):
    """Scheduler with `num_requests` queued requests, a model-less runner and engine.

    Each request starts with `output_len` tokens already generated (like a preempted
    request being recomputed), since per-step output cost may grow with the output.
    """
    max_tokens = MAX_MODEL_LEN - prompt_len
    blocks_per_seq = -(-MAX_MODEL_LEN // BLOCK_SIZE)
    kv = KVCacheManager(num_requests * blocks_per_seq, BLOCK_SIZE)  # room for all: no preemption
    max_batched = max(8192, num_requests)
    scheduler = Scheduler(SchedulerConfig(num_requests, max_batched, MAX_MODEL_LEN), kv)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = LLMEngine.__new__(LLMEngine)  # only what `step` reads
    engine.tokenizer, engine.scheduler, engine.kv_cache_manager = tokenizer, scheduler, kv
    engine._in_flight, engine._token_texts = None, {}
    engine._multiprocess = engine._requests_changed = False
    engine.metrics = MetricsCollector("host-step", MAX_MODEL_LEN)  # metrics are part of a real step's cost
    parents = {}
    for i in range(num_requests):
        prompt = rng.integers(3, VOCAB, prompt_len).tolist()
        request = Request(str(i), prompt, params, max_tokens=max_tokens, arrival_index=i)
        request.token_ids += rng.integers(3, VOCAB, output_len).tolist()
        request.detokenizer = IncrementalDetokenizer(tokenizer)
        scheduler.add_request(request)
        parents[request.request_id] = ParentRequest(request.request_id, [request])

    runner = ModelRunner.__new__(ModelRunner)  # only what `prepare` reads
    runner.config = SimpleNamespace(max_num_seqs=num_requests)
    runner.backend = "pallas"  # a GPU's: decode steps take the decode-only layout
    runner.block_size, runner.max_blocks_per_seq = BLOCK_SIZE, blocks_per_seq
    runner.buckets, runner.widths = default_buckets(max_batched), block_table_widths(blocks_per_seq)
    runner.input_batch = InputBatch(num_requests, blocks_per_seq)
    runner.params = "stub"  # not closed
    engine.runner, engine._parents = runner, parents
    return scheduler, runner, engine, parents


def prefill(scheduler: Scheduler, runner: ModelRunner, rng: np.random.Generator) -> int:
    """Step (untimed) until every request is decoding; returns the number of steps."""
    steps = 0
    while len(scheduler.waiting) or any(r.num_tokens - r.num_computed_tokens > 1 for r in scheduler.running):
        out = scheduler.schedule()
        runner.prepare(out.scheduled)  # admits them to the persistent batch, as a real step does
        scheduler.update_from_output(out, rng.integers(0, VOCAB, len(out.scheduled), dtype=np.int32))
        steps += 1
    return steps


def time_steps(scheduler, runner, engine, parents, steps: int, rng, profile: cProfile.Profile | None = None) -> dict:
    """Time `steps` decode steps part by part; returns {part: [seconds per step]}."""
    n = len(scheduler.running)
    sampled_all = rng.integers(0, VOCAB, (steps, n), dtype=np.int32)  # the stubbed device step
    times = {p: [] for p in PARTS}
    clock = time.perf_counter
    if profile:
        profile.enable()
    for k in range(steps):
        t0 = clock()
        out = scheduler.schedule()
        t1 = clock()
        runner.prepare(out.scheduled)
        t2 = clock()
        updated = scheduler.update_from_output(out, sampled_all[k, : len(out.scheduled)])
        runner.release(r.request_id for r in updated if r.is_finished)
        t3 = clock()
        outputs = [engine._output(parents[r.request_id]) for r in updated]
        t4 = clock()
        assert len(out.scheduled) == n == len(outputs), "every request should decode every step"
        for part, dt in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            times[part].append(dt)
    if profile:
        profile.disable()
    return times


def summarize(times: dict, n: int) -> dict:
    """{part: [seconds per step]} -> {part: mean/p50/p90 ms and us per request} for n requests."""
    figures = {}
    for part, seconds in times.items():
        ms = np.asarray(seconds) * 1e3
        figures[part] = {"mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
                         "p90_ms": float(np.percentile(ms, 90)), "us_per_request": float(ms.mean() * 1e3 / n)}
    return figures


def print_parts(parts: dict) -> None:
    print(f"{'part':<16}{'mean ms':>10}{'p50 ms':>10}{'p90 ms':>10}{'us/request':>12}")
    for part, f in parts.items():
        print(f"{part:<16}{f['mean_ms']:>10.3f}{f['p50_ms']:>10.3f}{f['p90_ms']:>10.3f}{f['us_per_request']:>12.2f}")


def run(num_requests: int, steps: int, prompt_len: int, output_len: int, tokenizer, seed: int = 0,
        profile: cProfile.Profile | None = None) -> dict:
    rng = np.random.default_rng(seed)
    scheduler, runner, engine, parents = build(num_requests, prompt_len, output_len, tokenizer, rng)
    prefill_steps = prefill(scheduler, runner, rng)
    if len(scheduler.running) < num_requests:  # the first ones decode while the last ones prefill
        raise ValueError(f"requests reached max_model_len ({MAX_MODEL_LEN}) during {prefill_steps} prefill "
                         "steps; lower --prompt-len or --output-len")
    times = time_steps(scheduler, runner, engine, parents, steps, rng, profile)
    return {"num_requests": num_requests, "steps": steps, "prompt_len": prompt_len, "output_len": output_len,
            "prefill_steps": prefill_steps, "parts": summarize(times, num_requests)}


class StubDevice:
    """Stands in for `ModelRunner.launch`: a step's tokens are ready `ms` after the device
    starts it, and it starts a step when the one before is done (one stream)."""

    def __init__(self, ms: float, rng: np.random.Generator) -> None:
        self.seconds, self.rng, self.free_at = ms / 1e3, rng, 0.0

    def launch(self, batch) -> "StubStep":
        self.free_at = max(time.perf_counter(), self.free_at) + self.seconds
        return StubStep(batch.num_scheduled, self.free_at, self.rng)


class StubStep:
    awaits_bitmask = False  # no structured outputs here

    def __init__(self, n: int, ready: float, rng: np.random.Generator) -> None:
        self.n, self.ready, self.rng = n, ready, rng

    def result(self) -> RunnerOutput:
        wait = self.ready - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return RunnerOutput(self.rng.integers(0, VOCAB, self.n, dtype=np.int32), None, None, [])


def wall_per_step(num_requests: int, steps: int, prompt_len: int, tokenizer, device_ms: float,
                  async_scheduling: bool, seed: int = 0) -> float:
    """Mean wall ms of `LLMEngine.step()` (outputs as `LLM.generate` asks: final only)."""
    rng = np.random.default_rng(seed)
    scheduler, runner, engine, parents = build(num_requests, prompt_len, 0, tokenizer, rng)
    prefill(scheduler, runner, rng)
    engine.config = SimpleNamespace(async_scheduling=async_scheduling)
    for parent in parents.values():
        parent.output_kind = RequestOutputKind.FINAL_ONLY
    runner.launch = StubDevice(device_ms, rng).launch
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e3


def pipelining(num_requests: int, steps: int, prompt_len: int, device_ms: list[float], tokenizer) -> dict:
    """Wall ms per step, sync vs async, against host ms (the step with a 0 ms device) and D."""
    host = {a: wall_per_step(num_requests, steps, prompt_len, tokenizer, 0.0, a) for a in (False, True)}
    rows = []
    for d in device_ms:
        sync, async_ = (wall_per_step(num_requests, steps, prompt_len, tokenizer, d, a) for a in (False, True))
        bound = max(host[True], d)
        rows.append({"device_ms": d, "sync_wall_ms": sync, "async_wall_ms": async_,
                     "async_over_max_host_device": async_ / bound, "async_device_busy": min(1.0, d / async_),
                     "sync_device_busy": min(1.0, d / sync)})
    return {"num_requests": num_requests, "steps": steps, "host_ms_sync": host[False], "host_ms_async": host[True],
            "rows": rows}


def print_pipelining(result: dict) -> None:
    print(f"\npipelining, {result['num_requests']} decoding requests, {result['steps']} steps of LLMEngine.step(): "
          f"host {result['host_ms_sync']:.3f} ms (sync), {result['host_ms_async']:.3f} ms (async) with a 0 ms device")
    print(f"{'device ms':>10}{'sync wall':>11}{'async wall':>12}{'async/max(host,D)':>19}{'busy sync':>11}{'busy async':>12}")
    for r in result["rows"]:
        print(f"{r['device_ms']:>10.1f}{r['sync_wall_ms']:>11.3f}{r['async_wall_ms']:>12.3f}"
              f"{r['async_over_max_host_device']:>19.3f}{r['sync_device_busy']:>11.1%}{r['async_device_busy']:>12.1%}")


def print_table(result: dict) -> None:
    print(f"\n{result['num_requests']} decoding requests, {result['steps']} steps "
          f"(prompt {result['prompt_len']}, output {result['output_len']}+, "
          f"{result['prefill_steps']} prefill steps untimed)")
    print_parts(result["parts"])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=0, help="tokens each request has generated already")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--profile", type=int, default=0, metavar="K", help="print the top K functions (cProfile)")
    ap.add_argument("--device-ms", type=float, nargs="*", default=[2.0, 8.0],
                    help="simulated device step times for the pipelining figures (none: skip them)")
    ap.add_argument("--nanovllm", metavar="PATH", help="a nano-vllm checkout: time its scheduler and batch "
                    "building on the same workload, in this run (a peer, never a dependency)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.prompt_len < 1 or args.output_len < 0:
        ap.error("--steps and --prompt-len must be >= 1, --output-len >= 0")
    if args.prompt_len + args.output_len + args.steps > MAX_MODEL_LEN:
        ap.error(f"prompt + output + steps must fit in max_model_len {MAX_MODEL_LEN}")

    tokenizer = make_tokenizer()
    results = []
    for n in args.num_requests:
        profile = cProfile.Profile() if args.profile else None
        results.append(run(n, args.steps, args.prompt_len, args.output_len, tokenizer, profile=profile))
        print_table(results[-1])
        if profile:
            pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile)
        if args.nanovllm:
            from jaxvllm.benchmarks.nanovllm_peer import time_nanovllm

            peer = time_nanovllm(args.nanovllm, n, args.prompt_len, args.steps)
            ours = results[-1]["parts"]
            results[-1]["nanovllm"] = peer
            print(f"nano-vllm {peer.get('commit') or ''}: schedule + prepare + update p50 "
                  f"{peer['parts']['total']['p50_ms']:.3f} ms; ours (same parts) "
                  f"{sum(ours[p]['p50_ms'] for p in ('schedule', 'prepare', 'update')):.3f} ms")
        if args.device_ms:
            results[-1]["pipelining"] = pipelining(n, args.steps, args.prompt_len, args.device_ms, tokenizer)
            print_pipelining(results[-1]["pipelining"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
