"""Continuous-batching scheduler with vLLM V1 semantics.

No prefill or decode phases: every step gives each request some of the tokens it is
missing from the KV cache (`num_tokens - num_computed_tokens`) under a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`); running requests first,
then waiting ones; long prompts are cut into chunks. When blocks run out, a running
request is preempted: blocks freed, `num_computed_tokens` reset, back to the waiting
queue, recomputed later (its tokens so far are kept, so its output continues).
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from jaxvllm.config import POLICIES
from jaxvllm.kv_cache_manager import KVCacheManager
from jaxvllm.request import Request, RequestStatus, ScheduledBatch, ScheduledRequest


@dataclass
class SchedulerOutput:
    scheduled: ScheduledBatch = field(default_factory=lambda: ScheduledBatch.of([]))
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.scheduled.num_tokens


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # vLLM's: a request's chunk at most this many tokens (without chunked prefill too, as
    # vLLM's: a prompt then takes several steps); 0: no cap.
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    # The token buckets steps are padded to, where a padding token costs as much as a real
    # one (a CPU): an admitted prompt's chunk then stops at a bucket's edge rather than
    # spill a little past it (`bucket_edge`). None: chunks take all the budget, as vLLM's.
    fill_buckets: tuple[int, ...] | None = None
    # LoRA: at most this many distinct adapters among the running requests (the device's
    # slots); 0: no LoRA.
    max_loras: int = 0
    # Slots allocated past a chunk that samples, for the draft model to write its drafts'
    # K/V on the device before the host knows the step's tokens (vLLM's lookahead slots);
    # 0: none. Such a request then counts 1 + its drafts as pending: the most it can get.
    lookahead: int = 0


def bucket_edge(buckets: tuple[int, ...], used: int, num_new: int, step_tokens: int = 32) -> int:
    """A chunk of `num_new` tokens joining a step of `used` tokens, cut to end at the edge
    of the bucket below when it would spill at most `step_tokens` past that edge and the
    padding of the next bucket exceeds the spill plus `step_tokens` (about what one more
    step costs a CPU: reading every weight once, as much as computing a few dozen tokens).
    1042 tokens in buckets of 1024 and 2048 run as 1024 now and 18 later, not as 2048.
    A larger spill is not cut: it would run next step in a small bucket, whose attention
    takes its queries one by one against the whole context so far (300 tokens as 256 + 44
    took 1.05 s, as 512 0.88 s)."""
    total = used + num_new
    i = bisect.bisect_left(buckets, total)
    if i == 0 or i == len(buckets) or buckets[i - 1] <= used:  # (fits the smallest, or cannot be cut)
        return num_new
    low, high = buckets[i - 1], buckets[i]
    spill = total - low
    return low - used if spill <= step_tokens and high - total > spill + step_tokens else num_new


def priority_key(request: Request) -> tuple[int, float, int]:
    """Order under the priority policy, as vLLM's: priority (lower first), then arrival time
    (`add_request`'s `arrival_time` when given), then arrival order."""
    return request.priority, request.metrics.arrival_time, request.arrival_index


class WaitingQueue:
    """Requests waiting for (re)admission, in a heap on (priority, arrival).

    Under "fcfs" every priority counts as 0, so order is arrival: a preempted request
    (which arrived before every request that has never run) is back at the front.
    Under "priority" a lower value runs first, ties by arrival (`priority_key`), as in vLLM.
    Removals are gathered and made in one pass when the queue is next read: aborting k of W
    queued requests costs O(W), not O(k W).
    """

    def __init__(self, policy: str) -> None:
        self._heap: list[tuple] = []
        self._removed: set[int] = set()  # ids of requests removed, still in the heap
        self.set_policy(policy)

    def set_policy(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._heap = [self._entry(e[-1]) for e in self._entries()]
        heapq.heapify(self._heap)

    def _entry(self, request: Request) -> tuple:
        return (*(priority_key(request) if self.policy == "priority" else (request.arrival_index,)), request)

    def _entries(self) -> list[tuple]:
        """The heap, without the requests removed since it was last read."""
        if self._removed:
            self._heap = [e for e in self._heap if id(e[-1]) not in self._removed]
            heapq.heapify(self._heap)
            self._removed.clear()
        return self._heap

    def __len__(self) -> int:
        return len(self._entries())

    def __iter__(self):
        return (e[-1] for e in sorted(self._entries(), key=lambda e: e[:-1]))

    def add(self, request: Request) -> None:
        heapq.heappush(self._entries(), self._entry(request))

    def peek(self) -> Request:
        return self._entries()[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._entries())[-1]

    def remove(self, request: Request) -> None:
        self._removed.add(id(request))  # (the heap holds the request: its id stays its own until then)

    def clear(self) -> None:
        self._heap, self._removed = [], set()


class RunningRows:
    """The running requests' counters as numpy rows, in running order: what the vectorized
    schedule reads instead of each `Request`. Made from the requests, then kept up to date
    by the scheduler from step to step while the running set stays the same (copies: the
    requests keep their own counters too)."""

    __slots__ = ("requests", "blocks", "pending", "num_tokens", "last_tokens", "computed", "limits", "num_blocks",
                 "num_full", "special")

    def __init__(self, requests: list[Request], req_blocks: dict[str, list[int]]) -> None:
        self.requests = list(requests)
        self.blocks = [req_blocks[r.request_id] for r in requests]
        self.pending = np.array([r.num_pending for r in requests], np.int64)
        self.num_tokens = np.array([len(r.token_ids) for r in requests], np.int64)  # on the host
        self.last_tokens = np.array([r.token_ids[-1] if r.token_ids else -1 for r in requests], np.int64)
        self.computed = np.array([r.num_computed_tokens for r in requests], np.int64)
        self.limits = np.array([r.max_num_tokens for r in requests], np.int64)
        self.num_blocks = np.array([len(b) for b in self.blocks], np.int64)
        self.num_full: np.ndarray | None = None  # full host blocks when last registered (None: unknown)
        # Requests whose next token takes the general way: structured outputs, or a first token.
        self.special = np.array([r.grammar is not None or r.metrics.first_token_time is None for r in requests],
                                bool)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Running requests are scheduled and updated with numpy and a tight loop; False: one
        # request at a time always (the tests check that both give the same steps).
        self.vectorized = True
        self._rows: RunningRows | None = None  # the running requests' counters, while they are exact
        # The unfinished requests' stop ids, each with how many requests have it: the vectorized
        # update checks sampled tokens against them (`_stop_token_ids`, sorted).
        self._stop_counts: Counter[int] = Counter()
        self._stop_token_ids = np.zeros(0, np.int64)

    # -- requests in and out ---------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse, before it is queued, a request that could never be scheduled."""
        c = self.config
        total = num_prompt_tokens + max_tokens
        if total > c.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds max_model_len ({c.max_model_len})"
            )
        need = self.kv.blocks_needed(total - 1)  # (the last token is sampled, never written)
        if need > self.kv.pool.num_blocks:
            raise ValueError(
                f"request needs {need} KV blocks but the cache has only {self.kv.pool.num_blocks}; "
                f"raise num_gpu_blocks_override / gpu_memory_utilization or lower max_tokens"
            )
        if not c.enable_chunked_prefill and num_prompt_tokens > c.max_num_batched_tokens:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) exceeds max_num_batched_tokens "
                f"({c.max_num_batched_tokens}) and chunked prefill is disabled"
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, request.max_tokens)
        request.metrics.queued_time = time.time()
        self.requests[request.request_id] = request
        self.waiting.add(request)
        self._count_stop_ids(request, 1)

    def _count_stop_ids(self, request: Request, delta: int) -> None:
        """Add (1) or take away (-1) a request's stop ids; the array changes only when an id
        comes or goes (kept to the unfinished requests' ids, or a long job's would pile up
        to the vocabulary, each compared with every sampled token)."""
        counts, before = self._stop_counts, len(self._stop_counts)
        for token in request.stop_ids:
            counts[token] += delta
            if not counts[token]:
                del counts[token]
        if len(counts) != before:  # (one sign of delta only adds ids, the other only removes them)
            self._stop_token_ids = np.array(sorted(counts), np.int64)

    def finish(self, request: Request, reason: str) -> None:
        """End a request (stopped, at its length, or aborted) and release its blocks. It is
        finished first: a failure part-way leaves a finished request that `recompute_all`
        drops, not one that runs on."""
        status, request.status = request.status, RequestStatus.FINISHED
        request.finish_reason = reason
        request.metrics.finished_time = time.time()
        if status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        del self.requests[request.request_id]
        self._count_stop_ids(request, -1)
        self.kv.free(request)

    def set_policy(self, policy: str) -> None:
        self.config.policy = policy
        self.waiting.set_policy(policy)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget, preempted = self.config.max_num_batched_tokens, []
        running = self._schedule_running_columns(budget) if self.vectorized else None
        if running is None:  # (or blocks run short: preemption, one request at a time)
            running = self._schedule_running(budget, preempted)
        batch, budget = running
        if not preempted:
            batch = batch.extend(self._admit(budget))
        return SchedulerOutput(batch, preempted)

    def _schedule_running_columns(self, budget: int) -> tuple[ScheduledBatch, int] | None:
        """The running requests' chunks, computed with numpy over all of them at once: the
        one-by-one loop's result whenever it preempts nothing. None when the blocks the
        chunks need exceed the free ones (that loop then picks the victims)."""
        kv, bs = self.kv, self.kv.block_size
        rows = self._rows if self._rows is not None and self._rows.requests == self.running else None
        self._rows = None  # (set again below, once the step is decided)
        if rows is None:
            rows = RunningRows(self.running, kv.req_blocks)
        pending, num_tokens = rows.pending, rows.num_tokens + rows.pending  # (with the tokens on the device)
        # A request whose last token is on the device has nothing more to compute.
        done = (pending > 0) & (num_tokens >= rows.limits)
        want = np.where(done, 0, num_tokens - rows.computed)
        if self.config.long_prefill_token_threshold:
            want = np.minimum(want, self.config.long_prefill_token_threshold)
        if not (done | (want > 0)).all():  # (never: a running request always has a token to compute)
            return None
        if want.sum() <= budget:  # (every decoding step)
            chosen, num_new = want > 0, want
        else:
            budget_before = budget - (np.cumsum(want) - want)  # what is left when its turn comes
            chosen = (want > 0) & (budget_before > 0)
            num_new = np.minimum(want, budget_before)
        starts, ends = rows.computed, rows.computed + num_new
        grows = np.flatnonzero(chosen & (ends > rows.num_blocks * bs))
        new_blocks = -(-ends[grows] // bs) - rows.num_blocks[grows]
        # In running order, as the loop allocates them: the same block ids.
        if not kv.grow([rows.requests[i] for i in grows.tolist()], new_blocks.tolist()):
            return None
        rows.num_blocks[grows] += new_blocks
        samples = ends == num_tokens
        host_ends = np.minimum(ends, rows.num_tokens)
        # One-token chunks' inputs: the request's last token (decoding), or another one.
        one = (host_ends - starts == 1) & chosen
        start_tokens = np.where(one, rows.last_tokens, -1)
        for i in np.flatnonzero(one & (host_ends < rows.num_tokens)).tolist():
            start_tokens[i] = rows.requests[i].token_ids[starts[i]]
        if chosen.all():  # (every decoding step)
            picked = slice(None)
            requests, blocks, num_blocks = list(rows.requests), rows.blocks, rows.num_blocks.copy()
            for request, end, sample in zip(requests, ends.tolist(), samples.tolist()):
                request.num_computed_tokens = end
                request.num_pending += sample
            # Blocks a request filled since the last step are in the cache map already but for
            # those past their last full block then (`cache_blocks` checks each of them).
            candidates = None if rows.num_full is None else np.flatnonzero(host_ends // bs > rows.num_full)
            rows.computed, rows.pending, rows.num_full = ends, pending + samples, host_ends // bs
            self._rows = rows
        else:
            picked = np.flatnonzero(chosen)
            requests = [rows.requests[i] for i in picked.tolist()]
            blocks, num_blocks = [rows.blocks[i] for i in picked.tolist()], rows.num_blocks[picked]
            for request, end, sample in zip(requests, ends[picked].tolist(), samples[picked].tolist()):
                request.num_computed_tokens = end
                request.num_pending += sample
            candidates = None
        batch = ScheduledBatch(requests, starts[picked], num_new[picked], samples[picked], blocks, host_ends[picked],
                               num_blocks, start_tokens[picked])
        self.kv.cache_blocks(batch, candidates)
        return batch, budget - int(num_new.sum())

    def _schedule_running(self, budget: int, preempted: list[Request]) -> tuple[ScheduledBatch, int]:
        """The running requests' chunks, one request at a time, preempting when blocks run short."""
        scheduled: dict[str, ScheduledRequest] = {}
        running, req_blocks, bs = RequestStatus.RUNNING, self.kv.req_blocks, self.kv.block_size
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not running:  # preempted as a victim this step
                continue
            num_tokens = len(request.token_ids) + request.num_pending
            if request.num_pending and num_tokens >= request.max_num_tokens:
                continue  # its last token is on the device: nothing more to compute
            start = request.num_computed_tokens
            # Draft tokens (speculative decoding) are computed after the request's own, as far
            # as the budget goes; the chunk samples once it reaches the last of its own.
            num_new = min(num_tokens + len(request.spec_token_ids) - start, budget, self._chunk_cap)
            lookahead = self._lookahead(start + num_new >= num_tokens, start + num_new)
            if lookahead and start + num_new + lookahead > len(req_blocks[request.request_id]) * bs:
                self.kv.allocate_slots(request, num_new + lookahead)  # (if blocks are free: it preempts nobody)
            if start + num_new > len(req_blocks[request.request_id]) * bs:  # (most decode steps fit)
                freed, allocated = self._allocate_or_preempt(request, num_new, scheduled, preempted)
                budget += freed
                if not allocated:  # it was preempted itself
                    continue
            samples = start + num_new >= num_tokens
            drafts = max(0, start + num_new - num_tokens)
            scheduled[request.request_id] = chunk = ScheduledRequest(
                request, start, num_new, req_blocks[request.request_id], samples, drafts
            )
            request.num_computed_tokens = start + num_new
            request.num_pending += chunk.num_in_flight
            budget -= num_new
        batch = ScheduledBatch.of(list(scheduled.values()))
        # Victims are out; the requests still scheduled will run this step, so their blocks
        # can be found from now on (a victim's, never written, are never registered).
        self.kv.cache_blocks(batch)
        return batch, budget

    def _admit(self, budget: int) -> list[ScheduledRequest]:
        """Waiting requests that join this step, in queue order, while budget, sequences and blocks last."""
        c, kv = self.config, self.kv
        admitted = []
        compiling = []  # structured-output requests whose grammar is not compiled yet
        # LoRA, as vLLM: the running requests hold at most max_loras adapters; a request whose
        # adapter would be one more waits. Once one waits, so do the adapter requests behind
        # it (base requests go on): the running adapters drain, and it is next, never starved.
        adapters = {r.lora_id for r in self.running if r.lora_id}
        for_slot, too_long = [], []
        while len(self.waiting) and len(self.running) < c.max_num_seqs and budget > 0:
            request = self.waiting.peek()
            if request.grammar is not None and not request.grammar.ready:
                compiling.append(self.waiting.pop())  # the others go first meanwhile
                continue
            if request.lora_id and (for_slot or (request.lora_id not in adapters and len(adapters) >= c.max_loras)):
                for_slot.append(self.waiting.pop())
                continue
            if request.num_pending:  # preempted with a token in flight: it joins once that is here
                break
            # Fresh and preempted requests start from whatever prefix is cached.
            computed = kv.get_computed_blocks(request)
            num_cached = len(computed) * kv.block_size
            num_new = min(request.num_tokens - num_cached, self._chunk_cap)
            # Without chunked prefill a prompt, or a preempted request's recompute, waits for a
            # step with room for all of it, and those behind it go first meanwhile (vLLM's;
            # max_num_batched_tokens is then at least max_model_len, so a step has room).
            if not c.enable_chunked_prefill and num_new > budget:
                too_long.append(self.waiting.pop())
                continue
            num_new = min(num_new, budget)
            # The last request to join (no other waits, or no row is left) ends the step: on
            # a CPU its chunk may stop at a bucket's edge rather than spill a little past it.
            last = len(self.waiting) == 1 or len(self.running) + 1 >= c.max_num_seqs
            if last and c.enable_chunked_prefill and c.fill_buckets is not None:
                num_new = bucket_edge(c.fill_buckets, c.max_num_batched_tokens - budget, num_new)
            lookahead = self._lookahead(num_cached + num_new == request.num_tokens, num_cached + num_new)
            with_lookahead = lookahead > 0 and kv.allocate_slots(request, num_new + lookahead, computed) is not None
            if not with_lookahead and kv.allocate_slots(request, num_new, computed) is None:
                break
            # Nothing is preempted once admissions start, so this step will write these
            # blocks: a request admitted next with the same prefix shares them in the
            # same forward pass (each layer writes its K/V before attention reads it).
            scheduled_request = ScheduledRequest(
                request, num_cached, num_new, kv.req_blocks[request.request_id],
                num_cached + num_new == request.num_tokens,  # nothing pending: it was not running
            )
            kv.cache_blocks((scheduled_request,))
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached + num_new
            request.num_pending += scheduled_request.num_in_flight
            if request.read_prefix_cache:  # (as vLLM's: a request that skips the lookup is no query)
                kv.record_prefix_hits(request.num_tokens, num_cached,
                                      readmitted=request.metrics.first_scheduled_time is not None)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.time()
            admitted.append(scheduled_request)
            budget -= num_new
            if request.lora_id:
                adapters.add(request.lora_id)
        for request in compiling + for_slot + too_long:
            self.waiting.add(request)
        return admitted

    def _allocate_or_preempt(self, request: Request, num_new: int, scheduled: dict[str, ScheduledRequest],
                             preempted: list[Request]) -> tuple[int, bool]:
        """Allocate blocks for `num_new` more tokens of a running request, preempting others
        (or, last, itself) until they fit. Returns (the budget given back by victims that
        were already scheduled this step, whether `request` got its blocks)."""
        freed = 0
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self._pick_victim()
            self._preempt(victim, preempted)
            if victim.request_id in scheduled:  # the priority policy may pick one already scheduled
                dropped = scheduled.pop(victim.request_id)
                freed += dropped.num_new_tokens
                victim.num_pending -= dropped.num_in_flight
            if victim is request:
                return freed, False
        return freed, True

    @property
    def _chunk_cap(self) -> int | float:
        return self.config.long_prefill_token_threshold or math.inf

    def _lookahead(self, samples: bool, end: int) -> int:
        """Slots to allocate past a chunk ending at `end` (`SchedulerConfig.lookahead`), when
        blocks are free: without them the request drafts nothing for its next step."""
        k = self.config.lookahead
        return k if k and samples and end + k <= self.config.max_model_len else 0

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":  # lowest priority = largest value; ties: latest arrival
            return max(self.running, key=priority_key)
        return self.running[-1]

    def _preempt(self, request: Request, preempted: list[Request]) -> None:
        self._requeue(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        preempted.append(request)

    def _requeue(self, request: Request) -> None:
        """A running request gives back its blocks and waits to be recomputed."""
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.add(request)

    def recompute_all(self, unfinished: Iterable[Request], preempting: bool = False) -> None:
        """After a failure (a step's, or any in the engine's bookkeeping): the scheduler is
        made anew from `unfinished`, the requests the engine still answers for. Each waits
        to be recomputed from its tokens on the host; tokens still on the device are
        forgotten (sampling depends only on (seed, position), so they come out the same);
        every KV block is released. So whatever a failure left half done (a request in no
        queue, a finished one still holding blocks, one nobody answers for) is gone.
        `preempting`: the running requests count as preempted (a reset of the prefix cache
        preempts them, as vLLM's does; a recovery does not)."""
        self.requests, self.running, self._rows = {}, [], None
        self._stop_counts, self._stop_token_ids = Counter(), np.zeros(0, np.int64)
        self.waiting.clear()
        for request in unfinished:
            if request.finish_reason is not None:  # (its end was found, not yet carried out)
                request.status = RequestStatus.FINISHED
            if request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                request.status = RequestStatus.PREEMPTED
                if preempting:
                    request.num_preemptions += 1
                    self.num_preemptions += 1
            request.num_computed_tokens = request.num_pending = 0
            request.spec_token_ids = []
            self.requests[request.request_id] = request
            self._count_stop_ids(request, 1)
            self.waiting.add(request)
        self.kv.release_all()

    def update_from_output(self, out: SchedulerOutput, sampled, num_accepted=None, draft_ids=None) -> list[Request]:
        """Append each sampling request's token, finish those that stop; returns requests with new tokens.

        Under async scheduling this runs after the next step was dispatched: a token of a
        request that finished meanwhile (stopped by its previous token, or aborted) is
        dropped. A request preempted meanwhile keeps its token (its recompute includes it).
        `num_accepted`: with speculative decoding, how many of each row's drafts were accepted,
        and `draft_ids` [n, K] the drafts each row verified.
        """
        batch = out.scheduled
        if num_accepted is not None and batch.num_drafts.any():
            return self._update_speculative(batch, sampled, num_accepted, draft_ids)
        tokens = sampled.tolist() if hasattr(sampled, "tolist") else list(sampled)
        rows, self._rows = self._rows, None
        if (rows is not None and len(tokens) == len(batch) and batch.samples.all()
                and rows.requests == batch.requests == self.running):
            return self._update_rows(rows, tokens)
        requests = batch.requests
        if not batch.samples.all():  # (partial prefill chunks sample nothing)
            picked = np.flatnonzero(batch.samples[: len(tokens)]).tolist()
            requests, tokens = [requests[i] for i in picked], [tokens[i] for i in picked]
        updated = []
        now = time.time()
        finished = RequestStatus.FINISHED
        for request, token in zip(requests, tokens):
            request.num_pending -= 1
            if request.status is finished:
                continue
            self._append(request, token, now)
            updated.append(request)
        return updated

    def _update_speculative(self, batch, sampled, num_accepted, draft_ids) -> list[Request]:
        """`update_from_output` for a step that verified drafts: each request gets its
        accepted drafts, then the token sampled after them, one at a time with the stop
        checks, so that a stop among them ends it there. The K/V of its rejected drafts is
        forgotten (`num_computed_tokens` goes back, also under async scheduling, where the
        step after counted on every draft passing): their slots are written again later, and
        they were never registered in the prefix cache (only host tokens are)."""
        updated, now, finished = [], time.time(), RequestStatus.FINISHED
        for i, request in enumerate(batch.requests):
            if not batch.samples[i]:
                continue
            drafts, accepted = int(batch.num_drafts[i]), int(num_accepted[i])
            request.num_pending -= 1 + drafts
            if request.status is finished:
                continue
            if request.status is RequestStatus.RUNNING:  # (a request preempted meanwhile recomputes from 0)
                request.num_computed_tokens -= drafts - accepted
            for token in draft_ids[i, :accepted].tolist() + [int(sampled[i])]:
                self._append(request, token, now)
                if request.status is finished:
                    break
            updated.append(request)
        return updated

    def _append(self, request: Request, token: int, now: float) -> None:
        request.append_token(token)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        if request.finish_reason is not None:
            self.finish(request, request.finish_reason)

    def _update_rows(self, rows: RunningRows, tokens: list[int]) -> list[Request]:
        """`update_from_output` for a step in which every running request sampled (and none
        finished before): tokens that end nothing, the most, are appended in one loop, the
        others as one by one; the rows stay exact if nobody finished."""
        requests, sampled = rows.requests, np.asarray(tokens, np.int64)
        general = rows.special | (rows.num_tokens + 1 >= rows.limits)
        general |= (sampled[:, None] == self._stop_token_ids).any(axis=1)  # (a stop id of some request)
        if general.any():
            plain = np.flatnonzero(~general).tolist()
            for i in plain:
                request = requests[i]
                request.num_pending -= 1
                request.token_ids.append(tokens[i])
            now = time.time()
            for i in np.flatnonzero(general).tolist():  # (in order: finishing frees blocks in order)
                requests[i].num_pending -= 1
                self._append(requests[i], tokens[i], now)
        else:
            for request, token in zip(requests, tokens):
                request.num_pending -= 1
                request.token_ids.append(token)
        if len(self.running) == len(requests):  # nobody finished: the rows are still those requests'
            rows.pending -= 1
            rows.num_tokens += 1
            rows.last_tokens = sampled
            rows.special = np.array([r.grammar is not None for r in requests], bool) if rows.special.any() else \
                rows.special
            self._rows = rows
        return list(requests)
