"""The batch builder: buckets, block-table widths, rows and the packed batch of a step,
built and checked with no model, params or device."""

import jax.numpy as jnp
import numpy as np

from jaxvllm.batch_builder import BatchBuilder, default_buckets
from jaxvllm.input_batch import BatchLayout, block_table_widths
from jaxvllm.request import Request, ScheduledRequest
from jaxvllm.sampler import SamplerFeatures
from jaxvllm.sampling_params import SamplingParams


def make_builder(**overrides) -> BatchBuilder:
    """The shapes of a small engine: 4 sequences of up to 64 tokens, one 32-token bucket."""
    kw = dict(max_num_seqs=4, max_model_len=64, block_size=16, buckets=[32], vocab_size=384)
    return BatchBuilder(**{**kw, **overrides})


def test_prompt_rows_from_the_start_position():
    """Prompt logprobs from position 18 of a 20-token prompt: of the chunk 16-19, the rows
    of positions 17 and 18 score prompt tokens 18 and 19; a whole-prompt request's rows
    score from token 1 on; width 0 asks for no top-k, and a wider one for the default 20."""
    builder = make_builder()
    late = Request("late", list(range(10, 30)), SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                               extra_args={"prompt_logprobs_start": 18}), max_tokens=1)
    whole = Request("whole", [7, 8, 9], SamplingParams(max_tokens=1, prompt_logprobs=0), max_tokens=1)
    batch = builder.prepare([ScheduledRequest(late, 16, 4, [3, 1]), ScheduledRequest(whole, 0, 3, [2])])
    np.testing.assert_array_equal(batch.prompt_rows, [1, 2, 4, 5])  # rows of positions 17, 18 | 0, 1
    np.testing.assert_array_equal(batch.prompt_targets, [28, 29, 8, 9])
    assert batch.prompt_positions == [(0, 18), (0, 19), (1, 1), (1, 2)] and batch.prompt_width == 0
    early = builder.prepare([ScheduledRequest(late, 0, 16, [3])])  # the first chunk: nothing scored yet
    assert len(early.prompt_rows) == 0 and early.prompt_positions == []
    wide = Request("wide", [7, 8, 9], SamplingParams(max_tokens=1, prompt_logprobs=2), max_tokens=1)
    assert make_builder().prepare([ScheduledRequest(wide, 0, 3, [2])]).prompt_width == 20


def test_default_buckets():
    assert default_buckets(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert default_buckets(100) == [16, 32, 64, 100]
    # a CPU computes every padded token: small batches get buckets of their own
    assert default_buckets(2048, cpu=True) == [1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert default_buckets(8, cpu=True) == [1, 4, 8] and default_buckets(4, cpu=True) == [1, 4]
    assert default_buckets(1, cpu=True) == [1]


def test_prepare_builds_the_packed_batch():
    builder = make_builder()
    params = SamplingParams(temperature=0.5, max_tokens=4)
    a = Request("a", list(range(10, 30)), params, max_tokens=4, seed=9)  # 20 prompt tokens, 16 computed
    b = Request("b", [7, 8, 9], params, max_tokens=4, seed=9)
    b.token_ids.append(11)  # one output token so far, decoding
    batch = builder.prepare([ScheduledRequest(a, 16, 4, [3, 1]), ScheduledRequest(b, 3, 1, [2])])
    assert batch.layout == BatchLayout(num_tokens=32, num_rows=4, width=4)  # padded to the bucket
    assert batch.packed.shape == (batch.layout.size,) and batch.packed.dtype == np.int32  # one transfer
    assert batch.features == SamplerFeatures(random=True) and len(batch.prompt_rows) == 0
    v = batch.layout.views(batch.packed)
    assert (v["prev_row"] == -1).all()
    np.testing.assert_array_equal(v["input_ids"][:6], [26, 27, 28, 29, 11, 0])
    np.testing.assert_array_equal(v["positions"][:5], [16, 17, 18, 19, 3])
    np.testing.assert_array_equal(v["slot_mapping"][:6], [1 * 16 + 0, 17, 18, 19, 2 * 16 + 3, -1])
    assert (v["slot_mapping"][5:] == -1).all()
    np.testing.assert_array_equal(v["query_start_loc"], [0, 4, 5, 5, 5])
    np.testing.assert_array_equal(v["seq_lens"], [20, 4, 0, 0])
    np.testing.assert_array_equal(v["block_tables"][:2, :2], [[3, 1], [2, 0]])
    np.testing.assert_array_equal(v["logits_indices"], [3, 4, 0, 0])
    np.testing.assert_array_equal(v["temperature"], [0.5, 0.5, 0, 0])
    np.testing.assert_array_equal(v["top_p"], [1.0] * 4)
    np.testing.assert_array_equal(v["counts_sample"], [True, True, False, False])  # both chunks end the sequence
    np.testing.assert_array_equal(v["seeds"][:2], [9, 9])
    np.testing.assert_array_equal(v["output_index"][:2], [0, 1])
    rows = [builder.input_batch.row_of[r] for r in "ab"]
    np.testing.assert_array_equal(v["slot"][:2], rows)

    # Next step: both new tokens are still on the device; a got a third block. Rows persist.
    a.num_pending = b.num_pending = 1
    batch = builder.prepare([ScheduledRequest(a, 20, 1, [3, 1, 5]), ScheduledRequest(b, 4, 1, [2])])
    v = batch.layout.views(batch.packed)
    assert builder.input_batch.row_of == dict(zip("ab", rows))
    np.testing.assert_array_equal(v["block_tables"][:2, :3], [[3, 1, 5], [2, 0, 0]])
    np.testing.assert_array_equal(v["prev_row"][:3], [*rows, -1])  # inputs: each row's last sample
    a.token_ids.append(40)  # a's first output reached the host (synchronous scheduling)
    a.num_pending = 0
    batch = builder.prepare([ScheduledRequest(a, 20, 1, [3, 1, 5]), ScheduledRequest(b, 4, 1, [2])])
    np.testing.assert_array_equal(batch.layout.views(batch.packed)["input_ids"][:2], [40, 0])
    builder.release(["a"])
    assert "a" not in builder.input_batch.row_of and len(builder.input_batch) == 1


def test_block_table_width_follows_the_longest_request():
    assert block_table_widths(4) == [4] and block_table_widths(256) == [256]
    assert block_table_widths(512) == [64, 512] and block_table_widths(2560) == [320, 2560]
    # the ladder of the reference attention with a fixed KV loop (NARROW_WIDTH): short contexts gather 8 columns
    assert block_table_widths(64, smallest=8) == [8, 64] and block_table_widths(32, smallest=8) == [32]
    builder = make_builder(max_model_len=1024, block_size=2)
    assert builder.widths == [64, 512]
    params = SamplingParams(max_tokens=4)
    short = Request("s", [5] * 3, params, max_tokens=4)
    assert builder.prepare([ScheduledRequest(short, 0, 3, [0, 1])]).layout.width == 64
    long = Request("l", [5] * 300, params, max_tokens=4)
    blocks = list(range(2, 152))
    assert builder.prepare([ScheduledRequest(long, 290, 10, blocks)]).layout.width == 512


def test_sequence_rows_follow_the_token_bucket():
    """A bucket of T tokens holds at most T sequences: small steps get min(max_num_seqs, T) rows."""
    builder = make_builder(max_num_seqs=24, buckets=[16, 32])
    params = SamplingParams(max_tokens=4)
    reqs = [Request(str(i), [5 + i] * 3, params, max_tokens=4) for i in range(20)]
    small = builder.prepare([ScheduledRequest(r, 0, 3, [i]) for i, r in enumerate(reqs[:2])])
    assert small.layout == BatchLayout(16, 16, 4)
    builder.release(r.request_id for r in reqs[:2])
    large = builder.prepare([ScheduledRequest(r, 2, 1, [i]) for i, r in enumerate(reqs)])
    assert large.layout == BatchLayout(32, 24, 4)
    np.testing.assert_array_equal(large.layout.views(large.packed)["seq_lens"][:21], [3] * 20 + [0])
    assert builder.rows_for(16) == 16 and builder.rows_for(32) == 24


def test_sampling_fields_come_from_the_sampler_table():
    """`SamplingTensors` is the one table of sampling fields: the packed batch's sampling
    prefix (its order, dtypes and padding values) and the persistent rows' columns (what
    each copies from the request) are derived from it."""
    from dataclasses import fields
    from operator import attrgetter

    from jaxvllm.sampler import SAMPLING_COLUMNS, SamplingTensors

    builder = make_builder()
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.5,
                            frequency_penalty=-0.5, repetition_penalty=1.2, min_tokens=1)
    request = Request("r", [5, 6, 7], params, max_tokens=4, seed=11)
    batch = builder.prepare([ScheduledRequest(request, 0, 3, [0])])
    names = [f.name for f in fields(SamplingTensors)]
    assert list(batch.layout.spans)[: len(names)] == names == [name for name, *_ in SAMPLING_COLUMNS]
    assert batch.layout.sampling_size == len(names) * batch.layout.num_rows
    v = batch.layout.views(batch.packed)
    for name, dtype, pad, row in SAMPLING_COLUMNS:
        host = {np.float32: np.float32, np.uint32: np.uint32}.get(dtype, np.int32)  # bools travel as 0/1
        assert v[name].dtype == host, name
        np.testing.assert_array_equal(v[name][1:], pad)  # padding rows
        if row is not None:
            np.testing.assert_allclose(v[name][0], np.asarray(attrgetter(row)(request), dtype))
            assert builder.input_batch.columns[name].dtype == np.dtype(dtype)
    assert set(builder.input_batch.columns) == {name for name, *_, row in SAMPLING_COLUMNS if row is not None}
    assert (v["use_state"][0], v["min_tokens"][0], v["output_index"][0], v["counts_sample"][0]) == (1, 1, 0, 1)
    assert batch.admitted == [(v["slot"][0], request)]  # its device state row is written at dispatch


def test_device_drafts_and_positions_to_correct():
    """Async scheduling with a draft model: a row whose verify of 2 drafts is in flight
    takes its token from the device's last sampled ids and its drafts from `draft_rows`
    (ids -(row K + j) - 1), and is `shifted` (the device takes off what that verify
    rejected); rows whose K lookahead slots are allocated propose, and are marked drafted."""
    builder = make_builder(spec_tokens=2, device_drafts=True)
    params = SamplingParams(temperature=0, max_tokens=8)
    a = Request("a", [10, 11, 12, 13, 14], params, max_tokens=8)
    a.token_ids.append(20)  # 6 tokens on the host; 1 + 2 more pending on the device
    a.spec_token_ids = [-1, -1]  # its 2 device drafts
    b = Request("b", [7, 8, 9], params, max_tokens=8)
    b.token_ids.append(11)  # decoding, nothing pending
    batch = builder.prepare([ScheduledRequest(a, 7, 3, [3], True, 2), ScheduledRequest(b, 3, 1, [2], True)])
    layout = batch.layout
    assert layout.device_drafts and layout.block_size == 16 and layout.spec_tokens == 2
    v = layout.views(batch.packed)
    np.testing.assert_array_equal(v["input_ids"][:4], [0, -1, -2, 11])  # a's row is 0: drafts 0 and 1 of row 0
    np.testing.assert_array_equal(v["prev_row"][:4], [0, -1, -1, -1])
    np.testing.assert_array_equal(v["positions"][:4], [7, 8, 9, 3])  # the host's, as if both drafts pass
    np.testing.assert_array_equal(v["shifted"][:2], [1, 0])
    np.testing.assert_array_equal(v["shift_seq"][:5], [0, 0, 0, -1, -1])
    np.testing.assert_array_equal(v["next_pos"][:2], [10, 4])
    np.testing.assert_array_equal(batch.proposing, [0, 1])
    np.testing.assert_array_equal(v["draft_ids"][0], [-1, -1])
    np.testing.assert_array_equal(v["num_drafts"][:2], [2, 0])
    assert builder.input_batch.drafted[[0, 1]].all()
    rows = builder.max_num_seqs
    inputs = layout.model_inputs(jnp.asarray(batch.packed), jnp.zeros(rows, jnp.int32), jnp.zeros((rows, 4), jnp.int32))
    assert inputs.verifies_drafts  # (static: the CPU reference attention runs such a step in query blocks)
    # A row without its lookahead slots proposes nothing: its 16th token fills its one block.
    c = Request("c", list(range(30, 45)), params, max_tokens=8)
    c.token_ids.append(21)
    full = builder.prepare([ScheduledRequest(c, 15, 1, [5], True)])
    assert len(full.proposing) == 0 and not builder.input_batch.drafted[2]
    assert not full.layout.model_inputs(jnp.asarray(full.packed), jnp.zeros(rows, jnp.int32),
                                        jnp.zeros((rows, 4), jnp.int32)).verifies_drafts
