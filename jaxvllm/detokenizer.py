"""Incremental detokenization with stop strings, on the host, for one completion.

A completion's text is what vLLM's detokenizer builds, token by token, and a token's
text is handed out once and never taken back:

- A fast tokenizer decodes in tokenizers' `DecodeStream` (vLLM's
  `FastIncrementalDetokenizer`). The stream decodes its context (the tokens it last handed
  out) with the new tokens and hands out what they add once the text no longer ends in
  U+FFFD, so a UTF-8 character spelled over several tokens (byte-level pieces, or
  byte-fallback `<0xNN>` tokens) appears whole with the token that completes it. Where new
  tokens change the context's text (tokenizers' "Invalid prefix"), the stream starts anew
  from the new token alone, as vLLM's does.
- A slow (Python) tokenizer decodes a window of recent tokens with
  `convert_tokens_to_string` (vLLM's `detokenize_incrementally`): the text the new tokens
  add to the window's first tokens, once it does not end in U+FFFD.

Either way the decoder starts from the prompt's last tokens, so the first output token
decodes as it follows the prompt (a SentencePiece "▁Paris" keeps its space). A token
costs one short decode, except in a run of tokens whose text keeps ending in U+FFFD
(invalid bytes): the stream decodes the whole run again with each token until it ends,
as vLLM's does. Tokens that decode to nothing (skipped special tokens, ids past the
vocabulary) never reach the stream, so a long run of them (an EOS repeated under
`ignore_eos`) costs nothing.

Stop strings are vLLM's `check_stop_strings`: the new text (and the characters before
it that a stop string could start in) is searched for each stop string in turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers.decoders import DecodeStream

# The prompt tokens a fast tokenizer's stream starts from: the shortest suffix of at least
# this many whose text is whole (no U+FFFD), up to _PRIME_MAX - 1. If none is, vLLM's takes
# the whole prompt; here its last _PRIME_ALL tokens (the same text unless more of them end
# unfinished: a stream primed with a run of broken bytes costs the square of its length).
_PRIME_MIN = 4
_PRIME_MAX = 24
_PRIME_ALL = 256
# A slow tokenizer's window: the prompt's last tokens read as context, of which the text
# before the last _SLOW_CONTEXT is not part of the window.
_SLOW_PROMPT = 7
_SLOW_CONTEXT = 5
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class TokenizerInfo:
    """What every detokenizer of one tokenizer reads from it: made once per tokenizer (the
    added tokens, thousands in some vocabularies, took milliseconds a request)."""

    added_tokens: dict[int, str]  # an added token's id -> its text (a fast tokenizer's)
    special_ids: frozenset[int]  # the ids of its special ones (what skip_special_tokens drops)
    added_vocab: frozenset[str]  # a slow tokenizer's added tokens
    special_tokens: frozenset[str]  # and its special ones

    @classmethod
    def of(cls, tokenizer: Any) -> "TokenizerInfo":
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            added = backend.get_added_tokens_decoder()
            return cls({i: t.content for i, t in added.items()}, frozenset(i for i, t in added.items() if t.special),
                       frozenset(), frozenset())
        return cls({}, frozenset(), frozenset(tokenizer.get_added_vocab()), frozenset(tokenizer.all_special_tokens))


class _StreamDecoder:
    """A fast tokenizer's text, token by token (vLLM's `FastIncrementalDetokenizer`)."""

    def __init__(self, backend: Any, info: TokenizerInfo, prompt_token_ids: Sequence[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._hidden = info.special_ids if skip_special_tokens else frozenset()
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        prime = prompt_token_ids
        if len(prompt_token_ids) > _PRIME_MIN:
            for size in range(_PRIME_MIN, min(len(prompt_token_ids) + 1, _PRIME_MAX)):
                if _REPLACEMENT not in backend.decode(prompt_token_ids[-size:]):
                    prime = prompt_token_ids[-size:]
                    break
        for token_id in prime:
            if not self._silent(token_id):
                self._step(token_id)
        # Without spaces between special tokens, a special token right after another shows
        # as itself, not as the stream decodes the pair.
        raw = not (skip_special_tokens or spaces_between_special_tokens) and info.added_tokens
        self._raw_specials = info.added_tokens if raw else None
        self._last_special = False

    def next(self, token_id: int) -> str:
        text = None if self._silent(token_id) else self._step(token_id)
        if self._raw_specials is not None:
            special = self._raw_specials.get(token_id)
            if special is not None and self._last_special:
                text = special
            self._last_special = special is not None
        return text or ""

    def _silent(self, token_id: int) -> bool:
        """Whether the id decodes to nothing wherever it is: the stream would keep it among
        the ids it decodes again with each later token, until it hands out text."""
        try:
            return token_id in self._hidden or self._backend.id_to_token(token_id) is None
        except OverflowError:  # (an id past what tokenizers takes)
            return True

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as error:  # (tokenizers raises plain Exceptions)
            if not str(error).startswith("Invalid prefix"):
                raise
            # The new token changed the context's text (invalid UTF-8 that a later byte
            # turns valid): start again from this token alone.
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            return self._stream.step(self._backend, token_id)


class _WindowDecoder:
    """A slow tokenizer's text, token by token (vLLM's `detokenize_incrementally`): the
    window's tokens from `_prefix` are decoded again with each new one, and the text past
    that of tokens[_prefix:_read] is new once it does not end in U+FFFD."""

    def __init__(self, tokenizer: Any, info: TokenizerInfo, prompt_token_ids: Sequence[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._info = info
        self._skip = skip_special_tokens
        self._spaces = spaces_between_special_tokens
        self._vocab_size = len(tokenizer)  # (a Python tokenizer's len() counts its vocabulary each call)
        tail = prompt_token_ids[-_SLOW_PROMPT:]
        self._tokens = [t or "" for t in tokenizer.convert_ids_to_tokens(tail, skip_special_tokens=skip_special_tokens)]
        self._read = len(self._tokens)
        self._prefix = max(self._read - _SLOW_CONTEXT, 0)

    def next(self, token_id: int) -> str:
        new = [""]
        if 0 <= token_id < self._vocab_size:
            new = self._tokenizer.convert_ids_to_tokens([token_id], skip_special_tokens=self._skip)
            new = [new] if isinstance(new, str) else new
        self._tokens.extend(new)
        prefix_text = self._text(self._tokens[self._prefix:self._read])
        text = self._text(self._tokens[self._prefix:])
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return text[len(prefix_text):]

    def _text(self, tokens: list[str]) -> str:
        """The tokens' text; added tokens are their own text, joined to the rest with a space
        if spaces_between_special_tokens (transformers' slow decode)."""
        if not self._info.added_vocab:
            return self._tokenizer.convert_tokens_to_string(tokens)
        parts, run = [], []
        for token in tokens:
            if self._skip and token in self._info.special_tokens:
                continue
            if token in self._info.added_vocab:
                if run:
                    parts.append(self._tokenizer.convert_tokens_to_string(run))
                    run = []
                parts.append(token)
            else:
                run.append(token)
        if run:
            parts.append(self._tokenizer.convert_tokens_to_string(run))
        return (" " if self._spaces else "").join(parts)


class IncrementalDetokenizer:
    """The text of one completion, updated token by token, with vLLM stop strings.

    `text` is what the tokens so far add to the prompt's text (see the module docstring);
    once a stop string appears, `text` is cut before it (after it with
    `include_stop_str_in_output`) and further `update` calls raise RuntimeError, since
    tokens after the stop are not part of the completion.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        spaces_between_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
        info: "TokenizerInfo | None" = None,
    ) -> None:
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())  # vLLM also takes one string
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        info = info or TokenizerInfo.of(tokenizer)
        self._tokenizer = tokenizer
        self._options = dict(skip_special_tokens=skip_special_tokens, stop=stop,
                             include_stop_str_in_output=include_stop_str_in_output,
                             spaces_between_special_tokens=spaces_between_special_tokens, info=info)
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self._include_stop = include_stop_str_in_output
        prompt = [int(t) for t in prompt_token_ids[-_PRIME_ALL:]]  # (all either decoder reads of it)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decoder = _StreamDecoder(backend, info, prompt, skip_special_tokens, spaces_between_special_tokens)
        else:
            self._decoder = _WindowDecoder(tokenizer, info, prompt, skip_special_tokens, spaces_between_special_tokens)
        self._chunks: list[str] = []  # the text, in pieces (joined lazily)
        self._length = 0
        self._text: str | None = ""  # cached `text`; None when stale
        self._stopped = False

    # -- public ----------------------------------------------------------------------

    def restarted(self, prompt_token_ids: Sequence[int]) -> "IncrementalDetokenizer":
        """A detokenizer with the same options that has seen no output yet: a failed step's
        tokens were taken back, and the tokens before them are fed again."""
        return IncrementalDetokenizer(self._tokenizer, prompt_token_ids=prompt_token_ids, **self._options)

    @property
    def text(self) -> str:
        """The completion text so far. Joined on demand and cached until the next change,
        so updates that nobody reads in between cost nothing here."""
        if self._text is None:
            text = "".join(self._chunks)
            # Two pieces: a later stop search then copies only the short one.
            self._chunks = [text[:-64], text[-64:]]
            self._text = text
        return self._text

    def text_since(self, start: int) -> str:
        """`text[start:]`, without joining the text before it (a DELTA stream's new text)."""
        if self._text is not None:
            return self._text[start:]
        return self._recent(self._length - start)

    @property
    def length(self) -> int:
        """len(text), without joining it."""
        return self._length

    @property
    def stop_buffer(self) -> int:
        """Characters at the end of `text` that could still be the start of a stop string
        left out of the text: a stream holds them back until the completion ends (vLLM's
        `stop_buffer_length`)."""
        return self._max_stop_len - 1 if self._stop and not self._include_stop else 0

    def update(self, new_token_ids: Sequence[int], check_stop: bool = True) -> str | None:
        """Append output tokens (usually one per step); return the stop string if one now
        appears in the text (then `text` is cut there and later calls are not allowed).
        With `check_stop=False` (below min_tokens) the new text is not searched, and later
        calls search only their own new text, as vLLM does."""
        if self._stopped:
            raise RuntimeError("a stop string was already found; the completion is over")
        before = self._length
        for token_id in new_token_ids:
            piece = self._decoder.next(int(token_id))
            if piece:
                self._chunks.append(piece)
                self._length += len(piece)
                self._text = None
        if not self._stop or not check_stop:
            return None
        return self._check_stop(before)

    # -- internals -------------------------------------------------------------------

    def _recent(self, count: int) -> str:
        """The last `count` characters of the text (without joining it all)."""
        if count <= 0:
            return ""
        if self._chunks and len(self._chunks[-1]) >= count:
            return self._chunks[-1][-count:]
        parts, have = [], 0
        for chunk in reversed(self._chunks):
            if have >= count:
                break
            parts.append(chunk)
            have += len(chunk)
        joined = "".join(reversed(parts))
        return joined[len(joined) - count:]

    def _check_stop(self, frontier: int) -> str | None:
        """Search the text from `frontier` on (plus len(longest stop) - 1 characters before
        it) for the stop strings; on a match cut the text and finish. As vLLM's
        `check_stop_strings`: the first stop string in `stop`'s order that occurs there, at
        its first occurrence, even if another one ends before it."""
        if self._length <= frontier:
            return None
        lo = max(0, frontier - (self._max_stop_len - 1))
        region = self._recent(self._length - lo)
        for s in self._stop:
            # An occurrence must reach past the frontier: older ones were seen before.
            start = region.find(s, max(0, frontier - lo - len(s) + 1))
            if start != -1:
                cut = lo + start + (len(s) if self._include_stop else 0)
                text = self.text[:cut]
                self._chunks, self._length, self._text = [text], len(text), text
                self._stopped = True
                return s
        return None
