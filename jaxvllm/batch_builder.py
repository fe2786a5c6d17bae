"""The host side of a step: which compiled shape it takes, and its packed batch.

`BatchBuilder` owns the persistent batch (`InputBatch`): it admits new requests to rows,
picks the step's token bucket, block-table width and row count, and fills one packed
int32 buffer from the rows with numpy gathers. It needs no model, no params and no
device, so it is built, tested and benchmarked on its own; the model runner dispatches
what it builds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain

import numpy as np

from jaxvllm.config import DEFAULT_MAX_LOGPROBS
from jaxvllm.input_batch import ROW_COLUMNS, SMALLEST_WIDTH, BatchLayout, InputBatch, block_table_widths
from jaxvllm.request import Request, ScheduledBatch, ScheduledRequest
from jaxvllm.sampler import SamplerFeatures, SamplingTensors
from jaxvllm.sampling_params import resolve_logprobs


# Below the powers of two, a CPU's buckets also have these: a CPU computes every padded
# token, so a small batch's decode step pays for 16, where a GPU reads the same weights.
CPU_SMALL_BUCKETS = (1, 4)


def default_buckets(max_num_batched_tokens: int, smallest: int = 16, cpu: bool = False) -> list[int]:
    """Powers of two from `smallest`, ending with `max_num_batched_tokens` itself; on a CPU,
    `CPU_SMALL_BUCKETS` first."""
    buckets = [s for s in CPU_SMALL_BUCKETS if s < min(smallest, max_num_batched_tokens)] if cpu else []
    b = smallest
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_num_batched_tokens]


def sequence_rows(max_num_seqs: int, bucket: int) -> int:
    """Sequence rows of a token bucket's batch (static per bucket): every sequence brings
    at least one token, so a bucket of T tokens never holds more than T sequences."""
    return min(max_num_seqs, bucket)


def request_features(request: Request) -> SamplerFeatures:
    """The sampler variant of a step in which `request` alone samples (no logprobs asked)."""
    _, views = BatchLayout.rows_only(1).empty()
    for name, get in ROW_COLUMNS:
        views[name][0] = get(request)
    tensors = SamplingTensors(**{name: views[name] for name in SamplingTensors.__dataclass_fields__})
    return SamplerFeatures.of(tensors, np.ones(1, bool), bad_words=np.array([bool(request.bad_words_token_ids)]))


@dataclass
class HostBatch:
    """One step as the host built it: the packed buffer, its layout and sampler variant."""

    layout: BatchLayout
    packed: np.ndarray  # int32 [layout.size]
    features: SamplerFeatures | None  # None: no row samples, the sampler is not run
    num_scheduled: int
    # Prompt logprobs: the token rows scored, the prompt token each scores, (scheduled index,
    # prompt position) of each, and the top logprobs per row (0: the token's own only).
    prompt_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    prompt_targets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    prompt_positions: list[tuple[int, int]] = field(default_factory=list)
    prompt_width: int = 0
    # Structured outputs: (sampling row, grammar, drafts verified) of each constrained row.
    # Their bitmask is filled once the tokens before are known: the sampler runs then
    # (`ModelRunner.sample`).
    grammar_rows: list = field(default_factory=list)
    # (row, request) of the requests admitted this step that use sampler state: the runner
    # writes their device state rows before it dispatches the step.
    admitted: list[tuple[int, Request]] = field(default_factory=list)
    # Device drafts: the sequence rows the drafter drafts for after this step; after each
    # row's chunk the prompt's next token where it samples nothing (-1: none), an EAGLE head's.
    proposing: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    chunk_next: np.ndarray | None = None

    def grammar_masks(self) -> list[tuple[int, object, list[int]]]:
        """(first logits row, grammar, drafts) of each constrained row: its bitmask rows are
        the first and, in a speculative step, one after each of its drafts."""
        spec = self.layout.spec_tokens
        starts = self.layout.views(self.packed)["logits_start"] if spec else range(self.num_scheduled)
        return [(int(starts[i]), grammar, drafts) for i, grammar, drafts in self.grammar_rows]


class BatchBuilder:
    """Builds each step's `HostBatch` over the persistent batch.

    `decode_only`: the attention backend has a decode-only forward (`ModelInputs.decode_only`,
    the pallas backend's), so steps of one token per sequence take that layout.
    `smallest_width`: the narrowest block table (`input_batch.SMALLEST_WIDTH` or `NARROW_WIDTH`).
    `dynamic_loops`: every layout's `ModelInputs.dynamic_loops` (a CPU engine).
    `spec_tokens`: speculative decoding's K; a step with drafts takes a layout with room
    for K per row (`BatchLayout.spec_tokens`). `device_drafts`: the drafts are the draft
    model's on the device (async scheduling; `BatchLayout.device_drafts`), a request's given
    as -1s in its `spec_token_ids`; `draft_max_model_len`: no drafts for a row whose K draft
    positions would reach it (vLLM's speculative `max_model_len`; default `max_model_len`).
    `lora`: LoRA is on; a step with an adapter's tokens takes a layout that carries each
    token's slot (`BatchLayout.lora`), a step without one the layout of an engine without LoRA;
    `lora_kernel`: their delta as grouped matmuls (`ModelInputs.lora_kernel`).
    """

    def __init__(self, *, max_num_seqs: int, max_model_len: int, block_size: int, buckets: list[int],
                 vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS, decode_only: bool = False,
                 smallest_width: int = SMALLEST_WIDTH, dynamic_loops: bool = False, spec_tokens: int = 0,
                 device_drafts: bool = False, draft_max_model_len: int | None = None, lora: bool = False,
                 lora_kernel: bool = False) -> None:
        self.max_num_seqs, self.block_size, self.vocab_size = max_num_seqs, block_size, vocab_size
        self.max_logprobs, self.decode_only, self.dynamic_loops = max_logprobs, decode_only, dynamic_loops
        self.spec_tokens, self.lora, self.lora_kernel = spec_tokens, lora, lora_kernel
        self.device_drafts = device_drafts
        self.draft_max_model_len = max_model_len if draft_max_model_len is None else draft_max_model_len
        self.buckets = sorted(set(buckets))
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.widths = block_table_widths(self.max_blocks_per_seq, smallest_width)
        self.input_batch = InputBatch(max_num_seqs, self.max_blocks_per_seq)
        # The last step's requests and their rows: reused while no request leaves or joins.
        self._last_rows: tuple[list[Request], np.ndarray] | None = None
        self._last_features: tuple[np.ndarray, bool, SamplerFeatures | None] | None = None  # over those rows
        self._layouts: dict[tuple, BatchLayout] = {}  # (bucket, width, decode_only, spec, lora) -> its layout

    # -- shapes ------------------------------------------------------------------------

    def rows_for(self, bucket: int) -> int:
        return sequence_rows(self.max_num_seqs, bucket)

    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def width_for(self, num_blocks: int) -> int:
        for w in self.widths:
            if w >= num_blocks:
                return w
        raise ValueError(f"{num_blocks} blocks exceed the widest block table {self.widths[-1]} (max_model_len)")

    @cached_property
    def decode_only_buckets(self) -> list[int]:
        """Buckets that also compile a decode-only forward: with a decode-only backend, those
        a step of one token per sequence can take (up to max_num_seqs tokens); else none."""
        if not self.decode_only:
            return []
        return [b for b in self.buckets if b <= self.bucket_for(self.max_num_seqs)]

    def _layout(self, bucket: int, width: int, decode_only: bool, spec: bool = False, lora: bool = False
                ) -> BatchLayout:
        """A step shape's layout, made once (it caches its field offsets and padding)."""
        key = bucket, width, decode_only, spec, lora
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = BatchLayout(
                bucket, self.rows_for(bucket), width, decode_only, self.dynamic_loops, self.spec_tokens if spec else 0,
                lora, lora and self.lora_kernel, self.device_drafts, self.block_size if self.device_drafts else 0)
        return layout

    def logprobs_width(self, k: int) -> int:
        """Top logprobs computed in a step whose rows ask for up to k: vLLM's default
        max_logprobs (20) unless more is asked, then the engine's max_logprobs; at most the
        vocabulary. Two widths at most, so two sampler variants."""
        vocab = self.vocab_size
        width = DEFAULT_MAX_LOGPROBS if k <= DEFAULT_MAX_LOGPROBS else resolve_logprobs(self.max_logprobs, vocab)
        return max(1, min(width, vocab))

    def padding_batch(self, bucket: int, width: int, features: SamplerFeatures | None,
                      decode_only: bool = False, spec: bool = False, lora: bool = False) -> HostBatch:
        """An all-padding batch of a bucket's shape: writes nothing to the cache."""
        layout = self._layout(bucket, width, decode_only, spec, lora)
        return HostBatch(layout, layout.empty()[0], features, 0)

    # -- rows ----------------------------------------------------------------------------

    def release(self, request_ids) -> None:
        """Requests that left the running set (finished, aborted, preempted) give back their row."""
        for rid in request_ids:
            if self.input_batch.remove(rid):
                self._last_rows = None

    def release_all(self) -> None:
        self.input_batch.clear()
        self._last_rows = None

    # -- one step ------------------------------------------------------------------------

    def prepare(self, scheduled: ScheduledBatch | list[ScheduledRequest], lora_slots: dict[int, int] | None = None
                ) -> HostBatch:
        """Admit new requests to the persistent batch, then fill one packed buffer from its
        rows (numpy gathers) and the few per-step values. `lora_slots`: the device slot of
        each LoRA adapter id of the step's requests."""
        if not isinstance(scheduled, ScheduledBatch):
            scheduled = ScheduledBatch.of(list(scheduled))
        n, bs, ib, requests = len(scheduled), self.block_size, self.input_batch, scheduled.requests
        if n > self.max_num_seqs:
            raise ValueError(f"{n} sequences scheduled, max_num_seqs is {self.max_num_seqs}")
        rows, admitted = self._rows(scheduled)
        starts, lens = scheduled.starts.astype(np.int32), scheduled.num_new_tokens.astype(np.int32)
        samples, ends, drafts = scheduled.samples, starts + lens, scheduled.num_drafts
        # Tokens [start, host_end) are on the host, then the request's drafts if any; the one
        # after, if any, was sampled by the step before and is still on the device.
        host_ends = scheduled.host_ends
        spec = bool(drafts.any())
        own_ends = ends - drafts if spec else ends  # where each request's own tokens end
        pending = np.flatnonzero(own_ends > host_ends)
        grammar_rows = [(i, requests[i].grammar, requests[i].spec_token_ids[: drafts[i]])
                        for i in np.flatnonzero(samples & ib.has_grammar[rows]).tolist()] if ib.num_special else []
        max_blocks = int(ib.num_blocks[rows].max(initial=1))

        num_tokens = int(lens.sum())
        bucket = self.bucket_for(num_tokens)
        decode_only = num_tokens == n and bucket in self.decode_only_buckets  # one token per sequence
        adapters = np.array([r.lora_id for r in requests], np.int64) if self.lora else None
        lora = adapters is not None and bool(adapters.any())
        layout = self._layout(bucket, self.width_for(max_blocks), decode_only, spec, lora)
        packed, v = layout.empty()

        qsl = v["query_start_loc"]
        qsl[n + 1 :] = num_tokens
        np.cumsum(lens, out=qsl[1 : n + 1])
        last = qsl[1 : n + 1] - 1  # each sequence's last token row
        seq_of_token = np.repeat(np.arange(n, dtype=np.int32), lens)
        token_pos = np.arange(num_tokens, dtype=np.int32) - qsl[seq_of_token] + starts[seq_of_token]
        v["positions"][:num_tokens] = token_pos
        tables = ib.block_table[rows, :max_blocks]  # (the columns after are padding: no request reads them)
        v["block_tables"][:n, :max_blocks] = tables
        v["slot_mapping"][:num_tokens] = tables[seq_of_token, token_pos // bs] * bs + token_pos % bs
        v["seq_lens"][:n] = ends
        if lora:
            slot_of_row = np.array([lora_slots[a] if a else -1 for a in adapters.tolist()], np.int32)
            v["lora_slots"][:num_tokens] = slot_of_row[seq_of_token]
        if spec:  # each row's first verified token and its drafts' rows, row after row
            counts = 1 + drafts
            start = np.cumsum(counts) - counts
            v["logits_start"][:n] = start
            v["logits_indices"][: counts.sum()] = np.repeat(last - drafts - start, counts) + np.arange(counts.sum())
            v["num_drafts"][:n] = drafts
            for i in np.flatnonzero(drafts).tolist():
                v["draft_ids"][i, : drafts[i]] = requests[i].spec_token_ids[: drafts[i]]
        else:
            v["logits_indices"][:n] = last

        ids = v["input_ids"][:num_tokens]
        flat = self._host_tokens(scheduled)
        if len(pending):  # those tokens come from the device's last sampled ids, at the request's row
            own_last = last[pending] - drafts[pending]
            v["prev_row"][own_last] = rows[pending]
            from_host = np.ones(num_tokens, bool)
            from_host[own_last] = False
            ids[from_host] = flat
        else:
            ids[:] = flat
        proposing, chunk_next = np.zeros(0, np.int64), None
        if self.device_drafts:
            proposing = self._device_rows(v, ids, rows, pending, drafts, last, ends, samples, seq_of_token,
                                          scheduled.num_blocks)
            chunk_next = self._chunk_next(scheduled, layout.num_rows)

        layout.row_columns(packed)[:, :n] = ib.packed_columns[:, rows]
        features = self._fill_sampling_rows(v, rows, own_ends, samples, bool(grammar_rows))
        batch = HostBatch(layout, packed, features, n, grammar_rows=grammar_rows, admitted=admitted,
                          proposing=proposing, chunk_next=chunk_next)
        if ib.num_special:  # (else no row has a grammar or prompt logprobs)
            self._prompt_targets(batch, v["query_start_loc"], scheduled, rows)
        return batch

    def _rows(self, scheduled: ScheduledBatch) -> tuple[np.ndarray, list[tuple[int, Request]]]:
        """Each scheduled request's row, new requests admitted (in order), block tables brought
        up to date; and (row, request) of the admitted requests that use sampler state."""
        ib, requests = self.input_batch, scheduled.requests
        reused = self._last_rows is not None and self._last_rows[0] == requests  # the same requests as last step
        admitted = []
        if reused:
            rows = self._last_rows[1]
        else:
            self._last_features = None
            rows = np.array([ib.row_of.get(r.request_id, -1) for r in requests], np.int64)
            for i in np.flatnonzero(rows < 0).tolist():
                request = requests[i]
                rows[i] = row = ib.add(request)
                if request.uses_sampler_state:
                    admitted.append((row, request))
            self._last_rows = (list(requests), rows)
        for i in np.flatnonzero(scheduled.num_blocks != ib.num_blocks[rows]).tolist():  # (those that got a block)
            ib.set_blocks(int(rows[i]), scheduled.block_ids[i])
        return rows, admitted

    def _device_rows(self, v: dict[str, np.ndarray], ids: np.ndarray, rows: np.ndarray, pending: np.ndarray,
                     drafts: np.ndarray, last: np.ndarray, ends: np.ndarray, samples: np.ndarray,
                     seq_of_token: np.ndarray, num_blocks: np.ndarray) -> np.ndarray:
        """Device drafts: a draft's id codes its place in `draft_rows` (its row, its index);
        rows whose step before is in flight are `shifted`. Returns the sequence rows that
        sample and have the K slots after this step's tokens allocated: the drafter drafts
        for them on the device, and their rows are marked `drafted` for the next step."""
        k, n = self.spec_tokens, len(rows)
        for i in np.flatnonzero(drafts).tolist():
            first = last[i] - drafts[i] + 1
            if ids[first] < 0:  # (-1s: the request's drafts are on the device)
                ids[first : last[i] + 1] = -(rows[i] * k + np.arange(drafts[i])) - 1
        v["shifted"][pending] = 1
        v["shift_seq"][: len(seq_of_token)] = np.where(np.isin(seq_of_token, pending), seq_of_token, -1)
        v["next_pos"][:n] = ends
        propose = samples & (num_blocks * self.block_size >= ends + k) & (ends + k <= self.draft_max_model_len)
        self.input_batch.drafted[rows] = propose
        return np.flatnonzero(propose)

    @staticmethod
    def _chunk_next(scheduled: ScheduledBatch, num_rows: int) -> np.ndarray:
        """After each chunk that samples nothing, the prompt's next token (an EAGLE head's
        input there under device drafts); -1 for the others and padding rows [num_rows]."""
        chunk_next = np.full(num_rows, -1, np.int32)
        for i in np.flatnonzero(~scheduled.samples).tolist():
            end, tokens = int(scheduled.starts[i] + scheduled.num_new_tokens[i]), scheduled.requests[i].token_ids
            if end < len(tokens):
                chunk_next[i] = tokens[end]
        return chunk_next

    @staticmethod
    def _host_tokens(scheduled: ScheduledBatch) -> np.ndarray:
        """Each chunk's input tokens that the host knows (its drafts after its own), in order."""
        starts, ends, drafts = scheduled.starts, scheduled.host_ends, scheduled.num_drafts
        counts = ends - starts
        if (counts <= 1).all() and not drafts.any():  # decoding: one token each (or none: it is on the device)
            return scheduled.start_tokens[counts == 1].astype(np.int32)
        return np.fromiter(chain.from_iterable(r.token_ids[s:e] + r.spec_token_ids[:d] for r, s, e, d in
                                               zip(scheduled.requests, starts.tolist(), ends.tolist(),
                                                   drafts.tolist())), np.int32)

    def _fill_sampling_rows(self, v: dict[str, np.ndarray], rows: np.ndarray, ends: np.ndarray,
                            samples: np.ndarray, grammar: bool = False) -> SamplerFeatures | None:
        """The sampling rows' per-step fields (the persistent ones are copied already); returns
        the sampler variant they need (None when no row samples)."""
        ib, n = self.input_batch, len(rows)
        output_index = ends - ib.num_prompt_tokens[rows]  # outputs before the one sampled
        v["output_index"][:n] = output_index
        v["slot"][:n] = rows
        v["counts_sample"][:n] = samples
        wanted = samples & ib.want_logprobs[rows]
        v["want_logprobs"][:n] = wanted
        last = self._last_features  # (samples, grammar, features) of the last step, over the same rows
        if last is not None and last[1] == grammar and np.array_equal(last[0], samples):
            return last[2]  # (the rows' parameters are those of the last step)
        features = None
        if samples.any():
            width = self.logprobs_width(int(ib.num_logprobs[rows][wanted].max())) if wanted.any() else 0
            tensors = SamplingTensors(**{k: v[k][:n] for k in SamplingTensors.__dataclass_fields__})
            features = SamplerFeatures.of(tensors, samples, bad_words=ib.has_bad_words[rows], logprobs_width=width,
                                          grammar=grammar)
        self._last_features = (samples, grammar, features)
        return features

    def _prompt_targets(self, batch: HostBatch, query_start_loc: np.ndarray, scheduled: ScheduledBatch,
                        rows: np.ndarray) -> None:
        """Fill the batch's prompt-logprob rows: those of the scheduled prompt positions p
        from the request's first scored position - 1 on, the row of p scoring prompt token p + 1."""
        token_rows, targets, width = [], [], 0
        for i in np.flatnonzero(self.input_batch.num_prompt_logprobs[rows] >= 0).tolist():
            request, start = scheduled.requests[i], int(scheduled.starts[i])
            first = max(start, (request.prompt_logprobs_start or 1) - 1)
            end = min(start + int(scheduled.num_new_tokens[i]), request.num_prompt_tokens - 1)
            if first >= end:
                continue
            width = max(width, request.num_prompt_logprobs)
            token_rows.append(np.arange(first, end) + (int(query_start_loc[i]) - start))
            targets.append(request.prompt_token_ids[first + 1 : end + 1])
            batch.prompt_positions += [(i, p) for p in range(first + 1, end + 1)]
        if token_rows:
            batch.prompt_rows = np.concatenate(token_rows).astype(np.int32)
            batch.prompt_targets = np.concatenate(targets).astype(np.int32)
            batch.prompt_width = self.logprobs_width(width) if width else 0
