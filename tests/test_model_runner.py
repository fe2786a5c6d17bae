"""Model runner: KV cache sizing, buckets, and the flat batch it builds."""

import shutil

import jax
import numpy as np
import pytest

import jaxvllm.model_runner as model_runner
from jaxvllm import LLM, EngineConfig
from jaxvllm.input_batch import BatchLayout, block_table_widths
from jaxvllm.model_runner import ModelRunner, default_buckets
from jaxvllm.sampler import SamplerFeatures
from jaxvllm.request import Request, ScheduledRequest
from jaxvllm.sampling_params import SamplingParams

SMALL = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=[32])


def test_default_buckets():
    assert default_buckets(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert default_buckets(100) == [16, 32, 64, 100]


def test_kv_cache_sized_from_device_memory(tiny_checkpoint, monkeypatch, caplog):
    """With allocator figures (a GPU), vLLM's meaning: blocks = utilization * the device's total
    memory - peak after a profiling run. JAX's allocator limit is 0.75 of the total by default,
    and caps the budget."""
    fake = {"bytes_limit": 75 << 20, "bytes_in_use": 5 << 20, "peak_bytes_in_use": 10 << 20}  # 100 MiB total
    calls = []

    def stats(device):  # the peak reaches 10 MiB during the profiling step (after 2 readings)
        calls.append(device)
        return dict(fake, peak_bytes_in_use=fake["peak_bytes_in_use"] if len(calls) % 3 == 0 else 0)

    monkeypatch.setattr(model_runner, "device_memory_stats", stats)
    path = str(tiny_checkpoint("llama"))
    runner = ModelRunner(EngineConfig(model=path, gpu_memory_utilization=0.5, **SMALL))
    # llama tiny: 2 layers x 2 kv heads x 16 head_dim x 16 tokens x 4 bytes x (K and V) = 8 KiB a block
    assert runner.bytes_per_block == 8192
    assert runner.num_blocks == int((0.5 * (100 << 20) - (10 << 20)) // 8192)
    with caplog.at_level("INFO", logger="jaxvllm"):
        capped = ModelRunner(EngineConfig(model=path, gpu_memory_utilization=0.9, **SMALL))
    assert capped.num_blocks == int(((75 << 20) - (10 << 20)) // 8192)  # 90 MiB asked, 75 MiB allowed
    assert "gpu_memory_utilization=0.9 asks for 0.09 GiB, JAX's allocator allows 0.07 GiB" in caplog.text
    fake["peak_bytes_in_use"] = 50 << 20
    with pytest.raises(ValueError, match="only 0 KV blocks fit in gpu_memory_utilization=0.5 on "):
        ModelRunner(EngineConfig(model=path, gpu_memory_utilization=0.5, **SMALL))


def test_an_earlier_engines_peak_does_not_shrink_the_cache(tiny_checkpoint, monkeypatch):
    """JAX's peak_bytes_in_use never resets: after an engine of 60 MiB was freed, a new one
    reads that peak. Its own step's peak then comes from XLA's analysis of the compiled
    step, on top of what is in use (5 MiB here)."""
    fake = {"bytes_limit": 75 << 20, "bytes_in_use": 5 << 20, "peak_bytes_in_use": 60 << 20}
    monkeypatch.setattr(model_runner, "device_memory_stats", lambda device: fake)
    runner = ModelRunner(EngineConfig(model=str(tiny_checkpoint("llama")), gpu_memory_utilization=0.5,
                                      enforce_eager=True, **SMALL))
    batch = runner.padding_batch(runner.buckets[-1], runner.widths[-1], None)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), runner.kv_caches)
    step = runner._step_bytes(batch, shapes)
    assert 0 < step < 5 << 20
    assert runner.num_blocks == int((0.5 * (100 << 20) - (5 << 20) - step) // 8192)


def test_kv_cache_cpu_default_and_override(tiny_checkpoint, caplog):
    path = str(tiny_checkpoint("llama"))
    with caplog.at_level("INFO", logger="jaxvllm"):
        runner = ModelRunner(EngineConfig(model=path, **SMALL))
    assert runner.num_blocks == 4 * 4  # every sequence at max_model_len: 4 seqs x 4 blocks
    assert "KV cache: 16 blocks x 16 tokens = 256 tokens" in caplog.text
    assert "warm-up: compiled 1 token buckets [32] x 1 block-table widths [4] and 3 sampler variants" in caplog.text
    assert ModelRunner(EngineConfig(model=path, num_gpu_blocks_override=7, **SMALL)).num_blocks == 7


def test_prepare_builds_the_packed_batch(tiny_checkpoint):
    runner = ModelRunner(EngineConfig(model=str(tiny_checkpoint("llama")), **SMALL))
    params = SamplingParams(temperature=0.5, max_tokens=4)
    a = Request("a", list(range(10, 30)), params, max_tokens=4, seed=9)  # 20 prompt tokens, 16 computed
    b = Request("b", [7, 8, 9], params, max_tokens=4, seed=9)
    b.token_ids.append(11)  # one output token so far, decoding
    batch = runner.prepare([ScheduledRequest(a, 16, 4, [3, 1]), ScheduledRequest(b, 3, 1, [2])])
    assert batch.layout == BatchLayout(num_tokens=32, num_rows=4, width=4)  # padded to the bucket
    assert batch.packed.shape == (batch.layout.size,) and batch.packed.dtype == np.int32  # one transfer
    assert batch.features == SamplerFeatures(random=True) and batch.prompt_rows == []
    v = batch.layout.views(batch.packed)
    assert (v["prompt_targets"] == -1).all() and (v["prev_row"] == -1).all()
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
    rows = [runner.input_batch.row_of[r] for r in "ab"]
    np.testing.assert_array_equal(v["slot"][:2], rows)

    # Next step: both new tokens are still on the device; a got a third block. Rows persist.
    a.num_pending = b.num_pending = 1
    batch = runner.prepare([ScheduledRequest(a, 20, 1, [3, 1, 5]), ScheduledRequest(b, 4, 1, [2])])
    v = batch.layout.views(batch.packed)
    assert runner.input_batch.row_of == dict(zip("ab", rows))
    np.testing.assert_array_equal(v["block_tables"][:2, :3], [[3, 1, 5], [2, 0, 0]])
    np.testing.assert_array_equal(v["prev_row"][:3], [*rows, -1])  # inputs: each row's last sample
    a.token_ids.append(40)  # a's first output reached the host (synchronous scheduling)
    a.num_pending = 0
    batch = runner.prepare([ScheduledRequest(a, 20, 1, [3, 1, 5]), ScheduledRequest(b, 4, 1, [2])])
    np.testing.assert_array_equal(batch.layout.views(batch.packed)["input_ids"][:2], [40, 0])
    runner.release(["a"])
    assert "a" not in runner.input_batch.row_of and len(runner.input_batch) == 1


def test_block_table_width_follows_the_longest_request(tiny_checkpoint):
    assert block_table_widths(4) == [4] and block_table_widths(256) == [256]
    assert block_table_widths(512) == [64, 512] and block_table_widths(2560) == [320, 2560]
    runner = ModelRunner(EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=1024, block_size=2,
                                      max_num_seqs=4, max_num_batched_tokens=32, token_buckets=[32]))
    assert runner.widths == [64, 512] and runner.num_compiled_buckets() == 2  # both widths warmed up
    params = SamplingParams(max_tokens=4)
    short = Request("s", [5] * 3, params, max_tokens=4)
    assert runner.prepare([ScheduledRequest(short, 0, 3, [0, 1])]).layout.width == 64
    long = Request("l", [5] * 300, params, max_tokens=4)
    blocks = list(range(2, 152))
    assert runner.prepare([ScheduledRequest(long, 290, 10, blocks)]).layout.width == 512


def test_sequence_rows_follow_the_token_bucket(tiny_checkpoint):
    """A bucket of T tokens holds at most T sequences: small steps get min(max_num_seqs, T) rows."""
    config = EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=64, max_num_seqs=24,
                          max_num_batched_tokens=32, token_buckets=[16, 32])
    runner = ModelRunner(config)
    params = SamplingParams(max_tokens=4)
    reqs = [Request(str(i), [5 + i] * 3, params, max_tokens=4) for i in range(20)]
    small = runner.prepare([ScheduledRequest(r, 0, 3, [i]) for i, r in enumerate(reqs[:2])])
    assert small.layout == BatchLayout(16, 16, 4)
    runner.release(r.request_id for r in reqs[:2])
    large = runner.prepare([ScheduledRequest(r, 2, 1, [i]) for i, r in enumerate(reqs)])
    assert large.layout == BatchLayout(32, 24, 4)
    np.testing.assert_array_equal(large.layout.views(large.packed)["seq_lens"][:21], [3] * 20 + [0])
    assert runner.rows_for(16) == 16 and runner.rows_for(32) == 24


def test_missing_tokenizer_is_a_clear_error(tiny_checkpoint, tmp_path):
    path = tmp_path / "no-tokenizer"
    path.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_checkpoint("llama") / name, path)
    with pytest.raises(ValueError, match="cannot load a tokenizer from .*no-tokenizer.*tokenizer=PATH"):
        LLM(path, **SMALL)
    llm = LLM(path, tokenizer=str(tiny_checkpoint("llama")), **SMALL)
    assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_kv_blocks_are_capped_at_32_bit_offsets(tiny_checkpoint, monkeypatch, caplog):
    """A tiny model on a large device would get more blocks than 32-bit element offsets
    address in one layer's cache (the kernels' and the K/V scatter's index math): the count
    is capped there, with a log line; an explicit override past it is refused."""
    from jaxvllm.model_runner import MAX_CACHE_ELEMENTS, max_kv_blocks

    path = str(tiny_checkpoint("llama"))
    runner = ModelRunner(EngineConfig(model=path, **SMALL))
    limit = max_kv_blocks(runner.cfg, runner.block_size, 1)
    per_block = runner.cfg.num_kv_heads * runner.block_size * runner.cfg.head_dim  # 2 x 16 x 16 = 512 elements
    assert limit * per_block <= MAX_CACHE_ELEMENTS < (limit + 1) * per_block
    assert limit * per_block * 2 > 2**31 - 2 * per_block  # the largest cache just under 2^31 elements
    # 1 TiB of device memory would give 2^27 blocks of 8 KiB: capped (sized only, nothing allocated here).
    monkeypatch.setattr(model_runner, "device_memory_stats", lambda device: {"bytes_limit": 3 << 38,
                                                                            "bytes_in_use": 0, "peak_bytes_in_use": 0})
    with caplog.at_level("INFO", logger="jaxvllm"):
        assert runner._addressable(runner._num_kv_blocks()) == limit
    assert f"KV cache: capped at {limit} blocks" in caplog.text
    runner.config.num_gpu_blocks_override = limit + 1
    with pytest.raises(ValueError, match=f"num_gpu_blocks_override={limit + 1} exceeds the {limit} KV blocks"):
        runner._addressable(limit + 1)
