"""A LoRA adapter trained on the real SmolLM2-135M-Instruct (weights/train_lora.py: English
questions, French answers), for a behaviour you can see: with the adapter, jaxvllm answers
held-out English questions in French, token for token as HF PEFT does; without it, in English."""

from __future__ import annotations

import pytest
import torch

from jaxvllm import LLM, LoRARequest, SamplingParams
from tests.models.paged import hf_greedy
from weights.train_lora import HELD_OUT, _ids, chat, french_share, train

pytestmark = pytest.mark.slow
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def french(smollm2_path, tmp_path_factory):
    # the last half of the 30 layers: the backward pass stops at layer 15, half the cost of training all
    return train(smollm2_path, tmp_path_factory.mktemp("lora-french"), steps=12, layers=list(range(15, 30)))


def test_trained_adapter_answers_in_french_as_peft(smollm2_path, french):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with LLM(str(smollm2_path), dtype="float32", enable_lora=True, max_lora_rank=16, max_model_len=256,
             max_num_batched_tokens=128, max_num_seqs=8, token_buckets=[16, 128]) as llm:
        tokenizer = llm.get_tokenizer()
        messages = [[{"role": "user", "content": q}] for q in HELD_OUT]
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        adapted = llm.chat(messages, sp, lora_request=LoRARequest("french", 1, str(french)), use_tqdm=False)
        plain = llm.chat(messages, sp, use_tqdm=False)
    prompts = [_ids(chat(tokenizer, q)) for q in HELD_OUT]
    assert [o.prompt_token_ids for o in adapted] == prompts
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    assert [list(o.outputs[0].token_ids) for o in plain] == hf_greedy(base, prompts, MAX_TOKENS)
    peft_model = PeftModel.from_pretrained(base, str(french)).eval()
    assert [list(o.outputs[0].token_ids) for o in adapted] == hf_greedy(peft_model, prompts, MAX_TOKENS)
    french_texts = [o.outputs[0].text for o in adapted]
    english_texts = [o.outputs[0].text for o in plain]
    assert min(map(french_share, french_texts)) >= 0.2, french_texts
    assert max(map(french_share, english_texts)) < 0.1, english_texts
