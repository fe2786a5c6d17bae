"""Host time per engine step with the device step stubbed out, and how well async
scheduling hides it under a (simulated) device step.

At a few ms per decode step on an accelerator, Python on the host (scheduling,
building the numpy batch, appending tokens and detokenizing) can become the
bottleneck; this measures it for N decoding requests without loading a model:

    python -m jaxvllm.benchmarks.host_step [--num-requests 256 1024] [--steps 50] [--json PATH]
        [--output-len 1000]           # each request has already generated this many tokens
        [--device-ms 2 8]             # pipelining: LLMEngine.step against a stub device
        [--nanovllm PATH]             # nano-vllm's scheduler + batch building, same run
        [--ngram K]                   # speculative decoding: n-gram drafts of K tokens ("propose")

A real `LLMEngine` runs over dummy:tiny's config and tokenizer, with `StubRunner` as its
model runner: the real `BatchBuilder` builds every batch, and a stub device stands in for
the jitted step, so no model is loaded and nothing compiles. The sampled tokens are
random ids below the tiny tokenizer's vocabulary. The parts are timed one by one: the
scheduler, the batch builder, appending tokens, and the output processor's outputs.

With `--ngram K` the engine drafts by n-gram prompt lookup (window 1-4) and the stub device
accepts a random number of each row's drafts; "propose" is the proposer's part.

Pipelining: the whole `LLMEngine.step()` runs against a stub device whose results are
ready D ms after it starts a step (steps run one after another, as on one stream).
Synchronous scheduling costs host + D per step; async scheduling should cost max(host, D).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from jaxvllm.batch_builder import BatchBuilder, HostBatch, default_buckets
from jaxvllm.benchmarks.common import print_host_step, summarize
from jaxvllm.config import EngineConfig
from jaxvllm.dummy import write_dummy_model
from jaxvllm.engine import LLMEngine
from jaxvllm.loader import load_config
from jaxvllm.model_runner import RunnerOutput
from jaxvllm.request import ScheduledRequest
from jaxvllm.sampling_params import RequestOutputKind, SamplingParams

# "outputs" is detokenizing every running request into a RequestOutput, which a
# streaming caller of `LLMEngine.step()` pays; `LLM.generate` (final_only) skips it.
PARTS = ("schedule", "prepare", "update", "propose", "outputs", "total")
VOCAB = 384  # the tiny tokenizer's vocabulary
MAX_MODEL_LEN = 4096
BLOCK_SIZE = 16


class StubStep:
    """A dispatched step of the stub device: its tokens are ready at `ready`."""

    awaits_bitmask = False  # no structured outputs here

    def __init__(self, batch: HostBatch, ready: float, rng: np.random.Generator) -> None:
        self.batch, self.ready, self.rng = batch, ready, rng

    def result(self) -> RunnerOutput:
        wait = self.ready - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return RunnerOutput(self.rng.integers(0, VOCAB, self.batch.num_scheduled, dtype=np.int32), None, None, [])


class StubRunner:
    """The engine's model runner with the device stubbed out: the real `BatchBuilder`, and
    a device whose step's tokens are ready `device_ms` after it starts the step, starting
    each when the one before is done (one stream)."""

    def __init__(self, config: EngineConfig, *, device_ms: float, rng: np.random.Generator) -> None:
        self.cfg = load_config(config.model)
        self.max_model_len, self.num_blocks = config.max_model_len, config.num_gpu_blocks_override
        # decode_only: a GPU's pallas backend, so decode steps take the decode-only layout
        spec = config.speculative_config
        self.spec_tokens, self.device_drafts = spec.num_speculative_tokens if spec else 0, False  # (n-gram drafts)
        self.builder = BatchBuilder(max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                                    block_size=config.block_size, buckets=default_buckets(config.max_num_batched_tokens),
                                    vocab_size=self.cfg.vocab_size, decode_only=True, spec_tokens=self.spec_tokens)
        self.fill_buckets = None  # (a GPU's: chunks take all the budget)
        self.seconds, self.rng, self.free_at = device_ms / 1e3, rng, 0.0
        self.closed = False
        self.asleep: set[str] = set()  # (no sleep mode, no LoRA: the engine's checks find nothing)
        self.weights_gone = False
        self.lora = None

    def execute(self, scheduled: list[ScheduledRequest]) -> StubStep:
        batch = self.builder.prepare(scheduled)
        self.free_at = max(time.perf_counter(), self.free_at) + self.seconds
        return StubStep(batch, self.free_at, self.rng)

    def release(self, request_ids) -> None:
        self.builder.release(request_ids)

    def recover(self) -> bool:
        self.builder.release_all()
        return False

    def close(self) -> None:
        self.closed = True


def build(num_requests: int, prompt_len: int, output_len: int, folder: str, rng: np.random.Generator, *,
          device_ms: float = 0.0, async_scheduling: bool = False, ngram: int = 0) -> LLMEngine:
    """An engine over the stub runner with `num_requests` queued requests (room for all in
    the KV cache: no preemption).

    Each request starts with `output_len` tokens already generated (like a preempted
    request being recomputed), since per-step output cost may grow with the output.
    """
    spec = {"method": "ngram", "num_speculative_tokens": ngram, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    config = EngineConfig(model=folder, load_format="dummy", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                          hf_overrides={"max_position_embeddings": MAX_MODEL_LEN},  # (dummy:tiny's is 2048)
                          max_num_seqs=num_requests, max_num_batched_tokens=max(8192, num_requests * (1 + ngram)),
                          num_gpu_blocks_override=num_requests * -(-MAX_MODEL_LEN // BLOCK_SIZE),
                          async_scheduling=async_scheduling, compilation_cache_dir="",
                          speculative_config=spec if ngram else None)
    engine = LLMEngine(config, runner_class=partial(StubRunner, device_ms=device_ms, rng=rng))
    params = SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - prompt_len, ignore_eos=True)
    for i in range(num_requests):
        parent = engine.make_requests(str(i), {"prompt_token_ids": rng.integers(3, VOCAB, prompt_len).tolist()}, params)
        parent.children[0].token_ids += rng.integers(3, VOCAB, output_len).tolist()
        engine.add_parent(parent)
    return engine


def prefill(engine: LLMEngine, rng: np.random.Generator) -> int:
    """Step (untimed) until every request is decoding; returns the number of steps."""
    scheduler, builder = engine.scheduler, engine.runner.builder
    steps = 0
    while len(scheduler.waiting) or any(r.num_tokens - r.num_computed_tokens > 1 for r in scheduler.running):
        out = scheduler.schedule()
        builder.prepare(out.scheduled)  # admits them to the persistent batch, as a real step does
        scheduler.update_from_output(out, rng.integers(0, VOCAB, len(out.scheduled), dtype=np.int32))
        steps += 1
    return steps


def time_steps(engine: LLMEngine, steps: int, rng, profile: cProfile.Profile | None = None) -> dict:
    """Time `steps` decode steps part by part; returns {part: [seconds per step]}."""
    scheduler, builder, output_processor = engine.scheduler, engine.runner.builder, engine.output_processor
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
        builder.prepare(out.scheduled)
        t2 = clock()
        accepted = drafts = None
        if engine.proposer:  # (the drafts as the device hands them back: [n, K])
            accepted = rng.integers(0, out.scheduled.num_drafts + 1)
            drafts = np.zeros((n, engine.runner.spec_tokens), np.int64)
            for i, (r, d) in enumerate(zip(out.scheduled.requests, out.scheduled.num_drafts.tolist())):
                drafts[i, :d] = r.spec_token_ids[:d]
        updated = scheduler.update_from_output(out, sampled_all[k, : len(out.scheduled)], accepted, drafts)
        builder.release(r.request_id for r in updated if r.is_finished)
        t3 = clock()
        if engine.proposer:
            engine._propose_drafts(out.scheduled)
        t4 = clock()
        outputs = [output_processor.output(engine._parents[r.parent_id]) for r in updated]
        output_processor.commit()
        t5 = clock()
        assert len(out.scheduled) == n == len(outputs), "every request should decode every step"
        for part, dt in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
            times[part].append(dt)
    if profile:
        profile.disable()
    return times


def run(num_requests: int, steps: int, prompt_len: int, output_len: int, folder: str, seed: int = 0,
        profile: cProfile.Profile | None = None, ngram: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    engine = build(num_requests, prompt_len, output_len, folder, rng, ngram=ngram)
    prefill_steps = prefill(engine, rng)
    if len(engine.scheduler.running) < num_requests:  # the first ones decode while the last ones prefill
        raise ValueError(f"requests reached max_model_len ({MAX_MODEL_LEN}) during {prefill_steps} prefill "
                         "steps; lower --prompt-len or --output-len")
    times = time_steps(engine, steps, rng, profile)
    if not ngram:
        del times["propose"]
    return {"num_requests": num_requests, "steps": steps, "prompt_len": prompt_len, "output_len": output_len,
            "prefill_steps": prefill_steps, "ngram": ngram, "parts": summarize(times, num_requests)}


def wall_per_step(num_requests: int, steps: int, prompt_len: int, folder: str, device_ms: float,
                  async_scheduling: bool, seed: int = 0) -> float:
    """Mean wall ms of `LLMEngine.step()` (outputs as `LLM.generate` asks: final only)."""
    rng = np.random.default_rng(seed)
    engine = build(num_requests, prompt_len, 0, folder, rng, device_ms=device_ms, async_scheduling=async_scheduling)
    prefill(engine, rng)
    for parent in engine._parents.values():
        parent.output_kind = RequestOutputKind.FINAL_ONLY
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e3


def pipelining(num_requests: int, steps: int, prompt_len: int, device_ms: list[float], folder: str) -> dict:
    """Wall ms per step, sync vs async, against host ms (the step with a 0 ms device) and D."""
    host = {a: wall_per_step(num_requests, steps, prompt_len, folder, 0.0, a) for a in (False, True)}
    rows = []
    for d in device_ms:
        sync, async_ = (wall_per_step(num_requests, steps, prompt_len, folder, d, a) for a in (False, True))
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
    ap.add_argument("--ngram", type=int, default=0, metavar="K",
                    help="n-gram speculative decoding with K drafts a step (times the proposer as 'propose')")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.prompt_len < 1 or args.output_len < 0:
        ap.error("--steps and --prompt-len must be >= 1, --output-len >= 0")
    if args.prompt_len + args.output_len + args.steps > MAX_MODEL_LEN:
        ap.error(f"prompt + output + steps must fit in max_model_len {MAX_MODEL_LEN}")

    results = []
    with tempfile.TemporaryDirectory(prefix="jaxvllm-host-step-") as folder:
        write_dummy_model("dummy:tiny", folder)  # its config and tokenizer; no weights are made
        for n in args.num_requests:
            profile = cProfile.Profile() if args.profile else None
            results.append(run(n, args.steps, args.prompt_len, args.output_len, folder, profile=profile,
                               ngram=args.ngram))
            print_host_step(results[-1], f"output {results[-1]['output_len']}+")
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
                results[-1]["pipelining"] = pipelining(n, args.steps, args.prompt_len, args.device_ms, folder)
                print_pipelining(results[-1]["pipelining"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
