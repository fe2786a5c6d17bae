"""LLM.beam_search: vLLM's algorithm, checked against HF beam search and a plain re-implementation
over HF's logprobs (EOS handling, length penalty), plus the API's edges."""

import math

import pytest
import torch
from transformers import GenerationConfig

from jaxvllm import LLM, BeamSearchOutput, BeamSearchParams, BeamSearchSequence, SamplingParams
from tests.conftest import ARCHS

ENGINE = dict(max_model_len=64, max_num_seqs=16, max_num_batched_tokens=64, token_buckets=[64])
MAX_TOKENS = 6
WIDTHS = (1, 2, 4)
TOKEN_PROMPT = [5, 17, 300, 42, 99, 7]


@pytest.fixture(scope="module")
def llms(tiny_checkpoint):
    """llms(arch) -> (checkpoint path, LLM), one engine per architecture for the module."""
    made: dict = {}

    def get(arch: str):
        if arch not in made:
            path = tiny_checkpoint(arch)
            made[arch] = path, LLM(path, **ENGINE)
        return made[arch]

    yield get
    for _, llm in made.values():
        llm.shutdown()


def hf_beam_search(model, prompt: list[int], width: int, max_new_tokens: int) -> list[list[int]]:
    """HF's beam search with EOS switched off (an id no token has): with `ignore_eos=True` ours
    must pick the same beams. (eos_token_id=None would be filled in from the checkpoint's
    generation config.)"""
    config = GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=max_new_tokens, eos_token_id=model.config.vocab_size, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             generation_config=config)
    return out.tolist()


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """Row i: the log-probabilities of the token after tokens[: i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def score(tokens: list[int], cum_logprob: float, length_penalty: float, ends=()) -> float:
    """vLLM's beam score, written out: the length counts every token, the prompt's included,
    but a final end id."""
    return cum_logprob / ((len(tokens) - (tokens[-1] in ends)) ** length_penalty)


def reference_beam_search(model, prompt, width, steps, ends, length_penalty, ignore_eos):
    """vLLM's algorithm over HF's logprobs, the plain way: (tokens, cum_logprob), best first."""
    beams, completed = [(list(prompt), 0.0)], []
    rank = lambda b: score(b[0], b[1], length_penalty, ends)  # noqa: E731
    for _ in range(steps):
        candidates = []
        for tokens, cum in beams:
            top = torch.topk(hf_logprobs(model, tokens)[-1], 2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                new = (tokens + [token], cum + logprob)
                (completed if token in ends and not ignore_eos else candidates).append(new)
        beams = sorted(candidates, key=rank, reverse=True)[:width]
    return sorted(completed + beams, key=rank, reverse=True)[:width]


def test_beam_search_sequence_fields_in_vllms_order():
    """vLLM's positional order: tokens, logprobs, lora_request, cum_logprob, text, finish_reason, stop_reason."""
    seq = BeamSearchSequence([1, 2], [], None, -0.5, "txt", "stop", 7)
    assert (seq.lora_request, seq.cum_logprob, seq.text, seq.finish_reason, seq.stop_reason) == (None, -0.5, "txt",
                                                                                                "stop", 7)


def check_sequence(seq: BeamSearchSequence, prompt: list[int], tokenizer) -> None:
    """What every returned sequence satisfies: the prompt leads its tokens, one logprob dict
    per generated token, cum_logprob is their sum, text decodes all tokens, the special ones
    included (as vLLM's `tokenizer.decode(beam.tokens)`)."""
    assert isinstance(seq, BeamSearchSequence) and seq.tokens[: len(prompt)] == prompt
    generated = seq.tokens[len(prompt):]
    assert len(seq.logprobs) == len(generated)
    assert all(t in step for t, step in zip(generated, seq.logprobs))
    assert seq.cum_logprob == pytest.approx(sum(step[t].logprob for t, step in zip(generated, seq.logprobs)), abs=1e-5)
    assert seq.text == tokenizer.decode(seq.tokens)


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_hf_beam_search(arch, llms, hf_model):
    """Same beams as HF's `generate(num_beams=k, num_return_sequences=k)`, best first, at every
    width, with cum_logprob equal to HF's log-probability of the generated tokens."""
    path, llm = llms(arch)
    model, tokenizer = hf_model(path), llm.get_tokenizer()
    text = "Hello, my name is"
    prompts = [TOKEN_PROMPT, tokenizer(text).input_ids]
    for width in WIDTHS:
        outputs = llm.beam_search([{"prompt_token_ids": TOKEN_PROMPT}, {"prompt": text}],
                                  BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert len(outputs) == 2 and all(isinstance(o, BeamSearchOutput) for o in outputs)
        for prompt, output in zip(prompts, outputs):
            assert [s.tokens for s in output.sequences] == hf_beam_search(model, prompt, width, MAX_TOKENS), width
            # (EOS never reaches these beams: HF's stopping rules for finished beams are its own.)
            assert all(tokenizer.eos_token_id not in s.tokens for s in output.sequences)
            for seq in output.sequences:
                check_sequence(seq, prompt, tokenizer)
                assert seq.finish_reason == "length" and seq.stop_reason is None
                rows = hf_logprobs(model, seq.tokens)[len(prompt) - 1: -1]
                hf_cum = rows.gather(1, torch.tensor(seq.tokens[len(prompt):])[:, None]).sum().item()
                assert seq.cum_logprob == pytest.approx(hf_cum, abs=1e-3)


@pytest.fixture(scope="module")
def eos_case(llms, hf_model, tmp_path_factory):
    """qwen3 whose generation_config.json adds, as Llama 3 and Qwen instruct models do, an end
    id: the third token of the greedy completion of TOKEN_PROMPT, so that the best beam meets
    it at its third step (the tiny model's own EOS is never a top candidate). Beam search
    ends beams at the tokenizer's EOS and those ids, as vLLM's."""
    import json
    import shutil

    path, llm = llms("qwen3")
    greedy = llm.generate({"prompt_token_ids": TOKEN_PROMPT}, SamplingParams(temperature=0, max_tokens=3),
                          use_tqdm=False)[0].outputs[0].token_ids
    end = greedy[2]
    assert end not in greedy[:2] and end not in TOKEN_PROMPT
    copy = tmp_path_factory.mktemp("eos") / "qwen3"
    shutil.copytree(path, copy)
    eos = llm.get_tokenizer().eos_token_id
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, end]}))
    with LLM(copy, **ENGINE) as ended:
        yield ended, hf_model(path), end, {eos, end}


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 3.0])
def test_eos_and_length_penalty_follow_vllm(eos_case, length_penalty):
    """A candidate end id finishes its beam (finish_reason "stop", kept with its end id);
    finished and live beams are ranked together by cum_logprob / length ** length_penalty
    (the prompt's tokens counted, a final end id not), as the plain re-implementation over
    HF's logprobs ranks them."""
    llm, model, end, ends = eos_case
    width = 2
    [output] = llm.beam_search({"prompt_token_ids": TOKEN_PROMPT},
                               BeamSearchParams(width, MAX_TOKENS, length_penalty=length_penalty))
    want = reference_beam_search(model, TOKEN_PROMPT, width, MAX_TOKENS, ends, length_penalty, ignore_eos=False)
    assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in want]
    assert [s.cum_logprob for s in output.sequences] == pytest.approx([cum for _, cum in want], abs=1e-3)
    scores = [score(s.tokens, s.cum_logprob, length_penalty, ends) for s in output.sequences]
    assert scores == sorted(scores, reverse=True)
    for seq in output.sequences:
        check_sequence(seq, TOKEN_PROMPT, llm.get_tokenizer())
        if seq.tokens[-1] == end:
            assert seq.finish_reason == "stop" and seq.stop_reason is None
            assert len(seq.tokens) < len(TOKEN_PROMPT) + MAX_TOKENS and end not in seq.tokens[:-1]
        else:
            assert seq.finish_reason == "length" and len(seq.tokens) == len(TOKEN_PROMPT) + MAX_TOKENS
    finished = [s.tokens[-1] == end for s in output.sequences]
    # The short finished beam wins when length does not count, and loses to long beams when it counts a lot.
    if length_penalty == 0.0:
        assert finished[0]
    if length_penalty == 3.0:
        assert not any(finished)


def test_ignore_eos_extends_through_eos(eos_case):
    """ignore_eos=True: an end id is extended like any other token; the beams are HF's with
    EOS off where length does not count, and the plain re-implementation's where it does (a
    live beam that ends in an end id counts one token less, as vLLM's score counts it)."""
    llm, model, end, ends = eos_case
    for length_penalty in (0.0, 1.0):
        [output] = llm.beam_search([{"prompt_token_ids": TOKEN_PROMPT}],
                                   BeamSearchParams(2, MAX_TOKENS, ignore_eos=True, length_penalty=length_penalty))
        want = reference_beam_search(model, TOKEN_PROMPT, 2, MAX_TOKENS, ends, length_penalty, ignore_eos=True)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in want]
        if length_penalty == 0.0:
            assert [s.tokens for s in output.sequences] == hf_beam_search(model, TOKEN_PROMPT, 2, MAX_TOKENS)
            assert all(end in s.tokens[len(TOKEN_PROMPT): -1] for s in output.sequences)  # the end id's path went on
        for seq in output.sequences:
            check_sequence(seq, TOKEN_PROMPT, llm.get_tokenizer())
            assert seq.finish_reason == "length" and len(seq.tokens) == len(TOKEN_PROMPT) + MAX_TOKENS


def test_prompt_forms_concurrency_and_prefix_sharing(llms):
    _, llm = llms("qwen3")
    tokenizer = llm.get_tokenizer()
    text = "The quick brown fox"
    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    ids = tokenizer(text).input_ids
    a, b, c = llm.beam_search([text, {"prompt": text}, {"prompt_token_ids": ids}], params)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences] == [s.tokens for s in c.sequences]
    assert [s.tokens for s in llm.beam_search(text, params)[0].sequences] == [s.tokens for s in a.sequences]

    prompts = [{"prompt_token_ids": TOKEN_PROMPT}, text, {"prompt_token_ids": [9, 8, 7]}]
    together = llm.beam_search(prompts, params)
    one_at_a_time = llm.beam_search(prompts, params, concurrency_limit=1, use_tqdm=True)
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences] for o in one_at_a_time]
    assert together[2].sequences[0].tokens[:3] == [9, 8, 7]  # input order
    prioritized = llm.beam_search(prompts, params, priority=[2, 0, 1])  # (vLLM's: scheduling only)
    assert [[s.tokens for s in o.sequences] for o in prioritized] == [[s.tokens for s in o.sequences] for o in together]

    # The text keeps special tokens unless asked (a prompt holding the EOS shows it), as vLLM's.
    special = {"prompt_token_ids": TOKEN_PROMPT + [tokenizer.eos_token_id]}
    [skipped] = llm.beam_search(special, BeamSearchParams(2, 2, ignore_eos=True, skip_special_tokens=True))
    [kept] = llm.beam_search(special, BeamSearchParams(2, 2, ignore_eos=True))
    assert tokenizer.eos_token not in skipped.sequences[0].text and tokenizer.eos_token in kept.sequences[0].text

    # temperature > 0 samples each step's chosen token; its logprob joins the candidates too.
    [hot] = llm.beam_search(text, BeamSearchParams(beam_width=2, max_tokens=3, temperature=1.0))
    scores = [score(s.tokens, s.cum_logprob, 1.0, {tokenizer.eos_token_id}) for s in hot.sequences]
    assert len(hot.sequences) == 2 and scores == sorted(scores, reverse=True)
    for seq in hot.sequences:
        check_sequence(seq, ids, tokenizer)

    # Beams re-submit whole sequences; the prompt's full blocks come from the prefix cache.
    llm.reset_prefix_cache()
    before = llm.stats()["prefix_cache_hits"]
    long_prompt = list(range(10, 50))  # 40 tokens: two full blocks of 16
    llm.beam_search({"prompt_token_ids": long_prompt}, BeamSearchParams(2, 4, ignore_eos=True))
    assert llm.stats()["prefix_cache_hits"] - before >= 3 * 2 * 32  # steps 2-4, two beams, 32 tokens each
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"] and stats["num_running"] == stats["num_waiting"] == 0


def test_beams_stop_at_max_model_len(llms):
    """A beam that fills the context cannot grow: it is returned, finish_reason "length"."""
    _, llm = llms("qwen3")
    prompt = list(range(10, 70))  # 60 of 64 positions
    [output] = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(2, 10, ignore_eos=True))
    assert len(output.sequences) == 2
    assert all(len(s.tokens) == 64 and s.finish_reason == "length" for s in output.sequences)


def test_bad_arguments(llms):
    _, llm = llms("qwen3")
    from jaxvllm.beam_search import BeamSearchOutput as Output  # vLLM's module paths
    from jaxvllm.sampling_params import BeamSearchParams as Params

    assert Output is BeamSearchOutput and Params is BeamSearchParams
    for kwargs, match in [
        (dict(beam_width=0, max_tokens=4), "beam_width"),
        (dict(beam_width=2.0, max_tokens=4), "beam_width must be an int"),
        (dict(beam_width=True, max_tokens=4), "beam_width must be an int"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
        (dict(beam_width=2, max_tokens=4, length_penalty=math.inf), "length_penalty"),
        (dict(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos must be True or False"),
        (dict(beam_width=2, max_tokens=4, include_stop_str_in_output=1), "include_stop_str_in_output"),
    ]:
        with pytest.raises(ValueError, match=match):
            BeamSearchParams(**kwargs)
    limit = getattr(llm.llm_engine.config, "max_logprobs", 20)
    width = limit // 2 + 1
    with pytest.raises(ValueError, match=rf"beam_width={width} needs {2 * width} logprobs.*max_logprobs={limit}"):
        llm.beam_search("Hi", BeamSearchParams(width, 2))
    params = BeamSearchParams(2, 2)
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search("Hi", params, concurrency_limit=0)
    with pytest.raises(ValueError, match="LoRA"):
        llm.beam_search("Hi", params, lora_request=object())
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search("Hi", SamplingParams())
    with pytest.raises(ValueError, match="^You passed 64 input tokens.* context length is only 64 tokens") as error:
        llm.beam_search(["Hi", {"prompt_token_ids": list(range(64))}], params)
    assert error.value.__notes__ == ["(prompt 1 of 2)"]
    with pytest.raises(ValueError, match="^The decoder prompt cannot be empty"):
        llm.beam_search([{"prompt_token_ids": []}], params)
    assert llm.beam_search([], params) == []
    stats = llm.stats()  # nothing was queued by the refused calls
    assert stats["num_running"] == stats["num_waiting"] == 0
