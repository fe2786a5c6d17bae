"""Structured outputs on llguidance (vLLM's "guidance" backend).

A request's `StructuredOutputsParams` becomes an llguidance grammar. It is checked when
the request is added (a bad schema, regex or grammar is a ValueError there), compiled
once per distinct spec in a thread pool (the request waits in the queue meanwhile,
without holding the others back), and each request gets its own matcher: a copy of the
compiled one. Per step, each constrained row's matcher fills its row of a packed int32
bitmask [rows, ceil(vocab / 32)] on the host (bit v % 32 of word v // 32: token v may
come next); the jitted sampler masks the logits with it. The matcher advances on every
token the request gets (`Request.append_token`). Once the match is complete, its mask
allows only EOS, as vLLM's: the request ends on that EOS (finish reason "stop").

The tokenizer may have more ids than the model's vocabulary (added special tokens the
model never learned: transformers 5 gives Qwen2's tokenizer an extra <|endoftext|>), or
fewer (embeddings padded past it). llguidance refuses a size below the tokenizer's, so its
tokenizer spans the larger of the two, and the ids at or past the model's vocabulary are
masked out of every row: the sampler never sees them. A grammar that can then go on only
with such an id is at a dead end (`Grammar.dead_end`): the engine ends the request there.

llguidance is a Rust core with a numpy API and no Python dependencies; xgrammar, vLLM's
other default, would pull torch and triton into a JAX engine at run time.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from jaxvllm.config import StructuredOutputsConfig
from jaxvllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


def _llguidance():
    """llguidance, imported when structured outputs are first used (the engine runs without it)."""
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError as e:
        raise ImportError("structured outputs need llguidance: pip install llguidance") from e
    return llguidance

# Compiled grammars kept for reuse (the oldest are dropped past this many distinct specs).
MAX_CACHED_GRAMMARS = 1024


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def tokenizer_size(tokenizer) -> int:
    """The ids a HF tokenizer has, added tokens included, as llguidance counts them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend.get_vocab_size(with_added_tokens=True) if backend is not None else len(tokenizer)


# Where a JSON schema holds subschemas: maps of named ones, and one or a list of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
               "unevaluatedItems", "not", "if", "then", "else", "contentSchema", "items", "prefixItems", "allOf",
               "anyOf", "oneOf")


def _no_additional_properties(schema):
    """vLLM's `disable_additional_properties`: a schema that lists `properties` (or
    `patternProperties`) and says nothing of others gets `additionalProperties: false`.
    Subschemas are reached through the schema keywords and through local `$ref`s (wherever
    their targets lie: OpenAPI's `components/schemas`, say), so `const` and `enum` values and
    free-form objects ({"type": "object"} alone) stay as written."""
    refs: set[str] = set()
    root = _closed(schema, refs)
    done: set[str] = set()
    while refs - done:
        ref = min(refs - done)
        done.add(ref)
        root = _closed_at(root, _pointer(ref), refs)
    return root


def _closed(schema, refs: set[str]):
    """`_no_additional_properties` of one schema through its keywords; the local `$ref`s met go into `refs`."""
    if isinstance(schema, list):
        return [_closed(s, refs) for s in schema]
    if not isinstance(schema, dict):
        return schema
    schema = dict(schema)
    if isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#"):
        refs.add(schema["$ref"])
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            schema[key] = {name: _closed(s, refs) for name, s in schema[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(schema.get(key), (dict, list)):
            schema[key] = _closed(schema[key], refs)
    listed = isinstance(schema.get("properties"), dict) or isinstance(schema.get("patternProperties"), dict)
    if listed and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def _pointer(ref: str) -> list[str]:
    """The keys of a local `$ref` ("#/a/b~1c": JSON pointer escapes, URI-encoded)."""
    path = urllib.parse.unquote(ref[1:])
    return [part.replace("~1", "/").replace("~0", "~") for part in path.split("/")[1:]] if path else []


def _closed_at(node, keys: list[str], refs: set[str]):
    """`node` with the subschema at `keys` closed (the containers on the way copied; a
    pointer to nothing changes nothing: the grammar's compiler reports it)."""
    if not keys:
        return _closed(node, refs)
    key, rest = keys[0], keys[1:]
    if isinstance(node, dict) and key in node:
        return {**node, key: _closed_at(node[key], rest, refs)}
    if isinstance(node, list) and key.isdigit() and int(key) < len(node):
        return [*node[: int(key)], _closed_at(node[int(key)], rest, refs), *node[int(key) + 1:]]
    return node


def grammar_text(spec: StructuredOutputsParams, config: StructuredOutputsConfig) -> str:
    """The llguidance grammar of a spec, as vLLM's guidance backend builds it."""
    llguidance = _llguidance()
    no_whitespace = spec.disable_any_whitespace or config.disable_any_whitespace
    defaults = {"whitespace_flexible": not no_whitespace}
    if spec.whitespace_pattern is not None:
        defaults["whitespace_pattern"] = spec.whitespace_pattern

    def json_grammar(schema) -> str:
        try:
            schema = json.loads(schema) if isinstance(schema, str) else schema
        except json.JSONDecodeError as e:
            raise ValueError(f"structured outputs: the JSON schema is not valid JSON: {e}") from e
        if spec.disable_additional_properties or config.disable_additional_properties:
            schema = _no_additional_properties(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)

    if spec.json is not None:
        return json_grammar(spec.json)
    if spec.json_object:  # (any object: disable_additional_properties does not apply, as in vLLM)
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=defaults)
    if spec.regex is not None:
        return llguidance.grammar_from("regex", spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(spec.choice))
    if spec.grammar is not None:
        return llguidance.grammar_from("grammar", spec.grammar)
    try:
        tag = json.loads(spec.structural_tag)
        triggers, structures = tag["triggers"], tag["structures"]
        if not isinstance(triggers, list) or not isinstance(structures, list):
            raise TypeError("not lists")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError('structured outputs: structural_tag must be JSON with "structures" and "triggers" '
                         'lists') from e
    tags = []
    for s in structures:
        try:
            begin, schema, end = s["begin"], s["schema"], s["end"]
            trigger = next((t for t in triggers if begin.startswith(t)), None)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f'structured outputs: each structural_tag structure needs "begin", "schema" and "end" '
                             f'strings, and "triggers" a list of strings; got {s!r}') from e
        if trigger is None:
            raise ValueError(f"structured outputs: structural_tag begin {begin!r} starts with no trigger of {triggers}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=json_grammar(schema), end=end))
    if not tags:
        raise ValueError("structured outputs: structural_tag has no structures")
    return llguidance.StructTag.to_grammar(tags)


def spec_key(spec: StructuredOutputsParams) -> str:
    """Specs that give the same grammar share one compilation. A schema's property order is
    the order its output takes, so the key keeps it (as vLLM's does)."""
    fields = {k: v for k, v in spec.__dict__.items() if v not in (None, False) and k != "disable_fallback"}
    return json.dumps(fields, default=str)


class Grammar:
    """One request's matcher: which tokens may come next, advanced on each token it gets."""

    def __init__(self, compiled: Future, eos: int | None = None) -> None:
        self._compiled = compiled
        self._eos = eos  # llguidance's EOS id (the tokenizer's)
        self._matcher = None  # the request's own copy, made when first needed
        # vLLM's `terminated`: the EOS was accepted. Under ignore_eos the request goes on, its
        # tokens no longer constrained (every bit of its mask rows set), as in vLLM.
        self.terminated = False
        # Set when filling a mask: no id of the model's vocabulary may come next (only ids
        # that the tokenizer alone has); the engine ends the request, dropping that row's token.
        self.dead_end = False
        # In a speculative step: the first position after a draft that is at a dead end (None:
        # none). A request that accepts the drafts up to there ends after them.
        self.dead_end_at: int | None = None

    @property
    def ready(self) -> bool:
        """Compiled: the request may be scheduled."""
        return self._compiled.done()

    @property
    def matcher(self):
        if self._matcher is None:
            self._matcher = self._compiled.result().deep_copy()
        return self._matcher

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar accepts from here (drafts past them are dropped;
        after a complete match, all: its EOS is sampled, not drafted)."""
        return 0 if self.stopped or self.failed else self.matcher.validate_tokens(tokens)

    def replay(self, token_ids: list[int]) -> None:
        """Start again and advance past `token_ids`: a failed step's tokens were taken back
        after the matcher had consumed some of them."""
        self._matcher = None
        self.dead_end, self.dead_end_at, self.terminated = False, None, False
        for token_id in token_ids:
            self.accept(token_id)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar refuses it (a matcher in error
        refuses every token)."""
        if self.terminated:
            return True
        if self.failed:
            return False
        if token_id != self._eos and self.matcher.is_stopped():
            return True  # (vLLM's: past the match only EOS is consumed; what else comes is not judged)
        accepted = self.matcher.consume_token(token_id)
        self.terminated = accepted and token_id == self._eos
        return accepted

    @property
    def stopped(self) -> bool:
        """The match is complete: only EOS may follow. As vLLM's, its mask then allows only
        EOS (llguidance's mask of a stopped matcher), the model samples it, and the EOS ends
        the request (under ignore_eos, the tokens after it are not constrained: `terminated`)."""
        return self.matcher.is_stopped()

    @property
    def failed(self) -> bool:
        """The matcher is in error (its grammar failed to compile, or a token put it there): the
        request ends aborted at its next token, which `accept` refuses, rather than going on
        unconstrained."""
        return self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    @property
    def dead_end_reason(self) -> str:
        """A dead end's finish reason: "stop" if the text is a complete match already (only an
        EOS the model lacks could follow), else "abort" (the grammar needs an id the model lacks)."""
        return "stop" if self.matcher.is_accepting() else "abort"


class StructuredOutputManager:
    """Grammars for one engine: checks specs, compiles each distinct one once (in a thread
    pool), and fills the bitmask of a step's constrained rows."""

    def __init__(self, tokenizer, vocab_size: int, config: StructuredOutputsConfig, *, wait: bool = False) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config
        # Across processes (jax.distributed) compilation is awaited when a request is added:
        # readiness must not depend on timing, or the processes would schedule differently.
        self.wait = wait
        self._tokenizer = None
        self._executor: ThreadPoolExecutor | None = None
        self._mask_executor = None
        self._compiled: dict[str, Future] = {}
        self.mask_seconds = 0.0  # host time spent filling bitmasks
        self.mask_steps = 0

    @property
    def tokenizer(self):
        """llguidance's view of the tokenizer, built on first use over the larger of the model's
        vocabulary and the tokenizer's ids (llguidance refuses fewer ids than the tokenizer has;
        ids past the tokenizer's are never allowed)."""
        if self._tokenizer is None:
            n_vocab = max(self.vocab_size, tokenizer_size(self.hf_tokenizer))
            self._tokenizer = _llguidance().hf.from_tokenizer(self.hf_tokenizer, n_vocab=n_vocab)
        return self._tokenizer

    def grammar(self, spec: StructuredOutputsParams) -> Grammar:
        """A new request's grammar; a ValueError naming the problem if the spec is invalid."""
        llguidance = _llguidance()
        key = spec_key(spec)
        compiled = self._compiled.get(key)
        if compiled is None:
            text = grammar_text(spec, self.config)
            error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
            if error:
                raise ValueError(f"Grammar error: {error}")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                                    thread_name_prefix="jaxvllm-grammar")
            compiled = self._compiled[key] = self._executor.submit(self._compile, text)
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                del self._compiled[next(iter(self._compiled))]
        if self.wait:
            compiled.result()
        return Grammar(compiled, self.tokenizer.eos_token)

    def _compile(self, text: str):
        """A matcher in its start state, which requests copy. (A grammar that fails here,
        after it was validated, gives matchers in error: their requests end as aborted.)"""
        matcher = _llguidance().LLMatcher(self.tokenizer, text)
        if matcher.is_error():
            logger.error("structured outputs: %s", matcher.get_error())
        return matcher

    def bitmask(self, rows: list[tuple[int, Grammar, list[int]]], num_rows: int) -> np.ndarray:
        """int32 [num_rows, ceil(vocab / 32)] over the model's vocabulary, every bit set but in
        the rows of each (row, grammar, drafts): the grammar's allowed next tokens at `row`,
        and in a speculative step, after each of its drafts at the rows that follow (a copy
        of the matcher advances over the drafts: llguidance cannot roll back a grammar with
        a `stop=` or `max_tokens=` lexeme, and costs as much to copy). A failed grammar's rows keep
        every bit (their tokens are dropped), and so do a terminated one's (past its EOS,
        under ignore_eos: unconstrained, as vLLM's). So does a row at a dead end: its grammar is
        marked (`Grammar.dead_end` at `row`, `Grammar.dead_end_at` after a draft)."""
        llguidance = _llguidance()
        start = time.perf_counter()
        vocab, words = self.vocab_size, bitmask_words(self.vocab_size)
        # llguidance fills rows as wide as its tokenizer: wider when the tokenizer has ids
        # past the model's vocabulary.
        extra = self.tokenizer.vocab_size > vocab
        mask = np.full((num_rows, bitmask_words(self.tokenizer.vocab_size)), -1, np.int32)
        live = [(g, row) for row, g, _ in rows if not (g.failed or g.dead_end or g.terminated)]
        matchers = [(g.matcher, row) for g, row in live]
        if len(matchers) == 1:
            llguidance.numpy.fill_next_token_bitmask(matchers[0][0], mask, matchers[0][1])
        elif matchers:
            if self._mask_executor is None:
                self._mask_executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(self._mask_executor, matchers, mask)
        after_drafts = []  # (grammar, row, position) filled past a draft
        for row, g, drafts in rows:
            g.dead_end_at = None
            if g.stopped or g.failed or g.dead_end or not drafts:
                continue
            matcher = g.matcher.deep_copy()
            for position, token in enumerate(drafts, 1):  # (valid: the engine cut them, `Grammar.valid_prefix`)
                if not matcher.consume_token(token):
                    break
                llguidance.numpy.fill_next_token_bitmask(matcher, mask, row + position)
                after_drafts.append((g, row + position, position))
                if matcher.is_stopped():  # (EOS only at the row after; no draft follows a stop)
                    break
        if extra:
            mask = np.ascontiguousarray(mask[:, :words])
            filled = [(g, row, 0) for g, row in live] + after_drafts
            if filled:
                filled_rows = [row for _, row, _ in filled]
                if vocab % 32:  # the last word's bits at or past the vocabulary
                    mask[filled_rows, -1] &= np.int32((1 << vocab % 32) - 1)
                for (g, row, position), allowed in zip(filled, mask[filled_rows].any(axis=1)):
                    if allowed:
                        continue
                    if position == 0:
                        g.dead_end = True
                    elif g.dead_end_at is None:
                        g.dead_end_at = position
                    mask[row] = -1  # (its token is dropped; an all -inf row would sample junk anyway)
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1
        return mask

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
