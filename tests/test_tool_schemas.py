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


# oneOf: exactly one branch, or a 400.

@pytest.mark.parametrize("strict", [False, True])
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
