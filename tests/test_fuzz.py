"""Schema-aware fuzzing of every endpoint (issue 20 item 2), in the default test run.

Request bodies come from the served /openapi.json (tests/fuzzing.py: valid bodies drawn from each endpoint's
schema, then mutated at every depth and sent as raw bytes, sometimes as mangled text) and go to a real server on
a tiny random checkpoint. Every answer is a 2xx or a 4xx in the error shape naming a field of the request; never a
5xx, a dropped connection or a hang (each request has a timeout). Afterwards the engine holds no KV block or state
slot and a good request succeeds. The examples are derandomized (the same bodies each run, a few hundred in all);
`benchmarks/fuzz.py` runs the same generator at random for as long as asked.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, Phase, given, settings

import fuzzing
import pocketllm

KEY = "fuzz-key"
# endpoint -> examples in the default run
EXAMPLES = {"/v1/chat/completions": 160, "/v1/completions": 60, "/tokenize": 50, "/detokenize": 30,
            "/v1/responses": 30, "/v1/messages": 30, "/v1/messages/count_tokens": 15}
GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
GOOD = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 1.0,
        "presence_penalty": 0.5, "seed": 7}

# Bodies that once answered 500 (or that a fuzzer finds only rarely), kept as regressions: (path, raw body).
REGRESSIONS = [
    ("/v1/chat/completions", json.dumps({**GOOD, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "required": 5}}}]}).encode()),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * fuzzing.DEEP + b"]" * fuzzing.DEEP + b"}"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}], "max_tokens": 1}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}'),
    ("/v1/chat/completions", b'{"max_tokens": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}'),
    ("/v1/completions", b'{"prompt": "Hi", "max_tokens": 1, "logit_bias": {"\\ud800": 1}}'),
    ("/v1/completions", b'{"prompt": "Hi", "max_tokens": 1, "stop": ["\\udfff"]}'),
    ("/tokenize", b'{"prompt": "' + "\U0001F600".encode() * 50_000 + b'"}'),
    ("/v1/chat/completions", json.dumps({**GOOD, "logit_bias": {"5": None}}).encode()),       # issue 47
    ("/v1/messages", json.dumps({"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                                 "output_config": {"effort": []}}).encode()),
    ("/v1/responses", b'{"input": "Hi", "max_output_tokens": 4, "temperature": 1' + b"0" * 400 + b"}"),  # no float
]


# Every value inside a map or an array of the FULL bodies is replaced by each of these (issue 47).
INSIDE_VALUES = [None, True, "x", -1, 2 ** 70, -1e308, "\ud800", [], {"": None}, fuzzing._deep(300, "list")]
# Fields whose inner values the protocol layer reads itself: a 400 names the very value (logit_bias.5, stop[1]).
NAMED_INSIDE = ("logit_bias", "stop", "stop_token_ids", "metadata", "tokens", "include", "stop_sequences",
                "allowed_token_ids")


@pytest.fixture(scope="module")
def llm(ckpt_factory):
    path, _ = ckpt_factory("qwen3_5")
    llm = pocketllm.LLM(str(path), quiet=True, max_context=256, max_batch_size=4)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def doc(server):
    status, answer = fuzzing.get(server.port, "/openapi.json", KEY)
    assert status == 200
    return json.loads(answer)


def _fields(doc, path):
    return list(doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"])


def assert_clean_afterwards(server, llm):
    """No KV block or state slot held once the requests are answered, and a good request succeeds."""
    assert fuzzing.wait_idle(llm), llm.stats()
    status, answer = fuzzing.send(server.port, "/v1/chat/completions", json.dumps(GOOD).encode(), KEY)
    assert status == 200, answer
    assert json.loads(answer)["choices"][0]["message"]["role"] == "assistant"
    assert fuzzing.wait_idle(llm), llm.stats()


@pytest.mark.parametrize("path", list(EXAMPLES))
def test_fuzzed_bodies_get_a_clean_answer(server, llm, doc, path):
    strategy = fuzzing.request_strategy(doc, path, llm.options.max_context, path in GENERATING)
    fields = _fields(doc, path)
    statuses = {}

    @settings(max_examples=EXAMPLES[path], deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(data):
        status, answer = fuzzing.send(server.port, path, data, KEY)
        statuses[status] = statuses.get(status, 0) + 1
        problem = fuzzing.check_answer(path, fields, data, status, answer)
        assert problem is None, problem

    one()
    print(path, dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= EXAMPLES[path] // 2, statuses
    assert any(status == 200 for status in statuses), statuses      # the valid half does get answers
    assert any(400 <= status < 500 for status in statuses), statuses
    assert_clean_afterwards(server, llm)


def _spelled(where: tuple) -> str:
    return "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in where).lstrip(".")


def _inside_cases(path: str):
    """(where, body bytes) for every value inside a map or an array of the endpoint's FULL bodies, each replaced
    by each of INSIDE_VALUES."""
    for body in fuzzing.FULL[path]:
        for where in fuzzing._inside_paths(body):
            for value in INSIDE_VALUES:
                mutated = json.loads(json.dumps(body))
                fuzzing._node(mutated, where[:-1])[where[-1]] = value
                yield where, json.dumps(mutated).encode()


@pytest.mark.parametrize("path", list(EXAMPLES))
def test_every_value_inside_a_map_or_array_is_checked(server, llm, doc, path):
    """A null, a wrong type, a huge or negative number, a lone surrogate or deep nesting anywhere inside a field's
    map or array is a 2xx or a clean 4xx (`"logit_bias": {"5": null}` was a 500); inside the fields that
    NAMED_INSIDE lists, the 4xx names the value itself."""
    fields = _fields(doc, path)
    for body in fuzzing.FULL[path]:                              # the starting points themselves are good
        status, answer = fuzzing.send(server.port, path, json.dumps(body).encode(), KEY)
        assert status == 200, (body, answer)
    cases = list(_inside_cases(path))
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda case: fuzzing.send(server.port, path, case[1], KEY), cases))
    problems = []
    for (where, data), (status, answer) in zip(cases, answers):
        problem = fuzzing.check_answer(path, fields, data, status, answer)
        if problem is None and status == 400 and where[0] in NAMED_INSIDE:
            param = json.loads(answer)["error"]["param"]
            if param != _spelled(where):
                problem = f"names {param!r}"
        if problem:
            problems.append(f"{_spelled(where)} = {data.decode()[:160]}: {problem[:200]}")
    assert not problems, "\n".join(problems[:20])
    assert_clean_afterwards(server, llm)


@pytest.mark.parametrize("path,data", REGRESSIONS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(REGRESSIONS)])
def test_regressions(server, llm, doc, path, data):
    status, answer = fuzzing.send(server.port, path, data, KEY)
    assert fuzzing.check_answer(path, _fields(doc, path), data, status, answer) is None
    assert_clean_afterwards(server, llm)


def test_the_checker_catches_bad_answers():
    """check_answer itself: a 500, a 400 without a param for an object body, a param naming nothing."""
    body = json.dumps({"messages": []}).encode()
    fields = ["messages", "tools"]
    error = {"error": {"message": "m", "type": "invalid_request_error", "param": "messages", "code": None}}
    assert fuzzing.check_answer("/x", fields, body, 400, json.dumps(error).encode()) is None
    assert fuzzing.check_answer("/x", fields, body, 500, json.dumps(error).encode())
    assert fuzzing.check_answer("/x", fields, body, 400, json.dumps({**error, "error": {
        **error["error"], "param": None}}).encode())
    assert fuzzing.check_answer("/x", fields, body, 400, json.dumps({**error, "error": {
        **error["error"], "param": "nothing[0]"}}).encode())
    assert fuzzing.check_answer("/x", fields, body, 400, b'{"detail": "no"}')
    assert fuzzing.check_answer("/x", fields, body, 200, b'data: {"error": {}}\n\ndata: [DONE]\n\n')
    for key in ("a.b[0", "a\\udfffb"):                     # an unknown key spelling a path, or a lone surrogate
        named = json.dumps({**error, "error": {**error["error"], "param": key}}).encode()
        assert fuzzing.check_answer("/x", fields, ('{"%s": 1}' % key).encode(), 400, named) is None
        assert fuzzing.check_answer("/x", fields, b'{"b": 1}', 400, named)
    assert fuzzing.check_answer("/x", fields, b"[", 400, json.dumps({**error, "error": {
        **error["error"], "param": None}}).encode()) is None                # not an object: nothing to name
