"""vLLM's beam search (`LLM.beam_search`), built on `LLM.generate` as vLLM builds it.

Each step submits every live beam as a one-token request for its 2 * beam_width top
logprobs; every candidate token extends its beam, and the best beam_width extensions of
each prompt live on. Re-submitting whole sequences costs little: beams share their
prompt's KV blocks (and each other's) through the prefix cache.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Callable


from jaxvllm.engine import LLMEngine
from jaxvllm.inputs import prompt_list
from jaxvllm.interrupts import ProgressBar
from jaxvllm.logprobs import Logprob
from jaxvllm.sampling_params import BeamSearchParams, SamplingParams, resolve_logprobs


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's included, as vLLM), the logprob dict of each
    generated step and their running sum. `text` (the decoded tokens) and `finish_reason`
    ("stop" for an end id, "length" otherwise) are filled when the sequence is returned;
    `stop_reason` stays None, as vLLM's."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's beam_width best sequences (fewer if fewer exist), best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | Collection[int],
                          length_penalty: float = 1.0) -> float:
    """vLLM's score (from an older HF's): cumulative logprob over length ** length_penalty,
    where the length counts all of `tokens`, the prompt's included, but a final end id
    (`eos_token_id`: one, or a collection of them)."""
    ends = eos_token_id if isinstance(eos_token_id, Collection) else (eos_token_id,)
    return cumulative_logprob / (max(len(tokens) - (tokens[-1] in ends), 1) ** length_penalty)


@dataclass
class _Instance:
    """One prompt's search: the live beams (each with its adapter), the finished ones, the prompt's cache
    salt and priority."""

    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)
    cache_salt: str | None = None
    priority: int = 0


def beam_search(engine: LLMEngine, generate: Callable[..., list], prompts: Any, params: BeamSearchParams, *,
                use_tqdm: bool = False, concurrency_limit: int | None = None,
                lora_requests: list | None = None, priorities: list[int] | None = None) -> list[BeamSearchOutput]:
    """Run vLLM's beam search for each prompt (a str, a TextPrompt, a TokensPrompt or a list
    of them), each step one `generate` call (`LLM.generate`) over `engine` (the one whose
    tokenizer and limits apply); outputs come back in input order. `concurrency_limit`
    searches at most that many prompts at once (None: all). `lora_requests`,
    `priorities`: each prompt's LoRA adapter (None: the base model) and priority."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError("beam search needs a tokenizer (for the EOS id and the texts); "
                         "this LLM has skip_tokenizer_init=True")
    max_logprobs = resolve_logprobs(engine.config.max_logprobs, engine.model_config.vocab_size)
    if 2 * params.beam_width > max_logprobs:
        raise ValueError(
            f"beam_width={params.beam_width} needs {2 * params.beam_width} logprobs per step, more than "
            f"this engine returns (max_logprobs={max_logprobs})"
        )
    prompts = prompt_list(prompts)
    if concurrency_limit is None:
        concurrency_limit = max(len(prompts), 1)
    elif isinstance(concurrency_limit, bool) or not isinstance(concurrency_limit, int) or concurrency_limit < 1:
        raise ValueError(f"concurrency_limit must be a positive int or None, got {concurrency_limit!r}")

    max_model_len = engine.runner.max_model_len
    instances = []
    for i, prompt in enumerate(prompts):  # every prompt is checked before any step runs
        try:
            _, token_ids, salt = engine.input_processor.tokenize_prompt(prompt)  # text as vLLM: tokenizer.encode(text)
            engine.input_processor.check_prompt_length(len(token_ids))
        except (ValueError, TypeError) as e:
            e.add_note(f"(prompt {i} of {len(prompts)})")  # the message stays vLLM's, as in generate
            raise
        first = BeamSearchSequence(token_ids, lora_request=lora_requests[i] if lora_requests else None)
        instances.append(_Instance([first], cache_salt=salt, priority=priorities[i] if priorities else 0))

    # The end ids generate stops at (the tokenizer's EOS and generation_config.json's), where
    # vLLM 0.11 ends a beam at the tokenizer's EOS only and extends the others' beams past them.
    ends = frozenset(engine.eos_token_ids)
    width = params.beam_width

    def score(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, ends, params.length_penalty)

    # 2 * beam_width candidates per beam, as HF (enough that EOS candidates leave beam_width others).
    step_params = SamplingParams(logprobs=2 * width, max_tokens=1, temperature=params.temperature)
    batches = [instances[i:i + concurrency_limit] for i in range(0, len(instances), concurrency_limit)]
    with ProgressBar(total=len(batches) * params.max_tokens, desc="Beam search", unit="token",
              disable=not use_tqdm, dynamic_ncols=True) as bar:
        for batch in batches:
            for _ in range(params.max_tokens):
                for inst in batch:  # a beam that fills the context cannot grow: it is finished ("length")
                    inst.completed += [b for b in inst.beams if len(b.tokens) >= max_model_len]
                    inst.beams = [b for b in inst.beams if len(b.tokens) < max_model_len]
                live = [(inst, beam) for inst in batch for beam in inst.beams]
                if not live:
                    break
                outputs = iter(generate([_tokens_prompt(beam.tokens, inst.cache_salt) for inst, beam in live],
                                        step_params, use_tqdm=False,
                                        lora_request=[beam.lora_request for _, beam in live],
                                        priority=[inst.priority for inst, _ in live] if priorities else None))
                for inst in batch:  # the outputs come in the order of `live`: instance by instance
                    candidates = []
                    for beam in inst.beams:
                        step_logprobs = next(outputs).outputs[0].logprobs[0]
                        for token, logprob in step_logprobs.items():
                            child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [step_logprobs],
                                                       beam.lora_request, beam.cum_logprob + logprob.logprob)
                            if token in ends and not params.ignore_eos:
                                child.finish_reason = "stop"
                                inst.completed.append(child)
                            else:
                                candidates.append(child)
                    inst.beams = sorted(candidates, key=score, reverse=True)[:width]
                bar.update(1)

    results = []
    for inst in instances:
        best = sorted(inst.completed + inst.beams, key=score, reverse=True)[:width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens, skip_special_tokens=params.skip_special_tokens)  # (the prompt's too)
            beam.finish_reason = beam.finish_reason or "length"
        results.append(BeamSearchOutput(best))
    return results


def _tokens_prompt(tokens: list[int], cache_salt: str | None) -> dict:
    prompt: dict = {"prompt_token_ids": tokens}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt
