"""The LLM API end to end: greedy parity with HF generate, preemption, chunking, no recompiles, bad input."""

import numpy as np
import pytest

from jaxvllm import LLM, RequestOutput, SamplingParams
from tests.conftest import ARCHS
from tests.models.paged import hf_greedy

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
ENGINE = dict(max_model_len=256, max_num_seqs=64, max_num_batched_tokens=256, token_buckets=[64, 256])


def prompts_of_mixed_lengths(n=64, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[1, 2, 200, 16, 17], rng.integers(1, 201, size=n - 5)])
    return [[int(t) for t in rng.integers(3, 384, size=n)] for n in lengths]


@pytest.fixture(scope="module")
def prompts():
    return prompts_of_mixed_lengths()


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tiny_checkpoint, hf_model, prompts):
    """(path, HF greedy completions of every prompt, each generated alone)."""
    path = tiny_checkpoint(request.param)
    return path, hf_greedy(hf_model(path), prompts, MAX_TOKENS)


def completions(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_hf(arch_case, prompts, compile_counter):
    path, want = arch_case
    before = compile_counter.count
    llm = LLM(path, **ENGINE)
    assert compile_counter.count > before  # the counter sees warm-up compiles
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert completions(outputs) == want
    assert [o.request_id for o in outputs] == sorted((o.request_id for o in outputs), key=int)
    assert all(o.finished and o.outputs[0].finish_reason in ("stop", "length") for o in outputs)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_compiled_buckets"] == 2 and stats["warmup_seconds"] > 0

    llm.llm_engine.finish_warmup()  # (what a CPU compiles after ready: the larger bucket)
    assert llm.stats()["warmup_pending_compiles"] == 0 and llm.stats()["warmup_done_seconds"] > 0
    before = compile_counter.count
    again = llm.generate([{"prompt_token_ids": p} for p in prompts[:20]], GREEDY, use_tqdm=False)
    assert compile_counter.count == before, "serving compiled something after warm-up"
    assert completions(again) == want[:20]


def test_greedy_matches_hf_with_preemption(arch_case, prompts):
    path, want = arch_case
    # 20 blocks x 16 = 320 tokens of KV for 64 prompts averaging ~100 tokens.
    llm = LLM(path, **ENGINE, num_gpu_blocks_override=20)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert completions(outputs) == want
    assert llm.stats()["num_free_blocks"] == 20


def test_greedy_matches_hf_with_chunked_prefill(arch_case, prompts):
    path, want = arch_case
    llm = LLM(path, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=32, token_buckets=[32])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert completions(outputs) == want
