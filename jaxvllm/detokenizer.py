"""Incremental detokenization with stop strings, on the host, for one completion.

Decoding the whole completion after every sampled token costs O(length) per step, so
a long completion would get slower to stream the longer it gets. Like vLLM, we decode
a small window of recent tokens instead and keep the text as

    committed text + text of the pending (not yet committed) tokens.

The window is `ids[start:n]`; `ids[start:read]` is left context whose text
(`prefix_text`) is already committed, so the new text is the window's text minus that
prefix. The context makes position-dependent decoder rules act as in a decode of the
whole completion: a Metaspace/SentencePiece decoder drops the leading space of the
first token only, a ByteLevel decoder needs the lead byte of a character. Text is
committed only when it does not end in U+FFFD: a partial UTF-8 character shows as
U+FFFD (as `tokenizer.decode` shows it) and stays pending until it is complete. If
new tokens change text of the context after all (clean_up_tokenization_spaces turns
" ." into "."), the committed characters that differ are taken back.

The result is exactly `tokenizer.decode(all_ids, skip_special_tokens=...)` after
every update, for about one decode of at most ~16 tokens per update.

A fast tokenizer without the cleanup runs the same scheme in Rust: tokenizers'
`DecodeStream` (vLLM's `FastIncrementalDetokenizer`) keeps the last committed tokens as
the context and commits whatever no longer ends in U+FFFD, so a Python call per token
is most of the cost. The window above mirrors its state, so that pending text can be
shown, and it takes over where the stream cannot keep the text exact: its context's text
changed (tokenizers' "Invalid prefix"), a character was spelled in byte-fallback tokens,
or U+FFFD stayed pending for more than `_FORCE_AFTER` tokens (the stream would re-decode
an ever longer window). A new stream starts from the window's context when the window
next slides past such tokens. The one case
where the window grows with the output is a run of byte-fallback tokens (`<0xE6>`...):
the ByteFallback decoder shows the whole run as U+FFFD once any byte of it is
invalid, so nothing inside a run can be committed before the run ends.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers.decoders import DecodeStream

# Tokens of left context kept in the window before the commit point. A ByteLevel
# character is at most 4 bytes, so 4 tokens (>= 1 byte each) always include the lead
# byte of a character that the commit point cuts into.
_CONTEXT = 4
# ... and, when the tokenizer may clean up tokenization spaces, at least this many
# characters of it (if that takes at most `_SLIDE_AT` tokens).
_CONTEXT_CHARS = 8
# Once the committed part of the window holds more tokens than this, the window moves
# up to the commit point (less `_CONTEXT`): one extra decode every few updates, and
# windows of at most `_SLIDE_AT` + pending tokens.
_SLIDE_AT = 10
# When this many tokens are pending (text keeps ending in U+FFFD, e.g. invalid bytes),
# look for an earlier point where the text is already final and commit up to it.
_FORCE_AFTER = 6
# Tokens after a forced commit point: a UTF-8 character needs at most 3 more bytes,
# so with 3 tokens after it the decoder has settled everything before the point.
_FORCE_KEEP = 3
# Prompt tokens looked at for the context that the first output tokens decode after.
_PROMPT_CONTEXT = 24
# Drop ids before the window once this many have piled up (memory stays bounded).
_TRIM_AT = 1024
# What the ByteFallback decoder reads as one byte: "<0x" + 2 digits (Rust's
# u8::from_str_radix also takes a leading '+') + ">".
_BYTE_TOKEN = re.compile(r"<0x[+0-9A-Fa-f][0-9A-Fa-f]>\Z")
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class TokenizerInfo:
    """What every detokenizer of one tokenizer reads from it: made once per tokenizer (the
    added tokens, thousands in some vocabularies, took milliseconds a request)."""

    special_ids: frozenset[int]  # the ids skip_special_tokens drops
    byte_fallback: bool  # its decoder spells missing characters as <0xNN> byte tokens

    @classmethod
    def of(cls, tokenizer: Any) -> "TokenizerInfo":
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow (Python) tokenizer: be conservative about byte fallback
            return cls(frozenset(tokenizer.all_special_ids), True)
        decoder = backend.decoder
        return cls(frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special),
                   decoder is not None and b"ByteFallback" in decoder.__getstate__())


class IncrementalDetokenizer:
    """The text of one completion, updated token by token, with vLLM stop strings.

    `text` equals `tokenizer.decode(output_ids, skip_special_tokens=...)` after every
    `update` until a stop string appears; then `text` is cut before the stop string
    (after it with `include_stop_str_in_output`) and further `update` calls raise
    RuntimeError, since tokens after the stop are not part of the completion. Given
    `prompt_token_ids`, the text is instead what the output adds to the prompt's last
    tokens, decode(context + output_ids)[len(decode(context)):], as vLLM's is.
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
        self._tokenizer = tokenizer
        self._options = dict(skip_special_tokens=skip_special_tokens, stop=stop,
                             include_stop_str_in_output=include_stop_str_in_output,
                             spaces_between_special_tokens=spaces_between_special_tokens, info=info)
        self._skip_special_tokens = skip_special_tokens
        # transformers' decode option (slow tokenizers honour it; fast ones never add the spaces).
        self._spaces = spaces_between_special_tokens
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self._include_stop = include_stop_str_in_output
        # transformers may skip the cleanup for some models; a longer context is harmless.
        self._cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))

        info = info or TokenizerInfo.of(tokenizer)
        # Ids that decode to nothing wherever they are (skipped specials, ids past the
        # vocabulary) are dropped on arrival: they would otherwise leave a window
        # without real left context, and a long run of them would widen it.
        self._hidden = info.special_ids if skip_special_tokens else frozenset()
        self._byte_fallback = info.byte_fallback
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # Without the cleanup, a fast tokenizer's decode is its backend's: call that
        # directly (transformers' wrapper costs several times the decode itself).
        self._backend_decode = backend.decode if backend is not None and not self._cleanup else None
        self._id_to_token = backend.id_to_token if backend is not None else self._slow_id_to_token

        self._ids: list[int] = []  # decoder-visible output ids (older ones trimmed)
        self._is_byte: list[bool] = []  # per id: a ByteFallback byte token
        self._start = 0  # first id of the decode window
        self._read = 0  # ids before this are committed
        self._prefix_text = ""  # the window's text for ids[start:read]
        self._chunks: list[str] = []  # committed text, in pieces (joined lazily; the last one not empty)
        self._committed_len = 0
        self._settled = 0  # the text's length when it last did not end in U+FFFD (what stops are searched in)
        self._tail = ""  # text of the pending ids ids[read:]
        self._text: str | None = ""  # cached `text`; None when stale
        self._searched_to = 0  # text before this was searched for stop strings
        self._stopped = False
        # tokenizers' incremental decoder while it keeps the text exact, else None (see
        # the module docstring). Its context is ids[start:read] and its pending ids
        # ids[read:]; `_prefix_text` is then None until the pending text needs it.
        self._backend = backend
        self._stream: DecodeStream | None = None
        if prompt_token_ids:
            self._prime(prompt_token_ids)
        if self._backend_decode is not None:
            self._start_stream()

    # -- public ----------------------------------------------------------------------

    def restarted(self, prompt_token_ids: Sequence[int] = ()) -> "IncrementalDetokenizer":
        """A detokenizer with the same options that has seen no output yet: a failed step's
        tokens were taken back, and the tokens before them are fed again."""
        return IncrementalDetokenizer(self._tokenizer, prompt_token_ids=prompt_token_ids, **self._options)

    @property
    def text(self) -> str:
        """The completion text so far. Joined on demand and cached until the next change,
        so updates that nobody reads in between cost nothing here."""
        if self._text is None:
            committed = "".join(self._chunks)
            # Two pieces: taking back a few characters then copies only the short one.
            self._chunks = [committed[:-64], committed[-64:]] if committed else []
            self._text = committed + self._tail
        return self._text

    def text_since(self, start: int) -> str:
        """`text[start:]`, without joining the text before it (a DELTA stream's new text)."""
        if self._text is not None:
            return self._text[start:]
        if start >= self._committed_len:
            return self._tail[start - self._committed_len :]
        return self._recent_committed(self._committed_len - start) + self._tail

    @property
    def settled(self) -> int:
        """How much of `text` vLLM's DecodeStream would show: the text as of the last update
        that left it not ending in U+FFFD (a token's text counts once the character it
        starts is complete; of several tokens at once, all but the U+FFFDs at the end), all
        of it once a stop string cut it."""
        length = self._committed_len + len(self._tail)
        return length if self._stopped else min(self._settled, length)

    @property
    def stop_buffer(self) -> int:
        """Characters at the end of `text` that could still be the start of a stop string
        left out of the text: a stream holds them back until the completion ends (vLLM's
        `stop_buffer_length`)."""
        return self._max_stop_len - 1 if self._stop and not self._include_stop else 0

    def update(self, new_token_ids: Sequence[int], check_stop: bool = True) -> str | None:
        """Append output tokens (usually one per step); return the stop string if one now
        appears in the text (then `text` is cut there and later calls are not allowed).
        A trailing U+FFFD (a character the next token may complete) is not searched yet,
        as vLLM's detokenizer adds no text until a character is complete. With
        `check_stop=False` (below min_tokens) the new text is not searched, and later
        calls search only their own new text, as vLLM does."""
        if self._stopped:
            raise RuntimeError("a stop string was already found; the completion is over")
        added = self._append(new_token_ids)
        if not added:
            return None  # decode ignores these ids: the text is unchanged

        # Where the text may have changed: everything before is as it was.
        changed_from = self._stream_extend(added) if self._stream is not None else None
        if changed_from is None:
            changed_from = self._extend()
        self._text = None
        # As vLLM's DecodeStream, a token's text counts once the text no longer ends in U+FFFD
        # (a token of " " and half an emoji adds " " with the emoji's other half).
        length = self._committed_len + len(self._tail)
        pending = (self._tail or (self._chunks[-1] if self._chunks else "")).endswith(_REPLACEMENT)
        if not pending:
            self._settled = length
        elif added > 1:  # (as one at a time, but for a token of a character and a lead byte: its character counts)
            self._settled = len(self.text.rstrip(_REPLACEMENT))
        else:
            self._settled = min(self._settled, length)
        if self._stop and check_stop:
            return self._check_stop(changed_from)
        if self._stop:  # (below min_tokens: this text counts as searched)
            self._searched_to = self._settled
        return None

    # -- internals -------------------------------------------------------------------

    def _append(self, new_token_ids: Sequence[int]) -> int:
        """Append the ids that decode shows; return how many."""
        added = 0
        for tid in new_token_ids:
            tid = int(tid)
            if tid in self._hidden:
                continue
            token = self._id_to_token(tid)
            if token is None:  # past the vocabulary: decode ignores it
                continue
            self._ids.append(tid)
            self._is_byte.append(self._byte_fallback and _BYTE_TOKEN.match(token) is not None)
            added += 1
        return added

    def _prime(self, prompt_token_ids: Sequence[int]) -> None:
        """Start the window with the prompt's last tokens as committed context, as vLLM's
        detokenizer does: the completion's first token then decodes as it follows the
        prompt (a SentencePiece "▁Paris" keeps its space, which it loses at the start of
        a text). The context is the shortest suffix of at least `_CONTEXT` visible tokens
        whose text is whole (no U+FFFD), else the last `_PROMPT_CONTEXT` of them."""
        visible = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT:]
                   if int(t) not in self._hidden and self._id_to_token(int(t)) is not None]
        context = visible
        for size in range(_CONTEXT, len(visible)):
            if _REPLACEMENT not in self._decode(visible[-size:]):
                context = visible[-size:]
                break
        if context:
            self._ids = context
            self._is_byte = [self._byte_fallback and _BYTE_TOKEN.match(self._id_to_token(t)) is not None
                             for t in context]
            self._read = len(context)
            self._prefix_text = self._decode(context)

    def _start_stream(self) -> bool:
        """Feed the committed ids ids[start:read] to a new stream, which commits them in its
        own groups; the window follows them. Returns False, the window unchanged, where the
        stream could not keep the text exact (see `update`) or its text ends pending."""
        stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        start = read = self._start
        try:
            for i in range(self._start, self._read):
                if stream.step(self._backend, self._ids[i]) is not None:
                    if self._is_byte[i]:
                        raise ValueError("committed inside a byte-fallback run")
                    start, read = read, i + 1
        except Exception as error:  # (tokenizers raises plain Exceptions)
            if not _stream_gave_up(error):
                raise
            return False
        if read != self._read:
            return False
        self._stream, self._start, self._prefix_text = stream, start, None
        return True

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, spaces_between_special_tokens=self._spaces
        )

    def _slow_id_to_token(self, tid: int) -> str | None:
        try:
            return self._tokenizer.convert_ids_to_tokens(tid)
        except (IndexError, KeyError, ValueError, OverflowError):
            return None

    def _stream_extend(self, added: int) -> int | None:
        """Step the stream over the `added` new ids and commit what it hands out. Returns
        the offset in `text` from which the text may differ from before, or None after
        handing the window back to `_extend` (the state as it was before these ids)."""
        ids, n = self._ids, len(self._ids)
        before = (len(self._chunks), self._committed_len, self._start, self._read)
        try:
            for i in range(n - added, n):
                piece = self._stream.step(self._backend, ids[i])
                if piece is not None:
                    if self._is_byte[i]:  # (a later byte of the run may turn it into U+FFFD)
                        raise ValueError("committed inside a byte-fallback run")
                    self._chunks.append(piece)
                    self._committed_len += len(piece)
                    self._start, self._read = self._read, i + 1
            if self._read < n:  # pending ids: their text, from the context's
                if n - self._read > _FORCE_AFTER:
                    raise ValueError("U+FFFD pending too long")
                if self._prefix_text is None or self._read != before[3]:
                    self._prefix_text = self._decode(ids[self._start:self._read])
                window_text = self._decode(ids[self._start:n])
                if not window_text.startswith(self._prefix_text):
                    raise ValueError("the context's text changed")
                tail = window_text[len(self._prefix_text):]
            else:
                tail, self._prefix_text = "", None
        except Exception as error:  # (tokenizers raises plain Exceptions)
            if not _stream_gave_up(error):
                raise
            # Back to the state before these ids, and the window decode from there on.
            del self._chunks[before[0]:]
            self._committed_len, self._start, self._read = before[1:]
            self._stream = None
            self._prefix_text = self._decode(ids[self._start:self._read])
            return None
        changed_from = before[1]
        if self._tail:  # (the pending text's start that the new ids left as it was did not change)
            changed_from += len(os.path.commonprefix([self._tail, "".join(self._chunks[before[0]:]) + tail]))
        self._tail = tail
        if self._start >= _TRIM_AT:
            del self._ids[:self._start], self._is_byte[:self._start]
            self._read -= self._start
            self._start = 0
        return changed_from

    def _extend(self) -> int:
        """Decode the window after new ids arrived; commit what is final. Returns the
        offset in `text` from which the text may differ from before."""
        ids, n = self._ids, len(self._ids)
        window_text = self._decode(ids[self._start:n])
        prefix = self._prefix_text
        if window_text.startswith(prefix):
            keep = len(prefix)
            # (the pending text's start that the new tokens left as it was did not change)
            changed_from = self._committed_len + len(os.path.commonprefix([self._tail, window_text[keep:]]))
        else:
            # The new tokens changed text of the context (e.g. clean_up_tokenization_spaces
            # turns " ." into "."): take back the committed characters that differ.
            keep = len(os.path.commonprefix([prefix, window_text]))
            self._drop_committed(len(prefix) - keep)
            self._prefix_text = prefix = prefix[:keep]
            changed_from = self._committed_len
        self._tail = window_text[keep:]

        if not window_text.endswith(_REPLACEMENT) and not self._is_byte[-1]:
            self._commit(n, window_text)
        elif n - self._read > _FORCE_AFTER:
            self._force_commit(window_text)
        return changed_from

    def _commit(self, read: int, read_text: str) -> None:
        """Move the commit point to `read`, whose window text is `read_text` (a prefix of
        the current window text that starts with `prefix_text`)."""
        new = read_text[len(self._prefix_text):]
        if new:
            self._chunks.append(new)
            self._committed_len += len(new)
        self._tail = self._tail[len(new):]
        self._read = read
        self._prefix_text = read_text
        if read - self._start > _SLIDE_AT:
            # With clean_up_tokenization_spaces (" ' s" -> "'s") the context should
            # also hold a few characters: the window's first token may lose its
            # leading space (Metaspace), which changes how the cleanup reads the
            # characters after it; those must stay before the commit point.
            start = read - _CONTEXT
            prefix = self._decode(self._ids[start:read])
            while self._cleanup and len(prefix) < _CONTEXT_CHARS and start > 0 and read - start < _SLIDE_AT:
                start = max(0, start - _CONTEXT)
                prefix = self._decode(self._ids[start:read])
            self._start, self._prefix_text = start, prefix
            if self._start >= _TRIM_AT:
                del self._ids[:self._start], self._is_byte[:self._start]
                self._read -= self._start
                self._start = 0
            # Where the stream gave up (a byte-fallback character, say), it takes over
            # again from a context that no byte run crosses.
            if (self._backend_decode is not None and self._read == len(self._ids)
                    and not any(self._is_byte[self._start:self._read])):
                self._start_stream()

    def _force_commit(self, window_text: str) -> None:
        """The text has ended in U+FFFD for a while (invalid bytes): commit up to a
        point a few tokens back whose text is already final, so the window stays small.

        A point qualifies when it is not inside a byte-fallback run and the window's
        text up to it is a prefix of the whole window's text (a cut inside a valid
        character would show U+FFFD there instead of the character). Nothing qualifies
        inside a long byte-fallback run: the window then grows until the run ends.
        """
        n, lo = len(self._ids), max(self._read, len(self._ids) - _FORCE_AFTER)
        for cut in range(n - _FORCE_KEEP, lo, -1):
            if self._is_byte[cut - 1]:
                continue
            cut_text = self._decode(self._ids[self._start:cut])
            if len(cut_text) >= len(self._prefix_text) and window_text.startswith(cut_text):
                self._commit(cut, cut_text)
                return

    def _drop_committed(self, count: int) -> None:
        """Remove the last `count` characters of the committed text."""
        count = min(count, self._committed_len)
        self._committed_len -= count
        while count:
            last = self._chunks.pop()
            if len(last) > count:
                self._chunks.append(last[:-count])
                break
            count -= len(last)

    def _recent_committed(self, count: int) -> str:
        """The last `count` characters of the committed text (without joining it all)."""
        if count and self._chunks and len(self._chunks[-1]) >= count:
            return self._chunks[-1][-count:]
        parts, have = [], 0
        for chunk in reversed(self._chunks):
            if have >= count:
                break
            parts.append(chunk)
            have += len(chunk)
        joined = "".join(reversed(parts))
        return joined[len(joined) - count:] if count else ""

    def _check_stop(self, changed_from: int) -> str | None:
        """Search the text not searched before or changed since (plus len(longest stop) - 1
        characters before it), up to its trailing U+FFFD, for the stop strings; on a match
        cut the text and finish. As vLLM's (`check_stop_strings`): the first stop string
        in `stop`'s order that occurs there, at its first occurrence, even if another one
        ends before it."""
        frontier, settled = min(changed_from, self._searched_to), self._settled
        self._searched_to = settled
        if settled <= frontier:  # nothing new to search (a run of U+FFFD goes on)
            return None
        lo = max(0, frontier - (self._max_stop_len - 1))
        if lo >= self._committed_len:  # (all in the pending text)
            region = self._tail[lo - self._committed_len : settled - self._committed_len]
        else:
            region = (self._recent_committed(self._committed_len - lo) + self._tail)[: settled - lo]
        found = None
        for s in self._stop:
            # An occurrence must reach past the frontier: older ones were seen before.
            start = region.find(s, max(0, frontier - lo - len(s) + 1))
            if start != -1:
                found, end = s, start + len(s)
                break
        if found is None:
            return None
        cut = lo + (end if self._include_stop else start)
        text = ("".join(self._chunks) + self._tail)[:cut]
        self._chunks, self._committed_len, self._tail = [text], len(text), ""
        self._text = text
        self._stopped = True
        return found


def _stream_gave_up(error: Exception) -> bool:
    """Whether `error` says the stream cannot keep the text exact: tokenizers' "Invalid
    prefix" (new tokens changed the context's text), or one of our checks (ValueError)."""
    return isinstance(error, ValueError) or str(error).startswith("Invalid prefix")
