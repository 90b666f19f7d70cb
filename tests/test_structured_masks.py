"""Structured output's vocabulary masks (issue 47): the fast mask of a grammar state (trie walk, per-frame first
bytes, strings' clean tokens as one translate, exits by suffix, budget needs found only past an upper bound)
is exactly the straightforward one, every token's bytes run through the grammar, over many states and
schemas, on vocabularies with Unicode tokens and UTF-8 characters split across tokens."""

import random

import pytest
from test_structured import JsonishTokenizer, reference_bits

import pocketllm as P


class UnicodeTokenizer(JsonishTokenizer):
    """Every byte alone (so any character may be split anywhere), whole non-ASCII characters, their pieces at
    every split point, and pieces where a string's exits and escapes meet non-ASCII text."""

    CHARS = ["é", "ß", "Ж", "東", "京", "€", "😀", "𝄞"]
    PIECES = [b'"', b'",', b'"}', b'"]', b'":', b'":"', b'","', b'{"', b'["', b'  "', b'\\"', b'\\n', b'\\u00e9',
              b'\\u6771', b'a"', b'ab"', b'true', b'null', b'12', b'-3', b'0.5', b'caf', b'name', b'"name":',
              "café".encode(), "東京".encode(), '東京"}'.encode(), 'é",'.encode(), '"é'.encode(), 'Ж\\"'.encode(),
              "é".encode()[1:] + b'"', "東".encode()[1:] + b'"]', "😀".encode()[2:] + b'",', b'\xc3\xa9\xc3',
              "東京".encode()[2:5], b"abcdefgh", b"<"]

    def __init__(self):
        pieces = [bytes((b,)) for b in range(0x20, 0x100) if b != 0x7F] + [b"\n", b"\t"]
        for ch in self.CHARS:
            data = ch.encode()
            pieces += [data] + [data[:k] for k in range(2, len(data))] + [data[k:] for k in range(1, len(data) - 1)]
        self.vocab = list(dict.fromkeys(pieces + self.PIECES)) + [b""]
        self.vocab_size, self.eos_token, self.special_ids = len(self.vocab), "<eos>", set()


UNICODE_SCHEMAS = [
    {"type": "object", "properties": {
        "名前": {"type": "string", "minLength": 1, "maxLength": 3},
        "city": {"enum": ["東京", "café", "Zürich", None]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 3},
        "note": {"type": "string"}},
     "required": ["名前", "city", "tags", "note"], "additionalProperties": False},
    {"type": "object", "properties": {"ß": {"type": "string", "minLength": 2}, "n": {"type": "integer", "minimum": -5,
                                                                                     "maximum": 120}},
     "required": ["ß"], "additionalProperties": True},
    {"type": "array", "items": {"anyOf": [{"type": "string", "pattern": "^[a-c]{1,3}$"}, {"const": "€uro"},
                                          {"type": "number"}, {"type": "boolean"}]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "additionalProperties": {"type": "string", "maxLength": 1}},
    {"type": ["string", "null"], "minLength": 2, "maxLength": 5},
]


def assert_fast_masks_exact(decoder, seed, steps):
    """Along a random path, every state's mask is the token-by-token reference's, and the bound the budget
    trusts (instead of a tokenizer call per state) is at least the exact need after every allowed token."""
    rng, grammar = random.Random(seed), decoder.grammar
    state = grammar.start
    for _ in range(steps):
        found = grammar.mask(state)
        want = reference_bits(grammar, state)
        assert found.bits == want, [(t, grammar.facts.blobs[t]) for t in range(len(want)) if found.bits[t] != want[t]]
        assert found.bound >= found.most
        assert all(found.fits(room) == (found.most <= room) for room in range(found.most - 2, found.bound + 2))
        allowed = [t for t, ok in enumerate(found.bits) if ok and t not in grammar.facts.eos_ids]
        if not allowed:
            return
        state = grammar.advance(state, grammar.facts.blobs[rng.choice(allowed)])


@pytest.mark.parametrize("schema", range(len(UNICODE_SCHEMAS)))
def test_masks_on_split_unicode_tokens_equal_the_reference(schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": UNICODE_SCHEMAS[schema]}}
    decoder = P.structured_decoder(UnicodeTokenizer(), response_format=fmt, max_tokens=4096)
    assert not decoder.facts.byte_bound                  # a tokenizer of unknown normalisation: exact needs
    for seed in range(4):
        assert_fast_masks_exact(decoder, seed, steps=40)


@pytest.mark.parametrize("schema", range(len(UNICODE_SCHEMAS)))
def test_masks_and_budget_bound_on_a_byte_level_bpe(schema):
    tokenizer = P.Tokenizer(P.bundled_model_dir())        # pocket-tiny's byte-level BPE
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": UNICODE_SCHEMAS[schema]}}
    decoder = P.structured_decoder(tokenizer, response_format=fmt, max_tokens=4096)
    assert decoder.facts.byte_bound
    for seed in range(3):
        assert_fast_masks_exact(decoder, seed, steps=40)



@pytest.mark.parametrize("lo, hi", [(0, 1000), (-5, 120), (None, -3), ("0.25", "7.5"), (-1000, None), (1, 1)])
def test_bounded_number_search_skips_only_what_it_cannot_reach(lo, hi):
    """The shortest-number search answers as the full search over every shape does (which the early rejection
    of prefixes past a bound skips), for every prefix up to 3 bytes; nodes with the same bounds share it."""
    bound = lambda v: None if v is None else P.fractions.Fraction(v)  # noqa: E731
    fast, full = P._Decimal(bound(lo), bound(hi)), P._Decimal(bound(lo), bound(hi))
    assert fast._picks is full._picks
    full._picks, full._reachable = {}, lambda text: True
    texts = level = [b""]
    for _ in range(3):
        level = [t + bytes((b,)) for t in level for b in b"-.0123456789" if P._DECIMAL_START.fullmatch(t + bytes((b,)))]
        texts += level
    for text in texts:
        assert fast._pick(text) == full._pick(text), text
