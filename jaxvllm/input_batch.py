"""The host side of one step's batch: per-request rows that persist across steps, and
the packed int32 buffer that carries a step's batch to the device in one transfer.

`InputBatch` (vLLM's persistent batch) keeps, per running request, a row of numpy
arrays: block table, sampling parameters, seed. A row is written when the request is
admitted and when it gets a new block, and freed when it finishes or is preempted; a
step gathers the rows it schedules with numpy indexing instead of rebuilding them from
Python objects. The row number is also the request's row of the device `SamplerState`
and of the device buffer of last sampled tokens.

`BatchLayout` is the static shape of a step (T tokens, S sequence rows, W block-table
columns): every field of the batch, model inputs and sampling tensors alike, has a
fixed place in one int32 vector (floats and uint32 seeds bitcast), so that the host
fills it with numpy and hands it to the jitted call as one array (one transfer), and
the jitted functions slice it back apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter

import jax
import jax.numpy as jnp
import numpy as np

from jaxvllm.batch import ModelInputs
from jaxvllm.request import Request
from jaxvllm.sampler import SAMPLING_COLUMNS, SamplingTensors

# (field, length: "T" tokens, "S" rows, "S+1", "SW" block table, "SK" K draft tokens per
# row, "SD" S in a speculative layout (K > 0) else none, "SX" / "TX" S / T in a layout with
# device drafts (`BatchLayout.device_drafts`) else none, "L" logits rows: S, or with drafts
# min(S (1 + K), T), as every logits row is a distinct token's) in packing order. The sampling rows (the sampler's table, and a speculative step's drafts)
# come first, so that their offsets depend on S and K alone: the forward hands the sampler
# that prefix, and the sampler compiles per row count, not per bucket/width.
_SAMPLING_FIELDS = tuple((name, "S") for name, *_ in SAMPLING_COLUMNS) + (
    ("draft_ids", "SK"),  # a row's draft tokens, verified this step (speculative decoding)
    ("num_drafts", "SD"),  # how many of them are real (the others: padding)
    ("logits_start", "SD"),  # the row's first logits row (its 1 + num_drafts rows follow)
    # Device drafts (async scheduling with a draft model): the row's step before is still in
    # flight, so its positions are the host's count if every draft were accepted (1: the
    # device takes off what that step rejected); the host's position of the token this step
    # samples.
    ("shifted", "SX"),
    ("next_pos", "SX"),
)
_FIELDS = _SAMPLING_FIELDS + (
    ("query_start_loc", "S+1"),
    ("seq_lens", "S"),
    # The token rows that get logits: each row's last token; with drafts, each row's first
    # verified token and one per draft, row after row (from `logits_start`).
    ("logits_indices", "L"),
    ("input_ids", "T"),  # host-known token ids (0 where prev_row says where to look)
    ("prev_row", "T"),  # >= 0: take the id from the device's last sampled tokens at this row
    ("positions", "T"),
    ("slot_mapping", "T"),
    ("block_tables", "SW"),
    ("lora_slots", "TL"),  # each token's LoRA slot (-1: none), in a layout with adapters (else none)
    ("shift_seq", "TX"),  # device drafts: the sequence row of a token whose row is `shifted` (-1: none)
)
_DTYPES = {name: np.dtype(dtype) for name, dtype, _, _ in SAMPLING_COLUMNS}
_FLOATS = {name for name, dtype in _DTYPES.items() if dtype == np.float32}
_BOOLS = {name for name, dtype in _DTYPES.items() if dtype == np.bool_}
_UINTS = {name for name, dtype in _DTYPES.items() if dtype == np.uint32}
_PADDING = {name: pad for name, _, pad, _ in SAMPLING_COLUMNS if pad} | {"prev_row": -1, "slot_mapping": -1,
                                                                          "lora_slots": -1, "shift_seq": -1}
# The sampling columns a request's persistent row holds, and the Request attribute of each.
ROW_COLUMNS = tuple((name, attrgetter(row)) for name, _, _, row in SAMPLING_COLUMNS if row is not None)
# They lead the sampler's table, so a step copies them into the packed buffer in one gather.
assert [name for name, _ in ROW_COLUMNS] == [name for name, _ in _SAMPLING_FIELDS[: len(ROW_COLUMNS)]]


@dataclass(frozen=True)
class BatchLayout:
    """Where each field lives in a step's packed int32 vector (a static jit argument)."""

    num_tokens: int  # T, the token bucket
    num_rows: int  # S
    width: int  # W, block-table columns
    decode_only: bool = False  # every sequence brings one token (`ModelInputs.decode_only`)
    dynamic_loops: bool = False  # `ModelInputs.dynamic_loops` (a CPU step)
    spec_tokens: int = 0  # K: draft tokens a row may verify (0: no drafts this step)
    lora: bool = False  # tokens carry LoRA slots (`ModelInputs.lora_slots`)
    lora_kernel: bool = False  # `ModelInputs.lora_kernel`
    # Draft tokens and position corrections come from the device (`model_inputs`' draft_rows):
    # async scheduling with a draft model. `block_size` then places the corrected positions.
    device_drafts: bool = False
    block_size: int = 0

    @cached_property
    def spans(self) -> dict[str, tuple[int, int]]:
        s, k = self.num_rows, self.spec_tokens
        sizes = {"T": self.num_tokens, "S": s, "S+1": s + 1, "SW": s * self.width, "SK": s * k,
                 "SD": s if k else 0, "L": self.num_logits, "SX": s if self.device_drafts else 0,
                 "TX": self.num_tokens if self.device_drafts else 0,
                 "TL": self.num_tokens if self.lora else 0}
        spans, start = {}, 0
        for name, kind in _FIELDS:
            spans[name] = (start, start + sizes[kind])
            start += sizes[kind]
        return spans

    @property
    def size(self) -> int:
        return self.spans[_FIELDS[-1][0]][1]

    @property
    def num_logits(self) -> int:
        """Logits rows of a step: one per sequence row; with drafts, one per verified token."""
        s, k = self.num_rows, self.spec_tokens
        return min(s * (1 + k), self.num_tokens) if k else s

    @property
    def sampling_size(self) -> int:
        """Length of the sampling rows' prefix of the packed vector."""
        return self.spans[_SAMPLING_FIELDS[-1][0]][1]

    @classmethod
    def rows_only(cls, num_rows: int, spec_tokens: int = 0, device_drafts: bool = False) -> "BatchLayout":
        """A layout that reads just the sampling rows (the prefix every layout with
        `num_rows` rows and `spec_tokens` drafts per row shares)."""
        return cls(0, num_rows, 0, spec_tokens=spec_tokens, device_drafts=device_drafts)

    def empty(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A fresh all-padding buffer and its field views.

        Padding is neutral: no K/V written (slot -1), greedy, no state (slot 0 with
        use_state off), no logits row of its own. A fresh buffer every step: the device may still read the last
        one (on CPU, a device_put may alias host memory).
        """
        packed = np.zeros(self.size, np.int32)
        views = self.views(packed)
        for name, value in _PADDING.items():
            views[name][:] = value
        views["logits_start"][:] = self.num_logits  # (a padding row verifies nothing: its logits row is past the end)
        return packed, views

    def views(self, packed: np.ndarray) -> dict[str, np.ndarray]:
        """Writable numpy views of a host buffer's fields (bool fields as int32 0/1)."""
        floats = packed.view(np.float32)
        views = {name: (floats if name in _FLOATS else packed)[a:b] for name, (a, b) in self.spans.items()}
        for name in _UINTS:
            views[name] = views[name].view(np.uint32)
        views["block_tables"] = views["block_tables"].reshape(self.num_rows, self.width)
        views["draft_ids"] = views["draft_ids"].reshape(self.num_rows, self.spec_tokens)
        return views

    def row_columns(self, packed: np.ndarray) -> np.ndarray:
        """The sampling fields a persistent row holds (`ROW_COLUMNS`, the first ones), as one
        writable [fields, S] int32 view of a host buffer."""
        return packed[: len(ROW_COLUMNS) * self.num_rows].reshape(len(ROW_COLUMNS), self.num_rows)

    def _field(self, packed: jax.Array, name: str) -> jax.Array:
        a, b = self.spans[name]
        x = packed[a:b]
        if name in _FLOATS:
            return jax.lax.bitcast_convert_type(x, jnp.float32)
        if name in _UINTS:
            return jax.lax.bitcast_convert_type(x, jnp.uint32)
        if name in _BOOLS:
            return x != 0
        if name == "block_tables":
            return x.reshape(self.num_rows, self.width)
        return x

    def model_inputs(self, packed: jax.Array, last_sampled: jax.Array, draft_rows: jax.Array | None = None
                     ) -> ModelInputs:
        """On the device: the model's inputs, with ids still in flight taken from `last_sampled`.
        With device drafts, `draft_rows` [persistent rows, 2 + K] holds each row's rejected
        count of its step before (column 0), its newest token's position (1) and its drafts
        (2..): a draft's id is -(row * K + j) - 1 on the host, and a `shifted` row's positions,
        slots and length lose what its step before rejected."""
        f = lambda name: self._field(packed, name)  # noqa: E731
        ids, prev = f("input_ids"), f("prev_row")
        input_ids = jnp.where(prev >= 0, last_sampled[jnp.maximum(prev, 0)], ids)
        positions, slots, seq_lens, tables = f("positions"), f("slot_mapping"), f("seq_lens"), f("block_tables")
        if self.device_drafts:
            drafts = draft_rows[:, DRAFTS:].reshape(-1)
            input_ids = jnp.where(ids < 0, drafts[jnp.clip(-ids - 1, 0, drafts.shape[0] - 1)], input_ids)
            shift = self.rejected_before(packed, draft_rows)
            seq = f("shift_seq")
            row = jnp.maximum(seq, 0)
            positions = positions - jnp.where(seq >= 0, shift[row], 0)
            bs = self.block_size
            slots = jnp.where(seq >= 0, tables[row, positions // bs] * bs + positions % bs, slots)
            seq_lens = seq_lens - shift
        return ModelInputs(input_ids, positions, slots, f("query_start_loc"), seq_lens,
                           tables, f("logits_indices"), f("lora_slots") if self.lora else None,
                           self.decode_only, self.dynamic_loops, self.lora and self.lora_kernel,
                           self.spec_tokens > 0)

    def sampling(self, packed: jax.Array) -> SamplingTensors:
        return SamplingTensors(**{k: self._field(packed, k) for k in SamplingTensors.__dataclass_fields__})

    def drafts(self, packed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """A speculative step's draft tokens [S, K], each row's count of them [S] and its
        first logits row [S]."""
        return (self._field(packed, "draft_ids").reshape(self.num_rows, self.spec_tokens),
                self._field(packed, "num_drafts"), self._field(packed, "logits_start"))

    def rejected_before(self, packed: jax.Array, draft_rows: jax.Array) -> jax.Array:
        """With device drafts: what each `shifted` row's step before rejected (0 for the
        other rows) [S], which its positions, length and output index lose."""
        return jnp.where(self._field(packed, "shifted") != 0, draft_rows[self._field(packed, "slot"), REJECTED], 0)

    def next_positions(self, packed: jax.Array) -> jax.Array:
        """With device drafts: the host's position of the token each row samples [S]."""
        return self._field(packed, "next_pos")


# Columns of the device drafts' per-row buffer (`ModelRunner.draft_rows`, [persistent rows,
# 2 + K]): what the row's step before rejected, its newest token's position, its K drafts.
REJECTED, NEWEST, DRAFTS = 0, 1, 2


def store_drafts(draft_rows: jax.Array, rows: jax.Array, live: jax.Array, drafts: jax.Array) -> jax.Array:
    """`draft_rows` with the drafts [R, K] of the `live` persistent `rows` written."""
    target = jnp.where(live, rows, draft_rows.shape[0])  # (other rows: dropped)
    return draft_rows.at[target, DRAFTS:].set(drafts, mode="drop")


# The narrowest block-table width. An attention whose cost follows the table's width (the
# reference's KV loop at a fixed trip count scores every column for every token, so a short
# context in a wide table costs what max_model_len would: at max_model_len 1024, a step of
# ~100-token sequences ran 3x slower at width 64 than at 8) gets a ladder down to
# NARROW_WIDTH. The kernels, and the reference with CPU loops (`ModelInputs.dynamic_loops`),
# visit the columns in use only: for them a narrower table saves just its upload.
SMALLEST_WIDTH = 64
NARROW_WIDTH = 8


def block_table_widths(max_blocks: int, smallest: int = SMALLEST_WIDTH, factor: int = 8) -> list[int]:
    """Block-table widths a step may take: `max_blocks`, then down by `factor` while at least
    `smallest` (`SMALLEST_WIDTH`, or `NARROW_WIDTH`). A step's table is as wide as the first
    width that holds its longest request, so short contexts neither upload nor (reference
    backend) gather `max_model_len` columns.

    Each width is one more compiled forward per token bucket, so the ladder is coarse: for
    the kernels, up to 64 blocks (1024 tokens at block size 16) one width is cheap enough to
    send always; Qwen3's 40,960 positions give [320, 2560]."""
    widths = [max_blocks]
    while widths[0] // factor >= smallest:
        widths.insert(0, -(-widths[0] // factor))
    return widths


class InputBatch:
    """Rows of per-request step inputs that persist while a request runs."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros(max_num_seqs, np.int64)  # block_table columns filled, per row
        # The sampling columns (the sampler's table), then what the batch builder reads per row.
        self.columns = {name: np.full(max_num_seqs, pad, dtype) for name, dtype, pad, row in SAMPLING_COLUMNS
                        if row is not None}
        # The same, as they travel (int32 bits, field-major): what a step gathers in one go.
        self.packed_columns = np.stack([self._bits(self.columns[name]) for name, _ in ROW_COLUMNS])
        self.num_prompt_tokens = np.zeros(max_num_seqs, np.int32)
        self.want_logprobs = np.zeros(max_num_seqs, bool)
        self.num_logprobs = np.zeros(max_num_seqs, np.int32)  # top logprobs per sampled token
        self.has_bad_words = np.zeros(max_num_seqs, bool)
        self.has_grammar = np.zeros(max_num_seqs, bool)  # structured output
        self.num_prompt_logprobs = np.full(max_num_seqs, -1, np.int64)  # -1: not asked for
        self.drafted = np.zeros(max_num_seqs, bool)  # device drafts: the row's newest drafts are on the device
        self.num_special = 0  # rows with a grammar or prompt logprobs (none: a step skips looking for them)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, request: Request) -> int:
        """Give a request a row and write its parameters there; returns the row."""
        if not self._free_rows:
            raise RuntimeError(f"more than max_num_seqs ({self.max_num_seqs}) requests are running")
        row = self._free_rows.pop()
        self.row_of[request.request_id] = row
        for i, (name, value_of) in enumerate(ROW_COLUMNS):
            column = self.columns[name]
            column[row] = value_of(request)
            self.packed_columns[i, row] = self._bits(column[row : row + 1])[0]
        self.num_prompt_tokens[row] = request.num_prompt_tokens
        self.want_logprobs[row] = request.num_logprobs is not None
        self.num_logprobs[row] = request.num_logprobs or 0
        self.has_bad_words[row] = bool(request.bad_words_token_ids)
        self.has_grammar[row] = request.grammar is not None
        self.num_prompt_logprobs[row] = -1 if request.num_prompt_logprobs is None else request.num_prompt_logprobs
        self.num_special += self._special(row)
        self.num_blocks[row] = 0
        self.drafted[row] = False
        return row

    @staticmethod
    def _bits(column: np.ndarray) -> np.ndarray:
        """A column as the packed buffer holds it: int32 bits (bools as 0/1)."""
        return column.astype(np.int32) if column.dtype == np.bool_ else column.view(np.int32)

    def remove(self, request_id: str) -> bool:
        """Free a request's row; returns whether it had one."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
            self.num_special -= self._special(row)
        return row is not None

    def clear(self) -> None:
        """Every row free, made anew (after a failure, whatever it left half done)."""
        self.row_of = {}
        self._free_rows = list(range(self.max_num_seqs - 1, -1, -1))
        self.num_special = 0

    def _special(self, row: int) -> bool:
        return bool(self.has_grammar[row] or self.num_prompt_logprobs[row] >= 0)

    def set_blocks(self, row: int, block_ids: list[int]) -> None:
        """Copy the blocks a row's request got since the last call (blocks are only ever
        appended while it runs; the runner calls this when the count changed)."""
        known = int(self.num_blocks[row])
        self.block_table[row, known : len(block_ids)] = block_ids[known:]
        self.num_blocks[row] = len(block_ids)
