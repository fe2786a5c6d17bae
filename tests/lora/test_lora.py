"""Multi-LoRA serving against HF PEFT: tiny random adapters (non-zero B, made with PEFT
itself by weights/make_lora.py) over every architecture, several adapters and the base
model in one batch, slots swapped without recompiling, the prefix cache keyed by
adapter, the engine's paths under adapters (async, preemption, chunked prefill, a
quantized base), the adapter API and every refusal."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxvllm import LLM, LLMEngine, LoRARequest, SamplingParams
from jaxvllm.config import EngineConfig
from jaxvllm.sampling_params import BeamSearchParams
from tests.models.paged import hf_greedy

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[16, 64])
PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40)]
MAX_TOKENS = 8
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ALL[:4]
# Adapters of differing ranks, targets and scalings (the MoE models' MLPs are experts:
# attention only there). Rank 8 is the engines' max_lora_rank.
ADAPTERS = [
    dict(rank=4, targets=ALL),
    dict(rank=8, targets=("q_proj", "v_proj", "down_proj"), use_rslora=True),
    dict(rank=2, targets=("k_proj", "o_proj", "up_proj"), alpha=3.0),
    dict(rank=8, targets=ALL, alpha=4.0),
    dict(rank=6, targets=("gate_proj", "down_proj", "q_proj")),
]
MOE = ("qwen3_moe", "mixtral")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def adapter(tiny_checkpoint, tmp_path_factory):
    """adapter(arch, i) -> the folder of adapter i (ADAPTERS) of the tiny `arch`, made once."""
    from weights.make_lora import make_lora

    made = {}

    def get(arch: str, i: int, base: Path | None = None) -> Path:
        if (arch, i) not in made:
            kwargs = dict(ADAPTERS[i])
            if arch in MOE:
                kwargs["targets"] = tuple(t for t in kwargs["targets"] if t in ATTENTION) or ATTENTION
            made[arch, i] = make_lora(base or tiny_checkpoint(arch), tmp_path_factory.mktemp(f"lora-{arch}-{i}"),
                                      seed=i, **kwargs)
        return made[arch, i]

    return get


def request(arch_adapter: Path, i: int) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", i + 1, str(arch_adapter))


@pytest.fixture(scope="module")
def peft_reference():
    """peft_reference(base, adapter or None, hf=None) -> (greedy ids per prompt, model):
    HF transformers with the PEFT adapter loaded, float32 (`hf`: a base model to wrap)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    done = {}

    def get(base: Path, adapter: Path | None, hf=None):
        key = (base, adapter, id(hf))
        if key not in done:
            model = hf if hf is not None else AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
            model = PeftModel.from_pretrained(model, str(adapter)) if adapter is not None else model
            model.eval()
            done[key] = (hf_greedy(model, PROMPTS, MAX_TOKENS), model)
        return done[key]

    return get


def run(llm: LLM, loras: list, prompts=PROMPTS, **params) -> list:
    """Every prompt under every entry of `loras` (None: the base model), in one generate call:
    completions [lora][prompt]."""
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    batch = [{"prompt_token_ids": p} for _ in loras for p in prompts]
    outs = llm.generate(batch, sp, lora_request=[lr for lr in loras for _ in prompts], use_tqdm=False)
    return [[o.outputs[0] for o in outs[i * len(prompts) : (i + 1) * len(prompts)]] for i in range(len(loras))]


def hf_logprobs(model, prompt: list[int], completion: list[int]) -> np.ndarray:
    """log p(completion[j] | prompt + completion[:j]) under the HF model."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(completion)), torch.tensor(completion)].numpy()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral"])
def test_mixed_batch_matches_peft(arch, tiny_checkpoint, adapter, peft_reference):
    """Three adapters and the base model in one batch: each request's greedy ids are HF
    PEFT's with its adapter, its logprobs close; the adapters change the outputs."""
    base = tiny_checkpoint(arch)
    paths = [adapter(arch, i) for i in range(3)]
    loras = [None] + [request(p, i) for i, p in enumerate(paths)]
    with LLM(base, enable_lora=True, max_loras=3, max_lora_rank=8, **ENGINE) as llm:
        got = run(llm, loras, logprobs=0)
    for lora, path, outs in zip(loras, [None] + paths, got):
        want, model = peft_reference(base, path)
        assert [list(o.token_ids) for o in outs] == want, (arch, lora)
        for prompt, o in zip(PROMPTS, outs):
            ours = np.array([step[t].logprob for step, t in zip(o.logprobs, o.token_ids)])
            np.testing.assert_allclose(ours, hf_logprobs(model, prompt, list(o.token_ids)), atol=2e-4)
    base_ids = [list(o.token_ids) for o in got[0]]
    assert all([list(o.token_ids) for o in outs] != base_ids for outs in got[1:])


@pytest.fixture(scope="module")
def llama_llm(tiny_checkpoint):
    """A LoRA engine over tiny llama: 2 device slots, 3 adapters kept on the host."""
    with LLM(tiny_checkpoint("llama"), enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
             **ENGINE) as llm:
        yield llm


def test_base_requests_are_unchanged_by_adapters_beside_them(llama_llm, tiny_checkpoint, adapter):
    """The base model's tokens and logprobs alone, and beside two adapters' requests."""
    loras = [None, request(adapter("llama", 0), 0), request(adapter("llama", 1), 1)]
    mixed = run(llama_llm, loras, logprobs=0)[0]
    alone = run(llama_llm, [None], logprobs=0)[0]
    for a, b in zip(mixed, alone):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([s[t].logprob for s, t in zip(a.logprobs, a.token_ids)],
                                   [s[t].logprob for s, t in zip(b.logprobs, b.token_ids)], atol=1e-5)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_five_adapters_swap_through_two_slots(async_scheduling, tiny_checkpoint, adapter, peft_reference,
                                              compile_counter):
    """max_loras=2 and 5 adapters (3 kept on the host): every output is PEFT's, nothing
    compiles after the warm-up, and the slot loads and adapter reads are counted."""
    base = tiny_checkpoint("llama")
    paths = [adapter("llama", i) for i in range(5)]
    loras = [request(p, i) for i, p in enumerate(paths)] + [None]
    with LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
             async_scheduling=async_scheduling, **ENGINE) as llm:
        llm.llm_engine.finish_warmup()
        before = compile_counter.count
        got = run(llm, loras)
        assert compile_counter.count == before
        stats = llm.stats()
    for path, outs in zip(paths + [None], got):
        assert [list(o.token_ids) for o in outs] == peft_reference(base, path)[0], path
    assert stats["lora_slot_loads"] >= 5 and stats["lora_adapter_reads"] >= 5
    assert stats["lora_adapters"] == 5 and len(stats["lora_slots"]) == 2


def test_prefix_cache_is_keyed_by_adapter(llama_llm, adapter):
    """The same prompt under another adapter hits no cached block; under the same one, it hits."""
    prompt = [{"prompt_token_ids": list(range(100, 140))}]  # 2 full blocks of 16
    a, b = request(adapter("llama", 0), 0), request(adapter("llama", 1), 1)
    sp = SamplingParams(temperature=0, max_tokens=2)
    llama_llm.reset_prefix_cache()
    cached = [llama_llm.generate(prompt, sp, lora_request=lr, use_tqdm=False)[0].num_cached_tokens
              for lr in (a, b, None, a, b, None)]
    assert cached == [0, 0, 0, 32, 32, 32]
    # A salt never spells an adapter's key: this one was adapter 1's whole key before.
    salted = {**prompt[0], "cache_salt": "\x00" * 8 + "\x01" + "\x00" * 7}
    assert llama_llm.generate(salted, sp, use_tqdm=False)[0].num_cached_tokens == 0


def test_an_id_added_again_reads_no_block_of_its_last_adapter(tiny_checkpoint, adapter, peft_reference):
    """remove_lora, then another adapter (or the same folder, retrained) under the same id:
    the prefix cached with the first must not serve it (vLLM keys blocks on name and path)."""
    base = tiny_checkpoint("llama")
    first, second = adapter("llama", 0), adapter("llama", 1)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def generate(llm, lora):
        outs = llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]

    with LLM(base, enable_lora=True, max_lora_rank=8, **ENGINE) as llm:
        tokens, fresh = generate(llm, LoRARequest("a", 3, str(first)))  # (the prompts share their first tokens)
        assert tokens == peft_reference(base, first)[0]
        assert llm.llm_engine.remove_lora(3)
        assert generate(llm, LoRARequest("b", 3, str(second))) == (peft_reference(base, second)[0], fresh)
        assert generate(llm, LoRARequest("b", 3, str(second)))[1] == [0, 16, 32]  # (the same reading hits)


def test_preemption_and_chunked_prefill_under_adapters(tiny_checkpoint, adapter, peft_reference):
    """Few KV blocks (requests preempted and recomputed) and 16-token steps (prompts in
    chunks), adapters in every step: the outputs stay PEFT's."""
    base = tiny_checkpoint("llama")
    paths = [adapter("llama", i) for i in range(2)]
    loras = [request(p, i) for i, p in enumerate(paths)] + [None]
    with LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=64, max_num_seqs=8,
             max_num_batched_tokens=16, token_buckets=[16], num_gpu_blocks_override=20, block_size=4) as llm:
        got = run(llm, loras)
        assert llm.stats()["num_preemptions"] > 0
    for path, outs in zip(paths + [None], got):
        assert [list(o.token_ids) for o in outs] == peft_reference(base, path)[0], path


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_speculative_decoding_under_adapters(method, tiny_checkpoint, adapter, peft_reference, compile_counter,
                                             tmp_path):
    """Drafts verified by the target with each request's adapter, as vLLM does: the drafter
    (a draft model, an EAGLE head; both on the device under async scheduling) runs the base
    model. Outputs stay PEFT's, adapters and base in one batch, drafts are accepted, and
    nothing compiles after the warm-up."""
    from tests.spec_decode.eagle_heads import passing_head

    base = tiny_checkpoint("llama")
    paths = [adapter("llama", i) for i in range(2)]
    loras = [request(p, i) for i, p in enumerate(paths)] + [None]
    spec = {"method": method, "num_speculative_tokens": 3}
    spec.update({"ngram": dict(prompt_lookup_max=3, prompt_lookup_min=1), "draft_model": dict(model=str(base)),
                 "eagle": dict(model=str(passing_head(base, tmp_path / "head")))}[method])
    prompts = PROMPTS + [[7, 8, 9] * 5]  # (a repeating prompt: n-gram drafts)
    with LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, speculative_config=spec, **ENGINE) as llm:
        llm.llm_engine.finish_warmup()
        before = compile_counter.count
        got = run(llm, loras, prompts)
        assert compile_counter.count == before
        stats = llm.stats()
    for path, outs in zip(paths + [None], got):
        assert [list(o.token_ids) for o in outs[: len(PROMPTS)]] == peft_reference(base, path)[0], path
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_adapter_over_a_quantized_base(tiny_checkpoint, adapter, peft_reference, tmp_path):
    """A GPTQ 4-bit base (W4A16: an exact oracle) with an adapter in float32: PEFT's over
    the HF model holding the dequantized weights."""
    from tests.models.test_int4 import unpacked_hf
    from weights.make_quantized import make_gptq

    base = tiny_checkpoint("llama")
    gptq = make_gptq(base, tmp_path / "gptq", 32, True)
    path = adapter("llama", 0)
    with LLM(gptq, enable_lora=True, max_lora_rank=8, **ENGINE) as llm:
        got = run(llm, [request(path, 0), None])
    assert [list(o.token_ids) for o in got[0]] == peft_reference(gptq, path, unpacked_hf(gptq, base))[0]
    assert [list(o.token_ids) for o in got[1]] == peft_reference(gptq, None, unpacked_hf(gptq, base))[0]
    assert got[0] != got[1]


def test_adapter_api(llama_llm, adapter, tiny_checkpoint):
    """vLLM's add_lora / list_loras / pin_lora / remove_lora; LLMEngine.add_request, chat
    and beam_search take lora_request."""
    engine = llama_llm.llm_engine
    a, b = request(adapter("llama", 0), 0), request(adapter("llama", 1), 1)
    assert engine.add_lora(a) and engine.add_lora(b)
    assert {1, 2} <= engine.list_loras()
    assert engine.pin_lora(1)
    greedy = SamplingParams(max_tokens=3, temperature=0)
    want = llama_llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy, lora_request=b, use_tqdm=False)
    engine.add_request("r", {"prompt_token_ids": PROMPTS[0]}, greedy, lora_request=b)
    engine.step()
    # As vLLM's: removed while a request uses it, it is read again for the request, which goes on
    assert engine.remove_lora(2) and 2 not in engine.list_loras()
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    assert done[-1].finished and done[-1].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert 2 in engine.list_loras()
    assert engine.remove_lora(2) and 2 not in engine.list_loras() and not engine.remove_lora(2)
    beams = llama_llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=2, max_tokens=3),
                                  lora_request=a)
    plain = llama_llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=2, max_tokens=3))
    assert len(beams[0].sequences) == 2 and beams[0].sequences[0].tokens != plain[0].sequences[0].tokens
    assert all(s.lora_request is a for s in beams[0].sequences) and plain[0].sequences[0].lora_request is None
    chat = [{"role": "user", "content": "hi"}]
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with_lora = llama_llm.chat(chat, sp, chat_template=template, lora_request=a, use_tqdm=False)
    without = llama_llm.chat(chat, sp, chat_template=template, use_tqdm=False)
    assert with_lora[0].outputs[0].token_ids != without[0].outputs[0].token_ids
    assert with_lora[0].lora_request is a and with_lora[0].outputs[0].lora_request is a  # (vLLM's fields)
    assert without[0].lora_request is None and without[0].outputs[0].lora_request is None


def test_an_id_removed_while_in_use_is_free_once_unused(llama_llm, adapter):
    """remove_lora while a request uses the id: once that request ends without reading the
    adapter again (aborted), the id may name another folder, read as new weights."""
    engine, prompt = llama_llm.llm_engine, {"prompt_token_ids": PROMPTS[0]}
    first, second = LoRARequest("first", 7, str(adapter("llama", 0))), LoRARequest("second", 7, str(adapter("llama", 1)))
    engine.add_request("waiting", prompt, SamplingParams(max_tokens=3), lora_request=first)
    assert engine.remove_lora(7) and 7 not in engine.list_loras()
    engine.abort_request("waiting")
    greedy = SamplingParams(max_tokens=4, temperature=0)
    got = llama_llm.generate(prompt, greedy, lora_request=second, use_tqdm=False)[0].outputs[0].token_ids
    want = llama_llm.generate(prompt, greedy, lora_request=LoRARequest("second-again", 8, second.lora_path),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert got == want and engine.remove_lora(7) and engine.remove_lora(8)


def test_list_loras_is_the_host_cache(tiny_checkpoint, adapter):
    """As vLLM's (its tests/lora/test_lora_functions.py): list_loras is the max_cpu_loras
    adapters held on the host, least recently used dropped but pinned kept; removing or
    pinning one dropped is refused as vLLM refuses it, and a request reads it again."""
    path = adapter("llama", 0)
    with LLM(tiny_checkpoint("llama"), enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
             **ENGINE) as llm:
        engine = llm.llm_engine
        mk = lambda i: LoRARequest(f"{i}", i, str(path))  # noqa: E731
        assert engine.add_lora(mk(1)) and engine.add_lora(mk(2)) and engine.pin_lora(1)
        for i in (3, 4, 5):
            engine.add_lora(mk(i))
        assert engine.list_loras() == {1, 4, 5}
        assert not engine.remove_lora(2)
        with pytest.raises(ValueError, match="Pinning failed. LoRA 3 is not registered."):
            engine.pin_lora(3)
        assert engine.remove_lora(1) and engine.list_loras() == {4, 5}
        llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2), lora_request=mk(2),
                     use_tqdm=False)
        assert engine.list_loras() == {2, 4, 5}


def test_lora_engine_arguments_as_vllm_reads_them():
    """vLLM 0.11's LoRA arguments: max_cpu_loras 0 means max_loras, lora_dtype may be a torch
    dtype, fully_sharded_loras and lora_extra_vocab_size are taken (nothing changes here),
    and without enable_lora none is read; multimodal default adapters are refused."""
    config = EngineConfig(model="m", enable_lora=True, max_loras=2, max_cpu_loras=0, fully_sharded_loras=True,
                          lora_extra_vocab_size=512, lora_dtype=torch.bfloat16)
    assert (config.max_cpu_loras, config.lora_dtype, config.fully_sharded_loras) == (2, "bfloat16", True)
    assert EngineConfig(model="m", max_loras=0, lora_dtype="int8").max_loras == 0
    with pytest.raises(ValueError, match="default_mm_loras: multimodal models are not supported"):
        EngineConfig(model="m", default_mm_loras={"image": "/adapters/vision"})


def _edit_config(src: Path, out: Path, **changes) -> Path:
    shutil.copytree(src, out)
    config = json.loads((out / "adapter_config.json").read_text())
    config.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def test_refusals(llama_llm, adapter, tiny_checkpoint, tmp_path):
    """Each refused with a message naming what is not supported; nothing is queued and the
    engine keeps serving."""
    from weights.make_lora import make_lora

    good = adapter("llama", 0)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with LLM(tiny_checkpoint("llama"), **ENGINE) as plain:
        with pytest.raises(ValueError, match="LoRA adapters need an engine started with enable_lora=True"):
            plain.generate(prompt, lora_request=request(good, 0), use_tqdm=False)
        assert not plain.llm_engine.has_unfinished_requests()
    cases = [
        (_edit_config(good, tmp_path / "dora", use_dora=True), r"DoRA \(use_dora=True\) is not supported"),
        (_edit_config(good, tmp_path / "bias", bias="all"), r"bias='all' is not supported \(only 'none'\)"),
        (_edit_config(good, tmp_path / "r", r=16), r"rank 16 is above max_lora_rank=8"),
        (make_lora(tiny_checkpoint("llama"), tmp_path / "lm_head", rank=4, targets=("lm_head",)),
         r"adapters on embed_tokens / lm_head are not supported"),
        (make_lora(tiny_checkpoint("llama"), tmp_path / "embed", rank=4, targets=("embed_tokens",)),
         r"adapters on embed_tokens / lm_head are not supported"),
        (make_lora(tiny_checkpoint("llama", intermediate_size=96), tmp_path / "shape", rank=4, targets=("up_proj",)),
         r"base_model.model.model.layers.0.mlp.up_proj.lora_B.weight has shape \(96, 4\); the base model's "
         r"model.layers.0.mlp.up_proj needs \(128, 4\)"),
        # a smaller model's adapter: B's rows divide the weight's, and were once taken as KV heads repeated
        (make_lora(tiny_checkpoint("llama", intermediate_size=64), tmp_path / "half", rank=4, targets=("up_proj",)),
         r"up_proj.lora_B.weight has shape \(64, 4\); the base model's model.layers.0.mlp.up_proj needs \(128, 4\)"),
        (make_lora(tiny_checkpoint("llama", num_key_value_heads=1), tmp_path / "kv1", rank=4, targets=("v_proj",)),
         r"v_proj.lora_B.weight has shape \(16, 4\); the base model's model.layers.0.self_attn.v_proj needs "
         r"\(32, 4\)"),
        (make_lora(tiny_checkpoint("llama", num_hidden_layers=3), tmp_path / "layers", rank=4, targets=("q_proj",)),
         r"target module 'model.layers.2.self_attn.q_proj' is not one the model has an adapter slot for"),
        (make_lora(tiny_checkpoint("llama"), tmp_path / "big", rank=16, targets=("q_proj",)),
         r"rank 16 is above max_lora_rank=8; start the engine with max_lora_rank=16 or more"),
        (tmp_path / "missing", r"no adapter_config.json there"),
    ]
    for name, text in (("json", "{'r': 8"), ("list", "[8]")):
        broken = shutil.copytree(good, tmp_path / name)
        (broken / "adapter_config.json").write_text(text)
        cases.append((broken, r"adapter_config.json (is not valid JSON|holds a list, not a JSON object)"))
    # (a missing lora_alpha is PEFT's 8, not r: vLLM refuses the file, as here)
    no_alpha = shutil.copytree(good, tmp_path / "no-alpha")
    config = json.loads((no_alpha / "adapter_config.json").read_text())
    del config["lora_alpha"], config["target_modules"]
    (no_alpha / "adapter_config.json").write_text(json.dumps(config))
    cases.append((no_alpha, r"adapter_config.json lacks \['lora_alpha', 'target_modules'\]: vLLM's required fields"))
    bin_dir = shutil.copytree(good, tmp_path / "bin")
    (bin_dir / "adapter_model.safetensors").rename(bin_dir / "adapter_model.bin")
    cases.append((bin_dir, r"adapter_model.bin \(a pickled torch file\) is not supported"))
    for i, (path, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            llama_llm.generate([prompt, prompt], lora_request=[None, LoRARequest(f"bad{i}", 100 + i, str(path))],
                               use_tqdm=False)
        assert not llama_llm.llm_engine.has_unfinished_requests()
        assert 100 + i not in llama_llm.llm_engine.list_loras()
    run(llama_llm, [request(good, 0)])  # (id 1 is adapter-0's, whichever tests ran before)
    with pytest.raises(ValueError, match=r"lora_int_id 1 is adapter 'adapter-0'"):
        llama_llm.generate(prompt, lora_request=LoRARequest("other", 1, str(adapter("llama", 1))), use_tqdm=False)
    for bad in (0, 2**63):  # (ids are int64 on the device)
        with pytest.raises(ValueError, match=r"lora_int_id must be an int from 1 to 2\*\*63 - 1"):
            LoRARequest("x", bad, str(good))
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be an int >= max_loras \(2\)"):
        EngineConfig(model="m", enable_lora=True, max_loras=2, max_cpu_loras=1)
    # still serving, adapters and all
    assert len(run(llama_llm, [request(good, 0), None])[0]) == len(PROMPTS)


def test_engine_from_config_takes_lora_request(tiny_checkpoint, adapter):
    """LLMEngine.add_request(..., lora_request=) on an engine built from its config."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), enable_lora=True, max_lora_rank=8,
                                    **ENGINE))
    engine.add_request("x", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=2, temperature=0),
                       lora_request=request(adapter("llama", 0), 0))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs[-1].outputs[0].token_ids) == 2 and engine.stats()["lora_slot_loads"] == 1
    engine.shutdown()


def test_lora_request_takes_vllm_0_11s_fields(adapter):
    """vLLM 0.11's LoRARequest fields in its order: lora_local_path (deprecated, warned, the
    path when lora_path is not given), long_lora_max_len and tensorizer_config_dict (refused:
    not supported here)."""
    path = str(adapter("llama", 0))
    with pytest.warns(DeprecationWarning, match="lora_local_path is deprecated"):
        old, positional = LoRARequest("old", 1, lora_local_path=path), LoRARequest("positional", 2, "", path)
    assert old.lora_path == path == positional.path
    # (vLLM's get_adapter_absolute_path expands "~"; one folder named relative and absolute is one)
    home = LoRARequest("home", 4, "~/adapters/x")
    assert home.lora_path == os.path.join(os.path.expanduser("~"), "adapters", "x")
    from jaxvllm.lora.manager import _same_folder

    relative = LoRARequest("relative", 5, os.path.relpath(path))
    assert relative.lora_path == os.path.relpath(path) and _same_folder(relative, old)
    with pytest.raises(ValueError, match="long_lora_max_len=4096: long-context LoRA is not supported"):
        LoRARequest("long", 3, path, long_lora_max_len=4096)
    # its 7th: an adapter serialized with tensorizer (refused), None taken by position too
    assert LoRARequest("seven", 6, path, None, None, "base", None).base_model_name == "base"
    with pytest.raises(ValueError, match="tensorizer_config_dict .* is not supported by jaxvllm"):
        LoRARequest("tensorized", 7, path, tensorizer_config_dict={"tensorizer_dir": "/x"})


def test_tensor_and_data_parallel(tiny_checkpoint, adapter, peft_reference):
    """TP 2 and 4 (KV heads repeated) and 2 replicas in a process of 4 CPU devices: PEFT's
    ids, with B split where the weight's outputs are (q/k/v, gate/up) and A where its inputs
    are (o, down)."""
    base = tiny_checkpoint("llama")
    paths = [adapter("llama", i) for i in range(2)]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "lora" / "tensor_parallel_worker.py"), str(base),
                           *map(str, paths)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("tp2", "tp4", "dp2"):
        for path, got in zip([None] + paths, results[key]):
            assert got == peft_reference(base, path)[0], (key, path)
    assert results["dp2 replaced"] == peft_reference(base, paths[1])[0] * 2
    assert results["dp2 replaced per replica"] == [str(paths[1])] * 2
    for key in ("tp2", "tp4"):
        specs = results[f"specs {key}"]
        # A [rows, slots, P R, *in], then B [rows, slots, *part out, R] of each part
        assert specs["qkv_proj"] == [[], *[[None, None, "tp"]] * 3]  # q, k, v split on heads
        assert specs["gate_up_proj"] == [[], *[[None, None, "tp"]] * 2]  # gate, up on columns
        assert specs["o_proj"] == [[None, None, None, "tp"], []]  # in: [heads, head_dim]
        assert specs["down_proj"] == [[None, None, None, "tp"], []]  # in: [intermediate]


@pytest.mark.parametrize("arch,backend", [("llama", "reference"), ("qwen3_moe", "pallas")])
def test_stacked_layout_under_adapters(arch, backend, tiny_checkpoint, adapter, peft_reference, monkeypatch):
    """A GPU's layout on a CPU (layer weights stacked, q/k/v and gate/up apart; the Pallas
    kernels interpreted): PEFT's ids."""
    import jaxvllm.loader as loader

    monkeypatch.setattr(loader, "stacks_layers", lambda device: True)
    base = tiny_checkpoint(arch)
    paths = [adapter(arch, i) for i in range(2)]
    loras = [None] + [request(p, i) for i, p in enumerate(paths)]
    with LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, attention_backend=backend, **ENGINE) as llm:
        assert "q_proj" in llm.llm_engine.runner.lora.stacks
        got = run(llm, loras)
    for path, outs in zip([None] + paths, got):
        assert [list(o.token_ids) for o in outs] == peft_reference(base, path)[0], path


def test_ray_data_rows_carry_a_lora_path(tiny_checkpoint, adapter, peft_reference):
    """A replica's predictor (in process): rows with `lora_path` (or null) get PEFT's ids."""
    import pyarrow as pa

    from jaxvllm.integrations.ray import JaxvllmPredictor, JaxvllmProcessorConfig

    base, path = tiny_checkpoint("llama"), adapter("llama", 0)
    config = JaxvllmProcessorConfig(model=base, engine_kwargs=dict(enable_lora=True, max_lora_rank=8, **ENGINE))
    predictor = JaxvllmPredictor(config)
    params = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    rows = [{"prompt_token_ids": p, "lora_path": lp, "sampling_params": params}
            for lp in (str(path), None) for p in PROMPTS]
    out = predictor(pa.Table.from_pylist(rows)).to_pylist()
    predictor.llm.shutdown()
    assert [r["generated_tokens"] for r in out] == peft_reference(base, path)[0] + peft_reference(base, None)[0]


def test_lm_eval_lora_local_path(tiny_checkpoint, adapter, peft_reference):
    """lm-eval's `lora_local_path` model argument: loglikelihoods under the adapter are
    PEFT's, and differ from the base model's."""
    from lm_eval.api.instance import Instance

    from jaxvllm.integrations.lm_eval import JaxvllmLM

    base, path = tiny_checkpoint("llama"), adapter("llama", 0)
    lm = JaxvllmLM(pretrained=str(base), lora_local_path=str(path), max_lora_rank=8, **ENGINE)
    pairs = [("hello there", " world"), ("the quick brown", " fox jumps")]
    scores = [s for s, _ in lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                                             disable_tqdm=True)]
    tokenizer = lm.tokenizer
    lm.shutdown()
    model = peft_reference(base, path)[1]
    for (context, continuation), score in zip(pairs, scores):
        whole = tokenizer(context + continuation).input_ids
        ctx = tokenizer(context).input_ids
        want = hf_logprobs(model, ctx, whole[len(ctx):]).sum()
        assert score == pytest.approx(float(want), abs=1e-4)


def test_a_failed_slot_load_leaves_the_engine_usable(llama_llm, adapter, peft_reference, tiny_checkpoint):
    """A slot write that raises after consuming the donated stacks (as a device error
    would): generate raises, the next one gives PEFT's ids again, slots loaded anew."""
    manager = llama_llm.llm_engine.runner.lora
    path = adapter("llama", 3)
    write = manager._write

    def failing(stacks, slot, arrays):
        write(stacks, slot, arrays)  # the stacks are donated: gone from here on
        raise RuntimeError("injected failure after the slot write")

    manager._write = failing
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            run(llama_llm, [request(path, 3)])
    finally:
        manager._write = write
    assert not llama_llm.llm_engine.has_unfinished_requests()
    got = run(llama_llm, [request(path, 3), None])
    base = tiny_checkpoint("llama")
    assert [list(o.token_ids) for o in got[0]] == peft_reference(base, path)[0]
    assert [list(o.token_ids) for o in got[1]] == peft_reference(base, None)[0]
    # The same in add_lora, which writes a replaced adapter (id 4, from another folder now) into
    # its slot: the next generate read consumed stacks ("Array has been deleted") before.
    other = LoRARequest("replaced", 4, str(adapter("llama", 2)))
    manager._write = failing
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            llama_llm.add_lora(other)
    finally:
        manager._write = write
    got = run(llama_llm, [other])
    assert [list(o.token_ids) for o in got[0]] == peft_reference(base, adapter("llama", 2))[0]


def test_command_line_and_benchmark(tiny_checkpoint, adapter, peft_reference, tmp_path):
    """`jaxvllm generate --lora FOLDER` gives PEFT's ids; `bench throughput --num-loras 2`
    reports the adapters' time against the base model's (random adapters, dummy:tiny)."""
    from jaxvllm.cli import main

    base, path = tiny_checkpoint("llama"), adapter("llama", 1)
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in PROMPTS))
    engine = ["--max-model-len", "128", "--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--max-lora-rank", "8"]
    assert main(["generate", "--model", str(base), *engine, "--lora", str(path), "--prompts-file", str(prompts),
                 "--output", str(out), "--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
                 "--disable-tqdm"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["outputs"][0]["token_ids"] for r in records] == peft_reference(base, path)[0]

    report = tmp_path / "bench.json"
    assert main(["bench", "throughput", "--model", "dummy:tiny", "--num-prompts", "8", "--input-len", "16",
                 "--output-len", "8", "--num-loras", "2", "--max-lora-rank", "8", "--max-model-len", "64",
                 "--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--disable-tqdm",
                 "--output-json", str(report)]) == 0
    lora = json.loads(report.read_text())["lora"]
    assert lora["num_loras"] == 2 and lora["max_loras"] == 2 and lora["slot_loads"] == 2
    assert lora["time_ratio"] > 0 and lora["adapters"] == ["random-0", "random-1"]


def test_an_adapter_waiting_for_a_slot_is_not_starved(llama_llm, adapter):
    """max_loras=2 with adapters 1 and 2 running: a request for adapter 3 waits, and the
    requests for adapters 1 and 2 that came after it wait behind it (base requests do not)."""
    a, b, c = (request(adapter("llama", i), i) for i in range(3))
    order = [a, b, c, a, b, None]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llama_llm.generate([{"prompt_token_ids": PROMPTS[1]}] * len(order), sp, lora_request=order, use_tqdm=False)
    first = [o.metrics.first_scheduled_time for o in outs]
    assert first[2] > first[0] and first[2] > first[1]  # adapter 3 waited for a slot
    assert first[3] >= first[2] and first[4] >= first[2]  # the later 1 and 2 did not pass it
    assert first[5] < first[2]  # the base request went ahead


def test_add_lora_with_an_existing_id_replaces_it(tiny_checkpoint, adapter, peft_reference, compile_counter, tmp_path):
    """Adapter-only RL: add_lora under an id in use (and in a device slot) with another
    folder, or with its folder saved again, replaces the adapter, slot included, with no
    recompile. Added again unchanged it is only touched, as vLLM's: no read, and its
    cached blocks still serve it."""
    base = tiny_checkpoint("llama")
    first, second = adapter("llama", 0), adapter("llama", 4)
    folder = shutil.copytree(first, tmp_path / "policy")
    policy = LoRARequest("policy", 7, str(folder))
    with LLM(base, enable_lora=True, max_lora_rank=8, **ENGINE) as llm:
        engine, manager = llm.llm_engine, llm.llm_engine.runner.lora
        assert [list(o.token_ids) for o in run(llm, [policy])[0]] == peft_reference(base, first)[0]
        reads, before = manager.host_reads, compile_counter.count
        assert engine.add_lora(policy) and manager.host_reads == reads  # (unchanged: touched only)
        assert engine.add_lora(LoRARequest("policy", 7, str(folder) + "/")) and manager.host_reads == reads
        outs = run(llm, [policy])[0]
        assert manager.host_reads == reads and [list(o.token_ids) for o in outs] == peft_reference(base, first)[0]
        cached = llm.generate({"prompt_token_ids": PROMPTS[2]}, SamplingParams(max_tokens=1), lora_request=policy,
                              use_tqdm=False)[0].num_cached_tokens
        assert cached == 32
        # A base request unfinished does not stop it; one that uses the adapter does.
        engine.add_request("base", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2))
        engine.add_request("user", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2),
                           lora_request=policy)
        shutil.copytree(second, folder, dirs_exist_ok=True)  # (saved again, trained further)
        with pytest.raises(RuntimeError, match=r"add_lora would replace adapter 7 while unfinished requests use "
                                               r"it \['user'\]"):
            engine.add_lora(policy)
        engine.abort_request(["user"])
        assert engine.add_lora(policy) and manager.host_reads == reads + 1
        while engine.has_unfinished_requests():
            engine.step()
        assert [list(o.token_ids) for o in run(llm, [policy])[0]] == peft_reference(base, second)[0]
        assert llm.generate({"prompt_token_ids": PROMPTS[2]}, SamplingParams(max_tokens=1), lora_request=policy,
                            use_tqdm=False)[0].num_cached_tokens == 32  # (the new reading's own blocks)
        # another folder under the same id
        assert engine.add_lora(LoRARequest("policy", 7, str(first)))
        assert [list(o.token_ids) for o in run(llm, [LoRARequest("policy", 7, str(first))])[0]] == \
            peft_reference(base, first)[0]
        assert compile_counter.count == before


@pytest.mark.parametrize("merge,dtype", [("", "float32"), ("kv_groups", "float32"), ("side_by_side", "bfloat16")])
def test_grouped_delta_equals_the_dense_one(merge, dtype):
    """The SGMV form (tokens sorted by slot, the Pallas grouped matmul, interpreted here)
    against the dense masked form, with tokens of every slot and of none, in batch order."""
    import jax.numpy as jnp

    from jaxvllm.lora.weights import LoRAWeight, lora_delta, lora_groups

    rng = np.random.default_rng(0)
    slots_n, rank, t, hidden = 3, 8, 37, 64
    parts = {"": [(4, 16)], "kv_groups": [(4, 16), (2, 16), (2, 16)], "side_by_side": [(96,), (96,)]}[merge]
    dt = jnp.dtype(dtype)
    a = jnp.asarray(rng.standard_normal((slots_n, len(parts) * rank, hidden)) * 0.1, dt)
    bs = tuple(jnp.asarray(rng.standard_normal((slots_n, *out, rank)) * 0.1, dt) for out in parts)
    x = jnp.asarray(rng.standard_normal((t, hidden)), dt)
    slots = jnp.asarray(rng.integers(-1, slots_n, t), jnp.int32)
    dense = lora_delta(x, LoRAWeight(None, a, bs, slots, merge))
    grouped = lora_delta(x, LoRAWeight(None, a, bs, slots, merge, lora_groups(slots, slots_n)))
    assert grouped.shape == dense.shape
    np.testing.assert_allclose(np.asarray(grouped, np.float32), np.asarray(dense, np.float32),
                               atol=1e-5 if dtype == "float32" else 2e-2, rtol=1e-5 if dtype == "float32" else 2e-2)
    assert not np.asarray(dense, np.float32)[np.asarray(slots) < 0].any()


def test_lora_dtype(tiny_checkpoint, adapter, peft_reference):
    """lora_dtype="bfloat16" over a float32 model: the slots are bfloat16, and the greedy
    ids stay PEFT's (float32) on these tiny adapters."""
    import jax
    import jax.numpy as jnp

    base, path = tiny_checkpoint("llama"), adapter("llama", 0)
    with LLM(base, enable_lora=True, max_lora_rank=8, lora_dtype="bfloat16", **ENGINE) as llm:
        got = run(llm, [request(path, 0)])
        dtypes = {x.dtype for x in jax.tree.leaves(llm.llm_engine.runner.lora.stacks)}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    assert [list(o.token_ids) for o in got[0]] == peft_reference(base, path)[0]
