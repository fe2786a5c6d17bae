"""Async scheduling: the same outputs as the synchronous loop (preemption, chunked prefill,
prefix hits, n > 1, seeded sampling, aborts, stops), no compiles after warm-up, output
kinds through LLMEngine.step(), and per-step executables that never branch on device data."""

import dataclasses
import re

import numpy as np
import pytest

from jaxvllm import LLM, RequestOutput, RequestOutputKind, SamplingParams
from jaxvllm.input_batch import BatchLayout
from jaxvllm.models.common import logits_params
from jaxvllm.sampler import SamplerFeatures
from tests.conftest import ARCHS

# One engine pair (async on / off) per architecture serves every parity scenario: a
# 32-token step budget chunks long prompts and 14 blocks x 16 tokens of KV preempt.
NUM_BLOCKS = 14
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=[32],
              num_gpu_blocks_override=NUM_BLOCKS)
GREEDY = SamplingParams(temperature=0, max_tokens=8)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
MODES = (True, False)  # async_scheduling


def _instrument(llm: LLM) -> None:
    """Count, on `llm.llm_engine.scheduler.counts`, what a run exercised: chunks that stop
    short of the request's last token (chunked prefill), chunks whose last input is still on
    the device, requests preempted with a token in flight, and tokens dropped because their
    request stopped or was aborted after the next step was dispatched."""
    scheduler = llm.llm_engine.scheduler
    counts = scheduler.counts = dict(partial_prefills=0, device_inputs=0, preempted_in_flight=0, dropped=0)
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def counting_schedule():
        out = schedule()
        counts["partial_prefills"] += sum(not s.samples for s in out.scheduled)
        counts["device_inputs"] += sum(s.start + s.num_new_tokens > s.request.num_tokens for s in out.scheduled)
        counts["preempted_in_flight"] += sum(r.num_pending > 0 for r in out.preempted)
        return out

    def counting_update(out, sampled, num_accepted=None, draft_ids=None):
        counts["dropped"] += sum(s.samples and s.request.is_finished for s in out.scheduled)
        return update(out, sampled, num_accepted, draft_ids)

    scheduler.schedule, scheduler.update_from_output = counting_schedule, counting_update


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    """engines(arch) -> {async_scheduling: LLM}, built once per architecture."""
    made: dict = {}

    def get(arch: str) -> dict[bool, LLM]:
        if arch not in made:
            path = tiny_checkpoint(arch)
            made[arch] = {mode: LLM(path, **ENGINE, async_scheduling=mode) for mode in MODES}
            for llm in made[arch].values():
                _instrument(llm)
        return made[arch]

    yield get
    for pair in made.values():
        for llm in pair.values():
            llm.shutdown()


def summary(outputs: list[RequestOutput]) -> list:
    """What must match between the modes: per completion its tokens, text and stop."""
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def assert_no_leak(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.llm_engine.runner.builder.input_batch) == 0  # every persistent row given back


def random_prompts(rng, lengths) -> list[dict]:
    return [{"prompt_token_ids": [int(t) for t in rng.integers(3, 384, size=int(n))]} for n in lengths]


# -- 1. greedy parity per architecture ---------------------------------------------------------


def run_with_aborts(llm: LLM, prompts: list[dict], abort_ids: list[str], abort_after: int):
    """Add requests by hand, step, abort some after `abort_after` steps, step to the end.
    Returns (final output per surviving id, abort outputs, ids seen after the abort)."""
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-test-{i}", p, SamplingParams(temperature=0, max_tokens=10))
    final: dict[str, RequestOutput] = {}
    for _ in range(abort_after):
        for out in engine.step():
            assert not out.finished, "a request finished before the abort: abort later"
    aborted = engine.abort_request(abort_ids)
    seen_after = set()
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 500
        for out in engine.step():
            seen_after.add(out.request_id)
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out
    return final, aborted, seen_after


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_async_matches_sync(arch, engines):
    pair = engines(arch)
    rng = np.random.default_rng(7)
    mixed = random_prompts(rng, [1, 2, 70, 16, 17, 45, 90] + list(rng.integers(1, 100, size=9)))
    decode_heavy = random_prompts(rng, rng.integers(5, 30, size=10))
    shared = [int(t) for t in rng.integers(3, 384, size=64)]  # 4 full blocks
    prefixed = [{"prompt_token_ids": shared + [int(t) for t in rng.integers(3, 384, size=n)]} for n in (3, 9, 20, 5)]
    seeded = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=8)
    to_abort = random_prompts(rng, [30, 5, 12, 40, 8])
    abort_ids = ["abort-test-1", "abort-test-3"]

    results = {}
    for mode, llm in pair.items():
        got = {}
        stats0 = llm.stats()
        # (a) preemption and (b) chunked prefill: prompts up to 90 tokens with a 32-token step
        # budget and KV for 224 tokens.
        got["mixed"] = summary(llm.generate(mixed, GREEDY, use_tqdm=False))
        stats = llm.stats()
        assert stats["num_preemptions"] > stats0["num_preemptions"], f"async={mode}: nothing was preempted"
        counts = llm.llm_engine.scheduler.counts
        assert counts["partial_prefills"] > 0, f"async={mode}: no prompt was chunked"
        assert_no_leak(llm)
        # (a) again, decode-heavy: requests are preempted while decoding (async: a token in flight).
        before = llm.stats()["num_preemptions"]
        got["decode_heavy"] = summary(llm.generate(decode_heavy, LONG, use_tqdm=False))
        assert llm.stats()["num_preemptions"] > before, f"async={mode}: nothing was preempted"
        assert_no_leak(llm)
        # (c) prefix cache hits: prompts sharing 64 tokens.
        got["prefixed"] = summary(llm.generate(prefixed, GREEDY, use_tqdm=False))
        assert llm.stats()["prefix_cache_hits"] > stats["prefix_cache_hits"], f"async={mode}: no prefix hit"
        assert_no_leak(llm)
        # (d) n > 1, seeded.
        [out] = llm.generate(mixed[2], seeded, use_tqdm=False)
        assert len({tuple(c.token_ids) for c in out.outputs}) == 3
        got["seeded"] = summary([out])
        assert_no_leak(llm)
        # (e) aborts while stepping by hand.
        final, aborted, seen_after = run_with_aborts(llm, to_abort, abort_ids, abort_after=3)
        assert sorted(o.request_id for o in aborted) == abort_ids
        for o in aborted:
            assert o.finished and all(c.finish_reason == "abort" for c in o.outputs)
        assert not seen_after & set(abort_ids), f"async={mode}: an aborted request came back"
        assert sorted(final) == sorted(f"abort-test-{i}" for i in (0, 2, 4))
        got["aborts"] = {rid: summary([o]) for rid, o in final.items()}
        assert_no_leak(llm)
        # (f) everything aborted with a step in flight, then the engine serves on.
        engine = llm.llm_engine
        for i, p in enumerate(to_abort):
            engine.add_request(f"all-{i}", p, GREEDY)
        for _ in range(3):
            engine.step()
        in_flight = any(r.num_pending for r in engine.scheduler.requests.values())
        assert in_flight == mode, f"async={mode}: tokens in flight at the abort: {in_flight}"
        engine.abort_request([f"all-{i}" for i in range(len(to_abort))])
        assert not engine.has_unfinished_requests()
        assert_no_leak(llm)
        got["after_abort_all"] = summary(llm.generate(to_abort, GREEDY, use_tqdm=False))
        assert_no_leak(llm)
        # What async scheduling does differently actually happened (and never without it).
        if mode:
            assert counts["device_inputs"] > 0 and counts["preempted_in_flight"] > 0 and counts["dropped"] > 0, counts
        else:
            assert counts["device_inputs"] == counts["preempted_in_flight"] == counts["dropped"] == 0, counts
        results[mode] = got

    for scenario in results[False]:
        assert results[True][scenario] == results[False][scenario], scenario


# -- 2. seeded sampling parity ------------------------------------------------------------------


SAMPLED = [
    SamplingParams(temperature=0.8, seed=1, max_tokens=10, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=1.0, top_p=0.8, top_k=20, seed=2, max_tokens=10, logprobs=2),
    SamplingParams(temperature=1.2, min_p=0.05, seed=3, max_tokens=10, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.8, repetition_penalty=1.3, seed=4,
                   max_tokens=12, logprobs=2),
    SamplingParams(temperature=0.9, logit_bias={5: 4.0, 9: -100.0, 2: 3.0}, min_tokens=6, seed=5, max_tokens=12,
                   logprobs=2),
    SamplingParams(temperature=1.0, stop=["o", "e", "i"], seed=6, max_tokens=12, logprobs=2),
    SamplingParams(temperature=1.0, top_k=5, stop_token_ids=list(range(200, 400)), seed=7, max_tokens=12,
                   logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=0, max_tokens=6, logprobs=2),
]


def assert_logprobs_close(a, b) -> None:
    assert (a is None) == (b is None)
    if a is None:
        return
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is None:
            continue
        assert list(x) == list(y)
        for token in x:
            assert abs(x[token].logprob - y[token].logprob) <= 1e-5
            assert x[token].rank == y[token].rank


def test_seeded_sampling_async_matches_sync(engines):
    pair = engines("qwen3")
    rng = np.random.default_rng(3)
    prompts = random_prompts(rng, [40, 7, 25, 3, 60, 12, 33, 9])
    outs = {mode: llm.generate(prompts, SAMPLED, use_tqdm=False) for mode, llm in pair.items()}
    for a, b in zip(outs[True], outs[False]):
        assert summary([a]) == summary([b])
        assert_logprobs_close(a.prompt_logprobs, b.prompt_logprobs)
        for ca, cb in zip(a.outputs, b.outputs):
            assert len(ca.logprobs) == len(ca.token_ids)
            assert_logprobs_close(ca.logprobs, cb.logprobs)
            assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-4)
    stop_str, stop_id = outs[True][5].outputs[0], outs[True][6].outputs[0]
    assert stop_str.finish_reason == "stop" and stop_str.stop_reason in ("o", "e", "i")
    assert stop_id.finish_reason == "stop" and stop_id.stop_reason in range(200, 400)
    for llm in pair.values():
        assert_no_leak(llm)


# -- 3. compiles ------------------------------------------------------------------------------------


def test_no_compiles_after_warmup(tiny_checkpoint, compile_counter):
    # Row counts 8 and 12 (distinct per bucket): an engine shape no other test here uses.
    llm = LLM(tiny_checkpoint("llama"), max_model_len=128, max_num_seqs=12, max_num_batched_tokens=24,
              token_buckets=[8, 24])
    assert llm.stats()["async_scheduling"] is True
    llm.llm_engine.finish_warmup()  # (bucket 24 compiles after ready on a CPU)
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (20, 3, 6, 1)]  # both buckets
    warmed = [
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(temperature=0.8, seed=1, max_tokens=6),
        SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=2, max_tokens=6),
        SamplingParams(temperature=0.6, top_p=0.9, seed=4, max_tokens=6),  # (Llama 3's defaults)
    ]
    variants = llm.stats()["num_compiled_sampler_variants"]
    before = compile_counter.count
    for params in warmed:
        llm.generate(prompts, params, use_tqdm=False)
    assert compile_counter.count == before, "a warmed sampler variant or bucket compiled while serving"
    assert llm.stats()["num_compiled_sampler_variants"] == variants
    # Penalties are a rarer variant: compiled when first used, once per layout. (The count is
    # of the process's jitted sampler, shared by every engine: compare before and after.)
    rare = SamplingParams(temperature=0.8, presence_penalty=1.0, seed=3, max_tokens=6)
    short = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (3, 1, 2)]  # every step fits bucket 8
    llm.generate(short, rare, use_tqdm=False)
    # (that variant alone: the state row write it needs is warmed, for the host row it is given)
    assert compile_counter.count == before + 1
    assert llm.stats()["num_compiled_sampler_variants"] == variants + 1
    before = compile_counter.count
    llm.generate(short, rare, use_tqdm=False)
    assert compile_counter.count == before
    assert llm.stats()["num_compiled_buckets"] == 2
    assert_no_leak(llm)
    llm.shutdown()


def test_no_sampler_compile_in_a_bucket_sharing_its_row_count(tiny_checkpoint, compile_counter):
    """The sampler compiles per row count, not per bucket or block-table width."""
    # Buckets 8 and 16 both have 6 rows: one set of sampler variants serves both.
    llm = LLM(tiny_checkpoint("mistral"), max_model_len=128, max_num_seqs=6, max_num_batched_tokens=16,
              token_buckets=[8, 16])
    llm.llm_engine.finish_warmup()
    before = compile_counter.count
    try:
        llm.generate({"prompt_token_ids": list(range(10, 22))}, SamplingParams(temperature=0, max_tokens=2),
                     use_tqdm=False)  # a 12-token prefill: bucket 16, greedy
        assert compile_counter.count == before
    finally:
        llm.shutdown()


# -- 4. stops -------------------------------------------------------------------------------------


def run_by_hand(llm: LLM, requests: dict[str, tuple], max_steps: int = 500) -> dict[str, list[RequestOutput]]:
    """Add {id: (prompt, params)}, step to the end; every output of each id, in order."""
    engine = llm.llm_engine
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    seen: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            seen[out.request_id].append(out)
    assert not engine.has_unfinished_requests()
    for rid, outs in seen.items():
        assert outs and outs[-1].finished, rid
        assert not any(o.finished for o in outs[:-1]), f"{rid}: output after the finished one"
    return seen


def test_stops_under_async(engines):
    pair = engines("qwen3")
    llm = pair[True]
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    [ref] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    ids, text = ref.outputs[0].token_ids, ref.outputs[0].text
    assert eos not in ids[:4]
    stop_id = next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i])
    cut = ids.index(stop_id)
    prefix3, prefix5 = tokenizer.decode(ids[:3]), tokenizer.decode(ids[:5])
    assert len(prefix5) > len(prefix3) >= 1
    stop_str = text[len(prefix3) - 1 : len(prefix5)]  # starts in token 3, ends in token 5
    companion = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    cases = {
        "eos": SamplingParams(temperature=0, max_tokens=12, min_tokens=3, logit_bias={eos: 100.0}),
        "stop_id": SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id], ignore_eos=True),
        "stop_str": SamplingParams(temperature=0, max_tokens=12, stop=[stop_str], ignore_eos=True),
        "length": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    }
    want = {
        "eos": (ids[:3] + [eos], "stop", None),
        "stop_id": (ids[: cut + 1], "stop", stop_id),
        "stop_str": (None, "stop", stop_str),
        "length": (ids[:4], "length", None),
    }
    finals = {}
    dropped_before = pair[True].llm_engine.scheduler.counts["dropped"]
    for mode, engine in pair.items():
        requests = {name: ("Hello", params) for name, params in cases.items()}
        requests["companion"] = ("Hello there", companion)  # keeps steps going past each stop
        seen = run_by_hand(engine, requests)
        finals[mode] = {rid: summary([outs[-1]]) for rid, outs in seen.items()}
        for name, (tokens, reason, stop_reason) in want.items():
            final = seen[name][-1].outputs[0]
            assert (final.finish_reason, final.stop_reason) == (reason, stop_reason), (mode, name)
            if tokens is not None:
                assert final.token_ids == tokens, (mode, name)
            # Every output (CUMULATIVE) is a prefix of the final one: nothing past the stop ever shows.
            for out in seen[name]:
                assert final.token_ids[: len(out.outputs[0].token_ids)] == out.outputs[0].token_ids
        stopped = seen["stop_str"][-1].outputs[0]
        assert stopped.text == text[: text.index(stop_str)]
        assert stopped.token_ids == ids[: len(stopped.token_ids)] and len(stopped.token_ids) <= 5
        assert_no_leak(engine)
    assert pair[True].llm_engine.scheduler.counts["dropped"] > dropped_before  # tokens after a stop were computed
    assert finals[True] == finals[False]


# -- 5. output kinds ------------------------------------------------------------------------------


def test_output_kinds_through_step(engines):
    """vLLM V1's output kinds through `step()`. A streamed request of n > 1 completions gives
    one output per completion and step, holding that completion alone; FINAL_ONLY gives all
    n once. DELTA sends the prompt logprobs with a completion's first output only."""
    llm = engines("llama")[True]
    prompt = {"prompt_token_ids": list(range(30, 70))}  # 40 tokens: two chunks, then decode
    kinds = {
        "cumulative": RequestOutputKind.CUMULATIVE,
        "delta": RequestOutputKind.DELTA,
        "final": RequestOutputKind.FINAL_ONLY,
    }
    requests = {}
    for name, kind in kinds.items():
        for n in (1, 2):
            params = SamplingParams(n=n, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True, logprobs=1,
                                    prompt_logprobs=1, output_kind=kind)
            requests[f"{name}-{n}"] = (prompt, params)
    seen = run_by_hand(llm, requests)

    def stream(outputs: list[RequestOutput], i: int) -> list:
        return [c for o in outputs for c in o.outputs if c.index == i]

    for n in (1, 2):
        cumulative, delta, final = seen[f"cumulative-{n}"], seen[f"delta-{n}"], seen[f"final-{n}"]
        assert all(len(o.outputs) == 1 for o in cumulative + delta)
        # FINAL_ONLY: exactly one output, at the end, with every completion.
        assert len(final) == 1 and final[0].finished and [c.index for c in final[0].outputs] == list(range(n))
        end = final[0]
        assert len(end.prompt_logprobs) == 40 and end.prompt_logprobs[0] is None
        assert all(o.prompt_logprobs == end.prompt_logprobs for o in cumulative)
        for i in range(n):
            # CUMULATIVE: every step with a new token, everything so far; the last as FINAL_ONLY's.
            steps = stream(cumulative, i)
            last, want = steps[-1], end.outputs[i]
            assert len(steps) >= 10
            assert (last.token_ids, last.text, last.finish_reason) == (want.token_ids, want.text, want.finish_reason)
            for before, after in zip(steps, steps[1:]):
                assert len(after.token_ids) > len(before.token_ids)
                assert after.token_ids[: len(before.token_ids)] == before.token_ids
                # A trailing U+FFFD (a character's first bytes) may become the whole character.
                assert after.text.startswith(before.text.rstrip("\ufffd"))
            # DELTA: only what is new; the pieces add up to the final output.
            pieces = stream(delta, i)
            assert sum((p.token_ids for p in pieces), []) == end.outputs[i].token_ids
            assert "".join(p.text for p in pieces) == end.outputs[i].text
            assert sum((p.logprobs for p in pieces), []) == end.outputs[i].logprobs
            assert all(p.finish_reason is None for p in pieces[:-1]) and pieces[-1].finish_reason == "length"
            assert all(p.token_ids for p in pieces)
            sent = [o.prompt_logprobs for o in delta if o.outputs[0].index == i]
            assert sent[0] == end.prompt_logprobs and all(p == [] for p in sent[1:])
    assert_no_leak(llm)


# -- 6. no device-side branches -----------------------------------------------------------------


def assert_no_host_sync(hlo: str, what: str) -> None:
    assert not re.search(r"\bconditional\(", hlo), f"{what} has a conditional"
    loops = [line for line in hlo.splitlines() if re.search(r"\bwhile\(", line)]
    for line in loops:
        assert '"known_trip_count"' in line, f"{what}: a while loop without a known trip count: {line[:200]}"


def test_step_executables_do_not_branch(engines):
    import jax
    import jax.numpy as jnp

    llm = engines("qwen3")[True]
    runner = llm.llm_engine.runner
    everything = SamplerFeatures(random=True, min_p=True, top_k=True, top_p=True, state=True, bad_words=True, logprobs=20,
                                 grammar=True)
    b = runner.builder
    batch = b.padding_batch(b.buckets[-1], b.widths[-1], everything)
    assert isinstance(batch.layout, BatchLayout) and batch.layout.dynamic_loops  # a CPU engine's steps
    # The step as a GPU compiles it: no loop of unknown trip count. (On the CPU, the
    # reference attention's KV loop stops at the last column used: XLA:CPU runs loops
    # without the host, so that costs no sync.)
    layout = dataclasses.replace(batch.layout, dynamic_loops=False)
    packed = jnp.asarray(batch.packed)
    forward = runner._forward.lower(runner.params, runner.kv_caches, packed, runner.last_sampled, layout=layout)
    assert_no_host_sync(forward.compile().as_text(), "forward")
    cpu_forward = runner._forward.lower(runner.params, runner.kv_caches, packed, runner.last_sampled,
                                        layout=batch.layout).compile().as_text()
    assert not re.search(r"\bconditional\(", cpu_forward)
    logits = jax.ShapeDtypeStruct((layout.num_rows, runner.cfg.vocab_size), jnp.float32)
    bitmask = jax.ShapeDtypeStruct((layout.num_rows, -(-runner.cfg.vocab_size // 32)), jnp.int32)
    sampler = runner._sampler.lower(packed[: layout.sampling_size], logits, runner.last_sampled,
                                    runner.sampler_state, bitmask, num_rows=layout.num_rows, features=everything)
    hlo = sampler.compile().as_text()
    assert_no_host_sync(hlo, "sampler")
    assert re.search(r"\bwhile\(", hlo), "expected the top-k/top-p bisection loops"
    hidden = jax.ShapeDtypeStruct((layout.num_tokens, runner.cfg.hidden_size), runner.dtype)
    rows = np.zeros((2, 16), np.int32)
    for width in (0, 20):
        prompt_logprobs = runner._prompt_logprobs.lower(logits_params(runner.params), hidden, rows, width=width)
        assert_no_host_sync(prompt_logprobs.compile().as_text(), "prompt logprobs")


def test_generate_after_stepping_by_hand_until_the_last_output(engines):
    """The step that returns the last final output drops the step dispatched before the
    stops were known (its tokens are for finished requests only): the engine is idle at
    once, as vLLM's, for a user who steps while has_unfinished_requests(); generate works after."""
    llm = engines("qwen3")[True]
    engine = llm.llm_engine
    [full] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    tokens = full.outputs[0].token_ids
    stop = next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])  # (max_tokens is seen ahead)
    engine.add_request("by-hand", "Hello", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]))
    while not any(o.finished for o in engine.step()):
        pass
    assert not engine.has_unfinished_requests()
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and not engine.has_unfinished_requests()
