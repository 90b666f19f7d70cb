"""Structured output (issue 21): response_format json_object / json_schema, strict tools, $ref schemas, and
every call valid in auto mode, all by the one constrained decoder of section 11b.

The model is a random-weight checkpoint (the worst model there is: it never writes JSON on its own), sampled
at temperature 1 with penalties, so every valid answer below is the decoder's doing. The reference for
"valid" is the `jsonschema` package, for "parses" the published clients (openai's parse(), langchain's
with_structured_output()).
"""

import enum
import json
import random
from typing import Optional

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import pocketllm as P

KEY = "structured-key"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def llm(ckpt_factory):
    path, _ = ckpt_factory("qwen3_5")
    return P.LLM(str(path), quiet=True, max_context=1024, max_batch_size=8)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)


def decode(llm, schema, max_tokens=96, seed=0, strict=True):
    """The schema's JSON answer from the random model through the real engine and sampler."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}
    decoder = P.structured_decoder(llm.tokenizer, response_format=fmt, max_tokens=max_tokens,
                                   eos_token_ids=llm.eos_token_ids)
    out = llm.generate("Answer in JSON:", max_tokens=max_tokens, temperature=1.0, presence_penalty=0.5,
                       repetition_penalty=1.1, seed=seed, logits_processors=[decoder])
    assert out["finish_reason"] == "stop", out            # closed within max_tokens, never cut off
    return out["text"]


# Schemas from the supported set (item 2), as hypothesis draws them.

LEAVES = st.one_of(
    st.builds(lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span}, st.integers(0, 3),
              st.integers(0, 6)),
    st.just({"type": "string"}),
    st.sampled_from([{"type": "string", "pattern": p} for p in ("^[a-z]{2,5}$", "^\\d{3}-\\d{2}$", "^(yes|no)$",
                                                                 "ab+c?")]),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span}, st.integers(-50, 50),
              st.integers(0, 1000)),
    st.sampled_from([{"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
                     {"type": ["string", "null"]}, {"type": "integer", "nullable": True},
                     {"enum": ["red", "green", 3, None]}, {"const": "fixed"}, {"format": "date-time", "type": "string"}]),
)


def objects(children):
    return st.dictionaries(st.sampled_from(["a", "b", "name", "x y", "é"]), children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False, "title": "T", "description": "d"}))


SCHEMAS = st.recursive(LEAVES, lambda children: st.one_of(
    objects(children),
    st.builds(lambda items, lo, span: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + span},
              children, st.integers(0, 2), st.integers(0, 2)),
    st.builds(lambda a, b: {"anyOf": [a, b]}, children, children),
    st.builds(lambda a, b: {"type": "array", "prefixItems": [a, b], "items": False}, children, children),
    st.builds(lambda a: {"allOf": [a]}, children),
), max_leaves=6)


def with_defs(schema):
    """The same schema reached through $ref into $defs (as pydantic writes nested models)."""
    return {"$defs": {"Inner": schema}, "type": "object", "properties": {"inner": {"$ref": "#/$defs/Inner"}},
            "required": ["inner"], "additionalProperties": False}


def without_nullable(schema):
    """The schema as JSON Schema itself says it: OpenAPI's `"nullable": true` (which pocketllm honours) becomes
    "null" among the types, so jsonschema, which ignores the keyword, judges what the decoder means."""
    if isinstance(schema, list):
        return [without_nullable(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: without_nullable(v) for k, v in schema.items() if k != "nullable"}
    if schema.get("nullable") is True and "type" in out:
        kinds = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = kinds + ["null"] * ("null" not in kinds)
    return out


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(schema=SCHEMAS, refs=st.booleans(), seed=st.integers(0, 1000))
def test_random_model_answers_validate(llm, schema, refs, seed):
    schema = with_defs(schema) if refs else schema
    text = decode(llm, schema, max_tokens=64, seed=seed)
    jsonschema.validate(json.loads(text), without_nullable(schema))


def reference_bits(grammar, state) -> bytearray:
    """A state's mask token by token: each token's bytes run through the grammar (no trie, no pruning, no
    grouping), the ends allowed when the state is complete."""
    facts = grammar.facts
    bits = bytearray(1 if blob and grammar.advance(state, blob) is not None else 0 for blob in facts.blobs)
    for t in facts.eos_ids if grammar.accepts(state) else []:
        bits[t] = 1
    return bits


def assert_masks_match_reference(decoder, seed, steps=48):
    """Along a random path of allowed tokens, every state's mask is the token-by-token reference's."""
    rng, grammar = random.Random(seed), decoder.grammar
    state = grammar.start
    for _ in range(steps):
        bits = grammar.mask(state).bits
        want = reference_bits(grammar, state)
        assert bits == want, [(t, grammar.facts.blobs[t]) for t in range(len(bits)) if bits[t] != want[t]][:10]
        allowed = [t for t, ok in enumerate(bits) if ok and t not in grammar.facts.eos_ids]
        if not allowed:
            return
        state = grammar.advance(state, grammar.facts.blobs[rng.choice(allowed)])


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return P.Tokenizer(P.bundled_model_dir())             # pocket-tiny's byte-level BPE (1,122 tokens)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, refs=st.booleans(), seed=st.integers(0, 1000))
def test_masks_equal_the_token_by_token_reference(tiny_tokenizer, schema, refs, seed):
    """The vocabulary walk (first bytes per frame, trie levels, strings' exits by suffix, length codes) allows
    exactly the tokens that the grammar takes one by one."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": with_defs(schema) if refs else schema}}
    decoder = P.structured_decoder(tiny_tokenizer, response_format=fmt, max_tokens=4096)
    assert_masks_match_reference(decoder, seed)


class JsonishTokenizer:
    """Single bytes plus the multi-byte tokens where a string's exits live (clean text then '"' or '\\' and
    what follows, of every length), so that counted strings' exits by suffix are exercised; greedy longest-match
    encode (any tokenization serves the budget's estimate)."""

    PIECES = [b'"', b'",', b'"}', b'"],', b'":"', b'a"', b'ab"', b'abc",', b'abcd"}', b'abcde"', b'ab\\n', b'a\\"',
              b'\\"', b'\\u00e9', b'xy"]', b'\xc3\xa9"', b'\xc3\xa9t\xc3\xa9', b'  "', b'"a', b'","', b'12', b'true',
              b'{"', b'["', b'abcdefgh']

    def __init__(self):
        self.vocab = [bytes((b,)) for b in range(0x20, 0x7F)] + [b"\n", b"\xc3", b"\xa9"] + self.PIECES + [b""]
        self.vocab_size, self.eos_token, self.special_ids = len(self.vocab), "<eos>", set()

    def token_bytes(self, i):
        return self.vocab[i]

    def token_to_id(self, text):
        return self.vocab_size - 1 if text == "<eos>" else None

    def encode(self, text):
        data, out = text.encode(), []
        while data:
            best = max((t for t in self.vocab if t and data.startswith(t)), key=len, default=data[:1])
            out.append(best)
            data = data[len(best):]
        return out


@pytest.mark.parametrize("seed", range(6))
def test_counted_string_masks_equal_the_token_by_token_reference(seed):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4},
                                               "t": {"type": "string", "minLength": 3},
                                               "u": {"type": "array", "items": {"type": "string", "maxLength": 1}},
                                               "v": {"type": "string"}},
              "required": ["s", "t", "u", "v"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    decoder = P.structured_decoder(JsonishTokenizer(), response_format=fmt, max_tokens=4096)
    assert_masks_match_reference(decoder, seed, steps=64)


@pytest.mark.parametrize("fmt", ["qwen_xml", "hermes"])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_call_masks_equal_the_token_by_token_reference(tiny_tokenizer, fmt, choice):
    decoder = P.structured_decoder(tiny_tokenizer, tools=[SHIP], tool_choice=choice, tool_parser=fmt,
                                   max_tokens=4096)
    for seed in range(4):
        assert_masks_match_reference(decoder, seed, steps=64)


RECURSIVE = {"$defs": {"Node": {"type": "object", "properties": {
    "label": {"type": "string", "maxLength": 8}, "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
    "required": ["label", "children"], "additionalProperties": False}}, "$ref": "#/$defs/Node"}


@pytest.mark.parametrize("seed", range(2))
def test_recursive_schema_nests_and_closes(llm, seed):
    value = json.loads(decode(llm, RECURSIVE, max_tokens=160, seed=seed))
    jsonschema.validate(value, RECURSIVE)


def test_json_object_and_non_strict_unsupported_keyword(llm):
    value = json.loads(decode(llm, {"type": "object"}, max_tokens=48, strict=False))
    assert isinstance(value, dict)
    # not enforced without strict (documented), still a valid object of the rest of the schema
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "minProperties": 1}
    assert type(json.loads(decode(llm, schema, max_tokens=32, strict=False))["n"]) is int


def test_masks_stay_in_budget_at_the_smallest_max_tokens(llm):
    schema = with_defs({"type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "integer"}},
                        "required": ["k", "v"], "additionalProperties": False})
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(P.RequestError) as e:
        P.structured_decoder(llm.tokenizer, response_format=fmt, max_tokens=3, eos_token_ids=llm.eos_token_ids)
    assert e.value.param == "max_tokens"
    smallest = int(str(e.value).split("at least ")[1].split()[0])
    for seed in range(3):
        jsonschema.validate(json.loads(decode(llm, schema, max_tokens=smallest, seed=seed)), schema)


def test_no_tools_bans_the_call_token(llm):
    decoder = P.structured_decoder(llm.tokenizer, max_tokens=50, eos_token_ids=llm.eos_token_ids)
    mask = decoder.token_mask([], llm.config.vocab_size, "cpu")
    call = llm.tokenizer.token_to_id("<tool_call>")
    tokens = llm.tokenizer.vocab_size                       # the rows past it pad the embedding: never tokens
    assert not bool(mask[call]) and int(mask[:tokens].sum()) == tokens - 1 and not bool(mask[tokens:].any())


# Strict tools with pydantic-style $ref schemas, forced and in both formats.

ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^\\d{5}$"}},
           "required": ["city", "zip"], "additionalProperties": False}
SHIP = {"type": "function", "function": {"name": "ship", "strict": True, "parameters": {
    "$defs": {"Address": ADDRESS, "Speed": {"enum": ["slow", "fast"], "type": "string"}},
    "type": "object", "additionalProperties": False, "required": ["to", "speed", "items", "note"], "properties": {
        "to": {"$ref": "#/$defs/Address"}, "speed": {"$ref": "#/$defs/Speed"},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 3},
        "note": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]}}}}}


@pytest.mark.parametrize("fmt", ["qwen_xml", "hermes"])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_ref_schema_calls_validate(llm, fmt, choice):
    """Forced ("required") and auto-mode calls: arguments parse and validate against the $ref schema."""
    prompt = P.load_chat_template(llm.tokenizer).render([{"role": "user", "content": "Ship it."}], tools=[SHIP])
    in_reasoning = P.prompt_ends_in_reasoning(prompt)
    decoder = P.structured_decoder(llm.tokenizer, tools=[SHIP], tool_choice=choice, tool_parser=fmt,
                                   in_reasoning=in_reasoning, max_tokens=160, eos_token_ids=llm.eos_token_ids)
    calls = 0
    for choice_out in llm.generate(prompt, max_tokens=160, temperature=1.0, seed=5, n=2,
                                   logits_processors=[decoder])["choices"]:
        parser = P.ChatOutputParser([SHIP], fmt, in_reasoning)
        parser.feed(choice_out["text"])
        for call in parser.message()["tool_calls"] or []:
            assert call["function"]["name"] == "ship"
            jsonschema.validate(json.loads(call["function"]["arguments"]), SHIP["function"]["parameters"])
            calls += 1
    assert calls >= (2 if choice == "required" else 0)


# Through the server and the published clients.

class Color(str, enum.Enum):
    red = "red"
    blue = "blue"


class Pet(BaseModel):
    name: str
    age: int


class Person(BaseModel):
    name: str
    favourite: Color
    pets: list[Pet]
    best_friend: Optional[Pet]


class Tree(BaseModel):
    value: int
    children: list["Tree"]


@pytest.mark.parametrize("model", [Person, Tree])
def test_openai_parse_with_pydantic(client, llm, model):
    completion = client.chat.completions.parse(model=llm.model_name, messages=USER, response_format=model,
                                               max_completion_tokens=120, temperature=1.0, seed=3, extra_body=NO_THINK)
    assert isinstance(completion.choices[0].message.parsed, model)


def test_openai_parse_after_thinking(client, llm):
    """Reasoning on: the model thinks, the reasoning is closed early for the budget, then the JSON."""
    completion = client.chat.completions.parse(model=llm.model_name, messages=USER, response_format=Pet,
                                               max_completion_tokens=60, temperature=1.0, seed=4)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Pet) and getattr(message, "reasoning_content", None)


def test_streamed_json_is_the_content(client, llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema(), "strict": True}}
    chunks = client.chat.completions.create(model=llm.model_name, messages=USER, response_format=fmt, stream=True,
                                            max_tokens=60, temperature=1.0, seed=2, extra_body=NO_THINK)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    Pet.model_validate_json(content)


def test_langchain_with_structured_output(server, llm):
    from langchain_openai import ChatOpenAI
    chat = ChatOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, model=llm.model_name,
                      max_tokens=120, temperature=1.0, max_retries=0, extra_body=NO_THINK)
    assert isinstance(chat.with_structured_output(Person).invoke("Describe a person."), Person)


def test_completions_response_format(client, llm):
    out = client.completions.create(model=llm.model_name, prompt="JSON:", max_tokens=40, temperature=1.0, seed=1,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(out.choices[0].text), dict)


def bad(schema, strict=True):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}}


def tool(parameters, strict=None):
    function = {"name": "f", "parameters": parameters}
    return {"tools": [{"type": "function", "function": {**function, **({"strict": strict} if strict else {})}}]}


REFUSALS = [
    (bad({"type": "object", "properties": {"x": {"type": "strnig"}}}), "response_format.json_schema.schema.properties.x.type"),
    (bad({"type": "object", "properties": {"x": {"$ref": "#/$defs/Nope"}}}),
     "response_format.json_schema.schema.properties.x.$ref"),
    (bad({"$ref": "http://example.com/s.json"}), "response_format.json_schema.schema.$ref"),
    (bad({"type": "object", "minProperties": 1}), "response_format.json_schema.schema.minProperties"),
    (bad({"type": "number", "multipleOf": 2}), "response_format.json_schema.schema.multipleOf"),
    (bad({"oneOf": [{"type": "integer"}, {"type": "number"}]}), "response_format.json_schema.schema.oneOf"),
    (bad({"type": "number", "minimum": 1, "exclusiveMaximum": 1}), "response_format.json_schema.schema.minimum"),
    (bad({"type": "number", "maximum": "3"}), "response_format.json_schema.schema.maximum"),
    (bad({"type": "string", "pattern": "(?<=a)b"}), "response_format.json_schema.schema.pattern"),
    (bad({"type": "string", "pattern": "([a-z"}, strict=False), "response_format.json_schema.schema.pattern"),
    (bad({"type": "object", "required": "x"}), "response_format.json_schema.schema.required"),
    (bad({"type": "array", "minItems": 3, "maxItems": 1}), "response_format.json_schema.schema.minItems"),
    (bad({"$defs": {"L": {"type": "object", "properties": {"next": {"$ref": "#/$defs/L"}}, "required": ["next"]}},
          "$ref": "#/$defs/L"}), "response_format.json_schema.schema"),
    (bad(False), "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "colour": 1}}},
     "response_format.json_schema.colour"),
    ({"response_format": {"type": "json_object"}, "max_tokens": 1}, "max_tokens"),
    (tool({"type": "object", "required": 1}), "tools[0].function.parameters.required"),
    (tool({"type": "object", "properties": {"x": {"$ref": "#/$defs/A"}}}), "tools[0].function.parameters.properties.x.$ref"),
    (tool({"type": "object", "properties": {"x": {"type": "string", "not": {"const": "a"}}}}, strict=True),
     "tools[0].function.parameters.properties.x.not"),
]


@pytest.mark.parametrize("extra, param", REFUSALS)
def test_refusals_name_the_schema_path(client, llm, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=llm.model_name, messages=USER, **{"max_tokens": 8, **extra})
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


# The limits of item 2: bounded numbers, oneOf, min_tokens with a grammar.

BOUNDS = st.tuples(st.one_of(st.none(), st.integers(-50, 50), st.floats(-60, 60, allow_nan=False).map(lambda x: round(x, 3))),
                   st.one_of(st.none(), st.integers(0, 80), st.floats(-1, 100, allow_nan=False).map(lambda x: round(x, 2))),
                   st.booleans(), st.booleans())


def number_schema(lo, span, lo_exclusive, hi_exclusive):
    schema = {"type": "number"}
    if lo is not None:
        schema["exclusiveMinimum" if lo_exclusive else "minimum"] = lo
    if span is not None:
        hi = (span if lo is None else lo + abs(span)) + (1 if lo_exclusive or hi_exclusive else 0)   # room between
        schema["exclusiveMaximum" if hi_exclusive else "maximum"] = hi
    return schema


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(bounds=BOUNDS, seed=st.integers(0, 1000))
@example(bounds=(0, -1.0, False, False), seed=0)       # a negative span once made the test's own schema empty
def test_bounded_numbers_validate(llm, bounds, seed):
    """minimum / maximum / exclusive bounds on `number`: every value the random model writes is in range."""
    schema = {"type": "object", "properties": {"x": number_schema(*bounds), "xs": {"type": "array", "items":
              number_schema(*bounds), "minItems": 1, "maxItems": 3}}, "required": ["x", "xs"], "additionalProperties": False}
    jsonschema.validate(json.loads(decode(llm, schema, max_tokens=96, seed=seed)), schema)


@pytest.mark.parametrize("schema", [{"type": "number", "minimum": 0.3, "maximum": 0.3},
                                    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                                    {"type": "number", "minimum": -2.5, "maximum": -1.25},
                                    {"type": "number", "exclusiveMaximum": 10, "minimum": 9.99}])
def test_bounded_number_masks_equal_the_token_by_token_reference(tiny_tokenizer, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "items": schema}}}
    decoder = P.structured_decoder(tiny_tokenizer, response_format=fmt, max_tokens=4096)
    for seed in range(3):
        assert_masks_match_reference(decoder, seed, steps=40)


def test_bounds_hold_however_the_value_is_parsed(tiny_tokenizer):
    """Exact decimals at the bounds: 0.3 is allowed by maximum 0.3 (it parses to the same float), and nothing
    that parses onto an exclusive bound is (1 - 1e-20 is 1.0 as a float)."""
    def allowed(schema, text):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        grammar = P.structured_decoder(tiny_tokenizer, response_format=fmt, max_tokens=4096).grammar
        state = grammar.advance(grammar.start, text)
        return state is not None and grammar.accepts(state)
    assert allowed({"type": "number", "maximum": 0.3}, b"0.3") and not allowed({"type": "number", "maximum": 0.3}, b"0.31")
    assert not allowed({"type": "number", "exclusiveMaximum": 1}, b"0.99999999999999999999")
    assert allowed({"type": "number", "exclusiveMaximum": 1}, b"0.99") and not allowed({"type": "number", "exclusiveMaximum": 1}, b"1")
    assert not allowed({"type": "number", "minimum": -1}, b"-1.5") and allowed({"type": "number", "minimum": -1}, b"-0.5")


CAT = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
       "required": ["kind", "lives"], "additionalProperties": False}
DOG = {"type": "object", "properties": {"kind": {"enum": ["dog", "puppy"]}, "good": {"type": "boolean"}},
       "required": ["kind"], "additionalProperties": False}
PETS = {"$defs": {"Cat": CAT, "Dog": DOG}, "type": "object", "additionalProperties": False, "required": ["pets", "id"],
        "properties": {"pets": {"type": "array", "items": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}},
                       "id": {"oneOf": [{"type": "string", "maxLength": 4}, {"type": "integer"}, {"type": "null"}]}}}


@pytest.mark.parametrize("seed", range(4))
def test_one_of_discriminated_and_by_type_validates(llm, seed):
    """jsonschema checks oneOf's exclusivity: every answer matches exactly one branch."""
    jsonschema.validate(json.loads(decode(llm, PETS, max_tokens=96, seed=seed)), PETS)


def test_min_tokens_with_a_json_answer(llm):
    """The end is banned until min_tokens while the grammar still holds: the value, then whitespace."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    for seed in range(3):
        decoder = P.structured_decoder(llm.tokenizer, response_format=fmt, max_tokens=40, min_tokens=24,
                                       eos_token_ids=llm.eos_token_ids)
        out = llm.generate("JSON:", max_tokens=40, min_tokens=24, temperature=1.0, presence_penalty=0.5, seed=seed,
                           logits_processors=[decoder])
        assert out["finish_reason"] == "stop" and out["completion_tokens"] >= 24, out
        jsonschema.validate(json.loads(out["text"]), schema)


def test_min_tokens_through_the_server(client, llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema(), "strict": True}}
    out = client.chat.completions.create(model=llm.model_name, messages=USER, response_format=fmt, max_tokens=60,
                                         temperature=1.0, seed=6, extra_body={**NO_THINK, "min_tokens": 40})
    assert out.usage.completion_tokens >= 40 and out.choices[0].finish_reason == "stop"
    Pet.model_validate_json(out.choices[0].message.content)


@pytest.mark.parametrize("extra", [{"tool_choice": "required"}, {"parallel_tool_calls": False}])
def test_min_tokens_with_a_call_that_must_close_is_refused(client, llm, extra):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=llm.model_name, messages=USER, max_tokens=40, tools=[SHIP],
                                       extra_body={"min_tokens": 4}, **extra)
    assert e.value.status_code == 400 and e.value.body["param"] == "min_tokens", e.value.body


def test_counted_strings_take_any_characters_counted_as_code_points(tiny_tokenizer):
    """minLength / maxLength count characters (JSON Schema's code points), not bytes, over well-formed UTF-8."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 2, "maxLength": 3}}}
    grammar = P.structured_decoder(tiny_tokenizer, response_format=fmt, max_tokens=4096).grammar

    def complete(text: str | bytes) -> bool:
        state = grammar.advance(grammar.start, text if isinstance(text, bytes) else json.dumps(text, ensure_ascii=False).encode())
        return state is not None and grammar.accepts(state)
    assert complete("éü") and complete("山田太") and complete("a😀") and not complete("山田太郎") and not complete("é")
    assert not complete(b'"\xa9\xa9"') and not complete(b'"a\xc3"') and not complete(b'"\xe0\x80\x80a"')   # not UTF-8


@pytest.mark.parametrize("seed", range(3))
def test_counted_non_ascii_strings_validate(llm, seed):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 5},
                                               "t": {"type": "array", "items": {"type": "string", "maxLength": 2}}},
              "required": ["s", "t"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    decoder = P.structured_decoder(llm.tokenizer, response_format=fmt, max_tokens=64, eos_token_ids=llm.eos_token_ids)
    out = llm.generate("名前:", max_tokens=64, temperature=1.0, presence_penalty=0.5, seed=seed,
                       logits_processors=[decoder])
    assert out["finish_reason"] == "stop", out
    jsonschema.validate(json.loads(out["text"]), schema)


UNICODE_PATTERNS = ["^[a-zà-ÿ]{2,8}$", "^東京.{0,3}$", "^[一-龥]+$", "^[^0-9x]{1,4}$", "^(é|ü|ß)+-\\d$"]


def test_patterns_take_any_characters(tiny_tokenizer):
    """A pattern's literals, ranges, '.' and negated classes take characters of any language (a character's
    UTF-8 bytes move the pattern once it is complete, and one is begun only where it can be finished)."""
    def complete(pattern, text: str) -> bool:
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": pattern},
                                                      "strict": True}}
        grammar = P.structured_decoder(tiny_tokenizer, response_format=fmt, max_tokens=4096).grammar
        state = grammar.advance(grammar.start, json.dumps(text, ensure_ascii=False).encode())
        return state is not None and grammar.accepts(state)
    assert complete("^[a-zà-ÿ]{2,8}$", "café") and not complete("^[a-zà-ÿ]{2,8}$", "Café")
    assert complete("^東京.{0,3}$", "東京タワー") and not complete("^東京.{0,3}$", "京東")
    assert complete("^[一-龥]+$", "中文") and not complete("^[一-龥]+$", "中a")
    assert complete("^[^0-9x]{1,4}$", "山田é") and not complete("^[^0-9x]{1,4}$", "山1")


@pytest.mark.parametrize("pattern", UNICODE_PATTERNS)
@pytest.mark.parametrize("byte_level", [False, True])
def test_unicode_pattern_masks_equal_the_token_by_token_reference(tiny_tokenizer, pattern, byte_level):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "items": {
        "type": "string", "pattern": pattern}, "minItems": 2, "maxItems": 4}}}
    decoder = P.structured_decoder(tiny_tokenizer if byte_level else JsonishTokenizer(), response_format=fmt,
                                   max_tokens=4096)
    for seed in range(3):
        assert_masks_match_reference(decoder, seed, steps=40)


@pytest.mark.parametrize("seed", range(2))
def test_unicode_patterns_validate(llm, seed):
    schema = {"type": "object", "properties": {f"s{k}": {"type": "string", "pattern": p} for k, p in
                                               enumerate(UNICODE_PATTERNS)},
              "required": [f"s{k}" for k in range(len(UNICODE_PATTERNS))], "additionalProperties": False}
    jsonschema.validate(json.loads(decode(llm, schema, max_tokens=96, seed=seed)), schema)
