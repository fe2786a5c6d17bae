"""IncrementalDetokenizer: the text equals a full decode after every token, stop
strings are found across token boundaries, and the work per token stays bounded.

Tokenizers built here with no download: the project's tiny byte-level BPE (GPT-2 /
Llama 3 / Qwen style) and a SentencePiece-style Unigram with byte fallback (Llama 2 /
Mistral style), where characters missing from the vocabulary are spelled as <0xNN>
byte tokens, so partial UTF-8 shows up; the latter with a Metaspace decoder ("sp") and
with Llama 2's Replace / ByteFallback / Fuse / Strip decoder ("llama2").
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jaxvllm.detokenizer import IncrementalDetokenizer

try:
    from weights.make_tiny import make_tokenizer
except ImportError:  # moved: it lives in jaxvllm.dummy
    from jaxvllm.dummy import make_tokenizer

TOKENIZERS = ["tiny", "sp", "llama2"]
SENTENCE = "The quick brown fox jumps over the lazy dog."
# Text for the random streams and the long-run check: CJK and emoji, some of which
# ("漢", "🙂") the SentencePiece vocabulary lacks, so they become byte tokens there.
MIXED = "Hello, world! 漢字 and 日本語 🙂 text 🎉, how are you today ? 中文 ✨ fine . I 'm ' s ok"


def _sentencepiece_tokenizer(cleanup: bool = False, llama2_decoder: bool = False):
    """A Unigram Metaspace tokenizer with byte fallback and a hand-written vocabulary
    (deterministic, unlike a trained one): <unk> <s> </s>, the 256 byte tokens, then
    pieces. `cleanup`: transformers' clean_up_tokenization_spaces (" ." -> "."), which
    rewrites text before the newest token. `llama2_decoder`: the decoder of Llama 2's
    fast tokenizer, whose Strip drops the text's first space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "Hello", "world", "how", "are",
             "you", "today", "text", "and", "fine", "日本語", "中文", "The"]
    chars = sorted(set("abcdefghijklmnopqrstuvwxyzHTW.,!?'日本語中文字🎉✨"))
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    pieces += [("▁", -2.0)] + [("▁" + w, -3.0) for w in words] + [(w, -4.0) for w in words]
    pieces += [(c, -5.0) for c in chars if (c, -4.0) not in pieces]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    if llama2_decoder:
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=cleanup)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return {
        "tiny": make_tokenizer(tmp_path_factory.mktemp("tok")),
        "sp": _sentencepiece_tokenizer(),
        "sp_cleanup": _sentencepiece_tokenizer(cleanup=True),
        "llama2": _sentencepiece_tokenizer(llama2_decoder=True),
    }


def _byte_token_ids(tok, char: str) -> list[int]:
    """One token per UTF-8 byte of `char` (ByteLevel alphabet or <0xNN> tokens)."""
    data = char.encode()
    if tok.convert_tokens_to_ids("<0x00>") not in (None, tok.unk_token_id):
        return [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in data]
    # GPT-2's bytes_to_unicode: printable bytes stand for themselves, the rest map past 255.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [tok.convert_tokens_to_ids(table[b]) for b in data]


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _feed(tok, ids, chunks=None, **kwargs):
    """Feed ids (in the given chunk sizes, default one at a time); return the
    detokenizer, the texts after each update and the first stop string returned."""
    d = IncrementalDetokenizer(tok, **kwargs)
    texts, i = [], 0
    for size in chunks or [1] * len(ids):
        stop = d.update(ids[i:i + size])
        i += size
        texts.append(d.text)
        if stop is not None:
            return d, texts, stop
    return d, texts, None


# -- text equals a full decode ------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", [*TOKENIZERS, "sp_cleanup"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_text_equals_full_decode_after_every_update(tokenizers, name, skip, data):
    tok = tokenizers[name]
    vocab = len(tok)
    text_ids = _encode(tok, MIXED)
    byte_ids = sorted({i for c in "漢🙂é\x80\x7f" for i in _byte_token_ids(tok, c)})
    piece = st.one_of(
        st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3),  # anything
        st.lists(st.sampled_from(sorted(tok.all_special_ids)), min_size=1, max_size=3),
        st.lists(st.sampled_from(byte_ids), min_size=1, max_size=5),  # partial or invalid UTF-8
        st.integers(vocab, vocab + 100).map(lambda i: [i]),  # past the vocabulary: decodes to nothing
        st.tuples(st.integers(0, len(text_ids) - 1), st.integers(1, 8)).map(lambda ab: text_ids[ab[0]:ab[0] + ab[1]]),
    )
    ids = [i for p in data.draw(st.lists(piece, min_size=1, max_size=40)) for i in p]
    chunks, left = [], len(ids)
    for size in data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids))):
        if left <= 0:
            break
        chunks.append(min(size, left))
        left -= size
    d, texts, stop = _feed(tok, ids, chunks, skip_special_tokens=skip)
    assert stop is None
    done = 0
    for size, text in zip(chunks, texts):
        done += size
        assert text == tok.decode(ids[:done], skip_special_tokens=skip), tok.convert_ids_to_tokens(ids[:done])


@pytest.mark.parametrize("name", TOKENIZERS)
def test_long_realistic_stream(tokenizers, name):
    """A few hundred tokens of text with special tokens between sentences."""
    tok = tokenizers[name]
    ids = []
    for k in range(12):
        ids += _encode(tok, (MIXED + " " + SENTENCE + " ") * (1 + k % 2)) + [tok.eos_token_id, tok.bos_token_id]
    for skip in (True, False):
        d, texts, _ = _feed(tok, ids, skip_special_tokens=skip)
        for n in range(1, len(ids) + 1, 7):
            assert texts[n - 1] == tok.decode(ids[:n], skip_special_tokens=skip)
        assert d.text == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("char", ["漢", "🙂"])
@pytest.mark.parametrize("name", TOKENIZERS)
def test_partial_utf8_shows_replacement_char_until_complete(tokenizers, name, char):
    tok = tokenizers[name]
    prefix = _encode(tok, "Hello")
    d = IncrementalDetokenizer(tok)
    d.update(prefix)
    assert d.text == "Hello"
    byte_ids = _byte_token_ids(tok, char)
    assert len(byte_ids) == len(char.encode()) >= 3
    for i, tid in enumerate(byte_ids):
        assert d.update([tid]) is None
        expected = tok.decode(prefix + byte_ids[:i + 1], skip_special_tokens=True)
        assert d.text == expected
        if i < len(byte_ids) - 1:
            assert d.text.startswith("Hello") and d.text.endswith("\ufffd")
    assert d.text == "Hello" + char
    # More text after the completed character.
    more = _encode(tok, " fine")
    d.update(more)
    assert d.text == tok.decode(prefix + byte_ids + more) == "Hello" + char + " fine"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_special_tokens_and_unknown_ids(tokenizers, name):
    tok = tokenizers[name]
    hello = _encode(tok, "Hello world")
    # Long runs of ids that decode to nothing: with skip_special_tokens they must not
    # become the window's only left context (Metaspace would drop " world"'s space).
    hidden = [tok.eos_token_id, len(tok) + 7, tok.bos_token_id] * 4
    ids = [tok.bos_token_id] * 3 + hello + hidden + hello + hidden + hello[-1:]
    for skip in (True, False):
        d, texts, _ = _feed(tok, ids, skip_special_tokens=skip)
        assert texts == [tok.decode(ids[:n], skip_special_tokens=skip) for n in range(1, len(ids) + 1)]
    assert IncrementalDetokenizer(tok).text == ""


def test_byte_fallback_run_turns_invalid(tokenizers):
    """The ByteFallback decoder shows a whole run of byte tokens as U+FFFD (one per
    byte) once any byte in it is invalid: committed characters of the run change."""
    tok = tokenizers["sp"]
    prefix = _encode(tok, "Hello")
    run = _byte_token_ids(tok, "漢") * 8 + _byte_token_ids(tok, "🙂") * 2
    lead = _byte_token_ids(tok, "漢")[:1]
    ids = prefix + run + lead + _encode(tok, " fine") + run[:5]
    d, texts, _ = _feed(tok, ids)
    assert texts == [tok.decode(ids[:n], skip_special_tokens=True) for n in range(1, len(ids) + 1)]
    assert texts[len(prefix) + len(run) - 1] == "Hello" + "漢" * 8 + "🙂" * 2
    assert texts[len(prefix) + len(run)] == "Hello" + "\ufffd" * (len(run) + 1)


@pytest.mark.parametrize("name", [*TOKENIZERS, "sp_cleanup"])
def test_seeded_random_streams(tokenizers, name):
    """Byte soup (lead, continuation and ASCII bytes), text, special tokens: long enough
    streams that the window moves and commits are forced, checked at every update."""
    import random

    tok = tokenizers[name]
    leads = [_byte_token_ids(tok, c)[0] for c in "é漢🙂"]
    conts = sorted({i for c in "漢🙂" for i in _byte_token_ids(tok, c)[1:]})
    ascii_ = _byte_token_ids(tok, "A") + _byte_token_ids(tok, " ")
    text_ids = _encode(tok, MIXED)
    for seed in range(40):
        rng = random.Random(seed)
        ids: list[int] = []
        while len(ids) < 100:
            r = rng.random()
            if r < 0.5:
                ids += rng.choices(leads + conts * 2 + ascii_, k=rng.randrange(1, 12))
            elif r < 0.6:
                ids += [rng.choice(sorted(tok.all_special_ids))] * rng.randrange(1, 6)
            else:
                i = rng.randrange(len(text_ids))
                ids += text_ids[i:i + rng.randrange(1, 8)]
        for skip in (True, False):
            d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            i = 0
            while i < len(ids):
                size = rng.choice([1, 1, 2, 3])
                d.update(ids[i:i + size])
                i += size
                assert d.text == tok.decode(ids[:i], skip_special_tokens=skip), (seed, skip, ids[:i])


def test_cleanup_of_tokenization_spaces_near_the_window_start(tokenizers):
    """clean_up_tokenization_spaces rewrites " ' s" as "'s" (through two replaces):
    with one-character tokens the left context must still hold enough characters."""
    import random

    tok = tokenizers["sp_cleanup"]
    pieces = [tok.convert_tokens_to_ids(p) for p in ["▁", "▁", "▁", "'", "'", "s", "m", ".", ",", "▁you"]]
    for seed in range(30):
        rng = random.Random(seed)
        ids = rng.choices(pieces, k=80)
        _, texts, _ = _feed(tok, ids)
        assert texts == [tok.decode(ids[:n], skip_special_tokens=True) for n in range(1, len(ids) + 1)], seed


# -- stop strings -------------------------------------------------------------------


def test_stop_across_token_boundaries(tokenizers):
    tok = tokenizers["tiny"]
    ids = _encode(tok, SENTENCE)
    d, texts, stop = _feed(tok, ids, stop=["brown fox"])
    assert stop == "brown fox"
    assert d.text == "The quick "
    # Returned at the first update whose text contains it, not before.
    first = next(n for n in range(1, len(ids) + 1) if "brown fox" in tok.decode(ids[:n]))
    assert len(texts) == first
    assert all("brown fox" not in t for t in texts[:-1])

    d, _, stop = _feed(tok, ids, stop=["brown fox"], include_stop_str_in_output=True)
    assert (stop, d.text) == ("brown fox", "The quick brown fox")


@pytest.mark.parametrize("include", [False, True])
def test_stop_at_the_very_start(tokenizers, include):
    tok = tokenizers["tiny"]
    d, texts, stop = _feed(tok, _encode(tok, SENTENCE), stop=["The"], include_stop_str_in_output=include)
    assert stop == "The" and len(texts) == 1
    assert d.text == ("The" if include else "")


@pytest.mark.parametrize("name", TOKENIZERS)
def test_stop_inside_one_token_and_from_one_token_into_the_next(tokenizers, name):
    tok = tokenizers[name]
    ids = _encode(tok, SENTENCE)
    # A token of 3+ characters and a stop string strictly inside it (not seen before).
    for k in range(1, len(ids) - 1):
        before = tok.decode(ids[:k])
        token_text = tok.decode(ids[:k + 1])[len(before):]
        inside = token_text.strip()[1:-1][:2]
        if inside and inside not in before:
            break
    else:
        pytest.fail("no token of 3+ characters")
    start = len(before) + token_text.index(inside)
    d, texts, stop = _feed(tok, ids, stop=[inside])
    assert (stop, len(texts)) == (inside, k + 1)
    assert d.text == SENTENCE[:start]
    d, _, stop = _feed(tok, ids, stop=[inside], include_stop_str_in_output=True)
    assert d.text == SENTENCE[:start + len(inside)]

    # The last 2 characters of that token and the first 2 of the next one.
    nxt = tok.decode(ids[:k + 2])[len(tok.decode(ids[:k + 1])):]
    spanning = token_text[-2:] + nxt[:2]
    where = SENTENCE.index(spanning)
    d, texts, stop = _feed(tok, ids, stop=["zzz", spanning])
    assert (stop, len(texts)) == (spanning, k + 2)
    assert d.text == SENTENCE[:where]
    d, _, _ = _feed(tok, ids, stop=[spanning], include_stop_str_in_output=True)
    assert d.text == SENTENCE[:where + len(spanning)]


def test_the_first_listed_stop_found_wins(tokenizers):
    """As vLLM's `check_stop_strings`: among the stop strings the new text holds, the first
    in the list's order, at its first occurrence, wins (even if another ends before it)."""
    tok = tokenizers["tiny"]
    ids = _encode(tok, SENTENCE)
    # Both appear within one update: "dog" is listed first though "fox" comes first in the text.
    d = IncrementalDetokenizer(tok, stop=["dog", "fox"])
    assert d.update(ids) == "dog"
    assert d.text == SENTENCE[:SENTENCE.index("dog")]
    # Token by token, the one whose text comes first is found first.
    d, _, stop = _feed(tok, ids, stop=["lazy", "quick"])
    assert (stop, d.text) == ("quick", "The ")
    # Overlapping stop strings completed by the same update: the one listed first.
    for stops in (["own fox", "brown f"], ["brown f", "own fox"]):
        d = IncrementalDetokenizer(tok, stop=stops, include_stop_str_in_output=True)
        assert d.update(ids) == stops[0]
        assert d.text == SENTENCE[:SENTENCE.index(stops[0]) + len(stops[0])]
    for stops in (["quick brown fox", "brown"], ["brown", "quick brown fox"], ["brown", "bro"], ["bro", "brown"]):
        d = IncrementalDetokenizer(tok, stop=stops)
        assert d.update(ids) == stops[0] and d.text == SENTENCE[:SENTENCE.index(stops[0])]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_character_split_over_tokens_is_not_a_replacement_char_stop(tokenizers, name):
    """stop=["\ufffd"] (a guard against broken text) ignores the U+FFFD that a character
    shows until its last byte arrives, and finds one that more text leaves behind."""
    tok = tokenizers[name]
    hello, fine = _encode(tok, "Hello"), _encode(tok, " fine")
    char = _byte_token_ids(tok, "漢")
    _, texts, stop = _feed(tok, hello + char + fine, stop=["\ufffd"])
    assert stop is None and texts[-1] == "Hello漢 fine"
    assert texts[len(hello)].endswith("\ufffd")  # (shown while the character is partial)
    _, texts, stop = _feed(tok, hello + char[:1] + fine, stop=["\ufffd"], include_stop_str_in_output=True)
    assert stop == "\ufffd" and texts[-1] == "Hello\ufffd"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_text_below_min_tokens_is_never_searched(tokenizers, name):
    """vLLM searches only text that came once min_tokens tokens were there: a character
    complete within them (pending text while its last token is a byte-fallback byte) is not
    searched later."""
    tok = tokenizers[name]
    char, fine = _byte_token_ids(tok, "漢"), _encode(tok, " fine")
    d = IncrementalDetokenizer(tok, stop=["漢"])
    for i, tid in enumerate(char + fine):
        assert d.update([tid], check_stop=i >= len(char)) is None
    assert d.text == "漢 fine"


def test_a_long_run_of_broken_bytes_costs_little_per_token(tokenizers, monkeypatch):
    """With a stop string, text ending in ever more U+FFFD is not searched again at every
    token (each update read the whole run)."""
    tok = tokenizers["tiny"]
    read: list[int] = []
    recent = IncrementalDetokenizer._recent_committed
    monkeypatch.setattr(IncrementalDetokenizer, "_recent_committed",
                        lambda self, count: (read.append(count), recent(self, count))[1])
    cont = _byte_token_ids(tok, "漢")[1]  # 0xBC: never valid on its own
    d = IncrementalDetokenizer(tok, stop=["\ufffdHello", "zz"])
    for i in range(2000):
        assert d.update([cont], check_stop=i % 7 != 0) is None
    assert max(read, default=0) < 20
    assert d.update(_encode(tok, "Hello")) == "\ufffdHello" and d.text == "\ufffd" * 1999


def test_stop_found_only_once_more_text_arrives(tokenizers):
    """A stop string inside a partial UTF-8 character matches once the character is whole."""
    tok = tokenizers["sp"]
    prefix = _encode(tok, "Hello")
    d = IncrementalDetokenizer(tok, stop=["o漢"], include_stop_str_in_output=True)
    assert d.update(prefix) is None
    byte_ids = _byte_token_ids(tok, "漢")
    assert d.update(byte_ids[:1]) is None
    assert d.update(byte_ids[1:2]) is None
    assert d.text == "Hello\ufffd\ufffd"
    assert d.update(byte_ids[2:]) == "o漢"
    assert d.text == "Hello漢"


def test_no_update_after_a_stop(tokenizers):
    """After a stop string the completion is over: update raises, the text stays."""
    tok = tokenizers["tiny"]
    ids = _encode(tok, SENTENCE)
    d, texts, stop = _feed(tok, ids, stop=["fox"])
    assert stop == "fox"
    with pytest.raises(RuntimeError):
        d.update(ids[:1])
    with pytest.raises(RuntimeError):
        d.update([])
    assert d.text == "The quick brown "


@pytest.mark.parametrize("bad", [[""], ["ok", ""]])
def test_empty_stop_string_is_rejected(tokenizers, bad):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tokenizers["tiny"], stop=bad)


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_match_a_search_of_the_full_text(tokenizers, name, data):
    """Reference: decode everything after each update and search all of it."""
    tok = tokenizers[name]
    text_ids = _encode(tok, MIXED + " " + SENTENCE)
    start = data.draw(st.integers(0, len(text_ids) - 1))
    ids = text_ids[start:start + 30] + data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=10))
    full = tok.decode(ids, skip_special_tokens=True)
    substring = st.tuples(st.integers(0, max(0, len(full) - 1)), st.integers(1, 6)).map(
        lambda ab: full[ab[0]:ab[0] + ab[1]] or "x")
    stops = data.draw(st.lists(st.one_of(substring, st.sampled_from(["o", "漢", "\ufffd", "🙂 t", "zz"])),
                               min_size=1, max_size=3))
    include = data.draw(st.booleans())
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))
    d = IncrementalDetokenizer(tok, stop=stops, include_stop_str_in_output=include)
    done = settled_len = 0
    for size in sizes:
        if done >= len(ids):
            break
        got = d.update(ids[done:done + size])
        # The first listed among those the text now holds, as vLLM's (none was there before),
        # in the text as of the last update that did not leave it ending in U+FFFD (vLLM's
        # DecodeStream adds a token's text once the character it starts is complete; of
        # several tokens at once, all but the U+FFFDs at the end).
        done += size
        text = tok.decode(ids[:done], skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            settled_len = len(text)
        elif len([t for t in ids[done - size:done] if t not in tok.all_special_ids]) > 1:  # (several at once)
            settled_len = len(text.rstrip("\ufffd"))
        else:
            settled_len = min(settled_len, len(text))
        settled = text[:settled_len]
        hits = [(order, settled.find(s), s) for order, s in enumerate(stops) if s in settled]
        if not hits:
            assert got is None and d.text == text and d.settled == settled_len  # (what an output shows)
            continue
        _, at, expected = min(hits)
        assert got == expected
        assert d.text == text[:at + (len(expected) if include else 0)] and d.settled == len(d.text)
        break


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_text_after_a_prompt_is_what_it_adds(tokenizers, name, data):
    """Given the prompt's ids, the text after every update is what the output adds to the
    prompt (vLLM's): decode(prompt + output)[len(decode(prompt)):]."""
    tok = tokenizers[name]
    ids = _encode(tok, SENTENCE + " " + MIXED + " " + SENTENCE)
    cut = data.draw(st.integers(1, len(ids) - 2))
    prompt, output = ids[:cut], ids[cut:cut + 25]
    head = tok.decode(prompt)
    assume(not head.endswith("\ufffd"))  # (a prompt that ends inside a character has no whole text)
    d = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    done = 0
    while done < len(output):
        size = data.draw(st.integers(1, 3))
        d.update(output[done:done + size])
        done += size
        assert d.text == tok.decode(prompt + output[:done])[len(head):]


# -- bounded work -------------------------------------------------------------------


@pytest.mark.parametrize("name", TOKENIZERS)
def test_work_per_update_is_bounded(tokenizers, name, monkeypatch):
    """2000 tokens one at a time: every decode call sees a short window, and there is
    about one call per update (no full re-decode)."""
    tok = tokenizers[name]
    lengths: list[int] = []
    decode = tok.decode
    window_decode = IncrementalDetokenizer._decode

    def recording_decode(self, ids):
        lengths.append(len(ids))
        return window_decode(self, ids)

    stream = []
    while len(stream) < 2000:
        stream += _encode(tok, MIXED + " " + SENTENCE) + [tok.eos_token_id]
    stream = stream[:2000]
    expected = decode(stream, skip_special_tokens=True)
    monkeypatch.setattr(IncrementalDetokenizer, "_decode", recording_decode)
    d = IncrementalDetokenizer(tok, stop=["never appears"])
    for tid in stream:
        d.update([tid])
    monkeypatch.undo()
    assert d.text == expected
    assert max(lengths) < 20
    assert len(lengths) < 1.5 * len(stream)


def test_invalid_bytes_do_not_grow_the_window(tokenizers, monkeypatch):
    """A byte-level stream of lone continuation bytes ends in U+FFFD at every step;
    the detokenizer still commits text (a few tokens back), so windows stay short."""
    tok = tokenizers["tiny"]
    lengths: list[int] = []
    decode, window_decode = tok.decode, IncrementalDetokenizer._decode
    monkeypatch.setattr(IncrementalDetokenizer, "_decode", lambda self, ids: (lengths.append(len(ids)), window_decode(self, ids))[1])
    cont = _byte_token_ids(tok, "漢")[1]  # 0xBC: never valid on its own
    d = IncrementalDetokenizer(tok)
    for _ in range(500):
        d.update([cont])
    monkeypatch.undo()
    assert d.text == "\ufffd" * 500 == decode([cont] * 500)
    assert max(lengths) < 20


# -- tokenizers' DecodeStream -------------------------------------------------------


@pytest.mark.parametrize("name", TOKENIZERS)
def test_plain_text_decodes_in_the_stream(tokenizers, name, monkeypatch):
    """A fast tokenizer without the cleanup decodes text whose characters are whole tokens
    in tokenizers' DecodeStream: the window's own decodes (Python calls, several times
    the cost) are then left for the prompt's context alone."""
    tok = tokenizers[name]
    calls = []
    window_decode = IncrementalDetokenizer._decode
    monkeypatch.setattr(IncrementalDetokenizer, "_decode", lambda self, ids: (calls.append(ids), window_decode(self, ids))[1])
    prompt, ids = _encode(tok, SENTENCE), _encode(tok, (SENTENCE + " Hello, how are you today? ") * 20)
    d = IncrementalDetokenizer(tok, stop=["never appears"], prompt_token_ids=prompt)
    primed = len(calls)
    for tid in ids:
        assert d.update([tid]) is None
    monkeypatch.undo()
    assert d.text == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert len(calls) == primed, calls[primed:]


@pytest.mark.parametrize("name", ["sp", "llama2"])
def test_the_stream_takes_over_again_after_a_byte_fallback_character(tokenizers, name, monkeypatch):
    """A character spelled in byte tokens is decoded in the window; once the window slides
    past it, a new stream decodes the plain text after it, so one emoji early in a long
    completion does not leave the rest of it on the window's Python decodes."""
    tok = tokenizers[name]
    ids = _encode(tok, "Hello 🙂 " + (SENTENCE + " Hello, how are you today? ") * 10)
    assert any(tok.convert_ids_to_tokens(t).startswith("<0x") for t in ids[:8])
    calls = []
    window_decode = IncrementalDetokenizer._decode
    monkeypatch.setattr(IncrementalDetokenizer, "_decode", lambda self, ids: (calls.append(ids), window_decode(self, ids))[1])
    d = IncrementalDetokenizer(tok, stop=["never appears"])
    for n, tid in enumerate(ids, 1):
        assert d.update([tid]) is None
        assert d.text == tok.decode(ids[:n], skip_special_tokens=True)
        if n == 30:
            assert d._stream is not None
            calls.clear()
    assert calls == []


class _FailingStream:
    """tokenizers' DecodeStream that raises its "Invalid prefix" error at step `at` (as it
    does where new tokens change its context's text)."""

    def __init__(self, stream, at: int):
        self.stream, self.at, self.steps = stream, at, 0

    def step(self, tokenizer, tid):
        self.steps += 1
        if self.steps == self.at:
            raise Exception("Invalid prefix encountered while decoding stream. Token ID: %d" % tid)
        return self.stream.step(tokenizer, tid)


@pytest.mark.parametrize("at", [1, 2, 5, 9])
@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_window_takes_over_where_the_stream_gives_up(tokenizers, name, at):
    """Where the stream raises, the update starts again from before it in the window, and
    the text and stop strings come out as without the stream."""
    tok = tokenizers[name]
    ids = _encode(tok, SENTENCE + " Hello 漢字 world, how are you? " + SENTENCE)
    expected = [tok.decode(ids[:n], skip_special_tokens=True) for n in range(1, len(ids) + 1)]
    for stop in ([], ["you?"]):
        d = IncrementalDetokenizer(tok, stop=stop, include_stop_str_in_output=True)
        assert d._stream is not None
        d._stream = failing = _FailingStream(d._stream, at)
        i, found = 0, None
        for size in [1, 3, 1, 2] * len(ids):
            if i >= len(ids) or found:
                break
            found = d.update(ids[i:i + size])
            i = min(i + size, len(ids))
            assert found or d.text == expected[i - 1]
        # (the window went on alone, then a new stream from its context when it slid)
        assert failing.steps >= at and d._stream is not failing
        assert d.text == (SENTENCE + " Hello 漢字 world, how are you?" if stop else expected[-1])


@pytest.mark.parametrize("name", TOKENIZERS)
def test_text_since_an_offset_is_the_texts_tail(tokenizers, name):
    """What a DELTA stream reads: text[start:] at every update, read or not in between,
    without joining the text before it."""
    tok = tokenizers[name]
    ids = _encode(tok, (MIXED + " " + SENTENCE + " ") * 4)
    d = IncrementalDetokenizer(tok)
    for n, tid in enumerate(ids, 1):
        d.update([tid])
        start = (n * 7) % (len(tok.decode(ids[:n], skip_special_tokens=True)) + 2)
        text = tok.decode(ids[:n], skip_special_tokens=True)
        assert d.text_since(start) == text[start:]
        if n % 5 == 0:
            assert d.text == text


def test_a_tokens_text_counts_for_stops_once_its_last_character_is_complete(tokenizers):
    """As vLLM's DecodeStream: a token of "c" and the first byte of "á" adds "c" only with
    the token that completes it, so a stop string (or the min_tokens count) sees the "c"
    at that token (a search up to the U+FFFD stopped a token early, and under min_tokens
    never stopped)."""
    tok = tokenizers["tiny"]
    hello = _encode(tok, "Hello ")
    c_and_lead = [i for i in range(len(tok)) if tok.decode([i]) == "c\ufffd"][0]
    completing = next(i for i in range(len(tok)) if tok.decode([c_and_lead, i]) == "cá")
    ids = hello + [c_and_lead, completing]
    for check_from in (0, len(hello) + 1):  # (the second: min_tokens covers the "c" token)
        d = IncrementalDetokenizer(tok, stop=["c"])
        found = [d.update([t], check_stop=i >= check_from) for i, t in enumerate(ids)]
        assert found == [None] * (len(ids) - 1) + ["c"] and d.text == "Hello "
    # What an output shows (`settled`): not the "c" while the "á" is partial; and a U+FFFD
    # that later text left behind stays, when a stop string cuts the text right after it.
    d = _feed(tok, hello + [c_and_lead])[0]
    assert d.text == "Hello c\ufffd" and d.settled == len("Hello ")
    d = _feed(tok, hello + [c_and_lead], [len(hello) - 1, 2])[0]  # (tokens fed at once: all but the U+FFFD)
    assert d.text == "Hello c\ufffd" and d.settled == len("Hello c")
    lead = _encode(tok, "\U0001F600")[0]
    d = IncrementalDetokenizer(tok, stop=["ST"])
    assert [d.update([t]) for t in [lead, *_encode(tok, "S"), *_encode(tok, "T")]] == [None, None, "ST"]
    assert d.text == "\ufffd" and d.settled == 1
