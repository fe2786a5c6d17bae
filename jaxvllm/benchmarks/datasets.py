"""Benchmark workloads: lists of (prompt token ids, output length), the same for every backend.

Prompts are random token ids, as in vLLM's random dataset and nano-vllm's bench.py:
what is measured is the engine, not the text, and token ids need no tokenizer that
matches the model (dummy models have none). Every list depends only on its
arguments and the seed, so jaxvllm and HF transformers get identical work.
json-schema is the exception: text prompts, tokenized, each with a JSON schema its
completion must follow (structured outputs, jaxvllm only).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxvllm.sampling_params import StructuredOutputsParams

DATASETS = ("random", "nanovllm", "shared-prefix", "json-schema")

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
    # most this many: the completion ends where its grammar does.
    output_len: int
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _token_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(_FIRST_TOKEN_ID, vocab_size, size=n).tolist()


def _lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> np.ndarray:
    """vLLM's random-dataset lengths: uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def random_requests(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int, *, range_ratio: float = 0.0, seed: int = 0
) -> list[BenchRequest]:
    """vLLM's `--dataset random`: lengths around input_len / output_len, random token ids."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be >= 1")
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    return [BenchRequest(_token_ids(rng, int(i), vocab_size), int(o)) for i, o in zip(in_lens, out_lens)]


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
