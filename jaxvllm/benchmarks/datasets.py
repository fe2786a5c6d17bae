"""Benchmark workloads: lists of (prompt token ids, output length), the same for every backend.

Prompts are random token ids, as in vLLM's random dataset and nano-vllm's bench.py:
what is measured is the engine, not the text, and token ids need no tokenizer that
matches the model (dummy models have none). Every list depends only on its
arguments and the seed, so jaxvllm and HF transformers get identical work.
json-schema and repeat are the exceptions: text prompts, tokenized. json-schema's each
come with a JSON schema their completion must follow (structured outputs, jaxvllm only);
repeat's ask the model to copy, reformat or continue a passage given in the prompt, the
work speculative decoding by prompt lookup (n-gram drafts) is meant for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxvllm.sampling_params import StructuredOutputsParams

DATASETS = ("random", "nanovllm", "shared-prefix", "json-schema", "repeat")

# B1 (the README's "Command line"): nano-vllm's bench.py workload.
NANOVLLM_NUM_PROMPTS = 256
NANOVLLM_MIN_LEN, NANOVLLM_MAX_LEN = 100, 1024
NANOVLLM_MAX_MODEL_LEN = 4096

# The low ids are special tokens in most tokenizers (and in the dummy one); leave them out.
_FIRST_TOKEN_ID = 3


# json-schema: a user profile, bounded everywhere (strings, integers, the array) so that even
# random weights finish, well within JSON_SCHEMA_MAX_TOKENS.
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
JSON_SCHEMA_MAX_TOKENS = 512


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    # Exactly this many tokens are generated (EOS is ignored); with structured outputs, at
    # most this many: the completion ends where its grammar does; with stop_at_eos, at most
    # this many, the EOS included.
    output_len: int
    structured_outputs: StructuredOutputsParams | None = None
    stop_at_eos: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _token_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(_FIRST_TOKEN_ID, vocab_size, size=n).tolist()


def _lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> np.ndarray:
    """vLLM's random-dataset lengths: uniform in [floor(mean * (1 - r)), ceil(mean * (1 + r))], at least 1."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def random_requests(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int, *, range_ratio: float = 0.0, seed: int = 0,
    prefix_len: int = 0,
) -> list[BenchRequest]:
    """vLLM's `--dataset random`: lengths around input_len / output_len, random token ids,
    after `prefix_len` random tokens every prompt shares."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if num_prompts < 1 or input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError("num_prompts, input_len and output_len must be >= 1, prefix_len >= 0")
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    prefix = _token_ids(rng, prefix_len, vocab_size) if prefix_len else []
    return [BenchRequest(prefix + _token_ids(rng, int(i), vocab_size), int(o)) for i, o in zip(in_lens, out_lens)]


def nanovllm_requests(vocab_size: int, *, num_prompts: int = NANOVLLM_NUM_PROMPTS, seed: int = 0) -> list[BenchRequest]:
    """B1: prompt and output lengths uniform in [100, 1024] (nano-vllm's bench.py), seed 0."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(NANOVLLM_MIN_LEN, NANOVLLM_MAX_LEN + 1, size=num_prompts)
    out_lens = rng.integers(NANOVLLM_MIN_LEN, NANOVLLM_MAX_LEN + 1, size=num_prompts)
    return [BenchRequest(_token_ids(rng, int(i), vocab_size), int(o)) for i, o in zip(in_lens, out_lens)]


def shared_prefix_requests(
    num_prompts: int, prefix_len: int, input_len: int, output_len: int, vocab_size: int, *, seed: int = 0
) -> list[BenchRequest]:
    """Every prompt = one shared prefix of `prefix_len` tokens + its own `input_len` random tokens.

    The workload of prefix caching: a system prompt or few-shot examples in front of
    every request.
    """
    if num_prompts < 1 or prefix_len < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, prefix_len, input_len and output_len must be >= 1")
    rng = np.random.default_rng(seed)
    prefix = _token_ids(rng, prefix_len, vocab_size)
    return [BenchRequest(prefix + _token_ids(rng, input_len, vocab_size), output_len) for _ in range(num_prompts)]


def json_schema_requests(num_prompts: int, output_len: int, encode: Callable[[str], list[int]]) -> list[BenchRequest]:
    """Prompts asking for a JSON object (vLLM's structured-output benchmark: the schema in
    the prompt, here first, so that the prompts share it as a prefix), each constrained by
    JSON_SCHEMA without whitespace between tokens (random weights would loop on it).
    Text, unlike the other datasets: the grammar works on the tokenizer's tokens anyway."""
    if num_prompts < 1 or output_len < 1:
        raise ValueError("num_prompts and output_len must be >= 1")
    _jsonschema()  # before anything runs: the completions are checked with it
    schema = json.dumps(JSON_SCHEMA, separators=(",", ":"))
    spec = StructuredOutputsParams(json=JSON_SCHEMA, disable_any_whitespace=True)
    return [BenchRequest(encode(f"JSON schema: {schema}\nWrite user profile number {i} as a JSON object "
                                "that follows the schema:\n"), output_len, spec)
            for i in range(num_prompts)]


def _jsonschema():
    try:
        import jsonschema
    except ImportError as e:
        raise ImportError("--dataset json-schema validates the completions with jsonschema: "
                          "pip install jsonschema") from e
    return jsonschema


def is_valid_json(text: str, schema: dict = JSON_SCHEMA) -> bool:
    """The text parses as JSON and validates against the schema (checked by jsonschema,
    not by the grammar that produced it)."""
    jsonschema = _jsonschema()
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# -- repeat: prompts whose answers copy much of the prompt ------------------------------------

_PROSE = (
    "The lighthouse stood on a low rock at the mouth of the harbour. Every evening the keeper climbed "
    "the one hundred and twelve steps, trimmed the wick, wound the clockwork that turned the lens, and "
    "wrote the weather in a thick blue logbook. Ships that passed at night saw the light sweep across "
    "the water once every ten seconds, and knew from that rhythm which coast they were following. When "
    "the lamp was finally replaced by an electric beacon, the keeper kept the logbook, and the town "
    "museum still shows it open at the page of the great storm of 1911.",
    "Bread needs only four things: flour, water, salt and yeast. Mix them into a rough dough and leave "
    "it covered for half an hour, so that the flour can absorb the water. Knead it until it is smooth "
    "and springs back when pressed, then let it rise in a warm place until it has doubled in size. "
    "Shape the loaf gently, let it rise a second time, and bake it in a hot oven until the crust is "
    "deep brown and the bottom sounds hollow when tapped. Let it cool before cutting it.",
    "Honeybees tell each other where food is by dancing. A forager that has found a rich patch of "
    "flowers returns to the hive and runs a short straight line across the comb while waggling her "
    "body, then circles back and repeats it. The angle of the straight run against the vertical gives "
    "the direction of the flowers relative to the sun, and the length of the waggle tells the distance. "
    "Other bees follow the dancer, learn the route, and fly out to the same flowers.",
)
_LIST = ("apples\nbananas\ncarrots\ndates\neggs\nflour\ngarlic\nhoney\nonions\npotatoes\nrice\n"
         "spinach\ntomatoes\nyoghurt")
_CODE = (
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError(\"window must be positive\")\n"
    "    averages = []\n"
    "    total = 0.0\n"
    "    for i, value in enumerate(values):\n"
    "        total += value\n"
    "        if i >= window:\n"
    "            total -= values[i - window]\n"
    "        if i >= window - 1:\n"
    "            averages.append(total / window)\n"
    "    return averages\n"
)
# What each kind of passage is asked for: copied, reformatted or continued.
_REPEAT_TASKS = {
    "prose": ("Repeat the following text exactly:\n\n{}",
              "Rewrite the following text with each sentence on a line of its own:\n\n{}",
              "Copy the following paragraph, then continue it with one more paragraph in the same style:\n\n{}"),
    "list": ("Rewrite this list as a numbered list:\n{}",
             "Repeat the following list exactly, one item per line:\n\n{}",
             "Rewrite this list as a comma-separated line, keeping the order:\n{}"),
    "code": ("Copy this code and add a comment to each line:\n{}",
             "Repeat the following code exactly:\n\n{}",
             "Rewrite this function with type hints and a docstring:\n{}"),
}
REPEAT_PROMPTS = tuple(task.format(passage)
                       for kind, passages in (("prose", _PROSE), ("list", (_LIST,)), ("code", (_CODE,)))
                       for passage in passages for task in _REPEAT_TASKS[kind])


def chat_encoder(tokenizer) -> Callable[[str], list[int]]:
    """text -> the token ids of a one-turn chat asking it, as `LLM.chat` makes them: the
    tokenizer's chat template with the generation prompt, rendered then tokenized without
    special tokens (the template writes its own); plain encoding where it has no template."""
    if getattr(tokenizer, "chat_template", None) is None:
        return tokenizer.encode

    def encode(text: str) -> list[int]:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer.encode(chat, add_special_tokens=False)

    return encode


def repeat_requests(num_prompts: int, output_len: int, encode: Callable[[str], list[int]], *,
                    seed: int = 0) -> list[BenchRequest]:
    """Prompts asking to repeat, reformat or continue one of a few fixed passages: answers
    that copy long runs of the prompt, so n-gram drafts get accepted. Shuffled by the seed;
    every prompt is used once before any is used twice."""
    if num_prompts < 1 or output_len < 1:
        raise ValueError("num_prompts and output_len must be >= 1")
    rng = np.random.default_rng(seed)
    order: list[int] = []
    while len(order) < num_prompts:
        order += rng.permutation(len(REPEAT_PROMPTS)).tolist()
    return [BenchRequest(encode(REPEAT_PROMPTS[i]), output_len) for i in order[:num_prompts]]
