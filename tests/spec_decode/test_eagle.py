"""Speculative decoding with EAGLE and EAGLE-3 heads (vLLM's "eagle" / "eagle3" methods),
read in their published checkpoint layouts: each head drafts what a torch reference of
it drafts after the same context; greedy outputs equal those without drafts (under
preemption, chunked prefill, prefix caching and n > 1 too) with some drafts accepted;
seeded sampling repeats and nothing compiles after warm-up; heads that do not fit the
target are refused before any weight loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxvllm import LLM, SamplingParams
from jaxvllm.utils.compilation_cache import count_compilations
from tests.spec_decode.common import ENGINE, GREEDY, TO_THE_END, check_same_under_pressure, token_ids
from tests.spec_decode.eagle_heads import make_head, passing_head, reference_drafts

K = 4  # (at max_model_len, the last drafts' K/V would lie past it: 3 would not)
AUX = [0, 2, 3]  # the EAGLE-3 head's target layers (of 4)


def eagle_config(method: str, head, k: int = K) -> dict:
    return {"method": method, "model": str(head), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return tiny_checkpoint("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def plain(target):
    with LLM(str(target), **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """Random heads of both kinds, and heads built to agree with the tiny target now and then:
    an EAGLE head that passes the target's state through (drafting the token the target
    last chose, which a random model often repeats) and an EAGLE-3 head whose every draft
    is token 91 (the second prompt's loop)."""
    root = tmp_path_factory.mktemp("eagle")
    d = 64
    zero = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    d2t = np.zeros(256, np.int64)
    d2t[0] = 91
    return {
        "eagle": make_head(target, root / "eagle", "eagle"),
        "eagle3": make_head(target, root / "eagle3", "eagle3", draft_vocab=256, aux_layers=AUX),
        "eagle-repeat": passing_head(target, root / "eagle-repeat"),
        "eagle3-const": make_head(target, root / "eagle3-const", "eagle3", draft_vocab=256, aux_layers=AUX,
                                  **{"norm.weight": zero(d), "d2t": d2t}),
    }


def _spied(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Record each (context, drafts) a step verified, from the drafts the runner hands back
    with its tokens (under async scheduling only the device knew them before)."""
    scheduler, seen = llm.llm_engine.scheduler, []
    update = scheduler.update_from_output

    def spy(out, sampled, num_accepted=None, draft_ids=None):
        if num_accepted is not None:
            for i, (request, d) in enumerate(zip(out.scheduled.requests, out.scheduled.num_drafts.tolist())):
                if d and not request.is_finished:  # (its tokens so far: the context the drafts followed)
                    seen.append((list(request.token_ids), draft_ids[i, :d].tolist()))
        return update(out, sampled, num_accepted, draft_ids)

    scheduler.update_from_output = spy
    return seen


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_equal_the_reference_and_greedy_outputs_are_kept(method, async_scheduling, target, heads, plain):
    from transformers import AutoModelForCausalLM

    want, want_to_the_end = token_ids(plain), token_ids(plain, TO_THE_END[1], TO_THE_END[0])
    with LLM(str(target), speculative_config=eagle_config(method, heads[method]), async_scheduling=async_scheduling,
             **ENGINE) as llm:
        assert llm.llm_engine.runner.device_drafts == async_scheduling  # (async: the drafts stay on the device)
        seen = _spied(llm)
        llm.llm_engine.finish_warmup()
        with count_compilations() as counts:
            assert token_ids(llm) == want
            # (chunks of a prompt that samples nothing: the head's K/V of them written too; to
            # max_model_len: the last drafts' K/V would lie past it)
            assert token_ids(llm, TO_THE_END[1], TO_THE_END[0]) == want_to_the_end
        stats = llm.stats()
    assert counts.compilations == 0
    assert stats["spec_decode_num_drafts"] > 0
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    picked = seen[:: max(1, len(seen) // 16)]  # (contexts of every length, prompts of every request)
    assert len(picked) >= 12
    # and every one after the prompt prefilled in chunks (whose head K/V an async step once skipped)
    chunked = len(TO_THE_END[0][0]["prompt_token_ids"])
    picked += [(context, drafts) for context, drafts in seen if len(context) > chunked]
    for context, drafts in picked:
        assert drafts == reference_drafts(hf, heads[method], method, context, K, AUX)[: len(drafts)], len(context)


@pytest.mark.parametrize("method, head", [("eagle", "eagle-repeat"), ("eagle3", "eagle3-const")])
def test_heads_that_agree_get_drafts_accepted(method, head, target, heads, plain):
    with LLM(str(target), speculative_config=eagle_config(method, heads[head]), **ENGINE) as llm:
        assert token_ids(llm) == token_ids(plain)
        stats = llm.stats()
        llm.llm_engine.finish_warmup()
        params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=20, seed=3, ignore_eos=True)
        with count_compilations() as counts:
            first = token_ids(llm, params)
            assert token_ids(llm, params) == first
        assert counts.compilations == 0
    assert first == token_ids(plain, params)  # (each verified position draws what sampling without drafts would)
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


@pytest.mark.slow
def test_preemption_chunked_prefill_prefix_caching_and_n(target, heads):
    """Few KV blocks (preemption: the head's K/V is rewritten as the target recomputes),
    prompts longer than the token budget (chunks: each chunk's next tokens are the
    prompt's), shared prefixes (cache hits) and two samples a prompt."""
    engine = dict(ENGINE, num_gpu_blocks_override=16, max_num_batched_tokens=32, token_buckets=[16, 32])
    prompts = [{"prompt_token_ids": [3, 4, 5, 6] * 12 + [i]} for i in range(5)]
    check_same_under_pressure(target, eagle_config("eagle", heads["eagle-repeat"]), engine, prompts)


def test_stop_strings_inside_accepted_drafts(target, heads, plain):
    """A stop string that falls inside a step's accepted tokens ends the output there."""
    prompt = {"prompt_token_ids": [7, 8, 9]}
    full = plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    with LLM(str(target), speculative_config=eagle_config("eagle", heads["eagle-repeat"]), **ENGINE) as llm:
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        stats = llm.stats()
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, "stop", stop)
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_heads_that_do_not_fit_are_refused_before_loading(target, heads, tmp_path):
    def edited(name: str, **changes):
        folder = tmp_path / name
        folder.mkdir()
        cfg = json.loads((heads["eagle3"] / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **changes}))  # (no weights: refused before)
        return folder

    cases = [
        (edited("wide", hidden_size=96), "eagle", "hidden size 96; the target's is 64"),
        (edited("for-wide", target_hidden_size=96), "eagle3", "for a target of hidden size 96; the target's is 64"),
        (edited("vocab", vocab_size=640), "eagle3", "vocabulary of 640 tokens, the target's has 512"),
        (edited("layers", eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 4]}), "eagle3",
         r"reads target layers \[0, 1, 4\]: it needs three of the target's 4 layers"),
        (edited("hass", add_para_norm=True), "eagle", "HASS head"),
        (edited("speculators", speculators_config={"algorithm": "eagle3"}), "eagle3",
         "an EAGLE head in the speculators format"),
    ]
    for folder, method, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(str(target), speculative_config=eagle_config(method, folder), **ENGINE)
    # (vLLM also runs such a head given as the model: its verifier, with the head's drafts)
    with pytest.raises(ValueError, match="speculators.* which jaxvllm does not read"):
        LLM(str(tmp_path / "speculators"), **ENGINE)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(target), speculative_config=eagle_config("eagle", tmp_path), **ENGINE)
    for name in ("d2t", "lm_head.weight"):  # (a draft vocabulary needs both; refused before loading)
        tensors = load_file(heads["eagle3"] / "model.safetensors")
        del tensors[name]
        folder = make_head(target, tmp_path / f"no-{name}", "eagle3", draft_vocab=256, aux_layers=AUX)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=f"drafts over 256 tokens but has no {name.split('.')[0]}"):
            LLM(str(target), speculative_config=eagle_config("eagle3", folder), **ENGINE)
