"""Input processing: a user's prompt and sampling parameters in, validated scheduler
requests out (vLLM's `Processor`).

Everything about a request is checked here, before any of it is queued: the prompt (text,
token ids, length against `max_model_len`), the sampling parameters against the model
(vocabulary, logprobs, stop ids), bad words and structured outputs (their grammar is
compiled once per spec). A bad request raises with vLLM's message and leaves the engine
as it was.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jaxvllm.config import EngineConfig
from jaxvllm.detokenizer import IncrementalDetokenizer, TokenizerInfo
from jaxvllm.request import ParentRequest, Request
from jaxvllm.sampler import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from jaxvllm.sampling_params import SamplingParams
from jaxvllm.structured_output import StructuredOutputManager, tokenizer_size
from jaxvllm.transformers_utils.tokenizer import get_tokenizer

PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}  # (others are ignored, as by vLLM)
MULTIMODAL_KEYS = {"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"}


def load_tokenizer(config: EngineConfig):
    """The engine's HF tokenizer (from `tokenizer`, else the model's folder), or None under
    skip_tokenizer_init; never downloads."""
    if config.skip_tokenizer_init:
        return None  # token-id prompts only; outputs have empty text
    path = config.tokenizer or config.model
    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer directory {path!r} " + ("is a file: give its folder" if Path(path).exists()
                                                                     else "does not exist"))
    advice = "pass tokenizer=PATH to use another folder, or skip_tokenizer_init=True for token-id prompts only"
    try:
        tokenizer = get_tokenizer(path, tokenizer_mode=config.tokenizer_mode)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path!r} ({advice}): {e}") from e
    # (transformers makes some tokenizers, Qwen2's, from config.json alone: with no vocabulary)
    if len(tokenizer) <= len(tokenizer.all_special_ids):
        raise ValueError(f"cannot load a tokenizer from {path!r} ({advice}): it has no vocabulary files, and "
                         f"{type(tokenizer).__name__} made without them holds {len(tokenizer)} token(s)")
    return tokenizer


def eos_token_ids(config_eos: tuple[int, ...], generation_config: dict[str, Any], tokenizer) -> tuple[int, ...]:
    """Every id that ends a completion unless `ignore_eos`, the model's EOS first: the
    tokenizer's (without one, the first end id listed), whose stop_reason is None as
    vLLM's. The others, the generation config's (Llama 3 and Qwen instruct models list
    several; config.json's only where there is no generation_config.json, as vLLM reads
    them), stop as vLLM adds them to `stop_token_ids`, with their id as stop_reason."""
    listed = generation_config.get("eos_token_id")
    listed = [listed] if isinstance(listed, int) else list(listed or ())
    if tokenizer is not None:
        first = tokenizer.eos_token_id
    else:
        first = next(iter([*listed, *config_eos]), None)
    return tuple(dict.fromkeys(t for t in (first, *listed) if t is not None))


def fold_seed(seed: int) -> int:
    """The sampler's 32-bit seed of a request seed, which may be any 64-bit int (vLLM's
    range): seeds in [0, 2**32) are kept, others mixed by SplitMix64's finalizer, so that
    seeds apart by 2**32 or a sign do not share a stream."""
    if 0 <= seed < 2**32:
        return seed
    z, mask = (seed + 0x9E3779B97F4A7C15) % 2**64, 2**64 - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def unseeded(engine_seed: int, arrival: int) -> int:
    """The sampler's seed of a request given none: drawn from the engine's seed and the
    request's arrival by a hash, not counted from them, so that it is no small number a
    user would give (request 1 had seed 1's stream: vLLM draws unseeded rows from its
    global generator, apart from every seeded row's own)."""
    digest = hashlib.blake2b(f"unseeded {engine_seed} {arrival}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class InputProcessor:
    """Builds the `Request`s of one user request (its n completions); queues nothing.

    `check_fits(num_prompt_tokens, max_tokens)` refuses a request that could never be
    scheduled (the scheduler's); `digests`: across processes, give each request the digest
    every process must agree on.
    """

    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], check_fits: Callable[[int, int], None],
                 structured_outputs: StructuredOutputManager | None, digests: bool = False) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.tokenizer_info = TokenizerInfo.of(tokenizer) if tokenizer is not None else None
        self.vocab_size, self.max_model_len, self.eos_token_ids = vocab_size, max_model_len, eos_token_ids
        self.check_fits, self.structured_outputs, self.digests = check_fits, structured_outputs, digests
        self.next_arrival = 0  # FCFS order, and what unseeded requests' seeds are drawn from

    def tokenize_prompt(self, prompt: Any, add_special_tokens: bool = True,
                        truncate: int | None = None) -> tuple[str | None, list[int], str | None]:
        """A str, or a dict with "prompt" (str) or "prompt_token_ids" (list of ints) and an
        optional "cache_salt" -> (text, token ids, salt); raises on bad input. A dict with
        both is vLLM's `TokensPrompt` with its text: the ids are the prompt, the text is
        only reported. `truncate`: keep that many tokens, as vLLM does: the tokenizer
        truncates a text (its BOS stays), ids are cut on its `truncation_side` (the last
        ones, as the engine loads it)."""
        if isinstance(prompt, dict):
            # vLLM ignores empty multimodal fields (an Arrow row or a template may carry them)
            given = {key for key, value in prompt.items() if key not in MULTIMODAL_KEYS or value}
            if given & MULTIMODAL_KEYS:
                raise ValueError(f"multimodal inputs ({sorted(given & MULTIMODAL_KEYS)}) are not supported: jaxvllm's "
                                 "models read text only")
            if "prompt_embeds" in prompt:  # (vLLM reads it first, and refuses it without enable_prompt_embeds)
                raise ValueError("prompt_embeds: prompt embeddings are not supported by jaxvllm (enable_prompt_embeds "
                                 "is off)")
            if "prompt" not in prompt and "prompt_token_ids" not in prompt:
                raise TypeError(f"inputs must be a string, TextPrompt, TokensPrompt, or EmbedsPrompt: a prompt dict "
                                f"needs 'prompt' (text) or 'prompt_token_ids' (it has {sorted(prompt)})")
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise TypeError(f"cache_salt must be a str, got {type(salt).__name__}")
            if "prompt_token_ids" not in prompt:
                return (*self.tokenize_prompt(prompt["prompt"], add_special_tokens, truncate)[:2], salt)
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"a TokensPrompt's 'prompt' (its text) must be a str, got {type(text).__name__}")
            token_ids = self._check_token_ids(prompt["prompt_token_ids"])
            if truncate is not None:  # (on the tokenizer's side, as vLLM's; left without one)
                right = self.tokenizer is not None and self.tokenizer.truncation_side == "right"
                token_ids = token_ids[:truncate] if right else token_ids[-truncate:]
            return text, token_ids, salt
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("skip_tokenizer_init=True: pass prompt_token_ids, not text")
        # (as vLLM, an empty text is refused only if it encodes to nothing: a BOS is a prompt)
        truncation = {} if truncate is None else {"truncation": True, "max_length": truncate}
        token_ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens, **truncation).input_ids
        if not token_ids:
            raise ValueError(f"The decoder prompt cannot be empty (the text {prompt!r} encodes to no tokens)")
        if max(token_ids) >= self.vocab_size:  # (a tokenizer may have ids the model lacks)
            raise ValueError(f"Token id {max(token_ids)} is out of vocabulary: the text encodes to it, and the "
                             f"model's ids are 0 to {self.vocab_size - 1}")
        return prompt, token_ids, None

    def _check_token_ids(self, token_ids: Any) -> list[int]:
        if not isinstance(token_ids, (list, tuple, np.ndarray)):
            raise TypeError(f"prompt_token_ids must be a list of ints, got {type(token_ids).__name__}")
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("The decoder prompt cannot be empty (prompt_token_ids is [])")
        vocab = self.vocab_size
        for t in token_ids:
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool):
                raise ValueError(f"prompt token ids must be ints, got {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(f"Token id {t} is out of vocabulary (the model's ids are 0 to {vocab - 1})")
        return [int(t) for t in token_ids]

    def check_prompt_length(self, num_tokens: int) -> None:
        """A prompt must leave room for one generated token (the message is after vLLM's server's)."""
        max_model_len = self.max_model_len
        if num_tokens >= max_model_len:
            raise ValueError(
                f"You passed {num_tokens} input tokens, and a completion needs at least 1 output token. However, "
                f"the model's context length is only {max_model_len} tokens, resulting in a maximum input length "
                f"of {max_model_len - 1} tokens. Please reduce the length of the input prompt."
            )

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each word alone and after a space (when the
        space makes a different first token of the same length), without special tokens."""
        if self.tokenizer is None:
            raise ValueError("skip_tokenizer_init=True: bad_words need a tokenizer")
        sequences: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError("bad_words entries must tokenize to at least one token.")
            sequences.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORDS:
            raise ValueError(f"Too many bad words after tokenization: {len(sequences)}. The max number is {MAX_BAD_WORDS}.")
        longest = max(sequences, key=len)
        if len(longest) > MAX_BAD_WORD_TOKENS:
            raise ValueError(
                f"bad word {self.tokenizer.decode(longest)!r} is {len(longest)} tokens; at most "
                f"{MAX_BAD_WORD_TOKENS} are supported"
            )
        return sequences

    def _check_params(self, params: SamplingParams | None, priority: Any) -> SamplingParams:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(params.n, int) or params.n < 1:  # (checked when made; it may be set after)
            raise ValueError(f"n must be at least 1, got {params.n!r}.")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        params.check_supported(self.config.max_logprobs, self.vocab_size)
        params.check_vocab(self.vocab_size)
        if self.tokenizer is not None and params.allowed_token_ids is not None:  # (vLLM's check)
            size = tokenizer_size(self.tokenizer)
            if outside := [t for t in params.allowed_token_ids if t >= size]:
                raise ValueError(f"allowed_token_ids contains out-of-vocab token id {outside[0]}: the tokenizer "
                                 f"has {size} tokens")
        params.check_satisfiable(self.eos_token_ids)
        if self.tokenizer is None and params.stop_strings:
            raise ValueError("skip_tokenizer_init=True: stop strings need a tokenizer; use stop_token_ids")
        if self.tokenizer is None and params.structured_outputs is not None:
            raise ValueError("Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'")
        return params

    def process(self, request_id: str, prompt: Any, params: SamplingParams | None, priority: int = 0, *,
                add_special_tokens: bool = True, lora_id: int = 0, lora_path: str | None = None) -> ParentRequest:
        """Validate everything about a request and build its n completions' `Request`s
        (`lora_path`: its adapter's folder, which processes compare)."""
        params = self._check_params(params, priority)
        max_model_len = self.max_model_len
        bad_words = self.bad_words_token_ids(params.bad_words) if params.bad_words else []
        keep = params.truncate_prompt_tokens
        if keep is not None:  # (on the tokenizer's truncation_side, the left as loaded: the last tokens stay)
            keep = max_model_len - 1 if keep == -1 else keep
            if keep > max_model_len:
                raise ValueError(
                    f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}). "
                    "Please, select a smaller truncation size."
                )
        text, token_ids, cache_salt = self.tokenize_prompt(prompt, add_special_tokens, keep)
        self.check_prompt_length(len(token_ids))
        params.check_prompt_logprobs_start(len(token_ids))
        room = max_model_len - len(token_ids)
        # As vLLM: generation stops at max_model_len (finish reason "length"), whatever max_tokens asks.
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.check_fits(len(token_ids), max_tokens)
        request_id = str(request_id)
        first = self.next_arrival
        children = [self._child(request_id, index, first + index, text, token_ids, cache_salt, params, priority,
                                max_tokens, bad_words, lora_id) for index in range(params.n)]
        self.next_arrival = first + params.n  # (only once the request was built: a refused one takes none)
        parent = ParentRequest(request_id, children, params.output_kind)
        if self.digests:
            parent.digest = hashlib.blake2b(repr((request_id, token_ids, priority, params, [c.seed for c in children],
                                                  lora_id, lora_path, cache_salt))
                                            .encode(), digest_size=8).digest()
        return parent

    def take_back(self, parents: list[ParentRequest]) -> None:
        """Requests built last and never queued (the call was refused) give back their
        arrival numbers: later requests' unseeded seeds stay as without the refused call."""
        arrivals = [c.arrival_index for p in parents for c in p.children]
        if arrivals and max(arrivals) == self.next_arrival - 1:
            self.next_arrival = min(arrivals)

    def _child(self, request_id: str, index: int, arrival: int, text, token_ids, cache_salt, params: SamplingParams,
               priority: int, max_tokens: int, bad_words: list[list[int]], lora_id: int = 0) -> Request:
        """Completion `index` of a request: its id, seed, detokenizer and grammar."""
        # Each completion has its own randomness: seed + index, or a seed drawn from the engine's.
        seed = fold_seed(params.seed + index) if params.seed is not None else unseeded(self.config.seed, arrival)
        child = Request(
            request_id if params.n == 1 else f"{index}_{request_id}", token_ids, params, prompt=text,
            priority=priority, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids, arrival_index=arrival,
            seed=seed, cache_salt=cache_salt, vocab_size=self.vocab_size, bad_words_token_ids=bad_words,
            lora_id=lora_id,
        )
        if params.detokenize and self.tokenizer is not None:  # (no tokenizer: empty text)
            child.detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop_strings,
                include_stop_str_in_output=params.include_stop_str_in_output,
                spaces_between_special_tokens=params.spaces_between_special_tokens, prompt_token_ids=token_ids,
                info=self.tokenizer_info,
            )
        if params.structured_outputs is not None:  # (checked, and compiled once per spec)
            child.grammar = self.structured_outputs.grammar(params.structured_outputs)
        return child
