"""ChatOutputParser: reasoning, Qwen XML and Hermes tool calls, schema-typed arguments, streaming deltas.

Every case runs twice: non-streamed (message()) and streamed one character at a time; the assembled stream
must equal the non-streamed parse, and content deltas never carry markup.
"""

import json
import random
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import pocketllm as P

MARKUP = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", "</think>")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "run_code", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}, "timeout": {"type": "number"}}}}},
    {"type": "function", "function": {"name": "configure", "parameters": {"type": "object", "properties": {
        "options": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
        "enabled": {"type": "boolean"}, "ratio": {"type": "number"}, "nothing": {"type": "null"},
        "limit": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "maybe": {"type": ["null", "integer"]}, "mode": {"enum": ["1", "2"]}}}}},
]


def assemble(deltas):
    """Assemble OpenAI deltas the way a client does."""
    out = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for delta in deltas:
        assert len(delta) == 1, delta
        out["content"] += delta.get("content", "")
        out["reasoning_content"] += delta.get("reasoning_content", "")
        for part in delta.get("tool_calls", []):
            call = out["tool_calls"].get(part["index"])
            if call is None:
                assert set(part) == {"index", "id", "type", "function"} and part["function"]["arguments"] == ""
                call = out["tool_calls"][part["index"]] = {"id": part["id"], "type": part["type"],
                                                           "function": {"name": part["function"]["name"], "arguments": ""}}
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
            call["function"]["arguments"] += part["function"]["arguments"]
    calls = [out["tool_calls"][i] for i in range(len(out["tool_calls"]))]
    return out["content"], out["reasoning_content"], calls


def stream(text, chunks, tools=TOOLS, parser="qwen_xml", in_reasoning=False, parse_tools=True):
    p = P.ChatOutputParser(tools, parser, in_reasoning=in_reasoning, parse_tools=parse_tools)
    deltas = []
    for chunk in chunks:
        deltas += p.feed(chunk)
    deltas += p.finish()
    return p, deltas


def check_stream_equals_message(text, chunks, literal_markup=False, **kw):
    """literal_markup: the case has markup-like prose that is meant to stay text."""
    p, deltas = stream(text, chunks, **kw)
    content, reasoning, calls = assemble(deltas)
    message = p.message()
    assert content == (message["content"] or "")
    assert reasoning == (message["reasoning_content"] or "")
    assert calls == (message["tool_calls"] or [])
    for delta in deltas:
        assert literal_markup or not kw.get("parse_tools", True) or not any(m in delta.get("content", "") for m in MARKUP)
    return message, deltas


def parse(text, literal_markup=False, **kw):
    """Non-streamed parse, after checking the char-by-char stream assembles to it."""
    message, _ = check_stream_equals_message(text, list(text), literal_markup, **kw)
    return message


def call_xml(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def args_of(message, i=0):
    return json.loads(message["tool_calls"][i]["function"]["arguments"])


# ---- Reasoning and content ----

def test_plain_answer():
    m = parse("The capital of France is Paris.")
    assert m == {"content": "The capital of France is Paris.", "reasoning_content": None, "tool_calls": None}


def test_reasoning_prefilled_by_template():
    m = parse("The user wants a capital.\nParis.\n</think>\n\nParis.", in_reasoning=True)
    assert m["reasoning_content"] == "The user wants a capital.\nParis." and m["content"] == "Paris."


def test_reasoning_opened_by_model():
    m = parse("<think>\nhmm\n</think>\n\nHello!")
    assert m["reasoning_content"] == "hmm" and m["content"] == "Hello!"


def test_reasoning_truncated_is_all_reasoning():
    m = parse("still thinking about", in_reasoning=True)
    assert m["reasoning_content"] == "still thinking about" and m["content"] == ""


def test_stray_think_close_dropped_from_content():
    assert parse("Hi</think> there")["content"] == "Hi there"


def test_content_with_angle_brackets_kept():
    text = "Use a < b and <b>bold</b> or <tool and <function but <functional> too."
    assert parse(text)["content"] == text


# ---- Qwen XML calls ----

def test_content_then_call_typed_arguments():
    text = "I'll check the weather.\n\n" + call_xml("get_weather", city="Paris", days="3", zip="007")
    m = parse(text)
    assert m["content"] == "I'll check the weather."
    call = m["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == '{"city": "Paris", "days": 3, "zip": "007"}'
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])


def test_call_only_has_null_content():
    m = parse(call_xml("get_weather", city="Oslo"))
    assert m["content"] is None and args_of(m) == {"city": "Oslo"}


def test_arguments_keep_generation_order():
    m = parse(call_xml("get_weather", zip="12345", unit="celsius", city="Rome"))
    assert list(args_of(m)) == ["zip", "unit", "city"]
    assert m["tool_calls"][0]["function"]["arguments"].startswith('{"zip": "12345"')


def test_call_inside_reasoning_ends_it():
    text = "I need the weather for Paris.\n" + call_xml("get_weather", city="Paris")
    m = parse(text, in_reasoning=True)
    assert m["reasoning_content"] == "I need the weather for Paris." and m["content"] is None
    assert args_of(m) == {"city": "Paris"}


def test_call_after_reasoning_close():
    text = "thinking\n</think>\n\n" + call_xml("get_weather", city="Paris")
    m = parse(text, in_reasoning=True)
    assert m["reasoning_content"] == "thinking" and m["content"] is None and args_of(m) == {"city": "Paris"}


def test_several_calls_unique_ids():
    text = call_xml("get_weather", city="Paris") + "\n" + call_xml("get_weather", city="Rome") + "\n" + \
        call_xml("run_code", code="print(1)")
    m = parse(text)
    assert [c["function"]["name"] for c in m["tool_calls"]] == ["get_weather", "get_weather", "run_code"]
    assert [args_of(m, i) for i in range(3)] == [{"city": "Paris"}, {"city": "Rome"}, {"code": "print(1)"}]
    assert len({c["id"] for c in m["tool_calls"]}) == 3


def test_string_values_stay_raw_text():
    m = parse(call_xml("get_weather", city="true", zip="00123", unit="3.0"))
    assert args_of(m) == {"city": "true", "zip": "00123", "unit": "3.0"}


def test_multiline_code_value_with_markup_like_text():
    code = "\n\ndef f(a, b):\n    return a < b and '<x>' != \"</y>\"\n\n\n"
    m = parse(call_xml("run_code", code=code, timeout="2.5"))
    assert args_of(m) == {"code": code, "timeout": 2.5}


def test_every_schema_type():
    m = parse(call_xml("configure", options='{"a": [1, {"b": null}], "é": "ü"}', tags='["x", "y"]',
                       enabled="true", ratio="-1.5e-3", nothing="null", limit="12", maybe="null", mode="2"))
    assert args_of(m) == {"options": {"a": [1, {"b": None}], "é": "ü"}, "tags": ["x", "y"], "enabled": True,
                          "ratio": -1.5e-3, "nothing": None, "limit": 12, "maybe": None, "mode": "2"}
    assert "é" in m["tool_calls"][0]["function"]["arguments"]          # non-ASCII kept, not \u-escaped


def test_python_literal_object_accepted():
    assert args_of(parse(call_xml("configure", options="{'a': True}", enabled="False"))) == \
        {"options": {"a": True}, "enabled": False}


def test_wrong_type_falls_back_to_raw_string():
    m = parse(call_xml("configure", enabled="yes", ratio="NaN", options="[1]", tags="{oops", limit="many"))
    assert args_of(m) == {"enabled": "yes", "ratio": "NaN", "options": "[1]", "tags": "{oops", "limit": "many"}
    assert args_of(parse(call_xml("get_weather", city="Paris", days="three"))) == {"city": "Paris", "days": "three"}


def test_unknown_parameter_and_function_kept():
    m = parse(call_xml("get_weather", city="Paris", extra="42", note="hello", flag="true"))
    assert args_of(m) == {"city": "Paris", "extra": 42, "note": "hello", "flag": True}
    m = parse(call_xml("no_such_tool", x="01", y="[1, 2]"))
    assert m["tool_calls"][0]["function"]["name"] == "no_such_tool" and args_of(m) == {"x": "01", "y": [1, 2]}


def test_call_without_parameters():
    m = parse("<tool_call>\n<function=run_code>\n</function>\n</tool_call>")
    assert m["tool_calls"][0]["function"]["arguments"] == "{}"


def test_literal_tool_call_in_prose_stays_text():
    text = "To call a tool, the model writes <tool_call> followed by a function header."
    m = parse(text, literal_markup=True)
    assert m["content"] == text and m["tool_calls"] is None
    m = parse("Use the <tool_call> tag.\n\n" + call_xml("get_weather", city="Paris"), literal_markup=True)
    assert m["content"] == "Use the <tool_call> tag." and args_of(m) == {"city": "Paris"}


def test_bare_function_header_for_known_tool():
    m = parse("Checking.\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>")
    assert m["content"] == "Checking." and args_of(m) == {"city": "Paris"}
    text = "In XML, write <function=foo> to declare one."
    assert parse(text, literal_markup=True) == {"content": text, "reasoning_content": None, "tool_calls": None}


# Malformed markup fails soft: recover what is unambiguous, never raise, never lose the answer.

def test_missing_parameter_close():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</parameter>\n" \
           "</function>\n</tool_call>"
    assert args_of(parse(text)) == {"city": "Paris", "days": 2}


def test_missing_parameter_close_before_function_close():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"
    assert args_of(parse(text)) == {"city": "Paris"}


def test_duplicate_parameter_close():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</parameter>\n" \
           "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    assert args_of(parse(text)) == {"city": "Paris", "days": 2}


def test_duplicate_parameter_keeps_first():
    text = call_xml("get_weather", city="Paris").replace("</function>", "<parameter=city>\nRome\n</parameter>\n</function>")
    assert parse(text)["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_missing_function_close():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>\nDone."
    m = parse(text)
    assert args_of(m) == {"city": "Paris"} and m["content"] == "Done."


def test_missing_tool_call_close_between_calls():
    one = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    m = parse(one + one.replace("Paris", "Rome"))
    assert [args_of(m, i) for i in range(2)] == [{"city": "Paris"}, {"city": "Rome"}]


def test_missing_both_closers_at_end():
    m = parse("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n")
    assert m["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


@pytest.mark.parametrize("tail, expected", [
    ("<parameter=city>\nPar", {"city": "Par"}),
    ("<parameter=city>\nParis\n</para", {"city": "Paris"}),
    ("<parameter=city>\nParis\n</parameter>\n<parameter=days>\n1", {"city": "Paris", "days": 1}),
    ("<parameter=city>\nParis\n</parameter>\n<parame", {"city": "Paris"}),
    ("<parameter=ci", {}),
    ("", {}),
])
def test_truncated_call_is_closed_with_what_arrived(tail, expected):
    m = parse("<tool_call>\n<function=get_weather>\n" + tail)
    assert args_of(m) == expected and m["content"] is None


def test_truncated_before_header_confirmed_is_text():
    for text in ("Sure.\n<tool_call>\n<function=get_wea", "Sure.\n<tool_call>", "Sure.\n<tool_c"):
        m = parse(text, literal_markup=True)
        assert m["tool_calls"] is None and m["content"] == text.strip()


def test_stray_text_inside_call_dropped():
    text = "<tool_call>\n<function=get_weather>\nnoise <b> here\n<parameter=city>\nParis\n</parameter>\n" \
           "</function>\n</tool_call>"
    assert args_of(parse(text)) == {"city": "Paris"}


def test_parse_tools_false_leaves_markup_as_content():
    text = "Sure.\n" + call_xml("get_weather", city="Paris")
    p, deltas = stream(text, list(text), parse_tools=False)
    assert p.message() == {"content": text, "reasoning_content": None, "tool_calls": None}
    assert assemble(deltas)[0] == text and not p.has_tool_calls


# ---- Hermes JSON calls ----

def test_hermes_call():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich", "days": 2}}\n</tool_call>'
    m = parse(text, parser="hermes")
    assert m["content"] == "Let me look." and m["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich", "days": 2}'


def test_hermes_several_calls_and_reasoning():
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    m = parse("think\n</think>\n\n" + one % "A" + "\n" + one % "B", parser="hermes", in_reasoning=True)
    assert m["reasoning_content"] == "think" and [args_of(m, i) for i in range(2)] == [{"city": "A"}, {"city": "B"}]


def test_hermes_arguments_as_json_string():
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>'
    assert args_of(parse(text, parser="hermes")) == {"city": "Paris"}


def test_hermes_malformed_json_fails_soft():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", oops}}\n</tool_call>\nAfter.'
    m = parse(text, parser="hermes")
    assert args_of(m) == {"city": "Paris"} and m["content"] == "After."


def test_hermes_truncated_string_value():
    m = parse('<tool_call>\n{"name": "run_code", "arguments": {"code": "print(\\"hi\\u00e', parser="hermes")
    assert args_of(m) == {"code": 'print("hi'}


def test_hermes_literal_tool_call_in_prose():
    text = "The tag <tool_call> wraps JSON."
    assert parse(text, literal_markup=True, parser="hermes")["content"] == text


def test_xml_parser_also_reads_hermes_body():
    m = parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert args_of(m) == {"city": "Paris"}


# ---- Streaming shape ----

def test_arguments_stream_per_parameter_and_string_as_it_grows():
    p = P.ChatOutputParser(TOOLS, "qwen_xml", in_reasoning=False)
    head = p.feed("<tool_call>\n<function=get_weather>\n")
    assert head == [{"tool_calls": [{"index": 0, "id": head[0]["tool_calls"][0]["id"], "type": "function",
                                     "function": {"name": "get_weather", "arguments": ""}}]}]
    assert p.feed("<parameter=city>\nPar") == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Par'}}]}]
    assert p.feed("is\n") == [{"tool_calls": [{"index": 0, "function": {"arguments": "is"}}]}]
    assert p.feed("</parameter>\n<parameter=days>\n1") == [{"tool_calls": [{"index": 0, "function": {"arguments": '"'}}]}]
    assert p.feed("4\n</parameter>\n") == [{"tool_calls": [{"index": 0, "function": {"arguments": ', "days": 14'}}]}]
    assert p.feed("</function>\n</tool_call>") == [{"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]
    assert p.finish() == [] and p.has_tool_calls


def test_prose_streams_without_waiting_after_refuted_tool_call():
    p = P.ChatOutputParser(TOOLS, "qwen_xml", in_reasoning=False)
    assert p.feed("a <tool_call>") == [{"content": "a"}]
    assert p.feed(" is a tag") == [{"content": " <tool_call> is a tag"}]


def test_held_back_text_only_while_it_could_be_markup():
    p = P.ChatOutputParser(TOOLS, "qwen_xml", in_reasoning=False)
    assert p.feed("x <tool") == [{"content": "x"}]
    assert p.feed("s") == [{"content": " <tools"}]


def test_real_tokenizer_like_chunks():
    text = ("Thinking about it.\n</think>\n\nHere you go.\n\n" + call_xml("get_weather", city="Paris", days="2") +
            "\n" + call_xml("run_code", code="for i in range(3):\n    print(i)"))
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 25))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        check_stream_equals_message(text, chunks, in_reasoning=True)


def test_long_output_is_fast():
    import time
    text = ("word " * 20000) + "\n</think>\n\n" + "<b>x</b> " * 2000 + call_xml("run_code", code="x = 1\n" * 3000)
    p = P.ChatOutputParser(TOOLS, "qwen_xml", in_reasoning=True)
    start = time.perf_counter()
    for i in range(0, len(text), 4):
        p.feed(text[i:i + 4])
    p.finish()
    assert time.perf_counter() - start < 10, "streaming parse is not linear enough"


# ---- Property: random schemas and values, formatted as the model would, streamed at random splits ----

SAFE_TEXT = st.text(alphabet=st.sampled_from(list("ab xyz<>/=\n\t{}\"'\\é😀0129.-")), max_size=30)
STRING_VALUE = SAFE_TEXT.filter(lambda s: not any(m in s for m in ("</parameter>", "<parameter=", "</function>",
                                                                    "</tool_call>")))
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                      st.floats(allow_nan=False, allow_infinity=False, width=32), STRING_VALUE)
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(st.text("abc", max_size=3), inner, max_size=3)),
                          max_leaves=6)
VALUES_BY_TYPE = {"string": STRING_VALUE, "integer": st.integers(-10**9, 10**9),
                  "number": st.floats(allow_nan=False, allow_infinity=False), "boolean": st.booleans(),
                  "null": st.none(), "array": st.lists(JSON_VALUE, max_size=3),
                  "object": st.dictionaries(st.text("xyz", min_size=1, max_size=3), JSON_VALUE, max_size=3)}


@st.composite
def tool_and_call(draw):
    names = draw(st.lists(st.from_regex(r"[a-z][a-z_0-9]{0,8}", fullmatch=True), min_size=1, max_size=5, unique=True))
    types = [draw(st.sampled_from(sorted(VALUES_BY_TYPE))) for _ in names]
    schema = {n: {"type": t} for n, t in zip(names, types)}
    args = {}
    for n, t in zip(names, types):
        if draw(st.booleans()) or not args:
            args[n] = draw(VALUES_BY_TYPE[t])
    order = draw(st.permutations(list(args)))
    return schema, {k: args[k] for k in order}


def format_xml(name, args, schema):
    body = ""
    for k, v in args.items():
        text = v if schema[k]["type"] == "string" else json.dumps(v, ensure_ascii=False)
        body += f"<parameter={k}>\n{text}\n</parameter>\n"
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def format_hermes(name, args, schema):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


PROSE = SAFE_TEXT.filter(lambda s: not any(m in s for m in ("<tool_call>", "<function=", "<think>", "</think>")))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(tool_and_call(), min_size=1, max_size=3), fmt=st.sampled_from(["qwen_xml", "hermes"]),
       reasoning=st.one_of(st.none(), PROSE), close_think=st.booleans(), content=PROSE, seed=st.integers(0, 2**32 - 1))
def test_property_stream_equals_parse(calls, fmt, reasoning, close_think, content, seed):
    tools, text = [], ""
    if reasoning is not None and not close_think:     # the calls come inside the reasoning
        text, content = reasoning + "\n", ""
    elif reasoning is not None:
        text += reasoning + "\n</think>\n\n"
    text += content + ("\n\n" if content else "")
    for i, (schema, args) in enumerate(calls):
        name = f"tool_{i}"
        tools.append({"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": schema}}})
        text += ("\n" if i else "") + (format_xml if fmt == "qwen_xml" else format_hermes)(name, args, schema)
    rng = random.Random(seed)
    if len(text) <= 300:
        chunks = list(text)
    else:
        cuts = sorted(set(rng.randrange(1, len(text)) for _ in range(rng.randrange(1, 60))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    message, _ = check_stream_equals_message(text, chunks, tools=tools, parser=fmt, in_reasoning=reasoning is not None)
    assert (message["reasoning_content"] or "") == (reasoning or "").strip()
    assert (message["content"] or "") == content.strip()
    assert len(message["tool_calls"]) == len(calls)
    for call, (schema, args) in zip(message["tool_calls"], calls):
        parsed = json.loads(call["function"]["arguments"])
        assert parsed == args and list(parsed) == list(args)


FRAGMENTS = ["<tool_call>", "</tool_call>", "<function=get_weather>", "<function=run_code>", "<function=", "</function>",
             "<parameter=city>", "<parameter=days>", "<parameter=code>", "</parameter>", "<think>", "</think>", "\n",
             " ", "Paris", "12", "3.5", "{", "}", "[", "]", '"name"', '"get_weather"', ":", ",", '"arguments"',
             '"city"', '"', "\\", "<", ">", "/", "x", "é"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=40), fmt=st.sampled_from(["qwen_xml", "hermes"]),
       in_reasoning=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_property_malformed_markup_never_raises_and_streams_consistently(parts, fmt, in_reasoning, seed):
    """Arbitrary mixtures of markup fragments: no exception, and the stream still equals the parse."""
    text = "".join(parts)
    rng = random.Random(seed)
    chunks = list(text) if rng.random() < 0.5 else [text[i:i + 3] for i in range(0, len(text), 3)]
    message, _ = check_stream_equals_message(text, chunks, literal_markup=True, parser=fmt, in_reasoning=in_reasoning)
    for call in message["tool_calls"] or []:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
