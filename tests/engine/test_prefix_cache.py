"""Automatic prefix caching: block manager units, hit accounting, and outputs equal to uncached runs."""

import enum

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxvllm import LLM, SamplingParams
from jaxvllm.kv_cache_manager import BlockPool, KVCacheManager, hash_block
from jaxvllm.request import ScheduledRequest
from jaxvllm.scheduler import Scheduler, SchedulerConfig
from tests.conftest import ARCHS
from tests.engine.test_scheduler import check_blocks, check_tokens, fake_token, make_request

BS = 4


def request_with(rid, tokens, max_tokens=3, arrival=0, salt=None):
    r = make_request(rid, 1, max_tokens, arrival)
    r.prompt_token_ids, r.token_ids = list(tokens), list(tokens)
    r.cache_salt = salt
    return r


def admit(kv: KVCacheManager, request, num_new=None):
    """What the scheduler (admission) and the engine (dispatch) do; returns the number of cached tokens."""
    computed = kv.get_computed_blocks(request)
    cached = len(computed) * kv.block_size
    num_new = num_new or request.num_tokens - cached
    assert kv.allocate_slots(request, num_new, computed) is not None
    kv.cache_blocks([ScheduledRequest(request, cached, num_new, kv.get_block_ids(request.request_id), True)])
    request.num_computed_tokens = cached
    return cached


# -- block pool / manager units --------------------------------------------------------


def test_hash_chains_on_parent_and_salt():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4]) and len(a) == 32
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], b"x") not in (a, hash_block(None, [1, 2, 3, 4], b"y"))


def test_copies_of_a_block_stay_findable_once_the_first_is_reused():
    """Two blocks with the same contents (a full prompt hit recomputes its last block): both
    are registered, as vLLM's; a lookup finds the first, and once it is reused, the copy."""
    kv = KVCacheManager(7, BS)
    tokens = list(range(100, 108))  # exactly 2 blocks
    a, b = request_with("a", tokens), request_with("b", tokens, arrival=1)
    admit(kv, a)
    assert admit(kv, b) == 4
    h, first, copy = kv.block_hashes(a)[1], kv.get_block_ids("a")[1], kv.get_block_ids("b")[1]
    assert first != copy and kv.pool.cached[h] == first and list(kv.pool.copies[h]) == [copy]
    kv.free(a)
    kv.free(b)  # (b's copy after a's first in the free queue)
    c = request_with("c", range(200, 220), arrival=2)
    assert admit(kv, c) == 0  # the 4 unused blocks, then a's, not b's
    kv.free(c)
    assert kv.pool.block_hashes[first] != h and kv.pool.cached[h] == copy and h not in kv.pool.copies
    assert admit(kv, request_with("d", tokens + [9], arrival=3)) == 8
    kv.release_all()  # (made anew from the cache map: the copy is still found)
    assert kv.pool.cached[h] == copy and kv.pool.block_hashes[copy] == h


def test_a_copy_registered_for_a_step_that_failed_is_forgotten_alone():
    kv = KVCacheManager(8, BS)
    tokens = list(range(100, 108))
    admit(kv, request_with("a", tokens))
    kv.commit()
    h, first = kv.block_hashes(request_with("x", tokens))[1], kv.get_block_ids("a")[1]
    b = request_with("b", tokens, arrival=1)
    admit(kv, b)
    copy = kv.get_block_ids("b")[1]
    assert list(kv.pool.copies[h]) == [copy]
    kv.rollback()  # (b's step was never dispatched)
    assert kv.pool.cached[h] == first and h not in kv.pool.copies and kv.pool.block_hashes[copy] is None


def test_identical_prompt_hits_all_but_last_token():
    kv = KVCacheManager(16, BS)
    tokens = list(range(100, 112))  # exactly 3 blocks
    a = request_with("a", tokens)
    assert admit(kv, a) == 0
    b = request_with("b", tokens, arrival=1)
    assert admit(kv, b) == 8  # the last block is recomputed so there are logits to sample
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[2] != kv.get_block_ids("a")[2]
    assert kv.pool.ref_counts[kv.get_block_ids("a")[0]] == 2
    c = request_with("c", tokens + [7], arrival=2)
    assert admit(kv, c) == 12  # one more token: all three full blocks hit


def test_short_prompt_and_salts():
    kv = KVCacheManager(16, BS)
    assert admit(kv, request_with("short", [1, 2, 3])) == 0
    assert admit(kv, request_with("short2", [1, 2, 3], arrival=1)) == 0  # no full block: nothing to share
    tokens = list(range(9))
    assert admit(kv, request_with("s1", tokens, salt="alice")) == 0
    assert admit(kv, request_with("s2", tokens, salt="bob")) == 0
    assert admit(kv, request_with("s3", tokens)) == 0
    assert admit(kv, request_with("s4", tokens, salt="alice")) == 8


def test_lru_eviction_tail_first_and_o1_revival():
    kv = KVCacheManager(6, BS)
    a = request_with("a", list(range(12)))  # 3 blocks
    admit(kv, a)
    blocks_a = list(kv.get_block_ids("a"))
    b = request_with("b", list(range(50, 58)))  # 2 blocks
    admit(kv, b)
    blocks_b = list(kv.get_block_ids("b"))
    kv.free(a)
    kv.free(b)
    # Free queue: the never-used block, then a's blocks tail first, then b's tail first.
    assert kv.pool.free_blocks() == [5] + blocks_a[::-1] + blocks_b[::-1]
    assert all(kv.pool.block_hashes[x] is not None for x in blocks_a + blocks_b)
    # A hit on a's head takes its two first blocks out of the middle of the queue.
    again = request_with("a2", list(range(12)) + [99])
    assert admit(kv, again, num_new=1) == 12
    assert kv.get_block_ids("a2")[:3] == blocks_a
    assert kv.get_block_ids("a2")[3] == 5  # its new block was the oldest free one
    assert kv.pool.free_blocks() == blocks_b[::-1]
    # The next allocation evicts b's tail block (oldest), which loses its hash; b's head stays cached.
    d = request_with("d", [8] * 4)
    admit(kv, d)
    assert kv.get_block_ids("d") == [blocks_b[1]]
    assert kv.pool.cached.get(kv.block_hashes(b)[1]) is None
    b2 = request_with("b2", list(range(50, 58)) + [1])
    assert kv.get_computed_blocks(b2) == [blocks_b[0]]


def test_revival_checks_capacity_without_changing_anything():
    kv = KVCacheManager(3, BS)
    a = request_with("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    other = request_with("o", [5] * 4)
    admit(kv, other)  # takes the one never-used block
    b = request_with("b", list(range(8)) + list(range(20, 25)))  # 2 cached blocks + 2 new needed, 0 free after revival
    computed = kv.get_computed_blocks(b)
    assert len(computed) == 2
    free_before = kv.pool.free_blocks()
    assert kv.allocate_slots(b, b.num_tokens - 8, computed) is None
    assert kv.pool.free_blocks() == free_before and kv.pool.ref_counts[computed[0]] == 0


def test_reset_prefix_cache():
    kv = KVCacheManager(8, BS)
    a = request_with("a", list(range(12)))
    admit(kv, a)
    kv.reset_prefix_cache()
    assert kv.pool.cached == {} and kv.get_block_ids("a")
    assert admit(kv, request_with("b", list(range(12)) + [1])) == 0
    kv.free(a)


def test_block_pool_touch_counts():
    pool = BlockPool(3)
    [b] = pool.allocate(1)
    pool.touch([b])
    assert pool.ref_counts[b] == 2
    pool.free([b])
    pool.free([b])
    assert b in pool.free_blocks()
    pool.touch([b])
    assert b not in pool.free_blocks() and pool.ref_counts[b] == 1


# -- randomised: the fake KV store must always hold the right tokens --------------------


class FakeKV:
    """Which token's K/V each slot holds; a request's context read through its block table must be its tokens.

    `run` is the device executing a dispatched step, in dispatch order. A token still on
    the device (async scheduling) is the one the fake model samples there.
    """

    def __init__(self):
        self.slots = {}

    @staticmethod
    def token(request, pos: int) -> int:
        if pos < request.num_tokens:
            return request.token_ids[pos]
        return fake_token(request.request_id, pos - request.num_prompt_tokens)

    def run(self, scheduler: Scheduler, out):
        bs = scheduler.kv.block_size
        for x in out.scheduled:
            for pos in range(x.start, x.start + x.num_new_tokens):
                self.slots[(x.block_ids[pos // bs], pos % bs)] = self.token(x.request, pos)
        for x in out.scheduled:  # attention reads every earlier position, cached or computed now
            end = x.start + x.num_new_tokens
            context = [self.slots.get((x.block_ids[p // bs], p % bs)) for p in range(end)]
            want = [self.token(x.request, p) for p in range(end)]
            assert context == want, f"{x.request.request_id} would read wrong K/V"
        # What the device samples for each row that samples.
        return [fake_token(x.request.request_id, x.start + x.num_new_tokens - x.request.num_prompt_tokens)
                for x in out.scheduled]


def run_like_the_engine(s: Scheduler, kv_store: FakeKV, added, aborts, async_scheduling: bool):
    """LLMEngine.step's order: schedule, dispatch (the fake device runs), then read this
    step's tokens, or (async) the step before's."""
    in_flight = None
    for step in range(3000):
        if not s.has_unfinished_requests() and in_flight is None:
            break
        if step in aborts and added:
            victim = added[step % len(added)]
            if not victim.is_finished:
                s.finish(victim, "abort")
        out = s.schedule()
        launched = (out, kv_store.run(s, out)) if out.scheduled else None
        if async_scheduling:
            launched, in_flight = in_flight, launched
        if launched:
            s.update_from_output(*launched)
        check_blocks(s)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 14), st.integers(1, 8), st.integers(0, 2)),
                     min_size=1, max_size=14),
    num_blocks=st.integers(6, 30),
    budget=st.integers(8, 40),
    max_num_seqs=st.integers(1, 6),
    aborts=st.lists(st.integers(0, 20), max_size=3),
    policy=st.sampled_from(["fcfs", "priority"]),
    async_scheduling=st.booleans(),
)
def test_random_shared_prefix_workloads(prompts, num_blocks, budget, max_num_seqs, aborts, policy, async_scheduling):
    """No request ever reads K/V that was not written for its tokens: prefix caching,
    preemption (both policies), aborts, chunked prefill, with and without async scheduling."""
    prefixes = [[fake_token("prefix", p * 100 + i) for i in range(12)] for p in range(4)]
    runs = {}
    for caching in (True, False):
        s = Scheduler(SchedulerConfig(max_num_seqs=min(max_num_seqs, budget), max_num_batched_tokens=budget,
                                      max_model_len=64, policy=policy),
                      KVCacheManager(num_blocks, BS, enable_prefix_caching=caching))
        kv_store, added = FakeKV(), []
        for i, (p, suffix, max_tokens, priority) in enumerate(prompts):
            r = request_with(f"r{i}", prefixes[p][: 4 + suffix % 9] + [fake_token(f"sfx{i}", j) for j in range(suffix)],
                             max_tokens, arrival=i)
            r.priority = priority
            try:
                s.add_request(r)
                added.append(r)
            except ValueError:
                continue
        run_like_the_engine(s, kv_store, added, aborts, async_scheduling)
        assert not s.has_unfinished_requests() and s.kv.num_free_blocks == num_blocks
        for r in added:
            check_tokens(r)
            assert r.num_pending == 0
        runs[caching] = {r.request_id: r.output_token_ids for r in added if r.finish_reason != "abort"}
    # Aborts land at a step number, so they may catch different requests with and without caching.
    both = runs[True].keys() & runs[False].keys()
    assert {k: runs[True][k] for k in both} == {k: runs[False][k] for k in both}


# -- engine level: identical outputs and hit accounting ---------------------------------

ENGINE = dict(max_model_len=160, max_num_seqs=16, max_num_batched_tokens=64, token_buckets=[16, 64])


def shared_prefix_prompts():
    rng = np.random.default_rng(7)
    system = [int(t) for t in rng.integers(3, 384, size=80)]  # 5 blocks of 16
    suffixes = [0, 1, 15, 16, 17, 40]
    prompts = [system + [int(t) for t in rng.integers(3, 384, size=n)] for n in suffixes]
    prompts += [system[:32], system[:5], system[:5]]  # ends on a block boundary; shorter than a block
    return prompts


@pytest.mark.parametrize("arch", ARCHS)
def test_outputs_identical_with_and_without_caching(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts()]
    params = [SamplingParams(temperature=0, max_tokens=6)] * 5 + [SamplingParams(temperature=1.0, seed=i, max_tokens=6)
                                                                  for i in range(len(prompts) - 5)]
    cold = LLM(path, **ENGINE, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in cold.generate(prompts, params, use_tqdm=False)]
    assert cold.stats()["prefix_cache_hits"] == 0
    warm = LLM(path, **ENGINE)
    first = warm.generate(prompts, params, use_tqdm=False)
    second = warm.generate(prompts, params, use_tqdm=False)  # now every full prompt block is cached
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in second] == want
    assert sum(o.num_cached_tokens for o in first) > 0
    assert [o.num_cached_tokens for o in second] == [(len(p["prompt_token_ids"]) - 1) // 16 * 16 for p in prompts]
    # n = 2 of a new prompt: the second completion hits the first's blocks (it was the first's 0)
    [pair] = warm.generate({"prompt_token_ids": list(range(400, 440))}, SamplingParams(temperature=0, max_tokens=2, n=2),
                           use_tqdm=False)
    assert pair.num_cached_tokens == 32
    stats = warm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


def test_hit_accounting_and_salts(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("qwen3"), **ENGINE)
    rng = np.random.default_rng(3)
    prefix = [int(t) for t in rng.integers(3, 384, size=80)]  # 5 blocks
    a = {"prompt_token_ids": prefix + [11, 12, 13]}
    b = {"prompt_token_ids": prefix + [21, 22]}
    greedy = SamplingParams(temperature=0, max_tokens=2)
    out_a, out_b = llm.generate([a, b], greedy, use_tqdm=False)  # same step: b reads a's fresh blocks
    assert (out_a.num_cached_tokens, out_b.num_cached_tokens) == (0, 80)
    stats = llm.stats()
    assert stats["prefix_cache_queries"] == 83 + 82 and stats["prefix_cache_hits"] == 80
    assert stats["prefix_cache_hit_rate"] == pytest.approx(80 / 165)
    [again] = llm.generate(a, greedy, use_tqdm=False)  # identical to an earlier request
    assert again.num_cached_tokens == 80 and again.outputs[0].token_ids == out_a.outputs[0].token_ids

    salted = [{**a, "cache_salt": s} for s in ("alice", "bob", "alice")]
    results = [llm.generate(p, greedy, use_tqdm=False)[0] for p in salted]
    assert [r.num_cached_tokens for r in results] == [0, 0, 80]
    assert all(r.outputs[0].token_ids == out_a.outputs[0].token_ids for r in results)

    assert llm.reset_prefix_cache() is True
    assert llm.stats()["prefix_cache_queries"] == 0
    assert llm.generate(a, greedy, use_tqdm=False)[0].num_cached_tokens == 0
    with pytest.raises(TypeError, match="cache_salt must be a str"):
        llm.generate({**a, "cache_salt": 5}, greedy, use_tqdm=False)


def test_preempted_request_hits_its_own_blocks(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), **ENGINE, num_gpu_blocks_override=12)
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 384, size=60)]} for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_preempted_hits"] > 0
    assert stats["prefix_cache_queries"] == 4 * 60  # (vLLM's: the first admissions only)
    cold = LLM(tiny_checkpoint("llama"), **ENGINE, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in cold.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_reset_with_running_requests_is_refused_unless_asked(async_scheduling, tiny_checkpoint):
    """vLLM's reset_prefix_cache(reset_running_requests=False): refused while requests hold
    blocks; with True they are preempted, recomputed, and finish as they would have."""
    llm = LLM(tiny_checkpoint("llama"), **ENGINE, async_scheduling=async_scheduling)
    rng = np.random.default_rng(8)
    prefix = [int(t) for t in rng.integers(3, 384, size=40)]
    prompts = [{"prompt_token_ids": prefix + [int(t) for t in rng.integers(3, 384, size=5)]} for _ in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=2.0),
              SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, frequency_penalty=1.5),
              SamplingParams(temperature=0.8, top_p=0.9, seed=9, max_tokens=12, ignore_eos=True)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    finished = {}

    def steps(n):
        for _ in range(n):
            finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})

    steps(4)
    assert llm.reset_prefix_cache() is False  # (requests hold blocks: nothing forgotten)
    gpu = enum.Enum("Device", "GPU CPU")  # (vLLM 0.11's vllm.utils.Device)
    assert llm.reset_prefix_cache(gpu.GPU) is False  # (vLLM 0.11's first argument: the device)
    for device in (True, gpu.CPU):  # (True: reset_running_requests is keyword-only)
        with pytest.raises(ValueError, match="reset_prefix_cache device=.*KV cache in use"):
            llm.reset_prefix_cache(device)
    assert engine.stats()["prefix_cache_queries"] > 0
    steps(2)
    preemptions, running = engine.stats()["num_preemptions"], len(engine.scheduler.running)
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    stats = engine.stats()
    assert stats["prefix_cache_queries"] == 0 and stats["num_free_blocks"] == stats["num_gpu_blocks"]
    assert running and stats["num_preemptions"] == preemptions + running  # (vLLM's: each is preempted)
    while engine.has_unfinished_requests():
        steps(1)
    assert engine.stats()["prefix_cache_queries"] == 0  # (readmitted after a preemption: no new query)
    assert engine.stats()["prefix_cache_preempted_queries"] > 0
    assert [finished[str(i)] for i in range(3)] == expected
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_gpu_blocks"]
    assert llm.reset_prefix_cache() is True
