"""Model runner: KV cache sizing, buckets, and the flat batch it builds."""

import shutil

import numpy as np
import pytest

import jaxvllm.model_runner as model_runner
from jaxvllm import LLM, EngineConfig
from jaxvllm.model_runner import ModelRunner, default_buckets
from jaxvllm.request import Request, ScheduledRequest
from jaxvllm.sampling_params import SamplingParams

SMALL = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=[32])


def test_default_buckets():
    assert default_buckets(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert default_buckets(100) == [16, 32, 64, 100]


def test_kv_cache_sized_from_device_memory(tiny_checkpoint, monkeypatch):
    """With allocator figures (a GPU), blocks = utilization * limit - peak after a profiling run."""
    fake = {"bytes_limit": 100 << 20, "bytes_in_use": 5 << 20, "peak_bytes_in_use": 10 << 20}
    monkeypatch.setattr(model_runner, "device_memory_stats", lambda: fake)
    runner = ModelRunner(EngineConfig(model=str(tiny_checkpoint("llama")), gpu_memory_utilization=0.5, **SMALL))
    # llama tiny: 2 layers x 2 kv heads x 16 head_dim x 16 tokens x 4 bytes x (K and V) = 8 KiB a block
    assert runner.bytes_per_block == 8192
    assert runner.num_blocks == int((0.5 * (100 << 20) - (10 << 20)) // 8192)
    fake["peak_bytes_in_use"] = 50 << 20
    with pytest.raises(ValueError, match="only 0 KV blocks fit in gpu_memory_utilization=0.5"):
        ModelRunner(EngineConfig(model=str(tiny_checkpoint("llama")), gpu_memory_utilization=0.5, **SMALL))


def test_kv_cache_cpu_default_and_override(tiny_checkpoint, caplog):
    path = str(tiny_checkpoint("llama"))
    with caplog.at_level("INFO", logger="jaxvllm"):
        runner = ModelRunner(EngineConfig(model=path, **SMALL))
    assert runner.num_blocks == 4 * 4  # every sequence at max_model_len: 4 seqs x 4 blocks
    assert "KV cache: 16 blocks x 16 tokens = 256 tokens" in caplog.text
    assert "warm-up: compiled 1 token buckets [32]" in caplog.text
    assert ModelRunner(EngineConfig(model=path, num_gpu_blocks_override=7, **SMALL)).num_blocks == 7


def test_prepare_builds_the_flat_batch(tiny_checkpoint):
    runner = ModelRunner(EngineConfig(model=str(tiny_checkpoint("llama")), **SMALL))
    params = SamplingParams(temperature=0.5, max_tokens=4)
    a = Request("a", list(range(10, 30)), params, max_tokens=4, seed=9)  # 20 prompt tokens, 16 computed
    b = Request("b", [7, 8, 9], params, max_tokens=4, seed=9)
    b.token_ids.append(11)  # one output token so far, decoding
    batch = [ScheduledRequest(a, 16, 4, [3, 1]), ScheduledRequest(b, 3, 1, [2])]
    inputs, sampling, prompt_targets, prompt_positions = runner.prepare(batch)
    assert (prompt_targets == -1).all() and prompt_positions == []
    np.testing.assert_array_equal(inputs.input_ids[:6], [26, 27, 28, 29, 11, 0])
    assert inputs.input_ids.shape == (32,)  # padded to the bucket
    np.testing.assert_array_equal(inputs.positions[:5], [16, 17, 18, 19, 3])
    np.testing.assert_array_equal(inputs.slot_mapping[:6], [1 * 16 + 0, 17, 18, 19, 2 * 16 + 3, -1])
    assert (inputs.slot_mapping[5:] == -1).all()
    np.testing.assert_array_equal(inputs.query_start_loc, [0, 4, 5, 5, 5])
    np.testing.assert_array_equal(inputs.seq_lens, [20, 4, 0, 0])
    np.testing.assert_array_equal(inputs.block_tables[:2, :2], [[3, 1], [2, 0]])
    np.testing.assert_array_equal(inputs.logits_indices, [3, 4, 0, 0])
    np.testing.assert_array_equal(sampling.temperature, [0.5, 0.5, 0, 0])
    np.testing.assert_array_equal(sampling.top_p, [1.0] * 4)
    np.testing.assert_array_equal(sampling.counts_sample, [True, True, False, False])  # both chunks end the sequence
    np.testing.assert_array_equal(sampling.seeds[:2], [9, 9])
    np.testing.assert_array_equal(sampling.output_index[:2], [0, 1])


def test_sequence_rows_follow_the_token_bucket(tiny_checkpoint):
    """A bucket of T tokens holds at most T sequences: small steps get min(max_num_seqs, T) rows."""
    config = EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=64, max_num_seqs=24,
                          max_num_batched_tokens=32, token_buckets=[16, 32])
    runner = ModelRunner(config)
    params = SamplingParams(max_tokens=4)
    reqs = [Request(str(i), [5 + i] * 3, params, max_tokens=4) for i in range(20)]
    small = runner.prepare([ScheduledRequest(r, 0, 3, [i]) for i, r in enumerate(reqs[:2])])[0]
    assert small.input_ids.shape == (16,) and small.seq_lens.shape == (16,)
    assert small.block_tables.shape == (16, 4) and small.query_start_loc.shape == (17,)
    large = runner.prepare([ScheduledRequest(r, 2, 1, [i]) for i, r in enumerate(reqs)])[0]
    assert large.input_ids.shape == (32,) and large.seq_lens.shape == (24,)
    np.testing.assert_array_equal(large.seq_lens[:21], [3] * 20 + [0])
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
