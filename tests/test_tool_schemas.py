"""Tool-call arguments under composite parameter schemas (issue 47): the parser and the constrained decoder type
every Qwen XML value from the same resolved schema ($ref, allOf, anyOf/oneOf, type lists, enum/const, nullable),
so forced, strict and auto calls in both formats come back as values that validate with `jsonschema`.

The random "models" (random logits, a random-weight checkpoint at temperature 1) never call on their own:
every call is the decoder's doing, and every value the parser's reading of what it wrote.
"""

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from test_structured import without_nullable
from test_tool_choice import run, scripted, tokenizer  # noqa: F401 (tokenizer: the module's fixture)

import pocketllm as P

LOC = {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
       "required": ["lat", "lon"], "additionalProperties": False}
DEFS = {"Loc": LOC, "Name": {"type": "string", "maxLength": 12}, "Level": {"type": "string", "enum": ["low", "high"]},
        "Count": {"type": "integer", "minimum": 0, "maximum": 99}}


def tool(properties, required=None, strict=False, name="f"):
    parameters = {"$defs": DEFS, "type": "object", "properties": properties,
                  "required": list(properties) if required is None else required}
    if strict:
        parameters["additionalProperties"] = False
    function = {"name": name, "parameters": parameters, **({"strict": True} if strict else {})}
    return {"type": "function", "function": function}


def xml_call(name, **values):
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def parsed_arguments(tools, text, fmt="qwen_xml"):
    parser = P.ChatOutputParser(tools, fmt, False)
    parser.feed(text)
    return [json.loads(c["function"]["arguments"]) for c in parser.message()["tool_calls"] or []]


# The parser alone: each value typed by the resolved schema.

OPTIONAL_LOC = {"anyOf": [{"$ref": "#/$defs/Loc"}, {"type": "null"}]}          # pydantic's Optional[Loc]


@pytest.mark.parametrize("schema, raw, value", [
    (OPTIONAL_LOC, '{"lat": 1.5, "lon": -2}', {"lat": 1.5, "lon": -2}),
    (OPTIONAL_LOC, "null", None),
    ({"allOf": [{"type": "number"}, {"minimum": 0}]}, "2.5", 2.5),
    ({"$ref": "#/$defs/Count"}, "7", 7),
    ({"$ref": "#/$defs/Level"}, "low", "low"),
    ({"$ref": "#/$defs/Name"}, "123", "123"),                                 # a string through $ref stays text
    ({"type": "integer", "nullable": True}, "null", None),
    ({"type": ["null", "string"]}, "null", None),
    ({"type": ["null", "string"]}, "Paris", "Paris"),
    ({"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/Level"}]}, "3", 3),
    ({"allOf": [{"$ref": "#/$defs/Loc"}], "description": "where"}, '{"lat": 0, "lon": 1}', {"lat": 0, "lon": 1}),
])
def test_xml_values_are_typed_by_the_resolved_schema(schema, raw, value):
    tools = [tool({"p": schema})]
    assert parsed_arguments(tools, xml_call("f", p=raw)) == [{"p": value}]


def test_willing_model_writes_an_optional_model_as_an_object(tokenizer):
    """A model that writes the object itself (as Qwen3.5's template renders one) under a forced call: the
    arguments hold the object, not a JSON string holding it."""
    tools = [tool({"loc": OPTIONAL_LOC, "n": {"allOf": [{"type": "number"}, {"minimum": 0}]}})]
    script = xml_call("f", loc='{"lat": 48.85, "lon": 2.35}', n="3")
    processor = P.tool_choice_processor(tokenizer, tools, "required", "qwen_xml", False, False, 300)
    text = tokenizer.decode([i for i in scripted(tokenizer, processor, script) if i != tokenizer.token_to_id("<|im_end|>")])
    assert text == script
    assert parsed_arguments(tools, text) == [{"loc": {"lat": 48.85, "lon": 2.35}, "n": 3}]


# The decoder and the parser together, from random logits: forced, strict and auto, both formats.

COMPOSITE = {
    "loc": OPTIONAL_LOC,
    "n": {"allOf": [{"type": "number"}, {"minimum": 0}]},
    "level": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/Level"}]},
    "note": {"type": ["null", "string"]},
    "count": {"type": "integer", "nullable": True},
    "who": {"oneOf": [{"$ref": "#/$defs/Name"}, {"type": "null"}]},
    "tags": {"type": "array", "items": {"$ref": "#/$defs/Level"}, "maxItems": 2},
}


def check_arguments(tools, text, fmt, expect_call=True):
    calls = parsed_arguments(tools, text, fmt)
    assert calls or not expect_call, text
    parameters = tools[0]["function"]["parameters"]
    for arguments in calls:
        jsonschema.validate(arguments, without_nullable(parameters))
    return calls


@pytest.mark.parametrize("fmt", ["qwen_xml", "hermes"])
@pytest.mark.parametrize("mode", ["forced", "strict", "auto"])
def test_composite_parameters_from_random_logits(tokenizer, fmt, mode):
    tools = [tool(COMPOSITE, strict=mode == "strict")]
    choice = "auto" if mode == "auto" else {"type": "function", "function": {"name": "f"}}
    eos = tokenizer.token_to_id("<|im_end|>")
    calls = 0
    for seed in range(6):
        processor = P.tool_choice_processor(tokenizer, tools, choice, fmt, False, False, 400)
        ids = run(processor, tokenizer, 400, seed, scale=1.0 if mode == "auto" else 4.0)
        if mode == "auto" and tokenizer.token_to_id("<tool_call>") not in ids:
            continue
        calls += len(check_arguments(tools, tokenizer.decode([i for i in ids if i != eos]), fmt))
    assert calls >= (6 if mode != "auto" else 0)


def test_auto_mode_call_with_composite_parameters(tokenizer):
    """Auto mode: a model that opens a call gets the same typing as a forced one."""
    tools = [tool({"loc": OPTIONAL_LOC, "level": COMPOSITE["level"]})]
    script = "Checking.\n\n" + xml_call("f", loc='{"lat": 1, "lon": 2}', level="high")
    processor = P.tool_choice_processor(tokenizer, tools, "auto", "qwen_xml", True, False, 300)
    text = tokenizer.decode([i for i in scripted(tokenizer, processor, script) if i != tokenizer.token_to_id("<|im_end|>")])
    assert check_arguments(tools, text, "qwen_xml") == [{"loc": {"lat": 1, "lon": 2}, "level": "high"}]


# oneOf: exactly one branch, or a 400 under strict (without it, decoded as anyOf like other strict-only keywords).

def test_one_of_that_may_match_twice_is_decoded_as_any_of_without_strict(tokenizer):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "strict": False,
                                                  "schema": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}
    assert P.structured_decoder(tokenizer, response_format=fmt, max_tokens=50) is not None
    assert P.tool_choice_processor(tokenizer, [tool({"p": {"oneOf": [{"type": "string"}, {"$ref": "#/$defs/Name"}]}},
                                                    strict=False)], "auto", "hermes", True, False, 100) is not None


@pytest.mark.parametrize("strict", [True])
def test_one_of_that_may_match_twice_is_refused(tokenizer, strict):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "strict": strict,
                                                  "schema": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}
    with pytest.raises(P.RequestError) as e:
        P.structured_decoder(tokenizer, response_format=fmt, max_tokens=50)
    assert e.value.param == "response_format.json_schema.schema.oneOf" and "branches 0 and 1" in str(e.value)
    with pytest.raises(P.RequestError) as e:
        P.tool_choice_processor(tokenizer, [tool({"p": {"oneOf": [{"type": "string"}, {"$ref": "#/$defs/Name"}]}},
                                                 strict=strict)], "auto", "hermes", True, False, 100)
    assert e.value.param == "tools[0].function.parameters.properties.p.oneOf"


# The property (item 3): hypothesis-jsonschema draws parameter schemas from a meta-schema of the shapes agent
# frameworks send; a random-weight checkpoint at temperature 1 makes forced, strict and auto calls in both
# formats, and every call's arguments validate.

def _leaf_shapes():
    kinds = {"enum": ["string", "integer", "number", "boolean", "null"]}
    return [
        {"type": "object", "properties": {"type": kinds}, "required": ["type"], "additionalProperties": False},
        {"type": "object", "properties": {"type": {"const": "string"}, "maxLength": {"type": "integer", "minimum": 1,
         "maximum": 6}}, "required": ["type", "maxLength"], "additionalProperties": False},
        {"type": "object", "properties": {"type": {"const": "number"}, "minimum": {"type": "integer", "minimum": -3,
         "maximum": 3}}, "required": ["type", "minimum"], "additionalProperties": False},
        {"type": "object", "properties": {"enum": {"type": "array", "items": {"enum": ["a", "b", "7", 1, None]},
         "minItems": 1, "maxItems": 3, "uniqueItems": True}}, "required": ["enum"], "additionalProperties": False},
        {"type": "object", "properties": {"type": {"type": "array", "items": kinds, "minItems": 1, "maxItems": 3,
         "uniqueItems": True}}, "required": ["type"], "additionalProperties": False},
        {"type": "object", "properties": {"$ref": {"enum": [f"#/$defs/{name}" for name in DEFS]}},
         "required": ["$ref"], "additionalProperties": False},
    ]


def _composites(inner):
    pair = {"type": "array", "items": inner, "minItems": 1, "maxItems": 2}
    return [
        {"type": "object", "properties": {"anyOf": pair}, "required": ["anyOf"], "additionalProperties": False},
        {"type": "object", "properties": {"oneOf": pair}, "required": ["oneOf"], "additionalProperties": False},
        {"type": "object", "properties": {"allOf": {"type": "array", "items": inner, "minItems": 1, "maxItems": 1}},
         "required": ["allOf"], "additionalProperties": False},
        {"type": "object", "properties": {"type": {"const": "array"}, "items": inner, "maxItems": {"const": 2}},
         "required": ["type", "items", "maxItems"], "additionalProperties": False},
        {"type": "object", "properties": {"type": {"const": "object"}, "properties": {"type": "object",
         "properties": {"k": inner, "m": inner}, "required": ["k"], "additionalProperties": False},
         "required": {"const": ["k"]}, "additionalProperties": {"const": False}},
         "required": ["type", "properties", "required", "additionalProperties"], "additionalProperties": False},
        {"type": "object", "properties": {"type": {"enum": ["string", "integer", "number"]}, "nullable": {"const": True}},
         "required": ["type", "nullable"], "additionalProperties": False},
    ]


LEAF = {"anyOf": _leaf_shapes()}
LEVEL1 = {"anyOf": _leaf_shapes() + _composites(LEAF)}
PARAMETER_SCHEMAS = from_schema({"anyOf": _leaf_shapes() + _composites(LEVEL1)})
REFUSED = ("oneOf", "exclude each other", "admits no")         # overlapping oneOf, empty allOf / enum: a 400


@pytest.fixture(scope="module")
def random_llm(ckpt_factory):
    return P.LLM(ckpt_factory("qwen3_5")[0], backend="torch", quiet=True, max_context=1024, max_batch_size=8)


def _requests(llm, properties, think):
    """(format, mode, tools, processor, prompt ids, in_reasoning) for each format and mode; None where the
    schema is refused (checked: a 400 for one of the REFUSED reasons). think: the template opens reasoning
    (forced calls then think until the budget closes it)."""
    template = P.load_chat_template(llm.tokenizer)
    out = []
    for fmt in ("qwen_xml", "hermes"):
        for mode in ("forced", "strict", "auto"):
            tools = [tool(properties, required=["p"], strict=mode == "strict")]
            choice = "auto" if mode == "auto" else "required" if mode == "strict" else \
                {"type": "function", "function": {"name": "f"}}
            prompt = template.render([{"role": "user", "content": "Call f."}], tools=tools, enable_thinking=think)
            in_reasoning = P.prompt_ends_in_reasoning(prompt)
            try:
                processor = P.structured_decoder(llm.tokenizer, tools=tools, tool_choice=choice, tool_parser=fmt,
                                                 in_reasoning=in_reasoning, max_tokens=128,
                                                 eos_token_ids=llm.eos_token_ids)
            except P.RequestError as e:
                assert any(reason in str(e) for reason in REFUSED), e
                return None
            out.append((fmt, mode, tools, processor, llm.tokenizer.encode(prompt), in_reasoning))
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(p=PARAMETER_SCHEMAS, q=PARAMETER_SCHEMAS, seed=st.integers(0, 1000))
def test_random_checkpoint_calls_validate(random_llm, p, q, seed):
    requests = _requests(random_llm, {"p": p, "q": q}, think=seed % 3 == 0)
    if requests is None:
        return
    streams = [random_llm.submit(ids, P.SamplingParams(max_tokens=128, temperature=1.0, seed=seed,
                                                       logits_processors=[processor]))
               for _, _, _, processor, ids, _ in requests]
    for (fmt, mode, tools, _, _, in_reasoning), stream in zip(requests, streams):
        text = "".join(event.text for event in stream)
        parser = P.ChatOutputParser(tools, fmt, in_reasoning)
        parser.feed(text)
        calls = parser.message()["tool_calls"] or []
        assert calls or mode == "auto", (fmt, mode, text)
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                without_nullable(tools[0]["function"]["parameters"]))


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 3}, {"$ref": "#/$defs/Name"},
                                    {"type": "string", "minLength": 2, "maxLength": 4}])
def test_bounded_xml_strings_close_at_their_length(tokenizer, schema):
    """A raw string at its maxLength ends with the value's closing newline: tokens holding that newline are
    allowed there (they used to be taken for string content that no longer fits, which emptied the mask)."""
    tools = [tool({"p": schema, "n": {"type": "integer"}})]
    eos = tokenizer.token_to_id("<|im_end|>")
    for seed in range(6):
        processor = P.tool_choice_processor(tokenizer, tools, "required", "qwen_xml", False, False, 200)
        ids = run(processor, tokenizer, 200, seed)
        assert ids[-1] == eos, tokenizer.decode(ids)
        check_arguments(tools, tokenizer.decode(ids[:-1]), "qwen_xml")


BY_NAME = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": False}
BY_ID = {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}}, "required": ["id"],
         "additionalProperties": False}


@pytest.mark.parametrize("fmt", ["qwen_xml", "hermes"])
def test_one_of_objects_told_apart_by_a_forbidden_property(tokenizer, fmt):
    """oneOf branches that are objects, one requiring a property the other's additionalProperties: false
    forbids, never both match: taken under strict (a 400 before), and every call matches exactly one."""
    tools = [tool({"who": {"oneOf": [BY_NAME, BY_ID]}}, strict=True)]
    eos = tokenizer.token_to_id("<|im_end|>")
    for seed in range(4):
        processor = P.tool_choice_processor(tokenizer, tools, "required", fmt, False, False, 300)
        ids = run(processor, tokenizer, 300, seed)
        assert ids[-1] == eos
        check_arguments(tools, tokenizer.decode(ids[:-1]), fmt)
