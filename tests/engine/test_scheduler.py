"""Scheduler and KV block manager without a model: a fake model samples deterministic tokens."""

import hashlib

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jaxvllm.kv_cache_manager import BlockPool, KVCacheManager
from jaxvllm.request import Request, RequestStatus
from jaxvllm.sampling_params import SamplingParams
from jaxvllm.scheduler import Scheduler, SchedulerConfig, bucket_edge

VOCAB = 1000


def fake_token(request_id: str, index: int) -> int:
    """The token a fake model 'samples' as output `index` of a request: the same after any preemption."""
    return int.from_bytes(hashlib.sha256(f"{request_id}/{index}".encode()).digest()[:4], "little") % VOCAB


def make_request(rid, prompt_len, max_tokens, arrival, priority=0, eos=()):
    prompt = [fake_token(f"prompt-{rid}", i) for i in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(str(rid), prompt, params, priority=priority, max_tokens=max_tokens,
                   eos_token_ids=eos, arrival_index=arrival)


def run_step(scheduler: Scheduler, check=None):
    out = scheduler.schedule()
    if check:
        check(out)
    sampled = [fake_token(s.request.request_id, s.request.num_output_tokens) for s in out.scheduled]
    scheduler.update_from_output(out, sampled)
    return out


def make_scheduler(num_blocks=64, block_size=4, **kwargs):
    config = SchedulerConfig(**{"max_model_len": 256, **kwargs})
    return Scheduler(config, KVCacheManager(num_blocks, block_size))


def check_blocks(scheduler: Scheduler):
    """Every block is free or owned; its ref count is its number of owners; none leaks."""
    kv = scheduler.kv
    owners: dict[int, list[str]] = {}
    for rid, blocks in kv.req_blocks.items():
        assert rid in scheduler.requests, f"finished request {rid} still owns blocks"
        assert len(blocks) == len(set(blocks)), f"{rid} holds a block twice"
        for b in blocks:
            owners.setdefault(b, []).append(rid)
    free = set(kv.pool.free_blocks())
    assert not free & set(owners), "a block is both free and owned"
    assert len(free) + len(owners) == kv.pool.num_blocks, "a block leaked"
    for b in range(kv.pool.num_blocks):
        assert kv.pool.ref_counts[b] == len(owners.get(b, [])), f"block {b} ref count != owners"
    for h, b in kv.pool.cached.items():
        assert kv.pool.block_hashes[b] == h
    for h, copies in kv.pool.copies.items():  # (a copy is registered once, beside the block found)
        assert copies and all(kv.pool.block_hashes[b] == h and kv.pool.cached[h] != b for b in copies)
    assert sum(h is not None for h in kv.pool.block_hashes) == len(kv.pool.cached) + sum(map(len, kv.pool.copies.values()))
    for r in scheduler.running:
        assert len(kv.get_block_ids(r.request_id)) * kv.block_size >= r.num_computed_tokens


def check_tokens(request: Request):
    """Outputs are exactly the fake model's sequence: nothing lost or duplicated."""
    assert request.output_token_ids == [fake_token(request.request_id, i) for i in range(request.num_output_tokens)]


def test_chunked_prefill_cuts_long_prompts():
    s = make_scheduler(max_num_batched_tokens=32, max_num_seqs=4)
    s.add_request(make_request("a", 100, 3, 0))
    chunks = [run_step(s).scheduled[0].num_new_tokens for _ in range(4)]
    assert chunks == [32, 32, 32, 4]
    r = s.requests["a"]
    assert r.num_output_tokens == 1 and r.num_computed_tokens == 100
    assert [run_step(s).scheduled[0].num_new_tokens for _ in range(2)] == [1, 1]
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 64


def test_bucket_edge_cuts_only_a_small_spill():
    buckets = (16, 32, 64, 128, 256)
    assert bucket_edge(buckets, 0, 140) == 128  # 12 past 128, 116 of padding in 256: cut
    assert bucket_edge(buckets, 100, 40) == 28
    assert bucket_edge(buckets, 0, 170) == 170  # 42 past 128: the rest would be a step of its own
    assert bucket_edge(buckets, 0, 70) == 64  # 6 past 64, 58 of padding
    assert bucket_edge(buckets, 0, 20) == 20  # 4 past 16, but 12 of padding: less than one more step
    assert bucket_edge(buckets, 0, 128) == 128  # an exact fit
    assert bucket_edge(buckets, 130, 10) == 10  # already past 128: nothing to cut back to
    assert bucket_edge(buckets, 0, 10) == 10  # fits the smallest bucket


def test_last_admitted_chunk_stops_at_a_bucket_edge():
    """With buckets (a CPU's), the last request to join a step stops at a bucket's edge
    instead of spilling a little past it, and its rest runs next step; an earlier request
    is never cut (those after it fill the bucket)."""
    s = make_scheduler(max_num_batched_tokens=256, max_num_seqs=4, fill_buckets=(16, 32, 64, 128, 256))
    requests = [make_request("a", 100, 2, 0), make_request("b", 40, 2, 1)]
    for r in requests:
        s.add_request(r)
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [("a", 100, True),
                                                                                          ("b", 28, False)]
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 12)]
    while s.has_unfinished_requests():
        run_step(s)
    for r in requests:
        assert r.num_output_tokens == 2
        check_tokens(r)
    assert s.kv.num_free_blocks == 64
    # Without buckets (a GPU's), the chunk takes all it can.
    s = make_scheduler(max_num_batched_tokens=256, max_num_seqs=4)
    s.add_request(make_request("a", 100, 2, 0))
    s.add_request(make_request("b", 40, 2, 1))
    assert [x.num_new_tokens for x in run_step(s).scheduled] == [100, 40]


def test_running_first_then_waiting_within_budget():
    s = make_scheduler(max_num_batched_tokens=20, max_num_seqs=8)
    s.add_request(make_request("a", 10, 5, 0))
    run_step(s)
    s.add_request(make_request("b", 30, 5, 1))
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 19)]


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(i, 5, 5, i))
    out = run_step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 2


def test_fcfs_preempts_last_arrived_and_resumes_it_first():
    # 6 blocks of 4 tokens; three requests of 7 prompt tokens (2 blocks each) fill the pool.
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=64, max_num_seqs=8)
    for i in range(3):
        s.add_request(make_request(i, 7, 6, i))
    run_step(s)  # prefill 7 tokens each (2 blocks), sample an 8th
    run_step(s)  # compute the 8th: the 2 blocks are full
    out = run_step(s)  # a 9th token each needs 3 more blocks; none are free
    assert [r.request_id for r in out.preempted] == ["2"]
    assert s.waiting.peek().request_id == "2" and s.requests["2"].num_computed_tokens == 0
    while s.has_unfinished_requests():
        run_step(s)
        check_blocks(s)
    assert s.num_preemptions >= 1


def test_priority_preempts_lowest_priority():
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=64, max_num_seqs=8, policy="priority")
    s.add_request(make_request("low", 7, 6, 0, priority=5))
    s.add_request(make_request("high", 7, 6, 1, priority=0))
    s.add_request(make_request("mid", 7, 6, 2, priority=1))
    run_step(s)
    run_step(s)
    out = run_step(s)
    assert [r.request_id for r in out.preempted] == ["low"]
    assert [x.request.request_id for x in out.scheduled] == ["high", "mid"]


def test_priority_orders_admission():
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=1, policy="priority")
    s.add_request(make_request("b", 4, 1, 0, priority=2))
    s.add_request(make_request("a", 4, 1, 1, priority=1))
    s.add_request(make_request("c", 4, 1, 2, priority=2))
    order = [run_step(s).scheduled[0].request.request_id for _ in range(3)]
    assert order == ["a", "b", "c"]


def test_priority_ties_by_arrival_time():
    """As vLLM's priority queue: an `arrival_time` given (here set as the engine sets it) orders
    requests of equal priority, before the order they were added in."""
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=1, policy="priority")
    late, early = make_request("late", 4, 1, 0), make_request("early", 4, 1, 1)
    late.metrics.arrival_time, early.metrics.arrival_time = 100.0, 0.0
    s.add_request(late)
    s.add_request(early)
    assert [run_step(s).scheduled[0].request.request_id for _ in range(2)] == ["early", "late"]


def test_without_chunked_prefill_a_prompt_too_long_for_this_step_lets_others_by():
    """As vLLM's: a prompt that needs more of the budget than this step has left waits at the
    head of the queue while shorter ones behind it join (they once waited behind it)."""
    s = make_scheduler(max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False)
    for rid in "ab":
        s.add_request(make_request(rid, 4, 8, len(s.requests)))
    run_step(s)
    s.add_request(make_request("long", 31, 1, 2))  # 31 > 32 - 2 decoding
    s.add_request(make_request("c", 4, 8, 3))
    assert [x.request.request_id for x in run_step(s, lambda out: check_blocks(s)).scheduled] == ["a", "b", "c"]
    assert s.waiting.peek().request_id == "long"
    while s.has_unfinished_requests():
        run_step(s, lambda out: check_blocks(s))
    assert s.kv.num_free_blocks == 64


def test_without_chunked_prefill_a_preempted_request_is_recomputed_whole():
    """As vLLM's: a preempted request's recompute (prompt + outputs) is no chunk either; it
    waits for a step with room for all of it (max_num_batched_tokens >= max_model_len)."""
    s = make_scheduler(num_blocks=12, block_size=4, max_model_len=16, max_num_batched_tokens=16, max_num_seqs=6,
                       enable_chunked_prefill=False)
    for i, n in enumerate([1, 5, 8, 7, 5, 8]):
        s.add_request(make_request(f"r{i}", n, 16 - n, i))

    def whole(out):
        for x in out.scheduled:
            assert x.start + x.num_new_tokens == x.request.num_tokens, (x.request.request_id, x.start, x.num_new_tokens)

    preempted = 0
    while s.has_unfinished_requests():
        preempted += len(run_step(s, whole).preempted)
        check_blocks(s)
    assert preempted and s.kv.num_free_blocks == 12


def test_a_request_that_fills_the_cache_exactly_runs():
    """Its last token is sampled, never written: 60 prompt tokens + 5 outputs need 64 slots,
    the 4 blocks of 16 the cache has (it was refused as needing 5)."""
    s = make_scheduler(num_blocks=4, block_size=16, max_model_len=128, max_num_batched_tokens=64)
    s.add_request(make_request("a", 60, 5, 0))
    while s.has_unfinished_requests():
        run_step(s, lambda out: check_blocks(s))
    assert s.kv.num_free_blocks == 4


def test_long_prefill_token_threshold_caps_each_chunk():
    """vLLM's `long_prefill_token_threshold`: a long prompt takes chunks of at most that many
    tokens, so the request decoding beside it gets a token every step."""
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    s.add_request(make_request("a", 4, 20, 0))
    run_step(s)
    s.add_request(make_request("long", 40, 1, 1))
    for _ in range(5):
        out = run_step(s, lambda out: check_blocks(s))
        assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("long", 8)]
    s.vectorized = False  # (the one-at-a-time loop caps alike)
    s.add_request(make_request("long2", 20, 1, 2))
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("long2", 8)]
    assert [(x.request.request_id, x.num_new_tokens) for x in run_step(s).scheduled] == [("a", 1), ("long2", 8)]
    # Without chunked prefill too (vLLM's): the cap cuts the prompt, which then runs in chunks.
    s = make_scheduler(max_model_len=64, max_num_batched_tokens=64, enable_chunked_prefill=False,
                       long_prefill_token_threshold=8)
    s.add_request(make_request("long", 40, 2, 0))
    assert [run_step(s, lambda out: check_blocks(s)).num_tokens for _ in range(6)] == [8, 8, 8, 8, 8, 1]


def test_requests_that_can_never_fit_are_refused():
    s = make_scheduler(num_blocks=8, block_size=4, max_model_len=64, max_num_batched_tokens=16,
                       enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        s.add_request(make_request("a", 60, 5, 0))
    with pytest.raises(ValueError, match="needs 10 KV blocks but the cache has only 8"):
        s.add_request(make_request("b", 30, 10, 1))
    with pytest.raises(ValueError, match="chunked prefill is disabled"):
        s.add_request(make_request("c", 20, 1, 2))
    assert not s.has_unfinished_requests()


def test_stop_tokens_and_abort_free_blocks():
    s = make_scheduler()
    eos = fake_token("a", 2)
    s.add_request(make_request("a", 5, 50, 0, eos=(eos,)))
    s.add_request(make_request("b", 5, 50, 1))
    while "a" in s.requests:
        run_step(s)
    assert s.kv.get_block_ids("a") == []
    b = s.requests["b"]
    s.finish(b, "abort")
    assert b.finish_reason == "abort" and b.status == RequestStatus.FINISHED
    assert s.kv.num_free_blocks == 64 and not s.has_unfinished_requests()


def test_stop_ids_checked_are_the_unfinished_requests():
    """The vectorized update compares each sampled token with the unfinished requests' stop
    ids: a finished request's go (they piled up over a long job, up to the vocabulary)."""
    s = make_scheduler()
    s.add_request(make_request("a", 5, 50, 0, eos=(7, 9)))
    s.add_request(make_request("b", 5, 50, 1, eos=(9, 11)))
    assert s._stop_token_ids.tolist() == [7, 9, 11]
    s.finish(s.requests["a"], "abort")
    assert s._stop_token_ids.tolist() == [9, 11]
    s.recompute_all(list(s.requests.values()))
    assert s._stop_token_ids.tolist() == [9, 11]
    s.finish(s.requests["b"], "abort")
    assert s._stop_token_ids.tolist() == []


def test_block_pool_free_order_and_double_free():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free_blocks == 1
    pool.free(a[::-1])
    assert pool.allocate(4) == [3, 2, 1, 0]  # oldest free first: 3, then a's tail before its head
    with pytest.raises(RuntimeError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)
    pool.free([0])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([0])


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 20), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(4, 40),
    budget=st.integers(8, 64),
    max_num_seqs=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "priority"]),
    chunked=st.booleans(),
    fill=st.booleans(),
)
# Found by hypothesis: without chunked prefill, a preempted request's recompute (prompt +
# outputs = 13 tokens) exceeded the 12-token budget and waited forever.
@example(ops=[("add", 1, 3, 0), ("add", 11, 3, 0)], num_blocks=4, budget=12, max_num_seqs=2, policy="fcfs",
         chunked=False, fill=False)
def test_random_add_step_abort(ops, num_blocks, budget, max_num_seqs, policy, chunked, fill):
    max_num_seqs = min(max_num_seqs, budget)
    buckets = tuple(b for b in (1, 4, 16, 32) if b < budget) + (budget,) if fill else None  # (a CPU's)
    s = make_scheduler(num_blocks=num_blocks, block_size=4, max_model_len=64, max_num_batched_tokens=budget,
                       max_num_seqs=max_num_seqs, policy=policy, enable_chunked_prefill=chunked,
                       fill_buckets=buckets)
    added, ended = [], {}

    def check(out):
        assert out.num_tokens <= budget
        assert len(out.scheduled) <= max_num_seqs
        ids = [x.request.request_id for x in out.scheduled]
        assert len(ids) == len(set(ids))
        for x in out.scheduled:
            assert x.num_new_tokens >= 1
            assert x.start + x.num_new_tokens <= x.request.num_tokens
            assert len(x.block_ids) * 4 >= x.start + x.num_new_tokens

    def step():
        out = run_step(s, check)
        for r in list(added):
            if r.is_finished and r.request_id not in ended:
                ended[r.request_id] = r.finish_reason
        check_blocks(s)
        for r in added:
            check_tokens(r)

    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, priority = op
            r = make_request(f"r{len(added)}", prompt_len, max_tokens, len(added), priority)
            too_big = (prompt_len + max_tokens > 64 or -(-(prompt_len + max_tokens - 1) // 4) > num_blocks
                       or (not chunked and prompt_len > budget))
            if too_big:
                with pytest.raises(ValueError):
                    s.add_request(r)
                continue
            s.add_request(r)
            added.append(r)
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        elif added:
            r = added[op[1] % len(added)]
            if not r.is_finished:
                s.finish(r, "abort")
                ended[r.request_id] = "abort"
            check_blocks(s)

    for _ in range(2000):  # everything left must finish: no deadlock
        if not s.has_unfinished_requests():
            break
        step()
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == num_blocks
    for r in added:
        assert r.is_finished
        if ended.get(r.request_id) != "abort":
            assert r.num_output_tokens == r.max_tokens and r.finish_reason == "length"
        check_tokens(r)


def snapshot(s: Scheduler, out=None):
    """Everything a step decided and everything the scheduler holds, comparable across schedulers."""
    kv = s.kv
    state = (
        [(r.request_id, r.num_computed_tokens, r.num_pending, r.status, r.finish_reason, tuple(r.token_ids))
         for r in s.requests.values()],
        [r.request_id for r in s.running], [r.request_id for r in s.waiting],
        {rid: list(b) for rid, b in kv.req_blocks.items()}, kv.pool.free_blocks(), dict(kv.pool.cached),
        dict(kv._num_registered), s.num_preemptions,
    )
    if out is None:
        return state
    steps = ([(x.request.request_id, x.start, x.num_new_tokens, x.samples, list(x.block_ids)) for x in out.scheduled],
             [r.request_id for r in out.preempted], out.scheduled.host_ends.tolist(),
             out.scheduled.num_blocks.tolist())
    return state, steps


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.one_of(
        st.tuples(st.just("add"), st.integers(1, 24), st.integers(1, 16), st.integers(0, 3), st.booleans()),
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ), min_size=1, max_size=30),
    num_blocks=st.integers(8, 30),
    budget=st.integers(4, 64),
    max_num_seqs=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "priority"]),
    chunked=st.booleans(),
    async_scheduling=st.booleans(),
    prefix_caching=st.booleans(),
)
@example(ops=[("add", 5, 16, 0, False)] * 6 + [("step", 3), ("abort", 2), ("add", 9, 9, 1, True), ("step", 6)],
         num_blocks=20, budget=8, max_num_seqs=6, policy="fcfs", chunked=True, async_scheduling=True,
         prefix_caching=True)
# Without chunked prefill, a preempted request whose prompt and outputs exceed the budget
# waited forever (a state the engine's budget >= max_model_len rules out: the test skips it).
@example(ops=[("add", 1, 1, 0, False)] * 3 + [("add", 10, 8, 0, False), ("add", 7, 7, 0, False)], num_blocks=8,
         budget=10, max_num_seqs=3, policy="fcfs", chunked=False, async_scheduling=False, prefix_caching=False)
# Running requests that use up the budget exactly, ahead of others.
@example(ops=[("add", 7, 4, 0, False), ("add", 3, 4, 0, False), ("add", 9, 4, 0, False), ("step", 6)],
         num_blocks=30, budget=4, max_num_seqs=3, policy="fcfs", chunked=True, async_scheduling=False,
         prefix_caching=False)
def test_vectorized_steps_equal_one_by_one(ops, num_blocks, budget, max_num_seqs, policy, chunked, async_scheduling,
                                           prefix_caching):
    """The numpy path (running counters as rows, decode steps scheduled and updated at once)
    decides every step exactly as the one-request-at-a-time loop: same chunks, preemptions,
    blocks, prefix-cache entries, tokens and finishes, over random mixes of prefills, decodes,
    stops, aborts and preemptions, with async scheduling's tokens in flight."""
    max_num_seqs = min(max_num_seqs, budget)
    pair = []
    for vectorized in (True, False):
        config = SchedulerConfig(max_model_len=64, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                 policy=policy, enable_chunked_prefill=chunked)
        s = Scheduler(config, KVCacheManager(num_blocks, 4, enable_prefix_caching=prefix_caching))
        s.vectorized = vectorized
        pair.append({"s": s, "in_flight": None, "added": []})

    def step(run):
        s = run["s"]
        out = s.schedule()
        sampled = [fake_token(x.request.request_id, x.start + x.num_new_tokens - x.request.num_prompt_tokens)
                   for x in out.scheduled]
        launched = (out, sampled) if len(out.scheduled) else None
        if async_scheduling:
            launched, run["in_flight"] = run["in_flight"], launched
        updated = [r.request_id for r in s.update_from_output(*launched)] if launched else []
        return snapshot(s, out), updated

    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, priority, shared = op
            # (without chunked prefill the engine keeps the budget >= max_model_len, so that a
            # preempted request's recompute, its prompt and outputs, fits one step)
            if prompt_len + max_tokens > 64 or -(-(prompt_len + max_tokens) // 4) > num_blocks or (
                    not chunked and prompt_len + max_tokens > budget):
                continue
            for run in pair:
                rid = f"r{len(run['added'])}"
                r = make_request(rid, prompt_len, max_tokens, len(run["added"]), priority,
                                 eos=(fake_token(rid, 3),) if priority == 3 else ())  # (stops at its 4th token)
                if shared:  # a common prefix: prefix-cache hits
                    r.prompt_token_ids, r.token_ids = [7] * prompt_len, [7] * prompt_len
                    r.max_num_tokens = prompt_len + max_tokens
                run["s"].add_request(r)
                run["added"].append(r)
        elif op[0] == "step":
            for _ in range(op[1]):
                assert step(pair[0]) == step(pair[1])
        elif pair[0]["added"]:
            for run in pair:
                r = run["added"][op[1] % len(run["added"])]
                if not r.is_finished:
                    run["s"].finish(r, "abort")
        assert snapshot(pair[0]["s"]) == snapshot(pair[1]["s"])
    for _ in range(300):
        if not pair[0]["s"].has_unfinished_requests() and pair[0]["in_flight"] is None:
            break
        assert step(pair[0]) == step(pair[1])
    assert not pair[1]["s"].has_unfinished_requests()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_finishing_many_queued_requests_reorders_the_queue_once(policy, monkeypatch):
    """Aborting k of W queued requests (a Ctrl-C in a large generate, a shutdown) makes one
    pass over the queue, not one per request (k W: 40 s for 16k); the rest keep their order."""
    import heapq

    scheduler = make_scheduler(policy=policy)
    requests = [make_request(i, 4, 2, arrival=i, priority=i % 3) for i in range(200)]
    for r in requests:
        scheduler.add_request(r)
    heapifies = []
    real = heapq.heapify
    monkeypatch.setattr(heapq, "heapify", lambda heap: (heapifies.append(len(heap)), real(heap))[1])
    for r in requests[::2]:
        scheduler.finish(r, "abort")
    assert len(scheduler.waiting) == 100 and len(heapifies) == 1
    key = (lambda r: (r.priority, r.arrival_index)) if policy == "priority" else (lambda r: r.arrival_index)
    assert list(scheduler.waiting) == sorted(requests[1::2], key=key)
    assert [scheduler.waiting.pop() for _ in range(100)] == sorted(requests[1::2], key=key)
