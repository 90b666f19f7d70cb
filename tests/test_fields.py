"""The request-field tables (issue 16 item 1, issue 20 item 1) and generation defaults (issue 19 item 1).

One table per endpoint drives request validation, the SamplingParams the engine receives, docs/api.md's field
lists and /openapi.json. These tests prove the three agree: the docs are exactly what the tables render; every
row's type, range, enum and required flag in the served OpenAPI document is the row's; and for every row a
value the document's schema refuses is refused by the real server with that field as `param` (and a boundary
value both accept is answered). Malformed tools (the one walk over `tools`) are 400s naming the path, never 500.
Generation defaults are checked through the real engine: greedy by default where generation_config.json asks for
it (the README's quickstart, ten times over HTTP against pocket-tiny), the user's explicit fields winning.

Regenerate the docs' tables after changing a row: `python tests/test_fields.py`.
"""

import copy
import http.client
import json
import re
import shutil
import sys
from pathlib import Path

import jsonschema
import openai
import pytest
from openapi_spec_validator import validate as validate_openapi

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import pocketllm  # noqa: E402

API_DOC = ROOT / "docs" / "api.md"
README = ROOT / "README.md"
KEY = "fields-key"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
BASES = {"/v1/chat/completions": {"messages": USER, "max_tokens": 1},
         "/v1/completions": {"prompt": "Hi", "max_tokens": 1},
         "/tokenize": {"prompt": "Hi"},
         "/detokenize": {"tokens": [1, 2]},
         "/v1/responses": {"input": "Hi", "max_output_tokens": 1},
         "/v1/messages": {"messages": USER, "max_tokens": 1},
         "/v1/messages/count_tokens": {"messages": USER}}
MARKERS = re.compile(r"(<!-- fields: (\w+) -->\n)(.*?)(<!-- end fields -->)", re.S)


def render_docs(text: str) -> str:
    """docs/api.md with every `<!-- fields: NAME -->` block replaced by what FIELD_TABLES[NAME] renders."""
    return MARKERS.sub(lambda m: m[1] + pocketllm.fields_markdown(pocketllm.FIELD_TABLES[m[2]]) + "\n" + m[4], text)


@pytest.fixture(scope="module")
def llm(ckpt_factory):
    path, _ = ckpt_factory("qwen3_5")
    return pocketllm.LLM(str(path), quiet=True, max_context=640, max_batch_size=4)


def request(server, method, path, body=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request(method, path, body=raw if raw is not None else json.dumps(body) if body is not None else None,
                 headers={"Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    data = json.loads(resp.read().decode())
    conn.close()
    return resp.status, data


def idle(llm):
    stats = llm.stats()
    return not (stats["running"] or stats["waiting"] or stats["kv_blocks_used"] or stats["slots_used"])


# -----------------------------------------------------------------------------------------------
# One table, three uses: validation, docs/api.md, /openapi.json.
# -----------------------------------------------------------------------------------------------

def test_docs_are_what_the_tables_render():
    text = API_DOC.read_text()
    names = [m[2] for m in MARKERS.finditer(text)]
    assert sorted(names) == sorted(pocketllm.FIELD_TABLES), names      # every table, each once
    assert render_docs(text) == text, "docs/api.md is stale: run `python tests/test_fields.py`"


def test_sampling_rows_are_samplingparams_own():
    """SamplingParams' fields carry their rows; the endpoints use those very rows (max_tokens: its HTTP default)."""
    import dataclasses
    assert list(pocketllm.SAMPLING_FIELDS) == [f.name for f in dataclasses.fields(pocketllm.SamplingParams)]
    for name, row in pocketllm.SAMPLING_FIELDS.items():
        for table in (pocketllm.CHAT_FIELDS, pocketllm.COMPLETION_FIELDS):
            if name in table and name not in ("max_tokens", "logprobs"):
                assert table[name] is row, name
    assert pocketllm.COMPLETION_FIELDS["logprobs"].hi == pocketllm.SAMPLING_FIELDS["logprobs"].hi


# SamplingParams fields that an endpoint's table leaves out on purpose: Python callables, and logprobs, whose
# HTTP spelling differs per endpoint (chat: logprobs + top_logprobs; completions: its own row).
NOT_OVER_HTTP = {"/v1/chat/completions": {"logits_processors", "logprobs"},
                 "/v1/completions": {"logits_processors"}}


def test_every_sampling_field_is_in_the_generation_endpoints_tables():
    """A new SamplingParams field is a row of /v1/chat/completions and /v1/completions (or is named above)."""
    import dataclasses
    for path, skipped in NOT_OVER_HTTP.items():
        table = pocketllm.REQUEST_TABLES[path]
        missing = [f.name for f in dataclasses.fields(pocketllm.SamplingParams)
                   if f.name not in table and f.name not in skipped]
        assert not missing, (path, missing)


def test_allowed_token_ids_over_http(server, llm):
    """vLLM's allowed_token_ids at temperature 1: every completion token is one of them (the chat logprobs'
    bytes say which); bad values are 400s naming the field."""
    tok = llm.tokenizer
    allowed = [i for i in range(tok.vocab_size) if tok.token_bytes(i).isalpha()][:4]
    body = {**BASES["/v1/chat/completions"], "max_tokens": 24, "temperature": 1.0, "seed": 3, "ignore_eos": True,
            "allowed_token_ids": allowed, "logprobs": True}
    status, data = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200, data
    drawn = [bytes(t["bytes"]) for t in data["choices"][0]["logprobs"]["content"]]
    assert len(drawn) == 24 and set(drawn) <= {tok.token_bytes(i) for i in allowed}, drawn
    for bad, param in (([], "allowed_token_ids"), ([llm.config.vocab_size], "allowed_token_ids[0]"),
                       ("5", "allowed_token_ids"), ([1, None], "allowed_token_ids[1]")):
        status, data = request(server, "POST", "/v1/completions", {**BASES["/v1/completions"], "allowed_token_ids": bad})
        assert status == 400 and data["error"]["param"] == param, data


def test_openapi_document(server, llm):
    status, doc = request(server, "GET", "/openapi.json")
    assert status == 200
    validate_openapi(doc)                                             # a valid OpenAPI 3.1 document
    assert doc["openapi"].startswith("3.1")
    routes = {(method.lower(), path) for method, path, _ in pocketllm.ROUTES}
    assert {(m, p) for p, ops in doc["paths"].items() for m in ops} == routes
    for path, table in pocketllm.REQUEST_TABLES.items():
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        jsonschema.Draft202012Validator.check_schema(schema)
        assert list(schema["properties"]) == list(table)
        assert schema["required"] == [n for n, row in table.items() if row.required]
        assert schema["additionalProperties"] is False
        for name, row in table.items():
            prop = schema["properties"][name]
            assert prop.get("minimum", prop.get("exclusiveMinimum")) == row.lo, (path, name)
            assert ("exclusiveMinimum" in prop) == row.lo_open, (path, name)
            assert prop.get("maximum") == row.hi, (path, name)
            expected_enum = list(row.allowed) if row.policy == pocketllm.DEFAULT_ONLY and row.allowed else \
                list(row.enum) or None
            assert prop.get("enum") == expected_enum, (path, name)
            assert prop["x-pocketllm-policy"] == row.policy and prop["x-pocketllm-layer"] == row.layer
            if row.kind in pocketllm.JSON_KINDS and not row.schema:
                assert row.kind in (prop["type"] if isinstance(prop.get("type"), list) else [prop.get("type")])
    tokens = doc["paths"]["/detokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert tokens["properties"]["tokens"]["items"]["maximum"] == llm.config.vocab_size - 1


def _wrong_type(row):
    """A JSON value of another type than the row's kind."""
    return {"string": 5, "integer": "5", "number": "5", "boolean": "yes", "array": 5, "object": [1]}[row.kind]


def _probes(row):
    """(value, the table accepts it) pairs at the row's edges: bounds, enums, kinds, default-only values."""
    probes = []
    if row.lo is not None:
        probes += [(row.lo, not row.lo_open), (row.lo - 1, False)]
    if row.hi is not None:
        probes += [(row.hi, True), (row.hi + 1, False)]
    if row.enum:
        probes += [(row.enum[0], True), ("no-such-value", False)]
    if row.policy == pocketllm.DEFAULT_ONLY and row.allowed:
        probes += [(value, True) for value in row.allowed if value is not None] + [("changed", False)]
    elif row.kind in pocketllm.JSON_KINDS:
        probes.append((_wrong_type(row), False))
    return probes


# Rows whose accepted values also depend on another field or on the template (reasoning_effort and verbosity are
# honoured only by a template that reads them: test_server_openai.py covers the answers).
RELATED = ("max_tokens", "min_tokens", "n", "top_logprobs", "reasoning_effort", "verbosity")


def _send(server, path, body):
    return request(server, "POST", path, body)


@pytest.mark.parametrize("path", list(pocketllm.REQUEST_TABLES))
def test_schema_and_server_agree_on_every_row(server, llm, path):
    """For every row: a value the OpenAPI schema refuses is a 400 naming the field; a boundary value the schema
    accepts is answered (unless another field's relation needs more, as top_logprobs needs logprobs)."""
    table = pocketllm.REQUEST_TABLES[path]
    schema = pocketllm.request_schema(table, llm.config.vocab_size)
    validator = jsonschema.Draft202012Validator(schema)
    base = BASES[path]
    assert validator.is_valid(base)
    checked = 0
    for name, row in table.items():
        for value, ok in _probes(row):
            body = {**base, name: value}
            if name == "n" and path == "/v1/completions" and ok:
                body["best_of"] = None
            assert validator.is_valid(body) == ok, (name, value)
            if ok and (row.relate is not None or name in RELATED):
                continue                                  # needs another field or the template: checked elsewhere
            status, answer = _send(server, path, body)
            checked += 1
            if ok:
                assert status == 200, (name, value, answer)
            else:
                assert status == 400 and answer["error"]["param"] == name, (name, value, answer)
    for name, row in table.items():                       # required fields
        if row.required:
            body = {k: v for k, v in base.items() if k != name}
            assert not validator.is_valid(body)
            status, answer = _send(server, path, body)
            assert status == 400 and answer["error"]["param"] == name
    body = {**base, "temprature": 0.5}                     # unknown fields
    assert not validator.is_valid(body)
    status, answer = _send(server, path, body)
    assert status == 400 and answer["error"]["param"] == "temprature" and answer["error"]["code"] == "unknown_field"
    assert checked >= len(table) and idle(llm)


def test_python_api_validates_through_the_same_rows(llm):
    """LLM.generate's keywords and SamplingParams.validate use the rows the HTTP endpoints use."""
    for name, value, param in (
            ("temperature", 2.5, None), ("top_p", 0, None), ("top_k", -2, None), ("min_p", 1.5, None),
            ("n", 17, None), ("presence_penalty", 3, None), ("repetition_penalty", 0, None), ("logprobs", 21, None),
            ("seed", 1.5, None), ("stop", ["", "x"], "stop[0]"), ("stop", ["a"] * 17, None),
            ("stop", ["x", None], "stop[1]"), ("stop_token_ids", [1, -1], "stop_token_ids[1]"),
            ("ignore_eos", "yes", None), ("logit_bias", {"abc": 1}, "logit_bias.abc"),
            ("logit_bias", {5: 101}, "logit_bias.5"), ("logit_bias", {"5": None}, "logit_bias.5"),
            ("temperature", True, None)):
        param = param or name
        with pytest.raises(pocketllm.RequestError) as e:
            llm.generate("Hi", max_tokens=2, **{name: value})
        assert e.value.param == param, (name, value)
        with pytest.raises(pocketllm.RequestError) as e:
            pocketllm.chat_completions(llm, {"messages": USER, "max_tokens": 2, name: value})
        assert e.value.param == param, (name, value)
    with pytest.raises(pocketllm.RequestError) as e:
        llm.generate("Hi", max_tokens=2, min_tokens=3)
    assert e.value.param == "min_tokens"
    # Normalised the same way: a stop string is a one-element list, top_k -1 is off.
    params = pocketllm.SamplingParams(stop="x", top_k=-1, logit_bias={"5": 1}).validate(llm.config.vocab_size)
    assert params.stop == ["x"] and params.top_k == 0 and params.logit_bias == {5: 1.0}
    assert llm.generate("Hi", max_tokens=3, temperature=0, stop="zzz")["finish_reason"] == "length"


# -----------------------------------------------------------------------------------------------
# One walk over tools: malformed tools and schemas are 400s naming the path, never 500s.
# -----------------------------------------------------------------------------------------------

def tool(**function):
    return {"type": "function", "function": {"name": "f", **function}}


MALFORMED_TOOLS = [
    ([tool(parameters={"type": "object", "required": 1})], "tools[0].function.parameters.required"),
    ([tool(parameters={"type": "object", "required": "city"})], "tools[0].function.parameters.required"),
    ([tool(parameters={"type": "object", "required": [1]})], "tools[0].function.parameters.required[0]"),
    ([tool(parameters={"required": [["city"]]})], "tools[0].function.parameters.required[0]"),
    ([tool(parameters=[])], "tools[0].function.parameters"),
    ([tool(parameters="object")], "tools[0].function.parameters"),
    ([tool(parameters={"properties": []})], "tools[0].function.parameters.properties"),
    ([tool(parameters={"properties": "city"})], "tools[0].function.parameters.properties"),
    ([tool(parameters={"properties": {"city": 5}})], "tools[0].function.parameters.properties.city"),
    ([tool(parameters={"properties": {"city": "string"}})], "tools[0].function.parameters.properties.city"),
    ([tool(description=5)], "tools[0].function.description"),
    ([tool(strict="yes")], "tools[0].function.strict"),
    ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": 7}}], "tools[0].function.name"),
    ([{"type": "function", "function": None}], "tools[0].function"),
    ([{"type": "function", "function": "f"}], "tools[0].function"),
    ([{"type": "function"}], "tools[0].function"),
    ([5], "tools[0]"),
    ([{"function": {"name": "f"}}], "tools[0].type"),
    ([{"type": "function", "function": {"name": "f"}, "extra": 1}], "tools[0].extra"),
    ([WEATHER, tool(parameters={"required": {}})], "tools[1].function.parameters.required"),
]


@pytest.mark.parametrize("tool_choice", [None, "required", "none",
                                         {"type": "function", "function": {"name": "f"}}])
@pytest.mark.parametrize("tools,param", MALFORMED_TOOLS, ids=[p for _, p in MALFORMED_TOOLS])
def test_malformed_tools_are_400_naming_the_path(server, llm, tools, param, tool_choice):
    body = {"messages": USER, "max_tokens": 2, "tools": tools, "tool_choice": tool_choice}
    status, answer = _send(server, "/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    assert "\n" not in answer["error"]["message"]
    if tool_choice is None:
        status, answer = _send(server, "/tokenize", {"messages": USER, "tools": tools})
        assert status == 400 and answer["error"]["param"] == param
        with pytest.raises(pocketllm.RequestError) as e:           # the Python API and the section-11 users
            llm.chat(USER, tools=tools, max_tokens=2)
        assert e.value.param == param
        with pytest.raises(pocketllm.RequestError) as e:
            pocketllm.tool_choice_processor(llm.tokenizer, tools, "required", "qwen_xml", True, False, 100)
        assert e.value.param == param
        with pytest.raises(pocketllm.RequestError) as e:
            pocketllm.ChatOutputParser(tools, "qwen_xml", False)
        assert e.value.param == param
    assert idle(llm)


RICH_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {
    "type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer"},
        "unit": {"anyOf": [{"type": "number"}, {"type": "null"}]}}}}}
ODD_SCHEMA_VALUES = [None, True, 2.5, "", ["x"], {}, {"type": 5}, {"enum": 3}, {"anyOf": 1}, {"type": ["integer", 5]},
                     {"enum": [{"a": 1}]}]


def _positions(obj, prefix=()):
    """Every key path inside obj."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for key, value in items:
        yield prefix + (key,)
        yield from _positions(value, prefix + (key,))


def _replaced(obj, position, value):
    obj = copy.deepcopy(obj)
    inner = obj
    for key in position[:-1]:
        inner = inner[key]
    inner[position[-1]] = value
    return obj


def test_odd_values_at_every_depth_of_a_tool_are_never_a_500(llm):
    """Each position of a tool definition (its keys, its schema's keywords) set to odd JSON values, with tool_choice
    auto and a forced call (the parser and the forced-call code both walk the schema): an answer or a 400 naming
    a param, never another exception; no KV block or slot held afterwards."""
    answered = refused = 0
    for position in _positions(RICH_TOOL):
        for value in ODD_SCHEMA_VALUES:
            for tool_choice in (None, {"type": "function", "function": {"name": "get_weather"}}):
                body = {"messages": USER, "tools": [_replaced(RICH_TOOL, position, value)],
                        "tool_choice": tool_choice, "max_tokens": 16, "temperature": 1.0, "seed": 1}
                try:
                    pocketllm.chat_completions(llm, body)
                    answered += 1
                except pocketllm.RequestError as e:
                    assert e.status == 400 and e.param, (position, value, e)
                    refused += 1
    assert answered and refused and idle(llm)


def test_unusual_but_valid_tools_are_served(server, llm):
    """What the walk must not refuse: no parameters, no properties, boolean schemas, repeated or undescribed
    required names. A forced call to each is answered (the forced-call code consumes the walk's result)."""
    tools = [tool(), {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "h", "strict": None, "description": None, "parameters": {
                 "type": "object", "properties": {"a": True, "b": {"type": "integer"}},
                 "required": ["b", "b", "zz"]}}}]
    for name in ("f", "g", "h"):
        body = {"messages": USER, "max_tokens": 120, "tools": tools, "temperature": 0,
                "tool_choice": {"type": "function", "function": {"name": name}}}
        status, answer = _send(server, "/v1/chat/completions", body)
        assert status == 200, answer
        calls = answer["choices"][0]["message"].get("tool_calls") or []
        assert [c["function"]["name"] for c in calls] == [name], answer
    functions = pocketllm.tool_functions(tools)
    assert functions["h"].required == ["b", "zz"] and functions["f"].properties == {}
    status, answer = _send(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "tools": []})
    assert status == 200
    status, answer = _send(server, "/v1/chat/completions", {"messages": USER, "tools": [], "tool_choice": "auto"})
    assert status == 400 and answer["error"]["param"] == "tool_choice"
    assert idle(llm)


# -----------------------------------------------------------------------------------------------
# Generation defaults from the checkpoint (issue 19 item 1).
# -----------------------------------------------------------------------------------------------

GENERATION = {"temperature": 0.0, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}


@pytest.fixture(scope="module")
def ckpt_with_defaults(ckpt_factory, tmp_path_factory):
    """The random checkpoint with a generation_config.json that sets all five sampling defaults."""
    src, _ = ckpt_factory("qwen3_5")
    path = tmp_path_factory.mktemp("with_defaults") / "ckpt"
    shutil.copytree(src, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **GENERATION, "do_sample": True}))
    return path


def test_generation_defaults_reach_the_engine(ckpt_with_defaults, capfd):
    llm = pocketllm.LLM(str(ckpt_with_defaults), max_context=256, max_batch_size=4)
    try:
        log = capfd.readouterr().err
        assert ("generation defaults: temperature=0.0, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05 "
                "(from ") in log
        assert llm.generation_defaults == GENERATION
        body = {"messages": USER, "max_tokens": 8}
        completion = pocketllm.start_chat_completion(llm, copy.deepcopy(body))
        params = completion.stream.request.params                    # what the engine received
        completion.response()
        assert {name: getattr(params, name) for name in GENERATION} == GENERATION
        completion = pocketllm.start_completion(llm, {"prompt": "Hi", "max_tokens": 4, "top_k": 5, "top_p": None})
        params = completion.stream.request.params
        completion.response()
        assert params.top_k == 5 and params.top_p == 0.8 and params.temperature == 0.0   # sent fields win; null = unset
        # The default is greedy: unset temperature equals temperature 0, for HTTP-shaped and Python calls.
        greedy = pocketllm.completions(llm, {"prompt": "Hello there", "max_tokens": 12, "temperature": 0,
                                             "top_p": 1, "top_k": 0, "min_p": 0, "repetition_penalty": 1.05})
        assert pocketllm.completions(llm, {"prompt": "Hello there", "max_tokens": 12, "top_p": 1, "min_p": 0,
                                           "top_k": 0})["choices"][0]["text"] == greedy["choices"][0]["text"]
        assert llm.generate("Hello there", max_tokens=12, top_p=1, min_p=0, top_k=0)["text"] == \
            greedy["choices"][0]["text"]
        sampled = {llm.generate("Hello there", max_tokens=12, temperature=1.0, top_p=1, min_p=0, top_k=0, seed=s)["text"]
                   for s in range(4)}
        assert sampled != {greedy["choices"][0]["text"]}                  # an explicit temperature still samples
    finally:
        llm.close()


def test_generation_config_none_and_bad_values(ckpt_with_defaults, tmp_path):
    llm = pocketllm.LLM(str(ckpt_with_defaults), quiet=True, max_context=128, max_batch_size=2,
                        generation_config="none")
    try:
        assert llm.generation_defaults == {}
        completion = pocketllm.start_completion(llm, {"prompt": "Hi", "max_tokens": 2})
        params = completion.stream.request.params
        completion.response()
        assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    finally:
        llm.close()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text(json.dumps({"temperature": 5}))
    with pytest.raises(pocketllm.CheckpointError, match=r"generation_config.json: 'temperature' must be between"):
        pocketllm.LLM(str(ckpt_with_defaults), quiet=True, generation_config=str(bad))
    code = pocketllm.main(["--ckpt", str(ckpt_with_defaults), "--generation-config", str(tmp_path / "missing"),
                           "--quiet", "--port", "0"])
    assert code == 2


def readme_quickstart_body() -> dict:
    """The exact JSON body of the README's quickstart curl command."""
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    return json.loads(re.search(r"-d '(\{.*?\})'", section, re.S)[1])


def test_readme_quickstart_gives_its_tool_call_every_time():
    """pocket-tiny's generation_config.json asks for greedy decoding, so the README's request, sent as written
    (no temperature), must give the get_weather call with finish_reason tool_calls every time."""
    body = readme_quickstart_body()
    assert "temperature" not in body and body["model"] == "pocket-tiny"
    llm = pocketllm.LLM(None, backend="torch", quiet=True, max_batch_size=4, max_context=1024)
    server = llm.serve(port=0, block=False, log_requests=False)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0,
                               timeout=300)
        answers = []
        for _ in range(10):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            answer = json.loads(resp.read())
            conn.close()
            assert resp.status == 200, answer
            choice = answer["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            calls = choice["message"]["tool_calls"]
            assert [c["function"]["name"] for c in calls] == ["get_weather"]
            args = json.loads(calls[0]["function"]["arguments"])
            assert isinstance(args["city"], str) and isinstance(args["days"], int), args
            answers.append(args)
        assert answers == [answers[0]] * 10
        sdk = client.chat.completions.create(**body)                 # the same through the openai SDK
        assert sdk.choices[0].finish_reason == "tool_calls"
        assert json.loads(sdk.choices[0].message.tool_calls[0].function.arguments) == answers[0]
    finally:
        server.shutdown()
        llm.close()


if __name__ == "__main__":
    text = API_DOC.read_text()
    API_DOC.write_text(render_docs(text))
    print(f"{API_DOC}: {'unchanged' if render_docs(text) == text else 'field tables regenerated'}", file=sys.stderr)
