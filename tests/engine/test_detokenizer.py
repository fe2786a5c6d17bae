"""IncrementalDetokenizer: the text is vLLM's after every token (tokenizers' DecodeStream,
restated here with `decode` as the reference, `_vllm_texts`), whole characters show as HF's
decode shows them, and stop strings are found across token boundaries.

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

from jaxvllm.detokenizer import IncrementalDetokenizer, TokenizerInfo

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


def _vllm_texts(tok, ids, prompt=(), skip=True):
    """The text after each of `ids`, fed one at a time, as vLLM 0.11's detokenizer builds it:
    tokenizers' DecodeStream, restated with `decode` (the ids since the text last handed out,
    after the context before them, are decoded with it, and what they add is handed out
    once it does not end in U+FFFD; where the context's text changed, a new stream starts
    from the new id), primed with the prompt's shortest suffix of 4 to 23 ids whose text has
    no U+FFFD (the whole prompt if none)."""
    backend = tok.backend_tokenizer
    state = dict(ids=[], prefix="", index=0)

    def step(t):
        state["ids"].append(t)
        text = backend.decode(state["ids"], skip_special_tokens=skip)
        if len(text.encode()) <= len(state["prefix"].encode()) or text.endswith("\ufffd"):  # (Rust's lengths: bytes)
            return ""
        if not text.startswith(state["prefix"]):
            state.update(ids=[], prefix="", index=0)
            return step(t)
        new, index = text[len(state["prefix"]):], len(state["ids"]) - state["index"]
        state["ids"] = state["ids"][state["index"]:]
        state["prefix"], state["index"] = backend.decode(state["ids"], skip_special_tokens=skip), index
        return new

    prime = list(prompt)
    for size in range(4, min(len(prime) + 1, 24)) if len(prime) > 4 else ():
        if "\ufffd" not in backend.decode(prime[-size:]):
            prime = prime[-size:]
            break
    for t in prime:
        step(t)
    texts, text = [], ""
    for t in ids:
        text += step(t)
        texts.append(text)
    return texts


def _random_ids(tok, rng, n):
    """Text, byte soup (lead and continuation bytes: partial and invalid UTF-8), special
    tokens and ids past the vocabulary."""
    leads = [_byte_token_ids(tok, c)[0] for c in "é漢🙂"]
    conts = sorted({i for c in "漢🙂" for i in _byte_token_ids(tok, c)[1:]})
    text_ids = _encode(tok, MIXED)
    ids: list[int] = []
    while len(ids) < n:
        r = rng.random()
        if r < 0.4:
            ids += rng.choices(leads + conts * 2, k=rng.randrange(1, 8))
        elif r < 0.5:
            ids += [rng.choice(sorted(tok.all_special_ids))] * rng.randrange(1, 4)
        elif r < 0.55:
            ids.append(len(tok) + rng.randrange(100))
        else:
            i = rng.randrange(len(text_ids))
            ids += text_ids[i:i + rng.randrange(1, 8)]
    return ids[:n]


def _whole_characters(tok, words) -> list[list[int]]:
    """Each word's ids: " word" encoded, or each character of it spelled in byte tokens
    where the tokenizer has them (a byte-fallback run of several characters)."""
    return [_encode(tok, " " + w) for w in words] + [[i for c in w for i in _byte_token_ids(tok, c)] for w in words]


# -- the text -----------------------------------------------------------------------


@pytest.mark.parametrize("name", [*TOKENIZERS, "sp_cleanup"])
def test_text_is_vllms_after_every_update(tokenizers, name):
    """Random streams (byte soup, special tokens, ids past the vocabulary), after a random
    prompt or none, fed in chunks of 1 to 3: the text after each update is vLLM's."""
    import random

    tok = tokenizers[name]
    for seed in range(40):
        rng = random.Random(seed)
        prompt, ids = _random_ids(tok, rng, rng.randrange(0, 30)), _random_ids(tok, rng, 60)
        for skip in (True, False):
            want = _vllm_texts(tok, ids, prompt, skip)
            d = IncrementalDetokenizer(tok, skip_special_tokens=skip, prompt_token_ids=prompt)
            i = 0
            while i < len(ids):
                size = rng.choice([1, 1, 2, 3])
                d.update(ids[i:i + size])
                i = min(i + size, len(ids))
                assert d.text == want[i - 1] and d.length == len(d.text), (seed, skip, prompt, ids[:i])


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", [*TOKENIZERS, "sp_cleanup"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_whole_characters_show_as_hf_decodes_them(tokenizers, name, skip, data):
    """Wherever the tokens so far spell whole characters, the text is HF's decode of them
    (without clean_up_tokenization_spaces, which vLLM's stream never applies), also inside a
    run of byte-fallback tokens that spells several characters, which HF's decode shows as
    U+FFFDs until its last character is complete; between those points it only grows."""
    tok = tokenizers[name]
    words = ["Hello", "world", "漢🙂漢", "日本語", "🙂", "é", "fine", "."]
    piece = st.one_of(st.sampled_from(_whole_characters(tok, words)),
                      st.sampled_from(sorted(tok.all_special_ids)).map(lambda i: [i]),
                      st.integers(len(tok), len(tok) + 100).map(lambda i: [i]))
    ids = [i for p in data.draw(st.lists(piece, min_size=1, max_size=12)) for i in p]
    d, texts, _ = _feed(tok, ids, skip_special_tokens=skip)
    before = ""
    for n, text in enumerate(texts, 1):
        full = tok.decode(ids[:n], skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        if "\ufffd" not in full:
            assert text == full, tok.convert_ids_to_tokens(ids[:n])
        assert text.startswith(before)
        before = text


@pytest.mark.parametrize("name", TOKENIZERS)
def test_long_realistic_stream(tokenizers, name):
    """A few hundred tokens of text with special tokens between sentences."""
    tok = tokenizers[name]
    ids = []
    for k in range(12):
        ids += _encode(tok, (MIXED + " " + SENTENCE + " ") * (1 + k % 2)) + [tok.eos_token_id, tok.bos_token_id]
    for skip in (True, False):
        d, texts, _ = _feed(tok, ids, skip_special_tokens=skip)
        for n in range(1, len(ids) + 1):
            full = tok.decode(ids[:n], skip_special_tokens=skip)
            if "\ufffd" not in full:
                assert texts[n - 1] == full
        assert d.text == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("char", ["漢", "🙂"])
@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_partial_character_adds_nothing_until_complete(tokenizers, name, char):
    tok = tokenizers[name]
    prefix = _encode(tok, "Hello")
    d = IncrementalDetokenizer(tok)
    d.update(prefix)
    assert d.text == "Hello"
    byte_ids = _byte_token_ids(tok, char)
    assert len(byte_ids) == len(char.encode()) >= 3
    for tid in byte_ids[:-1]:
        assert d.update([tid]) is None and d.text == "Hello"
    d.update(byte_ids[-1:])
    assert d.text == "Hello" + char
    more = _encode(tok, " fine")
    d.update(more)
    assert d.text == tok.decode(prefix + byte_ids + more) == "Hello" + char + " fine"


@pytest.mark.parametrize("name", ["sp", "llama2"])
def test_a_byte_fallback_run_keeps_its_whole_characters(tokenizers, name):
    """A run of byte tokens shows each character once it is complete (HF's decode shows the
    whole run as U+FFFD while its last character is partial): a completion cut inside its
    last character keeps the others, and stop=["\ufffd"] does not fire on them."""
    tok = tokenizers[name]
    hello, run = _encode(tok, "Hello"), [i for c in "漢🙂漢" for i in _byte_token_ids(tok, c)]
    assert tok.decode(hello + run[:-1]).endswith("\ufffd" * (len(run) - 1))
    d, texts, stop = _feed(tok, hello + run[:-1], stop=["\ufffd"])
    assert stop is None and d.text == "Hello漢🙂"
    assert texts[len(hello) + 2] == "Hello漢" and texts[len(hello) + 6] == "Hello漢🙂"
    # A later byte that turns the run invalid takes back nothing: the stream starts anew.
    ids = hello + run[:7] + run[:1] + _encode(tok, " fine")
    d, texts, stop = _feed(tok, ids, stop=["zz"])
    assert texts[len(hello) + 6] == "Hello漢🙂" and d.text.startswith("Hello漢🙂")
    assert d.text == _vllm_texts(tok, ids)[-1]


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_text_after_a_prompt_is_what_it_adds(tokenizers, name, data):
    """Given the prompt's ids, the text is what the output adds to the prompt (vLLM's):
    decode(prompt + output)[len(decode(prompt)):] wherever both are whole characters, also
    where the prompt ends inside a run of byte tokens that the output goes on with."""
    tok = tokenizers[name]
    ids = _encode(tok, SENTENCE + " " + MIXED + " 漢🙂漢 " + SENTENCE)
    cut = data.draw(st.integers(1, len(ids) - 2))
    prompt, output = ids[:cut], ids[cut:cut + 25]
    head = tok.decode(prompt)
    assume(not head.endswith("\ufffd"))  # (a prompt that ends inside a character has no whole text)
    d = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    done = 0
    while done < len(output):
        size = data.draw(st.integers(1, 3))
        d.update(output[done:done + size])
        done = min(done + size, len(output))
        full = tok.decode(prompt + output[:done])
        if "\ufffd" not in full:
            assert d.text == full[len(head):]


def test_a_prompt_that_ends_in_a_byte_spelled_character(tokenizers):
    """An output that goes on with the prompt's run of byte tokens shows its own characters
    only (the prompt's were shown as the output's: "漢🙂" instead of "🙂")."""
    tok = tokenizers["sp"]
    prompt = _encode(tok, "Say it: ") + _byte_token_ids(tok, "漢")
    d, _, _ = _feed(tok, _byte_token_ids(tok, "🙂") + _encode(tok, " fine"), prompt_token_ids=prompt, stop=["zz"])
    assert d.text == "🙂 fine"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_special_tokens_and_unknown_ids(tokenizers, name):
    tok = tokenizers[name]
    hello = _encode(tok, "Hello world")
    # Long runs of ids that decode to nothing, between text.
    hidden = [tok.eos_token_id, len(tok) + 7, tok.bos_token_id] * 4
    ids = [tok.bos_token_id] * 3 + hello + hidden + hello + hidden + hello[-1:]
    for skip in (True, False):
        d, texts, _ = _feed(tok, ids, skip_special_tokens=skip)
        assert texts == [tok.decode(ids[:n], skip_special_tokens=skip) for n in range(1, len(ids) + 1)]
    assert IncrementalDetokenizer(tok).text == ""


def test_special_tokens_without_spaces_between_them(tokenizers):
    """vLLM's spaces_between_special_tokens=False (with skip_special_tokens=False): a special
    token right after another adds its own text, not what the stream makes of it."""
    tok = tokenizers["sp"]
    hello = _encode(tok, "Hello")
    ids = hello + [tok.bos_token_id, tok.eos_token_id, tok.eos_token_id] + _encode(tok, " fine")
    texts = _vllm_texts(tok, ids, skip=False)
    added = [after[len(before):] for before, after in zip([""] + texts, texts)]
    added[len(hello) + 1] = added[len(hello) + 2] = "</s>"
    d, _, _ = _feed(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert d.text == "".join(added)
    assert _feed(tok, ids, skip_special_tokens=False)[0].text == texts[-1]


@pytest.fixture
def stream_steps(monkeypatch):
    """The ids fed to the fast tokenizer's DecodeStream (`_StreamDecoder._step`), in order."""
    from jaxvllm.detokenizer import _StreamDecoder

    steps = []
    step = _StreamDecoder._step
    monkeypatch.setattr(_StreamDecoder, "_step", lambda self, t: (steps.append(t), step(self, t))[1])
    return steps


def test_ids_that_decode_to_nothing_never_reach_the_stream(tokenizers, stream_steps):
    """Skipped special tokens and ids past the vocabulary add no text anywhere: the stream
    never sees them (it would decode a run of them again with each later token: an EOS
    repeated under ignore_eos cost the square of its count), and the text is the same."""
    tok = tokenizers["sp"]
    hello = _encode(tok, "Hello world")
    ids = hello + [tok.eos_token_id] * 1000 + [len(tok) + 5, -1, 2**40] * 100 + hello
    d, _, _ = _feed(tok, ids)
    assert d.text == tok.decode(hello + hello) and stream_steps == hello + hello
    stream_steps.clear()
    d, _, _ = _feed(tok, ids[:len(hello) + 3], skip_special_tokens=False)  # (shown: they count)
    assert stream_steps == ids[:len(hello) + 3]


def test_priming_reads_at_most_the_prompts_last_256_tokens(tokenizers, stream_steps):
    """Where no suffix of 4 to 23 prompt tokens decodes whole (a prompt ending in broken
    bytes), the stream starts from the prompt's last 256 tokens, not all of it (vLLM's):
    primed with a run of broken bytes, its steps cost the square of the run's length."""
    tok = tokenizers["tiny"]
    cont = _byte_token_ids(tok, "漢")[1]  # 0xBC: never valid on its own
    fine = _encode(tok, " fine")
    for run in (30, 4000):
        stream_steps.clear()
        prompt = _encode(tok, "Hello") + [cont] * run
        d, _, _ = _feed(tok, fine, prompt_token_ids=prompt)
        assert len(stream_steps) == min(len(prompt), 256) + len(fine)
        assert d.text == _vllm_texts(tok, fine, prompt[-256:])[-1]
    assert d.text == "\ufffd" * 256 + " fine"


def test_clean_up_tokenization_spaces_is_not_applied(tokenizers):
    """As vLLM's stream: a fast tokenizer's text is never cleaned up (" ." stays " .")."""
    tok = tokenizers["sp_cleanup"]
    ids = _encode(tok, "Hello , world . how are you ' s")
    d, _, stop = _feed(tok, ids, stop=[" ,"])
    assert stop == " ," and d.text == "Hello"
    assert _feed(tok, ids)[0].text == tok.decode(ids, clean_up_tokenization_spaces=False) != tok.decode(ids)


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
    assert texts[len(hello)] == "Hello"  # (nothing while the character is partial)
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


def test_stop_found_only_once_more_text_arrives(tokenizers):
    """A stop string inside a partial UTF-8 character matches once the character is whole."""
    tok = tokenizers["sp"]
    prefix = _encode(tok, "Hello")
    d = IncrementalDetokenizer(tok, stop=["o漢"], include_stop_str_in_output=True)
    assert d.update(prefix) is None
    byte_ids = _byte_token_ids(tok, "漢")
    assert d.update(byte_ids[:1]) is None
    assert d.update(byte_ids[1:2]) is None
    assert d.text == "Hello"
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


def test_a_long_run_of_broken_bytes(tokenizers):
    """Lone continuation bytes leave the text ending in U+FFFD at every token: nothing is
    handed out until a token ends it, then all of it (vLLM's stream); a stop string that
    spans the run and the text after it is found then."""
    tok = tokenizers["tiny"]
    cont = _byte_token_ids(tok, "漢")[1]  # 0xBC: never valid on its own
    d = IncrementalDetokenizer(tok, stop=["\ufffdHello", "zz"])
    for i in range(300):
        assert d.update([cont], check_stop=i % 7 != 0) is None and d.text == ""
    assert d.update(_encode(tok, "Hello")) == "\ufffdHello" and d.text == "\ufffd" * 299


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_match_a_search_of_the_whole_text(tokenizers, name, data):
    """Reference: vLLM's text after each update, searched whole: the first listed stop string
    it holds (none was there before), at its first occurrence."""
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
    want = _vllm_texts(tok, ids)
    d = IncrementalDetokenizer(tok, stop=stops, include_stop_str_in_output=include)
    done = 0
    for size in sizes:
        if done >= len(ids):
            break
        got = d.update(ids[done:done + size])
        done = min(done + size, len(ids))
        text = want[done - 1]
        hits = [(order, text.find(s), s) for order, s in enumerate(stops) if s in text]
        if not hits:
            assert got is None and d.text == text
            continue
        _, at, expected = min(hits)
        assert got == expected
        assert d.text == text[:at + (len(expected) if include else 0)] and d.length == len(d.text)
        break


@pytest.mark.parametrize("name", TOKENIZERS)
def test_text_since_an_offset_is_the_texts_tail(tokenizers, name):
    """What a DELTA stream reads: text[start:] at every update, read or not in between,
    without joining the text before it."""
    tok = tokenizers[name]
    ids = _encode(tok, (MIXED + " " + SENTENCE + " ") * 4)
    want = _vllm_texts(tok, ids)
    d = IncrementalDetokenizer(tok)
    for n, tid in enumerate(ids, 1):
        d.update([tid])
        start = (n * 7) % (len(want[n - 1]) + 2)
        assert d.text_since(start) == want[n - 1][start:]
        if n % 5 == 0:
            assert d.text == want[n - 1]


def test_a_tokens_text_counts_once_its_last_character_is_complete(tokenizers):
    """As vLLM's DecodeStream: a token of "c" and the first byte of "á" adds "c" only with
    the token that completes it, so a stop string (or the min_tokens count) sees the "c"
    at that token, also when the tokens come several at once; a U+FFFD that later text
    left behind stays, when a stop string cuts the text right after it."""
    tok = tokenizers["tiny"]
    hello = _encode(tok, "Hello ")
    c_and_lead = [i for i in range(len(tok)) if tok.decode([i]) == "c\ufffd"][0]
    completing = next(i for i in range(len(tok)) if tok.decode([c_and_lead, i]) == "cá")
    ids = hello + [c_and_lead, completing]
    for check_from in (0, len(hello) + 1):  # (the second: min_tokens covers the "c" token)
        d = IncrementalDetokenizer(tok, stop=["c"])
        found = [d.update([t], check_stop=i >= check_from) for i, t in enumerate(ids)]
        assert found == [None] * (len(ids) - 1) + ["c"] and d.text == "Hello "
    assert _feed(tok, hello + [c_and_lead])[0].text == "Hello "
    assert _feed(tok, hello + [c_and_lead], [len(hello) - 1, 2])[0].text == "Hello "
    lead = _encode(tok, "\U0001F600")[0]
    d = IncrementalDetokenizer(tok, stop=["ST"])
    assert [d.update([t]) for t in [lead, *_encode(tok, "S"), *_encode(tok, "T")]] == [None, None, "ST"]
    assert d.text == "\ufffd" and d.length == 1


# -- a slow (Python) tokenizer ------------------------------------------------------


def _char_tokenizer():
    """A Python tokenizer of single characters (no `backend_tokenizer`), with <s> and </s>."""
    from transformers import PythonBackend

    class CharTokenizer(PythonBackend):
        chars = "abcdefghijklmnopqrstuvwxyz ,.!?'漢"

        def __init__(self, **kwargs):
            super().__init__(bos_token="<s>", eos_token="</s>", **kwargs)

        @property
        def vocab_size(self):
            return len(self.chars)

        def get_vocab(self):
            return {c: i for i, c in enumerate(self.chars)} | self.added_tokens_encoder

        def _tokenize(self, text, **kwargs):
            return list(text)

        def _convert_token_to_id(self, token):
            return self.chars.index(token)

        def _convert_id_to_token(self, index):
            return self.chars[index]

        def convert_tokens_to_string(self, tokens):
            return "".join(tokens)

    return CharTokenizer()


def test_a_slow_tokenizer_decodes_a_window_of_tokens():
    """Without tokenizers' backend the text is vLLM's `detokenize_incrementally`: here
    HF's decode of the tokens after the prompt, special tokens skipped or shown (joined to
    the text by a space, as transformers' slow decode joins them), and stop strings found."""
    tok = _char_tokenizer()
    assert getattr(tok, "backend_tokenizer", None) is None
    prompt, ids = tok.encode("well, ", add_special_tokens=False), tok.encode("hello there. fine!", add_special_tokens=False)
    d, texts, _ = _feed(tok, ids, prompt_token_ids=prompt)
    assert texts == [tok.decode(ids[:n]) for n in range(1, len(ids) + 1)]
    d, _, _ = _feed(tok, ids[:5] + [tok.eos_token_id] + ids[5:], skip_special_tokens=False)
    assert d.text == "hello </s>  there. fine!"  # ("hello", "</s>" and " there. fine!", joined by spaces)
    d, _, _ = _feed(tok, ids + [len(tok) + 3], skip_special_tokens=True, info=TokenizerInfo.of(tok))
    assert d.text == "hello there. fine!"
    d, _, stop = _feed(tok, ids, stop=["e. f"], include_stop_str_in_output=True)
    assert (stop, d.text) == ("e. f", "hello there. f")


def test_a_slow_tokenizers_added_tokens_are_their_own_text():
    """vLLM's rule for a slow tokenizer with added tokens: the text between them is converted
    in runs, and the pieces are joined by a space (spaces_between_special_tokens) or not."""
    tok = _char_tokenizer()
    tok.add_tokens(["<tool>"])
    tool = tok.convert_tokens_to_ids("<tool>")
    ids = tok.encode("hi", add_special_tokens=False) + [tool] + tok.encode("yo", add_special_tokens=False)
    assert _feed(tok, ids)[0].text == "hi <tool> yo"
    assert _feed(tok, ids, spaces_between_special_tokens=False)[0].text == "hi<tool>yo"
    with_eos = ids + [tok.eos_token_id] + tok.encode("ok", add_special_tokens=False)
    assert _feed(tok, with_eos)[0].text == "hi <tool> yook"
    assert _feed(tok, with_eos, skip_special_tokens=False)[0].text == "hi <tool> yo </s> ok"
