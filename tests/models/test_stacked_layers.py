"""Stacked layer weights (a GPU's layout: one array per kind of weight, each layer its row)
against one array per layer (a CPU's): the same outputs through the engine, for a dense,
a sliding-window and a mixture-of-experts architecture, on both attention backends."""

import numpy as np
import pytest

import jaxvllm.loader as loader
from jaxvllm import LLM, SamplingParams

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64])
PROMPTS = [[3, 17, 42, 99, 5], [7] * 12, list(range(20, 51))]


def completions(path, monkeypatch, stacked: bool, **kwargs):
    monkeypatch.setattr(loader, "stacks_layers", lambda device: stacked)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    with LLM(str(path), **ENGINE, **kwargs) as llm:
        layers = llm.llm_engine.runner.params["layers"]
        assert isinstance(layers["q_proj" if stacked else "qkv_proj"], list) != stacked
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("arch,backend", [("qwen3", "reference"), ("gemma3", "reference"),
                                          ("qwen3_moe", "reference"), ("qwen3", "pallas")])
def test_stacked_layers_give_the_same_outputs(arch, backend, tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint(arch)
    per_layer = completions(path, monkeypatch, False, attention_backend=backend)
    stacked = completions(path, monkeypatch, True, attention_backend=backend)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(stacked, per_layer):
        assert tokens == want_tokens
        for got, want in zip(logprobs, want_logprobs):
            assert got.keys() == want.keys()
            np.testing.assert_allclose(list(got.values()), list(want.values()), rtol=1e-5, atol=1e-5)
