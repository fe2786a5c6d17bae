"""Random schedules on engines that draft: requests of every kind (shared prefixes, loops that
prompt lookup matches, greedy and seeded random sampling with penalties, n = 2, stop ids,
min_tokens, logprobs) are added a few at a time between steps and some are aborted, on an
engine with few KV blocks (preemption) and prefix caching. Each method runs (n-gram,
synchronous; a draft model and an EAGLE head, async with their drafts on the device).

Every request that finishes has the tokens a plain engine gives it, greedy and seeded alike
(each verified position draws what sampling without drafts would), and no KV block is left
held. The schedules are seeded, so a failure repeats."""

from __future__ import annotations

import random

import pytest

from jaxvllm import LLM, SamplingParams
from tests.spec_decode.common import perturbed_copy
from tests.spec_decode.eagle_heads import passing_head

ENGINE = dict(max_model_len=160, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[16, 64], dtype="float32")
PRESSURE = dict(num_gpu_blocks_override=12, enable_prefix_caching=True)  # 10 blocks hold a whole request
SCHEDULES = [2, 3]  # seeds of schedules that preempt with every method


def workload(rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    shared = [rng.randrange(3, 500) for _ in range(rng.randrange(16, 40))]
    work = []
    for _ in range(rng.randrange(6, 12)):
        kind = rng.random()
        if kind < 0.3:  # a shared prefix (prefix-cache hits)
            prompt = shared[: rng.randrange(5, len(shared))] + [rng.randrange(3, 500) for _ in range(rng.randrange(6))]
        elif kind < 0.6:  # a loop (prompt lookup finds it)
            unit = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 5))]
            prompt = (unit * 30)[: rng.randrange(3, 60)]
        else:
            prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 70))]
        params = dict(max_tokens=rng.randrange(1, 50), ignore_eos=rng.random() < 0.7, temperature=0.0)
        if rng.random() < 0.5:
            params.update(temperature=rng.choice([0.6, 1.0, 1.4]), seed=rng.randrange(1 << 20))
            if rng.random() < 0.4:
                params["top_k"] = rng.choice([2, 20])
            if rng.random() < 0.4:
                params["top_p"] = 0.9
            if rng.random() < 0.3:
                params["frequency_penalty"] = 0.3
        if rng.random() < 0.25:
            params["n"] = 2
        if rng.random() < 0.2:
            params["stop_token_ids"] = [rng.randrange(3, 500) for _ in range(3)]
        if rng.random() < 0.2:
            params["min_tokens"] = rng.randrange(params["max_tokens"] + 1)
        if rng.random() < 0.15:
            params["logprobs"] = 2
        work.append((prompt, SamplingParams(**params)))
    return work


def drive(llm: LLM, work, rng: random.Random, abort_p: float) -> tuple[dict[str, list[list[int]]], set[str]]:
    """Add the requests a few at a time between steps, now and then aborting one still running:
    ({request id: its completions' tokens} of those that finished, the ids aborted)."""
    engine, pending = llm.llm_engine, list(enumerate(work))
    finished, aborted, running = {}, set(), set()
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(4)):
            if pending:
                i, (prompt, params) = pending.pop(0)
                engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
                running.add(str(i))
        if running and rng.random() < abort_p:
            rid = rng.choice(sorted(running))
            engine.abort_request(rid)
            running.discard(rid)
            aborted.add(rid)
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                finished[out.request_id] = [list(c.token_ids) for c in out.outputs]
                running.discard(out.request_id)
    return finished, aborted


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def plain(target):
    with LLM(str(target), **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module", params=["ngram", "draft_model", "eagle"])
def drafting(request, target, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    spec = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "num_speculative_tokens": 3,
                        "model": str(perturbed_copy(target, folder / "draft"))},
        "eagle": {"method": "eagle", "num_speculative_tokens": 3, "model": str(passing_head(target, folder / "head"))},
    }[request.param]
    with LLM(str(target), speculative_config=spec, **ENGINE, **PRESSURE) as llm:
        assert llm.llm_engine.runner.device_drafts == (request.param != "ngram")
        yield llm


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_random_schedules_give_the_plain_engines_outputs(drafting, plain, schedule):
    method = drafting.llm_engine.config.speculative_config.method
    seed = 1000 * schedule + len(method)  # (each method its own schedules)
    work = workload(random.Random(seed))
    assert drafting.reset_prefix_cache()  # (each schedule alone, whatever ran before it)
    before = drafting.stats()
    got, aborted = drive(drafting, work, random.Random(seed + 1), abort_p=0.05)
    want, _ = drive(plain, work, random.Random(seed + 1), abort_p=0.0)
    assert got and set(got) | aborted == {str(i) for i in range(len(work))}
    for rid, tokens in got.items():
        assert tokens == want[rid], (rid, work[int(rid)][1])
    stats = drafting.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"], "a KV block leaked"
    assert stats["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]
    assert stats["num_preemptions"] > before["num_preemptions"]  # (the pressure the schedule was built for)
    hits = ("prefix_cache_hits", "prefix_cache_preempted_hits")  # (readmissions after a preemption: apart)
    assert sum(stats[k] for k in hits) > sum(before[k] for k in hits)
