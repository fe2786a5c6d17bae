"""What the draft-model and EAGLE tests share: the tiny engine, its prompts, and the runs with
and without drafts that must agree."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from jaxvllm import LLM, SamplingParams

ENGINE = dict(max_model_len=160, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[16, 64], dtype="float32")
PROMPTS = [{"prompt_token_ids": p} for p in ([1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 60)), [300] * 9)]
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
# A prompt that decodes into max_model_len: its last drafts' K/V slots would lie past it (a
# synchronous engine once gave it a block more than the widest table: a StopIteration).
TO_THE_END = ([{"prompt_token_ids": [300] * (ENGINE["max_model_len"] - 12)}],
              SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))


def perturbed_copy(target: Path, out: Path, noise: float = 0.3) -> Path:
    """A copy of the checkpoint `target` with noise on every weight: a draft model that
    mostly agrees with it."""
    shutil.copytree(target, out)
    rng = np.random.default_rng(0)
    for file in out.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({name: (w + rng.normal(0, noise * w.std() + 1e-6, w.shape)).astype(w.dtype)
                   for name, w in tensors.items()}, file, metadata={"format": "pt"})
    return out


def token_ids(llm: LLM, params=GREEDY, prompts=PROMPTS) -> list[list[int]]:
    return [list(c.token_ids) for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def check_same_under_pressure(target, speculative_config: dict, engine: dict, prompts: list) -> None:
    """Greedy outputs (two a prompt) with and without drafts are equal on an engine that
    preempts and hits the prefix cache, and drafts were accepted."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2)
    results = []
    for spec in (None, speculative_config):
        with LLM(str(target), speculative_config=spec, **engine) as llm:
            results.append(token_ids(llm, params, prompts))
            stats = llm.stats()
    assert results[0] == results[1]
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] + stats["prefix_cache_preempted_hits"] > 0  # (readmissions: apart)
    assert stats["spec_decode_num_accepted_tokens"] > 0
