"""Schema-aware request fuzzing (issue 20 item 2), shared by tests/test_fuzz.py and benchmarks/fuzz.py.

Bodies start from the served `/openapi.json` (hypothesis-jsonschema draws valid bodies from each endpoint's request
schema) or from FULL (every map and array field filled), then get nested mutations at any depth (a node replaced by
a hostile value, a key removed or added, a node wrapped or nested deeply; a value inside a map or an array replaced
by a null, a wrong type, a huge or negative number, a lone surrogate or deep nesting) and are sent as raw bytes, sometimes mangled as text: duplicate keys, invalid UTF-8 and
lone surrogates, truncation, deep nesting. `check_answer` holds what every answer must be: a 2xx, or a 4xx in
OpenAI's error shape whose `param` names a field of the request; never a 5xx, a dropped connection or a hang.
"""

from __future__ import annotations

import copy
import http.client
import json
import time

from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

MAX_TOKENS = 4                    # generation kept short: the fuzz is about input, not output
TIMEOUT_S = 60.0                  # per request: longer than any answer on a busy CPU, shorter than a hang
DEEP = 5000                       # nesting of the deep JSON texts (past Python's recursion limit)
NESTED = (50, 400)                # nesting of the deep values (within it: the generator walks and encodes them)

HOSTILE_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\x00", "\ud800", "a\udfffb", "<|im_start|>system\n", "<|im_end|>", "</think>",
                     "<tool_call>\n<function=x>", "{{ 7*7 }}", "{% raw %}", "é" * 3, "\u202e", "\ufeff"]),
    st.builds(lambda n, c: c * n, st.sampled_from([1000, 100_000]), st.sampled_from(["x", "é", "😀", "\n"])),
)
HOSTILE_SCALAR = st.one_of(
    st.none(), st.booleans(), HOSTILE_TEXT,
    st.integers(-2 ** 70, 2 ** 70), st.sampled_from([0, -1, 1, 2 ** 31, 2 ** 63, -2 ** 63, 10 ** 400]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e308, -0.0, 5e-324, 0.5]),
)


def _deep(depth: int, kind: str):
    value = 0
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


HOSTILE = st.one_of(
    HOSTILE_SCALAR,
    st.lists(HOSTILE_SCALAR, max_size=4),
    st.dictionaries(HOSTILE_TEXT, HOSTILE_SCALAR, max_size=3),
    st.sampled_from([[], {}, [[]], [{}], {"": None}, {"type": "function"}, {"type": "text", "text": 5},
                     {"function": {"name": None}}, {"role": "user"}, list(range(2000)), {str(i): i for i in range(300)}])
    .map(copy.deepcopy),                                                # later mutations must not edit the constants
    st.builds(_deep, st.sampled_from(NESTED), st.sampled_from(["list", "dict"])),
)


# A null, a wrong type, a huge or negative number, a lone surrogate, deep nesting: what a value inside a map or
# an array (logit_bias.5, stop[1], messages[0].content[0].text, tools[0].function.parameters...) must be refused
# as cleanly as a top-level one (issue 47).
INSIDE = st.one_of(
    st.sampled_from([None, True, False, "", "x", "\ud800", "a\udfffb", 0, -1, 2 ** 31, 2 ** 64, 2 ** 70, -2 ** 70,
                     10 ** 400, 0.5, -1e308, 1e308, 5e-324, [], {}, [None], {"": None}, {"5": None}]).map(copy.deepcopy),
    HOSTILE_SCALAR,
    st.builds(_deep, st.sampled_from(NESTED), st.sampled_from(["list", "dict"])),
)


def _paths(value, prefix=()):
    """Every node of a JSON value as a key path, the root first."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, prefix + (i,))


def _node(value, path):
    for key in path:
        value = value[key]
    return value


@st.composite
def mutated(draw, body):
    """body (a valid one) with one to three mutations at random depths."""
    body = json.loads(json.dumps(body))
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(body))
        path = draw(st.sampled_from(paths[1:] if len(paths) > 1 else paths))
        parent, key = (_node(body, path[:-1]), path[-1]) if path else (None, None)
        target = _node(body, path)
        how = draw(st.sampled_from(["replace", "replace", "delete", "add", "wrap", "empty"]))
        if parent is None or how == "add":
            container = target if isinstance(target, (dict, list)) else parent if parent is not None else body
            if isinstance(container, dict):
                container[draw(st.one_of(HOSTILE_TEXT, st.sampled_from(list(container) or ["x"])))] = draw(HOSTILE)
            elif isinstance(container, list):
                container.append(draw(HOSTILE))
        elif how == "delete":
            del parent[key]
        elif how == "wrap":
            parent[key] = draw(st.sampled_from([[target], {"value": target}, [target, target]]))
        elif how == "empty":
            parent[key] = type(target)() if isinstance(target, (dict, list, str)) else None
        else:
            parent[key] = draw(HOSTILE)
    return body


def _inside_paths(body) -> list[tuple]:
    """The nodes inside a field's map or array (not the fields themselves): key paths of length 2 or more."""
    return [path for path in _paths(body) if len(path) >= 2]


@st.composite
def mutated_inside(draw, body):
    """body with one value inside a map or an array replaced by a hostile one (INSIDE), or one hostile entry added
    to a map or an array; a body without maps or arrays gets a top-level mutation instead."""
    body = json.loads(json.dumps(body))
    paths = _inside_paths(body) if isinstance(body, dict) else []
    if not paths:
        return draw(mutated(body))
    path = draw(st.sampled_from(paths))
    parent = _node(body, path[:-1])
    if draw(st.integers(0, 3)) == 0:                                    # an entry added beside it
        if isinstance(parent, dict):
            parent[draw(st.one_of(st.sampled_from(["5", "x", "", "type", "\ud800"]), HOSTILE_TEXT))] = draw(INSIDE)
        else:
            parent.insert(draw(st.integers(0, len(parent))), draw(INSIDE))
    else:
        parent[path[-1]] = draw(INSIDE)
    return body


@st.composite
def raw_text(draw, body) -> bytes:
    """body as the bytes a client sends: usually plain JSON, sometimes mangled as text."""
    ascii_ = draw(st.booleans())
    text = json.dumps(body, ensure_ascii=ascii_)
    how = draw(st.sampled_from(["plain"] * 6 + ["duplicate", "bad-utf8", "surrogate", "truncate", "deep", "junk"]))
    if how == "duplicate" and isinstance(body, dict) and body:            # a key twice: which one wins?
        key = draw(st.sampled_from(list(body)))
        text = "{" + json.dumps(key) + ": " + json.dumps(draw(HOSTILE), ensure_ascii=True) + ", " + text[1:] \
            if len(text) > 2 else text
    elif how == "deep":
        text = text[:-1] + (", " if len(text) > 2 else "") + '"deep": ' + "[" * DEEP + "]" * DEEP + "}"
    elif how == "truncate":
        text = text[:draw(st.integers(0, max(0, len(text) - 1)))]
    elif how == "junk":
        text = draw(st.sampled_from(["", "null", "[]", "1", '"x"', "{", "}", "NaN", '{"a": NaN}', "{'a': 1}",
                                     '{"messages": Infinity}', "\x00"]))
    data = text.encode("utf-8", "surrogatepass")                        # a lone surrogate: invalid UTF-8
    if how == "bad-utf8":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])) + data[at:]
    elif how == "surrogate":
        data = data.replace(b"}", b', "s": "\xed\xa0\x80"}', 1)
    return data


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Per generating endpoint: its token-count fields, and the one a body without any of its max fields gets.
LIMITS = {"/v1/responses": (("max_output_tokens",), "max_output_tokens"),
          "/v1/messages": (("max_tokens",), "max_tokens")}
CHAT_LIMITS = (("max_tokens", "max_completion_tokens", "min_tokens"), "max_tokens")


def cap_generation(body, max_context: int, path: str = "/v1/chat/completions"):
    """Keep what the server will generate short: token counts the server would honour become MAX_TOKENS, and a
    body that sets no max-tokens field gets one (else it would generate the rest of the context)."""
    if not isinstance(body, dict):
        return body
    names, default = LIMITS.get(path, CHAT_LIMITS)
    for name in names:
        if _count(body.get(name)) and MAX_TOKENS < body[name] <= max_context:
            body[name] = MAX_TOKENS
    if all(body.get(name) is None for name in names if name != "min_tokens"):
        body[default] = MAX_TOKENS
    return body


# The smallest good body of each endpoint: plausible bodies add a few schema-drawn fields to it, so that more
# requests pass validation and reach the template, the tool-choice machinery and the engine.
BASES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
         "/v1/completions": {"prompt": "Hi"}, "/tokenize": {"prompt": "Hi"}, "/detokenize": {"tokens": [1, 2]},
         "/v1/responses": {"input": "Hi"}, "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}]},
         "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "Hi"}]}}


# Bodies that fill every field of each endpoint that holds a map or an array (valid: each answers 200), the
# starting points of mutated_inside. Several per endpoint where fields exclude each other.
_TOOL = {"type": "function", "function": {"name": "f", "description": "d", "strict": False, "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
_MESSAGES = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
             {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
             {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "ok"}]
_SAMPLING = {"max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 1,
             "presence_penalty": 0.1, "frequency_penalty": 0.1, "repetition_penalty": 1.1,
             "logit_bias": {"5": 1.0, "7": -1}, "stop": ["x", "y"], "stop_token_ids": [3, 4], "min_tokens": 1,
             "ignore_eos": False, "n": 1, "metadata": {"a": "b"}, "user": "u", "store": False,
             "allowed_token_ids": [3, 4, 5, 6, 7]}
FULL = {
    "/v1/chat/completions": [
        {"messages": _MESSAGES, **_SAMPLING, "logprobs": True, "top_logprobs": 2, "modalities": ["text"]},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30, "tools": [_TOOL],     # a call fits
         "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": True,
         "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30, "stream": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": False},
         "response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": {
             "type": "object", "properties": {"a": {"type": "string", "enum": ["x"]}}, "required": ["a"]}}}}],
    "/v1/completions": [
        {"prompt": "Hi", **_SAMPLING, "logprobs": 2, "best_of": 1},
        {"prompt": [[1, 2, 3]], "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}],
    "/tokenize": [{"messages": _MESSAGES, "tools": [_TOOL], "chat_template_kwargs": {"enable_thinking": True},
                   "return_token_strs": True}],
    "/detokenize": [{"tokens": [1, 2, 3]}],
    "/v1/responses": [
        {"instructions": "i", "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}]}],
         "max_output_tokens": 30, "temperature": 0.5, "top_p": 0.9, "store": False,
         "tools": [{"type": "function", "name": "f", "parameters": _TOOL["function"]["parameters"]}],
         "tool_choice": {"type": "function", "name": "f"}, "reasoning": {"effort": "low", "summary": "auto"},
         "include": ["reasoning.encrypted_content"], "metadata": {"a": "b"}},
        {"input": "Hi", "max_output_tokens": 30, "stream": True, "text": {"format": {"type": "json_object"}}}],
    "/v1/messages": [
        {"max_tokens": 2, "system": [{"type": "text", "text": "s"}], "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                              {"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "is_error": False,
                                          "content": [{"type": "text", "text": "ok"}]}]}],
         "stop_sequences": ["x"], "temperature": 0.5, "top_p": 0.9, "top_k": 5, "metadata": {"user_id": "u"},
         "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}},
        {"max_tokens": 30, "messages": [{"role": "user", "content": "Hi"}],
         "tools": [{"name": "f", "description": "d", "input_schema": _TOOL["function"]["parameters"]}],
         "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True}},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
         "thinking": {"type": "enabled", "budget_tokens": 2}, "output_config": {"effort": "low"}}],
    "/v1/messages/count_tokens": [{"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                                   "system": [{"type": "text", "text": "s"}], "thinking": {"type": "disabled"},
                                   "tools": [{"name": "f", "input_schema": {"type": "object"}}]}],
}

def _plausible(schema: dict, base: dict):
    fields = {name: from_schema(prop) for name, prop in schema["properties"].items() if name not in base}
    names = st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)
    return names.flatmap(lambda chosen: st.fixed_dictionaries({n: fields[n] for n in chosen})).map(
        lambda extra: {**json.loads(json.dumps(base)), **extra})


def request_strategy(doc: dict, path: str, max_context: int, generates: bool):
    """Bytes bodies for one endpoint: drawn from its schema (whole, or a few fields over a good body), sometimes
    mutated, capped, encoded."""
    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    start = st.one_of(from_schema(schema), _plausible(schema, BASES[path]))
    full = st.sampled_from(FULL[path])
    body = st.one_of(start, start.flatmap(mutated), start.flatmap(mutated_inside), full.flatmap(mutated_inside))
    if generates:
        body = body.map(lambda b: cap_generation(b, max_context, path))
    return body.flatmap(raw_text)


def _exchange(port: int, method: str, path: str, data: bytes | None, key: str | None,
              extra_headers: dict | None = None) -> tuple[int, bytes]:
    """One request with a timeout; a dropped connection or a hang raises."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    headers = {"Content-Type": "application/json", **(extra_headers or {})}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def send(port: int, path: str, data: bytes, key: str | None = None) -> tuple[int, bytes]:
    return _exchange(port, "POST", path, data, key)


def get(port: int, path: str, key: str | None = None) -> tuple[int, bytes]:
    return _exchange(port, "GET", path, None, key)


def request(port: int, method: str, path: str, body=None, key: str | None = None,
            headers: dict | None = None) -> tuple[int, bytes]:
    """Any method, a JSON body (or none), extra headers (x-api-key, anthropic-version)."""
    return _exchange(port, method, path, None if body is None else json.dumps(body).encode(), key, headers)


def wait_idle(llm, seconds: float = 30.0) -> bool:
    """True once the engine runs nothing and holds no KV block or state slot (requests may still be finishing)."""
    end = time.monotonic() + seconds
    while True:
        stats = llm.stats()
        if not (stats["running"] or stats["waiting"] or stats["kv_blocks_used"] or stats["slots_used"]):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.05)


def _refuse(name):
    raise ValueError(f"{name} is not JSON")


def _sent_body(data: bytes):
    """The body as a strict JSON parser reads it (NaN and Infinity are not JSON), or None."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_refuse)
    except (ValueError, RecursionError):
        return None


def check_answer(path: str, fields: list[str], data: bytes, status: int, answer: bytes) -> str | None:
    """What is wrong with this answer, or None. fields: the endpoint's request fields."""
    if status >= 500:
        return f"{status} answer: {answer[:300]!r}"
    if status < 300:
        if answer.startswith(b"event:"):                                 # named events (Responses, Messages)
            events = [line[6:] for line in answer.split(b"\n") if line.startswith(b"data: ")]
            if not events or any(json.loads(event)["type"] == "error" for event in events):
                return f"no events or an error event in a 200 stream: {answer[-300:]!r}"
            if json.loads(events[-1])["type"] not in ("response.completed", "response.incomplete", "message_stop"):
                return f"a stream that did not finish: {answer[-300:]!r}"
        elif answer.startswith(b"data:"):                                # a stream: events, then [DONE]
            events = [line[6:] for line in answer.split(b"\n") if line.startswith(b"data: ")]
            if not events or events[-1] != b"[DONE]":
                return f"stream without [DONE]: {answer[-300:]!r}"
            for event in events[:-1]:
                if "error" in json.loads(event):
                    return f"error event in a 200 stream: {event[:300]!r}"
        else:
            json.loads(answer)
        return None
    error = json.loads(answer).get("error")
    if not (isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
            and "param" in error and "code" in error):
        return f"{status} answer not in the error shape: {answer[:300]!r}"
    body = _sent_body(data)
    if not isinstance(body, dict) or status in (401, 413):               # not a request object: no field to name
        return None
    param = error["param"]
    if not isinstance(param, str):                                     # "" names a key "" (unknown field)
        return f"{status} without a param for a JSON object body: {answer[:300]!r}"
    sent = set(body) | {key.encode("utf-8", "backslashreplace").decode() for key in body}   # escaped surrogates
    root = param if param in sent else param.split(".")[0].split("[")[0]          # a key may hold "." or "["
    if root not in sent and root not in fields:
        return f"{status} names {param!r}, which is neither sent nor a field of {path}: {answer[:300]!r}"
    return None
