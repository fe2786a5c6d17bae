"""The engine with attention_backend="pallas" generates what the reference backend generates.

One engine per (architecture, backend) with a small token budget (chunked prefill),
few KV blocks (preemption and recompute), mixed decode/prefill steps and prefix-cache
hits; on CPU the kernels run in interpret mode inside the jitted step.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxvllm import LLM, SamplingParams

ENGINE = dict(max_model_len=96, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=[32], block_size=8,
              num_gpu_blocks_override=12)
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
CASES = {
    "qwen3": {},  # GQA group 4, head_dim 32
    "llama": {},  # GQA group 2, head_dim 16
    "mistral-window": {"sliding_window": 8},  # a window shorter than the prompts
}


def prompts():
    rng = np.random.default_rng(0)
    lengths = [1, 2, 40, 16, 17, 33, 5, 60, 9]
    out = [[int(t) for t in rng.integers(3, 384, size=n)] for n in lengths]
    return out


@pytest.fixture(scope="module", params=list(CASES))
def generations(request, tiny_checkpoint):
    arch = request.param.split("-")[0]
    path = tiny_checkpoint(arch, **CASES[request.param])
    results = {}
    for backend in ("reference", "pallas"):
        llm = LLM(str(path), attention_backend=backend, **ENGINE)
        runner = llm.llm_engine.runner
        assert runner.backend == backend
        decode_only = []  # per step: whether it ran the decode-only forward
        launch = runner.launch
        runner.launch = lambda batch, *a: decode_only.append(batch.layout.decode_only) or launch(batch, *a)
        requests = [{"prompt_token_ids": p} for p in prompts()]
        outputs = llm.generate(requests, GREEDY, use_tqdm=False)
        # Again: the blocks still cached from the first round are prefix-cache hits.
        outputs += llm.generate(requests[::-1], GREEDY, use_tqdm=False)
        results[backend] = (outputs, dict(llm.stats(), decode_only_steps=sum(decode_only), steps=len(decode_only)))
    return results


def test_pallas_greedy_equals_reference(generations):
    (ref, ref_stats), (pal, pal_stats) = generations["reference"], generations["pallas"]
    assert [o.outputs[0].token_ids for o in pal] == [o.outputs[0].token_ids for o in ref]
    np.testing.assert_allclose(
        [o.outputs[0].cumulative_logprob for o in pal], [o.outputs[0].cumulative_logprob for o in ref],
        rtol=1e-4, atol=1e-4,
    )
    # The run exercised what it claims to: preemption with recompute, and prefix-cache hits.
    assert pal_stats["num_preemptions"] > 0
    assert pal_stats["num_preemptions"] == ref_stats["num_preemptions"]
    assert any(o.num_cached_tokens > 0 for o in pal)
    assert pal_stats["num_free_blocks"] == pal_stats["num_gpu_blocks"]
    # Steps of one token per sequence ran the pallas backend's decode-only forward, compiled
    # in the warm-up beside the mixed one; the reference backend has none.
    assert 0 < pal_stats["decode_only_steps"] < pal_stats["steps"] and ref_stats["decode_only_steps"] == 0
    assert pal_stats["num_compiled_buckets"] == 2 * ref_stats["num_compiled_buckets"]
